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
# # 02 · Data parallelism: naive, bucketed and overlapped DDP
#
# The simplest way to use N accelerators: give every rank a **full copy of the model** and **1/N of the batch**.
# Each rank computes the gradient of its share; the ranks **average** their gradients (an all-reduce), so every
# replica takes exactly the step a single process would take on the whole batch, and the replicas stay identical.
#
#     rank 0:  model  x[0 : B/N]      -> g_0 ─┐
#     rank 1:  model  x[B/N : 2B/N]   -> g_1 ─┼─ all-reduce:  g = (g_0 + ... + g_{N-1}) / N  on every rank
#     ...                                     │
#     rank N-1                         -> g_{N-1} ┘        then every rank: optimizer.step() with g
#
# That is all of DDP's maths. Its engineering (Li et al. 2020, *PyTorch Distributed: Experiences on Accelerating
# Data Parallel Training*) is about making the all-reduce cheap:
#
# 1. **naive** (`NaiveDDP`): one all-reduce per parameter tensor after backward: a latency α per tensor;
# 2. **bucketed**: pack gradients into ~25 MB *buckets*: few, large messages;
# 3. **overlapped**: launch each bucket's all-reduce *during* backward, the moment its gradients are ready, so
#    communication hides behind the rest of the backward pass.
#
# In this lesson you will predict and measure the bytes per step (2(N-1)/N · Ψ), see communication move under
# the backward pass in a timeline, accumulate gradients with `no_sync`, measure scaling at 1, 2 and 4 ranks, and
# read the fraction of time spent communicating from a `torch.profiler` trace.
#
# **The code, in reading order** ([distlab/parallel/data/](../distlab/parallel/data/__init__.py)):
# [ddp.py](../distlab/parallel/data/ddp.py) holds `NaiveDDP` (version 1, about 40 lines) and then `DDP`
# (versions 2 and 3); [buckets.py](../distlab/parallel/data/buckets.py) packs parameters into buckets;
# [backward_hooks.py](../distlab/parallel/data/backward_hooks.py) notices, during backward, when a bucket is full.
# Every all-reduce goes through [distlab/parallel/collectives.py](../distlab/parallel/collectives.py), which
# records it in the trace (the algorithms carry no instrumentation).

# %%
import contextlib
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
import matplotlib.pyplot as plt
import distlab as dl

MODEL = "gpt-small"                     # 4 layers, d_model 128: big enough that backward takes a while
ROWS = 8                                # sequences per rank per step
PSI = sum(p.numel() for p in dl.models.build(MODEL).parameters())
print(f"{MODEL}: Psi = {PSI} parameters = {4 * PSI} bytes of fp32 gradient")


# %% [markdown]
# ## 1. DDP by hand: average the gradients
#
# Before any library: give each rank its rows, run backward, all-reduce every gradient and divide by N. Because
# the loss is a **mean** over the batch and the shards are equal, the mean of the N shard-gradients *is* the
# gradient of the whole batch. We check it against one process that sees every row.
#
# `dl.NaiveDDP` ([ddp.py](../distlab/parallel/data/ddp.py)) is this loop as a class, plus the two things a real
# run needs: it broadcasts rank 0's weights at construction (replicas that start equal and take equal steps stay
# equal), and it runs the loop by itself when `loss.backward()` returns (a post-accumulate-grad hook queues it
# with autograd). We check it too.

