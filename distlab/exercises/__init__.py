"""Build-it-yourself exercises, checked on real ranks against the reference.

    res = dl.exercises.check("ring_all_reduce", my_ring_all_reduce)   # prints what passed, or the first
    res.passed                                                         # difference in words, with a hint
    dl.exercises.names()                    # every exercise, in lesson order
    dl.exercises.reference("ring_all_reduce")   # the solution (read it after trying)
    dl.exercises.task("ring_all_reduce")        # what to write

Reading order: harness.py (how a check runs: ranks, cases, the first difference, hangs explained),
then the exercises by lesson: comm.py (send/recv up to the ring and all-to-all), parallel.py (the
ZeRO-1 step, gathering a padded shard, Megatron's f and g, vocabulary-parallel cross-entropy), pieces.py (the
schedule, the mesh, buckets, the router, online softmax, an atomic write: no communication).
"""
from __future__ import annotations

from typing import Callable

__all__ = ["check", "names", "reference", "task", "Exercise", "ExerciseNotPassed", "Result"]
_HARNESS = ("check", "Exercise", "ExerciseNotPassed", "Result", "REGISTRY")


def __getattr__(name: str):
    """The harness's names load on first use (with torch), so that ``distlab grade``'s parser, beside
    this package, costs the ``distlab`` command nothing."""
    if name not in _HARNESS:
        raise AttributeError(f"module 'distlab.exercises' has no attribute {name!r}")
    from distlab.exercises import harness
    _registry()
    globals()[name] = getattr(harness, name)
    return globals()[name]


def _registry() -> dict:
    """Every exercise by name: the lessons' modules register theirs as they are imported."""
    from distlab.exercises import comm, parallel, pieces  # noqa: F401
    from distlab.exercises.harness import REGISTRY
    return REGISTRY


def names() -> list[str]:
    """Every exercise, in lesson order."""
    registry = _registry()
    return sorted(registry, key=lambda name: (registry[name].lesson, list(registry).index(name)))


def reference(name: str) -> Callable:
    """The reference solution of exercise ``name``."""
    return _get(name).reference


def task(name: str) -> str:
    """What exercise ``name`` asks for."""
    return _get(name).task


def _get(name: str):
    registry = _registry()
    if name not in registry:
        raise KeyError(f"no exercise named {name!r}; dl.exercises.names() lists them: {names()}")
    return registry[name]
