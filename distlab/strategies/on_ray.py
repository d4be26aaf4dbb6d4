"""``dl.train(..., engine="ray")``: the strategies of `dl.train` on Ray Train workers (`distlab.launch.ray`).

    report = dl.train("zero2", world_size=4, steps=40, checkpoint_dir="/shared/ck", checkpoint_every=5,
                      max_restarts=2, engine="ray")         # FailureConfig(max_failures=2)
    report.losses; report.results[0].info["ray"]            # {"attempt": 1, "reported": 10}

The same ``train_rank(spec)`` as under `dl.launch`, wrapped for restarts by Ray::

    attempt 0:  step 0 ... save 10 (report to Ray) ... step 13 X       X: a worker dies; Ray ends the group
    attempt 1:  Ray's newest checkpoint: step_10 -> resume=True -> step 10 ... step 40

A restart drops the planted faults (``fail_at_step``: first attempt only, as `restart` does) and resumes
from the newest checkpoint, bit for bit; where ``checkpoint_dir`` lost Ray's newest (a new node, a lost
disk) Ray's copy is put back first (`distlab.launch.ray.restore_checkpoint`).
Ray keeps its copies of the checkpoints under ``checkpoint_dir/.ray`` (``keep_last``: how many).
"""
from __future__ import annotations

from pathlib import Path

from .restart import FAULTS


def check(spec) -> None:
    """What Ray Train's path cannot do, refused before Ray starts; and Ray itself installed."""
    from ..launch import ray as ray_train
    if spec.strategy == "single":
        raise ValueError("engine='ray' starts workers: use a launched strategy (ddp, zero1, ...), not "
                         "'single'")
    if spec.restart.shrink not in (False, None):
        raise ValueError("engine='ray' restarts the group on the same number of workers: drop shrink= "
                         "(engine='local' shrinks), or see distlab.parallel's elastic replicas")
    if spec.checkpoint.async_save:
        raise ValueError("engine='ray' reports each checkpoint to Ray when it is committed: pass "
                         "async_save=False")
    ray_train._ray()                                          # ImportError: pip install 'distlab[ray]'


def launch(train_rank, spec, world_size: int, timeout: float):
    """Train ``spec`` on ``world_size`` Ray Train workers (Ray restarts the group up to ``max_restarts``
    times); the `Run`, whose results `runner.report` reads as a launch's."""
    from ..launch import ray as ray_train
    directory = spec.checkpoint.checkpoint_dir
    storage = Path(directory).resolve() / ".ray" if directory is not None else None
    return ray_train.launch(_rank, world_size, args=(train_rank, spec), storage_path=storage,
                            max_failures=spec.restart.max_restarts, keep=spec.checkpoint.keep_last,
                            timeout=timeout)


def _rank(train_rank, spec):
    """One worker. After a restart: without planted faults, and from the newest checkpoint that verifies
    (``resume=True``), with Ray's newest copied back into ``checkpoint_dir`` first if that lost it. Not
    from Ray's alone: Ray registers a report when its controller next polls the workers (every 2 s), so a
    worker that dies right after reporting can leave Ray one checkpoint behind distlab's directory."""
    from ..launch import ray as ray_train
    attempt, reported = ray_train.attempt(), None
    if attempt:
        spec = spec.replace(**dict.fromkeys(FAULTS))
        if spec.checkpoint.checkpoint_dir is not None:
            reported = ray_train.restore_checkpoint(spec.checkpoint.checkpoint_dir)
            spec = spec.replace(resume=True)
    result = train_rank(spec)
    result.info["ray"] = {"attempt": attempt, "reported": reported}
    return result
