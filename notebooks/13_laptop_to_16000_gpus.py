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
# # 13 · From a laptop to 16,000 GPUs: a step-time simulator, checked at both ends
#
# "How long would this run take on that cluster, and with which layout?" Every piece of the answer is already in
# `dl.theory`: FLOPs per layer, collective times in the alpha-beta model, activation memory, the pipeline schedule.
# `dl.theory.sim` composes them into one training step:
#
# ```
# one microbatch on one stage:   t_f = forward FLOPs / (peak x efficiency) + TP and CP collectives (critical path)
#                                t_b = 2 x forward + recomputation       + their backward collectives
# pipeline:                      dl.pp.simulate(dl.pp.schedule(name, pp, m, v), t_f, t_b)   -> bubble included
# step:                          pipeline + DP/ZeRO collectives not hidden under the last backward
# ```
#
# A model is only worth its checks, so this lesson checks it at both ends of the scale:
#
# 1. one step of GPT-3 175B on 1,024 A100s, and where its time goes;
# 2. **here**: calibrate the simulator's constants on this machine from a collective benchmark and two of
#    distlab's own runs, then predict three other runs (ZeRO-3, tensor parallel, 3D) and measure them;
# 3. **there**: reproduce published tables (Narayanan et al. 2021, Korthikanti et al. 2022, Llama 3) with one set
#    of efficiency constants per table;
# 4. answer the interview question: *how long to train a 70B model on 2,048 H100s, and how?*
#
# The code: the simulator, [distlab/theory/sim.py](../distlab/theory/sim.py); the published rows with their
# sources and the comparison, [distlab/theory/published.py](../distlab/theory/published.py) and
# [published_runs.json](../distlab/theory/data/published_runs.json); the layout search,
# [distlab/theory/layouts.py](../distlab/theory/layouts.py); the pipeline schedules it replays,
# [distlab/parallel/pipeline/schedule.py](../distlab/parallel/pipeline/schedule.py); the pieces it composes,
# [comm.py](../distlab/theory/comm.py), [memory.py](../distlab/theory/memory.py) and
# [activations.py](../distlab/theory/activations.py); and the widget,
# [distlab/widgets/cluster_planner.py](../distlab/widgets/cluster_planner.py).

# %%
import math
import os
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import distlab as dl
from distlab.theory import published, sim
from distlab.theory.layouts import describe, rank_layouts
from distlab.theory.presets import GPUPreset, LinkPreset, ModelPreset

KINDS = ("compute", "recompute", "tp", "cp", "bubble", "dp", "overhead")
COLORS = dict(zip(KINDS, ("#4C72B0", "#8172B3", "#DD8452", "#937860", "#C44E52", "#55A868", "#8C8C8C")))


def stacked(ax, labels, results, scale=1.0):
    left = [0.0] * len(results)
    for kind in KINDS:
        widths = [r.breakdown[kind] * scale for r in results]
        ax.barh(labels, widths, left=left, color=COLORS[kind], label=kind)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()


# %% [markdown]
# ## 1. One step, taken apart
#
# GPT-3 175B (96 layers, h = 12,288, 2,048 tokens) on 1,024 A100s: tensor parallel 8 inside each node, 8 pipeline
# stages, data parallel 16, a batch of 1,536 sequences (96 microbatches per pipeline), full recomputation. The
# efficiency constants are the ones that reproduce the A100 tables of section 3.

# %%
a100 = published.calibrated("a100-80gb")
r = sim.step("gpt3-175b", "a100-80gb", 1024, tp=8, pp=8, global_batch=1536, recompute="full", efficiency=a100)
assert abs(sum(r.breakdown.values()) - r.step_time) < 1e-9 * r.step_time      # the parts are the whole
print(f"step {r.step_time:.2f} s  |  MFU {r.mfu:.1%}  |  {r.tflops_per_gpu:.0f} TFLOP/s per GPU (recompute counted)"
      f"  |  {r.memory.total / 2**30:.1f} GiB per GPU  |  300B tokens in {r.days(300e9):.0f} days")
