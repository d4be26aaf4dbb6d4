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
# # 05 · Pipeline parallelism: schedules, bubbles and stashed activations
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# **Pipeline parallelism (PP)** cuts the model by depth: rank 0 holds the first layers, rank 1 the next, and so on.
# Activations travel forward from rank to rank and gradients travel back, point to point: the cheapest
# communication of all the parallelisms, which is why PP can cross the slow links between nodes (so can DP, whose
# one all-reduce per step overlaps the backward; lesson 06 shows both layouts).
#
# The catch is the **bubble**: rank 3 has nothing to do until rank 0, 1 and 2 have each done a forward, and rank 0
# sits idle while the gradient walks back. Cutting the batch into **m microbatches** lets the ranks overlap; the
# *schedule* decides in which order each rank does its forwards (F) and backwards (B).
#
# In this lesson you will
#
# 0. read 1F1B written by hand, three loops with their sends and receives, and see it give the executor's numbers;
# 1. read the four schedules as plain lists of actions (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1);
# 2. train a GPT through `dl.pp.Pipeline` with each schedule and get exactly the single-process result;
# 3. **measure** the four schedules' timelines side by side and compare the bubble with `dl.theory.bubble`;
# 4. sweep the number of microbatches: predicted and measured bubble, in both conventions;
# 5. watch the activations each stage keeps in flight: GPipe holds m microbatches, 1F1B at most p - i on stage i.
#
# The code, in the order [`distlab/parallel/pipeline/__init__.py`](../distlab/parallel/pipeline/__init__.py) gives:
# 1F1B by hand in [one_f_one_b.py](../distlab/parallel/pipeline/one_f_one_b.py), the schedules as pure lists in
# [schedule.py](../distlab/parallel/pipeline/schedule.py), cutting a model into stages in
# [split.py](../distlab/parallel/pipeline/split.py), the messages between neighbours in
# [p2p.py](../distlab/parallel/pipeline/p2p.py), the executor in
# [executor.py](../distlab/parallel/pipeline/executor.py) (each action: receive, compute, send) and the split
# backward of zero bubble in [zero_bubble.py](../distlab/parallel/pipeline/zero_bubble.py). The executor measures
# nothing itself: observers attached from outside, like a module's forward hooks, do.
# [measure.py](../distlab/parallel/pipeline/measure.py) records a span per action and reads the bubble back from the
# trace, [distlab/memory.py](../distlab/memory.py) (`PipelineStash`) the activations in flight, and
# [distlab/viz/pipeline.py](../distlab/viz/pipeline.py) draws both.

# %%
import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import distlab as dl
from distlab.models import GPT, GPTConfig, MarkovTokens
from distlab.viz.pipeline import pipeline as draw_pipeline, schedule as draw_schedule, stash as draw_stash

P, M = 4, 8                       # pipeline ranks, microbatches
CFG = GPTConfig(vocab=64, seq_len=32, d_model=64, heads=4, layers=6)   # 8 units: embed, 6 blocks, head

def observers():             # what we measure, attached from outside the executor
    return [dl.pp.ActionTrace(), dl.memory.PipelineStash()]    # a span per action; activations in flight


# %% [markdown]
# ## 0. 1F1B by hand: three loops
#
# First the schedule the way you would write it on a whiteboard (as picotron does): rank r holds stage r, runs
# p - r - 1 forwards to fill the pipe (**warm-up**), then one forward and one backward in turn (**steady state**),
# then the backwards it still owes (**cool-down**). Each forward receives its input from rank r - 1 and sends its
# output to rank r + 1; each backward receives the gradient of its output from rank r + 1 and sends the gradient of
# its input back to rank r - 1. Here is all of it, from
# [one_f_one_b.py](../distlab/parallel/pipeline/one_f_one_b.py):

# %%
import inspect

print(inspect.getsource(dl.pp.one_f_one_b))

# %% [markdown]
# The rest of the lesson runs schedules through `dl.pp.Pipeline`, an executor that walks any list of actions. For
# 1F1B the two must agree: one step of each, on the same stages and the same batch, gives the same loss and the same
# gradients on every stage, to the bit.

