"""torch.profiler around a launch: ``dl.launch(fn, 2, profile="prof")``, ``dl.train(..., profile="prof")``.

Every rank runs ``fn`` under ``torch.profiler.profile`` (CPU, and CUDA where there is a GPU), attached from
outside, at the one place distlab records:

* spans (forward, backward, optimizer, grad sync, a pipeline's F/B/I/W actions, checkpoints): while the
  profiler records, the rank's tracer opens a ``record_function("distlab:<name>")`` range around each
  (`Tracer.ranges`), live, so the profiler nests the ops run inside it under the range;
* comm events: a collective is recorded when it *finished* (its launch and end are known only then), too
  late to open a live range, so each is written into the profiler's trace at its measured times, as a
  ``distlab:<op> [<group>]`` range on a thread of its own ("distlab comm"), with its bytes and tags;
* the clock: a ``distlab:clock`` range opened at a known time of the tracer says where the rank's epoch
  falls on the profiler's clock (``epoch_us``), within a microsecond or two.

Each rank writes ``DIR/rank{r}.json`` (the profiler's own Chrome trace, which Holistic Trace Analysis reads:
``TraceAnalysis(trace_files={r: "DIR/rank{r}.json"})``; its ``distributedInfo`` names the rank), then the
parent merges them (`merge`) into ``DIR/trace.json``: one process per rank (pid = rank), all on the launch's
common time base, distlab's (microseconds since the barrier after start-up), so ``trace.json`` lines up
with ``run.trace.save_chrome(...)``. Open it at ui.perfetto.dev. `distlab.viz.profile` measures from it.
"""
from __future__ import annotations

import json
import os
import re
import time

from ..trace import _fitting_lane

PREFIX = "distlab:"
CLOCK_TRIES = 5                   # distlab:clock ranges opened at the start, to read the profiler's clock
COMM_TID = 1_000_000_000          # the "distlab comm" threads: this tid, then one more per lane
_RANK_FILE = re.compile(r"rank\d+\.json")


def prepare(profile, dry_run: bool = False) -> str | None:
    """The parent, before any rank starts: the directory ``profile`` made (old rank files removed), as an
    absolute path; None for no profile. Bad input is a ValueError that says what to pass."""
    if profile is None:
        return None
    if dry_run:
        raise ValueError(f"profile={profile!r} records what a real run spends its time on; a dry run "
                         "(backend='fake', ranks=...) computes on the meta device and sends nothing: "
                         "drop profile=, or run without ranks=")
    if isinstance(profile, os.PathLike):
        profile = os.fspath(profile)
    if not isinstance(profile, str) or not profile.strip():
        raise ValueError(f"profile={profile!r}: pass a directory for the profiler's traces (e.g. 'prof'), "
                         "or None for no profile")
    try:
        os.makedirs(profile, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"profile={profile!r}: cannot create the directory ({exc})") from None
    if not os.access(profile, os.W_OK | os.X_OK):
        raise ValueError(f"profile={profile!r}: the directory is not writable")
    for name in os.listdir(profile):
        if _RANK_FILE.fullmatch(name) or name == "trace.json":   # a previous run's: never merged with this
            try:
                os.remove(os.path.join(profile, name))
            except FileNotFoundError:                            # torchrun: a peer removed it first
                pass
    return os.path.abspath(profile)


def rank_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


class RankProfiler:
    """``with RankProfiler(directory, rank, tracer): fn()`` profiles ``fn`` and writes ``rank{r}.json``.
    ``origin``: the tracer's time that is zero of the run's axis (0: its epoch, as in a launch)."""

    def __init__(self, directory: str, rank: int, tracer, origin: float = 0.0):
        self.directory, self.rank, self.tracer, self.origin = directory, rank, tracer, origin

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile, record_function

        from ..runtime import device

        gpu = device().type == "cuda"                 # this rank's device; not is_available(), which
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])   # would cuInit here
        self.prof = profile(activities=activities, record_shapes=True)     # shapes: the matmuls' FLOPs
        self.prof.__enter__()
        self.anchors = []                      # (before, after) each clock range opened: the narrowest wins
        for _ in range(CLOCK_TRIES):
            before = self.tracer.now()
            with record_function(PREFIX + "clock"):
                self.anchors.append((before, self.tracer.now()))
        self.tracer.ranges = lambda name: record_function(PREFIX + name)
        self.modules = ModuleRanges().attach()
        return self

    def __exit__(self, *exc) -> None:
        self.tracer.ranges = None
        self.modules.detach()
        self.prof.__exit__(*exc)
        path = rank_path(self.directory, self.rank)
        self.prof.export_chrome_trace(path)
        with open(path) as f:
            data = json.load(f)
        _annotate(data, self.tracer.events(), self.anchors, self.rank, self.origin)
        data["distlab"]["peak_flops"] = peak_flops()
        with open(path, "w") as f:
            f.write(json.dumps(data))          # one shot: json's C encoder (json.dump to a file: pure Python)


