"""``cp=`` and ``ep=`` as mesh axes (issue 10): ``3d:dp=2,cp=2``, ``3d:cp=2,tp=2``, ``3d:dp=2,ep=2`` train
exactly as ``single`` on the same global batch, with the invariants (replicas bitwise equal, tp shards
and experts really 1/N per rank, communication inside its own axis), and the combinations not built
are refused before any rank starts, saying what to change."""
from __future__ import annotations

import functools

import pytest
import torch

import distlab as dl
from distlab.strategies import parse

CP = dict(model="gpt-tiny", steps=2, seed=0, optimizer="sgd", lr=0.1, global_batch=8, grad_accum=2)
EP = dict(model="gpt-moe-tiny", steps=2, seed=0, optimizer="sgd", lr=0.1, global_batch=6, clip=0.5)


@functools.lru_cache(maxsize=None)
def _single(kind: str):
    return dl.train("single", **(CP if kind == "cp" else EP))


def _assert_matches(report, ref) -> None:
    """Losses within 1e-5 relative; every final parameter within 1e-5 of its norm + 1e-7 (fp32 sums
    taken in another order; attn.k.bias has true gradient 0, its rounding noise stays below 1e-7)."""
    assert report.losses == pytest.approx(ref.losses, rel=1e-5)
    assert sorted(report.params) == sorted(ref.params)
    for name, want in ref.params.items():
        err = (report.params[name] - want).norm().item()
        assert err <= 1e-5 * want.norm().item() + 1e-7, (name, err)


# -- cp: with dp, with tp (on the attention heads), ring and Ulysses ----------------------------------
CP_MESHES = [("3d:dp=2,cp=2", 4), ("3d:cp=2,tp=2", 4), ("3d:cp=2,tp=2,attention=ulysses", 4),
             ("3d:dp=3,cp=2", 6),            # dp=3: micro-batches of 4 rows split 2, 1, 1
             ("3d:dp=2,cp=2,tp=2", 8)]


