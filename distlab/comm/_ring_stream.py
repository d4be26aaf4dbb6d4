"""The ring's engine: its steps cut into segments and streamed, two segments in flight.

A ring collective is a list of steps; at each step every rank sends one chunk to its right
neighbour and receives one from its left. Done literally (send the chunk, wait, reduce, next
step) the link idles while the rank reduces. As gloo's own ring does (gloo/allreduce.cc), each
chunk is cut into K segments and the steps become one stream of (N-1)K or 2(N-1)K items:

    item i = (step s, segment j):  post recv i and send i, then finish item i-2
                                   (wait for it, reduce it), so one segment is on the wire
                                   while the previous one is being reduced

Segment j of step s+1 sends what item (s, j) just reduced, K items earlier, so with K >= 2
nothing waits for data that is not there yet. Small chunks (K = 1) run one item at a time.

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
    """Run ``steps`` around the ring (send to ``ring.next``, receive from ``ring.prev``)."""
    if not steps:
        return
    width = max(max(s.send.numel(), s.target.numel()) for s in steps)
    example = steps[0].send
    k = 1 if example.is_cuda else max(1, -(-width * example.element_size() // SEGMENT_BYTES))
    depth = min(2, k)
    dst, src = ring.glob(ring.next), ring.glob(ring.prev)
    nccl = dist.get_backend(ring.group) == "nccl"
    parts = [_split(s, k) for s in steps]
    slots = [scratch(-(-width // k), example.dtype, example.device, slot) for slot in range(depth)] \
        if any(s.recv is None for s in steps) else []
    tr = tracer()
    began: dict[int, float] = {}
    pending: dict[int, tuple] = {}
    total = len(steps) * k

    def post(i: int) -> None:
        s, j = divmod(i, k)
        send, recv, _, _ = parts[s][j]
        if steps[s].recv is None:                       # in place: land in a scratch segment
            recv = slots[i % depth][: parts[s][j][2].numel()]
        if j == 0:
            began[s] = tr.now()
        works = []
        if nccl:
            ops = [dist.P2POp(dist.irecv, recv, src, ring.group)] if recv.numel() else []
            ops += [dist.P2POp(dist.isend, send, dst, ring.group)] if send.numel() else []
            works = dist.batch_isend_irecv(ops) if ops else []
        else:
            if recv.numel():
                works.append(dist.irecv(recv, src, group=ring.group))
            if send.numel():
                works.append(dist.isend(send, dst, group=ring.group))
        pending[i] = (recv, works)

    def finish(i: int) -> None:
        s, j = divmod(i, k)
        recv, works = pending.pop(i)
        for w in works:                                  # each gloo Work is waited on exactly once
            w.wait()
        step, (_, _, into, local) = steps[s], parts[s][j]
        if step.recv is None:
            reduce_into(into, recv, op)
            result = into
        elif local is not None:
            reduce_into(recv, local, op)
            result = recv
        else:
            result = None
        if step.divide and result is not None:
            result.div_(step.divide)
        if j == k - 1:
            info = step.info or {}
            tr.comm(name, start=began.pop(s), end=tr.now(), sent=_nbytes(step.send),
                    received=_nbytes(step.target), peer=dst if step.send.numel() else None,
                    src=src if step.target.numel() else None, step=first_step + s, call=call, size=size,
                    world=ring.size, **info)

    for i in range(total + depth):
        if i >= depth:
            finish(i - depth)
        if i < total:
            post(i)


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
