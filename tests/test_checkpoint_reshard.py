"""Resharding: data-parallel checkpoints resumed on another world size or by another data-parallel
strategy (`distlab.checkpoint.reshard`)."""
import pytest
import torch

import distlab as dl
from distlab.checkpoint import reshard
from distlab.strategies.checkpointing import Checkpointer
from distlab.strategies import parse
from distlab.strategies.base import build_model

# (saved strategy, its world size) -> (resuming strategy, its world size), precision
PAIRS = [
    (("zero3", 4), ("zero1", 3), "fp32"),          # 4 shards cut again into 3 (other padding)
    (("zero2", 2), ("zero3", 3), "fp32"),
    (("ddp", 2), ("zero2", 4), "fp32"),            # whole optimizer state -> shards
    (("zero1", 3), ("single", 1), "fp32"),         # shards -> one process (like zero_to_fp32.py)
    (("zero3", 2), ("ddp", 3), "bf16-mixed"),      # fp32 master shards -> whole masters
    (("single", 1), ("zero3", 2), "bf16-mixed"),
]


def _restore_and_capture(strategy: str, precision: str, directory: str) -> dict:
    """On each rank: build `strategy`'s model and optimizer, resume from ``directory``, and return
    what a checkpoint would save right now."""
    from distlab.strategies.data_parallel import _wrap, rank_state
    spec = parse(strategy, global_batch=12, precision=precision, checkpoint_dir=directory, resume=True,
                 bucket_mb=0.1)
    model = build_model(spec)
    if precision == "bf16-mixed":
        model = model.to(torch.bfloat16)
    wrapped, opt, _ = _wrap(spec, model)
    state = rank_state(model, opt, keeps_history=dl.rank() == 0)
    _, losses = Checkpointer(spec, state).resume()
    own, replicated = state.capture()
    if hasattr(wrapped, "comm"):
        wrapped.comm.close()
    own = {**own, "losses": torch.tensor(losses, dtype=torch.float64)}
    return {"own": own, "replicated": replicated, "format": state.format}


def _logical_of_run(results: list[dict]) -> dict:
    shared = results[0]["replicated"] or {}        # replicated state: identical, saved by rank 0
    return reshard.logical_state([{**r["own"], **shared} for r in results], results[0]["format"])


def _assert_same_logical(a: dict, b: dict):
    for part in ("params", "buffers", "masters"):
        assert a[part].keys() == b[part].keys(), part
        for name, t in a[part].items():
            assert torch.equal(t, b[part][name]), (part, name)
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for name, state in a["optimizer"].items():
        assert state.keys() == b["optimizer"][name].keys()
        for key, t in state.items():
            assert torch.equal(t, b["optimizer"][name][key]), (name, key)
    assert torch.equal(a["losses"], b["losses"])


@pytest.mark.parametrize("saved, resumed, precision", PAIRS,
                         ids=[f"{s[0]}{s[1]}-to-{r[0]}{r[1]}-{p}" for s, r, p in PAIRS])
def test_reshard_restores_the_exact_logical_state(saved, resumed, precision, tmp_path):
    """Every parameter, buffer, fp32 master and optimizer moment (and Adam's step) that the new layout
    holds right after resuming is, put back together, bit for bit what the old layout saved."""
    (s_name, s_world), (r_name, r_world) = saved, resumed
    dl.train(s_name, world_size=s_world, steps=2, global_batch=12, precision=precision,
             checkpoint_dir=str(tmp_path), checkpoint_every=2, bucket_mb=0.2)
    before = reshard.consolidate(tmp_path)
    assert before["world_size"] == s_world and before["step"] == 2 and before["optimizer"]
    assert bool(before["masters"]) == (precision == "bf16-mixed")
    results = dl.launch(_restore_and_capture, world_size=r_world, args=(r_name, precision, str(tmp_path)),
                        output="quiet").results
    after = _logical_of_run(results)
    _assert_same_logical(before, after)
    if r_name.startswith("zero"):                   # and the new shards really are 1/M of each bucket
        elements = [sum(t.numel() for t in r["own"]["optimizer"]["optimizer"]["state"][0].values()
                        if t.dim() > 0) for r in results]
        assert max(elements) - min(elements) <= 2 * r_world


