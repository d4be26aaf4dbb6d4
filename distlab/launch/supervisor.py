"""The parent's side of a launch: relay output, collect results, find the root cause, clean up.

One loop in the calling thread waits on every rank's output pipe, result pipe and process
sentinel at once (no helper threads: a Jupyter kernel has enough of those). It ends when every
rank has exited, when the first failure's grace window closes, or when the deadline passes; in
every case `shutdown` ends whatever is left: it closes the lifeline, on which each rank kills every
process it started and then itself (`lifeline`), then terminates, kills and reaps what still
runs, each rank with its process group, with Ctrl-C held back until it is done (`interrupts_deferred`).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import sys
import threading
import time
from multiprocessing.connection import wait

from . import flight as flight_recorder

#: Errors a rank raises because *another* rank died first: never blamed as the root cause.
_SECONDARY = re.compile(
    r"Connection (closed|reset) by peer|ECONNRESET|Broken pipe|EPIPE|Connection refused|"
    r"DistNetworkError|Socket Timeout|Timed out|timed out|Read error|Connection closed|"
    r"NCCL communicator was aborted|ProcessGroupGloo.*(closed|failed)", re.S)

GRACE_SECONDS = 1.0      # after the first failure, how long to gather the others' reports
EXIT_SECONDS = 5.0       # after every rank has returned, how long they may take to exit
OUTPUT_LIMIT = 2_000_000  # characters of output kept (and shown) per rank: a notebook cell is no log file
LINE_LIMIT = 100_000      # a line without end is cut here


def _shown(line: bytes) -> str:
    """What a terminal shows of ``line``: after carriage returns (a progress bar), the last frame."""
    if b"\r" in line:
        frames = [f for f in line.split(b"\r") if f]
        line = frames[-1] if frames else b""
    return line.decode("utf-8", "replace")


class LaunchError(RuntimeError):
    """One or more ranks failed, or the deadline passed.

    ``.rank``: the root-cause rank (None when the deadline passed with nobody failing);
    ``.failures``: {rank: traceback text} for every rank that failed; ``.unfinished``: ranks that
    never finished; ``.outputs``: what each rank printed; ``.flight``: {rank: its last operations}
    from the flight recorder (`flight`), oldest first, which a hang's message reads out.
    """

    def __init__(self, message: str, rank: int | None = None, failures: dict | None = None,
                 unfinished: list | None = None, outputs: list | None = None, flight: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.failures = failures or {}
        self.unfinished = unfinished or []
        self.outputs = outputs or []
        self.flight = flight or {}


class RankStatus:
    """What the parent knows about one rank."""

    def __init__(self, rank: int, process, out_conn, result_conn, lifeline=None):
        self.rank = rank
        self.process = process
        self.out_conn = out_conn          # read end of stdout+stderr
        self.result_conn = result_conn    # read end of the result message
        self.lifeline = lifeline          # write end of the launch's lifeline (shared by its ranks)
        self.lines: list[str] = []
        self.partial = bytearray()       # the line being received
        self.kept = 0                     # characters of output kept so far (at most OUTPUT_LIMIT)
        self.dropped = 0                  # bytes of output beyond it
        self.out_open = True
        self.exited_at: float | None = None
        self.result = None                # ("ok", value) once returned
        self.failure: str | None = None
        self.failed_at: float | None = None
        self.primary = False
        self.trace: list = []

    @property
    def done(self) -> bool:
        return self.exited_at is not None and not self.out_open


class Supervisor:
    def __init__(self, ranks: list[RankStatus], deadline: float, live: bool, stream=None,
                 on_progress=None):
        self.ranks = ranks
        self.on_progress = on_progress
        self.deadline = deadline
        self.live = live
        self.stream = stream or sys.stdout
        self.first_failure_at: float | None = None
        self.all_returned_at: float | None = None
        self.timed_out = False
        self.stuck_at_exit: list[int] = []

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        while not all(r.done for r in self.ranks):
            now = time.monotonic()
            if self.first_failure_at is not None and now > self.first_failure_at + GRACE_SECONDS:
                return
            if now > self.deadline:
                self.timed_out = True
                return
            if self._returned_but_stuck(now):
                return
            waitables = {}
            for r in self.ranks:
                if r.out_open:
                    waitables[r.out_conn] = (r, "out")
                if r.result is None and r.failure is None and not r.result_conn.closed:
                    waitables[r.result_conn] = (r, "result")
                if r.exited_at is None:
                    waitables[r.process.sentinel] = (r, "exit")
            timeout = min(self.deadline - now, 0.25)
            for ready in wait(list(waitables), timeout=max(timeout, 0.0)):
                rank, what = waitables[ready]
                if what == "out":
                    self._read_output(rank)
                elif what == "result":
                    self._read_result(rank)
                else:
                    self._on_exit(rank)
            self._give_up_on_stuck_pipes()

    def _returned_but_stuck(self, now: float) -> bool:
        """Every rank returned its result but some never exit (say, a send nobody received)."""
        if self.all_returned_at is None:
            if all(r.result is not None for r in self.ranks):
                self.all_returned_at = now
            return False
        if now > self.all_returned_at + EXIT_SECONDS:
            self.stuck_at_exit = [r.rank for r in self.ranks if r.exited_at is None]
            return True
        return False

    def _read_output(self, r: RankStatus) -> None:
        try:
            chunk = os.read(r.out_conn.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            r.out_open = False
            if r.partial:
                self._emit(r, _shown(bytes(r.partial)))
                r.partial = bytearray()
            if r.dropped:
                self._emit(r, f"[distlab: {r.dropped} more bytes of output not shown (the limit is "
                              f"{OUTPUT_LIMIT} per rank): write long output to a file]", force=True)
            return
        self._take(r, chunk)

    def _take(self, r: RankStatus, chunk: bytes) -> None:
        """Add ``chunk`` to rank ``r``'s output in time linear in its size: only the new bytes are searched,
        a carriage return keeps only the newest frame of a progress bar (what a terminal would show), and
        a line without end is cut at LINE_LIMIT."""
        r.partial += chunk
        if b"\n" in chunk:
            *complete, rest = bytes(r.partial).split(b"\n")
            r.partial = bytearray(rest)
            for line in complete:
                self._emit(r, _shown(line))
        elif b"\r" in chunk:
            frames = [f for f in bytes(r.partial).split(b"\r") if f]
            r.partial = bytearray(frames[-1] + b"\r" if frames else b"")
        if len(r.partial) > LINE_LIMIT:
            self._emit(r, _shown(bytes(r.partial)))
            r.partial = bytearray()

    def _emit(self, r: RankStatus, line: str, force: bool = False) -> None:
        if not force and r.kept + len(line) > OUTPUT_LIMIT:
            r.dropped += len(line) + 1
            return
        r.kept += len(line) + 1
        r.lines.append(line)
        if self.live:
            print(f"[rank {r.rank}] {line}", file=self.stream, flush=True)

    def _read_result(self, r: RankStatus) -> None:
        try:
            message = pickle.loads(r.result_conn.recv_bytes())
        except (EOFError, OSError):
            r.result_conn.close()
            return
        if message[0] == "progress":
            if self.on_progress is not None:
                self.on_progress(*message[1:])
        elif message[0] == "ok":
            _, payload, r.trace = message
            try:
                r.result = ("ok", pickle.loads(payload))
            except Exception as exc:   # e.g. a class the parent cannot import
                self._fail(r, f"rank {r.rank}'s return value could not be unpickled in the "
                              f"parent: {exc!r}", time.time(), primary=True)
        else:
            _, text, failed_at, r.trace = message
            self._fail(r, text, failed_at, primary=not _SECONDARY.search(text))

    def _on_exit(self, r: RankStatus) -> None:
        r.process.join(1.0)   # the sentinel fires as the process exits, a moment before it is reapable
        r.exited_at = time.monotonic()
        # A result already written must be read before judging the exit.
        while (r.result is None and r.failure is None and not r.result_conn.closed
               and r.result_conn.poll(0)):
            self._read_result(r)
        if r.result is None and r.failure is None:
            text = describe_exit(r.rank, r.process.exitcode)
            if r.lines:
                text += "\nits last output:\n" + "\n".join(r.lines[-15:])
            self._fail(r, text, time.time(), primary=True)

    def _fail(self, r: RankStatus, text: str, failed_at: float, primary: bool) -> None:
        r.failure, r.failed_at, r.primary = text, failed_at, primary
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def _give_up_on_stuck_pipes(self) -> None:
        """A grandchild may hold a rank's output pipe open after the rank exits: stop waiting."""
        for r in self.ranks:
            if r.out_open and r.exited_at is not None and time.monotonic() > r.exited_at + 1.0:
                r.out_open = False

    # -- verdicts ---------------------------------------------------------------------------
    def failures(self) -> dict[int, str]:
        return {r.rank: r.failure for r in self.ranks if r.failure is not None}

    def root_cause(self) -> int | None:
        """The earliest failure that is not a consequence of another rank's death."""
        failed = [r for r in self.ranks if r.failure is not None]
        if not failed:
            return None
        primaries = [r for r in failed if r.primary] or failed
        return min(primaries, key=lambda r: (r.failed_at, r.rank)).rank

    def unfinished(self) -> list[int]:
        return [r.rank for r in self.ranks if r.result is None and r.failure is None]


