"""`dl.elastic`: train with replicas that die and come back while the others keep stepping.

    import distlab as dl
    r = dl.elastic.train(replicas=3, steps=12, faults=[dl.elastic.Kill(replica=2, at_step=4, rejoin_at=8)])
    r.timeline        # per step, the replicas of its quorum: [(0, 1, 2)] * 4 + [(0, 1)] * 4 + [(0, 1, 2)] * 4
    print(r.table())  # the same, drawn: one row per replica, x computed, . away, h healed from a peer
    r.recoveries      # per fault: seconds until the survivors finished a step, and until the quorum was whole
    r.pids            # {replica: [pid, ...]}: one pid for a replica that never died
    r.losses          # per step, the global batch's mean loss
    r.params          # final parameters, by name

    dl.elastic.reference(r.timeline, steps=12)    # one process, the same schedule: (losses, params)

    r = dl.elastic.train(replicas=3, ranks_per_replica=2, inner="fsdp", steps=12, faults=[...])
    dl.elastic.reference(r.timeline, steps=12, ranks_per_replica=2)

``ranks_per_replica=k, inner="fsdp"``: each replica is k processes with `dl.fully_shard` over them (its own
process group), shard j of the live replicas all-reducing together (fault-tolerant HSDP,
`distlab.parallel.elastic.hsdp`); a replica dies, comes back and heals as a whole. ``r.pids[r]`` then
lists its k pids per process generation.

What runs (`distlab.parallel.elastic` for the algorithm, `distlab.launch.replicas` for the processes): one
process per replica, every step a quorum agreed through the store, the fixed global batch of
``global_batch`` rows split over the quorum and the gradients averaged with weights rows_i / B, so that
every step equals one process on the whole batch whoever computed it. A `Kill` is planted like
``fail_at_step`` (`faults`): the replica SIGKILLs itself at the start of the step; before that, if it is to
come back, it asks the store to have it waited for at ``rejoin_at``. The launcher restarts it at once
(a new pid; the others' never change) and the new process heals from a live peer at that step. A `Join`
starts a new replica with the others, which waits for its step (a real cluster starts it when its
machine arrives); replica 0 announces it in the store before the first step, so the members wait for it
at that step. Every check runs here, before any process starts.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from .. import models
from ..launch.replicas import launch_replicas
from .base import loss_fn, make_optimizer
from .elastic_plan import Join, Kill, Recovery, check_inner, check_plan, planned_timeline, recoveries, table
from .faults import die
from .parse import parse

__all__ = ["train", "reference", "Kill", "Join", "Recovery", "ElasticReport", "planned_timeline"]


@dataclass
class ElasticReport:
    """What `train` gives back (the module docstring shows each field)."""

    losses: list[float]                        # per step: the global batch's mean loss
    timeline: list[tuple[int, ...]]            # per step: the replicas of its quorum, as agreed
    planned: list[tuple[int, ...] | None]      # per step: the plan's (None: unknown after a "next" rejoin)
    healed: list[tuple[int, ...]]              # per step: the replicas healed from a peer before it
    recoveries: list[Recovery]                 # per Kill, in order of their steps
    pids: dict[int, list[int]]                 # replica -> the pid of each of its processes
    params: dict = field(repr=False)           # final parameters by name (CPU tensors)
    step_ends: list[float] = field(repr=False, default_factory=list)   # per step, when its last member ended
    seconds: float = 0.0                       # the whole run, wall clock

    def table(self) -> str:
        """A row per replica, a column per step: ``x`` computed, ``h`` healed then computed, ``.`` away."""
        return table(self.timeline, self.healed)


def train(replicas: int = 3, steps: int = 12, faults=(), joins=(), *, model: str = "gpt-tiny",
          global_batch: int = 12, seed: int = 0, lr: float = 1e-3, optimizer: str = "adamw",
          weight_decay: float = 0.0, heartbeat: float = 1.0, join_timeout: float = 30.0,
          timeout: float = 300.0, ranks_per_replica: int = 1, inner: str | None = None) -> ElasticReport:
    """Train ``model`` on ``replicas`` replicas (ids 0..replicas-1) for ``steps`` steps; ``faults``: `Kill`
    events, ``joins``: `Join` events. ``heartbeat``: seconds a member waits for another before leaving it
    out (the price of detecting a death); ``join_timeout``: seconds the members wait for an expected
    joiner (and at the first step); ``timeout``: the whole run; ``ranks_per_replica`` and ``inner``: k
    processes per replica, sharded with ``inner="fsdp"``. Every argument is checked before any process
    starts."""
    spec = parse("ddp", model=model, steps=steps, seed=seed, global_batch=global_batch, lr=lr,
                 optimizer=optimizer, weight_decay=weight_decay)
    k = check_inner(ranks_per_replica, inner)
    faults, joins = check_plan(replicas, steps, faults, joins, global_batch, heartbeat, join_timeout, k)
    records = tempfile.mkdtemp(prefix="distlab-elastic-")
    try:
        kills = {r: [k for k in faults if k.replica == r] for r in {k.replica for k in faults}}
        come_back = {r: [k.rejoin_at is not None for k in ks] for r, ks in kills.items()}
        run = launch_replicas(
            _replica, [*range(replicas), *(j.replica for j in joins)],
            args=(spec, replicas, kills, {j.replica: j.at_step for j in joins},
                  (heartbeat, join_timeout), records),
            restart=lambda r, incarnation: come_back.get(r, [False] * (incarnation + 1))[incarnation],
            timeout=timeout, ranks_per_replica=k)
        lines = _read_records(records)
    finally:
        shutil.rmtree(records, ignore_errors=True)
    return _report(lines, run, replicas, steps, faults, joins)


def _replica(ctx, spec, founders: int, kills: dict, joins: dict, waits: tuple, records: str):
    """One replica's process (`launch_replicas` runs it; ``ctx``: `ReplicaContext`)."""
    from ..parallel.elastic import ElasticDDP, ElasticHSDP, Quorum
    model = models.build(spec.model, spec.seed)
    if ctx.ranks > 1:
        model = _shard_inside(ctx, model)
    opt = make_optimizer(model.parameters(), spec)          # after sharding: on this rank's shards
    data, criterion = models.dataset_for(spec.model, spec.seed), loss_fn(spec)
    quorum = Quorum(ctx.store, ctx.replica, range(founders), *waits)
    mine = kills.get(ctx.replica, [])
    kill = mine[ctx.incarnation] if ctx.incarnation < len(mine) else None
    join_at = _join_step(ctx, mine, joins, quorum)
    if ctx.replica == ctx.rank == ctx.incarnation == 0:  # the plan's joiners, announced before step 0: the
        for replica, at in joins.items():               # members wait for each at its step, however slowly
            quorum.request(replica, at)                 # its process starts
    engine = ElasticHSDP if ctx.ranks > 1 else ElasticDDP
    ddp = engine(model, opt, quorum, ctx.store, join_at=join_at, timeout=ctx.timeout)
    path = os.path.join(records, f"{ctx.replica}.{ctx.incarnation}.jsonl") if ctx.rank == 0 else os.devnull
    with open(path, "w") as out:
        for step, decision, loss in ddp.steps(spec.steps, lambda s: data.batch(s, spec.global_batch),
                                              criterion):
            out.write(json.dumps({"step": step, "members": decision.members, "fresh": decision.fresh,
                                  "loss": loss, "end": time.time()}) + "\n")
            out.flush()
            if kill is not None and step + 1 == kill.at_step:
                dying = {k.replica for ks in kills.values() for k in ks if k.at_step == kill.at_step}
                _die(ctx, quorum, kill, [r for r in decision.members if r not in dying], out)
    if ctx.ranks > 1:
        from ..parallel.zero.fsdp import full_state_dict
        full = full_state_dict(model)                     # a collective inside the replica
        return {"params": full, "pid": os.getpid()} if ctx.rank == 0 else {"pid": os.getpid()}
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "pid": os.getpid()}


