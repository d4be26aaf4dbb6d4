"""Checkpoint, resume and fault injection for every strategy of `dl.train`.

    dl.train("zero2", world_size=4, steps=20, checkpoint_dir="ck", checkpoint_every=5)   # step_5, ..., step_20
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

Resharding: a checkpoint resumes on another world size or under another strategy or layout (ZeRO-3
on 4 ranks -> ZeRO-1 on 3; tp on 2 -> ``3d:dp=2,tp=1,pp=2`` on 4; anything -> ``single``), through
`distlab.checkpoint.reshard`: the logical state is rebuilt from every rank's file and cut again for
the new layout. The run then equals the uninterrupted one up to the rounding of a different
reduction order (not bit for bit).

Fault injection (for tests and lessons): ``fail_at_step=s`` kills ``fail_rank`` (default: the last
rank) with SIGKILL, either at the start of step s (``fail_in="step"``) or in the middle of saving
checkpoint s, after its shard is written but before the commit (``fail_in="save"``).
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

from ..runtime import rank, tracer, world_size
from . import reshard, store

OPTIONS = ("checkpoint_dir", "checkpoint_every", "keep_last", "resume", "fail_at_step", "fail_rank", "fail_in")
DATA_PARALLEL = reshard.DATA_PARALLEL
# spec fields that must agree between the run that saved and the run that resumes (steps may grow)
_MUST_MATCH = ("strategy", "model", "seed", "global_batch", "lr", "optimizer", "weight_decay", "grad_accum",
               "precision", "clip", "layout")
# options that decide which parameters a rank holds, and so must agree too
LAYOUT_OPTIONS = ("dp", "tp", "pp", "zero", "virtual", "balance", "sequence_parallel", "sp")


def requested(options: dict) -> bool:
    """Whether ``options`` ask for checkpointing or fault injection."""
    return any(options.get(k) not in (None, False) for k in OPTIONS)


class Checkpointer:
    """The checkpoint side of one rank's training loop (built by `for_spec`).

    ``replica_group``: the ranks that hold identical copies of the replicated state (3d's dp group);
    the first of them writes it. Default: all ranks. ``layout``: how a model-parallel rank's
    parameters sit in the full model (for resharding).
    """

    def __init__(self, spec, replica_group=None, layout: "Layout | None" = None):
        o = spec.options
        self.spec = spec
        self.replica_group = replica_group
        self.layout = layout
        self.directory = o.get("checkpoint_dir")
        self.every = o.get("checkpoint_every")
        self.keep_last = o.get("keep_last")
        self.resume_from = o.get("resume", False)
        self.fail_at, self.fail_in = o.get("fail_at_step"), o.get("fail_in", "step")
        self.fail_rank = o.get("fail_rank", world_size() - 1)
        self.saved: list[int] = []
        if self.directory is None and (self.every or self.resume_from or self.keep_last):
            raise ValueError("checkpoint_every, keep_last and resume need checkpoint_dir=... (a directory)")
        if self.every is not None and (int(self.every) != self.every or self.every < 1):
            raise ValueError(f"checkpoint_every must be a positive integer, got {self.every!r}")
        if self.fail_at is not None:
            if spec.strategy == "single":
                raise ValueError("fail_at_step kills a rank process: use a launched strategy (ddp, zero1, ...), "
                                 "not 'single', which runs in this process")
            if self.fail_in not in ("step", "save"):
                raise ValueError(f"fail_in must be 'step' or 'save', got {self.fail_in!r}")
            if not 0 <= self.fail_rank < world_size():
                raise ValueError(f"fail_rank={self.fail_rank} is not a rank of world_size={world_size()}")

    # -- resume --------------------------------------------------------------------------------
    def resume(self, model, wrapped, opt) -> tuple[int, list[float]]:
        """(first step to run, loss history so far): from the checkpoint asked for, or (0, []) for a
        fresh start (``resume=True`` with no checkpoint yet starts from scratch, as torchrun jobs do)."""
        if self.resume_from is False or self.resume_from is None:
            return 0, []
        step = "latest" if self.resume_from is True else int(self.resume_from)
        if step == "latest" and store.latest(self.directory) is None:
            return 0, []
        info = store.manifest(self.directory, step)
        saved, ours = info["meta"].get("spec", {}), _spec_facts(self.spec)
        reshardable = self._reshardable(saved, ours)
        self._check_compatible(info, saved, ours, reshardable)
        same = (info["world_size"] == world_size() and saved.get("strategy") == ours["strategy"]
                and saved.get("layout") == ours["layout"])
        if same or not reshardable:
            state = store.load(self.directory, step)       # the same layout: each rank reads its own file
            restore(self.spec, model, wrapped, opt, state)
            return info["step"], state["losses"].tolist()
        logical = reshard.consolidate(self.directory, step)  # another layout: rebuild, then cut anew
        if self.spec.strategy in DATA_PARALLEL:
            reshard.restore(self.spec, model, opt, logical)
            keeps = rank() == 0
        else:
            reshard.restore_model_parallel(self.layout.params, model, opt, logical)
            keeps = self.layout.keeps_history
        losses = logical["losses"] if keeps else torch.zeros_like(logical["losses"])
        return info["step"], losses.tolist()                 # the global history, where this layout keeps it

    def _reshardable(self, saved: dict, ours: dict) -> bool:
        """Both the saved run and this one can go through the logical (layout-free) state."""
        return (reshard.reshardable(saved.get("strategy", "")) and reshard.reshardable(ours["strategy"])
                and (self.spec.strategy in DATA_PARALLEL or self.layout is not None))

    def _check_compatible(self, info: dict, saved: dict, ours: dict, reshardable: bool) -> None:
        free = ("strategy", "layout") if reshardable else ()       # what resharding may change
        diff = [f"{k}: saved {saved.get(k)!r}, now {ours[k]!r}" for k in _MUST_MATCH
                if saved.get(k) != ours[k] and k not in free]
        if diff:
            raise store.CheckpointError(f"checkpoint step {info['step']} in {self.directory} was saved by a "
                                        f"different run ({'; '.join(diff)}): use the same settings, or a "
                                        f"new checkpoint_dir")
        if info["step"] > self.spec.steps:
            raise store.CheckpointError(f"checkpoint is at step {info['step']}, beyond steps={self.spec.steps}: "
                                        f"ask for at least {info['step']} steps")

    # -- during training -----------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        if self.fail_in == "step" and step == self.fail_at and rank() == self.fail_rank:
            _die()

    def after_step(self, done: int, model, wrapped, opt, losses: list[float]) -> None:
        """Save after ``done`` completed steps when it is a multiple of ``checkpoint_every`` or the end."""
        if self.directory is None or self.every is None:
            return
        if done % self.every and done != self.spec.steps:
            return
        with tracer().span("checkpoint", cat="io", step=done):
            state, replicated = capture(self.spec, model, wrapped, opt, losses, self.layout)
            hook = self._hook if (self.fail_in == "save" and done == self.fail_at) else None
            meta = {"strategy": self.spec.strategy, "spec": _spec_facts(self.spec)}
            store.save(self.directory, done, state, replicated=replicated, group=self.replica_group,
                       keep_last=self.keep_last, meta=meta, hook=hook)
        self.saved.append(done)

    def _hook(self, stage: str) -> None:
        if stage == "written" and rank() == self.fail_rank:
            _die()

    def summary(self, start: int) -> dict:
        """What to add to the rank's ``info``: ``{"checkpoint": {"resumed_from", "saved"}}``."""
        return {"checkpoint": {"resumed_from": start or None, "saved": list(self.saved)}}


class NoCheckpoints:
    """The training loop's checkpoint side when no option asks for one: every call does nothing."""

    def resume(self, model, wrapped, opt) -> tuple[int, list[float]]:
        return 0, []

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, done: int, model, wrapped, opt, losses: list[float]) -> None:
        pass

    def summary(self, start: int) -> dict:
        return {}


