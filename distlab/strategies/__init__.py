"""What `dl.train` runs: the typed spec, the registry of strategies, THE step loop, one file per family.

A strategy name is read into the typed spec by `parse` (`spec`: one dataclass per concern, a docstring
and a rule per field); `validate` checks it against the world size once, in the parent,
before any rank starts (`validate`); `load` gives the ``train_rank(spec)`` that every rank runs. Mesh
strategies are named by their degrees, ``"3d:dp=2,tp=2,pp=2"``, and all share the ``"3d"`` entry.
Modules load lazily, on first use (a rank imports only the strategy it runs).

Each family module declares, beside its ``train_rank``, what it refuses: ``check(spec, world)`` raises,
saying what to change, for a layout that cannot run on ``world`` ranks (heads over tp, rows per rank,
stages per model); `validate` calls it.

Reading order: `spec` (the typed spec), `parse` (names and keywords into it), `validate` (the whole spec
against the world), `runner` (the run and its `Report`), `base` (the data, the model, the result),
`compose` (THE composition of TP, EP, CP, PP and DP on a mesh, or over the world for the one-parallelism
families: every family builds its model there), `loop` (THE step loop every strategy runs) and
`numerics` (its fp16 loss scaling, non-finite steps skipped on every rank, gradient-norm spikes), then
one file per family, each only building the model (through `compose`), the criterion and the loop's
`loop.Plan`: `data_parallel` (single, DDP, ZeRO), `fsdp` (`dl.fully_shard`), `tensor`, `pipeline`,
`context` (cp-ring, cp-ulysses), `expert` (ep), `mesh` (3D), `mesh_axes` (its cp= and ep= axes). `dry`:
the same strategies at real size in a dry run (``backend="fake"``), one step on the meta device.
`elastic` (`dl.elastic.train`) and `elastic_plan`: replicas that die and rejoin while the others step
(`distlab.parallel.elastic`), with its own processes (`distlab.launch.replicas`), not `dl.train`'s.

The walk of ``dl.train(strategy=...)``, room by room: it leaves ``train.py`` once and does not come back
until the report is made::

    distlab/train.py        train: the arguments' rules, then hands the strategy down
    strategies/parse.py     the name and keywords -> `TrainSpec` (spec.py: each field's rule)
    strategies/validate.py  the spec against the world: registry.py's family ``check``, moe_support.py,
                            numerics.py, the recompute and checkpoint rules, restart.py's ``plan``
    (launch/parent.py)      train.py's ``check_machine``: the ranks this machine holds (the world size)
    strategies/runner.py    run: registry.py ``load`` -> ``train_rank``; here for single, else through
                            restart.py (attempts) to `distlab.launch` -> on every rank: the family file
                            -> compose.py -> loop.py; back in runner.py: notes (numerics.py), the `Report`
"""
from __future__ import annotations

from ..checkpoint.options import OPTIONS as CHECKPOINT_OPTIONS
from .base import RankResult, build_model, global_batch, loss_fn, make_optimizer
from .parse import MESH_FORM, names, options, parse
from .registry import REGISTRY, family, load
from .spec import DataParallel, Layout, Memory, Numerics, Restart, TrainSpec
from .validate import WORLD_SIZE, validate

__all__ = ["REGISTRY", "MESH_FORM", "CHECKPOINT_OPTIONS", "WORLD_SIZE", "names", "options", "parse",
           "validate", "load", "family", "TrainSpec", "Layout", "DataParallel", "Numerics", "Memory",
           "Restart", "RankResult", "build_model", "make_optimizer", "global_batch", "loss_fn"]
