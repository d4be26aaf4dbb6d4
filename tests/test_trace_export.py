"""The Chrome / Perfetto export (`Trace.to_chrome`) against the trace-event format's rules.

The format (Google's "Trace Event Format" document, the JSON Object Format): ``{"traceEvents": [...]}``;
every event has ``ph``, ``name``, ``pid`` and, except metadata, ``ts`` in microseconds; complete events
(``X``) have ``dur >= 0`` and a ``tid``; counters (``C``) have numeric args; instants (``i``) a scope
``s`` in g/p/t; metadata (``M``) names processes and threads. A track (pid, tid) is drawn as a stack,
so any two X events on it are disjoint or nested: that is what Perfetto needs to draw them right.

Checked on a 4-rank ring all-reduce (send and receive in flight together), a pipeline run and the
single-process run, which also starts at time 0.
"""
from __future__ import annotations

import itertools
import json
import re

import distlab as dl
from distlab.trace import COUNT_UNITS, Event, Trace

PHASES = {"X", "i", "C", "M"}
METADATA = {"process_name", "thread_name", "thread_sort_index", "process_sort_index"}


def check_chrome(chrome: dict) -> list[dict]:
    """Assert the export follows the format; returns its X events."""
    json.dumps(chrome, allow_nan=False)                           # plain JSON, no NaN or Infinity
    assert isinstance(chrome["traceEvents"], list) and chrome.get("displayTimeUnit") in ("ms", "ns")
    named_threads, xs = set(), []
    for ev in chrome["traceEvents"]:
        assert ev["ph"] in PHASES and isinstance(ev["name"], str) and isinstance(ev["pid"], int), ev
        if ev["ph"] == "M":
            assert ev["name"] in METADATA and isinstance(ev["args"], dict), ev
            if ev["name"] == "thread_name":
                named_threads.add((ev["pid"], ev["tid"]))
            continue
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert isinstance(ev["tid"], int) and ev["dur"] >= 0, ev
            xs.append(ev)
        elif ev["ph"] == "i":
            assert ev["s"] in ("g", "p", "t"), ev
        else:                                                      # a counter: numbers of one unit
            assert ev["args"] and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                      for v in ev["args"].values()), ev
            assert re.fullmatch(r".+ \([a-z]+\)", ev["name"]), f"{ev['name']}: a counter names its unit"
            unit = ev["name"].rsplit("(", 1)[1].rstrip(")")
            assert all(COUNT_UNITS.get(k, "bytes") == unit for k in ev["args"]), ev
    assert {(x["pid"], x["tid"]) for x in xs} <= named_threads   # every track has a name
    for track, events in itertools.groupby(sorted(xs, key=lambda x: (x["pid"], x["tid"])),
                                           key=lambda x: (x["pid"], x["tid"])):
        _check_nesting(track, list(events))
    return xs


def _check_nesting(track, events: list[dict]) -> None:
    """Any two X events of one track: disjoint, or one inside the other (all pairs)."""
    spans = [(x["ts"], x["ts"] + x["dur"], x["name"]) for x in events]
    for (a0, a1, an), (b0, b1, bn) in itertools.combinations(spans, 2):
        disjoint = a1 <= b0 or b1 <= a0
        nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
        assert disjoint or nested, f"track {track}: {an} [{a0}, {a1}] and {bn} [{b0}, {b1}] cross"


def overlapping_ring_all_reduce():
    import torch
    t = torch.arange(64, dtype=torch.float32) + dl.rank()
    for _ in range(3):                          # the fast ring: transfers posted ahead, in flight together
        dl.comm.pipelined_all_reduce(t)
    return t[:2].tolist()


def test_ring_all_reduce_on_4_ranks_nests_on_every_track():
    run = dl.launch(overlapping_ring_all_reduce, world_size=4, output="quiet")
    chrome = run.trace.to_chrome()
    xs = check_chrome(chrome)
    comm = [e for e in run.trace.events if e.kind == "comm"]
    assert len([x for x in xs if x["cat"] == "comm"]) == len(comm) > 0    # nothing lost
    tids = {x["tid"] for x in xs if x["pid"] == 0 and x["cat"] == "comm"}
    assert len(tids) > 1, "a ring's sends and receives overlap: they need more than one lane"


def test_pipeline_run_nests_and_counters_keep_units_apart():
    report = dl.train("pp-1f1b", world_size=2, model="gpt-tiny", steps=2, global_batch=8, microbatches=4)
    chrome = report.run.trace.to_chrome()
    xs = check_chrome(chrome)
    assert {x["pid"] for x in xs} == {0, 1}
    names = {ev["name"] for ev in chrome["traceEvents"] if ev["ph"] == "C"}
    assert {"pipeline stash (bytes)", "pipeline stash (microbatches)"} <= names


def test_single_run_starts_at_zero_and_follows_the_format():
    report = dl.train("single", model="gpt-tiny", steps=2, global_batch=8)
    xs = check_chrome(report.trace.to_chrome())
    # on the run's own clock, as a launch's trace is: 0 when training started, not when the process did
    assert xs and 0.0 <= min(e.start for e in report.trace.events)
    assert max(e.end for e in report.trace.events) <= report.seconds
    assert max(x["ts"] + x["dur"] for x in xs) <= report.seconds * 1e6


def test_lanes_on_a_hand_made_trace():
    # a contains b; c starts inside a and ends after it (crosses a); d is after everything
    ev = [Event(0, "comm", "a", 0.0, 4.0), Event(0, "comm", "b", 1.0, 2.0), Event(0, "comm", "c", 3.0, 5.0),
          Event(0, "comm", "d", 6.0, 7.0), Event(0, "span", "f", 0.0, 1.0)]
    xs = check_chrome(Trace(ev).to_chrome())
    tid = {x["name"]: x["tid"] for x in xs}
    assert tid["a"] == tid["b"] == tid["d"] == 1 and tid["c"] == 3 and tid["f"] == 0
    assert Trace(ev).shifted(-1.0).events[0].start == -1.0
