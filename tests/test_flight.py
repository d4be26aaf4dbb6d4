"""The flight recorder (`distlab.launch.flight`): a hang's LaunchError says what every rank was doing.

Planted hangs: a rank that never enters a collective of a named group (through the traced wrapper
`parallel.collectives`), a rank stuck in a receive nobody sends; a launch that does not hang keeps
at most `flight.SLOTS` records per rank, in a file of fixed size, and leaves no folder behind.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from distlab.launch import flight
from distlab.parallel import collectives as C

pytestmark = pytest.mark.usefixtures("no_leaks")


def skip_one_all_reduce(skipper: int):
    """Three broadcasts on the group named "dp", then an all-reduce that rank ``skipper`` never enters."""
    group = dist.new_group(list(range(dl.world_size())))
    C.name_group(group, "dp")
    t = torch.ones(8)
    for _ in range(3):
        dist.broadcast(t, src=0, group=group)
    if dl.rank() == skipper:
        time.sleep(120)                            # never enters all_reduce #4 (killed at the deadline)
    C.all_reduce_sum(t, group=group)                   # the traced wrapper: the tap sees it too


@pytest.mark.parametrize("world", [3, 4])
def test_a_rank_that_skips_a_collective_is_named_with_the_sequence_number(world):
    skipper = 2 if world == 4 else 1
    with pytest.raises(dl.LaunchError) as caught:
        dl.launch(skip_one_all_reduce, world_size=world, args=(skipper,), timeout=8, output="quiet")
    err = caught.value
    waiters = ", ".join(str(r) for r in range(world) if r != skipper)
    message = str(err)
    assert f"ranks {waiters} wait in all_reduce #4 of group dp" in message, message
    assert (f"rank {skipper} never entered it and is in no operation (computing, sleeping, or stuck "
            f"outside torch.distributed); last finished broadcast #3 of group dp") in message, message
    # .flight: every rank's records, oldest first, with op, group, seq, bytes, entered and finished
    assert sorted(err.flight) == list(range(world))
    last = err.flight[skipper][-1]
    assert (last["op"], last["group"], last["seq"], last["bytes"]) == ("broadcast", "dp", 3, 32)
    assert last["finished"] >= last["entered"]
    for r in range(world):
        if r != skipper:
            stuck = err.flight[r][-1]
            assert (stuck["op"], stuck["seq"], stuck["finished"]) == ("all_reduce", 4, None)
            assert stuck["ranks"] == list(range(world))


def give_up_waiting():
    """Ranks 0 and 1 give up on an all-reduce after a second (their own timeout); rank 2 never came."""
    t = torch.ones(4)
    dist.broadcast(t, src=0)
    if dl.rank() == 2:
        time.sleep(120)
    dist.all_reduce(t, async_op=True).wait(timeout=timedelta(seconds=1))


def test_peers_that_time_out_first_still_get_the_diagnosis():
    with pytest.raises(dl.LaunchError) as caught:
        dl.launch(give_up_waiting, world_size=3, timeout=60, output="quiet")
    message = str(caught.value)
    assert caught.value.rank in (0, 1) and "timed out" in message
    assert ("ranks 0, 1 were waiting in all_reduce #2 of group world when they failed; rank 2 never "
            "entered it and is in no operation") in message, message


def stuck_in_recv():
    """Rank 0 sends one message; rank 1 waits for a second one that never comes."""
    t = torch.zeros(4)
    if dl.rank() == 0:
        dist.send(torch.ones(4), dst=1)
        time.sleep(120)
    else:
        dist.recv(t, src=0)
        dist.recv(t, src=0)


def test_a_rank_stuck_in_recv_is_named_with_its_peer_and_what_the_peer_sent():
    with pytest.raises(dl.LaunchError) as caught:
        dl.launch(stuck_in_recv, world_size=2, timeout=6, output="quiet")
    message = str(caught.value)
    assert "rank 1 waits in recv #2 from rank 0; rank 0 posted 1 send to rank 1 and is in no operation" \
        in message, message
    assert [(r["op"], r["seq"], r["peer"]) for r in caught.value.flight[0]] == [("send", 1, 1)]


def many_operations(n: int):
    """n operations of several kinds (a textbook ring over P2POp(dist.isend, ...) among them), then what
    this rank's recorder holds."""
    ok, total = True, float(sum(range(dl.world_size())))
    for i in range(n):
        t = torch.full((10,), float(dl.rank()))
        dist.all_reduce(t) if i % 2 else dl.comm.ring_all_reduce(t)
        ok &= bool((t == total).all())
    recorder = next(x for x in flight._listeners if isinstance(x, flight.Recorder))
    path = recorder.path
    records = flight.read(path)
    return dict(size=os.path.getsize(path), records=len(records), count=recorder.count,
                newest=records[-1]["n"], unfinished=sum(r["finished"] is None for r in records),
                ring_ok=ok)


