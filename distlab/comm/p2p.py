"""The one primitive every collective here is built from: a traced point-to-point exchange.

``exchange(send=..., dst=..., recv=..., src=...)`` posts the send and the receive *together* and
waits for both. Posting both before waiting is what keeps a ring from deadlocking: if every rank
first did a blocking send to its right neighbour, nobody would be receiving. (Under NCCL the pair
goes through ``batch_isend_irecv`` so it lands in one NCCL group; under gloo plain
``isend``/``irecv`` do the same job with less Python overhead.)

Each exchange records one comm event in ``dl.tracer()``:

    name      the collective (``"ring_all_reduce"``, ``"broadcast"``, ...)
    sent      bytes sent in this step         received  bytes received in this step
    peer      global rank sent to (None if nothing was sent)
    src       global rank received from (None if nothing was received)
    step      index of the step within the call  (plus any ``**info``: phase, chunk indices, ...)
    call      a per-process counter shared by every event of one collective call
    size      bytes of the whole message the collective was asked to move
    world     ranks taking part
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import group_members, group_rank, tracer

OPS = ("sum", "avg", "max", "min", "prod")
_call_ids = itertools.count()


@dataclass(frozen=True)
class Ring:
    """Who I am inside ``group``: my group rank, the group size, and the global rank of each member.

    ``torch.distributed`` addresses sends by *global* rank; collectives think in group ranks.
    """

    group: object
    rank: int
    size: int
    members: tuple[int, ...]

    @classmethod
    def of(cls, group=None) -> "Ring":
        members = group_members(group)
        return cls(group, group_rank(group), len(members), members)

    def glob(self, group_rank: int) -> int:
        """Global rank of the member ``group_rank`` (taken modulo the size, so rank-1 and rank+1 work)."""
        return self.members[group_rank % self.size]

    def local(self, global_rank: int, what: str) -> int:
        """Group rank of the member whose global rank is ``global_rank`` (``what`` names it in errors)."""
        if global_rank not in self.members:
            raise ValueError(f"{what}={global_rank} is not in the group (its global ranks are "
                             f"{list(self.members)}); "
                             f"{what} is a global rank, as in torch.distributed.broadcast")
        return self.members.index(global_rank)

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size


def check_op(op: str, t: torch.Tensor) -> None:
    """Fail early, with what to do, on a non-tensor, an unknown op, or an average of integers."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    dtype = t.dtype
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"op='avg' needs a floating-point tensor, got {dtype}: an integer mean would be "
                        "rounded. Use op='sum' and divide (t // n or t / n) as you intend.")


