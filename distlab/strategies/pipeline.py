"""Strategies ``pp-gpipe``, ``pp-1f1b``, ``pp-interleaved`` and ``pp-zb-h1``: one pipeline stage per rank.

Every rank builds the same model from the seed and keeps only its stage(s), cut by THE composition
function (`distlab.strategies.compose`: `dl.pp.stage_module`, ``balance`` "layers" or "params"); rank
r holds stages r, r + p, ... (``virtual`` of them for ``pp-interleaved``, default 2); the schedule is
``spec.layout.schedule``, which the name sets. Each step and each gradient-accumulation micro-step, rank
0 feeds the micro-step's batch and the last stage its targets to `dl.pp.Pipeline.step`, which splits it into
``microbatches`` (option; default 2p when the batch allows, else p) and runs the schedule, forward
and backward. Then an ordinary optimizer step on this rank's parameters: each parameter lives on
exactly one rank, so the optimizer never talks. Clipping uses the norm of the whole model's gradient
(`distlab.parallel.clip`: squared norms summed over the pipeline with one all-reduce). The steps run
in `distlab.strategies.loop`.

A mixture-of-experts GPT routes (capacity, dropped tokens, balance loss) per microbatch, so it trains as
``single`` with ``grad_accum`` times the microbatches; its balance losses, computed on the middle
stages, join the backward there (`balance_losses`).

Keywords (fields of ``spec.layout``): ``microbatches``, ``virtual`` (interleaved), ``balance``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..checkpoint.state import model_parallel_state
from ..memory import PipelineStash, pipeline_memory
from ..parallel.clip import clip_grad_norm_
from ..parallel.pipeline.aux_loss import ride_balance_losses
from ..parallel.pipeline.executor import Pipeline
from ..parallel.pipeline.measure import ActionTrace
from ..runtime import device, world_size
from .base import (
    RankResult,
    TrainSpec,
    autocast,
    build_model,
    dry_run,
    check_pieces,
    gather_params,
    global_batch,
    loss_fn,
    make_optimizer,
    microbatch_count,
)
from . import dry
from .compose import parallelize
from .loop import Plan, run

STRATEGIES = ("pp-gpipe", "pp-1f1b", "pp-interleaved", "pp-zb-h1")


def check(spec: TrainSpec, p: int) -> tuple[int, int]:
    """Refuse, before any rank starts, a pipeline ``p`` ranks cannot run: more stages than the model has
    pieces, microbatches the batch cannot supply. Returns (virtual stages per rank, microbatches)."""
    if spec.strategy not in STRATEGIES:
        raise ValueError(f"unknown pipeline strategy {spec.strategy!r}: choose one of {sorted(STRATEGIES)}")
    layout = spec.layout
    v = layout.virtual if layout.schedule == "interleaved" else 1
    m = microbatch_count(layout.microbatches, spec.micro_batch, p, layout.schedule,
                         "micro-step (global_batch / grad_accum)")
    check_pieces(spec, p * v, v)
    return v, m


def balance_losses(spec: TrainSpec, model, modules):
    """For a mixture-of-experts GPT: each MoE layer of this rank's stages adds its balance loss, times
    ``aux_coef`` and its microbatch's share of the batch, to the backward of its output
    (`dl.pp.ride_balance_losses`), as single adds it to the loss. Returns the function that adds every
    stage's terms of one micro-step to the loss the last stage reports (an untraced sum: metrics only)."""
    if not getattr(getattr(model, "cfg", None), "experts", 0):
        return lambda loss: loss
    share = lambda out: out.shape[0] / spec.micro_batch / spec.grad_accum      # noqa: E731  rows of a microbatch
    values = ride_balance_losses(torch.nn.ModuleList(modules), model.cfg.aux_coef, share)

    def with_aux(loss: torch.Tensor | None) -> torch.Tensor | None:
        total = torch.stack(values).sum() if values else torch.zeros((), device=device())
        values.clear()
        dist.all_reduce(total)                       # every stage's terms of this micro-step
        return None if loss is None else loss + total
    return with_aux


def train_rank(spec: TrainSpec) -> RankResult:
    p = world_size()
    v, m = check(spec, p)
    name = spec.layout.schedule
    model = build_model(spec)
    names = {id(q): n for n, q in model.named_parameters()}
    par = parallelize(model, spec.layout)               # PP over the world (`compose`): stages r, r + p, ...
    modules, ids, balance = par.stages, par.stage_ids, spec.layout.balance
    plain = loss_fn(spec)
    pipe = Pipeline(modules if v > 1 else modules[0], ids if v > 1 else ids[0], p * v, schedule=name,
                    microbatches=m, loss_fn=lambda out, y: plain(out, y) / spec.grad_accum)
    if dry_run():                                   # no shape headers through a fake group
        dry.seed_pipeline_shapes(pipe, spec.micro_batch, model)
    stash = PipelineStash()
    pipe.observers += [ActionTrace(), stash]              # measured from outside: spans, stash bytes
    params = list(pipe.parameters())
    optimizer = make_optimizer(params, spec)
    held = torch.nn.ModuleList(modules)             # this rank's stage(s): what a checkpoint holds

    with_aux = balance_losses(spec, model, modules)

    def forward(step: int, micro: int) -> torch.Tensor | None:
        x, y = global_batch(spec, step, micro)      # (B, ...): the first stage feeds x, the last takes y
        with autocast(spec):
            return with_aux(pipe.step(x if pipe.first else None, y if pipe.last else None))

    state = model_parallel_state(model, params, held, optimizer, loss_weight=pipe.last,
                                 keeps_history=pipe.last, layout={"virtual": v, "balance": balance})
    plan = Plan(forward, optimizer, state, backward=False,
                clip=lambda max_norm: clip_grad_norm_(params, max_norm, groups=[None]),
                memory=pipeline_memory(modules, optimizer, stash))
    trained = run(spec, plan)
    full = gather_params({names[id(q)]: q for q in params}, list(names.values()))
    param_bytes = sum(q.numel() * q.element_size() for q in params)
    return RankResult(losses=trained.losses if pipe.last else None, params=full,
                      info={"pp": p, "schedule": name, "virtual": v, "microbatches": m, "stages": ids,
                            "param_bytes": param_bytes, **trained.info})
