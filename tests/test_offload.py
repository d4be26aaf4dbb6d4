"""Offload (ZeRO-Offload, ZeRO-Infinity): the optimizer state in host memory or in files, stepped there.

Both tiers equal the same strategy without offload to the bit (fp32), for ZeRO stages 1-3, ZeRO-1 on its
own, fully_shard with its user-built optimizer, and through `dl.train`; the ledger moves the optimizer's
bytes to ``host`` / ``disk``; a memory limit that the model states break without offload holds with it;
``offload="disk"`` measurably lowers the tensors alive in the process at the step's peak; and an
offloaded optimizer's state round-trips through its state_dict and through `dl.train`'s checkpoints.
"""
from __future__ import annotations

import gc

import pytest
import torch

import distlab as dl
from distlab.memory import storage_bytes

TIERS = (None, "cpu", "disk")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 7))


def _train(wrapped, optimizer, steps: int = 3) -> None:
    for s in range(steps):
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(s))
        wrapped(x[dl.rank()::dl.world_size()]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _zero_runs(stage: int, offload: str | None):
    """Three steps of ``dl.ZeRO(stage)`` (0: `dl.ShardedOptimizer` under a plain module), tiny buckets so
    the shards are many; the final parameters and the ledger's model states."""
    kw = {} if offload is None else {"offload": offload}
    if stage == 0:
        model = _model()
        for p in model.parameters():               # the same start on every rank (ZeRO's wrappers broadcast)
            torch.distributed.broadcast(p.data, 0)
        opt = dl.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_mb=0.001, **kw)
        _train(model, opt)
        return {k: v.clone() for k, v in model.state_dict().items()}, {}
    zero = dl.ZeRO(_model(), stage=stage, optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, bucket_mb=0.001,
                   **kw)
    _train(zero, zero.optimizer)
    return zero.full_state_dict(), dl.memory.zero_memory(zero)()


def _every_zero(_=None):
    out = {}
    for stage in (0, 1, 2, 3):
        for tier in TIERS:
            out[stage, tier] = _zero_runs(stage, tier)
    return out


@pytest.mark.parametrize("world", [2, 3])            # 3: uneven flat shards (padding)
def test_zero_offload_equals_zero_to_the_bit(world):
    """Every stage (and ZeRO-1 on its own), both tiers, equal the same run without offload: same
    parameters, bit for bit; the optimizer's bytes move to ``host`` (cpu) or ``disk``."""
    runs = dl.launch(_every_zero, world_size=world, output="quiet").results
    for r, out in enumerate(runs):
        for stage in (0, 1, 2, 3):
            ref, ref_mem = out[stage, None]
            for tier in ("cpu", "disk"):
                got, mem = out[stage, tier]
                assert all(torch.equal(ref[k], got[k]) for k in ref), (r, stage, tier)
                if stage:
                    assert mem["optimizer"] == 0 < ref_mem["optimizer"]
                    assert "host" not in ref_mem and "disk" not in ref_mem
            if stage:
                cpu, disk = out[stage, "cpu"][1], out[stage, "disk"][1]
                assert cpu["host"] >= ref_mem["optimizer"] and cpu["disk"] == 0       # state + fp32 masters
                assert disk["host"] == 0 and disk["disk"] >= ref_mem["optimizer"]     # all in files


def _fsdp_run(offload):
    from distlab.parallel.zero import OffloadedOptimizer
    model = _model()
    for layer in (model[0], model[2]):
        dl.fully_shard(layer)
    dl.fully_shard(model)
    if offload is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = OffloadedOptimizer(model.parameters(), torch.optim.AdamW, offload=offload, lr=1e-2)
    _train(model, opt)
    return dl.full_state_dict(model)


def _fsdp_all(_=None):
    return {tier: _fsdp_run(tier) for tier in TIERS}


def test_fully_shard_with_an_offloaded_optimizer_equals_plain():
    """The user's optimizer of a fully_shard-ed model, offloaded (`OffloadedOptimizer` over the shards),
    steps exactly as the plain one, at 4 ranks (uneven shards: 7 rows over 4)."""
    for out in dl.launch(_fsdp_all, world_size=4, output="quiet").results:
        for tier in ("cpu", "disk"):
            assert all(torch.equal(out[None][k], out[tier][k]) for k in out[None]), tier


