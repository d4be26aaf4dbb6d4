"""Expert parallelism (`dl.ep`, strategy ``ep``): the expert-parallel MoE equals the same MoE in one
process (outputs, dropped tokens, gradients) at world sizes 2 and 4 with an uneven token split; the
drop rule and the load-balancing loss against hand computations; ``dl.train("ep")`` against single;
bad input refused with errors that say what to change."""
from __future__ import annotations

import math

import pytest
import torch

import distlab as dl
from distlab.models import moe

H, F, E, TOKENS = 8, 16, 4, 13           # 13 tokens: uneven over 2 and 4 ranks


def _ep_against_local(top_k: int, capacity_factor: float) -> dict:
    """On this rank: the LOCAL MoE on all tokens and its expert-parallel copy on this rank's rows."""
    from distlab.parallel import collectives as C
    n, r = dl.world_size(), dl.rank()
    torch.manual_seed(0)
    ref = dl.ep.MoE(H, F, E, top_k=top_k, capacity_factor=capacity_factor, group=dl.ep.LOCAL)
    with torch.no_grad():
        ref.router.gate.weight.mul_(5.0)                # sharper routing: uneven loads, so tokens drop
    par = ref.shard(group=None)
    torch.manual_seed(1)
    x, g = torch.randn(TOKENS, H), torch.randn(TOKENS, H)           # the global tokens, an upstream grad
    rows = torch.tensor_split(torch.arange(TOKENS), n)[r]
    xr, xp = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
    mark = len(dl.tracer().events())
    y_ref, y = ref(xr), par(xp)
    ((y_ref * g).sum() + ref.balance_loss).backward()
    ((y * g[rows]).sum() + par.balance_loss).backward()
    kept_ref, kept = ref.route(x)[2].kept, par.route(x[rows])[2].kept
    aux_sum = C.all_reduce_sum(par.balance_loss.detach().clone())
    gate_grad = C.all_reduce_sum(par.router.gate.weight.grad.clone())
    per = E // n
    mine = slice(r * per, (r + 1) * per)                 # this rank's experts in the reference
    expert_err = max((getattr(par.local, k).grad - getattr(ref.local, k).grad[mine]).abs().max()
                     for k in ("w1", "b1", "w2", "b2"))
    a2a = [(e.sent, e.received) for e in dl.tracer().events()[mark:] if e.name == "all_to_all"]
    d, row = par.route(x[rows])[2], H * 4                 # rows that leave and arrive, fp32 bytes each
    out_, in_ = (sum(d.send) - d.send[r]) * row, (sum(d.recv) - d.recv[r]) * row
    return {"y": (y - y_ref[rows]).abs().max().item(), "x_grad": (xp.grad - xr.grad[rows]).abs().max().item(),
            "kept_equal": torch.equal(kept, kept_ref[rows]), "dropped": int((~kept_ref).sum()),
            "aux": abs(aux_sum.item() - ref.balance_loss.item()),
            "gate_grad": (gate_grad - ref.router.gate.weight.grad).abs().max().item(),
            "expert_grad": float(expert_err),
            "a2a_bytes": a2a == [(out_, in_), (in_, out_), (out_, in_), (in_, out_)]}


def _layer_checks() -> dict:
    out = {k: _ep_against_local(k, cf) for k, cf in ((1, 1.0), (2, 0.75))}
    try:
        dl.ep.MoE(H, F, 3, group=None)
    except ValueError as err:
        out["error"] = str(err)
    # exact all-to-all bytes: the dispatch of a known plan, counted by hand
    from distlab.parallel import collectives as C
    n, r = dl.world_size(), dl.rank()
    send = [(r + i) % 3 for i in range(n)]                 # uneven, zero rows to some ranks
    recv = [(i + r) % 3 for i in range(n)]                 # what rank i sends here: (i + r) % 3
    mark = len(dl.tracer().events())
    got = C.all_to_all(torch.full((sum(send), 5), float(r)), send, recv)
    event = [e for e in dl.tracer().events()[mark:] if e.name == "all_to_all"][0]
    want = torch.cat([torch.full((recv[i], 5), float(i)) for i in range(n)])
    out["bytes"] = (torch.equal(got, want), event.sent == (sum(send) - send[r]) * 20,
                    event.received == (sum(recv) - recv[r]) * 20)
    out["balanced"] = _balanced_all_to_all()
    return out


