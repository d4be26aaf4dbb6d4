"""Strategies ``pp-gpipe``, ``pp-1f1b``, ``pp-interleaved`` and ``pp-zb-h1``: one pipeline stage per rank.

Every rank builds the same model from the seed and keeps only its stage(s) (`dl.pp.stage_module`,
``balance`` option "layers" or "params"); rank r holds stages r, r + p, ... (``virtual`` of them for
``pp-interleaved``, default 2). Each step and each gradient-accumulation micro-step, rank 0 feeds the
micro-step's batch and the last stage its targets to `dl.pp.Pipeline.step`, which splits it into
``microbatches`` (option; default 2p when the batch allows, else p) and runs the schedule. Then an
ordinary optimizer step on this rank's parameters: each parameter lives on exactly one rank, so the
optimizer never talks. Clipping uses the norm of the whole model's gradient (squared norms summed
over the pipeline with one all-reduce).

Options: ``microbatches``, ``virtual`` (interleaved), ``balance``.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from ..checkpoint import training as checkpointing
from ..parallel.pipeline.executor import Pipeline
from ..parallel.pipeline.split import stage_module
from ..memory import PipelineStash
from ..parallel.pipeline.measure import ActionTrace
from ..runtime import device, rank, tracer, world_size
from .base import (RankResult, TrainSpec, autocast, build_model, clip_to_norm, global_batch, loss_fn,
                   make_optimizer, microbatch_count)

SCHEDULE_OF = {"pp-gpipe": "gpipe", "pp-1f1b": "1f1b", "pp-interleaved": "interleaved", "pp-zb-h1": "zb-h1"}


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Scale gradients so the whole pipeline's gradient norm is at most ``max_norm``; returns the norm."""
    sq = torch.zeros(1, device=device())
    for p in params:
        if p.grad is not None:
            sq += p.grad.float().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sq)
    return clip_to_norm(params, sq, max_norm)


def train_rank(spec: TrainSpec) -> RankResult:
    if spec.strategy not in SCHEDULE_OF:
        raise ValueError(f"unknown pipeline strategy {spec.strategy!r}: choose one of {sorted(SCHEDULE_OF)}")
    name = SCHEDULE_OF[spec.strategy]
    p, r = world_size(), rank()
    v = int(spec.options.get("virtual", 2)) if name == "interleaved" else 1
    m = microbatch_count(spec.options.get("microbatches"), spec.micro_batch, p, name,
                         "micro-step (global_batch / grad_accum)")
    model = build_model(spec)
    names = {id(q): n for n, q in model.named_parameters()}
    ids = [r + k * p for k in range(v)]
    modules = [stage_module(model, s, p * v, spec.options.get("balance", "layers")) for s in ids]
    pipe = Pipeline(modules if v > 1 else modules[0], ids if v > 1 else ids[0], p * v, schedule=name,
                    microbatches=m, loss_fn=loss_fn(spec))
    params = list(pipe.parameters())
    optimizer = make_optimizer(params, spec)
    pipe.observers += [ActionTrace(), PipelineStash()]    # measured from outside: spans, stash bytes
    held = torch.nn.ModuleList(modules)             # this rank's stage(s): what a checkpoint holds
    layout = checkpointing.model_parallel_layout(model, params, held, loss_weight=pipe.last,
                                                 keeps_history=pipe.last)
    ckpt = checkpointing.for_spec(spec, layout=layout)
    start, losses = ckpt.resume(held, None, optimizer)
    tr = tracer()
    for step in range(start, spec.steps):
        ckpt.before_step(step)
        tr.mark("step", step=step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(spec.grad_accum):
            x, y = global_batch(spec, step, micro)
            with autocast(spec):
                loss = pipe.step(x if pipe.first else None, y if pipe.last else None)
            if loss is not None:
                total += loss.item() / spec.grad_accum
        with tr.span("optimizer", step=step):
            if spec.grad_accum > 1:
                for q in params:
                    if q.grad is not None:
                        q.grad.div_(spec.grad_accum)
            if spec.clip is not None:
                clip_grad_norm(params, spec.clip)
            optimizer.step()
        losses.append(total)
        ckpt.after_step(step + 1, held, None, optimizer, losses)
    mine = {names[id(q)]: q.detach().cpu().clone() for q in params}
    gathered = [None] * p if r == 0 else None
    if dist.is_initialized() and p > 1:
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    full = None
    if r == 0:
        full = {}
        for part in gathered:
            full.update(part)
        full = {n: full[n] for n in names.values() if n in full}
    param_bytes = sum(q.numel() * q.element_size() for q in params)
    return RankResult(losses=losses if pipe.last else None, params=full,
                      info={"pp": p, "schedule": name, "virtual": v, "microbatches": m, "stages": ids,
                            "param_bytes": param_bytes, **ckpt.summary(start)})
