"""Resharding: a checkpoint saved on N ranks resumed on M ranks, or by another strategy.

A ZeRO shard is a range of a padded flat bucket, meaningless without the layout that cut it. So
every ZeRO rank saves its layout beside its shards (per bucket: the parameters' names and shapes in
bucket order, and the shard size), as torch.distributed.checkpoint's metadata records each shard's
global offsets and DeepSpeed's ``zero_to_fp32.py`` reads its ``param_shapes``. `consolidate` reads
every rank's file and rebuilds the *logical* state, one tensor per parameter name:

    {"params":    {name: tensor},           the model's parameters (tied ones once)
     "buffers":   {name: tensor},
     "optimizer": {name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}},   per-parameter state
     "masters":   {name: fp32 tensor},      bf16-mixed only
     "losses":    tensor,                   the global loss of every step so far
     "data_position": tensor,               where a data loader was (epoch, offset), if it saved one
     "strategy", "world_size", "step"}

Bucket b of a run on N ranks is the parameters p_1..p_k laid end to end and padded to a multiple of
N; rank r held elements [r * ceil(S/N), (r+1) * ceil(S/N)). Concatenating the N shards in rank order
gives the padded bucket back, and cutting it at the offsets gives each parameter. `restore` does the
reverse for whatever layout the new run has (another N, other bucket sizes, another stage, or plain
DDP), so the run continues with the same parameters and optimizer state; its later steps then differ
from the uninterrupted run only by the rounding of a different reduction order.

Model-parallel checkpoints (tp, tp-sp, pp-*, 3d with DDP) work the same way: each rank saves, per
parameter it holds, its full-model name and how it was cut (`describe`: the tensor-parallel dim,
rank and degree; Megatron's layers keep equal contiguous blocks, rank r block r). `consolidate`
concatenates the blocks back, and a run with another tp/pp/dp layout, or a data-parallel one, cuts
them again. A mesh with ``zero=1`` composes both: its optimizer state is the flat ZeRO shards, over
the dp replicas, of each rank's tensor-parallel blocks; the dp shards are joined first (by bucket
layout), then the blocks.
"""
from __future__ import annotations

import torch

from . import store

# how a checkpoint's ranks saved their state (see `distlab.checkpoint.state`): one whole copy, flat
# ZeRO shards with their bucket layout, or model-parallel tensors with where they sit in the model
FORMATS = ("replicated", "flat-shards", "model-parallel")


def describe(full_model, params: list, held) -> list[dict]:
    """Per parameter of ``params`` (the optimizer's order): its name in ``full_model`` (a GPT, tensor-
    parallel or not), its key in ``held.state_dict()``, and its tensor-parallel cut (dim, rank, degree;
    dim None for a parameter every tensor-parallel rank holds whole)."""
    from ..parallel import collectives as C
    names = {id(p): n for n, p in full_model.named_parameters()}
    keys = {id(p): k for k, p in held.named_parameters()}
    cuts = {}
    for module in full_model.modules():
        dims = getattr(module, "shard_dims", {})
        for p_name, p in module.named_parameters(recurse=False):
            if p_name in dims:
                group = getattr(module, "group", None)
                cuts[id(p)] = (dims[p_name], C.group_rank(group), C.group_size(group))
    out = []
    for p in params:
        dim, tp_rank, tp_size = cuts.get(id(p), (None, 0, 1))
        out.append({"name": names[id(p)], "key": keys[id(p)], "dim": dim, "tp_rank": tp_rank,
                    "tp_size": tp_size})
    return out


def bucket_layout(bucket, names_by_id: dict[int, str]) -> dict:
    """What a rank saves to make its shards of ``bucket`` readable at another world size."""
    return {"names": [names_by_id[id(p)] for p in bucket.params],
            "shapes": [list(p.shape) for p in bucket.params], "shard_numel": bucket.shard_numel}


def consolidate(directory, step: int | str = "latest") -> dict:
    """The logical (layout-free) state of a checkpoint; reads every rank's file."""
    info = store.manifest(directory, step)
    fmt = info["meta"].get("format")
    if fmt not in FORMATS:
        raise store.CheckpointError(f"checkpoint step {info['step']} in {directory} records no known format "
                                    f"({fmt!r}; saved by {info['meta'].get('strategy')!r}), so it cannot be "
                                    f"resharded: resume it with the same strategy and world_size")
    logical = logical_state(store.load_all(directory, info["step"]), fmt)
    return {"step": info["step"], "strategy": info["meta"].get("strategy"), **logical}


