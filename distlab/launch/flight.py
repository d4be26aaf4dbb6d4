"""The flight recorder: what every rank was doing when a launch hung.

A hang in distributed training is a rank waiting in a collective that a peer never entered (or a
receive that nobody sends). NCCL's "flight recorder" (PyTorch, ``TORCH_NCCL_TRACE_BUFFER_SIZE``)
answers it by keeping each rank's last collectives in a ring buffer; this is the same idea, for
any backend, readable after the rank was killed::

    rank r, inside dl.launch
      torch.distributed.all_reduce(...)  ->  tap: enter(op, group, peer, bytes) -> the original -> finish
                                                 |                                                  |
                                                 v                                                  v
      <launch dir>/rank{r}.ring   [ slot 0 | slot 1 | ... | slot SLOTS-1 ]   record n lives in slot n % SLOTS
      (a file mapped into memory: a write is a memory copy, and it outlives the process when the
       launcher kills it at the deadline)

    parent, after the deadline:  read every rank's ring  ->  `diagnose`:
      "ranks 0, 1, 3 wait in all_reduce #17 of group world; rank 2 never entered it,
       last finished broadcast #16 of group world"

Sequence numbers count, on each rank, the collectives issued on each group (1 for the first, as
NCCL's ``collective_seq_id`` does per communicator): ranks that agree on the program agree on
them, so the rank whose count stops short is the one that skipped (or has not reached) the call.
Point-to-point operations count per (direction, peer): "recv #3 from rank 0".

The tap wraps the functions of ``torch.distributed`` (not of ``distributed_c10d``, whose internal
calls, such as ``all_gather_object``'s own ``all_gather``, stay one record) once per process; every
collective of `distlab.parallel.collectives`, of `dl.comm` and of the user's own code goes through
it. ``isend``/``irecv`` are wrapped in both modules so that ``dist.P2POp(dist.isend, ...)`` still
passes torch's check. Listeners subscribe with `listening`: the `Recorder` here, and the exercise
checker's `P2PLog` (`distlab.exercises.harness`). Not seen: a function imported by name before the
launch (``from torch.distributed import all_reduce`` binds the original), torch's functional
collectives and DTensor; and under torchrun nothing is recorded (the launcher reads the rings).
The rings are put in words by `distlab.launch.diagnosis` (``flight.diagnose``).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import mmap
import os
import threading
import time
from pathlib import Path

from .diagnosis import P2P, SENDS as _SENDS
from .diagnosis import diagnose  # noqa: F401  (flight.diagnose: the parent reads the rings through it)

SLOTS = 256          # records kept per rank: the ring buffer holds the last SLOTS operations
SLOT_BYTES = 512     # one record, JSON padded with spaces (a longer one drops its member list)
_STAMP = 24          # characters kept for the "finished" time, so finishing rewrites only those

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list")


# -- the recorder: one ring buffer per rank, in a memory-mapped file ------------------------------
class Recorder:
    """This rank's last `SLOTS` operations, written to ``path`` as they enter and finish.

    A record: ``n`` (this rank's operation count), ``op``, ``group`` (its name: "world", a name
    given by `runtime.name_group`, else "ranks[0,2]"), ``ranks`` (the group's global ranks),
    ``seq`` (per group, or per direction and peer for point-to-point), ``peer``, ``bytes`` (of the
    first tensor argument: the buffer), ``entered`` and ``finished`` (wall-clock seconds, ``None``
    while it runs). Thread-safe: the ring of `dl.comm` and the backends' callbacks write too.
    """

    def __init__(self, path: str | Path, slots: int = SLOTS):
        self.path, self.slots, self.count, self.seqs = str(path), slots, 0, {}
        self._lock = threading.Lock()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, slots * SLOT_BYTES)
            self._map = mmap.mmap(fd, slots * SLOT_BYTES)
        finally:
            os.close(fd)

    def entered(self, op: str, group: str, ranks: list | None, peer: int | None, nbytes: int) -> dict:
        with self._lock:
            key = ("send" if op in _SENDS else "recv", group, peer) if op in P2P else (group,)
            self.seqs[key] = self.seqs.get(key, 0) + 1
            record = {"n": self.count, "op": op, "group": group, "ranks": ranks, "seq": self.seqs[key],
                      "peer": peer, "bytes": nbytes, "entered": time.time()}
            self.count += 1
            record["at"] = self._write(record)
        return record

    def finished(self, record: dict) -> None:
        """Rewrite only the ``finished`` field, in place: ``"finished":null   }`` -> ``"finished":12.5}``."""
        stamp = f"{time.time():.6f}".ljust(_STAMP).encode()
        with self._lock:
            if record["n"] >= self.count - self.slots:          # not yet overwritten by a newer one
                self._map[record["at"]:record["at"] + _STAMP] = stamp

    def _write(self, record: dict) -> int:
        """Write ``record`` into its slot with ``finished`` last and unset; return where its value starts."""
        head = json.dumps(record, separators=(",", ":"))[:-1] + ',"finished":'
        if len(head) + _STAMP + 1 > SLOT_BYTES:             # a huge group: drop the member list
            head = json.dumps({**record, "ranks": None}, separators=(",", ":"))[:-1] + ',"finished":'
        slot = (record["n"] % self.slots) * SLOT_BYTES
        self._map[slot:slot + SLOT_BYTES] = (head + "null".ljust(_STAMP) + "}").encode().ljust(SLOT_BYTES)
        return slot + len(head.encode())

    def close(self) -> None:
        self._map.close()


def read(path: str | Path) -> list[dict]:
    """The records in a ring file, oldest first (a slot cut short by a kill is skipped)."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return []
    records = []
    for i in range(0, len(raw), SLOT_BYTES):
        text = raw[i:i + SLOT_BYTES].strip(b" \0")
        try:
            records.append(json.loads(text)) if text else None
        except ValueError:
            pass
    return sorted(records, key=lambda r: r["n"])


