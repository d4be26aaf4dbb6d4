# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · ZeRO: shard the optimizer state, the gradients, then the parameters
#
# DDP (lesson 02) keeps a full copy of everything on every rank. With mixed-precision Adam a model of Ψ parameters
# holds, per rank, the **model states** (Rajbhandari et al. 2020, *ZeRO: Memory Optimizations Toward Training
# Trillion Parameter Models*, Sec. 3.1):
#
# | | bytes per parameter | |
# |---|---|---|
# | parameters (bf16) | 2 | |
# | gradients (bf16) | 2 | |
# | optimizer state: fp32 master copy, momentum, variance | K = 12 | 75% of the total |
#
# 16Ψ bytes: a 7.5B model needs 120 GB per GPU before a single activation. Yet every rank holds the **same**
# optimizer state, updates the **same** parameters with the **same** averaged gradient. ZeRO (the *Zero
# Redundancy Optimizer*) keeps one copy, split over the N data-parallel ranks:
#
#     stage   each rank keeps                                  bytes per rank          bytes sent per step
#     DDP     everything                                       (2 + 2 + K) Ψ            2 (N-1)/N · 2Ψ
#     ZeRO-1  1/N of the optimizer state                       (2 + 2) Ψ + K Ψ / N      2 (N-1)/N · 2Ψ
#     ZeRO-2  ... and 1/N of the gradients                     2 Ψ + (2 + K) Ψ / N      2 (N-1)/N · 2Ψ
#     ZeRO-3  ... and 1/N of the parameters                    (2 + 2 + K) Ψ / N        3 (N-1)/N · 2Ψ
#
# (Ψ is the number of parameters in both columns, as everywhere in the course: [docs/notation.md](../docs/notation.md).
# The bf16 gradients and parameters that travel are 2 bytes each, so one copy is 2Ψ bytes; the ZeRO paper counts
# the same volumes in elements, 2Ψ and 3Ψ.) Stages 1 and 2 cost **no extra
# communication**; stage 3 costs 1.5x. In this lesson you predict each row with `dl.theory`, measure it with
# distlab's ledger, and see where the bytes go.
#
# **The code, one file per stage, in reading order** ([distlab/parallel/zero/](../distlab/parallel/zero/__init__.py)):
# [zero1.py](../distlab/parallel/zero/zero1.py) is `ShardedOptimizer` (stage 1: reduce-scatter, step my shard,
# all-gather) and the stage-1 model wrapper; [shards.py](../distlab/parallel/zero/shards.py) what every stage's
# optimizer shares; [zero2.py](../distlab/parallel/zero/zero2.py) reduce-scatters each gradient bucket
# during backward; [zero3.py](../distlab/parallel/zero/zero3.py) owns the model's flat parameter buffers, gathers
# and frees them unit by unit, and hands its shards to the optimizer; [reducer.py](../distlab/parallel/zero/reducer.py)
# is the bounded queue of reduce-scatters they share. `dl.ZeRO(module, stage=...)` picks the stage's wrapper.

# %%
import torch
import torch.nn.functional as F
import matplotlib.pyplot as plt
import distlab as dl

MODEL, N = "gpt-tiny", 4
PSI = sum(p.numel() for p in dl.models.build(MODEL).parameters())
STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}       # strategy -> ZeRO stage
STATES = ("params", "grads", "optimizer")
print(f"{MODEL}: Psi = {PSI} parameters, N = {N} data-parallel ranks")

# %% [markdown]
# ## 1. The prediction
#
# `dl.theory.memory(Ψ, dp=N, zero=stage, precision=..., optimizer="adam")` is the table above as a function. The
# ZeRO paper's own example first (7.5B parameters, 64 GPUs, mixed precision), then our tiny model in fp32, where
# there is no master copy: 4 + 4 + K=8 bytes per parameter. A sharded flat buffer of Ψ elements leaves each rank
# ⌈Ψ/N⌉ of them (the last shard padded), which is what the formula charges.

