"""The naive all-reduce: everyone sends to a root, the root reduces and sends the result back.

    reduce:     1 -> 0, 2 -> 0, ..., N-1 -> 0      root receives (N-1) S bytes
    broadcast:  0 -> 1, 0 -> 2, ..., 0 -> N-1      root sends    (N-1) S bytes

Every byte passes through the root's link, so (alpha-beta model)

    T_naive = 2 (N-1) (alpha + S / B)

grows linearly with N, while the ring's 2 (N-1) alpha + 2 (N-1)/N * S / B does not: for large
messages the ring is about N times faster. It is here only to be measured beside the ring.
"""
from __future__ import annotations

import torch

from .p2p import Ring, check_op, exchange, finish_avg, flat_view, scratch


def naive_all_reduce(t: torch.Tensor, op: str = "sum", group=None, root: int = 0) -> torch.Tensor:
    """All-reduce ``t`` in place through global rank ``root`` (reduce to it, then it sends to all).

    The root receives from each rank in rank order and reduces in that order, then sends the
    result to each rank in turn: (N-1) S bytes in and (N-1) S out at the root, S each way elsewhere.
    """
    check_op(op, t)
    ring = Ring.of(group)
    n = ring.size
    root_g = ring.group_rank_of(root, "root")
    if n == 1:
        return t
    flat = flat_view(t)
    peers = [p for p in range(n) if p != root_g]
    if ring.rank == root_g:
        incoming = scratch(flat.numel(), flat.dtype, flat.device)
        for p in peers:                                  # reduce: every rank's data into mine
            exchange(ring, recv=incoming, src=p, reduce=(flat, incoming, op))
        finish_avg(flat, op, n)
        for p in peers:                                  # broadcast: the result to every rank
            exchange(ring, send=flat, dst=p)
    else:
        exchange(ring, send=flat, dst=root_g)
        exchange(ring, recv=flat, src=root_g)
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))
    return t
