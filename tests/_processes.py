"""Which processes and descriptors a test left behind (shared by conftest.py and the launcher tests)."""
from __future__ import annotations

import os
import signal
import time


def _helper(cmdline: bytes) -> bool:
    """spawn/forkserver keep a resource tracker (and forkserver a server) alive by design."""
    return b"resource_tracker" in cmdline or b"forkserver" in cmdline


def left_below() -> list[int]:
    """Live processes anywhere below this one (`distlab.launch.lifeline.descendants`), except
    multiprocessing's helpers, which earlier tests of the same session may have started."""
    from distlab.launch.lifeline import descendants
    left = []
    for pid in descendants():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if not _helper(cmdline):
            left.append(pid)
    return left


def child_pids() -> list[int]:
    """Live (or zombie) processes whose parent is this process, except multiprocessing's helpers."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and not _helper(cmdline):
            found.append(int(entry))
    return found


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
            out.append(f"{pid}: {cmdline[:200] or '(zombie)'}")
        except OSError:
            out.append(f"{pid}: (gone)")
    return out


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def is_library_singleton(fd: int) -> bool:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return True   # closed meanwhile
    return target.startswith(("/dev/", "anon_inode:")) or target.endswith((".so", ".json"))


# -- processes a test's scripts started, found by a marker in their environment ------------------
def marked(marker: str, cmdline: bytes = b"") -> list[int]:
    """Live, non-zombie processes with ``marker`` in their environment and ``cmdline`` in their command
    (a process inherits its parent's environment, so this finds a script's ranks and their processes)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in env and cmdline in command and state != "Z":
            found.append(int(entry))
    return found


def wait_until_gone(marker: str, seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while marked(marker) and time.monotonic() < end:
        time.sleep(0.1)
    return marked(marker)


def kill_marked(marker: str) -> None:
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
