"""A tensor-parallel *plan* for any model: module names -> how each is split (torch's ``parallelize_module``).

    model = MyModel()                                   # same seed on every rank: same full weights
    model = dl.tp.parallelize(model, plan={
        "embed.tok":          "embedding",              # vocabulary rows split, outputs summed (g)
        "blocks.*.attn.qkv":  dl.tp.Colwise(packed=3),  # a fused q|k|v: each of the 3 blocks split
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc":    "colwise",
        "blocks.*.mlp.proj":  "rowwise",
        "head":               "colwise_gather",         # vocabulary split, logits gathered back
    })

Each key is a module name in which a ``*`` stands for one whole name part (``blocks.*.attn.qkv``
matches ``blocks.0.attn.qkv``, not ``blocks.0.x.attn.qkv``), as in torch's
``torch.distributed.tensor.parallel.parallelize_module(module, mesh, plan)``. Every module matched is
replaced, in place, by its sharded form built from the full weights (`linear`, `vocab`)::

    style              replaces        this rank keeps                  entry / exit
    "colwise"          nn.Linear       rows W_i (out/t), bias_i         f (identity fwd, all-reduce bwd) / -
    "colwise_gather"   nn.Linear       the same                         f / all-gather of the outputs
    Colwise(packed=k)  nn.Linear       rows i of each of k blocks       f / -       (fused q|k|v: k = 3)
    "rowwise"          nn.Linear       columns W_i (in/t), full bias    - / g (all-reduce fwd)
    "rowwise_split"    nn.Linear       the same, from a full input      split / g
    "embedding"        nn.Embedding    vocabulary rows E_i (V/t)        - / g

Megatron's pairing (Shoeybi et al. 2019, Sec. 3) is the plan's job: a "colwise" followed by a
"rowwise" talks once forward (g) and once backward (f), and what runs between them (GELU, attention
on this rank's heads) must act feature by feature. A plan swaps layers, not the arithmetic around
them: a forward that reads a head count (``view(b, s, self.heads, d)``) must read it from the
tensor instead (``view(b, s, -1, d)``), or be told (torchtitan sets ``attn.n_heads //= tp``). And a
fused ``qkv`` needs ``Colwise(packed=3)``: a plain "colwise" would hand rank 0 all of q and half of k.

`full_state_dict` (``dl.tp.full_state_dict``) gathers a planned model back to full tensors, names
unchanged. A weight tied between two planned modules split the same way (an embedding and a
"colwise" head) stays tied to the same shard. `GPT_PLAN` is distlab's GPT as a plan (``gpt.py``'s
hand-written path is the same split with q, k, v sharing one f and a vocabulary-parallel loss).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import collectives as C
from .adapt import check_heads, head_splits, heads_per_rank, refuse_conv1d, refuse_sharded
from .linear import ColumnParallelLinear, RowParallelLinear, check_divisible
from .vocab import VocabParallelEmbedding


@dataclass(frozen=True)
class Colwise:
    """Split an nn.Linear's output features; ``gather_output`` all-gathers them back; ``packed=k``: the
    outputs are k blocks side by side (q | k | v), each split, so rank i holds [q_i; k_i; v_i]."""

    gather_output: bool = False
    packed: int = 1


@dataclass(frozen=True)
class Rowwise:
    """Split an nn.Linear's input features; ``input_is_parallel=False`` takes the full input and splits it."""

    input_is_parallel: bool = True


@dataclass(frozen=True)
class Embedding:
    """Split an nn.Embedding's rows (the vocabulary)."""


#: distlab's GPT as a plan: the same splits as `gpt.parallelize`, at a price the hand-written path avoids:
#: q, k, v each enter with their own f (3 all-reduces backward where `ParallelAttention` shares one) and
#: the logits are gathered (b s V) where `vocab_parallel_cross_entropy` all-reduces 3 b s numbers.
GPT_PLAN = {"tok": "embedding", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
            "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise", "head": "colwise_gather"}

STYLES = {"colwise": Colwise(), "colwise_gather": Colwise(gather_output=True), "rowwise": Rowwise(),
          "rowwise_split": Rowwise(input_is_parallel=False), "embedding": Embedding()}


