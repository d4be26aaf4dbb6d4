"""`parallelize`: THE composition of the parallelisms on a mesh, in the one order that works, TP -> CP ->
PP -> DP, as torchtitan's ``parallelize_llama`` composes them. Every family of `dl.train` builds its model
here -- ``tp``, the ``pp-*`` schedules, ``ddp`` and ``zero1-3``, ``fsdp``, ``ep``, ``cp-*`` and the
``3d:`` meshes -- and so can anyone with their own model::

    gpt = dl.models.GPT(dl.models.GPTConfig(...))                  # the same seed on every rank
    mesh = Mesh(dp=2, tp=2)                                         # inside dl.launch
    par = parallelize(gpt, Layout(dp=2, tp=2), mesh)
    loss = par.model.loss(ids[mine], targets[mine])                # this replica's rows
    loss.backward()                                                 # tp's f/g inside, dp's all-reduce after
    opt = par.optimizer(torch.optim.AdamW, lr=1e-3)                 # (ZeRO-1 over dp with zero=1)

Each step transforms what the step before left, which fixes the order (the reasons, in the code):

    1. TP   replace the big matrices by this rank's shards               dl.tp.parallelize
       EP   replace each MoE layer's experts by this rank's share         dl.ep.parallelize
    2. CP   make attention exact over this rank's part of each sequence  dl.cp.parallelize
    3. PP   keep this rank's stage(s) of the layers                      dl.pp.stage_module
    4. DP   average the gradients of what this rank holds over the ranks DDP (NaiveDDP, PowerSGDDDP),
            holding the same (its replicas)                              dl.fully_shard, ZeRO in the
                                                                         optimizer, or the ep sums

Without a mesh (``mesh=None``) the layout's one parallelism spans the world (`World`): ``tp`` on all
ranks, ``pp-1f1b`` one stage per rank, ``ddp`` every rank a replica; every group is then the world itself
(``group=None``). A step runs where its degree is above 1, and where the layout leaves its degree to the
world (``Layout(tp=None)``: the 1-D families run their parallelism even on one rank).

Which DP step, by what the layout and the caller ask for::

    experts split (ep)          the gradients *summed*: dense over the world, experts over their dp
                                replicas (`Parallel.sync_grads`; each loss is a share of the batch's)
    fsdp=dict(...)              `dl.fully_shard` bottom-up, each block then the root (`fully_shard_units`)
    zero=0, replicas            DDP over them (``naive``: NaiveDDP, ``compression``: PowerSGDDDP)
    zero>=1                     in the optimizer (`Parallel.optimizer`): over the world ZeRO's own wrapper
                                of that stage (`dl.ZeRO`), on a mesh ZeRO-1's `ShardedOptimizer`

What stays in each family's file is what is not layout: the criterion (vocabulary-parallel on a tp mesh),
the pipeline's schedule and executor, the rows each rank takes, the checkpoint's view of the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..parallel.mesh import Coord, Mesh
from ..parallel.pipeline.split import stage_module
from ..runtime import rank, world_size
from .spec import AXES, DataParallel, Layout


class World:
    """The whole world as a mesh of one axis (the 1-D families): the degree the layout leaves to the world
    is the world size, every other 1; rank r sits at coordinate r of that axis; every group is the world
    itself (None, the default ``group=`` of every parallelism)."""

    def __init__(self, layout: Layout):
        degrees = layout.degrees(world_size())
        self.dp, self.tp, self.pp, self.cp, self.ep = (degrees[a] for a in ("dp", "tp", "pp", "cp", "ep"))
        self.axis = next((a for a in AXES if getattr(layout, a) is None), None)

    def group(self, *axes: str):
        return None

    def coords(self) -> Coord:
        at = {a: rank() if a == self.axis else 0 for a in AXES}
        return Coord(dp=at["dp"], pp=at["pp"], tp=at["tp"], cp=at["cp"], ep=at["ep"])


@dataclass
class Parallel:
    """What `parallelize` returns. ``model``: the whole model after TP, EP and CP (every rank builds all of
    it; the stages are cut from it and share its parameters; under ``fsdp`` it holds this rank's shards);
    ``stages``: this rank's pipeline stage(s), stage ids ``stage_ids`` (one stage, the model itself, without
    a pipeline); ``ddp``: the data-parallel wrapper (DDP, NaiveDDP or PowerSGDDDP; ZeRO's after
    `optimizer`; None without replicas, with ZeRO-1 on a mesh, fully_shard or ep); ``sync_grads``: ep's
    gradient sums, to call after backward (None elsewhere)."""

    model: nn.Module
    stages: list[nn.Module]
    stage_ids: list[int]
    ddp: nn.Module | None
    replicas: object              # this rank's replicas' process group (dp, or dp x cp; None: the world)
    zero: int
    options: DataParallel = field(default_factory=DataParallel)
    sync_grads: object = None
    over_world: bool = False      # no mesh: ZeRO is the zero1-3 strategies' own wrapper (`dl.ZeRO`)

    @property
    def wrapped(self) -> nn.Module:
        """What a forward calls: the data-parallel wrapper, or the model."""
        return self.ddp if self.ddp is not None else self.model

    def parameters(self) -> list[torch.Tensor]:
        """This rank's parameters, each once, in stage order (what its optimizer steps)."""
        seen: dict[int, torch.Tensor] = {}
        for stage in self.stages:
            for p in stage.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs):
        """``cls`` over this rank's parameters. With ZeRO the data parallelism lives in the optimizer: on a
        mesh (``zero=1``) a ZeRO-1 `ShardedOptimizer` over the replicas, each holding 1/dp of the optimizer
        state (it reduce-scatters the gradients itself); over the world (the zero1-3 strategies) ZeRO's
        model wrapper of that stage, `dl.ZeRO`, which becomes ``ddp`` (call it), and its optimizer."""
        o = self.options
        if self.zero and self.over_world:
            from ..parallel.zero import ZeRO
            self.ddp = ZeRO(self.model, stage=self.zero, optim=cls, bucket_mb=o.bucket_mb, overlap=o.overlap,
                            prefetch=o.prefetch, comm=o.comm, max_inflight=o.max_inflight,
                            **({"quantize": o.quantize} if o.quantize else {}), **kwargs)   # zero3 only
            return self.ddp.optimizer
        if self.zero:
            from ..parallel.zero import ShardedOptimizer
            return ShardedOptimizer(self.parameters(), cls, group=self.replicas, bucket_mb=o.bucket_mb,
                                    **kwargs)
        return cls(self.parameters(), **kwargs)


