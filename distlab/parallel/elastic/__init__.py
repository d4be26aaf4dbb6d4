"""Elastic data parallelism: replicas that leave and join while the others keep stepping.

distlab's restart (`dl.train(..., max_restarts=k)`) stops every rank when one dies and starts them all
again from the newest checkpoint. Here nobody stops: every step the live replicas agree on who is there,
average their gradients over exactly those, and a replica that comes back copies the state from a live
peer and steps on with them::

    step        0   1   2   3   4   5   6   7   8   9
    replica 0   x   x   x   x   x   x   x   x   x   x
    replica 1   x   x   x   x   x   x   x   x   x   x
    replica 2   x   x   x   x   .   .   .   .   h   x     killed at the start of step 4 (.: away);
    quorum      3   3   3   3   2   2   2   2   3   3     h: a new process, healed from a peer, at step 8

Reading order:

    quorum.py    who takes part in step s: heartbeats in the store, one atomic compare-and-set decides
    replica.py   ElasticDDP: the quorum, a fresh gloo group per membership, healing, the weighted
                 all-reduce that keeps every step equal to one process on the whole global batch
    hsdp.py      ElasticHSDP: a replica of k ranks with fully_shard inside, shard j of every live
                 replica all-reducing together (torchft's fault-tolerant HSDP)

What starts and restarts the processes is the launcher's (`distlab.launch.replicas`: a dead replica is
restarted, the others keep their processes); what builds the model and reports the run is
`dl.elastic.train` (`distlab.strategies.elastic`)::

    r = dl.elastic.train(replicas=3, steps=12, faults=[dl.elastic.Kill(replica=2, at_step=4, rejoin_at=8)])
    r.timeline      # per step: the replicas in its quorum
    r.recoveries    # per fault: seconds until the survivors stepped again, and until the quorum was whole

Supported: one process per replica, or k with fully_shard inside (``ranks_per_replica=k, inner="fsdp"``;
CPU, gloo); faults between steps, a replica dying whole. Not yet: tp inside a replica, a death inside
a collective.
After torchft (github.com/pytorch/torchft, 2025), whose per-step quorum and healing from a live peer this
follows; its code is not copied.
"""
from .quorum import Decision, Quorum
from .hsdp import ElasticHSDP
from .replica import ElasticDDP

__all__ = ["Quorum", "Decision", "ElasticDDP", "ElasticHSDP"]
