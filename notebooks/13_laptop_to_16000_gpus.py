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
# 2. **here**: calibrate the simulator's constants on this machine (CPU time, cores shared by processor sharing)
#    from a collective benchmark and distlab's own runs, and predict each run (DDP, ZeRO-3, tensor parallel,
#    1F1B pipeline, two 3D layouts on 4 ranks) from constants fitted without it;
# 3. **there**: reproduce published tables (Narayanan et al. 2021, Korthikanti et al. 2022, Llama 3) with one set
#    of efficiency constants per table;
# 4. answer the interview question: *how long to train a 70B model on 2,048 H100s, and how?*
# 5. run the code that trains on your laptop at 16,384 GPUs (Llama 3 405B, a dry run): does Meta's layout fit?
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
import contextlib
import dataclasses
import os
import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import distlab as dl
from distlab.theory import calibrate, published, sim
from distlab.theory.layouts import describe, rank_layouts
from distlab.theory.presets import LinkPreset, ModelPreset

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
m, p = 1536 // 16, 8                                  # microbatches per pipeline (batch / dp), stages
assert abs(r.breakdown["recompute"] / r.breakdown["compute"] - 1 / 3) < 0.01   # a 4th forward over 3 passes
pipeline = sum(r.breakdown[k] for k in ("compute", "recompute", "tp", "bubble"))
assert 1 <= r.breakdown["bubble"] / pipeline / ((p - 1) / (m + p - 1)) < 1.04   # the bubble, plus its p2p sends
print(f"step {r.step_time:.2f} s  |  MFU {r.mfu:.1%}  |  {r.tflops_per_gpu:.0f} TFLOP/s per GPU (recompute counted)"
      f"  |  {r.memory.total / 2**30:.1f} GiB per GPU  |  300B tokens in {r.days(300e9):.0f} days")
for kind in KINDS:
    print(f"  {kind:10s} {r.breakdown[kind]:7.2f} s  {r.breakdown[kind] / r.step_time:6.1%}")
