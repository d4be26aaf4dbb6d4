"""Activation recomputation: ``recompute=True`` (full: `distlab.models.Block` under torch.utils.checkpoint)
and ``recompute="selective"`` (only attention's scores and softmax, `models.attention_core`).

Recomputing is the same arithmetic done again, so every strategy must train exactly as without it (bit
for bit on CPU). What a block keeps is Korthikanti et al.'s count to the byte (full: its input;
selective: all but the a s^2 b terms). The memory ledger counts what forward keeps and, through the
checkpoint's ``context_fn``, what backward saves again while it rebuilds one block: with gpt-tiny's two
blocks the activation peak about halves, and a memory limit between the two trips in backward. FSDP works
because its units put the gathered parameters back into the modules before their backward, where the
recomputation runs. Refused: models without blocks, the zero-bubble pipeline (its W pass would recompute),
full with mixtures of experts (the balance loss would count twice), selective with context parallelism.

``dl.recompute(module)`` does it for any module of a user's model (its forward under the checkpoint, its
hooks outside): the same weights under DDP, ZeRO-3, fully_shard, tp by a plan and pipeline stages, and
the ledger counts what backward rebuilds.
"""
from __future__ import annotations

import pytest
import torch

import distlab as dl

KW = dict(model="gpt-tiny", steps=3, global_batch=8, seed=0)


def _activation_peak(report) -> int:
    return max(m.get("peak", {}).get("activations", 0) for m in report.memory)


@pytest.mark.parametrize("strategy, world, options", [
    ("single", 1, {}), ("ddp", 2, {}), ("zero3", 2, {}), ("fsdp", 2, {}), ("fsdp", 4, {"hsdp": 2}),
    ("fsdp", 2, {"param_dtype": "bf16"}), ("tp-sp", 2, {}), ("cp-ring", 2, {}), ("3d:dp=2,tp=2,pp=1", 4, {})])
def test_recompute_trains_bit_for_bit_with_less_activation_memory(strategy, world, options):
    plain = dl.train(strategy, world_size=world, **KW, **options)
    again = dl.train(strategy, world_size=world, **KW, **options, recompute=True)
    assert again.losses == plain.losses
    assert all(torch.equal(again.params[k], plain.params[k]) for k in plain.params)
    assert _activation_peak(again) < 0.6 * _activation_peak(plain)


def test_the_ledger_counts_what_backward_rebuilds():
    """A "recompute" sample holds more than forward kept (the block being rebuilt), and a memory limit
    between what forward keeps and what backward rebuilds trips in backward, on the activations."""
    run = dict(model="gpt-tiny", global_batch=16, steps=1, recompute=True)
    timeline = dl.train("single", **run).memory[0]["timeline"]
    rows = {label: row for label, row in timeline}
    assert rows["recompute"]["activations"] > 1.5 * rows["forward"]["activations"]
    total = {label: sum(row[c] for c in dl.memory.CATEGORIES) for label, row in rows.items()}
    limit = (total["forward"] + total["recompute"]) // 2
    with pytest.raises(dl.memory.MemoryLimitExceeded) as caught:
        dl.train("single", **run, memory_limit=limit)
    assert caught.value.phase == "backward" and caught.value.category == "activations"


