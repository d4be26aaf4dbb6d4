"""`dl.clip_grad_norm_(model_or_params, max_norm, norm_type)`: the whole model's gradient norm under every
wrapper and layout, equal to ``torch.nn.utils.clip_grad_norm_`` on one process over the same global batch
(the returned norm, and every clipped gradient, each rank checking the pieces it holds).

Wrappers: DDP, ZeRO 1-3 (the model or its parameters: the gradients are the optimizer's shards; ZeRO-1 on
its own beside DDP), fully_shard (the model or its parameters: the shards carry their layout; a norm kept
whole by replicate=), HSDP, tensor parallelism by a plan, pipeline stages, and DDP over a tensor-parallel
model (a 2 x 2 mesh); p = 2 and p = inf. torch's own clipper on the shards (fully_shard, tp) computes this
rank's norm: a regression to it is caught here.
"""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_user_models import LM_PLAN, TinyLM, _data

import distlab as dl
from distlab.parallel.zero import fsdp

NORMS = (2.0, math.inf)


def _reference(norm_type: float, kind: str = "lm") -> tuple[float, float, dict]:
    """One process, the whole batch: (torch's norm, the max_norm used: half of it, {name: clipped grad})."""
    model = _model(kind)
    x, y = _data("lm", 0) if kind == "lm" else _gpt_data(kind)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward() if kind != "gpt-moe-tiny" \
        else model.loss(x, y).backward()                 # cross-entropy + the balance loss
    grads = [p.grad for p in model.parameters()]
    max_norm = torch.nn.utils.get_total_norm(grads, norm_type).item() / 2       # clipping changes the grads
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm.item(), max_norm, {n: p.grad for n, p in model.named_parameters()}


def _model(kind: str = "lm"):
    if kind != "lm":
        return dl.models.build(kind, seed=0)            # distlab's GPT, dense or mixture-of-experts
    torch.manual_seed(0)
    return TinyLM(layers=2, tied=False)


def _gpt_data(kind: str):
    return dl.models.dataset_for(kind).batch(step=0, size=8)


def _backward(model, rows: slice | None = None) -> None:
    """This rank's share of the mean loss over ``rows`` of the batch (data parallel: equal rows per rank)."""
    x, y = _data("lm", 0)
    x, y = (x, y) if rows is None else (x[rows], y[rows])
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()


def _rows(n: int, r: int) -> slice:
    k = 8 // n                                  # B = 8
    return slice(r * k, (r + 1) * k)


# -- each layout: build, backward, clip; returns (norm, torch's local norm before, {name: (mine, want)}) --
def _ddp(norm_type, max_norm):
    model = dl.DDP(_model())
    _backward(model, _rows(dl.world_size(), dl.rank()))
    norm = dl.clip_grad_norm_(model, max_norm, norm_type)
    return norm, None, {n: p.grad for n, p in model.module.named_parameters()}


def _zero(stage, as_params=False):
    def run(norm_type, max_norm):
        model = dl.ZeRO(_model(), stage=stage, optim=torch.optim.SGD, lr=0.1)
        _backward(model, _rows(dl.world_size(), dl.rank()))
        norm = dl.clip_grad_norm_(model.parameters() if as_params else model, max_norm, norm_type)
        return norm, None, _pieces(model.optimizer, model.module)
    return run


def _sharded_optimizer_under_ddp(norm_type, max_norm):
    """ZeRO-1 on its own beside DDP (average_grads=False): the norm of the optimizer's shards, once."""
    model = dl.DDP(_model())
    opt = dl.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, average_grads=False)
    _backward(model, _rows(dl.world_size(), dl.rank()))
    norm = dl.clip_grad_norm_(model, max_norm, norm_type)
    return norm, None, _pieces(opt, model.module)


