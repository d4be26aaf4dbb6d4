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
