"""`dl.train`: the one entry point to training that the CLI, the benchmarks and the lessons share.

    report = dl.train("zero2", world_size=4, model="gpt-tiny", steps=20, seed=0)
    report.losses          # per step, from the rank that holds the loss
    report.params          # final full parameters by name (gathered)
    report.memory[r]       # rank r's ledger: {"peak": {...}, "peak_total": ..., "timeline": [...]}
    report.comm[r]         # rank r's bytes: {"sent", "received", "sent_per_step", "sent_by_op",
                           #                  "sent_by_group"}
    report.run.trace       # everything recorded (None for "single", which runs in this process)
    report.stragglers()    # per step: each rank's compute time, the skew, the slowest rank

Checkpoints (every strategy; see `distlab.checkpoint`): ``checkpoint_dir=..., checkpoint_every=k``
saves every k steps and at the end (``keep_last=n`` keeps the newest n); ``resume=True`` continues from
the newest checkpoint that verifies, bit-exact (a damaged newer one is skipped, and named);
``fail_at_step=s`` kills a rank on purpose (lessons, tests). ``precision="fp16-mixed"`` scales the loss
dynamically; a step whose gradients hold an inf/NaN on any rank is skipped on all (``report.numerics``);
``memory_limit="64MB"`` raises an out-of-memory error the moment the ledger crosses it.
``async_save=True`` writes checkpoints in the background (`distlab.checkpoint.background`).
``profile="prof"`` runs every rank under torch.profiler: prof/rank{r}.json and the merged prof/trace.json,
with distlab's spans and collectives as ranges (`distlab.launch.profiler`; measured: `distlab.viz.profile`).
``max_restarts=k`` relaunches a failed run from its
newest checkpoint up to k times, on fewer ranks with ``shrink`` (`strategies.restart`; ``report.restarts``).

The walk of a call, straight down (train.py is left once, for `distlab.strategies`, and the run comes
back as the report)::

    spec = parse(strategy, **keywords)      the typed spec (`distlab.strategies.spec`); names checked,
                                            each value by its field's rule
    sizes = validate(spec, world_size)      the whole spec against the world, once, in the parent
    check_machine(world_size)               the ranks this machine can hold
    return run(spec, sizes, ...)            `distlab.strategies.runner`: ``load(strategy)``'s ``train_rank``
                                            here (single) or on every rank (`dl.launch`, relaunched by
                                            `strategies.restart`) -> the `Report`: losses, params, trace,
                                            memory, comm

A strategy is a ``train_rank(spec)`` function (`distlab.strategies`), run on every rank by
`dl.launch`; ``single`` runs right here on one process and is the reference every strategy must match
on the same global batch. Every strategy builds its model and hands the steps to the one training
loop, `distlab.strategies.loop`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .launch import fake
from .rules import WORLD_SIZE, Custom, Flag, Number, OneOf, check

if TYPE_CHECKING:                 # the strategies (and torch) load when `train` first runs, not on import
    from .strategies.runner import Report

__all__ = ["train", "Report", "check_machine", "available_memory"]


def __getattr__(name: str):
    """``Report`` (`distlab.strategies.runner`), loaded on first use with the strategies and torch."""
    if name == "Report":
        from .strategies.runner import Report
        return Report
    raise AttributeError(f"module 'distlab.train' has no attribute {name!r}")


def _is_dict(value) -> None:
    if not isinstance(value, dict):
        raise TypeError


def _are_ranks(value) -> None:
    """Whole numbers (not bools) in a list or tuple; each against the world size: `launch.fake.check`."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                       for r in value):
        raise TypeError


#: what `train`'s own arguments take (`distlab.rules`); every other parameter is a keyword of the typed
#: spec, whose field declares its rule (`distlab.strategies.spec`)
ARGUMENTS = {
    "world_size": WORLD_SIZE,
    "options": Custom(_is_dict, "a dict {option name: value}", example={"bucket_mb": 25.0}, none="none"),
    "output": OneOf("quiet", "ordered", "live"),
    "timeout": Number(0, strict=True, example=300.0),
    "progress": Flag(none="a bar when a person watches"),
    "check_only": Flag(),
    "backend": OneOf("auto", "gloo", "nccl", "fake"),
    "ranks": Custom(_are_ranks, "a list of rank numbers", example=[0, 1023], none="not a dry run"),
}
#: what one rank holds of its own, at the least: a process with torch, gloo and a tiny model loaded
#: (measured: a gpt-tiny DDP rank forked on Linux has about 130 MiB of private memory)
RANK_BYTES = 128 * 2**20


