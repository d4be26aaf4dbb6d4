"""All-to-all by pairwise exchange (dl.comm.all_to_all) beside torch.distributed's all_to_all_single.

    python benchmarks/all_to_all.py                      # 1 KB .. 16 MB, 2 and 4 ranks, gloo on CPU
    python benchmarks/all_to_all.py --ranks 2 --sizes 64K,1M --budget 0.2

Every rank sends S bytes (its whole tensor: N row blocks, block i to rank i) and receives S. Reported as
bus bandwidth, the nccl-tests definition for all-to-all (github.com/NVIDIA/nccl-tests, PERFORMANCE.md):

    algbw = S / t            busbw = algbw * (N-1) / N

(N-1)/N of the tensor leaves each rank (its own block stays), so busbw is what each rank's link carries
per second, comparable across N. t is, for each repeat, the slowest rank's time per call over --calls calls
back to back from a common barrier (nccl-tests' method); the median over the repeats of --launches
separate launches is reported (launches differ more than repeats within one). The
implementations take turns repeat by repeat so that all see the same background load, and their results
are checked equal first. dl's tracer and the launcher's flight recorder are paused for all of them.
A third line, "p2p", is the least a send/recv all-to-all can do from Python (`bare_sendrecv`): its ratio to
torch is the ceiling of any implementation built from isend/irecv here, recorded as ceiling_p2p_over_torch.
Target: dl.comm.all_to_all's busbw at least 0.8x torch's from 1 MB up, judged where every rank has a
core of its own (MPI micro-benchmarks run one process per core, nccl-tests one rank per GPU): with more
gloo ranks than cores, every rank's threads (its Python thread, gloo's worker and the I/O thread that
wakes for each message) take turns on the cores, so the time measures the scheduler's sharing more than
the collective. Those rows are measured and shown all the same, marked "oversubscribed".
Writes <out>.json and <out>.png.
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
from distlab.launch import flight  # noqa: E402
from _results import default_out, machine_facts, slowest_rank_rows, write  # noqa: E402
from allreduce import _sync, human, parse_size  # noqa: E402

DEFAULT_SIZES = [2**k for k in range(10, 25)]           # 1 KiB .. 16 MiB
IMPLS = ("dl", "torch", "p2p")
TARGET, FROM = 0.8, 1 << 20


def bare_sendrecv(x: torch.Tensor) -> torch.Tensor:
    """The least a send/recv all-to-all can do from Python: gloo's own order (per step an isend, then an
    irecv; all posted, my own block copied meanwhile, then waited), no checks, no tracing. Its busbw over
    torch's is the ceiling of any implementation built from torch.distributed's isend/irecv here."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.empty_like(x)
    send, recv = x.view(n, -1), out.view(n, -1)                 # (N, rows/N * 16): block i is row i
    works = []
    for s in range(1, n):
        works += [dist.isend(send[(r + s) % n], (r + s) % n), dist.irecv(recv[(r - s) % n], (r - s) % n)]
    recv[r].copy_(send[r])
    for w in works:
        w.wait()
    return out


def _call(impl: str, x: torch.Tensor) -> torch.Tensor:
    if impl == "dl":
        return dl.comm.all_to_all(x)
    if impl == "p2p":
        return bare_sendrecv(x)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


def measure(sizes, budget_s, min_reps, max_reps, calls, device=None, impls=IMPLS):
    """Inside each rank: per size and repeat, each implementation's time per call, timed over ``calls``
    calls back to back (nccl-tests' method, src/common.cu: start the iterations, wait, divide), the
    implementations taking turns. Timed one call alone, a result depended on which implementation ran
    just before (the same function under two names: 4.57 and 3.74 ms at 8 MB, 2 ranks); a likely cause,
    not measured, is work gloo's threads still do after a call returns. ``device``: where the tensors live
    (default ``dl.device()``); ``impls``: a subset of `IMPLS` that includes "torch"."""
    device = dl.device() if device is None else torch.device(device)
    n, impls = dl.world_size(), tuple(impls)
    dl.tracer().enabled = False                 # measure the collective, not the bookkeeping:
    with flight.paused():                       # neither the trace nor the launcher's flight recorder
        return {nbytes: _measure_size(nbytes, n, device, budget_s, min_reps, max_reps, calls, impls)
                for nbytes in sizes}


