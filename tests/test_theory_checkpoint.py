"""dl.theory's checkpoint cadence against Young (1974) and Daly (2006)."""
import math

import pytest

from distlab import theory


def _argmin(f, lo, hi, iters=200):
    """Golden-section minimum of a unimodal f on [lo, hi]."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(iters):
        c, d = b - g * (b - a), a + g * (b - a)
        a, b = (a, d) if f(c) < f(d) else (c, b)
    return (a + b) / 2


def test_young_is_sqrt_2_delta_m_and_minimises_the_first_order_waste():
    # a 60 s save, one failure a day: sqrt(2 * 60 * 86400) = 3219.9 s of work between saves
    assert theory.young_interval(60, 86400) == pytest.approx(3219.94, abs=0.01)
    assert theory.young_interval(60, 86400) == math.sqrt(2 * 60 * 86400)
    best = _argmin(lambda t: theory.waste_fraction(t, 60, 86400), 1, 86400)
    assert best == pytest.approx(theory.young_interval(60, 86400), rel=1e-6)
    # at the optimum the two wastes are equal: delta / tau = tau / (2 M)
    tau = theory.young_interval(60, 86400)
    assert 60 / tau == pytest.approx(tau / (2 * 86400))


def test_daly_higher_order_form_and_its_cap():
    # delta = 600 s, M = 3600 s: x = 1/12; sqrt(2 delta M) (1 + sqrt(x)/3 + x/9) - delta
    x = 600 / 7200
    expected = math.sqrt(2 * 600 * 3600) * (1 + math.sqrt(x) / 3 + x / 9) - 600
    assert theory.daly_interval(600, 3600) == pytest.approx(expected, rel=1e-12)
    assert theory.daly_interval(600, 3600) == pytest.approx(1697.7, abs=0.1)
    assert theory.daly_interval(7200, 3600) == 3600          # delta >= 2M: tau = M
    assert theory.daly_interval(1e4, 3600) == 3600
    # small delta / M: Daly tends to Young
    assert theory.daly_interval(1, 1e7) == pytest.approx(theory.young_interval(1, 1e7), rel=1e-3)


@pytest.mark.parametrize("delta, mtbf", [(10, 86400), (60, 3600), (300, 3600), (600, 3600)])
def test_daly_is_near_the_minimum_of_his_wall_time_model(delta, mtbf):
    """Daly's estimate sits within 1% of the true minimiser of T_wall (eq. 20 of the paper), and its wall
    time within 0.1% of the best; Young's first-order one drifts as delta / M grows."""
    wall = lambda t: theory.checkpointed_wall_time(1e6, t, delta, mtbf, restart_s=delta)   # noqa: E731
    best = _argmin(wall, 1, 10 * mtbf)
    daly, young = theory.daly_interval(delta, mtbf), theory.young_interval(delta, mtbf)
    assert daly == pytest.approx(best, rel=0.01)
    assert wall(daly) <= wall(best) * 1.001
    assert abs(daly - best) <= abs(young - best)


def test_wall_time_model_without_failures_is_work_plus_saves():
    # M -> infinity: T_wall -> work (1 + delta / tau)
    assert theory.checkpointed_wall_time(1000, 100, 5, 1e12) == pytest.approx(1050, rel=1e-6)


def test_interval_in_steps_and_bad_inputs():
    tau = theory.daly_interval(2.0, 3600)
    assert theory.interval_steps(0.5, 2.0, 3600) == round(tau / 0.5)
    assert theory.interval_steps(0.5, 2.0, 3600, formula="young") == round(math.sqrt(2 * 2 * 3600) / 0.5)
    assert theory.interval_steps(1e6, 2.0, 3600) == 1
    with pytest.raises(ValueError, match="mtbf_s must be a positive"):
        theory.young_interval(1, 0)
    with pytest.raises(ValueError, match="save_s must be a positive"):
        theory.daly_interval(float("nan"), 10)
    with pytest.raises(ValueError, match="formula must be"):
        theory.interval_steps(1, 1, 10, formula="other")
