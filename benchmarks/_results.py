"""What every benchmark script writes: the machine's facts beside the numbers, JSON and a plot.

    meta = {**machine_facts(started, backend), "model": ..., "statistic": ...}
    write(out, {"meta": meta, "results": rows}, lambda png: plot(rows, png))
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def default_out(name: str) -> str:
    """``benchmarks/results/<name>`` (the scripts add .json and .png)."""
    return os.path.join(RESULTS, name)


def machine_facts(started: float, backend: str | None) -> dict:
    """Versions, hardware, date, run time and load average: what a reader needs to trust a number."""
    return {"backend": backend, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "cuda": torch.cuda.is_available(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - started, 1),
            "load_average": os.getloadavg()}


def write(out: str, document: dict, plot) -> None:
    """``out``.json with ``document`` and ``out``.png drawn by ``plot(path)``."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(document, f, indent=1)
    plot(out + ".png")
    print(f"wrote {out}.json and {out}.png")


def parser(name: str, doc: str, *, model: bool = True, steps: int | None = None, warmup: int | None = None,
           training: bool = True):
    """The arguments every benchmark takes: ``--ranks`` (comma-separated world sizes), ``--backend``,
    ``--out`` (default ``results/<name>``), and, for the training benchmarks, ``--model``, ``--seed``,
    ``--lr``, and ``--steps`` / ``--warmup`` with the script's defaults. The script adds its own."""
    import argparse
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    if model:
        from distlab.models import PRESETS
        p.add_argument("--model", default="gpt-small", choices=sorted(PRESETS))
    p.add_argument("--ranks", default="2,4")
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help="timed steps per implementation")
    if warmup is not None:
        p.add_argument("--warmup", type=int, default=warmup)
    if training:
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--out", default=default_out(name))
    return p


def slowest_rank_rows(per_rank: list[dict], n: int, traffic: float) -> list[dict]:
    """Per message size and implementation, the median over repeats of the slowest rank's time, and the
    nccl-tests bandwidths: algbw = S / t, busbw = algbw x ``traffic`` (2(n-1)/n for all-reduce,
    (n-1)/n for all-to-all). ``per_rank[r][nbytes][impl]`` is rank r's list of seconds per repeat."""
    import statistics
    rows = []
    for nbytes, by_impl in per_rank[0].items():
        for impl in by_impl:
            slowest = [max(r[nbytes][impl][i] for r in per_rank) for i in range(len(by_impl[impl]))]
            t = statistics.median(slowest)
            rows.append({"world_size": n, "bytes": nbytes, "impl": impl, "median_s": t,
                         "algbw_GBps": nbytes / t / 1e9, "busbw_GBps": nbytes / t / 1e9 * traffic,
                         "repeats": len(slowest)})
    return rows
