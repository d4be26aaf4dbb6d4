"""ZeRO stage 1: the optimizer state sharded over the data-parallel ranks (Rajbhandari et al. 2020, Sec. 5.1).

Every rank keeps the whole model and computes whole gradients, but owns the optimizer state of only
1/N of the (flattened, padded) parameters:

    flat params  [ rank 0's shard | rank 1's shard | ... | rank N-1's shard ]   (per bucket, `FlatBucket`)
    step:  reduce-scatter grads  -> each rank holds the averaged grads of its own shard   (N-1)/N Psi
           optimizer.step() on the shard (Adam state: 8 bytes x Psi/N instead of 8 x Psi)
           all-gather params     -> every rank has the whole updated model again           (N-1)/N Psi

Same bytes on the wire as DDP's all-reduce (2 (N-1)/N Psi), a K/N optimizer term instead of K.
Works with any ``torch.optim`` class: the inner optimizer sees one flat tensor per bucket. With
low-precision parameters (bf16) it keeps fp32 master copies of its shards (counted as optimizer state).

What every stage's optimizer shares (the shards, fp32 masters, the inner optimizer, clipping, saving) is
in `shards.py`; ZeRO-2 and ZeRO-3 reduce-scatter during backward instead (`shards.ShardsFromBackward`).
`ZeRO1` wraps a module with a `ShardedOptimizer`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..flat_collectives import Collectives
from ..data.ddp import accumulate_locally, broadcast_from_rank0
from .shards import ShardedState, flat_layout


class ShardedOptimizer(ShardedState):
    """``ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)``: ZeRO-1 around any torch optimizer.

    ``step()`` reduce-scatters the replicas' gradients (averaging them), updates this rank's shard
    and all-gathers the parameters. Pass ``average_grads=False`` when the gradients are already
    averaged (e.g. under `DDP`): then each rank just reads its slice. ``max_inflight``: how many
    buckets' flat gradient buffers may be reduce-scattering at once (`GradReducer`, ``.reducer``).
    ``offload="cpu"``/``"disk"`` (+ ``offload_dir``): the state and fp32 masters of the shards in host
    memory or in files, the inner step run there (`offload.OffloadedOptimizer`).
    """

    def __init__(self, params, optim: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 bucket_mb: float = 25.0, comm: str | Collectives = "torch", group=None,
                 average_grads: bool = True, max_inflight: int = 1, offload: str | None = None,
                 offload_dir=None, **optim_kwargs):
        comm = comm if isinstance(comm, Collectives) else Collectives(comm, group)
        buckets, shards = flat_layout(params, bucket_mb, comm)     # the parameters become views of buckets
        super().__init__(buckets, shards, optim, comm, max_inflight, offload, offload_dir, **optim_kwargs)
        self.average_grads = average_grads

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        self.reduce_grads()       # 1. reduce-scatter: my shard's gradients, averaged   (N-1)/N Psi sent
        self.update_shards()      # 2. the inner optimizer steps my shard only           K Psi/N of state
        self.gather_params()      # 3. all-gather: every rank has the whole new model   (N-1)/N Psi sent
        self._new_step()         #    and this step's gradient shards are forgotten

    def reduce_grads(self) -> None:
        """Reduce-scatter every bucket's local gradients into this rank's gradient shard (averaged over
        the replicas, or, ``average_grads=False``, just sliced). Once per step: clipping calls it first."""
        if all(g is not None for g in self.grad_shards):
            return                                         # done already this step
        for b, bucket in enumerate(self.buckets):          # p.grad stays (zero_grad frees it)
            self.reducer.submit(b, bucket, average=self.average_grads, release_grads=False)
        self.reducer.drain()


class ZeROModule(nn.Module):
    """What the model wrapper of every stage shares: ``.module``, ``.optimizer`` (a `ShardedOptimizer`),
    ``.comm``, calling the module, ``no_sync()``, ``clip_grad_norm_``."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Backward passes inside keep their gradients local (stage 1 always does); the first synced
        backward, or else ``optimizer.step()``, reduce-scatters the accumulated sum (trade-off: `zero2`)."""
        return accumulate_locally(self)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm across all shards (see `ShardedOptimizer.clip_grad_norm_`)."""
        return self.optimizer.clip_grad_norm_(max_norm)


class ZeRO1(ZeROModule):
    """``ZeRO1(module, torch.optim.AdamW, lr=1e-3)``: the model replicated, the optimizer sharded.

    Backward is plain local autograd; all communication happens in ``optimizer.step()``.
    """

    stage = 1

    def __init__(self, module: nn.Module, optim: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 bucket_mb: float = 25.0, comm: str = "torch", group=None, max_inflight: int = 1,
                 **optim_kwargs):
        super().__init__()
        self.module = module
        self.comm = Collectives(comm, group)
        broadcast_from_rank0(module, self.comm)          # identical starting point on every rank
        self.optimizer = self._optimizer(module.parameters(), optim, bucket_mb, max_inflight, optim_kwargs)
        self._sync = True                                 # False inside no_sync()

    def _optimizer(self, params, optim, bucket_mb: float, max_inflight: int, optim_kwargs: dict):
        return ShardedOptimizer(params, optim, bucket_mb=bucket_mb, comm=self.comm, max_inflight=max_inflight,
                                **optim_kwargs)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, cloned, on every rank."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
