"""Distributed data parallel: every rank holds the whole model, sees 1/N of the batch, and the
gradients are averaged so every replica takes the same step.

    g = (1/N) sum_r g_r          (all-reduce; ring cost 2 (N-1)/N * Psi bytes sent per rank)

Two classes, from the simplest (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB, Sec. 3):

* `NaiveDDP`: after backward, one all-reduce per parameter (a latency alpha per tensor);
* `DDP`: gradients packed into *buckets* of ~``bucket_mb`` MB, one all-reduce per bucket; with
  ``overlap=True`` (default) each bucket's all-reduce starts, asynchronously, the moment its last
  gradient is accumulated, so communication hides under the rest of backward:

      backward   |== L4 ==|== L3 ==|== L2 ==|== L1 ==|
      all-reduce          |  b0   |   |  b1   |   |  b2  |      (buckets in reverse layer order)

  ...and is waited on when backward finishes: ``loss.backward()`` returns averaged gradients.

Both start by broadcasting rank 0's weights, so the replicas begin identical and, taking identical
steps, stay identical. ``no_sync()`` accumulates locally without communicating (gradient accumulation).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.autograd import Variable

from ..flat_collectives import Collectives
from .backward_hooks import BackwardWatcher
from .buckets import bucketize, trainable


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, comm: Collectives) -> None:
    """Copy rank 0's parameters and buffers to every rank: the replicas start identical."""
    seen = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:                         # a tied weight once
            seen.add(id(t))
            comm.broadcast(t.data, src=0)


@contextlib.contextmanager
def accumulate_locally(wrapper: nn.Module):
    """What every data-parallel wrapper's ``no_sync()`` does: backward passes inside keep their gradients
    local (``wrapper._sync`` off), summed by autograd; the first backward outside communicates the sum.
    Nested blocks restore the state they found."""
    before, wrapper._sync = wrapper._sync, False
    try:
        yield
    finally:
        wrapper._sync = before


class NaiveDDP(nn.Module):
    """Data parallelism as first written: after backward, all-reduce (average) every gradient, one by one.

        rank r:  forward(x_r) -> backward -> for p in params: all_reduce(p.grad) / N -> step

    Correct, and slow at scale: one message per parameter tensor, each paying the latency alpha, and
    all of them after the backward pass, none hidden under it. `DDP` fixes both.
    """

    def __init__(self, module: nn.Module, comm: str = "torch", group=None):
        super().__init__()
        self.module = module
        self.comm = Collectives(comm, group)
        broadcast_from_rank0(module, self.comm)
        self.params = trainable(module.parameters())
        self._sync, self._queued = True, False
        for p in self.params:                         # the first gradient of a backward queues the sync
            p.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one outside averages the sum."""
        return accumulate_locally(self)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._sync and not self._queued:
            self._queued = True                       # run all_reduce_grads once autograd has finished
            Variable._execution_engine.queue_callback(self.all_reduce_grads)

    def all_reduce_grads(self) -> None:
        """One all-reduce per parameter: g <- (1/N) sum_r g_r. Unused parameters contribute zeros."""
        self._queued = False
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad, op="avg")


class _GradBucket:
    """A flat gradient buffer for a group of parameters; ``p.grad`` become views into it."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.grad = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)   # (sum of numel,)
        self.views = [self.grad[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, params)]

    def absorb(self, i: int) -> None:
        """Make params[i].grad the bucket's view (copying a freshly allocated grad into it)."""
        p, view = self.params[i], self.views[i]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view


class DDP(nn.Module):
    """Wrap ``module`` for data parallelism over ``group`` (default: all ranks): bucketed, overlapped.

    Buckets are filled in reverse registration order, the order backward produces gradients (Li et
    al. 2020, Sec. 3.2.3; `buckets.bucketize`). Gradients live in each bucket's flat buffer (``p.grad``
    is a view into it), so all-reducing a bucket needs no copy. ``overlap=False`` all-reduces the
    buckets one by one after backward. Frozen parameters are skipped; parameters unused in a step
    contribute zeros; tied parameters are reduced once. ``comm``: "torch" (torch.distributed) or
    "ring" (distlab's ring from send/recv); both traced by `parallel/collectives.py`.
    """

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, overlap: bool = True,
                 comm: str = "torch", group=None):
        super().__init__()
        self.module, self.overlap, self.bucket_mb = module, overlap, bucket_mb
        self.comm = Collectives(comm, group)
        broadcast_from_rank0(module, self.comm)
        self.params = trainable(module.parameters())
        groups = bucketize(self.params, bucket_mb)
        self.buckets = [_GradBucket(ps) for ps in groups]
        self._index = {id(p): i for ps in groups for i, p in enumerate(ps)}
        self._pending: list = []                   # handles of bucket all-reduces in flight
        self._sync = True
        self.watcher = BackwardWatcher(groups, on_ready=self._bucket_ready, on_end=self._backward_done,
                                       on_grad=self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one outside all-reduces the sum."""
        return accumulate_locally(self)

    # -- backward hooks: each bucket's all-reduce starts when its last gradient arrives --------
    def _grad_ready(self, p: torch.Tensor, b: int) -> None:
        self.buckets[b].absorb(self._index[id(p)])

    def _bucket_ready(self, b: int) -> None:
        bucket = self.buckets[b]
        for i, p in enumerate(bucket.params):        # unused this step: contribute zeros, not stale values
            if p.grad is None:
                bucket.views[i].zero_()
        if self._sync and self.overlap:
            self._pending.append(self.comm.all_reduce(bucket.grad, op="avg", async_op=True))

    def _backward_done(self) -> None:
        if not self._sync:
            return
        if not self.overlap:                          # everything after backward, one bucket at a time
            for bucket in self.buckets:
                self.comm.all_reduce(bucket.grad, op="avg")
        self.wait_grad_sync()

    @property
    def in_flight(self) -> int:
        """Bucket all-reduces started and not yet waited for."""
        return len(self._pending)

    def wait_grad_sync(self) -> None:
        """Wait for the bucket all-reduces in flight (what every backward does as it ends, in
        ``watcher.on_end``); parameters unused in the step then hold the average too."""
        for handle in self._pending:
            handle.wait()
        self._pending = []
        for bucket in self.buckets:                   # unused parameters now hold the average too
            for i, p in enumerate(bucket.params):
                if p.grad is None:
                    p.grad = bucket.views[i]

    def finish_grad_sync(self) -> None:
        """All-reduce (average) every bucket now (Megatron's ``finish_grad_sync``), for callers whose
        micro-steps all ran under ``no_sync()``. Gradients assigned outside autograd's accumulation (code
        that sets ``p.grad`` directly) are first copied into their bucket, so every one takes part."""
        for bucket in self.buckets:
            for i in range(len(bucket.params)):
                bucket.absorb(i)
            self.comm.all_reduce(bucket.grad, op="avg")
