"""Where dl.comm's trace comes from: the algorithms pass no labels; `comm/p2p.py`'s primitives record each
step into the call that `comm/traced.py`'s entry points open around the algorithm (DESIGN.md: "tracing
attaches at the one p2p exchange, never in an algorithm's signature").

What the lessons and `test_comm.py` read from these events (names, bytes, steps, the ring's chunks and
phases) is checked there; here: the call is said from outside, calls nest, a step finished after its
call still lands in it, and an algorithm run bare still records its steps.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import torch

import distlab as dl
from distlab.comm import ring as ring_module

COMM = Path(dl.comm.__file__).parent
ALGORITHMS = ["ring.py", "ring_pipelined.py", "tree.py", "naive.py", "all_to_all.py", "shift.py"]
LABELS = {"name", "op_name", "call", "call_id", "first_step", "phase", "size", "info"}   # parameters
PASSED = LABELS | {"step", "send_chunk", "recv_chunk"}                                  # keywords


def test_algorithms_take_and_pass_no_labels():
    for file in ALGORITHMS:
        for node in ast.walk(ast.parse((COMM / file).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                assert not params & LABELS, f"{file}: {node.name} takes {params & LABELS}"
            if isinstance(node, ast.keyword):
                assert node.arg not in PASSED, f"{file}: {node.arg}= at line {node.value.lineno}"


def _calls():
    n, r = dl.world_size(), dl.rank()
    dl.comm.ring_all_gather(torch.ones(r + 1))                   # uneven: sizes are exchanged first
    ring_module.ring_all_reduce(torch.ones(6))                   # the algorithm itself, no entry point
    shift = dl.comm.start_ring_shift(torch.full((4,), float(r)))   # the call ends here...
    got = shift.wait()                                           # ...its step after
    dl.tracer().enabled = False
    quiet = dl.comm.ring_all_reduce(torch.ones(5))               # no trace: nothing counted, same result
    dl.tracer().enabled = True
    return got.tolist(), quiet.tolist(), n


@functools.lru_cache(maxsize=None)
def _run():
    return dl.launch(_calls, world_size=3, output="quiet")


def test_calls_are_said_from_outside_and_nest():
    run = _run()
    for r in range(3):
        sizes = run.trace.comms(rank=r, op="exchange_sizes")
        gather = run.trace.comms(rank=r, op="ring_all_gather")
        assert len(sizes) == len(gather) == 2
        assert len({e.args["call"] for e in sizes}) == len({e.args["call"] for e in gather}) == 1
        assert sizes[0].args["call"] != gather[0].args["call"]
        assert [e.args["step"] for e in sizes] == [e.args["step"] for e in gather] == [0, 1]
        assert {e.args["size"] for e in sizes} == {3 * 8} and {e.args["size"] for e in gather} == {6 * 4}
        assert sum(e.received for e in gather) == 4 * (6 - (r + 1))


def test_a_step_finished_after_its_call_is_recorded_in_it():
    run = _run()
    for r, (got, quiet, _) in enumerate(run.results):
        assert got == [float((r - 1) % 3)] * 4 and quiet == [3.0] * 5
        (hop,) = run.trace.comms(rank=r, op="ring_shift")
        assert (hop.args["peer"], hop.args["src"]) == ((r + 1) % 3, (r - 1) % 3)
        assert hop.args["size"] == hop.sent == hop.received == 16


def test_an_algorithm_run_bare_records_its_steps():
    run = _run()
    for r in range(3):
        bare = run.trace.comms(rank=r, op="exchange")
        assert [e.args["phase"] for e in bare] == ["reduce_scatter"] * 2 + ["all_gather"] * 2
        assert sum(e.sent for e in bare) == dl.comm.ring_bytes(6, 4, 3, r)[0]
        assert not run.trace.comms(rank=r, op="ring_all_reduce")     # the untraced call left nothing
