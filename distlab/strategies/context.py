"""Strategies ``cp-ring`` and ``cp-ulysses``: every rank trains the whole GPT on a part of each sequence.

All ranks form one context-parallel group and draw the whole global batch; each keeps its part of
every sequence (``dl.cp.split(ids, dim=1)``: zig-zag for ring attention, contiguous for Ulysses by
default; ``options={"zigzag": ...}`` overrides) and runs the GPT of `dl.cp.parallelize`, whose
attention is exact over the whole sequence. The weights are replicated, so the gradients are
averaged by `dl.DDP` over the group: with equal token counts per rank,

    (1/n) sum_r grad mean_r(loss) = grad mean(loss)       (the single-process gradient)

and each rank's reported loss share is its local mean / n. The steps run in `distlab.strategies.loop`.
"""
from __future__ import annotations

import torch

from ..checkpoint.state import replicated_state
from ..memory import replica_memory
from ..models import PRESETS
from ..parallel import context as cp_lib
from ..parallel.context.layout import check_length
from ..parallel.data import DDP
from ..runtime import rank, world_size
from .base import RankResult, TrainSpec, autocast, build_model, global_batch, loss_fn
from .data_parallel import LocalOptimizer
from .loop import Plan, run, sum_losses

ATTENTION = {"cp-ring": "ring", "cp-ulysses": "ulysses"}


def check(spec: TrainSpec, n: int) -> bool:
    """Refuse what context parallelism cannot run, saying what to change; returns ``zigzag``."""
    if spec.strategy not in ATTENTION:
        raise ValueError(f"context trains {sorted(ATTENTION)}, not {spec.strategy!r}")
    if spec.model not in PRESETS:
        raise ValueError(f"{spec.strategy} splits the sequence of a GPT: choose a GPT preset such as "
                         f"model='gpt-tiny', not {spec.model!r}")
    zigzag = bool(spec.options.get("zigzag", spec.strategy == "cp-ring"))
    check_length(PRESETS[spec.model].seq_len, n, zigzag, what=f"{spec.model}'s sequence length")
    heads = PRESETS[spec.model].heads
    if spec.strategy == "cp-ulysses" and heads % n:
        raise ValueError(f"cp-ulysses splits {spec.model}'s {heads} heads over {n} ranks: use a world size "
                         f"that divides {heads}, or strategy='cp-ring'")
    return zigzag


def train_rank(spec: TrainSpec) -> RankResult:
    n, r = world_size(), rank()
    zigzag = check(spec, n)
    if spec.precision != "fp32":
        raise ValueError(f"{spec.strategy} runs in fp32 here: pass precision='fp32'")
    model = cp_lib.parallelize(build_model(spec), attention=ATTENTION[spec.strategy], zigzag=zigzag)
    wrapped = DDP(model, bucket_mb=spec.options.get("bucket_mb", 25.0))     # averages gradients over cp
    opt = LocalOptimizer(model.parameters(), spec)
    criterion = loss_fn(spec)

    def forward(step: int, micro: int) -> torch.Tensor:
        ids, targets = global_batch(spec, step, micro)                     # (B, s) on every rank
        ids, targets = (cp_lib.split(t, dim=1, zigzag=zigzag) for t in (ids, targets))   # (B, s/n)
        with autocast(spec):
            return criterion(wrapped(ids), targets) / spec.grad_accum

    plan = Plan(forward, opt, replicated_state(model, opt, keeps_history=r == 0), loss_share=1 / n,
                no_sync=wrapped.no_sync, clip=opt.clip_grad_norm_,
                memory=replica_memory(model, opt.optimizer, ()))
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)
    params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()} if r == 0 else None
    return RankResult(losses=losses if r == 0 else None, params=params,
                      info={"cp": n, "attention": ATTENTION[spec.strategy], "zigzag": zigzag, **trained.info})
