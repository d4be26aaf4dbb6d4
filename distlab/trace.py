"""Per-rank event recorder and the merged trace over all ranks.

Every rank owns one `Tracer` (see `distlab.runtime.tracer()`). Strategies and collectives record
into it three kinds of event:

* compute spans  - ``with tracer.span("forward", stage=1): ...``
* comm events    - one per point-to-point transfer or collective call: op, bytes sent and received,
                   peer, start and end
* memory samples - bytes by category (params, grads, optimizer, activations, buffers) at a moment

Recording appends a tuple to a list, so it costs well under a microsecond; a disabled tracer
records nothing. When the launch ends, the parent merges every rank's events into a `Trace`.

Clock: each rank measures ``time.perf_counter_ns()`` relative to its own *epoch*, taken right after
the barrier that follows process-group initialisation, so all ranks share one time axis (exact on
one machine; within the barrier's exit skew, microseconds, across machines). Times are seconds.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

KINDS = ("span", "comm", "memory", "mark")


@dataclass(frozen=True)
class Event:
    """One recorded event. ``start``/``end`` are seconds since the rank's epoch (equal for instants)."""

    rank: int
    kind: str
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def cat(self) -> str:
        return self.args.get("cat", self.kind)

    @property
    def sent(self) -> int:
        return int(self.args.get("sent", 0))

    @property
    def received(self) -> int:
        return int(self.args.get("received", 0))


class Tracer:
    """Records one rank's events. Cheap when enabled, free when not."""

    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self._epoch_ns = time.perf_counter_ns()
        self._events: list[tuple] = []
        # Set from outside while a profiler records this rank (`distlab.launch.profiler`): ``ranges(name)``
        # gives a context manager that opens the profiler's own range (``torch.profiler.record_function``)
        # around every span. None (no profiler): a span costs one attribute check more.
        self.ranges = None

    def reset_epoch(self) -> None:
        """Make *now* time zero (called after the start-up barrier, so ranks share an axis)."""
        self._epoch_ns = time.perf_counter_ns()

    def now(self) -> float:
        """Seconds since this rank's epoch."""
        return (time.perf_counter_ns() - self._epoch_ns) * 1e-9

    def clear(self) -> None:
        self._events.clear()

    # -- recording -------------------------------------------------------------------------
    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args: Any) -> Iterator[None]:
        """Time a block of work: ``with tracer.span("backward", microbatch=3): ...``."""
        with self._timed(lambda start, end: self._events.append(("span", name, start, end,
                                                                 {"cat": cat, **args}))):
            if self.ranges is None:
                yield
            else:
                with self.ranges(name):
                    yield

    @contextlib.contextmanager
    def _timed(self, write) -> Iterator[None]:
        """Run the block, then ``write(start, end)`` (nothing when disabled)."""
        if not self.enabled:
            yield
            return
        start = self.now()
        try:
            yield
        finally:
            write(start, self.now())

    def comm(self, op: str, *, start: float, end: float, sent: int = 0, received: int = 0,
             peer: int | None = None, **args: Any) -> None:
        """Record a finished communication: ``op`` moved ``sent``/``received`` bytes to/from ``peer``."""
        if self.enabled:
            self._events.append(("comm", op, start, end,
                                 {"cat": "comm", "sent": int(sent), "received": int(received),
                                  "peer": peer, **args}))

    @contextlib.contextmanager
    def comm_span(self, op: str, *, sent: int = 0, received: int = 0, peer: int | None = None,
                  **args: Any) -> Iterator[None]:
        """Time a blocking communication and record it as one comm event."""
        with self._timed(lambda start, end: self.comm(op, start=start, end=end, sent=sent, received=received,
                                                      peer=peer, **args)):
            yield

    def memory(self, label: str = "", **bytes_by_category: int) -> None:
        """Sample memory: ``tracer.memory("after step", params=..., grads=..., optimizer=...)``."""
        if self.enabled:
            t = self.now()
            self._events.append(("memory", label, t, t,
                                 {k: int(v) for k, v in bytes_by_category.items()}))

    def mark(self, name: str, **args: Any) -> None:
        """An instant event (a step boundary, a checkpoint written)."""
        if self.enabled:
            t = self.now()
            self._events.append(("mark", name, t, t, dict(args)))

    # -- export ----------------------------------------------------------------------------
    def export(self) -> list[tuple]:
        """Plain tuples, cheap to pickle back to the parent."""
        return list(self._events)

    def events(self) -> list[Event]:
        return [Event(self.rank, *e) for e in self._events]