def logical_state(ranks: list[dict], fmt: str) -> dict:
    """The logical state from every rank's saved state (its own merged with its replicated state),
    saved in format ``fmt`` (one of `FORMATS`)."""
    if fmt == "model-parallel":
        out = _from_model_parallel(ranks)
    elif fmt == "replicated":
        out = _from_replicated(ranks[0])
    else:
        out = _from_shards(ranks)
    losses = sum(r["losses"] * r.get("loss_weight", 1) for r in ranks)   # the ranks whose history counts
    data = {"data_position": ranks[0]["data_position"]} if "data_position" in ranks[0] else {}
    return {"world_size": len(ranks), **out, "losses": losses, **data}   # data: the same on every rank


def _from_model_parallel(ranks: list[dict]) -> dict:
    """Tensor-parallel blocks concatenated back in tp-rank order; pipeline stages simply merge; dp
    replicas hold copies (the first one read wins)."""
    if "param_layout" not in ranks[0]:
        raise store.CheckpointError("this model-parallel checkpoint records no parameter layout (saved by an "
                                    "older distlab): resume it with the same strategy and world_size")
    blocks: dict[str, dict[int, tuple]] = {}            # name -> tp rank -> (value, optimizer state, layout)
    for lay, value, opt_state in _local_parameters(ranks):
        blocks.setdefault(lay["name"], {}).setdefault(lay["tp_rank"], (value, opt_state, lay))
    params, optimizer = {}, {}
    for name, by_rank in blocks.items():
        value, first_state, lay = by_rank[0]
        dim = lay["dim"]                                  # None: every tp rank held it whole
        pieces = [by_rank[0]] if dim is None else [by_rank[k] for k in range(lay["tp_size"])]
        params[name] = _join([v for v, _, _ in pieces], dim)
        optimizer[name] = {key: (_join([st[key] for _, st, _ in pieces], dim)
                                 if torch.is_tensor(val) and val.dim() > 0 and val.shape == value.shape
                                 else val.clone() if torch.is_tensor(val) else val)   # a scalar ("step")
                           for key, val in first_state.items()}
    return {"params": params, "buffers": {}, "optimizer": optimizer, "masters": {}}


