"""ZeRO 1/2/3 and the sharded optimizer: exactness against `single`, and the sharding invariants."""
from __future__ import annotations

import math

import pytest
import torch

import distlab as dl
from _data_parallel_runs import CASES, assert_matches_single, param_numel, run, same_losses

ZERO = [i for i, c in enumerate(CASES) if c[0].startswith("zero")]


@pytest.mark.parametrize("index", ZERO, ids=[f"{CASES[i][0]}-x{CASES[i][1]}-{CASES[i][2]}" for i in ZERO])
def test_zero_matches_single(index):
    strategy, n, optimizer, _ = CASES[index]
    report = run(index)
    assert_matches_single(report, optimizer)
    # sharding invariants, from the memory ledger of rank 0 and the last rank
    psi = param_numel(report)
    shard = 4 * math.ceil(psi / n)
    stage = int(strategy[-1])
    for r in (0, n - 1):
        peak = report.memory[r]["peak"]
        states = 2 if optimizer == "adamw" else 0           # SGD without momentum keeps no state
        if states:
            assert abs(peak["optimizer"] - states * shard) <= 0.01 * shard * states, peak   # 1/N of the state
        if stage == 1:
            assert peak["grads"] == 4 * psi, peak                        # ZeRO-1: whole gradients
        else:
            assert abs(peak["grads"] - shard) <= 0.01 * shard, peak     # ZeRO-2/3: gradients 1/N
        if stage == 3:
            assert abs(peak["params"] - shard) <= 0.01 * shard, peak    # ZeRO-3: parameters 1/N at rest
            # gathered one unit at a time (prefetch: two blocks and the root, all of this tiny model)
            assert 0 < peak["buffers"] <= 4 * psi * 1.01, peak
            if not CASES[index][3].get("prefetch"):
                assert peak["buffers"] < 4 * psi, peak


def test_bytes_per_step_match_theory():
    """DDP, ZeRO-1, ZeRO-2: 2 (N-1)/N Psi bytes sent per rank per step; ZeRO-3: 3 (N-1)/N Psi (within 1%)."""
    for index, (strategy, n, _optimizer, _) in enumerate(CASES):
        report = run(index)
        stage = 0 if strategy == "ddp" else int(strategy[-1])
        predicted = dl.theory.comm.zero_volume(stage, 4 * param_numel(report), n)
        for r in range(n):
            measured = report.comm[r]["sent_per_step"]
            assert abs(measured - predicted) <= 0.01 * predicted, (strategy, n, r, measured, predicted)


def test_ring_and_torch_collectives_send_the_same_bytes():
    a = dl.train("zero3", world_size=3, steps=1, comm="ring", global_batch=6)
    b = dl.train("zero3", world_size=3, steps=1, comm="torch", global_batch=6)
    assert [c["sent"] for c in a.comm] == [c["sent"] for c in b.comm]
    assert same_losses(a.losses, b.losses, 1e-6)
    ops = {e.name for e in a.run.trace.comms()}
    assert {"ring_all_gather", "ring_reduce_scatter"} <= ops       # real send/recv, traced by dl.comm


def test_clipping_grad_accum_and_bf16():
    """Global-norm clipping and gradient accumulation match single; bf16-mixed trains."""
    kw = dict(steps=3, global_batch=8, clip=0.05, lr=0.1, optimizer="sgd")
    ref = dl.train("single", **kw)
    z3 = dl.train("zero3", world_size=2, **kw)
    assert same_losses(z3.losses, ref.losses)
    z2 = dl.train("zero2", world_size=2, grad_accum=2, **kw)      # 2 micro-steps of 4 rows
    assert same_losses(z2.losses, ref.losses)
    for k, v in ref.params.items():
        assert torch.allclose(z2.params[k], v, rtol=1e-5, atol=1e-7), k
    bf16 = dl.train("zero2", world_size=2, steps=8, precision="bf16-mixed", lr=3e-3, global_batch=8, clip=1.0)
    assert bf16.losses[-1] < bf16.losses[0] - 0.2


def _sharded_optimizer_and_zero3_rest():
    """On each rank: ShardedOptimizer(SGD momentum) vs torch SGD; ZeRO-3's state at rest."""
    n, r = dl.world_size(), dl.rank()
    torch.manual_seed(0)
    ref = dl.models.MLP((16, 33, 7))                  # 16*33+33+33*7+7 = 799 elements: uneven over 3
    model = dl.models.MLP((16, 33, 7))
    model.load_state_dict(ref.state_dict())
    x = torch.randn(12, 16)
    opt = dl.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, bucket_mb=0.001)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        model(x.chunk(n)[r]).pow(2).mean().backward()          # each rank: its rows (equal: 12/3)
        opt.step()
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    mine, total = opt.numel()
    state = sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim())
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7)
               for a, b in zip(model.parameters(), ref.parameters()))
    # ZeRO-3 at rest: only shards; full_state_dict gathers the whole model
    torch.manual_seed(1)
    gpt = dl.models.build("gpt-tiny", 1)
    full_before = {k: v.clone() for k, v in gpt.state_dict().items()}
    z3 = dl.ZeRO(gpt, stage=3, optim=torch.optim.AdamW, lr=1e-3)
    at_rest = sum(p.untyped_storage().nbytes() for p in gpt.parameters())
    gathered = z3.full_state_dict()
    return dict(same=same, mine=mine, total=total, state=state, buckets=len(opt.buckets), at_rest=at_rest,
                gathered=all(torch.equal(gathered[k], v) for k, v in full_before.items()),
                after=sum(p.untyped_storage().nbytes() for p in gpt.parameters()))


def test_sharded_optimizer_any_torch_optimizer_and_zero3_at_rest():
    run_ = dl.launch(_sharded_optimizer_and_zero3_rest, world_size=3)
    for res in run_.results:
        assert res["same"]
        assert res["total"] == 799 and res["mine"] <= math.ceil(799 / 3) + res["buckets"]
        assert res["state"] == res["mine"]                # momentum buffer: this rank's shard only
        assert res["at_rest"] == 0 and res["after"] == 0  # no full parameter stays allocated
        assert res["gathered"]
