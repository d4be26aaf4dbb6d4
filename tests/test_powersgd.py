"""PowerSGD (Vogels et al. 2019): full rank equals plain DDP, bytes = (n + m) r per matrix, replicas stay
equal, error feedback loses nothing (the telescoping sum) and keeps convergence; options refused early."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import distlab as dl
from distlab.comm import ring_bytes
from distlab.parallel.data.powersgd import PowerSGDDDP, matrix_view

ROWS = 10                                   # uneven over 3 ranks: (4, 3, 3)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 5))     # matrices (9, 12), (5, 9)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 12, generator=g), torch.randn(ROWS, 5, generator=g)


def _loss(model, x, y, rows_total):
    """This rank's rows weighted by n n_r / B, so the average over ranks is the full-batch mean loss."""
    n = dl.world_size()
    return nn.functional.mse_loss(model(x), y) * n * x.shape[0] / rows_total


def _grads_full_batch(ref, step):
    ref.zero_grad()
    x, y = _batch(step)
    nn.functional.mse_loss(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


def _full_rank_and_bytes(out):
    """Rank 9 >= min(n, m) for both matrices: the step's gradients are the full-batch gradients."""
    n, r, tr = dl.world_size(), dl.rank(), dl.tracer()
    model, ref = _model(), _model()
    ddp = PowerSGDDDP(model, rank=9, comm="ring")
    x, y = _batch(0)
    before = len(tr.events())
    _loss(ddp, x.tensor_split(n)[r], y.tensor_split(n)[r], ROWS).backward()
    out["full_rank_grad_err"] = max((p.grad - g).abs().max().item()
                                    for p, g in zip(model.parameters(), _grads_full_batch(ref, 0)))
    out["full_rank_error_memory"] = max(e.abs().max().item() for e in ddp.compressor.errors)
    out["elements"] = ddp.elements_per_step()
    out["sent"] = _sent_since(tr, before)
    out["sent_expected"] = sum(ring_bytes(k, 4, n, r)[0] for k in (9 + 5, 9 * 9 + 5 * 5, 12 * 9 + 9 * 5))
    # (vectors whole, P's (n r: ranks capped at min(n, m) = 9 and 5), Q's (m r))
    ddp.comm.close()


def _sent_since(tr, before: int) -> int:
    return sum(e.sent for e in tr.events()[before:] if e.kind == "comm")


def _train(rank, error_feedback, steps=40, lr=0.2):
    """SGD with PowerSGD at ``rank``; returns (losses of the full batch, this rank's parameters)."""
    n, r = dl.world_size(), dl.rank()
    model = _model()
    ddp = PowerSGDDDP(model, rank=rank, error_feedback=error_feedback)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = _batch(step % 4)
        opt.zero_grad()
        _loss(ddp, x.tensor_split(n)[r], y.tensor_split(n)[r], ROWS).backward()
        opt.step()
        with torch.no_grad():
            losses.append(nn.functional.mse_loss(model(x), y).item())
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


def _telescoping(out, steps=5):
    """Parameters held fixed: sum_t G_t (applied) + mean_i e_i = sum_t mean_i g_i (nothing lost)."""
    n, r = dl.world_size(), dl.rank()
    model, ref = _model(), _model()
    ddp = PowerSGDDDP(model, rank=1)
    applied = [torch.zeros_like(p) for p in model.parameters()]
    true = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(steps):
        model.zero_grad()
        x, y = _batch(step)
        _loss(ddp, x.tensor_split(n)[r], y.tensor_split(n)[r], ROWS).backward()
        for a, t, p, g in zip(applied, true, model.parameters(), _grads_full_batch(ref, step)):
            a += p.grad
            t += g
    out["applied"] = [matrix_view(a) for a, p in zip(applied, model.parameters()) if p.dim() == 2]
    out["true"] = [matrix_view(t) for t, p in zip(true, model.parameters()) if p.dim() == 2]
    out["errors"] = [e.clone() for e in ddp.compressor.errors]


def _checks():
    out = {}
    _full_rank_and_bytes(out)
    _telescoping(out)
    out["plain"] = _train(9, True)
    out["ef"] = _train(1, True)
    out["no_ef"] = _train(1, False)
    return out


@functools.lru_cache(maxsize=None)
def _run(n: int):
    return dl.launch(_checks, world_size=n, output="quiet")


@pytest.mark.parametrize("n", [2, 3])
def test_powersgd_invariants(n):
    results = _run(n).results
    for res in results:
        assert res["full_rank_grad_err"] < 1e-5                       # r = min(n, m): plain DDP
        assert res["full_rank_error_memory"] < 1e-5                   # and nothing left over
        assert res["elements"] == dl.theory.powersgd_elements([(9, 12), (5, 9)], 9, 9 + 5)
        assert res["sent"] == res["sent_expected"]                    # the real sends of the ring
    # replicas equal, whatever the compression
    for key in ("plain", "ef", "no_ef"):
        assert all(torch.equal(res[key][1], results[0][key][1]) for res in results)
    # error feedback: sum of applied + mean error = sum of true averaged gradients
    for i in range(2):
        mean_error = sum(res["errors"][i] for res in results) / n
        err = (results[0]["applied"][i] + mean_error - results[0]["true"][i]).abs().max().item()
        assert err < 1e-5, err
    plain, ef, no_ef = (results[0][k][0] for k in ("plain", "ef", "no_ef"))
    assert ef[-1] < 1.1 * plain[-1], (ef[-1], plain[-1])             # rank 1 with EF converges like DDP
    assert ef[-1] < no_ef[-1], (ef[-1], no_ef[-1])                   # and better than without EF


def test_powersgd_bytes_formula():
    assert dl.theory.powersgd_elements([(100, 50)], 4) == 600
    assert dl.theory.powersgd_elements([(3, 2)], 8, vector_numel=5) == 5 * 2 + 5
    assert dl.theory.powersgd_ratio([(100, 50)], 4) == pytest.approx(5000 / 600)


def test_train_option_matches_single_at_full_rank():
    kw = dict(model="mlp", steps=3, global_batch=10, optimizer="sgd", lr=0.1, seed=0)
    single = dl.train("single", **kw)
    ddp = dl.train("ddp", world_size=3, compression="powersgd", powersgd_rank=1024, **kw)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ddp.losses, single.losses))
    for k, v in single.params.items():
        assert torch.allclose(ddp.params[k], v, atol=1e-5, rtol=1e-5), k


