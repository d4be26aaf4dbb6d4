"""Where each parameter of a wrapped model lives: this rank's pieces of the model's own tensors.

Every parallelism keeps a parameter somewhere else. A checkpoint that any other layout, at any world
size, can read back must therefore name each piece in terms that belong to no layout: the *logical*
tensor (its name in the user's model's own ``state_dict()``, its full shape) and how this rank's piece
is cut out of it (torch.distributed.checkpoint's metadata records a shard's offsets and lengths in
the same spirit; Megatron's and DeepSpeed's universal checkpoints convert to such pieces too):

    cut     this rank holds                                 who cuts it so
    whole   the whole tensor                                a plain module, DDP, ZeRO-1/2 parameters, a
                                                            pipeline stage's own, what tp leaves whole
    rows    rows [start, stop) of dim 0                     dl.fully_shard (uneven: the last ranks hold
                                                            fewer rows, maybe none; HSDP: per shard group)
    flat    elements [start, stop) of the flattened tensor  ZeRO's flat buckets (parameters at stage 3,
                                                            the optimizer state at every stage)
    block   block `index` of `parts` along `dim`            dl.tp's layers (``shard_dims``); ``packed=k``:
                                                            the tensor is k blocks (q|k|v), each cut so
    block, then rows                                        fully_shard over tp blocks (torchtitan's order)

(`cuts.Cut`: the arithmetic of each, drawn on one example.)

`describe(model)` reads how this rank holds each parameter of ``model`` (`cuts.held`, the records
`dl.clip_grad_norm_` reads too; ZeRO-3's flat shards from its optimizer; nothing is registered) and
returns a `Layout`: every logical tensor's name and shape, and this rank's `Piece`\\ s, each a view of
what the rank holds (read it to save, copy into it to load). `optimizer_pieces` does the same for an
optimizer's state (``exp_avg`` cut like its parameter; a scalar such as ``step`` whole) and
`load_optimizer` puts such state back, asking a *source* for each piece its layout needs. Pieces that
several ranks hold (DDP replicas, HSDP replica groups) carry the same cut: whoever writes files can
keep the first copy of each. The files themselves are `distlab.checkpoint`'s business.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .cuts import Cut, held

MASTER = "master"       # the optimizer-state key of ZeRO's fp32 master copy of low-precision parameters


@dataclass
class Piece:
    """This rank's piece of the logical tensor ``name`` (full ``shape``), cut by ``cut``: ``tensor``."""

    name: str
    shape: tuple[int, ...]
    cut: Cut
    tensor: torch.Tensor


@dataclass
class Layout:
    """What `describe` finds: ``tensors`` {name: (full shape, dtype)} of the model's parameters and
    persistent buffers, in ``state_dict()`` order (tied parameters under their first name);
    ``aliases`` {other name of a tied parameter: its first name}; ``pieces`` this rank holds;
    ``by_param`` {id of a parameter an optimizer may hold: its piece}; ``names`` {id of a parameter: its
    name}; ``order``: every name ``state_dict()`` has (tied ones too), in its order; ``partial``: the
    model is one part of a larger one (a pipeline stage), so other ranks hold the names missing here;
    ``sharded_optimizer``: ZeRO's optimizer, where the model wrapper owns one."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    pieces: list[Piece] = field(default_factory=list)
    by_param: dict[int, Piece] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    partial: bool = False
    sharded_optimizer: object = None


# -- the model ------------------------------------------------------------------------------------
def unwrap(model: nn.Module) -> tuple[nn.Module, object]:
    """(the user's module inside DDP / ZeRO wrappers, ZeRO's `ShardedOptimizer` or None)."""
    from torch.nn.parallel import DistributedDataParallel
    from .data.ddp import DDP, NaiveDDP
    from .zero.zero1 import ZeROModule
    owner = None
    while isinstance(model, (DDP, NaiveDDP, ZeROModule, DistributedDataParallel)):
        if isinstance(model, ZeROModule):
            owner = model.optimizer
        model = model.module
    return model, owner


def describe(model) -> Layout:
    """This rank's pieces of ``model`` (a plain module, or one under DDP, ZeRO 1-3, fully_shard, a
    tensor-parallel plan, a pipeline stage, or a mix of them), with every logical tensor's name. Several
    stages on one rank (an interleaved pipeline): their list, or the ``dl.pp.Pipeline`` holding them."""
    from .pipeline.named import NamedStage
    stages = model.modules if isinstance(getattr(model, "modules", None), dict) else None   # a Pipeline
    if isinstance(model, (list, tuple)) or stages is not None:
        return _merge([describe(m) for m in (stages.values() if stages is not None else model)])
    if not isinstance(model, nn.Module):
        raise TypeError(f"model= takes an nn.Module, got {type(model).__name__}: for a pipeline, the stage "
                        "module this rank gave dl.pp.Pipeline (dl.pp.named_stage(model, names)), a list of "
                        "them, or the Pipeline")
    inner, owner = unwrap(model)
    flat = _flat_params(owner) if owner is not None and owner.sharded_params else {}
    where = held([inner])
    out = Layout(partial=isinstance(inner, NamedStage), sharded_optimizer=owner)
    first: dict[int, str] = {}
    for name, p in inner.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.aliases[name] = first[id(p)]
            continue
        first[id(p)] = out.names[id(p)] = name
        if id(p) in flat:
            out.tensors[name] = (tuple(p.shape), p.dtype)
            out.pieces += [Piece(name, tuple(p.shape), cut, t) for cut, t in flat[id(p)]]
            continue
        cut, shape = where[id(p)].cut, where[id(p)].shape
        out.tensors[name] = (shape, p.dtype)
        out.by_param[id(p)] = Piece(name, shape, cut, p.detach())
        out.pieces.append(out.by_param[id(p)])
    for name, b in _persistent_buffers(inner):
        out.tensors[name] = (tuple(b.shape), b.dtype)
        out.pieces.append(Piece(name, tuple(b.shape), Cut(), b))
    out.order = [k for k in inner.state_dict(keep_vars=True) if k in out.tensors or k in out.aliases]
    out.tensors = {k: out.tensors[k] for k in out.order if k in out.tensors} | out.tensors
    return out


def _merge(layouts: list[Layout]) -> Layout:
    """One rank's stages as one layout: a part of a larger model."""
    out = Layout(partial=True)
    for lay in layouts:
        out.tensors.update(lay.tensors), out.aliases.update(lay.aliases), out.by_param.update(lay.by_param)
        out.names.update(lay.names)
        out.pieces += lay.pieces
        out.order += lay.order
        out.sharded_optimizer = out.sharded_optimizer or lay.sharded_optimizer
    return out