# %%
def by_hand():
    n, r = dl.world_size(), dl.rank()
    x, y = dl.models.dataset_for(MODEL).batch(0, ROWS * n)
    replica = dl.models.build(MODEL, seed=0)                 # same seed on every rank: identical replicas
    F.cross_entropy(replica(x.chunk(n)[r]).flatten(0, 1), y.chunk(n)[r].flatten()).backward()
    for p in replica.parameters():                           # the naive DDP: one all-reduce per tensor
        dist.all_reduce(p.grad)
        p.grad /= n
    naive = dl.NaiveDDP(dl.models.build(MODEL, seed=0))      # the same, as a class
    F.cross_entropy(naive(x.chunk(n)[r]).flatten(0, 1), y.chunk(n)[r].flatten()).backward()
    whole = dl.models.build(MODEL, seed=0)                   # one process, the whole batch
    F.cross_entropy(whole(x).flatten(0, 1), y.flatten()).backward()
    norm = sum(q.grad.pow(2).sum() for q in whole.parameters())

    def error(model):
        diff = sum((p.grad - q.grad).pow(2).sum() for p, q in zip(model.parameters(), whole.parameters()))
        return (diff / norm).sqrt().item()
    return {"by hand": error(replica), "dl.NaiveDDP": error(naive)}

errors = dl.launch(by_hand, world_size=2, output="quiet").results
for name in ("by hand", "dl.NaiveDDP"):
    print(f"{name:12} relative difference from the single-process gradient, per rank:",
          ["< 1e-6" if e[name] < 1e-6 else f"{e[name]:.1e}" for e in errors])
assert max(e[name] for e in errors for name in e) < 1e-6


# %% [markdown]
# ## 2. The prediction: bytes and messages per step
#
# A **ring all-reduce** of S bytes makes every rank send 2(N-1)/N · S (lesson 01): (N-1)/N · S in the
# reduce-scatter, as much again in the all-gather. The gradient is Ψ fp32 numbers, so whatever the packing,
#
#   **bytes sent per rank per step = 2(N-1)/N · 4Ψ**   (`dl.theory.dp_volume`)
#
# Packing changes the *number of messages*, and each costs a latency α (the α-β model:
# T = Σ_messages 2(N-1)(α + (S_i/N)/B), B the link's bandwidth in bytes per second, as in lesson 01 and
# [docs/notation.md](../docs/notation.md)): one per parameter tensor for the naive version, one per bucket otherwise.
#
# `dl.NaiveDDP(module)` is version 1; `dl.DDP(module, bucket_mb, overlap)` versions 2 (`overlap=False`) and 3.
# Buckets are filled in **reverse registration order** ([buckets.py](../distlab/parallel/data/buckets.py)), the
# order backward produces gradients; each bucket is one flat buffer and `p.grad` is a view into it, so
# all-reducing a bucket needs no copy. We train 5 steps of `gpt-small` at N = 2 in each mode, record a mark every
# time a parameter's gradient is ready, and read the trace.

# %%
def ddp_steps(mode, steps=5, bucket_mb=0.5, comm="torch"):
    tr, n, r = dl.tracer(), dl.world_size(), dl.rank()
    gpt = dl.models.build(MODEL, seed=0)
    if mode == "naive":
        ddp = dl.NaiveDDP(gpt, comm=comm)           # one all-reduce per parameter, after backward
    else:
        ddp = dl.DDP(gpt, bucket_mb=bucket_mb, overlap=(mode == "overlapped"), comm=comm)
    for name, p in gpt.named_parameters():          # registered after DDP's hooks: marks follow DDP's launches
        p.register_post_accumulate_grad_hook(lambda p, name=name: tr.mark("grad ready", param=name))
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    data = dl.models.dataset_for(MODEL)
    for step in range(steps):
        x, y = data.batch(step, ROWS * n)
        tr.mark("step", step=step)
        with tr.span("forward", step=step):
            loss = F.cross_entropy(ddp(x.chunk(n)[r]).flatten(0, 1), y.chunk(n)[r].flatten())
        with tr.span("backward", step=step):
            loss.backward()                          # returns with averaged gradients: no extra call
        with tr.span("optimizer", step=step):
            opt.step()
            opt.zero_grad()
    return {"buckets": len(ddp.buckets) if mode != "naive" else None, "tensors": len(ddp.params)}

