"""ZeRO: shard optimizer state (stage 1), gradients (2) and parameters (3) over data-parallel ranks.

    opt = dl.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)    # stage 1 on its own
    model = dl.ZeRO(module, stage=3, optim=torch.optim.AdamW, lr=1e-3)         # .module .optimizer
    with model.no_sync(): loss.backward()          # gradient accumulation: no reduce-scatter (see zero2)

Reading order:

    zero1.py     ShardedOptimizer: stage 1's step (reduce-scatter, step my shard, all-gather); ZeRO1
    shards.py    what every stage's optimizer shares: bucket layout, shards, masters, clipping, saving
    zero2.py     ZeRO2: gradients reduce-scattered bucket by bucket during backward
    zero3.py     ZeRO3: parameters sharded at rest, gathered and freed one unit at a time
    reducer.py   the bounded queue of gradient reduce-scatters every stage uses
    offload.py   OffloadedOptimizer: the state in host memory or files, stepped there (any stage, FSDP)
    fsdp.py      fully_shard (FSDP2): each parameter sharded on dim 0, the user's own optimizer; HSDP
    fsdp_unit.py its machinery: a unit gathered before forward and backward, freed, reduce-scattered
Flat buffers and bucketing: `..data.buckets`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .zero1 import ShardedOptimizer, ZeRO1, ZeROModule
from .zero2 import ZeRO2
from .zero3 import ZeRO3
from .fsdp import full_state_dict, fully_shard, no_sync, set_requires_gradient_sync
from .offload import OffloadedOptimizer

__all__ = ["ZeRO", "ShardedOptimizer", "OffloadedOptimizer", "ZeRO1", "ZeRO2", "ZeRO3", "fully_shard",
           "full_state_dict", "no_sync", "set_requires_gradient_sync"]


def ZeRO(module: nn.Module, stage: int = 1, optim: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
         bucket_mb: float = 25.0, overlap: bool = True, units: list[nn.Module] | None = None,
         prefetch: bool = False, **kwargs) -> ZeROModule:
    """The model wrapper of ZeRO ``stage`` 1, 2 or 3 (`ZeRO1`, `ZeRO2`, `ZeRO3`); ``.optimizer`` is its
    `ShardedOptimizer`. ``bucket_mb`` (stages 1, 2), ``overlap`` (2), ``units`` and ``prefetch`` (3) go to
    the stage that uses them, so one call can sweep the stages; ``comm``, ``group``, ``max_inflight``,
    ``offload`` ("cpu" or "disk", `offload.OffloadedOptimizer`) and ``offload_dir`` to every stage, and the
    remaining keyword arguments to ``optim``."""
    if stage == 1:
        return ZeRO1(module, optim, bucket_mb=bucket_mb, **kwargs)
    if stage == 2:
        return ZeRO2(module, optim, bucket_mb=bucket_mb, overlap=overlap, **kwargs)
    if stage == 3:
        return ZeRO3(module, optim, units=units, prefetch=prefetch, **kwargs)
    raise ValueError(f"ZeRO stage must be 1, 2 or 3 (stage 0 is plain DDP: use dl.DDP), got {stage}")
