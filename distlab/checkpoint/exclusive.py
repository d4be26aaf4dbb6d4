"""One training run at a time per checkpoint directory, in any process and in any thread.

Two runs saving into one directory interleave their checkpoints (step_2 of one seed, step_4 of the
other) and delete each other's saves. So rank 0 of a run holds an exclusive ``flock`` on the directory
itself for the whole run (no lock file to leave behind; the kernel drops it when the process ends,
however it ends)::

    run A (process 1, or thread 1)    open(dir), flock(EX)  ......... training, saving .........  close
    run B (process 2, or thread 2)            open(dir), flock(EX | NB) -> refused: "another training
                                                                           run is writing checkpoints"

A flock belongs to one *open* of the file, so the kernel refuses a second open of the directory in the
same process too. What this module adds is the other half: knowing when a lock this process holds
belongs to a run that is over. A run gives its lock back however it ends (the training loop's checkpoint
side is a context manager); a lock whose holder is finished without giving it back (a thread that is
gone, or this very thread, which cannot still be inside the run that took it) is taken over by the next
run. A live holder in another thread is never touched: the new run is refused.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .files import CheckpointError

BUSY = "another training run is writing checkpoints to"


@dataclass(eq=False)
class DirectoryLock:
    """The lock of one run on its checkpoint directory: an open descriptor holding ``flock``, and the
    thread of the run that took it. The class keeps the table of the locks this process holds (one per
    directory; the kernel's flocks are per process too), guarded for runs starting in any thread."""

    key: str                         # the directory, resolved
    fd: int                          # -1 once given back
    thread: threading.Thread

    held: ClassVar[dict[str, DirectoryLock]] = {}      # directory (resolved) -> the lock a run holds on it
    guard: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def take(cls, path: Path) -> DirectoryLock:
        """An exclusive lock on the directory ``path`` for one training run; raises `CheckpointError` if
        another live run holds it, in another process or in another thread of this one."""
        key = str(path.resolve())
        with cls.guard:
            earlier = cls.held.get(key)
            if earlier is not None and earlier.is_over():    # taken over: its run cannot still be saving
                os.close(earlier.fd)
                earlier.fd = -1
                del cls.held[key]
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise CheckpointError(f"{BUSY} {path}: wait for it to finish, or use another checkpoint_dir "
                                      f"(under torchrun, 'single' runs on every process: use a launched "
                                      f"strategy)") from None
            cls.held[key] = lock = cls(key, fd, threading.current_thread())
        return lock

    def release(self) -> None:
        """Give the directory back (closing the descriptor drops the flock); a second call does nothing."""
        with self.guard:
            if self.held.get(self.key) is self:
                del self.held[self.key]
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def is_over(self) -> bool:
        """Whether the run holding this lock is finished: its thread is gone, or it is the calling thread
        (which is starting a new run, so the one that took the lock ended without giving it back)."""
        return not self.thread.is_alive() or self.thread is threading.current_thread()

    @classmethod
    def forget_after_fork(cls) -> None:
        """In a forked child (a rank of a launched run): the parent's locks belong to the parent's runs.
        Close the child's copies of their descriptors, or a parent's run that ends would leave its
        directory locked for as long as this child lives."""
        cls.guard = threading.Lock()         # the parent may have held it at the fork
        for lock in cls.held.values():
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = -1
        cls.held.clear()


def take(path: Path) -> DirectoryLock:
    """`DirectoryLock.take`: an exclusive lock on the directory ``path`` for one training run."""
    return DirectoryLock.take(path)


os.register_at_fork(after_in_child=DirectoryLock.forget_after_fork)
