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
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# Every question about distributed training ends in arithmetic: *how many bytes per GPU*, *how long does the
# all-reduce take*, *how much of the pipeline sits idle*. `dl.theory` holds those formulas, each one citing the
# paper it comes from and tested against the paper's own figures; `dl.widgets` puts them behind sliders.
#
# Every widget here also exposes `.controls` (its inputs) and `.result` (its latest answer), so the cell below each
# one builds a second, undisplayed copy, moves *its* controls from code and **asserts** what the answer must be:
# the widget on screen is yours and stays where you leave it. Opened before anything runs, the widgets show the
# state they were saved in; running a widget's cell makes it live.
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

# the ZeRO paper's own example (7.5B on 64 GPUs, stages 0-3) is worked in lesson 03, section 1
assert dl.theory.memory(7e9, master_weights=False).total == 84 * GB

# %% [markdown]
# Activations come on top: per layer `s·b·h·(34 + 5·a·s/h)` bytes (Korthikanti et al. 2022), divided by the
# tensor-parallel size with sequence parallelism, and almost gone with recomputation. The calculator stacks the
# four categories for each pipeline stage and checks every GPU preset (dashed lines).

# %% tags=["nbval-ignore-output"]
mem = dl.widgets.memory_calculator("llama2-7b")
mem

# %%
calc = dl.widgets.memory_calculator("llama2-7b")      # a second calculator, driven from code
calc.controls["zero"].value = 0
start = calc.result.total_gb
calc.controls["zero"].value = 3
print(f"llama2-7b, dp=8, seq 2048: ZeRO-0 {start:.1f} GB -> ZeRO-3 {calc.result.total_gb:.1f} GB per GPU")
print("fits on:", [g for g, ok in calc.result.fits.items() if ok])
print("cheapest:", calc.result.cheapest)
assert calc.result.memory == dl.theory.memory("llama2-7b", dp=8, zero=3, seq_len=2048)
assert calc.result.total_gb < start and calc.result.fits["h100-80gb"]

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
advice = dl.widgets.advisor("llama3-70b", "h100-80gb", gpus=64)   # a second advisor, driven from code
for question, answer in advice.result.steps:
    print(f"- {question}\n    {answer}")
print("=>", advice.result.plan)
memory_only = advice.result.plan
assert (memory_only.zero, memory_only.recompute, memory_only.tp) == (3, "full", 1)
assert 22 < memory_only.memory.total / GB < 24

advice.controls["full_recompute"].value = False          # refuse the 33% recompute tax
print("without full recomputation =>", advice.result.plan)
assert advice.result.plan.tp == 8 and advice.result.plan.pp == 1
assert advice.result.plan.memory.total > memory_only.memory.total

# %% [markdown]
# ## 3. Communication: the ring all-reduce
#
# A ring all-reduce sends `2(N-1)/N · S` bytes per rank, so it takes `2(N-1)/N · S/B` plus `2(N-1)` latencies,
# nearly flat in N. A plain tree (reduce up, broadcast down) pays only `2·log2 N` latencies but moves the whole
# buffer at each level: that is the `tree` the explorer below draws, and it wins only for tiny messages on many
# ranks. NCCL's tree is not plain: its *double binary tree* cuts the buffer into chunks pipelined through two
# complementary trees, which keeps the bytes per rank near the ring's with a latency growing like log2 N, and NCCL
# picks it for all-reduces across many nodes, for mid-sized and, as the node count grows, large messages. nccl-tests report `busbw = S/t · 2(N-1)/N`, comparable with the link's peak.

# %% tags=["nbval-ignore-output"]
comm = dl.widgets.allreduce_explorer(n=8, size_mb=100.0, link="nvlink4")
comm

# %%
scripted = dl.widgets.allreduce_explorer(n=8, size_mb=100.0, link="nvlink4")   # a second one, driven from code
print({a: f"{t * 1e3:.3f} ms" for a, t in scripted.result.seconds.items()}, "fastest:", scripted.result.fastest)
with scripted.hold():
    scripted.controls["n"].value = 1024
    scripted.controls["size_mb"].value = 0.001
    scripted.controls["link"].value = "ethernet-100g"
print("1 KB on 1024 ranks over 100 GbE, fastest:", scripted.result.fastest)
assert scripted.result.fastest == "tree"
# the bandwidth term against the ring's own chunk arithmetic (dl.comm.ring_bytes: what each rank of the textbook ring
# sends, chunk by chunk, the count lesson 01 checks against real sends): a formula with N for N-1 would fail
ring = dl.theory.comm_time("all_reduce", 1e9, 8, 100e9)
sent = max(dl.comm.ring_bytes(250_000_000, 4, 8, r)[0] for r in range(8))        # 1 GB of fp32, 8 ranks
assert abs(ring - sent / 100e9) < 1e-12

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
bubbles = dl.widgets.bubble_explorer("1f1b", p=4, m=8)      # a second explorer, driven from code
for name in ["gpipe", "1f1b", "interleaved", "zb-h1"]:
    bubbles.controls["schedule"].value = name
    r = bubbles.result
    print(f"{name:12s} simulated {r.simulated:.3f}  theory {r.predicted:.3f}")
    assert abs(r.simulated - r.predicted) < 1e-9
