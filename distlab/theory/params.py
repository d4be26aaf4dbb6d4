"""Parameter count of a decoder-only transformer from its shape.

GPT (Radford et al. 2019; Narayanan et al. 2021, Sec. 5.1; the Ultra-Scale Playbook):

    N = h v + L (12 h^2 + 13 h) + 2 h

per layer: attention QKV 3h^2 + 3h, output projection h^2 + h, MLP with 4h inner width
8h^2 + 5h, two LayerNorms 4h; plus the tied embedding h v and the final LayerNorm 2h.

Llama (Touvron et al. 2023): SwiGLU MLP 3 h f, grouped-query attention (K and V projected to
kv_heads * head_dim), RMSNorm (h weights, no bias), no biases, untied output layer (+ h v).
"""
from __future__ import annotations


def transformer_params(hidden: int, layers: int, vocab: int, *, heads: int | None = None,
                       kv_heads: int | None = None, ffn: int | None = None, swiglu: bool = False,
                       bias: bool = True, norm: str = "layernorm", tied: bool = True,
                       positions: int = 0) -> int:
    """Number of parameters. Defaults give GPT's ``h v + L(12h^2 + 13h) + 2h``.

    ``ffn`` is the MLP inner width (default 4h), ``kv_heads`` < ``heads`` is grouped-query
    attention, ``positions`` > 0 adds learned position embeddings (``positions * h``).
    """
    if norm not in ("layernorm", "rmsnorm"):
        raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {norm!r}")
    heads = heads or 1
    kv_heads = kv_heads or heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    h, ffn = hidden, ffn or 4 * hidden
    kv = kv_heads * (h // heads)
    attention = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if bias else 0)
    mlp = (3 if swiglu else 2) * h * ffn + ((2 if swiglu else 1) * ffn + h if bias else 0)
    norm_size = 2 * h if norm == "layernorm" else h
    per_layer = attention + mlp + 2 * norm_size
    embeddings = vocab * h * (1 if tied else 2) + positions * h
    return embeddings + layers * per_layer + norm_size


def gpt_params(hidden: int, layers: int, vocab: int) -> int:
    """The closed form ``h v + L (12 h^2 + 13 h) + 2 h`` (tied embeddings, no position table)."""
    return hidden * vocab + layers * (12 * hidden**2 + 13 * hidden) + 2 * hidden