@dataclass
class Layout:
    """Where a model-parallel rank's parameters sit in the full model, for resharding its checkpoint.

    ``params``: `reshard.describe` of the optimizer's parameters; ``loss_weight``: 1 if this rank's
    loss history counts (once) toward the global one; ``keeps_history``: whether this rank carries the
    global history when it resumes from another layout.
    """

    params: list[dict]
    loss_weight: int
    keeps_history: bool


def model_parallel_layout(full_model, params: list, held, *, loss_weight: bool, keeps_history: bool) -> Layout:
    """The `Layout` of a tp/pp/3d rank: ``params`` in the optimizer's order, named as in ``full_model``,
    keyed as in ``held.state_dict()``."""
    return Layout(reshard.describe(full_model, params, held), int(loss_weight), bool(keeps_history))


def for_spec(spec, replica_group=None, layout: Layout | None = None) -> Checkpointer | NoCheckpoints:
    """A `Checkpointer` when the spec's options ask for one, else a `NoCheckpoints` that does nothing."""
    return Checkpointer(spec, replica_group, layout) if requested(spec.options) else NoCheckpoints()


def _die() -> None:
    """Die the way a preempted or crashed node does: no exception, no cleanup, no goodbye."""
    os.kill(os.getpid(), signal.SIGKILL)