def _pieces(opt, module) -> dict:
    """{(name, first, last element): gradient}: the slices of each parameter this rank's shards hold."""
    names, pieces = {id(p): n for n, p in module.named_parameters()}, {}
    for bucket, g in zip(opt.buckets, opt.grad_shards):
        for i, flat, piece in bucket.owner_slices(opt.comm.rank):
            pieces[(names[id(bucket.params[i])], flat.start, flat.stop)] = g[piece]
    return pieces


def _fully_shard(mesh=None, as_params=False):
    def run(norm_type, max_norm):
        model = _model()
        for block in model.blocks:                   # each block's first norm kept whole (replicate=)
            dl.fully_shard(block, mesh=mesh, replicate=[block.ln1.weight, block.ln1.bias])
        dl.fully_shard(model, mesh=mesh)
        units = fsdp.units(model)
        n, r = units[0].dp.size, units[0].dp.rank
        _backward(model, _rows(n, r))
        local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
        norm = dl.clip_grad_norm_(model.parameters() if as_params else model, max_norm, norm_type)
        where = {id(sp.shard): (sp, u.shard_comm.rank) for u in units for sp in u.params}
        pieces = {}
        for name, p in model.named_parameters():
            if id(p) not in where:                   # kept whole
                pieces[name] = p.grad
                continue
            sp, k = where[id(p)]
            pieces[(name, k * sp.rows, k * sp.rows + sp.local_rows)] = p.grad
        return norm, local, pieces
    return run


def _tp(norm_type, max_norm, as_params=False):
    model = dl.tp.parallelize(_model(), plan=LM_PLAN)
    _backward(model)
    local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
    norm = dl.clip_grad_norm_(model.parameters() if as_params else model, max_norm, norm_type)
    return norm, local, dl.tp.full_grads(model)


def _ddp_over_tp(norm_type, max_norm, as_params=False):
    from distlab.parallel.mesh import Mesh
    mesh = Mesh(dp=2, tp=2)
    model = dl.DDP(dl.tp.parallelize(_model(), plan=LM_PLAN, group=mesh.tp_group), group=mesh.dp_group)
    _backward(model, _rows(2, mesh.dp_rank))
    norm = dl.clip_grad_norm_(model.parameters() if as_params else model, max_norm, norm_type)
    return norm, None, dl.tp.full_grads(model.module)


def _pipeline(norm_type, max_norm, as_params=False):
    model, r = _model(), dl.rank()
    stages = dl.pp.cut(dl.pp.chain(model), at=["blocks.1"])
    stage = dl.pp.named_stage(model, stages[r])
    pipe = dl.pp.Pipeline(stage, r, 2, schedule="1f1b", microbatches=4)
    x, y = _data("lm", 0)
    pipe.step(x if pipe.first else None, y if pipe.last else None)
    norm = dl.clip_grad_norm_(stage if as_params == "stage" else pipe.parameters() if as_params else pipe,
                              max_norm, norm_type)
    return norm, None, {n: p.grad for n, p in stage.named_parameters()}


def _expert_parallel(norm_type, max_norm, as_params=False):
    """A mixture-of-experts GPT, experts split over the ranks (`dl.ep`), the rest data parallel: each rank
    its rows, its share of the loss; dense gradients summed (as `strategies/expert.py` does)."""
    n, r = dl.world_size(), dl.rank()
    model = dl.ep.parallelize(_model("gpt-moe-tiny"))
    x, y = _gpt_data("gpt-moe-tiny")
    rows = _rows(n, r)
    ce = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())
    (ce / n + model.aux_loss()).backward()                 # equal rows: each rank's share is 1/n
    experts = {id(p) for p in dl.ep.expert_params(model)}
    for p in model.parameters():
        if id(p) not in experts:
            dist.all_reduce(p.grad)
    norm = dl.clip_grad_norm_(model.parameters() if as_params else model, max_norm, norm_type)
    pieces = {}
    for name, p in model.named_parameters():              # an expert stack: this rank's E/n experts
        pieces[(name, r * len(p), (r + 1) * len(p)) if id(p) in experts else name] = p.grad
    return norm, None, pieces


