"""How a piece is cut out of its tensor: the four cuts distlab's layouts make, and a cut of a cut.

A parameter of logical shape (d0, d1, ...) that no rank holds whole is held in pieces, each cut out of
it in one of four ways (`distlab.parallel.placement` says which layout cuts which way):

    W (5, 2) over 2 ranks    rank 0                     rank 1
      rows                   W[0:3]                     W[3:5]              (ceil(5 / 2) = 3 rows a rank)
      block, dim 1           W[:, 0:1]                  W[:, 1:2]
      flat, in a bucket      W.flatten()[0:6]           W.flatten()[6:10]   (bucket [W | b (2,)], 12
                                                        and b whole          elements, 6 a rank)

``packed=k`` (a fused q|k|v): the tensor is k blocks side by side along ``dim``, and rank i holds block i
of each. ``then``: a cut of the piece this cut leaves (fully_shard over tensor-parallel blocks: rows of
this rank's block). `take` cuts a piece out, `put` writes one back in place: the same arithmetic both
ways, so a checkpoint can be written in one layout and read back in any other.

Who cuts what is read in one place, `held`: one `Held` record per parameter (its cut, the groups over
which ranks hold different pieces, the groups over which they hold copies), from the wrappers and layers:

    DDP(module, group)            every parameter of module     a copy over group
    dl.fully_shard                its shards: rows              cut over the shard group (HSDP: a copy
                                                                over the replica group)
                                  kept whole (replicate=)       a copy over the data-parallel group
    dl.tp / dl.ep layers          what ``shard_dims`` names:    cut over ``group``; every other parameter:
                                  a block (``packed``: q|k|v)   a copy over ``group``

The checkpoint (`placement.describe`) reads the cuts, `dl.clip_grad_norm_` the groups: a new parallelism
that cuts or copies parameters says so here once, and both follow.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from . import collectives as C

KEYS = {"whole": (), "rows": ("start", "stop"), "flat": ("start", "stop"),
        "block": ("dim", "index", "parts", "packed")}          # the fields each kind uses


@dataclass(frozen=True)
class Cut:
    """How a piece is cut out of its logical tensor (see the module docstring for the kinds)."""

    kind: str = "whole"                 # "whole" | "rows" | "flat" | "block"
    start: int = 0                      # rows, flat: [start, stop)
    stop: int = 0
    dim: int = 0                        # block: block `index` of `parts` along `dim`, of each of `packed`
    index: int = 0
    parts: int = 1
    packed: int = 1
    then: Cut | None = None             # a cut of this cut's piece

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This cut's piece of ``full`` (a view where one exists)."""
        piece = self._take(full)
        return piece if self.then is None else self.then.take(piece)

    def put(self, full: torch.Tensor, piece: torch.Tensor) -> None:
        """Write ``piece`` where this cut sits in ``full`` (a contiguous tensor of the logical shape)."""
        if self.then is not None:                    # read, write the inner piece into it, write it back
            outer = self._take(full).clone()
            self.then.put(outer, piece)
            piece = outer
        if self.kind == "whole":
            full.copy_(piece)
        elif self.kind == "rows":
            full[self.start:self.stop].copy_(piece)
        elif self.kind == "flat":
            full.view(-1)[self.start:self.stop].copy_(piece.reshape(-1))
        else:
            view = self._block(full)
            view.copy_(piece.reshape(view.shape))

    def _take(self, full: torch.Tensor) -> torch.Tensor:
        if self.kind == "whole":
            return full
        if self.kind == "rows":
            return full[self.start:self.stop]
        if self.kind == "flat":
            return full.reshape(-1)[self.start:self.stop]
        shape = (*full.shape[:self.dim], full.shape[self.dim] // self.parts, *full.shape[self.dim + 1:])
        return self._block(full).reshape(shape)

    def _block(self, full: torch.Tensor) -> torch.Tensor:
        """(..., packed, d / packed, ...) narrowed to this rank's block of each packed part."""
        d = full.shape[self.dim]
        split = [*full.shape[:self.dim], self.packed, d // self.packed, *full.shape[self.dim + 1:]]
        size = d // self.packed // self.parts
        return full.view(split).narrow(self.dim + 1, self.index * size, size)

    def as_dict(self) -> dict:
        """The JSON form a manifest records (only the fields this kind uses)."""
        out = {"kind": self.kind, **{k: getattr(self, k) for k in KEYS[self.kind]}}
        return out if self.then is None else {**out, "then": self.then.as_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Cut:
        """The cut a manifest records (`as_dict`); an unknown kind or field is refused."""
        if d.get("kind") not in KEYS or set(d) - {"kind", "then", *KEYS[d["kind"]]}:
            raise ValueError(f"{d} is not a cut: kinds {sorted(KEYS)}, fields as_dict writes")
        fields = {k: int(d[k]) for k in KEYS[d["kind"]]}
        then = cls.from_dict(d["then"]) if d.get("then") is not None else None
        return cls(d["kind"], **fields, then=then)


# -- who cuts what ---------------------------------------------------------------------------------
@dataclass
class Held:
    """How this rank holds one parameter, read from the wrappers and layers around it (`held`): the
    logical tensor's ``shape``; the ``cut`` of it this rank holds (what a checkpoint records); the groups
    ``cut_over`` whose ranks hold different pieces of it (a tp/ep layer's group, fully_shard's shard group);
    the groups ``copies`` whose ranks hold this same piece (DDP's group, HSDP's replica group, fully_shard's
    ``replicate=``, a tp/ep layer's group for what its layers leave whole). `dl.clip_grad_norm_` reads the
    groups: a replicated piece counts on the first copy only."""

    shape: tuple[int, ...]
    cut: Cut = Cut()
    cut_over: list = field(default_factory=list)
    copies: list = field(default_factory=list)


def held(roots: list[nn.Module]) -> dict[int, Held]:
    """{id(parameter): how this rank holds it} for every parameter of the modules ``roots`` (a model, or a
    pipeline rank's stages): each wrapper and layer says what it cut or copied, here and only here."""
    out = {id(p): Held(tuple(p.shape)) for r in roots for p in r.parameters()}
    modules = [m for r in roots for m in r.modules()]
    for m in modules:
        _copied(m, out)
        _rows(m, out)
    cut: dict[int, tuple] = {}                          # id(tp/ep group) -> (group, ids of what it cuts)
    for m in modules:                                   # after the rows: a block cut first, its rows then
        for p, block in _blocks(m):
            h = out[id(p)]
            h.cut = block if h.cut.kind == "whole" else replace(block, then=h.cut)
            h.shape = tuple(d * block.parts if i == block.dim else d for i, d in enumerate(h.shape))
            group = getattr(m, "group", None)          # None: the world
            h.cut_over.append(group)
            cut.setdefault(id(group), (group, set()))[1].add(id(p))
    for group, ids in cut.values():                     # what no layer cut over a group: a copy there
        for i, h in out.items():
            if i not in ids:
                h.copies.append(group)
    return out


def _copied(m: nn.Module, out: dict[int, Held]) -> None:
    """DDP (or NaiveDDP) ``m``: every parameter of its module is a copy over its group."""
    from .data.ddp import DDP, NaiveDDP
    if isinstance(m, (DDP, NaiveDDP)):
        for p in m.module.parameters():
            out[id(p)].copies.append(m.comm.group)


def _rows(m: nn.Module, out: dict[int, Held]) -> None:
    """dl.fully_shard's unit on ``m``: rank r of its shard group holds rows [r c, r c + local rows) of each
    shard, c = ceil(d0 / N) (`zero.fsdp_unit.ShardedParam`), a copy over the replica group (HSDP); the
    parameters kept whole (``replicate=``) are copies over the data-parallel group."""
    unit = getattr(m, "_fsdp", None)
    if unit is None:
        return
    for sp in unit.params:
        lo = min(unit.shard_comm.rank * sp.rows, sp.shape[0])
        h = out[id(sp.shard)]
        h.cut, h.shape = Cut("rows", lo, lo + sp.local_rows), tuple(sp.shape)
        h.cut_over.append(unit.shard_comm.group)
        h.copies += [] if unit.replica_comm is None else [unit.replica_comm.group]
    for _, _, p in unit.replicated:
        out[id(p)].copies.append(unit.dp.group)


def _blocks(m: nn.Module) -> list[tuple[torch.Tensor, Cut]]:
    """[(parameter, its block cut)] for what a dl.tp layer (or an expert shard) ``m`` cuts: its
    ``shard_dims`` name the dim, its ``group`` the parts, ``packed`` a fused q|k|v."""
    dims, group = getattr(m, "shard_dims", None), getattr(m, "group", None)
    if not dims or C.group_size(group) == 1:
        return []
    return [(p, Cut("block", dim=dims[name], index=C.group_rank(group), parts=C.group_size(group),
                    packed=getattr(m, "packed", 1)))
            for name, p in m.named_parameters(recurse=False) if name in dims]


def mark_cut(module: nn.Module, group) -> None:
    """Mark the parameters ``module`` cuts over ``group`` (those its ``shard_dims`` names) with
    ``_cut_over``: `held` in parameter form, for `dl.clip_grad_norm_` given bare parameters (no module to
    read), to tell a piece from a replica."""
    if C.group_size(group) > 1:
        for name in module.shard_dims:
            p = getattr(module, name, None)
            if isinstance(p, torch.Tensor):
                p._cut_over = Mark((group,))           # a tuple: group None (the world) is a group too


class Mark(tuple):
    """A parameter's marker, ``(group,)``. A process group can be neither copied nor pickled, so a
    ``copy.deepcopy`` of the parameter shares the mark and a pickled one drops it (``()``: unmarked)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return tuple, ()