def _persistent_buffers(module: nn.Module):
    """(name, buffer) of the buffers ``state_dict()`` saves (non-persistent ones, e.g. rotary tables, not)."""
    for mname, m in module.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                yield (f"{mname}.{bname}" if mname else bname), b


def _flat_params(opt) -> dict[int, list[tuple[Cut, torch.Tensor]]]:
    """ZeRO-3: {id(parameter): [(flat cut, its elements in this rank's shard)]}; the parameters live
    only as shards of the padded flat buckets (`data.buckets.FlatBucket.owner_slices`)."""
    out: dict[int, list] = {}
    for bucket, shard in zip(opt.buckets, opt.shards):
        for i, elems, piece in bucket.owner_slices(opt.comm.rank):
            out.setdefault(id(bucket.params[i]), []).append(
                (Cut("flat", elems.start, elems.stop), shard[piece]))
    for p in opt.params:
        out.setdefault(id(p), [])                     # a parameter this rank owns nothing of
    return out


# -- the optimizer --------------------------------------------------------------------------------
def optimizer_class(optimizer) -> str:
    """The torch optimizer's class name (ZeRO's: the one it wraps)."""
    return type(getattr(optimizer, "optimizer", optimizer)).__name__


def group_settings(layout: Layout, optimizer) -> dict[str, dict]:
    """{parameter name: the settings of its param group} (lr, betas, weight_decay...: plain values only),
    what a learning-rate schedule changes; restored with the state, as torch's ``load_state_dict`` does."""
    out = {}
    for group, names in _groups(layout, optimizer):
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"
                 and (isinstance(v, (bool, int, float, str, type(None)))
                      or isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v))}
        out.update(dict.fromkeys(names, plain))
    return out


def set_group_settings(layout: Layout, optimizer, saved) -> None:
    """Each param group takes the saved settings (``saved(name)``: a dict or None) of its first parameter
    that has some; a setting this optimizer's groups do not have is left out."""
    for group, names in _groups(layout, optimizer):
        found = next((s for n in names if (s := saved(n))), {})
        for k, v in found.items():
            if k in group and k != "params":
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _groups(layout: Layout, optimizer) -> list[tuple[dict, list[str]]]:
    """(param group, the names of the parameters it updates) of a torch or a ZeRO optimizer."""
    if not hasattr(optimizer, "buckets"):
        return [(g, [_piece_of(layout, p).name for p in g["params"]]) for g in optimizer.param_groups]
    names = _names(layout, optimizer)
    bucket_of = {id(m): b for b, m in enumerate(optimizer.masters)}
    return [(g, [names[id(p)] for m in g["params"] for p in optimizer.buckets[bucket_of[id(m)]].params])
            for g in optimizer.optimizer.param_groups]


def optimizer_pieces(layout: Layout, optimizer) -> list[tuple[str, str, Piece | object]]:
    """(parameter name, state key, piece or a plain scalar) for this rank's optimizer state: per-element
    state (``exp_avg``...) cut like the parameter, scalar state (``step``) whole."""
    if hasattr(optimizer, "buckets"):
        return _sharded_state(layout, optimizer)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            piece = _piece_of(layout, p)
            for key, v in optimizer.state.get(p, {}).items():
                out.append((piece.name, key, _state_piece(piece, v, p.shape)))
    return out


