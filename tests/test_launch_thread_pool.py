"""A launch after the notebook has computed: as a student runs it, with torch's default thread count (no
OMP_NUM_THREADS, which `make test` sets to 1 and so hid this). A forked rank inherited the parent's OpenMP
pool without its threads, and its first multi-threaded operation waited for them until the deadline
(world_size=1 on any machine: one rank gets every core; more ranks on a machine with more cores).

Each scenario runs in a fresh Python whose environment has no OMP_NUM_THREADS or MKL_NUM_THREADS."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import importlib, json, sys, time
import torch
import distlab as dl

launch_module = importlib.import_module("distlab.launch.parent")

def matmul():
    b = torch.randn(256, 256)
    return torch.get_num_threads(), float((b @ b).sum())

def launches(method):
    # (world size, threads per rank): as the launcher picks, then 2 ranks of 2 threads (4 cores' worth)
    report = []
    for world, threads in ((1, None), (2, None), (2, 2)):
        if threads:
            launch_module.threads_per_rank = lambda world_size: threads
        start = time.monotonic()
        try:
            run = dl.launch(matmul, world, start_method=method, output="quiet", timeout=12)
            outcome = [t for t, _ in run.results]
        except dl.LaunchError as err:
            outcome = str(err).splitlines()[0]
        report.append([world, outcome, round(time.monotonic() - start, 2)])
    return report

def exercises():
    report = []
    for name in ("tp_mlp", "tp_mlp", "vocab_parallel_cross_entropy"):
        result = dl.exercises.check(name, dl.exercises.reference(name), timeout=12, quiet=True)
        report.append([name, result.passed, result.problem])
    return report

if __name__ == "__main__":
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)          # a one-core machine: a pool to inherit all the same
    what = sys.argv[1]
    if what == "exercises":               # the first check computes the expected values here
        print(json.dumps(exercises()))
    else:
        a = torch.randn(512, 512)
        a @ a                             # the notebook computed something: torch's thread pool is up
        print(json.dumps(launches(what)))
"""


def _run(what: str) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, what], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["fork"] + [pytest.param(m, marks=pytest.mark.slow)   # ~10 s each:
                                                 for m in ("spawn", "forkserver")])      # ranks import torch
def test_a_launch_after_the_notebook_used_torch_threads_does_not_hang(method):
    report = _run(method)
    hung = [entry for entry in report if not isinstance(entry[1], list)]
    assert not hung, f"{method}: {hung}"
    assert [threads for _, threads, _ in report][-1] == [2, 2]       # the pool really was multi-threaded


def test_an_exercise_checked_twice_and_then_another_passes():
    """As the issue saw it: the first check passed, the second said a correct answer hung."""
    report = _run("exercises")
    assert all(passed for _, passed, _ in report), report
