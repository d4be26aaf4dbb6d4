"""Dry runs: the same code at 1,024 and 16,384 ranks in this process, on torch's fake process group and
tensors without storage (`distlab.launch.fake`), the model-state bytes equal to `dl.theory.memory`."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from distlab.memory import storage_bytes


def _who():
    mesh = dl.Mesh(dp=dl.world_size() // 64, tp=8, pp=8)
    x = torch.ones(4, device=dl.device())
    dist.all_reduce(x, group=mesh.group("tp"))                 # completes at once, nothing sent
    print("rank", dl.rank())
    return dl.rank(), dl.world_size(), dl.device().type, tuple(x.shape), mesh.coords().pp


@pytest.mark.parametrize("world", [1024, 16384])
def test_fake_launch_runs_the_listed_ranks_here_in_their_order(world):
    start = time.perf_counter()
    run = dl.launch(_who, world_size=world, backend="fake", ranks=(world - 1, 0), output="quiet")
    assert time.perf_counter() - start < 5                    # thousands of groups: no rendezvous
    assert run.results == [(world - 1, world, "meta", (4,), 7), (0, world, "meta", (4,), 0)]
    assert run.outputs == [f"rank {world - 1}\n", "rank 0\n"]
    assert run.backend == "fake" and run.world_size == world
    assert not dist.is_initialized()                          # each rank's group torn down after it


@pytest.mark.parametrize("kwargs, error", [
    (dict(backend="fake"), "pass ranks="),
    (dict(backend="gloo", ranks=(0,)), "pass backend='fake'"),
    (dict(backend="fake", ranks=(0, 8)), "8 is not a rank of world_size=8"),
    (dict(backend="fake", ranks=(1, 1)), "twice"),
    (dict(backend="fake", ranks=()), "no rank"),
    (dict(backend="fake", ranks=(-1,)), "not a rank"),
])
def test_fake_launch_refuses_bad_input_before_running(kwargs, error):
    ran = []
    with pytest.raises(ValueError, match=error):
        dl.launch(lambda: ran.append(1), world_size=8, **kwargs)
    assert not ran


def test_a_failing_rank_is_a_launch_error_naming_it():
    def fn():
        if dl.rank() == 3:
            raise RuntimeError("boom")
        return dl.rank()
    with pytest.raises(dl.LaunchError, match="boom") as info:
        dl.launch(fn, world_size=4, backend="fake", ranks=(0, 3), output="quiet")
    assert info.value.rank == 3
    assert not dist.is_initialized()


def test_storage_bytes_counts_tensors_without_storage_once_per_storage():
    from torch._subclasses.fake_tensor import FakeTensorMode
    meta = torch.empty(10, 3, device="meta")
    assert storage_bytes([meta, meta[2:], meta.view(30)]) == 120        # views: one storage
    assert storage_bytes([meta, torch.empty(5, device="meta")]) == 140   # distinct: both
    with FakeTensorMode():
        fake = torch.empty(1000, dtype=torch.bfloat16)
        assert storage_bytes([fake, fake[10:]]) == 2000


# -- dry runs of dl.train: model-state bytes per rank against dl.theory.memory, to the byte -------------
#
# The ledger counts storages (`distlab.memory.storage_bytes`), so what it reports is what the strategy's
# code really allocated, padding included. `dl.theory.memory` is a formula with two simplifications; each
# disagreement below is the exact number of bytes a rank holds beyond (or short of) it, and why:
#
# * torch's Adam keeps a ``step`` counter per parameter tensor it steps (a 4-byte fp32 scalar): + 4 bytes
#   per tensor in the optimizer's param groups (DDP, FSDP, TP, PP: one per parameter; ZeRO: one per flat
#   buffer). The theory's K bytes per parameter has no per-tensor term.
# * ZeRO-1/2 keep the *whole* parameters in one flat buffer padded to n ceil(P / n) elements (so that it
#   all-gathers from equal shards); the theory charges P (the padding is < n elements).
# * ZeRO-3 shards per unit (each block, then the root: FSDP1's flat units), each padded on its own:
#   sum over units of ceil(U / n) elements, not ceil(P / n) (`dl.theory.fsdp_padding(..., "flat")`).
# * fully_shard (FSDP2) shards every parameter on dim 0: rank r holds rows [r c, (r + 1) c) of d0, c =
#   ceil(d0 / n). Rank 0 holds c rows of every parameter: (P + fsdp_padding) / n elements
#   (`dl.theory.fsdp_padding`, per-param). A rank past the last row holds fewer (0 at 16,384 ranks for
#   most of a 4096-row matrix) -- but its gradient is the padded reduce-scatter output, c rows as rank 0.
# * Tensor parallelism shards all but the norms, which every tp rank holds whole; the theory divides
#   everything by tp ("layer norms ignored"): + (1 - 1/tp) x norms.
# * A pipeline cuts the model's L + 2 units (embedding, L blocks, final norm + head) into pp runs of equal
#   count (`parallel.pipeline.split.partition`): the first stage holds the embedding and the last the head,
#   where the theory gives every stage P / pp.
# Everything else is equal to the byte. The expectations are built from the shape with dl.theory's own
# formulas (`transformer_params`, `shard_numel`, `fsdp_padding`), never read back from the model.

from distlab.theory import ModelPreset, fsdp_padding, memory, shard_numel, transformer_params  # noqa: E402

SMALL = ModelPreset("llama3-8b-4-layers", hidden=4096, layers=4, heads=32, vocab=128256, seq_len=64,
                    ffn=14336, kv_heads=8, llama=True)                 # Llama 3 8B's width, 4 of its layers
DEEP = ModelPreset("llama3-8b-14-layers", hidden=4096, layers=14, heads=32, vocab=128256, seq_len=64,
                   ffn=14336, kv_heads=8, llama=True)                  # 16 units: 2 per stage of 8
LLAMA70 = ModelPreset("llama3-70b-seq64", hidden=8192, layers=80, heads=64, vocab=128256, seq_len=64,
                      ffn=28672, kv_heads=8, llama=True)               # Llama 3 70B's parameters exactly
TENSORS_PER_BLOCK = 9                      # q k v proj, gate fc proj, two RMSNorms


def _units(shape) -> tuple[int, int, int, int]:
    """(embedding, one block, final norm + head, the norms of one block) in parameters."""
    kw = dict(heads=shape.heads, kv_heads=shape.kv_heads, ffn=shape.ffn, swiglu=True, bias=False,
              norm="rmsnorm")
    norm = shape.hidden
    block = transformer_params(shape.hidden, 1, 0, tied=True, **kw) - norm
    return shape.vocab * shape.hidden, block, norm + shape.vocab * shape.hidden, 2 * norm


def _shapes(shape) -> list[tuple[int, ...]]:
    """Every parameter's shape, in Llama's layout (the per-parameter FSDP2 padding is per dim 0)."""
    h, f, kv = shape.hidden, shape.ffn, shape.kv_heads * shape.hidden // shape.heads
    block = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    return [(shape.vocab, h), *block * shape.layers, (h,), (shape.vocab, h)]


def _dry(strategy, shape, n, ranks, **kw):
    report = dl.train(strategy, model=shape, world_size=n, backend="fake", ranks=ranks, **kw)
    assert report.losses and all(x != x for x in report.losses)                 # NaN: no values
    return [m["peak"] for m in report.memory]


def _fsdp_rows(shape, n: int, r: int) -> int:
    """Elements rank r holds of a fully_shard-ed model: its rows of every parameter, no padding."""
    held = 0
    for s in _shapes(shape):
        c = shard_numel(s[0], n)
        held += max(0, min(c, s[0] - r * c)) * (math.prod(s) // s[0])
    return held


@pytest.mark.parametrize("n", [8, 1024, 16384])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_data_parallel_model_states_equal_theory(strategy, n):
    P, zero = SMALL.params, {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[strategy]
    theory = memory(P, dp=n, zero=zero, precision="fp32", optimizer="adamw")
    one_bucket = {"bucket_mb": 1e9} if strategy.startswith("zero") else {}
    first, last = _dry(strategy, SMALL, n, [0, n - 1], **one_bucket)
    tensors = len(_shapes(SMALL))
    if strategy == "ddp":
        expected = dict(params=theory.params, grads=theory.grads, optimizer=theory.optimizer + 4 * tensors)
        assert first == last or {k: first[k] for k in expected} == {k: last[k] for k in expected}
    elif strategy in ("zero1", "zero2"):
        expected = dict(params=4 * n * shard_numel(P, n), grads=theory.grads, optimizer=theory.optimizer + 4)
    elif strategy == "zero3":
        embed, block, head, _ = _units(SMALL)
        units = [block] * SMALL.layers + [embed + head]
        held = sum(shard_numel(u, n) for u in units)
        assert held - shard_numel(P, n) < len(units)                 # the theory's ceil(P/n), within
        expected = dict(params=4 * held, grads=4 * held, optimizer=8 * held + 4 * len(units))
    else:
        assert (P + fsdp_padding(_shapes(SMALL), n)) % n == 0
        held = (P + fsdp_padding(_shapes(SMALL), n)) // n
        expected = dict(params=4 * held, grads=4 * held, optimizer=8 * held + 4 * tensors)
        mine = _fsdp_rows(SMALL, n, n - 1)
        assert {k: last[k] for k in expected} == dict(params=4 * mine, grads=4 * held,
                                                     optimizer=8 * mine + 4 * tensors)
    assert {k: first[k] for k in expected} == expected
    if strategy != "fsdp":
        assert {k: last[k] for k in expected} == expected


def _stage_params(shape, stages: int, stage: int, tp: int = 1) -> tuple[int, int]:
    """(parameters, parameter tensors) of pipeline stage ``stage`` of ``stages`` on one tp rank: its run
    of the L + 2 units by count (sizes differ by at most one, larger ones last), each unit tp-sharded but
    for its norms."""
    embed, block, head, norms = _units(shape)
    h = shape.hidden
    sizes = [(embed // tp, 1)] + [((block - norms) // tp + norms, TENSORS_PER_BLOCK)] * shape.layers \
        + [((head - h) // tp + h, 2)]
    n = len(sizes)
    first, last = stage * n // stages, (stage + 1) * n // stages
    return sum(p for p, _ in sizes[first:last]), sum(t for _, t in sizes[first:last])


def _fp32_adam(params: int, tensors: int) -> dict:
    return dict(params=4 * params, grads=4 * params, optimizer=8 * params + 4 * tensors)


@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
def test_tensor_parallel_model_states_equal_theory(strategy):
    held, tensors = _stage_params(SMALL, 1, 0, tp=8)
    theory = memory(SMALL.params, tp=8, precision="fp32", optimizer="adamw")
    norms = (2 * SMALL.layers + 1) * SMALL.hidden
    assert held == theory.params / 4 + norms * (1 - 1 / 8)          # the norms the theory divides by tp
    for peak in _dry(strategy, SMALL, 8, [0, 7]):
        assert {k: peak[k] for k in ("params", "grads", "optimizer")} == _fp32_adam(held, tensors)


def test_pipeline_model_states_equal_theory_stage_by_stage():
    peaks = _dry("pp-1f1b", DEEP, 8, [0, 1, 7])                    # first (embedding), middle, last (head)
    held = [_stage_params(DEEP, 8, s) for s in range(8)]
    theory = memory(DEEP.params, pp=8, precision="fp32")
    assert sum(p for p, _ in held) == DEEP.params == 8 * theory.params / 4        # P / pp on average
    for peak, (params, tensors) in zip(peaks, [held[0], held[1], held[7]]):
        assert {k: peak[k] for k in ("params", "grads", "optimizer")} == _fp32_adam(params, tensors)


@pytest.mark.parametrize("shape, n, layout", [
    (SMALL, 8, "3d:dp=2,tp=2,pp=2"),
    (LLAMA70, 1024, "3d:dp=16,tp=8,pp=8"),             # Llama 3 70B at full width and depth
    (DEEP, 16384, "3d:dp=256,tp=8,pp=8"),
])
def test_mesh_model_states_equal_theory_first_and_last_stage(shape, n, layout):
    tp = pp = 8 if n > 8 else 2
    first, last = _dry(layout, shape, n, [0, n - 1])
    for peak, stage in ((first, 0), (last, pp - 1)):
        assert {k: peak[k] for k in ("params", "grads", "optimizer")} == _fp32_adam(
            *_stage_params(shape, pp, stage, tp=tp))


def test_cli_dry_run_prints_each_listed_rank(capsys):
    from distlab.cli import main
    assert main(["train", "--strategy", "zero3", "--model", "gpt-small", "--world-size", "1024",
                 "--backend", "fake", "--ranks", "0,1023"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "rank 0:" in out and "rank 1023:" in out and "loss nan" in out


@pytest.mark.parametrize("kwargs, error", [
    (dict(model="llama3-70b", world_size=8, strategy="ddp"), "backend='fake'"),
    (dict(world_size=8, strategy="ddp", backend="fake"), "ranks="),
    (dict(world_size=8, strategy="single", backend="fake", ranks=[0]), "one rank is"),
    (dict(world_size=8, strategy="ddp", backend="fake", ranks=[8]), "not a rank"),
    (dict(world_size=8, strategy="ddp", backend="fake", ranks=[0], max_restarts=1), "restarts nothing"),
    (dict(world_size=8, strategy="ddp", precision="fp16-mixed", backend="fake", ranks=[0]), "inf/NaN"),
    (dict(world_size=2, strategy="pp-zb-h1", recompute=True, backend="fake", ranks=[0]), "zero-bubble"),
])
def test_train_refuses_bad_dry_runs_before_any_rank(kwargs, error):
    with pytest.raises(ValueError, match=error):
        dl.train(**kwargs)


# -- activations per layer at GPT-3 175B's width, on meta tensors, against Korthikanti et al. 2022 ---------
def _gpt3_layer(tp: int, sp: bool, dtype) -> int:
    import dataclasses
    cfg = dataclasses.replace(dl.models.config("gpt3-175b"), layers=1, vocab=50304)   # Megatron's padded V
    with torch.device(dl.device()):
        gpt = dl.models.GPT(cfg).to(dtype)
        if tp > 1:
            gpt = dl.tp.parallelize(gpt, sequence_parallel=sp)
        x = torch.empty(1, cfg.seq_len // (tp if sp else 1), cfg.d_model, dtype=dtype)
    return dl.memory.measure_layer(gpt.blocks[0], x)


@pytest.mark.parametrize("tp, sp, dtype", [(1, False, torch.float32), (1, False, torch.bfloat16),
                                           (8, False, torch.bfloat16), (8, True, torch.bfloat16)])
def test_activations_per_layer_equal_korthikanti_at_gpt3_width(tp, sp, dtype):
    """s b h (34 + 5 a s / h) at 2-byte activations (Korthikanti Eq. 1; / t and SP's / t, Eq. 2-3), without
    the dropout masks distlab's GPT does not have, plus what it saves beyond the paper
    (`theory.activations.unmodelled_bytes`: LayerNorm statistics, the causal mask), to the byte."""
    from distlab.theory.activations import predicted_layer_bytes, unmodelled_bytes
    (got,) = dl.launch(_gpt3_layer, world_size=8, args=(tp, sp, dtype), backend="fake", ranks=(0,),
                       output="quiet").results
    s, h, a, size = 2048, 12288, 96, torch.finfo(dtype).bits // 8
    assert got == predicted_layer_bytes(s, 1, h, a, tp=tp, sp=sp, element_size=size) + unmodelled_bytes(
        s, 1, tp=tp, sp=sp)


def test_a_fake_launch_leaves_this_process_as_it_was():
    import sys
    hook = sys.excepthook
    dl.launch(dl.rank, world_size=64, backend="fake", ranks=(5, 63), output="quiet")
    assert sys.excepthook is hook and not dist.is_initialized() and dl.rank() == 0 and dl.world_size() == 1
    assert dl.device().type == "cpu"


def test_dry_run_comm_by_collective_and_by_mesh_group():
    report = dl.train("3d:dp=2,tp=2,pp=2", model="gpt-small", world_size=8, backend="fake", ranks=[7, 0])
    assert [m["peak"]["params"] > 0 for m in report.memory] == [True, True]
    for comm in report.comm:                                  # in the order of ranks: 7, then 0
        assert set(comm["sent_by_group"]) == {"dp", "tp", "pp"}
        assert sum(comm["sent_by_group"].values()) == sum(comm["sent_by_op"].values()) == comm["sent"] > 0
    assert report.comm[1]["sent_by_op"]["send"] > 0                       # stage 0 sends activations


@pytest.mark.parametrize("strategy, zero, states", [("ddp", 0, 39), ("zero1", 1, 1), ("zero3", 3, 5)])
def test_mixed_precision_model_states_equal_the_zero_papers(strategy, zero, states):
    """bf16-mixed Adam: 2 + 2 + K = 12 bytes per parameter (the fp32 master, momentum, variance), as the
    ZeRO paper counts and `dl.theory.memory` charges; plus Adam's step scalars (``states`` tensors)."""
    n, one_bucket = 1024, {"bucket_mb": 1e9} if zero else {}
    theory = memory(SMALL.params, dp=n, zero=zero, precision="bf16-mixed", optimizer="adamw")
    (peak,) = _dry(strategy, SMALL, n, [n - 1], precision="bf16-mixed", **one_bucket)
    held = {1: 2 * n * shard_numel(SMALL.params, n)} if zero == 1 else {}
    if zero == 3:                                          # per-unit padding, as in the fp32 test
        embed, block, head, _ = _units(SMALL)
        mine = sum(shard_numel(u, n) for u in [block] * SMALL.layers + [embed + head])
        theory = memory(mine * n, dp=n, zero=3, precision="bf16-mixed", optimizer="adamw")
    assert peak["params"] == held.get(zero, theory.params)
    assert (peak["grads"], peak["optimizer"]) == (theory.grads, theory.optimizer + 4 * states)


# -- bf16-mixed on the meta device (autocast emulated) and recomputation inside a pipeline -------------------
@pytest.mark.parametrize("strategy, world, recompute", [("tp", 2, False), ("3d:dp=1,tp=2,pp=2", 4, True)])
def test_bf16_dry_run_activations_equal_a_real_cpu_run(strategy, world, recompute):
    """Autocast does nothing to meta tensors; `strategies.dry.MetaAutocast` applies CPU autocast's policy
    (matmuls in bf16, a weight cast once per region, recomputations under it again): the bytes a dry run
    counts equal what the same code saves on real CPU tensors, to the byte, rank by rank."""
    kw = dict(world_size=world, model="gpt-small", precision="bf16-mixed", global_batch=8,
              recompute=recompute)
    real = dl.train(strategy, steps=1, seed=0, **kw)
    dry = dl.train(strategy, backend="fake", ranks=list(range(world)), **kw)
    fp32 = dl.train(strategy, backend="fake", ranks=[0], **{**kw, "precision": "fp32"})
    got = [m["peak"]["activations"] for m in dry.memory]
    assert got == [m["peak"]["activations"] for m in real.memory]
    assert got[0] < 0.9 * fp32.memory[0]["peak"]["activations"]          # emulated, not ignored


def test_pipeline_recompute_holds_each_blocks_input_plus_one_block_rebuilt():
    """Full recomputation in a 1F1B pipeline: stage 0 (embedding and 2 of gpt-small's 4 blocks) stashes
    p = 2 microbatches, each only its blocks' inputs (b s h fp32); backward rebuilds on top of that."""
    cfg = dl.models.config("gpt-small")
    kw = dict(world_size=2, model="gpt-small", backend="fake", ranks=[0], global_batch=8)
    layout = "3d:dp=1,tp=1,pp=2,microbatches=4"
    kept, plain = dl.train(layout, recompute=True, **kw), dl.train(layout, **kw)
    stash = max(e.args["activations"] for e in kept.run.trace.select("memory", rank=0, name="pipeline stash"))
    block_input = 2 * cfg.seq_len * cfg.d_model * 4                      # 8 rows / 4 microbatches = 2 rows
    assert abs(stash / (2 * 2 * block_input) - 1) < 0.05                 # + the token ids and positions
    assert stash < kept.memory[0]["peak"]["activations"] < plain.memory[0]["peak"]["activations"] / 2


def test_a_vocabulary_tp_does_not_divide_is_padded_as_megatron_pads_it():
    """GPT-3's 50,257 tokens under tp=8: padded to a multiple of 128 x 8 = 51,200 (Megatron-LM's
    ``--make-vocab-size-divisible-by 128``), the same bytes as a model built with 51,200 tokens."""
    from distlab.strategies.base import padded_vocab
    assert (padded_vocab(50257, 1), padded_vocab(50257, 8), padded_vocab(51200, 8)) == (50304, 51200, 51200)
    odd = ModelPreset("gpt3-vocab", hidden=64, layers=1, heads=8, vocab=50257, seq_len=16)
    even = ModelPreset("gpt3-vocab-padded", hidden=64, layers=1, heads=8, vocab=51200, seq_len=16)
    got, want = (_dry("tp", shape, 8, [0]) for shape in (odd, even))
    assert got == want


@pytest.mark.parametrize("strategy, op", [("cp-ring", "ring_shift"), ("cp-ulysses", "all_to_all")])
def test_context_parallel_dry_run_equals_a_real_run(strategy, op):
    """Ring attention on the fake group: the K/V blocks arrive as nothing, but with the right shapes, so the
    activations a rank saves and the bytes it sends per step are a real 2-rank run's, to the byte. Ulysses
    too, its attention on meta tensors by the fused kernel a real run takes (`launch.fake`), not the math
    path that saves the (b a s s) scores (+20% activations on gpt-small before)."""
    kw = dict(world_size=2, model="gpt-small", global_batch=8)
    real = dl.train(strategy, steps=1, seed=0, **kw)
    dry = dl.train(strategy, backend="fake", ranks=[0, 1], **kw)
    assert [m["peak"] for m in dry.memory] == [m["peak"] for m in real.memory]
    assert [c["sent_per_step"] for c in dry.comm] == [c["sent_per_step"] for c in real.comm]
    assert all(c["sent_by_op"][op] > 0 for c in dry.comm)
