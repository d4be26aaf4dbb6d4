"""Measure what a recorded collective really sends: re-run it on distlab's own send/recv ring.

torch's collectives do not say what their backend put on the wire, so the wrapper
(`distlab.parallel.collectives`) records each call's op and message size (measured: what torch was
handed) and the bytes a ring would move for it (modelled, ``bytes="ring-model"``). A check of those
bytes against a formula is a check of the calls, not of the bytes. `replay` closes the gap: run it on
every rank of a launch whose world has the recorded group's size, and each recorded call is re-run,
same op and same message size, on ``dl.comm``'s textbook ring, where ``p2p`` counts every byte it
hands to a send. What comes back is measured, independent of `ring_bytes` and of ``dl.theory``:

    calls = [(e.name, e.args["size"]) for e in trace.comms(rank=0) if e.args.get("world") == 4]
    sent = dl.launch(dl.comm.replay, world_size=4, args=(calls,)).results[0]    # bytes rank 0 sent

A call's size is its message in bytes: the input of an all-reduce or a reduce-scatter, the output of an
all-gather (the convention of the trace, as in nccl-tests); fp32 elements unless ``element_size`` says
otherwise. The all-gather's swap of shard sizes (8 bytes a step) is bookkeeping and is left out. Rank r of
the replay stands for group rank r of the recording: where n does not divide a message, ranks send
different amounts (`ring_bytes`), so compare a rank with the rank in the same place.
"""
from __future__ import annotations

import torch

from ..runtime import tracer
from . import traced
from .p2p import Ring

_RING = {"all_reduce": traced.ring_all_reduce, "reduce_scatter": traced.ring_reduce_scatter}


def replay(calls, element_size: int = 4, group=None) -> int:
    """Re-run ``calls`` (``(op, size_in_bytes)`` pairs; op in all_reduce, reduce_scatter, all_gather) on
    distlab's ring over ``group``; returns the bytes this rank sent, counted at each send."""
    ring = Ring.of(group)                                      # the group's size and this rank's place
    dtypes = {4: torch.float32, 2: torch.bfloat16, 8: torch.float64}
    if element_size not in dtypes:
        raise ValueError(f"element_size must be one of {sorted(dtypes)} bytes, got {element_size}")
    dtype = dtypes[element_size]
    mark = len(tracer().events())
    for op, size in calls:
        if size % element_size:
            raise ValueError(f"a {op} of {size} bytes is not a whole number of {element_size}-byte elements")
        numel = size // element_size
        if op == "all_gather":                                 # size is the output: n shards
            shard = torch.tensor_split(torch.zeros(numel, dtype=dtype), ring.size)[ring.rank]
            traced.ring_all_gather(shard, group=group)
        elif op in _RING:
            _RING[op](torch.zeros(numel, dtype=dtype), group=group)
        else:
            raise ValueError(f"cannot replay {op!r}: only all_reduce, reduce_scatter and all_gather")
    # the ring's own steps only: the all-gather first swaps shard sizes (one int64 a step, its own call,
    # "exchange_sizes"), which is bookkeeping, not the message
    return sum(e.sent for e in tracer().events()[mark:] if e.kind == "comm" and e.name.startswith("ring_"))
