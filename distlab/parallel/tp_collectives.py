"""Traced collectives over a tensor-parallel group: all-reduce, all-gather, reduce-scatter.

The tensor-parallel operators (`tp_ops`) call these. Each runs the ``torch.distributed``
collective (gloo here, NCCL on GPUs: their fastest kernels) and records one comm event in
``dl.tracer()`` with the bytes a bandwidth-optimal ring moves for it, counted exactly as
`distlab.comm`'s ring collectives count theirs (chunk sizes from ``torch.tensor_split``):

    op              size S (event arg "size")        sent per rank
    all_reduce      the tensor reduced                2S - |c_r| - |c_r+1|     = 2 (t-1)/t S
    all_gather      the gathered output               S - |c_r+1|              =   (t-1)/t S
    reduce_scatter  the input before scattering       S - |c_r|                =   (t-1)/t S

(``c_i`` = chunk i of the message; the right-hand forms hold when t divides S, which the TP
layers require.) Extra keyword tags (``phase``, ``operator``, ``where``) land in the event's args,
so a test or lesson can select e.g. the forward all-reduces of ``blocks.0``.

With a group of one rank (or no process group at all) every collective is the identity and
records nothing: a TP model of degree 1 is the plain model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import ring_bytes
from ..runtime import tracer

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group=None) -> int:
    """Ranks in ``group`` (1 outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    """This rank's index inside ``group`` (0 outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    r = dist.get_rank(group)
    if r < 0:
        raise ValueError(f"rank {dist.get_rank()} is not in this tensor-parallel group: build the "
                         "layer only on the ranks passed to dist.new_group(...)")
    return r


def _record(op: str, start: float, t: torch.Tensor, numel: int, group, **tags) -> None:
    tr = tracer()
    n, r = group_size(group), group_rank(group)
    sent, received = ring_bytes(numel, t.element_size(), n, r, op)
    tr.comm(op, start=start, end=tr.now(), sent=sent, received=received,
            size=numel * t.element_size(), world=n, **tags)


def all_reduce(t: torch.Tensor, group=None, op: str = "sum", **tags) -> torch.Tensor:
    """Sum (or max) ``t`` over the group, in place; returns ``t``."""
    if group_size(group) == 1:
        return t
    start = tracer().now()
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    _record("all_reduce", start, t, t.numel(), group, **tags)
    return t


def all_gather(shard: torch.Tensor, dim: int, group=None, **tags) -> torch.Tensor:
    """Concatenate every rank's equal-sized ``shard`` along ``dim``, in rank order."""
    n = group_size(group)
    if n == 1:
        return shard
    dim = dim % shard.dim()
    shard = shard.contiguous()
    start = tracer().now()
    out = torch.empty((n * shard.shape[0],) + tuple(shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    _all_gather_single(out, shard, group=group)
    _record("all_gather", start, shard, out.numel(), group, **tags)
    if dim == 0:
        return out
    # (n, ..., k, ...) -> (..., n*k, ...): move the rank axis next to ``dim`` and merge them
    out = out.view((n,) + tuple(shard.shape))
    return out.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(t: torch.Tensor, dim: int, group=None, **tags) -> torch.Tensor:
    """Sum ``t`` over the group and keep this rank's ``1/n`` slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return t
    dim = dim % t.dim()
    if t.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter size {t.shape[dim]} over {n} ranks: it must divide evenly")
    # lay the n slices out one after another so slice r is a contiguous block
    blocks = t.unflatten(dim, (n, t.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = torch.empty(blocks.shape[1:], dtype=t.dtype, device=t.device)
    blocks = blocks.flatten(0, 1) if blocks.dim() > 2 else blocks.flatten()
    start = tracer().now()
    _reduce_scatter_single(out, blocks, group=group)
    _record("reduce_scatter", start, t, t.numel(), group, **tags)
    return out


def split(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's ``1/n`` slice of ``t`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"cannot split size {t.shape[dim]} over {n} ranks: it must divide evenly")
    return t.chunk(n, dim)[group_rank(group)].contiguous()
