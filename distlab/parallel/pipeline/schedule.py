"""Pipeline schedules as plain lists of actions, one list per pipeline rank.

Pure Python, no torch: the executor (``dl.pp.Pipeline``) runs exactly these lists, and
:func:`simulate` replays them on a clock to draw timelines and measure bubbles.

Layout (Megatron's interleaved layout): with ``p`` ranks and ``v`` virtual stages per rank,
the model is cut into ``p * v`` stages and rank ``r`` holds stages ``r, r + p, r + 2p, ...``::

    p = 2, v = 2:   rank 0: stage 0 ........ stage 2
                    rank 1: ....... stage 1 ........ stage 3

Kinds of action: ``F`` forward, ``B`` whole backward, or, where the backward is split as in
zero-bubble pipelining (Qi et al. 2023), ``I`` (gradient of the input, on the critical path)
followed later by ``W`` (gradient of the weights, free to move into idle time).

Schedules:

* ``gpipe``       Huang et al. 2019: all forwards, then all backwards. Peak activations: m per rank.
* ``1f1b``        PipeDream-Flush (Narayanan et al. 2021): warm-up forwards, steady one-forward
                  one-backward, cool-down backwards. Peak activations on rank i: min(p - i, m).
* ``interleaved`` Narayanan et al. 2021 (Megatron-LM), v model chunks per rank; the bubble
                  shrinks by v: (p - 1) / (v m + p - 1) of the step.
* ``zb-h1``       Qi et al. 2023 ZB-H1: 1F1B with the backward split and W passes delayed
                  into the cool-down; bubble (p - 1)(T_F + T_I - T_W).

Replay (:func:`simulate`): every rank runs its actions in order, each as soon as its rank is
free and its inputs exist, like a GPU stream waiting on a recv:

* ``F`` of stage s, microbatch j   after F of stage s-1, microbatch j (its input activation)
* ``B``/``I`` of stage s, mb j      after its own F, and after B/I of stage s+1 (the output grad)
* ``W`` of stage s, mb j            after I of stage s, mb j

Crossing ranks costs ``t_comm``. The bubble is the idle share of ``p x makespan``,
``1 - busy / (p * makespan)``: the ``convention="total"`` of :func:`distlab.theory.bubble`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: ``kind`` in F/B/I/W, on global ``stage``, for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"


def schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """The ordered actions of every pipeline rank for one training step.

    ``stages`` is the number of pipeline ranks p, ``microbatches`` is m and ``virtual`` is v
    (model chunks per rank, only for ``interleaved``). Returns ``actions[rank]``.
    """
    _check(name, stages, microbatches, virtual)
    p, m = stages, microbatches
    if name == "gpipe":
        return [_gpipe(rank, p, m) for rank in range(p)]
    if name == "1f1b":
        return [_one_f_one_b(rank, p, m) for rank in range(p)]
    if name == "interleaved":
        return [_interleaved(rank, p, m, virtual) for rank in range(p)]
    return [_zb_h1(rank, p, m) for rank in range(p)]


def _check(name: str, p: int, m: int, v: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if p < 1:
        raise ValueError(f"stages must be >= 1, got {p}")
    if m < 1:
        raise ValueError(f"microbatches must be >= 1, got {m}: split the batch into at least one microbatch")
    if v < 1:
        raise ValueError(f"virtual must be >= 1, got {v}")
    if v > 1 and name != "interleaved":
        raise ValueError(f"virtual={v} needs schedule='interleaved'; {name!r} holds one stage per rank")
    if name == "interleaved" and m % p:
        lower, upper = max(p, m - m % p), m + p - m % p
        raise ValueError(f"interleaved needs microbatches to be a multiple of stages (Megatron-LM's rule): "
                         f"got m={m}, p={p}; use m={lower} or m={upper}")


def _gpipe(rank: int, p: int, m: int) -> list[Action]:
    """GPipe: forward every microbatch, then backward every microbatch."""
    forwards = [Action("F", rank, mb) for mb in range(m)]
    backwards = [Action("B", rank, mb) for mb in range(m)]
    return forwards + backwards


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    """1F1B: ``p - rank - 1`` warm-up forwards, then alternate F and B, then drain the Bs."""
    warmup = min(p - rank - 1, m)
    actions = [Action("F", rank, mb) for mb in range(warmup)]
    for step in range(m - warmup):                       # steady 1F1B
        actions.append(Action("F", rank, warmup + step))
        actions.append(Action("B", rank, step))
    for mb in range(m - warmup, m):                      # cool-down
        actions.append(Action("B", rank, mb))
    return actions


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): forwards walk chunks 0..v-1 in groups of p microbatches,
    backwards walk chunks v-1..0; warm-up is ``2(p - rank - 1) + (v - 1) p`` chunk-forwards."""
    total = m * v

    def forward(k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk, offset = divmod(within, p)
        return Action("F", chunk * p + rank, group * p + offset)

    def backward(k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk, offset = divmod(within, p)
        return Action("B", (v - 1 - chunk) * p + rank, group * p + offset)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):                      # steady 1F1B
        actions.append(forward(warmup + k))
        actions.append(backward(k))
    for k in range(total - warmup, total):               # cool-down
        actions.append(backward(k))
    return actions


def _zb_h1(rank: int, p: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B order with each B split into I then W, where rank r holds
    back its W passes by ``rank`` microbatches and drains them in the cool-down idle time."""
    warmup = min(p - rank - 1, m)
    delay = rank
    actions = [Action("F", rank, mb) for mb in range(warmup)]
    for step in range(m - warmup):                       # steady 1F1B, W delayed
        actions.append(Action("F", rank, warmup + step))
        actions.append(Action("I", rank, step))
        if step >= delay:
            actions.append(Action("W", rank, step - delay))
    done_w = max(0, m - warmup - delay)
    for mb in range(m - warmup, m):                      # cool-down: I, and a W into the gap
        actions.append(Action("I", rank, mb))
        if done_w <= mb - delay:
            actions.append(Action("W", rank, done_w))
            done_w += 1
    for mb in range(done_w, m):                          # drain the remaining Ws
        actions.append(Action("W", rank, mb))
    return actions


# --- replay on a clock ------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    """One action placed on the clock of its rank."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The simulated step: ``spans[rank]`` in execution order and the makespan."""

    spans: list[list[Span]] = field(repr=False)
    makespan: float

    @property
    def busy(self) -> float:
        """Compute time summed over ranks."""
        return sum(s.end - s.start for rank in self.spans for s in rank)

    @property
    def bubble(self) -> float:
        """Idle fraction of the step: ``1 - busy / (p * makespan)``."""
        capacity = len(self.spans) * self.makespan
        return 1.0 - self.busy / capacity if capacity > 0 else 0.0


class DeadlockError(RuntimeError):
    """Raised when no rank can take its next action: the schedule cannot complete."""


def durations(t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None) -> dict[str, float]:
    """Time of each kind: ``B`` takes ``t_b``; split, ``I`` takes ``t_b - t_w`` and ``W`` ``t_w``
    (``t_w`` defaults to ``t_b / 2``), so a split backward costs the same as a whole one."""
    t_w = t_b / 2 if t_w is None else t_w
    if not 0 <= t_w <= t_b:
        raise ValueError(f"t_w={t_w} must lie in [0, t_b={t_b}]: "
                         "W is the weight-gradient part of the backward")
    return {"F": t_f, "B": t_b, "I": t_b - t_w, "W": t_w}


def _inputs(action: Action, num_stages: int) -> list[tuple[str, int, int]]:
    """What ``action`` waits for, as (kind, stage, microbatch); "grad" is a B or I."""
    kind, stage, mb = action.kind, action.stage, action.microbatch
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "I"):
        return [("F", stage, mb)] + ([("grad", stage + 1, mb)] if stage < num_stages - 1 else [])
    if kind == "W":
        return [("I", stage, mb)]
    raise ValueError(f"unknown action kind {kind!r}: use F, B, I or W")


def simulate(actions: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0,
             t_w: float | None = None, t_comm: float = 0.0) -> Timeline:
    """Place every action of ``actions[rank]`` on a clock; raise :class:`DeadlockError` if stuck.

    Times are per action (per model chunk for interleaved schedules); ``t_comm`` is added to
    every input that comes from another rank.
    """
    cost = durations(t_f, t_b, t_w)
    p = len(actions)
    num_stages = 1 + max((a.stage for rank in actions for a in rank), default=0)
    done: dict[tuple[str, int, int], tuple[float, int]] = {}     # -> (end time, rank)
    spans: list[list[Span]] = [[] for _ in range(p)]
    clock, cursor = [0.0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while cursor[rank] < len(actions[rank]):
                action = actions[rank][cursor[rank]]
                needs = _inputs(action, num_stages)
                if any(n not in done for n in needs):
                    break
                arrivals = [end + (t_comm if src != rank else 0.0) for end, src in map(done.get, needs)]
                start = max([clock[rank], *arrivals])
                clock[rank] = start + cost[action.kind]
                spans[rank].append(Span(rank, action, start, clock[rank]))
                done[(action.kind, action.stage, action.microbatch)] = (clock[rank], rank)
                if action.kind in ("B", "I"):
                    done[("grad", action.stage, action.microbatch)] = (clock[rank], rank)
                cursor[rank] += 1
                progress = True
    stuck = {r: actions[r][cursor[r]] for r in range(p) if cursor[r] < len(actions[r])}
    if stuck:
        raise DeadlockError(f"schedule cannot complete: every rank waits for an input that never comes; "
                            f"next action per rank: {stuck}")
    return Timeline(spans, max(clock, default=0.0))


def peak_activations(actions: list[list[Action]]) -> list[int]:
    """Most microbatch activations each rank holds at once (F stores, B or W frees).

    GPipe holds m on every rank; 1F1B holds min(p - i, m) on rank i (Narayanan et al. 2021);
    interleaved rank 0 holds p v + p - 1 chunks, i.e. 1 + (p-1)/(p v) times 1F1B's
    (Korthikanti et al. 2022); ZB-H1 holds p on every rank, 1F1B's peak (Qi et al. 2023).
    """
    peaks = []
    for rank in actions:
        live = peak = 0
        for a in rank:
            live += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
            peak = max(peak, live)
        peaks.append(peak)
    return peaks
