"""Strategy ``3d:dp=D,tp=T,pp=P``: tensor parallelism inside each pipeline stage, a pipeline over the
pp group, and data parallelism over the dp group (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", the "PTD-P" composition).

Every rank builds the same full GPT from the seed, then, by its coordinates in `Mesh(D, T, P)`::

    1. TP   dl.tp.parallelize(gpt, group=tp_group)      keep 1/T of every big matrix
    2. PP   dl.pp.stage_module(gpt, stage, P)            keep the layers of pipeline stage pp_rank
    3. DP   DDP(stage, group=dp_group)                   replicas average their gradients
            (or ZeRO-1: ShardedOptimizer over dp_group,  option zero=1)

Each step every dp replica takes its rows of the global batch (``torch.tensor_split`` into D,
uneven allowed) and runs it through its pipeline (`dl.pp.Pipeline` over pp_group, schedule
``1f1b`` by default, ``microbatches`` default 2P when the rows allow, else P). Inside a stage the
T ranks of its TP group see the same microbatch and run the Megatron f/g collectives; the last
stage computes the vocabulary-parallel cross-entropy on logits split by vocabulary. The pipeline
accumulates gradients over microbatches, so the dp all-reduce runs once per step, not once per
microbatch: the micro-steps run under ``DDP.no_sync()``, except the last microbatch's backward on
each rank, which runs under ``DDP.start_grad_sync()``: each bucket's all-reduce starts as soon as
that backward has filled it, while the input gradient already travels upstream, and
``DDP.finish_grad_sync()`` waits for them after the flush (Megatron's ``overlap_grad_reduce`` and
``finalize_model_grads``). Where one B pass does not finish every gradient of the rank
(interleaved chunks, zero bubble's I/W split), ``finish_grad_sync`` all-reduces every bucket after
the flush instead.

Exactness on the same global batch as ``single``: replica d's loss is scaled by D n_d / (B k)
(n_d its rows, B the global batch, k = grad_accum), so averaging over D replicas and summing over
k micro-steps gives exactly the gradient of the global mean loss.

Options (in the name, ``"3d:dp=2,tp=2,pp=2,zero=1,schedule=gpipe"``, or in ``options=``):
``schedule`` ("1f1b", "gpipe", "interleaved", "zb-h1"), ``microbatches``, ``virtual`` (interleaved,
default 2), ``balance`` ("layers" or "params"), ``zero`` (0: DDP, 1: ZeRO-1 over dp),
``sequence_parallel`` / ``sp`` (Megatron SP inside each stage), ``bucket_mb``.

The steps run in `distlab.strategies.loop`; clipping is `distlab.parallel.clip` over the tp group
(replicated parameters counted once), then the pp group.

More axes: ``cp=`` (context parallelism, with dp and tp; ``attention=ring|ulysses``, ``zigzag``) and
``ep=`` (expert parallelism, with dp), e.g. ``"3d:dp=2,cp=2"``, ``"3d:cp=2,tp=2"``, ``"3d:dp=2,ep=2"``:
what composes and what is refused is in `distlab.strategies.mesh_axes`.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib

import torch

from ..checkpoint.state import model_parallel_state
from ..checkpoint.training import OPTIONS as CHECKPOINT_OPTIONS
from .loop import OPTIONS as LOOP_OPTIONS
from ..memory import PipelineStash, pipeline_memory
from ..parallel import tensor as tp_lib
from ..parallel.clip import clip_grad_norm_, sum_over
from ..parallel.mesh import AXES, Mesh
from ..parallel.pipeline.executor import Pipeline
from ..parallel.pipeline.measure import ActionTrace
from ..parallel.pipeline.split import stage_module
from ..rules import Flag, Number, OneOf, Whole
from ..rules import check as check_values
from .base import (
    RankResult,
    TrainSpec,
    autocast,
    build_model,
    check_gpt,
    check_pieces,
    gather_params,
    global_batch,
    loss_fn,
    make_optimizer,
    microbatch_count,
    optimizer_class,
    optimizer_kwargs,
)
from . import mesh_axes
from .loop import Plan, run, sum_losses
from .tensor import check_shards, sharded_params

INT_OPTIONS = ("dp", "tp", "pp", "microbatches", "virtual", "zero", "cp", "ep")
KEYS = INT_OPTIONS + ("schedule", "balance", "sequence_parallel", "sp", "bucket_mb", "attention", "zigzag")
OPTIONS = {"3d": KEYS}                # what `distlab.strategies.check_options` accepts in options=
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
LAYOUT = ("dp", "tp", "pp", "zero", "virtual", "balance", "sequence_parallel")   # what a rank holds
#: what each option takes (`distlab.rules`), in options= and, once `parse` has read them, in the name
RULES = {**{k: Whole(1, example=2) for k in INT_OPTIONS if k != "zero"},
         "zero": OneOf(0, 1), "schedule": OneOf(*SCHEDULES), "balance": OneOf("layers", "params"),
         "sequence_parallel": Flag(), "sp": Flag(), "bucket_mb": Number(0, strict=True, example=25.0),
         "attention": OneOf(*mesh_axes.ATTENTIONS), "zigzag": Flag()}
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def parse(strategy: str, options: dict | None = None) -> dict:
    """``"3d:dp=2,tp=2,pp=2,zero=1"`` (plus ``options``, which win) -> {"dp": 2, "tp": 2, "pp": 2,
    "zero": 1, ...}."""
    if not strategy.startswith("3d:"):
        raise ValueError(f"{strategy!r} is not a mesh strategy: write it like '3d:dp=2,tp=2,pp=2'")
    found: dict = {}
    for item in filter(None, (s.strip() for s in strategy[3:].split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close and eq else ""
            raise ValueError(f"{strategy!r}: cannot read {item!r}{hint}; write key=value with keys from "
                             f"{KEYS}, e.g. '3d:dp=2,tp=2,pp=2'")
        found[key] = _read(strategy, key, value.strip())
    unknown = [k for k in (options or {}) if k not in KEYS + CHECKPOINT_OPTIONS + LOOP_OPTIONS]
    if unknown:                                       # the checkpoint's and the loop's are read elsewhere
        close = difflib.get_close_matches(unknown[0], KEYS, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"the mesh strategy has no option {unknown[0]!r}{hint}: its options are {KEYS}")
    found.update({k: v for k, v in (options or {}).items() if k in KEYS})     # typed values, as given
    check_values(RULES, found)
    out = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "schedule": "1f1b", "balance": "layers",
           "bucket_mb": 25.0}
    for key, value in found.items():
        out["sequence_parallel" if key == "sp" else key] = value
    return out


def _read(strategy: str, key: str, text: str):
    """The value of ``key=text`` written in a mesh's name, as its option would be given in options=."""
    if key in ("sequence_parallel", "sp", "zigzag"):
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(f"{strategy!r}: {key}={text!r} must be true or false (or 1 or 0)")
        return text.lower() in _TRUE
    converter = int if key in INT_OPTIONS else float if key == "bucket_mb" else str
    try:
        return converter(text)
    except ValueError:
        raise ValueError(f"{strategy!r}: {key}={text!r} must be "
                         f"{'an integer' if converter is int else 'a number'}") from None


