"""`parallelize`: THE composition of the parallelisms on a mesh, in the one order that works, TP -> CP ->
PP -> DP, as torchtitan's ``parallelize_llama`` composes them. `dl.train`'s 3D mesh builds its model here,
and so can anyone with their own model::

    gpt = dl.models.GPT(dl.models.GPTConfig(...))                  # the same seed on every rank
    mesh = Mesh(dp=2, tp=2)                                         # inside dl.launch
    par = parallelize(gpt, Layout(dp=2, tp=2), mesh)
    loss = par.model.loss(ids[mine], targets[mine])                # this replica's rows
    loss.backward()                                                 # tp's f/g inside, dp's all-reduce after
    opt = par.optimizer(torch.optim.AdamW, lr=1e-3)                 # (ZeRO-1 over dp with zero=1)

Each step transforms what the step before left, which fixes the order (the reasons, in the code):

    1. TP   replace the big matrices by this rank's shards               dl.tp.parallelize
    2. CP   make attention exact over this rank's part of each sequence  dl.cp.parallelize
    3. PP   keep this rank's stage(s) of the layers                      dl.pp.stage_module
    4. DP   average the gradients of what this rank holds over the ranks DDP, or ZeRO-1 in the
            holding the same (its replicas)                              optimizer (`Parallel.optimizer`)

Mixture-of-experts layers are parallelized by their own family (`strategies.expert`: the ep axis with dp).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..parallel.mesh import Mesh
from ..parallel.pipeline.split import stage_module
from .spec import Layout


@dataclass
class Parallel:
    """What `parallelize` returns. ``model``: the whole model after TP and CP (every rank builds all of
    it; the stages are cut from it and share its parameters); ``stages``: this rank's pipeline stage(s),
    stage ids ``stage_ids`` (one stage, the model itself, without a pipeline); ``ddp``: the data-parallel
    wrapper over the stages (None without replicas, or with ZeRO-1, which lives in the optimizer)."""

    model: nn.Module
    stages: list[nn.Module]
    stage_ids: list[int]
    ddp: nn.Module | None
    replicas: object              # the process group of this rank's replicas (dp, or dp x cp)
    zero: int
    bucket_mb: float

    def parameters(self) -> list[torch.Tensor]:
        """This rank's parameters, each once, in stage order (what its optimizer steps)."""
        seen: dict[int, torch.Tensor] = {}
        for stage in self.stages:
            for p in stage.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs):
        """``cls`` over this rank's parameters; with ``zero=1`` a ZeRO-1 `ShardedOptimizer` over the
        replicas, each holding 1/dp of the optimizer state (it reduce-scatters the gradients itself)."""
        if self.zero:
            from ..parallel.zero import ShardedOptimizer
            return ShardedOptimizer(self.parameters(), cls, group=self.replicas, bucket_mb=self.bucket_mb,
                                    **kwargs)
        return cls(self.parameters(), **kwargs)


def parallelize(model: nn.Module, layout: Layout, mesh: Mesh, *, bucket_mb: float = 25.0,
                plan: dict | None = None) -> Parallel:
    """``model`` (the same weights on every rank) laid out on ``mesh`` as ``layout`` says: TP, then CP,
    then PP, then DP. ``plan``: `dl.tp.parallelize`'s plan for a model that is not a distlab GPT."""
    # 1. TP first: it replaces whole nn.Linear / nn.Embedding modules by their column- and row-parallel
    #    shards. Every later step must see the shards, not the full matrices: CP then runs attention on
    #    this rank's a/tp heads, PP cuts stages that hold shards, and DP averages the shards' gradients
    #    (wrapping first would bucket full-size gradients that no longer exist; torchtitan: TP before FSDP).
    if mesh.tp > 1:
        from ..parallel import tensor as tp_lib
        model = tp_lib.parallelize(model, group=mesh.group("tp"), sequence_parallel=layout.sequence_parallel,
                                   plan=plan)
    # 2. CP next: it swaps each attention core for ring attention or Ulysses over the cp group, on the
    #    heads TP left this rank, and makes the embedding place this rank's positions. It only rewires
    #    attention, so it composes with TP's shards; and it comes before PP, because a stage runs the
    #    model's own embed and blocks (`GPTStage` calls ``gpt.embed``): cut afterwards, it carries them.
    if mesh.cp > 1:
        from ..parallel import context as cp_lib
        zigzag = layout.zigzag if layout.zigzag is not None else layout.attention == "ring"
        model = cp_lib.parallelize(model, attention=layout.attention, group=mesh.group("cp"), zigzag=zigzag)
    # 3. PP: cut this rank's stage(s) -- stages pp_rank, pp_rank + pp, ... (``virtual`` of them for the
    #    interleaved schedule) -- out of the TP/CP model, so each stage holds shards and distributed
    #    attention already. Before DP: the data-parallel wrapper must cover exactly the parameters this
    #    rank holds, one wrapper per rank over its stages (a wrapper around the whole model would wait
    #    for gradients of layers that live on other ranks).
    v = layout.virtual if layout.schedule == "interleaved" else 1
    stage_ids = [mesh.coords().pp + k * mesh.pp for k in range(v)]
    stages = [stage_module(model, s, mesh.pp * v, layout.balance) for s in stage_ids] \
        if mesh.pp * v > 1 else [model]
    # 4. DP last: it averages gradients over the ranks that hold the same tensors -- this rank's
    #    replicas, every rank at the same (pp, tp) coordinate, across dp and (their weights are whole on
    #    each cp rank too) across cp. Wrapping last means it sees the final parameters; its buckets fill
    #    in the order backward produces them, stage by stage.
    replicas = mesh.group("dp", "cp") if mesh.cp > 1 else mesh.group("dp")
    ddp = None
    if layout.zero == 0 and mesh.dp * mesh.cp > 1:
        from ..parallel.data.ddp import DDP
        ddp = DDP(nn.ModuleList(stages), bucket_mb=bucket_mb, group=replicas)
    elif layout.zero > 1:
        raise ValueError(f"zero={layout.zero} on a mesh: a mesh offers ZeRO-1 over its replicas (zero=1); "
                         "for sharded gradients and parameters use dl.fully_shard")
    return Parallel(model, stages, stage_ids, ddp, replicas, layout.zero, bucket_mb)
