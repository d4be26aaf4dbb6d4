"""How a sequence is laid out over the ranks of a context-parallel group, and gathered back.

Contiguous: the sequence is cut into n chunks and rank r holds chunk r. Zig-zag: it is cut into 2n
chunks and rank r holds chunk r and chunk 2n-1-r (the load balancing of Megatron-LM's context
parallelism, and of Llama 3's, Dubey et al. 2024, Sec. 3.3.2):

    n = 4, contiguous          n = 4, zig-zag (8 chunks)
      r0: [0]                    r0: [0 | 7]
      r1: [1]                    r1: [1 | 6]
      r2: [2]                    r2: [2 | 5]
      r3: [3]                    r3: [3 | 4]

Under a causal mask a query sees only earlier keys. Counting the (query chunk, key chunk) pairs
ring attention computes (`ring_attention.py` skips the pairs wholly in the future):

    contiguous   rank r: r+1 blocks of (s/n)^2 (one on the diagonal)    rank n-1 works n times rank 0's
    zig-zag      rank r: 2n+1 blocks of (s/2n)^2 (two on the diagonal)  the same on every rank
"""
from __future__ import annotations

import torch

from ...runtime import group_rank, group_size
from .. import collectives
from ..mesh import as_group


def chunk_ids(rank: int, n: int, zigzag: bool) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in the order they sit in its local sequence
    (of ``n`` chunks when contiguous, of ``2n`` when zig-zag)."""
    return [rank, 2 * n - 1 - rank] if zigzag else [rank]


def check_length(length: int, n: int, zigzag: bool, what: str = "sequence length") -> None:
    """Raise, saying what to change, unless ``length`` cuts into n (contiguous) or 2n (zig-zag) chunks."""
    parts = 2 * n if zigzag else n
    if length <= 0 or length % parts:
        how = (f"2 x cp = {parts} (zig-zag gives each rank two equal chunks; or pass zigzag=False, "
               f"then a multiple of {n})" if zigzag else f"cp = {parts}")
        raise ValueError(f"{what} {length} must be a positive multiple of {how}: pad or trim the sequence")


def split(x: torch.Tensor, dim: int = 2, group=None, zigzag: bool = True) -> torch.Tensor:
    """This rank's part of the sequence along ``dim``: chunk r of n, or chunks r and 2n-1-r of 2n (zig-zag).

    A view-and-copy, no communication; differentiable. ``x``: e.g. (batch, heads, seq, head_dim).
    """
    group = as_group(group)                              # a 1-D mesh (mesh["cp"]): its process group
    n, r = group_size(group), group_rank(group)
    check_length(x.shape[dim], n, zigzag)
    chunks = x.chunk(2 * n if zigzag else n, dim)
    return torch.cat([chunks[i] for i in chunk_ids(r, n, zigzag)], dim)     # (.., seq / n, ..)


def unsplit(local: torch.Tensor, dim: int = 2, group=None, zigzag: bool = True) -> torch.Tensor:
    """All-gather every rank's ``local`` part back into the whole sequence, in sequence order.

    The inverse of `split` (every rank gets the whole); for results and checks: no gradient flows back.
    """
    group = as_group(group)                              # a 1-D mesh (mesh["cp"]): its process group
    n = group_size(group)
    dim = dim % local.dim()
    check_length(local.shape[dim] * n, n, zigzag, what="gathered sequence length")
    with torch.no_grad():
        gathered = collectives.all_gather(local.detach(), dim, group)        # rank order: (.., seq, ..)
    return to_sequence_order(gathered, n, zigzag, dim)


def rank_order(n: int, zigzag: bool) -> list[int]:
    """The chunk ids of a gathered sequence in rank order: zig-zag, n = 2: [0, 3, 1, 2]."""
    return [c for r in range(n) for c in chunk_ids(r, n, zigzag)]


def to_sequence_order(x: torch.Tensor, n: int, zigzag: bool, dim: int) -> torch.Tensor:
    """Reorder a sequence gathered in rank order (rank 0's part, rank 1's, ...) into sequence order."""
    if not zigzag:
        return x
    pieces, order = x.chunk(2 * n, dim), rank_order(n, zigzag)
    return torch.cat([pieces[order.index(c)] for c in range(2 * n)], dim)


def to_rank_order(x: torch.Tensor, n: int, zigzag: bool, dim: int) -> torch.Tensor:
    """The inverse of `to_sequence_order`: each rank's part, one after another."""
    if not zigzag:
        return x
    pieces = x.chunk(2 * n, dim)
    return torch.cat([pieces[c] for c in rank_order(n, zigzag)], dim)
