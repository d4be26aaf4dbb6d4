"""`dl.cp.parallelize`: a GPT whose every rank holds a part of each sequence, attention made exact by
ring attention or Ulysses.

    gpt = dl.models.build("gpt-tiny", seed=0)                 # same seed on every rank: same weights
    gpt = dl.cp.parallelize(gpt, attention="ring")            # takes over the GPT's modules
    ids_local = dl.cp.split(ids, dim=1)                       # (b, s) -> (b, s/n), zig-zag by default
    loss = gpt.loss(ids_local, dl.cp.split(targets, dim=1))   # the mean over this rank's tokens

Only attention mixes positions, so only it talks: every other layer (embeddings, LayerNorm, MLP, LM
head) acts token by token on the local part unchanged. Two things change (names stay the same, so
state dicts line up with the plain GPT):

    blocks[i].attn   ContextParallelAttention   the same q, k, v, proj; the core is ring or Ulysses
    embed            positions of this rank's tokens (chunks r and 2n-1-r when zig-zag), not 0..s/n-1

Weights are replicated, and each rank's gradient covers only its tokens: average them over the
group (e.g. wrap in `dl.DDP`, as `dl.train(strategy="cp-ring")` does; with equal token counts the
average of the local mean losses' gradients is the gradient of the global mean).

Context x tensor parallelism (``parallelize(dl.tp.parallelize(gpt, group=tp), group=cp)``): tensor
parallelism splits the heads, context parallelism the sequence, and attention is per head, so they
compose on the attention heads (Megatron-LM's ``--context-parallel-size`` beside
``--tensor-model-parallel-size``)::

    x (b, s/c, h) -f(tp)-> q, k, v: my a/t heads (b, a/t, s/c, d) -ring or Ulysses (cp)-> proj (row) -g(tp)->

Each (tp, cp) rank holds 1/t of the matrices and 1/c of every sequence; the vocabulary-parallel
loss of `TensorParallelGPT` averages over its local tokens. Refused: sequence parallelism (it also
splits the sequence, over tp), and Ulysses when the cp degree does not divide the a/t local heads.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...models import GPT
from ..tensor import ParallelAttention, TensorParallelGPT
from ..mesh import as_group
from ..tensor.layers import shared_input
from ...runtime import group_size
from .layout import split
from .ring_attention import ring_attention
from .ulysses import ulysses_attention

ATTENTIONS = {"ring": ring_attention, "ulysses": ulysses_attention}


class ContextParallelAttention(nn.Module):
    """The GPT's causal self-attention on a sequence part: local projections, distributed core."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, proj: nn.Linear, head_dim: int,
                 attention: str = "ring", group=None, zigzag: bool = True, tensor_parallel: bool = False,
                 tp_group=None):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: choose one of {sorted(ATTENTIONS)}")
        if tp_group is not None and not tensor_parallel:
            raise ValueError("tp_group is for tensor-parallel q, k, v: pass tensor_parallel=True with it "
                             "(or build from the attention module: ContextParallelAttention.from_module)")
        self.q, self.k, self.v, self.proj, self.head_dim = q, k, v, proj, head_dim
        self.core, self.group, self.zigzag = ATTENTIONS[attention], as_group(group), zigzag
        self.tensor_parallel, self.tp_group = tensor_parallel, as_group(tp_group)          # cp x tp: my heads

    @classmethod
    def from_module(cls, attn: nn.Module, **kw) -> "ContextParallelAttention":
        """From the GPT's attention, or from `dl.tp`'s `ParallelAttention` (its heads, its tp group)."""
        tp = isinstance(attn, ParallelAttention)
        return cls(attn.q, attn.k, attn.v, attn.proj, attn.head_dim, tensor_parallel=tp,
                   tp_group=attn.group if tp else None, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape                                                  # (b, s/n, h)
        linears = [self.q, self.k, self.v]
        qkv = shared_input(x, linears, self.tp_group) if self.tensor_parallel else [lin(x) for lin in linears]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in qkv)   # (b, heads[/t], s/n, d)
        out = self.core(q, k, v, causal=True, group=self.group, zigzag=self.zigzag)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))            # (b, s/n, h)


