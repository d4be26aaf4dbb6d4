"""Build-it-yourself exercises, checked on real ranks against the reference.

    res = dl.exercises.check("ring_all_reduce", my_ring_all_reduce)   # prints what passed, or the first
    res.passed                                                         # difference in words, with a hint
    dl.exercises.names()                    # every exercise, in lesson order
    dl.exercises.reference("ring_all_reduce")   # the solution (read it after trying)
    dl.exercises.task("ring_all_reduce")        # what to write

Reading order: harness.py (how a check runs: ranks, cases, the first difference, hangs explained),
then the exercises by lesson: comm.py (send/recv up to the ring and all-to-all), pieces.py (the
schedule, the mesh, buckets, the router, online softmax, an atomic write: no communication).
"""
from __future__ import annotations

from typing import Callable

from distlab.exercises import comm, pieces  # noqa: F401  (importing registers the exercises)
from distlab.exercises.harness import REGISTRY, Exercise, ExerciseNotPassed, Result, check

__all__ = ["check", "names", "reference", "task", "Exercise", "ExerciseNotPassed", "Result"]


def names() -> list[str]:
    """Every exercise, in lesson order."""
    return sorted(REGISTRY, key=lambda name: (REGISTRY[name].lesson, list(REGISTRY).index(name)))


def reference(name: str) -> Callable:
    """The reference solution of exercise ``name``."""
    return _get(name).reference


def task(name: str) -> str:
    """What exercise ``name`` asks for."""
    return _get(name).task


def _get(name: str) -> Exercise:
    if name not in REGISTRY:
        raise KeyError(f"no exercise named {name!r}; dl.exercises.names() lists them: {names()}")
    return REGISTRY[name]
