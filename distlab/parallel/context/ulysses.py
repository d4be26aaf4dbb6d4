"""DeepSpeed-Ulysses: trade the sequence split for a head split around attention, by all-to-all.

Jacobs et al. 2023 ("DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models", Sec. 3). Attention mixes tokens but never heads, so: swap which axis
is split, attend locally, swap back.

    (B, H, s/n, D) on each rank            every rank: all heads, its part of the sequence
        | all-to-all: head group i -> rank i
    (B, H/n, s, D)                         every rank: H/n heads, the whole sequence
        | ordinary attention, causal or not (no communication)
    (B, H/n, s, D)
        | all-to-all back: sequence part j -> rank j
    (B, H, s/n, D)

Each all-to-all moves (n-1)/n of a rank's q, k, v (forward: 3 tensors in, 1 out) and the same
backward, whatever n: the volume per rank stays constant as n and s grow together, where ring
attention moves all of K and V past every rank. The catch: n must divide the number of heads.

The all-to-all is its own inverse (block i of rank j goes to rank i, and back), so its backward
is the same all-to-all on the gradient (`SequenceHeadSwap`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...comm import all_to_all
from ...runtime import group_size
from ..mesh import as_group
from .layout import check_length, to_rank_order, to_sequence_order
from .ring_attention import check_qkv


class SequenceHeadSwap(torch.autograd.Function):
    """Swap which axis is split, sequence <-> heads: an equal-block all-to-all along dim 0 (block i to
    rank i, `dl.comm.all_to_all`). Its own inverse, so its backward is the same all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad.contiguous(), group=ctx.group), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, group=None,
                      zigzag: bool = False, scale: float | None = None) -> torch.Tensor:
    """Attention over the whole sequence via two all-to-alls (sequence-split <-> head-split).

    ``q``, ``k``, ``v``: (batch, heads, local_seq, head_dim) laid out by ``dl.cp.split(x, dim=2,
    zigzag=zigzag)``; heads must divide by the group size. Returns this rank's rows, same layout.
    """
    check_qkv(q, k, v)
    group = as_group(group)                              # a 1-D mesh (mesh["cp"]): its process group
    n = group_size(group)
    b, h, s_local, d = q.shape
    if h % n:
        raise ValueError(f"Ulysses splits the {h} heads over {n} ranks: heads must be a multiple of the "
                         f"group size (use cp = a divisor of {h}, or ring_attention: it has no such limit)")
    check_length(s_local * n, n, zigzag, what=f"sequence length (local {s_local} x cp {n})")
    qkv = torch.stack([q, k, v]).unflatten(2, (n, h // n)).movedim(2, 0)   # (n, 3, B, H/n, s/n, D)
    qkv = SequenceHeadSwap.apply(qkv, group)                       # block j: rank j's sequence part, my heads
    qkv = qkv.movedim(0, 3).flatten(3, 4)                  # (3, B, H/n, s, D), rank order
    q_, k_, v_ = to_sequence_order(qkv, n, zigzag, dim=3).unbind(0)
    o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, scale=scale)   # (B, H/n, s, D)
    o = to_rank_order(o, n, zigzag, dim=2).unflatten(2, (n, s_local)).movedim(2, 0)   # (n, B, H/n, s/n, D)
    o = SequenceHeadSwap.apply(o, group)                           # block i: my sequence part, head group i
    return o.movedim(0, 1).flatten(1, 2)                   # (B, H, s/n, D)
