"""The textbook 1F1B (`pipeline/one_f_one_b.py`: three loops, sends and receives inline) against the
executor running ``schedule("1f1b")``: the same loss and gradients to the bit, and the same actions in
the same order, read from outside by module hooks (a forward hook per F, a hook on its output's
gradient per B), at 2-4 stages and m = p - 1, p and 2p + 1 microbatches.
"""
from __future__ import annotations

import functools

import pytest
import torch

import distlab as dl
from distlab import models

CFG = models.GPTConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=4)
BATCH = 12


def _microbatches(p: int) -> list[int]:
    return [p - 1, p, 2 * p + 1]


def _watch(stage: torch.nn.Module, log: list):
    """Log ("F", j) when microbatch j's forward runs and ("B", j) when its output's gradient arrives."""
    def forward(module, args, out):
        j = sum(kind == "F" for kind, _ in log)
        log.append(("F", j))
        out.register_hook(lambda grad: log.append(("B", j)))
    return stage.register_forward_hook(forward)


def _run(stage, how, x, y, m):
    """One step of ``how``; returns (loss, {name: grad}, actions in order), the grads then zeroed."""
    log: list = []
    handle = _watch(stage, log)
    loss = how(x, y, m)
    handle.remove()
    grads = {n: q.grad.clone() for n, q in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    return loss, grads, log


def _both(p: int) -> list[dict]:
    torch.manual_seed(0)
    stage = dl.pp.stage_module(models.GPT(CFG), dl.rank(), p)
    x, y = models.MarkovTokens(CFG.vocab, CFG.seq_len, seed=0).batch(0, BATCH)
    first, last = dl.rank() == 0, dl.rank() == p - 1
    x, y = (x if first else None), (y if last else None)
    out = []
    for m in _microbatches(p):
        pipe = dl.pp.Pipeline(stage, dl.rank(), p, schedule="1f1b", microbatches=m)
        executor = _run(stage, lambda x, y, m, pipe=pipe: pipe.step(x, y), x, y, m)
        textbook = _run(stage, lambda x, y, m: dl.pp.one_f_one_b(stage, x, y, m), x, y, m)
        out.append({"m": m, "executor": executor, "textbook": textbook})
    return out


@functools.lru_cache(maxsize=None)
def _results(p: int):
    return dl.launch(_both, world_size=p, args=(p,), output="quiet").results


@pytest.mark.parametrize("p", [2, 3, 4])
def test_textbook_1f1b_equals_the_executor(p):
    for r, per_m in enumerate(_results(p)):
        for case in per_m:
            m, (loss_e, grads_e, _), (loss_t, grads_t, _) = case["m"], case["executor"], case["textbook"]
            if r == p - 1:
                assert torch.equal(loss_t, loss_e), (r, m, loss_t, loss_e)
            else:
                assert loss_t is None and loss_e is None
            assert grads_t.keys() == grads_e.keys()
            for name in grads_e:
                assert torch.equal(grads_t[name], grads_e[name]), (r, m, name)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_textbook_1f1b_runs_the_schedule(p):
    for r, per_m in enumerate(_results(p)):
        for case in per_m:
            m = case["m"]
            planned = [(a.kind, a.microbatch) for a in dl.pp.schedule("1f1b", p, m)[r]]
            assert case["textbook"][2] == planned, (r, m)
            assert case["executor"][2] == planned, (r, m)


def test_the_three_loops_are_in_the_file():
    import inspect
    source = inspect.getsource(dl.pp.one_f_one_b)
    for loop in ("# warm-up", "# steady state", "# cool-down"):
        assert loop in source
    assert len(source.splitlines()) <= 60
