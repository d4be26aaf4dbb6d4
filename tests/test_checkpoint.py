"""dl.checkpoint: sharded atomic saves, verified weights_only loads, bit-exact resume, crash recovery."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from _processes import child_pids
from distlab.checkpoint import CheckpointError


def _sharded_save_and_load(directory):
    """World 4 as 2 replica groups {0, 1} and {2, 3} (think dp=2 inside tp=2): replicated state is
    written by ranks 0 and 2 only; each rank also writes its own shard."""
    r = dl.rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[r // 2]
    for step in (1, 2, 3):
        own = {"shard": torch.full((100 * (r + 1),), float(r + step)), "rank": r}
        replicated = {"weights": torch.arange(1000, dtype=torch.float32) + 10 * (r // 2) + step}
        dl.checkpoint.save(directory, step, own, replicated=replicated, group=group, keep_last=2,
                           meta={"what": "test"})
    loaded = dl.checkpoint.load(directory)
    earlier = dl.checkpoint.load(directory, step=2)
    return {"shard": loaded["shard"], "rank": loaded["rank"], "weights": loaded["weights"],
            "earlier": earlier["shard"][0].item()}


def test_sharded_save_writes_replicated_state_once_per_group_and_rotates(tmp_path, no_leaks):
    run = dl.launch(_sharded_save_and_load, world_size=4, args=(str(tmp_path),), output="quiet")
    assert dl.checkpoint.steps(tmp_path) == [2, 3]                     # keep_last=2 removed step_1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    info = dl.checkpoint.manifest(tmp_path)
    assert info["step"] == 3 and info["world_size"] == 4 and info["meta"] == {"what": "test"}
    shards = info["shards"]
    assert [s["replicated_from"] for s in shards] == [0, 0, 2, 2]
    assert [s["has_replicated"] for s in shards] == [True, False, True, False]
    # rank 0 holds its 400-byte shard plus the 4000-byte replicated weights; rank 1 only its 800 bytes
    assert shards[0]["bytes"] - shards[1]["bytes"] > 4000 - 800 - 400
    for s in shards:
        assert (tmp_path / "step_3" / s["file"]).stat().st_size == s["bytes"]
    assert info["total_bytes"] == sum(s["bytes"] for s in shards)
    for r, res in enumerate(run.results):
        assert res["rank"] == r and torch.equal(res["shard"], torch.full((100 * (r + 1),), float(r + 3)))
        assert torch.equal(res["weights"], torch.arange(1000, dtype=torch.float32) + 10 * (r // 2) + 3)
        assert res["earlier"] == r + 2
    # this process is a world of 1: the error says which world size to resume with
    with pytest.raises(CheckpointError, match="saved by 4 ranks.*world_size=4"):
        dl.checkpoint.load(tmp_path)


def test_interrupted_save_is_ignored_then_cleaned_and_resave_replaces(tmp_path):
    dl.checkpoint.save(tmp_path, 1, {"x": torch.ones(3)})
    half = tmp_path / "step_2.tmp"                          # what a crash mid-save leaves: distlab's
    half.mkdir()                                            # own folder (marked first), a part of a shard
    (half / ".distlab-checkpoint").write_text("made by distlab.checkpoint")
    (half / "rank_0.pt").write_bytes(b"half a file")
    assert dl.checkpoint.latest(tmp_path) == 1
    assert torch.equal(dl.checkpoint.load(tmp_path)["x"], torch.ones(3))
    dl.checkpoint.save(tmp_path, 3, {"x": torch.zeros(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3"]
    dl.checkpoint.save(tmp_path, 3, {"x": torch.full((3,), 7.0)})   # same step again: replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3"]
    assert torch.equal(dl.checkpoint.load(tmp_path, 3)["x"], torch.full((3,), 7.0))
    with pytest.raises(CheckpointError, match="no complete checkpoint in .*train without resume"):
        dl.checkpoint.load(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"complete steps: \[1, 3\]"):
        dl.checkpoint.load(tmp_path, 2)


def test_views_save_only_their_own_bytes(tmp_path):
    """A ZeRO shard is a view of a whole flat buffer; torch.save would write the whole storage."""
    flat = torch.zeros(1_000_000)
    dl.checkpoint.save(tmp_path, 1, {"shard": flat[:1000]})
    assert dl.checkpoint.manifest(tmp_path)["shards"][0]["bytes"] < 10_000


def test_corrupt_files_are_refused(tmp_path):
    dl.checkpoint.save(tmp_path, 5, {"x": torch.arange(1000.0)})
    path = tmp_path / "step_5" / "rank_0.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        dl.checkpoint.load(tmp_path)
    path.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        dl.checkpoint.load(tmp_path)


class Payload:
    def __reduce__(self):
        return (print, ("arbitrary code ran while loading a checkpoint",))


def test_loading_never_runs_pickled_code(tmp_path):
    """weights_only=True: a checkpoint with a pickled callable is refused even with a valid manifest."""
    import hashlib
    dl.checkpoint.save(tmp_path, 1, {"x": torch.ones(1)})
    path = tmp_path / "step_1" / "rank_0.pt"
    torch.save({"step": 1, "rank": 0, "world_size": 1, "state": {"x": Payload()}}, path)
    manifest_path = tmp_path / "step_1" / "manifest.json"
    info = json.loads(manifest_path.read_text())
    data = path.read_bytes()
    info["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(info))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        dl.checkpoint.load(tmp_path)


@pytest.mark.parametrize("strategy, world, precision", [
    ("single", 1, "fp32"), ("ddp", 2, "fp32"), ("zero1", 2, "fp32"), ("zero2", 2, "fp32"),
    ("zero3", 2, "fp32"), ("zero3", 2, "bf16-mixed")])
def test_resume_reproduces_the_uninterrupted_run_exactly(strategy, world, precision, tmp_path):
    """Run 5 steps saving at 2, 4 and 5; a fresh run resumed from step 2 takes steps 2-4 only and ends
    with the same losses and the same parameters, bit for bit."""
    kw = dict(world_size=world, steps=5, precision=precision, checkpoint_dir=str(tmp_path),
              checkpoint_every=2)
    full = dl.train(strategy, **kw)
    assert dl.checkpoint.steps(tmp_path) == [2, 4, 5]
    resumed = dl.train(strategy, **kw, resume=2)
    assert resumed.results[0].info["checkpoint"] == {"resumed_from": 2, "saved": [4, 5]}
    assert len(resumed.trace.select("mark", rank=0, name="step")) == 3            # steps 2, 3, 4 only
    assert resumed.losses == full.losses and len(full.losses) == 5
    assert full.params.keys() == resumed.params.keys()
    for k, v in full.params.items():
        assert torch.equal(v, resumed.params[k]), k
    if strategy == "single":                                          # and checkpointing changed nothing
        plain = dl.train("single", steps=5, precision=precision)
        assert plain.losses == full.losses
        assert all(torch.equal(plain.params[k], v) for k, v in full.params.items())
    shards = dl.checkpoint.manifest(tmp_path)["shards"]
    if strategy.startswith("zero"):                                   # every rank writes its optimizer shard
        assert min(s["bytes"] for s in shards) > 100_000
    elif strategy == "ddp":                                           # replicated: written once, by rank 0
        assert shards[1]["bytes"] < 5_000 < shards[0]["bytes"]


def test_killed_rank_leaves_the_last_checkpoint_intact_and_resume_finishes(tmp_path, no_leaks):
    """SIGKILL rank 2 in the middle of saving step 4 (its shard written, no commit yet): LaunchError;
    step_2 is complete, step_4.tmp is ignored; relaunching with resume=True matches an uninterrupted run."""
    kw = dict(world_size=3, steps=6, global_batch=12)
    plain = dl.train("zero2", **kw)
    with pytest.raises(dl.LaunchError) as err:
        dl.train("zero2", **kw, checkpoint_dir=str(tmp_path), checkpoint_every=2, fail_at_step=4,
                 fail_in="save")
    assert err.value.rank == 2 and "SIGKILL" in str(err.value)
    assert child_pids() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4.tmp"]
    assert not (tmp_path / "step_4.tmp" / "manifest.json").exists()
    assert dl.checkpoint.latest(tmp_path) == 2
    resumed = dl.train("zero2", **kw, checkpoint_dir=str(tmp_path), checkpoint_every=2, resume=True)
    assert resumed.results[0].info["checkpoint"] == {"resumed_from": 2, "saved": [4, 6]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4", "step_6"]
    assert resumed.losses == plain.losses
    assert all(torch.equal(plain.params[k], v) for k, v in resumed.params.items())
    assert child_pids() == []


def test_checkpoint_options_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="need checkpoint_dir"):
        dl.train("single", steps=2, checkpoint_every=1)
    with pytest.raises(ValueError, match="not 'single'"):
        dl.train("single", steps=2, checkpoint_dir=str(tmp_path), fail_at_step=1)
    dl.train("single", steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(CheckpointError, match="lr: saved 0.001, now 0.002"):
        dl.train("single", steps=3, lr=2e-3, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(CheckpointError, match="beyond steps=1"):
        dl.train("single", steps=1, checkpoint_dir=str(tmp_path), resume=True)
    fresh = dl.train("single", steps=1, checkpoint_dir=str(tmp_path / "new"), resume=True)
    assert fresh.results[0].info["checkpoint"]["resumed_from"] is None     # nothing to resume: from scratch
