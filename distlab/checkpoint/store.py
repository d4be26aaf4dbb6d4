"""Sharded, atomic checkpoints on disk: every rank writes what it owns, rank 0 commits with one rename.

    directory/
      step_4/                 a complete checkpoint (it has a manifest: it was renamed into place)
        manifest.json         world size, step, run id, meta, per shard: file, bytes, sha256, replicated_from
        rank_0.pt             rank 0's own state + the replicated state of its replica group
        rank_1.pt             rank 1's own state (e.g. its ZeRO optimizer shard)
      step_6.tmp/             an interrupted save: never loaded, removed by the next save (only folders
                              distlab made are ever removed: see `distlab.checkpoint.files`)

The commit protocol (the same idea as torch.distributed.checkpoint and Megatron's, reduced to its bones):

    rank 0:  remove its own stale *.tmp, mkdir step_N.tmp    -- barrier (and rank 0's verdict) --
    rank r:  torch.save -> step_N.tmp/rank_r.pt, fsync       -- all-gather (bytes, sha256): a barrier --
    rank 0:  write manifest.json, fsync, rename step_N.tmp -> step_N, fsync directory, rotate keep_last
    all:     receive rank 0's verdict (raise together if the commit failed)

``rename`` is atomic on POSIX file systems, so a reader sees either no ``step_N`` or a complete
one; a crash anywhere before it leaves only ``step_N.tmp``. Rotation renames a victim to ``.tmp``
before deleting it, so a crash mid-delete cannot leave a half-deleted "complete" checkpoint.
All ranks must see the same file system (one machine, or a shared mount).

Replicated state (DDP's model and optimizer, ZeRO-1/2's parameters) is written once, by the first
rank of its replica ``group``; every rank's manifest entry records where to read it from. Loading
uses ``torch.load(..., weights_only=True)``: tensors, numbers, strings and containers only, no
arbitrary pickled code from a checkpoint someone handed you; nor does its manifest lead a read outside
its step folder, or further than the sizes it records (`distlab.checkpoint.files`).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from . import files
from .files import CheckpointError

FORMAT = "distlab-checkpoint/1"
MANIFEST = "manifest.json"
_COMPLETE = re.compile(r"^step_(\d+)$")


# -- where am I ------------------------------------------------------------------------------------
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _replica_writer(group) -> int:
    """Global rank that writes the replicated state for ``group`` (its first member; 0 by default)."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_global_rank(group, 0)


def _all_gather(obj, pg=None) -> list:
    _, n = _rank_world()
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=pg)
    return out


def _broadcast(obj, pg=None):
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=pg)
    return box[0]


# -- listing ---------------------------------------------------------------------------------------
def steps(directory) -> list[int]:
    """Steps with a complete checkpoint in ``directory`` (a ``step_N`` with a manifest), ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _COMPLETE.match(entry.name)
        if m and (entry / MANIFEST).is_file():
            found.append(int(m.group(1)))
    return sorted(found)


def latest(directory) -> int | None:
    """The newest complete step in ``directory``, or None; interrupted ``.tmp`` saves are ignored."""
    found = steps(directory)
    return found[-1] if found else None


def verify(directory, step: int) -> dict:
    """Check checkpoint ``step`` without loading it: a readable manifest, every shard present with the
    size and sha256 it records. Returns the manifest; raises `CheckpointError` saying what is wrong."""
    info = manifest(directory, step)
    path = _step_dir(directory, step)
    for entry in info["shards"]:
        data = files.read(path, entry["file"], entry["bytes"], advice="load another step")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path / entry['file']} does not match its manifest (sha256)")
    return info


def step_folders(directory) -> list[str]:
    """Every ``step_N`` folder in ``directory`` whether complete or not (interrupted ``.tmp`` saves aside)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p.name for p in directory.iterdir() if _COMPLETE.match(p.name)),
                  key=lambda name: int(name[5:]))


