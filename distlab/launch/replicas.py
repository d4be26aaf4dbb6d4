"""The launcher side of elastic training: replicas that die are restarted alone, the others never stop.

    run = launch_replicas(fn, replicas=[0, 1, 2], restart=lambda replica, incarnation: True)
    run.results[2]     # what replica 2's last process returned
    run.pids[2]        # [pid of its first process, pid of the one that replaced it, ...]

`launch` (`parent`) treats a rank's death as the run's failure: every rank is stopped, and a restart starts
them all again. Here a replica's death is an event of the run, not its end::

    parent          store keeper        replica 0     replica 1     replica 2
    ------          ------------        ---------     ---------     ---------
    fork keeper --> serves the store    (every replica reaches it; none of them holds it, so any can die)
    fork replicas ------------------->  fn(ctx)       fn(ctx)       fn(ctx)
                                          ...           ...           X  killed (no result, no word)
    sees its exit; restart(2, 0)? ------------------------------------>  fn(ctx), incarnation 1
                                          ...           ...           ...   (the others' pids unchanged)
    every process returned (or left for good): results, pids, deaths

The pieces are `launch`'s own: each process leaves the parent's process group, watches the lifeline and
is a subreaper (`lifeline`: no process outlives the launch), writes its output and its result into pipes
read by the parent's one loop (`supervisor`), and is forked from a fresh thread (`parent`). What differs:
the store lives in a process of its own (rank 0 can die here), there is no default process group (the
replicas form their own groups on the store, `distlab.parallel.elastic`), and a process that dies without
a word is handed to ``restart`` instead of failing the run. A replica that *raises* still fails the run
(`LaunchError`): a bug is not a fault to ride out.

``ranks_per_replica=k``: a replica is k processes (``ctx.rank`` 0..k-1, e.g. fully_shard over them, the
elastic HSDP of `distlab.parallel.elastic.hsdp`). It lives and dies as one: when one of its processes dies,
the parent kills the others of that generation (their group with the dead one is broken), and each is
restarted into the same next incarnation.
"""
from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import multiprocessing as mp

from . import lifeline
from . import parent as parent_side
from . import rank as rank_side
from .supervisor import LaunchError, RankStatus, Supervisor, interrupts_deferred, shutdown


@dataclass
class ReplicaContext:
    """What ``fn`` receives as its first argument: who it is and where the others are."""

    replica: int          # the replica's id (stable across its restarts)
    incarnation: int      # 0 for its first process, 1 after one restart, ...
    store: object         # a TCPStore client on the keeper's store
    timeout: float        # the launch's timeout in seconds (for the groups built on the store)
    rank: int = 0         # this process's rank inside its replica (0..ranks_per_replica-1)
    ranks: int = 1        # ranks_per_replica: the replica's processes, started and restarted together


@dataclass
class ReplicaRun:
    """What `launch_replicas` gives back (by replica id)."""

    results: dict                                   # replica -> what its last finished process returned
    pids: dict                                      # replica -> [pid of each of its processes, in order]
    deaths: dict                                    # replica -> [(pid, time.time() the parent saw it die)]
    outputs: dict                                   # replica -> its processes' output, one after the other
    seconds: float = field(default=0.0, repr=False)


@dataclass
class _Spec:
    fn: Callable
    args: tuple
    host: str
    port: int
    timeout: float
    threads: int
    ranks: int = 1                                  # processes per replica


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _keep_store(spec: _Spec, listen_fd: int, lifeline_end, fds_to_close: list[int]) -> None:
    """The store keeper: serve the TCPStore on the socket the parent bound, until the launch ends."""
    rank_side._leave_parent(lifeline_end)                 # ends with the launch, like every rank
    _close(fds_to_close)
    devnull = os.open(os.devnull, os.O_WRONLY)
    rank_side._redirect_output(devnull)
    import torch.distributed as dist
    store = dist.TCPStore(spec.host, spec.port, is_master=True, master_listen_fd=listen_fd,
                          wait_for_workers=False, timeout=timedelta(seconds=spec.timeout))
    threading.Event().wait()                              # the lifeline's watcher ends this process
    del store


