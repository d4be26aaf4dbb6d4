"""distlab: learn distributed training by running it.

    import distlab as dl
    run = dl.launch(fn, world_size=4)      # run fn on 4 ranks from a notebook cell

The public names are listed in DESIGN.md. Heavier parts (plots, widgets, the parallel strategies)
load on first use, so ``import distlab`` stays fast inside every freshly started rank.
"""
from __future__ import annotations

import importlib

from .launch import LaunchError, Run, launch   # the package distlab.launch is imported, then `launch` here
                                               # is its function (as for `train` below)
from .progress import progress
from .runtime import backend, barrier, device, local_rank, rank, tracer, world_size
from .trace import Event, Trace, Tracer
from .train import train   # eager: a lazy `train` would be shadowed by the module once anything
                           # imports distlab.train (the import system sets the attribute)

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "Report": (".strategies.runner", "Report"),       # with the strategies and torch, on first use
    "comm": (".comm", None),
    "theory": (".theory", None),
    "models": (".models", None),
    "data": (".data", None),
    "memory": (".memory", None),
    "viz": (".viz", None),
    "widgets": (".widgets", None),
    "checkpoint": (".checkpoint", None),
    "exercises": (".exercises", None),
    "tp": (".parallel.tensor", None),
    "pp": (".parallel.pipeline", None),
    "ep": (".parallel.expert", None),
    "cp": (".parallel.context", None),
    "NaiveDDP": (".parallel.data", "NaiveDDP"),
    "DDP": (".parallel.data", "DDP"),
    "PowerSGDDDP": (".parallel.data", "PowerSGDDDP"),
    "LocalSGD": (".parallel.data", "LocalSGD"),
    "DiLoCo": (".parallel.data", "DiLoCo"),
    "ZeRO": (".parallel.zero", "ZeRO"),
    "ShardedOptimizer": (".parallel.zero", "ShardedOptimizer"),
    "OffloadedOptimizer": (".parallel.zero", "OffloadedOptimizer"),
    "fully_shard": (".parallel.zero", "fully_shard"),
    "full_state_dict": (".parallel.zero", "full_state_dict"),
    "clip_grad_norm_": (".parallel.clip", "clip_grad_norm_"),
    "recompute": (".recomputation", "recompute"),     # (a module named "recompute" would shadow it)
    "Mesh": (".parallel.mesh", "Mesh"),
    "elastic": (".strategies.elastic", None),        # replicas that leave and join (`parallel.elastic`)
}

__all__ = ["launch", "Run", "LaunchError", "rank", "world_size", "local_rank", "device", "backend",
           "barrier", "tracer", "progress", "Trace", "Tracer", "Event", "train", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'distlab' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
