"""A rank's tie to its launch: when the launch ends, the rank ends, and so does every process it started.

    parent (the launching process)              rank (fork, spawn or forkserver)
    ------------------------------              --------------------------------
    write end of the lifeline  ====pipe====>    read end, watched by a thread:
    (nobody else holds it)                      end of file = the parent died, or its launch is over
                                                  -> kill every descendant, the rank's group, the rank

Why a pipe, and not the kernel's parent-death signal (prctl PR_SET_PDEATHSIG): that signal follows the
rank's *operating-system* parent, which under forkserver is the server, not the launcher (ranks outlived a
killed launcher by minutes, retrying its store); and it kills the rank at once, orphaning whatever the rank
started. A pipe reaches end of file when the last holder of its write end is gone, and only the launcher
holds it (forked ranks close their inherited copy; spawn and forkserver never pass it on), so a rank learns
of its launcher's death in milliseconds whoever its operating-system parent is.

What the rank started: on Linux the rank is a *child subreaper* (prctl PR_SET_CHILD_SUBREAPER), so a
process that leaves the rank's tree the classic way (a child calls setsid, forks and exits: a daemon) is
re-parented to the rank instead of to init. Everything the rank started therefore stays below it, in
whatever session or process group, and `end_descendants` walks that tree (/proc/PID/task/TID/children)
and kills it: when the function returns, when it raises, and when the lifeline ends.

What escapes (and why):
  - a rank killed outright (SIGKILL, the OOM killer, a crash, os._exit in the user's function) cleans
    nothing up; the parent still kills its process group, but a descendant in a session of its own
    survives, re-parented to init (only a cgroup would hold it, and those need privileges);
  - a rank whose main thread holds the GIL inside C code for long sees the lifeline end only when it lets
    go (torch's operations, collectives and sleeps let go); the parent kills it after a grace period;
  - outside Linux there is no subreaper and no /proc: the watcher kills the rank's process group only.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_CHILD_SUBREAPER = 36
_LINUX = sys.platform.startswith("linux")


def become_subreaper() -> bool:
    """Orphans below this process are re-parented to it, not to init (Linux 3.4+, no privileges needed)."""
    if not _LINUX:
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``: the kernel lists them per thread that forked them."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(child) for child in f.read().split()]
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie (a zombie is dead: it waits only for its parent to read its status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _children_by_scan() -> dict[int, list[int]]:
    """Every process's children, from each one's parent in /proc/PID/stat: for kernels built without
    the per-thread children lists (CONFIG_PROC_CHILDREN)."""
    below: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        below.setdefault(parent, []).append(int(entry))
    return below


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below ``pid`` (this process by default), parents before their children."""
    if not _LINUX:
        return []
    pid = os.getpid() if pid is None else pid
    children = _children
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        children = _children_by_scan().get
    found, frontier = [], [pid]
    while frontier:
        below = [child for parent in frontier for child in children(parent) or ()]
        found += [child for child in below if _alive(child)]
        frontier = below
    return found


def end_descendants(seconds: float = 2.0) -> None:
    """Kill (SIGKILL) every process below this one, round after round: a killed process's own children
    are re-parented to this subreaper and are found in the next round. Ends when a round finds nobody
    alive (or after ``seconds``, against a process that forks faster than it is killed)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        alive = descendants()
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.002)                      # let the killed exit, and their orphans move up to us


def end_this_rank() -> None:
    """Kill what this rank started, then its process group (it leads one), then itself."""
    end_descendants()
    if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _watch(fd: int) -> None:
    try:
        while os.read(fd, 1):                  # the parent never writes: this returns only at end of file
            pass
    except OSError:                            # the descriptor was closed under us: stop watching
        return
    end_this_rank()


def watch(lifeline) -> None:
    """Start the thread that ends this rank (and its tree) when ``lifeline`` (the read end) reaches end
    of file. A launcher that died before this call is noticed at once: the end of file is already there."""
    threading.Thread(target=_watch, args=(lifeline.fileno(),), name="distlab-lifeline", daemon=True).start()