def test_recompute_is_refused_where_it_would_be_wrong(monkeypatch):
    import importlib

    def no_launch(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(importlib.import_module("distlab.launch"), "launch", no_launch)
    with pytest.raises(ValueError, match="balance loss twice"):       # (selective is fine: attention only)
        dl.train("ep", world_size=2, **{**KW, "model": "gpt-moe-tiny"}, recompute=True)
    with pytest.raises(ValueError, match="'selective' or False"):
        dl.train("ddp", world_size=2, **KW, recompute="yes")
    for strategy in ("cp-ring", "3d:dp=1,cp=2,tp=1"):
        with pytest.raises(ValueError, match="ring attention or Ulysses"):
            dl.train(strategy, world_size=2, **KW, recompute="selective")
    with pytest.raises(ValueError, match="has none"):
        dl.train("ddp", world_size=2, **{**KW, "model": "mlp"}, recompute=True)
    for strategy in ("pp-zb-h1", "3d:dp=1,tp=1,pp=2,schedule=zb-h1"):    # 1F1B, GPipe, interleaved run it
        with pytest.raises(ValueError, match="zero-bubble"):
            dl.train(strategy, world_size=2, **KW, recompute=True)


def test_the_cli_flag_reaches_train(monkeypatch):
    import sys

    from distlab.cli import main
    seen = []
    monkeypatch.setattr(sys.modules["distlab.train"], "train",
                        lambda *a, **k: seen.append(k) or (_ for _ in ()).throw(SystemExit(0)))
    with pytest.raises(SystemExit):
        main(["train", "--strategy", "ddp", "--world-size", "2", "--recompute"])
    assert seen[0]["recompute"] == "full"


def test_a_recomputing_block_keeps_what_korthikanti_counts_for_full_recomputation():
    """Full recomputation keeps only the layer's input: 2 s b h bytes in 16-bit (Korthikanti et al. 2022),
    4 s b h here in fp32, measured on one block's forward to the byte."""
    from distlab.memory import SavedActivations
    from distlab.theory.activations import activation_bytes_per_layer
    gpt = dl.models.build("gpt-tiny", 0)
    block, (b, s, h) = gpt.blocks[0], (16, 32, gpt.cfg.d_model)
    block.recompute = True
    with SavedActivations(gpt) as kept:
        block(torch.randn(b, s, h, requires_grad=True))
    assert kept.bytes == activation_bytes_per_layer(s, b, h, gpt.cfg.heads, recompute="full") * 4 / 2
    block.recompute = False
    with SavedActivations(gpt) as whole:
        block(torch.randn(b, s, h, requires_grad=True))
    assert whole.bytes > 10 * kept.bytes


@pytest.mark.parametrize("sp", [False, True])
def test_selective_recomputation_keeps_what_korthikanti_counts(sp):
    """Selective recomputation drops the attention scores' a s^2 b terms (and the causal mask), to the byte
    of `predicted_layer_bytes(recompute="selective")` + `unmodelled_bytes`, one block alone and through
    tensor parallelism (``measure_layer`` as in test_tensor_parallel)."""
    from distlab.memory import SavedActivations
    from distlab.theory.activations import predicted_layer_bytes, unmodelled_bytes
    gpt = dl.models.build("gpt-tiny", 0)
    block, (b, s, h, a) = gpt.blocks[0], (16, 32, gpt.cfg.d_model, gpt.cfg.heads)
    block.attn.selective = True
    with SavedActivations(gpt) as kept:
        block(torch.randn(b, s, h, requires_grad=True))
    predicted = predicted_layer_bytes(s, b, h, a, recompute="selective")
    assert kept.bytes == predicted + unmodelled_bytes(s, b, recompute="selective")
    assert predicted < predicted_layer_bytes(s, b, h, a) - a * s * s * b * 4 + 1     # the scores are gone
    mine = dl.launch(_tp_selective_layer_bytes, world_size=2, args=(sp,)).results
    t = 2
    want = predicted_layer_bytes(s, b, h, a, tp=t, sp=sp, recompute="selective")
    assert all(m == want + unmodelled_bytes(s, b, t, sp, recompute="selective") for m in mine)


def _tp_selective_layer_bytes(sp: bool) -> int:
    from distlab.memory import SavedActivations
    gpt = dl.models.build("gpt-tiny", 0)
    for block in gpt.blocks:
        block.attn.selective = True
    tp = dl.tp.parallelize(gpt, sequence_parallel=sp)
    block = tp.blocks[0]
    s_local = 32 // 2 if sp else 32
    with SavedActivations(tp) as kept:
        block(torch.randn(16, s_local, 64, requires_grad=True))
    return kept.bytes


@pytest.mark.parametrize("strategy, world, model", [("single", 1, "gpt-tiny"), ("tp-sp", 2, "gpt-tiny"),
                                                    ("zero3", 2, "gpt-tiny"), ("ep", 2, "gpt-moe-tiny")])
def test_selective_recomputation_trains_bit_for_bit(strategy, world, model):
    plain = dl.train(strategy, world_size=world, **{**KW, "model": model})
    again = dl.train(strategy, world_size=world, **{**KW, "model": model}, recompute="selective")
    assert again.losses == plain.losses
    assert all(torch.equal(again.params[k], plain.params[k]) for k in plain.params)
    assert _activation_peak(again) < _activation_peak(plain)


# -- dl.recompute: any module, under any wrapper ------------------------------------------------------
def _user_lm_run(wrapper: str, recompute: bool, order: str = "before") -> tuple[dict, int]:
    """A user's TinyLM (tests/test_user_models.py) with ``dl.recompute`` on each block (before or after the
    wrapper), 2 AdamW steps on this rank's share of the batch; (full parameters, block forwards counted)."""
    import torch.nn.functional as F
    from test_user_models import LM_PLAN, TinyLM, _data
    torch.manual_seed(0)
    model, n, r = TinyLM(layers=2, tied=False), dl.world_size(), dl.rank()
    runs = []
    for block in model.blocks:
        block.ln2.register_forward_hook(lambda m, a, o: runs.append(1))      # inside: runs again
        if recompute and order == "before":
            dl.recompute(block)
    rows, step_model = slice(r * 8 // n, (r + 1) * 8 // n), model
    if wrapper == "pipeline":                        # 2 stages, 1F1B over 4 microbatches
        return _pipeline_run(model), len(runs)
    if wrapper == "ddp":
        step_model = dl.DDP(model)
    elif wrapper == "zero3":
        step_model = dl.ZeRO(model, stage=3, optim=torch.optim.AdamW, lr=1e-2)
    elif wrapper == "fsdp":
        for block in model.blocks:
            dl.fully_shard(block)
        dl.fully_shard(model)
    elif wrapper == "tp":
        dl.tp.parallelize(model, plan=LM_PLAN)
        rows = slice(None)
    if recompute and order == "after":
        for block in model.blocks:
            dl.recompute(block)
    opt = getattr(step_model, "optimizer", None) or torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _data("lm", step)
        F.cross_entropy(step_model(x[rows]).flatten(0, 1), y[rows].flatten()).backward()
        opt.step()
        opt.zero_grad()
    full = {"ddp": lambda: model.state_dict(), "zero3": lambda: step_model.full_state_dict(),
            "fsdp": lambda: dl.full_state_dict(model), "tp": lambda: dl.tp.full_state_dict(model)}[wrapper]()
    return {k: v.detach().clone() for k, v in full.items()}, len(runs)


def _pipeline_run(model) -> dict:
    from test_user_models import _data
    stage = dl.pp.named_stage(model, dl.pp.cut(dl.pp.chain(model), at=["blocks.1"])[dl.rank()])
    pipe = dl.pp.Pipeline(stage, dl.rank(), 2, schedule="1f1b", microbatches=4)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _data("lm", step)
        pipe.step(x if pipe.first else None, y if pipe.last else None)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in stage.named_parameters()}


def _user_lm_runs() -> dict:
    cases = [("ddp", "before"), ("zero3", "before"), ("fsdp", "before"), ("fsdp", "after"), ("tp", "after"),
             ("pipeline", "before")]
    return {(w, o): (_user_lm_run(w, False), _user_lm_run(w, True, o)) for w, o in cases}


def test_dl_recompute_on_a_user_model_trains_the_same_under_every_wrapper():
    """DDP, ZeRO-3, fully_shard (dl.recompute before or after it), tp by plan, pipeline stages: the same
    weights with and without recomputation, and each block's modules ran twice (forward, then again in
    backward: 2 blocks x 2 steps; a stage's one block x 4 microbatches x 2 steps)."""
    for r, res in enumerate(dl.launch(_user_lm_runs, world_size=2, output="quiet").results):
        for case, ((plain, runs), (again, reruns)) in res.items():
            worst = max(((again[k] - v).norm() / v.norm()).item() for k, v in plain.items())
            assert worst <= 1e-6, (case, r, worst)
            assert reruns == 2 * runs == 2 * (8 if case[0] == "pipeline" else 4), (case, runs, reruns)


def test_dl_recompute_keeps_only_the_inputs_and_the_ledger_counts_what_backward_rebuilds():
    """One process: forward keeps about the blocks' inputs only; backward's rebuilt activations are
    counted by the memory ledger of the run in progress (`recomputation.recompute_context`)."""
    import copy

    import torch.nn.functional as F
    from test_user_models import TinyLM, _data
    torch.manual_seed(0)
    plain = TinyLM(layers=2, tied=False)
    again = copy.deepcopy(plain)
    for block in again.blocks:
        assert dl.recompute(dl.recompute(block)) is block                 # twice: still once
    x, y = _data("lm", 0)
    kept, rebuilt, grads = {}, {}, {}
    for name, model in (("plain", plain), ("again", again)):
        ledger = dl.memory.Ledger()
        with ledger.activations():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        kept[name] = ledger.saved.current
        loss.backward()
        rebuilt[name] = ledger.saved.take_rebuilt()
        grads[name] = [p.grad for p in model.parameters()]
    assert kept["again"] < 0.6 * kept["plain"] and rebuilt["plain"] == 0 < rebuilt["again"]
    assert all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["again"]))
    with pytest.raises(TypeError, match="nn.Module"):
        dl.recompute(lambda x: x)
