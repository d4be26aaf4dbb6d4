"""Process workers for `Loader(..., worker_type="process")`: N processes that import no torch, each
reading the byte windows of the sample ids the rank sends it (`_worker.py`, the standard library only).

    rank (torch)                                        worker k (no torch)
    batch j's ids  --socket of worker j % N-------->     sleep latency, burn cpu, read windows
    Pending(j).result()  <--bytes-------------------     ("ok", bytes) | ("error", traceback)
    TextCorpus.from_bytes(bytes) -> (x, y)

Why not ``multiprocessing``: a forked worker of a rank that has used torch's thread pool can hang inside
it (DESIGN.md, "Traps already known"), and a spawned (or forkserver) worker first re-imports the
launching script's ``__main__``, which for a training script means torch, seconds per worker. Here each
worker is a fresh interpreter (``fork`` + ``exec`` at once, so nothing of torch runs in the child) started
on the worker file *by path*, so no package, and no torch, is imported: it starts in tens of milliseconds.
Each worker answers in the order it was asked, and the loader receives in the order it sent: the
batches are the stream's, in order, exactly as thread workers or no workers read them.

Shutdown: closing a worker's socket is its end of file, and it exits; a rank that dies closes the
sockets too (and its lifeline kills what it started), so no worker outlives its rank.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import weakref

from . import _worker

WORKER_FILE = os.path.abspath(_worker.__file__)


class WorkerError(RuntimeError):
    """A data worker process failed to read a batch, or died: raised in the rank, at the batch's turn."""


class Pending:
    """A batch sent to worker ``index`` and not received yet: ``result()`` receives it (in order)."""

    def __init__(self, pool: WorkerPool, index: int, ids, convert):
        self.pool, self.index, self.ids, self.convert = pool, index, ids, convert

    def result(self):
        return self.convert(self.pool.receive(self.index, self.ids))

    def cancel(self) -> bool:
        return False                                 # a request sent is answered: drained by exception()

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        try:
            self.pool.receive(self.index, self.ids)
        except WorkerError as e:
            return e
        return None


def _shutdown(procs: list[subprocess.Popen], socks: list[socket.socket]) -> None:
    """Close every socket (each worker's end of file), then reap each worker (killed if it lingers)."""
    for s in socks:
        s.close()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class WorkerPool:
    """``workers`` processes serving ``source`` (``{"path" | "text", "seq_len"}``, see `_worker.Windows`)."""

    def __init__(self, workers: int, source: dict):
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        self._next = 0
        self.broken: str | None = None
        self._finalize = weakref.finalize(self, _shutdown, self.procs, self.socks)
        try:
            for _ in range(workers):
                self._start(source)
        except BaseException:
            self.close()
            raise

    def _start(self, source: dict) -> None:
        mine, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", WORKER_FILE, str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.procs.append(proc)
        self.socks.append(mine)
        _worker.send(mine, source)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def submit(self, ids: list[int], latency: float, cpu: float, convert) -> Pending:
        """Send ``ids`` to the next worker in turn; ``convert(bytes)`` makes the result of its reply."""
        index = self._next
        self._next = (self._next + 1) % len(self.procs)
        try:
            _worker.send(self.socks[index], (ids, latency, cpu))
        except OSError as e:
            raise self._died(index, ids) from e
        return Pending(self, index, ids, convert)

    def receive(self, index: int, ids) -> bytes:
        """Worker ``index``'s next reply (the oldest request it has not answered): its bytes."""
        if self.broken:
            raise WorkerError(f"this loader was interrupted in the middle of a reply ({self.broken}): its "
                              f"stream of batches is lost; close it and make a new one")
        try:
            status, payload = _worker.receive(self.socks[index])
        except (EOFError, OSError) as e:
            raise self._died(index, ids) from e
        except BaseException as e:                 # Ctrl-C mid-frame: the rest of the frame is unread
            self.broken = type(e).__name__
            raise
        if status != "ok":
            raise WorkerError(f"data worker {index} (pid {self.procs[index].pid}) failed reading samples "
                              f"{_short(ids)}; its traceback:\n{payload}")
        return payload

    def _died(self, index: int, ids) -> WorkerError:
        proc = self.procs[index]
        try:
            code = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return WorkerError(f"data worker {index} (pid {proc.pid}) is gone (exit code {code}) while reading "
                           f"samples {_short(ids)}: close the loader and make a new one")

    def close(self) -> None:
        """End every worker and reap it (idempotent)."""
        self._finalize()


def _short(ids) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= 8 else f"{ids[:8]} ... ({len(ids)} ids)"