# %%
GB = 1e9
print("ZeRO paper, 7.5B parameters, N = 64, bf16 mixed precision: GB per GPU")
for name, stage in STRATEGIES.items():
    b = dl.theory.memory(7.5e9, dp=64, zero=stage, precision="bf16-mixed", optimizer="adam")
    print(f"  {name:6} params {b.params / GB:6.1f}   grads {b.grads / GB:6.1f}   optimizer {b.optimizer / GB:6.1f}"
          f"   total {b.total / GB:6.1f}")

predicted = {name: dl.theory.memory(PSI, dp=N, zero=stage, precision="fp32", optimizer="adam")
             for name, stage in STRATEGIES.items()}
print(f"\n{MODEL}, N = {N}, fp32 Adam: bytes per rank")
for name, b in predicted.items():
    print(f"  {name:6} params {b.params:8.0f}   grads {b.grads:8.0f}   optimizer {b.optimizer:8.0f}   total {b.total:8.0f}")

# %% [markdown]
# ## 2. The measurement
#
# `dl.train(strategy, world_size=N)` trains with DDP or `dl.ZeRO(module, stage, optim)` and keeps a **memory ledger**
# on every rank: the exact bytes of the distinct storages holding parameters, gradients and optimizer state
# (Adam's `exp_avg`, `exp_avg_sq` and `step`), sampled after forward, after backward and after the optimizer step.
# Two more categories are measured but not part of the model states: **activations** (tensors autograd saved for
# backward, counted with saved-tensor hooks) and **buffers** (flat gradient buckets waiting for their
# reduce-scatter, in every ZeRO stage, and ZeRO-3's gathered parameters).
#
# The algorithms carry no memory probes: the ledger is [distlab/memory.py](../distlab/memory.py), which reads a
# rank's storages from outside and samples the transient buffers right after each collective is launched.
#
# Every strategy must still train exactly like one process on the whole batch; we check that first.

# %%
reference = dl.train("single", model=MODEL, steps=2, global_batch=8)
reports = {name: dl.train(name, world_size=N, model=MODEL, steps=2, global_batch=8) for name in STRATEGIES}
for name, rep in reports.items():
    print(f"{name:6} losses " + " ".join(f"{l:.5f}" for l in rep.losses) + "   (single: "
          + " ".join(f"{l:.5f}" for l in reference.losses) + ")")
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(rep.losses, reference.losses))

# %%
print("peak bytes on each rank, measured / predicted")
for name, rep in reports.items():
    for r in range(N):
        peak = rep.memory[r]["peak"]
        for cat in STATES:
            assert abs(peak[cat] - getattr(predicted[name], cat)) <= 0.02 * getattr(predicted[name], cat), (name, r, cat)
    peak = rep.memory[0]["peak"]
    print(f"  {name:6} rank 0: " + "   ".join(f"{cat} {peak[cat]:7d} / {getattr(predicted[name], cat):7.0f}"
                                             for cat in STATES))

# %% [markdown]
# Within 2% on every rank (asserted). The small excess in the optimizer column is Adam's `step` counter (one scalar
# per parameter tensor); the rest is exact, padding included.
#
# Below, one panel per strategy: a solid bar per rank (measured peak by category) beside a hatched bar (predicted
# model states). Look at the blue (params), orange (grads) and green (optimizer) blocks shrink stage by stage.

# %%
fig, axes = plt.subplots(2, 2, figsize=(12, 7.6), sharey=True)
top = max(sum(rep.memory[r]["peak"].values()) for rep in reports.values() for r in range(N)) / 1024
for ax, (name, rep) in zip(axes.flat, reports.items()):
    dl.viz.memory(rep.trace, predicted=predicted[name], ax=ax, unit="KiB",
                  title=f"{name}: measured peak (solid) | predicted model states (hatched)")
    ax.set_ylim(0, 1.3 * top)          # room for the legend above the tallest bar
