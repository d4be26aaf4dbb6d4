"""DDP: exactness against `single`, and the invariants (replicas, buckets, no_sync, frozen/unused/tied)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import distlab as dl
from _data_parallel_runs import CASES, assert_matches_single, run, same_losses

DDP_CASES = [i for i, c in enumerate(CASES) if c[0] == "ddp"]


@pytest.mark.parametrize("index", DDP_CASES,
                         ids=[f"x{CASES[i][1]}-{CASES[i][2]}-{CASES[i][3]}" for i in DDP_CASES])
def test_ddp_matches_single(index):
    assert_matches_single(run(index), CASES[index][2])


class _WithUnused(nn.Module):
    """A tied-embedding GPT, a frozen final norm, and a layer the forward never calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = dl.models.GPT(dl.models.GPTConfig(tied=True, layers=1))
        self.gpt.ln_f.weight.requires_grad_(False)
        self.unused = nn.Linear(4, 4)

    def forward(self, ids):
        return self.gpt(ids)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _ddp_invariants():
    n, r, tr = dl.world_size(), dl.rank(), dl.tracer()
    data = dl.models.MarkovTokens(seed=0)
    out = {}
    model = _WithUnused()
    if r == 1:                                         # replicas start different: DDP must broadcast
        with torch.no_grad():
            model.gpt.tok.weight.add_(1.0)
    ddp = dl.DDP(model, bucket_mb=0.02)
    params = [p for p in model.parameters() if p.requires_grad]
    out["first_bucket_holds_last_param"] = ddp.buckets[0].params[0] is params[-1]
    out["frozen_in_no_bucket"] = all(p is not model.gpt.ln_f.weight for b in ddp.buckets for p in b.params)
    ref = _WithUnused()                               # every rank: the whole batch, no communication
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    checks = []
    for step in range(2):
        x, y = data.batch(step, 12)
        xs, ys = x.chunk(n)[r], y.chunk(n)[r]
        half = len(xs) // 2
        before = len(tr.export())
        with ddp.no_sync():                            # accumulate the first half locally
            (0.5 * _loss(ddp, xs[:half], ys[:half])).backward()
        out.setdefault("no_sync_events", []).append(len([e for e in tr.export()[before:] if e[0] == "comm"]))
        (0.5 * _loss(ddp, xs[half:], ys[half:])).backward()    # the second half syncs the sum
        _loss(ref, x, y).backward()
        grads_equal = all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
                          for p, q in zip(params, [q for q in ref.parameters() if q.requires_grad])
                          if q.grad is not None)
        unused_zero = torch.count_nonzero(model.unused.weight.grad).item() == 0
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(n)]
        torch.distributed.all_gather(gathered, flat)
        checks.append(dict(grads=grads_equal, unused_zero=unused_zero,
                           frozen=model.gpt.ln_f.weight.grad is None,
                           replicas=all(torch.equal(g, gathered[0]) for g in gathered),
                           tied=model.gpt.head.weight is model.gpt.tok.weight))
    out["checks"] = checks
    # overlap: the first bucket's all-reduce starts before backward has finished
    x, y = data.batch(9, 12)
    with tr.span("backward-probe"):
        _loss(ddp, x.chunk(n)[r], y.chunk(n)[r]).backward()
    probe = [e for e in tr.events() if e.name == "backward-probe"][-1]
    reduces = [e for e in tr.events() if e.kind == "comm" and e.start >= probe.start]
    out["buckets"], out["reduces"] = len(ddp.buckets), len(reduces)
    out["first_starts_inside_backward"] = reduces[0].start < reduces[-1].start <= probe.end
    # a pipeline's last backward (dl.pp.ReplicaGradSync): backward starts every bucket and does not wait
    for q in [*model.parameters(), *ref.parameters()]:
        q.grad = None
    x, y = data.batch(10, 12)
    sync = dl.pp.ReplicaGradSync(ddp)
    with ddp.no_sync(), sync.last_backward():
        _loss(ddp, x.chunk(n)[r], y.chunk(n)[r]).backward()
    out["in_flight_after_backward"] = ddp.in_flight
    sync.finish()
    out["in_flight_after_finish"] = ddp.in_flight
    _loss(ref, x, y).backward()
    out["started_sync_grads"] = all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
                                    for p, q in zip(params, [q for q in ref.parameters() if q.requires_grad])
                                    if q.grad is not None)
    # naive: one all-reduce per parameter, after backward
    naive = dl.NaiveDDP(_WithUnused())
    start = len(tr.export())
    _loss(naive, x.chunk(n)[r], y.chunk(n)[r]).backward()
    out["naive_calls"] = len([e for e in tr.export()[start:] if e[0] == "comm"])
    out["naive_params"] = len(naive.params)
    return out


def test_ddp_invariants():
    run_ = dl.launch(_ddp_invariants, world_size=3)
    for res in run_.results:
        assert res["first_bucket_holds_last_param"] and res["frozen_in_no_bucket"]
        assert res["no_sync_events"] == [0, 0]                 # no_sync sends nothing
        for c in res["checks"]:
            assert c == dict(grads=True, unused_zero=True, frozen=True, replicas=True, tied=True), c
        assert res["buckets"] > 1 and res["reduces"] == res["buckets"]
        assert res["first_starts_inside_backward"]
        assert res["in_flight_after_backward"] == res["buckets"] and res["in_flight_after_finish"] == 0
        assert res["started_sync_grads"]
        assert res["naive_calls"] == res["naive_params"]


