"""Activation recomputation: ``recompute=True`` (full: `distlab.models.Block` under torch.utils.checkpoint)
and ``recompute="selective"`` (only attention's scores and softmax, `models.attention_core`).

Recomputing is the same arithmetic done again, so every strategy must train exactly as without it (bit
for bit on CPU). What a block keeps is Korthikanti et al.'s count to the byte (full: its input;
selective: all but the a s^2 b terms). The memory ledger counts what forward keeps and, through the
checkpoint's ``context_fn``, what backward saves again while it rebuilds one block: with gpt-tiny's two
blocks the activation peak about halves, and a memory limit between the two trips in backward. FSDP works
because its units put the gathered parameters back into the modules before their backward, where the
recomputation runs. Refused: models without blocks, pipelines (their stash cannot see it yet), full
with mixtures of experts (the balance loss would count twice), selective with context parallelism.
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
    for strategy in ("pp-1f1b", "pp-zb-h1", "3d:dp=1,tp=1,pp=2,schedule=zb-h1"):
        with pytest.raises(ValueError, match="pipeline parallelism"):
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
