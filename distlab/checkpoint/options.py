"""The checkpoint options of `dl.train`, what each takes, and what they must say together.

Checked once, in the parent, before any rank starts (`training.check_options`, which then proves the
directory writable): a value of the wrong type or range (`RULES`, see `distlab.rules`), checkpoint
options without a ``checkpoint_dir``, a planted failure that would never fire, ``resume=s`` for a step
that the directory does not hold.
"""
from __future__ import annotations

from ..rules import Directory, Either, Flag, OneOf, Whole, check
from . import store

#: every checkpoint option and what it takes (`distlab.rules`); what depends on the run (a step below
#: steps, a rank below the world size, a checkpoint that exists) is checked by `check_options`
RULES = {
    "checkpoint_dir": Directory(example="ck", none="no checkpoints"),
    "checkpoint_every": Whole(1, example=5, none="no saves"),
    "keep_last": Whole(1, example=3, none="keep every checkpoint"),
    "resume": Either(OneOf(True, False, None, "latest"), Whole(1), example=True,
                     description="True (or 'latest': the newest checkpoint that verifies), a step number, or "
                                 "False"),
    "fail_at_step": Whole(0, example=3, none="no planted failure"),
    "fail_rank": Whole(0, example=0),
    "fail_in": OneOf("step", "save"),
    "async_save": Flag(),
    "heartbeat": Flag(),
}
OPTIONS = tuple(RULES)


def check_values(options: dict, in_process: str | None = None, *, steps: int | None = None,
                 world: int | None = None) -> None:
    """Each value (`RULES`), then what they say together, against ``steps`` and the ``world`` size when
    given (``in_process``: the name of a strategy that trains in this process, where a fault injection
    cannot kill a rank)."""
    check(RULES, options)
    if in_process and options.get("fail_at_step") is not None:
        raise ValueError(f"fail_at_step kills a rank process: use a launched strategy (ddp, zero1, ...), "
                         f"not {in_process!r}, which runs in this process")
    if options.get("checkpoint_dir") is None and any(
            options.get(k) for k in ("checkpoint_every", "keep_last", "resume", "async_save", "heartbeat")):
        raise ValueError("checkpoint_every, keep_last, resume, async_save and heartbeat need "
                         "checkpoint_dir=... (a directory)")
    _check_fault(options, steps, world)
    if options.get("checkpoint_dir") is not None:
        _check_resume(options["checkpoint_dir"], options.get("resume"), steps)


def _check_fault(options: dict, steps: int | None, world: int | None) -> None:
    """A planted failure that would never fire is refused: a step the run does not take (or, in a save, a
    step it does not save), a rank the world does not have, fail_rank or fail_in without fail_at_step."""
    at, where = options.get("fail_at_step"), options.get("fail_in", "step")
    if at is None:
        stray = [k for k in ("fail_rank", "fail_in") if k in options]
        if stray:
            raise ValueError(f"{' and '.join(stray)} only say{'s' if len(stray) == 1 else ''} how "
                             f"fail_at_step kills a rank: pass fail_at_step=s too, or drop them")
        return
    if world is not None and options.get("fail_rank", 0) >= world:
        raise ValueError(f"fail_rank={options['fail_rank']} is not a rank of world_size={world}: pass a rank "
                         f"from 0 to {world - 1}")
    if steps is None:
        return
    every = options.get("checkpoint_every")
    if where == "step" and at >= steps:
        raise ValueError(f"fail_at_step={at} is never reached: the steps are 0 .. {steps - 1} "
                         f"(steps={steps})")
    if where == "save" and (every is None or not (1 <= at <= steps and (at % every == 0 or at == steps))):
        saves = "none (pass checkpoint_every=k)" if every is None else \
            f"steps {sorted({*range(every, steps + 1, every), steps})}"
        raise ValueError(f"fail_at_step={at} with fail_in='save' kills a rank while it saves checkpoint "
                         f"{at}, which this run never saves: it saves {saves}")


def _check_resume(directory, resume, steps: int | None) -> None:
    """``resume=s``: checkpoint s must be in ``directory`` (refused here, naming the steps that are), and
    not beyond ``steps``."""
    if resume is None or isinstance(resume, (bool, str)):       # not a step: 1 == True, but 1 is a step
        return
    have = store.steps(directory)
    if resume not in have:
        held = f"holds checkpoints of steps {have}" if have else "holds no complete checkpoint"
        raise ValueError(f"resume={resume}: checkpoint_dir {str(directory)!r} has no checkpoint of step "
                         f"{resume}; it {held} (resume=True takes the newest that verifies)")
    if steps is not None and resume > steps:
        raise ValueError(f"resume={resume} is beyond steps={steps}: ask for at least {resume} steps")
