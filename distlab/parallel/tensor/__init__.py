"""``dl.tp``: tensor parallelism (Megatron-LM) and sequence parallelism.

Reading order:

    regions.py   Megatron's f and g and the sequence-parallel pair: small autograd Functions, the
                 only places tensor parallelism talks
    linear.py    ColumnParallelLinear and RowParallelLinear (and SP's gather fused into the column linears)
    layers.py    parallel attention and MLP: one region each
    vocab.py     vocabulary-parallel embedding and cross-entropy
    gpt.py       parallelize(gpt): the whole model
    plan.py      parallelize(model, plan={...}): any model, module by module (torch's parallelize_module)
    adapt.py     what a plan checks and fixes on a user's model: GPT-2's Conv1D (conv1d_to_linear),
                 whole heads per rank, TP before fully_shard

The layers carry no trace labels: `distlab.parallel.collectives` records every collective, and
``labels.label_modules(model)`` names the modules from outside.
"""
from .adapt import conv1d_to_linear
from .gpt import TensorParallelGPT, full_grads, full_state_dict, gather_logits, parallelize
from .layers import ParallelAttention, ParallelMLP
from .linear import (ColumnParallelLinear, GatheredLinears, RowParallelLinear, check_divisible,
                     sync_replicated_grad)
from .plan import GPT_PLAN, STYLES, Colwise, Embedding, PackedColumnParallelLinear, Rowwise, parallelize_plan
from .regions import (copy_to_region, gather_from_sequence, gather_from_tensor, reduce_from_region,
                      reduce_scatter_to_sequence, sequence_positions, split_to_tensor)
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelAttention",
           "ParallelMLP", "TensorParallelGPT", "parallelize", "vocab_parallel_cross_entropy",
           "full_state_dict", "full_grads", "gather_logits", "copy_to_region", "reduce_from_region",
           "gather_from_sequence", "reduce_scatter_to_sequence", "gather_from_tensor", "split_to_tensor",
           "sequence_positions", "GatheredLinears", "sync_replicated_grad", "check_divisible",
           "GPT_PLAN", "STYLES", "Colwise", "Rowwise", "Embedding", "PackedColumnParallelLinear",
           "parallelize_plan", "conv1d_to_linear"]
