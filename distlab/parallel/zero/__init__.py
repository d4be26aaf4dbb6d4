"""ZeRO: shard optimizer state (stage 1), gradients (2) and parameters (3) over data-parallel ranks.

    opt = dl.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)    # stage 1 on its own
    model = dl.ZeRO(module, stage=3, optim=torch.optim.AdamW, lr=1e-3)         # .module .optimizer
    with model.no_sync(): loss.backward()          # gradient accumulation: no reduce-scatter (see zero2)

Reading order:

    zero1.py     ShardedOptimizer: stage 1, and the optimizer of every stage
    zero2.py     ZeRO: gradients reduce-scattered during backward (stage 2), and the wrapper of all stages
    zero3.py     parameters gathered and freed per unit (stage 3)
    reducer.py   the bounded queue of gradient reduce-scatters every stage uses
Flat buffers and bucketing: `..data.buckets`.
"""
from .zero2 import ZeRO
from .zero1 import ShardedOptimizer

__all__ = ["ZeRO", "ShardedOptimizer"]
