"""Plots a learner needs: timelines per rank, memory bars, communication charts.

Every function takes a `distlab.Trace` (or plain numbers) and returns the matplotlib Figure, with
the theory's prediction drawn beside the measurement where there is one. One file per chart.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "timeline": ".timeline",
    "per_rank": ".tensors",
    "comm": ".comm",
    "ring_steps": ".comm",
    "memory": ".memory",
    "pipeline": ".pipeline",
    "schedule": ".pipeline",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'distlab.viz' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
