"""`dl.checkpoint`: sharded, atomic, resumable checkpoints.

    dl.checkpoint.save("ck", step, state, replicated=None, group=None, keep_last=None)  # on every rank
    state = dl.checkpoint.load("ck", step="latest")     # this rank's state, weights_only=True, verified
    dl.checkpoint.latest("ck"); dl.checkpoint.steps("ck"); dl.checkpoint.manifest("ck", step)
    full = dl.checkpoint.consolidate("ck")          # any sharded checkpoint as one tensor per name

    dl.train("zero2", world_size=4, steps=20, checkpoint_dir="ck", checkpoint_every=5, keep_last=2)
    dl.train("zero2", world_size=4, steps=20, checkpoint_dir="ck", resume=True)   # bit-exact continuation
    dl.train("zero1", world_size=3, steps=20, checkpoint_dir="ck", resume=True)   # resharded: 4 -> 3 ranks

Files: `store` (the on-disk format and the atomic commit), `state` (what a training rank hands over:
its own and its replicated state in one of three formats, and how to restore them), `directory` (the
run's checkpoint directory: proved writable, locked by one run at a time, its newest checkpoint that
verifies), `reshard` (a checkpoint rebuilt into one tensor per name and cut again for another world size
or layout), `background` (``async_save``: snapshot at the step boundary, the same commit written in a
thread). The checkpoint layer knows formats and files, never strategy names: each strategy builds its
`state.RankState`, and the training loop's checkpoint side (when to save, resume, planted failures) is
`distlab.strategies.checkpointing`.
"""
from .reshard import consolidate
from .store import CheckpointError, latest, load, load_all, manifest, save, steps

__all__ = ["save", "load", "load_all", "latest", "steps", "manifest", "consolidate", "CheckpointError"]
