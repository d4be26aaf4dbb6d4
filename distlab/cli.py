"""The ``distlab`` command.

    distlab train --strategy zero2 --world-size 4 --model gpt-tiny --steps 20
    distlab train --strategy ddp --world-size 2 --comm ring --bucket-mb 0.1 --json out.json
    distlab train --strategy zero2 --world-size 4 --steps 100 --checkpoint-dir ck --checkpoint-every 10 \
                  --resume
    distlab train --strategy zero2 --world-size 4 --steps 100 --checkpoint-dir ck --checkpoint-every 10 \
                  --max-restarts 2 --shrink --async-save
    distlab train --strategy ddp --world-size 2 --profile prof    (prof/trace.json: every rank profiled)
    distlab strategies                       every strategy name and the options it takes
    distlab lessons DIR                      the lessons: DIR/student to work in, DIR/solved to compare with
    distlab grade PATH --junit out.xml       every exercise check of student notebooks, headless, scored
    distlab --version

Under torchrun the same command runs on every rank (``--world-size`` must equal torchrun's) and
rank 0 prints; after a failure, the same command with ``--resume`` continues from the latest
complete checkpoint, and ``torchrun --max-restarts K ... --resume`` does that on its own (each attempt
meets under its own store prefix: `launch.torchrun`). Without torchrun, ``--max-restarts K`` relaunches
the ranks itself (`distlab.strategies.restart`).

``train`` runs `dl.train` and prints the loss of every step, then bytes sent per rank per step and
each rank's peak memory by category; ``--json PATH`` (``-``: stdout) writes them with the run's settings
and every step's wall time. Bad input (a misspelled option, a value of the wrong type or range, a layout
the world size cannot hold, a ``--json`` path that cannot be written) is one line, ``distlab: error:
...`` with what to do, and exit status 2, before any rank starts (`dl.train` with ``check_only=True``
runs first); a rank that fails is one line naming it and its error, exit status 1 (``--traceback``
shows the full traceback).
Other subcommands may be added by other modules.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys

from . import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, with a did-you-mean for a misspelled subcommand, choice or flag (argparse's own
    ``suggest_on_error`` arrives in Python 3.14)."""

    def error(self, message: str):
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            message += _did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), quote=True)
        return super().error(message)

    def refuse_unknown(self, extra: list[str]):
        """``unrecognized arguments: --stratgy ddp (did you mean --strategy?)``, from this (sub)parser."""
        flags = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        hints = "".join(_did_you_mean(a.split("=", 1)[0], flags) for a in extra if a.startswith("-"))
        self.error(f"unrecognized arguments: {' '.join(extra)}{hints}")


def _did_you_mean(word: str, options: list[str], quote: bool = False) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if quote else f" (did you mean {close[0]}?)"


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each default, except where there is none (None, False: a flag)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model with a parallel strategy and print per-step losses",
                       formatter_class=_Defaults)
    p.add_argument("--strategy", default="single",
                   help="single, ddp, zero1, zero2, zero3, fsdp, tp, pp-1f1b, 3d:dp=2,tp=2,pp=2, ... "
                        "(see `distlab strategies`)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to launch (default 1; under torchrun, torchrun's WORLD_SIZE, "
                        "which it must equal)")
    p.add_argument("--model", default="gpt-tiny",
                   help="gpt-tiny, gpt-small, gpt-wide, gpt-moe-tiny (for ep) or mlp; with --backend fake "
                        "also gpt3-175b, llama3-8b, llama3-70b, llama3-405b")
    _dry_run_flags(p)
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps; a dry run (--backend fake) takes 1 unless given (default: 20)")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--global-batch", type=int, default=None,
                   help="rows per step, over all ranks (default 16; a dry run one row per microbatch)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="optimizer")
    p.add_argument("--weight-decay", type=float, default=0.0, help="weight decay")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                   help="compute precision")
    p.add_argument("--clip", type=float, default=None, help="clip the gradient norm to this")
    p.add_argument("--comm", default=None, choices=["torch", "ring"],
                   help="collectives (data parallel; default torch)")
    p.add_argument("--bucket-mb", type=float, default=None, help="DDP/ZeRO bucket size (default 25)")
    p.add_argument("--no-overlap", action="store_true", help="communicate after backward, not during it")
    p.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next unit early")
    p.add_argument("--recompute", nargs="?", const="full", default=None, choices=["full", "selective"],
                   help="recompute activations in backward: each whole block (full, the default), or only "
                        "attention's scores and softmax (selective)")
    p.add_argument("--hsdp", type=int, default=None, metavar="R",
                   help="fsdp: R replicas of (world / R) shards")
    p.add_argument("--param-dtype", default=None, choices=["bf16", "fp16"],
                   help="fsdp: gather and compute dtype")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="fsdp: keep the gathered parameters from forward to backward")
    _checkpoint_flags(p)
    p.add_argument("--data", default=None, choices=["synthetic", "text"],
                   help="the model's synthetic data (default), or the shipped text corpus through dl.data's "
                        "loader (loader options: --option workers=2, data_latency=0.05, ...)")
    p.add_argument("--profile", metavar="DIR", help="torch.profiler traces to DIR; comm and MFU printed")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra strategy option (value parsed as JSON when it can be)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write settings, losses, step times, bytes and memory here ('-': stdout, "
                        "the table then goes to stderr)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a bar with step, loss and it/s on stderr (default: when stderr is a terminal)")
    p.add_argument("--traceback", action="store_true", help="on an error, show the full traceback")


def _dry_run_flags(p) -> None:
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "fake"],
                   help="fake: a dry run of the --ranks listed, here, at any world size (NaN losses)")
    p.add_argument("--ranks", default=None, metavar="R,R,...",
                   help="with --backend fake: the ranks to run, e.g. 0,1023")


