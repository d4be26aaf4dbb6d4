"""Who takes part in step s: the live replicas agree on a quorum through the store, every step.

No replica is in charge (a leader could die too); the store decides who was first. At step s::

    member r:  set  hb/s/r = <process id>       "I am here for step s" (the heartbeat)
               wait until every expected replica has its hb/s/*, or its wait is over:
                   expected = the last quorum   (waited for `timeout` seconds: a member that misses it
                            + the joiners        is taken for dead)
                              asking for <= s    (waited for `join_timeout`: a process starting up)
               compare_set("quorum/s", "", members seen)     the first proposal is stored, once
               get("quorum/s")                              everyone adopts that one, whoever wrote it

    joiner j:  add a request "j joins at step s" (joins/N), set hb/s/j, then get("quorum/s") and look
               for itself in it; not in it (it came too late): ask again for a later step

The store's ``compare_set`` is atomic, so however the members' views of who arrived differ (a heartbeat
that lands just as one of them stops waiting), they all adopt the same quorum. A member missing from the
quorum of step s (it was late, not dead) learns so from the same key and joins again like any other
replica, healing from a live peer (`replica`). ``Decision.fresh`` names the members that were not in the
quorum before, or are there in a new process (a replica restarted fast enough to answer for its dead
self: each heartbeat carries its process's own id): the ones that must be healed before the step runs.

Fischer, Lynch and Paterson (1985) show that no protocol can both always decide and never wait on a
crashed process when timing is unbounded: this one decides by timeout, so a replica slower than
``timeout`` is treated as dead (and heals when it comes back). torchft (github.com/pytorch/torchft) asks a
separate "lighthouse" server for each quorum; here the store's atomic compare-and-set stands in for it.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

POLL_SECONDS = 0.002


@dataclass(frozen=True)
class Decision:
    """The quorum of one step: who computes it (``members``, by replica id), and which of them are new
    since the step before (``fresh``: they receive the state from a live peer first)."""

    step: int
    members: tuple[int, ...]
    fresh: tuple[int, ...]


class Quorum:
    """One replica's side of the agreement (``store``: a `torch.distributed.Store` every replica reaches).

    ``members``: the replicas expected at the first step (every one starts from the same weights);
    ``timeout``: how long a member waits for another member's heartbeat before leaving it out;
    ``join_timeout``: how long members wait for a replica that asked to join (and at the first step).
    """

    def __init__(self, store, replica: int, members, timeout: float = 1.0, join_timeout: float = 30.0):
        self.store, self.replica = store, replica
        self.members: tuple[int, ...] = tuple(sorted(members))
        self.timeout, self.join_timeout = timeout, join_timeout
        self.uid = uuid.uuid4().hex             # this process: a restarted replica is a new one
        self.uids: dict[int, str] = {}          # the last quorum's members' processes
        self.pending: dict[int, int] = {}      # replica -> the step it asked to join at
        self.requests_read = 0
        self.first = True

    # -- a member ---------------------------------------------------------------------------------
    def agree(self, step: int) -> Decision:
        """The quorum of ``step``, as a member of the last one (it may leave this replica out)."""
        self.store.set(f"hb/{step}/{self.replica}", self.uid)
        self._read_requests(step)
        joiners = {j for j, at in self.pending.items() if at <= step and j not in self.members}
        member_wait = self.join_timeout if self.first else self.timeout
        waits = {**dict.fromkeys(self.members, member_wait), **dict.fromkeys(joiners, self.join_timeout)}
        seen = self._wait_for(step, waits)
        uids = {r: self.store.get(f"hb/{step}/{r}").decode() for r in sorted(seen)}
        fresh = [r for r in uids if r not in self.members or self.uids.get(r, uids[r]) != uids[r]]
        proposal = {"members": sorted(seen), "fresh": fresh, "uids": uids}
        stored = self.store.compare_set(f"quorum/{step}", "", json.dumps(proposal))
        return self._adopt(step, stored)

    def heard(self, step: int, replicas, seconds: float) -> set[int]:
        """Which of ``replicas`` announced ``step`` within ``seconds`` (an announcement of step s means its
        sender is done with step s-1, its last all-reduce included)."""
        return self._wait_for(step, dict.fromkeys(replicas, seconds))

    def _wait_for(self, step: int, waits: dict[int, float]) -> set[int]:
        """The replicas whose heartbeat for ``step`` arrived, each waited for at most its own seconds."""
        start, seen = time.monotonic(), set()
        missing = dict(waits)
        while missing:
            for r in list(missing):
                if self.store.check([f"hb/{step}/{r}"]):
                    seen.add(r)
                    del missing[r]
                elif time.monotonic() - start > missing[r]:
                    del missing[r]                         # taken for dead (or not there yet)
            if missing:
                time.sleep(POLL_SECONDS)
        return seen

    def _adopt(self, step: int, stored: bytes) -> Decision:
        agreed = json.loads(stored)
        decision = Decision(step, tuple(agreed["members"]), tuple(agreed["fresh"]))
        self.members, self.first = decision.members, False
        self.uids = {int(r): uid for r, uid in agreed["uids"].items()}
        self.pending = {j: at for j, at in self.pending.items() if at > step}   # asked, answered
        self.store.set("latest", str(step))
        return decision

    def _read_requests(self, step: int) -> None:
        """Join requests written since the last look (``joins`` counts them, ``joins/N`` is the N-th), those
        for ``step`` or later: one for an earlier step was answered already, or came too late for its step
        (that joiner asks again)."""
        count = self.store.add("joins", 0)
        for n in range(self.requests_read + 1, count + 1):
            replica, at = map(int, self.store.get(f"joins/{n}").decode().split(":"))
            if at >= step:
                self.pending[replica] = at
        self.requests_read = count

    # -- a joiner ---------------------------------------------------------------------------------
    def request(self, replica: int, step: int) -> None:
        """Ask for ``replica`` to be waited for from ``step`` on (a joiner for itself, or a replica about to
        go away for its own return: the members then wait for it at that step)."""
        n = self.store.add("joins", 1)
        self.store.set(f"joins/{n}", f"{replica}:{step}")

    def join(self, step: int) -> Decision:
        """Ask to be let in at ``step`` and wait for that step's quorum; it leaves this replica out when it
        was decided before the request was read (then ask again for a later step)."""
        self.request(self.replica, step)
        self.store.set(f"hb/{step}/{self.replica}", self.uid)
        return self._adopt(step, self.store.get(f"quorum/{step}"))

    def latest(self) -> int:
        """The last step whose quorum is decided (-1 before the first)."""
        return int(self.store.get("latest")) if self.store.check(["latest"]) else -1
