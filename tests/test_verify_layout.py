"""The advisor's and the cluster planner's pick checked by a dry run of distlab's code
(`distlab.strategies.verify`): the strategy a plan maps to, the bytes measured beside the prediction,
the verdict, and the widgets' ``verify()`` passing their layout through."""
from __future__ import annotations

import pytest

import distlab as dl
import distlab.strategies.verify as verify
from distlab.theory import ModelPreset

SMALL = ModelPreset("llama3-8b-4-layers", hidden=4096, layers=4, heads=32, vocab=128256, seq_len=64,
                    ffn=14336, kv_heads=8, llama=True)


@pytest.mark.parametrize("plan, strategy, noted", [
    ((8, 1, 1, 0), "ddp", False), ((8, 1, 1, 3), "fsdp", False),
    ((2, 2, 2, 1), "3d:dp=2,tp=2,pp=2,zero=1,sp=True,microbatches=4", False),
    ((4, 1, 2, 2), "3d:dp=4,tp=1,pp=2,zero=1,microbatches=4", True),
])
def test_a_plan_maps_to_distlabs_nearest_strategy(plan, strategy, noted):
    got, notes = verify.strategy_for(*plan, microbatches=4)
    assert got == strategy and bool(notes) == noted


def test_verify_measures_the_layout_and_judges_it_against_the_gpu():
    found = verify.verify_layout(SMALL, "h100-80gb", dp=2, tp=2, pp=2, zero=1, recompute="none")
    assert found.ranks == [0, 7] and found.strategy.startswith("3d:dp=2,tp=2,pp=2")
    first = found.measured[0]["peak"]
    total = found.measured[0]["peak_total"]              # the largest sum at one moment
    assert first["params"] > 0 and max(first.values()) <= total <= sum(first.values())
    assert found.fits and found.limit == 0.9 * dl.theory.gpu("h100-80gb").memory
    tiny = verify.Verification(found.strategy, found.ranks, found.predicted, found.measured, limit=1e6)
    assert not tiny.fits and "does not fit" in str(tiny)
    with pytest.raises(ValueError, match="recompute must be"):
        verify.verify_layout(SMALL, "h100-80gb", dp=8, recompute="always")


def test_the_widgets_verify_their_pick(monkeypatch):
    calls = []
    monkeypatch.setattr(verify, "verify_layout", lambda *a, **kw: calls.append((a, kw)) or
                        verify.Verification("s", [0], None, [], 1.0))
    advisor = dl.widgets.advisor("llama3-8b", "h100-80gb", 8)
    advisor.verify()
    plan = advisor.result.plan
    assert calls[-1] == (("llama3-8b", plan.gpu), dict(dp=plan.dp, tp=plan.tp, pp=plan.pp, zero=plan.zero,
                                                       recompute=plan.recompute, seq_len=4096))
    planner = dl.widgets.cluster_planner("llama3-70b", "h100-80gb", 1024, tokens=1e12)
    found = planner.verify(1)
    lay = planner.result.ranked[1].layout
    assert calls[-1][1]["dp"] == lay["dp"] and calls[-1][1]["pp"] == lay["pp"]
    assert calls[-1][1]["microbatches"] == (lay["microbatches"] if lay["pp"] > 1 else None)
    assert any("flash attention" in n for n in found.notes)