@pytest.mark.parametrize("name, world", CP_MESHES)
def test_cp_mesh_matches_single(name, world):
    report = dl.train(name, world_size=world, **CP)
    _assert_matches(report, _single("cp"))
    o = parse(name).layout
    dp, cp, tp = o.dp, o.cp, o.tp
    infos = [r.info for r in report.results]
    assert all((i["dp"], i["cp"], i["tp"]) == (dp, cp, tp) for i in infos)
    grid = torch.arange(world).view(dp, cp, tp)
    full = report.params
    for t in range(tp):                          # replicas: the dp x cp ranks holding the same shards
        replicas = grid[:, :, t].flatten().tolist()
        assert all(infos[q]["digests"] == infos[replicas[0]]["digests"] for q in replicas)
    for i in infos:                              # tp shards really 1/T (Megatron's matrices), the rest whole
        for pname, shape in i["shapes"].items():
            n, whole = torch.Size(shape).numel(), full[pname].numel()
            split = tp > 1 and pname.endswith(("q.weight", "k.weight", "v.weight", "q.bias", "k.bias",
                                               "v.bias", "proj.weight", "fc.weight", "fc.bias", "tok.weight",
                                               "head.weight"))
            assert n == (whole // tp if split else whole), (pname, shape)
    if tp > 1:                                   # different tp ranks hold different shards
        assert infos[0]["digests"]["blocks.0.attn.q.weight"] != infos[1]["digests"]["blocks.0.attn.q.weight"]
    op = "all_to_all" if o.attention == "ulysses" else "ring_shift"
    events = report.trace.comms(op=op)
    assert events
    for e in events:                             # attention talks only inside a cp group grid[d, :, t]
        (d, _, t), (d2, _, t2) = ((grid == x).nonzero()[0].tolist() for x in (e.rank, e.args["peer"]))
        assert (d, t) == (d2, t2), (e.rank, e.args["peer"])


# -- ep: experts over ep, the rest replicated over dp x ep --------------------------------------------
EP_MESHES = [("3d:dp=2,ep=2", 4, {}), ("3d:dp=2,ep=2", 4, {"grad_accum": 2, "global_batch": 8}),
             ("3d:dp=3,ep=2", 6, {})]


@pytest.mark.parametrize("name, world, kw", EP_MESHES)
def test_ep_mesh_matches_single(name, world, kw):
    """6 rows over 4 ranks (2, 2, 1, 1): uneven; the router counts over the whole batch, so capacity
    and dropped tokens are single's (drops themselves: `test_dp_x_ep_moe_equals_one_process_with_drops`)."""
    ref = dl.train("single", **{**EP, **kw}) if kw else _single("ep")
    report = dl.train(name, world_size=world, **{**EP, **kw})
    _assert_matches(report, ref)
    o = parse(name).layout
    dp, ep = o.dp, o.ep
    infos = [r.info for r in report.results]
    grid = torch.arange(world).view(dp, ep)
    experts = {n for n in infos[0]["shapes"] if ".mlp.local." in n}
    assert experts
    for r, i in enumerate(infos):
        assert (i["dp"], i["ep"]) == (dp, ep)
        for pname in experts:                                    # experts really 1/ep per rank
            assert torch.Size(i["shapes"][pname]).numel() * ep == report.params[pname].numel()
        dense = {n: v for n, v in i["digests"].items() if n not in experts}
        assert dense == {n: v for n, v in infos[0]["digests"].items() if n not in experts}   # one replica
        e = r % ep                                               # the dp column: the same experts
        assert all(infos[q]["digests"] == i["digests"] for q in grid[:, e].tolist())
    assert infos[0]["digests"]["blocks.0.mlp.local.w1"] != infos[1]["digests"]["blocks.0.mlp.local.w1"]
    moves = report.trace.comms(op="all_to_all")
    assert moves
    assert all(e.args.get("group") == "ep" for e in moves)


def _dp_ep_layer(top_k: int) -> dict:
    """world 4 = dp 2 x ep 2: the MoE's experts over each row {0,1} {2,3}, its counts over the world
    (``batch_group``), against the LOCAL MoE on all 13 tokens (capacity 0.75: tokens dropped)."""
    import torch.distributed as dist

    from distlab.parallel import collectives as C
    from distlab.strategies.expert import groups
    H, F, E, T = 8, 16, 4, 13
    r = dl.rank()
    ep_group, dp_group = groups(2, 4)
    torch.manual_seed(0)
    ref = dl.ep.MoE(H, F, E, top_k=top_k, capacity_factor=0.75, group=dl.ep.LOCAL)
    with torch.no_grad():
        ref.router.gate.weight.mul_(5.0)                       # sharp routing: uneven loads, drops
    par = ref.shard(group=ep_group, batch_group=dist.group.WORLD)
    torch.manual_seed(1)
    x, g = torch.randn(T, H), torch.randn(T, H)
    rows = torch.tensor_split(torch.arange(T), 4)[r]           # 4, 3, 3, 3 rows
    xr, xp = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
    y_ref, y = ref(xr), par(xp)
    ((y_ref * g).sum() + ref.balance_loss).backward()
    ((y * g[rows]).sum() + par.balance_loss).backward()
    kept_ref, kept = ref.route(x)[2].kept, par.route(x[rows])[2].kept
    mine = slice((r % 2) * 2, (r % 2) * 2 + 2)                 # this rank's experts in the reference
    expert = max((C.all_reduce_sum(getattr(par.local, k).grad.clone(), dp_group)
                  - getattr(ref.local, k).grad[mine]).abs().max().item() for k in ("w1", "b1", "w2", "b2"))
    return {"y": (y - y_ref[rows]).abs().max().item(), "kept": torch.equal(kept, kept_ref[rows]),
            "dropped": int((~kept_ref).sum()), "x_grad": (xp.grad - xr.grad[rows]).abs().max().item(),
            "aux": abs(C.all_reduce_sum(par.balance_loss.detach().clone()).item() - ref.balance_loss.item()),
            "gate": (C.all_reduce_sum(par.router.gate.weight.grad.clone()) - ref.router.gate.weight.grad)
            .abs().max().item(), "expert": expert}


@pytest.mark.parametrize("top_k", [1, 2])
def test_dp_x_ep_moe_equals_one_process_with_drops(top_k):
    """Outputs, dropped tokens, balance loss (summed over the world), input, router (summed over the
    world) and expert gradients (summed over the dp column) equal the one-process MoE's within 1e-6."""
    for r, res in enumerate(dl.launch(_dp_ep_layer, world_size=4, args=(top_k,), output="quiet").results):
        assert res["kept"] and res["dropped"] > 0, (r, res)
        for key in ("y", "x_grad", "aux", "gate", "expert"):
            assert res[key] < 1e-6, (r, key, res[key])


# -- what is refused, before any rank starts ---------------------------------------------------------
@pytest.mark.parametrize("name, world, model, match", [
    ("3d:dp=2,cp=2,pp=2", 8, "gpt-tiny", "cp=2 with pp=2.*use pp=1"),
    ("3d:dp=2,ep=2,pp=2", 8, "gpt-moe-tiny", "ep=2 with pp=2.*use pp=1"),
    ("3d:cp=2,ep=2", 4, "gpt-moe-tiny", "keep one of them"),
    ("3d:ep=2,tp=2", 4, "gpt-moe-tiny", "ep=2 with tp=2.*use tp=1"),
    ("3d:dp=2,cp=2,zero=1", 4, "gpt-tiny", "zero=0"),
    ("3d:cp=2,tp=2,sp=1", 4, "gpt-tiny", "use one of them"),
    ("3d:dp=2,cp=2", 8, "gpt-tiny", "dp=2 x cp=2 = 4 ranks.*world has 8"),
    ("3d:cp=2,tp=2,attention=ulysses,dp=1", 8, "gpt-tiny", "world has 8"),
    ("3d:cp=4,tp=2,attention=ulysses", 8, "gpt-tiny", "2 heads per tp rank over 4 ranks"),
    ("3d:cp=2,attention=flash", 2, "gpt-tiny", "attention='flash'"),
    ("3d:dp=1,ep=3", 3, "gpt-moe-tiny", "4 experts.*divides 4"),
    ("3d:dp=2,ep=3", 6, "gpt-moe-tiny", "4 experts.*ep=3 ranks.*an ep degree that divides 4"),
    ("3d:dp=2,ep=2", 4, "gpt-tiny", "gpt-moe-tiny"),
    ("3d:dp=2,cp=2", 4, "mlp", "GPT preset"),
    ("3d:cp=3", 3, "gpt-tiny", "multiple of 2 x cp = 6"),
])
def test_refused_before_any_rank_starts(name, world, model, match):
    from _processes import child_pids
    with pytest.raises(ValueError, match=match):
        dl.train(name, world_size=world, model=model, steps=1, global_batch=8)
    assert child_pids() == []


def test_parse_reads_the_new_axes():
    o = parse("3d:dp=2,cp=2,attention=ulysses,zigzag=1").layout
    assert (o.dp, o.cp, o.ep, o.tp, o.attention, o.zigzag) == (2, 2, 1, 1, "ulysses", True)
    assert parse("3d:dp=2", ep=2).layout.ep == 2
    with pytest.raises(ValueError, match="positive integer"):
        parse("3d:cp=0")


@pytest.mark.parametrize("name, model", [("3d:cp=2,tp=2", "gpt-tiny"), ("3d:dp=2,ep=2", "gpt-moe-tiny")])
def test_new_axes_checkpoint_and_resume_bit_for_bit(name, model, tmp_path):
    """3 AdamW steps saving at 2; resumed from 2, losses and final parameters are bit-identical."""
    kw = dict(model=model, steps=3, seed=0, optimizer="adamw", lr=0.01, global_batch=8,
              checkpoint_dir=str(tmp_path), checkpoint_every=2)
    full = dl.train(name, world_size=4, **kw)
    resumed = dl.train(name, world_size=4, **kw, resume=2)
    assert resumed.losses == full.losses
    assert all(torch.equal(v, resumed.params[k]) for k, v in full.params.items())


@pytest.mark.parametrize("strategy, options, dropped", [
    ("3d:dp=2,cp=2", {"microbatches": 4}, "microbatches"),
    ("3d:dp=2,cp=2,schedule=gpipe", {}, "schedule"),
    ("3d:dp=2,ep=2", {"attention": "ulysses"}, "attention"),
    ("3d:dp=2,ep=2,zigzag=0", {}, "zigzag"),
])
def test_a_mesh_refuses_options_it_would_drop(strategy, options, dropped):
    model = "gpt-moe-tiny" if "ep=" in strategy else "gpt-tiny"
    with pytest.raises(TypeError, match=dropped):
        dl.train(strategy, world_size=4, model=model, steps=1, global_batch=8, options=options)
