"""Strategy ``fsdp``: `dl.fully_shard` on every block, then the root; any torch optimizer on the shards.

Data as in `data_parallel` (every rank its rows of the same global batch, the loss weighted by its
share, so the averaged gradient is the global batch's). The model is sharded FSDP2-style by THE
composition function's DP step (`distlab.strategies.compose.fully_shard_units`): each child of an
``nn.ModuleList`` (the GPT's blocks, the MLP's layers) a unit, then the root for the rest; the
optimizer is built afterwards on ``model.parameters()``, the local shards.

``spec.data_parallel``: ``hsdp`` (replicate degree R, default 1: mesh (R, N / R)), ``param_dtype``
("bf16", "fp16" or None; ``precision="bf16-mixed"`` means "bf16", "fp16-mixed" "fp16"),
``reshard_after_forward`` (True),
``no_sync`` (True: accumulate micro-steps locally), ``quantize`` ("int8"/"fp8": block-scaled all-gathers
and reduce-scatters, `distlab.parallel.quantized_collectives`), ``offload`` ("cpu"/"disk": the optimizer an
`OffloadedOptimizer` over the shards). Checkpoints: the "model-parallel" format, each
shard a dim-0 block of its parameter (rows saved), so a checkpoint consolidates and reshards to and
from the other strategies (`distlab.checkpoint.reshard`).
"""
from __future__ import annotations

import torch

from ..checkpoint.state import model_parallel_state
from ..comm.quantized import check_kind
from ..memory import fsdp_memory
from ..parallel.clip import clip_grad_norm_
from ..parallel.zero import fsdp
from ..runtime import rank, world_size
from ..parallel.zero.offload import OffloadedOptimizer
from .base import (RankResult, TrainSpec, build_model, make_optimizer, optimizer_class, optimizer_kwargs,
                   rank0_copy, require_rows)
from .compose import parallelize
from .data_parallel import _forward, offload_options
from .loop import Plan, run, sum_losses

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}


def check(spec: TrainSpec, world: int) -> None:
    """Refuse, before any rank starts, what ``fsdp`` cannot run on ``world`` ranks."""
    require_rows(spec, world)
    options(spec, world)


def options(spec: TrainSpec, world: int) -> dict:
    """The keyword arguments of `fully_shard` for ``spec`` on ``world`` ranks; refuses bad ones (also
    called by `dl.train` before any rank starts)."""
    o = spec.data_parallel                       # each value's type and range: its field's rule
    if world % o.hsdp:
        raise ValueError(f"hsdp={o.hsdp!r}: the replicate degree must be a positive int dividing "
                         f"world_size={world} (mesh (hsdp, world_size / hsdp))")
    name = o.param_dtype or {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(spec.precision)
    if o.quantize is not None:
        check_kind(o.quantize)                   # fp8 where this torch has no float8_e4m3fn: refused
    return {"mesh": (o.hsdp, world // o.hsdp) if o.hsdp > 1 else None, "param_dtype": DTYPES[name],
            "reshard_after_forward": o.reshard_after_forward, "quantize": o.quantize}


def describe(model: torch.nn.Module, params: list) -> list[dict]:
    """Per optimizer parameter: its name, and the dim-0 rows this rank holds (None: held whole)."""
    blocks = {id(p.shard): p for u in fsdp.units(model) for p in u.params}
    comm = fsdp.units(model)[-1].shard_comm
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for p in params:
        sp = blocks.get(id(p))
        lo = min(comm.rank * sp.rows, sp.shape[0]) if sp is not None else 0
        out.append({"name": names[id(p)], "key": names[id(p)], "dim": None if sp is None else 0,
                    "tp_rank": comm.rank if sp else 0, "tp_size": comm.size if sp else 1,
                    "rows": None if sp is None else [lo, lo + sp.local_rows]})
    return out


def train_rank(spec: TrainSpec) -> RankResult:
    n, r = world_size(), rank()
    require_rows(spec, n)
    kwargs = options(spec, n)
    model = parallelize(build_model(spec), spec.layout, fsdp=kwargs).model    # the DP step: fully_shard
    params = list(model.parameters())                # the shards, in the optimizer's order
    offload = offload_options(spec)
    optimizer = (OffloadedOptimizer(params, optimizer_class(spec), **offload, **optimizer_kwargs(spec))
                 if offload else make_optimizer(params, spec))
    unit = fsdp.units(model)[-1]
    sharded = [p.shard for u in fsdp.units(model) for p in u.params]
    replicas = unit.replica_comm.group if unit.replica_comm is not None else None
    state = model_parallel_state(model, params, model, optimizer, loss_weight=True, keeps_history=r == 0,
                                 replica_group=replicas, layout={"hsdp": kwargs["mesh"]},
                                 described=describe(model, params))
    no_sync = (lambda: fsdp.no_sync(model)) if spec.data_parallel.no_sync is not False else None
    plan = Plan(_forward(spec, model, model, n, r), optimizer, state, loss_share=1 / n, no_sync=no_sync,
                clip=lambda max_norm: clip_grad_norm_(params, max_norm, sharded=sharded,
                                                      groups=[unit.shard_comm.group]),
                memory=fsdp_memory(model, optimizer),
                grads=lambda: [p.grad for p in params if p.grad is not None])
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)
    if offload:
        optimizer.close()                                # offload="disk": its files
    full = fsdp.full_state_dict(model)
    params_out = rank0_copy(full)
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return RankResult(losses=losses if r == 0 else None, params=params_out,
                      info={"param_bytes": shard_bytes, "world": world_size(), **trained.info})