def _naive_bucketed_single(steps: int = 3, rows: int = 7):
    """NaiveDDP, DDP (several buckets, overlapped) and one process on the whole batch, SGD, ``rows`` rows
    split unevenly (``tensor_split``); each rank's mean loss weighted by its share so the average is exact."""
    n, r, tr = dl.world_size(), dl.rank(), dl.tracer()
    data = dl.models.MarkovTokens(seed=0)
    torch.manual_seed(0)
    models = {k: dl.models.GPT(dl.models.GPTConfig(layers=2)) for k in ("naive", "ddp", "single")}
    for m in models.values():
        m.load_state_dict(models["single"].state_dict())
    wrapped = {"naive": dl.NaiveDDP(models["naive"]), "ddp": dl.DDP(models["ddp"], bucket_mb=0.01),
               "single": models["single"]}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.5) for k, m in models.items()}
    out = {"no_sync_events": 0}
    for step in range(steps):
        x, y = data.batch(step, rows)
        xs, ys = x.tensor_split(n)[r], y.tensor_split(n)[r]
        weight = n * xs.shape[0] / rows
        for k in ("naive", "ddp"):
            half = xs.shape[0] // 2
            before = len(tr.export())
            with wrapped[k].no_sync():                 # accumulate the first rows locally
                (weight * half / xs.shape[0] * _loss(wrapped[k], xs[:half], ys[:half])).backward()
            out["no_sync_events"] += len([e for e in tr.export()[before:] if e[0] == "comm"])
            rest = xs.shape[0] - half
            (weight * rest / xs.shape[0] * _loss(wrapped[k], xs[half:], ys[half:])).backward()
        _loss(models["single"], x, y).backward()
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    flat = {k: torch.cat([p.detach().flatten() for p in m.parameters()]) for k, m in models.items()}
    for k in ("naive", "ddp"):
        gathered = [torch.empty_like(flat[k]) for _ in range(n)]
        torch.distributed.all_gather(gathered, flat[k])
        out[f"{k}_replicas_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
        out[f"{k}_vs_single"] = ((flat[k] - flat["single"]).abs().max() / flat["single"].abs().max()).item()
    out["naive_vs_ddp"] = ((flat["naive"] - flat["ddp"]).abs().max() / flat["ddp"].abs().max()).item()
    out["buckets"] = len(wrapped["ddp"].buckets)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_naive_ddp_equals_ddp_equals_single(world):
    """7 rows over 2 or 3 ranks (4+3, 3+2+2): NaiveDDP, DDP and one process take the same steps."""
    for res in dl.launch(_naive_bucketed_single, world_size=world, output="quiet").results:
        assert res["buckets"] > 1
        assert res["no_sync_events"] == 0                      # no_sync sends nothing, in either class
        assert res["naive_replicas_equal"] and res["ddp_replicas_equal"]
        assert res["naive_vs_single"] <= 1e-5 and res["ddp_vs_single"] <= 1e-5, res
        assert res["naive_vs_ddp"] <= 1e-5, res


def test_ddp_grad_accum_equals_big_batch():
    """dl.train with grad_accum=2 (no_sync on the first micro-step) equals one big-batch step."""
    big = dl.train("single", steps=3, global_batch=8, lr=0.1, optimizer="sgd")
    acc = dl.train("ddp", world_size=2, steps=3, global_batch=8, grad_accum=2, lr=0.1, optimizer="sgd")
    assert same_losses(acc.losses, big.losses)
    for k, v in big.params.items():
        assert torch.allclose(acc.params[k], v, rtol=1e-5, atol=1e-7), k


def _fp16_averages(comm: str) -> list[float]:
    """Every rank holds 30000 in fp16 (max 65504): the sum of four overflows, the mean does not."""
    from distlab.parallel.flat_collectives import Collectives
    c = Collectives(comm)
    t = torch.full((8,), 30000.0, dtype=torch.float16)
    c.all_reduce(t, op="avg").wait()
    flat, out = torch.full((8,), 30000.0, dtype=torch.float16), torch.empty(2, dtype=torch.float16)
    c.reduce_scatter(flat, out, op="avg").wait()
    c.close()
    return [float(t.max()), float(out.max())]


@pytest.mark.parametrize("comm", ["torch", "ring"])
def test_an_fp16_average_divides_before_it_sums(comm):
    for averages in dl.launch(_fp16_averages, world_size=4, args=(comm,), timeout=60).results:
        assert averages == [30000.0, 30000.0]


def _summed_grads() -> list[list[float]]:
    """grad_summer over 3 ranks: rank r's gradients are r + 1 (one parameter has none on rank 0)."""
    from distlab.parallel.data.buckets import grad_summer
    r = dl.rank()
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    a.grad = torch.full((3,), r + 1.0)
    b.grad = None if r == 0 else torch.full((2, 2), r + 1.0)
    grad_summer([a, b], bucket_mb=0)()                          # every parameter its own bucket
    return [a.grad.tolist(), b.grad.flatten().tolist()]


def test_grad_summer_sums_over_the_group_counting_a_missing_gradient_as_zero():
    for a, b in dl.launch(_summed_grads, world_size=3, timeout=60).results:
        assert a == [6.0] * 3 and b == [5.0] * 4              # 1 + 2 + 3; 0 + 2 + 3
