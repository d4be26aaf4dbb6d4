"""Strategy ``3d:dp=D,tp=T,pp=P``: tensor parallelism inside each pipeline stage, a pipeline over the
pp group, and data parallelism over the dp group (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", the "PTD-P" composition).

Every rank builds the same full GPT from the seed, then, by its coordinates in `Mesh(D, T, P)`, lays it
out with THE composition function, `distlab.strategies.compose.parallelize` (the order's reasons there)::

    1. TP   dl.tp.parallelize(gpt, group=tp_group)      keep 1/T of every big matrix
    2. PP   dl.pp.stage_module(gpt, stage, P)            keep the layers of pipeline stage pp_rank
    3. DP   DDP(stage, group=dp_group)                   replicas average their gradients
            (or ZeRO-1: ShardedOptimizer over dp_group,  zero=1)

Each step every dp replica takes its rows of the global batch (``torch.tensor_split`` into D,
uneven allowed) and runs it through its pipeline (`dl.pp.Pipeline` over pp_group, schedule
``1f1b`` by default, ``microbatches`` default 2P when the rows allow, else P). Inside a stage the
T ranks of its TP group see the same microbatch and run the Megatron f/g collectives; the last
stage computes the vocabulary-parallel cross-entropy on logits split by vocabulary. The pipeline
accumulates gradients over microbatches, so the dp all-reduce runs once per step, not once per
microbatch: the micro-steps run under ``DDP.no_sync()``, except the last microbatch's backward on
each rank, which runs under ``ReplicaGradSync.last_backward()`` (`distlab.parallel.pipeline.grad_sync`):
each bucket's all-reduce starts as soon as that backward has filled it, while the input gradient already
travels upstream, and ``ReplicaGradSync.finish()`` waits for them after the flush (Megatron's
``overlap_grad_reduce`` and ``finalize_model_grads``). Where one B pass does not finish every gradient of
the rank (interleaved chunks, zero bubble's I/W split), ``finish`` all-reduces every bucket after the
flush instead.

Exactness on the same global batch as ``single``: replica d's loss is scaled by D n_d / (B k)
(n_d its rows, B the global batch, k = grad_accum), so averaging over D replicas and summing over
k micro-steps gives exactly the gradient of the global mean loss.

The layout (``spec.layout``, read from the name, ``"3d:dp=2,tp=2,pp=2,zero=1,schedule=gpipe"``, and
keywords): ``schedule`` ("1f1b", "gpipe", "interleaved", "zb-h1"), ``microbatches``, ``virtual``
(interleaved, default 2), ``balance`` ("layers" or "params"), ``zero`` (0: DDP, 1: ZeRO-1 over dp),
``sequence_parallel`` / ``sp`` (Megatron SP inside each stage); and ``bucket_mb``.

The steps run in `distlab.strategies.loop`; clipping is `distlab.parallel.clip` over the tp group
(replicated parameters counted once), then the pp group.

More axes: ``cp=`` (context parallelism, with dp and tp; ``attention=ring|ulysses``, ``zigzag``) and
``ep=`` (expert parallelism, with dp), e.g. ``"3d:dp=2,cp=2"``, ``"3d:cp=2,tp=2"``, ``"3d:dp=2,ep=2"``:
what composes and what is refused is in `distlab.strategies.mesh_axes`.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import replace

import torch

from ..checkpoint.state import model_parallel_state
from ..memory import PipelineStash, pipeline_memory
from ..parallel import tensor as tp_lib
from ..parallel.clip import clip_grad_norm_, sum_over
from ..parallel.mesh import AXES, Mesh
from ..parallel.pipeline.executor import Pipeline
from ..parallel.pipeline.grad_sync import ReplicaGradSync
from ..parallel.pipeline.measure import ActionTrace
from .base import (
    RankResult,
    TrainSpec,
    autocast,
    build_model,
    dry_run,
    check_gpt,
    check_pieces,
    gather_params,
    global_batch,
    loss_fn,
    microbatch_count,
    optimizer_class,
    optimizer_kwargs,
)
from . import dry, mesh_axes
from .compose import Parallel, parallelize
from .loop import Plan, run, sum_losses
from .tensor import check_shards, sharded_params

LAYOUT = ("dp", "tp", "pp", "zero", "virtual", "balance", "sequence_parallel")   # what a rank holds


def check(spec: TrainSpec, world: int) -> None:
    """Refuse, before any rank starts, a mesh that cannot run on ``world`` ranks: degrees that do not
    multiply to it (cp= / ep= axes: `mesh_axes.check`), a ZeRO stage above 1, a GPT that does not split
    over tp, rows that do not feed dp replicas, a pipeline with more stages than the model has pieces or
    more microbatches than rows."""
    spec = resolved(spec, world)
    layout = spec.layout
    if layout.cp > 1 or layout.ep > 1:
        mesh_axes.check(spec, world)
        return
    if layout.zero > 1:
        raise ValueError(f"zero={layout.zero}: the mesh offers ZeRO-1 over dp (zero=0 or 1); ZeRO-2 and -3 "
                         "shard gradients and parameters over every rank: use strategy='zero2', 'zero3' or "
                         "'fsdp'")
    mesh = Mesh(layout.dp, layout.tp, layout.pp, world_size=world, groups=False)
    check_shards(spec, mesh.tp, layout.sequence_parallel and mesh.tp > 1, "the 3d mesh")
    rows = _replica_rows(spec, mesh)
    microbatch_count(layout.microbatches, len(rows[-1]), mesh.pp, layout.schedule,
                     "data-parallel replica and micro-step (global_batch / grad_accum / dp)")
    virtual = layout.virtual if layout.schedule == "interleaved" else 1
    check_pieces(spec, mesh.pp * virtual, virtual)


def resolved(spec: TrainSpec, world: int) -> TrainSpec:
    """``spec`` with every degree a number (one given as None takes the ranks the others leave)."""
    return replace(spec, layout=replace(spec.layout, **spec.layout.degrees(world)))


def axis_of(event) -> str:
    """Which mesh axis a comm event travelled on: the name the mesh gave its group (``group`` tag,
    see `collectives.name_group`); the pipeline's send/recv -> "pp"; anything else -> "dp"."""
    if event.args.get("group") in AXES:
        return event.args["group"]
    return "pp" if event.name in ("send", "recv") else "dp"