fig.tight_layout()
plt.show()

# %% [markdown]
# What else is in the solid bars:
#
# * **activations** (red) are the same in every column: ZeRO shards model states, not activations (the batch is
#   already split by rank). For large models and long sequences they dominate, which is what activation
#   recomputation and sequence parallelism (lesson 04) attack.
# * **buffers** (purple): ZeRO-3 gathers one *unit* (a transformer block, or the root module with the embeddings
#   and the head) at a time, so its transient parameters are about one block plus the root, not the whole model.
#   Every ZeRO stage copies each gradient bucket into a flat buffer for its reduce-scatter and frees it as soon as
#   that reduce-scatter has completed and its shard has been taken. At most `max_inflight` of them are alive at once
#   (default 1, like FSDP2's `set_reduce_scatter_max_input_buffers`; DeepSpeed's `reduce_bucket_size` buckets play
#   the same role), so this transient is about `bucket_mb`, not Psi. Here `bucket_mb` is the default 25 MB, larger
#   than this whole model, so one bucket *is* the whole gradient and the purple bars of ZeRO-1 and ZeRO-2 are 4 Psi.
#   Smaller buckets shrink them to the largest bucket, measured below.

# %%
small = dl.train("zero2", world_size=N, model=MODEL, steps=2, global_batch=8, bucket_mb=0.05)
peak_buffers = max(small.memory[r]["peak"]["buffers"] for r in range(N))
print(f"zero2, bucket_mb=0.05: peak flat-gradient buffers {peak_buffers / (4 * PSI):.3f} x 4 Psi")
assert peak_buffers < PSI      # under a quarter of a whole fp32 gradient

# %% [markdown]
# ## 3. Bytes communicated per stage
#
# Per step and per rank, with 2Ψ the bytes of one bf16 copy of the gradients or parameters (ZeRO paper, Sec. 7,
# counts elements: Ψ each):
#
# * DDP: one all-reduce = reduce-scatter + all-gather: **2(N-1)/N · 2Ψ**
# * ZeRO-1/2: reduce-scatter the gradients (each rank gets the averaged gradient of its shard), update the shard,
#   all-gather the parameters: the two halves of the all-reduce, **2(N-1)/N · 2Ψ**; ZeRO-2 just does the
#   reduce-scatter during backward, bucket by bucket, and frees each gradient right away
# * ZeRO-3: all-gather each unit's parameters before its forward, **again** before its backward (they were freed
#   in between), reduce-scatter its gradients: **3(N-1)/N · 2Ψ**
#
# gloo does not report what it puts on the wire: the runs above record each torch collective with the ring's
# count (`bytes="ring-model"`), which would only check the formula against itself. To **measure**, we train one
# step of each strategy on distlab's own ring (`comm="ring"`, built from send/recv), where every chunk is counted
# where it is sent.

# %%
OPS = ("all_reduce", "reduce_scatter", "all_gather")
sent, wire = {}, {}
for name in STRATEGIES:
    rep = dl.train(name, world_size=N, model=MODEL, steps=1, global_batch=8, comm="ring")
    volume = dl.theory.zero_volume(STRATEGIES[name], 4 * PSI, N)
    for r in range(N):
        measured = rep.comm[r]["sent_per_step"]
        assert abs(measured - volume) <= 0.01 * volume, (name, r, measured, volume)
    sent[name] = {op: rep.comm[0]["sent_by_op"].get(f"ring_{op}", 0) for op in OPS}
    wire[name] = rep.comm[0]["sent_per_step"]
    print(f"{name:6} predicted {volume:8.0f}  measured {rep.comm[0]['sent_per_step']:8.0f}  = "
          + " + ".join(f"{op} {sent[name][op]:.0f}" for op in OPS if sent[name][op]))