def test_records_are_bounded_and_nothing_is_left_behind(monkeypatch):
    made = []
    original = flight.Box.__init__

    def remember(self):
        original(self)
        made.append(self.path)
    monkeypatch.setattr(flight.Box, "__init__", remember)
    run = dl.launch(many_operations, world_size=3, args=(150,), timeout=120, output="quiet")
    for r in run.results:
        assert r["size"] == flight.SLOTS * flight.SLOT_BYTES          # fixed, however long the run
        assert r["count"] > flight.SLOTS                              # the ring did wrap around
        assert r["records"] == flight.SLOTS and r["newest"] == r["count"] - 1
        assert r["unfinished"] == 0 and r["ring_ok"]
    assert made and not os.path.exists(made[0])                       # the launch's folder is gone


def sends_then_collectives():
    """Three exchanges with the other rank (gloo's requests have no future: asked once, then remembered),
    an asynchronous all-reduce on the same group (finished by its future), one all-reduce while paused."""
    peer, t = 1 - dl.rank(), torch.ones(4)
    for _ in range(3):
        for w in (dist.isend(t, peer), dist.irecv(torch.empty(4), peer)):
            w.wait()
    dist.all_reduce(t, async_op=True).wait()
    with flight.paused():
        dist.all_reduce(t)                        # not recorded
    recorder = next(x for x in flight._listeners if isinstance(x, flight.Recorder))
    return [(r["op"], r["finished"] is not None) for r in flight.read(recorder.path)]


def test_every_request_is_finished_and_a_paused_block_is_not_recorded():
    run = dl.launch(sends_then_collectives, world_size=2, timeout=60, output="quiet")
    for records in run.results:
        assert records == [("isend", True), ("irecv", True)] * 3 + [("all_reduce", True)]


def test_diagnose_names_a_rank_waiting_in_a_different_collective():
    def rec(n, op, seq, finished=1.0, group="tp", ranks=(0, 1)):
        return dict(n=n, op=op, group=group, ranks=list(ranks), seq=seq, peer=None, bytes=4, entered=0.0,
                    finished=finished)
    flight_records = {0: [rec(0, "all_gather", 1), rec(1, "all_reduce", 2, None)],
                      1: [rec(0, "all_gather", 1), rec(1, "broadcast", 2, None)]}
    text = flight.diagnose(flight_records)
    assert ("rank 0 waits in all_reduce #2 of group tp; rank 1 entered broadcast #2 of group tp instead "
            "(the ranks issue different collectives)") in text, text
    returned = flight.diagnose({0: [rec(0, "all_reduce", 1, None)], 1: [rec(0, "all_reduce", 1)]},
                               returned=[1])
    assert returned == ("rank 0 waits in all_reduce #1 of group tp\n"                  # rank 1 passed #1:
                        "rank 1 returned from the function; last finished all_reduce #1 of group tp")


def all_reduce_on_some_ranks(t):
    """A learner's all-reduce that rank 0 never joins."""
    if dl.rank() != 0:
        dist.all_reduce(t)
    return t


def test_an_exercise_hung_in_a_collective_says_which_rank_never_entered_it():
    res = dl.exercises.check("ring_all_reduce", all_reduce_on_some_ranks, world_sizes=(2,), timeout=4,
                             quiet=True)
    assert not res.passed
    assert ("the ranks hung for 4 s: rank 1 waits in all_reduce #1 of group world; rank 0 never entered it "
            "and returned from the function") in res.problem, res.problem


def test_diagnose_a_receive_from_any_rank():
    waiting = dict(n=0, op="recv", group="world", ranks=[0, 1], seq=1, peer=None, bytes=4, entered=0.0,
                   finished=None)
    text = flight.diagnose({0: [waiting], 1: []}, returned=[1])
    assert text == ("rank 0 waits in recv #1 from any rank\n"
                    "rank 1 returned from the function; it finished no operation")


def test_a_killed_launchers_folder_is_swept_by_the_next_launch(tmp_path, monkeypatch):
    import subprocess
    import tempfile
    gone = subprocess.Popen(["true"])
    gone.wait()                                                       # a pid nobody holds now
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"distlab-flight-{gone.pid}-abc"
    stale.mkdir()
    (stale / "rank0.ring").write_bytes(b" " * 16)
    box = flight.Box()
    assert not stale.exists() and os.path.isdir(box.path)
    assert box.collect(1) == {0: []} and not os.path.exists(box.path)
