"""The memory ledger: exact bytes by category, beside dl.theory.memory (within 2%), and its plot."""
from __future__ import annotations

import pytest
import torch

import distlab as dl
from _data_parallel_runs import CASES, param_numel, run


def _within(measured: float, predicted: float, rel: float = 0.02) -> bool:
    return abs(measured - predicted) <= rel * predicted


def test_fp32_ledger_matches_theory():
    """Model states per rank (params, grads, optimizer) from every fp32 run, within 2% of theory."""
    for index, (strategy, n, optimizer, _) in enumerate(CASES):
        report = run(index)
        stage = 0 if strategy == "ddp" else int(strategy[-1])
        theory = dl.theory.memory(param_numel(report), dp=n, zero=stage, precision="fp32",
                                  optimizer="adam" if optimizer == "adamw" else "sgd")
        for r in range(n):
            peak = report.memory[r]["peak"]
            for cat in ("params", "grads", "optimizer"):
                predicted = getattr(theory, cat)
                if predicted == 0:
                    assert peak[cat] == 0, (strategy, n, cat)
                else:
                    assert _within(peak[cat], predicted), (strategy, n, r, cat, peak[cat], predicted)


@pytest.fixture(scope="module")
def bf16_reports():
    return {s: dl.train(s, world_size=4, steps=2, precision="bf16-mixed", global_batch=8)
            for s in ("ddp", "zero1", "zero2", "zero3")}


def test_bf16_mixed_ledger_matches_theory(bf16_reports):
    """bf16 mixed with fp32 master weights: 2 + 2 + 12 bytes per parameter, ZeRO dividing by N."""
    for strategy, report in bf16_reports.items():
        stage = 0 if strategy == "ddp" else int(strategy[-1])
        theory = dl.theory.memory(param_numel(report), dp=4, zero=stage, precision="bf16-mixed",
                                  optimizer="adam", master_weights=True)
        for r in range(4):
            peak = report.memory[r]["peak"]
            for cat in ("params", "grads", "optimizer"):
                predicted = getattr(theory, cat)
                assert _within(peak[cat], predicted), (strategy, r, cat, peak[cat], predicted)
        # and in the trace, for the plot
        samples = report.run.trace.memory_samples(rank=0)
        assert samples and max(e.args["optimizer"] for e in samples) == report.memory[0]["peak"]["optimizer"]
    fig = dl.viz.memory(bf16_reports["zero3"].run.trace,
                        predicted=dl.theory.memory(param_numel(bf16_reports["zero3"]), dp=4, zero=3,
                                                   precision="bf16-mixed"))
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) == 4 * 2 * 5


def test_saved_tensor_hooks_count_activations_exactly():
    ledger = dl.memory.Ledger()
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with ledger.activations():
        h = torch.tanh(x @ w)           # matmul saves x (4*8*4 B; w is a parameter), tanh saves h (4*8*4 B)
        loss = h.sum()
    assert ledger.saved.current == 2 * 4 * 8 * 4
    row = ledger.sample("forward", trace=False, params=w.numel() * 4)
    assert row["activations"] == 256 and row["params"] == 256
    loss.backward()
    del h, loss
    assert ledger.saved.current == 0 and ledger.saved.peak == 256
    assert ledger.peak["activations"] == 256 and ledger.peak_total == 512
    with pytest.raises(ValueError, match="unknown memory categories"):
        ledger.sample("bad", weights=1)


@pytest.mark.parametrize("strategy", ["pp-1f1b", "3d:dp=1,tp=1,pp=2"])
def test_a_generous_memory_limit_reports_the_same_peaks(strategy):
    """A limit that is never crossed changes nothing reported: the budget's checks read the pipeline's stash
    peak (which each read resets), so the ledger's samples must still see it (they saw 0 activations)."""
    free, limited = (dl.train(strategy, world_size=2, model="gpt-tiny", steps=2, seed=0, memory_limit=limit)
                     for limit in (None, "64MB"))
    assert [m["peak"] for m in limited.memory] == [m["peak"] for m in free.memory]
    assert all(m["peak"]["activations"] > 0 for m in limited.memory)
