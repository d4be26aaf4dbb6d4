"""The textbook ring: reduce-scatter, all-gather, and all-reduce = the first followed by the second.

The bandwidth-optimal all-reduce of Patarasuk & Yuan (2009), popularised for deep learning by
Baidu (Gibiansky 2017) and used by NCCL and gloo. The message of S bytes is cut into N chunks
(``torch.tensor_split(t.flatten(), N)``); the ranks form a ring, each sending only to its right
neighbour and receiving only from its left one, so every link carries the same load.

    reduce-scatter, step s = 0..N-2:  rank r sends chunk (r-s-1) mod N, receives chunk (r-s-2) mod N
                                      and reduces it into its own copy. After N-1 steps, rank r holds
                                      chunk r reduced over all ranks.
    all-gather,     step s = 0..N-2:  rank r sends chunk (r-s) mod N, receives chunk (r-s-1) mod N.

    N = 3, reduce-scatter (chunk index moving on each arrow)

        step 0:  r0 --c2--> r1 --c0--> r2 --c1--> r0
        step 1:  r0 --c1--> r1 --c2--> r2 --c0--> r0      r0 ends with c0, r1 with c1, r2 with c2

Bytes per rank (exact, with ``|c_i|`` the size of chunk i from tensor_split):

    reduce-scatter sends S - |c_r|,        receives S - |c_(r-1)|
    all-gather     sends S - |c_(r+1)|,    receives S - |c_r|
    all-reduce     sends 2S - |c_r| - |c_(r+1)|  =  2 (N-1)/N * S  when N divides S

Cost (alpha-beta model, latency alpha per step, bandwidth B per link):

    T_ring_all_reduce = 2 (N-1) alpha + 2 (N-1)/N * S / B

which, unlike the naive reduce-then-broadcast, stops growing with N for large S.

Every step below is one ``p2p.ring_step``: post the send to the right and the receive from the left,
then wait for both (so the ring cannot deadlock). The step is recorded in the trace there, not here:
``dl.comm.ring_all_reduce`` runs this function inside a traced call (`traced.py`). ``ring_pipelined.py``
is the same ring made fast (chunks streamed in segments, receives posted ahead); the tests check
that both give bit-identical results.
"""
from __future__ import annotations

import torch

from .p2p import Ring, check_op, exchange_sizes, finish_avg, flat_view, ring_step


def ring_reduce_scatter(t: torch.Tensor, op: str = "sum", group=None, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Return chunk ``rank`` of ``torch.tensor_split(t.flatten(), N)``, reduced with ``op`` over ``group``.

    ``op``: sum, avg, max, min, prod. ``t`` is left unchanged (the ring works on a copy); every rank
    passes the same numel and dtype. ``out`` (contiguous, the chunk's size) receives the result.
    """
    check_op(op, t)
    ring = Ring.of(group)
    work = flat_view(t).clone()                          # (S,) reduced in place, chunk by chunk
    chunks = torch.tensor_split(work, ring.size)         # N views, |c_i| = S//N or S//N + 1
    out = check_out(out, chunks[ring.rank].numel(), t.dtype, t.device)
    reduce_scatter_steps(ring, chunks, op)
    out.view(-1).copy_(chunks[ring.rank])
    return out


def ring_all_gather(shard: torch.Tensor, group=None, sizes: list[int] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate every rank's flattened ``shard`` in rank order; every rank gets the whole.

    Shards may differ in size: ``sizes`` (element counts per group rank) when every rank knows them,
    else every rank first tells every other its own (`p2p.exchange_sizes`). ``out``: contiguous, sum(sizes).
    """
    ring = Ring.of(group)
    flat = flat_view(shard)                              # (|shard|,)
    sizes = gather_sizes(ring, flat, sizes)
    out = check_out(out, sum(sizes), shard.dtype, shard.device)
    slots = torch.split(out.view(-1), sizes)             # slot i will hold rank i's shard
    slots[ring.rank].copy_(flat)
    all_gather_steps(ring, slots)
    return out


def ring_all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """All-reduce ``t`` in place over ``group``: ring reduce-scatter, then ring all-gather; returns t.

    ``op``: sum, avg, max, min, prod (avg of integers raises). 2(N-1) steps, numbered on from the
    reduce-scatter into the all-gather; each rank sends 2S - |c_r| - |c_(r+1)| bytes.
    """
    check_op(op, t)
    ring = Ring.of(group)
    flat = flat_view(t)                                  # (S,) t's own storage when t is contiguous
    chunks = torch.tensor_split(flat, ring.size)
    reduce_scatter_steps(ring, chunks, op)               # chunks[r] is now reduced over all ranks
    all_gather_steps(ring, chunks)                       # ...and passed round to everyone
    if not t.is_contiguous():                            # we worked on a contiguous copy
        t.copy_(flat.view(t.shape))
    return t


def reduce_scatter_steps(ring: Ring, chunks, op: str) -> None:
    """N-1 steps, in place: send chunk r-s-1; receive chunk r-s-2 and reduce it into mine."""
    n, r = ring.size, ring.rank
    for s in range(n - 1):
        c_send, c_recv = (r - s - 1) % n, (r - s - 2) % n   # c_send is what I reduced at step s-1
        ring_step(ring, chunks, send=c_send, recv=c_recv, op=op)
    finish_avg(chunks[r], op, n)                         # avg: chunk r, now the sum, divided by N


def all_gather_steps(ring: Ring, slots) -> None:
    """N-1 steps in place, ``slots[r]`` holding mine: send slot r-s, receive slot r-s-1 where it belongs."""
    n, r = ring.size, ring.rank
    for s in range(n - 1):
        c_send, c_recv = (r - s) % n, (r - s - 1) % n
        ring_step(ring, slots, send=c_send, recv=c_recv)


def gather_sizes(ring: Ring, flat: torch.Tensor, sizes: list[int] | None) -> list[int]:
    """Every rank's shard length: ``sizes`` checked, or exchanged (one int64 to each rank) when None."""
    if sizes is None:
        sizes = exchange_sizes(ring, [flat.numel()] * ring.size, flat.device)
    sizes = [int(x) for x in sizes]
    if len(sizes) != ring.size or sizes[ring.rank] != flat.numel():
        raise ValueError(f"sizes must list {ring.size} element counts with sizes[{ring.rank}] == "
                         f"{flat.numel()} (this rank's shard), got {sizes}")
    return sizes


def check_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``out`` if it is a contiguous tensor of ``numel`` elements of ``dtype``; a new one if None."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.numel() != numel or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must hold {numel} elements of {dtype} (contiguous), got {out.numel()} "
                         f"of {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}")
    return out


def ring_bytes(numel: int, element_size: int, n: int, rank: int, op: str = "all_reduce") -> tuple[int, int]:
    """Exact (sent, received) bytes of one rank in a ring collective over ``numel`` elements.

    The chunk-rounded form of 2(N-1)/N * S (all-reduce) and (N-1)/N * S (reduce-scatter, all-gather
    of tensor_split chunks), used by tests and lessons to check the trace byte for byte.
    """
    if n == 1:
        return 0, 0
    q, rem = divmod(numel, n)
    c = [(q + 1 if i < rem else q) * element_size for i in range(n)]     # |c_i| in bytes
    total = sum(c)
    rs = (total - c[rank], total - c[(rank - 1) % n])
    ag = (total - c[(rank + 1) % n], total - c[rank])
    table = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": (rs[0] + ag[0], rs[1] + ag[1])}
    if op not in table:
        raise ValueError(f"op must be one of {sorted(table)}, got {op!r}")
    return table[op]
