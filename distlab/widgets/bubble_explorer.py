"""Bubble explorer: pick a schedule, stages p, microbatches m, chunks v and F/B/W times; see the
simulated timeline (:func:`distlab.parallel.pipeline.schedule.simulate`) and its idle fraction beside the
closed form (:func:`distlab.theory.bubble`, ``convention="total"``)."""
from __future__ import annotations

from dataclasses import dataclass

from distlab import theory
from distlab.parallel.pipeline.schedule import SCHEDULES, Timeline, schedule, simulate
from distlab.widgets.base import Explorer, dropdown, float_slider, int_slider, new_figure

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#8FBC8F", "W": "#C9A227"}


@dataclass(frozen=True)
class BubbleResult:
    """``simulated`` and ``predicted`` idle fractions (predicted is None with a comm delay);
    ``error`` says why nothing was simulated (e.g. interleaved with m not a multiple of p)."""

    simulated: float | None
    predicted: float | None
    timeline: Timeline | None
    error: str = ""


class BubbleExplorer(Explorer):
    title = "Pipeline bubble"

    def __init__(self, name: str = "1f1b", p: int = 4, m: int = 8):
        super().__init__({
            "schedule": dropdown("schedule", list(SCHEDULES), name),
            "p": int_slider("stages p", p, 1, 8),
            "m": int_slider("microbatches m", m, 1, 32),
            "v": int_slider("chunks v (interleaved)", 2, 1, 4),
            "t_f": float_slider("forward time", 1.0, 0.1, 4.0),
            "t_b": float_slider("backward time", 2.0, 0.1, 8.0),
            "t_w": float_slider("weight-grad part (zb-h1)", 1.0, 0.0, 4.0),
            "t_comm": float_slider("p2p time", 0.0, 0.0, 2.0, 0.05),
        })

    def compute(self) -> BubbleResult:
        name, p, m = self.value("schedule"), self.value("p"), self.value("m")
        v = self.value("v") if name == "interleaved" else 1
        times = dict(t_f=self.value("t_f"), t_b=self.value("t_b"),
                     t_w=min(self.value("t_w"), self.value("t_b")))
        try:
            timeline = simulate(schedule(name, p, m, virtual=v), t_comm=self.value("t_comm"), **times)
        except ValueError as error:
            return BubbleResult(None, None, None, str(error))
        predicted = None if self.value("t_comm") else theory.bubble(name, p, m, v=v, **times)
        return BubbleResult(timeline.bubble, predicted, timeline)

    def render(self, result: BubbleResult):
        if result.timeline is None:
            return None, f"<p style='color:#b00'>{result.error}</p>"
        fig = new_figure(8, 0.45 * len(result.timeline.spans) + 1.2)
        ax = fig.add_subplot()
        for rank, spans in enumerate(result.timeline.spans):
            for span in spans:
                ax.barh(rank, span.end - span.start, left=span.start, color=COLORS[span.action.kind],
                        edgecolor="white", height=0.8)
                if span.end - span.start >= 0.5:
                    ax.text((span.start + span.end) / 2, rank, str(span.action.microbatch),
                            ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(result.timeline.spans)),
                      [f"rank {r}" for r in range(len(result.timeline.spans))])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(f"{self.value('schedule')}: bubble {result.simulated:.1%} of the step")
        predicted = "" if result.predicted is None else f", theory {result.predicted:.1%}"
        return fig, f"<p>simulated bubble {result.simulated:.1%}{predicted}</p>"


def bubble_explorer(name: str = "1f1b", p: int = 4, m: int = 8) -> BubbleExplorer:
    """Interactive pipeline timeline; see :class:`BubbleExplorer`."""
    return BubbleExplorer(name, p, m)
