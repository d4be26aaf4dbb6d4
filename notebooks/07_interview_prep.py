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
# # 07 · Interview prep: the numbers behind distributed training
#
# Every question about distributed training ends in arithmetic: *how many bytes per GPU*, *how long does the
# all-reduce take*, *how much of the pipeline sits idle*. `dl.theory` holds those formulas, each one citing the
# paper it comes from and tested against the paper's own figures; `dl.widgets` puts them behind sliders.
#
# Every widget here also exposes `.controls` (its inputs) and `.result` (its latest answer), so the cells below
# move the controls from code and **assert** what the answer must be. Change the sliders yourself afterwards.
#
# The formulas are plain Python, no torch, one file per topic: memory per GPU in
# [distlab/theory/memory.py](../distlab/theory/memory.py), activations in
# [activations.py](../distlab/theory/activations.py), collective costs in [comm.py](../distlab/theory/comm.py),
# bubbles in [pipeline.py](../distlab/theory/pipeline.py), the advisor in [planner.py](../distlab/theory/planner.py);
# the widgets that draw them in [distlab/widgets/](../distlab/widgets/base.py).

# %%
# %matplotlib inline
import distlab as dl
from distlab.theory import GB

# %% [markdown]
# ## 1. Memory: 16 bytes per parameter
#
# Mixed-precision Adam keeps bf16 weights (2 bytes) and gradients (2), plus an fp32 master copy and two fp32
# moments (K = 12): **16 bytes per parameter** (Rajbhandari et al. 2020). Drop the master copy and it is 12;
# pure fp32 is 4 + 4 + 8 = 16 again. ZeRO shards the optimizer (stage 1), then gradients (2), then parameters (3)
# over the N data-parallel ranks.

# %%
for label, kwargs in [("bf16 Adam, no master copy", dict(master_weights=False)),
                      ("fp32 Adam", dict(precision="fp32")),
                      ("bf16 mixed + master", dict())]:
    print(f"7B  {label:26s} {dl.theory.memory(7e9, **kwargs).total / GB:6.0f} GB")
print(f"70B bf16 Adam, no master copy  {dl.theory.memory(70e9, master_weights=False).total / GB:6.0f} GB")

zero_paper = [round(dl.theory.memory(7.5e9, dp=64, zero=s).total / GB, 1) for s in range(4)]
print("ZeRO paper, 7.5B on 64 GPUs, stages 0-3:", zero_paper, "GB")
assert zero_paper == [120.0, 31.4, 16.6, 1.9]
assert dl.theory.memory(7e9, master_weights=False).total == 84 * GB

# %% [markdown]
# Activations come on top: per layer `s·b·h·(34 + 5·a·s/h)` bytes (Korthikanti et al. 2022), divided by the
# tensor-parallel size with sequence parallelism, and almost gone with recomputation. The calculator stacks the
# four categories for each pipeline stage and checks every GPU preset (dashed lines).

# %% tags=["nbval-ignore-output"]
mem = dl.widgets.memory_calculator("llama2-7b")
mem

# %%
mem.controls["zero"].value = 0
start = mem.result.total_gb
mem.controls["zero"].value = 3
print(f"llama2-7b, dp=8, seq 2048: ZeRO-0 {start:.1f} GB -> ZeRO-3 {mem.result.total_gb:.1f} GB per GPU")
print("fits on:", [g for g, ok in mem.result.fits.items() if ok])
print("cheapest:", mem.result.cheapest)
assert mem.result.memory == dl.theory.memory("llama2-7b", dp=8, zero=3, seq_len=2048)
assert mem.result.total_gb < start and mem.result.fits["h100-80gb"]

# %% [markdown]
# ## 2. Which parallelism?
#
# The decision guide: if it fits on one GPU, use DDP; otherwise recompute activations; then shard the optimizer,
# gradients and parameters (ZeRO), recomputing everything if need be; then split layers with tensor parallelism
# inside a node (NVLink); then cut the model into pipeline stages across nodes. The advisor walks it and says why
# at each step.
#
# The guide is about **memory**, and by memory alone ZeRO-3 with full recomputation always beats tensor
# parallelism: model states of `16Ψ/N` bytes against TP's `4Ψ/t + 12Ψ/N`, and two bytes per element of each
# layer's input against TP+SP's `34/t`. Large runs still choose TP for **throughput**: full recomputation costs a
# third more compute and ZeRO-3 all-gathers every layer across all nodes. Untick *accept full recomputation* to
# see the layout they pick.

# %% tags=["nbval-ignore-output"]
guide = dl.widgets.advisor("llama3-70b", "h100-80gb", gpus=64)
guide

# %%
for question, answer in guide.result.steps:
    print(f"- {question}\n    {answer}")
print("=>", guide.result.plan)
memory_only = guide.result.plan
assert (memory_only.zero, memory_only.recompute, memory_only.tp) == (3, "full", 1)
assert 22 < memory_only.memory.total / GB < 24

guide.controls["full_recompute"].value = False          # refuse the 33% recompute tax
print("without full recomputation =>", guide.result.plan)
assert guide.result.plan.tp == 8 and guide.result.plan.pp == 1
assert guide.result.plan.memory.total > memory_only.memory.total

