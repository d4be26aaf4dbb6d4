"""The parent side of `launch(fn, world_size)`: check, start every rank, supervise, collect the `Run`.

    run = dl.launch(train_step, world_size=4)
    run.results[2]      # what train_step returned on rank 2
    run.outputs[2]      # what rank 2 printed
    run.trace           # every rank's compute spans, comm events and memory samples, one clock

How it works (`rank` for what happens inside a rank, `supervisor` for the parent's loop):

* **fork** by default on Linux (4 ranks start in well under 0.1 s); **spawn** or **forkserver**
  when asked, where fork is unsafe (macOS, Windows), or when CUDA is already initialised in this
  process. Under spawn the function travels by cloudpickle, so cells' functions work too.
* **Rendezvous** on loopback by default: the parent binds a socket to port 0 (the OS picks a free
  port, so simultaneous launches never collide) before forking, and rank 0 serves the TCPStore
  on that very socket. Under spawn the parent serves the store itself, on the same kind of socket.
* **Output**: each rank's file descriptors 1 and 2 go into a pipe; the parent prints complete
  lines tagged ``[rank N]``, live or grouped by rank at the end ("ordered", deterministic); of a
  progress bar drawn with carriage returns, the last frame; at most 2 MB per rank (a cell is no log).
* **Ctrl-C** is held back while ranks start or stop, so it never orphans one. No process outlives a
  launch: a rank kills what it started when its function returns or raises, and ends with all of it as
  soon as the parent dies or the launch ends (a pipe only the parent holds open: `lifeline`).
* **Threads**: ranks fork from a fresh thread, never one that ran torch's (uncopied) thread pool.
* **Errors**: any failing rank raises `LaunchError` naming the root cause, the earliest rank to
  fail of its own accord, not the peers that then lost their connection to it. A hang (the
  deadline) says what each rank was doing, from its flight recorder (`flight`).
* **Torchrun**: with RANK and WORLD_SIZE in the environment, `launch` runs ``fn`` right here on
  the existing (or env-initialised) group and all-gathers the results (`torchrun`), so code written
  for a notebook runs unchanged on a cluster.
"""
from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

# Ask NVML rather than the CUDA driver whether GPUs exist, so checking does not initialise CUDA
# in this process (which would make every later fork unusable for CUDA).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import cloudpickle
import multiprocessing as mp

from ..progress import ProgressBar, shown_by_default
from ..trace import Trace
from . import fake, flight, profiler, torchrun
from . import rank as rank_side
from .supervisor import (EXIT_SECONDS, LaunchError, RankStatus, Supervisor, interrupts_deferred,
                         raise_if_failed, shutdown)

BACKENDS = ("auto", "gloo", "nccl")         # and "fake", with ranks=... (`fake`): a dry run in this process
START_METHODS = ("auto", "fork", "spawn", "forkserver")
OUTPUT_MODES = ("live", "ordered", "quiet")


@dataclass
class Run:
    """What a launch gives back: per-rank results and output, and the merged trace."""

    results: list
    trace: Trace
    outputs: list[str]
    world_size: int
    backend: str
    start_method: str
    seconds: float = field(default=0.0, repr=False)

    def __repr__(self) -> str:
        return (f"Run(world_size={self.world_size}, backend={self.backend!r}, "
                f"start_method={self.start_method!r}, {len(self.trace)} trace events)")


# -- choosing how to launch ---------------------------------------------------------------------
def _cuda_count() -> int:
    import torch
    # device_count() asks NVML and leaves CUDA uninitialised; is_available() would call cuInit here, and a
    # child forked after that cannot use CUDA ("poison fork", torch docs: torch.cuda.is_available's note)
    return torch.cuda.device_count()


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto": NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    gpus = _cuda_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{gpus} GPU(s) visible. Use backend='gloo' (CPU) or fewer ranks.")
    return backend


def resolve_start_method(start_method: str) -> str:
    if start_method not in START_METHODS:
        raise ValueError(f"unknown start_method {start_method!r}: use one of {START_METHODS}")
    import torch
    cuda_live = torch.cuda.is_initialized()
    if start_method == "fork" and cuda_live:
        raise ValueError("CUDA is already initialised in this process, so forked ranks cannot use "
                         "it: pass start_method='spawn' (or restart the kernel and launch first).")
    if start_method != "auto":
        return start_method
    if sys.platform != "linux":
        return "spawn"
    if cuda_live:
        print("distlab: CUDA is already initialised in this process, so ranks start with "
              "'spawn' (a forked child cannot use CUDA).", file=sys.stderr)
        return "spawn"
    return "fork"


