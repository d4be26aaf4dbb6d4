"""The same ring as ``ring.py``, made fast: each step cut into segments and streamed, receives posted ahead.

Read ``ring.py`` first: the chunk arithmetic, the bytes and the cost are the same here, and the
tests check that both rings give bit-identical results (every element is reduced in the same order).

Done literally (send the chunk, wait, reduce, next step) the link idles while the rank reduces, and
every step pays a full round trip. As gloo's own ring does (gloo/allreduce.cc), each chunk is cut
into K segments and the steps become one stream of (N-1)K or 2(N-1)K items,
item i = (step i // K, segment i % K), finished strictly in order:

    receives:  up to WINDOW posted ahead of the item being finished, so the left neighbour's data
               is expected before it arrives (gloo otherwise holds it back until it is asked for)
    sends:     posted the moment their data is final: all of step 0 at once (this rank's own data),
               segment j of step s+1 as soon as item (s, j) has been received and reduced
    finish i:  wait for receive i, reduce it, wait for send i

    K = 2, WINDOW = 4:   item   (0,0) (0,1) (1,0) (1,1) (2,0) ...
                         recv    post  post  post  post        <- posted before item (0,0) is finished
                         send    post  post   .     .          <- (1,j) posted once (0,j) is reduced

so a segment is on the wire while the previous one is being reduced, and no rank waits a round
trip per segment. Measured on 2 shared CPU cores, a window of 4 instead of 1 raised the median
bus bandwidth from 4 MB up from about 0.8x to about 0.93x of gloo's own all-reduce.

Why an early receive cannot overwrite data still being sent or reduced (receive i is posted
once item i - WINDOW is finished):
  * in-place receives land in WINDOW rotating scratch segments; item i uses the slot of item
    i - WINDOW, which is finished;
  * an all-gather's receive lands in its final place, written once. In an all-reduce that place
    held a partial sum this rank sent on during the reduce-scatter; the reduced chunk coming back
    into it was completed from that very partial, after it had travelled on around the ring:
    causality, not bookkeeping, keeps it safe (for N = 2 too);
  * an out-of-place reduce-scatter's partial sums travel through R rotating buffers: the buffer
    received into at step s is sent on at step s+1 and received into again at step s+R. No
    causality helps here (the data arriving at step s+R never passed through this rank), so
    R = 1 + ceil((WINDOW + 1) / K) buffers make sure item (s+1, j+1) is finished before (s+R, j) is
    posted (j+1: chunks differ by up to one element, so segment j of one step may reach one element
    into segment j+1 of another).

Each step's pieces are posted and waited for through one `p2p.Flight`, which records the step as
one comm event (its first post to its last completion) with the bytes of its whole chunk, so the
trace reads exactly as the textbook steps do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .p2p import Flight, Ring, check_op, flat_view, reduce_into, scratch
from .ring import check_out, gather_sizes

SEGMENT_BYTES = 1 << 22
"""Target segment size. Small enough to overlap reduction with transfer, large enough that the
per-segment cost (a few tens of microseconds of Python and gloo bookkeeping) stays small."""
WINDOW = 4
"""Receives posted ahead of the one being waited on (and in-place scratch segments kept)."""


def pipelined_reduce_scatter(t: torch.Tensor, op: str = "sum", group=None, out: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """``ring_reduce_scatter``, pipelined: chunk ``rank`` of ``tensor_split(t.flatten(), N)``, reduced.

    ``t`` is left unchanged. The partial results travel through 1 + ceil((WINDOW+1) / K) rotating reusable
    chunk-sized buffers (so that a receive posted early never lands in one still being sent); the
    last step lands in ``out`` (contiguous, the chunk's size; allocated when None).
    """
    check_op(op, t)
    ring = Ring.of(group)
    flat = flat_view(t)                                 # (S,)
    n, r = ring.size, ring.rank
    chunks = torch.tensor_split(flat, n)
    out = check_out(out, chunks[r].numel(), t.dtype, t.device)
    out_flat = out.view(-1)
    if n == 1:
        out_flat.copy_(flat)
        return out
    width = chunks[0].numel()                           # the largest chunk of tensor_split
    rotating = 1 + -(-(WINDOW + 1) // _segments(width, flat))   # R: see the module docstring
    first = WINDOW                                      # slots 0..WINDOW-1 are the stream's own
    buffers = [scratch(width, t.dtype, t.device, first + i) for i in range(min(rotating, n - 2))]
    steps, sending = [], chunks[(r - 1) % n]            # step 0 sends my own data of chunk r-1
    for s in range(n - 1):
        c_in = (r - s - 2) % n
        incoming = out_flat if s == n - 2 else buffers[s % rotating][: chunks[c_in].numel()]
        steps.append(Step(send=sending, recv=incoming, local=chunks[c_in],   # arriving partial (op)= mine
                          divide=n if op == "avg" and s == n - 2 else 0,
                          chunks=((r - s - 1) % n, c_in)))
        sending = incoming                              # ...and pass it on at the next step
    run_ring(ring, steps, op)
    return out


def pipelined_all_gather(shard: torch.Tensor, group=None, sizes: list[int] | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """``ring_all_gather``, pipelined: every rank's flattened ``shard`` in rank order (sizes may differ).

    ``sizes`` and ``out`` as in ``ring_all_gather``; each rank receives straight into ``out``.
    """
    ring = Ring.of(group)
    flat = flat_view(shard)
    sizes = gather_sizes(ring, flat, sizes)
    out = check_out(out, sum(sizes), shard.dtype, shard.device)
    slots = torch.split(out.view(-1), sizes)            # slot i will hold rank i's shard
    slots[ring.rank].copy_(flat)
    run_ring(ring, _gather_steps(slots, ring.rank, ring.size), "sum")
    return out


def pipelined_all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """``ring_all_reduce``, pipelined: in place over ``group`` (reduce-scatter then all-gather); returns t.

    The reduction happens inside ``t``'s own storage (arriving segments land in a small reusable
    buffer), then the all-gather receives each reduced chunk straight into place.
    """
    check_op(op, t)
    ring = Ring.of(group)
    n, r = ring.size, ring.rank
    if n == 1:
        return t
    flat = flat_view(t)                                 # (S,) t's own storage when t is contiguous
    chunks = torch.tensor_split(flat, n)
    steps = []
    for s in range(n - 1):                              # reduce-scatter, in place
        c_out, c_in = (r - s - 1) % n, (r - s - 2) % n
        steps.append(Step(send=chunks[c_out], into=chunks[c_in],
                          divide=n if op == "avg" and s == n - 2 else 0,
                          chunks=(c_out, c_in)))
    steps += _gather_steps(chunks, r, n)                # then pass the reduced chunks around
    run_ring(ring, steps, op)
    if not t.is_contiguous():                           # we worked on a contiguous copy
        t.copy_(flat.view(t.shape))
    return t


def _gather_steps(slots, r: int, n: int) -> list[Step]:
    """All-gather: ``slots[r]`` holds my piece; at step s send slot r-s, receive slot r-s-1 in place."""
    return [Step(send=slots[(r - s) % n], recv=slots[(r - s - 1) % n], chunks=((r - s) % n, (r - s - 1) % n))
            for s in range(n - 1)]


@dataclass
class Step:
    """One ring step on this rank: send ``send``; receive a chunk the size of ``target``.

    Where the received data goes:
      * ``recv`` given, ``local`` None:  straight into ``recv`` (all-gather)
      * ``recv`` given, ``local`` given: into ``recv``, then ``recv op= local`` (out-of-place reduce)
      * ``recv`` None, ``into`` given:   into a scratch segment, then ``into op= scratch`` (in place)
    ``divide`` > 0 divides the reduced result by it (the mean of op="avg") as each segment lands.
    ``chunks``: the indices of the chunk sent and of the chunk received, as in ``ring.py``.
    """

    send: torch.Tensor
    recv: torch.Tensor | None = None
    local: torch.Tensor | None = None
    into: torch.Tensor | None = None
    divide: int = 0
    chunks: tuple[int, int] = (0, 0)

    @property
    def target(self) -> torch.Tensor:
        return self.recv if self.recv is not None else self.into

    @property
    def reduces(self) -> bool:
        return self.recv is None or self.local is not None


def run_ring(ring: Ring, steps: list[Step], op: str) -> None:
    """Run ``steps`` around the ring (send to ``ring.next``, receive from ``ring.prev``), streamed.

    Items (step, segment) are finished in order. Up to ``WINDOW`` receives are posted ahead of the
    one being finished, and every send is posted as soon as its data is final (step 0 sends this
    rank's own data at once; segment j of step s+1 waits for item (s, j) to be reduced).
    """
    if not steps:
        return
    stream = _Stream(ring, steps, op)
    k, total = stream.k, stream.total
    posted_recv = posted_send = 0
    for done in range(total):                           # items 0 .. done-1 are finished
        while posted_recv < min(total, done + stream.window):
            stream.post_recv(posted_recv)
            posted_recv += 1
        while posted_send < total and posted_send - k < done:   # its data (item - k) is final
            stream.post_send(posted_send)
            posted_send += 1
        stream.finish(done)


class _Stream:
    """The items of one ``run_ring`` call, and the receives and sends posted for them but not yet finished."""

    def __init__(self, ring: Ring, steps: list[Step], op: str):
        self.ring, self.steps, self.op = ring, steps, op
        width = max(max(s.send.numel(), s.target.numel()) for s in steps)
        example = steps[0].send
        self.k = _segments(width, example)
        self.total = len(steps) * self.k
        self.window = min(WINDOW, self.total)
        self.parts = [_split(s, self.k) for s in steps]
        self.slots = [scratch(-(-width // self.k), example.dtype, example.device, slot)
                      for slot in range(self.window)] if any(s.recv is None for s in steps) else []
        self.flights: dict[int, Flight] = {}            # step -> its sends and receives (2k pieces)
        self.recvs: dict[int, tuple] = {}               # item -> (receive buffer, Work or None)
        self.sends: dict[int, object] = {}              # item -> Work or None

    def flight(self, s: int) -> Flight:
        """Step s's flight, begun by the first of its pieces to be posted."""
        if s not in self.flights:
            step = self.steps[s]
            self.flights[s] = Flight(self.ring, pieces=2 * self.k, chunks=step.chunks, reduce=step.reduces)
        return self.flights[s]

    def post_recv(self, i: int) -> None:
        s, j = divmod(i, self.k)
        _, recv, into, _ = self.parts[s][j]
        if recv is None:                                # in place: land in a scratch segment, free since
            recv = self.slots[i % self.window][: into.numel()]   # item i - window (its last user) finished
        self.recvs[i] = (recv, self.flight(s).irecv(recv, self.ring.prev))

    def post_send(self, i: int) -> None:
        s, j = divmod(i, self.k)
        self.sends[i] = self.flight(s).isend(self.parts[s][j][0], self.ring.next)

    def finish(self, i: int) -> None:
        """Wait for item i's receive, reduce it where it belongs, wait for its send (the step's last
        piece completes its flight)."""
        s, j = divmod(i, self.k)
        flight = self.flights[s]
        recv, work = self.recvs.pop(i)
        flight.wait(work)
        step, (_, _, into, local) = self.steps[s], self.parts[s][j]
        result = None
        if step.recv is None:
            reduce_into(into, recv, self.op)
            result = into
        elif local is not None:
            reduce_into(recv, local, self.op)
            result = recv
        if step.divide and result is not None:
            result.div_(step.divide)
        flight.wait(self.sends.pop(i))
        if j == self.k - 1:
            del self.flights[s]


def _segments(numel: int, example: torch.Tensor) -> int:
    """K, the segments per step for chunks of up to ``numel`` elements (1 on GPUs, where NCCL pipelines)."""
    return 1 if example.is_cuda else max(1, -(-numel * example.element_size() // SEGMENT_BYTES))


def _split(step: Step, k: int) -> list[tuple]:
    """Per segment: (send piece, receive piece or None, in-place target piece, local piece)."""
    send = torch.tensor_split(step.send, k)
    target = torch.tensor_split(step.target, k)
    recv = target if step.recv is not None else [None] * k
    into = target if step.recv is None else [None] * k
    local = torch.tensor_split(step.local, k) if step.local is not None else [None] * k
    return [(send[j], recv[j], into[j], local[j]) for j in range(k)]
