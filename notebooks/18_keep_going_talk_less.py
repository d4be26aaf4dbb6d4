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
# # 18 · Keep going, talk less
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# Data parallelism pays for its speed with bytes: DDP all-reduces every gradient, every step, 2(N-1)/N · 4Ψ bytes
# per rank (lesson 02). Inside a node that is cheap; across nodes, data centres or the internet it is the step.
# Three ways to send less, each measured here beside DDP on the same tokens, each with its prediction asserted:
#
# | § | idea | what it sends per step | distlab |
# |---|------|------------------------|---------|
# | 0 | **keep going**: replicas that leave and join | DDP's bytes, over whoever is alive | `dl.elastic.train(replicas=3, faults=[...])` |
# | 1 | **talk less often**: Local SGD, DiLoCo | the parameters (their change) every H steps: DDP's / H | `dl.train("diloco", sync_every=H)` |
# | 1 | (for comparison) talk smaller: PowerSGD | rank-r factors of each gradient matrix | `compression="powersgd"` |
# | 2 | **talk in fewer bits**: ZeRO++'s quantized collectives | int8 / fp8 codes plus one scale per 256 values | `dl.train("zero3", quantize="int8")` |
# | 3 | when each is worth it | on the links of lesson 07, computed with `dl.theory` | (modelled) |
#
# **The code, in reading order**: [local_sgd.py](../distlab/parallel/data/local_sgd.py) (`LocalSGD`, `DiLoCo`: one
# file, under 150 lines) and its strategy [strategies/local_sgd.py](../distlab/strategies/local_sgd.py);
# [comm/quantized.py](../distlab/comm/quantized.py) (block-scaled int8 and fp8, pure tensor code) and
# [quantized_collectives.py](../distlab/parallel/quantized_collectives.py) (the all-gather and the all-to-all
# reduce-scatter that carry it), used by [zero3.py](../distlab/parallel/zero/zero3.py) and
# [fsdp.py](../distlab/parallel/zero/fsdp.py); the formulas in
# [theory/compression.py](../distlab/theory/compression.py).

# %% [markdown]
# ## 0. Keep going: replicas that leave and join
#
# Lesson 14 survives a failure the way most clusters do: every rank stops, the job restarts from the newest
# checkpoint, and the steps since that checkpoint are computed again. torchft (PyTorch's fault-tolerant DDP) and
# DiLoCo's elastic descendants keep the survivors running instead. distlab's version, read top to bottom in
# [quorum.py](../distlab/parallel/elastic/quorum.py) and [replica.py](../distlab/parallel/elastic/replica.py):
#
#     every step   each live replica writes a heartbeat to the store; one compare-and-set fixes the quorum
#                  (who steps together): a replica not heard from within `heartbeat` seconds is left out
#     new quorum   a fresh gloo group over exactly its members (no dl.new_group: that needs the dead too)
#     the batch    the fixed global batch of B rows is split over the quorum, each gradient weighted by
#                  rows_i / B, so every step equals one process on the whole batch, whoever computed it
#     rejoining    a restarted replica (a new process; the others' pids never change) copies parameters,
#                  optimizer state and step from a live peer, then steps with them
#
# Prediction: the losses equal one process's on the same global batches (to float rounding), the survivors never
# restart, and they lose about one `heartbeat` to the death (the time it takes to decide a replica is gone);
# no step is computed twice.

# %%
import math

import matplotlib.pyplot as plt
import torch

import distlab as dl
from distlab.comm import quantized as q
from distlab.parallel.quantized_collectives import QuantizedCollectives

N, STEPS, BATCH, LR = 2, 32, 16, 3e-3          # the same token budget for every run: STEPS x BATCH sequences
COMMON = dict(world_size=N, model="gpt-tiny", steps=STEPS, global_batch=BATCH, lr=LR, seed=0, comm="ring")
gpt = dl.models.build("gpt-tiny")
PSI = sum(p.numel() for p in gpt.parameters())
MATRICES = [tuple(p.shape) for p in gpt.parameters() if p.dim() == 2]
VECTORS = sum(p.numel() for p in gpt.parameters() if p.dim() < 2)
print(f"gpt-tiny: Psi = {PSI:,} parameters; {N} ranks; {STEPS} steps of {BATCH} sequences for every run")

