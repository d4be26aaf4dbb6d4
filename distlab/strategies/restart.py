"""Automatic restart: when a rank dies, relaunch the run from its newest complete checkpoint.

    report = dl.train("zero2", world_size=4, steps=40, checkpoint_dir="ck", checkpoint_every=5,
                      max_restarts=2, fail_at_step=13)        # rank 3 dies at step 13, once
    report.restarts      # [Restart(attempt=1, world_size=4, failed_rank=3, reached_step=13,
                         #          resumed_from=10, lost_steps=3, lost_seconds=..., next_world_size=4)]

"Automatic restart from the last checkpoint is the minimum viable solution" to failures at scale:
every attempt is a fresh launch (fresh processes, a fresh rendezvous on a fresh port, nothing
inherited from the ranks that died) that resumes with ``resume=True``::

    attempt 1:  step 0 ... save 10 ... step 13 X          X: a rank dies; the launch ends every rank
    attempt 2:           load 10 -> step 10 ... step 40   the steps 10..12 are computed twice

What a restart costs is reported for each one: ``lost_steps`` (steps the failed attempt finished
beyond the checkpoint the next one starts from) and ``lost_seconds`` (wall time from that
checkpoint's commit, or the attempt's start if later, to the moment the failure was seen).

Elastic shrink: ``shrink=True`` relaunches on one rank fewer each time (the failed node is gone);
``shrink=[3, 2]`` gives the world size of each restart. The checkpoint of N ranks is then resharded
for the new world size (`distlab.checkpoint.reshard`), and the run equals the uninterrupted one up to
the rounding of a different reduction order; without shrink it is the same bit for bit.

A failure that every attempt would meet again is not restarted (`permanent`): bad input found inside a
rank, a full or read-only disk, a memory limit crossed; the error is raised at once, with a line saying
why. Planted faults (``fail_at_step``, ``fail_in``, ``fail_rank``) fire on the first attempt only. How
often to save is a trade against how often a failure comes: `dl.theory.daly_interval`.
"""
from __future__ import annotations

import errno
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import store
from ..checkpoint.directory import newest_verified
from ..launch import LaunchError
from . import faults

FAULTS = ("fail_at_step", "fail_in", "fail_rank")


@dataclass
class Restart:
    """One failed attempt and the relaunch after it (see the module docstring)."""

    attempt: int                 # the attempt that failed, 1 = the first
    world_size: int              # its ranks
    failed_rank: int | None      # the root-cause rank (None: the deadline passed)
    reason: str                  # the first line of the failure
    reached_step: int | None     # steps it had finished (None: unknown)
    resumed_from: int            # the checkpoint step the next attempt starts from (0: from scratch)
    lost_steps: int | None       # reached_step - resumed_from: work done twice
    lost_seconds: float          # wall time from that checkpoint (or the attempt's start) to the failure
    next_world_size: int         # ranks of the next attempt

    def __str__(self) -> str:
        at = f" after step {self.reached_step}" if self.reached_step is not None else ""
        lost = f"{self.lost_steps} step(s)" if self.lost_steps is not None else "an unknown number of steps"
        return (f"restart {self.attempt}: attempt {self.attempt} on {self.world_size} ranks failed{at} "
                f"({self.reason}); relaunching on {self.next_world_size} ranks from checkpoint step "
                f"{self.resumed_from}: {lost} and {self.lost_seconds:.2f} s lost")


def plan(spec, world_size: int) -> list[int]:
    """The world size of every attempt, ``[world_size, ...]`` (1 + ``spec.restart.max_restarts`` of them,
    where ``spec.restart.shrink`` says); refuses what cannot restart, before any rank starts (each
    value's type: its field's rule, `distlab.strategies.spec.Restart`)."""
    max_restarts, shrink = spec.restart.max_restarts, spec.restart.shrink
    if spec.strategy == "single":
        raise ValueError("max_restarts relaunches ranks: use a launched strategy (ddp, zero1, ...), not "
                         "'single', which runs in this process")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ValueError("under torchrun, torchrun restarts the processes: use torchrun --max-restarts K "
                         "with resume=True (--resume), not max_restarts")
    o = spec.checkpoint
    if o.checkpoint_dir is None or not o.checkpoint_every:
        raise ValueError("max_restarts relaunches from the newest checkpoint: pass checkpoint_dir=... and "
                         "checkpoint_every=k (dl.theory.daly_interval suggests k)")
    if shrink is not False and shrink is not None and max_restarts < 1:
        raise ValueError(f"shrink={shrink!r} says where to restart, but max_restarts=0 never restarts: pass "
                         "max_restarts=k >= 1 (--max-restarts K)")
    earlier = store.step_folders(o.checkpoint_dir)
    if earlier and o.resume in (None, False):
        raise ValueError(f"checkpoint_dir={o.checkpoint_dir!r} already holds {earlier} from an earlier "
                         "run: a restart would resume from them as if they were this run's. Pass "
                         "resume=True to continue that run, or use an empty checkpoint_dir")
    if shrink is True:
        return [max(1, world_size - i) for i in range(max_restarts + 1)]
    if shrink is False or shrink is None:
        return [world_size] * (max_restarts + 1)
    sizes = list(shrink)
    grows = next((n for n, before in zip(sizes, [world_size, *sizes]) if n > before), None)
    if grows is not None:
        raise ValueError(f"shrink={shrink!r} would grow the run to {grows} ranks: a restart runs on the "
                         f"ranks that are left, at most world_size={world_size} and never more than the "
                         f"attempt before (e.g. shrink=[{max(1, world_size - 1)}])")
    if len(sizes) > max_restarts:
        raise ValueError(f"shrink gives {len(sizes)} restart world sizes but max_restarts={max_restarts}: "
                         f"raise max_restarts to {len(sizes)}")
    return [world_size, *sizes, *[sizes[-1]] * (max_restarts - len(sizes))]


