"""Memory per GPU: parameters, gradients, optimizer state (ZeRO) and activations.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1): mixed-precision Adam keeps 2 bytes of
16-bit parameters, 2 of 16-bit gradients and K = 12 of optimizer state (fp32 master copy,
momentum, variance) per parameter -- 16 Psi in all. Over N_d data-parallel ranks:

    stage 0   (2 + 2 + K) Psi             7.5B on 64 GPUs: 120 GB
    stage 1   2 Psi + 2 Psi + K Psi / N_d                   31.4 GB
    stage 2   2 Psi + (2 + K) Psi / N_d                     16.6 GB
    stage 3   (2 + 2 + K) Psi / N_d                          1.9 GB

Without the master copy K = 8 (7B: 12 bytes/param = 84 GB); pure fp32 Adam is 4 + 4 + 8
(7B: 112 GB). A sharded flat buffer of ``numel`` elements over N ranks holds
``shard_numel(numel, N) = ceil(numel / N)`` per rank (the last shard is padded), which is what
``memory`` charges, so a measured ledger matches it exactly, not just on average.
Tensor and pipeline parallelism split the weights first: Psi / (tp * pp) per rank (layer norms
replicated across TP are ignored: < 0.1% of a large model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from distlab.theory.activations import activation_bytes_per_layer, pipeline_in_flight
from distlab.theory.presets import ModelPreset, model as model_preset

PRECISIONS = {"fp32": 4, "bf16-mixed": 2, "fp16-mixed": 2}
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}   # fp32 tensors per param


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU by category."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations}


def shard_numel(numel: int, n: int) -> int:
    """Elements each of ``n`` ranks holds of a flat buffer of ``numel``: ``ceil(numel / n)``."""
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    return -(-int(numel) // n)


def fsdp_padding(shapes: list[tuple[int, ...]], n: int, layout: str = "per-param") -> int:
    """Zero elements a unit's all-gather carries beyond its parameters, over all ``n`` ranks.

    ``"flat"`` (FSDP1, ZeRO-3): the unit's parameters concatenated, padded once to a multiple of n:
    ``n ceil(sum numel / n) - sum numel`` (< n). ``"per-param"`` (FSDP2): each parameter padded on
    dim 0 to ``n ceil(d0 / n)`` rows: ``sum (n ceil(d0 / n) - d0) x (elements per row)``."""
    if n < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n}")
    numels = [math.prod(s) for s in shapes]
    if layout == "flat":
        return n * shard_numel(sum(numels), n) - sum(numels)
    if layout != "per-param":
        raise ValueError(f"layout={layout!r}: choose 'flat' (FSDP1) or 'per-param' (FSDP2)")
    return sum((n * shard_numel(s[0], n) - s[0]) * (k // s[0]) for s, k in zip(shapes, numels) if s and s[0])


def bytes_per_param(precision: str = "bf16-mixed", optimizer: str = "adam",
                    master_weights: bool = True) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter; the ZeRO paper's (2, 2, K)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    weight = PRECISIONS[precision]
    master = 4 if weight < 4 and master_weights else 0
    return weight, weight, master + 4 * OPTIMIZER_STATES[optimizer]


def memory(params: int | float | str | ModelPreset, dp: int = 1, zero: int = 0,
           precision: str = "bf16-mixed", optimizer: str = "adam", master_weights: bool = True,
           tp: int = 1, pp: int = 1, *, seq_len: int = 0, micro_batch: int = 1,
           hidden: int | None = None, heads: int | None = None, layers: int | None = None,
           sp: bool = False, recompute: str = "none", schedule: str = "1f1b",
           microbatches: int | None = None, virtual: int = 1, stage: int = 0) -> MemoryBreakdown:
    """Bytes per GPU for training a model of ``params`` parameters (or a preset name).

    Activations stay 0 unless ``seq_len`` is given with the shape (``hidden``, ``heads``,
    ``layers``; a preset supplies them); they are pipeline rank ``stage``'s peak (the first by
    default, the fullest): per-layer bytes (Korthikanti et al. 2022) x ``layers / pp`` x
    microbatches in flight under ``schedule`` (``microbatches`` defaults to ``pp``).
    """
    shape = model_preset(params) if isinstance(params, str) else params
    if isinstance(shape, ModelPreset):
        params = shape.params
        hidden, heads, layers = hidden or shape.hidden, heads or shape.heads, layers or shape.layers
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("micro_batch", micro_batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    per_param, per_grad, per_state = bytes_per_param(precision, optimizer, master_weights)
    local = shard_numel(params, tp * pp)
    sharded = shard_numel(local, dp)
    activations = 0.0
    if seq_len:
        if not (hidden and heads and layers):
            raise ValueError("activation memory needs hidden, heads and layers (or a model preset name)")
        per_layer = activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, tp, sp, recompute)
        in_flight = pipeline_in_flight(schedule, pp, microbatches or pp, virtual, stage)
        activations = per_layer * (layers / pp) * in_flight
    return MemoryBreakdown(
        params=per_param * (sharded if zero >= 3 else local),
        grads=per_grad * (sharded if zero >= 2 else local),
        optimizer=per_state * (sharded if zero >= 1 else local),
        activations=activations,
    )
