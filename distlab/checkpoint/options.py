"""The checkpoint options of `dl.train`: one typed concern of the spec, `Checkpointing`, each field with
its rule and docstring, and what the fields must say together.

Checked once, in the parent, before any rank starts (`directory.check_options`, which then proves the
directory writable): a value of the wrong type or range (each field's rule, see `distlab.rules`),
checkpoint options without a ``checkpoint_dir``, a planted failure that would never fire, ``resume=s``
for a step that the directory does not hold. The field names are `dl.train`'s keywords.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..rules import Directory, Either, Flag, OneOf, Whole, check_fields, option
from . import store


@dataclass(frozen=True)
class Checkpointing:
    """Saving, resuming and the planted failures that test them (the training loop reads them:
    `distlab.strategies.checkpointing`, `distlab.strategies.faults`)."""

    checkpoint_dir: object = option(None, Directory(example="ck", none="no checkpoints"),
                                    "where the step_<k> folders go (created, and proved writable, before any "
                                    "rank starts)")
    checkpoint_every: int | None = option(None, Whole(1, example=5, none="no saves"),
                                          "save after every k-th step and after the last")
    keep_last: int | None = option(None, Whole(1, example=3, none="keep every checkpoint"),
                                   "keep only the newest n checkpoints")
    resume: object = option(False, Either(OneOf(True, False, None, "latest"), Whole(1), example=True,
                                          description="True (or 'latest': the newest checkpoint that "
                                                      "verifies), a step number, or False"),
                            "continue from a checkpoint: True the newest that verifies, s that of step s")
    async_save: bool = option(False, Flag(), "write checkpoints in a background thread (the step pays only "
                                             "for a copy to CPU memory)")
    heartbeat: bool = option(False, Flag(), "rank 0 records its last finished step (set by dl.train's "
                                            "restarts, to count the steps a failure lost)")
    fail_at_step: int | None = option(None, Whole(0, example=3, none="no planted failure"),
                                      "fault injection: SIGKILL a rank at step s (first attempt only)")
    fail_rank: int | None = option(None, Whole(0, example=0, none="the last rank"),
                                   "the rank fail_at_step kills")
    fail_in: str | None = option(None, OneOf("step", "save", none="'step'"),
                                 "kill it at the start of the step, or in the middle of saving checkpoint s")

    def __post_init__(self):
        check_fields(self)

    @property
    def requested(self) -> bool:
        """Whether any field asks for checkpointing or fault injection."""
        return any(getattr(self, f.name) not in (None, False) for f in fields(self))


OPTIONS = tuple(f.name for f in fields(Checkpointing))


def check_values(ck: Checkpointing, in_process: str | None = None, *, steps: int | None = None,
                 world: int | None = None) -> None:
    """What the fields say together, against ``steps`` and the ``world`` size when given (``in_process``:
    the name of a strategy that trains in this process, where a fault injection cannot kill a rank);
    each value was checked by its rule when ``ck`` was made."""
    if in_process and ck.fail_at_step is not None:
        raise ValueError(f"fail_at_step kills a rank process: use a launched strategy (ddp, zero1, ...), "
                         f"not {in_process!r}, which runs in this process")
    if ck.checkpoint_dir is None and any((ck.checkpoint_every, ck.keep_last, ck.resume, ck.async_save,
                                          ck.heartbeat)):
        raise ValueError("checkpoint_every, keep_last, resume, async_save and heartbeat need "
                         "checkpoint_dir=... (a directory)")
    _check_fault(ck, steps, world)
    if ck.checkpoint_dir is not None:
        _check_resume(ck.checkpoint_dir, ck.resume, steps)


def _check_fault(ck: Checkpointing, steps: int | None, world: int | None) -> None:
    """A planted failure that would never fire is refused: a step the run does not take (or, in a save, a
    step it does not save), a rank the world does not have, fail_rank or fail_in without fail_at_step."""
    at, where = ck.fail_at_step, ck.fail_in or "step"
    if at is None:
        stray = [k for k in ("fail_rank", "fail_in") if getattr(ck, k) is not None]
        if stray:
            raise ValueError(f"{' and '.join(stray)} only say{'s' if len(stray) == 1 else ''} how "
                             f"fail_at_step kills a rank: pass fail_at_step=s too, or drop them")
        return
    if world is not None and (ck.fail_rank or 0) >= world:
        raise ValueError(f"fail_rank={ck.fail_rank} is not a rank of world_size={world}: pass a rank "
                         f"from 0 to {world - 1}")
    if steps is None:
        return
    every = ck.checkpoint_every
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
