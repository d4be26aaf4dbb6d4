"""The simulator on this machine: ranks are processes sharing a few CPU cores.

`theory.sim` describes a GPU cluster; the same equations describe a laptop once its constants are
this machine's. Two clocks matter here, and they answer different questions:

* **CPU time** (``time.process_time`` in each rank: the seconds the rank actually ran, user and
  system, comm copies included) is the *work*. It does not include waiting (for a message, for the
  pipeline, for a core), so another program loading the machine does not inflate it. The simulator
  predicts it as the step minus the bubble, on a machine where every rank has a core of its own::

      busy = compute (FLOPs / speed) + exposed comm (CPU cost of gloo's copies) + overhead per step
             + overhead per pipeline action (Python and autograd dispatch per forward / backward)
             + overhead per tensor-parallel collective (the f / g autograd functions around it)

* **Wall time** is the work stretched by **processor sharing** (Kleinrock 1967; lesson 00): ``k``
  runnable processes on ``c`` cores each run at ``min(1, c / k)`` of a core::

      ranks R, cores c, other runnable programs L      share = min(1, c / (R + L))
      wall  ~  busy / share + bubble                   (a rank waits for the pipeline at no cost)

The constants (speed, overhead per step, per pipeline action, per tensor-parallel collective) are
fitted on some runs (`fit`: least squares, pure Python) and the others are *predicted*. A CPU
"GPU" here is one core at 1 GFLOP/s of "peak", so ``Efficiency.compute`` reads as GFLOP/s per core.
"""
from __future__ import annotations

from distlab.theory.presets import GPUPreset, LinkPreset, ModelPreset
from distlab.theory.sim import Cluster, Efficiency, StepResult, step

CORE_FLOPS = 1e9                         # a core's nominal "peak": efficiency.compute is then GFLOP/s


def processor_sharing(work: list[float], cores: float) -> list[float]:
    """Wall-clock finish time of each job when ``cores`` are shared equally by the unfinished jobs.

    Egalitarian processor sharing (Kleinrock 1967): with k jobs left, each runs at min(1, cores / k).
    ``processor_sharing([6, 12, 18, 24], 2) == [12, 21, 27, 33]``.
    """
    if cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    left, now, finish = dict(enumerate(work)), 0.0, [0.0] * len(work)
    while left:
        speed = min(1.0, cores / len(left))
        first = min(left, key=left.get)
        dt = left[first] / speed
        now += dt
        for job in left:
            left[job] -= dt * speed
        for job in [j for j, w in left.items() if w <= 1e-12]:
            finish[job] = now
            del left[job]
    return finish


def core_share(ranks: int, cores: float, others: float = 0.0) -> float:
    """Share of a core each of ``ranks`` busy ranks gets beside ``others`` runnable programs."""
    if ranks < 1 or cores <= 0 or others < 0:
        raise ValueError(f"need ranks >= 1, cores > 0, others >= 0; got {ranks}, {cores}, {others}")
    return min(1.0, cores / (ranks + others))


def fit_link(n: int, small: tuple[float, float], large: tuple[float, float],
             name: str = "measured") -> LinkPreset:
    """alpha (latency) and B (bandwidth, bytes/s) from two timed ring all-reduces, ``(bytes, seconds)``
    each: `theory.comm`'s t = 2(n-1) alpha + 2 (n-1)/n S / B solved for alpha from the small one
    (bytes ~ 0), then for B."""
    if n < 2 or large[0] <= small[0]:
        raise ValueError(f"need n >= 2 ranks and a large message bigger than the small one; "
                         f"got n={n}, small={small}, large={large}")
    alpha = small[1] / (2 * (n - 1))
    moving = large[1] - 2 * (n - 1) * alpha
    if moving <= 0:
        raise ValueError("the large all-reduce took no longer than the small one: use a larger message")
    return LinkPreset(name, 2 * (n - 1) / n * large[0] / moving, alpha)


def here(ranks: int, link: LinkPreset) -> Cluster:
    """This machine as a `sim.Cluster`: one core per rank (1 GFLOP/s nominal), all in one "node"."""
    return Cluster(GPUPreset("one core", 8 * 2**30, CORE_FLOPS, "gloo"), max(1, ranks), link, link)