# %%
def by_hand_and_executor(batch=16):
    torch.manual_seed(0)
    stage = dl.pp.stage_module(GPT(CFG), dl.rank(), P)                # this rank's stage of the same GPT
    x, y = MarkovTokens(CFG.vocab, CFG.seq_len, seed=0).batch(0, batch)
    x, y = (x if dl.rank() == 0 else None), (y if dl.rank() == P - 1 else None)
    loss = dl.pp.one_f_one_b(stage, x, y, microbatches=M)
    by_hand = [q.grad.clone() for q in stage.parameters()]
    stage.zero_grad()
    executor_loss = dl.pp.Pipeline(stage, dl.rank(), P, schedule="1f1b", microbatches=M).step(x, y)
    return loss, executor_loss, all(torch.equal(g, q.grad) for g, q in zip(by_hand, stage.parameters()))

results = dl.launch(by_hand_and_executor, world_size=P, output="quiet").results
loss, executor_loss, _ = results[-1]
print(f"loss on the last stage: by hand {loss.item():.6f}, executor {executor_loss.item():.6f}")
assert torch.equal(loss, executor_loss) and all(same for _, _, same in results)
print("gradients of every stage: equal to the bit")


# %% [markdown]
# ## 1. A schedule is a list of actions per rank
#
# `dl.pp.schedule(name, stages=p, microbatches=m)` is a pure function: no processes, no tensors. It returns, for
# every rank, the ordered list of what to do. `F3@s1` means "forward of microbatch 3 on stage 1". The executor
# runs **exactly** these lists, and the plots below are drawn from them, so there is one source of truth.
#
# * **GPipe** (Huang et al. 2019): all m forwards, then all m backwards.
# * **1F1B** (PipeDream-Flush, Narayanan et al. 2021): rank i does p - i - 1 warm-up forwards, then alternates one
#   forward and one backward, then drains the backwards. Same bubble as GPipe, far fewer stashed activations.
# * **Interleaved 1F1B** (Narayanan et al. 2021, Megatron-LM): each rank holds v model chunks (rank r holds stages
#   r, r + p, ...); the idle time shrinks by v at the price of v times more messages: (p-1)/m of the ideal step
#   becomes (p-1)/(v·m). As a share of the whole step, the "total" convention below, (p-1)/(m+p-1) becomes
#   (p-1)/(v·m+p-1), which is less than a factor v (here 27% -> 16% at v = 2).
# * **ZB-H1** (Qi et al. 2023, *Zero Bubble Pipeline Parallelism*): the backward is split into I (gradient of the
#   input, which the previous stage is waiting for) and W (gradient of the weights, which nobody waits for); the Ws
#   are pushed into what would have been idle time.

# %%
for name in ("gpipe", "1f1b", "zb-h1"):
    print(f"{name:6} rank 0:", dl.pp.schedule(name, stages=P, microbatches=M)[0])
print("interleaved rank 0:", dl.pp.schedule("interleaved", stages=P, microbatches=M, virtual=2)[0])

# %% [markdown]
# Replayed on an ideal clock (F takes 1 unit, B takes 2, messages are free), the lists already show the bubble:

# %%
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
for ax, (name, v) in zip(axes, SCHEDULES):
    actions = dl.pp.schedule(name, P, M, virtual=v)
    draw_schedule(actions, t_f=1 / v, t_b=2 / v, ax=ax,
                    title=f"{name}: simulated bubble {dl.pp.simulate(actions, 1 / v, 2 / v).bubble:.1%}")
fig.tight_layout()
plt.show()


# %% [markdown]
# ## 2. Same numbers as one process
#
# Each rank builds the same GPT from the same seed and keeps only its stage (`dl.pp.stage_module`, which keeps the
# model's parameter names). `Pipeline.step(x, target)` runs the rank's action list; every microbatch's loss is
# scaled by its share of the batch, so the accumulated gradient is the whole-batch gradient. We train three steps
# with every schedule and compare losses and **every parameter** with single-process training.

# %%
def data_and_model():
    torch.manual_seed(0)
    return MarkovTokens(CFG.vocab, CFG.seq_len, seed=0), GPT(CFG)

def single_process(steps=3, batch=16):
    data, model = data_and_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = data.batch(step, batch)
        opt.zero_grad(); loss = model.loss(x, y); loss.backward(); opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())