for kind in KINDS:
    print(f"  {kind:10s} {r.breakdown[kind]:7.2f} s  {r.breakdown[kind] / r.step_time:6.1%}")
fig, ax = plt.subplots(figsize=(9, 1.6))
stacked(ax, ["gpt3-175b\n1,024 A100"], [r])
ax.set_xlabel("seconds per step")
ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.55))
fig

# %% [markdown]
# Read it from the left: compute (the 3 passes of the model's FLOPs), the fourth forward that full recomputation
# adds, the tensor-parallel all-reduces (blocking, on NVLink), the pipeline bubble (96 microbatches over 8 stages:
# (p-1)/(m+p-1) of the pipeline), and what the data-parallel all-reduce could not hide under the last backward.
# Narayanan et al.'s own estimate for this run is 140 TFLOP/s per GPU and 34 days for 300B tokens (their Eq. 4,
# 8 T P / (n X)); the simulator lands next to it.

# %%
assert abs(r.tflops_per_gpu / 140 - 1) < 0.15 and abs(r.days(300e9) / 34 - 1) < 0.15
print("within 15% of the paper's 140 TFLOP/s and 34 days")


# %% [markdown]
# ## 2. Here: calibrated on this machine, checked on distlab's own runs
#
# The same simulator describes this machine if we give it this machine's constants. A "GPU" is one rank, its link
# is gloo over loopback, and ranks share the cores: with more ranks than cores each rank gets cores / ranks of
# one (`os.cpu_count()`, not fitted). The *fitted* constants:
#
# * **the link** (latency alpha and bandwidth beta): from timing one small and one large `all_reduce`,
#   t = 2(n-1) alpha + 2 (n-1)/n S / beta (lesson 01's ring);
# * **compute speed** (FLOP/s per core, Python overhead included), once from `tp` and `pp-1f1b` on 2 ranks (the
#   geometric mean of the speeds that make each exact), and once from `ddp` on 2 ranks for the data-parallel
#   family, whose loop does different Python work per step (gradient buckets, and the memory ledger sampled every
#   step, [distlab/memory.py](../distlab/memory.py)): on a quiet machine the two speeds come out close, under load
#   they drift apart.
#
# Then the simulator **predicts** two runs it never saw: `3d:dp=1,tp=2,pp=2` on **4** ranks (tensor and pipeline
# parallelism composed, and twice as many ranks as cores) and `zero3` on 2 ranks (parameters gathered for every
# forward and backward). A step time is the fastest of steps 1-6 (step 0 warms up), the least disturbed by whatever
# else runs here.
#
# **Tolerance, stated before measuring:** each prediction within a factor of 3 of the measurement. That is what is
# honest here: ranks time-slice 2 shared cores with other jobs, a message waits for its receiver to be scheduled,
# and one run's steps vary by 2x (printed below); a datacenter GPU gets the 15% of section 3. If an assertion fails,
# the machine was busier than that: re-run the section.

# %% tags=["nbval-ignore-output"]
def bench(sizes, reps=5):
    best = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)                           # warm up the connection
        best[nbytes] = float("inf")
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            best[nbytes] = min(best[nbytes], time.perf_counter() - t)
    return best


N, SMALL, LARGE = 2, 64, 4 << 20
link_run = dl.launch(bench, world_size=N, args=([SMALL, LARGE],), output="quiet")
t_small, t_large = (max(res[n] for res in link_run.results) for n in (SMALL, LARGE))
alpha = t_small / (2 * (N - 1))
beta = 2 * (N - 1) / N * LARGE / max(t_large - 2 * (N - 1) * alpha, 1e-9)
link = LinkPreset("gloo loopback", beta, alpha)
print(f"alpha = {alpha * 1e6:.0f} us per message, beta = {beta / 1e9:.2f} GB/s")

