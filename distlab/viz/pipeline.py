"""Pipeline timelines: one row per rank, one box per action (F/B/I/W, microbatch written inside).

``pipeline(trace)`` draws a measured run of `distlab.pp.Pipeline` (watched by `distlab.pp.ActionTrace`;
``stash`` also by `distlab.memory.PipelineStash`): compute boxes where the rank
worked, a thin grey bar under them while it waited on a receive from a neighbour, white where it
idled -- the bubble. ``schedule(actions)`` draws the same picture from the schedule alone, replayed
on an ideal clock by `distlab.parallel.pipeline.schedule.simulate`. Same colours, so the two sit side by side.
``stash(trace)`` draws the microbatches each rank holds activations for, over time.

Colours: F blue, B green, I (input-gradient half of B) orange, W (weight-gradient half) purple;
interleaved model chunks 1, 2, ... are drawn lighter.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..parallel.pipeline.measure import STEP, in_flight, measured_bubble
from ..parallel.pipeline.schedule import simulate

COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}
NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


def _box(ax, row: int, start: float, end: float, kind: str, microbatch: int, chunk: int, label: bool):
    alpha = 1.0 if chunk == 0 else max(0.35, 1.0 - 0.3 * chunk)
    ax.barh(row, end - start, left=start, height=0.8, color=COLOURS[kind], alpha=alpha,
            edgecolor="white", linewidth=0.5)
    if label:
        ax.text((start + end) / 2, row, str(microbatch), ha="center", va="center", fontsize=7, color="white")


def _finish(ax, p: int, title: str, xlabel: str, kinds: set[str]) -> None:
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=COLOURS[k], label=NAMES[k]) for k in "FBIW" if k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, framealpha=0.9)


def pipeline(trace, step: int | None = None, ax=None, title: str | None = None):
    """Measured timeline of one ``step`` (default: the last recorded) of a `Pipeline` run;
    returns the Figure."""
    spans = [e for e in trace.spans(cat="compute") if e.name in COLOURS and "step" in e.args]
    if not spans:
        raise ValueError("no pipeline actions in this trace: run dl.pp.Pipeline.step inside dl.launch, "
                         "with observers=[dl.pp.ActionTrace()]")
    step = max(e.args["step"] for e in spans) if step is None else step
    ranks = sorted({e.rank for e in spans})
    p = len(ranks)
    fig, ax = _axes(ax, p)
    origin = {}
    for r in ranks:
        marks = [e.start for e in trace.select("mark", rank=r, name=STEP) if e.args.get("step") == step]
        mine = [e for e in spans if e.rank == r and e.args["step"] == step]
        origin[r] = marks[0] if marks else min(e.start for e in mine)
        for e in mine:
            _box(ax, r, (e.start - origin[r]) * 1e3, (e.end - origin[r]) * 1e3, e.name, e.args["microbatch"],
                 e.args["stage"] // p, label=True)
        ends = sorted(e.end for e in mine)
        for c in trace.comms(rank=r, op="recv", step=step):
            # a receive is posted early; the rank only *waits* from its last finished action to the arrival
            waiting_from = max([c.start] + [t for t in ends if t <= c.end])
            ax.barh(r + 0.47, (c.end - waiting_from) * 1e3, left=(waiting_from - origin[r]) * 1e3,
                    height=0.08, color="#999999")
    b = measured_bubble(trace, step)
    _finish(ax, p, title or f"measured: bubble {b.total:.0%} of step time ({b.ideal:.0%} of ideal)",
            "ms since the step started (each rank's own clock); grey: waiting on a receive",
            {e.name for e in spans})
    return fig


def schedule(actions, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None, t_comm: float = 0.0,
             ax=None, title: str | None = None):
    """Ideal timeline of ``actions`` (from `dl.pp.schedule`), replayed by `simulate`; returns the Figure."""
    timeline = simulate(actions, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm)
    p = len(actions)
    fig, ax = _axes(ax, p)
    for row in timeline.spans:
        for s in row:
            a = s.action
            _box(ax, s.rank, s.start, s.end, a.kind, a.microbatch, a.stage // p, label=True)
    _finish(ax, p, title or f"simulated: bubble {timeline.bubble:.0%} of step time",
            "time (units of t_f)", {a.kind for row in actions for a in row})
    return fig


def stash(trace, step: int | None = None, ax=None, title: str | None = None):
    """Microbatches whose activations each rank holds, over one step; returns the Figure."""
    ranks = sorted({e.rank for e in trace.memory_samples() if e.name == "pipeline stash"})
    if not ranks:
        raise ValueError("no 'pipeline stash' samples in this trace: run dl.pp.Pipeline.step inside "
                         "dl.launch, with observers=[dl.memory.PipelineStash()]")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 2.6))
    else:
        fig = ax.figure
    for r in ranks:
        samples = in_flight(trace, r, step)
        if not samples:
            continue
        t0 = samples[0][0]
        ax.step([(t - t0) * 1e3 for t, _, _ in samples], [n for _, n, _ in samples], where="post",
                label=f"rank {r}")
    ax.set_xlabel("ms since the rank's first action")
    ax.set_ylabel("microbatches in flight")
    ax.set_title(title or "activations stashed per rank", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def _axes(ax, p: int):
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=(9, 0.45 * p + 1.2))
    return fig, ax
