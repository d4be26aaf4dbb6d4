"""Plots a learner needs: timelines per rank, memory bars, communication charts, pipeline schedules.

Every function takes a `distlab.Trace` (or plain numbers) and returns the matplotlib Figure, with
the theory's prediction drawn beside the measurement where there is one. One file per chart; the
functions are imported here eagerly, so ``dl.viz.timeline`` is always the function even though a
submodule of the same name exists.
"""
from __future__ import annotations

from .comm import comm, ring_steps
from .memory import memory
from .pipeline import pipeline, schedule, stash
from .tensors import per_rank
from .timeline import timeline

__all__ = ["comm", "memory", "per_rank", "pipeline", "ring_steps", "schedule", "stash", "timeline"]
