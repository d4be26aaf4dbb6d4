"""A user's model made ready for a tensor-parallel plan (`plan.py`): what a plan must check and fix
beyond swapping the linears.

    GPT-2's Conv1D      a linear with its weight stored transposed, (in, out): `conv1d_to_linear` turns
                        each into the nn.Linear it computes (W^T), which a plan can split
    heads per rank      an attention module views its projections as (..., heads, head_dim): every rank
                        must hold whole heads, so the head counts (q's and, for grouped-query attention,
                        k's and v's ``num_key_value_heads``) must divide by t (`check_heads`), and the
                        module's own counts become per-rank counts (`heads_per_rank`), as torchtitan sets
                        ``attn.n_heads //= tp``
    order with FSDP     TP splits the full weights each rank holds; after ``fully_shard`` a rank holds only
                        its dp shard, so TP comes first (`refuse_sharded`), as in torchtitan:
                        ``parallelize_module(model, tp_mesh, plan)``, then ``fully_shard`` per block and root

Hugging Face's Llama views ``(..., -1, head_dim)`` and keeps only the ratio ``num_key_value_groups``
(unchanged per rank), so it needs no count changed; GPT-2 splits its fused q|k|v output by
``split_size``, which must become ``split_size / t``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

#: integer attributes of an attention module that count heads (or a head-split width) and so become
#: per-rank counts when its projections are split (Hugging Face, torchtitan and nanoGPT spellings)
PER_RANK = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "n_kv_heads",
            "split_size")
#: config fields that may hold a head count, named in the error when one does not split
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "n_kv_heads", "num_heads")


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear: y = x W + b, W of shape (in, out))."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


@torch.no_grad()
def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``Conv1D`` of ``model`` by the ``nn.Linear(nx, nf)`` it computes: weight
    W^T (out, in), the same bias; returns ``model``. Then a plan splits it like any linear, e.g. GPT-2::

        {"transformer.wte": "embedding", "transformer.h.*.attn.c_attn": dl.tp.Colwise(packed=3),
         "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
         "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise_gather"}
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_conv1d(child):
                w = child.weight                                               # (in, out)
                linear = nn.Linear(child.nx, child.nf, bias=child.bias is not None, device=w.device,
                                   dtype=w.dtype)
                linear.weight.copy_(w.t())
                if child.bias is not None:
                    linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
    return model


def refuse_conv1d(name: str, module: nn.Module) -> None:
    if is_conv1d(module):
        raise TypeError(
            f"{name!r} is a transformers Conv1D (GPT-2's linear), not an nn.Linear: its weight is stored "
            f"transposed, (in, out) = ({module.nx}, {module.nf}), so a row split would cut the wrong "
            "dimension. Convert first: dl.tp.conv1d_to_linear(model), then plan it as a linear (GPT-2: "
            "c_attn Colwise(packed=3), attn.c_proj 'rowwise', mlp.c_fc 'colwise', mlp.c_proj 'rowwise')")


def refuse_sharded(model: nn.Module) -> None:
    """TP after data-parallel sharding: each rank would split its dp shard, not the full weight."""
    marked = [n for n, p in model.named_parameters()
              if getattr(p, "_fsdp_shard", False) or getattr(p, "_fsdp_whole", False)]
    if marked or any(hasattr(m, "_fsdp") for m in model.modules()):
        raise ValueError(f"{type(model).__name__} is already fully_shard-ed (each rank holds a dp shard): "
                         "apply tensor parallelism first, then fully_shard (torchtitan's order: "
                         "dl.tp.parallelize(model, plan=..., group=mesh['tp']), then dl.fully_shard(block, "
                         "group=mesh['dp']) per block and the root)")
    for name, p in model.named_parameters():
        if type(p).__name__ == "DTensor":
            raise ValueError(f"{name} is a DTensor (torch's fully_shard or parallelize_module sharded it): "
                             "give dl.tp.parallelize the plain model, then shard it")


def head_splits(model: nn.Module, chosen: dict) -> dict[str, dict[str, int]]:
    """{attention module name: {planned child name: its head count}} for every planned linear whose
    parent has an integer ``head_dim`` (column-split: out_features / packed; row-split: in_features)."""
    found: dict[str, dict[str, int]] = {}
    for name, style in chosen.items():
        parent_name = name.rpartition(".")[0]
        parent, child = model.get_submodule(parent_name), model.get_submodule(name)
        head_dim = getattr(parent, "head_dim", None)
        if not isinstance(head_dim, int) or not isinstance(child, nn.Linear):
            continue
        rowwise = type(style).__name__ == "Rowwise"             # plan.Rowwise (plan.py imports this file)
        features = child.in_features if rowwise else child.out_features // getattr(style, "packed", 1)
        if features % head_dim == 0:
            found.setdefault(parent_name, {})[name] = features // head_dim
    return found


def check_heads(model: nn.Module, splits: dict, t: int) -> None:
    """Every rank must hold whole heads: raise, naming the config field, when a head count of ``splits``
    (`head_splits`) does not divide by ``t`` (before the attention's ``view(..., -1, head_dim)`` would fail
    on a partial head)."""
    for parent_name, counts in splits.items():
        for name, heads in counts.items():
            if heads % t:
                raise ValueError(_heads_error(model.get_submodule(parent_name), name, heads, counts, t))


def _heads_error(attn: nn.Module, name: str, heads: int, counts: dict, t: int) -> str:
    cfg = getattr(attn, "config", None)
    fields = [f"{type(cfg).__name__}.{f}={heads}" for f in HEAD_FIELDS if getattr(cfg, f, None) == heads]
    common = math.gcd(*counts.values())
    ok = [d for d in range(1, common + 1) if common % d == 0]
    where = f" ({', '.join(fields)})" if fields else ""
    more = " (or a model with more key/value heads)" if any("key_value" in f for f in fields) else ""
    return (f"{name!r} holds {heads} heads{where}, which do not split over tp={t}: every rank must hold "
            f"whole heads of head_dim={attn.head_dim}. Valid tp degrees for this attention: {ok}{more}")


def heads_per_rank(model: nn.Module, splits: dict, t: int) -> None:
    """Divide by ``t`` the head counts (`PER_RANK`) kept by each attention module of ``splits`` (whose
    projections the plan split): its forward then reads this rank's count (GPT-2's ``split_size``)."""
    for parent_name in splits:
        parent = model.get_submodule(parent_name)
        for attr in PER_RANK:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(parent, attr, value // t)