def _runs(axis: str, layout: Layout, axes) -> bool:
    """Whether the step of ``axis`` runs: its degree is above 1, or the layout leaves it to the world."""
    return getattr(axes, axis) > 1 or getattr(layout, axis, 1) is None


def parallelize(model: nn.Module, layout: Layout, mesh: Mesh | None = None, *,
                data_parallel: DataParallel | None = None, plan: dict | None = None,
                fsdp: dict | None = None) -> Parallel:
    """``model`` (the same weights on every rank) laid out on ``mesh`` as ``layout`` says: TP (and EP), then
    CP, then PP, then DP. ``mesh=None``: the layout's one parallelism over the world (`World`).
    ``data_parallel``: the wrapper's knobs (`spec.DataParallel`); ``plan``: `dl.tp.parallelize`'s plan for
    a model that is not a distlab GPT; ``fsdp``: the DP step shards with `dl.fully_shard`, these keywords."""
    axes = mesh if mesh is not None else World(layout)
    # 1. TP first: it replaces whole nn.Linear / nn.Embedding modules by their column- and row-parallel
    #    shards. Every later step must see the shards, not the full matrices: CP then runs attention on
    #    this rank's a/tp heads, PP cuts stages that hold shards, and DP averages the shards' gradients
    #    (wrapping first would bucket full-size gradients that no longer exist; torchtitan: TP before FSDP).
    if _runs("tp", layout, axes):
        from ..parallel import tensor as tp_lib
        model = tp_lib.parallelize(model, group=axes.group("tp"), sequence_parallel=layout.sequence_parallel,
                                   plan=plan)
    #    EP beside it (torchtitan applies it with TP): each MoE layer keeps this rank's experts, the router
    #    and the rest whole; its tokens travel by all-to-all inside the ep group, routed over the whole batch.
    experts = _runs("ep", layout, axes)
    if experts:
        from ..parallel import expert as ep_lib
        batch = torch.distributed.group.WORLD if axes.dp > 1 else None     # counts over the whole batch
        model = ep_lib.parallelize(model, axes.group("ep"), replicate=layout.experts == "replicated",
                                   batch_group=batch)
    # 2. CP next: it swaps each attention core for ring attention or Ulysses over the cp group, on the
    #    heads TP left this rank, and makes the embedding place this rank's positions. It only rewires
    #    attention, so it composes with TP's shards; and it comes before PP, because a stage runs the
    #    model's own embed and blocks (`GPTStage` calls ``gpt.embed``): cut afterwards, it carries them.
    if _runs("cp", layout, axes):
        from ..parallel import context as cp_lib
        zigzag = layout.zigzag if layout.zigzag is not None else layout.attention == "ring"
        model = cp_lib.parallelize(model, attention=layout.attention, group=axes.group("cp"), zigzag=zigzag)
    # 3. PP: cut this rank's stage(s) -- stages pp_rank, pp_rank + pp, ... (``virtual`` of them for the
    #    interleaved schedule) -- out of the TP/CP model, so each stage holds shards and distributed
    #    attention already. Before DP: the data-parallel wrapper must cover exactly the parameters this
    #    rank holds, one wrapper per rank over its stages (a wrapper around the whole model would wait
    #    for gradients of layers that live on other ranks).
    v = layout.virtual if layout.schedule == "interleaved" else 1
    stage_ids = [axes.coords().pp + k * axes.pp for k in range(v)]
    stages = [stage_module(model, s, axes.pp * v, layout.balance) for s in stage_ids] \
        if axes.pp * v > 1 or _runs("pp", layout, axes) else [model]
    # 4. DP last: it averages gradients over the ranks that hold the same tensors -- this rank's
    #    replicas, every rank at the same (pp, tp) coordinate, across dp and (their weights are whole on
    #    each cp rank too) across cp. Wrapping last means it sees the final parameters; its buckets fill
    #    in the order backward produces them, stage by stage.
    replicas = axes.group("dp", "cp") if axes.cp > 1 else axes.group("dp")
    par = Parallel(model, stages, stage_ids, None, replicas, layout.zero, data_parallel or DataParallel(),
                   over_world=mesh is None)
    if experts:
        par.sync_grads = _expert_sums(model, layout, axes, par.options)
    elif fsdp is not None:
        par.model = par.stages[0] = fully_shard_units(model, **fsdp)
    elif layout.zero == 0 and (axes.dp * axes.cp > 1 or _runs("dp", layout, axes)):
        par.ddp = _ddp(model if stages == [model] else nn.ModuleList(stages), par.options, replicas)
    elif layout.zero > 1 and mesh is not None:
        raise ValueError(f"zero={layout.zero} on a mesh: a mesh offers ZeRO-1 over its replicas (zero=1); "
                         "for sharded gradients and parameters use dl.fully_shard")
    return par


