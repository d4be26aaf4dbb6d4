"""fp16 mixed precision with dynamic loss scaling, non-finite steps skipped on every rank, gradient-norm
spikes, and memory limits (`distlab.strategies.numerics`, `distlab.memory_budget`).

Every distributed run is compared with the single-process run of the same global batch doing the same
thing (the same scaler, the same planted NaN), at world sizes that split the batch unevenly."""
import math

import pytest
import torch

import distlab as dl
from distlab.checkpoint import store
from distlab.memory import Ledger, MemoryLimitExceeded, parse_bytes
from distlab.strategies.numerics import LossScaler, SpikeWatch

FP16 = dict(steps=6, global_batch=10, precision="fp16-mixed", clip=1.0, loss_scale=2.0 ** 20,
            growth_interval=2)


def _adam_steps(state) -> list[float]:
    """Every Adam ``step`` counter found in a saved rank state."""
    if isinstance(state, dict):
        own = [float(v) for k, v in state.items() if k == "step" and isinstance(v, torch.Tensor)]
        return own + [c for k, v in state.items() if k != "step" for c in _adam_steps(v)]
    if isinstance(state, (list, tuple)):
        return [c for v in state for c in _adam_steps(v)]
    return []


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


# -- the loss scaler and the spike rule, on their own ------------------------------------------------
def test_loss_scaler_halves_on_overflow_and_grows_after_n_good_steps():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    loss = torch.tensor(1.5)
    assert s.scale_loss(loss).item() == 12.0
    g = [torch.tensor([8.0, -4.0])]
    s.unscale_(g)
    assert g[0].tolist() == [1.0, -0.5]
    s.update(found_nonfinite=True)
    assert s.scale == 4.0 and s.good_steps == 0
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0 and s.good_steps == 0                 # grown after 2 good steps in a row
    with pytest.raises(ValueError, match="loss_scale"):
        LossScaler(init_scale=float("inf"))


def test_spike_watch_flags_norms_above_k_times_the_running_median():
    w = SpikeWatch(factor=3.0, warmup=3)
    for step, norm in enumerate([1.0, 1.2, 0.9, 1.1, 5.0, math.nan, 1.0, 3.5]):
        w.record(step, norm)
    assert [s["step"] for s in w.spikes] == [4, 7]               # 5.0 > 3 x 1.05; 3.5 > 3 x 1.05
    assert w.spikes[0]["median"] == pytest.approx(1.05)
    with pytest.raises(ValueError, match="spike_factor"):
        SpikeWatch(factor=1.0)


# -- fp16-mixed: every data-parallel strategy equals the single-process run with the same scaler ------
def test_fp16_mixed_with_loss_scaling_matches_the_single_process_reference():
    kw = {**FP16, "loss_scale": 2.0 ** 15, "growth_interval": 3}   # no overflow anywhere up to 2^16 here
    ref = dl.train("single", **kw)
    assert ref.numerics["skipped"] == []
    assert ref.numerics["loss_scales"] == [2.0 ** 15] * 3 + [2.0 ** 16] * 3      # grown after 3 good steps
    fp32 = dl.train("single", **{k: v for k, v in kw.items() if k not in ("precision",)})
    assert _max_diff(ref.params, fp32.params) > 1e-3                 # fp16 really ran (params in fp16)
    for strategy, n in (("ddp", 3), ("zero1", 2), ("zero2", 3), ("zero3", 3), ("fsdp", 2)):
        rep = dl.train(strategy, world_size=n, **kw)
        every = [r.info["numerics"] for r in rep.results]
        assert all(e["skipped"] == [] and e["loss_scales"] == ref.numerics["loss_scales"] for e in every)
        assert rep.losses == pytest.approx(ref.losses, rel=1e-3), (strategy, n)
        assert _max_diff(rep.params, ref.params) < 1e-2, (strategy, n)   # fp16 params: ~1 ulp at 1.0
        assert list(rep.numerics["grad_norms"].values()) == pytest.approx(
            list(ref.numerics["grad_norms"].values()), rel=2e-2), (strategy, n)


@pytest.mark.parametrize("strategy,n", [("single", 1), ("zero3", 3)])
def test_dynamic_loss_scale_skips_overflowing_steps_everywhere_and_follows_the_rule(strategy, n):
    """From S = 2^20 the scaled fp16 gradients overflow: those steps are skipped on every rank and S
    halves; after 2 good steps it doubles. (Which steps overflow may differ from the single process:
    an fp16 all-reduce *sums* N scaled gradients before averaging, so it needs log2(N) more bits of
    headroom; the rule and the agreement are what hold everywhere.)"""
    rep = dl.train(strategy, world_size=n, **FP16)
    every = [r.info["numerics"] for r in rep.results]
    skipped, scales = every[0]["skipped"], every[0]["loss_scales"]
    assert skipped[:2] == [0, 1]
    assert all(e["skipped"] == skipped and e["loss_scales"] == scales for e in every)
    replay = LossScaler(2.0 ** 20, growth_interval=2)
    for step in range(FP16["steps"]):
        assert scales[step] == replay.scale
        replay.update(step in skipped)
    assert every[0]["loss_scale"] == replay.scale
    assert all(math.isnan(every[0]["grad_norms"][s]) for s in skipped)
    assert all(math.isfinite(v) for v in rep.losses)


