"""Cutting a model into pipeline stages: contiguous runs of layers, balanced by count or by parameters.

A GPT is a chain of *units*: the embeddings, each transformer block, then the final LayerNorm with
the LM head. Pipeline parallelism gives stage ``s`` of ``S`` one contiguous run of that chain::

    units:   [embed] [block 0] [block 1] [block 2] [block 3] [ln_f + head]
    S = 3:   |---- stage 0 ----|---- stage 1 -----|------ stage 2 --------|

``balance="layers"`` gives every stage the same number of units (GPipe's even split);
``balance="params"`` minimises the largest stage's parameter count (the bottleneck stage sets the
pipeline's pace: step time ~ (m + p - 1) * max_stage_time), by exact dynamic programming.

Stage modules keep the full model's parameter names (``blocks.3.attn.q.weight`` stays that name on
whichever stage holds block 3), so a stage's ``state_dict()`` is a slice of the model's and results
compare with a single-process run name by name. They share the model's parameters (no copy).
A stage with no units passes its input through (only when there are more stages than units).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...models import GPT, MLP


def partition(weights: list[float], parts: int) -> list[tuple[int, int]]:
    """Cut ``weights`` into ``parts`` contiguous ranges ``[start, end)`` minimising the largest sum.

    Equal weights give the even split (sizes differ by at most one, larger ones last). With more
    parts than weights, some ranges are empty.
    """
    n = len(weights)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(set(weights)) <= 1:                       # even split by count
        bounds = [(k * n) // parts for k in range(parts + 1)]
        return list(zip(bounds, bounds[1:]))
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible largest-part sum when cutting units [0, i) into k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(n + 1):
            for j in range(i + 1):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, end = [], n
    for k in range(parts, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


class GPTStage(nn.Module):
    """Units ``[first, last)`` of a GPT's chain ``embed, block 0 .. block L-1, head``.

    The first stage takes token ids (b, s) and the last returns logits (b, s, vocab); every stage in
    between maps hidden states (b, s, h) to hidden states. The first stage embeds through the model it
    was cut from (``gpt.embed``), so a tensor-parallel GPT's own embedding applies (under sequence
    parallelism: this rank's positions, activations (b, s/T, h) on every pipeline link).
    """

    def __init__(self, gpt: GPT, first: int, last: int):
        super().__init__()
        layers = len(gpt.blocks)
        if gpt.cfg.tied and not (first == 0 and last == layers + 2):
            raise ValueError("a GPT with tied embeddings (cfg.tied=True) cannot be split across stages: "
                             "the tied weight would live on two ranks; build it with tied=False")
        self.has_embed, self.has_head = first == 0, last == layers + 2
        if self.has_embed:
            self.tok, self.pos = gpt.tok, gpt.pos
            self._embed = gpt.embed      # a bound method, not a child module: gpt is not registered
        self.block_ids = list(range(max(first, 1) - 1, min(last, layers + 1) - 1))
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in self.block_ids})
        if self.has_head:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embed:
            x = self._embed(x)                       # (b, s) ids -> (b, s, h)
        for block in self.blocks.values():
            x = block(x)
        if self.has_head:
            x = self.head(self.ln_f(x))
        return x


class MLPStage(nn.Module):
    """Layers ``[first, last)`` of an `MLP`, with GELU after every layer but the model's last."""

    def __init__(self, mlp: MLP, first: int, last: int):
        super().__init__()
        self.total = len(mlp.layers)
        self.layer_ids = list(range(first, last))
        self.layers = nn.ModuleDict({str(i): mlp.layers[i] for i in self.layer_ids})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in zip(self.layer_ids, self.layers.values()):
            x = layer(x)
            if i < self.total - 1:
                x = F.gelu(x)
        return x