def test_bad_options_refused_before_any_rank():
    with pytest.raises(ValueError, match="compression"):
        dl.train("ddp", world_size=2, model="mlp", compression="topk")
    with pytest.raises(ValueError, match="powersgd_rank"):
        dl.train("ddp", world_size=2, model="mlp", compression="powersgd", powersgd_rank=0)
    with pytest.raises(TypeError):
        dl.train("zero2", world_size=2, model="mlp", compression="powersgd")
    with pytest.raises(ValueError, match="rank"):
        dl.parallel.data.PowerSGD([(4, 4)], rank=0)


RESUME = dict(model="gpt-tiny", steps=6, global_batch=9, seed=0, compression="powersgd", powersgd_rank=1)


def test_a_restart_resumes_powersgd_exactly(tmp_path):
    """The Q's and every rank's error memory are in the checkpoint: killed after step 3 and restarted
    from step 2 on the same 3 ranks, the run equals the uninterrupted one bit for bit (without them it
    did not: the errors restarted from zero)."""
    plain = dl.train("ddp", world_size=3, **RESUME)
    restarted = dl.train("ddp", world_size=3, **RESUME, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                         fail_at_step=3, max_restarts=1)
    assert restarted.restarts and restarted.losses == plain.losses
    assert all(torch.equal(restarted.params[k], plain.params[k]) for k in plain.params)


def test_a_resharded_resume_restarts_the_compressor(tmp_path):
    """On fewer ranks the per-rank errors cannot be cut: the run goes on from the saved model and
    optimizer with fresh PowerSGD state, and still trains."""
    dl.train("ddp", world_size=3, **{**RESUME, "steps": 2}, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    resumed = dl.train("ddp", world_size=2, **RESUME, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                       resume=True)
    assert resumed.results[0].info["checkpoint"]["resumed_from"] == 2 and len(resumed.losses) == 6
    assert resumed.losses[-1] < resumed.losses[2]


def test_a_resume_with_another_powersgd_rank_restarts_the_compressor(tmp_path):
    """powersgd_rank is a layout fact: another rank on resume reshards (fresh Q's and errors), not a
    crash on Q's of the wrong shape."""
    dl.train("ddp", world_size=2, **{**RESUME, "steps": 2}, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    resumed = dl.train("ddp", world_size=2, **{**RESUME, "powersgd_rank": 2}, checkpoint_dir=str(tmp_path),
                       checkpoint_every=2, resume=True)
    assert resumed.results[0].info["checkpoint"]["resumed_from"] == 2 and len(resumed.losses) == 6
