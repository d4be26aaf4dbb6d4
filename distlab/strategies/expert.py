"""Strategy ``ep``: expert parallelism for a mixture-of-experts GPT, data parallelism for the rest.

As in GShard (Lepikhin et al. 2020) and DeepSpeed-MoE (Rajbhandari et al. 2022), all ranks form one
group: each holds E/n experts of every MoE layer (`dl.ep.parallelize`) and a whole copy of every other
parameter, and sees its own rows of the global batch (uneven splits allowed)::

    rank r: rows r of the batch -> attention (local) -> MoE: all-to-all to the experts' ranks,
            experts, all-to-all back -> ... -> loss share
    after backward: dense gradients summed over the group; expert gradients already whole

Losses: each rank backpropagates its *share* of the global batch's loss, (n_r / B) * CE_r plus its
share of the load-balancing term (`router.load_balancing_loss`), over ``grad_accum``. Summed over the
ranks the shares are single's loss, so the dense gradients are *summed* (the average over replicas of
each one's mean-loss gradient, weighted by its rows), and an expert's gradient, gathered through the
reverse all-to-all from every rank's tokens, needs nothing more. Clipping uses the whole model's norm
(expert shards summed over the group, replicated parameters counted once, as for tp). Checkpoints use
the "model-parallel" format: the experts' ``shard_dims`` record the cut, so they reshard like tp blocks.
"""
from __future__ import annotations

import torch

from .. import models
from ..checkpoint.state import model_parallel_state
from ..memory import replica_memory
from ..parallel import collectives as C
from ..parallel import expert as ep
from ..parallel.clip import clip_grad_norm_
from ..runtime import rank, world_size
from .base import (RankResult, TrainSpec, autocast, build_model, global_batch, loss_fn, make_optimizer,
                   require_rows)
from .loop import Plan, run, sum_losses


OPTIONS = {"ep": ()}


def check(spec: TrainSpec, n: int) -> None:
    """Refuse what ``ep`` cannot run on ``n`` ranks (called before any rank starts, and in each)."""
    cfg = models.PRESETS.get(spec.model)
    if cfg is None or not cfg.experts:
        moe = sorted(k for k, c in models.PRESETS.items() if c.experts)
        raise ValueError(f"strategy 'ep' splits the experts of a mixture-of-experts GPT, and {spec.model!r} "
                         f"has none: choose model= one of {moe}")
    if cfg.experts % n:
        raise ValueError(f"{spec.model!r} has {cfg.experts} experts per layer, which cannot be split over "
                         f"world_size={n}: choose a world_size that divides {cfg.experts}")
    require_rows(spec, n)


def train_rank(spec: TrainSpec) -> RankResult:
    n, r = world_size(), rank()
    check(spec, n)
    model = ep.parallelize(build_model(spec))                  # experts split over the world
    optimizer = make_optimizer(model.parameters(), spec)
    params = optimizer.param_groups[0]["params"]
    experts = ep.expert_params(model)
    dense = [p for p in params if all(p is not e for e in experts)]
    criterion = loss_fn(spec)

    def forward(step: int, micro: int) -> torch.Tensor:
        x, y = global_batch(spec, step, micro)                 # (B, s): the micro-batch, every rank
        xs, ys = models.shard(x, r, n), models.shard(y, r, n)  # (B_r, s): this rank's rows
        with autocast(spec):
            ce = criterion(model(xs), ys)
        return (ce * xs.shape[0] / x.shape[0] + model.aux_loss()) / spec.grad_accum

    def sync_grads() -> None:
        for p in dense:                                        # one all-reduce per tensor, as NaiveDDP
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            C.all_reduce(p.grad)

    state = model_parallel_state(model, params, model, optimizer, loss_weight=True, keeps_history=r == 0,
                                 layout={"ep": n})
    plan = Plan(forward, optimizer, state, sync_grads=sync_grads,
                clip=lambda max_norm: clip_grad_norm_(params, max_norm, sharded=experts, groups=[None]),
                memory=replica_memory(model, optimizer))
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)                        # each rank's share, summed
    full = ep.full_state_dict(model)
    expert_bytes = sum(p.numel() * p.element_size() for p in experts)
    return RankResult(losses=losses if r == 0 else None, params=full if r == 0 else None,
                      info={"ep": n, "expert_param_bytes": expert_bytes, **trained.info})