assert abs(pipe.result.simulated - 3 / 11) < 1e-12          # yours, untouched: 1F1B, p=4, m=8

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
# 6ND at the H100's dense bf16 peak from NVIDIA's datasheet (989 TFLOP/s; 1979 is the 2:4-sparse figure):
# forward-only 2ND, a sparse peak or a misplaced MFU would each miss by 1.4x or more
assert abs(days - 6 * n * tokens / (1024 * 989e12 * 0.4) / 86400) < 0.01 and 20 < days < 21.5

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
demo = dl.widgets.quiz(seed=7)        # a second quiz, answered from code: yours above starts at 0/0
print(len(demo.questions), "questions")
state = demo.result
demo.controls["answer"].value = state.choices[state.question.answer]
demo.controls["submit"].click()
print("right:", demo.result.correct, "| score", demo.result.score, "/", demo.result.attempted)
assert len(demo.questions) >= 40 and demo.result.correct and demo.result.explanation
assert demo.questions == q.questions and q.result.attempted == 0

# %% [markdown]
# ## 7. The landscape: links, real runs, frameworks
#
# **Why tensor parallelism stays inside a node.** Megatron's TP all-reduces one `b·s·h` activation twice in each
# layer's forward and twice in its backward, and nothing else can run meanwhile: the time sits on the critical path.
# The layer's matmuls, split over `t` GPUs, take `3·F_fwd/t` at the GPU's speed. Both are computed by
# [distlab/theory/landscape.py](../distlab/theory/landscape.py) for one layer of Llama-2 70B on each link preset of
# [presets.py](../distlab/theory/presets.py) (one direction, per GPU: a DGX node has one NIC per GPU), on the same
# H100 so only the link changes.

# %%
import matplotlib.pyplot as plt

LINKS = ["nvlink4", "nvlink3", "pcie5", "pcie4", "ib-ndr", "ethernet-400g", "ib-hdr", "ethernet-100g"]
layer = {name: dl.theory.tp_layer_time("llama2-70b", name, tp=8, gpu="h100-80gb", seq_len=4096, micro_batch=1,
                                       mfu=0.5) for name in LINKS}
print("one Llama-2 70B layer, tp=8 on H100 at 50% MFU, seq 4096, micro-batch 1 (a model's figures)")
print(f"{'link':14s} {'GB/s':>6s} {'4 all-reduces':>14s} {'matmuls':>9s} {'comm/compute':>13s} {'layer time':>11s}")
for name, r in layer.items():
    print(f"{name:14s} {r.bandwidth / 1e9:6.1f} {r.comm * 1e3:11.2f} ms {r.compute * 1e3:6.2f} ms {r.ratio:13.2f} "
          f"{1 + r.ratio:10.2f}x")

assert layer["nvlink4"].message == 4096 * 8192 * 2            # one (s, b, h) activation in bf16: 64 MiB
assert layer["nvlink4"].ratio < 0.25 and layer["nvlink3"].ratio < 0.35   # NVLink: a fifth to a third extra
assert all(layer[name].ratio > 1 for name in LINKS[2:])      # any other link: GPUs wait longer than they compute
assert layer["ethernet-100g"].ratio > 30 * layer["nvlink4"].ratio    # 36x less bandwidth, 20 us latencies
assert 2.3 <= round(min(1 + layer[n].ratio for n in LINKS[2:]), 1) and round(1 + layer["ethernet-100g"].ratio, 1) == 7.8

fig, ax = plt.subplots(figsize=(8, 3))
ax.barh(LINKS, [layer[n].compute * 1e3 for n in LINKS], color="#4C72B0", label="matmuls")
ax.barh(LINKS, [layer[n].comm * 1e3 for n in LINKS], left=[layer[n].compute * 1e3 for n in LINKS],
        color="#DD8452", label="TP all-reduces (exposed)")
ax.invert_yaxis()
ax.set_xlabel("ms per layer, forward + backward (model)")
ax.set_title("Llama-2 70B layer, tp=8: the same work on each link")
ax.legend(loc="upper right")
fig.tight_layout()
plt.show()