# %% [markdown]
# ## 4. The trade-off
#
# Put the two measurements side by side: model-state bytes per rank against bytes sent per step. ZeRO-1 and
# ZeRO-2 are free lunches (less memory, same traffic); ZeRO-3 buys the last factor of N with 50% more
# communication, and with a gather on the critical path of every layer, twice. The right panel is the same
# trade-off from `dl.theory` at the ZeRO paper's scale.

# %%
def model_states(b):
    return b.params + b.grads + b.optimizer

fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 3.8))
colors = dict(zip(STRATEGIES, plt.cm.tab10.colors))
for name, rep in reports.items():
    measured_states = sum(rep.memory[0]["peak"][c] for c in STATES)
    ax_m.scatter(wire[name] / 1024, measured_states / 1024, s=90, color=colors[name], label=name)
    volume = dl.theory.zero_volume(STRATEGIES[name], 4 * PSI, N)
    ax_m.scatter(volume / 1024, model_states(predicted[name]) / 1024, s=260, facecolors="none",
                 edgecolors="k", linewidths=1)
ax_m.set(xlabel="KiB sent per rank per step", ylabel="model states per rank (KiB)",
         title=f"{MODEL}, N = {N}: measured (dots), predicted (circles)")
ax_m.legend(fontsize=8)
for name, stage in STRATEGIES.items():
    ns = [2, 4, 8, 16, 32, 64]
    mem = [model_states(dl.theory.memory(7.5e9, dp=n, zero=stage, precision="bf16-mixed")) / GB for n in ns]
    vol = [dl.theory.zero_volume(stage, 2 * 7.5e9, n) / GB for n in ns]
    ax_t.plot(vol, mem, "o-", color=colors[name], label=name, markersize=4)
    ax_t.annotate("N=64", (vol[-1], mem[-1]), fontsize=7, textcoords="offset points", xytext=(4, 2))
ax_t.set(xlabel="GB sent per GPU per step", ylabel="model states per GPU (GB)", yscale="log",
         title="7.5B, bf16 mixed, theory: each line N = 2, 4, ... 64")
ax_t.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Mixed precision: 2 + 2 + 12
#
# With bf16 parameters and gradients, the optimizer keeps an fp32 **master copy** of the weights (counted as
# optimizer state, as in the paper), so K = 12. Same runs, `precision="bf16-mixed"`, again on distlab's ring
# (`comm="ring"`), so the bytes sent are measured, not the ring's formula:

# %%
for name, stage in STRATEGIES.items():
    rep = dl.train(name, world_size=N, model=MODEL, steps=1, global_batch=8, precision="bf16-mixed", comm="ring")
    theory = dl.theory.memory(PSI, dp=N, zero=stage, precision="bf16-mixed", optimizer="adam", master_weights=True)
    for r in range(N):
        for cat in STATES:
            assert abs(rep.memory[r]["peak"][cat] - getattr(theory, cat)) <= 0.02 * getattr(theory, cat)
    per_param = sum(rep.memory[0]["peak"][c] for c in STATES) / PSI
    print(f"{name:6} model states per rank: {per_param:5.2f} bytes per parameter "
          f"(predicted {model_states(theory) / PSI:5.2f}; DDP would be 16)")
    bytes_sent = rep.comm[0]["sent_per_step"]
    volume = dl.theory.zero_volume(stage, 2 * PSI, N)          # bf16 gradients: 2 bytes each
    assert abs(bytes_sent - volume) <= 0.01 * volume           # measured; fp32's would be twice as many


