"""Fault-tolerant HSDP: each replica is k ranks sharding the model (`dl.fully_shard`), replicas elastic.

    for step, decision, loss in ElasticHSDP(model, optimizer, quorum, store).steps(total, batch, loss_fn):
        ...          # ``model``: already fully_shard-ed over this process's default group = its replica

`ElasticDDP` with one process per replica, widened: a replica is now a group of k processes, and what
one of them holds is a shard (rows [j c, (j+1) c) of every parameter, `distlab.parallel.zero.fsdp`)::

     replica 0           replica 1           replica 2
    rank 0  rank 1      rank 0  rank 1      rank 0  rank 1      inner group: a replica's k ranks (each
    shard 0 shard 1     shard 0 shard 1     shard 0 shard 1     process's default group, one per replica
      |       |           |       |           |       |         incarnation): fully_shard runs over it
      +-------|-----------+-------|-----------+       |
              +-------------------+-------------------+         cross group of shard j: rank j of every
                                                                live replica, a fresh one per membership

One step, as every rank of every replica in the quorum runs it::

    rank 0: quorum.agree(s)     the replica's one voice in the quorum (`quorum`, unchanged)
    broadcast the decision      inside the replica: its k ranks act on one quorum, die and come back as one
    regroup                     shard j: a gloo group of the members' rank j (store prefix group/s/j)
    heal                        a fresh replica's shard j loads shard j (parameters and optimizer state) of
                                the lowest live member: the shards line up, k is the same everywhere
    forward/backward            on rows tensor_split(tensor_split(B, n)[i], k)[j] of the global batch;
                                the loss scaled by k w_ij, w_ij = rows_ij / B (fully_shard's reduce-scatter
                                averages over the k ranks: the k cancels, the shard holds sum_j w_ij grad_ij)
    all-reduce the shard        over the shard's cross group: sum_i sum_j w_ij grad_ij = grad on all B rows
    optimizer.step()            on the shard (AdamW and SGD are elementwise: the shard's step is the whole
                                parameter's step, sliced)

So a step still equals one process on the whole global batch, whoever computed it. Supported: k ranks per
replica on CPU (gloo), ``fully_shard`` inside; faults between steps, a replica dying whole (the launcher
ends the rest of a replica when one of its processes dies). Not here: tensor parallelism inside a
replica, a single rank of a replica restarted alone, a death inside a collective.
After torchft's HSDP (github.com/pytorch/torchft, 2025: "fault tolerant HSDP") and FSDP (Zhao et al. 2023).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .quorum import Decision
from .replica import ElasticDDP


class ElasticHSDP(ElasticDDP):
    """`ElasticDDP` for a replica of k processes: ``model`` fully_shard-ed over the default process group
    (the replica's k ranks), ``optimizer`` built on its shards; rank j of the replica holds shard j."""

    def __init__(self, model, optimizer, quorum, store, join_at: int | None = None, timeout: float = 300.0):
        super().__init__(model, optimizer, quorum, store, join_at=join_at, timeout=timeout)
        self.shard, self.ranks = dist.get_rank(), dist.get_world_size()
        said = [join_at]
        dist.broadcast_object_list(said, src=0)           # rank 0's view of "the next step" holds
        self.join_at = said[0]

    def _agree(self, step: int, joining: bool) -> tuple[Decision, int]:
        """Rank 0 takes part in the quorum for the replica; the others learn its outcome."""
        said = [super()._agree(step, joining) if self.shard == 0 else None]
        dist.broadcast_object_list(said, src=0)
        return said[0]

    def _params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]     # this rank's shards

    def _state(self) -> dict:
        return {str(n): p.detach().clone() for n, p in enumerate(self._params())}

    def _load(self, state: dict) -> None:
        with torch.no_grad():
            for n, p in enumerate(self._params()):
                p.copy_(state[str(n)])

    def _step(self, step: int, decision: Decision, batch, loss_fn) -> float:
        """Forward and backward on this rank's rows (fully_shard reduce-scatters inside the replica), the
        shard's weighted all-reduce across the replicas, the optimizer step on the shard."""
        x, y = batch(step)                                      # the whole global batch of B rows
        n, i, rows = len(decision.members), decision.members.index(self.replica), x.shape[0]
        replica_rows = torch.tensor_split(torch.arange(rows), n)[i]
        mine = torch.tensor_split(replica_rows, self.ranks)[self.shard]
        weight = len(mine) / rows                               # w_ij = rows_ij / B
        self.optimizer.zero_grad(set_to_none=False)
        loss = loss_fn(self.model(x[mine]), y[mine])
        (loss * (weight * self.ranks)).backward()               # averaged over k: sum_j w_ij grad_ij
        replica_loss = (loss.detach() * weight).reshape(1)
        dist.all_reduce(replica_loss)                           # inside the replica: sum_j w_ij loss_ij
        params = self._params()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.flatten() for g in grads] + [replica_loss])
        if self.group is not None:
            self.group.allreduce([flat]).wait()                 # shard j's cross group: sum over replicas
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        return float(flat[-1])
