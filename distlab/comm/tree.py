"""Broadcast down a binomial tree, the classic choice for one-to-all (MPICH, gloo for small messages).

At every step each rank that already holds the data sends it to one rank that does not, so the
number of holders doubles: ceil(log2 N) steps instead of the N-1 a root sending to everyone needs.

    N = 8, source 0 (ranks relative to the source)

        step 0:  0 -> 4
        step 1:  0 -> 2,  4 -> 6
        step 2:  0 -> 1,  2 -> 3,  4 -> 5,  6 -> 7

    T_tree = ceil(log2 N) * (alpha + S / B)

Each rank receives S bytes once (except the source) and sends S bytes to each of its children.
For very large S a pipelined chain (cut S into pieces and pass them down a line) approaches
S / B; the tree keeps the code to a dozen lines and the latency term logarithmic.
"""
from __future__ import annotations

import torch

from .p2p import Ring, exchange, flat_view


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy ``t`` from global rank ``src`` into ``t`` on every rank of ``group``, in place; returns t.

    ``src`` is a *global* rank, as in ``torch.distributed.broadcast``. Binomial tree,
    ceil(log2 N) rounds; a rank receives once (from its parent), then sends to each of its children.
    """
    ring = Ring.of(group)
    n = ring.size
    root = ring.group_rank_of(src, "src")
    if n == 1:
        return t
    flat = flat_view(t)
    vr = (ring.rank - root) % n                     # my rank counted from the source
    mask = 1
    while mask < n:                                 # find my parent: the lowest set bit of vr
        if vr & mask:
            exchange(ring, recv=flat, src=(vr - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:                                 # then serve my children, farthest first
        if vr + mask < n:
            exchange(ring, send=flat, dst=(vr + mask + root) % n)
        mask >>= 1
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))
    return t
