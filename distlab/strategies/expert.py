"""Strategy ``ep``: expert parallelism for a mixture-of-experts GPT, data parallelism for the rest.

As in GShard (Lepikhin et al. 2020) and DeepSpeed-MoE (Rajbhandari et al. 2022), all ranks form one
group: each holds E/n experts of every MoE layer (`dl.ep.parallelize`) and a whole copy of every other
parameter, and sees its own rows of the global batch (uneven splits allowed)::

    rank r: rows r of the batch -> attention (local) -> MoE: all-to-all to the experts' ranks,
            experts, all-to-all back -> ... -> loss share
    after backward: dense gradients summed over the group (one flat all-reduce per ~25 MB bucket,
            `data.buckets.bucketize`); expert gradients already whole

Losses: each rank backpropagates its *share* of the global batch's loss, (n_r / B) * CE_r plus its
share of the load-balancing term (`router.load_balancing_loss`), over ``grad_accum``. Summed over the
ranks the shares are single's loss, so the dense gradients are *summed* (the average over replicas of
each one's mean-loss gradient, weighted by its rows), and an expert's gradient, gathered through the
reverse all-to-all from every rank's tokens, needs nothing more. Clipping uses the whole model's norm
(expert shards summed over the group, replicated parameters counted once, as for tp). Checkpoints use
the "model-parallel" format: the experts' ``shard_dims`` record the cut, so they reshard like tp blocks.

``options={"experts": "replicated"}``: the alternative expert parallelism replaces, every expert on every
rank (no all-to-all; the experts' gradients all-reduced with the rest), routed over the whole batch all
the same, so it too equals single; lesson 11 and ``benchmarks/expert_parallel.py`` set the two side by side.
"""
from __future__ import annotations

import torch

from .. import models
from ..checkpoint.state import model_parallel_state
from ..parallel import collectives as C
from ..parallel import expert as ep
from ..parallel.clip import clip_grad_norm_
from ..parallel.data.buckets import bucketize
from ..runtime import rank, world_size
from .base import (RankResult, TrainSpec, autocast, build_model, global_batch, loss_fn, make_optimizer,
                   require_rows)
from .loop import Plan, run, sum_losses


def check(spec: TrainSpec, n: int) -> None:
    """Refuse what ``ep`` cannot run on ``n`` ranks (called before any rank starts, and in each)."""
    cfg = models.PRESETS.get(spec.model)
    if cfg is None or not cfg.experts:
        moe = sorted(k for k, c in models.PRESETS.items() if c.experts)
        raise ValueError(f"strategy 'ep' splits the experts of a mixture-of-experts GPT, and {spec.model!r} "
                         f"has none: choose model= one of {moe}")
    if not replicated(spec) and cfg.experts % n:
        raise ValueError(f"{spec.model!r} has {cfg.experts} experts per layer, which cannot be split over "
                         f"world_size={n}: choose a world_size that divides {cfg.experts}")
    require_rows(spec, n)


#: Strategies that train a mixture-of-experts model, and how. The data-parallel ones replicate the experts
#: and each replica routes its own rows (capacity and balance loss per replica, as DeepSpeed with ep=1);
#: ``ep`` splits them and routes over the whole batch, so it equals ``single`` on the same global batch.
MOE_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "ep")
#: and the pipelines (pp-*), which route per microbatch: as single with grad_accum x microbatches.