N = 2
MODES = ("naive", "bucketed", "overlapped")
# output="quiet": the ranks print nothing we need (their text stays in run.outputs)
runs = {mode: dl.launch(ddp_steps, world_size=N, args=(mode,), output="quiet") for mode in MODES}


def step_window(trace, rank, step):
    """(start of the step, end of its backward) on ``rank``."""
    start = [e for e in trace.select("mark", rank=rank, name="step") if e.args["step"] == step][0].start
    backward = [e for e in trace.spans(rank=rank, name="backward") if e.args["step"] == step][0]
    return start, backward


predicted = dl.theory.dp_volume(4 * PSI, N)
print(f"predicted bytes sent per rank per step: 2(N-1)/N * 4 Psi = {predicted:.0f}")
for mode, run in runs.items():
    info = run.results[0]
    for r in range(N):
        for step in range(1, 5):
            start, backward = step_window(run.trace, r, step)
            comms = [e for e in run.trace.comms(rank=r) if start <= e.start <= backward.end]
            expected_messages = info["tensors"] if mode == "naive" else info["buckets"]
            assert len(comms) == expected_messages, (mode, r, step, len(comms))
    print(f"{mode:10}  all-reduce calls per step {len(comms):3}")

# %% [markdown]
# **Measuring the bytes.** gloo does not say what it put on the wire, so a torch collective is recorded with the
# count the ring algorithm would send (the event says `bytes="ring-model"`): summing those would only check the
# formula against itself. To *measure*, run the same DDP on distlab's own ring (`comm="ring"`,
# [comm/ring_pipelined.py](../distlab/comm/ring_pipelined.py)), built from send/recv: every chunk is counted
# where it is sent.

# %%
on_the_wire = {mode: dl.launch(ddp_steps, world_size=N, args=(mode, 2), kwargs={"comm": "ring"}, output="quiet")
               for mode in MODES}
for mode, run in on_the_wire.items():
    for r in range(N):
        start, backward = step_window(run.trace, r, 1)
        sends = [e for e in run.trace.comms(rank=r) if start <= e.start <= backward.end]
        assert all(e.args.get("bytes") != "ring-model" for e in sends)       # real sends, not the model
        sent = sum(e.sent for e in sends)
        assert abs(sent - predicted) <= 0.01 * predicted, (mode, r, sent)
    print(f"{mode:10}  measured bytes sent {sent}   measured / predicted {sent / predicted:.4f}   "
          f"({len({e.args['call'] for e in sends})} ring all-reduces, {len(sends)} sends)")


# %% [markdown]
# Same bytes three ways (the ratio differs from 1 only by the ring's chunk rounding of odd-sized tensors), but
# the naive version sends one message per parameter tensor, the others one per bucket. At the 25 MB default,
# `gpt-small`'s whole gradient would fit in a single bucket; we use 0.5 MB buckets here so there are several to
# watch.
#
# ## 3. Overlap: communication hidden under backward
#
# Backward runs from the last layer to the first. In the overlapped version, the bucket holding the last layers'
# gradients is complete long before backward reaches the embeddings, and its all-reduce starts right then (a
# `register_post_accumulate_grad_hook` notices the bucket is full); `loss.backward()` waits for the outstanding
# ones at the very end. Without overlap, every all-reduce starts after the last gradient. (That hook, and the
# queue that keeps every rank launching its buckets in the same order, is
# [backward_hooks.py](../distlab/parallel/data/backward_hooks.py).)
#
# **Prediction that holds on any machine, loaded or not:** in overlapped mode the first all-reduce *starts before
# the last gradient is ready*; in the other two modes, every all-reduce starts after it. It is a statement about
# order, not speed, so we assert it on every rank and every step:

# %%
def first_comm_before_last_grad(trace, rank, step):
    start, backward = step_window(trace, rank, step)
    grads = [e.start for e in trace.select("mark", rank=rank, name="grad ready") if start <= e.start <= backward.end]
    comms = [e.start for e in trace.comms(rank=rank) if start <= e.start <= backward.end]
    return min(comms) < max(grads)