# %%
HEARTBEAT, ELASTIC_STEPS = 0.5, 10
kill = dl.elastic.Kill(replica=2, at_step=3, rejoin_at=6)        # replica 2 dies at step 3, is back for step 6
el = dl.elastic.train(replicas=3, steps=ELASTIC_STEPS, faults=[kill], heartbeat=HEARTBEAT, seed=0)
print(el.table())                            # x computed, . away, h healed from a live peer, then computed
ref_losses, _ = dl.elastic.reference(el.timeline, ELASTIC_STEPS)   # one process, the same schedule
worst = max(abs(a - b) / b for a, b in zip(el.losses, ref_losses))
processes = {r: len(p) for r, p in el.pids.items()}
rec = el.recoveries[0]
assert el.timeline == el.planned and worst < 1e-5
assert processes == {0: 1, 1: 1, 2: 2}                    # the survivors kept their process; replica 2 restarted
assert HEARTBEAT <= rec.stall_s < HEARTBEAT + 1.0 and rec.back_at == 6
print(f"losses equal one process's on the same batches (worst relative difference < 1e-5); processes per "
      f"replica {processes}; the survivors waited about one heartbeat ({HEARTBEAT} s) and stepped on")

# %% [markdown]
# The same fault under a checkpoint restart (lesson 14's way): every rank stops, three fresh processes load the
# checkpoint of step 4 and compute steps 4 and 5 again. Prediction: `lost_steps` = 6 - 4 = 2 (the steps since the
# checkpoint), where the elastic run lost none; and the restarted run's losses equal the elastic run's, because
# both equal one process.

# %% tags=["nbval-ignore-output"]
import tempfile

restarted = dl.train("ddp", world_size=3, model="gpt-tiny", steps=ELASTIC_STEPS, global_batch=12, seed=0,
                     checkpoint_dir=tempfile.mkdtemp(), checkpoint_every=4, max_restarts=1, fail_at_step=6)
lost = restarted.restarts[0].lost_steps
computed = {"elastic": sum(len(q) for q in el.timeline), "restart": 3 * (ELASTIC_STEPS + lost)}
assert lost == 6 - 4 and max(abs(a - b) / b for a, b in zip(restarted.losses, el.losses)) < 1e-5
print(f"checkpoint restart: {lost} steps computed twice on every rank; replica-steps computed: {computed}")
# (its output is not compared by nbval: distlab's restart line reports the measured seconds lost)

# %% [markdown]
# On gpt-tiny a restart costs well under a second, because here a process starts in milliseconds and the checkpoint is
# about a megabyte (gpt-tiny's parameters and Adam's two moments). On a real cluster a restart re-schedules every
# node, re-initialises NCCL on thousands of GPUs and reads terabytes of checkpoint, then recomputes the lost steps
# (torchft#329 reports 948 s from fault to full recovery): the elastic path pays one heartbeat and one peer-to-peer
# copy of one replica's state instead. What it does not cover here (its docstrings say so): a death *inside* an
# all-reduce (torchft needs a commit vote for that), and replicas that are themselves sharded.
#
# **Which engine does what.** `dl.train(..., max_restarts=k)` (lesson 14) and `dl.train(..., engine="ray")` (a Ray
# cluster: README, "On a Ray cluster") both restart the *whole* group from the newest checkpoint; Ray adds what a
# cluster needs around it (scheduling workers onto machines, replacing a dead node, retrying up to `max_failures`).
# `dl.elastic` keeps the survivors running and heals one replica from a live peer, without a checkpoint. Real
# systems stack them: torchft inside a job for replica failures, the scheduler's restart for everything else.