@pytest.mark.parametrize("saved, resumed", [(("zero3", 4), ("zero1", 3)), (("zero2", 2), ("ddp", 3))])
def test_resharded_run_continues_like_the_uninterrupted_one(saved, resumed, tmp_path):
    """Save at step 2 on one layout, finish steps 2-4 on another: losses and final parameters equal
    the single-process run (within the 1e-5 that any change of reduction order allows)."""
    kw = dict(steps=5, global_batch=12)
    reference = dl.train("single", **kw)
    first = dl.train(saved[0], world_size=saved[1], **kw, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    report = dl.train(resumed[0], world_size=resumed[1], **kw, checkpoint_dir=str(tmp_path), resume=2)
    assert report.results[0].info["checkpoint"]["resumed_from"] == 2
    assert len(report.trace.select("mark", rank=0, name="step")) == 3
    assert report.losses[:2] == pytest.approx(first.losses[:2], rel=1e-12)       # the history, carried over
    assert report.losses == pytest.approx(reference.losses, rel=1e-5)
    flat = lambda params: torch.cat([params[k].flatten() for k in sorted(params)])   # noqa: E731
    a, b = flat(report.params), flat(reference.params)
    assert ((a - b).norm() / b.norm()).item() < 1e-5


# -- model parallelism: tensor-parallel blocks and pipeline stages put back together ----------------
MP = dict(model="gpt-small", global_batch=8)


@pytest.mark.parametrize("strategy, world", [("tp", 2), ("tp-sp", 2), ("pp-interleaved", 2),
                                             ("3d:dp=2,tp=2,pp=1", 4), ("3d:dp=1,tp=2,pp=2", 4),
                                             ("3d:dp=2,tp=1,pp=2,zero=1", 4)])
def test_model_parallel_checkpoint_consolidates_to_the_full_model(strategy, world, tmp_path):
    """Every rank's blocks and stages, joined by the layout each rank saved, are the full model that
    the run itself gathers at the end, bit for bit; the loss history counts each step once."""
    report = dl.train(strategy, world_size=world, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                      **MP)
    full = reshard.consolidate(tmp_path)
    assert full["params"].keys() == report.params.keys()
    assert all(torch.equal(full["params"][k], v) for k, v in report.params.items())
    assert full["losses"].tolist() == report.losses
    assert all(full["optimizer"][k]["exp_avg"].shape == v.shape for k, v in report.params.items())


CROSS = [(("tp", 2), ("3d:dp=2,tp=1,pp=2", 4)), (("zero2", 2), ("tp", 2)), (("tp-sp", 2), ("single", 1)),
         (("3d:dp=1,tp=2,pp=2", 4), ("pp-1f1b", 2)),
         (("3d:dp=2,tp=2,pp=1,zero=1", 4), ("3d:dp=4,tp=1,pp=1,zero=1", 4))]   # dp shards of tp blocks


@pytest.mark.parametrize("saved, resumed", CROSS, ids=[f"{s[0]}-to-{r[0]}" for s, r in CROSS])
def test_resume_across_parallel_layouts(saved, resumed, tmp_path):
    """Saved at step 2 under one layout, resumed under another: the parameters arrive exactly, and the
    continued run equals single-process training (within 1e-5, a different reduction order)."""
    reference = dl.train("single", steps=4, **MP)
    dl.train(saved[0], world_size=saved[1], steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2, **MP)
    at_two = reshard.consolidate(tmp_path, 2)["params"]
    again = dict(world_size=resumed[1], checkpoint_dir=str(tmp_path), resume=2, **MP)
    restored = dl.train(resumed[0], steps=2, **again)
    assert all(torch.equal(v, at_two[k]) for k, v in restored.params.items())
    report = dl.train(resumed[0], steps=4, **again)
    assert report.losses == pytest.approx(reference.losses, rel=1e-5)
    flat = lambda params: torch.cat([params[k].flatten() for k in sorted(params)])   # noqa: E731
    a, b = flat(report.params), flat(reference.params)
    assert ((a - b).norm() / b.norm()).item() < 1e-5