def _context_parallel(norm_type, max_norm):
    """distlab's GPT with ring attention over the sequence (`dl.cp`), gradients averaged by DDP."""
    model = dl.DDP(dl.cp.parallelize(_model("gpt-tiny"), attention="ring"))
    x, y = (dl.cp.split(t, dim=1) for t in _gpt_data("gpt-tiny"))      # (B, s/n), zig-zag
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    norm = dl.clip_grad_norm_(model, max_norm, norm_type)
    return norm, None, {n: p.grad for n, p in model.module.named_parameters()}


def _ddp_over_pipeline(norm_type, max_norm, as_params=False):
    """Two pipeline stages, each a DDP pair (dp=2 x pp=2): the stage's gradients averaged over its pair."""
    from distlab.parallel.mesh import Mesh
    mesh, model = Mesh(dp=2, pp=2), _model()
    stage = dl.pp.named_stage(model, dl.pp.cut(dl.pp.chain(model), at=["blocks.1"])[mesh.pp_rank])
    ddp = dl.DDP(stage, group=mesh.dp_group)
    pipe = dl.pp.Pipeline(ddp, mesh.pp_rank, 2, schedule="1f1b", microbatches=2, group=mesh.pp_group)
    x, y = (t[_rows(2, mesh.dp_rank)] for t in _data("lm", 0))
    with ddp.no_sync():                                   # one all-reduce after the last microbatch
        pipe.step(x if pipe.first else None, y if pipe.last else None)
    ddp.finish_grad_sync()
    norm = dl.clip_grad_norm_(pipe.parameters() if as_params else pipe, max_norm, norm_type)
    return norm, None, {n: p.grad for n, p in stage.named_parameters()}


def _fully_shard_over_tp(norm_type, max_norm, as_params=False):
    """fully_shard over dp=2 of a model tensor-parallel over tp=2 (each tp shard sharded again by rows)."""
    from distlab.parallel.mesh import Mesh
    mesh = Mesh(dp=2, tp=2)
    model = dl.tp.parallelize(_model(), plan=LM_PLAN, group=mesh.tp_group)
    for block in model.blocks:
        dl.fully_shard(block, group=mesh.dp_group)
    dl.fully_shard(model, group=mesh.dp_group)
    _backward(model, _rows(2, mesh.dp_rank))
    local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
    norm = dl.clip_grad_norm_(model.parameters() if as_params else model, max_norm, norm_type)
    return norm, local, {}                                               # the norm only: shards of shards


LAYOUTS = {2: {"ddp": _ddp, "zero1": _zero(1), "zero2": _zero(2), "zero3": _zero(3), "fsdp": _fully_shard(),
               "zero3-params": _zero(3, as_params=True), "zero-beside-ddp": _sharded_optimizer_under_ddp,
               "fsdp-params": _fully_shard(as_params=True), "tp": _tp, "pipeline": _pipeline,
               "ep": _expert_parallel, "cp": _context_parallel,
               # bare parameters: the tp, ep and pipeline markers (`clip.mark_cut`, `_pipeline_of`)
               "tp-params": partial(_tp, as_params=True),
               "pipeline-params": partial(_pipeline, as_params=True),
               "pipeline-stage": partial(_pipeline, as_params="stage"),       # the stage module itself
               "ep-params": partial(_expert_parallel, as_params=True)},
           4: {"hsdp": _fully_shard(mesh=(2, 2)), "ddp-over-tp": _ddp_over_tp,
               "ddp-over-pipeline": _ddp_over_pipeline, "fsdp-over-tp": _fully_shard_over_tp,
               "ddp-over-tp-params": partial(_ddp_over_tp, as_params=True),
               "ddp-over-pipeline-params": partial(_ddp_over_pipeline, as_params=True),
               "fsdp-over-tp-params": partial(_fully_shard_over_tp, as_params=True)}}
