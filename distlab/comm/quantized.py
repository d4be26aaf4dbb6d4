"""Block-scaled quantization for the wire: int8 and fp8 payloads with one fp32 scale per block.

ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training") all-gathers weights in int8 (qwZ) and reduce-scatters gradients in int8 (qgZ); FSDP2's
float8 all-gather does the same with fp8. Both cut a tensor into blocks and give every block its own
scale, so one large value spoils only its own block's resolution:

    x (n,) -> pad to k blocks of B -> (k, B)
    int8:  s_b = absmax_b / 127     q = round(x / s_b)  in [-127, 127]    |x - q s_b| <= s_b / 2
    fp8:   s_b = absmax_b / 448     q = fp8_e4m3(x / s_b)                  |x - q s_b| <= |x| 2^-4
                                                                           (+ s_b 2^-10 near zero)
    on the wire:  k B payload bytes  +  4 k scale bytes   (B = 256: 1/4 + 1/64 of fp32's bytes)

Both halves travel as one uint8 *packet* (payload bytes, then the scales' bytes), so one collective
moves them and gloo, which has no fp8 type, carries fp8 too. Pure tensor code: no process group here;
`distlab.parallel.quantized_collectives` sends the packets.
"""
from __future__ import annotations

import math

import torch

BLOCK = 256                      # elements per scale (ZeRO++ uses a few hundred to a few thousand)
KINDS = ("int8", "fp8")
QMAX = {"int8": 127.0, "fp8": 448.0}         # the largest magnitude each payload holds (e4m3fn: 448)


def fp8_dtype() -> torch.dtype:
    """torch's float8_e4m3fn; a clear error where this torch has no fp8 type."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise ValueError(f"quantize='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
                         "use quantize='int8' or torch >= 2.1")
    return dtype


def check_kind(kind: str) -> None:
    """Refuse an unknown ``kind`` (or fp8 on a torch without it), before any rank starts."""
    if kind not in KINDS:
        raise ValueError(f"quantize={kind!r}: choose 'int8' or 'fp8' (or None: no quantization)")
    if kind == "fp8":
        fp8_dtype()


def blocks(numel: int, block: int = BLOCK) -> int:
    """k: how many blocks of ``block`` elements cover ``numel`` (the last one padded)."""
    return max(1, math.ceil(numel / block))


def packet_bytes(numel: int, block: int = BLOCK) -> int:
    """Bytes of the packet of ``numel`` elements: one payload byte per padded element, 4 per scale."""
    k = blocks(numel, block)
    return k * block + 4 * k


@torch.no_grad()
def quantize(x: torch.Tensor, kind: str, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload (k, B) int8 or fp8, scales (k,) fp32) of ``x`` flattened and zero-padded to k B."""
    flat = x.detach().reshape(-1).float()
    k = blocks(flat.numel(), block)
    padded = torch.zeros(k * block, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    rows = padded.view(k, block)                                       # (k, B)
    absmax = rows.abs().amax(dim=1)                                    # (k,)
    scales = torch.where(absmax > 0, absmax / QMAX[kind], torch.ones_like(absmax))   # an all-zero block: 1
    scaled = rows / scales[:, None]
    if kind == "int8":
        payload = scaled.round().clamp_(-127, 127).to(torch.int8)
    else:
        payload = scaled.to(fp8_dtype())                               # round to nearest e4m3
    return payload, scales


@torch.no_grad()
def dequantize(payload: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values (``numel``,) that ``payload`` and ``scales`` stand for: q s_b, padding cut off."""
    return (payload.float() * scales[:, None]).reshape(-1)[:numel]


def pack(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One uint8 packet: the payload's bytes, then the scales' (k B + 4 k bytes)."""
    return torch.cat([payload.reshape(-1).view(torch.uint8), scales.view(torch.uint8)])


def unpack(packet: torch.Tensor, kind: str, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload (k, B), scales (k,)) back from `pack`'s packet."""
    k = packet.numel() // (block + 4)
    dtype = torch.int8 if kind == "int8" else fp8_dtype()
    payload = packet[:k * block].view(dtype).view(k, block)
    scales = packet[k * block:].clone().view(torch.float32)           # clone: aligned for the float view
    return payload, scales


def roundtrip(x: torch.Tensor, kind: str, block: int = BLOCK) -> torch.Tensor:
    """What a receiver makes of ``x``: quantized and dequantized, in ``x``'s shape and dtype."""
    payload, scales = quantize(x, kind, block)
    return dequantize(payload, scales, x.numel()).view(x.shape).to(x.dtype)


def error_bound(x: torch.Tensor, kind: str, block: int = BLOCK) -> torch.Tensor:
    """Per element of ``x`` (flattened), the most round-to-nearest may lose: s_b / 2 (int8);
    |x| 2^-4 + s_b 2^-10 (fp8 e4m3: 3 mantissa bits, subnormals below 2^-6 spaced 2^-9)."""
    _, scales = quantize(x, kind, block)
    per = scales.repeat_interleave(block)[:x.numel()]
    if kind == "int8":
        return per / 2
    return x.detach().reshape(-1).float().abs() * 2.0 ** -4 + per * 2.0 ** -10