def pipelined(name, v, steps=3, batch=16):
    data, model = data_and_model()
    p, r = dl.world_size(), dl.rank()
    ids = [r + k * p for k in range(v)]
    modules = [dl.pp.stage_module(model, s, p * v) for s in ids]
    pipe = dl.pp.Pipeline(modules if v > 1 else modules[0], ids if v > 1 else ids[0], p * v,
                          schedule=name, microbatches=M, observers=observers())
    opt = torch.optim.SGD(list(pipe.parameters()), lr=0.5)
    losses = []
    for step in range(steps):
        x, y = data.batch(step, batch)
        opt.zero_grad(); loss = pipe.step(x, y); opt.step()
        losses.append(loss)
    names = {id(q): n for n, q in model.named_parameters()}
    return [l.item() for l in losses] if pipe.last else None, {names[id(q)]: q.detach() for q in pipe.parameters()}

ref_losses, ref_params = single_process()
for name, v in SCHEDULES:
    results = dl.launch(pipelined, world_size=P, args=(name, v), output="quiet").results
    losses = next(r[0] for r in results if r[0] is not None)
    params = {n: t for r in results for n, t in r[1].items()}
    assert set(params) == set(ref_params)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for n, t in params.items():
        torch.testing.assert_close(t, ref_params[n].detach(), rtol=1e-5, atol=1e-6)
    print(f"{name:12} losses {[round(l, 4) for l in losses]}  = single process, all {len(params)} parameters equal")

# %% [markdown]
# ## 3. Measured timelines
#
# To see the *schedule* rather than two CPU cores being shared by four processes, each stage here is a
# `dl.pp.TimedStage`: y = x + w with real gradients, whose forward takes T, backward 2T (split evenly into I and W),
# spent sleeping. Everything else is the real executor: real messages (gloo `isend`/`irecv`), real waiting.
# The trace records every F/B/I/W as a compute span (`dl.pp.ActionTrace`, around the compute only: a rank waiting
# for a message is idle), every send and receive as a comm event (`parallel/collectives.py`, the one writer), and
# after every action how many microbatches the rank holds activations for (`dl.memory.PipelineStash`).
#
# Prediction, with t_F = T and t_B = 2T (`dl.theory.bubble`, "total" convention: idle share of the step):
#
# * GPipe and 1F1B: (p-1)/(m+p-1)
# * interleaved with v chunks: (p-1)/(v·m+p-1)
# * ZB-H1: idle (p-1)(t_F + t_I - t_W) instead of (p-1)(t_F + t_B)

# %%
T = 0.02                         # seconds per forward of one stage; a backward takes 2T

def timed_run(name, m, v=1, steps=2, t=T):
    p, r = dl.world_size(), dl.rank()
    ids = [r + k * p for k in range(v)]
    stages = [dl.pp.TimedStage(8, t_f=t / v, t_b=2 * t / v) for _ in ids]
    pipe = dl.pp.Pipeline(stages if v > 1 else stages[0], ids if v > 1 else ids[0], p * v,
                          schedule=name, microbatches=m, observers=observers())
    x, y = torch.randn(m, 8), torch.zeros(m, 8)
    for _ in range(steps):       # step 0 also exchanges shapes; we measure step 1
        dist.barrier()           # start every rank's step together
        pipe.step(x, y)

runs = {name: dl.launch(timed_run, world_size=P, args=(name, M, v), output="quiet") for name, v in SCHEDULES}
fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
for ax, (name, v) in zip(axes, SCHEDULES):
    draw_pipeline(runs[name].trace, step=1, ax=ax,
                    title=f"{name}: measured bubble {dl.pp.measured_bubble(runs[name].trace, 1).total:.0%}")
fig.tight_layout()
plt.show()

# %% [markdown]
# Check the executed order against the schedule (the executor ran exactly the lists of section 1), then compare
# the measured bubble with the prediction. Measured = 1 - busy / (p · makespan), from the timeline itself.