# %% [markdown]
# With a ratio of 0.2 on NVLink the all-reduces add a fifth to each layer; on any other link the layer takes 2.3 to
# 7.8 times as long as its matmuls alone (the last column).
# Hence the layout of every large run: TP (and its sequence-parallel pair) within the 8 GPUs of a node, pipeline
# stages (one activation per microbatch, point to point) and data parallelism (overlapped with the backward) across
# nodes. Wider layers and longer sequences carry more FLOPs per byte (`F_fwd / bsh ≈ 24h + 4s`), which is why
# the ratio is smaller for GPT-3's `h = 12288`, but no layer width makes 50 GB/s look like 450.
#
# **What real runs cost.** Three runs, from the numbers their papers publish (each recorded with where it was read
# in [landscape_runs.json](../distlab/theory/data/landscape_runs.json)); everything else is computed: FLOPs as
# `6·N·D` where they are not published, accelerator-hours as `FLOPs / (peak × MFU)` where those are not, the MFU a
# run's published hours imply, and dollars at an **assumed** price per accelerator-hour. `*` marks a model's
# figure.

# %%
PRICE = 2.0      # dollars per accelerator-hour: an assumed rental price, not a published figure
runs = {name: dl.theory.run_cost(name, price_per_hour=PRICE, gpu="a100-80gb", mfu=0.4)
        for name in ["GPT-3 175B", "Llama 2 70B", "PaLM 540B"]}
print(f"{'run':12s} {'FLOPs':>10s} {'accelerator-days':>17s} {'MFU':>7s} {'cost at $2/h':>13s}")
for name, r in runs.items():
    star = {field: "*" if field in r.modelled else " " for field in ("flops", "accelerator_hours", "mfu")}
    print(f"{name:12s} {r.flops:9.3g}{star['flops']} {r.accelerator_days:16,.0f}{star['accelerator_hours']} "
          f"{r.mfu:6.1%}{star['mfu']} {r.cost / 1e6:8.1f} M$*")
gpt3, llama, palm = runs.values()

# GPT-3: Brown et al. 2020, Table D.1 (3.14e23 FLOPs, 3,640 PF-days); hours and GPUs unpublished: A100s at 40% MFU
assert gpt3.flops == 3.14e23 and abs(6 * dl.theory.model("gpt3-175b").params * 300e9 / gpt3.flops - 1) < 2e-3
assert abs(3640 * 1e15 * 86400 / gpt3.flops - 1) < 2e-3
# Llama 2 70B: Touvron et al. 2023, Table 2 (1,720,320 A100-80GB GPU-hours, 2T tokens)
assert llama.accelerator_days == 1_720_320 / 24 and 0.40 < llama.mfu < 0.45
# PaLM 540B: Chowdhery et al. 2022 (2527.2 zettaFLOPs = 6 x 540B params x 780B tokens); TPU v4: 275 TFLOP/s
assert abs(6 * 540e9 * 780e9 / palm.flops - 1) < 1e-4 and palm.mfu == 0.462

# %%
print(f"Llama 2 70B on 2,000 A100s at once: {llama.wall_days(2000):.1f} days (a model's figure: the paper gives the "
      f"GPU-hours and tests RoCE up to 2,000 GPUs, not this run's GPU count)")
steps_only = dl.theory.accelerator_hours(palm.flops, palm.peak_flops, palm.mfu) / 6144
print(f"PaLM 540B on 6,144 TPU v4 at its measured {palm.mfu:.1%} MFU: {steps_only:.0f} hours; published: 1,200 hours "
      f"on 6,144 chips + 336 on 3,072, downtime and repeated steps included")
print(f"  => utilisation of the whole run: {palm.utilisation:.1%}")
assert abs(llama.wall_days(2000) - 35.84) < 0.01
assert 850 < steps_only < 950 < 1200 and 0.29 < palm.utilisation < 0.32

