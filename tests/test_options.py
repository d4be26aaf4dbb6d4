"""Every option of `dl.train` and the CLI is checked once, in the parent, before any rank starts (issue 19,
item 6, and item 1's empty checkpoint_dir): its type and range (`distlab.rules`, one table per concern),
then what the options say together; a value that cannot be served is a ValueError that says what to pass
instead, and for the CLI one line, ``distlab: error: ...``, exit status 2. Nothing here trains: a tripwire
fails the test if anything starts a rank or a run.

Also: a restart that would fail the same way again is not made (disk full, bad input found in a rank),
the heartbeat leaves no part behind, a world the machine cannot hold is refused with the reason, and a
launch refuses an empty host.
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import sys

import pytest

import distlab as dl
from _processes import child_pids
from distlab.cli import main

CK = "<ck>"        # stands for the test's own checkpoint directory


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if anything starts a rank or trains (``single`` trains in this process)."""
    def tripwire(*args, **kwargs):
        raise AssertionError("training started: the error should have come before it")
    runner = importlib.import_module("distlab.strategies.runner")   # where dl.train's run goes down
    monkeypatch.setattr(sys.modules["distlab.launch"], "launch", tripwire)
    monkeypatch.setattr(runner, "_launched", tripwire)
    monkeypatch.setattr(runner, "_single", tripwire)


def _with_dir(kwargs: dict, directory) -> dict:
    return {k: (v.replace(CK, str(directory)) if isinstance(v, str) else v) for k, v in kwargs.items()}