def predict(shape: ModelPreset, ranks: int, link: LinkPreset, eff: Efficiency, **layout) -> StepResult:
    """One step of a distlab run here, fp32, no recomputation, communication not overlapped (the
    strategies of `dl.train` block on their collectives)."""
    layout = {"global_batch": 16, "seq_len": shape.seq_len, "recompute": "none", "precision": "fp32",
              "sp": False, "overlap_dp": False, **layout}
    return step(shape, here(ranks, link), ranks, efficiency=eff, **layout)


def busy(result: StepResult) -> float:
    """Seconds a rank runs (CPU time) in the predicted step: everything but the bubble."""
    return result.step_time - result.breakdown["bubble"]


def wall(result: StepResult, share: float) -> float:
    """Predicted wall time when each rank gets ``share`` of a core: the work stretched, the bubble not."""
    return busy(result) / share + result.breakdown["bubble"]


def tp_collectives(result: StepResult) -> float:
    """Tensor-parallel collectives per step on one rank, as `sim` counts them: per layer, f and g of
    the attention and of the MLP, twice forward (and again for a full recomputation) and twice backward."""
    lay = result.layout
    if lay["tp"] == 1:
        return 0.0
    per_layer = 4 + (2 if lay["recompute"] == "full" else 0)
    return lay["microbatches"] * lay["layers"] / lay["pp"] * per_layer


CONSTANTS = ("1/speed", "overhead", "per_action", "per_collective")


def _terms(result: StepResult) -> tuple[float, list[float]]:
    """(comm seconds, [seconds at 1 GFLOP/s, 1 per step, pipeline actions, TP collectives]) per step."""
    b, lay = result.breakdown, result.layout
    actions = 2 * lay["microbatches"] * lay["virtual"]
    comm = b["tp"] + b["cp"] + b["dp"]
    return comm, [b["compute"] + b["recompute"], 1.0, float(actions), tp_collectives(result)]


def fit(units: list[StepResult], cpu: list[float]) -> Efficiency:
    """Least-squares constants from measured CPU seconds per step::

        cpu = work / speed + comm + overhead + actions x per_action + TP collectives x per_collective

    ``units``: each run predicted with compute=1 and no overheads (so its breakdown holds the terms).
    A constant the runs cannot see (no TP run: per_collective) or that comes out negative is set to 0
    and the others are refitted. Give at least as many runs as constants, differing in FLOPs per rank.
    """
    if len(units) != len(cpu) or len(units) < 3:
        raise ValueError(f"fit needs >= 3 runs with a CPU time each, got {len(units)} and {len(cpu)}")
    rows = [_terms(u) for u in units]
    ys = [c - comm for c, (comm, _) in zip(cpu, rows)]
    keep = [i for i in range(len(CONSTANTS)) if i < 2 or any(x[i] for _, x in rows)]
    while True:
        if len(units) < len(keep):
            raise ValueError(f"{len(units)} runs cannot determine {len(keep)} constants: add runs")
        solved = dict(zip(keep, _least_squares([[x[i] for i in keep] for _, x in rows], ys)))
        negative = [i for i in keep if i >= 2 and solved[i] < 0]
        if not negative:
            break
        keep.remove(min(negative, key=solved.get))                   # the most negative one goes
    if solved[0] <= 0:
        raise ValueError("the fitted speed is not positive: the runs differ too little in FLOPs")
    return Efficiency(compute=1.0 / solved[0], comm=1.0, overhead=max(0.0, solved[1]),
                      per_action=solved.get(2, 0.0), per_collective=solved.get(3, 0.0))


def _least_squares(xs: list[tuple], ys: list[float]) -> list[float]:
    """Solve the normal equations (X^T X) beta = X^T y by Gaussian elimination (no numpy here)."""
    n = len(xs[0])
    a = [[sum(x[i] * x[j] for x in xs) for j in range(n)] + [sum(x[i] * y for x, y in zip(xs, ys))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-15:
            raise ValueError("the runs do not determine the constants: vary FLOPs and pipeline actions")
        for r in range(n):
            if r != col:
                k = a[r][col] / a[col][col]
                a[r] = [v - k * w for v, w in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]