fig, ax = plt.subplots(figsize=(9, 1.6))
stacked(ax, ["gpt3-175b\n1,024 A100"], [r])
ax.set_xlabel("seconds per step")
ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.55))
plt.show()

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
# The same simulator describes this machine once it has this machine's constants. A "GPU" is one rank (a process
# on a CPU core), its link is gloo over loopback. A shared 2-core machine has two clocks, and they answer
# different questions ([distlab/theory/calibrate.py](../distlab/theory/calibrate.py)):
#
# * **CPU time** (`time.process_time` in each rank: the seconds it actually ran, gloo's copies included) is the
#   *work*. Waiting (for a message, for the pipeline, for a core taken by another program) is not in it, so a
#   loaded machine barely moves it. THE training loop stamps it on every step mark
#   ([distlab/strategies/loop.py](../distlab/strategies/loop.py)). The simulator predicts it as the step without
#   its bubble, with a core per rank.
# * **Wall time** is that work stretched by **processor sharing** (lesson 00): R ranks on c cores beside L other
#   runnable programs each run at min(1, c / (R + L)) of a core; the bubble is waiting and is not stretched.
#
# Four constants are fitted (least squares, `calibrate.fit`) from the CPU time of distlab's runs:
#
#     CPU per step = FLOPs / speed + CPU cost of the collectives (alpha, B)
#                    + overhead per step + pipeline actions x per-action cost + TP collectives x per-collective cost
#
# (the last: Megatron's f and g are autograd functions around every tensor-parallel all-reduce, and their
# Python costs more than the bare call's alpha).
#
# The link's CPU cost (alpha, B: latency and bandwidth, as in lesson 01 and [docs/notation.md](../docs/notation.md))
# comes from timing one small and one large `all_reduce` with the same clock
# (t = 2(n-1) alpha + 2(n-1)/n S / B, lesson 01's ring, solved by `calibrate.fit_link`). Then every strategy
# is **predicted by constants fitted without it** (leave one out): `ddp`, `zero3` (parameters gathered for every
# forward and backward), `tp` (two all-reduces per layer and pass), `pp-1f1b` (eight actions per step) and
# `3d:dp=1,tp=2,pp=2` and `3d:dp=2,tp=1,pp=2` on 4 ranks (twice as many ranks as cores: half the FLOPs per
# rank, and as many pipeline actions as `pp-1f1b`) are each predicted from the other five and `single`, a
# one-process run with twice the FLOPs per rank of the 2-rank runs (`tp` and `3d:dp=1,tp=2,pp=2` are the only runs that see
# the per-collective cost, so each is predicted with it fitted on the other). A run's CPU time is its least disturbed step
# (steps 1-6 of each rank; step 0 warms up): interference (another process evicting the caches, a context
# switch) only ever adds CPU time.
#
# **Tolerances, stated before measuring: the median predicted CPU time within 40% of its measurement, and every one
# within a factor of 2** (a CI run on an idle 2-core machine once measured `3d:dp=1,tp=2,pp=2` 70% above, learning
# its per-collective cost from a slow `tp` run: one run's error is not the model's). Why these: one
# run's per-step CPU times (printed below) spread by 10-100% from slowest to fastest step, and in 10
# repetitions of this section while it was written (not stored here; load averages 6 to 11 on 2 cores) the
# leave-one-out predictions landed between 0.79 and 1.28 of the measurement; the worst run of each
# repetition was off by 3-28% (median 12%), most often `3d:dp=1,tp=2,pp=2` (without the per-collective constant and the second 3D run, 0.67-1.37: `3d` under-predicted and
# `pp-1f1b` over-predicted, each the only other run to learn the per-action cost from). CPU time, unlike wall
# time, counts only the cycles a rank ran, so ranks sharing cores do not inflate it. The wall time is shown beside
# the processor-sharing prediction for
# *free* cores (L = 0); other programs on this machine only add to it, so the assert there is one-sided: no run
# may beat processor sharing by more than 60%. On a second machine (a 2-core AMD EPYC virtual machine, idle) the
# CPU time of one and the same launch differed between kernel processes (`tp`: 57 ms per step in one, 94 ms in
# another; `single` 85 and 104 ms), and in 13 repetitions the worst prediction was off by up to 52%, always
# `3d:dp=1,tp=2,pp=2` learning its per-collective cost from a slow `tp` run: 40% held on the first machine, not
# on this one, so the assertion takes 60% and the measured spread is printed with every run.
# If an assertion fails, re-run the section (and look at the load printed beside each run).

# %% tags=["nbval-ignore-output"]
def bench(sizes, reps=5):
    best = {}                                     # bytes -> (fastest wall seconds, fewest CPU seconds)
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)                        # warm up the connection
        best[nbytes] = (float("inf"), float("inf"))
        for _ in range(reps):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            dist.all_reduce(x)
            best[nbytes] = (min(best[nbytes][0], time.perf_counter() - wall),
                            min(best[nbytes][1], time.process_time() - cpu))
    return best


def link_from(results, clock, name):               # clock 0: wall, 1: CPU; the slower rank of each size
    slowest = {n: max(res[n][clock] for res in results) for n in (SMALL, LARGE)}
    return calibrate.fit_link(N, (SMALL, slowest[SMALL]), (LARGE, slowest[LARGE]), name)


N, SMALL, LARGE = 2, 64, 4 << 20
link_run = dl.launch(bench, world_size=N, args=([SMALL, LARGE],), output="quiet")
link, link_wall = link_from(link_run.results, 1, "gloo loopback, CPU"), link_from(link_run.results, 0, "wall")
for what, x in (("CPU cost: ", link), ("wall time:", link_wall)):
    print(f"{what} alpha = {x.latency * 1e6:4.0f} us per message, B = {x.bandwidth / 1e9:.2f} GB/s")

