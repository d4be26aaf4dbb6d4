"""DDP replicas of a pipeline stage: their all-reduce starts in the last backward, ends after the flush.

A pipeline accumulates gradients over its microbatches, so `DDP` replicas of a stage all-reduce once per
step, not once per microbatch: every backward runs under ``ddp.no_sync()``. Starting that all-reduce only
after the flush would leave the network idle during the last backward. Instead the rank's final B action
runs with DDP's overlap switched on (`ReplicaGradSync.last_backward`): each bucket's all-reduce starts the
moment the bucket is full, the backward returns without waiting, so the input gradient goes upstream at
once, and `ReplicaGradSync.finish` waits after the flush (Megatron-LM's ``overlap_grad_reduce`` and
``finalize_model_grads``, Narayanan et al. 2021; torch.distributed.pipelining's last-backward sync)::

    last B     |== L4 ==|== L3 ==|== L2 ==|== L1 ==| -> d loss/d input upstream
    all-reduce          |  b0   |   |  b1   |  |  b2  |
    flush ...                                          finish(): wait b0, b1, b2 -> optimizer step

Where one B does not finish every gradient of the rank (interleaved chunks, zero bubble's I/W split),
no backward is marked and `finish` all-reduces every bucket after the flush (`DDP.finish_grad_sync`).

    sync = ReplicaGradSync(ddp)
    with ddp.no_sync():
        pipe.step(x, y, last_backward=sync.last_backward())     # the context entered around the final B
    sync.finish()

The hand-off attaches from here: DDP knows nothing of pipelines. It switches DDP's sync on for one
backward and replaces, for that backward, the callback that would wait when it ends (``ddp.watcher.on_end``).
"""
from __future__ import annotations

import contextlib


class ReplicaGradSync:
    """The all-reduce of ``ddp`` (a `distlab.parallel.data.DDP` around this rank's stage) started by the
    last backward of a pipeline step (`last_backward`) and waited for after the flush (`finish`)."""

    def __init__(self, ddp):
        self.ddp = ddp
        self.started = False                       # a last_backward ran: finish waits for its all-reduces

    @contextlib.contextmanager
    def last_backward(self):
        """The backward inside (even under ``ddp.no_sync()``) starts each bucket's all-reduce when the
        bucket is full and returns without waiting for them: `finish` waits."""
        ddp = self.ddp
        sync, on_end = ddp._sync, ddp.watcher.on_end
        ddp._sync, ddp.watcher.on_end = True, self._leave_in_flight
        self.started = True
        try:
            yield
        finally:
            ddp._sync, ddp.watcher.on_end = sync, on_end

    def _leave_in_flight(self) -> None:
        """The end of the last backward: the all-reduces stay in flight (where DDP would wait)."""

    def finish(self) -> None:
        """After the flush: wait for the all-reduces the last backward started or, if none did (or DDP
        does not overlap), all-reduce every bucket now."""
        started, self.started = self.started, False
        if started and self.ddp.overlap:
            self.ddp.wait_grad_sync()
        else:
            self.ddp.finish_grad_sync()
