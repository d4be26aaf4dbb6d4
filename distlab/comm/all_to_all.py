"""All-to-all by pairwise exchange: every rank sends a different block to every other rank.

The collective of expert parallelism (tokens to their experts' ranks and back) and of
DeepSpeed-Ulysses (sequence-sharded to head-sharded and back). Like ``all_to_all_single``, rank r
cuts its tensor along dim 0 into N row blocks, ``b[r][0] | b[r][1] | ... | b[r][N-1]``, sends block i
to rank i, and ends with the blocks addressed to it, in rank order:

    out on rank r = b[0][r] | b[1][r] | ... | b[N-1][r]          (a transpose of the N x N blocks)

The linear-shift pairwise exchange (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH", Sec. 4.4; works for any N): at step s = 1..N-1 rank r sends
block r+s to rank r+s and receives block r-s's message from rank r-s (mod N); its own block is a
local copy.

    N = 4, block b[r][i] written r->i

        step 1:  0->1  1->2  2->3  3->0          (everyone sends right by one)
        step 2:  0->2  1->3  2->0  3->1          (by two)
        step 3:  0->3  1->0  2->1  3->2          (by three)

Each step pairs every sender with exactly one receiver, so no link carries two messages at once.
Bytes per rank, with S the tensor (blocks equal): sends and receives (N-1)/N * S, in N-1 steps:

    T_all_to_all = (N-1) alpha + (N-1)/N * S / B

The fast path (``posted=True``, the default) keeps the same pairs but does not wait for one step
before starting the next (MPICH's medium-message all-to-all, Thakur et al. Sec. 4.4, Isend/Irecv all at
once). gloo moves a message only once both ends have posted it (a send announces itself, a receive
answers "ready", then the bytes flow, gloo/transport/tcp/pair.cc), so a blocking step costs a round
trip of notices before any byte moves; posted together, every block travels at once:

    post:  isend(b[r][r+1]) irecv(<- r-1)  isend(b[r][r+2]) irecv(<- r-2)  ...   gloo's own alltoall order
    copy:  b[r][r] into place                                                     (overlaps the transfers)
    wait:  step 1, step 2, ..., step N-1                                          (one trace event each)

A send is posted before its step's receive, as gloo's ``alltoall`` does (gloo/alltoall.cc): the peer's
"ready" then usually finds the send waiting and gloo's own thread writes the bytes, rather than the
caller's thread writing them inside ``isend`` while holding the connection's lock. The result is the
same bytes, and the trace still shows one event per step (from the posting to that step's completion).
``posted=False`` runs the textbook loop above, one blocking exchange per step, tested equal.

What remains between this and ``all_to_all_single`` on gloo is not bytes but a fixed cost per call:
2(N-1) posts and waits driven from the Python thread (torch runs the same loop as one C++ call in
gloo's worker thread). It shows in small messages and where ranks outnumber cores (every rank's
waiting and waking is then CPU time the others need); from about a megabyte the bytes dominate.
``benchmarks/all_to_all.py`` measures a bare isend/irecv loop beside both, the ceiling of any
send/recv implementation: this function sits at it.

Blocks may differ in size (``splits``, row counts; empty blocks too). A receiver cannot know them
in advance, so an uneven call first exchanges the row counts the same way (one int64 per block,
recorded as op ``"exchange_sizes"``), unless the caller passes ``out_splits``.
"""
from __future__ import annotations

import torch

from .p2p import Ring, exchange, exchange_sizes, post_exchanges


def all_to_all(t: torch.Tensor, splits: list[int] | None = None, group=None,
               out_splits: list[int] | None = None, posted: bool = True) -> torch.Tensor:
    """Row block i of ``t`` (dim 0) goes to group rank i; returns the blocks sent here, in rank order.

    ``splits``: N row counts summing to ``t.shape[0]`` (None: N equal blocks, the rows must divide by N).
    ``out_splits``: the rows each rank sends here, when the caller knows them (skips the size exchange).
    Every rank passes the same trailing shape and dtype, and either every rank passes ``splits`` or
    none does (with ``splits`` the row counts are exchanged first). N-1 steps; ``posted``: all steps
    posted at once (fast), or one after another (textbook).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError("all_to_all splits dim 0: pass a tensor with at least one dimension")
    ring = Ring.of(group)
    n, rows = ring.size, t.shape[0]
    even = splits is None                    # every rank passes splits, or none does
    splits = _check_splits(splits, n, rows, "splits", f"t.shape[0] = {rows}")
    x = t.contiguous()
    if out_splits is None:
        out_splits = splits if even else exchange_sizes(ring, splits, t.device)
    else:                                    # (exchanged counts were checked on the ranks that sent them)
        out_splits = _check_splits(out_splits, n, sum(map(int, out_splits)), "out_splits",
                                   "the rows received")
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))       # (sum(out_splits), *t.shape[1:])
    send_blocks = torch.split(x, splits)                             # send_blocks[i] -> rank i
    recv_blocks = torch.split(out, out_splits)                       # recv_blocks[j] <- rank j
    steps = posted_steps if posted else pairwise_steps
    steps(ring, send_blocks, recv_blocks)
    return out


def pairwise_steps(ring: Ring, send_blocks, recv_blocks) -> None:
    """My own block is a local copy; then N-1 steps: at step s send block r+s to rank r+s, receive into
    block r-s from rank r-s."""
    n, r = ring.size, ring.rank
    recv_blocks[r].copy_(send_blocks[r])
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        exchange(ring, send=send_blocks[dst].view(-1), dst=dst, recv=recv_blocks[src].view(-1), src=src)


def posted_steps(ring: Ring, send_blocks, recv_blocks) -> None:
    """The same N-1 steps, all in flight together: post step 1's send and receive, step 2's, ..., copy my
    own block while they travel, then wait step by step (each a comm event from its posting to its
    completion)."""
    n, r = ring.size, ring.rank
    peers = [((r + s) % n, (r - s) % n) for s in range(1, n)]          # step s: (send to, receive from)
    flights = post_exchanges(ring, [(send_blocks[dst], dst, recv_blocks[src], src)    # row blocks:
                                    for dst, src in peers])                            # contiguous
    recv_blocks[r].copy_(send_blocks[r])                               # overlaps the transfers
    for flight in flights:
        flight.wait_all()


def _check_splits(splits, n: int, rows: int, what: str, total: str) -> list[int]:
    if splits is None:
        if rows % n:
            raise ValueError(f"all_to_all over {n} ranks cannot cut {rows} rows into equal blocks: "
                             f"pass {what}=[rows for rank 0, ..., rows for rank {n - 1}]")
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or min(splits) < 0 or sum(splits) != rows:
        raise ValueError(f"{what} must list {n} non-negative row counts (one per rank) summing to "
                         f"{total}, got {splits}")
    return splits
