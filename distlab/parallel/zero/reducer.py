"""Reduce-scatter flat gradient buckets into their owners' shards, never more than ``max_inflight`` at once.

A reduce-scatter needs its bucket's gradients packed into one flat padded buffer (`FlatBucket.flat_grads`,
4 bytes per element in fp32), and that buffer must live until the collective has completed and this rank's
shard has been taken. ZeRO-2 and ZeRO-3 launch one per bucket (ZeRO-3: per unit) during backward; keeping
every buffer until backward ends would hold a whole gradient, 4 Psi bytes, at that moment whatever the
bucket size: exactly the memory stage 2 exists to save. So before packing a new bucket we *retire* the
oldest launched ones (wait for the reduce-scatter, add its shard to the optimizer's gradient shard, drop
the flat buffer) until fewer than ``max_inflight`` remain:

    backward (max_inflight = 1)                                  flat buffers alive
      bucket 0 ready: pack flat0, launch RS(flat0)               flat0
      bucket 1 ready: wait RS(flat0), shard0 -> grad_shards[0]
                      free flat0; pack flat1, launch RS(flat1)   flat1
      ...
      end of backward: wait and retire whatever is left          none

So the flat buffers alive at any moment are at most ``max_inflight`` buckets (plus, outside this class,
the ``p.grad`` autograd is filling for the next bucket), not Psi. The reduce-scatter of one bucket still
runs under the backward compute of the next: a larger ``max_inflight`` gives a slow network more of the
backward pass to hide under, for one more bucket of memory each.

This is what PyTorch FSDP2 does with its reduce-scatter inputs (``FSDPModule.
set_reduce_scatter_max_input_buffers``, default 1: before a module's reduce-scatter, reclaim the oldest
until fewer than the cap remain); DeepSpeed's stage 2 double-buffers its ``reduce_bucket_size`` buckets
(one filling while the other is reduced). Both realise the ZeRO paper's bucketed gradient partitioning
with *constant size buffers* (Rajbhandari et al. 2020, Sec. 5.2 and 6.3): temporary buffers whose size
does not grow with the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..flat_collectives import Collectives, Handle
from ..data.buckets import FlatBucket


@dataclass
class _InFlight:
    """One launched reduce-scatter: bucket ``b``'s flat gradients and the shard they reduce into."""
    b: int
    flat: torch.Tensor                # (padded,): every gradient of the bucket, back to back
    shard: torch.Tensor               # (padded / N,): this rank's averaged part, once complete
    handle: Handle | None = None


class GradReducer:
    """Bounded queue of launched reduce-scatters: ``submit`` packs and launches, ``drain`` waits for all.

    ``on_shard(b, shard)`` receives bucket ``b``'s averaged shard once its reduce-scatter has completed
    (the optimizer adds it to its gradient shard).
    """

    def __init__(self, comm: Collectives, on_shard: Callable[[int, torch.Tensor], None],
                 max_inflight: int = 1):
        if not isinstance(max_inflight, int) or max_inflight < 1:
            raise ValueError(f"max_inflight is how many flat gradient buckets may be reduce-scattering at "
                             f"once: an int >= 1 (1 = FSDP2's default, 2 = more overlap), "
                             f"got {max_inflight!r}")
        self.comm, self.on_shard, self.max_inflight = comm, on_shard, max_inflight
        self._queue: list[_InFlight] = []          # oldest first

    def submit(self, b: int, bucket: FlatBucket, *, average: bool = True, async_op: bool = True,
               release_grads: bool = True) -> None:
        """Reduce-scatter bucket ``b``'s gradients (averaged over ranks) into this rank's shard.

        ``release_grads``: set the parameters' ``.grad`` to None once packed (ZeRO-2/3: no full gradient
        stays behind). ``average=False``: the gradients are already averaged (under DDP): just take the
        slice. With ``async_op=False`` the bucket is retired before this returns.
        """
        self.make_room()                                  # *before* allocating the next buffer
        flat = bucket.flat_grads()
        if release_grads:
            for p in bucket.params:
                p.grad = None
        job = _InFlight(b, flat, torch.empty(bucket.shard_numel, dtype=flat.dtype, device=flat.device))
        self._queue.append(job)                           # in flight from here on
        if average:
            job.handle = self.comm.reduce_scatter(flat, job.shard, op="avg", async_op=async_op)
        else:
            job.shard.copy_(bucket.chunk(flat, self.comm.rank))
        if not async_op:
            self.drain()

    def make_room(self) -> None:
        """Retire the oldest launched reduce-scatters until fewer than ``max_inflight`` remain: call it
        before allocating a transient buffer (the next flat bucket; under ZeRO-3, a unit to gather)."""
        while len(self._queue) >= self.max_inflight:
            self._retire_oldest()

    def drain(self) -> None:
        """Wait for every launched reduce-scatter and hand its shard over (end of backward, or of step)."""
        while self._queue:
            self._retire_oldest()

    def in_flight(self) -> list[torch.Tensor]:
        """The flat gradient buffers launched and not yet retired (at most ``max_inflight``)."""
        return [job.flat for job in self._queue]

    def _retire_oldest(self) -> None:
        job = self._queue.pop(0)                          # FIFO: every rank waits in launch order
        if job.handle is not None:
            job.handle.wait()
        self.on_shard(job.b, job.shard)                   # job.flat's last reference goes with this frame