def _spec_facts(spec) -> dict:
    facts = {k: getattr(spec, k) for k in _MUST_MATCH if k != "layout"}
    facts["layout"] = {k: spec.options[k] for k in LAYOUT_OPTIONS if k in spec.options}
    return facts


# -- what each strategy owns -----------------------------------------------------------------------
def capture(spec, model, wrapped, opt, losses: list[float], layout: Layout | None = None
            ) -> tuple[dict, dict | None]:
    """(this rank's own state, the replicated state) of a training loop.

    ``model``: the module holding this rank's parameters (the whole model for data parallelism; the
    TP shard, the pipeline stage(s) or the mesh stage(s) otherwise); ``wrapped``: its DDP/ZeRO
    wrapper, if any; ``opt``: the optimizer that steps them.
    """
    own = {"losses": torch.tensor(losses, dtype=torch.float64)}
    if spec.strategy not in DATA_PARALLEL:
        if layout is not None:
            own.update(param_layout=layout.params, loss_weight=layout.loss_weight)
        return _capture_model_parallel(spec, model, opt, own)
    names_by_id = {id(p): n for n, p in model.named_parameters()}
    names = {"buffer_names": [n for n, _ in model.named_buffers()]}     # (for resharding: see reshard.py)
    if spec.strategy in ("single", "ddp"):
        replicated = {"model": model.state_dict(), "optimizer": opt.optimizer.state_dict(),
                      "param_names": [names_by_id[id(p)] for p in opt.params], **names}
        if opt.mixed:
            replicated["masters"] = list(opt.masters)
        return own, replicated
    own["optimizer"] = opt.state_dict()                    # this rank's ZeRO shard of the optimizer state
    own["masters"] = [m for m, s in zip(opt.masters, opt.shards) if m is not s]   # bf16: fp32 masters
    own["layout"] = [reshard.bucket_layout(b, names_by_id) for b in opt.buckets]  # what cut the shards
    if spec.strategy == "zero3":
        own["params"] = list(opt.shards)                   # parameters live only as shards at rest
        return own, {"buffers": dict(model.named_buffers())}
    return own, {"model": model.state_dict(), **names}


def _capture_model_parallel(spec, model, opt, own: dict) -> tuple[dict, dict | None]:
    if not spec.strategy.startswith("3d"):                 # tp, pp: nothing is replicated rank to rank
        own.update(model=model.state_dict(), optimizer=opt.state_dict())
        return own, None
    from ..strategies.mesh import parse                     # the dp replicas of a stage hold equal copies
    if parse(spec.strategy, spec.options)["zero"]:
        own["optimizer"] = opt.state_dict()                 # ZeRO-1 over dp: each replica its own shard
        keys = {id(p): k for k, p in model.named_parameters()}
        own["layout"] = [reshard.bucket_layout(b, keys) for b in opt.buckets]   # local keys, for resharding
        return own, {"model": model.state_dict()}
    return own, {"model": model.state_dict(), "optimizer": opt.state_dict()}


@torch.no_grad()
def restore(spec, model, wrapped, opt, state: dict) -> None:
    """Put ``state`` (from `capture` via `store.load`) back into the model and optimizer."""
    if spec.strategy not in DATA_PARALLEL:
        model.load_state_dict(state["model"])               # copies into the parameters in place
        opt.load_state_dict(state["optimizer"])
        return
    if spec.strategy in ("single", "ddp"):
        model.load_state_dict(state["model"])
        opt.optimizer.load_state_dict(state["optimizer"])
        for m, saved in zip(opt.masters if opt.mixed else [], state.get("masters", [])):
            m.copy_(saved)
        return
    if spec.strategy == "zero3":
        for s, saved in zip(opt.shards, state["params"]):
            s.copy_(saved)
        for name, buf in model.named_buffers():
            buf.copy_(state["buffers"][name])
    else:
        model.load_state_dict(state["model"])              # params are views of the flat buckets: shards follow
    masters = [m for m, s in zip(opt.masters, opt.shards) if m is not s]
    for m, saved in zip(masters, state["masters"]):
        m.copy_(saved)
    opt.load_state_dict(state["optimizer"])
