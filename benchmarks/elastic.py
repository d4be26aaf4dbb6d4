"""What a replica's death costs: elastic training (`dl.elastic`) beside a checkpoint restart (`dl.train`'s
``max_restarts``), on the same model, replicas, steps and fault.

    python benchmarks/elastic.py                        # gpt-tiny, 3 replicas, 12 steps, fault at step 6
    python benchmarks/elastic.py --replicas 4 --repeats 5

After ``--warmup`` untimed rounds (the first run in a process pays for its imports), each repeat runs
four trainings, in this order: elastic without a fault, elastic with the last replica
killed at the start of step ``--fault-step`` and restarted at once (``rejoin_at="next"``), ``dl.train("ddp")``
with checkpoints every ``--checkpoint-every`` steps and no fault, and the same with ``fail_at_step`` and
``max_restarts=1`` (every rank stopped, relaunched from the newest checkpoint).

With checkpoints every 4 steps and the fault at step 6, the restart computes steps 4 and 5 again (half
an interval, the expected loss of a fault at a random step). The restarted elastic replica often
announces itself before the survivors' heartbeat wait is over: it is then healed into that very step, and
the survivors' stall is the restart of one process, not the heartbeat.

Measured, per repeat (medians reported):
  elastic  stall_s     fault -> end of the survivors' next step (they wait ``--heartbeat`` s for the dead)
           recovery_s  fault -> end of the first step whose quorum holds every replica again
           extra_s     wall time of the run with the fault minus the run without
  restart  extra_s     the same difference for the checkpoint restart (detection, a fresh launch of every
                       rank, the checkpoint loaded, the lost steps computed again)
           lost_steps, lost_seconds   from `report.restarts`
Both are checked: the elastic run equals `dl.elastic.reference` on its own membership timeline, and the
restarted run ends with the losses of the run without a fault. Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import machine_facts, parser, write  # noqa: E402


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def elastic_repeat(a) -> dict:
    common = dict(replicas=a.replicas, steps=a.steps, model=a.model, global_batch=a.rows, seed=a.seed,
                  heartbeat=a.heartbeat)
    _, clean_s = _timed(dl.elastic.train, **common)
    kill = dl.elastic.Kill(a.replicas - 1, a.fault_step, rejoin_at="next")
    r, fault_s = _timed(dl.elastic.train, faults=[kill], **common)
    losses, _ = dl.elastic.reference(r.timeline, a.steps, model=a.model, global_batch=a.rows, seed=a.seed)
    worst = max(abs(x - y) / abs(y) for x, y in zip(r.losses, losses))
    assert worst < 1e-5, f"elastic run differs from the one-process reference by {worst:.2e}"
    rec, = r.recoveries
    survivors = [p for rep, p in r.pids.items() if rep != kill.replica]
    assert all(len(p) == 1 for p in survivors), r.pids
    return {"stall_s": rec.stall_s, "recovery_s": rec.recovery_s, "back_at": rec.back_at,
            "extra_s": fault_s - clean_s, "clean_s": clean_s, "fault_s": fault_s,
            "timeline": [list(m) for m in r.timeline], "table": r.table(), "reference_rel_diff": worst}


def restart_repeat(a) -> dict:
    folder = tempfile.mkdtemp(prefix="distlab-bench-elastic-")
    try:
        common = dict(world_size=a.replicas, model=a.model, steps=a.steps, seed=a.seed, global_batch=a.rows,
                      checkpoint_every=a.checkpoint_every)
        clean, clean_s = _timed(dl.train, "ddp", checkpoint_dir=os.path.join(folder, "clean"), **common)
        fault, fault_s = _timed(dl.train, "ddp", checkpoint_dir=os.path.join(folder, "fault"), max_restarts=1,
                                fail_at_step=a.fault_step, **common)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert fault.losses[-1] == clean.losses[-1], "the restarted run must end as the run without a fault"
    restart, = fault.restarts
    return {"extra_s": fault_s - clean_s, "clean_s": clean_s, "fault_s": fault_s,
            "lost_steps": restart.lost_steps, "lost_seconds": restart.lost_seconds}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def plot(result: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    bars = [("elastic: survivors stalled", result["elastic"]["stall_s"]),
            ("elastic: quorum whole again", result["elastic"]["recovery_s"]),
            ("elastic: wall time lost", result["elastic"]["extra_s"]),
            ("restart: wall time lost", result["restart"]["extra_s"])]
    ax.barh([b[0] for b in bars], [b[1] for b in bars], color=["C0", "C0", "C0", "C3"])
    ax.set_xlabel("seconds after the fault (median, measured)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    p = parser("elastic", __doc__, model=True, training=True, warmup=1)
    p.set_defaults(model="gpt-tiny")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fault-step", type=int, default=6)
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--rows", type=int, default=12, help="global batch rows per step")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    started = time.time()
    warm = argparse.Namespace(**{**vars(a), "steps": 3, "fault_step": 1, "checkpoint_every": 2})
    for _ in range(a.warmup):
        elastic_repeat(warm)
        restart_repeat(warm)
    elastic, restart = [], []
    for _ in range(a.repeats):
        elastic.append(elastic_repeat(a))
        restart.append(restart_repeat(a))
    timed = ("extra_s", "clean_s", "fault_s")
    result = {"elastic": {k: _median(elastic, k) for k in ("stall_s", "recovery_s", *timed)},
              "restart": {k: _median(restart, k) for k in (*timed, "lost_seconds")}}
    result["restart"]["lost_steps"] = restart[0]["lost_steps"]
    result["restart"]["losses_equal_to_no_fault"] = True          # asserted in restart_repeat
    result["elastic"]["max_reference_rel_diff"] = max(r["reference_rel_diff"] for r in elastic)
    result["elastic"]["timeline_table"] = elastic[-1]["table"]
    meta = {**machine_facts(started, "gloo"), "model": a.model, "replicas": a.replicas, "steps": a.steps,
            "fault_step": a.fault_step, "checkpoint_every": a.checkpoint_every, "heartbeat_s": a.heartbeat,
            "global_batch": a.rows, "repeats": a.repeats, "statistic": "median over repeats"}
    write(a.out, {"meta": meta, "results": result, "repeats": {"elastic": elastic, "restart": restart}},
          lambda png: plot(result, png))
    print(elastic[-1]["table"])
    print({k: {m: round(v, 3) if isinstance(v, float) else v for m, v in d.items() if m != "timeline_table"}
           for k, d in result.items()})


if __name__ == "__main__":
    main()