# %% tags=["nbval-ignore-output"]
cfg = dl.models.PRESETS["gpt-small"]
shape = ModelPreset("gpt-small", cfg.d_model, cfg.layers, cfg.heads, cfg.vocab, cfg.seq_len)
BATCH, CORES = 16, os.cpu_count()
RUNS = {                      # name: (ranks, layout for the simulator, family)
    "tp": (2, dict(tp=2, micro_batch=16), "plain"), "pp-1f1b": (2, dict(pp=2, micro_batch=4), "plain"),
    "ddp": (2, dict(micro_batch=8), "data-parallel"),
    "3d:dp=1,tp=2,pp=2": (4, dict(tp=2, pp=2, micro_batch=4), "plain"),
    "zero3": (2, dict(zero=3, micro_batch=8), "data-parallel")}
FITTED, PREDICTED = ("tp", "pp-1f1b", "ddp"), ("3d:dp=1,tp=2,pp=2", "zero3")


def step_times(report, rank=0):
    marks = sorted(e.start for e in report.trace.select("mark", rank=rank, name="step"))
    return [b - a for a, b in zip(marks[1:], marks[2:])]           # steps 1..6


measured, spread = {}, {}
for name, (ranks, _, _) in RUNS.items():
    report = dl.train(name, world_size=ranks, model="gpt-small", steps=8, seed=0, global_batch=BATCH)
    times = step_times(report)
    measured[name], spread[name] = min(times), max(times) / min(times)
    print(f"{name:20s} on {ranks} ranks: fastest step {measured[name] * 1e3:5.0f} ms, slowest / fastest "
          f"{spread[name]:.1f}")


# %% tags=["nbval-ignore-output"]
def predict(name, speed):
    ranks, layout, _ = RUNS[name]
    share = min(1.0, CORES / ranks)                            # ranks time-slice the cores
    machine = sim.Cluster(GPUPreset("one rank here", 8 * 2**30, 1e9 * share, "gloo"), ranks, link, link)
    eff = sim.Efficiency(compute=speed, comm=1.0)              # speed: GFLOP/s of one core
    return sim.step(shape, machine, ranks, global_batch=BATCH, seq_len=cfg.seq_len, recompute="none",
                    precision="fp32", sp=False, overlap_dp=False, efficiency=eff, **layout)


def exact_speed(name):
    # compute and bubble scale as 1 / speed; communication does not
    unit = predict(name, 1.0)
    scaled = unit.breakdown["compute"] + unit.breakdown["bubble"]
    return scaled / max(measured[name] - (unit.step_time - scaled), 1e-6)


speed = {"plain": math.sqrt(exact_speed("tp") * exact_speed("pp-1f1b")), "data-parallel": exact_speed("ddp")}
predictions = {name: predict(name, speed[family]) for name, (_, _, family) in RUNS.items()}
print(f"fitted: {speed['plain']:.1f} GFLOP/s per core, {speed['data-parallel']:.1f} for the data-parallel family")
for name in RUNS:
    kind = "fitted   " if name in FITTED else "predicted"
    print(f"{kind} {name:20s} measured {measured[name] * 1e3:6.0f} ms   simulated "
          f"{predictions[name].step_time * 1e3:6.0f} ms   ratio {predictions[name].step_time / measured[name]:.2f}")

# %%
fig, ax = plt.subplots(figsize=(9, 3.2))
names = list(RUNS)
stacked(ax, [f"{n} ({RUNS[n][0]} ranks)\n{'fitted' if n in FITTED else 'predicted'}" for n in names],
        [predictions[n] for n in names], scale=1e3)
ax.scatter([measured[n] * 1e3 for n in names], range(len(names)), marker="D", color="black", zorder=3,
           label="measured")