def _join(blocks: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """Tensor-parallel blocks concatenated along ``dim`` (None: one whole tensor), as a new tensor."""
    return (blocks[0] if dim is None else torch.cat(blocks, dim)).clone()


def _local_parameters(ranks: list[dict]):
    """(layout, value, optimizer state) of every parameter block each rank held. Under ZeRO-1 over dp
    (``layout`` saved), a block's optimizer state is first joined from its dp replicas' flat shards."""
    if "layout" not in ranks[0]:
        for state in ranks:
            per_param = state["optimizer"]["state"]
            for i, lay in enumerate(state["param_layout"]):
                yield lay, state["model"][lay["key"]], per_param.get(i, {})
        return
    replicas: dict[tuple, list[dict]] = {}              # dp replicas hold the same blocks, in rank order
    for state in ranks:
        signature = tuple((lay["name"], lay["tp_rank"]) for lay in state["param_layout"])
        replicas.setdefault(signature, []).append(state)
    for group in replicas.values():
        inner = [s["optimizer"]["optimizer"]["state"] for s in group]
        by_key = _optimizer_from_shards(inner, group[0]["layout"])
        for lay in group[0]["param_layout"]:
            yield lay, group[0]["model"][lay["key"]], by_key.get(lay["key"], {})


def _from_replicated(state: dict) -> dict:
    names = state["param_names"]
    model = state["model"]
    return {"params": {n: model[n] for n in names},
            "buffers": {n: t for n, t in model.items() if n not in names and n in state["buffer_names"]},
            "optimizer": {names[i]: s for i, s in state["optimizer"]["state"].items()},
            "masters": dict(zip(names, state.get("masters", [])))}


def _from_shards(ranks: list[dict]) -> dict:
    if "layout" not in ranks[0]:
        raise store.CheckpointError("this ZeRO checkpoint records no bucket layout (saved by an older "
                                    "distlab): resume it with the same world_size")
    layout = ranks[0]["layout"]
    sharded_params = "params" in ranks[0]                  # ZeRO-3: the parameters were saved as shards too
    params, masters = {}, {}
    optimizer = _optimizer_from_shards([r["optimizer"]["optimizer"]["state"] for r in ranks], layout)
    for b, lay in enumerate(layout):
        if sharded_params:
            params.update(_cut(torch.cat([r["params"][b] for r in ranks]), lay))
        if ranks[0]["masters"]:
            masters.update(_cut(torch.cat([r["masters"][b] for r in ranks]), lay))
    if not sharded_params:
        model = ranks[0]["model"]
        names = [n for lay in layout for n in lay["names"]]
        params = {n: model[n] for n in names}
        buffers = {n: t for n, t in model.items() if n in ranks[0]["buffer_names"]}
    else:
        buffers = dict(ranks[0]["buffers"])
    return {"params": params, "buffers": buffers, "optimizer": optimizer, "masters": masters}


def _optimizer_from_shards(inner: list[dict], layout: list[dict]) -> dict[str, dict]:
    """Per parameter name, the optimizer state joined from every rank's shard of each flat bucket
    (``inner``: the inner optimizer's ``state`` per rank, in rank order, keyed by bucket)."""
    optimizer: dict[str, dict] = {}
    for b, lay in enumerate(layout):
        for key, value in inner[0].get(b, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == lay["shard_numel"]:
                pieces = _cut(torch.cat([state[b][key] for state in inner]), lay)   # per element (moments)
            else:                                   # a per-bucket scalar ("step"): a copy each, since
                pieces = {n: value.clone() if torch.is_tensor(value) else value   # Adam increments it
                          for n in lay["names"]}                                  # in place
            for name, piece in pieces.items():
                optimizer.setdefault(name, {})[key] = piece
    return optimizer


def _cut(flat: torch.Tensor, lay: dict) -> dict[str, torch.Tensor]:
    """A padded flat bucket cut back into its parameters."""
    out, offset = {}, 0
    for name, shape in zip(lay["names"], lay["shapes"]):
        numel = 1
        for d in shape:
            numel *= d
        out[name] = flat[offset:offset + numel].view(shape).clone()
        offset += numel
    return out


@torch.no_grad()
def restore_model_parallel(layout: list[dict], held, opt, logical: dict) -> None:
    """Put a `consolidate`d state into a tp/pp/3d rank: each of its parameters (``layout`` from
    `describe`, keyed as in ``held``) gets its tensor-parallel block of the full tensor, and so does
    its optimizer state; under ZeRO-1 over dp (``opt`` a `ShardedOptimizer`) the blocks are then cut
    into this dp rank's flat shards."""
    missing = sorted({lay["name"] for lay in layout} - set(logical["params"]))
    if missing:
        raise store.CheckpointError(f"the checkpoint has no parameters {missing[:3]}...: it was saved for "
                                    f"another model")
    local = {"params": {}, "optimizer": {}, "masters": {}}      # this rank's blocks, by key in `held`
    for lay in layout:
        full = logical["params"][lay["name"]]
        local["params"][lay["key"]] = _block(full, lay)
        local["optimizer"][lay["key"]] = {
            key: (_block(v, lay).clone() if torch.is_tensor(v) and v.dim() > 0 and v.shape == full.shape
                  else v.clone() if torch.is_tensor(v) else v)          # per element, or a scalar ("step")
            for key, v in logical["optimizer"].get(lay["name"], {}).items()}
    keys = {id(p): k for k, p in held.named_parameters()}
    if hasattr(opt, "buckets"):
        _restore_sharded(opt, local, keys)
        return
    state = {}
    params = getattr(opt, "params", None) or opt.param_groups[0]["params"]     # offloaded: the device's
    for i, p in enumerate(params):
        p.copy_(local["params"][keys[id(p)]])
        if local["optimizer"][keys[id(p)]]:
            state[i] = local["optimizer"][keys[id(p)]]
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


@torch.no_grad()
def restore_replicated(model, opt, logical: dict) -> None:
    """Put a `consolidate`d state into a model and a whole optimizer (``opt.optimizer``, ``opt.params``,
    fp32 ``opt.masters`` when ``opt.mixed``), the same on every rank."""
    names_by_id = _check_names(model, logical)
    _restore_local(model, opt, logical, names_by_id)


@torch.no_grad()
def restore_flat_shards(model, opt, logical: dict) -> None:
    """Put a `consolidate`d state into this rank's shards of a `ShardedOptimizer`'s flat buckets."""
    names_by_id = _check_names(model, logical)
    _restore_sharded(opt, logical, names_by_id)


def _check_names(model, logical: dict) -> dict[int, str]:
    """Parameter names by id; copies the buffers; refuses a checkpoint of another model."""
    names_by_id = {id(p): n for n, p in model.named_parameters()}
    missing = set(names_by_id.values()) - set(logical["params"])
    if missing:
        raise store.CheckpointError(f"the checkpoint has no parameters {sorted(missing)[:3]}...: it was "
                                    f"saved for another model")
    for name, buf in model.named_buffers():
        if name in logical["buffers"]:                          # (non-persistent buffers are not saved)
            buf.copy_(logical["buffers"][name])
    return names_by_id


def _restore_local(model, opt, logical: dict, names_by_id: dict) -> None:
    for name, p in model.named_parameters():
        p.copy_(logical["params"][name])
    names = [names_by_id[id(p)] for p in opt.params]
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in logical["optimizer"][n].items()}
             for i, n in enumerate(names) if n in logical["optimizer"]}
    groups = opt.optimizer.state_dict()["param_groups"]
    opt.optimizer.load_state_dict({"state": state, "param_groups": groups})
    if opt.mixed:                          # (a model-parallel checkpoint has fp32 parameters, no masters)
        for m, n in zip(opt.masters, names):
            m.copy_(logical["masters"].get(n, logical["params"][n]))