for mode, run in runs.items():
    verdicts = {first_comm_before_last_grad(run.trace, r, step) for r in range(N) for step in range(5)}
    print(f"{mode:10}  first all-reduce starts before the last gradient is ready: {sorted(verdicts)}")
    assert verdicts == {mode == "overlapped"}

# %% [markdown]
# The timelines of one step show it (upper lane: forward, backward, optimizer; lower lane, red: all-reduces, each
# drawn from launch until it completed; dotted line: the rank's last gradient is ready). In the bucketed run the red
# bars start at the dotted line; in the overlapped one they start well before it, under the backward pass. A long
# first bar usually means waiting: a collective completes only when the *slowest* rank joins it, so a rank that
# was descheduled for a moment holds everyone up.

# %%
fig, axes = plt.subplots(2, 1, figsize=(10, 5.2))
for ax, mode in zip(axes, ("bucketed", "overlapped")):
    trace = runs[mode].trace
    start, _ = step_window(trace, 0, 3)
    end = [e for e in trace.spans(rank=0, name="optimizer") if e.args["step"] == 3][0].end
    dl.viz.timeline(trace, start=start, end=end, ax=ax, title=f"{mode} DDP, N = {N}: one step")
    for r in range(N):                               # dotted: this rank's last gradient is ready
        s, backward = step_window(trace, r, 3)
        last = max(e.start for e in trace.select("mark", rank=r, name="grad ready") if s <= e.start <= backward.end)
        y = N - 1 - r
        ax.plot([(last - start) * 1e3] * 2, [y + 0.02, y + 0.95], "k:", lw=2)
fig.tight_layout()
plt.show()


# %% [markdown]
# How much time did overlap actually save? The **exposed** communication is the wait between the last gradient
# and the end of `backward()`: all-reduces still in flight. These are wall-clock times on a small, shared CPU
# machine where the communication thread competes with the compute for the same cores, so they vary from run to
# run (this cell's output is not checked). On GPUs NCCL runs on its own streams, and overlap can hide the
# all-reduce only when it is shorter than the backward it overlaps. Per GPU, a ring all-reduce of bf16 gradients
# sends about 2 · 2Ψ bytes, 4Ψ/B seconds; the backward computes about 4Ψ FLOPs per token (two thirds of 6Ψ),
# 4Ψ·t/(F·MFU) seconds for t tokens per GPU. Ψ cancels: the all-reduce hides only if **t > F·MFU/B**. On H100s
# (F = 989 TFLOP/s in bf16, MFU 40%) with 400 Gb/s = 50 GB/s of network per GPU that is t > 396e12/50e9 ≈ 7,900
# tokens per GPU per step (four sequences of 2,048); with fp32 gradients twice that; over NVLink (450 GB/s) about
# 900. Below it the communication is exposed however well it overlaps; above it, what stays exposed is the last
# bucket (the first layers' gradients, ready only when backward ends): its all-reduce, about 2·25 MB / 50 GB/s =
# 1 ms for the default `bucket_mb=25`.

# %% tags=["nbval-ignore-output"]
def exposed_ms(trace, rank, step):
    start, backward = step_window(trace, rank, step)
    grads = [e.start for e in trace.select("mark", rank=rank, name="grad ready") if start <= e.start <= backward.end]
    return (backward.end - max(grads)) * 1e3

print(f"cores on this machine: {os.cpu_count()}")
for mode, run in runs.items():
    ms = [max(exposed_ms(run.trace, r, step) for r in range(N)) for step in range(1, 5)]
    print(f"{mode:10}  exposed communication, median over 4 steps: {statistics.median(ms):6.1f} ms")