def bytes_by_axis(events) -> dict[str, int]:
    """Bytes sent per mesh axis over ``events`` (comm events of one rank, or of a merged trace)."""
    out = dict.fromkeys(AXES, 0)
    for e in events:
        if e.kind == "comm":
            out[axis_of(e)] += e.sent
    return out


def _digest(t: torch.Tensor) -> str | None:
    if t.is_meta:                                    # a dry run's tensors have no bytes to hash
        return None
    return hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def train_rank(spec: TrainSpec) -> RankResult:
    from ..runtime import world_size
    spec = resolved(spec, world_size())
    layout = spec.layout
    if layout.cp > 1 or layout.ep > 1:                     # cp= / ep= axes: see mesh_axes
        return mesh_axes.train_rank(spec)
    check_gpt(spec, "the 3d mesh")
    mesh = Mesh(layout.dp, layout.tp, layout.pp)
    rows = _replica_rows(spec, mesh)
    m = microbatch_count(layout.microbatches, len(rows[-1]), mesh.pp, layout.schedule,
                         "data-parallel replica and micro-step (global_batch / grad_accum / dp)")
    model = build_model(spec)
    names = list(dict(model.named_parameters()))
    par = parallelize(model, layout, mesh, data_parallel=spec.data_parallel)   # TP -> PP -> DP
    modules, stage_ids, v = par.stages, par.stage_ids, len(par.stages)
    pipe = Pipeline(modules if v > 1 else modules[0], stage_ids if v > 1 else stage_ids[0],
                    mesh.pp * v, schedule=layout.schedule, microbatches=m,
                    loss_fn=_criterion(spec, par.model, mesh, rows), group=mesh.pp_group)
    if dry_run():                                   # no shape headers through a fake group
        dry.seed_pipeline_shapes(pipe, len(rows[mesh.dp_rank]), model,
                                 mesh.tp if layout.sequence_parallel else 1)
    stash = PipelineStash()
    pipe.observers += [ActionTrace(), stash]              # measured from outside: spans, stash bytes
    params = list(pipe.parameters())
    optimizer = par.optimizer(optimizer_class(spec), **optimizer_kwargs(spec))
    plan = _plan(spec, mesh, rows, par, pipe, optimizer)
    plan.memory = pipeline_memory(modules, optimizer, stash)
    trained = run(spec, plan)
    losses = sum_losses(trained.losses, mesh.dp_group) if pipe.last else None   # replicas' shares summed
    full = gather_params(_full_tensors(modules, mesh), names)
    info = _info(layout, mesh, modules, stage_ids, m, params, trained)
    if par.ddp is not None:
        par.ddp.comm.close()
    return RankResult(losses=losses, params=full, info=info)


def _replica_rows(spec: TrainSpec, mesh: Mesh) -> tuple[torch.Tensor, ...]:
    """Which rows of each micro-batch every dp replica takes (``tensor_split``: uneven allowed)."""
    rows = torch.tensor_split(torch.arange(spec.micro_batch), mesh.dp)
    if len(rows[-1]) == 0:
        raise ValueError(f"a micro-batch of {spec.micro_batch} rows cannot feed dp={mesh.dp} replicas: "
                         "raise global_batch")
    return rows


