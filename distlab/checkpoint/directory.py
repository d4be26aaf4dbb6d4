"""The checkpoint directory of a training run: proved writable, held by one run at a time, and the newest
checkpoint in it that verifies.

    check_options(ck)          # in the parent, before any rank starts: the options, then the directory
    held = lock(directory)     # rank 0, for the whole run (`exclusive`); held.release() at its end
    step, refusal, note = newest_verified(directory)      # what resume=True resumes from

What can go wrong, and what happens then:

* ``resume=True`` (or ``"latest"``) resumes from the newest checkpoint that *verifies* (manifest readable,
  every shard's size and sha256 as recorded); a damaged newer one is skipped and named on stderr. Step
  folders of which none verifies are a refusal, never a silent fresh start that would overwrite them.
* One training run at a time per directory: rank 0 holds an exclusive lock on it (flock) for the run, and
  the directory is checked writable before any rank starts (`exclusive`: a second live run is refused in
  any process or thread; a run gives the lock back however it ends).

The training loop's side (what to save when, resuming, planted failures) is the strategies' business:
`distlab.strategies.checkpointing` and `distlab.strategies.faults`.
"""
from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

from . import exclusive, store
from .options import Checkpointing, check_values


def newest_verified(directory) -> tuple[int | None, str | None, str | None]:
    """(step to resume from, refusal, note) for ``resume=True``: the newest checkpoint that verifies.
    A damaged newer one is skipped with a note; step folders of which none verifies are a refusal
    (starting from scratch would silently overwrite them); no step folder at all is a fresh start."""
    skipped = []
    for step in reversed(store.steps(directory)):
        try:
            store.verify(directory, step)
        except store.CheckpointError as err:
            skipped.append(f"step_{step}: {err}")
            continue
        note = (f"resuming from step {step}, the newest checkpoint that verifies, in {directory}; skipped "
                f"{'; '.join(skipped)} (resume={step} picks it explicitly)") if skipped else None
        return step, None, note
    found = store.step_folders(directory)
    if not found:
        return None, None, None
    why = "; ".join(skipped) if skipped else "none of them has a manifest.json"
    return None, (f"resume=True found {found} in {directory} but no checkpoint that verifies ({why}). Not "
                  f"starting from scratch over them: move them away, use a new checkpoint_dir, or pass "
                  f"resume=False to overwrite"), None


def check_options(ck: Checkpointing, in_process: str | None = None, *, steps: int | None = None,
                  world: int | None = None) -> None:
    """Everything about the checkpoint options that can be checked before any rank starts
    (`options.check_values`: what they say together against ``steps`` and the ``world`` size when given);
    then ``checkpoint_dir`` is created and proved writable now, not at the first save."""
    check_values(ck, in_process, steps=steps, world=world)
    directory = ck.checkpoint_dir
    if directory is not None:
        writable(directory)


def writable(directory) -> Path:
    """Create ``directory`` if need be and prove it writable now, not at the first save."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex}"
        probe.write_bytes(b"")        # named for this process, thread and call: two runs checking one
        probe.unlink()                # directory at once must not remove each other's probe
    except OSError as err:
        raise store.CheckpointError(f"checkpoint_dir {str(directory)!r} is not writable "
                                    f"({err.strerror or err}): choose a directory you can write to") from None
    return directory


def lock(directory) -> exclusive.DirectoryLock:
    """An exclusive lock on ``directory`` for one training run (rank 0 holds it; the kernel drops it when
    the process ends, however it ends; no lock file to leave behind). Two runs writing one directory
    would delete each other's saves: a second live run, in another process or another thread of this
    one, is refused; a lock whose run is over is taken over (`exclusive`)."""
    return exclusive.take(writable(directory))