MODEL_OF = {"ep": "gpt-moe-tiny", "ep-params": "gpt-moe-tiny", "cp": "gpt-tiny"}     # the others: TinyLM


def _rank(world: int) -> dict:
    """Every layout of this world size, both norms: (norm, want, worst clipped-gradient error, local)."""
    out = {}
    for norm_type in NORMS:
        for name, run in LAYOUTS[world].items():
            want, max_norm, ref = _reference(norm_type, MODEL_OF.get(name, "lm"))
            norm, local, grads = run(norm_type, max_norm)
            err = 0.0
            for key, g in grads.items():
                if (key[0] if isinstance(key, tuple) else key).endswith("attn.k.bias"):
                    continue    # zero in exact arithmetic (softmax ignores a shift of a row's scores):
                full = ref[key[0] if isinstance(key, tuple) else key]     # rounding noise, no relative error
                w = full if not isinstance(key, tuple) else full.flatten()[key[1]:key[2]] \
                    if name.startswith("zero") else full[key[1]:key[2]]      # flat slices, or rows
                err = max(err, ((g.reshape(w.shape) - w).norm() / (w.norm() + 1e-12)).item())
            out[(name, norm_type)] = (float(norm), want, err, None if local is None else float(local))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_clip_grad_norm_is_the_whole_models_under_every_layout(world):
    results = dl.launch(_rank, world_size=world, args=(world,), output="quiet").results
    wrong = []
    for r, res in enumerate(results):
        for (name, p), (norm, want, err, local) in res.items():
            if norm != pytest.approx(want, rel=1e-5) or err > 1e-5:
                wrong.append(f"rank {r} {name} p={p}: norm {norm} (one process: {want}), grads {err:.1e}")
            if local is not None and p == 2.0 and local == pytest.approx(want, rel=1e-3):
                wrong.append(f"rank {r} {name}: torch's clipper on this rank's shards found the global norm")
    assert not wrong, "\n".join(wrong)


def _two_cut_groups() -> tuple[str, tuple]:
    """Bare parameters cut over two different groups; and a marked parameter through torch.save."""
    import io
    a = dl.tp.ColumnParallelLinear(4, 4)                         # over the world
    b = dl.tp.RowParallelLinear(4, 4, group=dist.new_group([0, 1]))   # the same ranks, another group
    (a(torch.ones(1, 4)).sum() + b(torch.ones(1, 2)).sum()).backward()
    try:
        dl.clip_grad_norm_([*a.parameters(), *b.parameters()], 1.0)
        refused = ""
    except ValueError as e:
        refused = str(e)
    buf = io.BytesIO()
    torch.save(a.weight, buf)                                    # a process group cannot be pickled
    buf.seek(0)
    return refused, getattr(torch.load(buf, weights_only=False), "_cut_over", None)


def test_bare_parameters_cut_over_two_groups_are_refused():
    for refused, mark in dl.launch(_two_cut_groups, world_size=2, output="quiet").results:
        assert "more than one group" in refused and "pass the model" in refused, refused
        assert mark == ()                                        # pickled: the mark dropped


def _clip_a_submodule():
    """fully_shard on the root only; clip given one block (not a unit itself): the norm of that block's
    gradient over every rank's rows, not this rank's shards alone."""
    model = _model()
    dl.fully_shard(model)
    n, r = dist.get_world_size(), dist.get_rank()
    _backward(model, _rows(n, r))
    return dl.clip_grad_norm_(model.blocks[1], 1e9).item()


def test_clip_of_a_submodule_under_a_fully_shard_unit_above_it():
    model = _model()
    x, y = _data("lm", 0)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in model.blocks[1].parameters()]).item()
    run = dl.launch(_clip_a_submodule, world_size=2)
    assert run.results[0] == run.results[1] == pytest.approx(want, rel=1e-5)
