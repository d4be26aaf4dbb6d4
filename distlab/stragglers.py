"""Stragglers: which rank holds every step back, read from a training run's trace.

In synchronous training every rank waits for the slowest at the step's first blocking collective,
so step *times* come out equal on all ranks; what differs is how much of the step each rank spent
computing rather than waiting. From the loop's marks (`distlab.strategies.loop`: a "step" mark, the
forward and backward passes, then the "optimizer" span) and the comm events of the same window::

    rank 0  |step|-- forward + backward --[wait in all-reduce .........]|optimizer|step|
    rank 1  |step|-- forward + backward (slow) ---------------[all-red.]|optimizer|step|
                 <------------------------ work[r][s] ----------------->
                                           <------ waited[0][s] ------->
    busy[r][s] = work[r][s] - waited[r][s]     (seconds computing up to the optimizer step)
    skew[s]    = max_r busy[r][s] - min_r busy[r][s]       slowest[s] = argmax_r busy[r][s]

``waited`` is the time covered by communication events (overlapping ones counted once). An
all-reduce overlapped with backward counts as waiting from its launch, so a fast rank's busy time
is if anything underestimated and the skew overstated by the transfer time; the straggler, whose
collectives complete as soon as it joins them, waits least and keeps its whole compute time.
(Straggler mitigation at scale: Wu et al. 2024, "FALCON: Pinpointing and Mitigating Stragglers for
Large-Scale Hybrid-Parallel Training"; the per-rank step timeline is what MegaScale monitors.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stragglers:
    """Per rank and step: ``work`` (seconds from the step mark to the optimizer span), ``waited``
    (seconds inside communication in that window), ``busy`` (work - waited) and ``step`` (seconds from
    the mark to the rank's next one)."""

    steps: list[int]
    work: dict[int, list[float]]
    waited: dict[int, list[float]]
    step: dict[int, list[float]]

    @property
    def busy(self) -> dict[int, list[float]]:
        return {r: [w - x for w, x in zip(self.work[r], self.waited[r])] for r in self.work}

    @property
    def skew(self) -> list[float]:
        """Per step: the slowest rank's busy time minus the fastest rank's."""
        busy = self.busy
        per_step = [[b[i] for b in busy.values()] for i in range(len(self.steps))]
        return [max(b) - min(b) for b in per_step]

    @property
    def slowest(self) -> list[int]:
        """Per step: the rank that computed longest."""
        busy = self.busy
        return [max(busy, key=lambda r: (busy[r][i], -r)) for i in range(len(self.steps))]

    @property
    def straggler(self) -> int | None:
        """The rank slowest in the most steps (None without steps)."""
        if not self.steps:
            return None
        slowest = self.slowest
        return max(sorted(set(slowest)), key=slowest.count)

    def __str__(self) -> str:
        ranks = sorted(self.work)
        busy = self.busy
        head = "step  " + "".join(f"rank {r} busy  " for r in ranks) + "skew      slowest"
        rows = [f"{s:>4}  " + "".join(f"{busy[r][i]:>9.4f} s  " for r in ranks)
                + f"{self.skew[i]:.4f} s  rank {self.slowest[i]}" for i, s in enumerate(self.steps)]
        return "\n".join([head, *rows, f"straggler: rank {self.straggler}"])

    __repr__ = __str__


def stragglers(trace) -> Stragglers:
    """The per-step work of every rank in ``trace`` (a `dl.Trace` of a `dl.train` run); steps that
    every rank marked and finished (a resumed run's earlier steps are simply absent)."""
    marks = {r: {e.args["step"]: e.start for e in trace.select(kind="mark", rank=r, name="step")}
             for r in trace.ranks}
    optim = {r: {e.args["step"]: e.start for e in trace.spans(rank=r, name="optimizer")} for r in trace.ranks}
    ends = {r: max((e.end for e in trace.select(rank=r)), default=0.0) for r in trace.ranks}
    ranks = [r for r in trace.ranks if marks[r]]
    steps = sorted(set.intersection(*(set(marks[r]) & set(optim[r]) for r in ranks))) if ranks else []
    work, waited, step = {}, {}, {}
    for r in ranks:
        comms = [(e.start, e.end) for e in trace.comms(rank=r)]
        nxt = sorted(marks[r].values()) + [ends[r]]
        work[r] = [optim[r][s] - marks[r][s] for s in steps]
        waited[r] = [_covered(comms, marks[r][s], optim[r][s]) for s in steps]
        step[r] = [min(t for t in nxt if t > marks[r][s]) - marks[r][s] for s in steps]
    return Stragglers(steps, work, waited, step)


def _covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside at least one of ``intervals`` (overlapping ones counted once)."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total, reach = total + end - start, end
    return total
