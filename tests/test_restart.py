"""Automatic restart (`strategies.restart`) and asynchronous checkpoints (`distlab.checkpoint.background`),
end to end: a rank killed on purpose, the run relaunched from its newest complete checkpoint, the final
parameters compared with an uninterrupted run's (bit for bit on the same world size; within a stated
tolerance after an elastic shrink, whose reduction order differs)."""
import importlib

import pytest
import torch

import distlab as dl
from _processes import child_pids
from distlab.checkpoint import reshard, store

KW = dict(model="gpt-tiny", steps=6, global_batch=10, seed=0)      # 10 rows: uneven over 3 ranks


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_restart_on_the_same_world_size_is_bit_for_bit(tmp_path, no_leaks, capfd):
    plain = dl.train("zero2", world_size=3, **KW)
    report = dl.train("zero2", world_size=3, **KW, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                      fail_at_step=5, max_restarts=1)
    assert report.losses == plain.losses and _equal(report.params, plain.params)
    [r] = report.restarts
    assert (r.attempt, r.world_size, r.failed_rank, r.next_world_size) == (1, 3, 2, 3)
    assert (r.reached_step, r.resumed_from, r.lost_steps) == (5, 4, 1)      # steps 0..4 done, step_4 saved
    assert 0 < r.lost_seconds < 60 and "SIGKILL" in r.reason
    assert report.results[0].info["checkpoint"]["resumed_from"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4", "step_6"]   # no heartbeat
    err = capfd.readouterr().err
    assert "distlab: restart 1: attempt 1 on 3 ranks failed after step 5 (rank 2 was killed by SIGKILL" in err
    assert "relaunching on 3 ranks from checkpoint step 4: 1 step(s)" in err
    assert child_pids() == []


def test_elastic_shrink_reshards_and_matches_the_reference(tmp_path, no_leaks):
    """Rank 2 of 3 dies mid-save of step 4: the restart runs on 2 ranks from step_2 (resharded); the run
    equals the single-process reference within fp32 rounding of another reduction order."""
    ref = dl.train("single", world_size=1, **KW)
    report = dl.train("zero1", world_size=3, **KW, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                      fail_at_step=4, fail_in="save", max_restarts=1, shrink=True)
    [r] = report.restarts
    assert (r.world_size, r.next_world_size, r.reached_step, r.resumed_from, r.lost_steps) == (3, 2, 4, 2, 2)
    assert report.world_size == 2 and report.results[0].info["checkpoint"]["resumed_from"] == 2
    assert report.losses == pytest.approx(ref.losses, rel=1e-5, abs=1e-6)
    # Adam moves every element by about lr (1e-3) a step whatever its gradient's size, so an element whose
    # gradient is near zero can differ by a good part of a step after a change of reduction order (seen:
    # one element of 110k off by 1.07e-4 on an AMD EPYC, under 1e-4 on the CPU before it): every element
    # within one step (lr), at most 1 in 10,000 beyond 1e-5, and on average within 1e-7
    diffs = torch.cat([(report.params[k] - v).abs().flatten() for k, v in ref.params.items()])
    assert diffs.max() < 1e-3 and (diffs > 1e-5).sum() <= diffs.numel() // 10_000 and diffs.mean() < 1e-7
    assert dl.checkpoint.manifest(tmp_path)["world_size"] == 2


def test_async_save_equals_sync_and_survives_a_crash_during_its_write(tmp_path, no_leaks):
    """The background write is the same commit: the same checkpoints as a synchronous run; a rank killed
    while its background write is under way leaves the previous checkpoint whole; a restart from it is
    bit for bit; the run returns only once its last save is committed."""
    sync = dl.train("zero2", world_size=2, **KW, checkpoint_dir=str(tmp_path / "sync"), checkpoint_every=2)
    with pytest.raises(dl.LaunchError):
        dl.train("zero2", world_size=2, **KW, checkpoint_dir=str(tmp_path / "crash"), checkpoint_every=2,
                 async_save=True, fail_at_step=4, fail_in="save")
    crashed = tmp_path / "crash"
    assert store.steps(crashed) == [2] and store.verify(crashed, 2)["step"] == 2
    assert (crashed / "step_4.tmp").is_dir() and not (crashed / "step_4.tmp" / "manifest.json").exists()
    resumed = dl.train("zero2", world_size=2, **KW, checkpoint_dir=str(crashed), checkpoint_every=2,
                       async_save=True, resume=True)
    assert resumed.losses == sync.losses and _equal(resumed.params, sync.params)
    io = resumed.results[0].info["checkpoint_io"]
    assert io["mode"] == "async" and len(io["stall_s"]) == len(io["write_s"]) == 2      # steps 4 and 6
    assert store.steps(crashed) == [2, 4, 6]                  # the final save was waited for
    for step in (4, 6):                                       # and holds what the synchronous run saved
        a, b = reshard.consolidate(tmp_path / "sync", step), reshard.consolidate(crashed, step)
        assert _equal(a["params"], b["params"]) and torch.equal(a["losses"], b["losses"])


def test_restart_after_a_crash_in_an_async_write(tmp_path, no_leaks):
    plain = dl.train("ddp", world_size=2, **KW)
    report = dl.train("ddp", world_size=2, **KW, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                      async_save=True, fail_at_step=4, fail_in="save", fail_rank=0, max_restarts=2)
    [r] = report.restarts
    assert (r.failed_rank, r.resumed_from) == (0, 2)
    assert 4 <= r.reached_step <= 6 and r.lost_steps == r.reached_step - 2   # training went on meanwhile
    assert report.losses == plain.losses and _equal(report.params, plain.params)


def test_restart_options_are_refused_before_any_rank_starts(tmp_path):
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(ValueError, match="not 'single'"):
        dl.train("single", steps=2, max_restarts=1, **ck)
    with pytest.raises(ValueError, match="pass checkpoint_dir=... and checkpoint_every"):
        dl.train("ddp", world_size=2, steps=2, max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
        dl.train("ddp", world_size=2, steps=2, max_restarts=-1, **ck)
    with pytest.raises(ValueError, match="shrink must be True"):
        dl.train("ddp", world_size=2, steps=2, max_restarts=1, shrink=[0], **ck)
    with pytest.raises(ValueError, match="raise max_restarts to 2"):
        dl.train("ddp", world_size=3, steps=2, max_restarts=1, shrink=[2, 1], **ck)
    with pytest.raises(ValueError, match="pipeline stages"):     # a restart's layout is checked up front
        dl.train("pp-1f1b", world_size=4, model="mlp", steps=2, max_restarts=1, shrink=[5], **ck)
    with pytest.raises(ValueError, match="async_save and heartbeat need checkpoint_dir"):
        dl.train("ddp", world_size=2, steps=2, async_save=True)


def _die_on_rank_1():
    import os
    import signal
    if dl.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.zeros(100_000)                     # 400 kB: more than a pipe holds


def test_a_launch_after_a_dead_rank_forgets_its_descriptors(no_leaks):
    """A rank killed mid-launch closes its result pipe early; its descriptor number must still be forgotten,
    or the next launch's ranks close whatever reuses that number (once, rank 0's own result pipe: the
    restarted run hung sending its result)."""
    launch_module = importlib.import_module("distlab.launch.parent")
    for _ in range(2):
        with pytest.raises(dl.LaunchError, match="SIGKILL"):
            dl.launch(_die_on_rank_1, world_size=2, output="quiet", timeout=60)
        assert not launch_module._LIVE_FDS
    run = dl.launch(_ok, world_size=2, output="quiet", timeout=60)
    assert all(r.numel() == 100_000 for r in run.results)


def _ok():
    return torch.zeros(100_000)


def test_cli_flags_reach_train(monkeypatch, capsys):
    """``--max-restarts``, ``--shrink [SIZES]`` and ``--async-save`` arrive in `dl.train` as max_restarts,
    shrink and the async_save option; the restarts are printed."""
    from distlab import cli
    from distlab.strategies import restart
    seen = {}

    def fake_train(*args, **kwargs):
        seen.update(kwargs)
        report = dl.train("single", steps=1)
        report.restarts = [restart.Restart(1, 3, 2, "killed", 5, 4, 1, 0.5, 2)]
        return report

    monkeypatch.setattr(importlib.import_module("distlab.train"), "train", fake_train)
    base = ["train", "--strategy", "ddp", "--world-size", "3", "--checkpoint-dir", "ck",
            "--checkpoint-every", "2"]
    cli.main([*base, "--max-restarts", "2", "--shrink", "2,1", "--async-save"])
    assert seen["max_restarts"] == 2 and seen["shrink"] == [2, 1] and seen["async_save"] is True
    out = capsys.readouterr().out
    assert "restart 1: 3 -> 2 ranks, resumed from step 4, lost 1 step(s) and 0.50 s" in out
    cli.main([*base, "--max-restarts", "1", "--shrink"])
    assert seen["shrink"] is True
    capsys.readouterr()
    assert cli.main(["train", "--strategy", "ddp", "--max-restarts", "1", "--shrink", "two"]) == 2
    assert capsys.readouterr().err.startswith("distlab: error: --shrink expects world sizes like 3,2")


def test_when_every_attempt_fails_the_last_error_carries_the_restarts(tmp_path, capfd):
    """No processes: a stand-in launch that always fails. The last attempt's LaunchError is raised with
    ``.restarts`` (one per relaunch), each attempt after the first asked to resume and freed of faults."""
    from distlab.strategies import restart
    from distlab.strategies import parse
    spec = parse("ddp", steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2, fail_at_step=1,
                 max_restarts=2, shrink=True)
    seen = []

    def always_fails(s, n):
        seen.append((n, s.checkpoint))
        raise dl.LaunchError("rank 1 failed:\n\nrank 1 was killed by SIGKILL", rank=1,
                             failures={1: "rank 1 was killed by SIGKILL"})

    with pytest.raises(dl.LaunchError) as err:
        restart.run(spec, restart.plan(spec, 3), always_fails)
    assert [n for n, _ in seen] == [3, 2, 1]
    assert seen[0][1].fail_at_step == 1 and seen[0][1].heartbeat is True
    assert all(o.fail_at_step is None and o.resume is False for _, o in seen[1:])   # nothing saved yet
    assert [(r.attempt, r.world_size, r.next_world_size, r.resumed_from) for r in err.value.restarts] == [
        (1, 3, 2, 0), (2, 2, 1, 0)]
    assert err.value.restarts[0].reason == "rank 1 was killed by SIGKILL"
    assert capfd.readouterr().err.count("distlab: restart") == 2


def test_restart_refuses_a_checkpoint_dir_holding_an_earlier_run_and_shrink_without_restarts(tmp_path):
    """An earlier run's newer checkpoint would be taken for this run's: refused before any rank starts."""
    (tmp_path / "step_6").mkdir()
    with pytest.raises(ValueError, match="earlier run"):
        dl.train("ddp", world_size=2, steps=4, max_restarts=1, checkpoint_dir=str(tmp_path),
                 checkpoint_every=2)
    with pytest.raises(ValueError, match="max_restarts=0 never restarts"):
        dl.train("ddp", world_size=2, steps=4, shrink=True, checkpoint_dir=str(tmp_path / "new"),
                 checkpoint_every=2)
