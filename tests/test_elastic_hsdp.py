"""Fault-tolerant HSDP (`dl.elastic.train(ranks_per_replica=k, inner="fsdp")`,
`distlab.parallel.elastic.hsdp`): replicas of k ranks with fully_shard inside, killed and rejoined whole.

The statement tested: the global batch cut over the live replicas and again over each replica's k ranks,
each part's gradient weighted by rows / B (fully_shard's average over k undone), the shards all-reduced
across the replicas, equals one process applying the same membership schedule
(`dl.elastic.reference(..., ranks_per_replica=k)`); a killed replica comes back as k new processes
healed shard by shard; the replicas that did not die keep their k pids; no process is left behind.
"""
from __future__ import annotations

import random

import pytest
import torch
from _processes import left_below
from test_elastic import _random_plan

import distlab as dl
from distlab.launch.replicas import launch_replicas

Kill, Join = dl.elastic.Kill, dl.elastic.Join
HEARTBEAT = 1.0


def _check_against_reference(r, steps, global_batch, k, atol=1e-5, **optimizer):
    losses, params = dl.elastic.reference(r.timeline, steps, global_batch=global_batch, ranks_per_replica=k,
                                          **optimizer)
    assert r.losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert sorted(r.params) == sorted(params)
    for name, value in params.items():
        torch.testing.assert_close(r.params[name], value, rtol=1e-4, atol=atol, msg=name)


def _check_pids(r, k, killed):
    """k processes per replica and generation: a survivor's k pids never changed."""
    for replica, pids in r.pids.items():
        assert len(pids) == k * (1 + killed.get(replica, 0)), (replica, pids)
        assert len(set(pids)) == len(pids)
    assert left_below() == []


def test_kill_and_rejoin_3_replicas_of_2_ranks_equals_the_reference():
    """10 rows over 3 replicas of 2 ranks (4 3 3 -> 2 2 2 1 2 1 rows) and over 2 (5 5 -> 3 2 3 2): uneven.
    SGD, whose step is linear in the gradient: a wrong weight (fully_shard's 1/k left in, a part counted
    twice) moves the parameters; AdamW's step would hide a scale (see the next test)."""
    steps, batch, sgd = 8, 10, dict(optimizer="sgd", lr=0.5)
    r = dl.elastic.train(replicas=3, ranks_per_replica=2, inner="fsdp", steps=steps, global_batch=batch,
                         faults=[Kill(2, at_step=3, rejoin_at=6)], heartbeat=HEARTBEAT, **sgd)
    assert r.timeline == r.planned == [(0, 1, 2)] * 3 + [(0, 1)] * 3 + [(0, 1, 2)] * 2
    assert r.healed[6] == (2,) and sum(map(len, r.healed)) == 1
    _check_against_reference(r, steps, batch, 2, **sgd)
    _check_pids(r, 2, {2: 1})
    rec, = r.recoveries
    assert (rec.replica, rec.at_step, rec.back_at) == (2, 3, 6)


@pytest.mark.slow
def test_shrink_grow_and_rejoin_replicas_of_2_ranks():
    """A replica gone for good, one added, one killed and back: quorums of 2 and 3 replicas of 2 ranks.
    AdamW: its step is about lr * sign(m) where the gradient is near 0, so a rounding of a different
    summation order can flip one element by up to lr (1e-3); hence atol lr / 10."""
    steps, batch = 8, 12
    faults = [Kill(1, at_step=2), Kill(2, at_step=4, rejoin_at=6)]
    r = dl.elastic.train(replicas=3, ranks_per_replica=2, inner="fsdp", steps=steps, global_batch=batch,
                         faults=faults, joins=[Join(3, at_step=3)], heartbeat=HEARTBEAT)
    assert r.timeline == r.planned
    assert r.timeline[3] == (0, 2, 3) and r.timeline[4] == (0, 3)
    _check_against_reference(r, steps, batch, 2, atol=1e-4)
    _check_pids(r, 2, {1: 0, 2: 1})