def _ddp(module: nn.Module, o: DataParallel, group) -> nn.Module:
    """The replicas' wrapper: DDP (buckets all-reduced during backward), or the textbook NaiveDDP, or
    PowerSGD-compressed DDP, as the knobs say."""
    from ..parallel import data
    if o.compression == "powersgd":
        return data.PowerSGDDDP(module, rank=o.powersgd_rank, error_feedback=o.error_feedback, comm=o.comm,
                                group=group)
    if o.naive:
        return data.NaiveDDP(module, comm=o.comm, group=group)
    return data.DDP(module, bucket_mb=o.bucket_mb, overlap=o.overlap, comm=o.comm, group=group)


def _expert_sums(model: nn.Module, layout: Layout, axes, o: DataParallel):
    """ep's DP: every loss is a share of the batch's, so gradients are *summed*: the dense ones over the
    world (replicated on every rank), the experts' over their dp replicas (each rank's own otherwise)."""
    from ..parallel import expert as ep_lib
    from ..parallel.data.buckets import grad_summer
    split = [] if layout.experts == "replicated" else ep_lib.expert_params(model)
    dense = [p for p in model.parameters() if all(p is not e for e in split)]
    sync_dense = grad_summer(dense, float(o.bucket_mb))
    sync_experts = grad_summer(split if axes.dp > 1 else [], float(o.bucket_mb), axes.group("dp"))

    def sync_grads() -> None:
        sync_dense()
        sync_experts()
    return sync_grads


def fully_shard_units(model: nn.Module, **kwargs) -> nn.Module:
    """FSDP2 bottom-up: every default unit (`zero3.default_units`: each block) but the root, then the root."""
    from ..parallel.zero import fsdp
    from ..parallel.zero.zero3 import default_units
    for unit in default_units(model)[:-1]:
        fsdp.fully_shard(unit, **kwargs)
    return fsdp.fully_shard(model, **kwargs)