def _replica_main(spec: _Spec, key: int, incarnation: int, out_conn, result_conn, lifeline_end,
                  fds_to_close: list[int]) -> None:
    """One replica's process: `rank.main`'s order (leave the parent, close the others' descriptors, own
    output, threads, loopback), then ``fn(ReplicaContext, *args)`` on a store client (``key``: replica *
    ranks_per_replica + rank)."""
    replica, rank = divmod(key, spec.ranks)
    rank_side._leave_parent(lifeline_end)
    _close(fds_to_close)
    rank_side._redirect_output(out_conn.fileno())
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    os.environ[rank_side.INSIDE_A_LAUNCH] = str(replica)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(spec.threads)
    rank_side._pin_gloo_to_loopback(spec.host)
    try:
        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.timeout))
        ctx = ReplicaContext(replica, incarnation, store, spec.timeout, rank, spec.ranks)
        value = spec.fn(ctx, *spec.args)
        message = ("ok", rank_side._encode_result(key, value), [])
    except BaseException:
        message = ("error", traceback.format_exc(), time.time(), [])
    sys.stdout.flush()
    sys.stderr.flush()
    result_conn.send_bytes(pickle.dumps(message))
    lifeline.end_descendants()
    os._exit(0 if message[0] == "ok" else 1)


class _Replicas(Supervisor):
    """`Supervisor`'s loop; a process that exits without a result (killed) is a departure, not a failure:
    ``restart(replica, incarnation)`` says whether to start it again."""

    def __init__(self, launcher: "_Launcher", deadline: float):
        super().__init__(launcher.ranks, deadline, live=False)
        self.launcher = launcher

    def _on_exit(self, r: RankStatus) -> None:
        r.process.join(1.0)
        r.exited_at = time.monotonic()
        while r.result is None and r.failure is None and not r.result_conn.closed and r.result_conn.poll(0):
            self._read_result(r)
        if r.result is None and r.failure is None:       # died without a word: the others go on
            self.launcher.departed(r)