def _balanced_all_to_all() -> list[tuple[int, int]]:
    """(sent, received) of the 4 all-to-alls of one forward and backward, with routing balanced by
    construction: 8 tokens per rank, token t's choices t mod E then t+1 mod E, nothing dropped."""
    r = dl.rank()
    layer = dl.ep.MoE(H, F, E, top_k=2, capacity_factor=1.0, group=None)
    with torch.no_grad():
        layer.router.gate.weight.copy_(10 * torch.eye(E, H))
    t = torch.arange(8 * r, 8 * r + 8)
    x = 2.0 * torch.nn.functional.one_hot(t % E, H) + torch.nn.functional.one_hot((t + 1) % E, H)
    mark = len(dl.tracer().events())
    layer(x.float().requires_grad_()).sum().backward()
    return [(e.sent, e.received) for e in dl.tracer().events()[mark:] if e.name == "all_to_all"]


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_moe_equals_one_process(world):
    """Outputs, the dropped tokens, the load-balancing loss and every gradient (input, router, experts)
    equal the single-process MoE's within fp32 rounding, for top-1 and top-2, with tokens dropped."""
    for r, res in enumerate(dl.launch(_layer_checks, world_size=world, output="quiet").results):
        for top_k in (1, 2):
            got = res[top_k]
            assert got["kept_equal"], (r, top_k)
            assert got["dropped"] > 0, "the capacity factor should drop some tokens in this test"
            for key in ("y", "x_grad", "aux", "gate_grad", "expert_grad"):
                assert got[key] < 1e-6, (r, top_k, key, got[key])
            assert got["a2a_bytes"], (r, top_k)       # dispatch, combine, their backwards: exact bytes
        assert "divisible by the expert-parallel group size" in res["error"]
        one = dl.theory.moe_all_to_all_bytes(tokens=8, hidden=H, top_k=2, ep=world)     # k T h b (n-1)/n
        assert res["balanced"] == [(one, one)] * 4
        assert sum(s for s, _ in res["balanced"]) == dl.theory.moe_step_all_to_all_bytes(8, H, 2, world, 1)
        assert res["bytes"] == (True, True, True), r


def test_drop_rule_first_choices_first_then_token_order():
    """E = 2, k = 2, 4 tokens, capacity 2 per expert: the first choices fill the slots in token order,
    second choices only take what is left; the split into parts (ranks) changes nothing."""
    expert = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])            # (T, k)
    cap = moe.capacity(4, 2, 2, capacity_factor=0.5)
    assert cap == 2                                                    # ceil(0.5 * 2 * 4 / 2)
    want = torch.tensor([[True, True], [True, False], [True, False], [False, False]])
    whole = moe.slots(expert, 2, moe.offsets(moe.counts(expert, 2)[None])[0]) < cap
    assert torch.equal(whole, want)
    parts = [expert[:1], expert[1:3], expert[3:]]
    every = torch.stack([moe.counts(p, 2) for p in parts])            # (n, k, E)
    cut = torch.cat([moe.slots(p, 2, moe.offsets(every)[i]) < cap for i, p in enumerate(parts)])
    assert torch.equal(cut, want)
    assert moe.kept(every, cap).sum().item() == want.sum().item()


def test_load_balancing_loss_by_hand():
    """Switch Eq. 4: E * sum_i f_i P_i, f from first choices, P the mean probability; shares add up."""
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.4, 0.1], [0.2, 0.2, 0.6]])
    first = torch.tensor([2, 1, 1])                         # argmax per token: 0, 1, 0, 2
    f = [2 / 4, 1 / 4, 1 / 4]
    p = [(0.7 + 0.1 + 0.5 + 0.2) / 4, (0.2 + 0.6 + 0.4 + 0.2) / 4, (0.1 + 0.3 + 0.1 + 0.6) / 4]
    want = 3 * sum(fi * pi for fi, pi in zip(f, p))
    assert moe.load_balancing_loss(probs, first, 4).item() == pytest.approx(want, rel=1e-6)
    shares = moe.load_balancing_loss(probs[:1], first, 4) + moe.load_balancing_loss(probs[1:], first, 4)
    assert shares.item() == pytest.approx(want, rel=1e-6)
    uniform = torch.full((6, 3), 1 / 3)
    assert moe.load_balancing_loss(uniform, torch.tensor([2, 2, 2]), 6).item() == pytest.approx(1.0)


