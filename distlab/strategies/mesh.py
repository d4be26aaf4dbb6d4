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
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

from ..checkpoint import training as checkpointing
from ..parallel import tensor as tp_lib
from ..parallel import collectives as C
from ..parallel.mesh import AXES, Mesh
from ..parallel.pipeline.executor import Pipeline
from ..parallel.pipeline.split import GPTStage, stage_module
from ..memory import PipelineStash
from ..parallel.pipeline.measure import ActionTrace
from ..runtime import device, rank, tracer
from .base import (RankResult, TrainSpec, autocast, build_model, clip_to_norm, global_batch, loss_fn,
                   make_optimizer, microbatch_count, optimizer_class, optimizer_kwargs)

INT_OPTIONS = ("dp", "tp", "pp", "microbatches", "virtual", "zero")
OPTIONS = INT_OPTIONS + ("schedule", "balance", "sequence_parallel", "sp", "bucket_mb")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


def parse(strategy: str, options: dict | None = None) -> dict:
    """``"3d:dp=2,tp=2,pp=2,zero=1"`` (plus ``options``, which win) -> {"dp": 2, "tp": 2, "pp": 2, "zero": 1, ...}."""
    if not strategy.startswith("3d:"):
        raise ValueError(f"{strategy!r} is not a mesh strategy: write it like '3d:dp=2,tp=2,pp=2'")
    found: dict = {}
    for item in filter(None, (s.strip() for s in strategy[3:].split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in OPTIONS:
            raise ValueError(f"{strategy!r}: cannot read {item!r}; write key=value with keys from {OPTIONS}, "
                             "e.g. '3d:dp=2,tp=2,pp=2'")
        found[key] = value.strip()
    found.update(options or {})
    out = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "schedule": "1f1b", "balance": "layers", "bucket_mb": 25.0}
    for key, value in found.items():
        if key not in OPTIONS:
            continue                                  # options meant for other strategies are ignored
        if key in INT_OPTIONS:
            try:
                value = int(value)
            except (TypeError, ValueError):
                raise ValueError(f"{strategy!r}: {key}={value!r} must be an integer") from None
        elif key in ("sequence_parallel", "sp"):
            key, value = "sequence_parallel", str(value).lower() in ("1", "true", "yes")
        elif key == "bucket_mb":
            value = float(value)
        out[key] = value
    if out["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule={out['schedule']!r}: choose one of {SCHEDULES}")
    if out["zero"] not in (0, 1):
        raise ValueError(f"zero={out['zero']}: the mesh supports DDP (zero=0) or ZeRO-1 (zero=1) over dp")
    return out


class SequenceParallelStage(GPTStage):
    """A `GPTStage` of a sequence-parallel GPT: the first stage adds the position embeddings of this
    rank's sequence shard (the token embedding already reduce-scattered along the sequence), so the
    activations crossing stage boundaries are (b, s/T, h) -- T times fewer bytes on every PP link."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embed:
            positions = torch.arange(x.shape[1], device=x.device).chunk(C.group_size(self.tp_group))
            x = self.tok(x) + self.pos(positions[C.group_rank(self.tp_group)])
        for block in self.blocks.values():
            x = block(x)
        if self.has_head:
            x = self.head(self.ln_f(x))
        return x


def _sharded(modules) -> set[int]:
    return {id(p) for m in modules for sub in m.modules() for name, p in sub.named_parameters(recurse=False)
            if name in getattr(sub, "shard_dims", {})}


def clip_grad_norm(params, sharded: set[int], max_norm: float, mesh: Mesh) -> float:
    """Scale gradients so the whole model's gradient norm is at most ``max_norm``; returns the norm.

    ||g||^2 = sum over stages of (sum over TP ranks of ||TP shards||^2 + ||replicated||^2): TP-sharded
    squares are summed over the tp group, replicated ones counted once, then stages summed over pp.
    Call after the dp all-reduce (replicas then hold equal gradients)."""
    sq_shards = torch.zeros(1, device=device())
    sq_replicated = torch.zeros(1, device=device())
    for p in params:
        if p.grad is not None:
            (sq_shards if id(p) in sharded else sq_replicated).add_(p.grad.float().pow(2).sum())
    sq = C.all_reduce(sq_shards, mesh.tp_group, phase="step", operator="grad_norm", axis="tp") + sq_replicated
    sq = C.all_reduce(sq, mesh.pp_group, phase="step", operator="grad_norm", axis="pp")
    return clip_to_norm(params, sq, max_norm)


def clip_sharded_grad_norm(optimizer, sharded: set[int], max_norm: float, mesh: Mesh) -> float:
    """`clip_grad_norm` under ZeRO-1 over dp: each rank holds 1/D of its stage's averaged gradient.

    The same sum, taken over the dp shards first (`ShardedOptimizer.clip_grad_norm_`), a replicated
    parameter's square weighted 1/T so that summing over the tp group counts it once."""
    T = mesh.tp

    def outer(sq):
        sq = C.all_reduce(sq, mesh.tp_group, phase="step", operator="grad_norm", axis="tp")
        return C.all_reduce(sq, mesh.pp_group, phase="step", operator="grad_norm", axis="pp")

    return optimizer.clip_grad_norm_(max_norm, weight=lambda p: 1.0 if id(p) in sharded else 1.0 / T,
                                     outer=outer)


def axis_of(event) -> str:
    """Which mesh axis a comm event travelled on: pipeline send/recv -> "pp", tensor-parallel
    collectives (tagged with an ``operator``) -> "tp", data-parallel collectives -> "dp"."""
    if "axis" in event.args:
        return event.args["axis"]
    if event.name in ("send", "recv"):
        return "pp"
    if "operator" in event.args:
        return "tp"
    return "dp"


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
    if spec.model == "mlp":
        raise ValueError("the 3d mesh shards a GPT (heads, MLP, vocabulary) and pipelines its blocks: "
                         "choose a GPT preset such as model='gpt-tiny'")
    mesh = Mesh(opts["dp"], opts["tp"], opts["pp"])
    D, T, P = mesh.dp, mesh.tp, mesh.pp
    me = mesh.coords()
    rows = torch.tensor_split(torch.arange(spec.micro_batch), D)
    if len(rows[-1]) == 0:
        raise ValueError(f"a micro-batch of {spec.micro_batch} rows cannot feed dp={D} replicas: raise global_batch")
    m = microbatch_count(opts.get("microbatches"), len(rows[-1]), P, opts["schedule"],
                         "data-parallel replica and micro-step (global_batch / grad_accum / dp)")

    # 1. tensor parallelism over this rank's TP group, 2. keep this pipeline rank's stage(s)
    model = build_model(spec)
    names = list(dict(model.named_parameters()))
    sp = bool(opts.get("sequence_parallel")) and T > 1
    if T > 1:
        model = tp_lib.parallelize(model, group=mesh.tp_group, sequence_parallel=sp)
    v = opts.get("virtual", 2) if opts["schedule"] == "interleaved" else 1
    stage_ids = [me.pp + k * P for k in range(v)]
    modules = [stage_module(model, s, P * v, opts["balance"]) for s in stage_ids]
    for module in modules:
        if sp:
            module.__class__, module.tp_group = SequenceParallelStage, mesh.tp_group

    # the loss: vocabulary-parallel on logits split over T, scaled for this replica's share
    scale = D * len(rows[me.dp]) / spec.micro_batch / spec.grad_accum
    vocab_start = me.tp * model.cfg.vocab // T
    plain = loss_fn(spec)

    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if T == 1:
            return plain(logits, targets) * scale
        per_token = tp_lib.vocab_parallel_cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                        vocab_start, mesh.tp_group)
        return per_token.mean() * scale

    pipe = Pipeline(modules if v > 1 else modules[0], stage_ids if v > 1 else stage_ids[0], P * v,
                    schedule=opts["schedule"], microbatches=m, loss_fn=criterion, group=mesh.pp_group)
    params = list(pipe.parameters())
    pipe.observers += [ActionTrace(), PipelineStash()]    # measured from outside: spans, stash bytes

    # 3. data parallelism over this rank's DP group
    ddp = None
    if opts["zero"]:
        from ..parallel.zero import ShardedOptimizer
        optimizer = ShardedOptimizer(params, optimizer_class(spec), group=mesh.dp_group,
                                     bucket_mb=opts["bucket_mb"], **optimizer_kwargs(spec))
    else:
        if D > 1:
            from ..parallel.data.ddp import DDP
            ddp = DDP(torch.nn.ModuleList(modules), bucket_mb=opts["bucket_mb"], group=mesh.dp_group)
        optimizer = make_optimizer(params, spec)
    sharded = _sharded(modules)
    # DP all-reduces start during the last microbatch's backward when one B pass finishes every
    # gradient of this rank (one module, no split I/W); otherwise all of them run after the flush
    kinds = {a.kind for a in pipe.actions}
    overlap_dp = ddp is not None and v == 1 and "B" in kinds and "W" not in kinds

    held = torch.nn.ModuleList(modules)         # this rank's stage(s): what a checkpoint holds
    layout = checkpointing.model_parallel_layout(model, params, held, loss_weight=pipe.last and me.tp == 0,
                                                 keeps_history=pipe.last and me.dp == 0)
    ckpt = checkpointing.for_spec(spec, replica_group=mesh.dp_group, layout=layout)
    start, losses = ckpt.resume(held, ddp, optimizer)
    tr = tracer()
    t_start = tr.now()
    for step in range(start, spec.steps):
        ckpt.before_step(step)
        tr.mark("step", step=step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
            for micro in range(spec.grad_accum):
                x, y = global_batch(spec, step, micro)
                xs, ys = x[rows[me.dp]], y[rows[me.dp]]
                overlap = overlap_dp and micro == spec.grad_accum - 1
                with autocast(spec):
                    loss = pipe.step(xs if pipe.first else None, ys if pipe.last else None,
                                     last_backward=ddp.start_grad_sync() if overlap else None)
                if loss is not None:
                    total += loss.item() / D
        with tr.span("optimizer", step=step):
            if ddp is not None:
                with tr.span("dp grad sync", step=step):
                    ddp.finish_grad_sync()
            if spec.clip is not None and opts["zero"]:
                clip_sharded_grad_norm(optimizer, sharded, spec.clip, mesh)
            elif spec.clip is not None:
                clip_grad_norm(params, sharded, spec.clip, mesh)
            optimizer.step()
        losses.append(total)
        ckpt.after_step(step + 1, held, ddp, optimizer, losses)
    t_end = tr.now()

    if pipe.last and D > 1:                     # each replica saw its rows: sum their weighted shares
        t = torch.tensor(losses, dtype=torch.float64, device=device())
        dist.all_reduce(t, group=mesh.dp_group)
        losses = t.tolist()
    full = {}
    for module in modules:                      # collective over the TP group
        full.update(tp_lib.full_state_dict(module) if T > 1 else
                    {n: q.detach() for n, q in module.named_parameters()})
    mine = {n: q.cpu().clone() for n, q in full.items()} if (me.dp == 0 and me.tp == 0) else {}
    gathered = [None] * mesh.world_size if rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    params_full = None
    if rank() == 0:
        merged = {k: val for part in gathered for k, val in part.items()}
        params_full = {n: merged[n] for n in names if n in merged}
    local = {n: q for module in modules for n, q in module.named_parameters()}
    events = [e for e in tr.events() if e.kind == "comm" and t_start <= e.start <= t_end]
    info = {"coords": me, "stages": stage_ids, "microbatches": m, "schedule": opts["schedule"],
            "zero": opts["zero"], "sequence_parallel": sp,
            "shapes": {n: tuple(q.shape) for n, q in local.items()},
            "digests": {n: _digest(q) for n, q in local.items()},
            "param_bytes": sum(q.numel() * q.element_size() for q in params),
            "comm": {"sent_by_axis": bytes_by_axis(events), "sent": sum(e.sent for e in events)},
            **ckpt.summary(start)}
    if ddp is not None:
        ddp.comm.close()
    return RankResult(losses=losses if pipe.last else None, params=params_full, info=info)
