"""dl.theory.scaling (Kaplan 2020, Hoffmann 2022), dl.theory.precision:
closed forms checked against brute force and against torch's own float formats."""
import math

import pytest
import torch

from distlab.theory import precision as P
from distlab.theory import scaling as S


def test_chinchilla_20_tokens_per_param_and_6nd():
    n, d = S.chinchilla_optimal(5.76e23)                 # Gopher's budget, Chinchilla's 70B / 1.4T
    assert d == pytest.approx(20 * n) and 6 * n * d == pytest.approx(5.76e23)
    assert 6.5e10 < n < 7.5e10 and 1.3e12 < d < 1.5e12
    n4, _ = S.chinchilla_optimal(4 * 5.76e23)
    assert n4 == pytest.approx(2 * n)                    # N_opt ~ C^0.5


def test_closed_form_minimises_the_fitted_loss():
    for c in (1e20, 1e23, 1e26):
        n_opt, d_opt = S.chinchilla_optimal_fit(c)
        assert 6 * n_opt * d_opt == pytest.approx(c)
        grid = [n_opt * 2 ** (k / 8) for k in range(-24, 25)]        # brute force along 6 N D = C
        best = min(grid, key=lambda n: S.chinchilla_loss(n, c / (6 * n)))
        assert best == pytest.approx(n_opt, rel=0.05)
    (n1, _), (n2, _) = S.chinchilla_optimal_fit(1e22), S.chinchilla_optimal_fit(1e24)
    assert math.log(n2 / n1) / math.log(100) == pytest.approx(0.28 / 0.62, abs=1e-9)


def test_allocation_power_law_fit_and_gpu_seconds():
    assert S.scale_allocation(10, 0.5) == pytest.approx((10 ** 0.5, 10 ** 0.5))
    assert S.scale_allocation(10, 0.73)[0] == pytest.approx(10 ** 0.73)
    c, k = S.fit_power_law([1, 10, 100], [3.0, 3.0 * 10 ** -0.3, 3.0 * 100 ** -0.3])
    assert (c, k) == (pytest.approx(3.0), pytest.approx(-0.3))
    assert S.gpu_seconds(1e18, 1e15, 0.5) == pytest.approx(2000.0)
    assert S.kaplan_loss(8.8e13) == pytest.approx(1.0)
    for bad in (lambda: S.chinchilla_optimal(0), lambda: S.gpu_seconds(1, 1, 1.5),
                lambda: S.fit_power_law([1, 2], [0, 1]), lambda: S.fit_power_law([2, 2], [1, 3])):
        with pytest.raises(ValueError):
            bad()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name", DTYPES)
def test_formats_equal_torch_finfo_and_round_as_predicted(name):
    f, fi = P.fmt(name), torch.finfo(DTYPES[name])
    assert (f.eps, f.max_value, f.min_normal, f.bytes * 8) == (fi.eps, fi.max, fi.smallest_normal, fi.bits)
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x * P.scale_for(x.abs().max().item(), name)
    x = x[x.abs() >= f.min_normal]
    rel = (x.to(DTYPES[name]).double() - x) / x
    assert 0.85 * f.unit_roundoff < rel.abs().max().item() <= f.unit_roundoff    # u / (1 + u) at 1 + u
    assert rel.square().mean().sqrt().item() == pytest.approx(P.cast_rms_error(name), rel=0.05)
    tiny = torch.tensor([P.underflow_threshold(name) * 0.99, f.min_subnormal], dtype=torch.float64)
    assert tiny.to(DTYPES[name]).double().tolist() == [0.0, f.min_subnormal]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_running_sum_of_ones_stalls_at_2_to_the_m_plus_1(name):
    acc, one = torch.zeros((), dtype=DTYPES[name]), torch.ones((), dtype=DTYPES[name])
    for _ in range(P.fmt(name).stall + 10):
        acc = acc + one
    assert acc.item() == P.fmt(name).stall


def test_collective_bytes_and_bad_input():
    assert P.collective_bytes(1000, "e4m3", 4, "all_gather", scales=1) == pytest.approx(0.75 * 1004)
    assert P.collective_bytes(1000, "bf16", 2, "all_reduce") == 2000
    assert P.sum_error_bound(65, "bf16") == pytest.approx(64 / 256 / (1 - 64 / 256))
    for bad in (lambda: P.fmt("fp4"), lambda: P.collective_bytes(1, "fp32", 2, "broadcast"),
                lambda: P.scale_for(0, "e4m3"), lambda: P.sum_error_bound(257, "bf16")):
        with pytest.raises(ValueError):
            bad()


def test_a_format_one_mantissa_bit_off_fails_the_lessons_bounds():
    """Lesson 19 asserts the RMS error within 3% of 0.42 u: data rounded to a neighbouring format (e4m3
    and e5m2 differ by one mantissa bit, bf16 and fp16 by three) lands a factor 2 or more away."""
    x = torch.rand(50_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = x.mul(5).exp()                       # 1 to 148: normal in every format, below e4m3's 448
    for rounded, claimed in (("e5m2", "e4m3"), ("e4m3", "e5m2"), ("bf16", "fp16")):
        rel = (x.to(DTYPES[rounded]).double() - x) / x
        assert abs(rel.square().mean().sqrt().item() / P.cast_rms_error(claimed) - 1) > 0.5