def manifest(directory, step: int | str = "latest") -> dict:
    """The manifest of checkpoint ``step`` (default: the latest complete one), its shape checked
    (`files.check_manifest`: among others, every file it names is a plain name in its step folder)."""
    path = _step_dir(directory, step) / MANIFEST
    advice = f"the checkpoint is damaged; load another step (complete: {steps(directory)})"
    try:
        data = json.loads(files.read(path.parent, MANIFEST, advice=advice))
    except (ValueError, RecursionError) as err:      # truncated, overwritten, not JSON
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}): {advice}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        data = data if isinstance(data, dict) else {}
        raise CheckpointError(f"{path} is not a {FORMAT} manifest (format={data.get('format')!r})")
    files.check_manifest(path, data)
    return data


def _step_dir(directory, step: int | str) -> Path:
    directory = Path(directory)
    if step == "latest":
        step = latest(directory)
        if step is None:
            extra = [p.name for p in files.leftovers(directory)]
            note = f" (only interrupted saves, which are never loaded: {extra})" if extra else ""
            raise CheckpointError(f"no complete checkpoint in {directory}{note}: train without resume first")
    path = directory / f"step_{int(step)}"
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"no complete checkpoint for step {step} in {directory}; "
                              f"complete steps: {steps(directory)}")
    return path


