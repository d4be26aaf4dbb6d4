"""Strategies ``tp`` and ``tp-sp``: every rank trains one tensor-parallel shard of the same GPT.

All ranks form one TP group and see the *whole* global batch (tensor parallelism splits the model,
not the data). The model is laid out by THE composition function (`distlab.strategies.compose`:
`dl.tp.parallelize` over the world). Each step: forward and backward per micro-batch (the tensor-parallel
layers do the f/g communication), then an ordinary optimizer step on this rank's shards -- the optimizer never
talks, since every parameter is either a shard only this rank updates or replicated with equal
gradients on all ranks. ``spec.layout.sequence_parallel`` (``tp-sp`` sets it; ``tp`` takes
``sequence_parallel=True``) adds Megatron's sequence parallelism.

Gradient clipping uses the norm of the *full* gradient (`distlab.parallel.clip`): squared norms of
the shards summed over the group, replicated parameters counted once. The steps run in
`distlab.strategies.loop`.
"""
from __future__ import annotations

import torch

from ..checkpoint.state import model_parallel_state
from ..parallel import collectives as C
from ..parallel import tensor as tp_lib
from ..parallel.clip import clip_grad_norm_
from ..runtime import rank
from ..memory import replica_memory
from ..models import config
from .base import RankResult, TrainSpec, autocast, build_model, check_gpt, global_batch, make_optimizer
from .compose import parallelize
from .loop import Plan, run


def check_shards(spec: TrainSpec, t: int, sequence_parallel: bool, who: str) -> None:
    """Refuse, before any rank starts, a GPT whose heads or width (and, with sequence parallelism,
    sequence) do not split over ``t`` tensor-parallel ranks (`dl.tp.parallelize`'s rule); a vocabulary
    that does not split is padded when the model is built (`base.padded_vocab`, Megatron's rule)."""
    check_gpt(spec, who)
    cfg = config(spec.model)
    sizes = {"heads": cfg.heads, "d_model": cfg.d_model}        # the vocabulary is padded (`padded_vocab`)
    if sequence_parallel:
        sizes["seq_len"] = cfg.seq_len
    for what, size in sizes.items():
        tp_lib.check_divisible(f"{spec.model}'s {what}", size, t, "another model")


def check(spec: TrainSpec, world: int) -> None:
    """Refuse, before any rank starts, a model that ``world`` tensor-parallel ranks cannot split."""
    check_shards(spec, world, spec.layout.sequence_parallel, spec.strategy)


def sharded_params(modules) -> list[torch.Tensor]:
    """The parameters of ``modules`` that tensor parallelism cut (listed in their module's ``shard_dims``)."""
    return [p for m in modules for sub in m.modules() for name, p in sub.named_parameters(recurse=False)
            if name in getattr(sub, "shard_dims", {})]


def train_rank(spec: TrainSpec) -> RankResult:
    check_gpt(spec, spec.strategy)
    sp = spec.layout.sequence_parallel
    model = parallelize(build_model(spec), spec.layout).model      # TP over the world (`compose`)
    optimizer = make_optimizer(model.parameters(), spec)
    params = optimizer.param_groups[0]["params"]
    sharded = sharded_params([model])

    def forward(step: int, micro: int) -> torch.Tensor:
        ids, targets = global_batch(spec, step, micro)      # (B, s): every TP rank the whole batch
        with autocast(spec):
            return model.loss(ids, targets) / spec.grad_accum

    state = model_parallel_state(model, params, model, optimizer, loss_weight=rank() == 0, keeps_history=True,
                                 layout={"sequence_parallel": sp})
    plan = Plan(forward, optimizer, state,
                clip=lambda max_norm: clip_grad_norm_(params, max_norm, sharded=sharded, groups=[None]),
                memory=replica_memory(model, optimizer))
    trained = run(spec, plan)
    full = tp_lib.full_state_dict(model)
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return RankResult(losses=trained.losses, params=full if rank() == 0 else None,
                      info={"tp": C.group_size(), "sequence_parallel": sp, "param_bytes": shard_bytes,
                            **trained.info})
