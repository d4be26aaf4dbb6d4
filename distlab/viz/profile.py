"""What fraction of a step is communication? Measured from a torch.profiler trace, beside distlab's own.

    report = dl.train("ddp", world_size=2, steps=6, profile="prof")
    figures = measured("prof", report.trace)     # per rank: comm, hidden, mfu, and distlab's own comm, hidden

Both are measured over the same windows, the training steps (from each "step" mark to the next; the first
``skip`` steps, warm-up, left out), on the same clock (`distlab.launch.profiler` puts the merged trace on
distlab's time axis):

* ``comm``: the fraction of step time some communication was in flight. From the profiler: the ops it saw,
  ``c10d::*`` (a collective's launch on the calling thread), ``gloo:*`` / ``nccl:*`` (its run on the
  backend's thread) and NCCL kernels; from distlab: its comm events, each from launch to completion.
* ``hidden``: the part of that communication under compute. From the profiler: other ops running at the same
  time (on any thread, a comm op's own children aside); from distlab: its forward, backward and pipeline
  action spans (not the optimizer's or grad sync's, which wait on the communication).
* ``mfu``: FLOPs of the matrix products the profiler saw (mm, addmm, bmm, baddbmm, from their recorded
  shapes: a fused attention kernel is not counted, so a lower bound) over step time x this rank's measured
  matmul peak (`launch.profiler.peak_flops`).

Why the two ``comm`` figures differ, and what must hold: a distlab event spans from before the launch call
to completion as distlab learns it (a done callback, which waits for the GIL, or the wait), the profiler's
ops only the launch call and the backend's run of it, both inside that event; so distlab's fraction also
holds the time a collective waits queued, or its callback waits for the GIL: the profiler's is at most
distlab's (tested in tests/test_profile.py) for collectives, and close to it on a quiet machine. A
pipeline's point-to-point traffic is the exception: distlab records a send as an instant (a rank never
waits for it), the profiler the backend's run of it, so there the profiler's fraction is the larger
(measured on gloo: about 0.9 beside 0.65 for pp-1f1b at 2 ranks). Their ``hidden`` figures differ more:
distlab's compute is a whole forward or backward span, the profiler's the ops actually running.
"""
from __future__ import annotations

import json
import os

COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
COMPUTE_SPANS = ("forward", "backward", "F", "B", "I", "W")


def measured(directory: str, trace=None, skip: int = 1) -> dict[int, dict]:
    """Per rank, from ``directory/trace.json`` (and ``trace``, a `dl.Trace` of the same run, for distlab's
    own figures): ``{"step_seconds", "comm", "hidden", "flops", "peak_flops", "mfu", "distlab": {"comm",
    "hidden"}}``."""
    with open(os.path.join(directory, "trace.json")) as f:
        data = json.load(f)
    out = {}
    for key, info in data["distlab"]["ranks"].items():
        r = int(key)
        windows = _union([(a, b) for a, b in info["steps"][skip:]]) or _union(info["steps"])
        step = _length(windows)
        ev = [e for e in data["traceEvents"] if e.get("ph") == "X" and _of_rank(e.get("pid"), r)]
        comm, compute = _profiler_intervals(ev)
        flops = sum(_flops(e) for e in ev if e["name"] in MATMULS and _inside(e, windows))
        figures = {"step_seconds": step * 1e-6, "comm": _fraction(comm, windows, step),
                   "hidden": _hidden(comm, compute, windows), "flops": flops,
                   "peak_flops": info["peak_flops"],
                   "mfu": flops / (step * 1e-6 * info["peak_flops"]) if step else 0.0}
        if trace is not None:
            figures["distlab"] = _distlab(trace, r, windows, step)
        out[r] = figures
    return out


def summary(directory: str, trace=None) -> str:
    """`measured`, in words, a line per rank (what ``distlab train --profile DIR`` prints)."""
    lines = [f"profile: {os.path.join(directory, 'trace.json')} (ui.perfetto.dev); measured after the first "
             "step:"]
    for r, f in sorted(measured(directory, trace).items()):
        own = f.get("distlab", {})
        lines.append(f"rank {r}: comm {f['comm']:.1%} of step time, {f['hidden']:.1%} of it under compute, "
                     f"MFU {f['mfu']:.1%} of a measured {f['peak_flops'] / 1e9:.1f} GFLOP/s   (distlab's "
                     f"trace: comm {own.get('comm', 0):.1%}, {own.get('hidden', 0):.1%} under compute)")
    return "\n".join(lines)


def _of_rank(pid, rank: int) -> bool:
    return pid == rank or (isinstance(pid, int) and pid >= 1000 and pid // 1000 - 1 == rank)


def _is_comm(e: dict) -> bool:
    name = e.get("name", "")
    return name.startswith(COMM_PREFIXES) or (e.get("cat") == "kernel" and "nccl" in name.lower())


def _profiler_intervals(events: list[dict]) -> tuple[list, list]:
    """(communication, compute) as unions of intervals in µs: compute is every op that is not
    communication, less the communication on its own thread (a comm op's children)."""
    comm, ops = [], {}
    for e in events:
        span = (e["ts"], e["ts"] + e.get("dur", 0.0))
        if e.get("name", "").startswith("distlab:"):
            continue
        if _is_comm(e):
            comm.append(span)
            ops.setdefault(("comm", e["pid"], e["tid"]), []).append(span)
        elif e.get("cat") in ("cpu_op", "kernel", "gpu_memcpy"):
            ops.setdefault(("ops", e["pid"], e["tid"]), []).append(span)
    compute = []
    for (kind, pid, tid), spans in ops.items():
        if kind == "ops":
            compute += _subtract(_union(spans), _union(ops.get(("comm", pid, tid), [])))
    return _union(comm), _union(compute)


def _distlab(trace, rank: int, windows: list, step: float) -> dict:
    comm = _union([(e.start * 1e6, e.end * 1e6) for e in trace.comms(rank=rank)])
    compute = _union([(e.start * 1e6, e.end * 1e6) for e in trace.spans(rank=rank)
                      if e.name in COMPUTE_SPANS])
    return {"comm": _fraction(comm, windows, step), "hidden": _hidden(comm, compute, windows)}


def _flops(e: dict) -> float:
    """2 m k n (times the batch) of a matrix product, from its recorded input shapes."""
    dims = e.get("args", {}).get("Input Dims") or []
    shapes = [d for d in dims if isinstance(d, list) and len(d) >= 2]
    if len(shapes) < 2:
        return 0.0
    a, b = shapes[-2], shapes[-1]
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _inside(e: dict, windows: list) -> bool:
    return any(a <= e["ts"] < b for a, b in windows)


def _fraction(intervals: list, windows: list, step: float) -> float:
    return _length(_intersect(intervals, windows)) / step if step else 0.0


def _hidden(comm: list, compute: list, windows: list) -> float:
    inside = _intersect(comm, windows)
    total = _length(inside)
    return _length(_intersect(inside, compute)) / total if total else 0.0


# -- intervals: sorted, disjoint lists of (start, end) ---------------------------------------------
def _union(spans) -> list:
    out: list = []
    for a, b in sorted((float(a), float(b)) for a, b in spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(x: list, y: list) -> list:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(x: list, y: list) -> list:
    """x less y (both unions)."""
    out = []
    for a, b in x:
        for c, d in y:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _length(intervals: list) -> float:
    return sum(b - a for a, b in intervals)
