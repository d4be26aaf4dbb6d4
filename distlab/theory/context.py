"""Context parallelism: activation memory and bytes per step, ring attention vs Ulysses.

s sequence length, b micro-batch, h hidden (heads x head_dim), a heads, c context-parallel degree,
e bytes per element. Each rank holds s/c tokens of every sequence.

Activations (Megatron-LM context parallelism; Korthikanti et al. 2022, Eq. 1, per rank): every
per-token term shrinks with the tokens, s -> s/c, and so does the attention-score term 5as^2b, since
a rank scores only its s/c queries (ring: (s/c) x s blocks, one at a time) or only a/c heads
(Ulysses: a/c x s x s):

    cp_activation_bytes_per_layer = s b h (34 + 5 a s / h) / c

Communication per rank per layer (sent; received is the same):

    ring attention (Liu et al. 2023), K and V (2 b s h / c elements) hop c-1 times forward; backward
    K and V hop again c-1 times and dK, dV c times (the last hop brings them home, `dl.cp`):
        forward   2 b s h (c-1)/c e           backward  2 b s h (c-1)/c e + 2 b s h e_grad
    Ulysses (Jacobs et al. 2023, Sec. 3.2): all-to-all of q, k, v (3 b s h / c elements) and of the
    output (b s h / c), each sending (c-1)/c of it; backward the same on the gradients:
        forward   4 b s h (c-1)/c^2 e         backward  the same
    i.e. per link 4 s h / c for b = 1 (the paper's 4Nh/P): constant when s and c grow together,
    where ring attention's stays ~2 b s h whatever c. Ulysses needs c to divide the heads.

What distlab's GPT layer actually saves under `dl.cp` (fp32, no dropout; `cp_saved_bytes_per_layer`):
both attention cores keep no s x s matrix at all (ring attention recomputes its blocks in backward,
Ulysses' local attention is fused, FlashAttention-style), only the output in fp32 and one log-sum-exp
per query and head, so Korthikanti's a s^2 b (softmax) is replaced by s b h + s b a, all over c:

    plain layer   4 s b (16 h + a s) + 16 s b + s^2        (LayerNorm stats, causal mask: 1 byte each)
    cp layer      4 (s/c) b (16 h + h + a) + 16 (s/c) b      linear in s: no s^2 term left
"""
from __future__ import annotations

from distlab.theory.activations import activation_bytes_per_layer

ATTENTIONS = ("ring", "ulysses")


def cp_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, cp: int = 1,
                                  tp: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Bytes one layer stores for the backward on each of ``cp`` ranks: Korthikanti's Eq. 1-4 / cp."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    return activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, tp=tp, sp=sp,
                                      recompute=recompute) / cp


def cp_bytes_per_layer(attention: str, seq_len: int, micro_batch: int, hidden: int, cp: int,
                       bytes_per_element: int = 2, grad_bytes_per_element: int | None = None,
                       heads: int | None = None) -> dict:
    """Bytes each rank sends for one layer's attention: {"forward", "backward", "total"}.

    ``grad_bytes_per_element``: the width of the gradients ring attention passes (dl.cp accumulates
    them in fp32: 4); the element size by default. ``heads``: checked to divide by ``cp`` for Ulysses.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if cp < 1 or seq_len % cp:
        raise ValueError(f"cp={cp} must be >= 1 and divide seq_len={seq_len}")
    e = bytes_per_element
    g = e if grad_bytes_per_element is None else grad_bytes_per_element
    sbh = seq_len * micro_batch * hidden
    if attention == "ring":
        forward = 2 * sbh * (cp - 1) / cp * e
        backward = forward + (2 * sbh * g if cp > 1 else 0)
    else:
        if heads is not None and heads % cp:
            raise ValueError(f"Ulysses splits the {heads} heads over cp={cp}: cp must divide them")
        forward = backward = 4 * sbh * (cp - 1) / cp ** 2 * e
    return {"forward": forward, "backward": backward, "total": forward + backward}


def cp_saved_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, cp: int = 1) -> int:
    """Bytes one layer of distlab's fp32 GPT saves for backward on each of ``cp`` ranks under `dl.cp`
    (ring attention or Ulysses): per local token, Korthikanti's 16 h elements without dropout (LayerNorm,
    q/k/v, projection and MLP inputs), plus the attention core's fp32 output (h) and log-sum-exp (one per
    head), plus the two LayerNorms' mean and 1/std: 4 (s/c) b (17 h + a) + 16 (s/c) b. No s^2 term."""
    if cp < 1 or seq_len % cp:
        raise ValueError(f"cp={cp} must be >= 1 and divide seq_len={seq_len}")
    tokens = seq_len // cp * micro_batch
    return 4 * tokens * (17 * hidden + heads) + 2 * 2 * tokens * 4


def ring_attention_flops(seq_len: int, micro_batch: int, hidden: int, cp: int, causal: bool = True,
                         zigzag: bool = True) -> list[int]:
    """Forward matmul FLOPs of ring attention on each rank: the causal load (im)balance.

    The sequence is cut into n chunks (contiguous) or 2n (zig-zag: rank r holds chunks r and 2n-1-r) of
    length c; a rank computes one (query chunk a, key chunk b) pair for every b <= a (every b when not
    causal; `dl.cp` skips the pairs wholly in the future and computes a diagonal pair whole, then masks).
    Each pair costs q k^T and P v, 2 c^2 d FLOPs each per head: 4 b c^2 h in all (h = heads x d).

        contiguous   rank r: r + 1 pairs of c = s/n      -> the last rank works n times the first
        zig-zag      rank r: 2n + 1 pairs of c = s/2n    -> the same on every rank
    """
    if cp < 1 or seq_len % (2 * cp if zigzag else cp):
        raise ValueError(f"seq_len={seq_len} must split into {'2 x ' if zigzag else ''}cp={cp} equal chunks")
    parts = 2 * cp if zigzag else cp
    c = seq_len // parts
    flops = []
    for r in range(cp):
        mine = [r, parts - 1 - r] if zigzag else [r]
        pairs = sum(1 for a in mine for b in range(parts) if not causal or b <= a)
        flops.append(4 * micro_batch * c * c * hidden * pairs)
    return flops