# %% [markdown]
# ## 1. Talk less often: Local SGD and DiLoCo
#
# Let every replica take H optimizer steps on its own rows, then meet (Stich 2019; Lin et al. 2020):
#
#     local SGD:  theta <- mean_r theta_r                                  every H steps
#     DiLoCo:     delta = mean_r (theta - theta_r)                          every H steps (Douillard et al. 2023)
#                 theta <- Nesterov SGD step on delta (lr 0.7, momentum 0.9)
#
# Either way one all-reduce of Ψ numbers every H steps instead of every step: **2(N-1)/N · 4Ψ / H bytes per step**
# (`dl.theory.local_sgd_volume`). The inner optimizer is AdamW, its state never communicated. Five runs on the ring
# (so the bytes are counted send by send): DDP, PowerSGD at rank 4 (lesson 12), local SGD and DiLoCo every 8 steps,
# DiLoCo every 4.

# %%
RUNS = {"DDP": ("ddp", {}), "PowerSGD r=4": ("ddp", dict(compression="powersgd", powersgd_rank=4)),
        "local SGD H=8": ("local-sgd", dict(sync_every=8)), "DiLoCo H=4": ("diloco", dict(sync_every=4)),
        "DiLoCo H=8": ("diloco", dict(sync_every=8))}
reports = {name: dl.train(strategy, **COMMON, **kw) for name, (strategy, kw) in RUNS.items()}
ddp_bytes = dl.theory.dp_volume(4 * PSI, N)
predicted = {"DDP": ddp_bytes, "PowerSGD r=4": dl.theory.dp_volume(4 * dl.theory.powersgd_elements(MATRICES, 4, VECTORS), N)}
for name, (strategy, kw) in RUNS.items():
    if "sync_every" in kw:
        predicted[name] = dl.theory.local_sgd_volume(4 * PSI, N, kw["sync_every"])
measured = {name: r.comm[0]["sent_per_step"] for name, r in reports.items()}
for name, r in reports.items():
    print(f"{name:>14}: {measured[name]:>9,.0f} B per step (predicted {predicted[name]:>9,.0f}), "
          f"{ddp_bytes / measured[name]:5.1f}x fewer than DDP; loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f}")

# %% [markdown]
# **Check.** The bytes are the formula's (a 2-rank ring sends each all-reduced buffer once, half in the reduce-scatter
# and half in the all-gather, give or take one element per call), and a run that synced every step would send H times
# too much, one that forgot to sync nothing. The losses: every replica of local SGD and DiLoCo sees only its half of each batch
# between syncs, yet both keep learning; plain averaging every 8 steps ends behind DDP, while DiLoCo's outer momentum
# ends ahead of it on this tiny model.

# %%
for name in RUNS:
    assert abs(measured[name] - predicted[name]) <= 4 * 4, (name, measured[name], predicted[name])
final = {name: r.losses[-1] for name, r in reports.items()}
assert all(final[name] < 0.75 * reports[name].losses[0] for name in RUNS)       # every run learns
assert final["local SGD H=8"] > final["DDP"]                                      # averaging alone lags DDP
assert final["DiLoCo H=8"] < final["local SGD H=8"] and final["DiLoCo H=4"] < final["DDP"]
print("checks passed")

# %%
fig, (ax_l, ax_b) = plt.subplots(1, 2, figsize=(11, 3.6))
for i, (name, r) in enumerate(reports.items()):
    ax_l.plot(r.losses, color=f"C{i}", label=name)
    ax_b.bar(i, measured[name] / 1e3, color=f"C{i}")
    ax_b.plot(i, predicted[name] / 1e3, "k_", ms=30, mew=2)
ax_l.set(xlabel="step", ylabel="training loss", title=f"gpt-tiny, N = {N}: the same tokens")
ax_l.legend(fontsize=8)
ax_b.set_xticks(range(len(reports)), [n.replace(" ", "\n", 1) for n in reports], fontsize=8)
ax_b.set(ylabel="kB sent per rank per step", title="bytes per step: bars measured, black marks predicted")
fig.tight_layout()
plt.show()

# %% [markdown]
# Why DiLoCo can run *ahead* of DDP here: its outer step is SGD with Nesterov momentum μ on the averaged change of
# H inner steps. Once the momentum has built up, a steady change is applied lr_outer · (1 + μ/(1-μ)) times over,
# a larger effective step than the inner optimizer takes, which a tiny model at a small learning rate welcomes.
# The paper's claim is the other half: with 8 workers syncing every 500 steps on C4, DiLoCo "performs as well as
# fully synchronous optimization while communicating 500 times less" (Douillard et al. 2023, abstract). Local SGD
# has no such outer optimizer, and its replicas drift apart for 8 steps before each average.