# %% tags=["nbval-ignore-output"]
cfg = dl.models.PRESETS["gpt-small"]
shape = ModelPreset("gpt-small", cfg.d_model, cfg.layers, cfg.heads, cfg.vocab, cfg.seq_len)
BATCH, CORES = 16, os.cpu_count()
RUNS = {                                 # name: (ranks, layout for the simulator); global batch 16 sequences
    "single": (1, dict(micro_batch=16)), "ddp": (2, dict(micro_batch=8)), "pp-1f1b": (2, dict(pp=2, micro_batch=4)),
    "zero3": (2, dict(zero=3, micro_batch=8)), "tp": (2, dict(tp=2, micro_batch=16)),
    "3d:dp=1,tp=2,pp=2": (4, dict(tp=2, pp=2, micro_batch=4)), "3d:dp=2,tp=1,pp=2": (4, dict(pp=2, micro_batch=2))}
PREDICTED = [name for name in RUNS if name != "single"]


def per_step(report, rank):
    marks = sorted(report.trace.select("mark", rank=rank, name="step"), key=lambda e: e.start)
    cpu, wall = [m.args["cpu"] for m in marks], [m.start for m in marks]
    return ([b - a for a, b in zip(cpu[1:], cpu[2:])],              # CPU seconds of steps 1..6 (0 warms up)
            [b - a for a, b in zip(wall[1:], wall[2:])])


cpu, wall, spread, load = {}, {}, {}, {}
threads = torch.get_num_threads()
torch.set_num_threads(1)          # `single` runs in this process: one thread, as every rank has, so CPU time = work
for name, (ranks, _) in RUNS.items():
    load[name] = os.getloadavg()[0]
    report = dl.train(name, world_size=ranks, model="gpt-small", steps=8, seed=0, global_batch=BATCH)
    steps = [per_step(report, r) for r in range(ranks)]
    cpu[name] = statistics.mean(min(c) for c, _ in steps)     # a rank's least disturbed step, mean over ranks
    wall[name] = min(steps[0][1])
    spread[name] = max(max(c) / min(c) for c, _ in steps) - 1
    print(f"{name:18s} {ranks} ranks, load {load[name]:4.1f}: CPU {cpu[name] * 1e3:5.1f} ms per step "
          f"(slowest step +{spread[name]:.0%} over the fastest), wall {wall[name] * 1e3:6.1f} ms")
torch.set_num_threads(threads)


# %% tags=["nbval-ignore-output"]
def predict(name, eff):
    ranks, layout = RUNS[name]
    return calibrate.predict(shape, ranks, link, eff, global_batch=BATCH, **layout)


unit = sim.Efficiency(compute=1.0, comm=1.0)                 # 1 GFLOP/s, no overhead: the fit's terms
everything = calibrate.fit([predict(n, unit) for n in RUNS], [cpu[n] for n in RUNS])
print(f"fitted on all seven: {everything.compute:.0f} GFLOP/s per core, {everything.overhead * 1e3:.1f} ms per step, "
      f"{everything.per_action * 1e3:.2f} ms per pipeline action, {everything.per_collective * 1e3:.2f} ms per "
      "TP collective")
predictions = {"single": predict("single", everything)}
for name in PREDICTED:                                       # leave one out: fitted on the other five
    others = [n for n in RUNS if n != name]
    predictions[name] = predict(name, calibrate.fit([predict(n, unit) for n in others], [cpu[n] for n in others]))
floor = {name: calibrate.wall(p, calibrate.core_share(RUNS[name][0], CORES)) for name, p in predictions.items()}
for name, p in predictions.items():
    kind = "fitted   " if name == "single" else "predicted"
    print(f"{kind} {name:18s} CPU: measured {cpu[name] * 1e3:5.1f} ms, simulated {calibrate.busy(p) * 1e3:5.1f} ms "
          f"({calibrate.busy(p) / cpu[name] - 1:+4.0%})  |  wall: measured {wall[name] * 1e3:6.1f} ms, "
          f"free cores {floor[name] * 1e3:6.1f} ms")

# %%
fig, (ax, ax_w) = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True, gridspec_kw={"width_ratios": [3, 2]})
names = list(RUNS)
labels = [f"{n} ({RUNS[n][0]} rank{'s' if RUNS[n][0] > 1 else ''})\n{'predicted' if n in PREDICTED else 'fitted'}"
          for n in names]
busy_only = [dataclasses.replace(predictions[n], breakdown={**predictions[n].breakdown, "bubble": 0.0})
             for n in names]
