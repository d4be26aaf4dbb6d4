"""Stored lesson outputs must not depend on the CPU that runs them (issue 24, item 0).

nbval compares a lesson's printed output digit for digit with the output stored when it was executed.
`make notebooks` and `make test` pin the arithmetic (the Makefile's REPRODUCIBLE: one thread, MKL's AVX2
code path, torch's AVX2 kernels), but a learner's machine may differ: another processor (an ARM laptop
has neither MKL nor AVX2), other libraries. A loss printed to six digits then reads 3.674724 where the
lesson stored 3.674723, and the README's test command fails for them.

This test re-runs lessons under another setting that every x86-64 processor (and torch on any other)
can run, each variable different from the pin:

    OMP_NUM_THREADS=2            reductions split over two threads, added in another order
    MKL_CBWR=COMPATIBLE          MKL's SSE2 code path instead of its AVX2 one
    ATEN_CPU_CAPABILITY=default  torch's scalar kernels instead of its AVX2 ones (sums, softmax, norms)

and checks that nbval still passes: an output that prints more digits than the arithmetic fixes fails
here, on any machine, and not only on a learner's. The lessons re-run are fast ones that print numbers
computed by torch (losses after training steps). Slow: ~40 s a lesson on 2 cores.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nbval")

ROOT = Path(__file__).resolve().parents[1]
OTHER = {"OMP_NUM_THREADS": "2", "MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}

# lesson: None, or the cell of it that still prints a CPU-dependent number (nbval's "Cell N", counting
# code cells from 0), to be fixed in the lesson (print fewer digits, or what is invariant): an expected
# failure of that cell alone (any other cell failing fails the test), and a failure once the lesson passes,
# so that the entry goes. Two lessons (~40 s each), to keep CI short. Every lesson under this setting
# (14.5 min on 2 cores, Nov 2026) failed at 04 Cell 12, 08 Cell 4 (losses to 6 digits), 15 Cell 0 (norms to
# 4 digits) and 15 Cell 7 (logits computed with another thread count than the ranks'): all fixed since.
LESSONS = {
    "11_mixture_of_experts.ipynb": None,
    "08_checkpointing.ipynb": None,
}


def pinned() -> dict[str, str]:
    """The Makefile's REPRODUCIBLE setting, the one the lessons were executed under."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("REPRODUCIBLE"))
    return dict(re.findall(r"(\w+)=(\S+)", line))


def test_the_other_setting_differs_from_the_pinned_one_in_every_variable():
    pin = pinned()
    assert set(pin) == set(OTHER), f"the Makefile pins {sorted(pin)}: vary each of them here"
    assert all(pin[name] != OTHER[name] for name in OTHER), (pin, OTHER)


@pytest.mark.slow
@pytest.mark.parametrize("lesson", sorted(LESSONS))
def test_a_lesson_passes_nbval_under_another_cpu_setting(lesson):
    env = {**os.environ, **OTHER, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                              os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                           str(ROOT / "notebooks" / lesson)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    failed = re.findall(r"FAILED \S+::(Cell \d+)", done.stdout)
    known = LESSONS[lesson]
    if known is None:
        assert done.returncode == 0, (f"{lesson} prints a CPU-dependent output under {OTHER}: {failed}\n"
                                      f"{done.stdout[-4000:]}")
        return
    assert done.returncode != 0, f"{lesson} passes under {OTHER} now: remove its entry from LESSONS"
    cell = known.split(":")[0]
    assert failed == [cell], f"{lesson}: {failed} failed, not just {cell}\n{done.stdout[-4000:]}"
    pytest.xfail(f"CPU-dependent output, known: {lesson} {known}")