# %%
OUTER_LR, MU = 0.7, 0.9
print(f"DiLoCo's steady-state outer gain: {OUTER_LR} x (1 + {MU}/(1-{MU})) = {OUTER_LR * (1 + MU / (1 - MU)):.1f}")

# %% [markdown]
# ## 2. Talk in fewer bits: quantized all-gather and reduce-scatter
#
# ZeRO-3 and FSDP send 3(N-1)/N Ψ elements per step (weights gathered twice, gradients reduce-scattered once:
# lesson 03). ZeRO++ (Wang et al. 2023) sends the weights as block-quantized int8 (qwZ) and the gradients
# quantized too, through an all-to-all (qgZ, int4 in the paper); here both go as int8: each block of 256 values
# becomes 256 one-byte codes and one fp32 scale s = absmax/127 (`comm/quantized.py`). FSDP2's float8 all-gather
# (with torchao) sends weights as fp8 with their scales; here fp8 (e4m3) takes the same blocks, s = absmax/448.
# Per value the wire carries (1 + 4/256) bytes instead of 4 (fp32) or 2 (bf16):
#
#     bytes ratio = (1 + 4/256) / 4 = 0.254 (fp32),  / 2 = 0.508 (bf16)        dl.theory.quantized_ratio
#     int8 error per value  <= s/2,  rms s/sqrt(12)  (round to nearest)        dl.theory.int8_error
#
# The gradients go by one all-to-all (each rank's row for rank k, quantized once, summed in fp32 at k), not by a
# ring that would requantize the partial sums at every hop. First the collective alone, on the weights of gpt-tiny's
# matrices, each rank gathering both halves: the error against the exact gather, and the bytes.