# %% [markdown]
# At N = 4, ZeRO-3 brings 16 bytes per parameter to 4, ZeRO-1 to 4 + 12/4 = 7. On 64 GPUs ZeRO-3 needs
# 16/64 = 0.25 bytes per parameter: for a trillion parameters that is still 250 GB of model states per GPU, three
# times an 80 GB GPU. The ZeRO paper's trillion-parameter case shards over 1,024 GPUs: 16 × 10¹² / 1024 ≈ 15.6 GB
# per GPU, leaving room for activations. (The bytes sent are half the fp32 ones: bf16 gradients and parameters
# travel.)
#
# ## 6. ZeRO-3 up close: gather, compute, free
#
# `dl.ZeRO(module, stage=3)` ([zero3.py](../distlab/parallel/zero/zero3.py)) cuts the model into **units**: each transformer block, and the root module for the
# rest (embeddings, final norm, head). Each unit's parameters live in one flat buffer whose storage is freed except
# while the unit computes; each rank keeps only its 1/N shard:
#
#     forward   unit i:  all-gather params -> compute -> free
#     backward  unit i:  all-gather params -> compute grads -> reduce-scatter grads -> free
#
# So per step: one all-gather per unit in forward, one in backward, one reduce-scatter per unit. We count them,
# and look at the timeline of one step on 2 ranks. `dl.ShardedOptimizer` (ZeRO-1 on its own, around any torch
# optimizer) is what updates each rank's shard; its `repr` says how much of the model this rank updates.

# %%
def zero3_step():
    tr = dl.tracer()
    n, r = dl.world_size(), dl.rank()
    gpt = dl.models.build(MODEL, seed=0)
    model = dl.ZeRO(gpt, stage=3, optim=torch.optim.AdamW, lr=1e-3)
    at_rest = sum(p.untyped_storage().nbytes() for p in gpt.parameters())      # freed: only shards remain
    x, y = dl.models.dataset_for(MODEL).batch(0, 8)
    tr.clear()
    with tr.span("forward"):
        loss = F.cross_entropy(model(x.chunk(n)[r]).flatten(0, 1), y.chunk(n)[r].flatten())
    with tr.span("backward"):
        loss.backward()
    with tr.span("optimizer"):
        model.optimizer.step()
        model.optimizer.zero_grad()
    return {"units": len(model.units), "at_rest": at_rest, "optimizer": repr(model.optimizer)}

z3 = dl.launch(zero3_step, world_size=2, output="quiet")
info = z3.results[0]
print(f"units: {info['units']}; full parameter bytes held at rest: {info['at_rest']}")
print(info["optimizer"])
for phase in ("forward", "backward"):
    span = z3.trace.spans(rank=0, name=phase)[0]
    ops = [e.name for e in z3.trace.comms(rank=0) if span.start <= e.start <= span.end]
    print(f"{phase:8}: " + ", ".join(f"{ops.count(op)} x {op}" for op in ("all_gather", "reduce_scatter")))
    expected = {"forward": [info["units"], 0], "backward": [info["units"], info["units"]]}[phase]
    assert [ops.count("all_gather"), ops.count("reduce_scatter")] == expected and len(ops) == sum(expected)
assert info["at_rest"] == 0

# %%
fig = dl.viz.timeline(z3.trace, title="ZeRO-3, N = 2, one step: all-gathers before each unit, "
                      "reduce-scatters after its backward",
                      comm_kind=lambda e: e.name,            # colour communication by collective
                      comm_colours={"all_gather": "#ff7f0e", "reduce_scatter": "#d62728"})
plt.show()

