"""What ``distlab train``, ``distlab strategies`` and ``distlab lessons`` do once parsed (`distlab.cli`):
train (a check of the input first, then the run), print the report, write its JSON; say an error in one
line. torch loads here, when a command runs, never for ``--help``."""
from __future__ import annotations

import json
import os
import sys

from .. import __version__
from .flags import train_keywords


def _check_writable(path: str | None) -> None:
    """``--json PATH``: proved writable before training (a run of minutes must not end in a path that
    cannot be written); a file made only to prove it is removed again."""
    if path is None or path == "-" or os.environ.get("RANK", "0") != "0":    # torchrun: rank 0 writes it
        return
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
        if not existed:
            os.unlink(path)
    except OSError as err:
        raise ValueError(f"--json {path!r} cannot be written ({err.strerror or err}): choose a file in a "
                         f"directory you can write to, or '-' for stdout") from None


class RunFailed(Exception):
    """A ValueError or TypeError raised while training, after every check of the input passed: a failure
    of the run (exit 1), not bad input (exit 2)."""


def run_train(args) -> int:
    from ..train import train
    world = args.world_size if args.world_size is not None else (
        1 if args.strategy == "single" else int(os.environ.get("WORLD_SIZE", 1)))
    kwargs = dict(world_size=world, progress=args.progress, **train_keywords(args))
    train(args.strategy, check_only=True, **kwargs)       # bad input: one line, exit 2, no rank started
    _check_writable(args.json)
    printing = os.environ.get("RANK", "0") == "0"   # under torchrun every rank has the report: one prints it
    out = sys.stderr if args.json == "-" else sys.stdout     # stdout is the JSON's, then
    if printing:                                             # what runs, before the ranks start
        dry = " (a dry run: fake backend)" if args.backend == "fake" else ""
        batch = args.global_batch or ("the dry run's" if dry else 16)
        print(f"{args.strategy} on {world} rank(s){dry}, {args.model}, global batch {batch}", file=out,
              flush=True)
    try:
        report = train(args.strategy, **kwargs)
    except (ValueError, TypeError) as err:                # every check passed: the run itself failed
        raise RunFailed(f"{type(err).__name__}: {err}") from err
    if not printing:
        return 0
    times = step_seconds(report) if args.backend != "fake" else {}   # a dry run's time is no step time
    for step, loss in enumerate(report.losses):
        took = f"  {times[step] * 1e3:8.1f} ms" if step in times else ""     # a resumed run's own steps
        print(f"step {step:4d}  loss {loss:.6f}{took}", file=out)
    if times:
        print(mean_step_time(times), file=out)
    listed = train_keywords(args).get("ranks") or range(len(report.memory))
    for r, comm, mem in zip(listed, report.comm, report.memory):
        peak = mem.get("peak", {})
        parts = "  ".join(f"{k} {v / 2**20:.3f}" for k, v in peak.items())
        sent = comm.get("sent_per_step", 0) / 2**20
        print(f"rank {r}: sent {sent:.3f} MiB/step   peak MiB: {parts}", file=out)
    for r in getattr(report, "restarts", []):
        print(f"restart {r.attempt}: {r.world_size} -> {r.next_world_size} ranks, resumed from step "
              f"{r.resumed_from}, lost {r.lost_steps} step(s) and {r.lost_seconds:.2f} s", file=out)
    if args.profile:                                      # what torch.profiler measured, beside distlab
        from ..viz.profile import summary
        print(summary(args.profile, report.trace), file=out)
    if args.json == "-":
        json.dump(_as_json(args, report, times), sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(_as_json(args, report, times), f, indent=1)
    return 0


def mean_step_time(times: dict[int, float]) -> str:
    """The steady step time: the mean over this run's steps but its first, the warm-up (allocations,
    the first collectives' connections; often ten times a steady step), which the line says it left out."""
    first, *steady = sorted(times)
    if not steady:
        return f"mean step time {times[first] * 1e3:.1f} ms (1 step, the warm-up: no steady step to time)"
    mean = sum(times[s] for s in steady) / len(steady)
    return (f"mean step time {mean * 1e3:.1f} ms ({1 / mean:.2f} steps/s over {len(steady)} "
            f"step{'s' * (len(steady) != 1)}; step {first}, the warm-up, left out)")


def _as_json(args, report, times: dict[int, float]) -> dict:
    """The run's settings, losses, step times (seconds; None for steps an earlier run did before a
    resume), bytes and peak memory per rank."""
    spec = report.spec
    return {"version": __version__, "strategy": spec.strategy, "world_size": report.world_size,
            "model": spec.model, "steps": spec.steps, "seed": spec.seed, "global_batch": spec.global_batch,
            "grad_accum": spec.grad_accum, "precision": spec.precision, "optimizer": spec.optimizer,
            "lr": spec.lr, "options": _options(spec), "losses": report.losses,
            "step_seconds": [times.get(step) for step in range(len(report.losses))],
            "seconds": report.seconds, "comm": report.comm,
            "memory": [{k: v for k, v in m.items() if k != "timeline"} for m in report.memory]}


def _options(spec) -> dict:
    """The spec's options that were set (not at their defaults), beside its own parameters, as keywords."""
    from ..strategies.parse import TOP, keywords_of
    return {k: (str(v) if k in ("checkpoint_dir", "profile") else v) for k, v in keywords_of(spec).items()
            if k not in TOP}


def step_seconds(report) -> dict[int, float]:
    """{step: wall time on rank 0}, from its "step" mark to the end of its "optimizer" span, for the
    steps this run took (after a resume, the earlier run's steps are not there)."""
    trace = report.trace
    if trace is None:
        return {}
    starts = {e.args.get("step"): e.start for e in trace.select("mark", rank=0, name="step")}
    ends = {e.args.get("step"): e.end for e in trace.spans(rank=0, name="optimizer")}
    return {s: ends[s] - starts[s] for s in sorted(starts) if s in ends}


def list_strategies() -> int:
    """Every strategy name and the options it reads, then what each option does: the docstring of its
    field in the typed spec (`distlab.strategies.spec`)."""
    import textwrap

    from ..strategies.parse import NAMED, SHARED, describe, key, names, options
    for name in names():
        own = NAMED[key(name)].reads
        note = "  (ddp's, read and ignored: one process)" if name == "single" else ""
        print(f"{name:<20} {', '.join(own) or '-'}{note}")
    print(f"\nevery strategy also takes {', '.join(SHARED)} (and the numerics' options where fp16 runs); "
          "pass options as --option KEY=VALUE (or the flags of `distlab train --help`)")
    print("\nwhat each option does:")
    for option in dict.fromkeys(o for name in names() for o in options(name)):
        lines = textwrap.wrap(describe(option), 84, break_on_hyphens=False) or ["-"]
        print(f"  {option:<24}{lines[0]}", *(f"  {'':<24}{line}" for line in lines[1:]), sep="\n")
    return 0


def copy_lessons(args) -> int:
    from ..lessons import copy, report
    print(report(args.dir, copy(args.dir, force=args.force)))
    print(f"open them with: jupyter lab {args.dir}   (pip install distlab[lab] for JupyterLab and the "
          "widgets)")
    return 0


def say_error(err: Exception) -> int:
    """One line on stderr for what went wrong and what to do: 2 for bad input, 1 for a failed rank or run."""
    from ..launch import LaunchError
    if isinstance(err, LaunchError):
        lines = [line for line in (err.failures.get(err.rank) or str(err)).splitlines() if line.strip()]
        where = f"rank {err.rank} failed" if err.rank is not None else str(err).splitlines()[0]
        print(f"distlab: error: {where}: {lines[-1].strip() if lines else ''}\n"
              "(run again with --traceback for the full traceback)", file=sys.stderr)
        return 1
    if isinstance(err, RunFailed):
        print(f"distlab: error: the run failed: {err}\n(run again with --traceback for the full traceback)",
              file=sys.stderr)
        return 1
    print(f"distlab: error: {err}", file=sys.stderr)
    return 2


def reported() -> tuple[type, ...]:
    """The errors said in one line (`say_error`) rather than as a traceback."""
    from ..checkpoint.store import CheckpointError
    from ..launch import LaunchError
    from ..memory_budget import MemoryLimitExceeded
    return (ValueError, TypeError, OSError, ImportError, CheckpointError, LaunchError, MemoryLimitExceeded,
            RunFailed)                # ImportError: an extra not installed (--engine ray): what to install

