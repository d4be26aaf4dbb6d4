"""The data feed of `dl.train(..., data="text")`: one `dl.data.Loader` per rank, its position in every
checkpoint, its waits on the timeline.

    loop.run:   feed = for_spec(spec)                    a Loader over the shipped corpus, or None
                state = feed.carry(plan.state)           checkpoints save and restore its position
                with feeding(feed):                      `base.global_batch` reads from it
                    start = resume()                     the position comes back with the model...
                    feed.start(start)                    ...or, from an older checkpoint, from the step
                    for step: ... feed.step_done(step)   every rank past the step's micro-batches

Every rank walks every global micro-batch's sample ids; a data-parallel rank reads only its rows of it
(`base.local_batch`: ``part=(r, n)``), the other layouts the whole micro-batch and cut it as for synthetic
data. So the position, *global samples consumed*, is the same on every rank and means the same on any world
size.
That is what makes a resume on another data-parallel size exact: a per-rank count (torch's
DistributedSampler iterated on each rank, the position kept by rank) would be cut for the old size.

Each ``next`` that waits for storage is a "data wait" span (cat "data"): with ``data_latency`` L per
batch, no workers and a step of t seconds, the spans take L / (L + t) of the time (`idle_fraction`).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from ..checkpoint.state import RankState
from ..data import DistributedSampler, Loader, Position, TextCorpus
from ..models.presets import config
from ..runtime import current_run, tracer

KEY = "data_position"          # the checkpoint entry: tensor([epoch, offset]), the same on every rank


class Feed:
    """One rank's loader for ``spec`` and what it has served, step by step."""

    def __init__(self, spec):
        o = spec.data_loading
        self.spec = spec
        self.corpus = TextCorpus(seq_len=config(spec.model).seq_len)   # a preset's, or a ModelPreset's
        self.sampler = DistributedSampler(len(self.corpus), shuffle=o.shuffle, seed=spec.seed,
                                          drop_last=o.drop_last)
        self.loader = Loader(self.corpus, self.sampler, spec.micro_batch, workers=o.workers,
                             prefetch=o.read_ahead, latency=o.data_latency)
        self.restored: Position | None = None
        self.served: dict[tuple[int, int], tuple] = {}   # (step, micro) -> (ids, x, y) of the step so far
        self.samples: dict[int, list[int]] = {}          # step -> the global sample ids it consumed
        self.rows_read = 0                               # samples this rank read from storage

    # -- checkpoints ---------------------------------------------------------------------------
    def carry(self, state: RankState) -> RankState:
        """``state`` whose checkpoints also hold the loader's position (every rank's own, all equal), put
        back on a resume by the same layout (``restore``) and by another one (``reshard``)."""
        base_capture, base_restore, base_reshard = state.capture, state.restore, state.reshard

        def capture():
            own, replicated = base_capture()
            return {**own, KEY: self.loader.position.as_tensor()}, replicated

        def restore(saved):
            base_restore(saved)
            self._restored(saved.get(KEY))

        def reshard(logical):
            base_reshard(logical)
            self._restored(logical.get(KEY))

        return replace(state, capture=capture, restore=restore,
                       reshard=reshard if base_reshard is not None else None)

    def _restored(self, saved) -> None:
        self.restored = Position.from_tensor(saved) if saved is not None else None

    def start(self, step: int) -> None:
        """Go to where step ``step`` begins: the checkpoint's position, or (a fresh start, a checkpoint that
        holds none) the position after ``step`` global batches from the start."""
        derived = self.sampler.position_after(step * self.spec.global_batch, self.spec.micro_batch)
        self.loader.seek(self.restored if self.restored is not None else derived)

    # -- during training -----------------------------------------------------------------------
    def batch(self, step: int, micro: int, part: tuple[int, int] | None = None):
        """Micro-batch ``micro`` of step ``step``: the loader's next one (a "data wait" span), or the one
        already served if asked again. Steps and micro-steps come in order. ``part=(r, n)``: only rank r
        of n's rows are read (a data-parallel rank's shard; the loader is told at the first call)."""
        if not self.served and not self.samples:
            self.loader.read_part(part)                  # before the first batch: read only this part
        if (step, micro) not in self.served:
            if part != self.loader.part:
                raise RuntimeError(f"the text loader reads the part {self.loader.part}, asked for {part}")
            expected = (step, len(self.served))
            if (step, micro) != expected:
                raise RuntimeError(f"the text loader serves micro-batches in order: asked for {(step, micro)}"
                                   f", next is {expected}")
            with tracer().span("data wait", cat="data", step=step, micro=micro):
                b = next(self.loader)
            self.served[(step, micro)] = (b.ids, b.x, b.y)
            self.rows_read += b.x.shape[0]
        _, x, y = self.served[(step, micro)]
        return x, y

    def step_done(self, step: int) -> None:
        """Take any micro-batch of ``step`` this rank did not ask for (a pipeline's middle stage), so every
        rank's position is past the step; record the step's sample ids."""
        for micro in range(self.spec.grad_accum):
            self.batch(step, micro, self.loader.part)
        ids = [self.served[(step, m)][0] for m in range(self.spec.grad_accum)]
        self.samples[step] = torch.cat(ids).tolist()
        self.served.clear()

    def summary(self) -> dict:
        """``{"data": {...}}`` for the rank's info: the sample ids of each step it ran, the samples it read
        (its rows only, on a data-parallel rank), the final position, the seconds each ``next`` waited."""
        p = self.loader.position
        return {"data": {"samples": dict(self.samples), "rows_read": self.rows_read,
                         "position": (p.epoch, p.offset),
                         "resumed_position": (self.restored.epoch, self.restored.offset) if self.restored
                         else None, "wait_s": list(self.loader.wait_s)}}


def for_spec(spec) -> Feed | None:
    """A `Feed` for ``data="text"``; None for synthetic data (computed in `base.global_batch`)."""
    return Feed(spec) if spec.data_loading.data != "synthetic" else None


@contextlib.contextmanager
def feeding(feed: Feed | None):
    """``feed`` is this rank's run's (`base.global_batch` reads it) until the block ends; then its
    workers stop."""
    run = current_run()
    run.feed = feed
    try:
        yield feed
    finally:
        run.feed = None
        if feed is not None:
            feed.loader.close()


def idle_fraction(trace, rank: int = 0) -> float:
    """Measured: the share of rank ``rank``'s training time spent in "data wait" spans (from its first
    step mark to its last span's end)."""
    spans = trace.spans(rank=rank)
    waits = [s for s in spans if s.name == "data wait"]
    if not waits:
        return 0.0
    begin = min(s.start for s in spans)
    end = max(s.end for s in spans)
    return sum(s.end - s.start for s in waits) / (end - begin)


def predicted_idle_fraction(latency: float, step_s: float, workers: int = 0) -> float:
    """latency / (latency + step) without workers; with w workers reading ahead the storage delivers a
    batch every latency / w seconds, and the ranks wait only for what it falls short:
    max(0, latency / w - step) / (latency / w)."""
    if workers == 0:
        return latency / (latency + step_s)
    per = latency / workers
    return max(0.0, per - step_s) / per if per > 0 else 0.0