def _measure_size(nbytes, n, device, budget_s, min_reps, max_reps, calls, impls=IMPLS):
    rows = max(n, nbytes // 4 // 16 // n * n)                                       # (rows, 16) fp32
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(dl.rank())).to(device)
    want = _call("torch", x)                                                        # also warms up
    for impl in (i for i in impls if i != "torch"):
        if not torch.equal(_call(impl, x), want):
            raise AssertionError(f"{impl} all-to-all differs from all_to_all_single at {nbytes} bytes")
    estimate = torch.tensor([_timed(impls[0], x, device, calls)], dtype=torch.float64, device=device)
    dist.broadcast(estimate, 0)                 # every rank must run the same number of repeats (on the
                                                # tensors' device: NCCL takes no CPU tensor)
    reps = int(min(max_reps, max(min_reps, budget_s / len(impls) / max(float(estimate) * calls, 1e-6))))
    times = {impl: [] for impl in impls}
    for rep in range(reps):
        for impl in impls[rep % len(impls):] + impls[:rep % len(impls)]:     # each first in turn
            times[impl].append(_timed(impl, x, device, calls))
    if dl.rank() == 0:
        print(f"n={n} {human(x.numel() * 4):>7}: "
              + "  ".join(f"{k} {statistics.median(v) * 1e3:8.3f} ms" for k, v in times.items()), flush=True)
    return times


def _timed(impl: str, x: torch.Tensor, device, calls: int) -> float:
    """Seconds per call of ``impl``, over ``calls`` calls back to back, from a common barrier."""
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        _call(impl, x)
    _sync(device)
    return (time.perf_counter() - t0) / calls


def ratios(rows, impl="dl", cores=None):
    """Per world size: busbw(impl) / busbw(torch) at each size from 1 MB up, min and median, and whether
    the target is met; ``oversubscribed`` (more gloo ranks than ``cores``): shown, not judged."""
    out = {}
    for n in sorted({r["world_size"] for r in rows}):
        bw = {(r["impl"], r["bytes"]): r["busbw_GBps"] for r in rows if r["world_size"] == n}
        big = {s: bw[impl, s] / bw["torch", s] for (i, s) in bw if i == impl and s >= FROM}
        if big:
            crowded = cores is not None and n > cores
            out[n] = {"ratio_by_size": big, "min_ratio_from_1MB": min(big.values()),
                      "median_ratio_from_1MB": statistics.median(big.values()),
                      "met": min(big.values()) >= TARGET, "oversubscribed": crowded}
            verdict = ("met" if out[n]["met"] else "not met") + (", oversubscribed: not judged" * crowded)
            print(f"N={n}: {impl} / torch busbw from 1 MB up: min {min(big.values()):.2f}, "
                  f"median {statistics.median(big.values()):.2f} (target >= {TARGET}: {verdict})")
    return out


LABELS = {"dl": "dl.comm.all_to_all", "p2p": "bare isend/irecv"}


def plot(rows, path, backend):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4))
    for n in sorted({r["world_size"] for r in rows}):
        for impl, style in (("dl", "-o"), ("torch", "--s"), ("p2p", ":^")):
            pts = [r for r in rows if r["world_size"] == n and r["impl"] == impl]
            ax.plot([p["bytes"] for p in pts], [p["busbw_GBps"] for p in pts], style, ms=3,
                    label=f"{LABELS.get(impl, f'{backend} all_to_all_single')} N={n}")
        bw = {(r["impl"], r["bytes"]): r["busbw_GBps"] for r in rows if r["world_size"] == n}
        sizes = sorted(s for impl, s in bw if impl == "dl")
        ax_ratio.plot(sizes, [bw["dl", s] / bw["torch", s] for s in sizes], "-o", ms=3, label=f"dl N={n}")
        ax_ratio.plot(sizes, [bw["p2p", s] / bw["torch", s] for s in sizes], ":^", ms=3,
                      label=f"bare isend/irecv N={n}")
    ax.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="bus bandwidth (GB/s)",
           title="all-to-all bus bandwidth, busbw = S/t (N-1)/N")
    ax.legend(fontsize=8)
    ax_ratio.axhline(TARGET, color="grey", ls=":", label=f"target {TARGET}")
    ax_ratio.axhline(1.0, color="black", lw=0.5)
    ax_ratio.axvline(FROM, color="grey", lw=0.5)
    ax_ratio.set(xscale="log", xlabel="bytes per rank", ylabel=f"busbw dl / busbw {backend}",
                 title=f"dl.comm.all_to_all vs {backend} all_to_all_single")
    ax_ratio.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pooled(launches: list[list[dict]]) -> list[dict]:
    """Every launch's repeats as one list per rank, size and implementation. Separate launches, because
    the spread between them (which ranks share a core, for one) is larger than within one."""
    return [{nbytes: {impl: [t for launch in launches for t in launch[r][nbytes][impl]] for impl in by_impl}
             for nbytes, by_impl in rank.items()} for r, rank in enumerate(launches[0])]


