"""Registry of training strategies: name -> ``"module:function"`` of its ``train_rank(spec)``.

Modules load lazily, on first use (a rank imports only the strategy it runs). Mesh strategies are
named by their degrees, ``"3d:dp=2,tp=2,pp=2"``, and all share the ``"3d"`` entry. `load` returns the
``train_rank`` callable.

Reading order: `base` (the spec, the data, the result), `loop` (THE step loop every strategy runs), then
one file per family, each only building the model, the criterion and the loop's `loop.Plan`:
`data_parallel` (single, DDP, ZeRO), `fsdp` (`dl.fully_shard`), `tensor`, `pipeline`, `context` (cp-ring,
cp-ulysses), `expert` (ep), `mesh` (3D).
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
    "fsdp": "distlab.strategies.fsdp:train_rank",
    "tp": "distlab.strategies.tensor:train_rank",
    "tp-sp": "distlab.strategies.tensor:train_rank",
    "pp-gpipe": "distlab.strategies.pipeline:train_rank",
    "pp-1f1b": "distlab.strategies.pipeline:train_rank",
    "pp-interleaved": "distlab.strategies.pipeline:train_rank",
    "pp-zb-h1": "distlab.strategies.pipeline:train_rank",
    "ep": "distlab.strategies.expert:train_rank",
    "cp-ring": "distlab.strategies.context:train_rank",
    "cp-ulysses": "distlab.strategies.context:train_rank",
    "3d": "distlab.strategies.mesh:train_rank",
}


def names() -> list[str]:
    return list(REGISTRY)


def load(strategy: str):
    """The ``train_rank`` function for ``strategy`` (e.g. "zero2", "3d:dp=2,tp=2,pp=1")."""
    key = "3d" if strategy.startswith("3d:") else strategy
    if key not in REGISTRY:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {names()} "
                         "(meshes as '3d:dp=2,tp=2,pp=2')")
    module_name, func_name = REGISTRY[key].split(":")
    return getattr(importlib.import_module(module_name), func_name)


__all__ = ["REGISTRY", "names", "load", "TrainSpec", "RankResult",
           "build_model", "make_optimizer", "global_batch", "loss_fn"]
