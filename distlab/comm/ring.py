"""Ring reduce-scatter, ring all-gather, and ring all-reduce = the first followed by the second.

The bandwidth-optimal all-reduce of Patarasuk & Yuan (2009), popularised for deep learning by
Baidu (Gibiansky 2017) and used by NCCL and gloo. The message of S bytes is cut into N chunks
(``torch.tensor_split(t.flatten(), N)``); the ranks form a ring, each sending only to its right
neighbour and receiving only from its left one, so every link carries the same load.

    reduce-scatter, step s = 0..N-2:  rank r sends chunk (r-s-1) mod N, receives chunk (r-s-2) mod N
                                      and reduces it into its own copy. After N-1 steps, rank r holds
                                      chunk r reduced over all ranks.
    all-gather,     step s = 0..N-2:  rank r sends chunk (r-s) mod N, receives chunk (r-s-1) mod N.

    N = 3, reduce-scatter (chunk index moving on each arrow; [c] = partial sums so far)

        step 0:  r0 --c2--> r1 --c0--> r2 --c1--> r0
        step 1:  r0 --c1--> r1 --c2--> r2 --c0--> r0      r0 ends with c0, r1 with c1, r2 with c2

Bytes per rank (exact, with ``|c_i|`` the size of chunk i from tensor_split):

    reduce-scatter sends S - |c_r|,        receives S - |c_(r-1)|
    all-gather     sends S - |c_(r+1)|,    receives S - |c_r|
    all-reduce     sends 2S - |c_r| - |c_(r+1)|  =  2 (N-1)/N * S  when N divides S

Cost (alpha-beta model, latency alpha per step, bandwidth B per link):

    T_ring_all_reduce = 2 (N-1) alpha + 2 (N-1)/N * S / B

which, unlike the naive reduce-then-broadcast, stops growing with N for large S.
"""
from __future__ import annotations

import torch

from .p2p import Ring, check_op, flat_view, new_call, scratch
from .ring_pipelined import WINDOW, Step, run_ring


def _chunk_sizes(numel: int, n: int) -> list[int]:
    """Element counts of ``torch.tensor_split(x, n)`` for ``x.numel() == numel``."""
    q, rem = divmod(numel, n)
    return [q + 1 if i < rem else q for i in range(n)]


