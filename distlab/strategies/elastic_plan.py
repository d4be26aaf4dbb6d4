"""The plan of an elastic run (`elastic`): who dies, who comes back, who joins; checked before any process
starts; and what a run's records say about it (the membership timeline, the recovery times).

    Kill(replica=2, at_step=4, rejoin_at=8)     replica 2 is SIGKILLed at the start of step 4 and is
                                                back (a new process, healed from a peer) at step 8
    Kill(replica=1, at_step=6)                  replica 1 is gone for good: the run shrinks
    Kill(replica=0, at_step=3, rejoin_at="next")  back as soon as its new process is up (a measurement)
    Join(replica=3, at_step=5)                  a new replica joins at step 5: the run grows

Recovery of a fault at step k (seconds from the killed process's last word, measured)::

    stall     to the end of step k, the first step after the fault: the survivors waited ``heartbeat``
              seconds for the dead replica before leaving it out
    recovery  to the end of the first step whose quorum again holds every replica of step k-1
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kill:
    """Replica ``replica`` dies (SIGKILL) at the start of step ``at_step``; ``rejoin_at``: the step its new
    process joins at, ``"next"`` as soon as that process is up, None never (the run goes on without it)."""

    replica: int
    at_step: int
    rejoin_at: int | str | None = None


@dataclass(frozen=True)
class Join:
    """A new replica ``replica`` (an id not among the founding ones) joins at step ``at_step``."""

    replica: int
    at_step: int


@dataclass(frozen=True)
class Recovery:
    """What one `Kill` cost, measured (see the module docstring)."""

    replica: int
    at_step: int
    stall_s: float                    # fault -> end of step at_step (the survivors' next step)
    back_at: int | None               # the first step whose quorum is whole again (None: never)
    recovery_s: float | None          # fault -> end of that step


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numbers(replicas, steps, global_batch, heartbeat, join_timeout) -> None:
    if not _whole(replicas) or replicas < 1:
        raise ValueError(f"replicas must be a whole number >= 1, got {replicas!r}")
    if not _whole(steps) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
    for name, value in (("heartbeat", heartbeat), ("join_timeout", join_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _check_kill(k, ids: dict, steps: int) -> None:
    if not isinstance(k, Kill):
        raise TypeError(f"faults takes dl.elastic.Kill(replica, at_step, rejoin_at) events, got {k!r}")
    if k.replica not in ids:
        raise ValueError(f"{k}: no replica {k.replica} (replicas are {sorted(ids)})")
    if not _whole(k.at_step) or not ids[k.replica] < k.at_step < steps:
        raise ValueError(f"{k}: at_step must be a step after the replica's first ({ids[k.replica]}) and "
                         f"before steps={steps}")
    if k.rejoin_at not in (None, "next") and (not _whole(k.rejoin_at) or not k.at_step < k.rejoin_at < steps):
        raise ValueError(f"{k}: rejoin_at must be None, 'next' or a step after at_step and before "
                         f"steps={steps} (a replica waiting for a step that never comes would hang)")


def check_inner(ranks_per_replica, inner) -> int:
    """The processes per replica, checked against the inner strategy: 1 and None (one rank each), or
    k >= 2 and "fsdp" (fully_shard over the replica's k ranks)."""
    if not _whole(ranks_per_replica) or ranks_per_replica < 1:
        raise ValueError(f"ranks_per_replica must be a whole number >= 1, got {ranks_per_replica!r}")
    if inner not in (None, "fsdp"):
        raise ValueError(f"inner={inner!r}: supported inside a replica is 'fsdp' (fully_shard over its "
                         "ranks) or None (one rank per replica); tp inside a replica is not supported yet")
    if (inner == "fsdp") != (ranks_per_replica > 1):
        raise ValueError(f"ranks_per_replica={ranks_per_replica} with inner={inner!r}: several ranks per "
                         "replica need inner='fsdp', and inner='fsdp' needs ranks_per_replica >= 2")
    return ranks_per_replica


def check_plan(replicas, steps, faults, joins, global_batch, heartbeat, join_timeout, ranks_per_replica=1):
    """The plan, checked (a clear error before any process starts); returns (faults, joins) as tuples,
    faults in order of their steps."""
    _check_numbers(replicas, steps, global_batch, heartbeat, join_timeout)
    faults, joins = tuple(faults), tuple(joins)
    ids = dict.fromkeys(range(replicas), 0)
    for j in joins:
        if not isinstance(j, Join):
            raise TypeError(f"joins takes dl.elastic.Join(replica, at_step) events, got {j!r}")
        if not _whole(j.replica) or j.replica in ids or not _whole(j.at_step) or not 0 < j.at_step < steps:
            raise ValueError(f"{j}: a joining replica needs a new id (not {sorted(ids)}) and a step in "
                             f"1..{steps - 1}")
        ids[j.replica] = j.at_step
    faults = tuple(sorted(faults, key=lambda k: (getattr(k, "at_step", 0), getattr(k, "replica", 0))))
    for k in faults:
        _check_kill(k, ids, steps)
    for r in ids:
        mine = [k for k in faults if k.replica == r]
        for before, after in zip(mine, mine[1:]):
            if before.rejoin_at in (None, "next") or after.at_step <= before.rejoin_at:
                raise ValueError(f"{after}: replica {r} is not back from {before} by then (kill a replica "
                                 "again only after a rejoin_at step it reached)")
    if global_batch < len(ids) * ranks_per_replica:
        ranks = len(ids) * ranks_per_replica
        raise ValueError(f"global_batch={global_batch} rows cannot give each of {ranks} ranks ({len(ids)} "
                         f"replicas) a row: raise global_batch to at least {ranks}")
    _check_alive(planned_timeline(replicas, steps, faults, joins))
    return faults, joins


def _check_alive(plan) -> None:
    for step, (members, before) in enumerate(zip(plan, [None, *plan])):
        if members is not None and not members:
            raise ValueError(f"step {step} would have no replica at all: keep at least one alive")
        if members and before and not set(members) & set(before):
            raise ValueError(f"step {step}: every replica is new, none to heal from: keep one alive across")


def planned_timeline(replicas: int, steps: int, faults, joins) -> list[tuple[int, ...] | None]:
    """Per step, the replicas the plan puts in its quorum; None from a ``"next"`` rejoin until the end of
    that replica's absence is known (its return depends on how fast its new process starts)."""
    plan: list = []
    for step in range(steps):
        members, unknown = set(range(replicas)) | {j.replica for j in joins if j.at_step <= step}, False
        for k in faults:
            if k.at_step <= step and (k.rejoin_at is None or (k.rejoin_at != "next" and step < k.rejoin_at)):
                members.discard(k.replica)
            unknown |= k.at_step <= step and k.rejoin_at == "next"
        plan.append(None if unknown else tuple(sorted(members)))
    return plan


def recoveries(faults, fault_times: dict, timeline, ends) -> list[Recovery]:
    """Each `Kill`'s `Recovery`, from the time its process wrote before dying and the steps' end times."""
    found = []
    for k in faults:
        died = fault_times.get((k.replica, k.at_step))
        if died is None:
            continue
        whole = set(timeline[k.at_step - 1])
        back = next((s for s in range(k.at_step, len(timeline)) if whole <= set(timeline[s])), None)
        found.append(Recovery(k.replica, k.at_step, ends[k.at_step] - died, back,
                              None if back is None else ends[back] - died))
    return found


def table(timeline, healed) -> str:
    """The timeline drawn: a row per replica, a column per step (``x`` computed, ``h`` healed, ``.`` away)."""
    replicas = sorted({r for members in timeline for r in members})
    steps = len(timeline)
    lines = ["step       " + " ".join(f"{s % 100:>2}" for s in range(steps))]
    for r in replicas:
        marks = ["h" if r in healed[s] else "x" if r in timeline[s] else "." for s in range(steps)]
        lines.append(f"replica {r:<2} " + " ".join(f"{m:>2}" for m in marks))
    lines.append("quorum     " + " ".join(f"{len(m):>2}" for m in timeline))
    return "\n".join(lines)
