"""Asynchronous checkpoints: snapshot at the step boundary, write in a background thread.

A synchronous save stalls training for the whole save (serialise, hash, write, fsync, commit). An
asynchronous one stalls it only for a copy of the state into CPU memory, then writes that copy while
the next steps run::

    main thread    | step k | snapshot | step k+1 | step k+2 | ... | wait? | snapshot | step ...
    writer thread             |-- torch.save, sha256, write, fsync, commit --|
                              ^ stall: the copy only              the next save waits for this one

The same `store.save` runs in the thread, so the commit is the same (every shard in ``step_N.tmp``,
rank 0's manifest, one rename): a crash during a background write leaves ``step_N.tmp`` and the
previous ``step_N`` untouched. Its collectives (who wrote what, the commit verdict) go over a gloo
process group of its own, so they never interleave with the training's collectives on the default
group (torch.distributed.checkpoint's ``async_save`` keeps a separate group for the same reason).

At most one save is in flight: the next save first waits for the previous one, and the end of
training waits for the last, so a run never returns before its final checkpoint is committed. The
cost is host memory for one extra copy of the state being saved.
(Nicolae et al., "DeepFreeze: towards scalable asynchronous checkpointing of deep learning models",
CCGrid 2020; Mohan et al., "CheckFreq", FAST 2021: snapshot, then persist in the background.)
"""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

from . import store


class BackgroundWriter:
    """Runs one save at a time in a thread; call `submit` and `wait` on every rank, in the same order."""

    def __init__(self):
        many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.pg = dist.new_group(backend="gloo") if many else None    # a collective: every rank, once
        self.write_s: list[float] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, save, *args, **kwargs) -> None:
        """Run ``save(*args, pg=..., **kwargs)`` (a `store.save`) in a thread, after the previous one."""
        self.wait()

        def write():
            t0 = time.perf_counter()
            try:
                save(*args, pg=self.pg, **kwargs)
            except BaseException as err:                 # re-raised on the main thread by wait()
                self._error = err
            self.write_s.append(time.perf_counter() - t0)

        self._thread = threading.Thread(target=write, name="distlab-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, store.CheckpointError):
                raise err
            raise store.CheckpointError(f"a background checkpoint save failed: {type(err).__name__}: {err}") \
                from err

    def close(self) -> None:
        """Wait for the save in flight, then give the writer's process group back (the end of training,
        on every rank): a barrier first, so that no peer is still inside the last save's collectives.
        If the save failed, `wait` raises and the group is left to the process's end."""
        self.wait()
        if self.pg is not None:
            dist.barrier(group=self.pg)
            dist.destroy_process_group(self.pg)
            self.pg = None
