"""Strategies ``cp-ring`` and ``cp-ulysses``: every rank trains the whole GPT on a part of each sequence.

All ranks form one context-parallel group and draw the whole global batch; each keeps its part of
every sequence (``dl.cp.split(ids, dim=1)``: zig-zag for ring attention, contiguous for Ulysses by
default; ``options={"zigzag": ...}`` overrides) and runs the GPT of `dl.cp.parallelize`, whose
attention is exact over the whole sequence. The weights are replicated, so the gradients are
averaged by `dl.DDP` over the group: with equal token counts per rank,

    (1/n) sum_r grad mean_r(loss) = grad mean(loss)       (the single-process gradient)

and each rank's reported loss share is its local mean / n. The steps run in `distlab.strategies.loop`.

With data parallelism (``options={"dp": D}``, world = D x C): the ranks form the grid
``torch.arange(world).view(D, C)``; row d is a context-parallel group (consecutive ranks: the fast
links, since attention talks every layer) that takes replica d's rows of the global batch
(``torch.tensor_split`` into D, uneven allowed), and every rank averages gradients over the whole
world (weights are replicated along both axes), its loss scaled by D n_d / B as in `data_parallel`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..checkpoint.state import replicated_state
from ..memory import replica_memory
from ..models import PRESETS, shard
from ..parallel import collectives as C
from ..parallel import context as cp_lib
from ..parallel.context.layout import check_length
from ..parallel.data import DDP
from ..runtime import rank, world_size
from .base import (RankResult, TrainSpec, autocast, build_model, global_batch, loss_fn, rank0_copy,
                   require_rows)
from .data_parallel import LocalOptimizer
from .loop import Plan, run, sum_losses

ATTENTION = {"cp-ring": "ring", "cp-ulysses": "ulysses"}
OPTIONS = {name: ("dp", "zigzag", "bucket_mb") for name in ATTENTION}


def check(spec: TrainSpec, world: int) -> tuple[int, int, bool]:
    """Refuse what context parallelism cannot run, saying what to change; returns (dp, cp, zigzag)."""
    if spec.strategy not in ATTENTION:
        raise ValueError(f"context trains {sorted(ATTENTION)}, not {spec.strategy!r}")
    dp = spec.options.get("dp", 1)
    if not isinstance(dp, int) or dp < 1 or world % dp:
        raise ValueError(f"dp={dp!r} must be a positive integer dividing the world size {world} "
                         f"(the context-parallel degree is world / dp)")
    require_rows(spec, dp, "data-parallel replicas")
    n = world // dp
    if spec.model not in PRESETS:
        raise ValueError(f"{spec.strategy} splits the sequence of a GPT: choose a GPT preset such as "
                         f"model='gpt-tiny', not {spec.model!r}")
    if spec.precision != "fp32":
        raise ValueError(f"{spec.strategy} runs in fp32 here: pass precision='fp32'")
    zigzag = bool(spec.options.get("zigzag", spec.strategy == "cp-ring"))
    check_length(PRESETS[spec.model].seq_len, n, zigzag, what=f"{spec.model}'s sequence length")
    heads = PRESETS[spec.model].heads
    if spec.strategy == "cp-ulysses" and heads % n:
        raise ValueError(f"cp-ulysses splits {spec.model}'s {heads} heads over {n} ranks: use a world size "
                         f"that divides {heads}, or strategy='cp-ring'")
    return dp, n, zigzag


def cp_group(dp: int, cp: int):
    """(this rank's replica index, its context-parallel group): row d of arange(world).view(dp, cp).
    Every rank creates every group, in the same order (``new_group`` is collective over the world)."""
    if dp == 1:
        return 0, None
    rows = torch.arange(dp * cp).view(dp, cp).tolist()
    groups = [dist.new_group(row) for row in rows]
    d = rank() // cp
    C.name_group(groups[d], "cp")
    return d, groups[d]


def train_rank(spec: TrainSpec) -> RankResult:
    world, r = world_size(), rank()
    dp, n, zigzag = check(spec, world)
    d, group = cp_group(dp, n)
    model = cp_lib.parallelize(build_model(spec), attention=ATTENTION[spec.strategy], group=group,
                               zigzag=zigzag)
    wrapped = DDP(model, bucket_mb=spec.options.get("bucket_mb", 25.0))   # averages over the whole world
    opt = LocalOptimizer(model.parameters(), spec)
    criterion = loss_fn(spec)

    def forward(step: int, micro: int) -> torch.Tensor:
        ids, targets = global_batch(spec, step, micro)                     # (B, s) on every rank
        ids, targets = shard(ids, d, dp), shard(targets, d, dp)            # (B/dp, s): replica d's rows
        weight = dp * ids.shape[0] / spec.micro_batch / spec.grad_accum    # D n_d / (B k)
        ids, targets = (cp_lib.split(t, dim=1, group=group, zigzag=zigzag) for t in (ids, targets))
        with autocast(spec):                                               # (B/dp, s/cp) tokens
            return criterion(wrapped(ids), targets) * weight

    plan = Plan(forward, opt, replicated_state(model, opt, keeps_history=r == 0), loss_share=1 / world,
                no_sync=wrapped.no_sync, clip=opt.clip_grad_norm_,
                memory=replica_memory(model, opt.optimizer, ()))
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)
    params = rank0_copy(model.state_dict())
    return RankResult(losses=losses if r == 0 else None, params=params,
                      info={"cp": n, "dp": dp, "attention": ATTENTION[spec.strategy], "zigzag": zigzag,
                            **trained.info})
