"""The functions ``dl.checkpoint`` offers, for three kinds of checkpoint, each pointing to the next step:

    kind                    written by                              read back by
    a model's pieces        save(d, step, model=m, optimizer=opt)   load(d, model=..., optimizer=...): any
                                                                    world size and layout; consolidate(d):
                                                                    the model's own state_dict(); export
    a training run's state  dl.train(..., checkpoint_dir=d)         dl.train(..., resume=True); consolidate(d)
    your own state dicts    save(d, step, state)                    load(d) on as many ranks; load_all(d)

`export` writes a consolidated model as one safetensors file (the format of Hugging Face's
``model.safetensors``: a JSON header of names, dtypes, shapes and offsets, then the raw bytes; no code
runs on reading it), so ``from_pretrained`` of a folder holding it and the model's ``config.json`` loads it.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import pieces, reshard, store
from .files import CheckpointError


def save(directory, step: int, state: dict | None = None, *, model=None, optimizer=None, **options) -> Path:
    """Save checkpoint ``step`` on every rank (a collective); returns the ``step_N`` path.

    ``model=`` (and ``optimizer=``): a model under any distlab layout (DDP, ZeRO, fully_shard, tensor or
    pipeline parallel, plain; several stages on one rank: their list), saved with where each piece
    sits, so `load` can put it into any other layout at any world size (`pieces`); ``keep_last``
    applies. ``state``: a dict of your own per rank (`store.save`: ``replicated``, ``group``,
    ``keep_last``, ``meta``... apply)."""
    if model is None and optimizer is not None:
        raise ValueError("optimizer= needs model= too (the optimizer's state is saved per parameter of it)")
    if model is not None:
        if state is not None:
            raise ValueError("pass either state (a dict of your own) or model=/optimizer=, not both")
        unknown = set(options) - {"keep_last"}
        if unknown:
            raise TypeError(f"save(model=...) takes keep_last= only, not {sorted(unknown)}")
        return pieces.save(directory, step, model, optimizer, **options)
    if state is None:
        raise TypeError("save(directory, step, state) or save(directory, step, model=model, optimizer=opt)")
    return store.save(directory, step, state, **options)


def load(directory, step: int | str = "latest", *, model=None, optimizer=None, strict: bool = True,
         map_location="cpu", verify: bool = True):
    """``model=`` (and ``optimizer=``): put a checkpoint saved with ``save(..., model=)`` into them, in their
    own layout, at this world size (any); returns the checkpoint's step. Without: this rank's own
    state of a ``save(d, step, state)`` checkpoint (`store.load`). Call on every rank either way."""
    info = store.manifest(directory, step)
    fmt = info["meta"].get("format")
    if model is None:
        if optimizer is not None:
            raise ValueError("optimizer= needs model= too: load(directory, model=model, optimizer=opt)")
        if fmt == pieces.FORMAT:
            raise CheckpointError(f"checkpoint step {info['step']} in {directory} holds a model's pieces: "
                                  f"load it with dl.checkpoint.load(directory, model=model, optimizer=opt) "
                                  f"(any world size), or take dl.checkpoint.consolidate(directory), its "
                                  f"state_dict")
        return store.load(directory, info["step"], map_location=map_location, verify=verify)
    if fmt in reshard.FORMATS:
        raise CheckpointError(_from_training(directory, info))
    if fmt != pieces.FORMAT:
        raise CheckpointError(f"checkpoint step {info['step']} in {directory} was saved with "
                              f"dl.checkpoint.save(directory, step, state), a state dict of your own, so it "
                              f"records no model layout: read it with dl.checkpoint.load(directory) (on "
                              f"{info['world_size']} ranks) and restore it yourself; save with "
                              f"dl.checkpoint.save(directory, step, model=model, optimizer=opt) to load it "
                              f"into any layout")
    pieces.load(directory, info, model, optimizer, strict=strict, verify=verify)
    return info["step"]


def _from_training(directory, info: dict) -> str:
    meta = info["meta"]
    return (f"checkpoint step {info['step']} in {directory} was written by dl.train (strategy "
            f"{meta.get('strategy')!r}, model {meta.get('spec', {}).get('model')!r}), not by "
            f"dl.checkpoint.save(model=...): continue that run with dl.train(..., "
            f"checkpoint_dir={str(directory)!r}, resume=True) (any strategy or world size), or take its "
            f"weights into your model with full = dl.checkpoint.consolidate(directory); "
            f"model.load_state_dict({{**full['params'], **full['buffers']}})")


def consolidate(directory, step: int | str = "latest", *, optimizer: bool = False) -> dict:
    """One tensor per name, in one process. For ``save(model=)``: the model's own ``state_dict()`` (names
    and full shapes; tied names share a tensor), so ``model.load_state_dict(consolidate(d))`` works; with
    ``optimizer=True``: ``{"model": that, "optimizer": {name: {key: tensor}}, "settings": {name: its param
    group's lr, betas...}, "optimizer_class", "step"}``.
    For ``dl.train``'s checkpoints: its logical state (`reshard.consolidate`)."""
    info = store.manifest(directory, step)
    fmt = info["meta"].get("format")
    if fmt == pieces.FORMAT:
        return _model_state(directory, info, optimizer)
    if fmt in reshard.FORMATS:
        return reshard.consolidate(directory, info["step"])
    raise CheckpointError(f"checkpoint step {info['step']} in {directory} was saved with dl.checkpoint.save("
                          f"directory, step, state), a state dict of your own, so there is nothing to "
                          f"consolidate by: read every rank's state in one process with "
                          f"dl.checkpoint.load_all(directory) (or load(directory) on {info['world_size']} "
                          f"ranks); a checkpoint saved with save(directory, step, model=model, "
                          f"optimizer=opt) consolidates and loads into any layout")


def _model_state(directory, info: dict, optimizer: bool) -> dict:
    source = pieces.Source(directory, info)
    meta = info["meta"]
    model = {name: source.tensor(name) for name in meta["names"]}       # a tied name: the same tensor
    if not optimizer:
        return model
    if meta["optimizer"] is None:
        raise CheckpointError(f"checkpoint step {info['step']} in {directory} holds no optimizer state "
                              f"(saved with model= only): consolidate(directory) gives its model")
    from ..parallel.cuts import Cut
    state = {name: {key: source.get(name, key, Cut()) for key in meta["state"][name]}
             for name in meta["names"] if name in meta["state"]}          # (the manifest's dicts are sorted)
    return {"model": model, "optimizer": state, "optimizer_class": meta["optimizer"], "step": info["step"],
            "settings": {name: meta["groups"][name] for name in state if name in meta["groups"]}}


def export(directory, path, step: int | str = "latest") -> Path:
    """Write the consolidated model of checkpoint ``step`` to the safetensors file ``path`` (a folder:
    ``path/model.safetensors``); returns the file. A tied parameter is written once, under its first
    name, as ``save_pretrained`` does (``from_pretrained`` ties it again). Written atomically."""
    from safetensors.torch import save_file
    full = consolidate(directory, step)
    if "params" in full and "optimizer" in full:            # dl.train's logical state
        full = {**full["params"], **full["buffers"]}
    else:
        aliases = store.manifest(directory, step)["meta"]["aliases"]
        full = {k: v for k, v in full.items() if k not in aliases}
    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in full.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path
