"""Watching a pipeline run from outside, and reading it back from the trace.

`ActionTrace`, attached to a `Pipeline` (``pipe.observers.append(ActionTrace())``), records per rank:
a mark ``"pipeline step"`` when a step starts, one compute span per action (name F/B/I/W; args
stage, microbatch, step) and, inside a W span whose custom Functions deferred weight gradients, a mark
``"deferred weight grads"`` (``count``); every comm event of the step is tagged ``step`` through
`collectives.scope`. `distlab.memory.PipelineStash` adds after every action a memory sample
``"pipeline stash"`` (args ``microbatches`` in flight, their saved ``activations`` bytes).

Measured bubble of one step, on p ranks (each rank's times on its own clock, so no cross-rank
clock offset enters)::

    makespan = max over ranks of (end of its last action - its step start)
    busy     = sum over ranks of its compute time in the step
    total    = 1 - busy / (p * makespan)         theory: (p-1)/(m+p-1) for 1F1B, "total" convention
    ideal    = (p * makespan - busy) / busy      theory: (p-1)/m, the "ideal" convention (Megatron)

For the start marks to line up, start the step on every rank together (``dist.barrier()`` first).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ...runtime import tracer
from .. import collectives
from .executor import Observer
from .schedule import Action

STASH = "pipeline stash"          # the label `distlab.memory.PipelineStash` samples under
STEP = "pipeline step"


class ActionTrace(Observer):
    """Records a pipeline's steps and actions into ``dl.tracer()`` (see the module docstring)."""

    @contextlib.contextmanager
    def around_step(self, pipe):
        tracer().mark(STEP, step=pipe.steps)
        with collectives.scope(step=pipe.steps):            # every send/recv (and collective) of the step
            yield

    @contextlib.contextmanager
    def around_action(self, pipe, action: Action):
        s, j = action.stage, action.microbatch
        with tracer().span(action.kind, stage=s, microbatch=j, step=pipe.steps):
            if action.kind == "W":
                work = pipe.stash[(s, j)].deferred
                count = sum(p is not None for params, _ in work for p in params)
                if count:
                    tracer().mark("deferred weight grads", stage=s, microbatch=j, count=count)
            yield


def executed(trace, rank: int, step: int) -> list[Action]:
    """The actions ``rank`` ran in ``step``, in order, as `Action`s (compare with the schedule)."""
    return [Action(e.name, e.args["stage"], e.args["microbatch"])
            for e in trace.spans(rank=rank, cat="compute")
            if e.args.get("step") == step and e.name in ("F", "B", "I", "W")]


@dataclass(frozen=True)
class Bubble:
    """Measured idle share of one pipeline step, in both conventions."""

    total: float       # idle / (p * makespan)
    ideal: float       # idle / busy
    makespan: float    # seconds
    busy: float        # compute seconds summed over ranks
    ranks: int


def measured_bubble(trace, step: int) -> Bubble:
    """The bubble of ``step`` measured from the executed timeline (see the module docstring)."""
    ranks = sorted({e.rank for e in trace.spans(cat="compute") if e.args.get("step") == step})
    if not ranks:
        raise ValueError(f"no pipeline actions recorded for step {step}: attach dl.pp.ActionTrace() to the "
                         "Pipeline (observers=[...])")
    makespan, busy = 0.0, 0.0
    for r in ranks:
        spans = [e for e in trace.spans(rank=r, cat="compute") if e.args.get("step") == step]
        marks = [e.start for e in trace.select("mark", rank=r, name=STEP) if e.args.get("step") == step]
        start = marks[0] if marks else min(e.start for e in spans)
        makespan = max(makespan, max(e.end for e in spans) - start)
        busy += sum(e.duration for e in spans)
    capacity = len(ranks) * makespan
    return Bubble(1.0 - busy / capacity, (capacity - busy) / busy, makespan, busy, len(ranks))


def in_flight(trace, rank: int, step: int | None = None) -> list[tuple[float, int, int]]:
    """(time, microbatches in flight, saved activation bytes) after each action of ``rank``."""
    samples = [e for e in trace.memory_samples(rank=rank) if e.name == STASH]
    if step is not None:
        starts = {e.args.get("step"): e.start for e in trace.select("mark", rank=rank, name=STEP)}
        lo, hi = starts.get(step, float("-inf")), starts.get(step + 1, float("inf"))
        samples = [e for e in samples if lo <= e.start < hi]
    return [(e.start, e.args["microbatches"], e.args["activations"]) for e in samples]


def peak_in_flight(trace, rank: int) -> int:
    """Most microbatches ``rank`` held activations for at once."""
    return max((n for _, n, _ in in_flight(trace, rank)), default=0)
