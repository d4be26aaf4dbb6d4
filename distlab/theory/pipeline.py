"""Pipeline bubbles: the idle share of a training step.

Per rank, with forward time t_f, backward t_b (split: input-grad t_i = t_b - t_w, weight-grad
t_w), p stages, m microbatches, v chunks per rank:

    gpipe, 1f1b   (p-1)(t_f + t_b)                         Huang et al. 2019; Narayanan et al. 2021
    interleaved   (p-1)(t_f + t_b), times per chunk        Narayanan et al. 2021 (ideal v m (t_f + t_b))
    zb-h1         (p-1)(t_f + t_i - t_w)  (m >= p)         Qi et al. 2023, Table 2
    zb-h2         (p-1)(t_f + t_i - 2 t_w), at least 0     Qi et al. 2023, Table 2
    dualpipe      (p/2 - 1)(t_fb + t_b - 3 t_w)            DeepSeek-AI 2024 (V3 report), Table 2;
                                                           t_fb: an overlapped F&B chunk (default t_f + t_b)

Two conventions: ``"total"`` divides the bubble by the whole step (bubble + ideal), giving
(p-1)/(m+p-1) for 1F1B -- what a timeline shows idle; ``"ideal"`` divides by the ideal compute
time, giving Megatron's (p-1)/m and (p-1)/(v m).
"""
from __future__ import annotations

BUBBLE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "dualpipe")


def bubble_time(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float | None = None,
                t_w: float | None = None, t_fb: float | None = None) -> float:
    """Idle time per rank in one step (same units as the times)."""
    if schedule not in BUBBLE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(BUBBLE_SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"v={v} chunks per rank needs schedule='interleaved', not {schedule!r}")
    t_b = t_f if t_b is None else t_b
    t_w = t_b / 2 if t_w is None else t_w
    t_i = t_b - t_w
    if schedule in ("gpipe", "1f1b", "interleaved"):
        return (p - 1) * (t_f + t_b)
    if schedule == "zb-h1":      # exact for any m in distlab's schedule; paper's form when m >= p
        return (p - 1) * (t_f + t_i) - (min(m, p) - 1) * t_w
    if schedule == "zb-h2":
        return max(0.0, (p - 1) * (t_f + t_i - 2 * t_w))
    if p % 2:
        raise ValueError(f"dualpipe needs an even number of stages, got p={p}")
    t_fb = t_f + t_b if t_fb is None else t_fb
    return max(0.0, (p / 2 - 1) * (t_fb + t_b - 3 * t_w))


def bubble(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float | None = None,
           t_w: float | None = None, t_fb: float | None = None, convention: str = "total") -> float:
    """Bubble fraction. ``convention="total"``: idle / step time, (p-1)/(m+p-1) for 1F1B;
    ``"ideal"``: idle / ideal compute, (p-1)/m. ``t_b`` defaults to ``t_f`` (equal F and B)."""
    if convention not in ("total", "ideal"):
        raise ValueError(f"convention must be 'total' or 'ideal', got {convention!r}")
    idle = bubble_time(schedule, p, m, v, t_f, t_b, t_w, t_fb)
    t_b = t_f if t_b is None else t_b
    ideal = (v if schedule == "interleaved" else 1) * m * (t_f + t_b)
    return idle / (ideal + idle) if convention == "total" else idle / ideal
