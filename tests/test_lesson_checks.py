"""The lessons' checks catch planted mistakes.

A lesson is a test: its assertions compare a prediction with a measurement. An assertion that cannot
fail protects nothing, so here each planted mistake (a wrong constant in a ``dl.theory`` formula, a
wrong byte count in the trace's ring model, a pipeline whose chunks are not smaller, ...) is applied by
monkeypatching, the lesson's own cells are executed from its jupytext source (``notebooks/NN_x.py``,
only the cells a check needs), and the check must raise ``AssertionError``. The same cells without the
mistake must pass, so a check that fails for every input does not count either.

The cells run in a subprocess (they set thread counts, fork ranks, import matplotlib), one per lesson,
each mistake planted and removed in turn. Formulas against formulas (both wrong the same way) are the
interesting case: lesson 04's recorded bytes are a ring model, so a wrong `tp_volume` *and* a ring
model wrong the same way agree with each other, and only the bytes measured on distlab's own ring
(`dl.comm.replay`) catch them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The harness run in the subprocess: cells of one lesson, mistakes planted one at a time.
HARNESS = textwrap.dedent('''
    import contextlib, json, re, sys
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.show = lambda *a, **k: None

    def cells(path):
        """The code cells of a jupytext percent-format lesson, in order."""
        out, current, code = [], [], False
        for line in open(path).read().splitlines():
            if line.startswith("# %%"):
                if code:
                    out.append("\\n".join(current))
                current, code = [], "[markdown]" not in line
            elif code:
                current.append(line)
        if code:
            out.append("\\n".join(current))
        return out

    def pick(all_cells, marker):
        found = [c for c in all_cells if marker in c]
        assert len(found) == 1, (marker, len(found))
        return found[0]

    @contextlib.contextmanager
    def patched(target, name, value):
        old = getattr(target, name)
        setattr(target, name, value)
        try:
            yield
        finally:
            setattr(target, name, old)

    def run(ns, codes):
        """'passed', or 'AssertionError' when a check caught something (any other error is re-raised)."""
        try:
            for code in codes:
                exec(compile(code, "<lesson cell>", "exec"), ns)
        except AssertionError:
            return "AssertionError"
        return "passed"
''')


def run_lesson(script: str, timeout: float = 240) -> dict:
    """Run HARNESS + ``script`` (which prints one JSON line: {case: outcome}) in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", HARNESS + textwrap.dedent(script)], cwd=ROOT / "notebooks",
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lesson_14_checkpoint_cadence_catches_wrong_constants():
    outcome = run_lesson('''
        import math
        import distlab as dl
        import distlab.theory as theory
        C = cells("14_when_things_go_wrong.py")
        codes = [pick(C, "young, daly = dl.theory.young_interval"), pick(C, "first_order = min(grid")]
        ns = {"math": math, "dl": dl}
        result = {"clean": run(dict(ns), codes)}
        with patched(theory, "young_interval", lambda s, m: math.sqrt(s * m)):        # the 2 forgotten
            result["young without the 2"] = run(dict(ns), codes)
        real_daly = theory.daly_interval
        with patched(theory, "daly_interval", lambda s, m: real_daly(s, m) + s):      # the - save_s forgotten
            result["daly without - save_s"] = run(dict(ns), codes)
        print(json.dumps(result))
    ''')
    assert outcome == {"clean": "passed", "young without the 2": "AssertionError",
                       "daly without - save_s": "AssertionError"}


def test_lesson_04_measured_bytes_catch_a_formula_and_a_ring_model_wrong_together():
    outcome = run_lesson('''
        import distlab as dl
        import distlab.theory as theory
        from distlab.parallel import collectives
        C = cells("04_tensor_parallel.py")
        setup = [c for c in C[:C.index(pick(C, "def one_step(sequence_parallel)"))]
                 if "dl.launch(" not in c]                                      # imports and constants only
        codes = setup + [pick(C, "def one_step(sequence_parallel)")]
        real_volume, real_ring = theory.tp_volume, collectives.ring_bytes

        def half_volume(*a, **k):                  # (t-1)/t instead of 2(t-1)/t: an all-reduce as a gather
            return real_volume(*a, **k) / 2

        def half_ring(numel, size, n, rank, op="all_reduce"):   # the trace's ring model wrong the same way
            sent, received = real_ring(numel, size, n, rank, op)
            return (sent // 2, received // 2) if op == "all_reduce" else (sent, received)

        ns = {}
        for code in setup:
            exec(code, ns)
        check = codes[-1]
        recorded, measured = check.split("def replayed")[0], "def replayed" + check.split("def replayed")[1]
        result = {}
        with patched(theory, "tp_volume", half_volume):
            result["tp_volume halved"] = run(dict(ns), [check])
        with patched(theory, "tp_volume", half_volume), patched(collectives, "ring_bytes", half_ring):
            both = dict(ns)
            result["recorded bytes alone"] = run(both, [recorded])   # formula and ring model agree: passes
            result["tp_volume and the ring model halved"] = run(both, [measured])
        print(json.dumps(result))
    ''')
    assert outcome == {"tp_volume halved": "AssertionError",
                       "tp_volume and the ring model halved": "AssertionError",
                       "recorded bytes alone": "passed"}