class Trace:
    """All ranks' events on one time axis, with the queries lessons and tests need."""

    def __init__(self, events: Iterable[Event] = ()):
        self.events: list[Event] = sorted(events, key=lambda e: (e.start, e.rank))

    @classmethod
    def merge(cls, per_rank: dict[int, list[tuple]] | list[list[tuple]]) -> "Trace":
        """Build from each rank's ``Tracer.export()``."""
        items = per_rank.items() if isinstance(per_rank, dict) else enumerate(per_rank)
        return cls(Event(rank, *e) for rank, events in items for e in (events or ()))

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __repr__(self) -> str:
        return f"Trace({len(self.events)} events over ranks {self.ranks})"

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    @property
    def duration(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def select(self, kind: str | None = None, rank: int | None = None, name: str | None = None,
               cat: str | None = None, **args: Any) -> list[Event]:
        """Events matching every given field, e.g. ``trace.select("comm", rank=0, name="send")``."""
        return [e for e in self.events
                if (kind is None or e.kind == kind) and (rank is None or e.rank == rank)
                and (name is None or e.name == name) and (cat is None or e.cat == cat)
                and all(e.args.get(k) == v for k, v in args.items())]

    def spans(self, rank: int | None = None, cat: str | None = None, name: str | None = None) -> list[Event]:
        return self.select("span", rank=rank, name=name, cat=cat)

    def comms(self, rank: int | None = None, op: str | None = None, **args: Any) -> list[Event]:
        return self.select("comm", rank=rank, name=op, **args)

    def memory_samples(self, rank: int | None = None) -> list[Event]:
        return self.select("memory", rank=rank)

    def bytes_sent(self, rank: int | None = None, op: str | None = None, **args: Any) -> int:
        return sum(e.sent for e in self.comms(rank, op, **args))

    def bytes_received(self, rank: int | None = None, op: str | None = None, **args: Any) -> int:
        return sum(e.received for e in self.comms(rank, op, **args))

    def busy_time(self, rank: int, cat: str | None = None) -> float:
        """Seconds covered by this rank's spans (overlaps counted once)."""
        intervals = sorted((e.start, e.end) for e in self.spans(rank=rank, cat=cat))
        total, cur_start, cur_end = 0.0, None, None
        for s, t in intervals:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = s, t
            else:
                cur_end = max(cur_end, t)
        if cur_end is not None:
            total += cur_end - cur_start
        return total

    def shifted(self, seconds: float) -> "Trace":
        """The same events ``seconds`` later (negative: earlier), e.g. to start a trace at 0."""
        return Trace(Event(e.rank, e.kind, e.name, e.start + seconds, e.end + seconds, e.args)
                     for e in self.events)

    # -- Chrome trace-event format (opens in Perfetto / chrome://tracing) -------------------
    def to_chrome(self) -> dict:
        """Trace-event JSON: one process per rank, its compute and comm spans on tracks that nest.

        The format draws complete events (``ph: "X"``) of one track (pid, tid) as a stack, so two
        of them must be disjoint or one inside the other. Operations in flight together (a ring's
        send beside its receive, a pipeline's overlapped transfers) only partly overlap, so each
        category is spread over *lanes*: an event goes on the first lane whose open events all
        contain it, else on a new lane::

            comm    |== bucket all_reduce ===============|  |- step 2 -|
                       |- step 0 -|                             inside the bucket: same lane
            comm 2           |- step 1 -|                       crosses step 0: the next lane

        Memory samples become counters (``ph: "C"``), one counter name per unit; marks are instants.
        """
        out, tracks = [], {}
        for e in self.events:
            args = {k: v for k, v in e.args.items() if isinstance(v, (int, float, str, bool, type(None)))}
            if e.kind == "memory":
                out += _counters(e)
            elif e.kind == "mark":
                out.append({"ph": "i", "s": "p", "name": e.name, "pid": e.rank, "tid": 0,
                            "ts": e.start * 1e6, "args": args})
            else:
                ts = e.start * 1e6
                out.append({"ph": "X", "name": e.name, "cat": e.cat, "pid": e.rank,
                            "ts": ts, "dur": max(e.end * 1e6 - ts, 0.0), "args": args})
                tracks.setdefault((e.rank, "comm" if e.kind == "comm" else "compute"), []).append(out[-1])
        meta = []
        for r in self.ranks:
            meta.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                         "args": {"name": f"rank {r}"}})
            for category in ("compute", "comm"):
                meta += _lanes(r, category, tracks.get((r, category), []))
        return {"traceEvents": meta + out, "displayTimeUnit": "ms"}

    def save_chrome(self, path: str) -> str:
        """Write trace-event JSON to ``path`` (open it at ui.perfetto.dev); returns the path."""
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)
        return path


