"""Ring all-reduce from send/recv (dl.comm) beside torch.distributed's own all_reduce.

    python benchmarks/allreduce.py                       # 1 KB .. 64 MB, 2 and 4 ranks, gloo on CPU
    python benchmarks/allreduce.py --ranks 2 --sizes 1M,16M --impls ring,torch,naive
    python benchmarks/allreduce.py --impls ring,textbook,torch   # the default

Implementations: ``ring`` is the pipelined ring (``dl.comm.pipelined_all_reduce``, comm/ring_pipelined.py),
the one measured against the target of 0.9x gloo; ``textbook`` is the plain ring the lessons draw
(``dl.comm.ring_all_reduce``, comm/ring.py: one blocking exchange per step), shown for comparison;
``naive`` goes through one root; ``torch`` is ``torch.distributed.all_reduce``.
    python benchmarks/allreduce.py --backend nccl        # one GPU per rank

Reported as bus bandwidth, the nccl-tests definition (github.com/NVIDIA/nccl-tests, PERFORMANCE.md):

    algbw = S / t            busbw = algbw * 2 (N-1) / N

busbw is what each link must carry for a ring all-reduce, so it is comparable across N and with
the link's raw speed. t is, for each repeat, the slowest rank's time from a common barrier to the
end of the call; the median over repeats is reported. Implementations alternate repeat by repeat
so that both see the same background load. Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import default_out, machine_facts, slowest_rank_rows, write  # noqa: E402

UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}
DEFAULT_SIZES = [2**k for k in range(10, 27)]           # 1 KiB .. 64 MiB


def parse_size(text: str) -> int:
    text = text.strip().upper()
    digits = text.rstrip("KMGB")
    return int(float(digits) * UNITS[text[len(digits):]])


def human(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit]:
            return f"{nbytes / UNITS[unit]:g} {unit}"
    return f"{nbytes} B"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


IMPLS = ("ring", "textbook", "naive", "torch")


def _call(impl: str, x: torch.Tensor):
    if impl == "ring":
        dl.comm.pipelined_all_reduce(x)
    elif impl == "textbook":
        dl.comm.ring_all_reduce(x)
    elif impl == "naive":
        dl.comm.naive_all_reduce(x)
    else:
        dist.all_reduce(x)


def measure(sizes, impls, budget_s, min_reps, max_reps, device=None):
    """Inside each rank: per size, per repeat, the time of each implementation (alternating). ``device``:
    where the tensors live (default ``dl.device()``; e.g. ``cuda:0`` for gloo ranks sharing one GPU)."""
    device = dl.device() if device is None else torch.device(device)
    dl.tracer().enabled = False                 # measure the collectives, not the bookkeeping
    out = {}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(dl.rank())).to(device)
        check = {}
        for impl in impls:                      # warm up, and check every result against torch's
            y = x.clone()
            _call(impl, y)
            _call(impl, x.clone())
            check[impl] = y
        for impl in impls:
            if not torch.allclose(check[impl], check[impls[0]], rtol=1e-4, atol=1e-4):
                raise AssertionError(f"{impl} disagrees with {impls[0]} at {nbytes} bytes")
        dist.barrier()
        t0 = time.perf_counter()
        _call(impls[0], x)
        _sync(device)
        estimate = torch.tensor([(time.perf_counter() - t0) * len(impls)], dtype=torch.float64, device=device)
        dist.broadcast(estimate, 0)             # every rank must run the same number of repeats (on the
                                                # tensors' device: NCCL takes no CPU tensor)
        reps = int(min(max_reps, max(min_reps, budget_s / max(float(estimate), 1e-6))))
        times = {impl: [] for impl in impls}
        for rep in range(reps):
            order = impls if rep % 2 == 0 else impls[::-1]
            for impl in order:
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                _call(impl, x)
                _sync(device)
                times[impl].append(time.perf_counter() - t0)
        out[nbytes] = times
        if dl.rank() == 0:
            print(f"n={dl.world_size()} {human(nbytes):>7}: "
                  + "  ".join(f"{k} {statistics.median(v) * 1e3:8.3f} ms" for k, v in times.items()),
                  flush=True)
    return out


NAMES = {"ring": "dl pipelined ring", "textbook": "dl textbook ring", "naive": "dl naive"}


def plot(rows, path, backend):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4))
    for n in sorted({r["world_size"] for r in rows}):
        for impl, style in (("ring", "-o"), ("textbook", "-.v"), ("torch", "--s"), ("naive", ":^")):
            pts = [r for r in rows if r["world_size"] == n and r["impl"] == impl]
            if pts:
                ax.plot([p["bytes"] for p in pts], [p["busbw_GBps"] for p in pts], style, ms=3,
                        label=f"{NAMES.get(impl, backend)} (N={n})")
        ref = {r["bytes"]: r["median_s"] for r in rows if r["world_size"] == n and r["impl"] == "torch"}
        for impl, style in (("ring", "-o"), ("textbook", "-.v")):
            mine = {r["bytes"]: r["median_s"] for r in rows if r["world_size"] == n and r["impl"] == impl}
            common = sorted(set(mine) & set(ref))
            if common:
                ax_ratio.plot(common, [ref[s] / mine[s] for s in common], style, ms=3,
                              label=f"{NAMES[impl]}, N={n}")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title="all-reduce bus bandwidth")
    ax.legend(fontsize=8)
    ax_ratio.axhline(0.9, color="grey", ls=":", label="target 0.9")
    ax_ratio.axhline(1.0, color="black", lw=0.5)
    ax_ratio.axvline(4 * 2**20, color="grey", lw=0.5)
    ax_ratio.set(xscale="log", xlabel="message size (bytes)", ylabel=f"busbw ring / busbw {backend}",
                 title=f"dl rings vs {backend} all_reduce")
    ax_ratio.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help="comma list like 1K,1M,64M (default: powers of 2, 1K..64M)")
    p.add_argument("--ranks", default="2,4", help="world sizes, comma list (default 2,4)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--impls", default="ring,textbook,torch",
                   help="any of ring (pipelined), textbook, torch, naive (default ring,textbook,torch)")
    p.add_argument("--budget", type=float, default=1.5, help="seconds of repeats per size (default 1.5)")
    p.add_argument("--min-reps", type=int, default=7)
    p.add_argument("--max-reps", type=int, default=40)
    p.add_argument("--out", default=default_out("allreduce"))
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")] if a.sizes else DEFAULT_SIZES
    impls = [s.strip() for s in a.impls.split(",")]
    if any(i not in IMPLS for i in impls):
        p.error(f"--impls takes {', '.join(IMPLS)}; got {a.impls}")
    rows, backend, started = [], None, time.time()
    for n in [int(x) for x in a.ranks.split(",")]:
        run = dl.launch(measure, world_size=n, args=(sizes, impls, a.budget, a.min_reps, a.max_reps),
                        backend=a.backend, output="live", timeout=1800)
        backend = run.backend
        rows += slowest_rank_rows(run.results, n, traffic=2 * (n - 1) / n)
    ratios = {impl: ratios_from_4mb(rows, impl, backend) for impl in ("ring", "textbook")}
    meta = {**machine_facts(started, backend), "dtype": "float32", "ring": "dl.comm.pipelined_all_reduce",
            "textbook": "dl.comm.ring_all_reduce",
            "statistic": "median over repeats of the slowest rank's time",
            "busbw": "algbw * 2(N-1)/N (nccl-tests)"}
    write(a.out, {"meta": meta, "ratio_ring_over_torch": ratios["ring"],
                  "ratio_textbook_over_torch": ratios["textbook"], "results": rows},
          lambda png: plot(rows, png, backend))


def ratios_from_4mb(rows, impl, backend):
    """Per world size: min and median of busbw(impl) / busbw(torch) over the sizes from 4 MB up."""
    ratios = {}
    for n in sorted({r["world_size"] for r in rows}):
        mine = {r["bytes"]: r["busbw_GBps"] for r in rows if r["world_size"] == n and r["impl"] == impl}
        ref = {r["bytes"]: r["busbw_GBps"] for r in rows if r["world_size"] == n and r["impl"] == "torch"}
        big = [mine[s] / ref[s] for s in mine if s in ref and s >= 4 * 2**20]
        if big:
            ratios[n] = {"min_ratio_from_4MB": min(big), "median_ratio_from_4MB": statistics.median(big)}
            print(f"N={n}: {NAMES[impl]} / {backend} busbw from 4 MB up: min {min(big):.2f}, "
                  f"median {statistics.median(big):.2f}")
    return ratios


if __name__ == "__main__":
    main()
