"""Elastic data parallelism (`dl.elastic`, `distlab.parallel.elastic`, `distlab.launch.replicas`): replicas
killed and rejoined, shrunk and grown, while the others keep stepping in the same processes.

The statement tested: with a fixed global batch per step, split over the live replicas and each part's
gradient weighted by rows_i / B, a run whose membership changes equals one process applying the same
membership schedule (`dl.elastic.reference`), step by step; the realised membership is the planned one;
the replicas that did not die keep their one pid; no process is left behind.
"""
from __future__ import annotations

import random

import pytest
import torch
from _processes import left_below

import distlab as dl
from distlab.launch import LaunchError
from distlab.launch.replicas import launch_replicas
from distlab.strategies.elastic_plan import check_plan

Kill, Join = dl.elastic.Kill, dl.elastic.Join
HEARTBEAT = 1.0          # seconds: long enough that a busy 2-core machine never drops a live replica


def _check_against_reference(r, steps, global_batch=12):
    """The run equals one process on the same membership schedule: losses and final parameters."""
    losses, params = dl.elastic.reference(r.timeline, steps, global_batch=global_batch)
    assert r.losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for name, value in params.items():
        if name.endswith("attn.k.bias"):    # true gradient 0 (softmax ignores a shift of all key scores):
            continue                        # AdamW steps on rounding noise, g / (sqrt(v) + eps)
        torch.testing.assert_close(r.params[name], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _check_pids(r, killed):
    for replica, pids in r.pids.items():
        assert len(pids) == 1 + killed.get(replica, 0), (replica, pids)
        assert len(set(pids)) == len(pids)
    assert left_below() == []                 # no replica, no store keeper left running


def test_kill_and_rejoin_at_3_replicas_equals_the_reference():
    steps = 8
    r = dl.elastic.train(replicas=3, steps=steps, faults=[Kill(2, at_step=3, rejoin_at=6)],
                         heartbeat=HEARTBEAT)
    assert r.timeline == r.planned == [(0, 1, 2)] * 3 + [(0, 1)] * 3 + [(0, 1, 2)] * 2
    assert r.healed[6] == (2,) and sum(map(len, r.healed)) == 1
    _check_against_reference(r, steps)
    _check_pids(r, {2: 1})
    rec, = r.recoveries
    assert (rec.replica, rec.at_step, rec.back_at) == (2, 3, 6)
    assert HEARTBEAT * 0.9 < rec.stall_s < rec.recovery_s      # the survivors waited one heartbeat
    assert "h" in r.table().splitlines()[3]


def test_shrink_grow_and_rejoin_at_4_replicas_uneven_splits():
    """Quorums of 3, 4 and 5 replicas over 12 rows (5 does not divide 12); a replica gone for good, one
    added, one killed and back."""
    steps = 9
    faults = [Kill(1, at_step=2), Kill(2, at_step=5, rejoin_at=7)]
    r = dl.elastic.train(replicas=4, steps=steps, faults=faults, joins=[Join(4, at_step=4)],
                         heartbeat=HEARTBEAT)
    assert r.timeline == r.planned
    assert sorted({len(m) for m in r.timeline}) == [3, 4]
    assert r.timeline[4] == r.timeline[7] == (0, 2, 3, 4) and r.timeline[5] == (0, 3, 4)
    _check_against_reference(r, steps)
    _check_pids(r, {1: 0, 2: 1})              # replica 1 was killed and not restarted: one pid
    assert [(x.replica, x.back_at) for x in r.recoveries] == [(1, None), (2, 7)]


def test_a_late_replica_is_left_out_and_heals_without_a_restart(monkeypatch):
    """A replica slower than the heartbeat is taken for dead (the quorum cannot tell slow from dead): it
    finds itself outside the step's quorum, joins the next one and heals from a peer, in the same process."""
    import time

    from distlab.parallel.elastic import ElasticDDP, Quorum
    agree, step_once = Quorum.agree, ElasticDDP._step

    def late(self, step):                       # forked into the replicas: replica 1 oversleeps step 3
        if self.replica == 1 and step == 3:
            time.sleep(HEARTBEAT * 1.3)
        return agree(self, step)

    def slow(self, *args):                      # steps long enough for the late one to catch up
        time.sleep(0.1)
        return step_once(self, *args)

    monkeypatch.setattr(Quorum, "agree", late)
    monkeypatch.setattr(ElasticDDP, "_step", slow)
    steps = 12
    r = dl.elastic.train(replicas=3, steps=steps, heartbeat=HEARTBEAT)
    back = r.healed.index((1,))                 # when its request reached the members: a step or two on
    assert 3 < back and r.timeline == [(0, 1, 2)] * 3 + [(0, 2)] * (back - 3) + [(0, 1, 2)] * (steps - back)
    _check_against_reference(r, steps)
    _check_pids(r, {})                           # nobody died: one pid each


def test_membership_changes_who_computes_never_what():
    """The weighting rows_i / B makes every schedule equal to one process on the whole batch."""
    one, _ = dl.elastic.reference([(0,)] * 4, global_batch=12)
    three, _ = dl.elastic.reference([(0, 1, 2), (0, 1), (0, 1, 2, 3, 4), (0,)], global_batch=12)
    assert three == pytest.approx(one, rel=1e-5)


@pytest.mark.parametrize("bad, words", [
    (dict(faults=[Kill(5, 3)]), "no replica 5"),
    (dict(faults=[Kill(1, 0)]), "at_step"),
    (dict(faults=[Kill(1, 3, rejoin_at=20)]), "rejoin_at"),
    (dict(faults=[Kill(1, 3, rejoin_at=2)]), "rejoin_at"),
    (dict(faults=[Kill(0, 2), Kill(1, 2), Kill(2, 3)]), "no replica at all"),
    (dict(faults=[Kill(1, 2, rejoin_at=4), Kill(1, 3)]), "not back"),
    (dict(joins=[Join(1, 3)]), "new id"),
    (dict(global_batch=2), "global_batch"),
    (dict(heartbeat=0), "heartbeat"),
    (dict(faults=["kill 2"]), "Kill"),
])
def test_a_bad_plan_is_refused_before_any_process_starts(bad, words):
    with pytest.raises((ValueError, TypeError), match=words):
        dl.elastic.train(**{"replicas": 3, "steps": 8, **bad})
    assert left_below() == []


def test_planned_timeline():
    plan = dl.elastic.planned_timeline(3, 6, [Kill(2, 2, rejoin_at=4), Kill(0, 3, rejoin_at="next")],
                                       [Join(3, 1)])
    assert plan == [(0, 1, 2), (0, 1, 2, 3), (0, 1, 3), None, None, None]


def _raises(ctx):
    if ctx.replica == 1:
        raise ValueError("a bug, not a fault")
    return ctx.replica


def test_a_replica_that_raises_fails_the_run():
    with pytest.raises(LaunchError, match="replica 1 failed") as err:
        launch_replicas(_raises, [0, 1, 2], timeout=60)
    assert "a bug, not a fault" in err.value.failures[1]
    assert left_below() == []


def _random_plan(rng: random.Random, steps: int):
    """3 or 4 replicas; one or two of them killed at random steps, back at a random later step or never;
    sometimes a new replica joining: drawn until the plan is valid (`check_plan`)."""
    while True:
        replicas = rng.choice([3, 4])
        victims = rng.sample(range(replicas), rng.choice([1, 2]))
        faults = []
        for v in victims:
            k = rng.randrange(1, steps - 1)
            faults.append(Kill(v, k, rejoin_at=rng.choice([None, rng.randrange(k + 1, steps)])))
        joins = [Join(replicas, rng.randrange(1, steps))] if rng.random() < 0.3 else []
        try:
            check_plan(replicas, steps, faults, joins, 12, HEARTBEAT, 30.0)
        except ValueError:
            continue
        return replicas, faults, joins


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(20))
def test_random_faults_equal_the_reference(trial):
    rng, steps = random.Random(trial), 7
    replicas, faults, joins = _random_plan(rng, steps)
    r = dl.elastic.train(replicas=replicas, steps=steps, faults=faults, joins=joins, heartbeat=HEARTBEAT)
    assert r.timeline == r.planned, (faults, joins, r.table())
    _check_against_reference(r, steps)
    _check_pids(r, {k.replica: int(k.rejoin_at is not None) for k in faults})
