"""`timeline(trace)`: what every rank did over time, compute and communication in distinct colours.

Each rank gets two lanes: compute spans on top, communication underneath, so communication that
overlaps computation (DDP's bucketed all-reduce hidden under backward) is visible as bars stacked
in the same time column, and idle time is the white space left on both lanes.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..trace import Trace

COMM_COLOUR = "#d62728"
_PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f"]


def colour_for(names: list[str]) -> dict[str, str]:
    """A stable colour per span name (first seen, first coloured)."""
    return {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(dict.fromkeys(names))}


COMM_PALETTE = ["#d62728", "#ff7f0e", "#2ca02c", "#7f7f7f"]


def timeline(trace: Trace, ranks: list[int] | None = None, start: float | None = None,
             end: float | None = None, title: str | None = None, ax=None, unit: str = "ms",
             comm_kind=None, comm_colours: dict[str, str] | None = None):
    """Draw per-rank lanes of compute spans and comm events; returns the Figure.

    ``start``/``end`` (seconds) crop the window; ``unit`` is "s" or "ms" for the x axis.
    ``comm_kind(event) -> str`` colours communication by kind (e.g. the mesh axis, `strategies.mesh.axis_of`);
    by default all communication is one colour; ``comm_colours`` picks the colour of each kind.
    """
    scale = {"s": 1.0, "ms": 1e3}[unit]
    ranks = trace.ranks if ranks is None else ranks
    spans = [e for e in trace.events if e.kind == "span" and e.rank in ranks]
    comms = [e for e in trace.events if e.kind == "comm" and e.rank in ranks]
    window = [e for e in spans + comms
              if (start is None or e.end >= start) and (end is None or e.start <= end)]
    t0 = min((e.start for e in window), default=0.0) if start is None else start

    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * max(len(ranks), 1)))
    else:
        fig = ax.figure
    colours = colour_for([e.name for e in spans])
    kind_of = comm_kind or (lambda e: "communication")
    kinds = sorted({kind_of(e) for e in comms}) or ["communication"]
    chosen = comm_colours or {}
    comm_colours = {k: chosen.get(k, COMM_COLOUR if comm_kind is None
                                  else COMM_PALETTE[i % len(COMM_PALETTE)])
                    for i, k in enumerate(kinds)}
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        mine = [e for e in window if e.rank == r]
        compute = [((e.start - t0) * scale, max(e.duration, 1e-9) * scale) for e in mine if e.kind == "span"]
        ax.broken_barh(compute, (y + 0.38, 0.5),
                       facecolors=[colours[e.name] for e in mine if e.kind == "span"])
        comm = [e for e in mine if e.kind == "comm"]
        ax.broken_barh([((e.start - t0) * scale, max(e.duration, 1e-9) * scale) for e in comm],
                       (y + 0.08, 0.28), facecolors=[comm_colours[kind_of(e)] for e in comm])
    ax.set_yticks([len(ranks) - 1 - i + 0.5 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(0, max(len(ranks), 1))
    ax.set_xlabel(f"time ({unit})")
    if end is not None:
        ax.set_xlim(0, (end - t0) * scale)
    handles = [Patch(color=c, label=n) for n, c in colours.items()] + \
        [Patch(color=c, label=k if comm_kind is None else f"{k} communication")
         for k, c in comm_colours.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "timeline: compute (upper lane) and communication (lower lane) per rank")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
