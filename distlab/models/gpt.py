"""A GPT-2 style decoder (Radford et al. 2019), small enough to train on a laptop, dense or MoE.

Token + position embeddings, ``layers`` pre-LayerNorm blocks of causal self-attention and a 4h MLP, a
final LayerNorm and an LM head (optionally tied to the token embedding)::

    ids (b, s) -> tok + pos (b, s, h) -> L x Block: x + attn(ln1(x)), then + mlp(ln2(x))
               -> ln_f -> head -> logits (b, s, V)

Attention keeps separate ``q``, ``k``, ``v`` and ``proj`` linears and infers its head count from ``q``'s
output size, so `distlab.tp` can shard heads by replacing layers without touching this code. Parameter
count (untied, with biases): ``V*h + S*h + L*(12h^2 + 13h) + 2h + h*V``.

With ``experts > 0`` (preset ``gpt-moe-tiny``) each block's MLP is a mixture of experts (`moe.MoE`, every
expert in this process): top-k softmax routing, a capacity factor with token dropping, and the Switch
load-balancing loss added to ``loss`` times ``aux_coef`` (Fedus et al. 2021, Eq. 4); ``GPT.aux_loss()`` is
that term of the last forward. `dl.ep.parallelize` splits those experts over ranks from the outside.

The Llama shape (Touvron et al. 2023; Dubey et al. 2024), for dry runs at real size (`presets`):
``kv_heads`` < ``heads`` is grouped-query attention (K and V project to kv_heads x d_head, each shared
by heads / kv_heads query heads), ``ffn`` the MLP's inner width, ``swiglu`` its gated form
``proj(silu(gate(x)) * fc(x))``, ``norm="rmsnorm"`` RMSNorm (a weight, no bias), ``positions=0`` no
learned position table. Parameters then equal `dl.theory.transformer_params` of the same shape exactly.
Llama's rotary position embedding (RoPE) has no parameters and is *not* applied here: the shapes, the
bytes and the collectives are Llama's, the positions are not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mlp import init_weights
from .moe import MoE, check


@dataclass
class GPTConfig:
    vocab: int = 64
    seq_len: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    tied: bool = False
    bias: bool = True
    experts: int = 0                 # > 0: a mixture-of-experts MLP in every block (E experts)
    top_k: int = 2                   # experts per token (1: Switch, 2: GShard)
    capacity_factor: float = 1.25    # slots per expert = ceil(capacity_factor * top_k * tokens / experts)
    aux_coef: float = 0.01           # weight of the load-balancing loss in ``GPT.loss`` (Switch: 1e-2)
    ffn: int | None = None           # the MLP's inner width (None: mlp_ratio * d_model)
    kv_heads: int | None = None      # < heads: grouped-query attention (None: heads)
    swiglu: bool = False             # the gated MLP of Llama (a third matrix, ``gate``)
    norm: str = "layernorm"          # or "rmsnorm" (Llama)
    positions: int | None = None     # rows of the learned position table (None: seq_len; 0: none)

    def __post_init__(self):
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by heads={self.heads}")
        if self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.experts:
            check(self.experts, self.top_k)


class CausalSelfAttention(nn.Module):
    """softmax(Q K^T / sqrt(d_head) + causal mask) V, then the output projection.

    Written out (not fused) so saved activations match the per-layer accounting of
    Korthikanti et al. 2022 and so tensor parallelism can split the heads.
    """

    def __init__(self, d_model: int, heads: int, bias: bool = True, kv_heads: int | None = None):
        super().__init__()
        self.head_dim = d_model // heads
        kv = (kv_heads or heads) * self.head_dim                 # grouped-query: fewer K and V heads
        self.q = nn.Linear(d_model, d_model, bias=bias)
        self.k = nn.Linear(d_model, kv, bias=bias)
        self.v = nn.Linear(d_model, kv, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.selective, self.recompute_context = False, None     # see `attention_core`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.proj(attention_core(self, q, k, v))


def attention_core(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal_attention` for ``attn``; with ``attn.selective``, Korthikanti et al.'s selective
    recomputation (2022, Sec. 4.1): the core runs under `torch.utils.checkpoint`, so forward keeps only
    q, k, v and backward recomputes the scores, the mask and the softmax (the a s^2 b terms: the most
    memory for the least compute), ``attn.recompute_context`` as the checkpoint's ``context_fn``."""
    if getattr(attn, "selective", False) and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint, noop_context_fn
        return checkpoint(causal_attention, q, k, v, attn.head_dim, use_reentrant=False,
                          context_fn=attn.recompute_context or noop_context_fn)
    return causal_attention(q, k, v, attn.head_dim)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_head) + causal mask) V over (b, s, heads * d_head) projections.

    The head count is whatever the projections hold, so tensor parallelism calls this on its
    shard of the heads unchanged.
    """
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))   # (b, heads, s, d_head)
    if k.shape[1] != q.shape[1]:                         # grouped-query: each K/V head serves a group of Q's
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return (attn @ v).transpose(1, 2).reshape(b, s, -1)


class FeedForward(nn.Module):
    """GELU(x W_fc + b) W_proj + b: h -> ratio*h -> h; ``swiglu``: (SiLU(x W_gate) * x W_fc) W_proj
    (Shazeer 2020, Llama's MLP), ``inner`` its width (default ratio*h)."""

    def __init__(self, d_model: int, ratio: int = 4, bias: bool = True, inner: int | None = None,
                 swiglu: bool = False):
        super().__init__()
        inner = inner or ratio * d_model
        self.fc = nn.Linear(d_model, inner, bias=bias)
        self.gate = nn.Linear(d_model, inner, bias=bias) if swiglu else None
        self.proj = nn.Linear(inner, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x)))


