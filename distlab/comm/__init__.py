"""Collectives built from nothing but point-to-point send/recv, each step recorded in the trace.

    dl.comm.ring_all_reduce(t, op="sum", group=None)       # in place: reduce-scatter + all-gather
    dl.comm.ring_reduce_scatter(t, op="sum", group=None)   # chunk `rank` of tensor_split(t.flatten(), N)
    dl.comm.ring_all_gather(shard, group=None)             # every rank's shard, in rank order
    dl.comm.broadcast(t, src=0, group=None)                # binomial tree
    dl.comm.naive_all_reduce(t, op="sum", group=None, root=0)   # through one root, to compare
    dl.comm.all_to_all(t, splits=None, group=None)         # row block i to rank i; returns rank j's for me
    dl.comm.ring_shift(t, group=None)                      # send to the next rank, return the previous one's
    dl.comm.start_ring_shift(t, group=None).wait()         # the same, posted now and waited later (overlap)

    dl.comm.pipelined_all_reduce / pipelined_reduce_scatter / pipelined_all_gather
                                                           # the same ring, fast: same arguments, same bits

    dl.comm.ring_bytes(numel, element_size, n, rank, "all_reduce")   # exact (sent, received) bytes
    dl.comm.replay(calls)                                  # re-run recorded (op, size) calls on the ring:
                                                           # the bytes this rank really sent
    dl.comm.free_scratch()                                 # drop the receive buffers kept between calls

Reading order:
  1. ``p2p.py``            the primitives: post a send and a receive together and wait (``exchange``), one
                           step round a ring (``ring_step``); the one place a step is recorded in the trace
  2. ``ring.py``           the textbook ring: N-1 plain exchange steps per phase (what lesson 01 draws)
  3. ``tree.py``, ``naive.py``   broadcast down a binomial tree; the all-reduce through one root, to compare
  4. ``all_to_all.py``     every rank a different block for every other: N-1 pairwise-exchange steps
                           (expert parallelism's dispatch, Ulysses' sequence <-> heads)
  5. ``shift.py``          a block to the next rank, the previous rank's back (ring attention's K/V hops)
  6. ``ring_pipelined.py`` the same ring made fast: chunks streamed in segments, receives posted ahead;
                           tested bit-identical to ``ring.py``
  7. ``traced.py``         the entry points above: each algorithm run inside a traced call, from outside
  8. ``quantized.py``      block-scaled int8 / fp8 packets (pure tensor code, no communication): what
                           ZeRO-3's and fully_shard's ``quantize=`` send (`parallel.quantized_collectives`)
  9. ``replay.py``         torch's recorded calls re-run on the ring, to measure the bytes the trace models
"""
from .p2p import OPS, free_scratch
from .replay import replay
from .ring import ring_bytes
from .traced import (all_to_all, broadcast, naive_all_reduce, pipelined_all_gather, pipelined_all_reduce,
                     pipelined_reduce_scatter, ring_all_gather, ring_all_reduce, ring_reduce_scatter,
                     ring_shift, start_ring_shift)

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "pipelined_all_reduce",
           "pipelined_reduce_scatter", "pipelined_all_gather", "broadcast", "naive_all_reduce",
           "all_to_all", "ring_shift", "start_ring_shift", "ring_bytes", "replay", "free_scratch", "OPS"]
