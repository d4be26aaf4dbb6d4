"""FSDP2: every parameter sharded on dim 0, gathered one module ("unit") at a time (Zhao et al. 2023,
"PyTorch FSDP", and torch's ``fully_shard``, the per-parameter rewrite of it).

    for block in model.blocks:
        dl.fully_shard(block)                        # bottom-up: the blocks, then the root
    dl.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())      # after sharding: the parameters are the shards
    loss.backward(); opt.step()                      # .grad: this shard's averaged gradient (fp32)
    dl.full_state_dict(model)                        # {name: full tensor}, on every rank

This file is the public face (sharding a module, HSDP's groups, no_sync, the full state); the unit's
machinery, what happens in forward and backward, is `fsdp_unit.py`.

ZeRO-3 (`zero3.py`) flattens a unit into one padded buffer and owns the optimizer. ``fully_shard``
keeps each parameter a parameter: rank r holds rows ``[r c, (r+1) c)`` of it, ``c = ceil(d0 / N)``,
as an ordinary ``nn.Parameter`` registered where the original was, so any optimizer the user builds
on ``module.parameters()`` updates the shards:

    W (d0 = 5, N = 2, c = 3)     rank 0: rows 0..2      rank 1: rows 3..4 (+ 1 row of padding, internal)

    forward of a unit:   all-gather the padded shards (one collective per unit: copy-in, gather,
                         copy-out into one tensor per parameter), compute, free      (N-1)/N Psi_unit
    backward of a unit:  gather again (reshard_after_forward=True; False keeps them from forward),
                         compute, free, reduce-scatter the gradients into the shards' .grad (avg)

    ||shard|| = ceil(d0 / N) rows; bytes per rank per step 3 (N-1)/N Psi, as ZeRO-3 (2 without resharding)

Applied bottom-up: ``fully_shard(block)`` for each block, then ``fully_shard(model)`` for what is left
(embeddings, head); the root then drives its units with one `Coordinator` (forward order recorded on the
first step: the next unit prefetched in forward, the previous one in backward; one bounded queue of
reduce-scatters, `reducer.GradReducer`, shared with ZeRO). Mixed precision: ``param_dtype`` for the
all-gather and compute (the shards stay fp32 masters), ``reduce_dtype`` for the reduce-scatter.
``replicate=``: parameters kept whole, gradients all-reduced (DDP). HSDP, ``mesh=(R, S)``::

    grid = arange(R S).view(R, S)     shard groups: rows (S ranks, fast links)
                                      replica groups: columns (R ranks); after the reduce-scatter in a
                                      row, each shard's gradient is all-reduced down its column

Gradient accumulation: ``no_sync(module)`` (FSDP2's ``set_requires_gradient_sync(False)``) keeps the
unsharded gradients of each unit summed locally (fp32), reduce-scattered by the next synced backward.

Clipping: ``torch.nn.utils.clip_grad_norm_`` on the shards would compute this rank's norm; each shard (and
each whole parameter) carries ``_fsdp_copies``, the ranks holding a copy of it, which `dl.clip_grad_norm_`
reads to sum the squares of the whole model, replicas once (`parallel/clip.py`).

Offload (ZeRO-Offload / ZeRO-Infinity): the optimizer is the user's, so offloading it is too, one line:
``opt = dl.OffloadedOptimizer(model.parameters(), torch.optim.AdamW, offload="cpu", lr=...)`` keeps the
state and fp32 masters of the shards in host memory (``"disk"``: in files) and steps there (`offload`).

Scalars (0-dim parameters) are kept whole, like ``replicate=``. Tied parameters must sit in one unit
(a common parent): one shard then fills every slot. A unit's module is called once per forward.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..flat_collectives import Collectives
from ..quantized_collectives import collectives, exact
from ..mesh import as_group, describe, grid_groups, mesh_dims, span_group
from .fsdp_unit import FSDPUnit, ShardedParam


# -- the public functions ------------------------------------------------------------------------
def fully_shard(module: nn.Module, *, group=None, mesh=None, param_dtype=None, reduce_dtype=None,
                reshard_after_forward: bool = True, replicate=None,
                quantize: str | None = None) -> nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` took) on dim 0, in place; returns it.

    ``group``: the data-parallel ranks (default: the world; or a 1-D mesh); ``mesh=(R, S)``: HSDP over
    the world, shards over S ranks, R replicas (a 2-D DeviceMesh or dl.Mesh: HSDP over it, (replicate,
    shard); a 1-D one: FSDP over it); ``param_dtype``/``reduce_dtype``: gather-and-compute and
    reduce-scatter dtypes (the shards stay in their own dtype); ``replicate``: parameters kept whole,
    gradients averaged; ``quantize``: "int8" or "fp8", the shards' all-gathers and reduce-scatters sent
    as block-scaled packets (`..quantized_collectives`; replicas' all-reduces stay exact). Build the
    optimizer *after* sharding, on ``module.parameters()`` (one built
    before holds the replaced originals: its first ``step`` raises, `_refuse_stale_optimizers`).
    """
    replicate, group = list(replicate or []), as_group(group)      # a 1-D mesh: its process group
    fresh, replicated = _params_to_shard(module, replicate)
    _refuse_stale_optimizers()
    dp, shard_comm, replica_comm = _comms(module, group, mesh, quantize)
    _broadcast([p for p, _ in fresh] + [p for _, _, p in replicated] + list(module.buffers()), dp)
    device = next((p.device for p, _ in fresh), torch.device("cpu"))
    dtype = param_dtype or next((p.dtype for p, _ in fresh), torch.float32)
    params = [ShardedParam(p, slots, shard_comm.size, shard_comm.rank) for p, slots in fresh]
    for _, _, p in replicated:
        p._fsdp_whole = True                          # this unit all-reduces it; outer units leave it
        p._fsdp_copies = dp                           # a replica on every rank (`dl.clip_grad_norm_`)
    for (p, _), sp in zip(fresh, params):
        sp.shard._fsdp_copies = replica_comm          # distinct on every rank; under HSDP, a replica
        if hasattr(p, "_cut_over"):                   # a tensor-parallel piece, sharded again
            sp.shard._cut_over = p._cut_over
        sp.install(sp.shard)
        p._fsdp_moved = True                          # the original: gone from the module
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    unit = FSDPUnit(module, params, replicated, (dp, shard_comm, replica_comm), param_dtype=dtype,
                    reduce_dtype=reduce_dtype or dtype, reshard=reshard_after_forward, device=device)
    unit.cast_inputs, unit.mesh, unit.group = param_dtype is not None, mesh, group
    _coordinate_inner(unit, [m._fsdp for m in module.modules() if m is not module and hasattr(m, "_fsdp")])
    module._fsdp = unit
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward)
    return module