# %% [markdown]
# ## 7. How FSDP relates
#
# PyTorch's **Fully Sharded Data Parallel** is ZeRO-3 (Zhao et al. 2023, *PyTorch FSDP: Experiences on Scaling
# Fully Sharded Data Parallel*). Its first version (FSDP1) is what this lesson built: each wrapped module is a
# *unit* whose parameters are flattened into one buffer, sharded 1/N, all-gathered before the unit's forward and
# backward, its gradients reduce-scattered. Its current version, FSDP2 (`fully_shard`), shards each parameter on
# dim 0 instead. The two side by side (padding, copies, allocations, what the optimizer sees), FSDP's names for the
# stages (`SHARD_GRAD_OP` / `reshard_after_forward=False` is ZeRO-2-like, `NO_SHARD` is DDP), mixed precision and
# hybrid sharding across nodes are the home of [lesson 09](09_fsdp2_and_hsdp.ipynb), measured there.
#
# DeepSpeed calls the same things ZeRO stage 1, 2, 3 (and adds offloading the optimizer state and parameters to
# CPU or NVMe: ZeRO-Offload, ZeRO-Infinity).
#
# `benchmarks/data_parallel.py` runs distlab's ZeRO-3 beside FSDP2 (and DDP and ZeRO-1 beside torch's) on the same
# model and data.
#
# ## What to remember
#
# * Model states are (2 + 2 + K)Ψ per rank under DDP; ZeRO divides K by N (stage 1), then the gradients (2), then
#   the parameters (3). Measured here to within 2%, padding included.
# * Stages 1 and 2 send exactly what DDP sends (an all-reduce is a reduce-scatter plus an all-gather); stage 3 sends
#   1.5x, and puts a gather in front of every unit's forward and backward.
# * ZeRO shards model states, not activations: those need recomputation, sequence or pipeline parallelism.
# * FSDP = ZeRO-3 with per-module units; FSDP2's `reshard_after_forward` chooses between ZeRO-3 and ZeRO-2-like.
#
# **Try it**: set `N = 2` in the first cell and re-run: DDP's model states do not change, every sharded block
# doubles, and the activations double in every column (the global batch stays 8, so each rank gets 4 samples
# instead of 2).

# %% [markdown]
# ## Build it yourself
#
# Write each function below, then run the check under it: `dl.exercises.check` runs your code on real ranks (several world sizes, sizes that do not divide) beside the reference and says the first difference in words. The teacher's version of this notebook shows a solution; the student version has a stub instead: `make lab` opens it (`lab/student/`), and `distlab lessons DIR` writes it to `DIR/student/`.

# %%
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab as dl


# %% [markdown]
# **zero1_step**: zero1_step(param, grad, lr) -> param after one SGD step with the gradient averaged over ranks, by reduce-scatter, a step on this rank's chunk, all-gather (no all-reduce)

# %% nbgrader={"grade": false, "grade_id": "zero1_step", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def zero1_step(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """One SGD step of ZeRO-1 on a flat parameter, in place: reduce-scatter the gradient (each rank gets
    the average of its 1/N chunk), update that chunk only, all-gather the parameters. The flat buffers
    are padded to a multiple of N so every chunk has the same size (Rajbhandari et al. 2020, P_os)."""
    ### BEGIN SOLUTION
    n, r = dist.get_world_size(), dist.get_rank()
    chunk = -(-param.numel() // n)                                   # ceil(numel / N)
    padded_grad = F.pad(grad.flatten(), (0, chunk * n - grad.numel()))
    padded_param = F.pad(param.flatten(), (0, chunk * n - param.numel()))
    mine = torch.empty(chunk)
    dist.reduce_scatter_tensor(mine, padded_grad)                    # sum of chunk r over ranks
    shard = padded_param[r * chunk:(r + 1) * chunk] - lr * mine / n  # the local optimizer step
    dist.all_gather_into_tensor(padded_param, shard.contiguous())
    param.copy_(padded_param[: param.numel()].view_as(param))
    return param
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_zero1_step", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("zero1_step", zero1_step).require();


# %% [markdown]
# **gather_full**: gather_full(shard, numel) -> the full flat parameter (numel elements) from every rank's padded shard of ceil(numel / N) elements

# %% nbgrader={"grade": false, "grade_id": "gather_full", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def gather_full(shard: torch.Tensor, numel: int) -> torch.Tensor:
    """The full flat parameter from every rank's shard: rank r holds elements [r c, (r+1) c) of the
    parameter padded to N c elements, c = ceil(numel / N); all-gather, then drop the padding (FSDP's
    unshard, Zhao et al. 2023)."""
    ### BEGIN SOLUTION
    n = dist.get_world_size()
    full = torch.empty(shard.numel() * n, dtype=shard.dtype)
    dist.all_gather_into_tensor(full, shard.contiguous())
    return full[:numel]
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_gather_full", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("gather_full", gather_full).require();
