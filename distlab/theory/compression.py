"""Talking less: how many numbers a compressed, infrequent or quantized data-parallel step sends.

PowerSGD (Vogels, Karimireddy and Jaggi 2019, NeurIPS) sends, for each gradient matrix n x m, the
factors P (n x r) and Q (m x r) of a rank-r approximation instead of the n m entries:

    elements per step = sum over matrices (n + m) min(r, n, m)  +  sum over vectors numel
    compression ratio = (sum n m + vectors) / elements

On a ring each all-reduced element still costs 2 (N-1)/N of its bytes per rank (`comm.dp_volume`).
"""
from __future__ import annotations


def powersgd_elements(matrices: list[tuple[int, int]], rank: int, vector_numel: int = 0) -> int:
    """Numbers all-reduced per step by PowerSGD of rank ``rank`` (matrices as (n, m); vectors whole)."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    return sum((n + m) * min(rank, n, m) for n, m in matrices) + vector_numel


def powersgd_ratio(matrices: list[tuple[int, int]], rank: int, vector_numel: int = 0) -> float:
    """Uncompressed over compressed elements: how many times fewer bytes PowerSGD sends than DDP."""
    full = sum(n * m for n, m in matrices) + vector_numel
    return full / powersgd_elements(matrices, rank, vector_numel)


# -- talking less often: local SGD and DiLoCo ---------------------------------------------------------
# Local SGD (Stich 2019; Lin et al. 2020) and DiLoCo (Douillard et al. 2023) all-reduce the parameters
# (DiLoCo: their change) once every H inner steps instead of the gradients every step:
#
#     bytes per step per rank = 2 (N-1)/N Psi / H        (DDP's, `comm.dp_volume`, over H)

def local_sgd_volume(param_bytes: float, n: int, sync_every: int) -> float:
    """Bytes each rank sends per step, on average, when the replicas sync every ``sync_every`` steps."""
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    return 2 * (n - 1) / n * param_bytes / sync_every


# -- talking in fewer bits: block-scaled quantization (ZeRO++ qwZ / qgZ, Wang et al. 2023) -----------
# Each block of B elements travels as B one-byte codes plus one fp32 scale s = absmax / qmax:
#
#     packet bytes  = ceil(numel / B) (B + 4)           ratio to the unquantized = (1 + 4/B) / element_bytes
#     int8 error    <= s / 2 per element (round to nearest); uniform on [-s/2, s/2]: rms s / sqrt(12)

QMAX = {"int8": 127.0, "fp8": 448.0}


def quantized_bytes(numel: int, block: int = 256, scale_bytes: int = 4) -> int:
    """Bytes of ``numel`` elements quantized in blocks of ``block`` (the last one padded)."""
    if numel < 0 or block < 1:
        raise ValueError(f"need numel >= 0 and block >= 1, got numel={numel}, block={block}")
    return max(1, -(-numel // block)) * (block + scale_bytes)


def quantized_ratio(element_bytes: int = 4, block: int = 256, scale_bytes: int = 4) -> float:
    """Quantized over unquantized bytes: (1 + scale_bytes / block) / element_bytes (fp32 ~1/4, bf16 ~1/2)."""
    return (1 + scale_bytes / block) / element_bytes


def quantized_volume(volume_bytes: float, element_bytes: int = 4, block: int = 256) -> float:
    """A collective's bytes per rank (e.g. `comm.zero_volume` (3, ...)) when its elements travel quantized."""
    return volume_bytes * quantized_ratio(element_bytes, block)


def int8_error(absmax: float) -> dict[str, float]:
    """The most and the rms error per element of a block whose largest magnitude is ``absmax`` (int8):
    ``{"bound": s / 2, "rms": s / sqrt(12)}`` with s = absmax / 127."""
    s = absmax / QMAX["int8"]
    return {"bound": s / 2, "rms": s / 12 ** 0.5}


def step_time_on_link(compute: float, comm_bytes: float, bandwidth: float, latency: float = 0.0,
              messages: float = 1.0) -> float:
    """Seconds per step when ``comm_bytes`` per rank (averaged per step) cross a link of ``bandwidth``
    bytes/s, with ``messages`` latencies per step, and nothing overlaps the compute (the worst case)."""
    return compute + comm_bytes / bandwidth + messages * latency