def threads_per_rank(world_size: int) -> int:
    """Cores divided by world size, at least 1: ranks must not fight over cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_inputs(fn, world_size, output, timeout, host, backend="auto") -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable (a function to run on every rank), got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if output not in OUTPUT_MODES:
        raise ValueError(f"unknown output mode {output!r}: use one of {OUTPUT_MODES}")
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or timeout <= 0):
        raise ValueError(f"timeout must be a positive, finite number of seconds (e.g. 300.0), "
                         f"got {timeout!r}")
    if not isinstance(host, str) or not host.strip():       # "" would listen on every interface
        raise ValueError(f"host={host!r}: pass the address the rendezvous listens on, e.g. '127.0.0.1' "
                         f"(this machine only)")
    if backend != "fake":                                   # a dry run starts no process
        _check_limits(world_size)


def _check_limits(world_size: int) -> None:
    """The parent holds about 6 descriptors per rank while starting them, and each rank is a process:
    say so before forking hundreds of ranks into a limit, not halfway through."""
    try:
        import resource
    except ImportError:
        return
    fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if fds != resource.RLIM_INFINITY and 6 * world_size + 64 > fds:
        raise ValueError(f"world_size={world_size} needs about {6 * world_size + 64} open files in this "
                         f"process, but its limit is {fds}: use fewer ranks, or raise the limit "
                         f"(`ulimit -n`, or resource.setrlimit(resource.RLIMIT_NOFILE, ...))")
    procs, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if procs != resource.RLIM_INFINITY and world_size > procs:
        raise ValueError(f"world_size={world_size} ranks exceed this user's process limit ({procs}): "
                         f"use fewer ranks, or raise `ulimit -u`")


def _spawn_payload(fn, args, kwargs) -> bytes:
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to spawned ranks: {exc}. "
            "Make the function refer only to picklable things (no open files, locks or sockets), "
            "or use start_method='fork' on Linux.") from exc


def _import_before_forking() -> None:
    """Import once, here, what nearly every rank imports on its first optimizer: ``torch.optim``
    loads ``torch._dynamo`` lazily (seconds of CPU), and a forked rank that loads it pays again, in
    every rank of every launch. Imported before the fork, every rank inherits it for free."""
    import torch._dynamo  # noqa: F401


# -- the launch ---------------------------------------------------------------------------------
def launch(fn: Callable, world_size: int = 2, args: tuple = (), kwargs: dict | None = None,
           backend: str = "auto", start_method: str = "auto", timeout: float = 300.0,
           output: str = "ordered", host: str = "127.0.0.1", progress: bool | None = None,
           ranks=None, profile=None) -> Run:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return a `Run`.

    ``timeout`` bounds the whole launch and every collective inside it (the process group's own
    timeout), so a hang ends in a `LaunchError` naming the ranks that never finished. ``host`` is
    where the rendezvous listens: loopback unless you give an address other machines can reach.
    ``progress``: a bar for what ranks report with ``dl.progress`` (None: if a person watches).
    ``backend="fake", ranks=(0, ...)``: a dry run, ``fn`` run here as each listed rank of a
    ``world_size``-rank job on a fake process group; ``run.results`` in the order of ``ranks`` (`fake`).
    ``profile``: a directory; every rank runs ``fn`` under torch.profiler with distlab's spans and comm
    events as its ranges, writes ``rank{r}.json`` there, and the launch merges them into ``trace.json``
    (`distlab.launch.profiler`; not in a dry run).
    """
    _check_inputs(fn, world_size, output, timeout, host, backend)
    listed = fake.check(world_size, ranks, backend)
    profile_dir = profiler.prepare(profile, dry_run=listed is not None)
    kwargs = dict(kwargs or {})
    if rank_side.INSIDE_A_LAUNCH in os.environ:
        raise RuntimeError(f"dl.launch was called inside rank {os.environ[rank_side.INSIDE_A_LAUNCH]} of "
                           "another launch (already inside a launch): launches do not nest. Call the "
                           "function here (this rank is one of the world), or launch it from the notebook.")
    if listed is not None:
        return Run(**fake.launch_fake(fn, world_size, listed, tuple(args), kwargs, output))
    if _under_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if world_size != launched:
            raise ValueError(f"running under torchrun with WORLD_SIZE={launched}, but world_size="
                             f"{world_size}: pass world_size={launched} (torchrun decides how many processes "
                             f"run), or change torchrun's --nproc-per-node / --nnodes")
        return Run(**torchrun.launch_here(fn, args, kwargs, backend, timeout, progress, profile_dir))
    run = _launch_ranks(fn, world_size, (tuple(args), kwargs), resolve_backend(backend, world_size),
                        resolve_start_method(start_method), timeout, output, host, progress, profile_dir)
    if profile_dir is not None:
        profiler.merge(profile_dir, world_size)
    return run


