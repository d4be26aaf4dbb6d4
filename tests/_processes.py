"""Which processes and descriptors a test left behind (shared by conftest.py and the launcher tests)."""
from __future__ import annotations

import os


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
        # spawn/forkserver keep a resource tracker (and forkserver a server) alive by design
        helper = b"resource_tracker" in cmdline or b"forkserver" in cmdline
        if ppid == me and not helper:
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
