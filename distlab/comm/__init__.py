"""Collectives built from nothing but point-to-point send/recv, each step recorded in the trace.

    dl.comm.ring_all_reduce(t, op="sum", group=None)       # in place: reduce-scatter + all-gather
    dl.comm.ring_reduce_scatter(t, op="sum", group=None)   # chunk `rank` of tensor_split(t.flatten(), N)
    dl.comm.ring_all_gather(shard, group=None)             # every rank's shard, in rank order
    dl.comm.broadcast(t, src=0, group=None)                # binomial tree
    dl.comm.naive_all_reduce(t, op="sum", group=None, root=0)   # through one root, to compare

    dl.comm.ring_bytes(numel, element_size, n, rank, "all_reduce")   # exact (sent, received) bytes

    dl.comm.free_scratch()                                 # drop the receive buffers kept between calls

Files: `p2p` (group bookkeeping and the traced send+recv exchange), `ring_pipelined` (the ring's
segmented, pipelined step loop), `ring`, `tree` (broadcast), `naive`.
"""
from .p2p import OPS, free_scratch
from .naive import naive_all_reduce
from .ring import ring_all_gather, ring_all_reduce, ring_bytes, ring_reduce_scatter
from .tree import broadcast

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "broadcast", "naive_all_reduce",
           "ring_bytes", "free_scratch", "OPS"]