def check_world(spec: TrainSpec, world_size: int) -> None:
    """Before any rank starts: the degrees fill ``world_size`` and (cp=, ep=) the combination is built."""
    opts = parse(spec.strategy, spec.options)
    if opts["cp"] > 1 or opts["ep"] > 1:
        mesh_axes.check(spec, opts, world_size)
    else:
        Mesh(opts["dp"], opts["tp"], opts["pp"], world_size=world_size, groups=False)


def check(spec: TrainSpec, world: int) -> None:
    """Refuse, before any rank starts, a mesh that cannot run on ``world`` ranks: degrees that do not
    multiply to it (`check_world`; cp= / ep= axes: `mesh_axes.check`), a GPT that does not split over tp,
    rows that do not feed dp replicas, a pipeline with more stages than the model has pieces or more
    microbatches than rows."""
    check_world(spec, world)
    opts = parse(spec.strategy, spec.options)
    if opts["cp"] > 1 or opts["ep"] > 1:
        return
    mesh = Mesh(opts["dp"], opts["tp"], opts["pp"], world_size=world, groups=False)
    check_shards(spec, mesh.tp, bool(opts.get("sequence_parallel")) and mesh.tp > 1, "the 3d mesh")
    rows = _replica_rows(spec, mesh)
    microbatch_count(opts.get("microbatches"), len(rows[-1]), mesh.pp, opts["schedule"],
                     "data-parallel replica and micro-step (global_batch / grad_accum / dp)")
    virtual = opts.get("virtual", 2) if opts["schedule"] == "interleaved" else 1
    check_pieces(spec, mesh.pp * virtual, virtual)


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


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def train_rank(spec: TrainSpec) -> RankResult:
    opts = parse(spec.strategy, spec.options)
    if opts["cp"] > 1 or opts["ep"] > 1:                  # cp= / ep= axes: see mesh_axes
        return mesh_axes.train_rank(spec, opts)
    check_gpt(spec, "the 3d mesh")
    mesh = Mesh(opts["dp"], opts["tp"], opts["pp"])
    rows = _replica_rows(spec, mesh)
    m = microbatch_count(opts.get("microbatches"), len(rows[-1]), mesh.pp, opts["schedule"],
                         "data-parallel replica and micro-step (global_batch / grad_accum / dp)")
    model = build_model(spec)
    names = list(dict(model.named_parameters()))
    model, modules, stage_ids = _tensor_then_pipeline(model, opts, mesh)
    v = len(modules)
    pipe = Pipeline(modules if v > 1 else modules[0], stage_ids if v > 1 else stage_ids[0],
                    mesh.pp * v, schedule=opts["schedule"], microbatches=m,
                    loss_fn=_criterion(spec, model, mesh, rows), group=mesh.pp_group)
    stash = PipelineStash()
    pipe.observers += [ActionTrace(), stash]              # measured from outside: spans, stash bytes
    params = list(pipe.parameters())
    ddp, optimizer = _data_parallel(spec, opts, mesh, modules, params)
    plan = _plan(spec, opts, mesh, rows, model, modules, pipe, ddp, optimizer)
    plan.memory = pipeline_memory(modules, optimizer, stash)
    trained = run(spec, plan)
    losses = sum_losses(trained.losses, mesh.dp_group) if pipe.last else None   # replicas' shares summed
    full = gather_params(_full_tensors(modules, mesh), names)
    info = _info(opts, mesh, modules, stage_ids, m, params, trained)
    if ddp is not None:
        ddp.comm.close()
    return RankResult(losses=losses, params=full, info=info)