# %% [markdown]
# PaLM's 46.2% is measured over training steps; the chip-hours the paper reports hold about half as many again
# (46.2 / 30.4 ≈ 1.52: 1,200 × 6,144 + 336 × 3,072 chip-hours against 899 × 6,144 at 46.2%), because a
# real run also stops, restarts from checkpoints and repeats steps (lesson 08 and Young/Daly's interval in
# [checkpoint.py](../distlab/theory/checkpoint.py)). Llama 2 publishes hours but no MFU: the hours imply 43%.
#
# **The frameworks, and where distlab teaches the same idea.** None of them is magic: each is one or more of the
# pieces this course builds.
#
# | framework | what it provides | distlab file that teaches the same idea | lesson |
# |---|---|---|---|
# | PyTorch DDP | gradients all-reduced in buckets during the backward | [data/ddp.py](../distlab/parallel/data/ddp.py), [buckets.py](../distlab/parallel/data/buckets.py) | 02 |
# | PyTorch FSDP / FSDP2 (`fully_shard`) | per-parameter shards, all-gather before use, reduce-scatter of gradients, HSDP | [zero/fsdp.py](../distlab/parallel/zero/fsdp.py), [fsdp_unit.py](../distlab/parallel/zero/fsdp_unit.py) | 09 |
# | DeepSpeed ZeRO 1-3 | optimizer states, then gradients, then parameters sharded | [zero1.py](../distlab/parallel/zero/zero1.py), [zero2.py](../distlab/parallel/zero/zero2.py), [zero3.py](../distlab/parallel/zero/zero3.py) | 03 |
# | DeepSpeed ZeRO-Offload / Infinity | optimizer states and step on the CPU (or NVMe) | estimator only: [theory/offload.py](../distlab/theory/offload.py) (no runnable offload in distlab) | 07 |
# | DeepSpeed Ulysses, DeepSpeed-MoE | sequence all-to-all; experts over ranks | [context/ulysses.py](../distlab/parallel/context/ulysses.py), [expert/moe.py](../distlab/parallel/expert/moe.py) | 10, 11 |
# | Megatron-LM | tensor (f/g) and sequence parallelism, interleaved 1F1B, 3D meshes | [tensor/regions.py](../distlab/parallel/tensor/regions.py), [tensor/linear.py](../distlab/parallel/tensor/linear.py), [pipeline/schedule.py](../distlab/parallel/pipeline/schedule.py), [mesh.py](../distlab/parallel/mesh.py) | 04, 05, 06 |
# | Horovod | ring all-reduce, tensor fusion (bucketing) | [comm/ring.py](../distlab/comm/ring.py), [data/buckets.py](../distlab/parallel/data/buckets.py) | 01, 02 |
# | torchrun | processes, rendezvous, `RANK`/`WORLD_SIZE`, restarts | [launch/parent.py](../distlab/launch/parent.py), [launch/torchrun.py](../distlab/launch/torchrun.py), [strategies/restart.py](../distlab/strategies/restart.py) | 00, 08 |
# | Ray Train | workers placed on a cluster, restarts; wraps DDP/FSDP | [launch/parent.py](../distlab/launch/parent.py), [strategies/restart.py](../distlab/strategies/restart.py) | 00, 08 |
# | HF Accelerate | one training script, DDP / FSDP / DeepSpeed chosen by a config | [strategies/loop.py](../distlab/strategies/loop.py), [train.py](../distlab/train.py) | 08 |
#
# ZeRO-Offload's claim (Ren et al. 2021: models of over 13B parameters on a single GPU) in DeepSpeed's own
# estimator, for a 32 GB GPU:

# %%
p = 13e9
on_gpu = dl.theory.zero2_offload(p, offload=False).gpu
offloaded = dl.theory.zero2_offload(p, offload=True)
print(f"13B, one GPU, ZeRO-2: {on_gpu / GB:.0f} GB of model states on the GPU; offloaded: {offloaded.gpu / GB:.0f} GB "
      f"on the GPU, {offloaded.cpu / GB:.0f} GB in CPU memory (DeepSpeed's estimator)")
assert on_gpu == 20 * p and offloaded.gpu == 2 * p        # fp16 params stay; grads, fp32 states and step on the CPU
assert offloaded.gpu < 32 * GB < on_gpu                   # Ren et al. 2021: over 13B params on a single GPU

# %% [markdown]
# ## What to remember
#
# * Mixed-precision Adam costs 16 bytes per parameter before activations; ZeRO divides 12, then 14, then all 16 of
#   them by the data-parallel size.
# * Activations grow with `s·b·h` per layer plus an `a·s²` attention term; recomputation trades them for compute.
# * A ring all-reduce moves `2(N-1)/N · S` bytes per rank whatever N; a plain tree wins only for tiny messages,
#   NCCL's pipelined double binary tree also for larger ones across many nodes.
# * GPipe and 1F1B idle `(p-1)/(m+p-1)` of the step; interleaving and zero-bubble schedules shrink it.
# * By memory alone, ZeRO-3 with full recomputation fits where tensor parallelism would; TP and PP are chosen for
#   throughput.
# * TP's four all-reduces per layer cost about a fifth of its matmuls on NVLink and more than the matmuls on PCIe,
#   InfiniBand or Ethernet: TP stays inside the node.
# * A run costs `FLOPs / (peak × MFU)` accelerator-hours; published hours also hold downtime (PaLM: 30% of peak over
#   the run against 46.2% MFU over steps). Dollars are always a model's figure.
# * DDP, FSDP, ZeRO, Megatron, Horovod and torchrun are the pieces built in lessons 00-11, packaged.
#
# **Try it**: in the advisor, pick `llama3-405b` on 1024 GPUs and untick full recomputation; in the memory
# calculator, raise the sequence length to 8192 and watch the activations overtake the model states; in section 7,
# give `tp_layer_time` `gpt3-175b` or `seq_len=32768` and see how far InfiniBand NDR's ratio falls (it stays above
# NVLink's by the bandwidth ratio), or change `PRICE` and `mfu` and see which figures move (only the starred ones).