def _launch_ranks(fn: Callable, world_size: int, call: tuple, backend: str, method: str, timeout: float,
                  output: str, host: str, progress: bool | None, profile_dir: str | None) -> Run:
    """`launch`'s own ranks, once its inputs are checked: started, supervised, collected."""
    args, kwargs = call
    if method == "fork":
        _import_before_forking()
    started = time.perf_counter()
    deadline = time.monotonic() + timeout                 # starting the ranks counts too
    ranks: list[RankStatus] = []
    rendezvous = box = None
    try:
        with interrupts_deferred():                       # Ctrl-C lands once every rank is tracked
            box = flight.Box()                            # each rank's flight recorder writes in here
            rendezvous = _Rendezvous(method, host, world_size, timeout)
            spec = rank_side.RankSpec(
                world_size=world_size, backend=backend, host=host, port=rendezvous.port,
                rank0_listen_fd=rendezvous.fd_for_rank0, threads=threads_per_rank(world_size),
                pg_timeout=float(timeout), local_world_size=world_size, flight_dir=box.path,
                profile_dir=profile_dir,
                payload=(fn, args, kwargs) if method == "fork" else _spawn_payload(fn, args, kwargs))
            _in_a_fresh_thread(_start_ranks, mp.get_context(method), spec, rendezvous, ranks, deadline)
        with ProgressBar(shown_by_default() if progress is None else progress) as bar:
            supervisor = Supervisor(ranks, deadline, live=(output == "live"), on_progress=bar.update)
            supervisor.run()
    finally:
        _forget(ranks)
        shutdown(ranks)
        with interrupts_deferred():                       # a second Ctrl-C must not leave the folder
            if rendezvous is not None:
                rendezvous.close()
            records = box.collect(world_size) if box is not None else {}    # once every rank is gone
    return _collect(ranks, supervisor, output, timeout, records,
                    dict(world_size=world_size, backend=backend, start_method=method,
                         seconds=time.perf_counter() - started))


class _Rendezvous:
    """Where the ranks meet: a socket bound to (host, port 0) before any rank starts, so the OS picks
    a free port no other launch can take and nothing listens beyond ``host``.

    fork: rank 0 serves the TCPStore on the very socket it inherits (``master_listen_fd``); spawn and
    forkserver do not inherit it, so the parent serves the store on it here.
    """

    def __init__(self, method: str, host: str, world_size: int, timeout: float):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(max(128, world_size))
        self.port = self.listener.getsockname()[1]
        self.fd_for_rank0 = self.listener.fileno() if method == "fork" else None
        self.store = None
        if method != "fork":
            import torch.distributed as dist
            fd = self.listener.detach()            # the store owns the socket from here (and closes it)
            self.store = dist.TCPStore(host, self.port, world_size + 1, is_master=True,
                                       wait_for_workers=False, timeout=timedelta(seconds=timeout),
                                       master_listen_fd=fd)

    def started(self) -> None:
        """Every rank has its copy (fork) or the store holds it (spawn): the parent's can go."""
        if self.store is None:
            self.listener.close()

    def close(self) -> None:
        self.listener.close()
        self.store = None


def _in_a_fresh_thread(start, *args) -> None:
    """Call ``start(*args)`` in a new thread and wait for it. Why: a forked child is a copy of the thread
    that forked, *with its OpenMP pool* if it ever computed (a notebook with the default thread count),
    minus the pool's threads, which fork does not copy: its first parallel operation waits for them
    forever (GNU libgomp's gomp_team_barrier_wait), whatever thread count the child sets. A thread that
    never computed has no pool, so the child builds a fresh one. (spawn and forkserver start clean.)"""
    raised: list[BaseException] = []

    def body():
        try:
            start(*args)
        except BaseException as exc:          # handed to the caller
            raised.append(exc)

    thread = threading.Thread(target=body, name=f"{threading.current_thread().name}: distlab starts ranks")
    thread.start()
    thread.join()
    if raised:
        raise raised[0]