def _params_to_shard(module: nn.Module, replicate: list) -> tuple[list, list]:
    """([(parameter, its slots)] to shard, [(module, name, parameter)] kept whole); refuses bad input."""
    if hasattr(module, "_fsdp"):
        raise ValueError(f"{type(module).__name__} is already fully_shard-ed: call fully_shard once per "
                         "module, bottom-up (blocks first, then the root)")
    _refuse_sharded(module)
    slots: dict[int, tuple] = {}
    for mname, m in module.named_modules():
        for name, p in m._parameters.items():
            if p is None or getattr(p, "_fsdp_shard", False) or getattr(p, "_fsdp_whole", False):
                continue                                           # an inner unit's shard, or kept whole
            if getattr(p, "_fsdp_moved", False):
                raise ValueError(f"{mname}.{name} is tied to a parameter an inner fully_shard already "
                                 "sharded: tied parameters must live in one unit (shard their common parent)")
            slots.setdefault(id(p), (p, []))[1].append((m, name))
    ids = {id(p) for p in replicate}
    missing = [i for i, p in enumerate(replicate) if id(p) not in slots]
    if missing:
        raise ValueError(f"replicate= parameter(s) at position {missing} are not parameters of this "
                         f"{type(module).__name__} (or an inner fully_shard already sharded them): pass only "
                         "module parameters, to the fully_shard call of the module that holds them")
    fresh = [(p, s) for p, s in slots.values() if id(p) not in ids and p.dim() > 0]
    whole = [(m, n, p) for p, s in slots.values() if id(p) in ids or p.dim() == 0 for m, n in s]
    return fresh, whole


