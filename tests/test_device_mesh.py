"""torch's DeviceMesh (and distlab's dl.Mesh) wherever distlab takes a group or a mesh (issue 20 item 4):
`parallel.mesh.as_group` turns a 1-D mesh into its process group and refuses a 2-D one with what to pass;
one launch on a 2 x 2 ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` checks each entry
point does its arithmetic over the right ranks (rank r sits at dp = r // 2, tp = r % 2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab as dl
from distlab.parallel.mesh import as_group
from distlab.runtime import group_members, group_name


# -- the conversion, without processes ------------------------------------------------------------
def test_as_group_passes_groups_and_sentinels_through_and_refuses_lists():
    assert as_group(None) is None
    assert as_group(dl.ep.LOCAL) is dl.ep.LOCAL
    for wrong in ([0, 1], (0, 1), "tp", 2):
        with pytest.raises(TypeError, match=r"pass a process group .*mesh\['tp'\]"):
            as_group(wrong)


def test_a_2d_dl_mesh_where_a_group_is_needed_says_which_axis_to_pass():
    mesh = dl.Mesh(dp=2, tp=2, world_size=4, groups=False)
    with pytest.raises(ValueError, match=r"2-D mesh Mesh\(dp=2, tp=2, pp=1\).*pass one of its dimensions, "
                                         r"mesh\['dp'\], mesh\['tp'\]"):
        as_group(mesh)
    with pytest.raises(TypeError, match=r"name one axis"):
        mesh["dp", "tp"]


# -- every entry point, in one launch ----------------------------------------------------------------
def _ones_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2, bias=False)


def _grad_of(model: nn.Module, rank: int) -> torch.Tensor:
    """Backward of sum(W x) with x = (rank, ...): dW = x in every row, so an average over a group of
    ranks is that group's mean rank (what says which ranks were averaged)."""
    model(torch.full((1, 4), float(rank))).sum().backward()
    return next(model.parameters()).grad


def _data_parallel(mesh, r: int) -> dict:
    """DDP, ZeRO, ShardedOptimizer over mesh["dp"] (ranks r % 2 and r % 2 + 2: mean rank r % 2 + 1);
    fully_shard over mesh["tp"] (mean 2 (r // 2) + 0.5), HSDP over the 2-D mesh (all ranks: 1.5) and over a
    2-D sub-mesh of a 3-D one (its ranks flattened into one data-parallel group)."""
    dp_mean, tp_mean = r % 2 + 1.0, 2 * (r // 2) + 0.5
    got = {"ddp": _grad_of(dl.DDP(_ones_model(), group=mesh["dp"]), r).unique().tolist() == [dp_mean]}
    zero = dl.ZeRO(_ones_model(), stage=2, optim=torch.optim.SGD, lr=1.0, group=mesh["dp"])
    before = zero.module.weight.detach().clone()
    _grad_of(zero.module, r)
    zero.optimizer.step()
    got["zero2"] = torch.allclose(before - zero.module.weight, torch.full_like(before, dp_mean))
    model = _ones_model()
    opt = dl.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=1.0, group=mesh["dp"])
    _grad_of(model, r)                                      # averaged over dp by the optimizer's step
    before = model.weight.detach().clone()
    opt.step()
    got["sharded_optimizer"] = torch.allclose(before - model.weight, torch.full_like(before, dp_mean))
    from torch.distributed.device_mesh import init_device_mesh
    sub = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "rep", "shard"))["rep", "shard"]
    cases = {"fsdp_tp": (dict(group=mesh["tp"]), tp_mean), "fsdp_mesh_1d": (dict(mesh=mesh["tp"]), tp_mean),
             "hsdp_2d": (dict(mesh=mesh), 1.5), "hsdp_dl_mesh": (dict(mesh=dl.Mesh(dp=2, tp=2)), 1.5),
             "hsdp_sub_mesh": (dict(mesh=sub), tp_mean)}      # 1 x 2 of a 3-D mesh: over ranks 2p, 2p + 1
    for name, (kw, mean) in cases.items():
        sharded = dl.fully_shard(_ones_model(), **kw)
        grad = _grad_of(sharded, r)
        got[name] = tuple(grad.shape) == (1, 4) and grad.unique().tolist() == [mean]   # rows split over tp
    return got


