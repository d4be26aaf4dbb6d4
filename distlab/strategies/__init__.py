"""Registry of training strategies: name -> ``"module:function"`` of its ``train_rank(spec)``.

Modules load lazily, on first use (a rank imports only the strategy it runs). Mesh strategies are
named by their degrees, ``"3d:dp=2,tp=2,pp=2"``, and all share the ``"3d"`` entry. `load` returns the
``train_rank`` callable.

Each family module declares, beside its ``train_rank``, what it accepts and what it refuses:
``OPTIONS`` (strategy name -> the option names it reads) and ``check(spec, world)`` (raises, saying what
to change, for a layout that cannot run on ``world`` ranks). `check` runs both in the parent, before
any rank starts: a misspelled or misplaced option is a TypeError naming the strategy's options, with a
did-you-mean; an impossible layout (heads over tp, rows per rank, stages per model) a ValueError.

Reading order: `base` (the spec, the data, the result), `loop` (THE step loop every strategy runs) and
`numerics` (its fp16 loss scaling, non-finite steps skipped on every rank, gradient-norm spikes), then
one file per family, each only building the model, the criterion and the loop's `loop.Plan`:
`data_parallel` (single, DDP, ZeRO), `fsdp` (`dl.fully_shard`), `tensor`, `pipeline`, `context` (cp-ring,
cp-ulysses), `expert` (ep), `mesh` (3D), `mesh_axes` (its cp= and ep= axes).
"""
from __future__ import annotations

import difflib
import importlib

from ..checkpoint.training import OPTIONS as CHECKPOINT_OPTIONS
from ..rules import Whole
from ..rules import check as check_values
from .loop import OPTIONS as _LOOP_OPTIONS
from .loop import RULES as LOOP_RULES
from .numerics import OPTIONS as NUMERICS_OPTIONS
from .numerics import SUPPORTED as NUMERICS_SUPPORTED
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
#: options of the training loop itself, taken by every strategy (`loop.OPTIONS`)
LOOP_OPTIONS = _LOOP_OPTIONS
#: how `names` and the CLI show the mesh entry: the form `dl.train` takes
MESH_FORM = "3d:dp=D,tp=T,pp=P"
WORLD_SIZE = Whole(1, example=4)          # what world_size takes (and what a machine holds: `train`)


def names() -> list[str]:
    """Every strategy name, the mesh in the form `dl.train` takes (``3d:dp=D,tp=T,pp=P``)."""
    return [MESH_FORM if n == "3d" else n for n in REGISTRY]


