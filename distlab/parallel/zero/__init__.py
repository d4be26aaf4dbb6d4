"""ZeRO: shard optimizer state (stage 1), gradients (2) and parameters (3) over data-parallel ranks.

    opt = dl.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)    # stage 1 on its own
    model = dl.ZeRO(module, stage=3, optim=torch.optim.AdamW, lr=1e-3)         # .module .optimizer
    with model.no_sync(): loss.backward()          # gradient accumulation: no reduce-scatter (see engine)

Files: `optimizer` (ShardedOptimizer, stage 1 and the optimizer of every stage), `engine` (ZeRO,
stage 2's backward hooks), `stage3` (gather/free per unit), `reducer` (the bounded queue of gradient
reduce-scatters every stage uses: flat buffers freed as each completes). Layout helpers in `..flat`.
"""
from .engine import ZeRO
from .optimizer import ShardedOptimizer

__all__ = ["ZeRO", "ShardedOptimizer"]