class ModuleRanges:
    """A ``distlab:module:<name>`` range around every module's forward while the profiler records (global
    forward hooks, attached from outside and removed after; the model carries nothing). ``<name>``: the
    module's name under the outermost module running (which is named by its class)."""

    def __init__(self):
        self.open: list = []                         # (module, range) of each forward running
        self.names: dict = {}                        # the outermost module's names of its submodules

    def attach(self) -> "ModuleRanges":
        from torch.nn.modules import module as nn_module
        self.handles = [nn_module.register_module_forward_pre_hook(self._enter),
                        nn_module.register_module_forward_hook(self._leave, always_call=True)]
        return self

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _enter(self, module, args) -> None:
        from torch.profiler import record_function
        if not self.open:
            self.names = {id(m): n for n, m in module.named_modules()}
            self.names[id(module)] = type(module).__name__
        rng = record_function(f"{PREFIX}module:{self.names.get(id(module), type(module).__name__)}")
        rng.__enter__()
        self.open.append((module, rng))

    def _leave(self, module, args, output) -> None:
        if self.open and self.open[-1][0] is module:
            self.open.pop()[1].__exit__(None, None, None)


def _annotate(data: dict, events: list, anchors: list, rank: int, origin: float) -> None:
    """Write into the profiler's ``data``: the clock, distlab's comm events as ranges, each live span range's
    arguments, and the step windows (``distlab`` key: rank, pid, epoch_us, steps as [start, end] µs).
    The clock: the range opened between the tracer's ``before`` and ``after`` that were closest (a rank
    preempted between them, on a busy machine, would put it off by as long)."""
    xs = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    clocks = sorted((e for e in xs if e.get("name") == PREFIX + "clock"), key=lambda e: e["ts"])
    (before, _), clock = min(zip(anchors, clocks), key=lambda pair: pair[0][1] - pair[0][0])
    epoch, pid = clock["ts"] - before * 1e6, clock["pid"]
    _span_args(xs, [e for e in events if e.kind == "span"])
    data["traceEvents"] += _comm_ranges([e for e in events if e.kind == "comm"], epoch, pid)
    windows = step_windows(events)
    data["traceEvents"] += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": pid,
                             "tid": clock["tid"], "ts": a + epoch, "dur": b - a, "args": {}}
                            for k, (a, b) in enumerate(windows)]      # the iterations, as HTA finds them
    steps = [[a - origin * 1e6, b - origin * 1e6] for a, b in windows]
    data["distlab"] = {"rank": rank, "pid": pid, "epoch_us": epoch + origin * 1e6, "steps": steps}


def _span_args(xs: list[dict], spans: list) -> None:
    """Give every live ``distlab:<name>`` range the arguments of its span (step, micro, stage, ...): the
    k-th range of a name is the k-th span of that name."""
    by_name: dict[str, list] = {}
    for e in sorted(spans, key=lambda e: e.start):
        by_name.setdefault(PREFIX + e.name, []).append(e)
    ranges: dict[str, list] = {}
    for x in sorted(xs, key=lambda x: x["ts"]):
        if x.get("name") in by_name:
            ranges.setdefault(x["name"], []).append(x)
    for name, found in ranges.items():
        if len(found) == len(by_name[name]):
            for x, e in zip(found, by_name[name]):
                x.setdefault("args", {}).update(_plain(e.args))


