"""Two launches from two threads of one process keep to their own pipes; output without newlines (a
progress bar's carriage returns) is relayed in linear time and what a cell receives is capped."""
from __future__ import annotations

import importlib
import os
import sys
import threading
import time

import distlab as dl
from _processes import child_pids
from distlab.launch.supervisor import LINE_LIMIT, OUTPUT_LIMIT, RankStatus, Supervisor

launch_module = importlib.import_module("distlab.launch.parent")


def _pipe_inodes() -> dict[int, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            found[int(fd)] = target
    return found


def _my_pipes(hold: float):
    """Every pipe this rank holds, and which one is its own output (fd 1)."""
    pipes = _pipe_inodes()
    time.sleep(hold)
    return sorted(set(pipes.values())), pipes[1]


def test_a_launch_started_while_another_starts_holds_none_of_its_pipes(monkeypatch):
    """Launch A starts its ranks slowly in a thread; launch B starts in the middle of that. B's ranks must
    not hold A's pipes (before: they held the write ends of A's output pipes, so A's output could not
    end until B's ranks exited)."""
    real_context = launch_module.mp.get_context
    a_started_one = threading.Event()

    class SlowProcess(real_context("fork").Process):
        def start(self):
            super().start()
            if threading.current_thread().name.startswith("launch-a"):   # (its starting thread)
                a_started_one.set()
                time.sleep(0.5)                     # A's start window stays open

    class Context:
        def __init__(self, method):
            self.inner = real_context(method)
            self.Process = SlowProcess if method == "fork" else self.inner.Process

        def Pipe(self, duplex):
            return self.inner.Pipe(duplex=duplex)

    monkeypatch.setattr(launch_module.mp, "get_context", Context)
    runs = {}
    a = threading.Thread(name="launch-a", target=lambda: runs.setdefault(
        "a", dl.launch(_my_pipes, 2, args=(1.0,), start_method="fork", output="quiet", timeout=60)))
    a.start()
    try:
        assert a_started_one.wait(60)
        runs["b"] = dl.launch(_my_pipes, 2, args=(0.0,), start_method="fork", output="quiet", timeout=60)
    finally:
        a.join(120)
    a_outputs = {own for _, own in runs["a"].results}
    for held, _ in runs["b"].results:
        assert not a_outputs & set(held), "a rank of launch B holds an output pipe of launch A"
    assert child_pids() == []
    assert not launch_module._LIVE_FDS


def _fake_rank() -> tuple[Supervisor, RankStatus]:
    r = RankStatus(0, None, None, None)
    return Supervisor([r], deadline=0.0, live=False), r


def test_progress_bars_without_newlines_keep_the_buffer_small_and_show_the_last_frame():
    sup, r = _fake_rank()
    frame = b"".join(b"\r%5d%%" % i for i in range(10_000))        # 70 kB of frames, no newline
    for _ in range(700):                                            # about 50 MB in all
        sup._take(r, frame)
        assert len(r.partial) < 64                                  # before: the whole 50 MB, re-copied
    sup._take(r, b"\rdone\n")
    assert r.lines == ["done"]


def test_a_line_without_end_is_cut_and_a_rank_output_is_capped():
    sup, r = _fake_rank()
    for _ in range(40):
        sup._take(r, b"x" * 65536)                                  # 2.6 MB without a newline
        assert len(r.partial) <= LINE_LIMIT + 65536
    assert all(len(line) <= LINE_LIMIT + 65536 for line in r.lines) and len(r.lines) >= 10
    for _ in range(100):
        sup._take(r, b"y" * 99 + b"\n")
    assert r.kept <= OUTPUT_LIMIT and r.dropped > 0
    read, write = os.pipe()
    os.close(write)
    r.out_conn = _Conn(read)
    r.partial = bytearray()
    sup._read_output(r)                                             # end of file: the note
    os.close(read)
    assert r.lines[-1].startswith(f"[distlab: {r.dropped} more bytes of output not shown")


class _Conn:
    def __init__(self, fd):
        self.fd = fd

    def fileno(self):
        return self.fd


def _progress_and_flood():
    for i in range(101):
        sys.stdout.write(f"\r{i:3d}%")
        sys.stdout.flush()
    print()
    for _ in range(30_000):                                         # 3 MB of lines
        print("z" * 99)
    return 0


def test_a_rank_progress_bar_and_flood_reach_the_parent_shown_and_capped():
    run = dl.launch(_progress_and_flood, 1, output="quiet", timeout=120)
    lines = run.outputs[0].splitlines()
    assert lines[0] == "100%"
    assert "more bytes of output not shown" in lines[-1]
    assert len(run.outputs[0]) <= OUTPUT_LIMIT + 200
    assert child_pids() == []
