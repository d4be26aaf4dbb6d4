"""`dl.data`: feeding the ranks. Which samples each rank reads, read ahead in threads, from a position
that a checkpoint holds, so a resumed run (on any data-parallel size) reads what the uninterrupted
run would have.

Reading order:

    sampler.py  `DistributedSampler`: the global order (epoch by epoch, shuffled by seed + epoch),
                torch's per-rank `shard` of it, the stream of global batches from a `Position`
    loader.py   `Loader`: global batches read by worker threads (or processes) with prefetch, slow
                storage (``latency=``), a Python decode (``cpu=``), a position that counts what the
                trainer took
    procs.py    `WorkerPool`: ``worker_type="process"``, workers that import no torch (_worker.py,
                the standard library only), the same batches in the same order; `WorkerError`
    text.py     `TextCorpus`: the shipped public-domain corpus, byte-tokenised; `complete`: greedy text

    sampler = dl.data.DistributedSampler(len(corpus), seed=0)
    loader = dl.data.Loader(corpus, sampler, batch=16, workers=2, prefetch=2)
    b = next(loader); rows = dl.data.rows(b.x, dl.rank(), dl.world_size())   # this rank's rows

``dl.train(..., data="text")`` trains on `TextCorpus` through a `Loader` (`distlab.strategies.feed`),
and every checkpoint it writes holds the loader's position.
"""
from .loader import Batch, Loader
from .procs import WorkerError
from .sampler import DistributedSampler, Position, rows
from .text import VOCAB, TextCorpus, before_and_after, complete, corpus_bytes, decode, encode

__all__ = ["Batch", "DistributedSampler", "Loader", "Position", "TextCorpus", "VOCAB", "WorkerError",
           "before_and_after", "complete", "corpus_bytes", "decode", "encode", "rows"]
