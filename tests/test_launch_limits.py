"""Input a launch cannot serve is refused before any rank starts, with what to change: timeouts that are
not a finite number, more ranks than the process may open files or start processes for, a world size
that disagrees with torchrun's, pipelines with more stages than the model has pieces; and an IPv6
loopback rendezvous simply works."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from _processes import child_pids


def _sum_of_ones():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), "10", -1.0, True])
def test_timeouts_that_are_not_a_finite_positive_number_are_refused(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        dl.launch(_sum_of_ones, 2, timeout=timeout)
    assert child_pids() == []


def test_more_ranks_than_the_limits_allow_are_refused_up_front(monkeypatch):
    real = resource.getrlimit

    def limits(which):
        if which == resource.RLIMIT_NOFILE:
            return (256, 256)
        if which == resource.RLIMIT_NPROC:
            return (100, 100)
        return real(which)
    monkeypatch.setattr(resource, "getrlimit", limits)
    with pytest.raises(ValueError, match=r"world_size=64 needs about 448 open files.*is 256.*ulimit -n"):
        dl.launch(_sum_of_ones, 64)
    monkeypatch.setattr(resource, "getrlimit", lambda w: (10**6, 10**6) if w == resource.RLIMIT_NOFILE
                        else (100, 100))
    with pytest.raises(ValueError, match=r"world_size=120 ranks exceed this user's process limit \(100\)"):
        dl.launch(_sum_of_ones, 120)
    assert child_pids() == []


def test_starting_the_ranks_counts_against_the_deadline(monkeypatch):
    import importlib
    import time
    import types
    launch_module = importlib.import_module("distlab.launch.parent")
    clock = iter(range(0, 10**6, 100))                       # every look at the clock: 100 s later
    monkeypatch.setattr(launch_module, "time", types.SimpleNamespace(
        perf_counter=time.perf_counter, monotonic=lambda: float(next(clock))))
    with pytest.raises(dl.LaunchError, match="deadline passed while starting the ranks"):
        dl.launch(_sum_of_ones, 3, timeout=150, output="quiet")
    assert child_pids() == []


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_ipv6_loopback_rendezvous_works(method):
    run = dl.launch(_sum_of_ones, 2, host="::1", start_method=method, output="quiet", timeout=120)
    assert run.results == [2.0, 2.0]


@pytest.mark.parametrize("strategy, world, message", [
    ("pp-1f1b", 5, r"5 pipeline stages but model 'gpt-tiny' has only 4 pieces.*at most 4 stages"),
    ("pp-interleaved", 3, r"6 pipeline stages \(2 per rank\).*smaller virtual"),
    ("3d:dp=1,tp=1,pp=5", 5, r"5 pipeline stages.*model='gpt-small'"),
])
def test_pipeline_stages_beyond_the_model_depth_say_what_to_change(strategy, world, message):
    with pytest.raises(ValueError, match=message):
        dl.train(strategy, world_size=world, steps=1)
    assert child_pids() == []


def test_strategy_options_are_checked_before_forking():
    with pytest.raises(ValueError, match="bucket_mb must be a positive"):
        dl.train("ddp", world_size=2, steps=1, bucket_mb=-1)
    with pytest.raises(ValueError, match="64 microbatches need at least 64 rows"):
        dl.train("pp-1f1b", world_size=2, steps=1, microbatches=64)
    assert child_pids() == []


def test_checkpoints_need_a_torch_whose_weights_only_load_is_safe(tmp_path, monkeypatch):
    dl.checkpoint.save(tmp_path, 1, {"x": torch.ones(2)})
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(dl.checkpoint.CheckpointError, match=r"needs torch >= 2.6 \(this is 2.5.1\).*CVE"):
        dl.checkpoint.load(tmp_path)


def test_under_torchrun_a_different_world_size_is_refused(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import distlab as dl\n"
                      "dl.launch(lambda: 0, world_size=3)\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1",          # the script in tmp_path imports this checkout
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(dl.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "WORLD_SIZE=2, but world_size=3: pass world_size=2" in done.stderr
