"""ZeRO with the optimizer offloaded (``offload="cpu"``, ZeRO-Offload; ``"disk"``, ZeRO-Infinity) beside the
same ZeRO stage without, and beside `dl.theory.offload.step_time`'s prediction of what offload adds.

    python benchmarks/offload.py                              # gpt-small, zero2 and zero3, 2 ranks, gloo/CPU
    python benchmarks/offload.py --ranks 2,4 --steps 10 --stages 2

Per (world size, stage, tier): the training step (forward, backward, optimizer step, behind a barrier,
the slowest rank), median over the steps after warm-up; the final parameters compared with the run
without offload (equal to the bit in fp32); the ledger's device bytes (params, grads, optimizer) beside
``host`` and ``disk``. The prediction uses this machine's bandwidths, measured first: a host copy of 64 MB
(on a CPU "device" and "host" are one memory: the copy is a memcpy) and writing then reading 64 MB through
``torch.save``/``torch.load`` in the offload directory (the page cache included, as the benchmark's own
files are). Predicted extra seconds per step:

    t = 8 Psi/N / B_host  +  [disk]  2 (8 + 4) Psi/N / B_disk  +  2 s t_file   (Adam: K = 8; fp32 masters;
                                                                             s shards, t_file per file)
The three tiers of a stage run in one launch, taking turns step by step, so they share the background load.

Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import machine_facts, parser, write  # noqa: E402
from distlab.memory import zero_memory  # noqa: E402
from distlab.models import build, dataset_for  # noqa: E402

TIERS = (None, "cpu", "disk")


def bandwidths(directory: str, nbytes: int = 64 * 2**20) -> dict[str, float]:
    """Bytes per second of a host copy and of a torch.save + torch.load round trip (counted once each way),
    and the seconds one small file's save or load takes (the per-file cost)."""
    x = torch.randn(nbytes // 4)
    y = torch.empty_like(x)
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    host = 5 * nbytes / (time.perf_counter() - t)
    path = os.path.join(directory, "bandwidth.pt")
    t = time.perf_counter()
    torch.save(x, path)
    torch.load(path, weights_only=True)
    disk = 2 * nbytes / (time.perf_counter() - t)
    small = torch.zeros(16)
    t = time.perf_counter()
    for _ in range(20):
        torch.save(small, path)
        torch.load(path, weights_only=True)
    latency = (time.perf_counter() - t) / 40
    os.remove(path)
    return {"host": host, "disk": disk, "file_latency_s": latency}


def rank_run(model_name: str, stage: int, steps: int, warmup: int, seed: int, lr: float, offload_dir):
    """Every tier of one stage on this rank, taking turns step by step (so they see the same background
    load): per-step seconds, final parameters (rank 0), the ledger's peak bytes, by tier."""
    runs = {}
    for tier in TIERS:
        kw = {} if tier is None else {"offload": tier}
        kw.update({"offload_dir": offload_dir} if tier == "disk" else {})
        model = build(model_name, seed).to(dl.device())
        zero = dl.ZeRO(model, stage=stage, optim=torch.optim.AdamW, lr=lr, **kw)
        runs[tier] = {"zero": zero, "measure": zero_memory(zero), "times": [], "memory": {}}
    data = dataset_for(model_name, seed)
    for step in range(warmup + steps):
        x, y = data.batch(step, 2 * dl.world_size())
        x, y = x[2 * dl.rank():2 * dl.rank() + 2], y[2 * dl.rank():2 * dl.rank() + 2]
        for tier in (TIERS if step % 2 else TIERS[::-1]):
            run = runs[tier]
            dist.barrier()
            t = time.perf_counter()
            logits = run["zero"](x)
            torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten()).backward()
            run["zero"].optimizer.step()
            run["zero"].optimizer.zero_grad()
            dist.barrier()
            if step >= warmup:
                run["times"].append(time.perf_counter() - t)
            run["memory"] = {k: max(v, run["memory"].get(k, 0)) for k, v in run["measure"]().items()}
    out = {}
    for tier, run in runs.items():
        opt = run["zero"].optimizer
        params = run["zero"].full_state_dict()
        if tier is not None:
            opt.optimizer.close()
        out[tier] = {"times": run["times"], "memory": run["memory"],
                     "params": params if dl.rank() == 0 else None,
                     "shard_params": sum(s.numel() for s in opt.shards), "shards": len(opt.shards)}
    return out


def measure(args, world: int, stage: int, offload_dir: str, bw: dict) -> list[dict]:
    config = (args.model, stage, args.steps, args.warmup, args.seed, args.lr, offload_dir)
    results = dl.launch(rank_run, world_size=world, backend=args.backend, args=config, output="quiet").results
    rows, ref = [], results[0][None]["params"]
    for tier in TIERS:
        res = [r[tier] for r in results]
        slowest = [max(r["times"][i] for r in res) for i in range(args.steps)]
        params = res[0]["params"]
        rows.append({"world": world, "stage": stage, "tier": tier or "none",
                     "step_s": statistics.median(slowest), "memory_rank0": res[0]["memory"],
                     "shard_params": max(r["shard_params"] for r in res), "shards": res[0]["shards"],
                     "equal_to_no_offload": all(torch.equal(ref[k], params[k]) for k in ref)})
    base = rows[0]["step_s"]
    for row in rows[1:]:
        pred = dl.theory.offload.step_time(row["shard_params"], dp=1, tier=row["tier"], shards=row["shards"],
                                           host_bandwidth=bw["host"], disk_bandwidth=bw["disk"],
                                           disk_latency=bw["file_latency_s"])
        row["measured_extra_s"] = row["step_s"] - base
        row["predicted_extra_s"] = pred.total
    return rows


def plot(rows: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"N={r['world']} zero{r['stage']}\n{r['tier']}" for r in rows]
    ax.bar(range(len(rows)), [r["step_s"] * 1e3 for r in rows], color="#4C72B0", label="measured step")
    base = {(r["world"], r["stage"]): r["step_s"] for r in rows if r["tier"] == "none"}
    pred = [(base[r["world"], r["stage"]] + r.get("predicted_extra_s", 0)) * 1e3 for r in rows]
    ax.scatter(range(len(rows)), pred, color="black", marker="_", s=400, zorder=3,
               label="no-offload step + dl.theory.offload.step_time")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, 1.3 * max(max(pred), max(r["step_s"] * 1e3 for r in rows)))
    ax.set_title("ZeRO step time with the optimizer offloaded")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = parser("offload", __doc__, steps=5, warmup=2)
    p.add_argument("--stages", default="2,3")
    p.set_defaults(ranks="2")
    args = p.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="distlab-offload-bench-") as directory:
        bw = bandwidths(directory)
        rows = [row for n in map(int, args.ranks.split(",")) for stage in map(int, args.stages.split(","))
                for row in measure(args, n, stage, directory, bw)]
    for r in rows:
        extra = (f"  extra {r['measured_extra_s'] * 1e3:7.2f} ms, "
                 f"predicted {r['predicted_extra_s'] * 1e3:7.2f}" if "measured_extra_s" in r else "")
        print(f"N={r['world']} zero{r['stage']} {r['tier']:5} {r['step_s'] * 1e3:8.2f} ms/step{extra}"
              f"  equal={r['equal_to_no_offload']}")
    meta = {**machine_facts(started, args.backend), "model": args.model, "steps": args.steps,
            "warmup": args.warmup, "bandwidth_bytes_per_s": bw,
            "statistic": "median over steps of the slowest rank's step; extra = offload - no offload"}
    write(args.out, {"meta": meta, "results": rows}, lambda png: plot(rows, png))


if __name__ == "__main__":
    main()