# %% tags=["nbval-ignore-output"]
measured = {}
print(f"{'schedule':12} {'predicted (total)':>18} {'measured (total)':>17} {'predicted (ideal)':>18}")
for name, v in SCHEDULES:
    trace = runs[name].trace
    plan = dl.pp.schedule(name, P, M, virtual=v)
    assert all(dl.pp.executed(trace, r, step=1) == plan[r] for r in range(P)), "executor left its schedule"
    total = dl.theory.bubble(name, P, M, v=v, t_f=1, t_b=2)
    ideal = dl.theory.bubble(name, P, M, v=v, t_f=1, t_b=2, convention="ideal")
    measured[name] = dl.pp.measured_bubble(trace, 1).total
    print(f"{name:12} {total:>18.3f} {measured[name]:>17.3f} {ideal:>18.3f}")
    # a real run can only add idle time (message latency, waking a process): never much below, a little above
    if name != "interleaved":    # its hops weigh twice as much here: measured on its own, below, with longer actions
        assert total - 0.03 < measured[name] < total + 0.12, (name, measured[name], total)
assert measured["zb-h1"] < measured["1f1b"]

# %% [markdown]
# GPipe, 1F1B and ZB-H1 land within [-0.03, +0.12] of the prediction and ZB-H1 below 1F1B (the cell asserts
# these; its printed numbers change from run to run, so nbval does not compare them).
# Interleaved is not held to the same window: that window, [0.13, 0.28], also holds 1F1B's own 0.27, so a schedule
# that quietly ran like 1F1B would pass it. Interleaving gets its own measurement below, where v must show.
#
# What the measurement shows, and what it does not. GPipe and 1F1B have the same predicted bubble, and measured
# they land close together, 1F1B often a point or two *above* GPipe: its steady state alternates F and B, so a
# rank waits on a neighbour more often and pays a wake-up each time. Interleaving's gain is measured smaller than
# predicted, and on a loaded machine a run can show interleaved barely below GPipe (or even above it): its actions
# are v times shorter while each hop costs the same, so hop costs eat the saving (next paragraph). With 20 ms
# actions these 2 shared cores do not show interleaving's factor v; the subsection after next makes the actions
# long beside a hop, and there it shows, measured.
#
# Why +0.12 and not tighter: the formula charges nothing for a hop from rank to rank, and each hop here costs a
# message plus waking a sleeping process, about 1 ms on an idle machine and several on a loaded 2-core one.
# 1F1B's extra idle is roughly (hops on the critical path) x (cost per hop) / (step time): a few percent. The
# interleaved schedule makes v = 2 times more hops with actions v times shorter, so the same per-hop cost weighs
# about twice as much (+0.12 and more on a busy machine). The bound is the worst case for GPipe, 1F1B and ZB-H1,
# not a fudge: an executor that left its schedule, or one that serialised the ranks, lands far outside it.

# %% [markdown]
# ### Where v shows: actions long beside a hop
#
# The claim to measure: interleaving v chunks divides the idle time by v ((p-1)·3T per rank for GPipe, (p-1)·3T/v
# interleaved: the ideal convention's (p-1)/m -> (p-1)/(v·m)). So we make the hops small beside the actions: T =
# 60 ms per forward (30 ms per chunk at v = 2), and m = p = 4 to keep the step short. The idle time per rank,
# measured, is makespan - busy / p. **Prediction:** GPipe idles 9T = 540 ms per rank, interleaved 270 ms, a ratio of
# v = 2; hops and wake-ups add to both, the more to interleaved (runs here measured 1.6 to 1.8 on a loaded machine),
# so we assert the measured ratio within [1.3, 2.5]. A schedule that behaved like 1F1B (or GPipe) under the name
# "interleaved" gives a ratio near 1 (1F1B's measured idle is GPipe's within a few percent).

# %% tags=["nbval-ignore-output"]
T_LONG, M_V = 0.06, 4

idle = {}
for name, v in (("gpipe", 1), ("interleaved", 2)):
    run = dl.launch(timed_run, world_size=P, args=(name, M_V, v, 2, T_LONG), output="quiet")
    b = dl.pp.measured_bubble(run.trace, 1)
    idle[name] = b.makespan - b.busy / b.ranks
    predicted_idle = (P - 1) * 3 * T_LONG / v
    print(f"{name:12} v = {v}: idle per rank measured {idle[name] * 1e3:4.0f} ms, predicted {predicted_idle * 1e3:4.0f} ms")