def reduce_into(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """``acc = acc (op) other``, in place (``avg`` reduces as a sum; the caller divides once at the end)."""
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:
        acc.mul_(other)


def finish_avg(t: torch.Tensor, op: str, n: int) -> torch.Tensor:
    if op == "avg" and n > 1:
        t.div_(n)
    return t


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of ``t`` when it has one; otherwise a contiguous copy."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).contiguous()


def new_call() -> int:
    return next(_call_ids)


_scratch: dict[tuple, torch.Tensor] = {}


def scratch(numel: int, dtype: torch.dtype, device, slot: int = 0) -> torch.Tensor:
    """A reusable receive buffer of ``numel`` elements (grown on demand, kept between calls).

    Reusing it spares every call a fresh allocation and, for large messages, the page faults of
    touching new memory (NCCL keeps its own buffers for the same reason). ``free_scratch()`` drops them.
    """
    key = (slot, dtype, torch.device(device))
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def free_scratch() -> None:
    """Release the receive buffers the collectives keep between calls."""
    _scratch.clear()


SEGMENT_BYTES = 1 << 20
"""Large transfers travel as segments of about this many bytes, so that the reduction of one
segment overlaps the arrival of the next (gloo pipelines its own ring the same way)."""
MAX_SEGMENTS = 16


def _segments(t: torch.Tensor | None) -> int:
    """How many pieces a transfer of ``t`` is cut into; a function of its size only, so that the
    sender and the receiver of the same chunk agree without talking."""
    if t is None or t.is_cuda:
        return 1
    return max(1, min(MAX_SEGMENTS, (t.numel() * t.element_size()) // SEGMENT_BYTES))


def exchange(ring: Ring, op_name: str, *, send: torch.Tensor | None = None, dst: int | None = None,
             recv: torch.Tensor | None = None, src: int | None = None, reduce: tuple | None = None,
             step: int = 0, call: int = 0, size: int = 0, **info) -> None:
    """Send ``send`` to group rank ``dst`` while receiving into ``recv`` from group rank ``src``.

    Either side may be None (or empty, when both ends know it is): then only the other happens.
    ``reduce=(acc, other, op)``, tensors shaped like ``recv``, asks for ``acc (op)= other`` once the
    data has arrived, done segment by segment as each lands. Blocks until everything is complete,
    and records one comm event.
    """
    if send is not None and send.numel() == 0:
        send = None
    if recv is not None and recv.numel() == 0:
        recv = None
    tr = tracer()
    start = tr.now()
    dst_g = ring.glob(dst) if send is not None else None
    src_g = ring.glob(src) if recv is not None else None
    recv_parts = torch.tensor_split(recv, _segments(recv)) if recv is not None else ()
    send_parts = torch.tensor_split(send, _segments(send)) if send is not None else ()
    if dist.get_backend(ring.group) == "nccl":
        ops = [dist.P2POp(dist.isend, p, dst_g, ring.group) for p in send_parts]
        ops += [dist.P2POp(dist.irecv, p, src_g, ring.group) for p in recv_parts]
        works = dist.batch_isend_irecv(ops) if ops else []
        recv_works, send_works = works[len(send_parts):], works[:len(send_parts)]
    else:
        recv_works = [dist.irecv(p, src_g, group=ring.group) for p in recv_parts]
        send_works = [dist.isend(p, dst_g, group=ring.group) for p in send_parts]
    if reduce is not None and recv is not None:
        acc, other, op = reduce
        pieces = zip(torch.tensor_split(acc, len(recv_parts)), torch.tensor_split(other, len(recv_parts)))
        for w, (a, b) in zip(recv_works, pieces):
            w.wait()                            # (a gloo Work must be waited on exactly once)
            reduce_into(a, b, op)
    else:
        for w in recv_works:
            w.wait()
    for w in send_works:
        w.wait()
    tr.comm(op_name, start=start, end=tr.now(),
            sent=0 if send is None else send.numel() * send.element_size(),
            received=0 if recv is None else recv.numel() * recv.element_size(),
            peer=dst_g, src=src_g, step=step, call=call, size=size, world=ring.size, **info)


def ring_shift(t: torch.Tensor, group=None) -> torch.Tensor:
    """Send ``t`` to the next rank of the ring and return what the previous rank sent (same shape, dtype).

        r0 --t0--> r1 --t1--> r2 --t2--> r0         rank r returns t_(r-1)

    One exchange, recorded as op ``"ring_shift"``; every rank passes the same shape. Ring attention
    moves its K/V blocks (and their gradients) round the ring this way. One rank: returns ``t``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    ring = Ring.of(group)
    if ring.size == 1:
        return t
    send = flat_view(t)
    recv = torch.empty_like(send)
    exchange(ring, "ring_shift", send=send, dst=ring.next, recv=recv, src=ring.prev, step=0,
             call=new_call(), size=send.numel() * send.element_size())
    return recv.view(t.shape)


class PendingShift:
    """A `ring_shift` posted but not finished: the block travels while the caller computes.

        shift = start_ring_shift(kv)     # isend to the next rank, irecv from the previous: posted now
        ... compute on kv ...            # the transfer proceeds meanwhile (gloo's and NCCL's own threads)
        kv = shift.wait()                # what the previous rank sent

    The send buffer must not be written until ``wait`` returns. One comm event ``"ring_shift"``, recorded
    by ``wait``, spans the whole flight: from posting to completion.
    """

    def __init__(self, t: torch.Tensor, group=None):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        self.ring, self.shape, self.start = Ring.of(group), t.shape, tracer().now()
        self.send = flat_view(t)
        self.recv = torch.empty_like(self.send)
        self.works, self.done = [], None
        if self.ring.size > 1 and self.send.numel():
            prev, nxt, g = self.ring.glob(self.ring.prev), self.ring.glob(self.ring.next), self.ring.group
            if dist.get_backend(g) == "nccl":
                self.works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, self.recv, prev, g),
                                                     dist.P2POp(dist.isend, self.send, nxt, g)])
            else:
                self.works = [dist.irecv(self.recv, prev, group=g), dist.isend(self.send, nxt, group=g)]

    def wait(self) -> torch.Tensor:
        """Block until the block has arrived (and ours has left); returns it, shaped like the one sent.
        Waiting again returns the same block."""
        if self.done is not None:
            return self.done
        if not self.works:                                   # one rank, or nothing to move
            self.done = self.send.view(self.shape)
            return self.done
        for w in self.works:
            w.wait()
        ring, nbytes = self.ring, self.send.numel() * self.send.element_size()
        tr = tracer()
        tr.comm("ring_shift", start=self.start, end=tr.now(), sent=nbytes, received=nbytes,
                peer=ring.glob(ring.next), src=ring.glob(ring.prev), step=0, call=new_call(), size=nbytes,
                world=ring.size)
        self.works = []
        self.done = self.recv.view(self.shape)
        return self.done


def start_ring_shift(t: torch.Tensor, group=None) -> PendingShift:
    """`ring_shift` in two halves, to overlap it with compute: post now, ``.wait()`` for the result."""
    return PendingShift(t, group)
