"""Planted failures, and the heartbeat that measures what a real one cost.

Fault injection (for tests and lessons): ``fail_at_step=s`` kills ``fail_rank`` (default: the last
rank) with SIGKILL, either at the start of step s (``fail_in="step"``) or in the middle of saving
checkpoint s, after its shard is written but before the commit (``fail_in="save"``); on the first
attempt only (not after a restart by torchrun, TORCHELASTIC_RESTART_COUNT > 0, or by ``dl.train``,
whose restarts drop ``fail_at_step`` themselves)::

    step:  0 ... s-1 | s X                         fail_in="step": dies before step s computes anything
    save:  ... step s | write shard X commit        fail_in="save": the save of checkpoint s never commits

``heartbeat=True`` (set by ``dl.train``'s restarts, `restart`): rank 0 records its last finished step in
``checkpoint_dir/.heartbeat.json``, so a restart can count the steps a failure lost.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ..runtime import rank, world_size

HEARTBEAT = ".heartbeat.json"     # with heartbeat=True: rank 0's last finished step (dl.train's restarts)


class PlantedFault:
    """The failure ``spec.checkpoint`` plants (``fail_at_step``, ``fail_in``, ``fail_rank``), if any."""

    def __init__(self, spec):
        o = spec.checkpoint
        self.at, self.where = o.fail_at_step, o.fail_in or "step"
        self.rank = world_size() - 1 if o.fail_rank is None else o.fail_rank
        if self.at is not None:
            self._check(spec.strategy)

    def _check(self, strategy: str) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("fail_at_step kills a rank process: use a launched strategy (ddp, zero1, ...), "
                             f"not {strategy!r}, which runs in this process")
        if self.where not in ("step", "save"):
            raise ValueError(f"fail_in must be 'step' or 'save', got {self.where!r}")
        if not 0 <= self.rank < world_size():
            raise ValueError(f"fail_rank={self.rank} is not a rank of world_size={world_size()}")

    def before_step(self, step: int) -> None:
        """``fail_in="step"``: die at the start of step ``fail_at_step``."""
        if self.where == "step" and step == self.at and rank() == self.rank and first_attempt():
            die()

    def save_hook(self, done: int) -> Callable[[str], None] | None:
        """``fail_in="save"``: for the save of checkpoint ``fail_at_step``, the hook `store.save` calls at
        each stage of it (this rank dies once its shard is "written"); None for every other save."""
        if self.where != "save" or done != self.at:
            return None

        def hook(stage: str) -> None:
            if stage == "written" and rank() == self.rank and first_attempt():
                die()
        return hook


def first_attempt() -> bool:
    """Planted faults fire on the first attempt only: not after torchrun's restarts (dl.train's restarts
    drop ``fail_at_step`` themselves)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def die() -> None:
    """Die the way a preempted or crashed node does: no exception, no cleanup, no goodbye."""
    os.kill(os.getpid(), signal.SIGKILL)


# -- the heartbeat ------------------------------------------------------------------------------
def beat(directory, done: int) -> None:
    """Record ``done`` finished steps in ``directory/.heartbeat.json`` (atomically: write a part, then
    rename it over the heartbeat). A write that fails (a full disk) removes its part, then raises."""
    path = Path(directory) / HEARTBEAT
    part = path.with_name(HEARTBEAT + ".part")
    try:
        part.write_text(json.dumps({"step": done, "time": time.time()}))
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def clear_heartbeat(directory) -> None:
    """Remove the heartbeat once the restarts are over (it is their bookkeeping, not a checkpoint), and
    the part of one whose writer was killed before its rename."""
    for name in (HEARTBEAT, HEARTBEAT + ".part"):
        (Path(directory) / name).unlink(missing_ok=True)


def heartbeat(directory) -> dict | None:
    """The last heartbeat in ``directory`` ({"step", "time"}), or None."""
    try:
        return json.loads((Path(directory) / HEARTBEAT).read_text())
    except (OSError, ValueError):
        return None