def test_fp16_loss_scale_is_checkpointed_and_resumes_bit_exact(tmp_path):
    kw = {**FP16, "global_batch": 8}
    straight = dl.train("ddp", world_size=2, **kw)
    dl.train("ddp", world_size=2, **{**kw, "steps": 3}, checkpoint_dir=tmp_path, checkpoint_every=3)
    resumed = dl.train("ddp", world_size=2, **kw, checkpoint_dir=tmp_path, checkpoint_every=3, resume=True)
    assert resumed.numerics["loss_scales"] == straight.numerics["loss_scales"][3:]
    assert resumed.losses == straight.losses
    assert _max_diff(resumed.params, straight.params) == 0.0


# -- a NaN planted on one rank: the step is skipped on every rank, never on one only -----------------
@pytest.mark.parametrize("strategy,n,plant_rank", [("ddp", 3, 1), ("zero2", 3, 2)])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(strategy, n, plant_rank, tmp_path):
    kw = dict(steps=4, global_batch=10, clip=1.0, nan_at_step=1, spike_factor=1.05)
    ref = dl.train("single", **kw, nan_rank=0)                     # the reference skips the same step
    assert ref.numerics["skipped"] == [1]
    rep = dl.train(strategy, world_size=n, **kw, nan_rank=plant_rank, checkpoint_dir=tmp_path,
                   checkpoint_every=4)
    # the optimizer state of every rank stepped 3 times in 4 steps (Adam's step counter, as saved)
    counters = [v for state in store.load_all(tmp_path, 4) for v in _adam_steps(state)]
    assert counters and all(c == 3 for c in counters), counters
    every = [r.info["numerics"] for r in rep.results]
    # only the planted rank saw a non-finite gradient; every rank skipped step 1, and only it
    assert [e["nonfinite_here"] for e in every] == [[1] if r == plant_rank else [] for r in range(n)]
    assert all(e["skipped"] == [1] for e in every)
    marks = rep.trace.select("mark", name="skipped step")
    assert sorted((e.rank, e.args["step"]) for e in marks) == [(r, 1) for r in range(n)]
    # replicas stayed equal: every rank's loss share is finite, and the result is the reference's
    assert all(math.isfinite(v) for v in rep.losses)
    assert rep.losses == pytest.approx(ref.losses, rel=1e-5)
    assert _max_diff(rep.params, ref.params) < 1e-4     # as ddp vs single differ with no NaN (Adam, fp32)
    # the norm of every stepped step is the global one, on every rank; spikes follow the stated rule
    for e in every:
        assert math.isnan(e["grad_norms"][1])
        assert [e["grad_norms"][s] for s in (0, 2, 3)] == pytest.approx(
            [ref.numerics["grad_norms"][s] for s in (0, 2, 3)], rel=1e-4)
    watch = SpikeWatch(1.05)
    for s, v in sorted(rep.numerics["grad_norms"].items()):
        watch.record(s, v)
    assert [s["step"] for s in rep.numerics["spikes"]] == [s["step"] for s in watch.spikes]
    # the agreement costs one all-reduce of a 4-byte flag per step
    assert rep.comm[0]["sent_by_op"].get("all_reduce", 0) > 0


def test_numerics_options_are_refused_where_unsupported_before_any_rank_starts():
    with pytest.raises(ValueError, match="fp16-mixed.*not by 'tp'"):
        dl.train("tp", world_size=2, precision="fp16-mixed")
    with pytest.raises(ValueError, match="nan_at_step"):
        dl.train("ddp", world_size=2, nan_at_step=-1)
    with pytest.raises(ValueError, match="nan_rank=2 but the ranks are 0 .. 1"):
        dl.train("ddp", world_size=2, nan_at_step=1, nan_rank=2)
    with pytest.raises(ValueError, match="skip_nonfinite"):
        dl.train("ddp", world_size=2, skip_nonfinite="yes")
    with pytest.raises(ValueError, match="spike_factor"):
        dl.train("ddp", world_size=2, spike_factor=0.5)
    with pytest.raises(ValueError, match="memory_limit"):
        dl.train("ddp", world_size=2, memory_limit="lots")
    with pytest.raises(TypeError, match="did you mean 'loss_scale'"):
        dl.train("ddp", world_size=2, loss_scal=2.0)
    with pytest.raises(ValueError, match="precision"):
        dl.train("single", precision="fp8")