NAN, INF = math.nan, math.inf
BAD = [
    # the list: silently wrong training
    (dict(clip=-1), r"clip=-1: clip must be a positive finite number \(e.g. clip=1.0\), or None \(no "
                    r"clipping\)"),
    (dict(clip=NAN), "clip must be a positive finite number"),
    (dict(clip=0), "clip must be a positive finite number"),
    (dict(clip=INF), "clip must be a positive finite number"),
    (dict(checkpoint_dir=CK, async_save="no"), "async_save='no': async_save must be True or False"),
    (dict(fail_at_step=-1), "fail_at_step must be an integer >= 0"),
    (dict(checkpoint_dir=f"{CK}/new", checkpoint_every=1, max_restarts=1, shrink=[5]), "grow the run to 5"),
    (dict(steps=True), r"steps=True: steps must be a positive integer \(e.g. steps=20\)"),
    # the list: found only inside the ranks
    (dict(steps=2.5), "steps must be a positive integer"),
    (dict(lr=-1), r"lr=-1: lr must be a positive finite number \(e.g. lr=0.001\)"),
    (dict(lr=NAN), "lr must be a positive finite number"),
    (dict(seed=2**70), "seed must be an integer from 0 to 4294967295"),
    (dict(weight_decay=-5), "weight_decay must be a finite number >= 0"),
    (dict(fail_at_step=1, fail_rank=99), "fail_rank=99 is not a rank of world_size=2: pass a rank from 0"),
    (dict(checkpoint_dir=CK, resume=999), "resume=999: checkpoint_dir .* has no checkpoint of step 999; "
                                          r"it holds checkpoints of steps \[2\]"),
    (dict(checkpoint_dir=CK, keep_last=0), "keep_last must be a positive integer"),
    (dict(checkpoint_dir=CK, keep_last=-1), "keep_last must be a positive integer"),
    (dict(checkpoint_dir=CK, keep_last="2"), "keep_last='2': keep_last must be a positive integer"),
    (dict(strategy=None), "strategy=None: strategy must be a non-empty string"),
    # item 1: an empty checkpoint_dir ('.' only when said)
    (dict(checkpoint_dir=""), "checkpoint_dir='': checkpoint_dir must be a directory .*'.' for the current"),
    (dict(checkpoint_dir="  "), "checkpoint_dir must be a directory"),
    # the spec's other fields and train's own arguments: bools, NaN, inf, strings
    (dict(global_batch=True), "global_batch must be a positive integer"),
    (dict(grad_accum=2.0), "grad_accum must be a positive integer"),
    (dict(lr=True), "lr must be a positive finite number"),
    (dict(lr=INF), "lr must be a positive finite number"),
    (dict(seed=-1), "seed must be an integer from 0"),
    (dict(seed=True), "seed must be an integer from 0"),
    (dict(weight_decay=NAN), "weight_decay must be a finite number >= 0"),
    (dict(model=None), "model must be a preset name or a dl.theory.ModelPreset"),
    (dict(optimizer=None), "optimizer must be one of 'adamw', 'adam' or 'sgd'"),
    (dict(world_size=True), "world_size must be a positive integer"),
    (dict(world_size=2.0), "world_size must be a positive integer"),
    (dict(output="loud"), "output must be one of 'quiet', 'ordered' or 'live'"),
    (dict(timeout=NAN), "timeout must be a positive finite number"),
    (dict(timeout="10"), "timeout must be a positive finite number"),
    (dict(progress="yes"), "progress must be True or False"),
    (dict(max_restarts=True), "max_restarts must be an integer >= 0"),
    (dict(options=[("bucket_mb", 1)]), "options must be a dict"),
    # the checkpoint's options, and what they say together
    (dict(checkpoint_dir=5), "checkpoint_dir must be a directory"),
    (dict(checkpoint_dir=CK, checkpoint_every=2.0), "checkpoint_every must be a positive integer"),
    (dict(checkpoint_dir=CK, resume="last"), "resume must be True .*a step number, or False"),
    (dict(checkpoint_dir=CK, resume=1.5), "resume must be True"),
    (dict(checkpoint_dir=CK, resume=2, steps=1), "resume=2 is beyond steps=1"),
    (dict(fail_at_step=20), r"fail_at_step=20 is never reached: the steps are 0 \.\. 19"),
    (dict(fail_at_step=3, fail_in="save", checkpoint_dir=CK, checkpoint_every=2), r"never saves: it saves "
                                                                                  r"steps \[2, 4, 6"),
    (dict(fail_at_step=2, fail_in="save"), "never saves: it saves none"),
    (dict(fail_at_step=1, fail_in="later"), "fail_in must be 'step' or 'save'"),
    (dict(fail_rank=1), "fail_rank only says how fail_at_step kills a rank: pass fail_at_step"),
    (dict(fail_at_step=True), "fail_at_step must be an integer >= 0"),
    (dict(checkpoint_dir=CK, heartbeat=1), "heartbeat must be True or False"),
    (dict(checkpoint_dir=f"{CK}/new", checkpoint_every=1, max_restarts=1, shrink=0), "shrink must be True"),
    # the loop's and the numerics' options
    (dict(memory_limit=True), "memory_limit must be a number of bytes"),
    (dict(recompute=1), "recompute must be one of True, 'full', 'selective' or False"),
    (dict(loss_scale=True), "loss_scale must be a positive finite number"),
    (dict(growth_interval=2.5), "growth_interval must be a positive integer"),
    (dict(spike_factor=NAN), "spike_factor must be a finite number > 1"),
    (dict(nan_at_step=20), r"nan_at_step=20 is never reached: the steps are 0 \.\. 19"),
    (dict(nan_at_step=1, nan_rank=True), "nan_rank must be an integer >= 0"),
    # each family's options
    (dict(bucket_mb=NAN), "bucket_mb must be a positive finite number"),
    (dict(bucket_mb=True), "bucket_mb must be a positive finite number"),
    (dict(overlap="no"), "overlap must be True or False"),
    (dict(naive=1), "naive must be True or False"),
    (dict(no_sync="x"), "no_sync must be True or False"),
    (dict(compression="topk"), "compression must be 'none' or 'powersgd'"),
    (dict(compression="powersgd", powersgd_rank=True), "powersgd_rank must be a positive integer"),
    (dict(error_feedback=0), "error_feedback must be True or False"),
    (dict(strategy="zero2", max_inflight=0), "max_inflight must be a positive integer"),
    (dict(strategy="zero3", prefetch="yes"), "prefetch must be True or False"),
    (dict(strategy="fsdp", hsdp=True), "hsdp must be a positive integer"),
    (dict(strategy="fsdp", param_dtype="fp8"), "param_dtype must be 'bf16' or 'fp16'"),
    (dict(strategy="fsdp", reshard_after_forward="no"), "reshard_after_forward must be True or False"),
    (dict(strategy="tp", sequence_parallel=1), "sequence_parallel must be True or False"),
    (dict(strategy="pp-1f1b", microbatches=0), "microbatches must be a positive integer"),
    (dict(strategy="pp-1f1b", microbatches=2.0), "microbatches must be a positive integer"),
    (dict(strategy="pp-interleaved", virtual="2"), "virtual must be a positive integer"),
    (dict(strategy="cp-ring", dp=1.0), "dp must be a positive integer"),
    (dict(strategy="cp-ring", zigzag=1), "zigzag must be True or False"),
    (dict(strategy="ep", model="gpt-moe-tiny", dp=True), "dp must be a positive integer"),
    (dict(strategy="3d:dp=2", microbatches=0), "microbatches must be a positive integer"),
    (dict(strategy="3d:dp=2,microbatches=0"), "microbatches must be a positive integer"),
    (dict(strategy="3d:dp=2", dp=2.5), "dp must be a positive integer"),
    (dict(strategy="3d:dp=2", sp=1), "sp must be True or False"),
    (dict(strategy="3d:dp=2,sp=maybe"), "sp='maybe' must be true or false"),
    (dict(strategy="3d:dp=2", zero=True), "zero must be one of 0, 1, 2 or 3"),
    (dict(strategy="3d:dp=2", zero=2), "the mesh offers ZeRO-1 over dp"),
    (dict(strategy="3d:dp=2", dp=None, tp=None), "dp and tp are both None"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=lambda v: repr(v)[:60] if isinstance(v, dict) else "")
def test_bad_values_are_refused_before_anything_starts(kwargs, message, tmp_path, no_training):
    (tmp_path / "step_2").mkdir()                          # a complete checkpoint of step 2
    (tmp_path / "step_2" / "manifest.json").write_text("{}")
    kw = _with_dir({"strategy": "ddp", "world_size": 2, **kwargs}, tmp_path)
    with pytest.raises(ValueError, match=message):
        dl.train(**kw)
    with pytest.raises(ValueError, match=message):         # check_only: the same refusal, nothing run
        dl.train(**kw, check_only=True)


def test_what_is_said_explicitly_passes(tmp_path, monkeypatch, no_training):
    """'.' (said, not an empty string), a checkpoint that exists, a shrink that shrinks, a planted failure
    that fires, numbers of either type where a number is asked: accepted, and nothing trains."""
    from pathlib import Path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "manifest.json").write_text("{}")
    for kw in (dict(checkpoint_dir="."), dict(checkpoint_dir=Path("")), dict(checkpoint_dir=".", resume=2),
               dict(lr=1, clip=2, weight_decay=0, bucket_mb=1), dict(fail_at_step=0, fail_rank=1),
               dict(checkpoint_dir="ck", checkpoint_every=2, fail_at_step=4, fail_in="save", keep_last=1),
               dict(checkpoint_dir="new", checkpoint_every=2, max_restarts=2, shrink=[1]),
               dict(seed=2**32 - 1, memory_limit="64MB", recompute="selective", compression=None)):
        assert dl.train("ddp", world_size=2, steps=6, check_only=True, **kw) is None
    # the largest seed really is one every step of the data can be drawn from
    batch = dl.models.dataset_for("gpt-tiny", 2**32 - 1).batch(10**6, 2)
    assert batch[0].shape[0] == 2