def _criterion(spec: TrainSpec, model, mesh: Mesh, rows):
    """The loss on the last stage: vocabulary-parallel cross-entropy on logits split over T, scaled by
    this replica's share D n_d / (B k) of the global batch (see the module docstring)."""
    T = mesh.tp
    scale = mesh.dp * len(rows[mesh.dp_rank]) / spec.micro_batch / spec.grad_accum
    vocab_start = mesh.tp_rank * model.cfg.vocab // T
    plain = loss_fn(spec)

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if T == 1:
            return plain(logits, targets) * scale
        per_token = tp_lib.vocab_parallel_cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                        vocab_start, mesh.tp_group)
        return per_token.mean() * scale

    return criterion


def _plan(spec: TrainSpec, mesh: Mesh, rows, par: Parallel, pipe, optimizer) -> Plan:
    """The loop's plan: each micro-step one pipeline step on this replica's rows, every backward under
    ``DDP.no_sync()`` but the last B of the last micro-step, which starts the dp all-reduces
    (`ReplicaGradSync.last_backward`) when one B pass finishes every gradient of this rank (one module, no
    split I/W); otherwise they all run after the flush, in `ReplicaGradSync.finish`."""
    kinds, ddp, modules, zero = {a.kind for a in pipe.actions}, par.ddp, par.stages, spec.layout.zero
    overlap = ddp is not None and len(modules) == 1 and "B" in kinds and "W" not in kinds
    mine = rows[mesh.dp_rank]
    sync = ReplicaGradSync(ddp) if ddp is not None else None

    def forward(step: int, micro: int) -> torch.Tensor | None:
        x, y = global_batch(spec, step, micro)
        xs, ys = x[mine], y[mine]                        # (B/D, s): this replica's rows
        last = sync.last_backward() if overlap and micro == spec.grad_accum - 1 else None
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext(), autocast(spec):
            return pipe.step(xs if pipe.first else None, ys if pipe.last else None, last_backward=last)

    params = list(pipe.parameters())
    sharded = sharded_params(modules)
    groups = [mesh.tp_group, mesh.pp_group]
    if zero:                                             # ZeRO-1: dp shards first, replicated weighted 1/T
        ids = {id(p) for p in sharded}

        def weight(p) -> float:
            return 1.0 if id(p) in ids else 1.0 / mesh.tp

        def clip(max_norm):
            return optimizer.clip_grad_norm_(max_norm, weight=weight, outer=lambda sq: sum_over(sq, groups))
    else:
        def clip(max_norm):
            return clip_grad_norm_(params, max_norm, sharded=sharded, groups=groups)
    held = torch.nn.ModuleList(modules)                  # this rank's stage(s): what a checkpoint holds
    layout = {k: getattr(spec.layout, k) for k in LAYOUT} | {"virtual": len(modules)}
    state = model_parallel_state(par.model, params, held, optimizer,
                                 loss_weight=pipe.last and mesh.tp_rank == 0,
                                 keeps_history=pipe.last and mesh.dp_rank == 0, replica_group=mesh.dp_group,
                                 layout=layout)
    return Plan(forward, optimizer, state, backward=False, loss_share=1 / mesh.dp, clip=clip,
                sync_grads=sync.finish if sync is not None else None, loss_group=mesh.dp_group)


def _full_tensors(modules, mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's stage(s) at full size (the TP shards all-gathered: collective over the tp group),
    sent by the first rank of each (dp, tp) block only."""
    full = {}
    for module in modules:
        full.update(tp_lib.full_state_dict(module) if mesh.tp > 1 else
                    {n: q.detach() for n, q in module.named_parameters()})
    return full if (mesh.dp_rank == 0 and mesh.tp_rank == 0) else {}


def _info(layout, mesh: Mesh, modules, stage_ids, m: int, params, trained) -> dict:
    """What the tests and lessons read: coordinates, shapes and digests of this rank's tensors (replicas
    must agree), and the bytes sent per mesh axis during the training steps."""
    local = {n: q for module in modules for n, q in module.named_parameters()}
    comm = {**trained.info["comm"], "sent_by_axis": bytes_by_axis(trained.events)}
    return {**trained.info, "coords": mesh.coords(), "stages": stage_ids, "microbatches": m,
            "schedule": layout.schedule, "zero": layout.zero,
            "sequence_parallel": layout.sequence_parallel and mesh.tp > 1,
            "shapes": {n: tuple(q.shape) for n, q in local.items()},
            "digests": {n: _digest(q) for n, q in local.items()},
            "param_bytes": sum(q.numel() * q.element_size() for q in params), "comm": comm}