# %% [markdown]
# ## 3. Communication: the ring all-reduce
#
# A ring all-reduce sends `2(N-1)/N · S` bytes per rank, so it takes `2(N-1)/N · S/B` plus `2(N-1)` latencies,
# nearly flat in N. Trees pay only `2·log2 N` latencies but move the whole buffer at each level: they win for tiny
# messages on many ranks. nccl-tests report `busbw = S/t · 2(N-1)/N`, comparable with the link's peak.

# %% tags=["nbval-ignore-output"]
comm = dl.widgets.allreduce_explorer(n=8, size_mb=100.0, link="nvlink4")
comm

# %%
print({a: f"{t * 1e3:.3f} ms" for a, t in comm.result.seconds.items()}, "fastest:", comm.result.fastest)
with comm.hold():
    comm.controls["n"].value = 1024
    comm.controls["size_mb"].value = 0.001
    comm.controls["link"].value = "ethernet-100g"
print("1 KB on 1024 ranks over 100 GbE, fastest:", comm.result.fastest)
assert comm.result.fastest == "tree"
ring = dl.theory.comm_time("all_reduce", 1e9, 8, 100e9)
assert abs(ring - 2 * 7 / 8 * 1e9 / 100e9) < 1e-12

# %% [markdown]
# ## 4. Pipeline bubbles
#
# With p stages and m microbatches, GPipe and 1F1B both idle `(p-1)/(m+p-1)` of the step. Interleaving v chunks
# per GPU divides the bubble by about v; zero-bubble ZB-H1 splits the backward into input-gradient (I) and
# weight-gradient (W) passes and pushes the Ws into the gaps: `(p-1)(T_F + T_I - T_W)` of idle time. The
# explorer *simulates* the exact action lists the pipeline executor runs and compares with the formula.

# %% tags=["nbval-ignore-output"]
pipe = dl.widgets.bubble_explorer("1f1b", p=4, m=8)
pipe

# %%
for name in ["gpipe", "1f1b", "interleaved", "zb-h1"]:
    pipe.controls["schedule"].value = name
    r = pipe.result
    print(f"{name:12s} simulated {r.simulated:.3f}  theory {r.predicted:.3f}")
    assert abs(r.simulated - r.predicted) < 1e-9
pipe.controls["schedule"].value = "1f1b"
assert abs(pipe.result.simulated - 3 / 11) < 1e-12

# %% [markdown]
# ## 5. Throughput and time to train
#
# Training costs about `6·N·D` FLOPs (2 forward, 4 backward per parameter per token). At a given model-FLOPs
# utilisation the wall-clock follows, and Chinchilla's compute-optimal `D ≈ 20·N` sets the token budget.

# %%
n = dl.theory.model("llama3-8b").params
tokens = 15e12
days = dl.theory.training_time(n, tokens, gpus=1024, peak_flops=dl.theory.gpu("h100-80gb").bf16_flops, mfu=0.4) / 86400
print(f"Llama-3 8B ({n / 1e9:.2f}B params) on 15T tokens, 1024 H100 at 40% MFU: {days:.0f} days")
print(f"Chinchilla-optimal tokens for 8B: {dl.theory.chinchilla_tokens(n) / 1e9:.0f}B")
assert 20 < days < 30

# %% [markdown]
# ## 6. Quiz
#
# Forty-odd questions: concepts (DP vs TP, ZeRO, schedules, collectives, failure modes such as NCCL timeouts,
# OOM in backward, NaN, corrupt checkpoints; scaling and learning-rate rules) and numeric ones drawn from a seed
# and answered by `dl.theory`. Pick an answer, press *Submit* for the explanation, then *Next question*.

# %% tags=["nbval-ignore-output"]
q = dl.widgets.quiz(seed=7)
q

# %%
print(len(q.questions), "questions")
state = q.result
q.controls["answer"].value = state.choices[state.question.answer]
q.controls["submit"].click()
print("right:", q.result.correct, "| score", q.result.score, "/", q.result.attempted)
assert len(q.questions) >= 40 and q.result.correct and q.result.explanation

# %% [markdown]
# ## What to remember
#
# * Mixed-precision Adam costs 16 bytes per parameter before activations; ZeRO divides 12, then 14, then all 16 of
#   them by the data-parallel size.
# * Activations grow with `s·b·h` per layer plus an `a·s²` attention term; recomputation trades them for compute.
# * A ring all-reduce moves `2(N-1)/N · S` bytes per rank whatever N; trees win only for tiny messages.
# * GPipe and 1F1B idle `(p-1)/(m+p-1)` of the step; interleaving and zero-bubble schedules shrink it.
# * By memory alone, ZeRO-3 with full recomputation fits where tensor parallelism would; TP and PP are chosen for
#   throughput.
#
# **Try it**: in the advisor, pick `llama3-405b` on 1024 GPUs and untick full recomputation; in the memory
# calculator, raise the sequence length to 8192 and watch the activations overtake the model states.
