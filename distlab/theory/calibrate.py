"""The simulator on this machine: ranks are processes sharing a few CPU cores.

`theory.sim` describes a GPU cluster; the same equations describe a laptop once its constants are
this machine's. Two clocks matter here, and they answer different questions:

* **CPU time** (``time.process_time`` in each rank: the seconds the rank actually ran, user and
  system, comm copies included) is the *work*. It does not include waiting (for a message, for the
  pipeline, for a core), so another program loading the machine does not inflate it. The simulator
  predicts it as the step minus the bubble, on a machine where every rank has a core of its own::

      busy = compute (FLOPs / speed) + exposed comm (CPU cost of gloo's copies) + overhead per step
             + overhead per pipeline action (Python and autograd dispatch per forward / backward)

* **Wall time** is the work stretched by **processor sharing** (Kleinrock 1967; lesson 00): ``k``
  runnable processes on ``c`` cores each run at ``min(1, c / k)`` of a core::

      ranks R, cores c, other runnable programs L      share = min(1, c / (R + L))
      wall  ~  busy / share + bubble                   (a rank waits for the pipeline at no cost)

The constants are fitted on some strategies (`fit`: least squares, pure Python) and the others are
*predicted*. A CPU "GPU" here is one core at 1 GFLOP/s of "peak", so ``Efficiency.compute`` reads as
GFLOP/s per core.
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
    """alpha and beta from two timed ring all-reduces, ``(bytes, seconds)`` each: `theory.comm`'s
    t = 2(n-1) alpha + 2 (n-1)/n S / beta solved for alpha from the small one (bytes ~ 0), then for beta."""
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


def _terms(result: StepResult) -> tuple[float, float, float, float]:
    """(seconds at 1 GFLOP/s of compute, comm seconds, 1 per step, pipeline actions per step)."""
    b = result.breakdown
    actions = 2 * result.layout["microbatches"] * result.layout["virtual"]
    return b["compute"] + b["recompute"], b["tp"] + b["cp"] + b["dp"], 1.0, float(actions)


def fit(units: list[StepResult], cpu: list[float]) -> Efficiency:
    """Least-squares constants from measured CPU seconds per step: ``cpu = work / speed + comm +
    overhead + actions x per_action`` (``units``: each run predicted with compute=1, no overhead).

    Three unknowns (1/speed, overhead, per_action), so give at least three runs whose FLOPs and
    action counts differ. Negative constants are clamped to 0 (then the others are refitted).
    """
    if len(units) != len(cpu) or len(units) < 3:
        raise ValueError(f"fit needs >= 3 runs with a CPU time each, got {len(units)} and {len(cpu)}")
    rows = [_terms(u) for u in units]
    ys = [c - comm for c, (_, comm, _, _) in zip(cpu, rows)]
    xs = [(flops, one, actions) for flops, _, one, actions in rows]
    inv_speed, overhead, per_action = _least_squares(xs, ys)
    if per_action < 0:                                          # refit without it
        inv_speed, overhead = _least_squares([x[:2] for x in xs], ys)
        per_action = 0.0
    if inv_speed <= 0:
        raise ValueError("the fitted speed is not positive: the runs differ too little in FLOPs")
    return Efficiency(compute=1.0 / inv_speed, comm=1.0, overhead=max(0.0, overhead),
                      per_action=per_action)


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
