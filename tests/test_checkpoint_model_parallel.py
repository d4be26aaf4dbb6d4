"""Checkpoint and resume for the model-parallel strategies (tp, tp-sp, pp-*, 3d): bit-exact, with each
rank writing what it holds and the dp replicas of a 3d stage writing their shared state once."""
import pytest
import torch

import distlab as dl
from distlab.checkpoint import CheckpointError

from _processes import child_pids

CASES = [  # (strategy, world size, options)
    ("tp", 2, {}),
    ("tp-sp", 2, {}),
    ("pp-1f1b", 2, {}),
    ("pp-interleaved", 2, {"virtual": 2}),
    ("3d:dp=2,tp=1,pp=2", 4, {}),                 # DDP over dp: each stage's state written once
    ("3d:dp=2,tp=2,pp=1,zero=1", 4, {}),          # ZeRO-1 over dp: every rank writes its optimizer shard
]


def assert_same_run(a, b):
    assert a.losses == b.losses and len(a.losses) == len(b.losses)
    assert a.params.keys() == b.params.keys()
    for k, v in a.params.items():
        assert torch.equal(v, b.params[k]), k


@pytest.mark.parametrize("strategy, world, options", CASES, ids=[c[0] for c in CASES])
def test_resume_reproduces_the_uninterrupted_run_exactly(strategy, world, options, tmp_path):
    """4 steps saving at 2 and 4; a run resumed from step 2 takes steps 2-3 only and ends with the
    same losses and parameters, bit for bit."""
    kw = dict(world_size=world, steps=4, model="gpt-small", global_batch=8, checkpoint_dir=str(tmp_path),
              checkpoint_every=2, **options)
    full = dl.train(strategy, **kw)
    assert dl.checkpoint.steps(tmp_path) == [2, 4]
    resumed = dl.train(strategy, **kw, resume=2)
    assert all(r.info["checkpoint"] == {"resumed_from": 2, "saved": [4]} for r in resumed.results)
    assert len(resumed.trace.select("mark", rank=0, name="step")) == 2              # steps 2 and 3 only
    assert_same_run(full, resumed)

    shards = dl.checkpoint.manifest(tmp_path)["shards"]
    sizes = [s["bytes"] for s in shards]
    if strategy.startswith(("tp", "pp")):              # nothing replicated: every rank writes its own part
        assert all(s["replicated_from"] is None for s in shards) and min(sizes) > 10_000
    elif "zero=1" in strategy:                         # dp pairs (0, 2), (1, 3) share a model copy
        assert [s["replicated_from"] for s in shards] == [0, 1, 0, 1]
        assert min(sizes) > 10_000                     # ...but each writes its own optimizer shard
    else:                                              # DDP: dp rank 1 of each stage writes its losses only
        assert [s["replicated_from"] for s in shards] == [0, 1, 0, 1]
        assert max(sizes[2:]) < 5_000 < min(sizes[:2])


def test_killed_mesh_rank_resumes_to_the_uninterrupted_result(tmp_path, no_leaks):
    """SIGKILL the last rank of a 2x1x2 mesh at the start of step 3: the launch fails naming it;
    the checkpoint of step 2 is intact and a resumed run matches one that never failed."""
    kw = dict(world_size=4, steps=4, model="gpt-small", global_batch=8)
    plain = dl.train("3d:dp=2,tp=1,pp=2", **kw)
    with pytest.raises(dl.LaunchError) as err:
        dl.train("3d:dp=2,tp=1,pp=2", **kw, checkpoint_dir=str(tmp_path), checkpoint_every=2, fail_at_step=3)
    assert err.value.rank == 3 and "SIGKILL" in str(err.value)
    assert child_pids() == []
    assert dl.checkpoint.steps(tmp_path) == [2]
    resumed = dl.train("3d:dp=2,tp=1,pp=2", **kw, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                       resume=True)
    assert resumed.results[-1].info["checkpoint"] == {"resumed_from": 2, "saved": [4]}
    assert_same_run(plain, resumed)


def test_resume_under_another_layout_still_refuses_another_run(tmp_path):
    """A layout may change on resume (that reshards); the run may not: another learning rate or another
    model is refused, naming the difference."""
    kw = dict(world_size=4, steps=2, checkpoint_dir=str(tmp_path))
    dl.train("3d:dp=2,tp=1,pp=2", **kw, checkpoint_every=1, zero=1)
    with pytest.raises(dl.LaunchError, match="lr: saved 0.001, now 0.002"):
        dl.train("3d:dp=1,tp=2,pp=2", **kw, resume=True, lr=2e-3)
    with pytest.raises(dl.LaunchError, match="model: saved 'gpt-tiny', now 'gpt-small'"):
        dl.train("tp", **kw, resume=True, model="gpt-small")
    with pytest.raises(CheckpointError, match="complete steps: \\[1, 2\\]"):
        dl.checkpoint.consolidate(tmp_path, 3)
