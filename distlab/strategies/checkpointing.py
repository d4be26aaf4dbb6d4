"""Checkpoint and resume: the checkpoint side of the training loop of `dl.train` (`loop`).

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
exactly the steps the uninterrupted run would have taken, bit for bit in fp32. With ``data="text"``
each rank's file also holds the loader's position in global samples consumed (`feed`), put back on
a resume by the same layout or another one.

What to save and how to restore it is the strategy's business: it hands the `Checkpointer` a
`RankState` (`distlab.checkpoint.state`), and nothing here asks which strategy that was.

Resharding: a checkpoint resumes on another world size or under another strategy or layout (ZeRO-3
on 4 ranks -> ZeRO-1 on 3; tp on 2 -> ``3d:dp=2,tp=1,pp=2`` on 4; anything -> ``single``), through
`distlab.checkpoint.reshard`: the logical state is rebuilt from every rank's file and cut again for
the new layout. The run then equals the uninterrupted one up to the rounding of a different
reduction order (not bit for bit).

What can go wrong (a damaged newest checkpoint, a second run on one directory) is the
directory's business (`distlab.checkpoint.directory`); planted failures (``fail_at_step``) and the
heartbeat of ``dl.train``'s restarts are `faults`.

``async_save=True``: the state is copied to CPU memory at the step boundary and the same `store.save`
runs in a background thread (`distlab.checkpoint.background`).
"""
from __future__ import annotations

import contextlib
import time
import uuid

import torch
import torch.distributed as dist

from ..checkpoint import reshard, store
from ..checkpoint.background import BackgroundWriter
from ..checkpoint.directory import check_options, lock, newest_verified
from ..checkpoint.options import Checkpointing
from ..checkpoint.state import RankState
from ..runtime import rank, tracer, world_size
from . import faults

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
        self.fault = faults.PlantedFault(spec)
        self.saved: list[int] = []
        self.stall_s: list[float] = []
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
        diff = [f"{k}: saved {saved.get(k)!r}, now {ours.get(k)!r}" for k in (*_MUST_MATCH, "data")
                if saved.get(k) != ours.get(k) and k not in free]
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
        o = self.spec.data_loading
        if o.data != "synthetic":                       # the order of the text: what the position counts in
            facts["data"] = {"data": o.data, "shuffle": o.shuffle, "drop_last": o.drop_last}
        return facts

    # -- during training -----------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        self.fault.before_step(step)                      # fail_at_step, fail_in="step"

    def after_step(self, done: int, losses: list[float]) -> None:
        """Save after ``done`` completed steps when it is a multiple of ``checkpoint_every`` or the end
        (in the background with ``async_save``: the step pays only for a copy into CPU memory)."""
        if self.heartbeat:
            faults.beat(self.directory, done)
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
            hook = self.fault.save_hook(done)              # fail_at_step, fail_in="save"
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
        if self.spec.restart.engine == "ray":            # committed: every rank reports it to Ray Train
            from ..launch import ray as ray_train
            ray_train.report_checkpoint(self.directory, done)

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


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank (this process alone when no group is running)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
