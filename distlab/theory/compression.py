"""Gradient compression: how many numbers a compressed data-parallel step all-reduces.

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
