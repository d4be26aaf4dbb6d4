"""Scaling laws: the compute-optimal model and data size, and what a budget costs a cluster.

Training compute C ~ 6 N D FLOPs for N parameters and D tokens (`throughput.training_flops`).
Given C, how large a model, trained on how many tokens, reaches the lowest loss?

Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", Sec. 6) fit power laws in C:
N_opt ~ C^0.73, so D_opt = C / (6 N_opt) ~ C^0.27: most of a larger budget goes into the model.

Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", Chinchilla) fit, with
learning-rate schedules matched to each run's length, the loss surface (their Approach 3, eq. 10)::

    L(N, D) = E + A / N^alpha + B / D^beta       E = 1.69, A = 406.4, B = 410.7,
                                                 alpha = 0.34, beta = 0.28

Minimising it under 6 N D = C gives (their eq. 4)::

    N_opt = G (C/6)^a      D_opt = (C/6)^b / G     a = beta/(alpha+beta), b = alpha/(alpha+beta)
    G = (alpha A / (beta B))^(1/(alpha+beta))

Their three approaches give a = 0.50, 0.49, 0.46 (Table 2): N and D grow about equally, as
C^0.5 each, at about 20 tokens per parameter (Chinchilla itself: 70B parameters, 1.4T tokens)::

    D = 20 N  and  C = 6 N D = 120 N^2   =>   N_opt = sqrt(C / 120),  D_opt = 20 N_opt

Kaplan's smaller-data allocation came partly from a learning-rate schedule not shortened for short
runs (Hoffmann et al., Sec. 2). What a budget costs a cluster: GPU-seconds = C / (peak x MFU).

Power laws are fitted here as straight lines in log-log space (`fit_power_law`), pure Python.
"""
from __future__ import annotations

import math

#: Hoffmann et al. 2022, Approach 3 (eq. 10): the fitted loss surface L(N, D) = E + A/N^alpha + B/D^beta
CHINCHILLA_FIT = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
#: Hoffmann et al. 2022, Table 2: the exponent a of N_opt ~ C^a by approach (b = 1 - a), and Kaplan's
CHINCHILLA_EXPONENTS = {"approach 1": 0.50, "approach 2": 0.49, "approach 3": 0.46, "kaplan": 0.73}
TOKENS_PER_PARAM = 20.0                 # Hoffmann et al. 2022: compute-optimal D / N, about 20
#: Kaplan et al. 2020, eq. 1.1: L(N) = (N_c / N)^alpha_N for non-embedding parameters, data unlimited
KAPLAN_N = {"N_c": 8.8e13, "alpha_N": 0.076}


def _check_compute(compute: float) -> None:
    if not compute > 0:
        raise ValueError(f"compute must be a positive number of FLOPs, got {compute!r}")


def chinchilla_optimal(compute: float, tokens_per_param: float = TOKENS_PER_PARAM) -> tuple[float, float]:
    """(N_opt, D_opt) for C FLOPs at a fixed D/N ratio (Hoffmann et al. 2022: about 20):
    6 N (r N) = C, so N = sqrt(C / (6 r)) and D = r N; both grow as C^0.5."""
    _check_compute(compute)
    n = math.sqrt(compute / (6.0 * tokens_per_param))
    return n, tokens_per_param * n


def chinchilla_loss(params: float, tokens: float, fit: dict | None = None) -> float:
    """Hoffmann et al.'s fitted loss L(N, D) = E + A / N^alpha + B / D^beta (nats per token, MassiveText)."""
    f = fit or CHINCHILLA_FIT
    return f["E"] + f["A"] / params ** f["alpha"] + f["B"] / tokens ** f["beta"]


def chinchilla_optimal_fit(compute: float, fit: dict | None = None) -> tuple[float, float]:
    """(N_opt, D_opt) minimising `chinchilla_loss` under 6 N D = C, in closed form (their eq. 4):
    N_opt = G (C/6)^(beta/(alpha+beta)), D_opt = (C/6)^(alpha/(alpha+beta)) / G,
    G = (alpha A / (beta B))^(1/(alpha+beta))."""
    _check_compute(compute)
    f = fit or CHINCHILLA_FIT
    s = f["alpha"] + f["beta"]
    g = (f["alpha"] * f["A"] / (f["beta"] * f["B"])) ** (1.0 / s)
    return g * (compute / 6.0) ** (f["beta"] / s), (compute / 6.0) ** (f["alpha"] / s) / g


def kaplan_loss(params: float) -> float:
    """Kaplan et al.'s L(N) = (N_c / N)^alpha_N: a model of N non-embedding parameters trained to
    convergence on unlimited data (nats per token, WebText2)."""
    return (KAPLAN_N["N_c"] / params) ** KAPLAN_N["alpha_N"]


def scale_allocation(factor: float, exponent: float) -> tuple[float, float]:
    """How much larger the model and the data get when the compute grows by ``factor`` and
    N_opt ~ C^exponent (so D_opt = C / 6N ~ C^(1 - exponent)): (N factor, D factor)."""
    if not factor > 0 or not 0 < exponent < 1:
        raise ValueError(f"need factor > 0 and 0 < exponent < 1, got {factor!r}, {exponent!r}")
    return factor ** exponent, factor ** (1.0 - exponent)


def gpu_seconds(compute: float, peak_flops: float, mfu: float) -> float:
    """GPU-seconds to spend C FLOPs at a model FLOPs utilisation: C / (peak x MFU)."""
    _check_compute(compute)
    if not 0 < mfu <= 1 or not peak_flops > 0:
        raise ValueError(f"need 0 < mfu <= 1 and peak_flops > 0, got {mfu!r}, {peak_flops!r}")
    return compute / (peak_flops * mfu)


def fit_power_law(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(c, k) of y = c x^k by least squares on log y = log c + k log x (all values > 0)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need at least two (x, y) pairs of equal length")
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError("a power law is fitted in log space: every x and y must be > 0")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    if sxx == 0:
        raise ValueError("the xs must not all be equal")
    k = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx
    return math.exp(my - k * mx), k