ax.set_xlim(0, 1.08e3 * max(max(measured.values()), max(p.step_time for p in predictions.values())))
ax.set_xlabel("milliseconds per step on this machine")
ax.legend(ncol=8, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
fig.tight_layout()
fig

# %%
for name in PREDICTED:
    ratio = predictions[name].step_time / measured[name]
    assert 1 / 3 <= ratio <= 3, f"{name}: simulated / measured = {ratio:.2f}, outside [1/3, 3]: re-run this section"
print("3d:dp=1,tp=2,pp=2 (4 ranks) and zero3: both predictions within a factor of 3 of their measurement")

# %% [markdown]
# What the fit says about this machine: a core does a few GFLOP/s on a model this small (Python and dispatch
# overhead included, far from its peak), the 3D run on 4 ranks is slower per rank because 4 ranks share 2 cores,
# and a message costs a scheduling quantum more than bytes / bandwidth. On a GPU cluster the FLOPs and the
# bandwidth dominate instead. The same simulator; only its constants change.

# %% [markdown]
# ## 3. There: published tables, reproduced
#
# Each table of the fixture carries its source (paper, table, columns, where each number was read) and ONE set of
# efficiency constants for all its rows; nothing is tuned per row. The two A100 tables even share theirs.
# Metrics: Narayanan's "achieved teraFLOP/s per GPU" (recomputation counted), Korthikanti's and Llama 3's MFU.

# %%
rows = {name: published.compare(name) for name in published.TABLES}
for name, comparisons in rows.items():
    print(f"{name}  (metric: {comparisons[0].metric}; constants {published.tables()[name]['efficiency']})")
    for c in comparisons:
        print(f"  {c.name:14s} published {c.published:8.3f}   simulated {c.predicted:8.3f}   {c.error:+6.1%}")
        assert abs(c.error) <= published.TOLERANCE, (name, c.name, c.error)
print("every published row within 15%")

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
for ax, (name, comparisons) in zip(axes, rows.items()):
    xs = [c.published for c in comparisons]
    ax.scatter(xs, [c.predicted for c in comparisons], color="#4C72B0")
    lo, hi = min(xs) * 0.8, max(xs) * 1.2
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.2, label="±15%")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel(f"published {comparisons[0].metric}")
axes[0].set_ylabel("simulated")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig

# %% [markdown]
# Where the rows differ, the simulator says why: Narayanan's 1.7B model is slow because its 2,304-wide layers
# spend relatively long in memory-bound work (softmax of 24 heads x 2048^2 scores); the 1T model loses 12% to the
# bubble of 64 stages; Korthikanti's "present work" beats full recomputation by the fourth forward it no longer
# runs; Llama 3 drops from 43% to 41% MFU on 16,384 GPUs because half the microbatches per pipeline double the
# bubble's share. Below: where the time goes for a few of them.

# %%
pick = [rows["narayanan2021_table1"][0], rows["narayanan2021_table1"][-1], rows["korthikanti2022_table5"][6],
        rows["korthikanti2022_table5"][7], *rows["llama3_2024_table4"]]
fig, ax = plt.subplots(figsize=(9, 3.2))
results = [c.result for c in pick]
short = {"narayanan2021_table1": "Narayanan", "korthikanti2022_table5": "Korthikanti", "llama3_2024_table4": "Llama 3"}
stacked(ax, [f"{short[c.table]} {c.name}" for c in pick], results, scale=1.0)
for i, res in enumerate(results):                  # normalise: share of each step
    for patch in ax.patches[i::len(results)]:
        patch.set_width(patch.get_width() / res.step_time)
        patch.set_x(patch.get_x() / res.step_time)
ax.set_xlim(0, 1)
ax.set_xlabel("share of the step")
ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
fig.tight_layout()
fig

# %% [markdown]
# ## 4. How long to train a 70B model on 2,048 H100s, and how?
#
# Llama 3 70B (80 layers, h = 8,192, 8 KV heads, 8,192-token sequences), 15T tokens, 2,048 H100s (256 nodes of 8,
# 400 Gb/s per GPU across nodes), a batch of 512 sequences (4M tokens). `rank_layouts` tries every (dp, tp, pp)
# with TP inside a node, ZeRO-1 and selective recomputation first (full recomputation, then ZeRO-3, only if memory
# demands), keeps the layouts that fit in 90% of 80 GB, and ranks them by the simulated step time, with the
# H100 constants that reproduced Llama 3's table. **This is a model's figure, not a measurement.**

