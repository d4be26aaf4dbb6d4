"""`dl.theory.fit_alpha_beta`: the alpha-beta fit lessons 01 and 12 run on measured all-reduce times."""
from __future__ import annotations

import random

import pytest

import distlab as dl

SIZES = [4096 * 4 ** k for k in range(7)]


@pytest.mark.parametrize("n", [2, 3, 8])
def test_recovers_the_model_it_fits(n):
    times = [dl.theory.comm_time("all_reduce", S, n, bandwidth=2e9, latency=5e-5) for S in SIZES]
    alpha, bandwidth = dl.theory.fit_alpha_beta(SIZES, times, n)
    assert alpha == pytest.approx(5e-5, rel=1e-9) and bandwidth == pytest.approx(2e9, rel=1e-9)


def test_minimises_the_relative_error():
    """Noisy times: nudging either parameter by 1% makes the summed squared relative error larger."""
    rng = random.Random(0)
    times = [dl.theory.comm_time("all_reduce", S, 4, 1e9, 1e-4) * rng.uniform(0.7, 1.4) for S in SIZES]
    alpha, bandwidth = dl.theory.fit_alpha_beta(SIZES, times, 4)

    def loss(a, b):
        return sum((dl.theory.comm_time("all_reduce", S, 4, b, a) / t - 1) ** 2 for S, t in zip(SIZES, times))

    best = loss(alpha, bandwidth)
    for a, b in ((alpha * 1.01, bandwidth), (alpha * 0.99, bandwidth), (alpha, bandwidth * 1.01),
                 (alpha, bandwidth * 0.99)):
        assert loss(a, b) > best


def test_latency_lost_in_noise_fits_bandwidth_alone_and_bad_input_is_refused():
    times = [S / 1e9 * 0.5 for S in SIZES]                    # no latency at all, times a bit uneven
    times[0] *= 0.5
    alpha, bandwidth = dl.theory.fit_alpha_beta(SIZES, times, 2)
    assert alpha == 0.0 and bandwidth > 0
    with pytest.raises(ValueError, match="at least two"):
        dl.theory.fit_alpha_beta([4096], [1e-3], 2)