class NoPositions(nn.Module):
    """Where a GPT's learned position table would be, for a shape without one (Llama): adds nothing."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=positions.device)


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.RMSNorm(cfg.d_model) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.d_model)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x)).

    ``recompute = True``: full activation recomputation (Chen et al. 2016, "Training Deep Nets with
    Sublinear Memory Cost"; Korthikanti et al. 2022, Sec. 4: Megatron's full recompute): forward keeps
    only the block's input, and backward runs the block's forward again to rebuild what it needs
    (`torch.utils.checkpoint`, non-reentrant). Activation memory per block falls from s b h (34 + 5 a s
    / h) bytes (fp16, Korthikanti Eq. 1) to the 2 s b h of its input, for one more forward of compute;
    in backward one block's activations are rebuilt at a time, held by the checkpoint itself; the memory
    ledger counts them through ``recompute_context`` (checkpoint's ``context_fn``, attached from outside).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.recompute, self.recompute_context = False, None   # context: checkpoint's, attached from outside
        self.ln1 = _norm(cfg)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.heads, cfg.bias, cfg.kv_heads)
        self.ln2 = _norm(cfg)
        if cfg.experts:
            self.mlp = MoE(cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.experts, cfg.top_k,
                           cfg.capacity_factor)       # every expert here: `dl.ep.parallelize` splits them
        else:
            self.mlp = FeedForward(cfg.d_model, cfg.mlp_ratio, cfg.bias, cfg.ffn, cfg.swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():     # full (selective: the attention's, see there)
            from torch.utils.checkpoint import checkpoint, noop_context_fn
            return checkpoint(self._layers, x, use_reentrant=False,
                              context_fn=self.recompute_context or noop_context_fn)
        return self._layers(x)

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (b, s) -> logits (b, s, vocab). ``loss(ids, targets)`` is mean cross-entropy."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        rows = cfg.seq_len if cfg.positions is None else cfg.positions
        self.pos = nn.Embedding(rows, cfg.d_model) if rows else NoPositions()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = _norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight
        self.apply(init_weights)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(positions)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + self.aux_loss()

    def aux_loss(self) -> torch.Tensor | float:
        """``aux_coef`` times the load-balancing losses of the last forward's MoE layers (0 if dense)."""
        moe = [b.mlp.balance_loss for b in self.blocks if hasattr(b.mlp, "balance_loss")]
        return self.cfg.aux_coef * sum(moe) if moe else 0.0
