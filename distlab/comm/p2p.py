"""The primitives every collective here is built from, and the one place dl.comm writes the trace.

``exchange(ring, send=..., dst=..., recv=..., src=...)`` posts the send and the receive *together* and
waits for both. Posting both before waiting is what keeps a ring from deadlocking: if every rank
first did a blocking send to its right neighbour, nobody would be receiving. (Under NCCL the pair
goes through ``batch_isend_irecv`` so it lands in one NCCL group; under gloo plain
``isend``/``irecv`` do the same job with less Python overhead.) Three more are built beside it:

    ring_step(ring, chunks, send=i, recv=j, op)   chunk i to the right, chunk j in from the left
                                                  (reduced into mine with op, or replacing it)
    post_exchanges(ring, [(send, dst, recv, src), ...])   every pair posted at once, waited later
    Flight(ring, pieces)                           one step posted piece by piece (the fast ring)
    exchange_sizes(ring, counts, device)           what an uneven collective tells every rank first

Tracing attaches here, and only here: the algorithms pass data and addresses (which rank, which
chunk), never labels. Each step records one comm event in ``dl.tracer()``, filled in from the
`call` the public entry point (`distlab.comm.traced`) opened around the algorithm:

    name      the collective (``"ring_all_reduce"``, ``"broadcast"``, ...): the call's
    sent      bytes sent in this step         received  bytes received in this step
    peer      global rank sent to (None if nothing was sent)
    src       global rank received from (None if nothing was received)
    step      this step's index in the call, counted as the rank takes them (0, 1, 2, ...)
    call      a per-process counter shared by every event of one collective call
    size      bytes of the whole message the collective was asked to move
    world     ranks taking part
    + for a ``ring_step``: ``send_chunk``, ``recv_chunk`` and ``phase`` (``"reduce_scatter"`` when the
      arriving chunk is reduced into mine, ``"all_gather"`` when it replaces it)
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import current_run, group_members, group_rank, tracer
from .host import post

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

    def global_rank(self, group_rank: int) -> int:
        """Global rank of the member ``group_rank`` (taken modulo the size, so rank-1 and rank+1 work)."""
        return self.members[group_rank % self.size]

    def group_rank_of(self, global_rank: int, what: str) -> int:
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


def scratch(numel: int, dtype: torch.dtype, device, slot: int = 0) -> torch.Tensor:
    """A reusable receive buffer of ``numel`` elements (grown on demand, kept between calls).

    Reusing it spares every call a fresh allocation and, for large messages, the page faults of
    touching new memory (NCCL keeps its own buffers for the same reason). They belong to the rank's run
    (`runtime.current_run`: dropped when it ends); ``free_scratch()`` drops them sooner.
    """
    kept, key = current_run().comm_buffers, (slot, dtype, torch.device(device))
    buf = kept.get(key)
    if buf is None or buf.numel() < numel:
        buf = kept[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def free_scratch() -> None:
    """Release the receive buffers the collectives keep between calls."""
    current_run().comm_buffers.clear()


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


# -- the primitives -----------------------------------------------------------------------------
def exchange(ring: Ring, *, send: torch.Tensor | None = None, dst: int | None = None,
             recv: torch.Tensor | None = None, src: int | None = None, reduce: tuple | None = None) -> None:
    """Send ``send`` to group rank ``dst`` while receiving into ``recv`` from group rank ``src``.

    Either side may be None (or empty, when both ends know it is): then only the other happens.
    ``reduce=(acc, other, op)``, tensors shaped like ``recv``, asks for ``acc (op)= other`` once the
    data has arrived, done segment by segment as each lands. Blocks until everything is complete,
    and records one comm event.
    """
    _exchange(ring, send, dst, recv, src, reduce, {})


def ring_step(ring: Ring, chunks, send: int, recv: int, op: str | None = None) -> None:
    """One step round the ring: ``chunks[send]`` goes to the right neighbour while ``chunks[recv]``
    comes in from the left, reduced into mine with ``op`` (reduce-scatter) or replacing it (``op``
    None: all-gather). The event records both chunk indices and which of the two phases it was."""
    mine = chunks[recv]
    info = {"phase": "all_gather" if op is None else "reduce_scatter", "send_chunk": send, "recv_chunk": recv}
    if op is None:
        _exchange(ring, chunks[send], ring.next, mine, ring.prev, None, info)
    else:
        incoming = scratch(mine.numel(), mine.dtype, mine.device)
        _exchange(ring, chunks[send], ring.next, incoming, ring.prev, (mine, incoming, op), info)


def _exchange(ring: Ring, send, dst, recv, src, reduce, info: dict) -> None:
    if send is not None and send.numel() == 0:
        send = None
    if recv is not None and recv.numel() == 0:
        recv = None
    step = _step(info)
    dst_g = ring.global_rank(dst) if send is not None else None
    src_g = ring.global_rank(src) if recv is not None else None
    recv_parts = torch.tensor_split(recv, _segments(recv)) if recv is not None else ()
    send_parts = torch.tensor_split(send, _segments(send)) if send is not None else ()
    if dist.get_backend(ring.group) == "nccl":
        ops = [dist.P2POp(dist.isend, p, dst_g, ring.group) for p in send_parts]
        ops += [dist.P2POp(dist.irecv, p, src_g, ring.group) for p in recv_parts]
        works = dist.batch_isend_irecv(ops) if ops else []
        recv_works, send_works = works[len(send_parts):], works[:len(send_parts)]
    else:
        recv_works = [post(False, p, src_g, ring.group) for p in recv_parts]   # GPU tensors on gloo: via
        send_works = [post(True, p, dst_g, ring.group) for p in send_parts]    # host memory (`host`)
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
    if step is not None:
        step.done(ring, nbytes(send), nbytes(recv), dst_g, src_g)


def exchange_sizes(ring: Ring, counts: list[int], device) -> list[int]:
    """What every rank must know before an uneven collective: ``counts[i]`` goes to group rank i, and
    ``result[j]`` is the count rank j sent here (``result[rank] = counts[rank]``). N-1 pairwise steps
    of one int64 each, recorded as a call of its own, ``"exchange_sizes"``."""
    n, r = ring.size, ring.rank
    mine = torch.tensor(counts, dtype=torch.int64, device=device)
    theirs = mine.clone()
    with call("exchange_sizes", mine):
        for s in range(1, n):
            dst, src = (r + s) % n, (r - s) % n
            exchange(ring, send=mine[dst:dst + 1], dst=dst, recv=theirs[src:src + 1], src=src)
    return theirs.tolist()


class Flight:
    """One step whose transfers are posted ahead and waited for later, piece by piece.

    ``pieces``: how many sends and receives the step is made of (empty ones included: they post
    nothing and their wait is free). Posting goes through ``isend``/``irecv`` here; once the last
    piece has been waited for, the step is recorded as one comm event, from its first post to its
    last completion, with the bytes of all its pieces. ``chunks=(sent, received)``: the chunk indices
    of a ring step; ``reduce``: whether the arriving data is reduced (as in `ring_step`)."""

    def __init__(self, ring: Ring, pieces: int, chunks: tuple[int, int] | None = None, reduce: bool = False):
        info = {} if chunks is None else {"phase": "reduce_scatter" if reduce else "all_gather",
                                          "send_chunk": chunks[0], "recv_chunk": chunks[1]}
        self.ring, self.left, self.step, self.works = ring, pieces, _step(info), []
        self.sent = self.received = 0
        self.dst = self.src = None
        self.nccl = dist.get_backend(ring.group) == "nccl"

    def isend(self, t: torch.Tensor, dst: int):
        """Post ``t`` to group rank ``dst``; returns the Work (None for an empty tensor)."""
        if not t.numel():
            return None
        self.sent, self.dst = self.sent + nbytes(t), self.ring.global_rank(dst)
        return self._posted(self._post(True, t, self.dst))

    def irecv(self, t: torch.Tensor, src: int):
        """Post the receive of ``t`` from group rank ``src``; returns the Work (None for an empty tensor)."""
        if not t.numel():
            return None
        self.received, self.src = self.received + nbytes(t), self.ring.global_rank(src)
        return self._posted(self._post(False, t, self.src))

    def _post(self, send: bool, t: torch.Tensor, peer: int):
        if self.nccl:
            fn = dist.isend if send else dist.irecv
            return dist.batch_isend_irecv([dist.P2POp(fn, t, peer, self.ring.group)])[0]
        return post(send, t, peer, self.ring.group)

    def _posted(self, work):
        self.works.append(work)
        return work

    def wait(self, work) -> None:
        """Wait for one piece (``work`` from `isend`/`irecv`, or None); the last one records the step."""
        if work is not None:
            work.wait()                         # (a gloo Work must be waited on exactly once)
        self.left -= 1
        if self.left == 0 and self.step is not None:
            self.step.done(self.ring, self.sent, self.received, self.dst, self.src)

    def wait_all(self) -> None:
        """Wait for every piece, in the order posted (empty ones, never posted, count as done)."""
        works, self.works = self.works, []
        for w in works:
            self.wait(w)
        while self.left > 0:
            self.wait(None)


def post_exchanges(ring: Ring, pairs) -> list[Flight]:
    """Post every ``(send, dst, recv, src)`` pair at once, each pair's send before its receive (gloo's
    own all-to-all order), as one batch under NCCL; returns one `Flight` per pair, to ``wait_all``.
    Tensors must be contiguous; empty ones post nothing (both ends know their size)."""
    flights = [Flight(ring, pieces=2) for _ in pairs]
    posts = []
    for f, (send, dst, recv, src) in zip(flights, pairs):
        posts += [(f, dist.isend, send, dst), (f, dist.irecv, recv, src)]
    live = [(f, fn, t, ring.global_rank(peer)) for f, fn, t, peer in posts if t.numel()]
    if live and dist.get_backend(ring.group) == "nccl":
        works = dist.batch_isend_irecv([dist.P2POp(fn, t, peer, ring.group) for _, fn, t, peer in live])
    else:
        works = [fn(t, peer, group=ring.group) for _, fn, t, peer in live]
    for (f, fn, t, peer), work in zip(live, works):
        if fn is dist.isend:
            f.sent, f.dst = nbytes(t), peer
        else:
            f.received, f.src = nbytes(t), peer
        f.works.append(work)
    return flights


# -- where the events come from: the call an entry point opened around the algorithm ---------------
class call:
    """``with call("ring_all_reduce", t): ...``: every step taken inside belongs to one call of that
    collective. Opened by the public entry points (`distlab.comm.traced`), never by an algorithm.

    ``message``: the tensor whose bytes are the call's ``size`` (it may be set on the object before
    the block ends, e.g. to an all-gather's output). Events wait in the call until it ends, then go
    to ``dl.tracer()``; a step still in flight when it ends (`start_ring_shift`) is written when done.
    """

    _open = threading.local()                   # each thread its own stack of open calls

    def __init__(self, name: str, message: torch.Tensor | None = None):
        self.name, self.message, self.id, self.steps = name, message, next(_call_ids), 0
        self.events: list | None = []

    def __enter__(self) -> "call":
        self._stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._stack().pop()
        events, self.events = self.events, None
        for event in events:
            self._write(*event)

    @classmethod
    def _stack(cls) -> list:
        if not hasattr(cls._open, "calls"):
            cls._open.calls = []
        return cls._open.calls

    @classmethod
    def current(cls) -> "call":
        """The innermost open call (a call of its own, ``"exchange"``, for a primitive used bare)."""
        stack = cls._stack()
        if stack:
            return stack[-1]
        bare = cls("exchange")
        bare.events = None
        return bare

    def _write(self, start: float, end: float, step: "_Step", moved: tuple) -> None:
        sent, received, dst, src, world = moved
        tracer().comm(self.name, start=start, end=end, sent=sent, received=received, peer=dst, src=src,
                      step=step.index, call=self.id, size=nbytes(self.message), world=world, **step.info)


@dataclass
class _Step:
    """A step being taken: which call it belongs to, its index there, when it began, what it is."""

    owner: call
    index: int
    start: float
    info: dict

    def done(self, ring: Ring, sent: int, received: int, dst: int | None, src: int | None) -> None:
        event = (self.start, tracer().now(), self, (sent, received, dst, src, ring.size))
        if self.owner.events is not None:
            self.owner.events.append(event)
        else:
            self.owner._write(*event)


def _step(info: dict) -> _Step | None:
    """Begin a step of the current call (None when the trace is off: nothing to count)."""
    tr = tracer()
    if not tr.enabled:
        return None
    owner = call.current()
    owner.steps += 1
    return _Step(owner, owner.steps - 1, tr.now(), info)


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
