"""Launch latency: time to start N ranks, form a process group, run a trivial function, collect results.

Compares, in one run on one machine:
  * distlab fork   - dl.launch(fn, N) (the default on Linux)
  * distlab spawn  - dl.launch(fn, N, start_method="spawn") (fresh interpreters, fn sent by cloudpickle)
  * torch.multiprocessing.spawn - PyTorch's own launcher, with the same process-group set-up and barrier
Every variant includes init_process_group(gloo) and one barrier, so the work is identical.
Target (foundation issue): distlab fork at most 0.15 s median for 4 ranks.

    python benchmarks/launch_latency.py [--ranks 4] [--repeats 20]
Writes benchmarks/results/launch_latency.json and .png.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import distlab as dl
from _results import default_out, write



def trivial():
    return dl.rank()


def _torch_worker(rank, world_size, port):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0),
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_distlab(n: int, method: str) -> float:
    start = time.perf_counter()
    run = dl.launch(trivial, n, start_method=method, output="quiet")
    elapsed = time.perf_counter() - start
    assert run.results == list(range(n))
    return elapsed


def time_torch_spawn(n: int) -> float:
    start = time.perf_counter()
    tmp.spawn(_torch_worker, args=(n, _free_port()), nprocs=n, join=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20,
                        help="repeats for fork (spawn variants use a quarter)")
    parser.add_argument("--out", default=default_out("launch_latency"))
    args = parser.parse_args()
    n, reps = args.ranks, args.repeats
    slow_reps = max(3, reps // 4)

    time_distlab(n, "fork")   # warm-up: imports, page cache
    samples = {
        "distlab fork": [time_distlab(n, "fork") for _ in range(reps)],
        "distlab spawn": [time_distlab(n, "spawn") for _ in range(slow_reps)],
        "torch.multiprocessing.spawn": [time_torch_spawn(n) for _ in range(slow_reps)],
    }
    summary = {name: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "repeats": len(v)}
               for name, v in samples.items()}
    target = 0.15
    result = {
        "benchmark": "launch_latency", "ranks": n, "backend": "gloo", "results": summary,
        "target": {"distlab fork median_s <=": target,
                   "met": summary["distlab fork"]["median_s"] <= target},
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "platform": platform.platform(), "load_average": list(os.getloadavg())},
    }
    write(args.out, result, lambda png: _plot(summary, n, target, png))
    for name, s in summary.items():
        print(f"{name:>30}: median {s['median_s'] * 1e3:8.1f} ms  "
              f"(min {s['min_s'] * 1e3:.1f}, max {s['max_s'] * 1e3:.1f})")


def _plot(summary: dict, n: int, target: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    medians = [summary[k]["median_s"] for k in names]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(names, medians, color=["#1f77b4", "#9467bd", "#7f7f7f"])
    ax.axvline(target, color="#d62728", ls="--", label=f"target for fork: {target} s")
    ax.set_xscale("log")
    ax.set_xlabel(f"seconds to launch {n} ranks + process group + barrier (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