def test_every_option_and_argument_has_a_rule():
    """Every option of every strategy is a field of the typed spec, with a rule and a docstring; every
    parameter of dl.train is a keyword of the spec or one of its own arguments (with a rule)."""
    import dataclasses

    from distlab.strategies import names, options
    from distlab.strategies.parse import ALIASES, TOP
    from distlab.strategies.spec import CONCERNS, WHERE, TrainSpec
    from distlab.train import ARGUMENTS
    for name in names():
        missing = set(options(name)) - set(WHERE) - set(ALIASES)
        assert not missing, f"{name}: options that are no field of the spec: {missing}"
    for cls in (TrainSpec, *CONCERNS.values()):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no docstring"
            assert f.name in CONCERNS or f.metadata.get("rule"), f"{cls.__name__}.{f.name} has no rule"
    given = set(inspect.signature(dl.train).parameters) - {"more_options", "strategy"}
    assert given <= set(TOP) | set(WHERE) | set(ARGUMENTS)


# -- the command: exit 2, one line, before anything starts ---------------------------------------------
CLI_BAD = [
    (["--clip", "-1"], "clip=-1.0: clip must be a positive finite number"),
    (["--clip", "nan"], "clip must be a positive finite number"),
    (["--clip", "0"], "clip must be a positive finite number"),
    (["--strategy", "ddp", "--world-size", "2", "--lr", "-1"], "lr must be a positive finite number"),
    (["--lr", "nan"], "lr must be a positive finite number"),
    (["--seed", str(2**70)], "seed must be an integer from 0 to 4294967295"),
    (["--weight-decay", "-5"], "weight_decay must be a finite number >= 0"),
    (["--strategy", "ddp", "--world-size", "2", "--option", "fail_at_step=1", "--option", "fail_rank=99"],
     "fail_rank=99 is not a rank of world_size=2"),
    (["--strategy", "ddp", "--world-size", "2", "--checkpoint-dir", CK, "--option", "resume=999"],
     "has no checkpoint of step 999"),
    (["--checkpoint-dir", CK, "--keep-last", "0"], "keep_last must be a positive integer"),
    (["--checkpoint-dir", CK, "--keep-last", "-1"], "keep_last must be a positive integer"),
    (["--checkpoint-dir", CK, "--option", 'keep_last="2"'], "keep_last='2'"),
    (["--checkpoint-dir", CK, "--option", 'async_save="no"'], "async_save must be True or False"),
    (["--checkpoint-dir", ""], "checkpoint_dir='': checkpoint_dir must be a directory"),
    (["--strategy", "ddp", "--world-size", "2", "--checkpoint-dir", CK, "--checkpoint-every", "1",
      "--max-restarts", "1", "--shrink", "abc"], "--shrink expects world sizes like 3,2"),
    (["--strategy", "ddp", "--world-size", "2", "--checkpoint-dir", f"{CK}/new", "--checkpoint-every", "1",
      "--max-restarts", "1", "--shrink", "5"], "would grow the run to 5 ranks"),
    (["--strategy", "ddp", "--world-size", "2", "--max-restarts", "-1"], "max_restarts must be an integer"),
    (["--strategy", "ddp", "--world-size", "2", "--option", "overlap=1"], "overlap must be True or False"),
    (["--strategy", "ddp", "--world-size", "2", "--json", f"{CK}/missing/out.json"],
     r"--json '.*out.json' cannot be written \(No such file or directory\)"),
    (["--strategy", "ddp", "--world-size", "2", "--json", CK], r"cannot be written \(Is a directory\)"),
]


