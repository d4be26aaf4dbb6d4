"""`Loader`: global batches from a data set in a `DistributedSampler`'s order, read ahead by worker
threads, with a position that is the samples the *trainer* has taken (not those read ahead).

    loader = Loader(corpus, sampler, batch=16, workers=2, prefetch=2, latency=0.05)
    for step in range(steps):
        b = next(loader)          # b.ids (16,), b.x, b.y; waits only if no batch is ready yet
    loader.state_dict()           # {"position": tensor([epoch, offset])}: what a checkpoint holds

Without workers, each ``next`` reads its batch itself: with storage that takes ``latency`` seconds a
batch and a training step of ``t`` seconds, the ranks idle ``latency / (latency + t)`` of the time.
With ``workers`` threads keeping ``workers * prefetch`` batches in flight (torch's ``num_workers`` and
``prefetch_factor``), the reads overlap training; the trainer waits only while ``latency / workers > t``::

    workers=0   |read|step|read|step|read|step|        idle: latency / (latency + t)
    workers=2   |step|step|step|step|step|step|        reads run beside the steps, in threads
                 |read  ||read  |                      (sleeping and tensor copies release the GIL)

The read-ahead never moves the position: a batch read ahead but not taken is read again after a resume.
``part=(r, n)``: this rank reads only its rows of each global batch (`rows`: ``tensor_split`` into n), the
ids stay the global batch's: each rank reads its shard, and the position is still global.
``wait_s`` keeps how long each ``next`` waited (the trainer traces it).

Threads or processes (``worker_type``). Threads share the rank's GIL: they hide waiting (storage, sleeps,
torch's copies, which let go of the GIL) but not Python's own CPU work. A decode written in Python
(``cpu=`` seconds of it per batch, simulated like ``latency``) run in a thread takes that CPU from the
rank's Python; ``worker_type="process"`` runs it in worker processes that import no torch (`procs`), at
the price of a process each (tens of milliseconds to start) and a copy of each batch's bytes::

    threads     rank CPU per batch: its step + cpu      (one GIL: the decode is the rank's Python)
    processes   rank CPU per batch: its step + a copy   (the decode on another core, if one is free)

Use threads for slow storage and for readers that are torch or numpy calls; processes when the reading
itself is Python work (a tokeniser, parsing) and a core is free for each worker: on a machine whose cores
the ranks already fill, the decode's CPU is spent somewhere anyway, and processes gain no wall time.
The tests assert where the CPU goes (the rank's CPU time), not wall time: on a shared 2-core machine
the wall time is the scheduler's (measured once at load 10: 120-200 ms a step for all three kinds,
where a free machine would give 60, 60 and 30 ms for a 30 ms step and a 30 ms decode).
A data set read by processes says how a worker without torch reads it (``worker_source()``) and how
the rank makes its tensors of the bytes (``from_bytes``): `TextCorpus` does.
"""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ._worker import burn
from .procs import WorkerPool
from .sampler import DistributedSampler, Position, rows

WORKER_TYPES = ("thread", "process")


@dataclass
class Batch:
    """One global batch: the sample ids (B,), the inputs and targets (B, ...; a ``part``: its rows only),
    and the position after it."""

    ids: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    after: Position


class Loader:
    """Global batches of ``batch`` samples of ``dataset`` (``dataset[ids] -> (x, y)``) in ``sampler``'s
    stream from ``position``; ``workers`` threads (``worker_type="process"``: processes), ``prefetch``
    batches in flight per worker, ``latency`` seconds of (simulated) storage and ``cpu`` seconds of
    (simulated) Python decoding per batch; ``part=(rank, n)``: only that rank's rows are read."""

    def __init__(self, dataset, sampler: DistributedSampler, batch: int, *, workers: int = 0,
                 prefetch: int = 2, latency: float = 0.0, position: Position | None = None,
                 part: tuple[int, int] | None = None, worker_type: str = "thread", cpu: float = 0.0):
        if worker_type not in WORKER_TYPES:
            raise ValueError(f"worker_type={worker_type!r}: choose one of {WORKER_TYPES}")
        if worker_type == "process" and not hasattr(dataset, "worker_source"):
            raise ValueError(f"process workers import no torch, so they read a data set by its "
                             f"worker_source() and from_bytes(), which {type(dataset).__name__} lacks: "
                             f"use worker_type='thread' (or a TextCorpus)")
        self.dataset, self.sampler, self.batch, self.part = dataset, sampler, batch, part
        self.workers, self.prefetch, self.latency, self.cpu = workers, prefetch, latency, cpu
        self.worker_type = worker_type
        self.position = position or Position()        # what the trainer has taken
        self._ahead = self.position                   # where the next read starts
        self._pool = self._procs = None
        if workers and worker_type == "process":
            self._procs = WorkerPool(workers, dataset.worker_source())
        elif workers:
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="distlab-data")
        self._inflight: collections.deque[Future] = collections.deque()
        self.wait_s: list[float] = []

    def _read(self, position: Position) -> Batch:
        """Read the batch at ``position`` (the storage's latency first): all its rows, or this part's."""
        ids, after = self.sampler.batch_at(position, self.batch)
        if self.latency:
            time.sleep(self.latency)
        burn(self.cpu)
        x, y = self.dataset[ids if self.part is None else rows(ids, *self.part)]
        return Batch(ids, x, y, after)

    def _send(self, position: Position):
        """Ask the next worker process for the batch at ``position`` (this part's rows of it)."""
        ids, after = self.sampler.batch_at(position, self.batch)
        mine = ids if self.part is None else rows(ids, *self.part)

        def convert(payload: bytes) -> Batch:
            return Batch(ids, *self.dataset.from_bytes(payload, len(mine)), after)
        return self._procs.submit(mine.tolist(), self.latency, self.cpu, convert)

    def _fill(self) -> None:
        """Keep ``workers * prefetch`` reads in flight, each one batch further along the stream."""
        while self.workers and len(self._inflight) < self.workers * self.prefetch:
            if self._procs is not None:
                self._inflight.append(self._send(self._ahead))
            elif self._pool is not None:
                self._inflight.append(self._pool.submit(self._read, self._ahead))
            else:
                return
            self._ahead = self.sampler.batch_at(self._ahead, self.batch)[1]

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Batch:
        """The next batch of the stream; the position moves past it."""
        t0 = time.perf_counter()
        if self._pool is None and self._procs is None:
            b = self._read(self.position)
        else:
            self._fill()
            b = self._inflight.popleft().result()
            self._fill()
        self.wait_s.append(time.perf_counter() - t0)
        self.position = b.after
        return b

    def state_dict(self) -> dict:
        return {"position": self.position.as_tensor()}

    def load_state_dict(self, state: dict) -> None:
        """Go to a saved position: reads in flight are dropped, reading starts again there."""
        self.seek(Position.from_tensor(state["position"]))

    def read_part(self, part: tuple[int, int] | None) -> None:
        """From now on read ``part``'s rows (None: whole batches); reads in flight are made again."""
        if part != self.part:
            self.part = part
            self.seek(self.position)

    def seek(self, position: Position) -> None:
        for f in self._inflight:
            f.cancel()
        for f in self._inflight:
            if not f.cancelled():
                f.exception()                         # let a running read finish before reading anew
        self._inflight.clear()
        self.position = self._ahead = position

    def close(self) -> None:
        """Stop the workers (reads in flight are dropped; process workers exit and are reaped)."""
        try:
            self.seek(self.position)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._procs is not None:
                self._procs.close()
                self._procs = None