def describe_exit(rank: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} was killed by {name} before returning (out of memory, or a crash?)"
    return (f"rank {rank} exited with code {exitcode} before returning "
            "(os._exit, sys.exit inside a C extension, or a crash)")


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C (SIGINT) back while processes are being started or stopped, then deliver it.

    A KeyboardInterrupt raised between ``fork()`` and the parent recording the child's pid orphans
    that child; one raised while shutdown waits for the ranks leaves them running. Here it lands
    after the block, when every process is accounted for. (Only the main thread receives SIGINT.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)  # None: set in C
        if caught:
            signal.raise_signal(signal.SIGINT)   # to the handler that was there before (KeyboardInterrupt)


def _signal_group(process, sig: int) -> None:
    """Signal the process group a rank leads (it calls setpgrp), reaching the processes it started
    (the kernel keeps a group's id from being reused while any member lives); then the rank itself
    unless already reaped, in case it had not yet made its own group."""
    targets = [(os.killpg, process.pid)]
    if process._popen.returncode is None:
        targets.append((os.kill, process.pid))
    for send, target in targets:
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


LIFELINE_SECONDS = 0.5    # how long ranks may take to end themselves (and their trees) once the lifeline ends


def shutdown(ranks: list[RankStatus], grace: float = 2.0) -> None:
    """End every rank and every process it started, reap the ranks, close every pipe.

    First the lifeline ends: each live rank kills the processes below it, then itself (`lifeline`),
    within milliseconds. A rank that cannot (still booting, or its main thread holding the GIL in C code)
    then gets SIGTERM, with its process group, and SIGKILL after ``grace``. Safe to call twice, and
    Ctrl-C cannot cut it short (it is delivered when everything is gone)."""
    with interrupts_deferred():
        started = [r.process for r in ranks if r.process._popen is not None]
        alive = [p for p in started if p.is_alive()]
        for r in ranks:
            if r.lifeline is not None and not r.lifeline.closed:
                r.lifeline.close()
        _join(alive, LIFELINE_SECONDS)
        for p in started:
            _signal_group(p, signal.SIGTERM)
        _join(alive, grace)
        for p in started:
            _signal_group(p, signal.SIGKILL)
        for p in started:
            p.join()
        for r in ranks:
            for conn in (r.out_conn, r.result_conn):
                if not conn.closed:
                    conn.close()
            try:
                r.process.close()
            except ValueError:
                pass