KW = dict(model="gpt-tiny", steps=2, seed=0, world_size=2)


@pytest.mark.parametrize("strategy,tier,precision", [
    ("zero1", "disk", "fp32"), ("zero2", "cpu", "fp32"), ("zero3", "disk", "fp32"), ("fsdp", "cpu", "fp32"),
    ("zero2", "cpu", "fp16-mixed"), ("zero3", "cpu", "bf16-mixed")])
def test_train_with_offload_equals_without(strategy, tier, precision, tmp_path):
    """fp32, and mixed precision too: the fp32 masters move to the host and get the same fp32 gradients
    (fp16: unscaled), so the low-precision parameters copied back are the same bits."""
    plain = dl.train(strategy, **KW, precision=precision)
    dirs = {"offload_dir": tmp_path / "off"} if tier == "disk" else {}
    off = dl.train(strategy, **KW, offload=tier, precision=precision, **dirs)
    assert off.losses == plain.losses
    assert all(torch.equal(off.params[k], plain.params[k]) for k in plain.params)
    for mem, ref in zip(off.memory, plain.memory):
        assert mem["peak"]["optimizer"] == 0 < ref["peak"]["optimizer"]
        assert mem["peak"]["host" if tier == "cpu" else "disk"] >= ref["peak"]["optimizer"]
        assert mem["peak_total"] < ref["peak_total"]                    # the device holds less
    if tier == "disk":
        assert not any((tmp_path / "off").iterdir())                    # the files go with the run


def test_memory_limit_a_model_that_fits_only_offloaded():
    """A limit between the device's peak with and without offload: the run without offload runs out of
    memory (the optimizer state is what grew), the offloaded one trains."""
    plain = dl.train("zero2", **KW)
    off = dl.train("zero2", **KW, offload="cpu")
    limit = (plain.memory[0]["peak_total"] + off.memory[0]["peak_total"]) // 2
    with pytest.raises(dl.LaunchError, match="MemoryLimitExceeded: out of memory"):     # raised in a rank
        dl.train("zero2", **KW, memory_limit=limit)
    fits = dl.train("zero2", **KW, memory_limit=limit, offload="cpu")
    assert fits.losses == plain.losses


def _live_tensor_bytes() -> int:
    """Bytes of every tensor alive in this process (distinct storages), found by the garbage collector."""
    return storage_bytes([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])


def _peak_live(offload):
    """The most tensor bytes alive in the process during the second optimizer step (sampled after each
    shard's step) above those alive before the run, ZeRO-2 over many small buckets; and the optimizer
    state's total."""
    gc.collect()
    before = _live_tensor_bytes()
    zero = dl.ZeRO(dl.models.build("gpt-tiny", 0), stage=2, optim=torch.optim.AdamW, lr=1e-3, bucket_mb=0.02,
                   offload=offload)
    peak = {"bytes": 0, "on": False}

    def sample(*_):
        if peak["on"]:
            peak["bytes"] = max(peak["bytes"], _live_tensor_bytes())
    for o in zero.optimizer.optimizer.optimizers[::3]:           # every third shard: gc walks are slow
        o.register_step_post_hook(sample)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dl.rank()))
    for step in range(2):
        zero(x).float().mean().backward()
        peak["on"] = step == 1                        # sample the second step: the state exists throughout
        zero.optimizer.step()
        zero.optimizer.zero_grad()
    state = sum(s.numel() for s in zero.optimizer.shards) * 12           # Adam's two moments + fp32 master
    zero.optimizer.optimizer.close()
    return peak["bytes"] - before, state, len(zero.optimizer.shards)


def _both_live(_=None):
    return {tier: _peak_live(tier) for tier in ("disk", "cpu")}


def test_disk_offload_lowers_the_live_tensors_at_the_step_peak():
    """offload="disk" streams the state shard by shard: at the step's peak the process holds about
    three shards' state (stepping, read ahead, being written), not all of it (measured over every
    tensor alive, through the garbage collector)."""
    for out in dl.launch(_both_live, world_size=2, output="quiet").results:
        (cpu_peak, state, shards), (disk_peak, _, _) = out["cpu"], out["disk"]
        assert shards >= 8
        assert cpu_peak - disk_peak >= state * (1 - 4 / shards) * 0.9, (cpu_peak, disk_peak, state)
        assert disk_peak < cpu_peak - 0.6 * state