class PackedColumnParallelLinear(ColumnParallelLinear):
    """A fused linear whose k output blocks are split separately: rank i holds rows i of each block,
    so its output (b, s, k out/(k t)) chunks into its own q_i, k_i, v_i. ``unpack`` reorders a
    gathered weight (all ranks' [q_i; k_i; v_i] in rank order) back to [q; k; v]."""

    def __init__(self, linear: nn.Linear, packed: int, group=None):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.packed = packed
        with torch.no_grad():
            for mine, full in ((self.weight, linear.weight), (self.bias, linear.bias)):
                if mine is not None:          # (k, out/k, ...) -> my rows of each block -> (k out/(k t), ...)
                    blocks = full.reshape(packed, full.shape[0] // packed, *full.shape[1:])
                    mine.copy_(C.split(blocks, 1, self.group).reshape(mine.shape))

    def unpack(self, gathered: torch.Tensor) -> torch.Tensor:
        t, k = self.tp, self.packed
        per = gathered.reshape(t, k, -1, *gathered.shape[1:])          # (t, k, out/(k t), ...)
        return per.transpose(0, 1).reshape(gathered.shape)               # (k, t, ...) -> [q; k; v]


def style_of(value, key: str):
    """A plan value (a style name or object) -> the style object; a clear error for an unknown one."""
    if isinstance(value, (Colwise, Rowwise, Embedding)):
        return value
    if isinstance(value, str) and value in STYLES:
        return STYLES[value]
    near = difflib.get_close_matches(str(value), list(STYLES), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"plan[{key!r}] = {value!r} is not a tensor-parallel style{hint}: choose one of "
                     f"{sorted(STYLES)}, or dl.tp.Colwise(packed=3) for a fused q|k|v linear")


def matches(pattern: str, name: str) -> bool:
    """``blocks.*.attn.qkv`` against a module name, one name part per ``*`` (torch's plan rule)."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w == "*" or w == h for w, h in zip(want, have))


def resolve(model: nn.Module, plan: dict) -> dict[str, object]:
    """{module name: style} for every module the plan names; errors for a key matching nothing, a
    module matched twice, a style that does not exist."""
    names = [n for n, _ in model.named_modules() if n]
    found: dict[str, object] = {}
    for key, value in plan.items():
        style = style_of(value, key)
        hits = [n for n in names if matches(key, n)]
        if not hits:
            near = difflib.get_close_matches(key, names, n=3)
            raise ValueError(f"plan key {key!r} names no module of {type(model).__name__}"
                             + (f"; closest: {near}" if near else f"; its modules: {names[:12]}")
                             + " ('*' stands for one name part, e.g. 'blocks.*.mlp.fc')")
        for n in hits:
            if n in found:
                raise ValueError(f"module {n!r} is matched by two plan keys: give each module one style")
            found[n] = style
    return found


def build(name: str, module: nn.Module, style, group) -> nn.Module:
    """The sharded replacement of ``module`` (named ``name``) for ``style``."""
    t = C.group_size(group)
    want = nn.Embedding if isinstance(style, Embedding) else nn.Linear
    refuse_conv1d(name, module)
    if not isinstance(module, want):
        raise TypeError(f"{name!r} is a {type(module).__name__}, but style {style} splits an "
                        f"{want.__name__}: name the {want.__name__} inside it")
    if isinstance(style, Embedding):
        check_divisible(f"{name}: vocab (num_embeddings)", module.num_embeddings, t)
        return VocabParallelEmbedding.from_embedding(module, group)
    if isinstance(style, Rowwise):
        check_divisible(f"{name}: in_features", module.in_features, t)
        return RowParallelLinear.from_linear(module, group, input_is_parallel=style.input_is_parallel)
    if module.out_features % style.packed:
        raise ValueError(f"{name!r}: out_features={module.out_features} is not {style.packed} packed blocks")
    check_divisible(f"{name}: out_features" + (f" / {style.packed}" if style.packed > 1 else ""),
                    module.out_features // style.packed, t)
    if style.packed > 1:
        return PackedColumnParallelLinear(module, style.packed, group)
    return ColumnParallelLinear.from_linear(module, group, gather_output=style.gather_output)


def parallelize_plan(model: nn.Module, plan: dict, group=None) -> nn.Module:
    """Replace, in place, every module ``plan`` names by its tensor-parallel form over ``group``
    (every rank must pass the same full weights); returns ``model``. Checks everything first (`adapt`:
    not yet fully_shard-ed, no Conv1D, whole heads per rank), and sets the attention modules' head
    counts to this rank's."""
    if not isinstance(plan, dict) or not plan:
        raise TypeError("plan must be a non-empty dict {module name pattern: style}, e.g. "
                        "{'blocks.*.mlp.fc': 'colwise', 'blocks.*.mlp.proj': 'rowwise'}")
    refuse_sharded(model)
    chosen = resolve(model, plan)
    check_ties(model, chosen)
    splits = head_splits(model, chosen)                      # attention modules: whole heads per rank
    check_heads(model, splits, C.group_size(group))
    built = {n: build(n, model.get_submodule(n), s, group) for n, s in chosen.items()}
    tied: dict[int, nn.Parameter] = {}
    for name, new in built.items():
        old = model.get_submodule(name)
        if isinstance(new, (VocabParallelEmbedding, ColumnParallelLinear)) and not isinstance(
                new, PackedColumnParallelLinear):            # same row blocks: a tie survives
            new.weight = tied.setdefault(id(old.weight), new.weight)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    heads_per_rank(model, splits, C.group_size(group))      # e.g. GPT-2's split_size: this rank's width
    return model


def _keeps_row_blocks(style) -> bool:
    """Whether ``style`` keeps rows [i n/t, (i+1) n/t) of the weight: the embedding and unpacked colwise."""
    return isinstance(style, Embedding) or (isinstance(style, Colwise) and style.packed == 1)


def check_ties(model: nn.Module, chosen: dict) -> None:
    """A weight the plan splits must not also sit, whole, in a module the plan leaves alone, and a tie
    survives only between styles that keep the same row block (embedding, colwise unpacked)."""
    owners: dict[int, list[str]] = {}
    for n in chosen:
        w = getattr(model.get_submodule(n), "weight", None)
        if isinstance(w, torch.Tensor):
            owners.setdefault(id(w), []).append(n)
    names = {f"{n}.weight" for n in chosen}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owners and n not in names:
            raise ValueError(f"{n!r} is tied to a weight the plan splits: name its module in the plan too, "
                             "with a style that splits it the same way (embedding / colwise)")
    for tied in (mods for mods in owners.values() if len(mods) > 1):
        if not all(_keeps_row_blocks(chosen[m]) for m in tied):
            raise ValueError(f"{tied} share one weight but their styles split it differently: give them "
                             "'embedding' / 'colwise' (rows split the same way), or untie them")
