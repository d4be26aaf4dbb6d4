"""Checkpoint files read and removed with care: a manifest never leads a read outside its step folder,
and a save never removes what distlab did not make.

A checkpoint is input from outside (someone hands you one, or edits one), and its manifest names the
files to read. So nothing a manifest says is used before it is checked, and no read goes further than
the manifest allows::

    manifest.json   world_size ranks, one shard entry per rank in rank order; each "file" a plain name
                    (rank_3.pt: not absolute, no "/", not ".."), "bytes" a count, "replicated_from" a
                    rank of this world or null
    each file       followed through any link it must still lie in its step folder, be a regular file
                    (not /dev/zero, a pipe or a folder) of exactly the size its manifest records, and
                    no more than that many bytes are read

The other way round, a save removes what earlier interrupted saves left, and only that. Every folder a
save makes to throw away later carries the marker file ``.distlab-checkpoint``, written first::

    step_6.tmp/              a save in progress (or interrupted)     -> step_6 at its commit
    step_6.replaced.tmp/     step_6 being replaced by a re-save       -> deleted
    step_2.deleting.tmp/     step_2 rotated out by keep_last          -> deleted

A folder is removed only when its name is one of these (an integer step) and it holds the marker: a
user's ``results.tmp`` or ``step_3.tmp`` beside the checkpoints, a file, a link, is never touched, and
neither is the working directory's ``cache.tmp`` when checkpoints go to the working directory.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

MARKER = ".distlab-checkpoint"
MANIFEST_LIMIT = 64 << 20      # bytes: a manifest holds ~250 bytes per rank, so ~250 000 ranks
_TEMPORARY = re.compile(r"^step_[0-9]+(\.replaced|\.deleting)?\.tmp$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit this run; the message says what to do."""


# -- the folders a save made -----------------------------------------------------------------------
def put_marker(folder: Path) -> None:
    """Mark ``folder`` as distlab's: a save may delete it once its name ends in ``.tmp``."""
    (folder / MARKER).write_text("made by distlab.checkpoint: a step_N.tmp folder holding this file is an "
                                 "unfinished or discarded save, which the next save removes\n")


def is_ours(entry: Path) -> bool:
    """Whether ``entry`` is a temporary folder distlab made: a real folder (not a link), named
    ``step_<N>.tmp`` (or ``.replaced.tmp``, ``.deleting.tmp``), holding the marker."""
    return (_TEMPORARY.match(entry.name) is not None and entry.is_dir() and not entry.is_symlink()
            and (entry / MARKER).is_file())


def leftovers(directory: Path) -> list[Path]:
    """distlab's temporary folders in ``directory`` (what interrupted saves left), by name."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if is_ours(p)), key=lambda p: p.name)


# -- a manifest, checked before it is used ---------------------------------------------------------
def check_manifest(path: Path, data: dict) -> None:
    """Refuse a manifest (read from ``path``) whose shape is not the one `store.save` writes."""
    n = data.get("world_size")
    if not _count(n) or n < 1 or not _count(data.get("step")) or not isinstance(data.get("meta", {}), dict):
        raise CheckpointError(f"{path} has world_size={n!r}, step={data.get('step')!r}: not a checkpoint "
                              f"manifest distlab wrote (damaged, or tampered with)")
    shards = data.get("shards")
    if not isinstance(shards, list) or len(shards) != n:
        raise CheckpointError(f"{path} lists {len(shards) if isinstance(shards, list) else shards!r} shards "
                              f"for world_size={n}: one per rank expected (damaged, or tampered with)")
    for r, entry in enumerate(shards):
        _check_entry(path, r, n, entry)


def _check_entry(path: Path, r: int, n: int, entry) -> None:
    entry = entry if isinstance(entry, dict) else {}
    name, src = entry.get("file"), entry.get("replicated_from")
    if not is_plain_name(name):
        raise CheckpointError(f"{path} names {name!r} for rank {r}: not a plain file name in its step folder "
                              f"(absolute paths, '..' and path separators are refused)")
    wrong = [f"{key}={entry.get(key)!r}" for key, ok in (
        ("rank", entry.get("rank") == r and _count(entry.get("rank"))),
        ("bytes", _count(entry.get("bytes"))),
        ("sha256", isinstance(entry.get("sha256"), str)),
        ("replicated_from", src is None or (_count(src) and src < n)))
        if not ok]
    if wrong:
        raise CheckpointError(f"{path}: the entry of rank {r} has {', '.join(wrong)} (rank: its place in the "
                              f"list; bytes: a count; replicated_from: not a rank of world_size={n}, or "
                              f"null): damaged, or tampered with")


def is_plain_name(name) -> bool:
    """A file name and nothing else: the only kind of name `store.save` writes into a manifest."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and os.sep not in name and (os.altsep is None or os.altsep not in name) and "\\" not in name)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


# -- reading no further than the manifest allows ---------------------------------------------------
def read(folder: Path, name: str, size: int | None = None, advice: str = "load an earlier step") -> bytearray:
    """The bytes of ``folder/name``, a regular file inside ``folder`` (links followed, then checked):
    exactly ``size`` bytes, the size checked before a byte is read (``size=None``, for the manifest
    itself: at most `MANIFEST_LIMIT` bytes)."""
    file = folder / name
    fd = _open_inside(folder, file, advice)
    with os.fdopen(fd, "rb", buffering=0) as f:
        found = os.fstat(f.fileno()).st_size
        if size is not None and found != size:
            raise CheckpointError(f"{file} does not match its manifest: {found} bytes on disk, {size} in the "
                                  f"manifest; the file is corrupt or was replaced; {advice}")
        if found > MANIFEST_LIMIT and size is None:
            raise CheckpointError(f"{file} is {found} bytes, more than any manifest ({MANIFEST_LIMIT}): "
                                  f"refused; {advice}")
        data = _read_at_most(f, found + 1)           # one byte more: a file that grew meanwhile shows
    if len(data) != found:
        raise CheckpointError(f"{file} changed while it was read; {advice}")
    return data


def _open_inside(folder: Path, file: Path, advice: str) -> int:
    """A descriptor open for reading on ``file``, refused unless it is a regular file inside ``folder``."""
    real = file.resolve()
    if not real.is_relative_to(folder.resolve()):
        raise CheckpointError(f"{file} leads outside its step folder (to {real}): refused; a checkpoint "
                              f"only reads the files in its own folder")
    try:                # no link followed any more, and a pipe or device does not block the open
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete; {advice}") from None
    except OSError as err:
        raise CheckpointError(f"{file} cannot be read ({err.strerror or err}); {advice}") from None
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        what = {stat.S_IFDIR: "a folder", stat.S_IFCHR: "a device", stat.S_IFIFO: "a pipe"}.get(kind, "")
        raise CheckpointError(f"{file} is not a regular file ({what or 'special'}): refused; a checkpoint's "
                              f"files are plain files in its own folder")
    return fd


def _read_at_most(f, n: int) -> bytearray:
    """Up to ``n`` bytes of ``f``, into one buffer (a shard of gigabytes is not copied twice)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    view.release()
    del buf[got:]
    return buf
