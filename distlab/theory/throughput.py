"""Throughput, FLOPs and training time.

Training FLOPs ~ 6 N D for N parameters and D tokens: 2 N per token forward, 4 N backward
(Kaplan et al. 2020, Sec. 2.1; Hoffmann et al. 2022, "Chinchilla", who also give the
compute-optimal D ~ 20 N). Model FLOPs utilisation (Chowdhery et al. 2022, PaLM, App. B):
MFU = 6 N x tokens/s / (GPUs x peak FLOP/s). Scaling: N GPUs deliver N x T_1 x efficiency.
"""
from __future__ import annotations


def training_flops(params: float, tokens: float) -> float:
    """6 N D floating-point operations to train on D tokens."""
    return 6.0 * params * tokens


def training_time(params: float, tokens: float, gpus: int, peak_flops: float, mfu: float = 0.4) -> float:
    """Seconds to train: 6 N D / (gpus x peak x MFU)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction in (0, 1], got {mfu}")
    return training_flops(params, tokens) / (gpus * peak_flops * mfu)


def mfu(params: float, tokens_per_second: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: 6 N x tokens/s / (gpus x peak)."""
    return 6.0 * params * tokens_per_second / (gpus * peak_flops)


def throughput(n: int, single: float, efficiency: float = 1.0) -> float:
    """What n workers deliver: n x T_1 x efficiency (samples or tokens per second)."""
    return n * single * efficiency


def scaling_efficiency(measured: float, n: int, single: float) -> float:
    """Measured throughput over perfect linear scaling: T_n / (n x T_1)."""
    return measured / (n * single)


def chinchilla_tokens(params: float) -> float:
    """Compute-optimal training tokens, about 20 per parameter (Hoffmann et al. 2022)."""
    return 20.0 * params