def _ratio_by_launch(launches: list[list[dict]]) -> dict:
    """Per size, dl's busbw over torch's in each launch on its own: the spread the pooled figure hides."""
    out = {}
    for rows in launches:
        t = {(r["impl"], r["bytes"]): r["median_s"] for r in rows}
        for (impl, nbytes), seconds in sorted(t.items()):
            if impl == "dl":
                out.setdefault(nbytes, []).append(round(t["torch", nbytes] / seconds, 3))
    return out


def _over(rows, a, b):
    """Per world size, median over sizes from 1 MB up of busbw(a) / busbw(b)."""
    bw = {(r["world_size"], r["impl"], r["bytes"]): r["busbw_GBps"] for r in rows}
    return {n: statistics.median(bw[n, a, s] / bw[n, b, s] for (m, i, s) in bw
                                 if m == n and i == a and s >= FROM)
            for n in sorted({r["world_size"] for r in rows})}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help="comma list like 1K,1M,4M (default: powers of 2, 1K..16M)")
    p.add_argument("--ranks", default="2,4", help="world sizes, comma list (default 2,4)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--budget", type=float, default=2.0, help="seconds of repeats per size (default 2.0)")
    p.add_argument("--min-reps", type=int, default=7)
    p.add_argument("--max-reps", type=int, default=60)
    p.add_argument("--calls", type=int, default=5, help="calls back to back per timing (default 5)")
    p.add_argument("--launches", type=int, default=3,
                   help="separate launches per world size, their repeats pooled (default 3)")
    p.add_argument("--out", default=default_out("all_to_all"))
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")] if a.sizes else DEFAULT_SIZES
    rows, by_launch, backend, started = [], {}, None, time.time()
    for n in [int(x) for x in a.ranks.split(",")]:
        runs = [dl.launch(measure, world_size=n, args=(sizes, a.budget, a.min_reps, a.max_reps, a.calls),
                          backend=a.backend, output="live", timeout=1800) for _ in range(a.launches)]
        backend = runs[0].backend
        rows += slowest_rank_rows(_pooled([run.results for run in runs]), n, traffic=(n - 1) / n)
        by_launch[n] = _ratio_by_launch([slowest_rank_rows(run.results, n, traffic=1.0) for run in runs])
    meta = {**machine_facts(started, backend), "dtype": "float32",
            "dl": "dl.comm.all_to_all (pairwise exchange)", "torch": "torch.distributed.all_to_all_single",
            "p2p": "bare isend/irecv loop (gloo's order, no checks or tracing): the send/recv ceiling",
            "why": "torch runs the whole exchange as one C++ call in gloo's worker thread; any send/recv "
                   "implementation drives 2(N-1) gloo operations from the Python thread, which is then on "
                   "the critical path (posting and every wait), exposed to preemption on a loaded machine",
            "statistic": f"median over repeats of the slowest rank's time per call, each repeat timing "
                         f"{a.calls} calls back to back (nccl-tests' method), the repeats of {a.launches} "
                         "separate launches pooled",
            "recording": "dl's tracer and the launcher's flight recorder paused for all implementations "
                         "(the recorder costs each send, receive or collective about ten microseconds)",
            "busbw": "algbw * (N-1)/N (nccl-tests, all-to-all)",
            "target": f"dl busbw >= {TARGET}x torch from 1 MB up"}
    cores = len(os.sched_getaffinity(0)) if backend == "gloo" else None   # ranks beyond them share cores
    found, ceiling = ratios(rows, cores=cores), ratios(rows, "p2p", cores=cores)
    judged = [r["met"] for r in found.values() if not r["oversubscribed"]]
    write(a.out, {"meta": meta, "target": {"ratio": TARGET, "from_bytes": FROM,
                                           "met": bool(judged) and all(judged),
                                           "judged_world_sizes": [n for n, r in found.items()
                                                                  if not r["oversubscribed"]]},
                  "ratio_dl_over_torch": found, "ceiling_p2p_over_torch": ceiling,
                  "ratio_dl_over_p2p": _over(rows, "dl", "p2p"),
                  "ratio_dl_over_torch_by_launch": by_launch, "results": rows},
          lambda png: plot(rows, png, backend))


if __name__ == "__main__":
    main()