stacked(ax, labels, busy_only, scale=1e3)
ax.scatter([cpu[n] * 1e3 for n in names], labels, marker="D", color="black", zorder=3,
           label="measured CPU")
ax.set_xlabel("CPU milliseconds per step and rank")
ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
ax_w.barh(labels, [floor[n] * 1e3 for n in names], color="#CCCCCC", label="processor sharing, free cores")
ax_w.scatter([wall[n] * 1e3 for n in names], labels, marker="D", color="black", zorder=3,
             label="measured wall")
ax_w.set_xlabel("wall milliseconds per step")
ax_w.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
fig.tight_layout()
plt.show()

# %%
MEDIAN_TOLERANCE, FACTOR, TOLERANCE = 0.40, 2.0, 0.60      # TOLERANCE: the wall-time check below
ratio = {name: calibrate.busy(predictions[name]) / cpu[name] for name in PREDICTED}
assert statistics.median(abs(r - 1) for r in ratio.values()) <= MEDIAN_TOLERANCE, ratio
for name, r in ratio.items():
    assert 1 / FACTOR <= r <= FACTOR, f"{name}: simulated CPU time {r - 1:+.0%} off the measurement: re-run this section"
for name in RUNS:                                # other programs only slow us down
    assert wall[name] >= (1 - TOLERANCE) * floor[name], (name, wall[name], floor[name])
# These are wide: would a constant do as well? The best constant a run could be given without the simulator is the
# mean of the other runs' CPU times; the simulator must beat it on average (it knows FLOPs, ranks and collectives)
naive = {n: statistics.mean(cpu[o] for o in RUNS if o != n) for n in PREDICTED}
errors = {"simulator": statistics.mean(abs(calibrate.busy(predictions[n]) / cpu[n] - 1) for n in PREDICTED),
          "the others' mean": statistics.mean(abs(naive[n] / cpu[n] - 1) for n in PREDICTED)}
assert errors["simulator"] < errors["the others' mean"], errors
print("ddp, zero3, tp, pp-1f1b and 3d (twice), each predicted by constants fitted without it: CPU time within 60%; "
      "no wall time beat processor sharing; the simulator's mean error is below a constant's")

# %% [markdown]
# What the fit says about this machine (its constants are printed above; on a shared machine they move from run to
# run): a core runs this small model's matmuls at some tens of GFLOP/s, but a distlab step also pays some 20 ms
# of Python (the loop, hooks, the memory ledger, the optimizer), about a millisecond per pipeline action and about
# half a millisecond per tensor-parallel collective beyond its bytes; gloo's copies cost CPU at about 2 GB/s
# (the `B` of the CPU-cost link above). Wall time is another matter: it was 1-4x the processor-sharing floor here, and that
# factor is the other programs (the load printed beside each run), which no simulator of *our* step can see.
# The 3D runs' 4 ranks do half the FLOPs each of a 2-rank run, but on 2 cores their floor doubles: processor
# sharing, not the simulator's GPUs. On a GPU cluster the FLOPs and the bandwidth dominate instead. The same
# simulator; only its constants change.

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
# 15% is wider than the rows' spread (a constant 149 TFLOP/s passes every Narayanan row, 0.42 both Llama rows):
# the simulator must also beat the best constant (the published mean) on average, and get the direction right
for name in ("narayanan2021_table1", "korthikanti2022_table5"):
    mean = statistics.mean(c.published for c in rows[name])
    constant = statistics.mean(abs(mean / c.published - 1) for c in rows[name])
    simulated = statistics.mean(abs(c.error) for c in rows[name])
    print(f"{name}: mean error {simulated:.1%}, a constant {mean:.3g}: {constant:.1%}")
    assert simulated < constant, name
korthikanti = {c.name: c.predicted for c in rows["korthikanti2022_table5"]}
assert all(korthikanti[f"{n} present"] > korthikanti[f"{n} full"] for n in ("22B", "175B", "530B", "1T"))
eight_k, sixteen_k = rows["llama3_2024_table4"]          # 43% -> 41%: more GPUs, half the microbatches each
assert sixteen_k.predicted < eight_k.predicted and sixteen_k.published < eight_k.published

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
plt.show()

