"""Joining a torchrun job's process group so that ``torchrun --max-restarts`` works with gloo.

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

import os
from datetime import timedelta


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