def test_offload_options_are_refused_before_ranks_start(tmp_path):
    with pytest.raises(ValueError, match="offload='disk'"):
        dl.train("zero2", **KW, offload="cpu", offload_dir=tmp_path)
    with pytest.raises(ValueError, match="offload"):
        dl.train("zero2", **KW, offload="gpu")
    with pytest.raises(TypeError, match="offload"):
        dl.train("ddp", **KW, offload="cpu")
    with pytest.raises(ValueError, match="'cpu'"):
        dl.OffloadedOptimizer([torch.zeros(2, requires_grad=True)], offload="nvme")


def test_theory_step_time_is_the_transfer_formula():
    t = dl.theory.offload.step_time(1e9, dp=4, tier="disk", host_bandwidth=25e9, disk_bandwidth=3e9)
    assert t.host == pytest.approx(8 * 1e9 / 4 / 25e9)
    assert t.disk == pytest.approx(2 * 12 * 1e9 / 4 / 3e9)
    assert dl.theory.offload.step_time(1e9, tier="cpu").disk == 0


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_an_offloaded_optimizers_state_dict_round_trips(tier, tmp_path):
    """Saved after two steps, loaded into a fresh optimizer (disk: in another directory) over parameters
    of the same values: the next steps are the same to the bit (the masters, Adam's moments, the step
    count and the learning rate all came back)."""
    def make():
        torch.manual_seed(0)
        return [torch.randn(5, 3), torch.randn(7)]

    def steps(params, opt, which):
        for s in which:
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s + p.numel()))
            opt.step()

    dirs = {"offload_dir": tmp_path / "a"} if tier == "disk" else {}
    a = make()
    opt = dl.OffloadedOptimizer(a, torch.optim.AdamW, offload=tier, lr=1e-2, **dirs)
    steps(a, opt, [0, 1])
    opt.param_groups[0]["lr"] = 5e-3
    saved = opt.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    b = [p.clone() for p in a]
    other = dl.OffloadedOptimizer(b, torch.optim.AdamW, offload=tier, lr=1.0,
                                  **({"offload_dir": tmp_path / "b"} if tier == "disk" else {}))
    other.load_state_dict(saved)
    steps(a, opt, [2, 3])
    steps(b, other, [2, 3])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert other.param_groups[0]["lr"] == 5e-3 and other.param_groups[1]["lr"] == 1e-2
    for o in (opt, other):
        o.close()


@pytest.mark.parametrize("strategy,tier,precision,world,shrink", [
    ("zero2", "cpu", "fp32", 2, False), ("zero3", "disk", "bf16-mixed", 2, False),
    ("fsdp", "cpu", "fp32", 3, True)])
def test_train_with_offload_resumes_from_its_checkpoints(strategy, tier, precision, world, shrink, tmp_path):
    """A rank killed at step 3, the run restarted from the checkpoint of step 2: the same losses and final
    parameters, to the bit, as the uninterrupted offloaded run on the same world size (bf16 too: the fp32
    masters are saved). After a shrink to one rank fewer (resharded: the reduction order changes, so the
    uninterrupted run is matched only up to rounding) the reference is the same restart without offload."""
    kw = dict(model="gpt-tiny", steps=4, seed=0, precision=precision)
    restart = dict(fail_at_step=3, max_restarts=1, shrink=shrink, checkpoint_every=2)
    plain = (dl.train(strategy, world_size=world, **kw, checkpoint_dir=str(tmp_path / "plain"), **restart)
             if shrink else dl.train(strategy, world_size=world, **kw, offload=tier))
    r = dl.train(strategy, world_size=world, **kw, offload=tier, checkpoint_dir=str(tmp_path / "off"),
                 **restart)
    [again] = r.restarts
    assert again.resumed_from == 2 and r.world_size == world - shrink
    assert r.losses == plain.losses
    assert all(torch.equal(r.params[k], plain.params[k]) for k in plain.params)