# %% [markdown]
# ## 4. Effective batch size and gradient accumulation with `no_sync`
#
# Each optimizer step sees an **effective batch** of
#
#   B_eff = N (ranks) × b (rows per rank per micro-step) × k (micro-steps accumulated)
#
# When b is limited by memory, accumulate: run k forward/backward passes and step once. With DDP you do not want k
# all-reduces: inside `with ddp.no_sync():` backward just accumulates into the local gradients, and the first
# backward outside it all-reduces the **sum**, once. We count the communication events of every micro-step:

# %%
def accumulate(k, rows_per_rank=2):
    tr, n, r = dl.tracer(), dl.world_size(), dl.rank()
    ddp = dl.DDP(dl.models.build(MODEL, seed=0), bucket_mb=0.5)
    x, y = dl.models.dataset_for(MODEL).batch(0, k * n * rows_per_rank)
    events = []
    for micro in range(k):
        rows = slice((micro * n + r) * rows_per_rank, (micro * n + r + 1) * rows_per_rank)
        before = len(tr.events())
        with ddp.no_sync() if micro < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp(x[rows]).flatten(0, 1), y[rows].flatten()) / k).backward()
        events.append(sum(e.kind == "comm" for e in tr.events()[before:]))
    return events, len(ddp.buckets)

K = 4
for r, (events, buckets) in enumerate(dl.launch(accumulate, world_size=N, args=(K,), output="quiet").results):
    print(f"rank {r}: comm events per micro-step {events}  ({buckets} buckets)")
    assert events == [0] * (K - 1) + [buckets]
print(f"effective batch: N x b x k = {N} x 2 x {K} = {N * 2 * K} sequences per optimizer step")

# %% [markdown]
# The bytes per *optimizer step* stay 2(N-1)/N · 4Ψ, so the communication per *sample* drops by k. And the
# accumulated step is the big-batch step: `dl.train` below runs DDP on 2 ranks with `grad_accum=4` (micro-steps of
# 4 rows, 2 per rank, `no_sync` on the first three) and the single-process reference on batches of 16. Same
# losses, same final parameters, to fp32 rounding:

# %%
big = dl.train("single", model="gpt-tiny", steps=5, global_batch=16, optimizer="sgd", lr=0.1)
acc = dl.train("ddp", world_size=2, model="gpt-tiny", steps=5, global_batch=16, grad_accum=4,
               optimizer="sgd", lr=0.1)
print("single, batch 16         :", " ".join(f"{l:.5f}" for l in big.losses))
print("ddp x2, 4 x 4 accumulated:", " ".join(f"{l:.5f}" for l in acc.losses))
diff = sum((acc.params[k] - v).pow(2).sum() for k, v in big.params.items())
rel = (diff / sum(v.pow(2).sum() for v in big.params.values())).sqrt().item()
print("final parameters, relative difference:", "< 1e-6" if rel < 1e-6 else f"{rel:.1e}")
assert all(abs(a - b) <= 1e-5 * b for a, b in zip(acc.losses, big.losses)) and rel < 1e-5


# %% [markdown]
# ## 5. Scaling efficiency at 1, 2 and 4 ranks
#
# **Weak scaling**: keep b = 8 sequences per rank, so N ranks process N times the tokens per step. Ideally the
# step time stays flat and the throughput grows N-fold; the **scaling efficiency** is
#
#   E(N) = throughput(N) / (N · throughput(1))   (`dl.theory.scaling_efficiency`)
#
# What costs efficiency: the exposed communication (2(N-1)/N · 4Ψ bytes per step: zero at N = 1, 4Ψ at 2,
# 6Ψ at 4), and here one more thing that matters more: **this machine's cores**. Each rank computes on one thread;
# if the ranks outnumber the free cores they take turns, and the step time grows in proportion. On a 2-core
# machine 4 ranks *oversubscribe* the CPU: E(4) cannot exceed about 2/4 whatever the communication does. On a GPU
# node, where each rank has its own device, the same code scales like the communication allows.
#
# The byte counts are the robust prediction (measured on the ring in section 2); the times are measured and
# shown.

