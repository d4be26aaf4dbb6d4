"""Lesson 13's checks against the published tables, with mistakes planted: a constant in place of the
simulator passes the lesson's 15% window on every Narayanan row (149 TFLOP/s) and both Llama 3 rows
(0.42 MFU), so the lesson also asks the simulator to beat the best constant and to get the direction of
each published change right. Here the same checks are run on the simulator (they pass) and on the
planted constants (they fail)."""
from __future__ import annotations

import dataclasses
import statistics

import pytest

from distlab.theory import published

pytestmark = pytest.mark.slow          # every published row simulated: ~10 s on 2 cores (more when loaded)


def _beats_the_best_constant(rows) -> bool:
    """Lesson 13, section 3: the mean relative error below a constant's at the published mean."""
    mean = statistics.mean(c.published for c in rows)
    constant = statistics.mean(abs(mean / c.published - 1) for c in rows)
    return statistics.mean(abs(c.predicted / c.published - 1) for c in rows) < constant


def _directions_right(tables) -> bool:
    """Lesson 13, section 3: Korthikanti's "present work" above full recomputation at every size, and
    Llama 3's MFU lower at 16,384 GPUs than at 8,192."""
    k = {c.name: c.predicted for c in tables["korthikanti2022_table5"]}
    eight, sixteen = tables["llama3_2024_table4"]
    return all(k[f"{n} present"] > k[f"{n} full"] for n in ("22B", "175B", "530B", "1T")) \
        and sixteen.predicted < eight.predicted


@pytest.fixture(scope="module")
def tables():
    return {name: published.compare(name) for name in published.TABLES}


def _planted(rows, value):
    return [dataclasses.replace(c, predicted=value) for c in rows]


def test_the_simulator_passes_the_lessons_checks(tables):
    assert all(abs(c.error) <= published.TOLERANCE for rows in tables.values() for c in rows)
    assert _beats_the_best_constant(tables["narayanan2021_table1"])
    assert _beats_the_best_constant(tables["korthikanti2022_table5"])
    assert _directions_right(tables)


def test_a_planted_constant_passes_the_window_and_fails_the_lessons_checks(tables):
    narayanan = _planted(tables["narayanan2021_table1"], 149.0)
    llama = _planted(tables["llama3_2024_table4"], 0.42)
    within = [abs(c.predicted / c.published - 1) <= published.TOLERANCE for c in narayanan + llama]
    assert all(within)                                              # the old check: blind to it
    assert not _beats_the_best_constant(narayanan)
    assert not _directions_right({**tables, "llama3_2024_table4": llama})
    flat = _planted(tables["korthikanti2022_table5"], 0.45)
    assert not _directions_right({**tables, "korthikanti2022_table5": flat})
