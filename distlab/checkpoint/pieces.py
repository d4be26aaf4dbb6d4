"""A user's own model, under any layout, saved as pieces of its logical tensors and read back into any other.

    dl.checkpoint.save("ck", step, model=model, optimizer=opt)    # on every rank
    dl.checkpoint.load("ck", model=model, optimizer=opt)          # any layout, any world size, one process

Saving. Each rank asks `distlab.parallel.placement` what it holds: pieces of the model's *logical*
tensors (their names in the model's own ``state_dict()``, their full shapes), each with its cut (whole,
rows, flat, block), and the optimizer state cut like its parameter. Every rank's list is gathered; a
piece several ranks hold with the same cut (DDP replicas, HSDP's replica groups, what tp leaves whole,
Adam's ``step``) is written once, by the first of them, after checking that the copies really are equal
(equal bytes: a piece wrongly taken for a replica would otherwise be saved from rank 0 alone):

    fully_shard on 2 ranks, W (5, 4) and b (4,) kept whole (replicate=), AdamW
    rank 0 holds  W rows [0, 3)  b  exp_avg W rows [0, 3)  exp_avg b  step    -> writes all of it
    rank 1 holds  W rows [3, 5)  b  exp_avg W rows [3, 5)  exp_avg b  step    -> writes the rows only

The manifest (`store`: the same atomic, verified, ``weights_only`` files as every distlab checkpoint)
records, per rank, each piece it wrote (name, state key or null, cut, the ranks holding a copy, its
slot in the rank's file) and, for the whole checkpoint, every logical tensor's shape and dtype, the
names of tied parameters, and the optimizer class: what torch.distributed.checkpoint keeps in its
metadata, as JSON one can read.

Loading needs no communication (nor a process group): a rank describes the layout it has *now*, and
for each of its pieces assembles the logical tensor from the saved pieces covering it (each element
must be covered) and cuts its own piece out. This reads every saved piece of the names the rank
holds; torch.distributed.checkpoint reads only the overlapping byte ranges, the next step up.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..parallel import placement
from ..parallel.cuts import Cut
from . import store
from .files import CheckpointError

FORMAT = "pieces"


# -- saving ----------------------------------------------------------------------------------------
def save(directory, step: int, model, optimizer=None, *, keep_last: int | None = None) -> Path:
    """Save ``model`` (and ``optimizer``'s state) as pieces; a collective: call on every rank."""
    layout = placement.describe(model)
    items = [(p.name, None, p) for p in layout.pieces]
    if optimizer is not None:
        items += placement.optimizer_pieces(layout, optimizer)
    entries = [_entry(name, key, piece) for name, key, piece in items]
    facts = {"tensors": {n: [list(s), str(d).removeprefix("torch.")] for n, (s, d) in layout.tensors.items()},
             "aliases": layout.aliases, "names": layout.order, "stage": layout.partial,
             "optimizer": None if optimizer is None else placement.optimizer_class(optimizer),
             "groups": {} if optimizer is None else placement.group_settings(layout, optimizer)}
    everyone = store._all_gather((entries, facts))
    meta, writes = _plan(everyone)
    r = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    tensors = [items[i][2].tensor for i in writes[r]]
    return store.save(directory, step, {"pieces": tensors}, meta=meta, keep_last=keep_last)


def _entry(name: str, key: str | None, piece) -> dict:
    """What a rank tells the others about one piece it holds (a plain scalar travels as its value)."""
    if not isinstance(piece, placement.Piece):
        return {"name": name, "key": key, "cut": {"kind": "whole"}, "value": piece, "digest": repr(piece)}
    t = piece.tensor.detach().cpu().contiguous()
    digest = hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    return {"name": name, "key": key, "cut": piece.cut.as_dict(), "shape": list(piece.shape),
            "dtype": str(t.dtype).removeprefix("torch."), "digest": digest}


def _plan(everyone: list[tuple[list, dict]]) -> tuple[dict, list[list[int]]]:
    """(the manifest's meta, per rank the indices of its entries it writes): the first copy of each piece."""
    first: dict[tuple, dict] = {}
    pieces: list[list[dict]] = [[] for _ in everyone]
    writes: list[list[int]] = [[] for _ in everyone]
    for r, (entries, _) in enumerate(everyone):
        for i, e in enumerate(entries):
            ident = (e["name"], e["key"], json.dumps(e["cut"], sort_keys=True))
            if ident in first:
                _same_copy(first[ident], e, r)
                continue
            rec = {k: v for k, v in e.items() if k != "digest"} | {"held_by": [r]}
            if "value" not in e:
                rec["slot"] = len(writes[r])
                writes[r].append(i)
            first[ident], rec["_digest"] = rec, e["digest"]
            pieces[r].append(rec)
    for rec in first.values():
        del rec["_digest"]
    return {"format": FORMAT, **_facts(everyone, first.values()), "pieces": pieces}, writes


def _same_copy(rec: dict, e: dict, r: int) -> None:
    if rec["_digest"] != e["digest"]:
        what = e["name"] + ("" if e["key"] is None else f" (optimizer state {e['key']!r})")
        raise CheckpointError(
            f"ranks {rec['held_by'][0]} and {r} both hold {what} with the same cut {e['cut']}, but their "
            f"copies differ: the replicas have diverged (a rank that skipped a step, or an unsynchronised "
            f"update), or a layer cuts this parameter in a way distlab cannot see (give the layer "
            f"shard_dims and a group, as dl.tp's layers have). Nothing was saved")
    rec["held_by"].append(r)


def _facts(everyone: list[tuple[list, dict]], records) -> dict:
    """Every logical tensor (the union over ranks: pipeline stages hold different ones), tied names,
    the optimizer class, and the logical shape of each optimizer state (per element: the parameter's)."""
    tensors, aliases, classes, groups = {}, {}, set(), {}
    for _, facts in everyone:
        groups.update(facts["groups"])
        for name, spec in facts["tensors"].items():
            if tensors.setdefault(name, spec) != spec:
                raise CheckpointError(f"ranks disagree on {name}: {tensors[name]} and {spec}: every rank "
                                      f"must save the same model")
        aliases.update(facts["aliases"])
        classes.add(facts["optimizer"])
    if len(classes) > 1:
        raise CheckpointError(f"ranks pass different optimizers ({sorted(map(str, classes))}): pass the "
                              f"optimizer on every rank, or on none")
    state: dict[str, dict] = {}
    for rec in records:
        if rec["key"] is not None:
            state.setdefault(rec["name"], {})[rec["key"]] = rec.get("shape")
    names = [n for _, facts in everyone for n in facts["names"]]        # state_dict() order (stages: in turn)
    return {"tensors": tensors, "aliases": aliases, "names": list(dict.fromkeys(names)),
            "stages": any(f["stage"] for _, f in everyone), "optimizer": classes.pop(), "state": state,
            "groups": groups}


# -- reading ---------------------------------------------------------------------------------------
class Source:
    """The saved pieces of checkpoint ``info`` (a pieces manifest), assembled on demand into logical
    tensors; ``rename`` maps this run's names to the saved ones (tied parameters, another first name).
    What `placement.load_optimizer` asks: ``keys(name)``, ``get(name, key, cut)``."""

    def __init__(self, directory, info: dict, rename: dict[str, str] | None = None, verify: bool = True):
        self.directory, self.step, self.verify = directory, info["step"], verify
        self.meta, self.rename = info["meta"], rename or {}
        self.index: dict[tuple, list[tuple[int, dict]]] = {}
        for r, recs in enumerate(self.meta["pieces"]):
            for rec in recs:
                self.index.setdefault((rec["name"], rec["key"]), []).append((r, rec))
        self.files: dict[int, dict] = {}
        self.full: dict[tuple, torch.Tensor] = {}

    def saved_name(self, name: str) -> str:
        name = self.rename.get(name, name)
        return self.meta["aliases"].get(name, name)

    def keys(self, name: str) -> list[str]:
        return list(self.meta["state"].get(self.saved_name(name), {}))

    def get(self, name: str, key: str | None, cut: Cut):
        """The piece ``cut`` of tensor ``name`` (``key``: of its optimizer state; a scalar state as saved)."""
        name = self.saved_name(name)
        shape = self.meta["tensors"][name][0]
        if key is not None and self.meta["state"][name][key] != shape:   # a scalar (Adam's step)
            r, rec = self.index[(name, key)][0]
            return rec["value"] if "value" in rec else self._file(r)[rec["slot"]].clone()
        return cut.take(self.tensor(name, key)).clone()

    def tensor(self, name: str, key: str | None = None) -> torch.Tensor:
        """The logical tensor ``name`` (or its optimizer state ``key``) from every saved piece of it."""
        name = self.saved_name(name)
        if (name, key) not in self.full:
            self.full[(name, key)] = self._assemble(name, key)
        return self.full[(name, key)]

    def _assemble(self, name: str, key: str | None) -> torch.Tensor:
        shape, dtype = self.meta["tensors"][name]
        found = self.index.get((name, key), [])
        if found:
            dtype = found[0][1]["dtype"]
        full = torch.zeros(shape, dtype=getattr(torch, dtype))
        covered = torch.zeros(shape, dtype=torch.bool)
        for r, rec in found:
            cut = Cut.from_dict(rec["cut"])
            piece = self._file(r)[rec["slot"]]
            cut.put(full, piece)
            cut.put(covered, torch.ones(piece.shape, dtype=torch.bool))
        if not bool(covered.all()):
            what = name + ("" if key is None else f" (optimizer state {key!r})")
            raise CheckpointError(f"checkpoint step {self.step} in {self.directory} covers only "
                                  f"{int(covered.sum())} of {covered.numel()} elements of {what}: its pieces "
                                  f"are incomplete (a rank's file lost, or a layout saved wrongly); load "
                                  f"another step (complete: {store.steps(self.directory)})")
        return full

    def _file(self, r: int) -> list[torch.Tensor]:
        if r not in self.files:
            (state,) = store.load_all(self.directory, self.step, verify=self.verify, ranks=[r])
            self.files[r] = state["pieces"]
        return self.files[r]


def load(directory, info: dict, model, optimizer=None, *, strict: bool = True, verify: bool = True) -> None:
    """Put checkpoint ``info`` (a pieces manifest) into ``model`` and ``optimizer``, whatever their layout."""
    layout = placement.describe(model)
    rename = match(layout, info, directory, strict)
    if optimizer is not None:
        check_optimizer(info, optimizer, directory)
    source = Source(directory, info, rename, verify)
    with torch.no_grad():
        for piece in layout.pieces:
            if piece.name in rename:
                piece.tensor.copy_(source.get(piece.name, None, piece.cut))
    placement.refresh_masters(layout)
    if optimizer is not None:
        placement.load_optimizer(layout, optimizer, _Matched(source, rename))
        settings = info["meta"].get("groups", {})
        placement.set_group_settings(layout, optimizer,
                                     lambda n: settings.get(source.saved_name(n)) if n in rename else None)


class _Matched:
    """A source that knows no optimizer state for the names ``strict=False`` left out."""

    def __init__(self, source: Source, names: dict):
        self.source, self.names = source, names

    def keys(self, name: str) -> list[str]:
        return self.source.keys(name) if name in self.names else []

    def get(self, name: str, key: str | None, cut: Cut):
        return self.source.get(name, key, cut)


def match(layout: placement.Layout, info: dict, directory, strict: bool) -> dict[str, str]:
    """{this model's name: the checkpoint's} for every logical tensor both hold; a clear error for
    names only one side has (``strict``) and for any shape that differs."""
    meta = info["meta"]
    saved, aliases = meta["tensors"], meta["aliases"]
    others = {}
    for alias, first in layout.aliases.items():
        others.setdefault(first, []).append(alias)
    rename, missing, wrong = {}, [], []
    for name, (shape, _) in layout.tensors.items():
        found = next((aliases.get(n, n) for n in [name, *others.get(name, [])]
                      if aliases.get(n, n) in saved), None)
        if found is None:
            missing.append(name)
        elif list(shape) != saved[found][0]:
            wrong.append(f"{name}: checkpoint {tuple(saved[found][0])}, model {tuple(shape)}")
        else:
            rename[name] = found
    extra = [] if layout.partial else sorted(set(saved) - set(rename.values()))
    if wrong or (strict and (missing or extra)):
        raise CheckpointError(_mismatch(directory, info["step"], missing, extra, wrong))
    return rename


def _mismatch(directory, step: int, missing: list, extra: list, wrong: list) -> str:
    parts = [f"checkpoint step {step} in {directory} does not fit this model"]
    if wrong:
        parts.append(f"shapes differ: {'; '.join(wrong[:4])}" + (" ..." if len(wrong) > 4 else ""))
    if missing:
        parts.append(f"{len(missing)} name(s) of the model are not in the checkpoint: {missing[:4]}")
    if extra:
        parts.append(f"{len(extra)} name(s) of the checkpoint are not in the model: {extra[:4]}")
    fix = ("build the model with the same class and config as the one that saved it (dl.checkpoint."
           "consolidate(directory) lists what the checkpoint holds, name by name)")
    if not wrong:
        fix += ", or load the names both have with dl.checkpoint.load(..., strict=False)"
    return "; ".join(parts) + ". To load it: " + fix


def check_optimizer(info: dict, optimizer, directory) -> None:
    saved, ours = info["meta"]["optimizer"], placement.optimizer_class(optimizer)
    if saved is None:
        raise CheckpointError(f"checkpoint step {info['step']} in {directory} holds no optimizer state (it "
                              f"was saved with model= only): load it without optimizer= and let the "
                              f"optimizer start fresh, or save with optimizer=opt next time")
    if saved != ours:
        raise CheckpointError(f"checkpoint step {info['step']} in {directory} holds {saved} state, this "
                              f"optimizer is {ours}: build a torch.optim.{saved} on the model's parameters, "
                              f"or load without optimizer= to take the model alone")