class _Launcher:
    """The processes of one `launch_replicas`: the keeper, every incarnation of every replica."""

    def __init__(self, spec: _Spec, restart, listener: socket.socket):
        self.spec, self.restart, self.listener = spec, restart, listener
        self.ctx = mp.get_context("fork")
        self.lifeline_r, self.lifeline_w = self.ctx.Pipe(duplex=False)
        self.ranks: list[RankStatus] = []                # every replica process, in the order started
        self.incarnations: dict[int, int] = {}           # by process key (replica * k + rank)
        self.pids: dict[int, list] = {}
        self.deaths: dict[int, list] = {}
        self.keeper = None

    def _parent_fds(self) -> list[int]:
        """What a new child must close: the lifeline's write end, the others' pipes, other launches'."""
        mine = [self.lifeline_w.fileno()]
        for r in self.ranks:
            mine += [c.fileno() for c in (r.out_conn, r.result_conn) if not c.closed]
        return mine + sorted(parent_side._LIVE_FDS)

    def start_keeper(self) -> None:
        with parent_side._STARTING:
            self.keeper = self.ctx.Process(target=_keep_store, name="distlab-store", daemon=False,
                                           args=(self.spec, self.listener.fileno(), self.lifeline_r,
                                                 self._parent_fds()))
            self.keeper.start()
        self.listener.close()                            # the keeper serves on it now

    def start(self, key: int) -> None:
        """Start the next incarnation of process ``key`` (replica * ranks_per_replica + rank)."""
        incarnation = self.incarnations.get(key, -1) + 1
        with parent_side._STARTING:
            (out_r, out_w), (res_r, res_w) = self.ctx.Pipe(duplex=False), self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_replica_main, name=f"distlab-replica-{key}",
                                    args=(self.spec, key, incarnation, out_w, res_w, self.lifeline_r,
                                          self._parent_fds() + [out_r.fileno(), res_r.fileno()]))
            self.ranks.append(RankStatus(key, proc, out_r, res_r, lifeline=self.lifeline_w))
            self.ranks[-1].incarnation = incarnation
            try:
                proc.start()
            finally:
                out_w.close()
                res_w.close()
        self.incarnations[key] = incarnation
        self.pids.setdefault(key // self.spec.ranks, []).append(proc.pid)

    def departed(self, r: RankStatus) -> None:
        """A replica's process died: note when, end the replica's other processes (a replica dies as a
        whole: its inner group is broken), and start it again if ``restart`` says so."""
        replica = r.rank // self.spec.ranks
        self.deaths.setdefault(replica, []).append((r.process.pid, time.time()))
        for sibling in self.ranks:
            if (sibling.rank // self.spec.ranks == replica and sibling.incarnation == r.incarnation
                    and sibling is not r and sibling.result is None and sibling.process.is_alive()):
                sibling.process.kill()                   # its exit comes back here, restarted likewise
        if self.restart is not None and self.restart(replica, self.incarnations[r.rank]):
            with interrupts_deferred():
                parent_side._in_a_fresh_thread(self.start, r.rank)

    def stop(self) -> None:
        """`shutdown` for the replicas (the lifeline closes: every process ends its tree and itself), then
        the keeper, which the lifeline ends too."""
        shutdown(self.ranks)
        with interrupts_deferred():
            if not self.lifeline_w.closed:
                self.lifeline_w.close()
            self.lifeline_r.close()
            if self.keeper is not None and self.keeper._popen is not None:
                self.keeper.join(2.0)
                if self.keeper.is_alive():
                    self.keeper.kill()
                self.keeper.join()


def launch_replicas(fn: Callable, replicas, args: tuple = (),
                    restart: Callable[[int, int], bool] | None = None, timeout: float = 300.0,
                    host: str = "127.0.0.1", ranks_per_replica: int = 1) -> ReplicaRun:
    """Run ``fn(ReplicaContext, *args)`` once per replica id in ``replicas`` (fork, loopback); a process
    that dies without returning is restarted when ``restart(replica, incarnation)`` is true, with the next
    incarnation. Returns when every process has returned or died for good; a replica that raises, or the
    deadline, raises `LaunchError` (every process ended first). ``ranks_per_replica`` = k: each replica is
    k processes (``ctx.rank`` 0..k-1); one of them dying ends the others, and each is restarted (the same
    incarnation for all k). ``results``, ``outputs`` and failures are then keyed by replica * k + rank;
    ``pids`` and ``deaths`` by replica, k per incarnation."""
    replicas = list(replicas)
    if sys.platform != "linux":
        raise RuntimeError("launch_replicas forks its replicas: Linux only")
    parent_side._import_before_forking()
    started, deadline = time.perf_counter(), time.monotonic() + timeout
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    k = ranks_per_replica
    spec = _Spec(fn, tuple(args), host, listener.getsockname()[1], float(timeout),
                 parent_side.threads_per_rank(len(replicas) * k), k)
    launcher = _Launcher(spec, restart, listener)
    try:
        with interrupts_deferred():
            parent_side._in_a_fresh_thread(launcher.start_keeper)
            for replica in replicas:
                for rank in range(k):
                    parent_side._in_a_fresh_thread(launcher.start, replica * k + rank)
        supervisor = _Replicas(launcher, deadline)
        supervisor.run()
    finally:
        launcher.stop()
    return _collect(launcher, supervisor, timeout, time.perf_counter() - started)


def _collect(launcher: _Launcher, supervisor: _Replicas, timeout: float, seconds: float) -> ReplicaRun:
    """The `ReplicaRun`; a `LaunchError` for the first replica that raised, or for the deadline."""
    ranks, outputs = launcher.ranks, {}
    for r in ranks:
        outputs[r.rank] = outputs.get(r.rank, "") + "".join(line + "\n" for line in r.lines)
    failed = sorted((r for r in ranks if r.failure is not None), key=lambda r: (not r.primary, r.failed_at))
    facts = dict(failures={r.rank: r.failure for r in failed}, outputs=list(outputs.values()))
    if failed:
        first = failed[0]
        raise LaunchError(f"replica {first.rank // launcher.spec.ranks} failed:\n\n{first.failure.rstrip()}",
                          rank=first.rank, **facts)
    unfinished = sorted({r.rank for r in ranks if r.result is None and r.exited_at is None})
    if supervisor.timed_out or unfinished:
        raise LaunchError(f"deadline of {timeout:g} s passed: replica(s) {unfinished} never finished (a "
                          "quorum waiting for a replica that never came?)", unfinished=unfinished, **facts)
    results = {r.rank: r.result[1] for r in ranks if r.result is not None}
    return ReplicaRun(results, launcher.pids, launcher.deaths, outputs, seconds)