# Launches from several threads of one process: only one starts ranks at a time (a rank forked while
# another launch holds the write ends of its pipes would keep that launch's pipes open), and each
# forked rank closes the parent-side descriptors of every launch still running (their pipes' read
# ends, lifelines and process sentinels), so no rank holds another launch's pipes.
_STARTING = threading.Lock()
_LIVE_FDS: dict[int, int] = {}       # descriptor -> id() of the launch's list of RankStatus


def _start_ranks(ctx, spec: rank_side.RankSpec, rendezvous: _Rendezvous, ranks: list[RankStatus],
                 deadline: float) -> None:
    """Start every rank, each with its own output and result pipes (appended to ``ranks`` *before* it
    starts, so that whatever was forked is shut down if a later start fails), and all with the read end
    of one lifeline (`lifeline`), whose write end only this process keeps: in every RankStatus,
    for `shutdown` to close."""
    with _STARTING:
        lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
        _LIVE_FDS[lifeline_w.fileno()] = id(ranks)
        pipes = [(ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)) for _ in range(spec.world_size)]
        fork = rendezvous.fd_for_rank0 is not None
        all_fds = [c.fileno() for pair in pipes for p in pair for c in p] + [lifeline_w.fileno()]
        try:
            for rank, ((out_r, out_w), (res_r, res_w)) in enumerate(pipes):
                if time.monotonic() > deadline:
                    raise LaunchError(f"the deadline passed while starting the ranks ({rank} of "
                                      f"{spec.world_size} started): use fewer ranks or a larger timeout",
                                      unfinished=list(range(spec.world_size)))
                keep = {out_w.fileno(), res_w.fileno()}
                close_in_child = [fd for fd in all_fds + sorted(_LIVE_FDS) if fd not in keep] if fork else []
                if fork and rank != 0:
                    close_in_child.append(rendezvous.fd_for_rank0)
                proc = ctx.Process(target=rank_side.main, name=f"distlab-rank-{rank}",
                                   args=(rank, spec, out_w, res_w, lifeline_r, close_in_child))
                ranks.append(RankStatus(rank, proc, out_r, res_r, lifeline=lifeline_w))
                proc.start()
                _LIVE_FDS.update(dict.fromkeys((out_r.fileno(), res_r.fileno(), proc.sentinel), id(ranks)))
        finally:
            lifeline_r.close()
            if not ranks:
                del _LIVE_FDS[lifeline_w.fileno()]
                lifeline_w.close()
            for rank, ((out_r, out_w), (res_r, res_w)) in enumerate(pipes):
                out_w.close()                      # the parent keeps only the read ends of started ranks
                res_w.close()
                if rank >= len(ranks):
                    out_r.close()
                    res_r.close()
    rendezvous.started()


def _forget(ranks: list[RankStatus]) -> None:
    """This launch's descriptors are about to close: later ranks of other launches need not close them."""
    with _STARTING:
        # by owner: a pipe closed mid-launch no longer knows its number
        for fd in [fd for fd, owner in _LIVE_FDS.items() if owner == id(ranks)]:
            del _LIVE_FDS[fd]


def _collect(ranks: list[RankStatus], supervisor: Supervisor, output: str, timeout: float,
             records: dict, facts: dict) -> Run:
    """Print the output, raise for failures, and build the `Run`."""
    outputs = ["\n".join(r.lines) + ("\n" if r.lines else "") for r in ranks]
    if output == "ordered":
        _print_ordered(ranks)
    raise_if_failed(supervisor, timeout, outputs, records)
    if supervisor.stuck_at_exit:
        print(f"distlab: rank(s) {supervisor.stuck_at_exit} returned but did not exit within "
              f"{EXIT_SECONDS:g} s (an unmatched send or receive left behind?); they were stopped.",
              file=sys.stderr)
    return Run(results=[r.result[1] for r in ranks], trace=Trace.merge({r.rank: r.trace for r in ranks}),
               outputs=outputs, **facts)


def _print_ordered(ranks: list[RankStatus]) -> None:
    for r in ranks:
        for line in r.lines:
            print(f"[rank {r.rank}] {line}")
    sys.stdout.flush()
