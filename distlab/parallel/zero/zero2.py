"""`ZeRO(module, stage, optim)`: the model wrapper for stages 1, 2 and 3 (Rajbhandari et al. 2020).

Per rank, for Psi parameters over N ranks with K bytes of optimizer state per parameter
(fp32 Adam: 4 + 4 + K=8; bf16 mixed with fp32 master weights: 2 + 2 + K=12):

    stage  params    grads     optimizer   sent per step        what happens
    0/DDP  4 Psi     4 Psi     K Psi       2 (N-1)/N Psi        all-reduce grads
    1      4 Psi     4 Psi     K Psi / N   2 (N-1)/N Psi        reduce-scatter grads at step, all-gather params
    2      4 Psi     4 Psi / N K Psi / N   2 (N-1)/N Psi        reduce-scatter each bucket *during* backward
    3      4 Psi / N 4 Psi / N K Psi / N   3 (N-1)/N Psi        params gathered per unit, forward and backward

Transient ``buffers`` on top (the ledger's fifth category): a reduce-scatter needs its bucket's gradients
in one flat buffer until it completes. At most ``max_inflight`` of them live at once (`reducer`): each is
freed as soon as its shard has been taken, so ZeRO-1/2 hold about max_inflight x bucket_mb of them (ZeRO-1
in step(), ZeRO-2 during backward), never the whole 4 Psi gradient unless one bucket is the whole model;
ZeRO-3 holds about one unit: a gathered unit waits for room among them too (see `stage3`).

    model = dl.ZeRO(module, stage=2, optim=torch.optim.AdamW, lr=1e-3)
    loss = loss_fn(model(x), y); loss.backward()
    model.optimizer.step(); model.optimizer.zero_grad()

Gradient accumulation over k micro-steps, ``with model.no_sync():`` on the first k-1 (as DDP and
FSDP): those backward passes keep their gradients local, summed by autograd into the parameters'
own ``.grad`` (the local accumulation buffer), and the first backward outside reduce-scatters the sum.
Bytes sent per rank per optimizer step, and the gradient memory held while accumulating:

    stage  without no_sync        with no_sync           gradients held between micro-steps
    1      2 (N-1)/N Psi          2 (N-1)/N Psi          4 Psi either way (stage 1 communicates only in step())
    2      (k+1) (N-1)/N Psi      2 (N-1)/N Psi          4 Psi with no_sync, 4 Psi / N without
    3      3k (N-1)/N Psi         (2k+1) (N-1)/N Psi     4 Psi with no_sync, 4 Psi / N without

The price is ZeRO-2/3's gradient saving, for the length of the accumulation: the memory of a full
gradient, as FSDP's ``no_sync`` documents ("higher memory usage because FSDP will accumulate the full
model gradients (instead of gradient shards) until the eventual sync").
DeepSpeed makes the other choice: its ``engine.no_sync()`` refuses stages 2 and 3 ("incompatible with
gradient partitioning") and reduce-scatters every micro-step, as this class does without no_sync.
Stage 3 keeps its parameters sharded, so every micro-step still all-gathers them for forward and
backward: only the k-1 reduce-scatters are saved. We allow it (FSDP's behaviour) rather than raise,
since which is scarcer, bandwidth or memory, is the user's call, and the lessons measure both sides;
`dl.train` turns it on for stage 3 only when asked (``no_sync=True``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..collectives import Collectives
from ..data.buckets import bucketize, storage_bytes, trainable
from ..data.backward_hooks import BackwardWatcher
from .zero1 import ShardedOptimizer
from .zero3 import Stage3, default_units, unit_params


class ZeRO(nn.Module):
    """Wrap ``module`` for ZeRO ``stage`` 1, 2 or 3; ``.optimizer`` is the `ShardedOptimizer`.

    ``bucket_mb``: gradient bucket size (stages 1-2); ``overlap``: stage 2 launches each bucket's
    reduce-scatter asynchronously during backward; ``max_inflight``: how many flat gradient buckets
    (stage 3: units) may be reduce-scattering at once, the older ones waited for and freed first (1, as
    FSDP2's ``set_reduce_scatter_max_input_buffers``; 2 hides a slow reduce-scatter under more backward
    for one more bucket of memory); ``units``: stage 3's gather units (default: the children of every
    ``nn.ModuleList``, then the root); ``prefetch``: stage 3 gathers the next unit early; ``comm``:
    "torch" or "ring". Remaining keyword arguments go to ``optim``.
    """

    def __init__(self, module: nn.Module, stage: int = 1, optim: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 *, bucket_mb: float = 25.0, overlap: bool = True, units: list[nn.Module] | None = None,
                 prefetch: bool = False, comm: str = "torch", group=None, max_inflight: int = 1,
                 **optim_kwargs):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3 (stage 0 is plain DDP: use dl.DDP), got {stage}")
        self.module, self.stage, self.overlap = module, stage, overlap
        self.comm = Collectives(comm, group)
        with torch.no_grad():                              # identical starting point on every rank
            for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():
                self.comm.broadcast(t.data, src=0)
        self.stage3 = None
        self._sync = True                                   # False inside no_sync()
        if stage == 3:
            units = units if units is not None else default_units(module)
            groups = unit_params(units)
            units = [u for u, g in zip(units, groups) if g]
            groups = [g for g in groups if g]
            self.optimizer = ShardedOptimizer(None, optim, comm=self.comm, groups=groups, sharded_params=True,
                                              max_inflight=max_inflight, **optim_kwargs)
            self.stage3 = Stage3(units, self.optimizer, prefetch=prefetch)
        else:
            groups = bucketize(trainable(module.parameters()), bucket_mb)
            self.optimizer = ShardedOptimizer(None, optim, comm=self.comm, groups=groups,
                                              max_inflight=max_inflight, **optim_kwargs)
            if stage == 2:
                self.watcher = BackwardWatcher(groups, on_ready=self._bucket_ready, on_end=self._backward_done)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep their gradients local (no reduce-scatter); the first backward
        outside, or else ``optimizer.step()``, reduce-scatters the accumulated sum.

        Stage 1: a no-op (it communicates only in ``step()``). Stages 2 and 3: full gradients stay in
        ``p.grad`` until then, 4 Psi bytes instead of 4 Psi / N; stage 3 still all-gathers parameters
        every micro-step (see the module docstring for the bytes and the trade-off).
        """
        before = self._sync                                 # nesting is harmless: restore, not reset
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(before)

    def _set_sync(self, sync: bool) -> None:
        self._sync = sync
        if self.stage3 is not None:
            self.stage3.sync = sync

    # -- stage 2: reduce-scatter during backward -------------------------------------------------
    def _bucket_ready(self, b: int) -> None:
        if not self._sync:
            return                                          # no_sync: autograd keeps summing into p.grad
        # pack the bucket's (accumulated) gradients into a flat buffer, drop p.grad, launch the
        # reduce-scatter; older buckets beyond max_inflight are waited for and their buffers freed first
        self.optimizer.reducer.submit(b, self.optimizer.buckets[b], async_op=self.overlap)

    def _backward_done(self) -> None:
        self.optimizer.reducer.drain()

    # -- utilities -------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm across all shards (see `ShardedOptimizer.clip_grad_norm_`)."""
        return self.optimizer.clip_grad_norm_(max_norm)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, cloned, on every rank (a collective under stage 3)."""
        if self.stage3 is not None:
            self.stage3.gather_all()
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.stage3 is not None:
            self.stage3.free_all()
        return state

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds by category: params (shards, or full buckets), grads, optimizer state,
        and ``buffers``: the most transient bytes alive at once since the last call: flat gradient
        buckets waiting for their reduce-scatter (every stage; at most ``max_inflight`` of them), and
        under stage 3 the gathered units beside them."""
        opt = self.optimizer
        buffers = opt.reducer.take_peak()
        if self.stage3 is not None:
            params = storage_bytes(opt.shards)
            buffers = max(buffers, self.stage3.take_peak())
        else:
            params = storage_bytes(b.full for b in opt.buckets)
        grads = storage_bytes([*(p.grad for p in opt.params), *opt.grad_shards])
        return {"params": params, "grads": grads, "optimizer": opt.state_bytes(), "buffers": buffers}
