"""`Loader(..., worker_type="process")`: worker processes that import no torch read exactly the batches, in
the same order, that thread workers and no workers read (whole batches and a rank's rows, across epochs,
after a seek), start in tens of milliseconds, surface a worker's error (or death) as a clear exception in
the rank, leave nothing behind when closed or when their rank is killed, and take a Python decode's CPU
off the rank, which thread workers (one GIL) cannot."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import distlab as dl
from distlab.data import DistributedSampler, Loader, TextCorpus
from distlab.data import WorkerError

from _processes import describe
from distlab.launch.lifeline import _alive


def _batches(loader: Loader, n: int) -> list:
    return [next(loader) for _ in range(n)]


def _same(a, b) -> bool:
    return (torch.equal(a.ids, b.ids) and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
            and a.after == b.after)


@pytest.mark.parametrize("text", [None, b"a corpus given as bytes, not read from a file. " * 8])
def test_process_workers_read_what_threads_and_no_workers_read(text, no_leaks):
    """16 batches of 5 over a 2-3 epoch stream (batches straddle epochs), whole and a rank's rows of 3
    (uneven), 1 and 3 workers, then a seek back: every batch equal to the plain loader's, in order."""
    corpus = TextCorpus(seq_len=64 if text is None else 8, text=text)    # 62 or 46 samples
    s = DistributedSampler(len(corpus), seed=5)
    for part in (None, (1, 3)):
        ref = _batches(Loader(corpus, s, 5, part=part), 16)
        for workers, kind in ((3, "thread"), (1, "process"), (3, "process")):
            loader = Loader(corpus, s, 5, workers=workers, prefetch=2, part=part, worker_type=kind)
            try:
                got = _batches(loader, 10)
                loader.seek(ref[5].after)                              # 6 reads in flight dropped
                got += _batches(loader, 10)
            finally:
                loader.close()
            assert all(_same(a, b) for a, b in zip(got[:10] + got[10:], ref[:10] + ref[6:16], strict=True))
    assert ref[-1].after.epoch >= 1 and ref[0].x.shape[0] == 2         # rows of 3 of 5: 2, 2, 1


def test_workers_start_fast_and_import_no_torch(no_leaks):
    """The workers are started by path on the standard library: no torch mapped in their memory, and the
    first batch (two workers started, then a read) arrives in well under the seconds an import of torch
    takes (measured here: the first batch of a 2-worker loader)."""
    corpus = TextCorpus(seq_len=8)
    s = DistributedSampler(len(corpus))
    t0 = time.perf_counter()
    loader = Loader(corpus, s, 4, workers=2, worker_type="process")
    try:
        next(loader)
        first = time.perf_counter() - t0
        for pid in loader._procs.pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtorch" not in maps and "libc10" not in maps, pid
    finally:
        loader.close()
    assert first < 1.0, first


def test_an_error_in_a_worker_is_raised_in_the_rank(no_leaks):
    """A sampler larger than its data set (a bug) makes a worker fail: the rank gets a `WorkerError` with
    the sample ids and the worker's traceback; a worker killed under the loader: a `WorkerError` naming it."""
    corpus = TextCorpus(seq_len=8)
    loader = Loader(corpus, DistributedSampler(len(corpus) + 40, seed=0), 8, workers=2,
                    worker_type="process")
    try:
        with pytest.raises(WorkerError, match=r"(?s)failed reading samples.*IndexError: sample \d+ is out"):
            _batches(loader, 12)
    finally:
        loader.close()
    loader = Loader(corpus, DistributedSampler(len(corpus)), 4, workers=2, worker_type="process")
    try:
        next(loader)
        loader._procs.procs[1].kill()
        loader._procs.procs[1].wait()                  # dead (its replies sent before may still come)
        with pytest.raises(WorkerError, match=r"data worker 1 \(pid \d+\) is gone \(exit code -9\)"):
            _batches(loader, 8)
    finally:
        loader.close()


def test_bad_worker_options_are_refused():
    corpus = TextCorpus(seq_len=8)
    s = DistributedSampler(len(corpus))
    with pytest.raises(ValueError, match="choose one of"):
        Loader(corpus, s, 4, workers=1, worker_type="fork")
    with pytest.raises(ValueError, match="worker_source.*use worker_type='thread'"):
        Loader(torch.arange(len(corpus)), s, 4, workers=1, worker_type="process")


def _start_workers_then_die(folder: str) -> None:
    loader = Loader(TextCorpus(seq_len=8), DistributedSampler(100 // 8), 4, workers=2,
                    worker_type="process", latency=30.0)          # the workers sleep in their first read
    loader._fill()                                                  # reads sent, none taken
    Path(folder, f"rank{dl.rank()}").write_text(" ".join(map(str, loader._procs.pids)))
    if dl.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)                        # killed outright: nothing cleaned up
    time.sleep(60)


def test_a_killed_rank_leaves_no_worker(tmp_path, no_leaks):
    """Rank 1 is SIGKILLed while its workers are busy (rank 0 then hangs until the launch ends it): the
    launch fails, and within seconds none of the four workers is alive (the dead rank's workers read end
    of file on their socket, the launcher kills its process group; rank 0's die with rank 0's tree)."""
    with pytest.raises(dl.LaunchError):
        dl.launch(_start_workers_then_die, 2, args=(str(tmp_path),), output="quiet", timeout=20)
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"rank{r}").read_text().split()]
    assert len(pids) == 4
    end = time.monotonic() + 10.0
    while any(map(_alive, pids)) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(map(_alive, pids)), describe([p for p in pids if _alive(p)])


def test_process_workers_take_a_python_decode_off_the_rank(no_leaks):
    """Each batch's read burns ``cpu`` = 30 ms of pure-Python CPU (a tokeniser in Python, holding the GIL).
    Thread workers spend it in the rank's process, so the rank's CPU time over 8 batches grows by about
    8 x 30 ms; process workers spend it in their own processes, and the rank's grows by little (the copy of
    the bytes). CPU time, not wall time, so a busy machine does not change the answer."""
    corpus = TextCorpus(seq_len=8)
    s = DistributedSampler(len(corpus))
    spent = {}
    for kind in ("thread", "process"):
        loader = Loader(corpus, s, 4, workers=1, prefetch=1, cpu=0.03, worker_type=kind)
        try:
            next(loader)
            t0 = time.process_time()
            _batches(loader, 8)
            spent[kind] = time.process_time() - t0
        finally:
            loader.close()
    assert spent["thread"] > 6 * 0.03 and spent["process"] < 2 * 0.03, spent


def test_an_interrupted_read_is_not_taken_for_the_next_batch(no_leaks, monkeypatch):
    """Ctrl-C while the rank receives a reply leaves part of it unread: the loader says so at the next
    batch instead of reading the rest of that reply as another batch."""
    from distlab.data import _worker
    corpus = TextCorpus(seq_len=8)
    loader = Loader(corpus, DistributedSampler(len(corpus)), 4, workers=2, worker_type="process")
    try:
        next(loader)
        real = _worker._exactly
        calls = []

        def interrupted(sock, n):
            calls.append(n)
            if len(calls) == 2:                   # the header read, then Ctrl-C in the body
                raise KeyboardInterrupt
            return real(sock, n)
        monkeypatch.setattr(_worker, "_exactly", interrupted)
        with pytest.raises(KeyboardInterrupt):
            next(loader)
        monkeypatch.setattr(_worker, "_exactly", real)
        with pytest.raises(WorkerError, match="interrupted in the middle of a reply.*make a new one"):
            next(loader)
    finally:
        loader.close()