def ring_reduce_scatter(t: torch.Tensor, op: str = "sum", group=None, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Reduce ``t`` over the ranks of ``group`` and return this rank's chunk of the result.

    Returns chunk ``rank`` of ``torch.tensor_split(t.flatten(), N)`` reduced with ``op``
    (sum, avg, max, min, prod). ``t`` is left unchanged; every rank must pass the same numel and dtype.
    ``out`` (contiguous, the chunk's size) receives the result without allocating. N-1 steps; the
    partial results travel through three rotating reusable chunk-sized buffers (so that a receive
    posted early never lands in one still being sent); the last step lands in ``out``.
    """
    check_op(op, t)
    ring = Ring.of(group)
    flat = flat_view(t)
    n, r = ring.size, ring.rank
    chunks = torch.tensor_split(flat, n)
    if out is None:
        out = torch.empty_like(chunks[r])
    elif out.numel() != chunks[r].numel() or out.dtype != t.dtype or not out.is_contiguous():
        raise ValueError(f"out must hold {chunks[r].numel()} elements of {t.dtype} (contiguous), "
                         f"got {out.numel()} of {out.dtype}")
    out_flat = out.view(-1)
    if n == 1:
        out_flat.copy_(flat)
        return out
    width = max(c.numel() for c in chunks)
    first = WINDOW                                    # slots 0..WINDOW-1 are run_ring's own
    buffers = [scratch(width, t.dtype, t.device, first + i) for i in range(min(3, n - 2))]
    steps, sending = [], chunks[(r - 1) % n]          # step 0 sends my own data of chunk r-1
    for s in range(n - 1):
        c_in = (r - s - 2) % n
        incoming = out_flat if s == n - 2 else buffers[s % 3][: chunks[c_in].numel()]
        steps.append(Step(send=sending, recv=incoming, local=chunks[c_in],   # arriving partial (op)= mine
                          divide=n if op == "avg" and s == n - 2 else 0,
                          info=dict(phase="reduce_scatter", send_chunk=(r - s - 1) % n, recv_chunk=c_in)))
        sending = incoming                              # ...and pass it on at the next step
    run_ring(ring, "ring_reduce_scatter", steps, op, call=new_call(), size=_nbytes(flat))
    return out


def ring_all_gather(shard: torch.Tensor, group=None, sizes: list[int] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate every rank's flattened ``shard`` in rank order; every rank gets the whole.

    Shards may differ in size. Pass ``sizes`` (element counts per group rank) when every rank
    knows them; otherwise they are exchanged first by a ring all-gather of one int64 per rank,
    recorded as op ``"exchange_sizes"`` (N-1 extra small steps). ``out`` (contiguous, sum of sizes)
    receives the result without allocating. N-1 steps, each rank receiving straight into ``out``.
    """
    if not isinstance(shard, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(shard).__name__}")
    ring = Ring.of(group)
    flat = flat_view(shard)
    n, r = ring.size, ring.rank
    if sizes is None:
        sizes = _exchange_sizes(ring, flat.numel(), shard.device) if n > 1 else [flat.numel()]
    sizes = [int(x) for x in sizes]
    if len(sizes) != n or sizes[r] != flat.numel():
        raise ValueError(f"sizes must list {n} element counts with sizes[{r}] == {flat.numel()} "
                         f"(this rank's shard), got {sizes}")
    total = sum(sizes)
    if out is None:
        out = torch.empty(total, dtype=shard.dtype, device=shard.device)
    elif out.numel() != total or out.dtype != shard.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with {total} elements of {shard.dtype}, "
                         f"got {out.numel()} of {out.dtype}")
    slots = torch.split(out.view(-1), sizes)
    slots[r].copy_(flat)
    if n > 1:
        run_ring(ring, "ring_all_gather", _gather_steps(slots, r, n), "sum", call=new_call(),
                 size=total * out.element_size())
    return out


def ring_all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """All-reduce ``t`` in place over ``group`` with the ring (reduce-scatter then all-gather); returns t.

    ``op``: sum, avg, max, min, prod (avg on integer tensors raises: say how to round).
    2(N-1) steps; each rank sends ``2S - |c_r| - |c_(r+1)|`` bytes (= 2(N-1)/N * S when N divides S).
    The reduction happens inside ``t``'s own storage (arriving segments land in a small reusable
    buffer), then the all-gather receives each reduced chunk straight into place.
    """
    check_op(op, t)
    ring = Ring.of(group)
    n, r = ring.size, ring.rank
    if n == 1:
        return t
    flat = flat_view(t)
    chunks = torch.tensor_split(flat, n)
    steps = []
    for s in range(n - 1):                                       # reduce-scatter, in place
        c_out, c_in = (r - s - 1) % n, (r - s - 2) % n
        steps.append(Step(send=chunks[c_out], into=chunks[c_in], divide=n if op == "avg" and s == n - 2 else 0,
                          info=dict(phase="reduce_scatter", send_chunk=c_out, recv_chunk=c_in)))
    steps += _gather_steps(chunks, r, n)                         # then pass the reduced chunks around
    run_ring(ring, "ring_all_reduce", steps, op, call=new_call(), size=_nbytes(flat))
    if not t.is_contiguous():                                    # we worked on a contiguous copy
        t.copy_(flat.view(t.shape))
    return t


def _gather_steps(slots, r: int, n: int) -> list[Step]:
    """All-gather: ``slots[r]`` holds my piece; at step s send slot r-s, receive slot r-s-1 in place."""
    return [Step(send=slots[(r - s) % n], recv=slots[(r - s - 1) % n],
                 info=dict(phase="all_gather", send_chunk=(r - s) % n, recv_chunk=(r - s - 1) % n))
            for s in range(n - 1)]


def _exchange_sizes(ring: Ring, numel: int, device) -> list[int]:
    counts = torch.zeros(ring.size, dtype=torch.int64, device=device)
    counts[ring.rank] = numel
    run_ring(ring, "exchange_sizes", _gather_steps(torch.split(counts, 1), ring.rank, ring.size), "sum",
             call=new_call(), size=counts.numel() * 8)
    return counts.tolist()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_bytes(numel: int, element_size: int, n: int, rank: int, op: str = "all_reduce") -> tuple[int, int]:
    """Exact (sent, received) bytes of one rank in a ring collective over ``numel`` elements.

    The chunk-rounded form of 2(N-1)/N * S (all-reduce) and (N-1)/N * S (reduce-scatter, all-gather
    of tensor_split chunks), used by tests and lessons to check the trace byte for byte.
    """
    if n == 1:
        return 0, 0
    c = [x * element_size for x in _chunk_sizes(numel, n)]
    total = sum(c)
    rs = (total - c[rank], total - c[(rank - 1) % n])
    ag = (total - c[(rank + 1) % n], total - c[rank])
    table = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": (rs[0] + ag[0], rs[1] + ag[1])}
    if op not in table:
        raise ValueError(f"op must be one of {sorted(table)}, got {op!r}")
    return table[op]
