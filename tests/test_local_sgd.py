"""Local SGD and DiLoCo (strategies local-sgd, diloco): equal to a one-process simulation of the K replicas
on the same shards (2 and 3 ranks, 3 uneven), local SGD at H=1 with SGD is DDP, bytes per step are DDP's / H,
and bad options are refused before any rank starts."""
from __future__ import annotations

import pytest
import torch

import distlab as dl
from distlab.models import shard
from distlab.strategies.base import build_model, global_batch, loss_fn, make_optimizer
from distlab.strategies.parse import parse

KW = dict(model="mlp", global_batch=10, lr=3e-3)        # 10 rows: (5, 5) on 2 ranks, (4, 3, 3) on 3


def simulate(strategy: str, n: int, steps: int, sync_every: int, outer_lr=0.7, outer_momentum=0.9, **kw):
    """The K replicas one after another in this process: each its own model and optimizer on its rows (the
    loss weighted by n n_r / B, as the strategies do), every H steps the parameters averaged (local SGD) or
    the outer Nesterov step written out (DiLoCo: buf = mu buf + delta; theta -= lr (delta + mu buf)).
    Returns (losses: the replicas' mean per step, replica 0's parameters)."""
    spec = parse(strategy, steps=steps, sync_every=sync_every, **{**KW, **kw})
    models = [build_model(spec) for _ in range(n)]
    opts = [make_optimizer(m.parameters(), spec) for m in models]
    crit = loss_fn(spec)
    theta = [p.detach().clone() for p in models[0].parameters()]
    buf = [torch.zeros_like(t) for t in theta]
    losses = []
    for step in range(steps):
        x, y = global_batch(spec, step)
        total = 0.0
        for r, (m, opt) in enumerate(zip(models, opts)):
            xs, ys = shard(x, r, n), shard(y, r, n)
            loss = crit(m(xs).float(), ys) * n * xs.shape[0] / x.shape[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
            total += loss.item() / n
        losses.append(total)
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                replicas = [list(m.parameters()) for m in models]
                for i in range(len(theta)):
                    mean = sum(ps[i] for ps in replicas) / n
                    if strategy == "diloco":
                        delta = theta[i] - mean
                        buf[i] = outer_momentum * buf[i] + delta
                        theta[i] = theta[i] - outer_lr * (delta + outer_momentum * buf[i])
                    else:
                        theta[i] = mean
                    for ps in replicas:
                        ps[i].copy_(theta[i])
    return losses, {k: v.detach().clone() for k, v in models[0].state_dict().items()}


def _close(run, ref, rtol=1e-4, atol=1e-5):
    losses, params = ref
    assert run.losses == pytest.approx(losses, rel=rtol, abs=atol)
    got = run.run.results[0].params
    for k, v in params.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("strategy,n,steps,h", [("diloco", 2, 6, 3), ("diloco", 3, 7, 2),
                                                ("local-sgd", 3, 5, 2)])
def test_equals_sequential_replicas(strategy, n, steps, h):
    """AdamW inside, syncs every h steps; 7 and 5 steps end between syncs (rank 0's replica compared)."""
    run = dl.train(strategy, world_size=n, steps=steps, sync_every=h, **KW)
    _close(run, simulate(strategy, n, steps, h))
    assert run.run.results[0].info["syncs"] == steps // h


def test_diloco_outer_knobs_reach_the_outer_step():
    """outer_lr 1 without momentum is local SGD; another lr/momentum follows the simulation, not local SGD."""
    plain = dl.train("diloco", world_size=2, steps=4, sync_every=2, outer_lr=1.0, outer_momentum=0.0, **KW)
    _close(plain, simulate("local-sgd", 2, 4, 2))
    other = dl.train("diloco", world_size=2, steps=4, sync_every=2, outer_lr=0.5, outer_momentum=0.5, **KW)
    _close(other, simulate("diloco", 2, 4, 2, outer_lr=0.5, outer_momentum=0.5))
    assert not torch.allclose(other.run.results[0].params["layers.0.weight"],
                              plain.run.results[0].params["layers.0.weight"], atol=1e-6)


def test_local_sgd_every_step_with_sgd_is_ddp_and_bytes_are_ddps_over_h():
    """H=1, SGD: averaging parameters after one step from the same point averages the gradients (uneven rows
    on 3 ranks too). Traced bytes per step: DDP's (gradients, fp32) over H (parameters, fp32, every H)."""
    kw = dict(KW, optimizer="sgd", lr=0.05)
    ddp = dl.train("ddp", world_size=3, steps=4, **kw)
    local1 = dl.train("local-sgd", world_size=3, steps=4, sync_every=1, **kw)
    _close(local1, (ddp.losses, ddp.run.results[0].params), rtol=1e-5, atol=1e-6)
    local4 = dl.train("local-sgd", world_size=3, steps=8, sync_every=4, **kw)
    psi_bytes = 4 * sum(v.numel() for v in ddp.run.results[0].params.values())
    predicted = dl.theory.local_sgd_volume(psi_bytes, 3, 4)                     # 2 (N-1)/N Psi / H
    for r in range(3):
        assert local4.comm[r]["sent_per_step"] == pytest.approx(predicted, rel=1e-3)
        per_step = ddp.comm[r]["sent_per_step"]
        assert local1.comm[r]["sent_per_step"] == pytest.approx(per_step, rel=1e-3)
        assert local4.comm[r]["sent_per_step"] == pytest.approx(per_step / 4, rel=1e-3)
        assert set(local4.comm[r]["sent_by_op"]) == {"all_reduce"}


@pytest.mark.parametrize("kw,match", [
    (dict(sync_every=0), "sync_every"),
    (dict(sync_every=2, outer_momentum=1.0), "outer_momentum"),
    (dict(sync_every=50), "never meet"),
    (dict(sync_every=2, checkpoint_dir="ck"), "cannot checkpoint"),
])
def test_bad_options_refused_before_ranks_start(kw, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=match):
        dl.train("diloco", world_size=2, steps=4, **{**KW, **kw})
    with pytest.raises(TypeError, match="sync_every"):
        dl.train("ddp", world_size=2, steps=4, sync_every=2, **KW)


def test_cli_options_parse_into_the_spec():
    """``distlab train --strategy diloco --option sync_every=4`` (and zero3's quantize) reach the spec."""
    from distlab.cli import _parser, train_keywords
    parser, _ = _parser()
    args = parser.parse_args(["train", "--strategy", "diloco", "--option", "sync_every=4",
                              "--option", "outer_lr=0.5"])
    spec = parse("diloco", **train_keywords(args))
    assert (spec.data_parallel.sync_every, spec.data_parallel.outer_lr) == (4, 0.5)
    args = parser.parse_args(["train", "--strategy", "zero3", "--option", "quantize=int8"])
    assert parse("zero3", **train_keywords(args)).data_parallel.quantize == "int8"


def test_the_ledger_counts_diloco_outer_state():
    """Model states per replica (fp32, AdamW inside): local SGD holds DDP's (4 + 4 + 8 bytes per parameter);
    DiLoCo adds the agreed theta and the outer momentum, 4 + 4 more, counted as optimizer state."""
    params = list(dl.models.build("gpt-tiny").parameters())
    psi = sum(p.numel() for p in params)
    peaks = {s: dl.train(s, world_size=2, model="gpt-tiny", steps=2, sync_every=2, global_batch=8,
                         seed=0).memory[1]["peak"] for s in ("local-sgd", "diloco")}
    assert peaks["local-sgd"]["params"] == peaks["diloco"]["params"] == 4 * psi
    adam = 8 * psi + 4 * len(params)                            # two moments, and one step counter a tensor
    assert peaks["local-sgd"]["optimizer"] == adam and peaks["diloco"]["optimizer"] == adam + 8 * psi