def _replica_rows(spec: TrainSpec, mesh: Mesh) -> tuple[torch.Tensor, ...]:
    """Which rows of each micro-batch every dp replica takes (``tensor_split``: uneven allowed)."""
    rows = torch.tensor_split(torch.arange(spec.micro_batch), mesh.dp)
    if len(rows[-1]) == 0:
        raise ValueError(f"a micro-batch of {spec.micro_batch} rows cannot feed dp={mesh.dp} replicas: "
                         "raise global_batch")
    return rows


def _tensor_then_pipeline(model, opts: dict, mesh: Mesh):
    """1. tensor parallelism over this rank's TP group (sequence parallel if asked), then 2. keep this
    pipeline rank's stage(s): stages pp_rank, pp_rank + P, ... (``virtual`` of them, interleaved).
    Returns (the model, this rank's stage modules, their stage ids)."""
    if mesh.tp > 1:
        sp = bool(opts.get("sequence_parallel"))
        model = tp_lib.parallelize(model, group=mesh.tp_group, sequence_parallel=sp)
    v = opts.get("virtual", 2) if opts["schedule"] == "interleaved" else 1
    stage_ids = [mesh.pp_rank + k * mesh.pp for k in range(v)]
    modules = [stage_module(model, s, mesh.pp * v, opts["balance"]) for s in stage_ids]
    return model, modules, stage_ids


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


