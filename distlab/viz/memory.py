"""Memory bars per rank by category: measured (from the trace's memory samples) beside predicted.

    fig = dl.viz.memory(run.trace, predicted=dl.theory.memory(psi, dp=4, zero=2, precision="fp32"))

Each rank gets a stacked bar of its *peak per category* over the run's samples (params, grads,
optimizer, activations, buffers); with ``predicted`` (a `dl.theory` MemoryBreakdown, a dict by
category, or one of either per rank) a hatched bar beside it stacks the predicted categories.
Read it as: where the bars agree the ledger is what the formula says; ZeRO-1 shrinks the
optimizer block by N, ZeRO-2 the gradients too, ZeRO-3 the parameters as well.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..memory import CATEGORIES, OFF_DEVICE

COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
          "buffers": "#8172B3", "host": "#937860", "disk": "#8C8C8C"}


def peaks(trace) -> dict[int, dict[str, int]]:
    """{rank: {category: peak bytes}} from a trace's memory samples (``host``/``disk`` where an offloading
    run sampled them: stacked above the device's categories)."""
    samples = trace.memory_samples()
    shown = CATEGORIES + tuple(c for c in OFF_DEVICE if any(c in e.args for e in samples))
    out: dict[int, dict[str, int]] = {}
    for e in samples:
        row = out.setdefault(e.rank, {c: 0 for c in shown})
        for c in shown:
            row[c] = max(row[c], int(e.args.get(c, 0)))
    return out


def _as_dict(p) -> dict[str, float]:
    if p is None:
        return {}
    if hasattr(p, "as_dict"):
        return p.as_dict()
    return dict(p)


def memory(trace, predicted=None, title: str | None = None, unit: str = "auto", ax=None):
    """Stacked bars per rank, measured (solid) beside predicted (hatched); returns the Figure."""
    trace = getattr(trace, "trace", trace)            # a Report or a Run works too
    measured = peaks(trace)
    if not measured:
        raise ValueError("the trace has no memory samples: record some with dl.memory.Ledger().sample(...)")
    ranks = sorted(measured)
    if isinstance(predicted, (list, tuple)):
        pred = {r: _as_dict(predicted[i]) for i, r in enumerate(ranks)}
    else:
        pred = {r: _as_dict(predicted) for r in ranks} if predicted is not None else {}
    top = max(max(sum(m.values()) for m in measured.values()),
              max((sum(p.values()) for p in pred.values()), default=0))
    scale, label = _unit(top, unit)
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(1.6 + 1.1 * len(ranks), 3.6))
    width = 0.38 if pred else 0.6
    for i, r in enumerate(ranks):
        bottoms = {"m": 0.0, "p": 0.0}
        for c in measured[r]:
            value = measured[r].get(c, 0) / scale
            ax.bar(i - (width / 2 if pred else 0), value, width, bottom=bottoms["m"], color=COLORS[c],
                   label=c if i == 0 else None)
            bottoms["m"] += value
            if pred:
                pv = pred[r].get(c, 0) / scale
                ax.bar(i + width / 2, pv, width, bottom=bottoms["p"], color=COLORS[c], alpha=0.45,
                       hatch="//", edgecolor="black", linewidth=0.4)
                bottoms["p"] += pv
    ax.set_xticks(range(len(ranks)),
                  [f"rank {r}" + ("\nmeasured | predicted" if pred else "") for r in ranks], fontsize=8)
    ax.set_ylabel(label)
    ax.set_title(title or "memory per rank (peak by category)")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def _unit(top: float, unit: str) -> tuple[float, str]:
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    if unit == "auto":
        unit = next((u for u in ("GiB", "MiB", "KiB") if top >= 10 * units[u]), "B")
    if unit not in units:
        raise ValueError(f"unit must be 'auto' or one of {list(units)}, got {unit!r}")
    return units[unit], unit
