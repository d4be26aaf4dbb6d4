"""Failures a user causes at the worst moment: Ctrl-C while ranks start, a second Ctrl-C while they are
shut down, the parent killed while spawned ranks boot, a rank that starts its own subprocesses.
Each scenario runs in a fresh Python process (a script below), so an escaped KeyboardInterrupt or an
orphan cannot disturb pytest; every process it started is found through a marker in its environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from _processes import kill_marked, marked, wait_until_gone

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, os, signal, sys, threading, time
sys.path.insert(0, os.path.join(os.environ["DISTLAB_ROOT"], "tests"))
import distlab as dl
from _processes import child_pids, open_fds

def sleeps(seconds, stubborn):
    if not stubborn:
        time.sleep(seconds)
        return
    # makes shutdown wait out its grace period: SIGTERM ignored, and the GIL held in C (a libc sleep
    # through PyDLL), so the rank's lifeline watcher cannot run either
    import ctypes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctypes.PyDLL(None).sleep(int(seconds))

def grandchild():
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return 1

mode, arg = sys.argv[1], float(sys.argv[2])
dl.launch(lambda: 0, 2, output="quiet")                   # warm up (imports, TCPStore singletons)
fds = open_fds()
if mode == "early":            # Ctrl-C at many moments of the first ~60 ms of a launch
    caught, n = 0, int(arg)
    for i in range(n):
        timer = threading.Timer(0.004 * (i + 1), os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            dl.launch(sleeps, 3, args=(30, False), output="quiet", timeout=60)
        except KeyboardInterrupt:
            caught += 1
        timer.join()
    print(json.dumps({"caught": caught, "children": child_pids(), "fds": sorted(open_fds() - fds)}))
elif mode == "soak":           # Ctrl-C at random moments of many launches of 1 to 3 ranks
    import random
    rng, caught, n = random.Random(0), 0, int(arg)
    for i in range(n):
        timer = threading.Timer(rng.uniform(0, 0.15), os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            dl.launch(sleeps, rng.choice([1, 2, 3]), args=(30, False), output="quiet", timeout=60)
        except KeyboardInterrupt:
            caught += 1
        timer.join()
    print(json.dumps({"caught": caught, "children": child_pids(), "fds": sorted(open_fds() - fds)}))
elif mode == "twice":          # a second Ctrl-C while the first one's shutdown waits for the ranks
    for delay in (1.5, 2.0):
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        dl.launch(sleeps, 2, args=(30, True), output="quiet", timeout=60)
    except KeyboardInterrupt:
        pass
    time.sleep(0.5)
    print(json.dumps({"children": child_pids(), "fds": sorted(open_fds() - fds)}))
elif mode == "spawn":          # the test SIGKILLs this process while the spawned ranks import torch
    print("launching", flush=True)
    dl.launch(sleeps, 2, args=(60, False), start_method="spawn", output="quiet", timeout=arg)
elif mode == "grandchild":
    print(json.dumps(dl.launch(grandchild, 2, output="quiet").results))
"""


def _script(mode: str, arg: float, marker: str, **popen):
    env = {**os.environ, "DISTLAB_ROOT": str(ROOT), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "DISTLAB_TEST_MARKER": marker}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, mode, str(arg)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def _run_script(mode: str, arg: float, timeout: float = 240):
    marker = f"distlab-test-{uuid.uuid4().hex}"
    proc = _script(mode, arg, marker)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        proc.wait()
        left = wait_until_gone(marker, 10)
        kill_marked(marker)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc")
def test_ctrl_c_in_the_first_milliseconds_is_never_swallowed_and_leaves_nothing():
    report, left = _run_script("early", 15)
    assert report["caught"] == 15, "an interrupt was swallowed"
    assert report["children"] == [] and report["fds"] == [], report
    assert left == []


@pytest.mark.skipif(not os.environ.get("DISTLAB_SOAK"), reason="a soak: set DISTLAB_SOAK=1 (about 15 s)")
def test_soak_100_launches_interrupted_at_random_moments_leave_nothing():
    report, left = _run_script("soak", 100)
    assert report == {"caught": 100, "children": [], "fds": []}
    assert left == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc")
def test_a_second_ctrl_c_during_shutdown_still_stops_every_rank():
    report, left = _run_script("twice", 0)
    assert report == {"children": [], "fds": []}
    assert left == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_rank_own_subprocesses_end_with_the_launch():
    report, left = _run_script("grandchild", 0)
    assert report == [1, 1]
    assert left == [], "a rank's subprocess outlived the launch"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc")
def test_spawned_ranks_die_when_the_parent_is_killed_while_they_boot():
    marker = f"distlab-test-{uuid.uuid4().hex}"
    proc = _script("spawn", 120, marker)
    try:
        assert proc.stdout.readline().strip() == "launching"
        end = time.monotonic() + 60
        while len(marked(marker, b"multiprocessing-fork")) < 2 and time.monotonic() < end:   # two ranks
            time.sleep(0.01)
        proc.kill()                                   # the notebook's kernel dies; the ranks still boot
        proc.wait()
        left = wait_until_gone(marker, 45)           # (before the fix: until the store timeout, 120 s)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        kill_marked(marker)
    assert left == [], "spawned ranks outlived the parent"