# %% [markdown]
# Where the rows differ, the simulator says why, and where it cannot, the table says so. Narayanan's published rows
# are nearly flat, 135 to 163 TFLOP/s: the 1.7B model's 137 is next to the lowest (18.4B's 135) and within 4% of
# every row up to 76.1B, so there is no slow small model to explain. The simulator gets the order wrong there: it
# puts 1.7B at 148, above every row from 7.5B to 76.1B, and its largest errors are at the two ends (+7.9% at 1.7B,
# -6.6% at 529.6B), while the paper tunes the layout (TP, PP, batch) row by row. The 1T model loses 12% to the
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
plt.show()

# %% [markdown]
# ## 4. How long to train a 70B model on 2,048 H100s, and how?
#
# Llama 3 70B (80 layers, h = 8,192, 8 KV heads, 8,192-token sequences), 15T tokens, 2,048 H100s (256 nodes of 8,
# 400 Gb/s per GPU across nodes), a batch of 512 sequences (4M tokens). `rank_layouts` tries every (dp, tp, pp)
# with TP inside a node, ZeRO-1 and selective recomputation first (full recomputation, then ZeRO-3, only if memory
# demands), keeps the layouts that fit in 90% of 80 GiB, and ranks them by the simulated step time, with the
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
plt.show()

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
# ## 5. The same code at 16,384 GPUs: a dry run of Llama 3 405B
#
# Sections 3 and 4 are formulas. This one runs **the code that trains on your laptop** at the size of Meta's run:
# Llama 3 405B (126 layers, h = 16,384, 8 KV heads, 8,192-token sequences) in the layout of Dubey et al. 2024
# ("The Llama 3 Herd of Models", Table 4): TP 8 inside a node, PP 16, DP 128, 16,384 GPUs, 16 sequences of
# micro-batch 1 per data-parallel replica (2,048 sequences, 16M tokens per step). Here it is
# `3d:dp=128,tp=8,pp=16` with sequence parallelism and ZeRO-1 over dp, bf16 mixed precision.
#
# `dl.train(..., backend="fake", ranks=[0, 16383])` runs the strategy's own code in this process as rank 0 (the
# first pipeline stage: the embedding and 7 blocks) and as rank 16,383 (the last: 7 blocks and the head), on
# torch's fake process group (collectives complete at once, nothing is sent) and on the `meta` device (tensors
# with shapes and dtypes, no storage: [distlab/launch/fake.py](../distlab/launch/fake.py),
# [distlab/strategies/dry.py](../distlab/strategies/dry.py)). The model is built, cut into 16 stages, its
# matrices split 8 ways; one step runs forward, backward and the optimizer through the 1F1B pipeline; the memory
# ledger counts every byte it would hold. No number in it is a formula's.
#
# **Prediction first** (`dl.theory.memory`, Korthikanti et al. 2022's activations, the ZeRO paper's bytes per
# parameter), with selective recomputation (only attention's scores are rebuilt in backward: about the memory of
# the flash attention Meta ran, without recomputation):

# %%
LLAMA, DP, TP, PP, M = "llama3-405b", 128, 8, 16, 16
WORLD, H100, GiB = DP * TP * PP, dl.theory.gpu("h100-80gb").memory, 2**30
shape405 = dl.theory.model(LLAMA)
theory = dl.theory.memory(LLAMA, dp=DP, zero=1, precision="bf16-mixed", optimizer="adamw", tp=TP, pp=PP,
                          seq_len=8192, sp=True, recompute="selective", microbatches=M)
print(f"dl.theory.memory, stage 0: states {(theory.total - theory.activations) / GiB:.1f} GiB + activations "
      f"{theory.activations / GiB:.1f} GiB = {theory.total / GiB:.1f} GiB of the H100's {H100 / GiB:.0f} GiB")


