"""Data parallelism over replicas that come and go: a quorum each step, a group per membership, healing.

    for step, decision, loss in ElasticDDP(model, optimizer, quorum, store).steps(total, batch, loss_fn):
        ...                        # this replica took part in `step`, with the replicas in decision.members

One step, as every replica of the quorum runs it::

    quorum.agree(s)            members of step s (`quorum`): a dead replica is simply not among them
    regroup                    members changed?  a fresh gloo group of len(members) ranks, on the store
                               under the prefix group/s (never dist.new_group: that needs every rank of
                               the default group, dead ones included)
    heal                       fresh members?  the lowest surviving member puts its state (parameters,
                               optimizer state, step) in the store; each fresh one loads it
    forward/backward           on rows tensor_split(global batch, n)[i] of the step's fixed global batch
    all-reduce                 sum over members of (rows_i / B) * grad_i  (and of the loss, likewise)
    optimizer.step()

Why the weights rows_i / B: with B rows split over n live replicas, replica i's loss is the mean over its
rows_i rows, so

    sum_i (rows_i / B) * grad(mean loss over rows_i)  =  grad(mean loss over all B rows)

whatever n is: a step taken by 3 replicas equals one taken by 4, and equals one process on the whole
batch, up to the rounding of a different summation order. Membership changes only who computes, never
what is computed; the data position is the step itself (batch s is the same for any quorum).

Supported: each replica is one process (one rank, CPU, gloo); k ranks with fully_shard inside a replica
(torchft's HSDP) is `hsdp.ElasticHSDP`, built on this class. Not here: a replica dying *inside*
the all-reduce: its peers' collective then fails and they stop (torchft votes on each step's commit to
survive that, "should_commit"); faults here strike between steps, like ``fail_in="step"``.
"""
from __future__ import annotations

import io
from datetime import timedelta

import torch
import torch.distributed as dist

from .quorum import Decision, Quorum


class ElasticDDP:
    """``model`` and ``optimizer`` of one replica; ``quorum`` (`Quorum`) and ``store`` shared with the
    others through the store; ``batch(step) -> (x, y)`` gives the step's whole global batch; ``join_at``:
    this replica starts as a joiner at that step (a restarted or added replica), else as a founding
    member at step 0."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, quorum: Quorum, store,
                 join_at: int | None = None, timeout: float = 300.0):
        self.model, self.optimizer, self.quorum, self.store = model, optimizer, quorum, store
        self.replica = quorum.replica
        self.join_at = join_at
        self.timeout = timedelta(seconds=timeout)
        self.group = None                       # the gloo group of the current members
        self.group_members: tuple[int, ...] = ()
        self.retired: list = []                 # earlier groups, kept open until the end (see _regroup)
        self.shard = 0                          # which shard of the replica this process holds (`hsdp`)

    def steps(self, total: int, batch, loss_fn):
        """Take part in steps until ``total``; yields ``(step, decision, loss)`` for each step this
        replica computed (``loss``: the global batch's mean loss, the same on every member)."""
        step, joining = (0, False) if self.join_at is None else (self.join_at, True)
        while step < total:
            decision, latest = self._agree(step, joining)
            if self.replica not in decision.members:          # left out (late): join again, heal
                step, joining = max(step, latest) + 1, True
                self._regroup(Decision(step, (), ()))           # no longer in the members' group
                continue
            step, joining = decision.step, False
            self._regroup(decision)
            if decision.fresh:
                self._heal(decision)
            yield step, decision, self._step(step, decision, batch, loss_fn)
            step += 1
        if self.group is not None:                            # nobody leaves (closing its sockets) while
            self.group.allreduce([torch.zeros(1)]).wait()     # a peer still reads the last all-reduce

    def _agree(self, step: int, joining: bool) -> tuple[Decision, int]:
        """The quorum of ``step`` (as a joiner or a member), and the last decided step."""
        decision = self.quorum.join(step) if joining else self.quorum.agree(step)
        return decision, (self.quorum.latest() if self.replica not in decision.members else step)

    def _regroup(self, decision: Decision) -> None:
        """A new gloo group whenever the members change, or one is a new process (its keys under
        group/<step>/<shard> in the store). The old one is kept open, not destroyed: a peer may still be
        reading the last bytes of its final all-reduce; closing our sockets under it would fail its step."""
        if decision.members == self.group_members and not decision.fresh:   # a fresh member: a new process
            return
        if self.group is not None:
            self.retired.append(self.group)
        self.group, self.group_members = None, decision.members
        n = len(decision.members)
        if n > 1:
            store = dist.PrefixStore(f"group/{decision.step}/{self.shard}", self.store)
            self.group = dist.ProcessGroupGloo(store, decision.members.index(self.replica), n, self.timeout)

    def _heal(self, decision: Decision) -> None:
        """The lowest member that was there before sends its state; the fresh members load it."""
        live = [r for r in decision.members if r not in decision.fresh]
        if not live:
            raise RuntimeError(f"step {decision.step}: every member is new, no live replica to heal from")
        key = f"heal/{decision.step}/{self.shard}"
        if self.replica == live[0]:
            buffer = io.BytesIO()
            torch.save({"model": self._state(), "optimizer": self.optimizer.state_dict(),
                        "step": decision.step}, buffer)
            self.store.set(key, buffer.getvalue())
        elif self.replica in decision.fresh:
            state = torch.load(io.BytesIO(self.store.get(key)), weights_only=True)
            assert state["step"] == decision.step, "healed from another step"
            self._load(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])

    def _state(self) -> dict:
        return self.model.state_dict()

    def _load(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def _step(self, step: int, decision: Decision, batch, loss_fn) -> float:
        """Forward and backward on this replica's rows, the weighted all-reduce, the optimizer step."""
        x, y = batch(step)                                     # the whole global batch of B rows
        n, i, rows = len(decision.members), decision.members.index(self.replica), x.shape[0]
        mine = torch.tensor_split(torch.arange(rows), n)[i]
        weight = len(mine) / rows                              # rows_i / B
        self.optimizer.zero_grad(set_to_none=False)
        loss = loss_fn(self.model(x[mine]), y[mine])
        loss.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([p.grad.flatten() for p in params] + [loss.detach().reshape(1)]) * weight
        if self.group is not None:
            self.group.allreduce([flat]).wait()                # sum over the members
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.optimizer.step()
        return float(flat[-1])
