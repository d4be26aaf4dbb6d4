"""dl.train, the strategy registry, the Report and the CLI."""
from __future__ import annotations

import json

import pytest
import torch

import distlab as dl
from distlab.strategies import REGISTRY, TrainSpec, global_batch, load
from test_cli import check_report


def test_single_learns_and_reports():
    report = dl.train("single", steps=12, lr=3e-3)
    assert report.run is None and len(report.losses) == 12
    assert report.losses[-1] < report.losses[0] - 0.3            # the Markov chain is learnable
    assert set(report.params) == set(dl.models.build("gpt-tiny").state_dict())
    assert report.memory[0]["peak"]["optimizer"] > 0 and report.comm[0]["sent"] == 0
    assert report.trace.spans(name="backward")


def test_global_batch_is_the_same_on_every_world_size_and_split_by_accumulation():
    spec = TrainSpec("ddp", global_batch=8, grad_accum=2)
    x0, _ = global_batch(spec, 3, 0)
    x1, _ = global_batch(spec, 3, 1)
    full, _ = global_batch(TrainSpec("single", global_batch=8), 3)
    assert torch.equal(torch.cat([x0, x1]), full)


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        dl.train("zero9", world_size=2)
    with pytest.raises(ValueError, match="world_size=1"):
        dl.train("single", world_size=2)
    with pytest.raises(ValueError, match="divisible"):
        TrainSpec("ddp", global_batch=10, grad_accum=3)
    with pytest.raises(ValueError, match="optimizer"):
        TrainSpec("ddp", optimizer="lamb")
    assert all(callable(load(name)) for name in REGISTRY)      # every registered strategy exists
    assert load("3d:dp=2,tp=1,pp=2") is load("3d")


def test_mlp_uneven_split_and_cli(capsys, tmp_path):
    """The MLP (MSE) through DDP on 3 ranks over a batch of 7 equals single; the CLI prints losses."""
    ref = dl.train("single", model="mlp", steps=3, global_batch=7, optimizer="sgd", lr=1e-3)
    ddp = dl.train("ddp", world_size=3, model="mlp", steps=3, global_batch=7, optimizer="sgd", lr=1e-3)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ddp.losses, ref.losses))
    for k, v in ref.params.items():
        assert torch.allclose(ddp.params[k], v, rtol=1e-5, atol=1e-7), k
    from distlab.cli import main
    out = tmp_path / "r.json"
    argv = ["train", "--strategy", "zero2", "--world-size", "2", "--steps", "2", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "step    0  loss" in text and "step    1  loss" in text and "sent" in text
    assert out.exists()


def test_cli_checkpoints_and_resumes(tmp_path, capsys):
    """`distlab train --checkpoint-dir ... --checkpoint-every 2`, then the same with --resume and more
    steps: the second run takes only the new steps and its losses are those of one uninterrupted run."""
    from distlab.cli import main
    base = ["train", "--strategy", "zero2", "--world-size", "2", "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "2", "--keep-last", "1"]
    assert main(base + ["--steps", "2"]) == 0
    assert dl.checkpoint.steps(tmp_path / "ck") == [2]
    assert main(base + ["--steps", "4", "--resume", "--json", str(tmp_path / "r.json")]) == 0
    assert dl.checkpoint.steps(tmp_path / "ck") == [4]                     # keep-last 1
    resumed = json.loads((tmp_path / "r.json").read_text())["losses"]
    assert resumed == dl.train("zero2", world_size=2, steps=4).losses
    capsys.readouterr()


# -- one loop, one clipper: every strategy equals single on the same global batch ----------------------
SGD = dict(model="gpt-tiny", steps=2, seed=0, optimizer="sgd", lr=0.1, global_batch=8)
EVERY = [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2), ("fsdp", 3), ("tp", 2), ("tp-sp", 2),
         ("pp-gpipe", 2), ("pp-1f1b", 2), ("pp-interleaved", 2), ("pp-zb-h1", 2), ("3d:dp=2,tp=1,pp=2", 4)]


def _assert_close_to(report, ref):
    assert report.losses == pytest.approx(ref.losses, rel=1e-5)
    assert sorted(report.params) == sorted(ref.params)
    for name, want in ref.params.items():
        err = (report.params[name] - want).norm().item()
        assert err <= 1e-5 * want.norm().item() + 1e-7, (name, err / want.norm().item())


@pytest.mark.parametrize("strategy, world", EVERY, ids=[s for s, _ in EVERY])
def test_every_strategy_runs_the_one_loop_and_matches_single(strategy, world):
    """Two accumulated micro-steps through `strategies.loop`: losses and final parameters equal single's;
    every rank marks each step once and the step's optimizer span follows the step mark."""
    kw = dict(SGD, grad_accum=2)
    report = dl.train(strategy, world_size=world, **kw)
    _assert_close_to(report, dl.train("single", **kw))
    check_report(report)                     # real bytes and memory on every rank (test_cli)
    for r in range(world):
        marks = report.trace.select("mark", rank=r, name="step")
        spans = report.trace.spans(rank=r, name="optimizer")
        assert [m.args["step"] for m in marks] == [s.args["step"] for s in spans] == [0, 1]
        assert all(m.start <= s.start for m, s in zip(marks, spans))


CLIPPED = [("tp", 2), ("pp-1f1b", 2), ("3d:dp=2,tp=2,pp=2", 8)]


@pytest.mark.parametrize("strategy, world", CLIPPED, ids=[s for s, _ in CLIPPED])
def test_clipping_by_the_whole_model_norm_matches_single(strategy, world):
    """`parallel.clip.clip_grad_norm_` over tp shards (replicated parameters once) and pipeline stages
    clips exactly as torch.nn.utils.clip_grad_norm_ does on the whole model; max_norm is small enough
    that clipping changes the run."""
    kw = dict(SGD, steps=3, clip=0.05)
    ref = dl.train("single", **kw)
    assert ref.losses[-1] != pytest.approx(dl.train("single", **dict(kw, clip=None)).losses[-1], rel=1e-4)
    _assert_close_to(dl.train(strategy, world_size=world, **kw), ref)


def _clip_tp_and_compare(max_norm):
    """On 2 TP ranks: the clipper's norm and clipped gradients against torch's on the full model."""
    from distlab.parallel.clip import clip_grad_norm_
    from distlab.strategies.tensor import sharded_params
    ids, targets = dl.models.dataset_for("gpt-tiny", 0).batch(0, 4)
    ref = dl.models.build("gpt-tiny", 0)
    ref.loss(ids, targets).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    model = dl.tp.parallelize(dl.models.build("gpt-tiny", 0))
    model.loss(ids, targets).backward()
    norm = clip_grad_norm_(model.parameters(), max_norm, sharded=sharded_params([model]), groups=[None])
    grads = dl.tp.full_grads(model)
    # attn.k.bias has a true gradient of exactly 0 (softmax ignores a per-query constant): noise on both sides
    err = max(((grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in ref.named_parameters()
              if not n.endswith("attn.k.bias"))
    return float(norm), float(want), err


def test_clipper_returns_the_full_norm_and_clips_like_torch():
    for norm, want, err in dl.launch(_clip_tp_and_compare, world_size=2, args=(0.1,), output="quiet").results:
        assert norm == pytest.approx(want, rel=1e-5) and err < 1e-5
