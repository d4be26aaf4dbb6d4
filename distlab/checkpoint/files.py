"""What a checkpoint directory may hold, and what a save may remove there: only what distlab made.

A save removes what earlier interrupted saves left, and only that. Every folder a save makes to throw
away later carries the marker file ``.distlab-checkpoint``, written first::

    step_6.tmp/              a save in progress (or interrupted)     -> step_6 at its commit
    step_6.replaced.tmp/     step_6 being replaced by a re-save       -> deleted
    step_2.deleting.tmp/     step_2 rotated out by keep_last          -> deleted

A folder is removed only when its name is one of these (an integer step) and it holds the marker: a
user's ``results.tmp`` or ``step_3.tmp`` beside the checkpoints, a file, a link, is never touched, and
neither is the working directory's ``cache.tmp`` when checkpoints go to the working directory.
"""
from __future__ import annotations

import re
from pathlib import Path

MARKER = ".distlab-checkpoint"
_TEMPORARY = re.compile(r"^step_\d+(\.replaced|\.deleting)?\.tmp$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit this run; the message says what to do."""


# -- the folders a save made -----------------------------------------------------------------------
def mark(folder: Path) -> None:
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