# %%
h100 = published.calibrated("h100-80gb")
ranked = rank_layouts("llama3-70b", "h100-80gb", 2048, global_batch=512, seq_len=8192, efficiency=h100)
assert ranked and all(x.fits for x in ranked)
assert [x.step_time for x in ranked] == sorted(x.step_time for x in ranked)
best = ranked[0]
print(f"{len(ranked)} layouts fit; the fastest five:")
for x in ranked[:5]:
    print(f"  {describe(x)}  ->  {x.days(15e12):.0f} days")
print(f"answer (a model's figure): {best.days(15e12):.0f} days for 15T tokens with {describe(best).split(':')[0]}, "
      f"{best.tokens_per_s / 1e6:.1f}M tokens/s, MFU {best.mfu:.0%}")
fig, ax = plt.subplots(figsize=(9, 3.4))
stacked(ax, [describe(x).split(":")[0] for x in ranked[:8]], ranked[:8])
ax.set_xlabel("simulated seconds per step")
ax.legend(ncol=4, fontsize=7, loc="lower right")
fig

# %%
# sanity: 6 N D / (GPUs x peak x MFU), the back-of-envelope every interview expects, agrees with the simulator
n_params = dl.theory.model("llama3-70b").params
envelope = dl.theory.training_time(n_params, 15e12, 2048, 989e12, mfu=best.mfu) / 86400
attention = 12 * 80 * 8192 * 8192 / (6 * n_params)     # 12 L h s per token (PaLM, App. B) over 6 N
# 6 N also counts the 1.05B input-embedding weights, a lookup with no matmul: 1.5% too many
assert abs(envelope * (1 + attention) / best.days(15e12) - 1) < 0.03
print(f"6ND at the simulated MFU: {envelope:.0f} days; plus attention's {attention:.0%} more FLOPs: "
      f"{envelope * (1 + attention):.0f} days, the simulator's {best.days(15e12):.0f}")

# %% [markdown]
# Try the widget: pick a model, a GPU, a cluster size and a token budget; it searches the layouts that fit and
# ranks them, with the breakdown.

# %% tags=["nbval-ignore-output"]
planner = dl.widgets.cluster_planner("llama3-70b", "h100-80gb", 2048, tokens=15e12)
planner

# %% [markdown]
# ## What to remember
#
# * A step is compute (3 passes, plus recomputation) + the collectives on the critical path (TP every layer, CP
#   every attention) + the pipeline bubble + whatever DP/ZeRO traffic the last backward cannot hide.
# * The bubble comes from replaying the schedule actually executed, not from a separate formula; with no
#   communication it reduces to (p-1)/(m+p-1).
# * A simulator is only as good as its constants: fit them once per machine (or per table), never per row, and
#   check it on runs it never saw. 15% on datacenter tables; a factor of 2 on a shared 2-core laptop.
# * Width helps: memory-bound work per layer grows as s b h, matmuls as s b h^2, so wide layers reach a higher
#   share of peak (Narayanan's "superlinear" scaling).
# * For "how long, and how?": 6 N D / (GPUs x peak x MFU) for the order of magnitude, then the layout that fits
#   and keeps TP inside a node, the bubble small (enough microbatches, interleaving) and DP hidden.
#
# **Try it**: `sim.step("llama3-405b", "h100-80gb", 16384, tp=8, pp=16, virtual=8, zero=2, global_batch=2048,
# seq_len=8192, recompute="none", flash_attention=True, inter="ib-ndr", efficiency=h100)` and then halve the
# batch; or rerun section 4 with `gpu="a100-80gb"`, or with `inter="ethernet-100g"` and watch DP and PP change.
