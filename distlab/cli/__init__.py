"""The ``distlab`` command.

    distlab train --strategy zero2 --world-size 4 --model gpt-tiny --steps 20
    distlab train --strategy ddp --world-size 2 --comm ring --bucket-mb 0.1 --json out.json
    distlab train --strategy diloco --world-size 4 --sync-every 4 --outer-lr 0.5
    distlab train --strategy zero3 --world-size 4 --quantize int8 --offload cpu
    distlab train --strategy zero2 --world-size 4 --steps 100 --checkpoint-dir ck --checkpoint-every 10 \
                  --resume
    distlab train --strategy zero2 --world-size 4 --steps 100 --checkpoint-dir ck --checkpoint-every 10 \
                  --max-restarts 2 --shrink --async-save          (--engine ray: Ray Train restarts them)
    distlab train --strategy ddp --world-size 2 --profile prof    (prof/trace.json: every rank profiled)
    distlab train --strategy zero3 --world-size 1024 --model llama3-8b --backend fake --ranks 0,1023
    distlab strategies                       every strategy name and the options it takes
    distlab lessons DIR                      the lessons: DIR/student to work in, DIR/solved to compare with
    distlab grade PATH --junit out.xml       every exercise check of student notebooks, headless, scored
    distlab --version                        (python -m distlab ... is the same command)

Every option of the typed spec (`distlab.strategies.spec`) has a flag of ``distlab train`` (`flags.OPTIONS`,
grouped by concern in ``--help``) or is set by the strategy's name; ``--option KEY=VALUE`` sets any.

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

    parser.py   argparse with a did-you-mean for a misspelled subcommand, choice or flag
    flags.py    ``distlab train``'s flags: the spec's options by concern, and the keywords they become
    run.py      what each command does once parsed (torch loads there, never for ``--help``)
"""
from __future__ import annotations

from .. import __version__
from .flags import OPTIONS, WITHOUT_FLAG, add_train_parser, train_keywords
from .parser import Parser
from .run import RunFailed, mean_step_time, step_seconds

__all__ = ["main", "train_keywords", "mean_step_time", "step_seconds", "RunFailed", "OPTIONS", "WITHOUT_FLAG"]
_train_parser = add_train_parser        # (its name when the command was one module)


def _parser() -> tuple[Parser, dict[str, Parser]]:
    """The ``distlab`` parser and its subcommands' parsers, by name. Other subcommands may be added by
    other modules (``distlab grade``: `distlab.exercises.grade`)."""
    parser = Parser(prog="distlab", description="distributed training, from send/recv up")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_train_parser(sub)
    sub.add_parser("strategies", help="list the strategy names train accepts, and what each option does")
    lessons = sub.add_parser("lessons", help="the lessons (Jupyter notebooks): DIR/student to work in "
                             "(exercises to write), DIR/solved to compare with")
    lessons.add_argument("dir", metavar="DIR", help="where to put them (created if need be)")
    lessons.add_argument("--force", action="store_true", help="overwrite copies you changed too")
    from ..exercises.grade import add_parser as add_grade_parser      # (no torch: the harness loads on use)
    add_grade_parser(sub)                              # `distlab grade`: distlab/exercises/grade.py
    return parser, sub.choices


def main(argv: list[str] | None = None) -> int:
    # torch and the strategies load only once a command runs: --help and a typo answer at once
    from . import run
    parser, commands = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        commands[args.command].refuse_unknown(extra)
    try:
        if args.command == "train":
            return run.run_train(args)
        if args.command == "strategies":
            return run.list_strategies()
        if args.command == "lessons":
            return run.copy_lessons(args)
        if args.command == "grade":
            return args.run(args)
    except Exception as err:
        if getattr(args, "traceback", False) or not isinstance(err, run.reported()):
            raise
        return run.say_error(err)
    return 2
