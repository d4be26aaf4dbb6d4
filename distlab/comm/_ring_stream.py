"""The ring's engine: its steps cut into segments and streamed, two segments in flight.

A ring collective is a list of steps; at each step every rank sends one chunk to its right
neighbour and receives one from its left. Done literally (send the chunk, wait, reduce, next
step) the link idles while the rank reduces. As gloo's own ring does (gloo/allreduce.cc), each
chunk is cut into K segments and the steps become one stream of (N-1)K or 2(N-1)K items:

    item i = (step s, segment j):  post recv i+1 (one ahead), post send i, then finish item i-1
                                   (wait for it, reduce it), so one segment is on the wire
                                   while the previous one is being reduced

Segment j of step s+1 sends what item (s, j) reduced, K items earlier, so with K >= 2 nothing
waits for data that is not there yet. Small chunks (K = 1) finish item i before sending i+1.
Posting each receive one item early means the left neighbour's data is expected before it
arrives (gloo otherwise holds it back until the receive is posted).

Why the early receive cannot overwrite data still being sent or reduced: in-place receives land
in three rotating scratch segments (items i-1, i, i+1 in flight); out-of-place ones in three
rotating chunk buffers (see ring_reduce_scatter); an all-gather receives into a chunk other than
the one being sent, except with N = 2, where the left neighbour only sends it after it has
received all of ours.

Each step still records one comm event (its first post to its last completion), with the
bytes of its whole chunk, so the trace reads exactly as the textbook steps do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import tracer
from ._p2p import Ring, reduce_into, scratch

SEGMENT_BYTES = 1 << 22
"""Target segment size. Small enough to overlap reduction with transfer, large enough that the
per-segment cost (a few tens of microseconds of Python and gloo bookkeeping) stays small."""


@dataclass
class Step:
    """One ring step on this rank: send ``send``; receive a chunk the size of ``recv_shape``.

    Where the received data goes:
      * ``recv`` given, ``local`` None:  straight into ``recv`` (all-gather)
      * ``recv`` given, ``local`` given: into ``recv``, then ``recv op= local`` (out-of-place reduce)
      * ``recv`` None, ``into`` given:   into a scratch segment, then ``into op= scratch`` (in place)
    ``divide`` > 0 divides the reduced result by it (the mean of op="avg") as each segment lands.
    """

    send: torch.Tensor
    recv: torch.Tensor | None = None
    local: torch.Tensor | None = None
    into: torch.Tensor | None = None
    divide: int = 0
    info: dict | None = None

    @property
    def target(self) -> torch.Tensor:
        return self.recv if self.recv is not None else self.into


def run_ring(ring: Ring, name: str, steps: list[Step], op: str, *, call: int, size: int, first_step: int = 0) -> None:
    """Run ``steps`` around the ring (send to ``ring.next``, receive from ``ring.prev``).

    Receives are posted one item ahead, so the left neighbour's data never waits for us to ask
    for it; a send is posted as soon as its data is final (item i-K reduced).
    """
    if not steps:
        return
    width = max(max(s.send.numel(), s.target.numel()) for s in steps)
    example = steps[0].send
    k = 1 if example.is_cuda else max(1, -(-width * example.element_size() // SEGMENT_BYTES))
    lag = 1 if k >= 2 else 0                    # finish item i-1 (K >= 2) or item i (K = 1) at iteration i
    dst, src = ring.glob(ring.next), ring.glob(ring.prev)
    nccl = dist.get_backend(ring.group) == "nccl"
    parts = [_split(s, k) for s in steps]
    slots = [scratch(-(-width // k), example.dtype, example.device, slot) for slot in range(3)] \
        if any(s.recv is None for s in steps) else []
    tr = tracer()
    began: dict[int, float] = {}
    recvs: dict[int, tuple] = {}
    sends: dict[int, object] = {}
    total = len(steps) * k

    def post_recv(i: int) -> None:
        s, j = divmod(i, k)
        _, recv, into, _ = parts[s][j]
        if recv is None:                                # in place: land in a scratch segment
            recv = slots[i % 3][: into.numel()]
        if j == 0:
            began[s] = tr.now()
        work = None
        if recv.numel():
            work = (dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, src, ring.group)])[0] if nccl
                    else dist.irecv(recv, src, group=ring.group))
        recvs[i] = (recv, work)

    def post_send(i: int) -> None:
        send = parts[i // k][i % k][0]
        sends[i] = None if not send.numel() else (
            dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, ring.group)])[0] if nccl
            else dist.isend(send, dst, group=ring.group))

    def finish(i: int) -> None:
        s, j = divmod(i, k)
        recv, work = recvs.pop(i)
        if work is not None:                            # each gloo Work is waited on exactly once
            work.wait()
        step, (_, _, into, local) = steps[s], parts[s][j]
        result = None
        if step.recv is None:
            reduce_into(into, recv, op)
            result = into
        elif local is not None:
            reduce_into(recv, local, op)
            result = recv
        if step.divide and result is not None:
            result.div_(step.divide)
        work = sends.pop(i)
        if work is not None:
            work.wait()
        if j == k - 1:
            tr.comm(name, start=began.pop(s), end=tr.now(), sent=_nbytes(step.send),
                    received=_nbytes(step.target), peer=dst if step.send.numel() else None,
                    src=src if step.target.numel() else None, step=first_step + s, call=call, size=size,
                    world=ring.size, **(step.info or {}))

    post_recv(0)
    for i in range(total):
        if i + 1 < total:
            post_recv(i + 1)
        post_send(i)
        if i >= lag:
            finish(i - lag)
    for i in range(total - lag, total):
        finish(i)


def _split(step: Step, k: int) -> list[tuple]:
    """Per segment: (send piece, receive piece or None, in-place target piece, local piece)."""
    send = torch.tensor_split(step.send, k)
    target = torch.tensor_split(step.target, k)
    recv = target if step.recv is not None else [None] * k
    into = target if step.recv is None else [None] * k
    local = torch.tensor_split(step.local, k) if step.local is not None else [None] * k
    return [(send[j], recv[j], into[j], local[j]) for j in range(k)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