class ContextParallelGPT(GPT):
    """A `GPT` fed this rank's part of each sequence (``dl.cp.split(ids, dim=1, zigzag=...)``); returns
    the logits of those tokens, (b, s/n, V). Built by `parallelize` from a full GPT."""

    def __init__(self, gpt: GPT, attention: str = "ring", group=None, zigzag: bool = True):
        nn.Module.__init__(self)               # not GPT.__init__: that would build new layers
        group = as_group(group)                # a 1-D mesh (mesh["cp"]): its process group
        self.cfg, self.group, self.zigzag = gpt.cfg, group, zigzag
        n = group_size(group)
        if attention == "ulysses" and gpt.cfg.heads % n:
            raise ValueError(f"cp-ulysses splits the {gpt.cfg.heads} heads over {n} ranks: use a cp degree "
                             f"that divides {gpt.cfg.heads}, or attention='ring'")
        _take_over(self, gpt, attention, group, zigzag)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(positions(ids, self.group, self.zigzag))


def _take_over(new: nn.Module, gpt: nn.Module, attention: str, group, zigzag: bool) -> None:
    """``new`` takes ``gpt``'s modules, each block's attention made context-parallel over ``group``."""
    for block in gpt.blocks:
        block.attn = ContextParallelAttention.from_module(block.attn, attention=attention, group=group,
                                                          zigzag=zigzag)
    new.tok, new.pos, new.blocks = gpt.tok, gpt.pos, gpt.blocks
    new.ln_f, new.head = gpt.ln_f, gpt.head


def positions(ids: torch.Tensor, group, zigzag: bool) -> torch.Tensor:
    """The positions in the whole sequence of this rank's s/n tokens ``ids`` (b, s/n)."""
    everywhere = torch.arange(ids.shape[1] * group_size(group), device=ids.device)   # 0 .. s-1
    return split(everywhere, dim=0, group=group, zigzag=zigzag)


class ContextTensorParallelGPT(TensorParallelGPT):
    """A `dl.tp` GPT (heads, MLP and vocabulary split over its tp group) whose attention is also
    context-parallel over ``group``: forward takes (b, s/c) ids, returns (b, s/c, V/t) logits; ``loss``
    is the vocabulary-parallel mean over this rank's tokens. Built by `parallelize` from a TP GPT."""

    def __init__(self, gpt: TensorParallelGPT, attention: str = "ring", group=None, zigzag: bool = True):
        nn.Module.__init__(self)               # take over the TP GPT's modules, as it took the GPT's
        if gpt.sequence_parallel:
            raise ValueError("sequence parallelism splits the sequence over tp, context parallelism over cp: "
                             "use one of them (drop sequence_parallel, or cp)")
        group = as_group(group)                # a 1-D mesh (mesh["cp"]): its process group
        local_heads, n = gpt.cfg.heads // group_size(gpt.group), group_size(group)
        if attention == "ulysses" and local_heads % n:
            raise ValueError(f"Ulysses splits each tp rank's {local_heads} heads over cp={n} ranks: choose a "
                             f"cp degree dividing {local_heads} (heads / tp), or attention='ring'")
        self.cfg, self.group, self.sequence_parallel = gpt.cfg, gpt.group, False
        self.cp_group, self.zigzag = group, zigzag
        _take_over(self, gpt, attention, group, zigzag)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(positions(ids, self.cp_group, self.zigzag))


def parallelize(gpt: GPT, attention: str = "ring", group=None, zigzag: bool = True) -> ContextParallelGPT:
    """The GPT with its attention made context-parallel over ``group`` (the GPT given is consumed); a
    `dl.tp` GPT becomes a `ContextTensorParallelGPT` (cp x tp on the attention heads)."""
    if isinstance(gpt, TensorParallelGPT):
        return ContextTensorParallelGPT(gpt, attention=attention, group=group, zigzag=zigzag)
    return ContextParallelGPT(gpt, attention=attention, group=group, zigzag=zigzag)
