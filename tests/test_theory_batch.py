"""dl.theory.batch: the linear scaling rule, warmup, the noise scale and McCandlish's trade-off."""
import pytest

import distlab as dl


def test_linear_rule_and_warmup():
    assert dl.theory.linear_scaling_lr(0.1, 256, 8192) == pytest.approx(3.2)     # Goyal et al.: 0.1 x kn/256
    lr = 3.2
    assert [dl.theory.warmup_lr(lr, t, 4) for t in range(6)] == pytest.approx([0.8, 1.6, 2.4, 3.2, 3.2, 3.2])
    assert dl.theory.warmup_lr(lr, 0, 0) == lr


def test_noise_scale_and_tradeoff():
    assert dl.theory.noise_scale(50.0, 0.5) == 100.0
    with pytest.raises(ValueError, match="positive"):
        dl.theory.noise_scale(1.0, 0.0)
    b = 100.0
    # at B = B_noise both costs double: twice the fewest steps, twice the fewest examples
    assert dl.theory.steps_factor(b, b) == dl.theory.examples_factor(b, b) == 2.0
    # S E trade-off (McCandlish eq. 2.11): (S/S_min - 1)(E/E_min - 1) = 1 for every B
    for batch in (1, 10, 100, 1000):
        s, e = dl.theory.steps_factor(batch, b), dl.theory.examples_factor(batch, b)
        assert (s - 1) * (e - 1) == pytest.approx(1)
