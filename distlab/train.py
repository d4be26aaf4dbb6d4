"""`dl.train`: the one entry point to training that the CLI, the benchmarks and the lessons share.

    report = dl.train("zero2", world_size=4, model="gpt-tiny", steps=20, seed=0)
    report.losses          # per step, from the rank that holds the loss
    report.params          # final full parameters by name (gathered)
    report.memory[r]       # rank r's ledger: {"peak": {...}, "peak_total": ..., "timeline": [...]}
    report.comm[r]         # rank r's bytes: {"sent", "received", "sent_per_step", "sent_by_op"}
    report.run.trace       # everything recorded (None for "single", which runs in this process)
    report.stragglers()    # per step: each rank's compute time, the skew, the slowest rank

Checkpoints (every strategy; see `distlab.checkpoint`): ``checkpoint_dir=..., checkpoint_every=k``
saves every k steps and at the end (``keep_last=n`` keeps the newest n); ``resume=True`` continues from
the newest checkpoint that verifies, bit-exact (a damaged newer one is skipped, and named);
``fail_at_step=s`` kills a rank on purpose (lessons, tests). ``precision="fp16-mixed"`` scales the loss
dynamically; a step whose gradients hold an inf/NaN on any rank is skipped on all (``report.numerics``);
``memory_limit="64MB"`` raises an out-of-memory error the moment the ledger crosses it.
``async_save=True`` writes checkpoints in the background (`distlab.checkpoint.background`).
``max_restarts=k`` relaunches a failed run from its
newest checkpoint up to k times, on fewer ranks with ``shrink`` (`strategies.restart`; ``report.restarts``).

The walk of a call, straight through::

    spec = parse(strategy, **keywords)      the typed spec (`distlab.strategies.spec`); names checked,
                                            each value by its field's rule
    sizes = validate(spec, world_size)      the whole spec against the world, once, in the parent
    check_machine(world_size)               the ranks this machine can hold
    run: _single | _launched | restart.run  ``load(strategy)``'s ``train_rank`` on every rank
    -> Report                               losses, params, trace, memory, comm

A strategy is a ``train_rank(spec)`` function (`distlab.strategies`), run on every rank by
`dl.launch`; ``single`` runs right here on one process and is the reference every strategy must match
on the same global batch. Every strategy builds its model and hands the steps to the one training
loop, `distlab.strategies.loop`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .progress import bar_here, shown_by_default
from .rules import WORLD_SIZE, Custom, Flag, Number, OneOf, check

if TYPE_CHECKING:                 # the strategies (and torch) load when `train` first runs, not on import
    import torch

    from .strategies import RankResult, TrainSpec


def _is_dict(value) -> None:
    if not isinstance(value, dict):
        raise TypeError


#: what `train`'s own arguments take (`distlab.rules`); every other parameter is a keyword of the typed
#: spec, whose field declares its rule (`distlab.strategies.spec`)
ARGUMENTS = {
    "world_size": WORLD_SIZE,
    "options": Custom(_is_dict, "a dict {option name: value}", example={"bucket_mb": 25.0}, none="none"),
    "output": OneOf("quiet", "ordered", "live"),
    "timeout": Number(0, strict=True, example=300.0),
    "progress": Flag(none="a bar when a person watches"),
    "check_only": Flag(),
}
#: what one rank holds of its own, at the least: a process with torch, gloo and a tiny model loaded
#: (measured: a gpt-tiny DDP rank forked on Linux has about 130 MiB of private memory)
RANK_BYTES = 128 * 2**20


@dataclass
class Report:
    """What `train` returns (see the module docstring)."""

    spec: TrainSpec
    world_size: int
    losses: list[float]
    params: dict[str, torch.Tensor] | None
    run: object | None
    memory: list[dict]
    comm: list[dict]
    results: list[RankResult] = field(repr=False, default_factory=list)
    seconds: float = 0.0

    @property
    def strategy(self) -> str:
        return self.spec.strategy

    @property
    def trace(self):
        """The merged trace (a `dl.Trace`); for ``single``, the events this process recorded."""
        return self.run.trace if self.run is not None else self._single_trace

    _single_trace: object = field(default=None, repr=False)
    restarts: list = field(default_factory=list)      # `distlab.strategies.restart.Restart`, one per relaunch

    def stragglers(self):
        """Per step, each rank's forward-and-backward time, the skew between ranks and the slowest rank
        (`distlab.stragglers`): ``report.stragglers().straggler``, ``.skew``, ``print(...)``."""
        from .stragglers import stragglers
        return stragglers(self.trace)

    @property
    def numerics(self) -> dict:
        """Rank 0's step numerics (`distlab.strategies.numerics`): ``skipped`` (steps skipped on every
        rank for an inf/NaN gradient), ``grad_norms`` {step: norm}, ``spikes``, ``loss_scales`` (fp16)."""
        return self.results[0].info.get("numerics", {}) if self.results else {}

    def __repr__(self) -> str:
        last = f"{self.losses[-1]:.4f}" if self.losses else "-"
        return (f"Report({self.spec.strategy!r}, world_size={self.world_size}, model={self.spec.model!r}, "
                f"steps={len(self.losses)}, final loss={last})")


def train(strategy: str = "single", world_size: int = 1, model: str = "gpt-tiny", steps: int = 20,
          seed: int = 0, *, global_batch: int = 16, lr: float = 1e-3, optimizer: str = "adamw",
          weight_decay: float = 0.0, grad_accum: int = 1, precision: str = "fp32",
          clip: float | None = None, options: dict | None = None, output: str = "quiet",
          timeout: float = 300.0, progress: bool | None = None, max_restarts: int = 0, shrink=False,
          check_only: bool = False, **more_options) -> Report | None:
    """Train ``model`` with ``strategy`` on ``world_size`` ranks. Every other keyword (and every entry of
    ``options``) is a field of the typed spec (`distlab.strategies.spec`), e.g. ``bucket_mb=1,
    overlap=False, comm="ring"`` for DDP, ``prefetch=True`` for ZeRO-3; one the strategy does not read
    is a TypeError naming those it does, with a did-you-mean (`distlab.strategies.parse`).
    ``progress``: a bar with step, loss and it/s (None: when a person watches, see `distlab.progress`).
    ``check_only``: check the training input (every argument and option, its type and range, the layout,
    the checkpoint options, the restart plan, the ranks this machine can hold; a ValueError, or a
    TypeError for an option that does not exist, that says what to pass instead), then return None
    without training (a ``checkpoint_dir`` is created, as proof that it is writable). Only torchrun's
    world is checked later, when the launch meets it."""
    from .strategies import load, parse, restart, validate
    check(ARGUMENTS, dict(world_size=world_size, options=options, output=output, timeout=timeout,
                          progress=progress, check_only=check_only))
    named = dict(model=model, steps=steps, seed=seed, global_batch=global_batch, lr=lr, optimizer=optimizer,
                 weight_decay=weight_decay, grad_accum=grad_accum, precision=precision, clip=clip,
                 max_restarts=max_restarts, shrink=shrink, **more_options)
    twice = sorted(set(options or {}) & set(named))
    if twice:
        raise TypeError(f"{twice[0]!r} is given twice, as a keyword and in options=: pass it once")
    spec = parse(strategy, **named, **(options or {}))
    sizes = validate(spec, world_size)        # every check, once, before any rank starts
    if spec.strategy != "single":
        check_machine(world_size)
    if check_only:
        return None
    train_rank = load(spec.strategy)
    if spec.strategy == "single":
        return _single(train_rank, spec, progress)
    if len(sizes) > 1:
        return restart.run(spec, sizes, lambda s, n: _launched(train_rank, s, n, output, timeout, progress))
    return _launched(train_rank, spec, world_size, output, timeout, progress)


def check_machine(world_size: int) -> None:
    """Refuse, with the reason, more ranks than this machine can hold: every rank is a process with at
    least `RANK_BYTES` of its own memory, and each takes open files and a process of this user's
    (`distlab.launch`'s limits). The deadline or the kernel's out-of-memory killer would end such a run
    halfway, after minutes, with no word on why."""
    from .launch.parent import _check_limits, _under_torchrun
    if _under_torchrun():                         # torchrun's processes, maybe on many machines
        return
    _check_limits(world_size)                     # open files and processes: what `ulimit` allows
    free = available_memory()
    if free is not None and world_size * RANK_BYTES > free:
        need, most = world_size * RANK_BYTES / 2**30, max(1, free // RANK_BYTES)
        raise ValueError(f"world_size={world_size} ranks need at least {world_size} x "
                         f"{RANK_BYTES / 2**20:.0f} MiB = {need:.1f} GiB of memory (each rank is a process "
                         f"with torch loaded), but this machine has {free / 2**30:.1f} GiB available: use "
                         f"at most {most} ranks, free memory, or run on a machine with more")


def available_memory() -> int | None:
    """Bytes this process could still allocate: the kernel's MemAvailable, or the room left under a
    cgroup (container) limit if that is smaller; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                found.append(int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _single(train_rank, spec: TrainSpec, progress: bool | None) -> Report:
    """``single``: the reference, right here in this process, with the events it records as its trace."""
    from .runtime import tracer
    from .trace import Trace
    start, tr = time.perf_counter(), tracer()
    mark, t0 = len(tr.export()), tr.now()
    with bar_here(shown_by_default() if progress is None else progress):
        result = train_rank(spec)
    _print_notes([result])
    trace = Trace.merge({0: tr.export()[mark:]}).shifted(-t0)       # 0: the run starts, as in a launch
    return Report(spec, 1, result.losses, result.params, None, [result.info.get("memory", {})],
                  [result.info.get("comm", {})], [result], time.perf_counter() - start, trace)


def _launched(train_rank, spec: TrainSpec, world_size: int, output: str, timeout: float,
              progress: bool | None) -> Report:
    """One launch of ``train_rank`` on ``world_size`` ranks, and its `Report`."""
    from .launch import launch
    start, strategy = time.perf_counter(), spec.strategy
    run = launch(train_rank, world_size=world_size, args=(spec,), output=output, timeout=timeout,
                 progress=progress)
    results: list[RankResult] = run.results
    _print_notes(results)
    holder = next((r for r in results if r.losses is not None), None)
    if holder is None:
        raise RuntimeError(f"strategy {strategy!r} returned no losses on any rank")
    params = next((r.params for r in results if r.params is not None), None)
    return Report(spec, world_size, holder.losses, params, run, [r.info.get("memory", {}) for r in results],
                  [r.info.get("comm", {}) for r in results], results, time.perf_counter() - start)


def _print_notes(results: list[RankResult]) -> None:
    """What the ranks' checkpoint side has to say (a damaged checkpoint skipped on resume), once."""
    for note in dict.fromkeys(r.info.get("checkpoint", {}).get("note") for r in results):
        if note:
            print(f"distlab: {note}", file=sys.stderr, flush=True)
    from .strategies.numerics import notes
    for note in notes(results[0].info.get("numerics", {})) if results else ():
        print(f"distlab: {note}", file=sys.stderr, flush=True)
