"""The rank side: what runs inside each rank started by `distlab.launch` (the parent side: `parent`).

Order matters here, each step for a reason found the hard way:

1. leave the parent's process group, so the notebook's stop button reaches the parent alone; become a
   subreaper and watch the lifeline, so that when the parent dies (or its launch ends) this rank ends
   with every process it started, under any start method (`lifeline`);
2. close every inherited descriptor that belongs to another rank, so each rank's output pipe
   reaches end-of-file exactly when that rank exits;
3. point file descriptors 1 and 2 (and Python's sys.stdout/sys.stderr, which in a Jupyter kernel
   are ZMQ streams that must not be used after fork) at this rank's pipe;
4. set the intra-op thread count *before any computation*: a forked child that inherits a
   parent's busy thread pool can hang in it;
5. rendezvous (rank 0 serves the TCPStore on the socket the parent bound before forking; gloo's
   own sockets stay on loopback when the rendezvous is), then a barrier, so no rank can exit while
   a peer is still connecting to it;
6. set torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT),
   run the user's function (its torch.distributed calls recorded by the flight recorder,
   `flight`), send back its result (or the traceback) and the trace, then a final
   barrier so that no rank tears its connections down while a peer still reads from them;
7. kill whatever the function started and left running (returned or raised alike), then exit.
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import cloudpickle

from . import lifeline


@dataclass
class RankSpec:
    """Everything a rank needs, shared by all ranks of one launch."""

    world_size: int
    backend: str
    host: str
    port: int
    rank0_listen_fd: int | None   # fork: rank 0 serves the store on this already-bound socket
    threads: int
    pg_timeout: float
    payload: object               # (fn, args, kwargs), or cloudpickle bytes of it under spawn
    local_world_size: int
    flight_dir: str | None = None  # where this rank's flight recorder keeps its last operations
    profile_dir: str | None = None  # torch.profiler records fn; this rank's trace goes here (`profiler`)


def _leave_parent(lifeline_end) -> None:
    """Step 1: Ctrl-C handled as usual (not by the handler the parent holds while starting ranks), a
    process group of our own (the notebook's stop button reaches the parent alone; the parent can kill
    the group, with whatever this rank starts), and an end tied to the parent's through ``lifeline_end``,
    with every process this rank starts (a subreaper keeps even daemons among them)."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass
    try:
        os.setpgrp()
    except OSError:
        pass
    lifeline.become_subreaper()
    lifeline.watch(lifeline_end)


def _pin_gloo_to_loopback(host: str) -> None:
    """Gloo listens on the address of the machine's *hostname* unless told an interface, so a hostname
    that maps to a LAN address would put every rank's sockets on the LAN. A loopback rendezvous keeps
    gloo on the loopback interface too (GLOO_SOCKET_IFNAME); a user's own setting wins."""
    import ipaddress
    import socket

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}     # IPv4 and IPv6 ("::1")
        loopback = bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
    except (OSError, ValueError):
        return
    names = [name for _, name in socket.if_nameindex()]
    if loopback and "lo" in names:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


INSIDE_A_LAUNCH = "DISTLAB_LAUNCH_RANK"
"""Set in every rank a launch starts: a launch from inside one says so instead of nesting."""


def _set_torchrun_environment(rank: int, local_rank: int, spec: RankSpec) -> None:
    """What torchrun (and accelerate's notebook launcher) give every process, so code written for
    torchrun (``int(os.environ["LOCAL_RANK"])``...) runs unchanged inside a launch."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(spec.world_size),
                      LOCAL_WORLD_SIZE=str(spec.local_world_size), MASTER_ADDR=spec.host,
                      MASTER_PORT=str(spec.port), **{INSIDE_A_LAUNCH: str(rank)})


def _redirect_output(fd: int) -> None:
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if fd not in (1, 2):
        os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="replace", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="replace", write_through=True)
    sys.stdin = open(os.devnull)


def _encode_result(rank: int, value: object) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception:
        pass
    try:
        return cloudpickle.dumps(value)
    except Exception as exc:
        raise TypeError(
            f"rank {rank} returned a {type(value).__name__} that cannot be pickled ({exc}); "
            "return plain data instead (numbers, strings, lists, dicts, tensors)") from None


def _run(fn, args, kwargs, profile_dir: str | None, rank: int, tracer):
    """``fn(*args, **kwargs)``, under torch.profiler when the launch asked for a profile."""
    if profile_dir is None:
        return fn(*args, **kwargs)
    from .profiler import RankProfiler
    with RankProfiler(profile_dir, rank, tracer):
        return fn(*args, **kwargs)


def main(rank: int, spec: RankSpec, out_conn, result_conn, lifeline_end, fds_to_close: list[int]) -> None:
    _leave_parent(lifeline_end)
    for fd in fds_to_close:
        try:
            os.close(fd)
        except OSError:
            pass
    _redirect_output(out_conn.fileno())
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)

    import torch
    import torch.distributed as dist

    from .. import runtime
    from ..progress import _attach as attach_progress
    from . import flight

    torch.set_num_threads(spec.threads)
    attach_progress(result_conn)
    tracer = None
    try:
        fn, args, kwargs = (cloudpickle.loads(spec.payload) if isinstance(spec.payload, bytes)
                            else spec.payload)
        local_rank = rank % spec.local_world_size
        if spec.backend == "nccl":
            torch.cuda.set_device(local_rank)
        timeout = timedelta(seconds=spec.pg_timeout)
        _pin_gloo_to_loopback(spec.host)
        if rank == 0 and spec.rank0_listen_fd is not None:
            store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=True,
                                  master_listen_fd=spec.rank0_listen_fd, wait_for_workers=False,
                                  timeout=timeout)
        else:
            store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size,
                                timeout=timeout)
        tracer = runtime._enter(rank, spec.world_size, local_rank, spec.backend)
        _set_torchrun_environment(rank, local_rank, spec)
        dist.barrier()
        tracer.reset_epoch()
        recorder = flight.start(flight.ring_path(spec.flight_dir, rank)) if spec.flight_dir else None
        value = _run(fn, args, kwargs, spec.profile_dir, rank, tracer)
        flight.stop(recorder)
        message = ("ok", _encode_result(rank, value), tracer.export())
    except BaseException:
        message = ("error", traceback.format_exc(), time.time(),
                   tracer.export() if tracer is not None else [])
    sys.stdout.flush()
    sys.stderr.flush()
    result_conn.send_bytes(pickle.dumps(message))
    if message[0] == "ok":
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    lifeline.end_descendants()
    os._exit(0 if message[0] == "ok" else 1)