# %%
def gather_weights(kind):
    flat = torch.cat([p.detach().flatten() for p in dl.models.build("gpt-tiny").parameters() if p.dim() == 2])
    flat = flat[:flat.numel() // N * N]                    # (Psi_matrices,), split evenly over the ranks
    mine = flat.view(N, -1)[dl.rank()].clone()
    comm, out = QuantizedCollectives(kind), torch.empty_like(flat)
    events = len(dl.tracer().events())
    comm.all_gather(out, mine)
    sent = sum(e.sent for e in dl.tracer().events()[events:] if e.kind == "comm")
    first = flat.view(N, -1)[0]                            # rank 0's part: its blocks' scales and bounds
    _, scales = q.quantize(first, kind)
    err = (out - flat).view(N, -1)[0]
    s = scales.repeat_interleave(q.BLOCK)[:err.numel()]
    return {"sent": sent, "exact_sent": (N - 1) * mine.numel() * 4,
            "max_err_over_bound": (err.abs() / q.error_bound(first, kind)).max().item(),
            "rms": err.pow(2).mean().sqrt().item(), "rms_predicted": (s.pow(2).mean() / 12).sqrt().item()}


gathered = {kind: dl.launch(gather_weights, world_size=N, args=(kind,), output="quiet").results[0] for kind in q.KINDS}
for kind, g in gathered.items():
    print(f"{kind}: {g['sent']:,} B sent vs {g['exact_sent']:,} B exact (x{g['sent'] / g['exact_sent']:.3f}); "
          f"largest error / its bound {g['max_err_over_bound']:.3f}; rms error {g['rms']:.2e}")
print(f"int8's rms predicted, s/sqrt(12) over the blocks: {gathered['int8']['rms_predicted']:.2e}")

# %% [markdown]
# **Check.** The bytes are the ratio's, up to the padding of the last block; every error is within its bound
# (int8: half a step, s/2; fp8: 2⁻⁴ of the value, its 3 mantissa bits, plus s 2⁻¹⁰ near zero) and int8's rms is
# the uniform rounding error's s/√12, so a quantizer that truncated (rms s/√3, max s) or dropped the block scales
# would fail here. fp8 spends its bits on range, int8 on resolution: on these Gaussian weights fp8's error is the
# larger one.

# %%
ratio = dl.theory.quantized_ratio(4)
for kind, g in gathered.items():
    assert ratio <= g["sent"] / g["exact_sent"] <= ratio * 1.01, (kind, g["sent"] / g["exact_sent"])
    assert 0.5 < g["max_err_over_bound"] <= 1 + 1e-5, (kind, g["max_err_over_bound"])   # within, and tight
assert abs(gathered["int8"]["rms"] / gathered["int8"]["rms_predicted"] - 1) < 0.05
assert gathered["fp8"]["rms"] > gathered["int8"]["rms"]
print("checks passed")

# %% [markdown]
# Now training: ZeRO-3 on the same tokens, exact and with `quantize="int8"` (ZeRO++'s qwZ for the weights and qgZ for
# the gradients, here int8 for both; the shards and AdamW stay in fp32, only the wire is int8).

# %%
Q_RUNS = {"zero3": {}, "zero3 int8": dict(quantize="int8")}
q_reports = {name: dl.train("zero3", **{**COMMON, "comm": "torch", "steps": 12}, **kw) for name, kw in Q_RUNS.items()}
q_bytes = {name: r.comm[0]["sent_per_step"] for name, r in q_reports.items()}
gap = max(abs(a - b) / a for a, b in zip(q_reports["zero3"].losses, q_reports["zero3 int8"].losses))
print(f"zero3: {q_bytes['zero3']:,.0f} B per step (3 (N-1)/N 4 Psi = {dl.theory.zero_volume(3, 4 * PSI, N):,.0f}); "
      f"int8: {q_bytes['zero3 int8']:,.0f} B (x{q_bytes['zero3 int8'] / q_bytes['zero3']:.3f}, predicted x{ratio:.3f})")
print(f"largest relative loss difference over 12 steps: {gap:.2%}; final losses {q_reports['zero3'].losses[-1]:.3f} "
      f"(exact) and {q_reports['zero3 int8'].losses[-1]:.3f} (int8)")
assert abs(q_bytes["zero3"] / dl.theory.zero_volume(3, 4 * PSI, N) - 1) < 0.01          # (units padded to N)
assert ratio <= q_bytes["zero3 int8"] / q_bytes["zero3"] <= ratio * 1.01
assert 0 < gap < 0.01                                   # lossy, but by less than 1% of the loss
print("checks passed")

# %% [markdown]
# ## 3. When is it worth it? The links of lesson 07 (modelled)
#
# A data-parallel step costs its compute plus whatever communication it does not hide. Take Llama-3 8B trained by
# 16 replicas of one 8-GPU H100 node each, 256k tokens per replica per step (4M in all) at 40% MFU, and the
# replicas joined by one link of lesson 07's (B, α from `dl.theory.LINKS`), gradients in bf16, nothing overlapped
# (the worst case; DDP hides part of it under backward):
#
#     compute = 6 Ψ tokens / (8 F · MFU)           bytes per step: DDP 2(N-1)/N · 2Ψ, DiLoCo H: that / H,
#     step    = compute + bytes / B + messages α   PowerSGD r=4: its elements, int8 ZeRO-3: 3(N-1)/N · Ψ (1+4/256)

# %%
llama = dl.theory.model("llama3-8b")
PSI8 = llama.params
hd = llama.hidden // llama.heads
kv = (llama.kv_heads or llama.heads) * hd
layer = [(llama.hidden, llama.hidden), (kv, llama.hidden), (kv, llama.hidden), (llama.hidden, llama.hidden),
         (llama.ffn, llama.hidden), (llama.ffn, llama.hidden), (llama.hidden, llama.ffn)]
mats8 = layer * llama.layers + [(llama.vocab, llama.hidden)] * 2
vecs8 = (2 * llama.layers + 1) * llama.hidden                 # RMSNorm weights: two per layer, one at the end
assert sum(n * m for n, m in mats8) + vecs8 == PSI8            # every parameter counted once
R, TOKENS, MFU = 16, 256 * 1024, 0.4
compute = 6 * PSI8 * TOKENS / (8 * dl.theory.gpu("h100-80gb").bf16_flops * MFU)
ddp8 = dl.theory.dp_volume(2 * PSI8, R)
volumes = {"DDP": (ddp8, 1), "PowerSGD r=4": (dl.theory.dp_volume(2 * dl.theory.powersgd_elements(mats8, 4, vecs8), R), 2),
           "int8 ZeRO-3": (dl.theory.quantized_volume(dl.theory.zero_volume(3, 2 * PSI8, R), element_bytes=2), 3),
           "DiLoCo H=8": (dl.theory.local_sgd_volume(2 * PSI8, R, 8), 1 / 8),
           "DiLoCo H=100": (dl.theory.local_sgd_volume(2 * PSI8, R, 100), 1 / 100)}
LINKS = ["nvlink4", "nvlink3", "pcie5", "pcie4", "ib-ndr", "ethernet-400g", "ib-hdr", "ethernet-100g"]
overhead = {}
print(f"Llama-3 8B: Psi = {PSI8 / 1e9:.2f} B; compute per step {compute:.2f} s; DDP sends {ddp8 / 1e9:.1f} GB per step")
print(f"{'link':14s} {'GB/s':>5s}" + "".join(f"{m:>14s}" for m in volumes))
for name in LINKS:
    link = dl.theory.link(name)
    overhead[name] = {m: dl.theory.step_time_on_link(compute, v, link.bandwidth, link.latency, msgs) / compute - 1
                      for m, (v, msgs) in volumes.items()}
    print(f"{name:14s} {link.bandwidth / 1e9:5.1f}" + "".join(f"{overhead[name][m]:>13.1%} " for m in volumes))

# %% [markdown]
# The table is the extra time on top of compute. **Check** (the model's consequences, stated before reading them
# off): on NVLink DDP's bytes cost under 5% of the step, so there is nothing to win; on every link at or below
# 50 GB/s they cost more than a tenth, and on 100 Gb Ethernet more than half, where DiLoCo every 100 steps brings
# the cost under 2% and int8 ZeRO-3 sends fewer bytes than DDP even though ZeRO-3 sends 1.5x DDP's elements.
# PowerSGD's bytes all but vanish at this width (rank 4 of 4096-wide matrices); what the table leaves out is its
# price: the extra matrix products and QR per step, and the progress it cost in section 1.

# %%
assert all(overhead[name]["DDP"] < 0.05 for name in ("nvlink4", "nvlink3"))
assert all(overhead[name]["DDP"] > 0.1 for name in LINKS if dl.theory.link(name).bandwidth <= 50e9)
assert overhead["ethernet-100g"]["DDP"] > 0.5 and overhead["ethernet-100g"]["DiLoCo H=100"] < 0.02
assert all(overhead[name]["int8 ZeRO-3"] < overhead[name]["DDP"] for name in LINKS)
print("checks passed")

# %%
fig, ax = plt.subplots(figsize=(11, 3.6))
width = 0.8 / len(volumes)
for k, m in enumerate(volumes):
    ax.bar([i + (k - 2) * width for i in range(len(LINKS))], [100 * overhead[n][m] for n in LINKS], width, label=m)
ax.set_yscale("symlog", linthresh=0.01)
ax.set_xticks(range(len(LINKS)), LINKS, fontsize=8)
ax.set(ylabel="communication / compute (%)", title="Llama-3 8B, 16 replicas: what each way of talking less costs "
       "per step (modelled, nothing overlapped)")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What to remember
#
# * **Talk less often** (Local SGD, DiLoCo): bytes per step divided by H, measured here to the byte. The price is
#   drift between syncs; DiLoCo's outer Nesterov step on the averaged change is what keeps it competitive, and it
#   is what OpenDiLoCo and prime use across the internet. It is an optimizer change: the run is no longer DDP's.
# * **Talk in fewer bits** (ZeRO++ qwZ/qgZ, fp8 all-gathers): about a quarter of fp32's bytes and half of bf16's,
#   for an error bounded by half a quantization step per block; the master weights and optimizer stay exact.
# * **Talk smaller** (PowerSGD): the most compression per step, but a low-rank gradient, and extra compute.
# * **When**: on NVLink none of them pays; on links at or below 50 GB/s each of them does, and the further apart
#   the replicas, the larger H can go.