# -- the tap: torch.distributed's functions, wrapped once per process ----------------------------
_listeners, _installed = [], {}
_inside = threading.local()            # the operation this thread is inside, if any
_NO_FUTURE: set = set()                # (op, backend) whose requests have no future (gloo's isend/irecv)


@contextlib.contextmanager
def listening(listener):
    """Call ``listener.entered(op, group, ranks, peer, nbytes) -> token`` and ``listener.finished(token)``
    around every torch.distributed operation made inside the block (installing the tap if needed)."""
    install()
    _listeners.append(listener)
    try:
        yield listener
    finally:
        _listeners.remove(listener)


@contextlib.contextmanager
def paused():
    """Record nothing inside the block, in this process: a benchmark timing a collective, not the tap."""
    saved = _listeners[:]
    _listeners.clear()
    try:
        yield
    finally:
        _listeners[:] = saved


def start(path: str | Path) -> Recorder:
    """Inside a rank: record every operation from now on into ``path`` (until `stop`)."""
    recorder = Recorder(path)
    install()
    _listeners.append(recorder)
    return recorder


def stop(recorder: Recorder | None) -> None:
    """Stop recording (the launcher's own closing barrier is not the user's)."""
    if recorder is not None and recorder in _listeners:
        _listeners.remove(recorder)


def install() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    if _installed:
        return
    for op in COLLECTIVES + P2P:
        original = getattr(dist, op, None)
        if original is None:
            continue
        _installed[op] = original
        tapped = _tap(op, original)
        setattr(dist, op, tapped)
        if op in ("isend", "irecv"):                     # dist.P2POp checks `op in [c10d.isend, c10d.irecv]`
            setattr(c10d, op, tapped)


