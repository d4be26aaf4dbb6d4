"""Batch size: the linear learning-rate scaling rule, warmup, and the critical batch size.

Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour": when the batch is
multiplied by k, multiply the learning rate by k (the k small steps are then about one big step),
and ramp it up linearly over the first steps (warmup), while the weights change fastest:

    lr(B) = lr_0 B / B_0          lr_t = lr(B) min(1, (t + 1) / warmup_steps)

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training": the gradient noise scale

    B_noise = tr(Sigma) / |G|^2        (Sigma: per-example gradient covariance, G: the true gradient)

predicts the critical batch size. Reaching a given loss takes S steps and E examples with

    S / S_min = 1 + B_noise / B        E / E_min = 1 + B / B_noise

so below B_noise a larger batch saves steps at almost no cost in examples; above it, each doubling
of B doubles the examples (compute) for little fewer steps. No torch here: the lessons measure
tr(Sigma) and |G|^2 and hand them in.
"""
from __future__ import annotations


def linear_scaling_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """Goyal et al.'s rule: the learning rate grows with the batch, lr_0 B / B_0."""
    return base_lr * batch / base_batch


def warmup_lr(lr: float, step: int, warmup_steps: int) -> float:
    """Linear warmup (Goyal et al. 2017, Sec. 2.2): lr (t + 1) / warmup_steps for the first steps."""
    return lr if warmup_steps <= 0 else lr * min(1.0, (step + 1) / warmup_steps)


def noise_scale(trace_cov: float, grad_sq_norm: float) -> float:
    """McCandlish et al.'s simple noise scale B_simple = tr(Sigma) / |G|^2 (eq. 2.8). Their B_noise weighs
    Sigma and G by the Hessian, tr(H Sigma) / (G^T H G): equal only when H is a multiple of the identity."""
    if grad_sq_norm <= 0:
        raise ValueError("the gradient's squared norm must be positive (at a minimum B_noise is infinite)")
    return trace_cov / grad_sq_norm


def examples_factor(batch: float, b_noise: float) -> float:
    """E / E_min = 1 + B / B_noise: examples needed at batch B over the fewest possible (B -> 0)."""
    return 1.0 + batch / b_noise


def steps_factor(batch: float, b_noise: float) -> float:
    """S / S_min = 1 + B_noise / B: steps needed at batch B over the fewest possible (B -> infinity)."""
    return 1.0 + b_noise / batch
