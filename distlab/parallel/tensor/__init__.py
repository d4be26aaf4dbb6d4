"""``dl.tp``: tensor parallelism (Megatron-LM) and sequence parallelism.

Reading order:

    regions.py   Megatron's f and g (and the sequence-parallel pair) as small autograd Functions
    linear.py    ColumnParallelLinear and RowParallelLinear
    layers.py    parallel attention and MLP: one region each
    vocab.py     vocabulary-parallel embedding and cross-entropy
    gpt.py       parallelize(gpt): the whole model, in place
"""
from .gpt import *  # noqa: F401,F403
from .gpt import __all__  # noqa: F401