ratio = idle["gpipe"] / idle["interleaved"]
print(f"GPipe's idle over interleaved's: {ratio:.2f} (v = 2)")
assert 1.3 <= ratio <= 2.5, ratio

# %% [markdown]
# With actions long beside a hop the factor v is there, measured. With the 20 ms actions of the timelines above,
# the same hops (a few ms each, more on a loaded machine) are a larger share of a 10 ms chunk, which is why the
# interleaved timeline shows less than v. On GPUs the same per-hop overheads exist (kernel launches, NCCL latency),
# which is one more reason real pipelines want m well above p and do not interleave more deeply than they must.

# %% [markdown]
# ## 4. Bubble against the number of microbatches
#
# Two conventions are in use, and papers mix them:
#
# * **total**: idle share of the whole step, (p-1)/(m+p-1), what the timeline shows blank;
# * **ideal**: idle time over the ideal compute time m(t_F + t_B), (p-1)/m, Megatron-LM's convention.
#
# Both fall like 1/m: more microbatches, smaller bubble (but smaller matmuls, and for GPipe more memory).

# %% tags=["nbval-ignore-output"]
MS = (1, 2, 4, 8, 16)
sweep = {m: dl.pp.measured_bubble((runs["1f1b"] if m == M else
                                   dl.launch(timed_run, world_size=P, args=("1f1b", m), output="quiet")).trace, 1)
         for m in MS}
predicted_total = [dl.theory.bubble("1f1b", P, m, t_f=1, t_b=2) for m in MS]
predicted_ideal = [dl.theory.bubble("1f1b", P, m, t_f=1, t_b=2, convention="ideal") for m in MS]
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
a.plot(MS, predicted_total, "o-", label="predicted (p-1)/(m+p-1)")
a.plot(MS, [sweep[m].total for m in MS], "s--", label="measured")
b.plot(MS, predicted_ideal, "o-", label="predicted (p-1)/m")
b.plot(MS, [sweep[m].ideal for m in MS], "s--", label="measured")
for ax, conv in ((a, "idle / step time"), (b, "idle / ideal compute")):
    ax.set_xscale("log", base=2); ax.set_xlabel("microbatches m"); ax.set_ylabel(conv); ax.legend(fontsize=8)
fig.suptitle(f"1F1B bubble, p = {P}")
fig.tight_layout()
for m, pt, pi in zip(MS, predicted_total, predicted_ideal):
    print(f"m = {m:2}:  predicted total {pt:.3f}   measured total {sweep[m].total:.3f}   predicted ideal {pi:.3f}")
    assert pt - 0.03 < sweep[m].total < pt + 0.12
assert all(sweep[a].total > sweep[b].total for a, b in zip(MS, MS[1:])), "bubble must fall as m grows"
# the m >= 4p rule of thumb (GPipe, Huang et al. 2019): at m = 4p the bubble is (p-1)/(5p-1), under a fifth
# (measured: within the window above of it, the hops' allowance; a loaded machine reaches the window's top)
assert 4 * P in MS and dl.theory.bubble("1f1b", P, 4 * P, t_f=1, t_b=2) < 0.2
plt.show()

# %% [markdown]
# **The m >= 4p rule.** The measured curve falls like the formula: each doubling of m removes a large share of the
# idle time while m is small, and less and less after. At m = 4p the predicted bubble is (p-1)/(5p-1), under 20%
# for any p (here 3/19 = 16%), and the measured one sits a few points above; beyond that, more microbatches buy
# little and cost smaller matmuls (and, for GPipe, more stashed activations). Hence the rule of thumb m >= 4p,
# GPipe's (Huang et al. 2019: the bubble overhead is negligible when M >= 4K, M microbatches on K partitions).

# %% [markdown]
# ## 5. Activations in flight
#
# A stage must keep a microbatch's activations from its forward until its backward. GPipe runs all m forwards
# first, so every stage holds **m** microbatches at its peak. 1F1B starts a backward as soon as one is possible,
# so stage i holds at most **p - i** (Narayanan et al. 2021): memory no longer grows with m. `PipelineStash`
# samples this count after every action (it reads `pipe.stash`, the executor's own record of what it keeps for the
# backward); the plot is the measured count over the step.

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
draw_stash(runs["gpipe"].trace, step=1, ax=a, title="GPipe: every rank reaches m")
draw_stash(runs["1f1b"].trace, step=1, ax=b, title="1F1B: rank i reaches p - i")
peaks = {name: [max(n for _, n, _ in dl.pp.in_flight(runs[name].trace, r, step=1)) for r in range(P)]
         for name in ("gpipe", "1f1b")}
