"""Gradient-norm clipping when no rank holds the whole gradient.

``torch.nn.utils.clip_grad_norm_`` scales every gradient by

    coef = min(1, max_norm / (||g||_p + 1e-6)),     ||g||_p^p = sum over every parameter of ||g_param||_p^p

(Pascanu et al. 2013, "On the difficulty of training recurrent neural networks"; p = inf: the largest
|g|). Under data, tensor, pipeline or sharded data parallelism ||g|| is still the norm of the *whole*
model's gradient, but its pieces live on different ranks, some of them on several ranks at once
(replicas). So each rank adds up |g|^p over the pieces it holds, a replicated piece only where it is the
first copy (rank 0 of the group it is replicated over), and one all-reduce over the ranks sums them::

    2 x 2 mesh, tensor parallel over rows, data parallel over columns (DDP)
    rank 0: [W shard 0] [ln]     rank 1: [W shard 1] [ln]        W: cut over tp, ln: a tp replica
    rank 2: [W shard 0] [ln]     rank 3: [W shard 1] [ln]        every piece: a dp replica of the row above

    counted on rank 0: W shard 0, ln     rank 1: W shard 1     ranks 2, 3: nothing (copies of the row above)
    ||g||^2 = all_reduce_sum(what each rank counted)            (p = inf: all_reduce_max of every |g|)

`clip_grad_norm_(model, max_norm, norm_type)` (``dl.clip_grad_norm_``) asks `cuts.held` how this rank
holds each parameter of ``model`` (the same records the checkpoint reads: the cut is declared once), and
counts a piece where this rank is the first copy in every group it is copied over (`layout`):

    DDP(module, group)          every parameter of module        a replica over group
    fully_shard                 a shard                          distinct (HSDP: a replica over the replicas)
                                kept whole (replicate=)          a replica over the data-parallel group
    dl.tp layers (shard_dims)   the parameters they cut          distinct; the others: a replica over it
    ZeRO, ShardedOptimizer      its gradient shards (a marker)   distinct over its group (reduced first)
    dl.pp.Pipeline              its stages' parameters           distinct (a stage module alone: the same)

Bare parameters (``model.parameters()``) carry markers instead: fully_shard's ``_fsdp_copies`` and ZeRO's,
``_cut_over`` (`cuts.mark_cut`: a tensor- or expert-parallel layer cut it over that group) and
``_pipeline_of`` (a `dl.pp.Pipeline` stage holds it), from which `layout` rebuilds the same rule: over
the one group some were cut over, the others are replicas (counted on its rank 0); then the pipeline's
group sums the stages. Parameters cut over two different groups cannot be told apart: a ValueError
says to pass the model. A plain module, or parameters nothing marked, keep torch's rule on this rank
alone (DDP's replicas: equal there, so that is the norm). The explicit form
``clip_grad_norm_(params, max_norm, sharded=..., groups=[tp_group, pp_group])`` (what the strategies call)
names the groups instead: over ``groups[0]`` only the ``sharded`` parameters are summed (the others are
replicated there and counted once); every later group holds different parameters on each rank.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..runtime import device, group_rank
from . import collectives as C
from .cuts import held
from .mesh import as_group


@torch.no_grad()
def clip_grad_norm_(model_or_params, max_norm: float, norm_type: float = 2.0, *, group=None, sharded=None,
                    groups=None) -> torch.Tensor:
    """Scale the gradients so the whole model's gradient norm is at most ``max_norm``; returns that norm
    (before clipping, a 0-dim tensor), the same on every rank, as torch's does on one process.

    ``model_or_params``: a model (any distlab wrapper, or a module holding them), a ``dl.pp.Pipeline``, or
    parameters (fully_shard's and ZeRO's shards, tp/ep layers' cut parameters and pipeline stages' carry
    their layout: `layout`; parameters nothing marked are clipped by this rank's norm);
    ``norm_type``: p of the p-norm, or ``math.inf``; ``group``: the ranks that hold the model between
    them (default: every rank, once a wrapper spreads it; a 1-D mesh stands for its group).
    ``sharded``/``groups``: the explicit form.
    """
    group = as_group(group)                             # a 1-D mesh: its process group
    if groups is not None:
        groups = [as_group(g) for g in groups]
        pieces, grads, group = _explicit(list(model_or_params), sharded, groups)
    else:
        pieces, grads, over = layout(model_or_params)
        group = over if group is None else group
    total = _norm(pieces, norm_type, group)
    return scale_by(grads, total, max_norm)


def _norm(pieces: list, norm_type: float, group) -> torch.Tensor:
    """||g||_p from [(tensor, counted here)], summed (or maxed) over ``group`` (``False``: this rank only;
    a list: over each group in turn)."""
    inf = math.isinf(norm_type)
    dev = pieces[0][0].device if pieces else device()
    acc = torch.zeros(1, device=dev)                  # (1,): all-reduced as a one-element tensor
    for g, counted in pieces:
        if inf:
            acc = torch.maximum(acc, g.detach().abs().max().float().reshape(1)) if g.numel() else acc
        elif counted:
            acc += g.detach().float().abs().pow(norm_type).sum()
    for grp in ([] if group is False else group if isinstance(group, list) else [group]):
        (C.all_reduce_max if inf else C.all_reduce_sum)(acc, grp)
    return (acc if inf else acc.pow(1.0 / norm_type)).reshape(())


def _explicit(params: list, sharded, groups: list) -> tuple[list, list, list]:
    """The explicit form as pieces: over ``groups[0]`` the non-``sharded`` parameters count on its rank 0
    only (a replica there); then every group sums what its ranks counted."""
    ids = None if sharded is None else {id(p) for p in sharded}
    first = not groups or group_rank(groups[0]) == 0
    mine = [p for p in params if p.grad is not None]
    pieces = [(p.grad, ids is None or id(p) in ids or first) for p in mine]
    return pieces, [p.grad for p in mine], groups


def layout(model_or_params) -> tuple[list, list, object]:
    """([(gradient piece, counted on this rank)], the gradients to scale, what to sum over: None for every
    rank (a wrapper spreads the model), a list of groups (bare parameters' markers), or False (this rank
    alone)): what `clip_grad_norm_` adds up. A model: `cuts.held` says how this rank holds each
    parameter (the checkpoint reads the same records), and a piece copied over some groups counts where
    this rank is the first copy in each; bare parameters: their markers (`_marked`)."""
    roots, spread = _roots(model_or_params)
    if roots is None:
        params = list(model_or_params)
        copies, over, spread = _marked(params)
    else:
        where = held(roots)
        params = list({id(p): p for r in roots for p in r.parameters()}.values())
        copies, over = {i: h.copies for i, h in where.items()}, []
        spread |= any(h.cut_over or h.copies for h in where.values())         # cut or copied over ranks
        spread |= any(getattr(p, "_pipeline_of", ()) for p in params)      # a stage: the others complete it
        for p in params:                   # shards of a fully_shard unit above the module given: its marker
            if hasattr(p, "_fsdp_copies") and not where[id(p)].cut_over:
                spread = True
                copies[id(p)] = [*copies[id(p)], *([p._fsdp_copies.group] if p._fsdp_copies else [])]
    zeros = list({id(o): o for p in params if (o := _zero_optimizer(p)) is not None}.values())
    managed = {id(p) for opt in zeros for p in opt.params}
    mine = [p for p in params if p.grad is not None and id(p) not in managed]
    pieces = [(p.grad, _first(copies.get(id(p), ()))) for p in mine]
    grads = [p.grad for p in mine]
    for opt in zeros:                                  # ZeRO: the gradients are the optimizer's shards,
        opt.reduce_grads()                             # reduce-scattered first (ZeRO-1: else at the step),
        for bucket, g in zip(opt.buckets, opt.grad_shards):   # distinct over its group (DDP's too)
            pieces += [(g[piece], _first(copies.get(id(bucket.params[i]), ()), but=opt.comm.group))
                       for i, _, piece in bucket.owner_slices(opt.comm.rank)]
            grads.append(g)
    return pieces, grads, None if spread or zeros else (over or False)


def _marked(params: list) -> tuple[dict, list, bool]:
    """Bare parameters' markers -> ({id(parameter): [the groups it is copied over]}, [the group they were
    cut over, the pipeline's group], whether fully_shard spread them over every rank). Over the one group
    a tp/ep layer cut some over (`cuts.mark_cut`), the others are copies; two cut groups: ambiguous."""
    cut = {id(m[0]): m[0] for p in params if (m := getattr(p, "_cut_over", ()))}
    if len(cut) > 1:
        raise ValueError("these parameters were cut over more than one group (tensor and expert "
                         "parallelism?): from bare parameters dl.clip_grad_norm_ cannot tell which are "
                         "replicas where; pass the model (or the dl.pp.Pipeline), whose layers say so")
    stages = {id(m[0]): m[0] for p in params if (m := getattr(p, "_pipeline_of", ()))}
    copies = {id(p): list(cut.values()) for p in params if not getattr(p, "_cut_over", ())}
    fsdp = [p for p in params if hasattr(p, "_fsdp_copies")]     # fully_shard's: the ranks holding a copy
    for p in fsdp:
        copies.setdefault(id(p), []).extend([] if p._fsdp_copies is None else [p._fsdp_copies.group])
    return copies, [*cut.values(), *stages.values()], bool(fsdp)


def _zero_optimizer(p: torch.Tensor):
    """The `ShardedOptimizer` (ZeRO 1-3) holding ``p``'s gradient in shards (a weak reference), or None."""
    ref = getattr(p, "_zero_optimizer", None)
    return ref() if ref is not None else None


def _first(groups, but=()) -> bool:
    """Whether this rank holds the first copy of a piece replicated over ``groups`` (``but`` excepted)."""
    return all(group_rank(g) == 0 for g in groups if g is not but)


def _roots(obj) -> tuple[list[nn.Module] | None, bool]:
    """(the modules to read: the model, or a Pipeline's stages, which other ranks' stages complete; None
    for an iterable of parameters), and whether that already spreads the model over ranks."""
    if isinstance(obj, nn.Module):
        return [obj], False
    stages = getattr(obj, "modules", None)
    if isinstance(stages, dict):                       # dl.pp.Pipeline: {stage id: module}
        return list(stages.values()), True
    return None, False


def scale_by(grads, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's rule once the whole model's ``norm`` is known (equal on every rank): scale every tensor
    of ``grads`` by min(1, max_norm / (norm + 1e-6)); returns ``norm``."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


def scale_to_norm(grads, squared_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`scale_by` from the squared 2-norm (a one-element tensor); ZeRO's `ShardedOptimizer` ends here."""
    return scale_by(grads, squared_norm.reshape(-1).sqrt()[0], max_norm)


def grad_square_sum(params, sharded=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of ||g_p||^2 over the ``sharded`` parameters, the same over the others), in fp32.

    ``sharded``: a collection of parameters (compared by identity); None means every parameter."""
    ids = None if sharded is None else {id(p) for p in sharded}
    grads = [p for p in params if p.grad is not None]
    dev = grads[0].grad.device if grads else torch.device("cpu")
    sq_sharded, sq_replicated = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    for p in grads:
        (sq_sharded if ids is None or id(p) in ids else sq_replicated).add_(p.grad.float().pow(2).sum())
    return sq_sharded, sq_replicated


def sum_over(sq: torch.Tensor, groups) -> torch.Tensor:
    """``sq`` summed over every group of ``groups`` in turn (each holds different parameters per rank)."""
    for group in groups:
        sq = C.all_reduce_sum(sq, group)
    return sq
