"""A launch leaves no process behind, whatever ends it: not the ranks, not what they started. Each rank here
starts three kinds of process: one in its process group, one in a session of its own, and a daemon that
double-forked away (setsid in a child that then exits, so its parent is no rank and it is in no rank's group).
All must end when the function returns, when it raises, and within seconds of the parent's death by
SIGKILL under every start method (before: forkserver ranks lived on for minutes, retrying the dead parent's
store; under fork and spawn the ranks died but what they started did not).

Each scenario runs in a fresh Python (the script below) that the test may kill; every process it started
carries a marker in its environment, which is how the test finds what is left."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from _processes import describe, kill_marked, wait_until_gone

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import os, subprocess, sys, time
import distlab as dl

DAEMON = ("import subprocess; p = subprocess.Popen(['sleep', '45'], start_new_session=True, "
          "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")

def start_processes(folder, then):
    subprocess.Popen(["sleep", "45"])                                     # in the rank's process group
    subprocess.Popen(["sleep", "45"], start_new_session=True)             # a session of its own
    subprocess.run([sys.executable, "-c", DAEMON], check=True, stdout=subprocess.DEVNULL)  # double fork
    open(os.path.join(folder, f"rank{dl.rank()}"), "w").close()           # all three started
    if then == "raise":
        raise RuntimeError("this rank fails")
    if then == "sleep":
        time.sleep(60)                                                    # until the test kills the parent
    return 0

if __name__ == "__main__":
    method, folder, then = sys.argv[1:4]
    try:
        dl.launch(start_processes, 2, args=(folder, then), start_method=method, output="quiet", timeout=90)
    except dl.LaunchError:
        pass
    print("returned", flush=True)
"""

SECONDS = 10.0      # how long the processes may take to end (they take well under a second)


def _script(method: str, folder: Path, then: str, marker: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DISTLAB_TEST_MARKER": marker}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, method, str(folder), then], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_ranks(folder: Path, proc: subprocess.Popen, seconds: float) -> None:
    end = time.monotonic() + seconds
    while len(list(folder.glob("rank*"))) < 2:
        assert proc.poll() is None, f"the script ended early: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < end, "the ranks did not start their processes in time"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, marker: str) -> None:
    proc.kill()
    proc.communicate()
    kill_marked(marker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc")
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_ranks_and_their_processes_end_within_seconds_of_the_parent_being_killed(method, tmp_path):
    marker = f"distlab-test-{uuid.uuid4().hex}"
    proc = _script(method, tmp_path, "sleep", marker)
    try:
        _wait_for_ranks(tmp_path, proc, 60)
        proc.kill()                                   # the notebook's kernel dies
        proc.wait()
        killed = time.monotonic()
        left = wait_until_gone(marker, SECONDS)
        took = time.monotonic() - killed
        described = describe(left)
    finally:
        _finish(proc, marker)
    assert left == [], f"{method}: alive {took:.1f} s after the parent's death: {described}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc")
@pytest.mark.parametrize("then", ["return", "raise"])
def test_what_a_rank_started_ends_when_the_launch_does(then, tmp_path):
    marker = f"distlab-test-{uuid.uuid4().hex}"
    proc = _script("fork", tmp_path, then, marker)
    try:
        out, err = proc.communicate(timeout=60)
        assert "returned" in out, err[-3000:]
        left = wait_until_gone(marker, 2.0)           # the rank ended them before it exited
        described = describe(left)
    finally:
        _finish(proc, marker)
    assert left == [], f"a rank that chose to {then} left processes behind: {described}"


_TREE = r"""
import importlib.util, os, subprocess, sys
spec = importlib.util.spec_from_file_location("lifeline", sys.argv[1])     # alone: no torch to import
lifeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lifeline)
DAEMON = "import subprocess; subprocess.Popen(['sleep', '30'], start_new_session=True)"
assert lifeline.become_subreaper()
subprocess.Popen(["sleep", "30"])
subprocess.run([sys.executable, "-c", DAEMON])            # its sleep is re-parented to this subreaper
walked = sorted(lifeline.descendants())
lifeline.os.path.exists = lambda path: False          # as on a kernel without per-thread children lists
scanned = sorted(lifeline.descendants())
lifeline.end_descendants()
print(len(walked), walked == scanned, lifeline.descendants())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc")
def test_a_subreaper_keeps_a_daemon_in_its_tree_and_ends_it():
    done = subprocess.run([sys.executable, "-c", _TREE, str(ROOT / "distlab" / "launch" / "lifeline.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "True", "[]"], done.stderr[-3000:]