def _key(strategy: str) -> str:
    key = "3d" if strategy.startswith("3d:") else strategy
    if key not in REGISTRY:
        close = difflib.get_close_matches(strategy, list(REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown strategy {strategy!r}{hint}: choose one of {names()} "
                         "(meshes as '3d:dp=2,tp=2,pp=2')")
    return key


def _module(strategy: str):
    return importlib.import_module(REGISTRY[_key(strategy)].split(":")[0])


def options(strategy: str) -> tuple[str, ...]:
    """The options ``strategy`` reads (its family's ``OPTIONS``), then those every strategy takes (the
    checkpoint's)."""
    key = _key(strategy)
    return tuple(_module(strategy).OPTIONS[key]) + CHECKPOINT_OPTIONS + LOOP_OPTIONS


def check_options(strategy: str, given) -> None:
    """TypeError for any of ``given`` (option names) that ``strategy`` does not read: names its valid
    options, the closest one, and the strategies that do take a misplaced one."""
    valid = options(strategy)
    for key in given:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        takers = [n for n in names() if key in options(n)]
        where = f"; {key!r} is an option of {', '.join(takers)}" if takers and not close else ""
        shared = CHECKPOINT_OPTIONS + ("memory_limit", "recompute")    # numerics: own where supported
        hidden = shared + (() if strategy in NUMERICS_SUPPORTED else NUMERICS_OPTIONS)
        own = ", ".join(o for o in valid if o not in hidden) or "none of its own"
        raise TypeError(f"strategy {strategy!r} has no option {key!r}{hint}{where}. Its options: {own}; "
                        f"and, for every strategy, {', '.join(shared)}")


def rules(strategy: str) -> dict:
    """What each option of ``strategy`` takes (`distlab.rules`): its family's ``RULES`` and the loop's
    (the checkpoint's are checked by `distlab.checkpoint.training.check_options`)."""
    return {**_module(strategy).RULES, **LOOP_RULES}


def check(spec: TrainSpec, world_size: int) -> None:
    """Everything that can be refused before any rank starts: the world size, the model name, the
    options' names (`check_options`) and values (`rules`), then the family's own ``check`` (rows per
    rank, heads over the tensor-parallel degree, pipeline stages and microbatches, mesh degrees, ...)."""
    from ..models import PRESETS
    from .moe_support import refuse_moe
    from .numerics import check as check_numerics
    WORLD_SIZE.check("world_size", world_size)
    models = sorted(PRESETS) + ["mlp"]
    if spec.model not in models:
        close = difflib.get_close_matches(spec.model, models, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model {spec.model!r}{hint}: choose one of {models}")
    check_options(spec.strategy, spec.options)
    check_values(rules(spec.strategy), spec.options)
    _module(spec.strategy).check(spec, world_size)
    refuse_moe(spec)                                          # a mixture of experts: ep, single, dp only
    check_numerics(spec, world_size)                          # fp16 and its options where supported
    _check_recompute(spec, PRESETS.get(spec.model))


def _check_recompute(spec: TrainSpec, cfg) -> None:
    """``recompute``: False, True or "full", or "selective"; only for the GPT presets; not with pipelines
    (their memory count cannot see it yet; zero bubble's weight pass would recompute every block again);
    full not with a mixture of experts (a second forward would count the router's balance loss twice);
    selective not with context parallelism (its attention cores are ring attention and Ulysses)."""
    how = spec.options.get("recompute", False)               # one of them: `loop.RULES`
    if not how:
        return
    if cfg is None:
        raise ValueError(f"recompute recomputes transformer blocks, and {spec.model!r} has none: "
                         "choose a GPT preset, or train without recompute")
    from .mesh import parse                               # a mesh's degrees, as its own check reads them
    mesh = parse(spec.strategy, spec.options) if spec.strategy.startswith("3d:") else {}
    if spec.strategy.startswith("pp-") or mesh.get("pp", 1) > 1:
        raise ValueError("recompute does not run with pipeline parallelism yet: a pipeline's memory count "
                         "(its stash) sees neither what a recomputation keeps nor what it rebuilds, and "
                         "zero bubble's weight pass would recompute every block again; use dp, ZeRO, "
                         "FSDP, tp or cp (or a mesh without pp)")
    if how in (True, "full") and getattr(cfg, "experts", 0):
        raise ValueError(f"recompute=True with the mixture-of-experts {spec.model!r} would count the "
                         "router's balance loss twice: use recompute='selective' (attention only)")
    if how == "selective" and (spec.strategy.startswith("cp-") or mesh.get("cp", 1) > 1):
        raise ValueError("recompute='selective' recomputes distlab's attention core, which context "
                         "parallelism replaces with ring attention or Ulysses: use recompute=True")


def load(strategy: str):
    """The ``train_rank`` function for ``strategy`` (e.g. "zero2", "3d:dp=2,tp=2,pp=1")."""
    module_name, func_name = REGISTRY[_key(strategy)].split(":")
    return getattr(importlib.import_module(module_name), func_name)


__all__ = ["REGISTRY", "MESH_FORM", "CHECKPOINT_OPTIONS", "names", "options", "rules", "check",
           "check_options", "load", "TrainSpec", "RankResult", "build_model", "make_optimizer",
           "global_batch", "loss_fn"]
