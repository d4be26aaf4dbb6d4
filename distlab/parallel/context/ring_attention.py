"""Ring attention: exact attention over a sequence split across n ranks, K/V passed round a ring.

Liu, Zaharia & Abbeel 2023 ("Ring Attention with Blockwise Transformers"). Every rank keeps its
own queries; the key/value blocks travel round the ring, one hop per step, so after n steps each
rank has met every block while holding only two of them (its own and the one in transit):

    n = 3, step s: rank r holds the K/V block of rank r-s

        step 0:  r0:KV0  r1:KV1  r2:KV2     --shift-->
        step 1:  r0:KV2  r1:KV0  r2:KV1     --shift-->
        step 2:  r0:KV1  r1:KV2  r2:KV0

Merging partial softmaxes (online softmax, Milakov & Gimelshein 2018; FlashAttention's rescaling).
For a query row, a block j of keys gives an output o_j = softmax(q K_j^T) V_j and its log-sum-exp
l_j = log sum_k exp(q . k / sqrt(d)). Two blocks merge exactly:

    l = log(exp(l_a) + exp(l_b))            o = exp(l_a - l) o_a + exp(l_b - l) o_b

Backward (hand-written: no autograd through the communication). With the final o, l and the
incoming gradient dO, per block pair (FlashAttention-2, Dao 2023, Alg. 2):

    P = exp(q K^T / sqrt(d) - l)     dV += P^T dO     dP = dO V^T
    dS = P * (dP - rowsum(dO * o))   dQ += dS K / sqrt(d)     dK += dS^T Q / sqrt(d)

dQ stays home; K/V go round the ring again, and dK/dV travel *with* their block, gathering every
rank's contribution; one last hop brings them to the block's owner (n hops for dK/dV, n-1 for K/V).

Overlap: each step posts the send of the held K/V block and the receive of the next one
(`start_ring_shift`: isend/irecv) *before* computing on the held block, and waits after, so the
transfer hides behind the block's compute when compute takes longer (Liu et al. 2023, Sec. 3):

    step s:   post  send KV_held -> r+1,  recv KV_next <- r-1
              compute  q x KV_held          (the transfer in flight meanwhile)
              wait  -> KV_next becomes KV_held

dK/dV cannot go early: they carry this step's sums, so they hop after the compute.

Bytes sent per rank, with b the bytes of one rank's K and V together (2 x batch x heads x s/n x d):
forward (n-1) b; backward (n-1) b + n b' (b' the same block in the accumulation dtype, for the gradients).

Precision: outputs, log-sum-exps and gradients accumulate in float32, or in the input's dtype when it is
wider (float64 stays exact to float64 rounding); the result is cast back to the input's dtype.

Causal masking works per chunk pair (`layout.py`: a rank holds one chunk, or two when zig-zag).
Chunk ids are global positions in sequence order, all chunks the same length, so for query chunk a
and key chunk b:  b < a  every key visible (no mask);  b == a  the lower triangle;  b > a  nothing
(the pair is skipped: the work zig-zag balances).

Memory per rank: Q, K, V, O of s/n tokens plus one K/V block in flight; the s x s score matrix is
never formed, only (s/n) x (s/n) blocks (s/2n with zig-zag).
"""
from __future__ import annotations

import math

import torch

from ...comm import ring_shift, start_ring_shift
from ...runtime import group_rank, group_size
from ..mesh import as_group
from .layout import check_length, chunk_ids

FULL, DIAGONAL = "full", "diagonal"


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, group=None,
                   zigzag: bool = True, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ causal mask]) v over the whole sequence, each rank holding its part.

    ``q``, ``k``, ``v``: (batch, heads, local_seq, head_dim), laid out by ``dl.cp.split(x, dim=2,
    zigzag=zigzag)``; returns this rank's rows of the output, same shape and layout. ``scale``:
    1/sqrt(head_dim) by default. Differentiable in q, k and v.
    """
    check_qkv(q, k, v)
    group = as_group(group)                              # a 1-D mesh (mesh["cp"]): its process group
    n = group_size(group)
    check_length(q.shape[2] * n, n, zigzag, what=f"sequence length (local {q.shape[2]} x cp {n})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingAttention.apply(q, k, v, causal, group, zigzag, scale)


class RingAttention(torch.autograd.Function):
    """Forward: K/V round the ring, partial results merged by log-sum-exp. Backward: dK/dV round the ring."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, zigzag, scale):
        out, lse = ring_forward(q, k, v, causal, group, zigzag, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, group, zigzag, scale)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or ``t``'s dtype where it is wider (float64): never less precise than the input."""
    return torch.promote_types(t.dtype, torch.float32)


