"""dl.train, the strategy registry, the Report and the CLI."""
from __future__ import annotations

import json

import pytest
import torch

import distlab as dl
from distlab.strategies import REGISTRY, TrainSpec, global_batch, load


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
    assert main(["train", "--strategy", "zero2", "--world-size", "2", "--steps", "2", "--json", str(out)]) == 0
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
