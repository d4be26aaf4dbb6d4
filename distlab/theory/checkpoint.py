"""How often to checkpoint: Young's and Daly's optimal interval, and the wall time it buys.

A job that saves every ``tau`` seconds of work, spends ``delta`` seconds per save and fails on
average every ``M`` seconds (the MTBF of the whole job: one node's MTBF / nodes) pays twice::

    |<-- tau -->|d|<-- tau -->|d|<-- tau --X            X: a failure
                                 |R|<-- redo -->|...    R: restart; redo: the work since the last save

saving (``delta / tau`` of the time) and redoing the work lost at each failure (on average half an
interval, every ``M`` seconds: ``tau / (2 M)``). The first-order waste ``delta / tau + tau / (2 M)``
is smallest at

    Young (1974):  tau_opt = sqrt(2 delta M)

Daly (2006) models the wall time exactly for exponentially distributed failures,

    T_wall = M e^(R / M) (e^((tau + delta) / M) - 1) T_solve / tau,

and gives its higher-order optimum

    Daly (2006):   tau_opt = sqrt(2 delta M) [1 + sqrt(delta / (2 M)) / 3 + (delta / (2 M)) / 9] - delta
                   (for delta < 2 M; otherwise tau_opt = M)

J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974.
J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
Generation Computer Systems 22(3), 2006 (eqs. 20 and 37).
All times in seconds; ``tau`` is work between saves, not counting the save itself.
"""
from __future__ import annotations

import math


def _check(save_s: float, mtbf_s: float) -> None:
    if not (save_s > 0 and math.isfinite(save_s)):
        raise ValueError(f"save_s must be a positive number of seconds, got {save_s!r}")
    if not (mtbf_s > 0 and math.isfinite(mtbf_s)):
        raise ValueError(f"mtbf_s must be a positive number of seconds, got {mtbf_s!r} (the job's mean time "
                         f"between failures: one node's MTBF divided by the nodes)")


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimal work between checkpoints, ``sqrt(2 * save_s * mtbf_s)`` seconds."""
    _check(save_s, mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal work between checkpoints (seconds); ``mtbf_s`` when
    ``save_s >= 2 * mtbf_s`` (saving takes longer than failures allow: save as often as you can)."""
    _check(save_s, mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def waste_fraction(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """Young's first-order fraction of time lost: ``save_s / interval_s + interval_s / (2 * mtbf_s)``."""
    _check(save_s, mtbf_s)
    return save_s / interval_s + interval_s / (2.0 * mtbf_s)


def checkpointed_wall_time(work_s: float, interval_s: float, save_s: float, mtbf_s: float,
                           restart_s: float = 0.0) -> float:
    """Daly's expected wall time to finish ``work_s`` seconds of work saving every ``interval_s``
    (exponential failures, mean ``mtbf_s``; ``restart_s`` to relaunch and load after each)."""
    _check(save_s, mtbf_s)
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((interval_s + save_s) / m) * work_s / interval_s


def interval_steps(step_s: float, save_s: float, mtbf_s: float, formula: str = "daly") -> int:
    """The optimal interval in whole training steps of ``step_s`` seconds (at least 1):
    ``checkpoint_every`` for `dl.train`."""
    if not step_s > 0:
        raise ValueError(f"step_s must be a positive number of seconds, got {step_s!r}")
    if formula not in ("young", "daly"):
        raise ValueError(f"formula must be 'young' or 'daly', got {formula!r}")
    tau = (young_interval if formula == "young" else daly_interval)(save_s, mtbf_s)
    return max(1, round(tau / step_s))