# -- memory limits ---------------------------------------------------------------------------------
def test_train_tells_the_user_about_skipped_steps_and_spikes():
    from distlab.strategies.numerics import notes
    said = notes({"skipped": [0, 3], "loss_scale": 16384.0,
                  "grad_norms": {0: math.nan, 1: 1.0, 2: 1.1, 4: 9.0},
                  "spikes": [{"step": 4, "norm": 9.0, "median": 1.05, "ratio": 9.0 / 1.05}]})
    assert said == ["2 step(s) skipped on every rank for an inf/NaN gradient (step 0, 3); fp16 loss scale "
                    "now 16384", "gradient-norm spike at step 4: 9, 8.6 x the median of the 3 steps before"]


def test_parse_bytes():
    assert parse_bytes(1000) == 1000 and parse_bytes("64MB") == 64_000_000
    assert parse_bytes("1.5 KiB") == 1536 and parse_bytes("2GiB") == 2 ** 31
    for bad in ("-1MB", "64XB", "", True, None):
        with pytest.raises(ValueError, match="memory_limit"):
            parse_bytes(bad)


def test_the_ledger_raises_the_moment_forward_crosses_the_limit():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    ledger = Ledger(limit=300, measure=lambda: {"params": 256})     # 256 + the first 128 B saved > 300
    with pytest.raises(MemoryLimitExceeded, match="out of memory in forward of step 0.*activations") as err:
        with ledger.activations(), ledger.phase("forward", 0):
            torch.tanh(x @ w).sum()
    assert err.value.phase == "forward" and err.value.category == "activations"
    assert isinstance(err.value, torch.OutOfMemoryError)


def test_out_of_memory_in_backward_and_zero3_fits_under_the_same_limit():
    kw = dict(model="mlp", global_batch=4, steps=2, optimizer="sgd")
    free = dl.train("single", **kw).memory[0]["timeline"]
    total = {label: sum(row[c] for c in dl.memory.CATEGORIES) for label, row in free[3:5]}   # step 1
    # a large model, a small batch: weights + gradients (backward) outweigh weights + activations
    assert total["backward"] > total["forward"]
    limit = (total["forward"] + total["backward"]) // 2
    with pytest.raises(MemoryLimitExceeded, match="out of memory in backward of step 0") as err:
        dl.train("single", **kw, memory_limit=limit)
    assert err.value.category == "grads" and "zero3" in str(err.value)
    assert "backward" in [entry.name for entry in err.traceback]       # raised inside loss.backward()
    fits = dl.train("zero3", world_size=4, **kw, memory_limit=limit)   # params, grads / 4
    assert max(m["peak_total"] for m in fits.memory) <= limit
    with pytest.raises(dl.LaunchError, match="out of memory in forward"):
        dl.train("zero3", world_size=2, **kw, memory_limit=limit // 2)


def test_loss_scaler_agrees_with_torch_grad_scaler():
    """Beside PyTorch's own: the same model, the same gradients (an inf planted at steps 1 and 2), the
    same scale history and the same weights as ``torch.amp.GradScaler`` (init 2^10, growth after 2)."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    theirs.load_state_dict(ours.state_dict())
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs))
    scaler, gs = LossScaler(2.0 ** 10, growth_interval=2), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                                                 growth_interval=2)
    for step in range(7):
        x = torch.randn(5, 4)
        for model in (ours, theirs):
            loss = model(x).pow(2).mean()
            (scaler.scale_loss(loss) if model is ours else gs.scale(loss)).backward()
            if step in (1, 2):
                model.weight.grad[0, 0] = float("inf")
        assert scaler.scale == gs.get_scale()
        grads = [p.grad for p in ours.parameters()]
        scaler.unscale_(grads)
        found = any(not torch.isfinite(g).all() for g in grads)
        if not found:
            opt_a.step()
        scaler.update(found)
        gs.step(opt_b)
        gs.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b), step
    assert scaler.scale == gs.get_scale() == 2.0 ** 10       # 2^10, halved twice, doubled twice


def test_cli_fp16_and_memory_limit(capsys):
    from distlab import cli
    assert cli.main(["train", "--strategy", "single", "--steps", "2", "--precision", "fp16-mixed",
                     "--option", "nan_at_step=1"]) == 0
    assert "1 step(s) skipped on every rank" in capsys.readouterr().err
    assert cli.main(["train", "--strategy", "single", "--model", "mlp", "--optimizer", "sgd",
                     "--global-batch", "4", "--steps", "2", "--option", "memory_limit=1kB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distlab: error: out of memory in forward of step 0")