# %%
def weak_scaling(steps=6):
    torch.set_num_threads(1)       # one compute thread per rank at every N (launch gives a lone rank 2)
    return ddp_steps("overlapped", steps=steps)

scaling = {n: dl.launch(weak_scaling, world_size=n, output="quiet") for n in (1, 2, 4)}
STEPS = range(1, 6)                # step 0 warms up


def bytes_per_step(run, rank):
    start, _ = step_window(run.trace, rank, STEPS[0])
    return sum(e.sent for e in run.trace.comms(rank=rank) if e.start >= start) / len(STEPS)

for n, run in scaling.items():          # torch collectives: bytes as the ring model counts them
    predicted = dl.theory.dp_volume(4 * PSI, n)
    sent = [bytes_per_step(run, r) for r in range(n)]
    print(f"N={n}: bytes sent per rank per step, predicted {predicted:9.0f}, "
          f"recorded (ring model) {sorted(set(sent))}")


# %% tags=["nbval-ignore-output"]
def step_seconds(run):
    """Median over steps 1..5 of the slowest rank's step time (step mark to the end of the optimizer)."""
    times = []
    for step in STEPS:
        per_rank = []
        for r in run.trace.ranks:
            start, _ = step_window(run.trace, r, step)
            end = [e for e in run.trace.spans(rank=r, name="optimizer") if e.args["step"] == step][0].end
            per_rank.append(end - start)
        times.append(max(per_rank))
    return statistics.median(times)

tokens = {n: ROWS * n * dl.models.PRESETS[MODEL].seq_len for n in scaling}
throughput = {n: tokens[n] / step_seconds(run) for n, run in scaling.items()}
efficiency = {n: dl.theory.scaling_efficiency(throughput[n], n, throughput[1]) for n in scaling}
for n in scaling:
    print(f"N={n}: {throughput[n]:8.0f} tokens/s   efficiency {efficiency[n]:.2f}   "
          f"(CPU bound on {os.cpu_count()} cores: <= {min(1, os.cpu_count() / n):.2f})")

# %%
ns = list(scaling)
fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 3.4))
ax_t.plot(ns, [throughput[n] for n in ns], "o-", label="measured")
ax_t.plot(ns, [n * throughput[1] for n in ns], "k--", label="ideal: N x throughput(1)")
ax_t.set(xlabel="ranks N", ylabel="tokens / s", title="weak scaling, 8 sequences per rank", xticks=ns)
ax_t.legend(fontsize=8)
xs = range(len(ns))
ax_e.bar(xs, [efficiency[n] for n in ns], 0.6, color="#4C72B0", label="measured")
ax_e.hlines([min(1, os.cpu_count() / n) for n in ns], [x - 0.35 for x in xs], [x + 0.35 for x in xs],
            colors="r", lw=2.5, label="CPU bound: min(1, cores / N)")
ax_e.set(xlabel="ranks N", ylabel="efficiency", ylim=(0, 1.4), title="scaling efficiency E(N)",
         xticks=list(xs), xticklabels=[str(n) for n in ns])
ax_e.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the right panel against the red marks: no bar should rise above its mark, because N ranks cannot compute
# faster than the cores allow; the gap below the mark is exposed communication, the comm thread competing with the
# compute for the same cores, and other programs sharing the machine. Those move every time you run the cell; the
# byte counts above do not.

