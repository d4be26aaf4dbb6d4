"""`dl.widgets.cluster_planner` and its search (`theory.layouts.rank_layouts`), without a browser."""
from __future__ import annotations

import pytest

from distlab import theory, widgets
from distlab.theory import layouts, published, sim
from distlab.widgets.cluster_planner import KINDS


def test_ranked_layouts_fit_are_sorted_and_are_the_simulators_own():
    ranked = layouts.rank_layouts("llama2-7b", "a100-80gb", 16, global_batch=64, seq_len=4096)
    assert ranked and all(r.fits for r in ranked)
    times = [r.step_time for r in ranked]
    assert times == sorted(times)
    seen = {(r.layout["dp"], r.layout["tp"], r.layout["pp"]) for r in ranked}
    assert len(seen) == len(ranked) and all(dp * tp * pp == 16 for dp, tp, pp in seen)
    best = ranked[0]
    again = sim.step("llama2-7b", "a100-80gb", 16, tp=best.layout["tp"], pp=best.layout["pp"],
                     virtual=best.layout["virtual"], zero=best.layout["zero"], global_batch=64, seq_len=4096,
                     recompute=best.layout["recompute"], flash_attention=True, inter="ib-ndr")
    assert again.step_time == pytest.approx(best.step_time)


def test_a_model_too_big_for_the_cluster_has_no_layout():
    assert layouts.rank_layouts("llama3-405b", "a100-40gb", 8, global_batch=8, seq_len=8192) == []


def test_the_widget_follows_its_controls():
    w = widgets.cluster_planner("llama2-13b", "a100-80gb", 64, tokens=1e12)
    assert set(w.controls) >= {"model", "gpu", "gpus", "tokens", "global_batch", "seq_len"}
    first = w.result
    expected = layouts.rank_layouts("llama2-13b", "a100-80gb", 64, global_batch=512, seq_len=8192,
                                    inter="ib-ndr", efficiency=published.calibrated("a100-80gb"))
    assert [r.layout for r in first.ranked] == [r.layout for r in expected]
    assert first.days[0] == pytest.approx(1e12 / first.best.tokens_per_s / 86400)
    bars = w.figure.axes[0].patches
    assert len(bars) == len(KINDS) * min(8, len(first.ranked))
    w.controls["gpus"].value = 128                              # twice the GPUs: a faster best step
    assert w.result.best.step_time < first.best.step_time
    w.controls["tokens"].value = 2e12
    assert w.result.days[0] == pytest.approx(2 * 1e12 / w.result.best.tokens_per_s / 86400)


def test_the_widget_says_when_nothing_fits():
    w = widgets.cluster_planner("llama3-405b", "a100-40gb", 8)
    assert w.result.best is None and w.figure is None
    assert "no layout fits" in w.output.outputs[0]["data"]["text/html"]


def test_calibrated_constants_are_the_tables():
    tables = published.tables()
    assert published.calibrated("h100-80gb") == sim.Efficiency(**tables["llama3_2024_table4"]["efficiency"])
    a100 = tables["korthikanti2022_table5"]["efficiency"]
    assert published.calibrated("a100-80gb") == sim.Efficiency(**a100)
    assert theory.sim is sim
