"""Distributed data parallel: every rank holds the whole model, sees 1/N of the batch, and the
gradients are averaged so every replica takes the same step.

    g = (1/N) sum_r g_r          (all-reduce; ring cost 2 (N-1)/N * Psi bytes sent per rank)

Three versions, from the simplest (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB, Sec. 3):

* ``naive=True``   after backward, one all-reduce per parameter (a latency alpha per tensor);
* ``overlap=False`` after backward, one all-reduce per *bucket* of ~``bucket_mb`` MB;
* ``overlap=True`` (default) each bucket's all-reduce starts, asynchronously, the moment its last
  gradient is accumulated, so communication hides under the rest of backward:

      backward   |== L4 ==|== L3 ==|== L2 ==|== L1 ==|
      all-reduce          |  b0   |   |  b1   |   |  b2  |      (buckets in reverse layer order)

  ...and is waited on when backward finishes: ``loss.backward()`` returns averaged gradients.

Gradients live in each bucket's flat buffer (``p.grad`` is a view into it), so all-reducing a
bucket needs no copy. ``no_sync()`` accumulates locally without communicating (gradient
accumulation). Frozen parameters are skipped; parameters unused in a step contribute zeros;
tied parameters are reduced once.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..collectives import Collectives
from .buckets import bucketize, storage_bytes, trainable
from .backward_hooks import BackwardWatcher


class _GradBucket:
    """A flat gradient buffer for a group of parameters; ``p.grad`` become views into it."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.grad = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
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
    """Wrap ``module`` for data parallelism over ``group`` (default: all ranks).

    ``comm``: "torch" (torch.distributed collectives, default) or "ring" (distlab's ring, built from
    send/recv). Bytes per step are recorded in ``dl.tracer()`` either way (see `parallel/collectives.py`).
    """

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, overlap: bool = True,
                 comm: str = "torch", naive: bool = False, group=None):
        super().__init__()
        self.module = module
        self.comm = Collectives(comm, group)
        self.naive = naive
        self.overlap = overlap and not naive
        self.bucket_mb = 0.0 if naive else bucket_mb
        with torch.no_grad():                      # identical replicas: rank 0's weights everywhere
            for t in _unique([*module.parameters(), *module.buffers()]):
                self.comm.broadcast(t.data, src=0)
        self.params = trainable(module.parameters())
        groups = bucketize(self.params, self.bucket_mb)
        self.buckets = [_GradBucket(ps) for ps in groups]
        self._index = {id(p): i for ps in groups for i, p in enumerate(ps)}
        self._pending: list = []
        self._sync = True
        self._wait_in_finish = False               # inside start_grad_sync(): finish_grad_sync waits
        self.watcher = BackwardWatcher(groups, on_ready=self._bucket_ready, on_end=self._backward_done,
                                       on_grad=self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one outside all-reduces the sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @contextlib.contextmanager
    def start_grad_sync(self):
        """The backward inside (even under ``no_sync()``) starts each bucket's all-reduce the moment the
        bucket is full and returns without waiting; `finish_grad_sync` waits. For a pipeline's last
        microbatch: its input gradient goes upstream at once while the replicas' all-reduces run
        (Megatron's ``overlap_grad_reduce``, torch.distributed.pipelining's last-backward sync)."""
        sync, self._sync, self._wait_in_finish = self._sync, True, True
        try:
            yield
        finally:
            self._sync = sync

    @property
    def in_flight(self) -> int:
        """Bucket all-reduces started and not yet waited for (after a `start_grad_sync` backward)."""
        return len(self._pending)

    # -- backward hooks --------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor, b: int) -> None:
        self.buckets[b].absorb(self._index[id(p)])

    def _bucket_ready(self, b: int) -> None:
        bucket = self.buckets[b]
        for i, p in enumerate(bucket.params):        # unused this step: contribute zeros, not stale values
            if p.grad is None:
                bucket.views[i].zero_()
        if self._sync and self.overlap:
            self._pending.append(self.comm.all_reduce(self.buckets[b].grad, op="avg", async_op=True))

    def _backward_done(self) -> None:
        if not self._sync or self._wait_in_finish:
            return
        if not self.overlap:                          # everything after backward, one by one
            for bucket in self.buckets:
                self.comm.all_reduce(bucket.grad, op="avg")
        self._wait_pending()

    def _wait_pending(self) -> None:
        for handle in self._pending:
            handle.wait()
        self._pending = []
        for bucket in self.buckets:                   # unused parameters now hold the average too
            for i in range(len(bucket.params)):
                if bucket.params[i].grad is None:
                    bucket.params[i].grad = bucket.views[i]

    def finish_grad_sync(self) -> None:
        """All-reduce (average) every bucket now (Megatron's ``finish_grad_sync``).

        For callers that drive backward themselves, such as a pipeline whose micro-steps all ran
        under ``no_sync()``: gradients assigned outside autograd's accumulation (a zero-bubble W
        pass sets ``p.grad`` directly) are first copied into their bucket, so every one takes part.
        After a `start_grad_sync` backward it only waits for the all-reduces that backward started.
        """
        if self._wait_in_finish:
            self._wait_in_finish = False
            if self.overlap:
                self._wait_pending()
                return
        for bucket in self.buckets:
            for i in range(len(bucket.params)):
                bucket.absorb(i)
            self.comm.all_reduce(bucket.grad, op="avg")

    # -- accounting ------------------------------------------------------------------------
    def memory_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds by category (params, grads, optimizer)."""
        from ...memory import optimizer_bytes
        params = list(self.module.parameters())
        return {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
                "optimizer": optimizer_bytes(optimizer) if optimizer is not None else 0}


def _unique(tensors):
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