def _checkpoint_flags(p) -> None:
    """``distlab train``'s checkpoint and restart flags."""
    p.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help="save every K steps and at the end")
    p.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep only the newest N checkpoints")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint (from scratch when there is none)")
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background (training stalls only for a copy to CPU memory)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="relaunch a failed run from its newest checkpoint up to K times")
    p.add_argument("--shrink", nargs="?", const="auto", default=None, metavar="SIZES",
                   help="restart on one rank fewer each time, or on the given world sizes (e.g. 3,2)")


def train_keywords(args) -> dict:
    """``distlab train``'s flags as `dl.train`'s keywords (the strategy aside): the same keywords a
    notebook would pass, parsed into the same typed spec (`distlab.strategies.parse`)."""
    kw = dict(model=args.model, seed=args.seed, lr=args.lr,
              optimizer=args.optimizer, weight_decay=args.weight_decay, grad_accum=args.grad_accum,
              precision=args.precision, clip=args.clip)
    flags = {"steps": args.steps, "global_batch": args.global_batch,       # None: train's default
             "comm": args.comm, "bucket_mb": args.bucket_mb, "recompute": args.recompute, "hsdp": args.hsdp,
             "param_dtype": args.param_dtype, "checkpoint_dir": args.checkpoint_dir,
             "checkpoint_every": args.checkpoint_every, "keep_last": args.keep_last,
             "overlap": False if args.no_overlap else None, "prefetch": True if args.prefetch else None,
             "reshard_after_forward": False if args.no_reshard_after_forward else None,
             "resume": True if args.resume else None, "async_save": True if args.async_save else None,
             "data": args.data, "profile": args.profile}
    kw.update({k: v for k, v in flags.items() if v is not None})      # a flag not given: not a keyword
    if args.backend != "auto":
        kw["backend"] = args.backend
    if args.ranks is not None:
        try:
            kw["ranks"] = [int(r) for r in args.ranks.split(",")]
        except ValueError:
            raise ValueError(f"--ranks expects rank numbers separated by commas (e.g. 0,1023), got "
                             f"{args.ranks!r}") from None
    for item in args.option:
        if "=" not in item:
            raise ValueError(f"--option expects KEY=VALUE (e.g. --option microbatches=4), got {item!r}")
        key, value = item.split("=", 1)
        try:
            kw[key] = json.loads(value)
        except json.JSONDecodeError:
            kw[key] = value
    return {**kw, **_restart_args(args)}


def _restart_args(args) -> dict:
    """``max_restarts`` and ``shrink`` for `dl.train` from ``--max-restarts`` and ``--shrink [SIZES]``."""
    out = {"max_restarts": args.max_restarts} if args.max_restarts else {}
    if args.shrink is not None:
        try:
            out["shrink"] = True if args.shrink == "auto" else [int(n) for n in args.shrink.split(",")]
        except ValueError:
            raise ValueError(f"--shrink expects world sizes like 3,2 (or nothing: one rank fewer per "
                             f"restart), got {args.shrink!r}") from None
    return out


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


def _run_train(args) -> int:
    from .train import train
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
        from .viz.profile import summary
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
    from .strategies.parse import TOP, keywords_of
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


def _strategies() -> int:
    """Every strategy name and the options it reads, then what each option does: the docstring of its
    field in the typed spec (`distlab.strategies.spec`)."""
    import textwrap

    from .strategies.parse import NAMED, SHARED, describe, key, names, options
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


def _lessons(args) -> int:
    from .lessons import copy, report
    print(report(args.dir, copy(args.dir, force=args.force)))
    print(f"open them with: jupyter lab {args.dir}   (pip install distlab[lab] for JupyterLab and the "
          "widgets)")
    return 0


def _error(err: Exception) -> int:
    """One line on stderr for what went wrong and what to do: 2 for bad input, 1 for a failed rank or run."""
    from .launch import LaunchError
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


def _parser() -> tuple[_Parser, dict[str, _Parser]]:
    """The ``distlab`` parser and its subcommands' parsers, by name."""
    parser = _Parser(prog="distlab", description="distributed training, from send/recv up")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    sub.add_parser("strategies", help="list the strategy names train accepts, and what each option does")
    lessons = sub.add_parser("lessons", help="the lessons (Jupyter notebooks): DIR/student to work in "
                             "(exercises to write), DIR/solved to compare with")
    lessons.add_argument("dir", metavar="DIR", help="where to put them (created if need be)")
    lessons.add_argument("--force", action="store_true", help="overwrite copies you changed too")
    from .exercises.grade import add_parser as add_grade_parser      # (no torch: the harness loads on use)
    add_grade_parser(sub)                              # `distlab grade`: distlab/exercises/grade.py
    return parser, sub.choices


def main(argv: list[str] | None = None) -> int:
    # torch and the strategies load only once a command runs: --help and a typo answer at once
    parser, commands = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        commands[args.command].refuse_unknown(extra)
    try:
        if args.command == "train":
            return _run_train(args)
        if args.command == "strategies":
            return _strategies()
        if args.command == "lessons":
            return _lessons(args)
        if args.command == "grade":
            return args.run(args)
    except Exception as err:
        if getattr(args, "traceback", False) or not isinstance(err, _reported()):
            raise
        return _error(err)
    return 2


def _reported() -> tuple[type, ...]:
    """The errors said in one line (`_error`) rather than as a traceback."""
    from .checkpoint.store import CheckpointError
    from .launch import LaunchError
    from .memory_budget import MemoryLimitExceeded
    return (ValueError, TypeError, OSError, CheckpointError, LaunchError, MemoryLimitExceeded, RunFailed)


if __name__ == "__main__":
    sys.exit(main())