def refuse_moe(spec: TrainSpec) -> None:
    """Refuse a mixture-of-experts model under a strategy that would silently train it wrong (called
    before any rank starts): tensor parallelism does not split experts, context parallelism routes a
    part of each sequence and its loss carries no load-balancing term, and the 3d mesh (whose pipeline
    criterion has none either) runs it only on an ep= axis."""
    cfg = models.PRESETS.get(spec.model)
    if cfg is None or not cfg.experts:
        return
    s, why = spec.strategy, None
    if s.startswith("3d:"):
        from .mesh import parse
        d = parse(s, spec.options)
        if d.get("ep", 1) == 1 or any(d.get(k, 1) > 1 for k in ("tp", "pp", "cp")):
            why = ("tensor parallelism does not split experts and the mesh's pipeline loss has no "
                   "load-balancing term (a mesh runs it only on an ep= axis with dp, where it has one)")
    elif s not in MOE_STRATEGIES and not s.startswith("pp-"):
        why = {"tp": "tensor parallelism does not split experts",
               "cp": "context parallelism routes each rank's part of a sequence on its own and its loss "
                     "has no load-balancing term"}.get(s[:2], "it has no mixture-of-experts support")
    if why:
        raise ValueError(f"strategy {s!r} cannot train the mixture-of-experts model {spec.model!r}: {why}. "
                         f"Use strategy='ep' (experts split over the ranks, equal to single) or one of "
                         f"{MOE_STRATEGIES[:-1]} (experts replicated, each replica routing its own rows), "
                         f"a pp-* pipeline (routing per microbatch), or a dense model (model='gpt-tiny')")


def replicated(spec: TrainSpec) -> bool:
    """``options={"experts": "replicated"}``: every expert on every rank (the baseline expert parallelism
    is measured against), routed over the whole batch as ``ep`` routes it, gradients all-reduced."""
    how = spec.options.get("experts", "split")
    if how not in ("split", "replicated"):
        raise ValueError(f"options['experts']={how!r}: choose 'split' (expert parallelism) or 'replicated'")
    return how == "replicated"


def grad_sync(params: list[torch.Tensor], bucket_mb: float = 25.0):
    """A function summing the gradients of ``params`` (the replicated ones) over the world: one flat
    all-reduce per bucket of ~``bucket_mb`` MB (`data.buckets.bucketize`: reverse order, one dtype)."""
    buckets = bucketize(params, bucket_mb)

    def sync() -> None:
        for bucket in buckets:
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in bucket]
            flat = C.all_reduce(torch.cat([g.flatten() for g in grads]))          # (sum of numel,)
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad = g.view_as(p)
    return sync


def train_rank(spec: TrainSpec) -> RankResult:
    n, r = world_size(), rank()
    check(spec, n)
    copies = replicated(spec)
    model = ep.parallelize(build_model(spec), replicate=copies)   # experts split over the world (or not)
    optimizer = make_optimizer(model.parameters(), spec)
    params = optimizer.param_groups[0]["params"]
    experts = [] if copies else ep.expert_params(model)
    dense = [p for p in params if all(p is not e for e in experts)]
    sync_grads = grad_sync(dense, float(spec.options.get("bucket_mb", 25.0)))
    criterion = loss_fn(spec)

    def forward(step: int, micro: int) -> torch.Tensor:
        x, y = global_batch(spec, step, micro)                 # (B, s): the micro-batch, every rank
        xs, ys = models.shard(x, r, n), models.shard(y, r, n)  # (B_r, s): this rank's rows
        with autocast(spec):
            ce = criterion(model(xs), ys)
        return (ce * xs.shape[0] / x.shape[0] + model.aux_loss()) / spec.grad_accum

    state = model_parallel_state(model, params, model, optimizer, loss_weight=True, keeps_history=r == 0,
                                 layout={"ep": 1 if copies else n})
    plan = Plan(forward, optimizer, state, sync_grads=sync_grads,
                clip=lambda max_norm: clip_grad_norm_(params, max_norm, sharded=experts, groups=[None]))
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)                        # each rank's share, summed
    full = ep.full_state_dict(model)
    expert_bytes = sum(p.numel() * p.element_size() for p in ep.expert_params(model))
    return RankResult(losses=losses if r == 0 else None, params=full if r == 0 else None,
                      info={"ep": 1 if copies else n, "experts": "replicated" if copies else "split",
                            "expert_param_bytes": expert_bytes, **trained.info})