def _block(t: torch.Tensor, lay: dict) -> torch.Tensor:
    """This rank's tensor-parallel block of the full tensor ``t`` (``lay`` from `describe`; explicit dim-0
    ``rows`` [lo, hi) where the cut is not ``chunk``'s, as fsdp's uneven shards)."""
    if lay.get("rows") is not None:
        return t[lay["rows"][0]:lay["rows"][1]]
    return t if lay["dim"] is None else t.chunk(lay["tp_size"], lay["dim"])[lay["tp_rank"]]


def _bucket_shard(bucket, names: list[str], per_name: dict, dtype: torch.dtype, r: int) -> torch.Tensor:
    """Rank ``r``'s shard of a flat ``bucket`` assembled from per-parameter tensors (by name)."""
    flat = torch.zeros(bucket.padded, dtype=dtype, device=bucket.full.device)
    for view, n in zip(bucket.views(flat), names):
        view.copy_(per_name[n])
    return bucket.chunk(flat, r)


def _restore_sharded(opt, logical: dict, names_by_id: dict) -> None:
    r = opt.comm.rank
    state = {}
    for b, bucket in enumerate(opt.buckets):
        names = [names_by_id[id(p)] for p in bucket.params]
        if opt.sharded_params:                                  # ZeRO-3: parameters live as shards
            opt.shards[b].copy_(_bucket_shard(bucket, names, logical["params"], opt.shards[b].dtype, r))
        else:                                                   # ZeRO-1/2: the bucket holds the parameters
            for view, n in zip(bucket.views(bucket.full), names):
                view.copy_(logical["params"][n])
        if opt.masters[b] is not opt.shards[b]:
            masters = logical["masters"] or logical["params"]
            opt.masters[b].copy_(_bucket_shard(bucket, names, masters, torch.float32, r))
        first = logical["optimizer"].get(names[0])
        if first is None:
            continue
        shape = logical["params"][names[0]].shape
        state[b] = {}
        for key, value in first.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == shape:     # per element
                per_name = {n: logical["optimizer"][n][key] for n in names}
                state[b][key] = _bucket_shard(bucket, names, per_name, value.dtype, r)
            else:                                                                       # a scalar ("step")
                state[b][key] = value.clone() if torch.is_tensor(value) else value
    groups = opt.optimizer.state_dict()["param_groups"]
    opt.optimizer.load_state_dict({"state": state, "param_groups": groups})
