"""Floating-point formats for training: range, precision, and what a low-precision step costs.

A binary float with e exponent bits and m explicit mantissa bits stores (-1)^s 1.f x 2^(E - bias)::

    sign | exponent (e bits) | mantissa (m bits)        fp32 1|8|23   bf16 1|8|7   fp16 1|5|10
                                                        fp8 e4m3 1|4|3   fp8 e5m2 1|5|2

    unit roundoff   u = 2^-(m+1)       round to nearest: |fl(x) - x| <= u |x| in the normal range
    machine eps     2u = 2^-m          the gap above 1.0 (torch.finfo(dtype).eps)
    min normal      2^(1 - bias)       below it the gap stays fixed (subnormals): relative error grows
    min subnormal   2^(1 - bias - m)   below half of it a value rounds to 0 (underflow)
    max             (2 - 2^-m) 2^(emax)   (e4m3: 448, its all-ones pattern being NaN, no infinities)

bf16 keeps fp32's 8 exponent bits (same range, 3.4e38) with 7 mantissa bits (u = 2^-8); fp16 has
more precision (u = 2^-11) but a range of 6e-8 to 65504, hence loss scaling (Micikevicius et al.
2018, "Mixed Precision Training", ICLR). FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep
Learning"): e4m3 (u = 2^-4, max 448) for weights and activations, e5m2 (u = 2^-3, max 57344) for
gradients, each tensor multiplied by a scale s = max_format / amax before the cast.

Two consequences the lessons measure (Higham 2002, "Accuracy and Stability of Numerical
Algorithms", ch. 4):

* adding 1 to a running sum stops changing it at 2^(m+1) (the gap there is 2, and x + 1 is a tie
  that rounds to even): a bf16 accumulator of ones stalls at 256, fp16 at 2048, fp32 at 2^24;
* summing k numbers in recursive order has a relative error of at most (k - 1) u / (1 - (k - 1) u)
  times sum |x_i| / |sum x_i| (worst case; typically about sqrt(k) u).

Rounding error of a cast, for values spread log-uniformly within a binade (as a Gaussian's are):
the error is uniform in +-ulp/2 with ulp = 2u x 2^E, so the RMS relative error is
2u sqrt(E[1/x^2] / 12) with x the significand in [1, 2): E[1/x^2] = 3 / (8 ln 2), about 0.42 u.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: ``exponent`` and ``mantissa`` bits (the explicit ones)."""
    name: str
    exponent: int
    mantissa: int
    max_value: float
    bytes: float

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent - 1) - 1

    @property
    def unit_roundoff(self) -> float:
        """u = 2^-(m+1): the largest relative error of rounding to nearest in the normal range."""
        return 2.0 ** -(self.mantissa + 1)

    @property
    def eps(self) -> float:
        """2u = 2^-m, the gap between 1.0 and the next number (torch.finfo(dtype).eps)."""
        return 2.0 ** -self.mantissa

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa)

    @property
    def stall(self) -> int:
        """The count at which a running sum of ones stops growing: 2^(m+1)."""
        return 2 ** (self.mantissa + 1)


def _ieee_max(exponent: int, mantissa: int) -> float:
    return (2.0 - 2.0 ** -mantissa) * 2.0 ** (2 ** (exponent - 1) - 1)


#: the formats of mixed-precision and FP8 training (Micikevicius et al. 2018, 2022)
FORMATS = {
    "fp32": FloatFormat("fp32", 8, 23, _ieee_max(8, 23), 4),
    "bf16": FloatFormat("bf16", 8, 7, _ieee_max(8, 7), 2),
    "fp16": FloatFormat("fp16", 5, 10, _ieee_max(5, 10), 2),
    "e4m3": FloatFormat("e4m3", 4, 3, 448.0, 1),          # no inf: the top exponent holds 1.75 x 2^8
    "e5m2": FloatFormat("e5m2", 5, 2, _ieee_max(5, 2), 1),
}


def fmt(name: str) -> FloatFormat:
    """The `FloatFormat` called ``name`` (fp32, bf16, fp16, e4m3, e5m2)."""
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def cast_rms_error(name: str) -> float:
    """Predicted RMS relative error of rounding log-uniformly spread normal-range values to ``name``:
    2u sqrt(3 / (8 ln 2) / 12), about 0.42 u."""
    return 2.0 * fmt(name).unit_roundoff * math.sqrt(3.0 / (8.0 * math.log(2.0)) / 12.0)


def sum_error_bound(k: int, name: str) -> float:
    """Higham's worst-case relative error of recursive summation of k terms of one sign:
    gamma_{k-1} = (k-1) u / (1 - (k-1) u)."""
    u = fmt(name).unit_roundoff
    if k < 1 or (k - 1) * u >= 1:
        raise ValueError(f"need k >= 1 and (k-1) u < 1, got k={k} for {name}")
    return (k - 1) * u / (1.0 - (k - 1) * u)


def underflow_threshold(name: str) -> float:
    """Magnitudes below this round to zero: half the smallest subnormal."""
    return fmt(name).min_subnormal / 2.0


def scale_for(amax: float, name: str, margin: int = 0) -> float:
    """The per-tensor scale of a scaled cast: max_format / amax, divided by 2^margin (Micikevicius et
    al. 2022: a margin leaves headroom for a later, larger amax)."""
    if not amax > 0:
        raise ValueError(f"amax must be > 0, got {amax!r}")
    return fmt(name).max_value / amax / 2.0 ** margin


def collective_bytes(numel: int, name: str, n: int, op: str = "all_gather", scales: int = 0) -> float:
    """Bytes each rank sends in a ring ``op`` ("all_gather", "reduce_scatter", "all_reduce") of ``numel``
    elements in format ``name``, plus ``scales`` fp32 scale factors gathered alongside (fp8: one per
    tensor or block): (n-1)/n S, or 2(n-1)/n S for an all-reduce."""
    factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
    if op not in factor or n < 1:
        raise ValueError(f"op must be one of {', '.join(factor)} and n >= 1; got {op!r}, n={n}")
    return factor[op] * (numel * fmt(name).bytes + 4 * scales)
