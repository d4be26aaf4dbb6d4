"""`dl.checkpoint`: sharded, atomic, resumable checkpoints.

    dl.checkpoint.save("ck", step, model=model, optimizer=opt)   # on every rank, any layout (DDP, ZeRO,
    dl.checkpoint.load("ck", model=model, optimizer=opt)         # fully_shard, tp, a pipeline stage, plain):
    full = dl.checkpoint.consolidate("ck")                       # loads into any layout at any world size;
    model.load_state_dict(full)                                  # the model's own state_dict(), one process
    dl.checkpoint.export("ck", "folder/model.safetensors")       # for from_pretrained (with its config.json)

    dl.checkpoint.save("ck", step, state, replicated=None, group=None, keep_last=None)  # your own dicts
    state = dl.checkpoint.load("ck", step="latest")     # this rank's state, weights_only=True, verified
    dl.checkpoint.latest("ck"); dl.checkpoint.steps("ck"); dl.checkpoint.manifest("ck", step)

    dl.train("zero2", world_size=4, steps=20, checkpoint_dir="ck", checkpoint_every=5, keep_last=2)
    dl.train("zero2", world_size=4, steps=20, checkpoint_dir="ck", resume=True)   # bit-exact continuation
    dl.train("zero1", world_size=3, steps=20, checkpoint_dir="ck", resume=True)   # resharded: 4 -> 3 ranks

Files: `store` (the on-disk format and the atomic commit), `api` (the functions above, for the three
kinds of checkpoint), `pieces` (a user's model: each rank's pieces of the logical tensors, as
`distlab.parallel.placement` describes them, written once and read back into any layout), `state` (what
a training rank hands over: its own and its replicated state in one of three formats, and how to
restore them), `directory` (the run's checkpoint directory: proved writable, locked by one run at a
time, its newest checkpoint that verifies), `reshard` (a training checkpoint rebuilt into one tensor per
name and cut again for another world size or layout), `background` (``async_save``: snapshot at the step
boundary, the same commit written in a thread). The checkpoint layer knows formats, files and
placements, never strategy names: each strategy builds its `state.RankState`, and the training loop's
checkpoint side (when to save, resume, planted failures) is `distlab.strategies.checkpointing`.
"""
from .api import consolidate, export, load, save
from .store import CheckpointError, latest, load_all, manifest, steps

__all__ = ["save", "load", "load_all", "latest", "steps", "manifest", "consolidate", "export",
           "CheckpointError"]