def _tap(op: str, original):
    names = list(inspect.signature(original).parameters)     # to name the positional arguments

    def call(*args, **kwargs):
        if not _listeners or getattr(_inside, "op", None):  # send calls the tapped isend: once
            return original(*args, **kwargs)
        bound = {**dict(zip(names, args)), **kwargs}       # (cheaper than Signature.bind, per call)
        tokens = _enter(op, bound)
        _inside.op = op
        try:
            out = original(*args, **kwargs)
        finally:
            _inside.op = None
        if op in ("isend", "irecv") or bound.get("async_op"):
            return _when_done(out, tokens, op, bound.get("group"))
        _finish(tokens)
        return out
    call.__wrapped__, call.__name__, call.__doc__ = original, original.__name__, original.__doc__
    return call


def _enter(op: str, bound: dict) -> list:
    group, peer = bound.get("group"), None
    name, ranks = _group(group)
    if op in P2P:
        peer = _global_peer(group, bound)
    nbytes = _nbytes(next((v for k, v in bound.items() if k not in ("group", "op")), None))
    return [(lst, lst.entered(op, name, ranks, peer, nbytes)) for lst in list(_listeners)]


def _finish(tokens: list) -> None:
    for listener, token in tokens:
        listener.finished(token)


def _when_done(work, tokens: list, op: str, group):
    """An asynchronous operation finishes when the backend says so (collectives' futures) or, where it
    cannot (gloo's send and receive: asked once per op and backend, refusing costs ~30 us), when waited."""
    import torch.distributed as dist
    if work is None:                          # inside NCCL's coalescing manager: finished, return None
        return _finish(tokens)
    kind = (op, str(dist.get_backend(group)))
    if kind not in _NO_FUTURE:
        try:
            work.get_future().add_done_callback(lambda _: _finish(tokens))
            return work
        except (AttributeError, RuntimeError):
            _NO_FUTURE.add(kind)
    return _WaitedWork(work, lambda: _finish(tokens))


class _WaitedWork:
    """A request whose ``wait()`` marks its records finished (everything else passes through)."""

    def __init__(self, work, on_done):
        self.work, self.on_done = work, on_done

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        if self.on_done is not None:                       # once, however often it is waited for
            self.on_done, done = None, self.on_done
            done()
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


def _group(group) -> tuple[str, list | None]:
    import torch.distributed as dist

    from ..runtime import group_name
    if group is None or group is dist.GroupMember.WORLD:
        return group_name(group) or "world", list(range(dist.get_world_size()))
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        ranks = None
    return group_name(group) or f"ranks{ranks}".replace(" ", ""), ranks


def _global_peer(group, bound: dict) -> int | None:
    import torch.distributed as dist
    for key in ("dst", "src"):
        if bound.get(key) is not None:
            return int(bound[key])
    for key in ("group_dst", "group_src"):
        if bound.get(key) is not None:
            return dist.get_global_rank(group, bound[key]) if group is not None else int(bound[key])
    return None


def _nbytes(value) -> int:
    import torch
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value if isinstance(v, torch.Tensor))
    return 0


# -- the parent's side: a folder per launch, read after the deadline -------------------------------
class Box:
    """The folder where the ranks of a launch keep their rings; `collect` reads it, then removes it."""

    def __init__(self):
        import tempfile
        _sweep(Path(tempfile.gettempdir()))
        self.path = tempfile.mkdtemp(prefix=f"distlab-flight-{os.getpid()}-")

    def collect(self, world_size: int) -> dict[int, list[dict]]:
        import shutil
        records = {r: read(Path(self.path) / f"rank{r}.ring") for r in range(world_size)}
        shutil.rmtree(self.path, ignore_errors=True)
        return records


def _sweep(tmp: Path) -> None:
    """Remove the folders of launchers that are gone (a parent killed by SIGKILL cleans up nothing)."""
    import shutil
    for folder in tmp.glob("distlab-flight-*-*"):
        try:
            os.kill(int(folder.name.split("-")[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, OSError):
            pass


def ring_path(folder: str, rank: int) -> str:
    return str(Path(folder) / f"rank{rank}.ring")
