"""The straggler report (`distlab.stragglers`, `Report.stragglers()`): a rank made slow on purpose is
named in every step, with a skew of at least the planted delay."""
from __future__ import annotations

import time

import distlab as dl
from distlab.stragglers import _covered
from distlab.strategies import loop

DELAY = 0.4      # seconds added to every step's forward on the slow rank


def test_a_planted_slow_rank_is_the_straggler(monkeypatch):
    original = loop._micro_steps

    def slowed(*args):
        if dl.rank() == 1:
            time.sleep(DELAY)                    # the straggler: slow data loading, a throttled GPU...
        return original(*args)
    monkeypatch.setattr(loop, "_micro_steps", slowed)       # forked ranks inherit it
    report = dl.train("ddp", world_size=3, model="mlp", steps=3, global_batch=12, timeout=120)
    s = report.stragglers()
    assert s.steps == [0, 1, 2] and sorted(s.work) == [0, 1, 2]
    assert s.slowest == [1, 1, 1] and s.straggler == 1
    assert all(b >= DELAY for b in s.busy[1]), s          # its sleep is busy time, never waiting
    assert all(skew >= DELAY / 2 for skew in s.skew), s   # (the others' busy time is their compute)
    # the fast ranks waited for it in the gradient all-reduce, so their steps took as long (step 0 aside:
    # the ranks reach it at different times, after building the model)
    for r in (0, 2):
        assert all(step >= DELAY * 0.9 for step in s.step[r][1:]), (r, s.step)
        assert all(w >= DELAY * 0.9 for w in s.waited[r][1:]), (r, s.waited)
    assert "straggler: rank 1" in str(s)


def test_covered_counts_overlaps_once():
    assert _covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], 0.5, 5.5) == 3.0
    assert _covered([], 0.0, 1.0) == 0.0