def _data_parallel(spec: TrainSpec, opts: dict, mesh: Mesh, modules, params):
    """3. data parallelism over this rank's DP group: (DDP or None, the optimizer). With ``zero=1`` the
    optimizer is ZeRO-1 over dp (it reduce-scatters the gradients itself); else DDP when dp > 1."""
    if opts["zero"]:
        from ..parallel.zero import ShardedOptimizer
        return None, ShardedOptimizer(params, optimizer_class(spec), group=mesh.dp_group,
                                      bucket_mb=opts["bucket_mb"], **optimizer_kwargs(spec))
    ddp = None
    if mesh.dp > 1:
        from ..parallel.data.ddp import DDP
        ddp = DDP(torch.nn.ModuleList(modules), bucket_mb=opts["bucket_mb"], group=mesh.dp_group)
    return ddp, make_optimizer(params, spec)


def _plan(spec: TrainSpec, opts: dict, mesh: Mesh, rows, model, modules, pipe, ddp, optimizer) -> Plan:
    """The loop's plan: each micro-step one pipeline step on this replica's rows, every backward under
    ``DDP.no_sync()`` but the last B of the last micro-step, which starts the dp all-reduces
    (``start_grad_sync``) when one B pass finishes every gradient of this rank (one module, no split
    I/W); otherwise they all run after the flush, in ``finish_grad_sync``."""
    kinds = {a.kind for a in pipe.actions}
    overlap = ddp is not None and len(modules) == 1 and "B" in kinds and "W" not in kinds
    mine = rows[mesh.dp_rank]

    def forward(step: int, micro: int) -> torch.Tensor | None:
        x, y = global_batch(spec, step, micro)
        xs, ys = x[mine], y[mine]                        # (B/D, s): this replica's rows
        last = ddp.start_grad_sync() if overlap and micro == spec.grad_accum - 1 else None
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext(), autocast(spec):
            return pipe.step(xs if pipe.first else None, ys if pipe.last else None, last_backward=last)

    params = list(pipe.parameters())
    sharded = sharded_params(modules)
    groups = [mesh.tp_group, mesh.pp_group]
    if opts["zero"]:                                     # ZeRO-1: dp shards first, replicated weighted 1/T
        ids = {id(p) for p in sharded}

        def weight(p) -> float:
            return 1.0 if id(p) in ids else 1.0 / mesh.tp

        def clip(max_norm):
            return optimizer.clip_grad_norm_(max_norm, weight=weight, outer=lambda sq: sum_over(sq, groups))
    else:
        def clip(max_norm):
            return clip_grad_norm_(params, max_norm, sharded=sharded, groups=groups)
    held = torch.nn.ModuleList(modules)                  # this rank's stage(s): what a checkpoint holds
    layout = {k: opts.get(k) for k in LAYOUT} | {"virtual": len(modules)}
    state = model_parallel_state(model, params, held, optimizer, loss_weight=pipe.last and mesh.tp_rank == 0,
                                 keeps_history=pipe.last and mesh.dp_rank == 0, replica_group=mesh.dp_group,
                                 layout=layout)
    return Plan(forward, optimizer, state, backward=False, loss_share=1 / mesh.dp, clip=clip,
                sync_grads=ddp.finish_grad_sync if ddp is not None else None)


def _full_tensors(modules, mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's stage(s) at full size (the TP shards all-gathered: collective over the tp group),
    sent by the first rank of each (dp, tp) block only."""
    full = {}
    for module in modules:
        full.update(tp_lib.full_state_dict(module) if mesh.tp > 1 else
                    {n: q.detach() for n, q in module.named_parameters()})
    return full if (mesh.dp_rank == 0 and mesh.tp_rank == 0) else {}


def _info(opts: dict, mesh: Mesh, modules, stage_ids, m: int, params, trained) -> dict:
    """What the tests and lessons read: coordinates, shapes and digests of this rank's tensors (replicas
    must agree), and the bytes sent per mesh axis during the training steps."""
    local = {n: q for module in modules for n, q in module.named_parameters()}
    comm = {**trained.info["comm"], "sent_by_axis": bytes_by_axis(trained.events)}
    return {**trained.info, "coords": mesh.coords(), "stages": stage_ids, "microbatches": m,
            "schedule": opts["schedule"], "zero": opts["zero"],
            "sequence_parallel": bool(opts.get("sequence_parallel")) and mesh.tp > 1,
            "shapes": {n: tuple(q.shape) for n, q in local.items()},
            "digests": {n: _digest(q) for n, q in local.items()},
            "param_bytes": sum(q.numel() * q.element_size() for q in params), "comm": comm}
