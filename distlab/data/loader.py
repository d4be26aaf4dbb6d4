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
Threads, not processes: a training rank is itself a process of `dl.launch`, and a corpus of a few KB
needs no second address space. ``wait_s`` keeps how long each ``next`` waited (the trainer traces it).
"""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .sampler import DistributedSampler, Position, rows


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
    stream from ``position``; ``workers`` threads, ``prefetch`` batches in flight per worker, ``latency``
    seconds of (simulated) storage per batch; ``part=(rank, n)``: only that rank's rows are read."""

    def __init__(self, dataset, sampler: DistributedSampler, batch: int, *, workers: int = 0,
                 prefetch: int = 2, latency: float = 0.0, position: Position | None = None,
                 part: tuple[int, int] | None = None):
        self.dataset, self.sampler, self.batch, self.part = dataset, sampler, batch, part
        self.workers, self.prefetch, self.latency = workers, prefetch, latency
        self.position = position or Position()        # what the trainer has taken
        self._ahead = self.position                   # where the next read starts
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="distlab-data") if workers else None
        self._inflight: collections.deque[Future] = collections.deque()
        self.wait_s: list[float] = []

    def _read(self, position: Position) -> Batch:
        """Read the batch at ``position`` (the storage's latency first): all its rows, or this part's."""
        ids, after = self.sampler.batch_at(position, self.batch)
        if self.latency:
            time.sleep(self.latency)
        x, y = self.dataset[ids if self.part is None else rows(ids, *self.part)]
        return Batch(ids, x, y, after)

    def _fill(self) -> None:
        """Keep ``workers * prefetch`` reads in flight, each one batch further along the stream."""
        while self._pool is not None and len(self._inflight) < self.workers * self.prefetch:
            self._inflight.append(self._pool.submit(self._read, self._ahead))
            self._ahead = self.sampler.batch_at(self._ahead, self.batch)[1]

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Batch:
        """The next batch of the stream; the position moves past it."""
        t0 = time.perf_counter()
        if self._pool is None:
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
        """Stop the workers (reads in flight are dropped)."""
        self.seek(self.position)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
