"""Flat, padded parameter buffers and the bucketing that DDP and ZeRO share.

Many small tensors are slow to communicate one by one (a latency alpha each), so data parallelism
packs them into *buckets*: contiguous flat buffers of about ``bucket_mb`` megabytes, filled in
**reverse registration order**, the order in which backward produces gradients (Li et al. 2020,
"PyTorch Distributed", Sec. 3.2.3). A bucket's parameters become views into its buffer.

For ZeRO each bucket is padded to a multiple of N and rank r owns chunk r of it:

    bucket (numel 10, N = 4, padded to 12)   [p3 p3 p3 p3 | p2 p2 p2 p1 | p1 p1 0 0]
    shards                                    rank 0        rank 1        rank 2 ...   3 elements each

so a reduce-scatter of the bucket lands exactly on each owner's shard and an all-gather of the
shards rebuilds the bucket. A rank owns ``ceil(numel / N)`` elements of every bucket
(`dl.theory.shard_numel`); the padding is at most N-1 elements per bucket.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..collectives import all_reduce_sum


def trainable(params) -> list[nn.Parameter]:
    """Parameters that need gradients, each once (tied parameters appear once), in registration order."""
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def bucketize(params: list[torch.Tensor], bucket_mb: float) -> list[list[torch.Tensor]]:
    """Group ``params`` into buckets of at most ``bucket_mb`` MB, in reverse registration order.

    A parameter larger than a bucket gets a bucket of its own; ``bucket_mb=0`` puts every parameter
    in its own bucket; buckets never mix dtypes.
    """
    if bucket_mb < 0:
        raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
    limit = bucket_mb * 2**20
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > limit or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def grad_summer(params: list[torch.Tensor], bucket_mb: float = 25.0, group=None):
    """A function that sums the gradients of ``params`` over ``group``: one flat all-reduce per bucket of
    about ``bucket_mb`` MB (`bucketize`: reverse order, one dtype), a missing gradient counted as zeros.
    A sum, not DDP's average: for losses already scaled by each rank's share of the batch (``ep``)."""
    buckets = bucketize(params, bucket_mb)

    def sum_grads() -> None:
        for bucket in buckets:
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in bucket]
            flat = all_reduce_sum(torch.cat([g.flatten() for g in grads]), group)      # (sum of numel,)
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad = g.view_as(p)
    return sum_grads


class FlatBucket:
    """Parameters laid out back to back in one flat buffer padded to a multiple of ``world``.

    ``full``: the padded flat buffer (the parameters are views into it);
    ``chunk(r)``: rank r's slice, ``shard_numel`` elements; ``offsets[i]``: where params[i] starts.
    """

    def __init__(self, params: list[torch.Tensor], world: int):
        self.params = list(params)
        self.world = world
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_numel = math.ceil(total / world)
        self.padded = self.shard_numel * world
        p0 = self.params[0]
        self.full = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, view in zip(self.params, self.views(self.full)):
                view.copy_(p)
                p.data = view       # the parameter now lives inside the bucket

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (padded bucket-sized) cut into tensors shaped like the parameters."""
        return [flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]

    def chunk(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def flat_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' ``.grad`` packed into a padded flat buffer (zeros where a grad is None)."""
        if out is None:
            out = torch.zeros(self.padded, dtype=self.dtype, device=self.full.device)   # (padded,)
        else:
            out.zero_()
        for p, view in zip(self.params, self.views(out)):
            if p.grad is not None:
                view.copy_(p.grad)
        return out

    def owner_slices(self, rank: int) -> list[tuple[int, slice, slice]]:
        """(param index, slice of that param's flat view, slice of the shard) for what ``rank`` owns."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for i, (o, p) in enumerate(zip(self.offsets, self.params)):
            a, b = max(o, lo), min(o + p.numel(), hi)
            if a < b:
                out.append((i, slice(a - o, b - o), slice(a - lo, b - lo)))
        return out