def _shard_inside(ctx, model):
    """The replica's own process group (this process's default one: its k ranks, keys under
    inner/<replica>/<incarnation> so a restarted replica never meets its dead self's), then fully_shard."""
    from datetime import timedelta

    import torch.distributed as dist

    from .compose import fully_shard_units
    store = dist.PrefixStore(f"inner/{ctx.replica}/{ctx.incarnation}", ctx.store)
    dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.ranks,
                            timeout=timedelta(seconds=ctx.timeout))
    return fully_shard_units(model)


def _die(ctx, quorum, kill, survivors: list[int], out) -> None:
    """The planted fault: at the start of step ``kill.at_step``, once the ``survivors`` are done with the
    step before (they announced the next: a death *inside* an all-reduce is not what is planted, see
    `distlab.parallel.elastic.replica`), ask to be waited for at ``rejoin_at``, note the time, SIGKILL."""
    quorum.heard(kill.at_step, survivors, quorum.timeout)
    if kill.rejoin_at is not None and kill.rejoin_at != "next" and ctx.rank == 0:
        quorum.request(ctx.replica, kill.rejoin_at)          # "wait for me at rejoin_at"
    out.write(json.dumps({"fault": kill.at_step, "time": time.time()}) + "\n")
    out.flush()
    if ctx.ranks > 1:                                        # the replica dies whole, its request made
        import torch.distributed as dist
        dist.barrier()
    die()


