"""Strategies ``tp`` and ``tp-sp``: every rank trains one tensor-parallel shard of the same GPT.

All ranks form one TP group and see the *whole* global batch (tensor parallelism splits the model,
not the data). Each step: forward and backward per micro-batch (`dl.tp.parallelize`'s layers do the
f/g communication), then an ordinary optimizer step on this rank's shards -- the optimizer never
talks, since every parameter is either a shard only this rank updates or replicated with equal
gradients on all ranks. ``options={"sequence_parallel": True}`` is what ``tp-sp`` sets.

Gradient clipping uses the norm of the *full* gradient: squared norms of the shards summed over the
group, replicated parameters counted once.
"""
from __future__ import annotations


import torch

from ..checkpoint import training as checkpointing
from ..parallel import tensor as tp_lib
from ..parallel import collectives as C
from ..runtime import device, rank, tracer
from .base import RankResult, TrainSpec, autocast, build_model, clip_to_norm, global_batch, make_optimizer


def _sharded_params(model) -> set[int]:
    return {id(p) for m in model.modules() for name, p in m.named_parameters(recurse=False)
            if name in getattr(m, "shard_dims", {})}


def clip_grad_norm(model, max_norm: float, group=None) -> float:
    """Scale gradients so the full model's gradient norm is at most ``max_norm``; returns the norm."""
    sharded = _sharded_params(model)
    params = [p for p in model.parameters() if p.grad is not None]
    sq_shards = torch.zeros((), device=device())
    sq_replicated = torch.zeros((), device=device())
    for p in params:
        if id(p) in sharded:
            sq_shards += p.grad.float().pow(2).sum()
        else:
            sq_replicated += p.grad.float().pow(2).sum()
    sq_shards = C.all_reduce(sq_shards.reshape(1), group, phase="step", operator="grad_norm").reshape(())
    return clip_to_norm(params, sq_shards + sq_replicated, max_norm)


def train_rank(spec: TrainSpec) -> RankResult:
    if spec.model == "mlp":
        raise ValueError("tp and tp-sp shard a GPT (attention heads, MLP, vocabulary): choose a GPT preset "
                         "such as model='gpt-tiny'")
    sp = spec.strategy == "tp-sp" or bool(spec.options.get("sequence_parallel", False))
    model = tp_lib.parallelize(build_model(spec), sequence_parallel=sp)
    optimizer = make_optimizer(model.parameters(), spec)
    layout = checkpointing.model_parallel_layout(model, optimizer.param_groups[0]["params"], model,
                                                 loss_weight=rank() == 0, keeps_history=True)
    ckpt = checkpointing.for_spec(spec, layout=layout)
    start, losses = ckpt.resume(model, None, optimizer)
    tr = tracer()
    for step in range(start, spec.steps):
        ckpt.before_step(step)
        tr.mark("step", step=step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(spec.grad_accum):
            ids, targets = global_batch(spec, step, micro)
            with tr.span("forward", step=step, microbatch=micro), autocast(spec):
                loss = model.loss(ids, targets) / spec.grad_accum
            with tr.span("backward", step=step, microbatch=micro):
                loss.backward()
            total += loss.item()
        with tr.span("optimizer", step=step):
            if spec.clip is not None:
                clip_grad_norm(model, spec.clip)
            optimizer.step()
        losses.append(total)
        ckpt.after_step(step + 1, model, None, optimizer, losses)
    full = tp_lib.full_state_dict(model)
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return RankResult(losses=losses, params=full if rank() == 0 else None,
                      info={"tp": C.group_size(), "sequence_parallel": sp, "param_bytes": shard_bytes,
                            **ckpt.summary(start)})