def test_lesson_11_drop_fraction_catches_the_fluid_limit_and_a_wrong_probability():
    outcome = run_lesson('''
        import distlab as dl
        import distlab.theory as theory
        C = cells("11_mixture_of_experts.py")
        codes = [C[0], pick(C, "MODEL, N = "), pick(C, "FACTORS = (0.5").split("def model_choices")[0]]
        real = theory.expected_drop_fraction
        result = {"clean": run({}, codes)}
        with patched(theory, "expected_drop_fraction", lambda t, e, k, f: max(0.0, 1 - f)):
            result["fluid limit, no binomial tail"] = run({}, codes)
        with patched(theory, "expected_drop_fraction", lambda t, e, k, f: real(t, e, 1, f)):
            result["top_k forgotten in the load's probability"] = run({}, codes)
        print(json.dumps(result))
    ''')
    assert outcome == {"clean": "passed", "fluid limit, no binomial tail": "AssertionError",
                       "top_k forgotten in the load's probability": "AssertionError"}


@pytest.mark.slow
def test_lesson_01_busbw_is_checked_against_counted_bytes():
    outcome = run_lesson('''
        import statistics
        import distlab as dl
        import distlab.theory as theory
        C = cells("01_ring_allreduce.py")
        ns = {}
        for code in (C[0], pick(C, "def both_algorithms(numels)")):
            exec(code, ns)
        # a stand-in for section 3's timings: the alpha-beta model itself, so only the busbw check is tested
        SIZES = [4096 * 4 ** k for k in range(7)]
        model = {n: (1e-4, 1e9) for n in (2, 4)}
        measured = {n: [theory.comm_time("all_reduce", S, n, 1e9, 1e-4) for S in SIZES] for n in (2, 4)}
        ns.update(SIZES=SIZES, model=model, measured=measured, TOLERANCE=0.35)
        code = pick(C, "counted = {n: max(ring)")
        real = theory.busbw
        result = {"clean": run(dict(ns), [code])}
        with patched(theory, "busbw", lambda op, S, t, n: real(op, S, t, n) / 2):      # (N-1)/N, not 2(N-1)/N
            result["busbw factor halved"] = run(dict(ns), [code])
        print(json.dumps(result))
    ''')
    assert outcome == {"clean": "passed", "busbw factor halved": "AssertionError"}


@pytest.mark.slow
def test_lesson_05_interleaving_must_divide_the_idle_time():
    outcome = run_lesson('''
        import distlab as dl
        C = cells("05_pipeline_parallel.py")
        codes = [C[0], pick(C, "def timed_run("), pick(C, "T_LONG, M_V = ")]
        codes[1] = codes[1].split("runs = {name")[0]                           # the function, not its runs
        real = dl.pp.TimedStage

        def not_split(width, t_f, t_b, **kw):     # v chunks not smaller: each takes a whole stage's time
            v = round(0.06 / t_f) if t_f < 0.06 else 1
            return real(width, t_f=t_f * v, t_b=t_b * v, **kw)

        result = {}
        with patched(dl.pp, "TimedStage", not_split):
            result["chunks not split"] = run({}, codes)
        print(json.dumps(result))
    ''')
    assert outcome == {"chunks not split": "AssertionError"}


def _replay_on(calls):
    import distlab as dl
    return dl.comm.replay(calls)


@pytest.mark.parametrize("n", [3])
def test_replay_counts_the_bytes_a_ring_sends(n):
    """`dl.comm.replay`, the lessons' measurement of torch's recorded calls, counts what the ring sends:
    equal to `ring_bytes` per rank, also where n does not divide the message."""
    import distlab as dl
    calls = [("all_reduce", 4000), ("all_gather", 4 * 1001), ("reduce_scatter", 4 * 999),
             ("all_reduce", 4 * 10_007)]
    sent = dl.launch(_replay_on, world_size=n, args=(calls,), output="quiet").results
    for r in range(n):
        assert sent[r] == sum(dl.comm.ring_bytes(size // 4, 4, n, r, op)[0] for op, size in calls)


def test_replay_refuses_what_it_cannot_replay():
    import distlab as dl
    with pytest.raises(dl.LaunchError, match="cannot replay 'all_to_all'"):
        dl.launch(_replay_on, world_size=2, args=([("all_to_all", 64)],), output="quiet")
