"""Strategies ``cp-ring`` and ``cp-ulysses``: every rank trains the whole GPT on a part of each sequence.

All ranks form one context-parallel group and draw the whole global batch; each keeps its part of
every sequence (``dl.cp.split(ids, dim=1)``: zig-zag for ring attention, contiguous for Ulysses by
default; ``zigzag=...`` overrides) and runs the GPT of `dl.cp.parallelize`, whose
attention is exact over the whole sequence. The weights are replicated, so the gradients are
averaged by `dl.DDP` over the group: with equal token counts per rank,

    (1/n) sum_r grad mean_r(loss) = grad mean(loss)       (the single-process gradient)

and each rank's reported loss share is its local mean / n. The steps run in `distlab.strategies.loop`.

With data parallelism (``dp=D``, world = D x C): the ranks form the grid
``torch.arange(world).view(D, C)``; row d is a context-parallel group (consecutive ranks: the fast
links, since attention talks every layer) that takes replica d's rows of the global batch
(``torch.tensor_split`` into D, uneven allowed), and every rank averages gradients over the whole
world (weights are replicated along both axes), its loss scaled by D n_d / B as in `data_parallel`.

With tensor parallelism too (``tp=T``, world = D x C x T; the mesh spelling
``3d:dp=D,cp=C,tp=T``): the grid is ``torch.arange(world).view(D, C, T)`` (tp fastest, as in
Megatron-LM); `dl.tp.parallelize` splits heads, MLP and vocabulary over each row ``grid[d, c, :]``,
``dl.cp.parallelize`` the sequence over ``grid[d, :, t]`` (attention on this rank's a/T heads), the
loss is the vocabulary-parallel cross-entropy, and the gradients are averaged over the D x C ranks
holding the same shards, ``grid[:, :, t]`` (the "replicas"); clipping uses the whole model's norm.

The grid is a `dl.Mesh(dp=D, cp=C, tp=T)`, and the model is laid out on it by THE composition function,
`distlab.strategies.compose.parallelize`: TP, then CP, then DDP over the replicas.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

import torch

from ..checkpoint.state import model_parallel_state, replicated_state
from ..memory import replica_memory
from ..models import config, shard
from ..parallel import collectives as C
from ..parallel import context as cp_lib
from ..parallel import tensor as tp_lib
from ..parallel.clip import clip_grad_norm_
from ..parallel.context.layout import check_length
from ..parallel.mesh import Mesh
from ..runtime import rank, world_size
from .base import (RankResult, TrainSpec, autocast, build_model, global_batch, loss_fn, rank0_copy,
                   require_rows)
from .compose import parallelize
from .data_parallel import LocalOptimizer
from .loop import Plan, run, sum_losses
from .tensor import sharded_params

STRATEGIES = ("cp-ring", "cp-ulysses")


def check(spec: TrainSpec, world: int) -> tuple[int, int, bool]:
    """Refuse what context parallelism cannot run, saying what to change; returns (dp, cp, zigzag)."""
    if spec.strategy not in STRATEGIES:
        raise ValueError(f"context trains {STRATEGIES}, not {spec.strategy!r}")
    dp, tp = spec.layout.dp, spec.layout.tp
    if not isinstance(tp, int) or tp < 1 or world % tp:
        raise ValueError(f"tp={tp!r} must be a positive integer dividing the world size {world}")
    if not isinstance(dp, int) or dp < 1 or (world // tp) % dp:
        raise ValueError(f"dp={dp!r} must be a positive integer dividing the world size {world // tp} "
                         f"(the context-parallel degree is world / (dp tp))")
    require_rows(spec, dp, "data-parallel replicas")
    n = world // dp // tp
    if config(spec.model) is None:
        raise ValueError(f"{spec.strategy} splits the sequence of a GPT: choose a GPT preset such as "
                         f"model='gpt-tiny', not {spec.model!r}")
    if spec.precision != "fp32":
        raise ValueError(f"{spec.strategy} runs in fp32 here: pass precision='fp32'")
    zigzag = spec.layout.zigzag if spec.layout.zigzag is not None else spec.layout.attention == "ring"
    check_length(config(spec.model).seq_len, n, zigzag, what=f"{spec.model}'s sequence length")
    cfg = config(spec.model)
    for what, size in (("heads", cfg.heads), ("d_model", cfg.d_model), ("vocab", cfg.vocab)):
        tp_lib.check_divisible(what, size, tp, "choose another model or tp")
    heads = cfg.heads // tp
    if spec.layout.attention == "ulysses" and heads % n:
        raise ValueError(f"cp-ulysses splits {spec.model}'s {heads} heads{' per tp rank' if tp > 1 else ''} "
                         f"over {n} ranks: use a cp degree that divides {heads}, or strategy='cp-ring'")
    return dp, n, zigzag


def train_rank(spec: TrainSpec) -> RankResult:
    world, r = world_size(), rank()
    dp, n, zigzag = check(spec, world)
    tp = spec.layout.tp
    mesh = Mesh(dp=dp, cp=n, tp=tp)                          # arange(world).view(dp, cp, tp), tp fastest
    layout = replace(spec.layout, zigzag=zigzag, cp=n)
    par = parallelize(build_model(spec), layout, mesh, data_parallel=spec.data_parallel)     # TP->CP->DP
    model, d = par.model, mesh.coords().dp
    groups = {"tp": mesh.group("tp") if tp > 1 else None, "cp": mesh.group("cp"), "dp": par.replicas}
    opt = LocalOptimizer(model.parameters(), spec)
    criterion = _criterion(spec, model, groups["tp"])

    def forward(step: int, micro: int) -> torch.Tensor:
        ids, targets = global_batch(spec, step, micro)                     # (B, s) on every rank
        ids, targets = shard(ids, d, dp), shard(targets, d, dp)            # (B/dp, s): replica d's rows
        weight = dp * ids.shape[0] / spec.micro_batch / spec.grad_accum    # D n_d / (B k)
        ids, targets = (cp_lib.split(t, dim=1, group=groups["cp"], zigzag=zigzag) for t in (ids, targets))
        with autocast(spec):                                               # (B/dp, s/cp) tokens
            return criterion(model(ids), targets) * weight                 # DDP averages in backward

    plan = Plan(forward, opt, _state(model, opt, groups, tp), loss_share=1 / (dp * n),
                no_sync=par.ddp.no_sync if par.ddp is not None else None, clip=_clip(model, opt, groups, tp),
                memory=replica_memory(model, opt.optimizer, ()), loss_group=groups["dp"])
    trained = run(spec, plan)
    losses = sum_losses(trained.losses, groups["dp"])
    params = rank0_copy(tp_lib.full_state_dict(model) if tp > 1 else model.state_dict())
    return RankResult(losses=losses if r == 0 else None, params=params,
                      info={"cp": n, "dp": dp, "tp": tp, "attention": spec.layout.attention,
                            "zigzag": zigzag, **digests(model), **trained.info})


def digests(model) -> dict:
    """What the invariant tests read: this rank's tensors' bytes, shapes and digests (replicas must agree)."""
    local = dict(model.named_parameters())
    return {"param_bytes": sum(p.numel() * p.element_size() for p in local.values()),
            "shapes": {n: tuple(p.shape) for n, p in local.items()},
            "digests": {n: hashlib.sha1(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
                        for n, p in local.items() if not p.is_meta}}       # a dry run's have no bytes


def _criterion(spec: TrainSpec, model, tp_group):
    """Mean cross-entropy over this rank's tokens: plain, or vocabulary-parallel over ``tp_group``."""
    if tp_group is None:
        return loss_fn(spec)

    def vocab_parallel(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:   # (b, s/c, V/t)
        return tp_lib.vocab_parallel_cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                   model.tok.vocab_start, tp_group).mean()
    return vocab_parallel


def _clip(model, opt, groups: dict, tp: int):
    """The whole model's gradient norm: tp shards summed over the tp group, replicated counted once."""
    if tp == 1:
        return opt.clip_grad_norm_
    params, sharded = list(model.parameters()), sharded_params([model])
    return lambda max_norm: clip_grad_norm_(params, max_norm, sharded=sharded, groups=[groups["tp"]])


def _state(model, opt, groups: dict, tp: int):
    """What a checkpoint holds: the replicated model, or (cp x tp) this rank's shards, replicated over
    the dp x cp ranks that hold the same ones."""
    if tp == 1:
        return replicated_state(model, opt, keeps_history=rank() == 0)
    return model_parallel_state(model, opt.masters, model, opt.optimizer, loss_weight=rank() % tp == 0,
                                keeps_history=rank() == 0, replica_group=groups["dp"],
                                layout={"tp": tp, "cp": C.group_size(groups["cp"])})