def ring_forward(q, k, v, causal, group, zigzag, scale):
    """(out, lse) of this rank's queries against every rank's keys, in `accumulation_dtype`."""
    n, r, acc = group_size(group), group_rank(group), accumulation_dtype(q)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)                    # (B, H, s/n, D)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)     # (B, H, s/n)
    mine = chunks(r, n, zigzag, q.to(acc), out, lse)
    kv = torch.stack([k, v])                                                  # (2, B, H, s/n, D)
    for step in range(n):
        if step < n - 1:
            shift = start_ring_shift(kv, group)               # pass it on: travels while we compute
        for b, k_b, v_b in chunks((r - step) % n, n, zigzag, kv[0], kv[1]):   # the block now held
            for a, q_a, out_a, lse_a in mine:
                kind = pair_kind(a, b, causal)
                if kind is not None:
                    merge(out_a, lse_a, *block_forward(q_a, k_b.to(acc), v_b.to(acc), kind, scale))
        if step < n - 1:
            kv = shift.wait()                                 # the next block, from rank r-step-1
    return out, lse


def ring_backward(dout, q, k, v, out, lse, causal, group, zigzag, scale):
    """(dq, dk, dv) in `accumulation_dtype`: dq accumulated here, dk/dv round the ring with their block."""
    n, r, acc = group_size(group), group_rank(group), accumulation_dtype(q)
    dout = dout.to(acc)
    delta = (dout * out).sum(-1)                                              # (B, H, s/n)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    mine = chunks(r, n, zigzag, q.to(acc), dout, lse, delta, dq)
    kv = torch.stack([k, v])                                                  # (2, B, H, s/n, D)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)                  # gradients of the held block
    for step in range(n):
        if step < n - 1:
            shift = start_ring_shift(kv, group)               # the next K/V travels while we compute
        held = chunks((r - step) % n, n, zigzag, kv[0], kv[1], dkv[0], dkv[1])
        for b, k_b, v_b, dk_b, dv_b in held:
            for a, q_a, do_a, lse_a, delta_a, dq_a in mine:
                kind = pair_kind(a, b, causal)
                if kind is not None:
                    block_backward(q_a, k_b.to(acc), v_b.to(acc), do_a, lse_a, delta_a, kind, scale,
                                   dq_a, dk_b, dv_b)
        if step < n - 1:
            kv = shift.wait()
        dkv = ring_shift(dkv, group)         # needs this step's sums: after the compute; after n hops, home
    return dq, dkv[0], dkv[1]


def pair_kind(a: int, b: int, causal: bool) -> str | None:
    """How query chunk ``a`` sees key chunk ``b``: FULL, DIAGONAL (lower triangle) or None (all masked)."""
    if not causal or b < a:
        return FULL
    return DIAGONAL if b == a else None


def block_forward(q, k, v, kind, scale):
    """This block's (output, log-sum-exp): q (B, H, c, D), k and v (B, H, c, D) -> (B, H, c, D), (B, H, c)."""
    s = scores(q, k, kind, scale)                                             # (B, H, c, c)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def block_backward(q, k, v, do, lse, delta, kind, scale, dq, dk, dv) -> None:
    """Add this block pair's contributions into dq, dk and dv (in place)."""
    p = torch.exp(scores(q, k, kind, scale) - lse[..., None])                # (B, H, c, c): final softmax
    dv.add_(p.transpose(-2, -1) @ do)
    ds = p * (do @ v.transpose(-2, -1) - delta[..., None])                   # dS = P * (dP - rowsum(dO*O))
    dq.add_(ds @ k, alpha=scale)
    dk.add_(ds.transpose(-2, -1) @ q, alpha=scale)


def scores(q, k, kind, scale):
    s = (q @ k.transpose(-2, -1)) * scale                                     # (B, H, c, c)
    if kind == DIAGONAL:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, -math.inf)
    return s


def merge(out, lse, o, o_lse) -> None:
    """Fold a block's (o, o_lse) into the running (out, lse), in place (online softmax)."""
    new = torch.logaddexp(lse, o_lse)
    out.mul_(torch.exp(lse - new)[..., None]).add_(o * torch.exp(o_lse - new)[..., None])
    lse.copy_(new)


def chunks(rank: int, n: int, zigzag: bool, *tensors):
    """(chunk id, that chunk of each tensor) for every chunk ``rank`` holds; the sequence is dim 2 of
    (B, H, s/n, D) and (B, H, s/n) tensors alike. The pieces are views: writing into them writes through."""
    ids = chunk_ids(rank, n, zigzag)
    parts = [t.chunk(len(ids), dim=2) for t in tensors]
    return [(c, *(p[i] for p in parts)) for i, c in enumerate(ids)]


def check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (batch, heads, local_seq, head_dim) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have the same shape (batch, heads, local_seq, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