# %% [markdown]
# ## 6. What fraction of time is communication? Ask the profiler you already use
#
# Everything above was measured by distlab's own trace. The tool you would reach for on a real cluster is
# `torch.profiler`: `dl.train(..., profile=DIR)` runs each rank under it
# ([profiler.py](../distlab/launch/profiler.py)) and writes each rank's trace (`DIR/rank{r}.json`, what Holistic
# Trace Analysis reads) and one merged `DIR/trace.json`, a process per rank on distlab's clock, with distlab's
# spans and collectives written in as `distlab:*` ranges beside torch's own ops. Open it at
# [ui.perfetto.dev](https://ui.perfetto.dev) ("Open trace file") or in `chrome://tracing`.
#
# The question "what fraction of the step is communication?" then has two measured answers over the same steps
# ([profile.py](../distlab/viz/profile.py)): the profiler's (the time its `c10d::allreduce_` and
# `gloo:all_reduce` ops run) and distlab's (each collective from before its launch to its completion). The
# profiler sees only the launch call and the backend's run, both inside distlab's interval, so the prediction
# is an order, not an equality: **profiler's fraction ≤ distlab's** (0.02 of slack for the two clocks), both
# above zero; the gap is the time a collective waited in a queue or its completion waited for the GIL. (The
# profiler records every op with its shapes, megabytes a step: the tiny GPT, 3 steps, the first left out.)

# %%
import json
import tempfile

from distlab.viz import profile as profiled

PROF = tempfile.mkdtemp(prefix="distlab_02_prof_")
report = dl.train("ddp", world_size=2, model="gpt-tiny", steps=3, profile=PROF)   # every op is in the file: small
with open(os.path.join(PROF, "trace.json")) as f:
    merged = json.load(f)["traceEvents"]
for r in range(2):
    names = {e["name"] for e in merged if e.get("pid") == r and e.get("ph") == "X"}
    ours = sorted(n for n in names if n in ("distlab:forward", "distlab:backward", "distlab:all_reduce"))
    theirs = sorted(n for n in names if n in ("c10d::allreduce_", "gloo:all_reduce"))
    print(f"rank {r}: distlab's ranges {ours}, torch's collective ops {theirs}")
    assert len(ours) == 3 and len(theirs) == 2
figures = profiled.measured(PROF, report.trace)

# %% tags=["nbval-ignore-output"]
for r, f in figures.items():
    print(f"rank {r}: communication {f['comm']:.1%} of step time by the profiler, {f['distlab']['comm']:.1%} by "
          f"distlab's trace; {f['hidden']:.0%} of the profiler's under compute")

# %%
for r, f in figures.items():
    assert 0 < f["comm"] <= f["distlab"]["comm"] + 0.02 and f["distlab"]["comm"] < 1, (r, f)
print("asserted on both ranks: 0 < the profiler's comm fraction <= distlab's (+0.02)")


# %% [markdown]
# ## What to remember
#
# * DDP = replicas + averaged gradients: every rank takes the single-process step on the global batch.
# * A ring all-reduce of Ψ fp32 gradients sends 2(N-1)/N · 4Ψ bytes per rank, under 8Ψ whatever N is; the
#   number of messages (latency) is what bucketing fixes.
# * Overlap launches each bucket as soon as it is full; measured here as an *order* (first all-reduce before
#   the last gradient), on GPUs as time saved.
# * `no_sync` turns k micro-steps into one all-reduce; the result is exactly the big-batch step.
# * Scaling efficiency needs resources that grow with N: on 2 shared CPU cores, 4 ranks are CPU-bound.
#
# **Try it**: change `bucket_mb` in `ddp_steps` (try 0.05 and 25) and count the messages; set `N = 4` in section 2.

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
# **buckets**: buckets(sizes, cap) -> lists of parameter indices, in reverse order, no bucket over cap bytes unless one parameter alone is larger

# %% nbgrader={"grade": false, "grade_id": "buckets", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Indices of the parameters in each DDP bucket: walk the parameters in *reverse* order (the order
    backward produces gradients) and start a new bucket when the next one would pass ``cap`` bytes;
    a parameter larger than ``cap`` gets a bucket of its own. (`distlab/parallel/data/buckets.py`)"""
    ### BEGIN SOLUTION
    out: list[list[int]] = []
    size = 0
    for i in reversed(range(len(sizes))):
        if not out or size + sizes[i] > cap:
            out.append([])
            size = 0
        out[-1].append(i)
        size += sizes[i]
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_buckets", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("buckets", buckets).require();
