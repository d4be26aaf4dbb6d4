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

`ShardedOptimizer` is also the optimizer of ZeRO-2 (gradients already reduce-scattered during
backward, `zero2.py`) and ZeRO-3 (the model hands it the shards of its own flat buffers: parameters
sharded at rest, no all-gather after the step, `zero3.py`). `ZeRO1` wraps a module with it.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..clip import scale_to_norm
from ..collectives import Collectives
from ..data.buckets import FlatBucket, bucketize, trainable
from ..data.ddp import accumulate_locally, broadcast_from_rank0
from .reducer import GradReducer


class ShardedOptimizer:
    """``ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3)``: ZeRO-1 around any torch optimizer.

    ``step()`` reduce-scatters the replicas' gradients (averaging them), updates this rank's shard
    and all-gathers the parameters. Pass ``average_grads=False`` when the gradients are already
    averaged (e.g. under `DDP`): then each rank just reads its slice. ``max_inflight``: how many
    buckets' flat gradient buffers may be reduce-scattering at once (`GradReducer`, ``.reducer``).

    ZeRO-3 passes its own layout instead of ``params``: ``buckets`` (its flat buffers, one per unit)
    and ``shards`` (this rank's chunk of each, the only copy of the parameters at rest).
    """

    def __init__(self, params, optim: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 bucket_mb: float = 25.0, comm: str | Collectives = "torch", group=None,
                 average_grads: bool = True, buckets: list[FlatBucket] | None = None,
                 shards: list[torch.Tensor] | None = None, max_inflight: int = 1, **optim_kwargs):
        self.comm = comm if isinstance(comm, Collectives) else Collectives(comm, group)
        if buckets is None:
            params = trainable(params)
            if not params:
                raise ValueError("ShardedOptimizer got no parameters that require grad")
            buckets = [FlatBucket(g, self.comm.size) for g in bucketize(params, bucket_mb)]
        self.buckets = buckets
        self.params = [p for b in buckets for p in b.params]
        self.average_grads, self.sharded_params = average_grads, shards is not None
        # this rank's shard of each bucket: a view of the flat buffer, or the model's own shard (ZeRO-3)
        self.shards = shards if shards is not None else [b.chunk(b.full, self.comm.rank) for b in buckets]
        # what the inner optimizer updates: the shard itself (fp32) or an fp32 master copy of it
        self.masters = [s if s.dtype == torch.float32 else s.detach().float() for s in self.shards]
        for m in self.masters:
            m.requires_grad_(True)
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._reduced = [False] * len(self.buckets)       # local p.grad already folded into grad_shards
        self.reducer = GradReducer(self.comm, self._add_shard, max_inflight)   # ZeRO-2/3: during backward
        for p in self.params:               # its gradient lives here, in shards (`dl.clip_grad_norm_`)
            p._zero_optimizer = weakref.ref(self)
        self.optimizer = optim(self.masters, **optim_kwargs)

    # -- the torch.optim surface -------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.grad_shards = [None] * len(self.buckets)
        self._reduced = [False] * len(self.buckets)
        for m in self.masters:
            m.grad = None

    def reduce_grads(self) -> None:
        """Bring each bucket's gradients to their owners (reduce-scatter, averaged), once per step.

        ZeRO-1 reduces its whole local gradients here. ZeRO-2/3 did it during backward (their ``p.grad``
        are then None) unless the last micro-steps ran under ``no_sync``: what is still local is
        reduce-scattered now and added to the shard backward produced.
        """
        for b, bucket in enumerate(self.buckets):
            local = not self._reduced[b] and any(p.grad is not None for p in bucket.params)
            if self.grad_shards[b] is not None and not local:
                continue                                   # already there (ZeRO-2/3 did it in backward)
            # local gradients stay in p.grad (ZeRO-1 keeps them; zero_grad frees them)
            self.reducer.submit(b, bucket, average=self.average_grads, release_grads=False)
            self._reduced[b] = True
        self.reducer.drain()

    def _add_shard(self, b: int, shard: torch.Tensor) -> None:
        """A completed reduce-scatter's shard of bucket ``b``: the gradient shard, or added to it."""
        prev = self.grad_shards[b]
        self.grad_shards[b] = shard if prev is None else prev.add_(shard)

    def clip_grad_norm_(self, max_norm: float, weight=None, outer=None) -> torch.Tensor:
        """Scale the gradient shards so the *global* L2 norm is at most ``max_norm``; returns the norm.

        ||g||^2 = sum over ranks of ||g_shard||^2 (padding is zero): one all-reduce of a scalar.
        Same formula as ``torch.nn.utils.clip_grad_norm_``: coef = min(1, max_norm / (norm + 1e-6)).

        When these parameters are themselves one part of a larger model (a tensor-parallel shard, a
        pipeline stage), ``weight(param) -> float`` scales each parameter's squared gradient (1/T for
        a parameter replicated over T tensor-parallel ranks, so it counts once) and ``outer(sq)``
        sums the data-parallel total over the other model-parallel groups.
        """
        self.reduce_grads()
        sq = self._grad_square_sum(weight).reshape(1)
        self.comm.all_reduce(sq, op="sum")
        if outer is not None:
            sq = outer(sq)
        return scale_to_norm(self.grad_shards, sq, max_norm)

    def _grad_square_sum(self, weight=None) -> torch.Tensor:
        """Sum of this rank's squared gradient-shard elements, each parameter's scaled by ``weight``."""
        sq = torch.zeros((), dtype=torch.float32, device=self.masters[0].device)
        for bucket, g in zip(self.buckets, self.grad_shards):
            if weight is None:
                sq += g.float().pow(2).sum()
                continue
            for i, _, piece in bucket.owner_slices(self.comm.rank):
                sq += weight(bucket.params[i]) * g[piece].float().pow(2).sum()
        return sq

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        self.reduce_grads()
        for m, g in zip(self.masters, self.grad_shards):
            m.grad = g if g.dtype == m.dtype else g.float()
        self.optimizer.step()
        for s, m in zip(self.shards, self.masters):
            if s is not m:
                s.copy_(m)                                 # fp32 master -> bf16 shard
        if not self.sharded_params:
            self.gather_params()
        self.grad_shards = [None] * len(self.buckets)
        self._reduced = [False] * len(self.buckets)

    def gather_params(self) -> None:
        """All-gather every bucket's shards into its full buffer (the module's parameters)."""
        handles = [self.comm.all_gather(b.full, s, async_op=True) for b, s in zip(self.buckets, self.shards)]
        for h in handles:
            h.wait()

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (save one per rank)."""
        return {"rank": self.comm.rank, "world": self.comm.size, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world") != self.comm.size or state.get("rank") != self.comm.rank:
            raise ValueError(f"state was saved by rank {state.get('rank')} of {state.get('world')}; "
                             f"this is rank {self.comm.rank} of {self.comm.size}")
        self.optimizer.load_state_dict(state["optimizer"])

    def numel(self) -> tuple[int, int]:
        """(elements this rank's optimizer updates, elements of the whole model): about 1/N."""
        return sum(s.numel() for s in self.shards), sum(b.numel for b in self.buckets)

    def __repr__(self) -> str:
        mine, total = self.numel()
        return (f"ShardedOptimizer({type(self.optimizer).__name__}, rank {self.comm.rank}/{self.comm.size}: "
                f"{mine} of {total} elements, {len(self.buckets)} buckets)")


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
        self.optimizer = ShardedOptimizer(module.parameters(), optim, bucket_mb=bucket_mb, comm=self.comm,
                                          max_inflight=max_inflight, **optim_kwargs)
        self._sync = True                                 # False inside no_sync()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, cloned, on every rank."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
