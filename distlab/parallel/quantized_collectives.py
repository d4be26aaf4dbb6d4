"""Quantized all-gather and reduce-scatter: ZeRO++'s qwZ and qgZ (Wang et al. 2023), FSDP2's fp8 gather.

``QuantizedCollectives(quantize="int8" | "fp8")`` is a `Collectives` whose two sharding collectives put
block-scaled packets on the wire (`distlab.comm.quantized`: one payload byte per element plus an fp32
scale per block of 256) instead of the tensors themselves; all-reduce and broadcast are left exact.

    all_gather (weights, qwZ)              every rank: q_r = Q(shard_r)      (S/N elements -> packet)
        all-gather the packets             rank r gets q_0 .. q_{N-1}          (N-1)/N * N packets
        out = [D(q_0), ..., D(q_{N-1})]    every rank, its own part included: replicas stay identical

    reduce_scatter (gradients, qgZ)        every rank: its flat buffer as N rows, row k for rank k,
        each row quantized                 q_{r,k} = Q(flat_r[k])
        all-to-all the packets             rank k gets q_{0,k} .. q_{N-1,k}    (N-1) packets out
        out = (1/N) sum_r D(q_{r,k})       dequantized and summed in fp32 (one quantization per value,
                                           unlike a ring, which would requantize the partial sums)

Bytes against the unquantized collective of the same elements: about (1 + 4/B)/4 of fp32's, (1 + 4/B)/2
of bf16's. Errors: each value loses at most s_b/2 (int8), so a gathered weight is off by <= s_b/2 and a
reduced gradient by <= mean_r s_{r,b}/2. The packets go through torch.distributed (gloo carries uint8),
recorded by `Collectives` with their bytes (the packets'); the calls finish before they return.
"""
from __future__ import annotations

import contextlib

import torch

from ..comm import quantized as q
from .flat_collectives import Collectives, Handle


class QuantizedCollectives(Collectives):
    """`Collectives` over ``group`` whose ``all_gather`` and ``reduce_scatter`` of floating-point buffers
    send block-quantized packets (``quantize``: "int8" or "fp8"; ``block``: elements per scale).
    ``with comm.exact():`` turns quantization off for a block (a full state dict must be exact)."""

    def __init__(self, quantize: str, comm: str = "torch", group=None, block: int = q.BLOCK):
        q.check_kind(quantize)
        if comm != "torch":
            raise ValueError(f"quantize={quantize!r} sends its packets through torch.distributed: use "
                             f"comm='torch' (got comm={comm!r})")
        super().__init__(comm, group)
        self.quantize, self.block = quantize, block

    @contextlib.contextmanager
    def exact(self):
        """Inside: the plain collectives (e.g. gathering a checkpoint's full weights)."""
        kind, self.quantize = self.quantize, None
        try:
            yield
        finally:
            self.quantize = kind

    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Handle:
        """``out`` <- every rank's ``shard``, each quantized and dequantized (its own too)."""
        if self.quantize is None or not shard.is_floating_point() or self.size == 1:
            return super().all_gather(out, shard, async_op)
        if out.numel() != self.size * shard.numel():
            raise ValueError(f"all_gather needs out of {self.size} x {shard.numel()} elements, "
                             f"got {out.numel()}")
        packet = q.pack(*q.quantize(shard, self.quantize, self.block))               # (P,) uint8
        packets = torch.empty(self.size * packet.numel(), dtype=torch.uint8, device=packet.device)
        super().all_gather(packets, packet)                  # traced there: the packets' bytes
        parts = [q.dequantize(*q.unpack(p, self.quantize, self.block), shard.numel())
                 for p in packets.view(self.size, -1)]                                 # N x (S/N,) fp32
        out.view(-1).copy_(torch.cat(parts))
        return Handle()

    @torch.no_grad()
    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, op: str = "avg",
                       async_op: bool = False) -> Handle:
        """``out`` <- the sum (op "sum") or mean ("avg") over ranks of their quantized row ``rank``."""
        if self.quantize is None or not flat.is_floating_point() or self.size == 1:
            return super().reduce_scatter(flat, out, op, async_op)
        if flat.numel() != self.size * out.numel():
            raise ValueError(f"reduce_scatter needs a flat buffer padded to {self.size} x {out.numel()} "
                             f"elements, got {flat.numel()}")
        rows = flat.view(self.size, -1)                                                # (N, S/N)
        send = torch.stack([q.pack(*q.quantize(row, self.quantize, self.block)) for row in rows])  # (N, P)
        recv = torch.empty_like(send)
        self.all_to_all(recv, send)                          # row k to rank k, (N-1) packets each way
        total = sum(q.dequantize(*q.unpack(p, self.quantize, self.block), out.numel()) for p in recv)
        out.view(-1).copy_(total / self.size if op == "avg" else total)
        return Handle()


def collectives(comm: str = "torch", group=None, quantize: str | None = None) -> Collectives:
    """A `Collectives`, quantized when ``quantize`` is "int8" or "fp8"."""
    return Collectives(comm, group) if quantize is None else QuantizedCollectives(quantize, comm, group)


def exact(comm: Collectives):
    """A context in which ``comm``'s collectives are exact (a no-op for plain `Collectives`)."""
    return comm.exact() if isinstance(comm, QuantizedCollectives) else contextlib.nullcontext()