def train(strategy: str = "single", world_size: int = 1, model: str = "gpt-tiny", steps: int | None = None,
          seed: int = 0, *, global_batch: int | None = None, lr: float = 1e-3, optimizer: str = "adamw",
          weight_decay: float = 0.0, grad_accum: int = 1, precision: str = "fp32",
          clip: float | None = None, options: dict | None = None, output: str = "quiet",
          timeout: float = 300.0, progress: bool | None = None, max_restarts: int = 0, shrink=False,
          check_only: bool = False, backend: str = "auto", ranks=None, **more_options) -> Report | None:
    """Train ``model`` with ``strategy`` on ``world_size`` ranks. Every other keyword (and every entry of
    ``options``) is a field of the typed spec (`distlab.strategies.spec`), e.g. ``bucket_mb=1,
    overlap=False, comm="ring"`` for DDP, ``prefetch=True`` for ZeRO-3; one the strategy does not read
    is a TypeError naming those it does, with a did-you-mean (`distlab.strategies.parse`).
    ``progress``: a bar with step, loss and it/s (None: when a person watches, see `distlab.progress`).
    ``check_only``: check the training input (every argument and option, its type and range, the layout,
    the checkpoint options, the restart plan, the ranks this machine can hold; a ValueError, or a
    TypeError for an option that does not exist, that says what to pass instead), then return None
    without training (a ``checkpoint_dir`` is created, as proof that it is writable). Only torchrun's
    world is checked later, when the launch meets it. ``backend="fake", ranks=[...]``: a dry run of the
    listed ranks at any world size and real model sizes (`distlab.strategies.dry`; ``steps`` 1 and a
    global batch of one row per microbatch unless given); ``model`` may be a `dl.theory.ModelPreset`."""
    from .strategies import dry, parse, validate
    from .strategies.runner import run
    check(ARGUMENTS, dict(world_size=world_size, options=options, output=output, timeout=timeout,
                          progress=progress, check_only=check_only, backend=backend, ranks=ranks))
    listed = fake.check(world_size, ranks, backend)
    steps = dry.default_steps(backend) if steps is None else steps
    named = dict(model=model, steps=steps, seed=seed, global_batch=global_batch or 16, lr=lr,
                 optimizer=optimizer, weight_decay=weight_decay, grad_accum=grad_accum, precision=precision,
                 clip=clip, max_restarts=max_restarts, shrink=shrink, **more_options)
    twice = sorted(set(options or {}) & set(named))
    if twice:
        raise TypeError(f"{twice[0]!r} is given twice, as a keyword and in options=: pass it once")
    spec = parse(strategy, **named, **(options or {}))
    dry.check(spec, world_size, backend)
    if backend == "fake" and global_batch is None:
        spec = spec.replace(global_batch=dry.default_rows(spec, world_size))
    sizes = validate(spec, world_size)        # every check, once, before any rank starts
    if spec.strategy != "single" and backend != "fake" and spec.restart.engine == "local":
        check_machine(world_size)             # (Ray Train's workers run on the cluster's machines)
    if check_only:
        return None
    return run(spec, sizes, output=output, timeout=timeout, progress=progress,      # -> strategies.runner
               dry_ranks=listed)


def check_machine(world_size: int) -> None:
    """Refuse, with the reason, more ranks than this machine can hold: every rank is a process with at
    least `RANK_BYTES` of its own memory, and each takes open files and a process of this user's
    (`distlab.launch`'s limits). The deadline or the kernel's out-of-memory killer would end such a run
    halfway, after minutes, with no word on why."""
    from .launch.parent import _check_limits, _under_torchrun
    if _under_torchrun():                         # torchrun's processes, maybe on many machines
        return
    _check_limits(world_size)                     # open files and processes: what `ulimit` allows
    free = available_memory()
    if free is not None and world_size * RANK_BYTES > free:
        need, most = world_size * RANK_BYTES / 2**30, max(1, free // RANK_BYTES)
        raise ValueError(f"world_size={world_size} ranks need at least {world_size} x "
                         f"{RANK_BYTES / 2**20:.0f} MiB = {need:.1f} GiB of memory (each rank is a process "
                         f"with torch loaded), but this machine has {free / 2**30:.1f} GiB available: use "
                         f"at most {most} ranks, free memory, or run on a machine with more")


def available_memory() -> int | None:
    """Bytes this process could still allocate: the kernel's MemAvailable, or the room left under a
    cgroup (container) limit if that is smaller; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                found.append(int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