def _shown(value) -> str:
    return " ".join(value)[-50:] if isinstance(value, list) else "-"


@pytest.mark.parametrize("argv, says", CLI_BAD, ids=_shown)
def test_cli_value_errors_are_one_line_exit_2_before_anything_starts(argv, says, tmp_path, capsys,
                                                                     no_training):
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "manifest.json").write_text("{}")
    argv = [a.replace(CK, str(tmp_path)) for a in argv]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distlab: error: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(says, err), err
    assert not (tmp_path / "missing").exists()


# -- the machine: more ranks than it holds -------------------------------------------------------------
def test_a_world_the_machine_cannot_hold_is_refused_with_the_reason(monkeypatch, capsys, no_training):
    """Refused by memory (each rank a process with torch loaded), not left to the open-files limit: with a
    generous ulimit -n the old code forked them all."""
    import resource
    real, free = resource.getrlimit, getattr(sys.modules["distlab.train"], "available_memory", None)
    monkeypatch.setattr(resource, "getrlimit", lambda w: (10**6, 10**6) if w in (
        resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC) else real(w))
    monkeypatch.setattr(sys.modules["distlab.train"], "available_memory", lambda: 2**30, raising=False)
    message = (r"world_size=16 ranks need at least 16 x 128 MiB = 2\.0 GiB of memory \(each rank is a "
               r"process with torch loaded\), but this machine has 1\.0 GiB available: use at most 8 ranks")
    with pytest.raises(ValueError, match=message):
        dl.train("ddp", world_size=16, check_only=True)
    assert main(["train", "--strategy", "ddp", "--world-size", "16"]) == 2
    assert "use at most 8 ranks" in capsys.readouterr().err
    assert dl.train("ddp", world_size=8, check_only=True) is None
    assert free is None or free() is None or free() > 0          # this machine's own, read for real


