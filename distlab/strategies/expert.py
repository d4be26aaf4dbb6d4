"""Strategy ``ep``: expert parallelism for a mixture-of-experts GPT, data parallelism for the rest.

As in GShard (Lepikhin et al. 2020) and DeepSpeed-MoE (Rajbhandari et al. 2022), all ranks form one
group: each holds E/n experts of every MoE layer (`dl.ep.parallelize`) and a whole copy of every other
parameter, and sees its own rows of the global batch (uneven splits allowed)::

    rank r: rows r of the batch -> attention (local) -> MoE: all-to-all to the experts' ranks,
            experts, all-to-all back -> ... -> loss share
    after backward: dense gradients summed over the group (one flat all-reduce per ~25 MB bucket,
            `data.buckets.grad_summer`); expert gradients already whole

Losses: each rank backpropagates its *share* of the global batch's loss, (n_r / B) * CE_r plus its
share of the load-balancing term (`models.moe.load_balancing_loss`), over ``grad_accum``. Summed over the
ranks the shares are single's loss, so the dense gradients are *summed* (the average over replicas of
each one's mean-loss gradient, weighted by its rows), and an expert's gradient, gathered through the
reverse all-to-all from every rank's tokens, needs nothing more. Clipping uses the whole model's norm
(expert shards summed over the group, replicated parameters counted once, as for tp). Checkpoints use
the "model-parallel" format: the experts' ``shard_dims`` record the cut, so they reshard like tp blocks.

``experts="replicated"``: the alternative expert parallelism replaces, every expert on every
rank (no all-to-all; the experts' gradients all-reduced with the rest), routed over the whole batch all
the same, so it too equals single; lesson 11 and ``benchmarks/expert_parallel.py`` set the two side by side.

With data parallelism (``dp=D``; the mesh spelling ``3d:dp=D,ep=E``, world = D x E):
the grid is ``torch.arange(world).view(D, E)``; row d is an expert-parallel group (consecutive ranks:
tokens travel inside it), column e the D replicas of the same experts. Every rank still takes its
own rows of the batch (rank r part r of n), the router's counts are all-gathered over the whole world
(`dispatch.plan`'s ``batch_group``: capacity, dropped tokens and the balance loss are the global
batch's, as in one process), dense gradients are summed over the world and expert gradients over
their D replicas only (each replica's experts saw the tokens of its own E ranks)::

    dense (attention, router, ...)    replicated over dp x ep     all-reduce over the world
    experts E/ep per rank             replicated over dp          all-reduce over the dp column
"""
from __future__ import annotations

import torch

from .. import models
from ..checkpoint.state import model_parallel_state
from ..memory import replica_memory
from ..parallel import expert as ep
from ..parallel.clip import clip_grad_norm_
from ..parallel.mesh import Mesh
from ..runtime import rank, world_size
from .base import (RankResult, TrainSpec, autocast, build_model, dry_run, global_batch, loss_fn,
                   make_optimizer, require_rows)
from .compose import parallelize
from .context import digests
from .loop import Plan, run, sum_losses


def check(spec: TrainSpec, n: int) -> None:
    """Refuse what ``ep`` cannot run on ``n`` ranks (called before any rank starts, and in each)."""
    dp = spec.layout.dp
    if not isinstance(dp, int) or dp < 1 or n % dp:
        raise ValueError(f"dp={dp!r} must be a positive integer dividing the world size {n} "
                         "(the expert-parallel degree is world / dp)")
    require_rows(spec, n)
    n //= dp
    cfg = models.config(spec.model)
    if cfg is None or not cfg.experts:
        moe = sorted(k for k, c in models.PRESETS.items() if c.experts)
        raise ValueError(f"strategy 'ep' splits the experts of a mixture-of-experts GPT, and {spec.model!r} "
                         f"has none: choose model= one of {moe}")
    if not replicated(spec) and cfg.experts % n:
        where, fix = (f"world_size={n}", "a world_size") if dp == 1 else (f"ep={n} ranks", "an ep degree")
        raise ValueError(f"{spec.model!r} has {cfg.experts} experts per layer, which cannot be split over "
                         f"{where}: choose {fix} that divides {cfg.experts}")


def mesh_of(dp: int, n: int) -> Mesh | None:
    """``arange(n).view(dp, n / dp)``: rows the ep groups, columns the dp groups (dp == 1: None, the world
    is the one ep group)."""
    return Mesh(dp=dp, ep=n // dp, world_size=n) if dp > 1 else None


def groups(dp: int, n: int):
    """(ep group, dp group) of this rank on ``arange(n).view(dp, n / dp)``: its row and its column
    (dp == 1: the world, None)."""
    mesh = mesh_of(dp, n)
    return (None, None) if mesh is None else (mesh.group("ep"), mesh.group("dp"))


def replicated(spec: TrainSpec) -> bool:
    """``experts="replicated"``: every expert on every rank (the baseline expert parallelism is measured
    against), routed over the whole batch as ``ep`` routes it, gradients all-reduced."""
    return spec.layout.experts == "replicated"


def train_rank(spec: TrainSpec) -> RankResult:
    n, r = world_size(), rank()
    check(spec, n)
    copies = replicated(spec)
    dp = spec.layout.dp
    mesh = mesh_of(dp, n)
    ep_group, dp_group = (None, None) if mesh is None else (mesh.group("ep"), mesh.group("dp"))
    # EP, then ep's DP (dense gradients summed over the world, experts' over their dp replicas): `compose`
    par = parallelize(build_model(spec), spec.layout, mesh, data_parallel=spec.data_parallel)
    model = par.model
    optimizer = make_optimizer(model.parameters(), spec)
    params = optimizer.param_groups[0]["params"]
    experts = [] if copies else ep.expert_params(model)
    criterion = loss_fn(spec)

    def forward(step: int, micro: int) -> torch.Tensor:
        x, y = global_batch(spec, step, micro)                 # (B, s): the micro-batch, every rank
        xs, ys = models.shard(x, r, n), models.shard(y, r, n)  # (B_r, s): this rank's rows
        with autocast(spec):
            ce = criterion(model(xs), ys)
        return (ce * xs.shape[0] / x.shape[0] + model.aux_loss()) / spec.grad_accum

    layout = {"ep": 1 if copies else n // dp} | ({"dp": dp} if dp > 1 else {})
    state = model_parallel_state(model, params, model, optimizer, loss_weight=True, keeps_history=r == 0,
                                 replica_group=dp_group, layout=layout)
    plan = Plan(forward, optimizer, state, sync_grads=par.sync_grads,
                clip=lambda max_norm: clip_grad_norm_(params, max_norm, sharded=experts, groups=[ep_group]),
                memory=replica_memory(model, optimizer))
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)                        # each rank's share, summed
    full = None if dry_run() else ep.full_state_dict(model)   # a dry run's parameters have no values
    expert_bytes = sum(p.numel() * p.element_size() for p in ep.expert_params(model))
    return RankResult(losses=losses if r == 0 else None, params=full if r == 0 else None,
                      info={"ep": 1 if copies else n // dp, "dp": dp,
                            "experts": "replicated" if copies else "split",
                            "expert_param_bytes": expert_bytes, **digests(model), **trained.info})