def run(spec, sizes: list[int], launch_once):
    """``launch_once(spec, world_size) -> Report`` for each attempt until one succeeds; the report gets
    ``.restarts``. After the last attempt fails, its `LaunchError` is raised with ``.restarts``. However
    it ends, the heartbeat (the attempts' bookkeeping, not a checkpoint) is removed."""
    try:
        return _attempts(spec, sizes, launch_once)
    finally:
        faults.clear_heartbeat(spec.checkpoint.checkpoint_dir)


def _attempts(spec, sizes: list[int], launch_once):
    restarts: list[Restart] = []
    first_start = time.time()
    current = spec.replace(heartbeat=True)
    for attempt, n in enumerate(sizes, 1):
        started = time.time()
        try:
            report = launch_once(current, n)
        except LaunchError as err:
            final = permanent(err)
            if final:
                print(f"distlab: not restarting after attempt {attempt}: {final}", file=sys.stderr,
                      flush=True)
            if final or attempt == len(sizes):
                err.restarts = restarts
                raise
            record, resume = _after_failure(err, spec, attempt, n, sizes[attempt], started, first_start)
            restarts.append(record)
            print(f"distlab: {record}", file=sys.stderr, flush=True)
            current = current.replace(resume=resume, **dict.fromkeys(FAULTS))     # faults: first attempt
            continue
        report.restarts = restarts
        return report
    raise AssertionError("unreachable: the last attempt returns or raises")


#: what a failed rank meets again on every attempt: bad input it found (a ValueError or TypeError raised
#: in a rank), a checkpoint it refuses, a memory limit it crosses, and a disk that is full, read-only or
#: forbidden to it (OSError with one of `LASTING_ERRNOS`); anything else (a killed rank, a lost peer, the
#: deadline) may pass, and is restarted
LASTING = ("ValueError", "TypeError", "PermissionError", "CheckpointError", "MemoryLimitExceeded")
LASTING_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                  errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                  errno.EPERM: "operation not permitted"}


def permanent(err: LaunchError) -> str | None:
    """Why a restart of ``err``'s run would fail the same way (None: it might not), read from the
    exception that ended its root-cause rank: the last line of its traceback, ``Type: message``."""
    text = err.failures.get(err.rank, "") if err.rank is not None else ""
    raised = re.findall(r"^((?:\w+\.)*\w+(?:Error|Exception|Exceeded)): (.*)$", text, flags=re.MULTILINE)
    if not raised:
        return None
    kind, message = raised[-1][0].rsplit(".", 1)[-1], raised[-1][1]
    code = re.match(r"\[Errno (\d+)\]", message)
    why = LASTING_ERRNOS.get(int(code.group(1))) if code else None
    if kind not in LASTING and why is None:
        return None
    because = why or ("bad input, found in the rank" if kind in ("ValueError", "TypeError") else kind)
    return (f"rank {err.rank} failed with {kind}: {message} ({because}: every attempt would meet it "
            f"again; fix it, then run again with resume=True)")


def _after_failure(err: LaunchError, spec, attempt: int, n: int, next_n: int, started: float,
                   first_start: float) -> tuple[Restart, object]:
    """The `Restart` record of a failed attempt, and the ``resume`` option of the next one."""
    seen = time.time()
    directory = spec.checkpoint.checkpoint_dir
    step, problem, _ = newest_verified(directory)
    if problem:
        raise store.CheckpointError(f"cannot restart after attempt {attempt} failed: {problem}") from err
    mtime = _commit_time(directory, step) if step is not None else None
    # a checkpoint older than this run is another run's, unless this run was asked to resume from it
    ours = step is not None and (mtime >= first_start or spec.checkpoint.resume not in (None, False))
    resumed = step if ours else 0
    beat = faults.heartbeat(directory)
    reached = beat["step"] if beat is not None and beat["time"] >= started else None
    since = max(started, mtime) if ours else started
    lost = reached - resumed if reached is not None else None
    text = err.failures.get(err.rank, "") or str(err)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    reason = lines[-1] if lines else type(err).__name__          # the root cause's last word
    record = Restart(attempt, n, err.rank, reason, reached, resumed, lost, seen - since, next_n)
    return record, (True if ours else spec.checkpoint.resume)


def _commit_time(directory, step: int) -> float:
    """When checkpoint ``step`` was committed (its manifest is written just before the rename)."""
    return (Path(directory) / f"step_{step}" / store.MANIFEST).stat().st_mtime
