"""`validate`: a whole `TrainSpec` against the world it will run on, once, in the parent, before any rank
starts (`dl.train` calls it; each field's type and range was checked when the spec was made).

    the world size         a positive integer; one rank for ``single``
    the model              a preset of `dl.models` (did-you-mean) or "mlp"
    the layout             the family's own ``check``: degrees that fill the world, heads over tp, rows
                           per replica, stages per model, microbatches per batch, ... (each family's file)
    mixture of experts     only where it trains right (`moe_support`)
    numerics               fp16 and its options where the loop is handed the gradients (`numerics.check`)
    recompute              only where the memory count and the attention core allow it
    data                   the text corpus for a GPT (`check_data`)
    offload                offload_dir only with offload="disk" (and writable)
    checkpoints            what the options say together, the directory writable (`distlab.checkpoint`)
    restarts               the world size of every attempt (`restart.plan`), each checked as above

Every refusal is a ValueError that says what to pass instead.
"""
from __future__ import annotations

import difflib

from . import restart
from ..checkpoint.directory import check_options as check_checkpoints
from ..models import config
from ..rules import WORLD_SIZE       # what world_size takes (re-exported: `strategies.WORLD_SIZE`)
from .spec import TrainSpec


def validate(spec: TrainSpec, world_size: int) -> list[int]:
    """Refuse what cannot run; return the world size of every attempt (the first, then each restart's)."""
    check_world(spec, world_size)
    in_process = spec.strategy if spec.strategy == "single" else None
    check_checkpoints(spec.checkpoint, in_process, steps=spec.steps, world=world_size)   # resume=...
    r = spec.restart
    if r.engine == "ray":
        from .on_ray import check
        check(spec)                           # what Ray Train's path cannot do, and Ray itself installed
    if not r.max_restarts and r.shrink in (False, None):
        return [world_size]
    sizes = restart.plan(spec, world_size)
    for n in sorted(set(sizes[1:])):          # every restart's layout
        check_world(spec, n)
    return sizes


def check_world(spec: TrainSpec, world: int) -> None:
    """What ``spec`` needs of ``world`` ranks: the world size, the model, the family's layout check, then
    the mixture-of-experts, numerics and recompute rules."""
    from .moe_support import refuse_moe
    from .numerics import check as check_numerics
    from .registry import family
    WORLD_SIZE.check("world_size", world)
    if spec.strategy == "single" and world != 1:
        raise ValueError("strategy 'single' is one process: pass world_size=1 (or pick ddp, zero1, ...)")
    check_model(spec.model)
    family(spec.strategy).check(spec, world)
    refuse_moe(spec)                                          # a mixture of experts: ep, single, dp only
    check_numerics(spec, world)                               # fp16 and its options where supported
    check_recompute(spec, world)
    check_data(spec)
    check_offload(spec)


def check_model(model) -> None:
    from ..models import PRESETS
    if hasattr(model, "hidden") and hasattr(model, "layers"):     # a dl.theory.ModelPreset
        config(model)
        return
    models = sorted(PRESETS) + ["mlp"]
    if model not in models:
        close = difflib.get_close_matches(model, models, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model {model!r}{hint}: choose one of {models}")


def check_data(spec: TrainSpec) -> None:
    """``data="text"``: bytes (vocab 256) for a GPT preset (its vocabulary is set to 256); not the MLP."""
    if spec.data_loading.data == "text" and spec.model == "mlp":
        raise ValueError("data='text' is byte tokens for a GPT: choose a GPT preset such as "
                         "model='gpt-tiny' (its vocabulary becomes 256), or data='synthetic' for the MLP")


def check_recompute(spec: TrainSpec, world: int) -> None:
    """``recompute``: False, True or "full", or "selective"; only for the GPT presets; not with the
    zero-bubble pipeline (its weight pass would recompute every block again);
    full not with a mixture of experts (a second forward would count the router's balance loss twice);
    selective not with context parallelism (its attention cores are ring attention and Ulysses)."""
    how, cfg = spec.memory.recompute, config(spec.model)
    if not how:
        return
    if cfg is None:
        raise ValueError(f"recompute recomputes transformer blocks, and {spec.model!r} has none: "
                         "choose a GPT preset, or train without recompute")
    degrees = spec.layout.degrees(world)
    uses = {a: getattr(spec.layout, a) is None or degrees[a] > 1 for a in ("pp", "cp")}
    if uses["pp"] and spec.layout.schedule == "zb-h1":
        raise ValueError("recompute does not run with the zero-bubble schedule: its weight pass (W) would "
                         "recompute every block a second time after the input pass (I); use "
                         "schedule='1f1b', 'gpipe' or 'interleaved' with recompute")
    if how in (True, "full") and getattr(cfg, "experts", 0):
        raise ValueError(f"recompute=True with the mixture-of-experts {spec.model!r} would count the "
                         "router's balance loss twice: use recompute='selective' (attention only)")
    if how == "selective" and uses["cp"]:
        raise ValueError("recompute='selective' recomputes distlab's attention core, which context "
                         "parallelism replaces with ring attention or Ulysses: use recompute=True")


def check_offload(spec: TrainSpec) -> None:
    """``offload``: zero1-3 and fsdp only (their keywords, `parse`); ``offload_dir`` only with "disk", a
    directory this process can create and write."""
    import os
    m = spec.memory
    if m.offload_dir is not None and m.offload != "disk":
        raise ValueError("offload_dir= is where offload='disk' keeps the optimizer state: pass "
                         "offload='disk' too (or drop offload_dir)")
    if m.offload_dir is not None:
        path = os.fspath(m.offload_dir)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"offload_dir={path!r} cannot be created: {e}") from None
        if not os.access(path, os.W_OK):
            raise ValueError(f"offload_dir={path!r} is not writable: pass a directory you can write to")