def dry(recompute, ranks=(0, WORLD - 1), **kw):
    """One step of the 3D strategy at full size, as the listed ranks; (report, seconds)."""
    start = time.perf_counter()
    report = dl.train(f"3d:dp={DP},tp={TP},pp={PP},zero=1,sp=True,microbatches={M}", model=LLAMA,
                      world_size=WORLD, backend="fake", ranks=list(ranks), precision="bf16-mixed",
                      global_batch=DP * M, recompute=recompute, **kw)
    return report, time.perf_counter() - start


def show(report, ranks=(0, WORLD - 1)):
    for r, m in zip(ranks, report.memory):
        peak = m["peak"]
        print(f"  rank {r:5d}: params {peak['params'] / GiB:5.2f}  grads {peak['grads'] / GiB:5.2f}  optimizer "
              f"{peak['optimizer'] / GiB:4.2f}  activations {peak['activations'] / GiB:6.2f}  ->  peak "
              f"{m['peak_total'] / GiB:6.1f} GiB {'fits' if m['peak_total'] <= H100 else 'DOES NOT FIT'}")


selective, seconds = dry("selective", ranks=(0,))
print("dry run, selective recomputation:")
show(selective, ranks=(0,))

# %% tags=["nbval-ignore-output"]
print(f"the dry run took {seconds:.0f} s here for one rank of a 16,384-GPU job")

# %% [markdown]
# The formula says the layout fits, barely (79 of 80 GiB); the code says it does not: it needs half as much
# again. The dry run caught it before 16,384 GPUs did. Each byte of the difference has a reason, and each reason is measured below.
#
# **Model states, exact.** distlab's `bf16-mixed` under tensor and pipeline parallelism is autocast over fp32
# weights (`strategies/base.py`): 4 bytes of weight and 4 of gradient per parameter stay on every rank, only
# Adam's 8 are sharded over dp. The ZeRO paper's (and Megatron's) bf16 weights with fp32 masters keep 2 + 2 and
# shard the 12 bytes of master, momentum and variance. Same 16 bytes a parameter; twice the resident bytes.
# The stage holds exactly its units of the model (the embedding or the head where the theory gives every stage
# P / pp, the norms whole on every tp rank): counted from the shape, the ledger agrees to the byte.

# %%
from distlab.theory import transformer_params  # noqa: E402

h, V = shape405.hidden, shape405.vocab
block = transformer_params(h, 1, 0, tied=True, heads=shape405.heads, kv_heads=shape405.kv_heads,
                           ffn=shape405.ffn, swiglu=True, bias=False, norm="rmsnorm") - h   # one block's P
per_block = (block - 2 * h) // TP + 2 * h          # on one tp rank: its 1/8 of the matrices, both norms whole
first_stage = V * h // TP + 7 * per_block           # (126 blocks + embedding + head) / 16 stages = 8 units
peak0 = selective.memory[0]["peak"]
assert peak0["params"] == peak0["grads"] == 4 * first_stage                 # fp32 weights and gradients
print(f"stage 0: {first_stage / 1e9:.3f} B parameters, x 4 bytes = {4 * first_stage / GiB:.2f} GiB: the ledger's "
      f"params and grads to the byte; the theory's bf16 weights: {theory.params / GiB:.2f} GiB")

# %% [markdown]
# **Activations, layer by layer.** Korthikanti's 34 s b h / t bytes per layer (selective, sequence parallel)
# assume GPT's layer in a bf16 model. Measure one Llama 3 405B block on one of 8 tensor-parallel ranks
# (`dl.memory.measure_layer`, on a fake 8-rank group), first as a bf16 model (Megatron's way), then as
# `dl.train` runs it (fp32 weights under autocast):

# %%
from distlab.strategies.dry import MetaAutocast  # noqa: E402


