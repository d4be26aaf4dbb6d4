"""Registry of training strategies: name -> ``"module:function"`` of its ``train_rank(spec)``.

Modules load lazily, on first use (a rank imports only the strategy it runs). Mesh strategies are
named by their degrees, ``"3d:dp=2,tp=2,pp=2"``, and all share the ``"3d"`` entry. `load` returns the
``train_rank`` callable.

Reading order: `base` (the spec, the data, the result), `loop` (THE step loop every strategy runs), then
one file per family, each only building the model, the criterion and the loop's `loop.Plan`:
`data_parallel` (single, DDP, ZeRO), `fsdp` (`dl.fully_shard`), `tensor`, `pipeline`, `context` (cp-ring,
cp-ulysses), `expert` (ep), `mesh` (3D), `mesh_axes` (its cp= and ep= axes).
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


def check(spec: TrainSpec, world_size: int) -> None:
    """What can be refused before any rank starts: a pipeline with more stages than the model has pieces
    to cut, microbatches the batch cannot supply, data-parallel options out of range."""
    from ..models import PRESETS
    from .base import microbatch_count
    from .moe_support import refuse_moe
    refuse_moe(spec)                                          # a mixture of experts: ep, single, dp only
    o = spec.options
    if spec.strategy.startswith("3d:"):
        from .mesh import parse
        degrees = parse(spec.strategy, o)
        virtual = degrees.get("virtual", 2) if degrees["schedule"] == "interleaved" else 1
        stages = degrees["pp"] * virtual
    elif spec.strategy.startswith("pp-"):
        virtual = int(o.get("virtual", 2)) if spec.strategy == "pp-interleaved" else 1
        stages = world_size * virtual
        microbatch_count(o.get("microbatches"), spec.micro_batch, world_size, spec.strategy[3:],
                         "micro-step (global_batch / grad_accum)")
    else:
        stages, virtual = 1, 1
    layers = PRESETS[spec.model].layers if spec.model in PRESETS else None
    pieces = layers + 2 if layers is not None else 3          # GPT: embeddings, blocks, head; mlp: 3 linears
    if stages > pieces:
        what = (f"the embeddings, {layers} blocks and the head" if layers is not None else "its 3 layers")
        per_rank = f" ({virtual} per rank)" if virtual > 1 else ""
        smaller = ", or a smaller virtual" if virtual > 1 else ""
        raise ValueError(f"{stages} pipeline stages{per_rank} but model {spec.model!r} has only {pieces} "
                         f"pieces to cut ({what}): use at most {pieces} stages (fewer pipeline "
                         f"ranks{smaller}), or a deeper model (e.g. model='gpt-small', "
                         f"{PRESETS['gpt-small'].layers + 2} pieces)")
    if "bucket_mb" in o and not (isinstance(o["bucket_mb"], (int, float)) and o["bucket_mb"] > 0):
        raise ValueError(f"bucket_mb must be a positive number of megabytes, got {o['bucket_mb']!r}")
    if o.get("comm", "torch") not in ("torch", "ring"):
        raise ValueError(f"comm={o['comm']!r}: choose 'torch' (torch.distributed's collectives) or 'ring'")


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