def test_moe_gpt_adds_the_weighted_aux_loss_and_single_trains_it():
    """gpt-moe-tiny's loss is cross-entropy + aux_coef * sum of its layers' balance losses, and the
    single-process run of `dl.train` reports exactly that loss at step 0."""
    model = dl.models.build("gpt-moe-tiny", 0)
    ids, targets = dl.models.dataset_for("gpt-moe-tiny", 0).batch(0, 8)
    logits = model(ids)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    balance = [b.mlp.balance_loss.item() for b in model.blocks]
    assert all(b >= 1.0 - 1e-6 for b in balance)           # E sum f P >= 1 (Cauchy-Schwarz-like bound)
    want = ce.item() + model.cfg.aux_coef * sum(balance)
    assert model.loss(ids, targets).item() == pytest.approx(want, rel=1e-6)
    report = dl.train("single", model="gpt-moe-tiny", steps=1, global_batch=8)
    assert report.losses[0] == pytest.approx(want, rel=1e-6)


SGD = dict(model="gpt-moe-tiny", steps=2, seed=0, optimizer="sgd", lr=0.1)


@pytest.mark.parametrize("world, batch, accum", [(2, 6, 2), (4, 6, 1)])
def test_train_ep_matches_single(world, batch, accum):
    """Losses within 1e-5 relative and final parameters within 1e-5 relative (+1e-7 absolute) of single,
    with uneven rows per rank (6 over 4) and with accumulation; experts really 1/n per rank."""
    kw = dict(SGD, global_batch=batch, grad_accum=accum, clip=0.5)
    ref, report = dl.train("single", **kw), dl.train("ep", world_size=world, **kw)
    assert report.losses == pytest.approx(ref.losses, rel=1e-5)
    assert sorted(report.params) == sorted(ref.params)
    for name, want in ref.params.items():
        err = (report.params[name] - want).norm().item()
        assert err <= 1e-5 * want.norm().item() + 1e-7, (name, err)
    experts = _theory_params().experts                                  # fp32 bytes, 1/n of them per rank
    assert all(r.info["expert_param_bytes"] == experts * 4 // world for r in report.results)
    assert report.comm[0]["sent_by_op"]["all_to_all"] > 0


@pytest.mark.parametrize("strategy, world, micro", [("pp-1f1b", 2, 4), ("pp-gpipe", 4, 4), ("pp-zb-h1", 2, 2),
                                                    ("pp-interleaved", 2, 2)])
def test_pipelines_add_every_stage_balance_loss(strategy, world, micro):
    """A pipeline routes each microbatch on its own, so it is single with grad_accum x microbatches; the
    balance losses of the MoE layers on every stage join the backward and the reported loss: losses and
    parameters within 1e-5 of that single run (without the stages' terms, as before this was fixed, the
    parameters differ by over 1e-4 relative), the reported loss above the cross-entropy alone."""
    kw = dict(SGD, steps=2, global_batch=8, clip=0.5)
    ref = dl.train("single", grad_accum=2 * micro, **kw)
    report = dl.train(strategy, world_size=world, grad_accum=2, options={"microbatches": micro}, **kw)
    assert report.losses == pytest.approx(ref.losses, rel=1e-5)
    for name, want in ref.params.items():
        assert (report.params[name] - want).norm() <= 1e-5 * want.norm() + 1e-7, name
    model = dl.models.build("gpt-moe-tiny", 0)             # step 0's cross-entropy alone, per microbatch
    x, y = dl.models.dataset_for("gpt-moe-tiny", 0).batch(0, 8)
    ce = sum(torch.nn.functional.cross_entropy(model(a).flatten(0, 1), b.flatten()).item()
             for a, b in zip(x.chunk(2 * micro), y.chunk(2 * micro))) / (2 * micro)
    assert report.losses[0] - ce >= 2 * 0.01 * (1 - 1e-6)  # aux_coef x 2 layers x a balance loss >= 1


def test_replicated_experts_match_single_with_no_all_to_all():
    """options={"experts": "replicated"} on 3 ranks (4 experts do not split over 3: no need here): every
    expert on every rank, routed over the whole batch, equals single; no all-to-all, all experts held."""
    kw = dict(SGD, global_batch=7, clip=0.5)
    ref = dl.train("single", **kw)
    report = dl.train("ep", world_size=3, options={"experts": "replicated"}, **kw)
    assert report.losses == pytest.approx(ref.losses, rel=1e-5)
    for name, want in ref.params.items():
        assert (report.params[name] - want).norm() <= 1e-5 * want.norm() + 1e-7, name
    assert all(r.info["expert_param_bytes"] == _theory_params().experts * 4 for r in report.results)
    assert "all_to_all" not in report.comm[0]["sent_by_op"]
    with pytest.raises(ValueError, match="experts must be 'split' or 'replicated'"):
        dl.train("ep", world_size=2, model="gpt-moe-tiny", options={"experts": "copies"})


def test_ep_checkpoint_resumes_exactly_and_reshards(tmp_path):
    """Model-parallel format: 3 steps saving at 2; resumed from 2 it ends bit-identical; the same
    checkpoint (experts joined along dim 0, Adam state too) resumed by single and by ep on 4 ranks
    ends within 1e-5 of an uninterrupted single run."""
    kw = dict(SGD, steps=3, global_batch=4, optimizer="adamw", lr=0.01, checkpoint_dir=str(tmp_path),
              checkpoint_every=2)
    full = dl.train("ep", world_size=2, **kw)
    resumed = dl.train("ep", world_size=2, **kw, resume=2)
    assert resumed.losses == full.losses
    assert all(torch.equal(v, resumed.params[k]) for k, v in full.params.items())
    assert dl.checkpoint.consolidate(tmp_path, 2)["params"]["blocks.0.mlp.local.w1"].shape[0] == 4
    ref = dl.train("single", **dict(kw, checkpoint_dir=None, checkpoint_every=None))
    for other in (dl.train("single", **kw, resume=2), dl.train("ep", world_size=4, **kw, resume=2)):
        assert other.losses == pytest.approx(ref.losses, rel=1e-5)
        for name, want in ref.params.items():
            if name.endswith("attn.k.bias"):        # true gradient 0 (softmax ignores a per-query constant):
                continue                            # Adam turns its rounding noise into lr-sized steps
            assert (other.params[name] - want).norm() <= 1e-5 * want.norm() + 1e-7, name


def test_bad_input_says_what_to_change(monkeypatch):
    """Experts that do not split over the world, a dense model for ep, top_k > experts, a capacity factor
    <= 0: clear errors; the first two before any rank starts."""
    import importlib

    def no_launch(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(importlib.import_module("distlab.launch"), "launch", no_launch)
    with pytest.raises(ValueError, match="divides 4"):
        dl.train("ep", world_size=3, model="gpt-moe-tiny")
    with pytest.raises(ValueError, match="gpt-moe-tiny"):
        dl.train("ep", world_size=2, model="gpt-tiny")
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and experts=4"):
        dl.ep.MoE(8, 16, 4, top_k=5, group=dl.ep.LOCAL)
    with pytest.raises(ValueError, match="top_k=3"):
        dl.models.GPTConfig(experts=2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        dl.ep.MoE(8, 16, 4, capacity_factor=0, group=dl.ep.LOCAL)
    assert math.isfinite(dl.ep.capacity(10, 4, 2, 1.25))


def test_balance_loss_riders_come_off():
    """ride_balance_losses: one term per MoE forward while riding, none after remove()."""
    model = torch.nn.Sequential(*[dl.ep.MoE(8, 16, 4, group=dl.ep.LOCAL) for _ in range(2)])
    riders = dl.pp.ride_balance_losses(model, 0.01, lambda out: 1.0)
    model(torch.randn(6, 8))
    assert len(riders) == 2 and len(riders.handles) == 2
    riders.remove()
    model(torch.randn(6, 8))
    assert len(riders) == 2 and not riders.handles


def _ep_group_not_a_run() -> str:
    """world 4: experts over ranks {0, 2} (not consecutive) with the batch over the world: refused."""
    import torch.distributed as dist
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    try:
        dl.ep.MoE(8, 16, 4, group=groups[dl.rank() % 2], batch_group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_an_ep_group_that_is_not_a_run_of_the_batch_group_is_refused():
    for said in dl.launch(_ep_group_not_a_run, world_size=4, timeout=60, output="quiet").results:
        assert "must be consecutive ranks of batch_group" in said and "arange(world).view(dp, ep)" in said


@pytest.mark.parametrize("strategy, world", [("tp", 2), ("tp-sp", 2), ("cp-ring", 2), ("cp-ulysses", 2),
                                             ("3d:dp=1,tp=2,pp=1", 2), ("3d:dp=1,tp=1,pp=2", 2),
                                             ("3d:dp=2,tp=1,pp=1", 2)])
def test_strategies_without_moe_support_refuse_it_before_launch(strategy, world, monkeypatch):
    """tp does not split experts, cp's and the 3d mesh's losses carry no load-balancing term: a clear
    error naming the strategies that do run MoE, raised in this process (no rank is started)."""
    import importlib

    def no_launch(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(importlib.import_module("distlab.launch"), "launch", no_launch)
    with pytest.raises(ValueError, match=r"cannot train the mixture-of-experts model 'gpt-moe-tiny'.*"
                                         r"strategy='ep'.*'ddp'"):
        dl.train(strategy, world_size=world, model="gpt-moe-tiny", steps=1, global_batch=8)


# -- theory (`dl.theory.moe`) against the model and the papers' formulas ----------------------------
def _theory_params():
    cfg = dl.models.PRESETS["gpt-moe-tiny"]
    return dl.theory.gpt_moe_params(cfg.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.experts, cfg.top_k,
                                    ffn=cfg.mlp_ratio * cfg.d_model, tied=cfg.tied)


def test_theory_counts_the_moe_gpt_parameters():
    """Total = the model's parameter count; experts = the Experts modules'; active = total minus the
    (E - k) unused experts of every layer; with E = k = 1 it is the dense GPT's count plus the router."""
    model, p, cfg = dl.models.build("gpt-moe-tiny"), _theory_params(), dl.models.PRESETS["gpt-moe-tiny"]
    assert p.total == sum(q.numel() for q in model.parameters())
    assert p.experts == sum(q.numel() for q in dl.ep.expert_params(model)) and p.dense + p.experts == p.total
    one = dl.theory.moe.expert_params(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
    assert p.active == p.total - cfg.layers * (cfg.experts - cfg.top_k) * one
    assert dl.theory.moe_layer_params(2, 4, 4, 2) == (4 * 22 + 8, 2 * 22 + 8)     # 2hf + f + h = 22
    V, S, h, L = 64, 32, 16, 3
    dense = V * h + S * h + L * (12 * h * h + 13 * h) + 2 * h + h * V           # models/gpt.py's closed form
    assert dl.theory.gpt_moe_params(V, S, h, L, experts=1, top_k=1).total == dense + L * h
    assert dl.theory.ep_params_per_rank(p, 2) == p.dense + p.experts / 2
    assert dl.theory.ep_memory(p, 1) == 16 * p.total and dl.theory.ep_memory(p, 4) < dl.theory.ep_memory(p, 2)
    for tokens, experts, k, cf in [(13, 4, 1, 1.0), (13, 4, 2, 0.75), (64, 8, 2, 1.25)]:
        assert dl.theory.expert_capacity(tokens, experts, k, cf) == moe.capacity(tokens, experts, k, cf)


def test_expected_drop_fraction_by_hand_and_by_sampling():
    """T = 4 tokens, E = 2, k = 1, capacity 2: L ~ Binomial(4, 1/2) drops (L - 2) when L > 2, so each expert
    drops 1 * 4/16 + 2 * 1/16 = 6/16 on average and the fraction is 2 * 6/16 / 4 = 3/16. Against uniform
    random top-2 routing of 512 tokens over 8 experts, 200 draws: within 0.005 of the sampled mean."""
    assert dl.theory.expected_drop_fraction(4, 2, 1, 1.0) == pytest.approx(3 / 16)
    assert dl.theory.expected_drop_fraction(10, 4, 4, 1.0) == 0.0          # k = E: all fit at capacity T
    g = torch.Generator().manual_seed(0)
    T, E_, k, cf = 512, 8, 2, 1.0
    cap = moe.capacity(T, E_, k, cf)
    drops = []
    for _ in range(200):
        choice = torch.rand(T, E_, generator=g).topk(k, dim=1).indices          # k distinct, uniform
        load = torch.bincount(choice.flatten(), minlength=E_)
        drops.append((load - cap).clamp(min=0).sum().item() / (k * T))
    assert dl.theory.expected_drop_fraction(T, E_, k, cf) == pytest.approx(sum(drops) / len(drops), abs=0.005)
    with pytest.raises(ValueError, match="tokens"):
        dl.theory.expected_drop_fraction(0, 4, 2, 1.0)
