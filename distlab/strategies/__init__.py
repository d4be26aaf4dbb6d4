"""Registry of training strategies: name -> ``"module:function"`` of its ``train_rank(spec)``.

Modules load lazily, on first use, so a strategy that is not written yet only fails when asked for,
with a message saying so. `load` returns the ``train_rank`` callable.
"""
from __future__ import annotations

import importlib

from .base import RankResult, TrainSpec, build_model, global_batch, loss_fn, make_optimizer

REGISTRY: dict[str, str] = {
    "single": "distlab.strategies.data_parallel:train_rank",
    "ddp": "distlab.strategies.data_parallel:train_rank",
    "zero1": "distlab.strategies.data_parallel:train_rank",
    "zero2": "distlab.strategies.data_parallel:train_rank",
    "zero3": "distlab.strategies.data_parallel:train_rank",
    "tp": "distlab.strategies.tensor:train_rank",
    "tp-sp": "distlab.strategies.tensor:train_rank",
    "pp-gpipe": "distlab.strategies.pipeline:train_rank",
    "pp-1f1b": "distlab.strategies.pipeline:train_rank",
    "pp-interleaved": "distlab.strategies.pipeline:train_rank",
    "pp-zb-h1": "distlab.strategies.pipeline:train_rank",
}


class StrategyNotImplemented(NotImplementedError):
    """The strategy is registered but its module is not written (or not importable) yet."""


def names() -> list[str]:
    return list(REGISTRY)


def load(strategy: str):
    """The ``train_rank`` function for ``strategy`` (e.g. "zero2")."""
    if strategy.startswith("3d:"):
        target = REGISTRY.get("3d", "distlab.strategies.mesh:train_rank")
    elif strategy in REGISTRY:
        target = REGISTRY[strategy]
    else:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {names()}")
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise StrategyNotImplemented(
                f"strategy {strategy!r} is not implemented yet ({module_name} does not exist)") from None
        raise
    try:
        return getattr(module, func_name)
    except AttributeError:
        raise StrategyNotImplemented(f"strategy {strategy!r}: {module_name} has no {func_name}() yet") from None


__all__ = ["REGISTRY", "StrategyNotImplemented", "names", "load", "TrainSpec", "RankResult",
           "build_model", "make_optimizer", "global_batch", "loss_fn"]