def _piece_of(layout: Layout, p) -> Piece:
    piece = layout.by_param.get(id(p))
    if piece is None:
        raise ValueError("the optimizer holds a tensor that is no parameter of the model given: pass the "
                         "model whose .parameters() (or fully_shard shards) the optimizer was built on")
    return piece


def _state_piece(piece: Piece, v, local_shape) -> Piece | object:
    """A per-element state tensor as a piece cut like its parameter; a scalar whole (0-dim) or as is."""
    if torch.is_tensor(v) and v.dim() > 0 and v.shape == local_shape:
        return Piece(piece.name, piece.shape, piece.cut, v)
    if torch.is_tensor(v):
        return Piece(piece.name, tuple(v.shape), Cut(), v)
    return v


def _sharded_state(layout: Layout, opt) -> list[tuple[str, str, Piece | object]]:
    """ZeRO: the inner optimizer's state of each flat bucket shard, cut back per parameter."""
    names = _names(layout, opt)
    out = []
    for b, bucket in enumerate(opt.buckets):
        state = dict(opt.optimizer.state.get(opt.masters[b], {}))
        if opt.masters[b] is not opt.shards[b]:            # low-precision shards: their fp32 masters too
            state[MASTER] = opt.masters[b]
        for i, elems, piece in bucket.owner_slices(opt.comm.rank):
            name, shape = names[id(bucket.params[i])], tuple(bucket.params[i].shape)
            for key, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() == bucket.shard_numel:
                    cut = Cut("flat", elems.start, elems.stop)
                    out.append((name, key, Piece(name, shape, cut, v[piece])))
                else:
                    out.append((name, key, _state_piece(Piece(name, shape, Cut(), v), v, ())))
    return out


def _names(layout: Layout, opt) -> dict[int, str]:
    """{id(parameter): logical name} for a ZeRO optimizer's bucket parameters."""
    found = {id(p): layout.names[id(p)] for p in opt.params if id(p) in layout.names}
    if len(found) < len(opt.params):
        raise ValueError("the ZeRO optimizer holds parameters that are not the model's: pass the model it "
                         "was built on (for dl.ZeRO: optimizer=model.optimizer)")
    cut = [layout.by_param[id(p)].name for p in opt.params
           if id(p) in layout.by_param and layout.by_param[id(p)].cut.kind != "whole"]
    if cut:
        raise ValueError(f"the ZeRO optimizer holds {cut[:2]}, parameters already cut (tensor parallel or "
                         "fully_shard): flat shards of a cut, which placement does not describe yet; use a "
                         "plain torch optimizer on them")
    return found


@torch.no_grad()
def load_optimizer(layout: Layout, optimizer, source) -> None:
    """Put saved optimizer state into ``optimizer`` (any layout): ``source.keys(name)`` lists a
    parameter's saved state keys, ``source.get(name, key, cut)`` returns its piece for ``cut`` (a
    scalar as saved). Through ``load_state_dict``, so state the optimizer has not created yet is made."""
    if hasattr(optimizer, "buckets"):
        _load_sharded(layout, optimizer, source)
        return
    state, index = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            piece = _piece_of(layout, p)
            state[index] = {key: source.get(piece.name, key, piece.cut) for key in source.keys(piece.name)
                            if key != MASTER}
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def _load_sharded(layout: Layout, opt, source) -> None:
    """ZeRO: each bucket's shard of every per-element state assembled from its parameters' flat pieces;
    fp32 masters of low-precision shards from the saved ones (else from the shards)."""
    names = _names(layout, opt)
    state = {}
    for b, bucket in enumerate(opt.buckets):
        keys = source.keys(names[id(bucket.params[0])])
        if opt.masters[b] is not opt.shards[b]:
            opt.masters[b].copy_(_bucket_shard(opt, b, names, source, MASTER) if MASTER in keys
                                 else opt.shards[b])
        state[b] = {key: _bucket_shard(opt, b, names, source, key) for key in keys if key != MASTER}
    inner = opt.optimizer
    inner.load_state_dict({"state": state, "param_groups": inner.state_dict()["param_groups"]})


def _bucket_shard(opt, b: int, names: dict, source, key: str):
    """This rank's shard of bucket ``b`` for state ``key``, from its parameters' saved flat pieces
    (padding zero); a scalar state (Adam's step) as saved, the same for every parameter."""
    bucket = opt.buckets[b]
    owned = bucket.owner_slices(opt.comm.rank) or [(0, slice(0, 0), slice(0, 0))]   # (none: read dtype)
    flat = None
    for i, elems, piece in owned:
        value = source.get(names[id(bucket.params[i])], key, Cut("flat", elems.start, elems.stop))
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        if flat is None:
            flat = torch.zeros(bucket.shard_numel, dtype=value.dtype, device=opt.masters[b].device)
        flat[piece] = value.reshape(-1)
    return flat


@torch.no_grad()
def refresh_masters(layout: Layout) -> None:
    """After loading the parameters of a ZeRO model with low-precision shards: fp32 masters from them."""
    opt = layout.sharded_optimizer
    for m, s in zip(opt.masters if opt is not None else [], opt.shards if opt is not None else []):
        if m is not s:
            m.copy_(s)
