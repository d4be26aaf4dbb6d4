"""`run`: a validated `TrainSpec` run and reported -- the strategy's ``train_rank`` (`registry.load`) right
here for ``single``, on every rank of `dl.launch` otherwise, relaunched from its checkpoint by `restart`
when a rank fails and restarts are allowed -- and the `Report` `dl.train` returns: losses, parameters,
the trace, each rank's memory and bytes, notes from the checkpoint side and the numerics.

    spec, sizes (validated) -> load(spec.strategy) -> _single | restart.run(_launched) | _launched -> Report
                                                   (a dry run, ``backend="fake"``: _dry_run, the listed ranks)
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from ..progress import bar_here, shown_by_default
from . import restart
from .base import RankResult
from .registry import load
from .spec import TrainSpec


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
        from ..stragglers import stragglers
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


def run(spec: TrainSpec, sizes: list[int], *, output: str, timeout: float, progress: bool | None,
        dry_ranks: tuple | None = None) -> Report:
    """Run ``spec`` (validated: `validate.validate` gave ``sizes``, the world size of every attempt) and
    report it; ``dry_ranks``: only those ranks, here, on the fake backend (`distlab.strategies.dry`)."""
    train_rank = load(spec.strategy)
    if dry_ranks is not None:
        return _dry_run(train_rank, spec, sizes[0], dry_ranks, output, timeout)
    if spec.strategy == "single":
        return _single(train_rank, spec, progress)

    if spec.restart.engine == "ray":                  # Ray Train starts (and restarts) the ranks
        from . import on_ray
        start = time.perf_counter()
        return report(spec, sizes[0], on_ray.launch(train_rank, spec, sizes[0], timeout), start)

    def launch_once(s: TrainSpec, n: int) -> Report:
        return _launched(train_rank, s, n, output, timeout, progress)
    if len(sizes) > 1:
        return restart.run(spec, sizes, launch_once)
    return launch_once(spec, sizes[0])


def _single(train_rank, spec: TrainSpec, progress: bool | None) -> Report:
    """``single``: the reference, right here in this process, with the events it records as its trace."""
    from ..runtime import tracer
    from ..trace import Trace
    start, tr = time.perf_counter(), tracer()
    mark, t0 = len(tr.export()), tr.now()
    with bar_here(shown_by_default() if progress is None else progress), _profiled(spec, tr, t0):
        result = train_rank(spec)
    _print_notes([result])
    trace = Trace.merge({0: tr.export()[mark:]}).shifted(-t0)       # 0: the run starts, as in a launch
    return Report(spec, 1, result.losses, result.params, None, [result.info.get("memory", {})],
                  [result.info.get("comm", {})], [result], time.perf_counter() - start, trace)


@contextlib.contextmanager
def _profiled(spec: TrainSpec, tr, origin: float):
    """``single`` with ``profile=DIR``: this process as rank 0 of a launch's profile (`launch.profiler`)."""
    from ..launch import profiler
    directory = profiler.prepare(spec.profiling.profile)
    if directory is None:
        yield
        return
    with profiler.RankProfiler(directory, 0, tr, origin):           # on the axis of the report's trace
        yield
    profiler.merge(directory, 1)


def _launched(train_rank, spec: TrainSpec, world_size: int, output: str, timeout: float,
              progress: bool | None) -> Report:
    """One launch of ``train_rank`` on ``world_size`` ranks, and its `Report`."""
    from ..launch import launch
    start = time.perf_counter()
    run = launch(train_rank, world_size=world_size, args=(spec,), output=output, timeout=timeout,
                 progress=progress, profile=spec.profiling.profile)
    return report(spec, world_size, run, start)


def report(spec: TrainSpec, world_size: int, run, start: float) -> Report:
    """The `Report` of a ``run`` of ``train_rank`` on every rank (by `dl.launch` or Ray Train), begun at
    ``start`` (``time.perf_counter()``)."""
    strategy = spec.strategy
    results: list[RankResult] = run.results
    _print_notes(results)
    holder = next((r for r in results if r.losses is not None), None)
    if holder is None:
        raise RuntimeError(f"strategy {strategy!r} returned no losses on any rank")
    params = next((r.params for r in results if r.params is not None), None)
    return Report(spec, world_size, holder.losses, params, run, [r.info.get("memory", {}) for r in results],
                  [r.info.get("comm", {}) for r in results], results, time.perf_counter() - start)


def _dry_run(train_rank, spec: TrainSpec, world_size: int, ranks: tuple, output: str,
             timeout: float) -> Report:
    """The listed ranks of a ``world_size``-rank run, here, on the fake backend (`strategies.dry`):
    memory and comm one entry per listed rank, in the order of ``ranks``; losses NaN."""
    from ..launch import launch
    start = time.perf_counter()
    run = launch(train_rank, world_size=world_size, args=(spec,), output=output, timeout=timeout,
                 backend="fake", ranks=ranks)
    results: list[RankResult] = run.results
    losses = next((r.losses for r in results if r.losses is not None), [math.nan] * spec.steps)
    return Report(spec, world_size, losses, None, run, [r.info.get("memory", {}) for r in results],
                  [r.info.get("comm", {}) for r in results], results, time.perf_counter() - start)


def _print_notes(results: list[RankResult]) -> None:
    """What the ranks' checkpoint side has to say (a damaged checkpoint skipped on resume), once."""
    for note in dict.fromkeys(r.info.get("checkpoint", {}).get("note") for r in results):
        if note:
            print(f"distlab: {note}", file=sys.stderr, flush=True)
    from .numerics import notes
    for note in notes(results[0].info.get("numerics", {})) if results else ():
        print(f"distlab: {note}", file=sys.stderr, flush=True)