# -- helpers of the Chrome export ---------------------------------------------------------------
_CATEGORY_TID = {"compute": 0, "comm": 1}   # lane k of a category is tid 2k + this (lane 0: tids 0, 1)
# Memory samples are bytes by category, except these keys (their unit): the pipeline's stash counts
# the microbatches it holds beside their bytes.
COUNT_UNITS = {"microbatches": "microbatches"}
# Labels that name a series of their own (sampled after every pipeline action); every other label
# is a moment of the memory ledger ("forward", "step") and feeds the one "memory" series.
OWN_SERIES = ("pipeline stash",)


def _lanes(rank: int, category: str, events: list[dict]) -> list[dict]:
    """Give each X event of one rank's ``category`` a tid so that every tid's events nest; returns
    the thread metadata naming the lanes used (at least lane 0)."""
    lanes: list[list[float]] = []                   # per lane: ends of its open events, outermost first
    for x in sorted(events, key=lambda x: (x["ts"], -(x["ts"] + x["dur"]))):
        k = _fitting_lane(lanes, x["ts"], x["ts"] + x["dur"])
        lanes[k].append(x["ts"] + x["dur"])
        x["tid"] = 2 * k + _CATEGORY_TID[category]
    meta = []
    for k in range(max(1, len(lanes))):
        tid = 2 * k + _CATEGORY_TID[category]
        name = category if k == 0 else f"{category} {k + 1}"
        meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                     "args": {"sort_index": 1000 * _CATEGORY_TID[category] + k}})
    return meta


def _fitting_lane(lanes: list[list[float]], start: float, end: float) -> int:
    """The first lane where [start, end] nests (a new one if none): events are visited by start, so
    a lane's open events that ended by ``start`` are closed for good."""
    for k, open_ends in enumerate(lanes):
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        if not open_ends or end <= open_ends[-1]:   # empty, or its innermost open event contains it
            return k
    lanes.append([])
    return len(lanes) - 1


def _counters(e: Event) -> list[dict]:
    """One memory sample as counter events, one per unit: ``memory (bytes)``, ``pipeline stash
    (microbatches)``; each counter's args are its series (params, grads, ...)."""
    series = e.name if e.name in OWN_SERIES else "memory"
    by_unit: dict[str, dict] = {}
    for key, value in e.args.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_unit.setdefault(COUNT_UNITS.get(key, "bytes"), {})[key] = value
    return [{"ph": "C", "name": f"{series} ({unit})", "pid": e.rank, "tid": 0, "ts": e.start * 1e6,
             "args": values} for unit, values in sorted(by_unit.items())]