def _refuse_sharded(module: nn.Module) -> None:
    """Parameters someone else already sharded: an outer ``fully_shard`` (called top-down), torch's own
    ``fully_shard`` (DTensors), or ``dl.ZeRO(stage=3)`` (storage freed at rest; gathering from it would
    read freed memory)."""
    inner = {id(t) for m in module.modules() if hasattr(m, "_fsdp")
             for t in [*(p.shard for p in m._fsdp.params), *(p for _, _, p in m._fsdp.replicated)]}
    for name, p in module.named_parameters(remove_duplicate=False):
        if (getattr(p, "_fsdp_shard", False) or getattr(p, "_fsdp_whole", False)) and id(p) not in inner:
            raise ValueError(f"{name} belongs to an outer fully_shard already: call fully_shard bottom-up "
                             "(each block first, then the root), never on a part of a sharded module")
        if type(p).__name__ == "DTensor":
            raise ValueError(f"{name} is a DTensor (torch's fully_shard or parallelize_module sharded it): "
                             "use either torch's FSDP or dl.fully_shard on a plain module, not both")
        if p.numel() and p.untyped_storage().nbytes() < p.numel() * p.element_size():
            raise ValueError(f"{name} has no storage (it is a view of a freed flat buffer: dl.ZeRO(stage=3) "
                             "already shards this module): give fully_shard the plain module instead")


@functools.cache
def _refuse_stale_optimizers():
    """Once per process: every torch optimizer's ``step`` first checks it holds no parameter that
    ``fully_shard`` replaced by its shard (torch's public ``register_optimizer_step_pre_hook``). An
    optimizer built before sharding holds the originals, emptied: it would silently update nothing."""
    return register_optimizer_step_pre_hook(_refuse_if_stale)