def _model_parallel(mesh, r: int) -> dict:
    """dl.tp layers and parallelize, dl.cp, dl.ep.MoE, dl.pp.Pipeline, dl.clip_grad_norm_ over mesh["tp"]."""
    tp = mesh["tp"]
    got = {"column": dl.tp.ColumnParallelLinear(4, 8, group=tp).weight.shape == (4, 4),
           "row": dl.tp.RowParallelLinear(8, 4, group=tp).weight.shape == (4, 4)}
    with pytest.raises(ValueError, match=r"2-D mesh DeviceMesh \(dp=2, tp=2\).*mesh\['dp'\], mesh\['tp'\]"):
        dl.tp.parallelize(nn.Sequential(nn.Linear(4, 4)), plan={"0": "colwise"}, group=mesh)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))          # the same full sequence everywhere
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name, attention in (("ring", dl.cp.ring_attention), ("ulysses", dl.cp.ulysses_attention)):
        zz = name == "ring"
        local = [dl.cp.split(t, dim=2, group=tp, zigzag=zz) for t in (q, k, v)]
        out = attention(*local, causal=True, group=tp, zigzag=zz)
        got[f"cp_{name}"] = torch.allclose(dl.cp.unsplit(out, dim=2, group=tp, zigzag=zz), full, atol=1e-6)
    moe = dl.ep.MoE(hidden=8, ffn=16, experts=4, top_k=1, group=tp)
    got["ep"] = moe.local.w1.shape[0] == 2 and moe(torch.randn(6, 8)).shape == (6, 8)
    got["pp"] = _pipeline(tp, r % 2)
    return got


def _pipeline(group, stage: int) -> bool:
    """Two stages (one linear each) over ``group``: the last stage's loss equals the whole model's."""
    torch.manual_seed(2)
    layers, x, target = [nn.Linear(4, 4) for _ in range(2)], torch.randn(4, 4), torch.randn(4, 4)
    want = F.mse_loss(layers[1](layers[0](x)), target).item()
    pipe = dl.pp.Pipeline(layers[stage], stage, 2, microbatches=2, group=group)
    loss = pipe.step(x if stage == 0 else None, target if stage == 1 else None)
    norm = dl.clip_grad_norm_(layers[stage].parameters(), 1e9, groups=[group])    # each stage: its own
    both = torch.cat([p.grad.flatten() for p in layers[stage].parameters()]).pow(2).sum()
    dl.comm.ring_all_reduce(both, group=as_group(group))
    ok_loss = loss is None if stage == 0 else abs(loss.item() - want) < 1e-6
    return ok_loss and torch.allclose(norm, both.sqrt())


def _rank() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    r = dl.rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = as_group(mesh["tp"]), as_group(mesh["dp"])
    got = {"members": group_members(tp) == (2 * (r // 2), 2 * (r // 2) + 1)
           and group_members(dp) == (r % 2, r % 2 + 2),
           "names": (group_name(tp), group_name(dp)) == ("tp", "dp"),
           "dl_mesh": group_members(dl.Mesh(dp=2, tp=2)["tp"]) == group_members(tp)}
    try:
        as_group(mesh)
    except ValueError as e:
        got["refused_2d"] = "pass one of its dimensions, mesh['dp'], mesh['tp']" in str(e)
    return {**got, **_data_parallel(mesh, r), **_model_parallel(mesh, r)}


CHECKS = {"members", "names", "dl_mesh", "refused_2d", "ddp", "zero2", "sharded_optimizer", "fsdp_tp",
          "fsdp_mesh_1d", "hsdp_2d", "hsdp_dl_mesh", "hsdp_sub_mesh", "column", "row", "cp_ring",
          "cp_ulysses", "ep", "pp"}


def test_every_entry_point_takes_a_device_mesh_on_a_2x2_mesh():
    run = dl.launch(_rank, world_size=4, output="quiet")
    for r, got in enumerate(run.results):
        assert all(got.values()), (r, {k: v for k, v in got.items() if not v})
        assert set(got) == CHECKS, sorted(set(got) ^ CHECKS)