# -- saving ----------------------------------------------------------------------------------------
def save(directory, step: int, state: dict, *, replicated: dict | None = None, group=None,
         keep_last: int | None = None, meta: dict | None = None,
         hook: Callable[[str], None] | None = None, run_id: str | None = None, pg=None) -> Path:
    """Save checkpoint ``step``; call on every rank (a collective). Returns the ``step_N`` path.

    ``state``: what this rank alone owns (its ZeRO shards, its loss history), written by every rank.
    ``replicated``: state identical across the replica ``group`` (default: all ranks), written only by
    the group's first rank. ``keep_last``: keep the newest k complete checkpoints, delete older ones.
    ``meta``: JSON-able facts for the manifest (strategy, model, ...). ``hook(stage)`` is called at
    "prepared", "written" and (rank 0) "committing": a place to inject faults in tests and lessons.
    ``run_id`` (default: rank 0 draws a fresh one) goes into the manifest and into every shard, so a
    shard from another run or another save is refused on load even where its step and rank match.
    ``pg``: the process group of the save's own collectives (default: the default group; a background
    save passes a group of its own, so its collectives never interleave with training's).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    if int(step) != step or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    clash = set(state) & set(replicated or {})
    if clash:
        raise ValueError(f"keys {sorted(clash)} are in both state and replicated: rename one of them")
    directory, step = Path(directory), int(step)
    r, n = _rank_world()
    writer = _replica_writer(group)
    tmp = directory / f"step_{step}.tmp"
    ready = ((run_id or uuid.uuid4().hex), _prepare(directory, tmp)) if r == 0 else None
    run_id, problem = _broadcast(ready, pg)                # a barrier: .tmp exists (or rank 0 says why not)
    if problem is not None:
        raise CheckpointError(f"saving step {step} to {directory} failed on rank 0: {problem}")
    _call(hook, "prepared")

    payload = {"step": step, "rank": r, "world_size": n, "run_id": run_id, "state": _compact(state)}
    if replicated is not None and r == writer:
        payload["replicated"] = _compact(replicated)
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getbuffer()
    name = f"rank_{r}.pt"
    _write_synced(tmp / name, data)
    entry = {"rank": r, "file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
             "has_replicated": "replicated" in payload,
             "replicated_from": writer if replicated is not None else None}
    _call(hook, "written")
    entries = _all_gather(entry, pg)                       # barrier: every shard is on disk

    verdict = None
    if r == 0:
        try:
            _call(hook, "committing")
            verdict = _commit(directory, step, tmp, entries, n, {"run_id": run_id, "meta": meta or {}},
                              keep_last)
        except Exception as err:                           # tell the others instead of leaving them waiting
            verdict = f"{type(err).__name__}: {err}"
    verdict = _broadcast(verdict, pg)
    if verdict is not None:
        raise CheckpointError(f"saving step {step} to {directory} failed on rank 0: {verdict}")
    return directory / f"step_{step}"


def _prepare(directory: Path, tmp: Path) -> str | None:
    """Rank 0: remove what earlier interrupted saves left (distlab's own folders only: `files.is_ours`)
    and make ``tmp``, marked as distlab's before anything goes in. Returns what went wrong, or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in files.leftovers(directory):
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.lexists(tmp) and not files.is_ours(tmp):
            return (f"{tmp} is in the way: it is not one distlab made (it has no {files.MARKER}), so it is "
                    f"left alone; move it away, or use another checkpoint_dir")
        if tmp.exists():                  # distlab's, and removing it above failed: now say why
            shutil.rmtree(tmp)
        tmp.mkdir()
        files.put_marker(tmp)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _commit(directory: Path, step: int, tmp: Path, entries: list[dict], n: int, facts: dict,
            keep_last: int | None) -> None:
    for e in entries:
        src = e["replicated_from"]
        if src is not None and not entries[src]["has_replicated"]:
            raise CheckpointError(f"rank {e['rank']} expects replicated state from rank {src}, which passed "
                                  f"none: pass replicated= on every rank of the group")
    record = {"format": FORMAT, "step": step, "world_size": n, **facts, "shards": entries,
              "total_bytes": sum(e["bytes"] for e in entries)}
    _write_synced(tmp / MANIFEST, json.dumps(record, indent=1, sort_keys=True).encode())
    _fsync_dir(tmp)
    final = directory / f"step_{step}"
    if final.exists():                                     # re-saving a step: move the old one aside first
        aside = directory / f"step_{step}.replaced.tmp"
        _move_aside(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)                             # the commit point
    _fsync_dir(directory)
    if keep_last is not None:
        for old in steps(directory)[:-keep_last]:
            victim = directory / f"step_{old}.deleting.tmp"
            _move_aside(directory / f"step_{old}", victim)  # no longer "complete" before any file goes
            shutil.rmtree(victim, ignore_errors=True)
        _fsync_dir(directory)


def _move_aside(folder: Path, aside: Path) -> None:
    """Rename a complete checkpoint to the ``.tmp`` name ``aside``, marked as distlab's first (one saved
    before the marker existed has none), so that a crash before its deletion leaves a folder the next
    save removes, never a half-deleted "complete" checkpoint."""
    files.put_marker(folder)
    os.replace(folder, aside)


def _map_tensors(obj, copy, memo: dict):
    """``obj`` with every tensor replaced by ``copy(tensor)`` (containers rebuilt; a tensor met twice is
    copied once, so shared tensors stay shared)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = copy(obj.detach())
        return memo[id(obj)]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, copy, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, copy, memo) for v in obj)
    return obj


def _compact_copy(t: torch.Tensor) -> torch.Tensor:
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.cpu() if whole else t.cpu().clone()


def _compact(obj, memo: dict | None = None):
    """Detached CPU copies of the tensors in ``obj``; views are cloned, so a 1/N shard that is a view
    of a full flat buffer saves 1/N of the bytes, not the whole buffer (torch.save writes storages)."""
    return _map_tensors(obj, _compact_copy, {} if memo is None else memo)


def snapshot(obj, memo: dict | None = None):
    """A CPU copy of every tensor in ``obj`` (containers rebuilt), owned by nobody else: what an
    asynchronous save writes while training goes on changing the originals in place."""
    return _map_tensors(obj, lambda t: t.to("cpu", copy=True), {} if memo is None else memo)


def _write_synced(path: Path, data) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _call(hook, stage: str) -> None:
    if hook is not None:
        hook(stage)


# -- loading ---------------------------------------------------------------------------------------
def load(directory, step: int | str = "latest", *, map_location="cpu", verify: bool = True) -> dict:
    """This rank's state of checkpoint ``step`` (default: the latest complete one): its own ``state``
    merged with the ``replicated`` state of its replica group. Call on every rank (no communication).

    Checks the world size (it must equal the one that saved) and, with ``verify``, each file's sha256.
    """
    path = _step_dir(directory, step)
    info = manifest(directory, step)
    r, n = _rank_world()
    if info["world_size"] != n:                   # dl.train's formats consolidate; your own dicts do not
        other = ("read all of them with dl.checkpoint.consolidate (dl.train's resume does that when the "
                 "world size or the layout changes)" if info["meta"].get("format") else "read every rank's "
                 "state in one process with dl.checkpoint.load_all (save(model=) loads at any world size)")
        raise CheckpointError(f"checkpoint {path} was saved by {info['world_size']} ranks, this run has {n}: "
                              f"each rank's file belongs to the rank that wrote it. Load it with "
                              f"world_size={info['world_size']}, or {other}")
    return _rank_state(path, info, r, verify, map_location)


def load_all(directory, step: int | str = "latest", *, map_location="cpu", verify: bool = True,
             ranks=None) -> list[dict]:
    """Every rank's state of checkpoint ``step`` (only those of ``ranks``, if given), in rank order, whatever
    the world size of this run (for consolidating or resharding; each file is read and verified once)."""
    path = _step_dir(directory, step)
    info = manifest(directory, step)
    files: dict[int, dict] = {}
    ranks = range(info["world_size"]) if ranks is None else ranks
    return [_rank_state(path, info, r, verify, map_location, files) for r in ranks]


def _rank_state(path: Path, info: dict, r: int, verify: bool, map_location,
                files: dict | None = None) -> dict:
    """Rank ``r``'s own state merged with the replicated state of its replica group."""
    files = {} if files is None else files

    def read(k: int) -> dict:
        if k not in files:
            files[k] = _read(path, info["shards"][k], verify, map_location)
        return files[k]

    entry = info["shards"][r]
    own = read(r)
    if own.get("rank") != r or own.get("step") != info["step"]:
        raise CheckpointError(f"{path / entry['file']} holds rank {own.get('rank')} step {own.get('step')}, "
                              f"expected rank {r} step {info['step']}: the directory was tampered with")
    if own.get("run_id") != info.get("run_id"):
        raise CheckpointError(f"{path / entry['file']} was written by run {own.get('run_id')}, but the "
                              f"manifest belongs to run {info.get('run_id')}: shards of two runs were mixed "
                              f"in one directory; load another step (complete: {steps(path.parent)})")
    out = dict(own["state"])
    if entry["replicated_from"] is not None:
        out.update(read(entry["replicated_from"])["replicated"])
    return out


def _read(path: Path, entry: dict, verify: bool, map_location) -> dict:
    """One shard file (a plain name in ``path``, exactly the bytes its manifest entry records)."""
    advice = f"load an earlier step (complete: {steps(path.parent)})"
    data = files.read(path, entry["file"], entry["bytes"], advice=advice)
    if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path / entry['file']} does not match its manifest (sha256): the file is "
                              f"corrupt; {advice}")
    require_safe_torch()
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def require_safe_torch() -> None:
    """``weights_only=True`` is the safety of loading a checkpoint someone handed you, and before torch
    2.6 it could be bypassed to run code (CVE-2025-32434). Later advisories against torch.load were fixed
    in later releases too: keep torch current."""
    from torch.torch_version import TorchVersion
    if TorchVersion(torch.__version__) < (2, 6):
        raise CheckpointError(f"loading checkpoints needs torch >= 2.6 (this is {torch.__version__}): older "
                              f"torch.load(weights_only=True) can be tricked into running code "
                              f"(CVE-2025-32434). Upgrade: pip install -U 'torch>=2.6'")