def _refuse_if_stale(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if any(getattr(p, "_fsdp_moved", False) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("this optimizer holds parameters that fully_shard replaced by their shards: build "
                         "it *after* fully_shard, on module.parameters() (the shards); the one built before "
                         "would update nothing")


def _comms(module: nn.Module, group, mesh, quantize=None) -> tuple:
    """(data-parallel, shard, replica or None) `Collectives`; an inner unit's, when it used the same
    (the shard one quantized where ``quantize`` asks)."""
    for m in module.modules():
        inner = getattr(m, "_fsdp", None)
        if (inner is not None and inner.mesh == mesh and inner.group is group
                and getattr(inner.shard_comm, "quantize", None) == quantize):
            return inner.dp, inner.shard_comm, inner.replica_comm
    if mesh is not None and group is not None:
        raise ValueError("give fully_shard either group= (plain FSDP) or mesh= (HSDP over the world), "
                         "not both")
    dims = mesh_dims(mesh)                     # a DeviceMesh or dl.Mesh: 1-D is FSDP, 2-D HSDP over it
    if dims is not None and len(dims) == 1:
        group, mesh, dims = dims[0][1], None, None
    dp = Collectives("torch", span_group(mesh) if dims else group)
    if mesh is None:
        return dp, (dp if quantize is None else collectives("torch", group, quantize)), None
    if dims is None:
        shard_group, replica_group = hsdp_groups(*_check_mesh(mesh, dist.get_world_size()))
    elif len(dims) == 2:
        (_, replica_group), (_, shard_group) = dims
    else:
        raise ValueError(f"mesh={describe(mesh)}: fully_shard takes a 1-D mesh (FSDP) or a 2-D one (HSDP: "
                         "replicate, shard); pass a sub-mesh, e.g. mesh['dp_replicate', 'dp_shard']")
    return dp, collectives("torch", shard_group, quantize), Collectives("torch", replica_group)


def _check_mesh(mesh, world: int) -> tuple[int, int]:
    if (not isinstance(mesh, (tuple, list)) or len(mesh) != 2
            or not all(isinstance(d, int) and d >= 1 for d in mesh) or mesh[0] * mesh[1] != world):
        raise ValueError(f"mesh={mesh!r}: HSDP needs (replicate_degree, shard_degree), two positive ints "
                         f"whose product is the world size {world}, e.g. ({2 if world % 2 == 0 else 1}, "
                         f"{world // 2 if world % 2 == 0 else world})")
    return mesh[0], mesh[1]


def hsdp_groups(replicas: int, shards: int):
    """This rank's (shard group, replica group) of ``arange(world).view(replicas, shards)``: its row
    and its column. Every rank creates every group, in the same order (``new_group`` is collective)."""
    mine = grid_groups({"replicate": replicas, "shard": shards},
                       {"shard": ("shard",), "replicate": ("replicate",)})
    return mine["shard"], mine["replicate"]


@torch.no_grad()
def _broadcast(tensors: list, comm: Collectives) -> None:
    """Rank 0's values everywhere before cutting: the shards of one model (cf. ``broadcast_from_rank0``)."""
    for t in {id(t): t for t in tensors}.values():
        comm.broadcast(t.data, src=0)


def _coordinate_inner(root: FSDPUnit, inner: list[FSDPUnit]) -> None:
    """The root drives its inner units: one coordinator, one forward order, one reduce-scatter queue."""
    shared = root.coordinator
    for inner_coordinator in {id(u.coordinator): u.coordinator for u in inner}.values():
        shared.units[:0] = [u for u in inner_coordinator.units if u not in shared.units]
    for unit in shared.units:
        unit.coordinator = shared


def units(module: nn.Module) -> list[FSDPUnit]:
    """Every unit in ``module``'s tree (inner first); refuses a module fully_shard never touched."""
    found = [m._fsdp for m in module.modules() if hasattr(m, "_fsdp")][::-1]     # modules(): root first
    if not found:
        raise ValueError(f"{type(module).__name__} has no fully_shard-ed part: call dl.fully_shard first")
    return found


def set_requires_gradient_sync(module: nn.Module, requires: bool) -> None:
    """``False``: backward passes sum each unit's gradients locally, unsharded (FSDP2's switch)."""
    for unit in units(module):
        unit.coordinator.sync = requires


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Backward passes inside accumulate locally; the first one outside reduce-scatters the sum."""
    coordinators = {id(u.coordinator): u.coordinator for u in units(module)}.values()
    before = [c.sync for c in coordinators]
    for c in coordinators:
        c.sync = False
    try:
        yield
    finally:
        for c, b in zip(coordinators, before):
            c.sync = b


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full tensor} on every rank (a collective): shards gathered in their own (master) dtype."""
    full: dict[int, torch.Tensor] = {}
    for unit in units(module):
        if not unit.params:
            continue
        send = torch.cat([p.padded(p.shard.detach(), p.dtype) for p in unit.params])
        out = torch.empty(unit.shard_comm.size * unit.total, dtype=send.dtype, device=send.device)
        with exact(unit.shard_comm):                                        # never quantized
            unit.shard_comm.all_gather(out, send)
        rows = out.view(unit.shard_comm.size, unit.total)                 # (N, S)
        for p, off in zip(unit.params, unit.offsets):
            full[id(p.shard)] = p.unpad(rows[:, off:off + p.chunk]).clone()
    return {k: full[id(v)] if id(v) in full else v.detach().clone()
            for k, v in module.state_dict(keep_vars=True).items()}