def _comm_ranges(comms: list, epoch: float, pid) -> list[dict]:
    """distlab's comm events as complete events on the "distlab comm" threads (lanes that nest)."""
    out, lanes = [], []
    for e in sorted(comms, key=lambda e: (e.start, -e.end)):
        ts, dur = e.start * 1e6 + epoch, max(e.duration * 1e6, 0.0)
        lane = _fitting_lane(lanes, ts, ts + dur)
        lanes[lane].append(ts + dur)
        group = e.args.get("group")
        name = f"{PREFIX}{e.name}" + (f" [{group}]" if group else "")
        out.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": COMM_TID + lane,
                    "ts": ts, "dur": dur, "args": _plain(e.args)})
    for lane in range(len(lanes)):
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_TID + lane,
                    "args": {"name": "distlab comm" + (f" {lane + 1}" if lane else "")}})
    return out


def _plain(args: dict) -> dict:
    return {k: v for k, v in args.items() if isinstance(v, (int, float, str, bool)) and k != "cat"}


def step_windows(events: list) -> list[list[float]]:
    """[start, end] in µs on distlab's axis of each training step: from its "step" mark to the next one, the
    last to the end of what was recorded after it (empty: no steps marked)."""
    marks = sorted(e.start for e in events if e.kind == "mark" and e.name == "step")
    if not marks:
        return []
    last = max(e.end for e in events if e.start >= marks[-1])
    return [[a * 1e6, b * 1e6] for a, b in zip(marks, marks[1:] + [last])]


def peak_flops(seconds: float = 0.05, n: int | None = None) -> float:
    """This rank's measured matmul peak, FLOP/s: n x n matrix products on its device and threads,
    repeated for about ``seconds`` after one warm-up. On a CPU fp32 products of n = 512; on a GPU bf16
    products of n = 8192, the size and dtype the tensor cores reach their peak with (fp32 products of 512
    measured 11 TFLOP/s on an H100 whose bf16 peak is 989: a figure no step can be judged against)."""
    import torch
    from ..runtime import device

    dev = device()
    gpu = dev.type == "cuda"
    n = n or (8192 if gpu else 512)
    dtype = torch.bfloat16 if gpu else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    a @ b
    sync()
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
        if gpu and reps % 32:
            continue
        sync()
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def merge(directory: str, world_size: int) -> str:
    """``directory/trace.json`` from every ``rank{r}.json``: pid = rank (a GPU of rank r: 1000 (r + 1) + its
    device), times in µs since the launch's common epoch; returns its path."""
    events, meta = [], {}
    for r in range(world_size):
        with open(rank_path(directory, r)) as f:
            data = json.load(f)
        info = data["distlab"]
        meta[str(r)] = {k: v for k, v in info.items() if k != "pid"}
        events += _moved(data["traceEvents"], r, info["pid"], info["epoch_us"])
        events += [{"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}},
                   {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}}]
    path = os.path.join(directory, "trace.json")
    with open(path, "w") as f:
        clock = "microseconds since the launch's common epoch"
        f.write(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",           # one shot: C encoder
                            "distlab": {"clock": clock, "ranks": meta}}))
    return path


def _moved(trace_events: list[dict], rank: int, host, epoch: float) -> list[dict]:
    """One rank's events in the merged file: its process renumbered, its times on the common axis (the
    profiler's own window markers, whose pid is a word, left out), its GPU's process named "rank r GPU d"
    (the profiler names it after the program, "python3", the same for every rank)."""
    out = []
    for e in trace_events:
        pid = e.get("pid")
        renamed = e.get("ph") == "M" and e.get("name") == "process_name" and pid == host   # "rank r" instead
        if not isinstance(pid, int) or renamed:
            continue
        e = dict(e, pid=rank if pid == host else 1000 * (rank + 1) + pid)
        if e.get("ph") == "M" and e.get("name") == "process_name":    # a device's (kineto: "python3")
            e["args"] = {**e.get("args", {}), "name": f"rank {rank} GPU {pid}"}
        if "ts" in e:
            e["ts"] = e["ts"] - epoch
        if "id" in e:                                   # flow arrows: ids unique per rank only
            e["id"] = e["id"] + rank * 10 ** 9 if isinstance(e["id"], int) else f"{rank}:{e['id']}"
        out.append(e)
    return out