# -- restarts: not for what every attempt would meet again ---------------------------------------------
def _failure(last_line: str) -> dl.LaunchError:
    text = f'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\n{last_line}'
    return dl.LaunchError(f"rank 1 failed:\n\n{text}", rank=1, failures={1: text})


@pytest.mark.parametrize("last_line, retried", [
    ("OSError: [Errno 28] No space left on device: 'ck/step_4.tmp/rank_1.pt'", False),
    ("PermissionError: [Errno 13] Permission denied: 'ck/step_4.tmp'", False),
    ("OSError: [Errno 30] Read-only file system: 'ck/.heartbeat.json.part'", False),
    ("ValueError: fail_in must be 'step' or 'save', got 'x'", False),
    ("TypeError: unsupported operand type(s)", False),
    ("distlab.checkpoint.store.CheckpointError: checkpoint step 2 was saved by a different run", False),
    ("distlab.memory_budget.MemoryLimitExceeded: out of memory in forward of step 0", False),
    ("rank 1 was killed by SIGKILL before returning (out of memory, or a crash?)", True),
    ("RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242", True),
    ("OSError: [Errno 104] Connection reset by peer", True),
])
def test_restarts_are_made_only_for_failures_that_may_pass(last_line, retried, tmp_path, capfd):
    from distlab.strategies import restart
    from distlab.strategies import parse
    spec = parse("ddp", steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2, max_restarts=2)
    attempts = []

    def fails(s, n):
        attempts.append(n)
        raise _failure(last_line)

    with pytest.raises(dl.LaunchError) as err:
        restart.run(spec, restart.plan(spec, 2), fails)
    assert len(attempts) == (3 if retried else 1)
    assert len(err.value.restarts) == (2 if retried else 0)
    said = capfd.readouterr().err
    assert ("not restarting" in said) == (not retried), said


def test_a_full_disk_is_not_restarted_and_leaves_no_heartbeat_part(tmp_path, no_leaks, capfd):
    """Rank 0's heartbeat goes to a full disk (its part is /dev/full): one attempt, no restart, no part."""
    part = tmp_path / ".heartbeat.json.part"
    part.symlink_to("/dev/full")
    with pytest.raises(dl.LaunchError, match="No space left on device") as err:
        dl.train("ddp", world_size=2, steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                 max_restarts=2, timeout=120)
    assert err.value.restarts == []
    assert "not restarting after attempt 1: rank 0 failed with OSError" in capfd.readouterr().err
    assert not os.path.lexists(part) and sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_heartbeat_cleans_its_part(tmp_path):
    from distlab.strategies.faults import HEARTBEAT, beat, clear_heartbeat, heartbeat
    part = tmp_path / (HEARTBEAT + ".part")
    part.symlink_to("/dev/full")
    with pytest.raises(OSError, match="No space left"):
        beat(tmp_path, 3)
    assert not os.path.lexists(part) and heartbeat(tmp_path) is None
    beat(tmp_path, 3)
    assert heartbeat(tmp_path)["step"] == 3 and not part.exists()
    part.write_text("{")                        # a writer killed between its write and its rename
    clear_heartbeat(tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- the launcher: an empty host ---------------------------------------------------------------------
def _one():
    return 1


@pytest.mark.parametrize("host", ["", "  ", None])
def test_an_empty_host_is_refused_before_any_rank_starts(host):
    with pytest.raises(ValueError, match="host=.*: pass the address the rendezvous listens on, e.g. '127"):
        dl.launch(_one, 2, host=host, timeout=10, output="quiet")
    assert child_pids() == []
