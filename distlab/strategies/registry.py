"""The registry of strategies: name -> ``"module:function"`` of its ``train_rank(spec)``.

Modules load lazily, on first use (a rank imports only the strategy it runs); every mesh,
``"3d:dp=2,tp=2,pp=2"``, shares the ``"3d"`` entry. What each name means as a layout: `parse.NAMED`.
"""
from __future__ import annotations

import importlib

from .parse import NAMED, key

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
    "local-sgd": "distlab.strategies.local_sgd:train_rank",
    "diloco": "distlab.strategies.local_sgd:train_rank",
    "3d": "distlab.strategies.mesh:train_rank",
}
assert set(REGISTRY) == set(NAMED), "every strategy name has a preset (parse.NAMED) and a train_rank"


def family(strategy: str):
    """The module of ``strategy``'s family (its ``check`` and ``train_rank``)."""
    return importlib.import_module(REGISTRY[key(strategy)].split(":")[0])


def load(strategy: str):
    """The ``train_rank`` function for ``strategy`` (e.g. "zero2", "3d:dp=2,tp=1,pp=1")."""
    return getattr(family(strategy), REGISTRY[key(strategy)].split(":")[1])
