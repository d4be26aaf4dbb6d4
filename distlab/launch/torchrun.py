"""torchrun's path: with RANK and WORLD_SIZE in the environment, `launch` runs ``fn`` in this process.

    torchrun --nproc-per-node 4 train.py        # each of the 4 processes calls dl.launch(fn, 4)
      -> `launch_here`: join (or reuse) the job's process group, run fn here, all-gather every
         rank's result and trace, so each process gets the same `Run` a notebook would

Joining the job's process group so that ``torchrun --max-restarts`` works with gloo
(`init_process_group`):

torchrun's agent serves one TCPStore for the whole job: every restart of the workers finds it at the
same MASTER_ADDR:MASTER_PORT, with what the dead attempt wrote still in it. ``init_process_group``
with gloo publishes each rank's listening address under the same keys on every attempt (the
default group's prefix does not change), so a restarted rank can read the *dead* attempt's address
of a peer before that peer has published its new one::

    attempt 0:  rank 1 listens on :7581, writes "rank 1 is at :7581"          then dies
    attempt 1:  rank 0 reads  "rank 1 is at :7581"  (stale)  -> connect refused: the attempt fails,
                                                                or the port was reused: it hangs
                rank 1 writes "rank 1 is at :43747" (too late)

The cure is a store namespace per attempt: the same server, under the prefix
``attempt_{TORCHELASTIC_RESTART_COUNT}/``. A plain torch script can do the same::

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))

(seen on torch 2.13 with ``--standalone``, whose agent hosts the store; pytorch/pytorch#167288 reports
the same refused connections on restart with NCCL.)
"""
from __future__ import annotations

import atexit
import os
from datetime import timedelta

from ..progress import bar_here, shown_by_default
from ..trace import Trace
from . import profiler
from . import rank as rank_side


def init_process_group(backend: str, timeout: float) -> None:
    """``dist.init_process_group`` from torchrun's environment, on a store prefix of this attempt."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    hosting = not agent_hosts_it and rank == 0          # otherwise rank 0 serves it, as torch does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=hosting, timeout=timedelta(seconds=timeout), multi_tenant=hosting)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"distlab/attempt_{attempt}/", store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def _leave_process_group() -> None:
    """At exit, leave together and tear the group down: a process that exits with a live gloo group
    while a peer already closed its end can abort ("terminate called without an active exception")."""
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass


def launch_here(fn, args, kwargs, backend, timeout, progress=None, profile_dir=None) -> dict:
    """Already one of N processes (torchrun): run here, gather every rank's result to all. Returns the
    fields of the `Run` (`distlab.launch.parent`)."""
    import torch
    import torch.distributed as dist

    from .. import runtime

    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        local = int(os.environ.get("LOCAL_RANK", 0))
        if backend == "nccl":
            torch.cuda.set_device(local)
        init_process_group(backend, timeout)               # a store prefix per attempt: --max-restarts
        atexit.register(_leave_process_group)
    n, me = dist.get_world_size(), dist.get_rank()
    tracer = runtime._enter(me, n, int(os.environ.get("LOCAL_RANK", 0)), dist.get_backend())
    dist.barrier()
    tracer.reset_epoch()
    with bar_here(me == 0 and (shown_by_default() if progress is None else progress)):
        value = rank_side._run(fn, args, kwargs, profile_dir, me, tracer)
    gathered: list = [None] * n
    dist.all_gather_object(gathered, (value, tracer.export()))      # every rank's file is written by now
    if profile_dir is not None and me == 0:
        profiler.merge(profile_dir, n)
    return dict(results=[g[0] for g in gathered], trace=Trace.merge([g[1] for g in gathered]),
                outputs=[""] * n, world_size=n, backend=dist.get_backend(), start_method="torchrun")