@pytest.mark.parametrize("bad, words", [
    (dict(ranks_per_replica=2), "inner='fsdp'"),
    (dict(inner="fsdp"), "ranks_per_replica >= 2"),
    (dict(ranks_per_replica=2, inner="tp"), "not supported"),
    (dict(ranks_per_replica=0, inner="fsdp"), "ranks_per_replica must"),
    (dict(ranks_per_replica=4, inner="fsdp", global_batch=8), "global_batch"),
])
def test_a_bad_inner_strategy_is_refused_before_any_process_starts(bad, words):
    with pytest.raises(ValueError, match=words):
        dl.elastic.train(**{"replicas": 3, "steps": 8, **bad})
    assert left_below() == []


def _one_rank_dies(ctx):
    """Replica 1's rank 1 dies in its first process; its rank 0 would wait forever (a broken inner group)."""
    import os
    import signal
    import time
    if (ctx.replica, ctx.incarnation) == (1, 0):
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    return (ctx.replica, ctx.rank, ctx.incarnation)


def test_a_replica_of_2_ranks_dies_and_restarts_whole():
    run = launch_replicas(_one_rank_dies, [0, 1], restart=lambda replica, incarnation: incarnation == 0,
                          timeout=60, ranks_per_replica=2)
    assert run.results == {0: (0, 0, 0), 1: (0, 1, 0), 2: (1, 0, 1), 3: (1, 1, 1)}   # key: replica * k + rank
    assert len(run.pids[0]) == 2 and len(set(run.pids[1])) == 4 and len(run.deaths[1]) == 2
    assert left_below() == []


def test_the_reference_does_not_depend_on_how_the_rows_are_cut():
    """rows / B weights: cutting each replica's rows over 2 or 3 ranks changes the sums' order only."""
    one, _ = dl.elastic.reference([(0, 1, 2)] * 3, global_batch=12)
    two, _ = dl.elastic.reference([(0, 1, 2), (0, 1), (0, 1, 2)], global_batch=12, ranks_per_replica=3)
    assert two == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
def test_a_late_replica_of_2_ranks_is_left_out_and_heals_without_a_restart(monkeypatch):
    """Replica 1's rank 0 (its voice in the quorum) oversleeps step 3: the whole replica finds itself out
    (rank 0 tells rank 1), joins a later step and heals shard by shard, in the same 2 processes."""
    import time

    from distlab.parallel.elastic import ElasticHSDP, Quorum
    agree, step_once = Quorum.agree, ElasticHSDP._step

    def late(self, step):
        if self.replica == 1 and step == 3:
            time.sleep(HEARTBEAT * 1.3)
        return agree(self, step)

    def slow(self, *args):
        time.sleep(0.1)
        return step_once(self, *args)

    monkeypatch.setattr(Quorum, "agree", late)
    monkeypatch.setattr(ElasticHSDP, "_step", slow)
    steps, batch = 12, 12
    r = dl.elastic.train(replicas=3, ranks_per_replica=2, inner="fsdp", steps=steps, global_batch=batch,
                         heartbeat=HEARTBEAT, optimizer="sgd", lr=0.5)
    back = r.healed.index((1,))
    assert 3 < back and r.timeline == [(0, 1, 2)] * 3 + [(0, 2)] * (back - 3) + [(0, 1, 2)] * (steps - back)
    _check_against_reference(r, steps, batch, 2, optimizer="sgd", lr=0.5)
    _check_pids(r, 2, {})


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(6))
def test_random_faults_with_replicas_of_2_ranks_equal_the_reference(trial):
    """`test_elastic`'s random plans (kills of any replica, replica 0 included, back or not; joins)."""
    steps, sgd = 7, dict(optimizer="sgd", lr=0.5)
    replicas, faults, joins = _random_plan(random.Random(100 + trial), steps)
    r = dl.elastic.train(replicas=replicas, ranks_per_replica=2, inner="fsdp", steps=steps, faults=faults,
                         joins=joins, heartbeat=HEARTBEAT, **sgd)
    assert r.timeline == r.planned, (faults, joins, r.table())
    _check_against_reference(r, steps, 12, 2, **sgd)
    _check_pids(r, 2, {k.replica: int(k.rejoin_at is not None) for k in faults})