print("peak microbatches in flight, gpipe:", peaks["gpipe"], " 1f1b:", peaks["1f1b"])
assert peaks["gpipe"] == [M] * P and peaks["1f1b"] == [P - i for i in range(P)]
assert peaks["1f1b"] == dl.pp.peak_activations(dl.pp.schedule("1f1b", P, M))
fig.tight_layout()
plt.show()


# %% [markdown]
# In bytes, for the real GPT of section 2: `PipelineStash` measures what autograd saves for the backward in each
# stage's first forward of a microbatch (saved-tensor hooks around the action, parameters excluded). Peak stash = peak count x bytes per microbatch.

# %%
def gpt_stash(name):
    pipelined(name, 1, steps=1)
    return None

gpt_runs = {name: dl.launch(gpt_stash, world_size=P, args=(name,), output="quiet") for name in ("gpipe", "1f1b")}
for name, run in gpt_runs.items():
    per_mb = [max(b for _, n, b in dl.pp.in_flight(run.trace, r) if n == 1) for r in range(P)]
    peak = [max(b for _, _, b in dl.pp.in_flight(run.trace, r)) for r in range(P)]
    count = dl.pp.peak_activations(dl.pp.schedule(name, P, M))
    assert peak == [c * b for c, b in zip(count, per_mb)]
    print(f"{name:6} peak stash per rank (KiB): {[round(b / 1024) for b in peak]}   (= {count} microbatches)")

# %% [markdown]
# ## What to remember
#
# * A pipeline schedule is a list of actions per rank; GPipe and 1F1B have the same bubble, (p-1)/(m+p-1) of the
#   step ((p-1)/m of the ideal time), but 1F1B keeps at most p - i microbatches on stage i instead of m.
# * Interleaving v chunks per rank divides the idle time by v ((p-1)/m -> (p-1)/(v·m) of the ideal step; less than
#   v as a share of the step), for v times more point-to-point messages, whose latency eats part of the gain:
#   measured here, the factor shows with actions long beside a hop, and shrinks with short ones.
# * Splitting the backward into I and W (ZB-H1) moves the weight gradients into the bubble: smaller idle time at
#   1F1B's activation memory.
# * Measured timelines sit slightly above the formulas: every hop costs latency the formulas ignore; a larger m
#   amortises it.
#
# **Try it**: set `P = 2` or `M = 16` at the top, or give `TimedStage` a larger `t_w`: ZB-H1's bubble shrinks further.

# %% [markdown]
# ## Build it yourself
#
# Write each function below, then run the check under it: `dl.exercises.check` runs your code on real ranks (several world sizes, sizes that do not divide) beside the reference and says the first difference in words. The teacher's version of this notebook shows a solution; the student version has a stub instead: `make lab` opens it (`lab/student/`), and `distlab lessons DIR` writes it to `DIR/student/`.

# %%
import os
from pathlib import Path

import torch
import torch.distributed as dist

import distlab as dl


# %% [markdown]
# **one_f_one_b**: one_f_one_b(stages, microbatches) -> for each rank the list of 'F<i>' / 'B<i>' actions of 1F1B

# %% nbgrader={"grade": false, "grade_id": "one_f_one_b", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def one_f_one_b(stages: int, microbatches: int) -> list[list[str]]:
    """Per rank, the 1F1B order of "F<i>" and "B<i>": rank r runs min(p - r - 1, m) warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards (PipeDream-Flush,
    Narayanan et al. 2021)."""
    ### BEGIN SOLUTION
    plan = []
    for r in range(stages):
        warmup = min(stages - r - 1, microbatches)
        actions = [f"F{i}" for i in range(warmup)]
        for i in range(warmup, microbatches):
            actions += [f"F{i}", f"B{i - warmup}"]
        actions += [f"B{i}" for i in range(microbatches - warmup, microbatches)]
        plan.append(actions)
    return plan
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_one_f_one_b", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("one_f_one_b", one_f_one_b).require();