class SequentialStage(nn.Module):
    """Children ``[first, last)`` of an ``nn.Sequential``, registered under their original indices."""

    def __init__(self, seq: nn.Sequential, first: int, last: int):
        super().__init__()
        for i in range(first, last):
            self.add_module(str(i), seq[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self._modules.values():
            x = module(x)
        return x


def units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The chain a model is cut along (what `split` balances)."""
    if isinstance(model, GPT):
        return [[model.tok, model.pos], *model.blocks, [model.ln_f, model.head]]
    if isinstance(model, MLP):
        return list(model.layers)
    if isinstance(model, nn.Sequential):
        return list(model)
    raise TypeError(f"cannot split a {type(model).__name__} into stages: pass a dl.models.GPT, "
                    "dl.models.MLP or nn.Sequential, or build the stage modules yourself")


def _size(unit) -> int:
    mods = unit if isinstance(unit, list) else [unit]
    return sum(p.numel() for m in mods for p in m.parameters())


def boundaries(model: nn.Module, num_stages: int, balance: str = "layers") -> list[tuple[int, int]]:
    """Unit ranges ``[first, last)`` of every stage."""
    chain = units(model)
    if balance == "layers":
        weights = [1.0] * len(chain)
    elif balance == "params":
        weights = [float(_size(u)) for u in chain]
    else:
        raise ValueError(f"balance must be 'layers' or 'params', got {balance!r}")
    return partition(weights, num_stages)


def split(model: nn.Module, num_stages: int, balance: str = "layers") -> list[nn.Module]:
    """Every stage module of ``model`` (they share its parameters)."""
    return [stage_module(model, s, num_stages, balance) for s in range(num_stages)]


def stage_module(model: nn.Module, stage_id: int, num_stages: int, balance: str = "layers") -> nn.Module:
    """Stage ``stage_id`` of ``num_stages``: the module one pipeline stage runs."""
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"stage_id={stage_id} out of range for num_stages={num_stages}")
    first, last = boundaries(model, num_stages, balance)[stage_id]
    if isinstance(model, GPT):
        return GPTStage(model, first, last)
    if isinstance(model, MLP):
        return MLPStage(model, first, last)
    return SequentialStage(model, first, last)


def stage_names(model: nn.Module, stage_id: int, num_stages: int, balance: str = "layers") -> list[str]:
    """Parameter names (as in ``model.named_parameters()``) that live on this stage."""
    mine = {id(p) for p in stage_module(model, stage_id, num_stages, balance).parameters()}
    return [n for n, p in model.named_parameters() if id(p) in mine]


# -- a stage with a chosen compute time, to see the schedule itself ---------------------------
class _TimedPath(torch.autograd.Function):
    """Identity whose forward takes ``t_fwd`` seconds and backward ``t_bwd`` (the input-gradient path)."""

    @staticmethod
    def forward(ctx, x, t_fwd, t_bwd):
        time.sleep(t_fwd)
        ctx.t_bwd = t_bwd
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_bwd)
        return grad, None, None


class _TimedBias(nn.Module):
    """x + w; computing d loss / d w takes ``t_w`` seconds (the W pass).

    ``w`` is broadcast by a plain ``expand`` whose backward node sleeps first: that node is the one
    op between ``w`` and the graph, so the zero-bubble executor runs it in W, and 1F1B inside B.
    """

    def __init__(self, features: int, t_w: float):
        super().__init__()
        self.t_w = t_w
        self.weight = nn.Parameter(torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.expand(x.shape)
        if w.grad_fn is not None:
            w.grad_fn.register_prehook(self._spend)
        return x + w

    def _spend(self, grad_outputs):
        time.sleep(self.t_w)


class TimedStage(nn.Module):
    """y = x + w, where F takes ``t_f`` seconds and B ``t_b``: ``t_b - t_w`` for the input-gradient
    path (the I pass) and ``t_w`` for the weight gradient (the W pass); ``t_w`` defaults to ``t_b / 2``.

    A lesson's stand-in for a transformer stage: the gradients are real (``w`` trains), but the
    time of each pass is fixed and spent *sleeping*, so four ranks sharing two CPU cores still see
    the timeline the schedule theory assumes (equal stages, F : B = 1 : 2) instead of a fight for
    cores. As in a real stage the weight sits *before* the timed path, so even stage 0 (whose input
    needs no gradient) spends ``t_b - t_w`` in its I pass::

        x --(+ w: W pass t_w)--> h --(timed path: F t_f, I pass t_b - t_w)--> y
    """

    def __init__(self, features: int = 8, t_f: float = 0.01, t_b: float = 0.02, t_w: float | None = None):
        super().__init__()
        self.t_f, self.t_b = t_f, t_b
        self.t_w = t_b / 2 if t_w is None else t_w
        if not 0 <= self.t_w <= t_b:
            raise ValueError(f"t_w={self.t_w} must lie in [0, t_b={t_b}]")
        self.bias = _TimedBias(features, self.t_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TimedPath.apply(self.bias(x), self.t_f, self.t_b - self.t_w)