def _join_step(ctx, mine: list, joins: dict, quorum) -> int | None:
    """None for a founding replica's first process; else the step this process asks to join at."""
    if ctx.incarnation == 0:
        return joins.get(ctx.replica)
    at = mine[ctx.incarnation - 1].rejoin_at
    return quorum.latest() + 1 if at == "next" else at


def _read_records(directory: str) -> dict:
    """{(replica, incarnation): [record, ...]} from every process's file (a killed one's too)."""
    found = {}
    for name in sorted(os.listdir(directory)):
        replica, incarnation = map(int, name.split(".")[:2])
        with open(os.path.join(directory, name)) as f:
            found[replica, incarnation] = [json.loads(line) for line in f if line.strip()]
    return found


def _report(lines: dict, run, replicas: int, steps: int, faults, joins) -> ElasticReport:
    by_step: dict[int, list] = {}
    fault_times = {}
    for (replica, _), records in lines.items():
        for rec in records:
            if "fault" in rec:
                fault_times[replica, rec["fault"]] = rec["time"]
            else:
                by_step.setdefault(rec["step"], []).append(rec)
    missing = [s for s in range(steps) if s not in by_step]
    if missing:
        raise RuntimeError(f"no replica recorded step(s) {missing}")
    timeline = [tuple(by_step[s][0]["members"]) for s in range(steps)]
    healed = [tuple(by_step[s][0]["fresh"]) for s in range(steps)]
    ends = [max(rec["end"] for rec in by_step[s]) for s in range(steps)]
    final = run.results[min(key for key, value in run.results.items() if "params" in value)]
    return ElasticReport(
        losses=[by_step[s][0]["loss"] for s in range(steps)], timeline=timeline,
        planned=planned_timeline(replicas, steps, faults, joins), healed=healed,
        recoveries=recoveries(faults, fault_times, timeline, ends), pids=run.pids, params=final["params"],
        step_ends=ends, seconds=run.seconds)


def reference(timeline, steps: int | None = None, *, model: str = "gpt-tiny", global_batch: int = 12,
              seed: int = 0, lr: float = 1e-3, optimizer: str = "adamw", weight_decay: float = 0.0,
              ranks_per_replica: int = 1):
    """One process applying the same membership schedule: at step s the global batch is cut into
    len(timeline[s]) parts as the replicas cut it (each again into ``ranks_per_replica`` parts, as a
    replica's ranks cut its rows), each part's gradient weighted by rows / B and summed in member order,
    then one optimizer step. Returns (losses, final parameters by name)."""
    steps = len(timeline) if steps is None else steps
    spec = parse("ddp", model=model, steps=steps, seed=seed, global_batch=global_batch, lr=lr,
                 optimizer=optimizer, weight_decay=weight_decay)
    import torch
    net = models.build(spec.model, spec.seed)
    opt, criterion = make_optimizer(net.parameters(), spec), loss_fn(spec)
    data = models.dataset_for(spec.model, spec.seed)
    params, losses = [p for p in net.parameters() if p.requires_grad], []
    for step in range(steps):
        x, y = data.batch(step, global_batch)
        total, loss_sum = [torch.zeros_like(p) for p in params], 0.0
        parts = [rows for replica in torch.tensor_split(torch.arange(global_batch), len(timeline[step]))
                 for rows in torch.tensor_split(replica, ranks_per_replica)]
        for rows in parts:
            net.zero_grad(set_to_none=False)
            loss = criterion(net(x[rows]), y[rows])
            loss.backward()
            weight = len(rows) / global_batch
            for t, p in zip(total, params):
                t += p.grad * weight
            loss_sum += float(loss.detach()) * weight
        for t, p in zip(total, params):
            p.grad.copy_(t)
        opt.step()
        losses.append(loss_sum)
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}
