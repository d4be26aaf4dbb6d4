"""What the optimizer of every ZeRO stage shares (Rajbhandari et al. 2020, Sec. 5): the flat bucket layout,
this rank's shard of each bucket, the inner torch optimizer over fp32 copies of the shards, the gradient
shards, and clipping by the global norm.

    flat params  [ rank 0's shard | rank 1's shard | ... | rank N-1's shard ]   (per bucket, `FlatBucket`)
    optimizer    updates the shards only: K bytes x Psi/N of state per rank instead of K x Psi

Read ZeRO-1's step first (`zero1.ShardedOptimizer`); the stages differ only in when the gradient shards
arrive and whether the parameters are gathered after the step:

    stage 1   `zero1.ShardedOptimizer`   shards reduce-scattered in step()      parameters all-gathered
    stage 2   `ShardsFromBackward`       shards reduce-scattered during backward parameters all-gathered
    stage 3   `ShardsFromBackward`       the same, per unit                      the shards ARE the parameters
"""
from __future__ import annotations

import weakref

import torch

from ..clip import scale_to_norm
from ..flat_collectives import Collectives
from ..data.buckets import FlatBucket, bucketize, trainable
from .offload import OffloadedOptimizer
from .reducer import GradReducer


def flat_layout(params, bucket_mb: float, comm: Collectives) -> tuple[list[FlatBucket], list[torch.Tensor]]:
    """The trainable ``params`` in flat buckets of ~``bucket_mb`` MB (their ``.data`` become views into the
    buckets' buffers), and this rank's shard of each: a view of chunk ``rank`` of the buffer."""
    params = trainable(params)
    if not params:
        raise ValueError("ShardedOptimizer got no parameters that require grad")
    buckets = [FlatBucket(g, comm.size) for g in bucketize(params, bucket_mb)]
    return buckets, [b.chunk(b.full, comm.rank) for b in buckets]


class ShardedState:
    """The optimizer state of this rank's ``shards`` (one per flat bucket of ``buckets``) under any torch
    optimizer ``optim``: what every stage's optimizer shares. Subclasses say how the gradient shards
    arrive (``reduce_grads``) and write ``step``; ``.reducer`` (`GradReducer`, at most ``max_inflight``
    flat gradient buckets reduce-scattering at once) brings them. With low-precision shards (bf16) the
    inner optimizer updates fp32 master copies (counted as optimizer state)."""

    sharded_params = False        # ZeRO-3: the shards are the parameters at rest (nothing to all-gather)

    def __init__(self, buckets: list[FlatBucket], shards: list[torch.Tensor],
                 optim: type[torch.optim.Optimizer], comm: Collectives, max_inflight: int = 1,
                 offload: str | None = None, offload_dir=None, **optim_kwargs):
        self.comm, self.buckets, self.shards, self.offload = comm, buckets, shards, offload
        self.params = [p for b in buckets for p in b.params]
        # what the inner optimizer updates: the shard itself (fp32 or offloaded: its fp32 master is on
        # the host) or an fp32 master copy of it on the device
        self.masters = [s if s.dtype == torch.float32 or offload else s.detach().float() for s in self.shards]
        for m in self.masters:
            m.requires_grad_(True)
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.reducer = GradReducer(self.comm, self._add_shard, max_inflight)
        for p in self.params:               # its gradient lives here, in shards (`dl.clip_grad_norm_`)
            p._zero_optimizer = weakref.ref(self)
        self.optimizer = (optim(self.masters, **optim_kwargs) if offload is None else
                          OffloadedOptimizer(self.masters, optim, offload=offload, offload_dir=offload_dir,
                                             **optim_kwargs))

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
        self._new_step()
        for m in self.masters:
            m.grad = None

    def _new_step(self) -> None:
        """Forget this step's gradient shards (after the step, or zero_grad)."""
        self.grad_shards = [None] * len(self.buckets)

    def reduce_grads(self) -> None:
        """Fill ``grad_shards``: ZeRO-1 reduce-scatters once per step (`zero1.ShardedOptimizer`), ZeRO-2/3
        take the shards backward produced (`ShardsFromBackward`)."""
        raise NotImplementedError(f"{type(self).__name__} must say how its gradient shards are reduced")

    def _add_shard(self, b: int, shard: torch.Tensor) -> None:
        """A completed reduce-scatter's shard of bucket ``b``: the gradient shard, or added to it."""
        prev = self.grad_shards[b]
        self.grad_shards[b] = shard if prev is None else prev.add_(shard)

    # -- the three moves of a step -------------------------------------------------------------
    def update_shards(self) -> None:
        """The inner optimizer's step on this rank's shards, from their gradient shards (in fp32)."""
        if self.offload is not None:                       # on the host, from the shards (`offload`)
            self.optimizer.step(grads=self.grad_shards)
            return
        for m, g in zip(self.masters, self.grad_shards):
            m.grad = g if g.dtype == m.dtype else g.float()
        self.optimizer.step()
        for s, m in zip(self.shards, self.masters):
            if s is not m:
                s.copy_(m)                                 # fp32 master -> bf16 shard

    def gather_params(self) -> None:
        """All-gather every bucket's shards into its full buffer (the module's parameters)."""
        handles = [self.comm.all_gather(b.full, s, async_op=True) for b, s in zip(self.buckets, self.shards)]
        for h in handles:
            h.wait()

    # -- clipping by the global norm -----------------------------------------------------------
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

    # -- saving, and what a learner prints -----------------------------------------------------
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


class ShardsFromBackward(ShardedState):
    """The optimizer of ZeRO-2 and ZeRO-3: the model wrapper reduce-scatters each bucket (unit) into its
    gradient shard during backward (through ``.reducer``); `step` updates the shards and, unless they
    are the parameters themselves (``sharded_params``, ZeRO-3), all-gathers the parameters."""

    def __init__(self, buckets, shards, optim, comm, max_inflight: int = 1, sharded_params: bool = False,
                 offload: str | None = None, offload_dir=None, **optim_kwargs):
        super().__init__(buckets, shards, optim, comm, max_inflight, offload, offload_dir, **optim_kwargs)
        self.sharded_params = sharded_params
        self._reduced = [False] * len(self.buckets)       # local p.grad already folded into grad_shards

    def _new_step(self) -> None:
        super()._new_step()
        self._reduced = [False] * len(self.buckets)

    def reduce_grads(self) -> None:
        """What backward left local (the last micro-steps ran under ``no_sync``: their ``p.grad``) is
        reduce-scattered now and added to the shard backward produced; once per step."""
        for b, bucket in enumerate(self.buckets):
            local = not self._reduced[b] and any(p.grad is not None for p in bucket.params)
            if self.grad_shards[b] is not None and not local:
                continue                                   # already there: backward reduce-scattered it
            self.reducer.submit(b, bucket, release_grads=False)
            self._reduced[b] = True
        self.reducer.drain()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        self.reduce_grads()
        self.update_shards()
        if not self.sharded_params:
            self.gather_params()
        self._new_step()