def one_block(bf16_weights):
    cfg = dataclasses.replace(dl.models.config(LLAMA), layers=1)
    with torch.device(dl.device()):
        gpt = dl.models.GPT(cfg)
        gpt = dl.tp.parallelize(gpt.to(torch.bfloat16) if bf16_weights else gpt, sequence_parallel=True)
        gpt.blocks[0].attn.selective = True
        x = torch.empty(1, cfg.seq_len // TP, cfg.d_model, dtype=torch.bfloat16 if bf16_weights else torch.float32)
    with contextlib.nullcontext() if bf16_weights else MetaAutocast(torch.bfloat16):
        return dl.memory.measure_layer(gpt.blocks[0], x)


korthikanti = dl.theory.activation_bytes_per_layer(8192, 1, h, shape405.heads, tp=TP, sp=True, recompute="selective")
bf16_block, = dl.launch(one_block, world_size=TP, args=(True,), backend="fake", ranks=(0,), output="quiet").results
mixed_block, = dl.launch(one_block, world_size=TP, args=(False,), backend="fake", ranks=(0,), output="quiet").results
stash = max(e.args["activations"] for e in selective.run.trace.select("memory", rank=0, name="pipeline stash"))
for what, b in (("Korthikanti, GPT layer, bf16", korthikanti), ("measured, Llama block, bf16 weights", bf16_block),
                ("measured, Llama block, as dl.train runs it", mixed_block)):
    print(f"  {what:42s} {b / 2**20:6.0f} MiB per layer per microbatch")
print(f"stage 0 holds {M} microbatches of 7 blocks: at most {M * 7 * mixed_block / GiB:.1f} GiB, at least the bf16 "
      f"model's {M * 7 * bf16_block / GiB:.1f} GiB; its stash measured {stash / GiB:.1f} GiB; the rest of the "
      f"peak, {(peak0['activations'] - stash) / GiB:.1f} GiB, is what backward rebuilds on top")
assert M * 7 * bf16_block < stash < M * 7 * mixed_block      # below: the bf16 copies of the weights, shared
assert bf16_block > korthikanti                             # Llama's block saves more than GPT's
assert 1.25 < mixed_block / bf16_block < 1.75    # autocast: between all-bf16 (1) and autocast ignored (~2)

# %% [markdown]
# Three measured reasons, none tuned away: (1) Llama's block is not GPT's (its SwiGLU MLP saves four tensors of
# width 3.25h, 13h in all, where GELU's saves two of 4h; grouped-query attention's K and V are smaller),
# (2) autocast saves the fp32 residual stream and norms and a bf16 copy of each matmul input beside them, where
# a bf16 model saves one 2-byte copy, (3) the written-out attention
# rebuilds its s x s scores in backward (flash attention, which Meta ran, never materialises them). 1F1B's first
# stage holds p = 16 microbatches: all 16 here. The stash is less than 16 x 7 one-block measurements because
# autocast casts each weight to bf16 once per step and every microbatch's matmuls save that same copy: the ledger
# counts what is alive, each storage once (a block measured alone counts its copies as its own).
#
# **The fix: full recomputation.** Each block keeps only its input (the fp32 residual, 1/8 of the sequence under
# SP) and runs its forward again in backward. Prediction before measuring: stage 0's stash is
# 16 x 7 x (s / t) h x 4 bytes = 7.0 GiB, plus one block rebuilt at a time.

# %%
full, seconds = dry(True)
print("dry run, full recomputation:")
show(full)
predicted_stash = M * 7 * (8192 // TP) * h * 4
stash = max(e.args["activations"] for e in full.run.trace.select("memory", rank=0, name="pipeline stash"))
print(f"stage 0's stash: predicted {predicted_stash / GiB:.2f} GiB, measured {stash / GiB:.2f} GiB (+ the token ids)")
assert abs(stash / predicted_stash - 1) < 0.005             # a bf16 residual (half) or no SP (x8) fails
assert all(m["peak_total"] <= H100 for m in full.memory)
assert selective.memory[0]["peak_total"] > H100
meta = {**published.tables()["llama3_2024_table4"]["common"], "virtual": 1, "zero": 1}   # Meta's run, 1F1B as here
price = {how: sim.step(**{**meta, "recompute": how}, gpus=WORLD, tp=TP, pp=PP, global_batch=DP * M, efficiency=h100)
         for how in ("none", "full")}
print(f"the price (simulated with section 3's H100 constants; flash attention and no recomputation as Meta ran it, "
      f"the 1F1B schedule of this dry run): "
      f"step {price['none'].step_time:.1f} s -> {price['full'].step_time:.1f} s with full recomputation, "
      f"MFU {price['none'].mfu:.0%} -> {price['full'].mfu:.0%}")
assert price["full"].step_time > 1.2 * price["none"].step_time          # a fourth forward over three passes

# %% tags=["nbval-ignore-output"]
print(f"the full-recomputation dry run took {seconds:.0f} s here for two ranks of a 16,384-GPU job")

# %% [markdown]
# **Your turn: what does the schedule hold?** GPipe runs every forward before any backward, so its first stage
# holds all m microbatches; 1F1B holds at most p. Take Llama 3 70B on 1,024 GPUs (dp 16, tp 8, pp 8: 80 blocks +
# embedding + head = 82 units, cut 10 or 11 per stage, the larger ones last) with full recomputation. Write
# `my_stash` (bytes of stage 0's stash), pick a `SCHEDULE` and `MICRO`, run the cell: the dry run checks you.
# Then try the other schedule, 16 or 32 microbatches, or `sp=False` in the layout (and 8x the bytes per block).

# %%
SCHEDULE, MICRO = "gpipe", 8                    # try "1f1b", and MICRO = 16 or 32


def my_stash(schedule, m, p=8, t=8, s=8192, h=8192):
    in_flight = m if schedule == "gpipe" else min(m, p)
    blocks = 10 - 1                             # stage 0: the embedding and 9 blocks
    return in_flight * blocks * (s // t) * h * 4     # each block keeps its fp32 input, 1/t of the sequence


report70 = dl.train(f"3d:dp=16,tp=8,pp=8,zero=1,sp=True,schedule={SCHEDULE},microbatches={MICRO}",
                    model="llama3-70b", world_size=1024, backend="fake", ranks=[0], precision="bf16-mixed",
                    global_batch=16 * MICRO, recompute=True)
measured70 = max(e.args["activations"] for e in report70.run.trace.select("memory", rank=0, name="pipeline stash"))
print(f"{SCHEDULE}, {MICRO} microbatches: you predicted {my_stash(SCHEDULE, MICRO) / GiB:.2f} GiB, the dry run "
      f"measured {measured70 / GiB:.2f} GiB")
assert abs(measured70 / my_stash(SCHEDULE, MICRO) - 1) < 0.005, "not yet: which microbatches are in flight?"

# %% [markdown]
# ## What to remember
#
# * A step is compute (3 passes, plus recomputation) + the collectives on the critical path (TP every layer, CP
#   every attention) + the pipeline bubble + whatever DP/ZeRO traffic the last backward cannot hide.
# * The bubble comes from replaying the schedule actually executed, not from a separate formula; with no
#   communication it reduces to (p-1)/(m+p-1).
# * A simulator is only as good as its constants: fit them once per machine (or per table), never per row, and
#   check it on runs it never saw. 15% on datacenter tables; 40-60% on a shared 2-core machine, and only for CPU
#   time: wall time there depends on the other programs, which processor sharing can bound but not foresee.
# * Width helps: memory-bound work per layer grows as s b h, matmuls as s b h^2, so wide layers reach a higher
#   share of peak (Narayanan's "superlinear" scaling).
# * For "how long, and how?": 6 N D / (GPUs x peak x MFU) for the order of magnitude, then the layout that fits
#   and keeps TP inside a node, the bubble small (enough microbatches, interleaving) and DP hidden.
# * "Fits" is a claim about code, not about a formula: a dry run (`backend="fake"`, `ranks=[...]`) runs the real
#   strategy at full size on tensors without storage and counts its bytes. For Llama 3 405B the formula said
#   79 GiB, the code needed half as much again (fp32 weights under autocast, Llama's block, written-out
#   attention); full recomputation brought it under 80 GiB, for a fourth forward.
#
# **Try it**: `sim.step("llama3-405b", "h100-80gb", 16384, tp=8, pp=16, virtual=8, zero=2, global_batch=2048,
# seq_len=8192, recompute="none", flash_attention=True, inter="ib-ndr", efficiency=h100)` and then halve the
# batch; or rerun section 4 with `gpu="a100-80gb"`, or with `inter="ethernet-100g"` and watch DP and PP change.
