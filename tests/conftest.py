"""Shared fixtures: every test must leave no rank process and no file descriptor behind."""
from __future__ import annotations

import os

import pytest


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


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves rank processes or file descriptors behind."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()   # a per-process singleton that spawn starts: not a leak
    _warm_singletons()
    before_fds = open_fds()
    yield
    left = child_pids()
    assert left == [], f"orphan or zombie rank processes left: {describe(left)}"
    leaked = open_fds() - before_fds
    # allow descriptors opened lazily by libraries once per process (torch, multiprocessing helpers)
    leaked = {fd for fd in leaked if not _is_library_singleton(fd)}
    assert not leaked, f"file descriptors leaked: {sorted(leaked)}"


_warmed = []


def _warm_singletons() -> None:
    """TCPStore keeps one wake-up pipe per process; start it (and forkserver) before counting."""
    if not _warmed:
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        del store
        from multiprocessing import forkserver
        forkserver.ensure_running()   # forkserver keeps one connection to its server: not a leak
        _warmed.append(True)


def _is_library_singleton(fd: int) -> bool:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return True   # closed meanwhile
    return target.startswith(("/dev/", "anon_inode:")) or target.endswith((".so", ".json"))


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
            out.append(f"{pid}: {cmdline[:200]}")
        except OSError:
            out.append(f"{pid}: (gone)")
    return out