def _join(processes: list, seconds: float) -> None:
    end = time.monotonic() + seconds
    for p in processes:
        p.join(max(end - time.monotonic(), 0.0))


def raise_if_failed(supervisor: Supervisor, timeout: float, outputs: list[str], flight: dict) -> None:
    """A `LaunchError` for the root cause, or for the deadline; when ranks hung (the deadline, or only
    timeouts of waiting peers), its message ends with what each rank was doing (`flight.diagnose`)."""
    failures, unfinished = supervisor.failures(), supervisor.unfinished()
    facts = dict(failures=failures, unfinished=unfinished, outputs=outputs, flight=flight)
    root = supervisor.root_cause()
    secondary = root is not None and not supervisor.ranks[root].primary      # a peer's timeout, say
    hung = supervisor.timed_out or bool(unfinished) or secondary
    said = ""
    if hung:
        returned = [r.rank for r in supervisor.ranks if r.result is not None]
        said = "\n\nWhat each rank was doing (flight recorder):\n" + (
            flight_recorder.diagnose(flight, returned=returned, failed=list(failures)) or "no records")
    if failures:
        others = sorted(set(failures) - {root})
        tail = (f" (rank(s) {others} failed after it)" if others else "")
        raise LaunchError(f"rank {root} failed{tail}:\n\n{failures[root].rstrip()}{said}", rank=root, **facts)
    if supervisor.timed_out or unfinished:
        raise LaunchError(
            f"deadline of {timeout:g} s passed: rank(s) {unfinished} never finished. A rank may be "
            f"waiting in a collective that a peer never entered, or the work needs a larger timeout.{said}",
            rank=None, **facts)
