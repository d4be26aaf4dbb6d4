"""Checkpoint, resume and fault injection for the training loop of `dl.train`.

    dl.train("zero2", world_size=4, steps=20, checkpoint_dir="ck", checkpoint_every=5)   # step_5 .. step_20
    dl.train("zero2", world_size=4, steps=20, checkpoint_dir="ck", resume=True)          # from the latest

What each rank writes, for Psi fp32 parameters with Adam (K = 8 bytes of state per parameter):

    strategy     rank 0 writes                    every other rank writes       total on disk
    single/ddp   model 4 Psi + optimizer 8 Psi    (its loss history only)       12 Psi
    zero1/zero2  model 4 Psi + its 8 Psi / N      its optimizer shard 8 Psi / N 4 Psi + 8 Psi
    zero3        its 4 Psi / N + 8 Psi / N        its 12 Psi / N                12 Psi (plus padding)

    tp, tp-sp    its 1/N of every big matrix, the small replicated ones, and their optimizer state
    pp-*         its stage(s) and their optimizer state
    3d           per (tp, pp) coordinate the first dp rank writes its stage's model (and, with DDP, its
                 optimizer state); with zero=1 every rank writes its own optimizer shard

(ZeRO shards are of the padded flat buckets, so "Psi" there includes at most N-1 padding elements
per bucket, and each ZeRO rank also saves the bucket layout that cut its shards.) Replicated state
goes to disk once, from the first rank of its replica group; the shards go from whoever owns them,
in parallel, which is why sharded checkpoints save faster as N grows (Rajbhandari et al. 2020 save
ZeRO state the same way; so do DeepSpeed's ``zero_pp_rank_*`` files and FSDP's sharded state dict).
The model-parallel strategies save each rank's parameters as they lie on that rank, with where they
sit in the full model (name, tensor-parallel cut), and which rank's loss history counts.

A checkpoint after step s holds the state *after* s optimizer steps and the loss history of steps
0..s-1; data is a pure function of (seed, step) (`dl.models` data sets), so a resumed run takes
exactly the steps the uninterrupted run would have taken, bit for bit in fp32.

What to save and how to restore it is the strategy's business: it hands the `Checkpointer` a
`RankState` (`distlab.checkpoint.state`), and nothing here asks which strategy that was.

Resharding: a checkpoint resumes on another world size or under another strategy or layout (ZeRO-3
on 4 ranks -> ZeRO-1 on 3; tp on 2 -> ``3d:dp=2,tp=1,pp=2`` on 4; anything -> ``single``), through
`distlab.checkpoint.reshard`: the logical state is rebuilt from every rank's file and cut again for
the new layout. The run then equals the uninterrupted one up to the rounding of a different
reduction order (not bit for bit).

What can go wrong, and what happens then:

* ``resume=True`` (or ``"latest"``) resumes from the newest checkpoint that *verifies* (manifest readable,
  every shard's size and sha256 as recorded); a damaged newer one is skipped and named on stderr. Step
  folders of which none verifies are a refusal, never a silent fresh start that would overwrite them.
* Every save carries the run's id in its manifest and in every shard: a shard of another run is refused.
* One training run at a time per directory: rank 0 holds an exclusive lock on it (flock) for the run, and
  the directory is checked writable before any rank starts (`exclusive`: a second live run is refused in
  any process or thread; a run gives the lock back however it ends).

Fault injection (for tests and lessons): ``fail_at_step=s`` kills ``fail_rank`` (default: the last
rank) with SIGKILL, either at the start of step s (``fail_in="step"``) or in the middle of saving
checkpoint s, after its shard is written but before the commit (``fail_in="save"``); on the first
attempt only (not after a restart by torchrun, TORCHELASTIC_RESTART_COUNT > 0, or by ``dl.train``).

``async_save=True``: the state is copied to CPU memory at the step boundary and the same `store.save`
runs in a background thread (`background`); ``heartbeat=True`` (set by ``dl.train``'s restarts,
`strategies.restart`): rank 0 records its last finished step in ``.heartbeat.json``, to count lost steps.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime import rank, tracer, world_size
from . import exclusive, reshard, store
from .background import BackgroundWriter
from .options import Checkpointing, check_values
from .state import RankState

HEARTBEAT = ".heartbeat.json"     # with heartbeat=True: rank 0's last finished step (dl.train's restarts)
# spec fields that must agree between the run that saved and the run that resumes (steps may grow);
# "layout" (the rank state's facts) may differ when both sides can reshard
_MUST_MATCH = ("strategy", "model", "seed", "global_batch", "lr", "optimizer", "weight_decay", "grad_accum",
               "precision", "clip", "layout")


class Checkpointer:
    """The checkpoint side of one rank's training loop (built by `for_spec`) over ``state``, the
    `RankState` its strategy built; ``spec.checkpoint`` is its `Checkpointing`. A context manager around
    the loop: leaving it, however the run ends, gives the checkpoint directory back to the next run."""

    def __init__(self, spec, state: RankState):
        o: Checkpointing = spec.checkpoint
        self.spec, self.state = spec, state
        self.directory = o.checkpoint_dir
        self.every = o.checkpoint_every
        self.keep_last = o.keep_last
        self.resume_from = o.resume
        self.fail_at, self.fail_in = o.fail_at_step, o.fail_in or "step"
        self.fail_rank = world_size() - 1 if o.fail_rank is None else o.fail_rank
        self.saved: list[int] = []
        self.stall_s: list[float] = []
        if self.fail_at is not None:
            self._check_fault_injection()
        check_options(o)
        self.run_id: str | None = None
        self.note: str | None = None
        self._lock = lock(self.directory) if self.directory is not None and rank() == 0 else None
        self.heartbeat = o.heartbeat and rank() == 0
        self.writer = BackgroundWriter() if o.async_save and self.every else None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, err, tb) -> None:
        """The run is over. After a failure, a save still in flight is waited for first where that cannot
        hang (one rank: no peers in its collectives); a failed rank of several keeps the lock until its
        process ends, which stops its writer too."""
        if kind is not None and self.writer is not None:
            if self.writer.pg is not None:
                return
            with contextlib.suppress(Exception):
                self.writer.wait()
        self.release()

    def release(self) -> None:
        """Give the checkpoint directory back (rank 0; a second call does nothing)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _check_fault_injection(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("fail_at_step kills a rank process: use a launched strategy (ddp, zero1, ...), "
                             f"not {self.spec.strategy!r}, which runs in this process")
        if self.fail_in not in ("step", "save"):
            raise ValueError(f"fail_in must be 'step' or 'save', got {self.fail_in!r}")
        if not 0 <= self.fail_rank < world_size():
            raise ValueError(f"fail_rank={self.fail_rank} is not a rank of world_size={world_size()}")

    # -- resume --------------------------------------------------------------------------------
    def resume(self) -> tuple[int, list[float]]:
        """(first step to run, loss history so far): from the checkpoint asked for, or (0, []) for a
        fresh start (``resume=True`` with no checkpoint yet starts from scratch, as torchrun jobs do)."""
        if self.resume_from is False or self.resume_from is None:
            return 0, []
        if self.resume_from in (True, "latest"):
            step, problem, note = _broadcast(newest_verified(self.directory) if rank() == 0 else None)
            if problem:
                raise store.CheckpointError(problem)
            self.note = note                                 # dl.train prints it, and the report keeps it
            if step is None:
                return 0, []
        else:
            step = int(self.resume_from)
        info = store.manifest(self.directory, step)
        self.run_id = info.get("run_id")                     # a resumed run goes on under its run id
        saved, ours = info["meta"].get("spec", {}), self._facts()
        reshardable = info["meta"].get("format") in reshard.FORMATS and self.state.reshard is not None
        self._check_compatible(info, saved, ours, reshardable)
        same = (info["world_size"] == world_size() and saved.get("strategy") == ours["strategy"]
                and saved.get("layout") == ours["layout"])
        if same or not reshardable:
            loaded = store.load(self.directory, step)      # the same layout: each rank reads its own file
            self.state.restore(loaded)
            return info["step"], loaded["losses"].tolist()
        logical = reshard.consolidate(self.directory, step)  # another layout: rebuild, then cut anew
        self.state.reshard(logical)
        losses = logical["losses"] if self.state.keeps_history else torch.zeros_like(logical["losses"])
        return info["step"], losses.tolist()                 # the global history, where this layout keeps it

    def _check_compatible(self, info: dict, saved: dict, ours: dict, reshardable: bool) -> None:
        free = ("strategy", "layout") if reshardable else ()       # what resharding may change
        diff = [f"{k}: saved {saved.get(k)!r}, now {ours[k]!r}" for k in _MUST_MATCH
                if saved.get(k) != ours[k] and k not in free]
        if diff:
            raise store.CheckpointError(f"checkpoint step {info['step']} in {self.directory} was saved by a "
                                        f"different run ({'; '.join(diff)}): use the same settings, or a "
                                        f"new checkpoint_dir")
        if info["step"] > self.spec.steps:
            raise store.CheckpointError(f"checkpoint is at step {info['step']}, beyond "
                                        f"steps={self.spec.steps}: ask for at least {info['step']} steps")

    def _facts(self) -> dict:
        facts = {k: getattr(self.spec, k) for k in _MUST_MATCH if k != "layout"}
        facts["layout"] = dict(self.state.layout)
        return facts

    # -- during training -----------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        if self.fail_in == "step" and step == self.fail_at and rank() == self.fail_rank and _first_attempt():
            _die()

    def after_step(self, done: int, losses: list[float]) -> None:
        """Save after ``done`` completed steps when it is a multiple of ``checkpoint_every`` or the end
        (in the background with ``async_save``: the step pays only for a copy into CPU memory)."""
        if self.heartbeat:
            _beat(self.directory, done)
        if self.directory is None or self.every is None:
            return
        if done % self.every and done != self.spec.steps:
            return
        t0 = time.perf_counter()
        with tracer().span("checkpoint", cat="io", step=done, mode="async" if self.writer else "sync"):
            if self.writer is not None:
                self.writer.wait()                        # one save in flight at a time
            own, replicated = self.state.capture()
            own = {**own, "losses": torch.tensor(losses, dtype=torch.float64),
                   "loss_weight": self.state.loss_weight}
            hook = self._hook if (self.fail_in == "save" and done == self.fail_at) else None
            meta = {"strategy": self.spec.strategy, "format": self.state.format, "spec": self._facts()}
            if self.run_id is None:          # only rank 0's counts: store.save hands it to every rank
                self.run_id = uuid.uuid4().hex
            kw = dict(replicated=replicated, group=self.state.replica_group, keep_last=self.keep_last,
                      meta=meta, hook=hook, run_id=self.run_id)
            if self.writer is None:
                store.save(self.directory, done, own, **kw)
            else:                                         # a private copy: training goes on changing ours
                kw["replicated"] = store.snapshot(replicated)
                self.writer.submit(store.save, self.directory, done, store.snapshot(own), **kw)
        self.stall_s.append(time.perf_counter() - t0)
        self.saved.append(done)

    def _hook(self, stage: str) -> None:
        if stage == "written" and rank() == self.fail_rank and _first_attempt():
            _die()

    def summary(self, start: int) -> dict:
        """What to add to the rank's ``info``: ``{"checkpoint": {"resumed_from", "saved"}, "checkpoint_io":
        {"mode", "stall_s", "write_s"}}`` (seconds per save: training stalled, writing took) (the end of
        training: the directory is free for the next run). Waits for a background save still in flight."""
        if self.writer is not None:
            self.writer.close()
        self.release()
        note = {"note": self.note} if self.note else {}
        write_s = self.writer.write_s if self.writer is not None else self.stall_s
        return {"checkpoint": {"resumed_from": start or None, "saved": list(self.saved), **note},
                "checkpoint_io": {"mode": "async" if self.writer is not None else "sync",
                                  "stall_s": list(self.stall_s), "write_s": list(write_s)}}


class NoCheckpoints:
    """The training loop's checkpoint side when no option asks for one: every call does nothing."""

    def __enter__(self) -> NoCheckpoints:
        return self

    def __exit__(self, kind, err, tb) -> None:
        pass

    def resume(self) -> tuple[int, list[float]]:
        return 0, []

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, done: int, losses: list[float]) -> None:
        pass

    def summary(self, start: int) -> dict:
        return {}


def for_spec(spec, state: RankState) -> Checkpointer | NoCheckpoints:
    """A `Checkpointer` when ``spec.checkpoint`` asks for one, else a `NoCheckpoints` that does nothing."""
    return Checkpointer(spec, state) if spec.checkpoint.requested else NoCheckpoints()


def _first_attempt() -> bool:
    """Planted faults fire on the first attempt only: not after torchrun's restarts (dl.train's restarts
    drop ``fail_at_step`` themselves)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _beat(directory, done: int) -> None:
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


def _die() -> None:
    """Die the way a preempted or crashed node does: no exception, no cleanup, no goodbye."""
    os.kill(os.getpid(), signal.SIGKILL)


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank (this process alone when no group is running)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
