"""Pipeline schedules: every action exactly once, in a legal order, with theory's bubble."""
from collections import Counter

import pytest

from distlab import theory
from distlab.parallel.pipeline.schedule import (Action, DeadlockError, peak_activations, schedule, simulate)

CASES = [(name, p, m, v)
         for p in range(1, 9) for m in range(1, 17)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3))
         if name != "interleaved" or m % p == 0]


def _check_complete_and_ordered(actions, p, m, v, split):
    stages = p * v
    kinds = ("F", "I", "W") if split else ("F", "B")
    seen = Counter((a.kind, a.stage, a.microbatch) for rank in actions for a in rank)
    assert set(seen.values()) == {1}, "an action appears twice"
    assert set(seen) == {(k, s, j) for k in kinds for s in range(stages) for j in range(m)}
    for rank, ops in enumerate(actions):
        assert all(a.stage % p == rank for a in ops), "rank r holds stages r, r + p, ..."
        position = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(ops)}
        for (kind, s, j), i in position.items():
            if kind in ("B", "I"):
                assert position[("F", s, j)] < i, f"backward before forward of mb {j} on stage {s}"
            if kind == "W":
                assert position[("I", s, j)] < i


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_every_schedule_is_complete_ordered_and_deadlock_free(name, p, m, v):
    actions = schedule(name, p, m, virtual=v)
    assert len(actions) == p
    _check_complete_and_ordered(actions, p, m, v, split=name == "zb-h1")
    timeline = simulate(actions)                    # raises DeadlockError if stuck
    for rank in timeline.spans:                     # cross-stage dependencies respected
        for span in rank:
            assert span.end > span.start
    ends = {(s.action.kind, s.action.stage, s.action.microbatch): s for r in timeline.spans for s in r}
    for (kind, stage, mb), span in ends.items():
        if kind == "F" and stage > 0:
            assert span.start >= ends[("F", stage - 1, mb)].end
        if kind in ("B", "I") and stage < p * v - 1:
            after = ends.get(("B", stage + 1, mb)) or ends[("I", stage + 1, mb)]
            assert span.start >= after.end


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 8), (8, 16), (3, 5), (4, 1)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_bubble_matches_theory(name, p, m):
    for t_f, t_b in ((1.0, 1.0), (1.0, 2.0)):
        sim = simulate(schedule(name, p, m), t_f=t_f, t_b=t_b)
        assert sim.bubble == pytest.approx(theory.bubble(name, p, m))
        assert sim.makespan == pytest.approx((m + p - 1) * (t_f + t_b))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 4, 4), (8, 16, 2), (3, 9, 3)])
def test_interleaved_bubble_matches_theory(p, m, v):
    sim = simulate(schedule("interleaved", p, m, virtual=v), t_f=1.0, t_b=1.0)
    assert sim.bubble == pytest.approx(theory.bubble("interleaved", p, m, v=v))
    assert sim.bubble < theory.bubble("1f1b", p, m)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 8), (8, 16), (4, 2), (6, 1)])
@pytest.mark.parametrize("t_f, t_b, t_w", [(1, 2, 1), (1, 2, 0.5), (2, 3, 1), (1, 3, 1)])
def test_zb_h1_bubble_matches_qi_et_al(p, m, t_f, t_b, t_w):
    sim = simulate(schedule("zb-h1", p, m), t_f=t_f, t_b=t_b, t_w=t_w)
    assert sim.bubble == pytest.approx(theory.bubble("zb-h1", p, m, t_f=t_f, t_b=t_b, t_w=t_w))
    if m >= p:                                      # Table 2: (p-1)(T_F + T_B - T_W), T_B input-grad only
        assert sim.makespan - m * (t_f + t_b) == pytest.approx((p - 1) * (t_f + (t_b - t_w) - t_w))
    one_f_one_b = simulate(schedule("1f1b", p, m), t_f=t_f, t_b=t_b)
    assert sim.makespan < one_f_one_b.makespan or p == 1


def test_peak_activations():
    assert peak_activations(schedule("gpipe", 4, 8)) == [8] * 4
    assert peak_activations(schedule("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert peak_activations(schedule("1f1b", 4, 2)) == [2, 2, 2, 1]
    assert peak_activations(schedule("zb-h1", 4, 8)) == [4] * 4            # 1F1B's peak p M_B
    assert peak_activations(schedule("interleaved", 4, 8, virtual=2))[0] == 4 * 2 + 4 - 1
    assert peak_activations(schedule("interleaved", 4, 8, virtual=2))[0] / 2 == theory.pipeline_in_flight(
        "interleaved", 4, 8, v=2)


def test_layout_and_first_actions_read_like_megatron():
    ranks = schedule("1f1b", 4, 8)
    assert ranks[0][:4] == [Action("F", 0, 0), Action("F", 0, 1), Action("F", 0, 2), Action("F", 0, 3)]
    assert ranks[3][:2] == [Action("F", 3, 0), Action("B", 3, 0)]
    inter = schedule("interleaved", 2, 4, virtual=2)
    assert {a.stage for a in inter[1]} == {1, 3}
    assert [a.stage for a in inter[0] if a.kind == "F"][:4] == [0, 0, 2, 2]


def test_deadlock_is_detected():
    bad = [[Action("F", 0, 0), Action("B", 0, 0)],
           [Action("B", 1, 0), Action("F", 1, 0)]]     # backward waits for its own later forward
    with pytest.raises(DeadlockError, match="cannot complete"):
        simulate(bad)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        schedule("pipedream", 4, 8)
    with pytest.raises(ValueError, match="at least one microbatch"):
        schedule("1f1b", 4, 0)
    with pytest.raises(ValueError, match="use m=4 or m=8"):
        schedule("interleaved", 4, 6, virtual=2)
    with pytest.raises(ValueError, match="interleaved"):
        schedule("1f1b", 4, 8, virtual=2)
    with pytest.raises(ValueError, match="t_w"):
        simulate(schedule("zb-h1", 2, 2), t_b=1.0, t_w=2.0)


def test_communication_delay_grows_the_step():
    fast = simulate(schedule("gpipe", 4, 8))
    slow = simulate(schedule("gpipe", 4, 8), t_comm=0.5)
    assert slow.makespan == pytest.approx(fast.makespan + 2 * 3 * 0.5)   # one hop per boundary, each way
    fast, slow = (simulate(schedule("1f1b", 4, 8), t_comm=c) for c in (0.0, 0.5))
    assert slow.makespan > fast.makespan + 2 * 3 * 0.5                  # 1F1B's steady state waits too
    assert slow.bubble > fast.bubble


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1),
                                           ("zb-h1", 4, 8, 1), ("interleaved", 4, 8, 2),
                                           ("interleaved", 2, 4, 3)])
def test_theory_in_flight_matches_every_ranks_simulated_peak(name, p, m, v):
    peaks = peak_activations(schedule(name, p, m, virtual=v))
    assert [theory.pipeline_in_flight(name, p, m, v, stage=r) for r in range(p)] == [x / v for x in peaks]
