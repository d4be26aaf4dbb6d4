"""What a training rank hands the checkpoint layer: its state, in one of three saved formats.

A strategy knows how its rank holds the model; the checkpoint layer knows files. Between them sits a
`RankState`: how to capture this rank's own state and the state its replicas share, how to put a
saved state back (same layout), and how to cut a consolidated one for this layout (resharding). The
checkpoint layer never asks which strategy it serves, only which of three formats the state has:

    format           what each rank saves                                 who builds it
    "replicated"     rank 0: model + whole optimizer; others: losses      `replicated_state`   (one copy)
    "flat-shards"    its shard of every flat bucket + the bucket layout   `flat_shard_state`   (ZeRO 1-3)
    "model-parallel" the tensors it holds + where they sit in the model   `model_parallel_state` (tp, pp, 3d)

`distlab.checkpoint.reshard` reads each format back into the logical state (one tensor per name).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from . import reshard

FORMATS = reshard.FORMATS


@dataclass
class RankState:
    """One rank's training state, as the checkpoint layer sees it.

    ``capture() -> (own, replicated)``: what this rank alone writes, and what its ``replica_group``
    holds in equal copies (written once, by the group's first rank; None: nothing replicated).
    ``restore(state)``: put back a state saved by the same layout (`store.load` merges both parts).
    ``reshard(logical)``: put back a consolidated state saved by another layout (None: cannot).
    ``layout``: facts that decide what this rank holds (a resume with other facts reshards).
    ``loss_weight``: 1 if this rank's loss history counts (once) toward the global one, else 0.
    ``keeps_history``: whether this rank carries the global history after a resharded resume.
    """

    capture: Callable[[], tuple[dict, dict | None]]
    restore: Callable[[dict], None]
    format: str
    reshard: Callable[[dict], None] | None = None
    replica_group: object = None
    layout: dict = field(default_factory=dict)
    loss_weight: int = 1
    keeps_history: bool = True


# -- "replicated": one model, one whole optimizer, identical on every rank --------------------------
def replicated_state(model, opt, keeps_history: bool) -> RankState:
    """``opt``: a plain optimizer holder with ``.optimizer`` (torch's), ``.params`` (in the optimizer's
    order) and, under bf16-mixed, fp32 ``.masters`` (``.mixed``)."""
    names_by_id = {id(p): n for n, p in model.named_parameters()}

    def capture():
        replicated = {"model": model.state_dict(), "optimizer": opt.optimizer.state_dict(),
                      "param_names": [names_by_id[id(p)] for p in opt.params],
                      "buffer_names": [n for n, _ in model.named_buffers()]}
        if opt.mixed:
            replicated["masters"] = list(opt.masters)
        return {}, replicated

    @torch.no_grad()
    def restore(state):
        model.load_state_dict(state["model"])
        opt.optimizer.load_state_dict(state["optimizer"])
        for m, saved in zip(opt.masters if opt.mixed else [], state.get("masters", [])):
            m.copy_(saved)

    def reshard_into(logical):
        reshard.restore_replicated(model, opt, logical)

    return RankState(capture, restore, "replicated", reshard_into, keeps_history=keeps_history)


def with_part(state: RankState, name: str, capture: Callable[[], tuple], load: Callable,
              layout: dict | None = None) -> RankState:
    """``state`` carrying one more part, e.g. a gradient compressor's: ``capture() -> (replicated, own)``
    (what the replicas share, written once; what this rank alone holds), ``load(replicated, own)`` on a
    resume by the same layout (``layout``: the facts the part's shape depends on, added to the state's,
    so that other facts reshard instead). Saved under ``name`` (replicated) and ``name + "_own"``; a
    checkpoint without them (saved by another strategy or before the part existed) leaves the part as
    it is, and a resharded resume, which has no per-rank parts to cut, does too."""
    base_capture, base_restore = state.capture, state.restore

    def capture_with():
        own, replicated = base_capture()
        shared, mine = capture()
        return {**own, name + "_own": mine}, {**(replicated or {}), name: shared}

    def restore_with(saved):
        base_restore(saved)
        if name in saved and name + "_own" in saved:
            load(saved[name], saved[name + "_own"])

    facts = {**state.layout, **(layout or {})}
    return replace(state, capture=capture_with, restore=restore_with, layout=facts)


# -- "flat-shards": ZeRO's flat buckets, each rank one shard ----------------------------------------
def flat_shard_state(model, opt, keeps_history: bool) -> RankState:
    """``opt``: a `ShardedOptimizer` (``.buckets``, ``.shards``, ``.masters``, ``.sharded_params``: True
    when the parameters themselves live only as shards at rest, ZeRO-3)."""
    names_by_id = {id(p): n for n, p in model.named_parameters()}

    def capture():
        own = {"optimizer": opt.state_dict(),                              # this rank's shard of it
               "masters": [m for m, s in zip(opt.masters, opt.shards) if m is not s],   # bf16: fp32 masters
               "layout": [reshard.bucket_layout(b, names_by_id) for b in opt.buckets]}  # what cut the shards
        if opt.sharded_params:
            own["params"] = list(opt.shards)
            return own, {"buffers": dict(model.named_buffers())}
        return own, {"model": model.state_dict(), "buffer_names": [n for n, _ in model.named_buffers()]}

    @torch.no_grad()
    def restore(state):
        if opt.sharded_params:
            for s, saved in zip(opt.shards, state["params"]):
                s.copy_(saved)
            for name, buf in model.named_buffers():
                buf.copy_(state["buffers"][name])
        else:
            model.load_state_dict(state["model"])   # params are views of the flat buckets: shards follow
        for m, saved in zip([m for m, s in zip(opt.masters, opt.shards) if m is not s], state["masters"]):
            m.copy_(saved)
        opt.load_state_dict(state["optimizer"])

    def reshard_into(logical):
        reshard.restore_flat_shards(model, opt, logical)

    return RankState(capture, restore, "flat-shards", reshard_into, keeps_history=keeps_history)


# -- "model-parallel": each rank the tensors it holds, and where they sit ---------------------------
def model_parallel_state(full_model, params: list, held, opt, *, loss_weight: bool, keeps_history: bool,
                         replica_group=None, layout: dict | None = None, described=None) -> RankState:
    """A tp / pp / 3d rank: ``params`` (the optimizer's, in its order) belong to ``held`` (this rank's
    stage(s) or tensor-parallel model) and are named as in ``full_model``. ``replica_group``: the ranks
    holding equal copies of ``held`` (3d's dp group; None: every rank holds different tensors). Under
    ZeRO-1 over those replicas (``opt`` has ``.buckets``) each replica saves its own optimizer shard.
    ``described``: the layout `reshard.describe` would give, from a strategy that cuts otherwise (fsdp:
    dim-0 ``rows``)."""
    described = described if described is not None else reshard.describe(full_model, params, held)
    sharded_opt = hasattr(opt, "buckets")

    def capture():
        own = {"param_layout": described}
        if replica_group is None:
            return {**own, "model": held.state_dict(), "optimizer": opt.state_dict()}, None
        if not sharded_opt:
            return own, {"model": held.state_dict(), "optimizer": opt.state_dict()}
        keys = {id(p): k for k, p in held.named_parameters()}
        own.update(optimizer=opt.state_dict(), layout=[reshard.bucket_layout(b, keys) for b in opt.buckets])
        return own, {"model": held.state_dict()}

    @torch.no_grad()
    def restore(state):
        held.load_state_dict(state["model"])              # copies into the parameters in place
        opt.load_state_dict(state["optimizer"])

    def reshard_into(logical):
        reshard.restore_model_parallel(described, held, opt, logical)

    return RankState(capture, restore, "model-parallel", reshard_into,
                     replica_group=replica_group, layout=dict(layout or {}), loss_weight=int(loss_weight),
                     keeps_history=bool(keeps_history))
