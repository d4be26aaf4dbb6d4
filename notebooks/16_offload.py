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
# # 16 · Beyond one GPU's memory: offload
#
# ZeRO (lesson 03) divides the model states by the number of data-parallel ranks. When even the divided share
# does not fit, the states can leave the device. **ZeRO-Offload** (Ren et al. 2021) keeps the fp32 master weights
# and Adam's two moments of each rank's shard in **host memory** and runs the optimizer step there, on the CPU;
# only gradients go down and updated parameters come back up. **ZeRO-Infinity** (Rajbhandari et al. 2021) adds
# the tier below: the same state in **files** (NVMe), streamed through host memory one shard at a time.
#
# In distlab it is one option: `dl.train("zero2", ..., offload="cpu")` or `offload="disk"` (+ `offload_dir=`), and
# `dl.ZeRO(model, stage, offload=...)` for your own loop. For Ψ parameters on N ranks, with Adam (K = 8 bytes of
# state a parameter) and fp32 masters (4 bytes; [docs/notation.md](../docs/notation.md)):
#
# | where | no offload | `offload="cpu"` | `offload="disk"` |
# |---|---|---|---|
# | device: optimizer state | K Ψ/N | 0 | 0 |
# | host memory | 0 | (K + 4) Ψ/N | about 3 shards' worth while stepping |
# | files | 0 | 0 | (K + 4) Ψ/N |
# | moved per step | nothing | gradients down, parameters up: 8 Ψ/N | and the state read and written: 2 (K + 4) Ψ/N |
#
# | § | what is predicted | what is measured and asserted |
# |---|---|---|
# | 1 | the ledger: K Ψ/N leaves the device, (K + 4) Ψ/N appears in `host` or `disk` | every rank's categories |
# | 2 | offload changes where the step runs, not what it computes | losses and parameters equal to the bit |
# | 3 | a memory limit between the two device peaks | out of memory without offload; trains with it |
# | 4 | ZeRO-Infinity: the process holds only a few shards of state at once | the process's resident memory |
# | 5 | the time offload adds: bytes over measured bandwidths (`dl.theory.offload.step_time`) | the optimizer step's time |
#
# **The code, in reading order**: [offload.py](../distlab/parallel/zero/offload.py) (the optimizer that lives in
# host memory or in files, with its read-ahead), [zero2.py](../distlab/parallel/zero/zero2.py) (where ZeRO hands
# it the gradient shards); the ledger's `host` and `disk` come from [memory.py](../distlab/memory.py), the
# predictions from [theory/offload.py](../distlab/theory/offload.py).

# %%
import ctypes
import os
import tempfile
import time

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it with the first optimizer: here, once, not in each rank)
import torch.distributed as dist

import distlab as dl
from distlab.models import GPT, GPTConfig

KW = dict(model="gpt-tiny", steps=2, seed=0, world_size=2)
TIERS = (None, "cpu", "disk")
TMP = tempfile.mkdtemp(prefix="distlab_16_")
MB = 1e6

# %% [markdown]
# ## 1 · The ledger: where the bytes went
#
# Three runs of ZeRO-2 on 2 ranks, identical but for `offload`. In fp32 there is no separate master copy on the
# device, so the device's optimizer state is Adam's two moments, K Ψ/N = 8 Ψ/N bytes. Offloaded, the host also
# keeps an fp32 master of the shard (the parameter the CPU steps): (K + 4) Ψ/N = 12 Ψ/N. Prediction from
# `dl.theory.memory` for the device, and 12 Ψ/N for the host or the files (a file adds its format's header).

# %%
runs = {tier: dl.train("zero2", **KW, offload=tier, offload_dir=TMP if tier == "disk" else None) for tier in TIERS}
psi = sum(p.numel() for p in dl.models.build("gpt-tiny", 0).parameters())
device = dl.theory.memory(psi, dp=2, zero=2, precision="fp32")
print(f"gpt-tiny: Psi = {psi:,} parameters; predicted per rank: optimizer {device.optimizer / MB:.3f} MB on the "
      f"device, {12 * psi / 2 / MB:.3f} MB offloaded")
print(f"{'offload':8} {'rank':>4} {'params':>8} {'grads':>8} {'optimizer':>10} {'host':>8} {'disk':>8} "
      f"{'device total':>13}   (MB)")
for tier, r in runs.items():
    for rank, mem in enumerate(r.memory):
        p = mem["peak"]
        print(f"{str(tier):8} {rank:4} {p['params'] / MB:8.3f} {p['grads'] / MB:8.3f} {p['optimizer'] / MB:10.3f} "
              f"{p.get('host', 0) / MB:8.3f} {p.get('disk', 0) / MB:8.3f} {mem['peak_total'] / MB:13.3f}")

for rank in range(2):
    plain, cpu, disk = (runs[t].memory[rank] for t in TIERS)
    assert abs(plain["peak"]["optimizer"] - device.optimizer) <= 8 * 64          # padding: < N elements a bucket
    assert cpu["peak"]["optimizer"] == disk["peak"]["optimizer"] == 0
    assert abs(cpu["peak"]["host"] - 12 * psi / 2) <= 12 * 64                     # masters + moments, in host memory
    assert 12 * psi / 2 <= disk["peak"]["disk"] <= 1.05 * 12 * psi / 2           # the same bytes, in files
    assert disk["peak"]["host"] == 0                                              # nothing held between steps
    for off in (cpu, disk):                                                       # the device lost exactly that
        assert plain["peak_total"] - off["peak_total"] == plain["peak"]["optimizer"]
print("asserted: the optimizer state left the device and appeared in host memory or in files, as predicted")

# %% [markdown]
# ## 2 · Same numbers, to the bit
#
# Each shard is stepped by its own AdamW on the host, on the same fp32 gradient; Adam is elementwise, so the
# numbers cannot differ from the step on the device. Prediction: equal losses, and parameters equal to the bit.

# %%
for tier in ("cpu", "disk"):
    same = all(torch.equal(runs[tier].params[k], runs[None].params[k]) for k in runs[None].params)
    print(f"offload={tier:4}: losses {[round(x, 4) for x in runs[tier].losses]}, parameters equal to the bit: {same}")
    assert runs[tier].losses == runs[None].losses and same
print(f"offload=None: losses {[round(x, 4) for x in runs[None].losses]}")
assert not os.listdir(TMP)                           # offload="disk" removes its files when the run ends

# %% [markdown]
# ## 3 · A model that does not fit
#
# `memory_limit` gives each rank a device of that size (lesson 14). Set it halfway between the two device peaks
# measured above: the run without offload must run out of memory once Adam's moments exist (they are created in
# step 0's optimizer step, so step 1's forward, with its activations on top, is the first thing that cannot
# fit), and the offloaded run must train, with the same losses.

# %%
limit = (runs[None].memory[0]["peak_total"] + runs["cpu"].memory[0]["peak_total"]) // 2
print(f"memory_limit = {limit / MB:.3f} MB per rank")
try:
    dl.train("zero2", **KW, memory_limit=limit)
    raise AssertionError("the run without offload should not fit")
except dl.LaunchError as e:
    message = str(e)[str(e).index("out of memory"):].split(" (")[0]
    print("without offload:", message)
    assert "of step 1" in message                 # step 0 fits; Adam's moments, made in its optimizer step, do not
fits = dl.train("zero2", **KW, memory_limit=limit, offload="cpu")
print(f"offload='cpu':   trains; losses {[round(x, 4) for x in fits.losses]}")
assert fits.losses == runs[None].losses

# %% [markdown]
# ## 4 · ZeRO-Infinity: the process holds less
#
# With `offload="cpu"` the whole state stays in the process for the whole run; with `offload="disk"` it lives in
# files, and the step reads one shard, steps it and writes it back while the next is read ahead: about three
# shards' state in memory at once. On a CPU "device" and "host" are one memory, so this is a real effect here:
# the process's **resident memory** (`VmRSS` in `/proc/self/status`, what the operating system charges it) at the
# step's peak, above what it was before the model existed (the C allocator keeps freed memory for reuse:
# `malloc_trim` before each reading hands it back, so the reading follows what is alive). A larger GPT (about
# 6 M parameters, so the state, 12 Ψ/N ≈ 39 MB a rank, stands out of the noise), one fresh launch per tier,
# ZeRO's buckets of 1 MB (many small shards). Prediction: disk holds
# (1 - 3/s) of the state less than cpu, for s shards; asserted with room for the allocator and the buffers of
# a file being saved or loaded at the moment of the reading: at least half the state less.

# %% tags=["nbval-ignore-output"]
CFG = GPTConfig(vocab=256, seq_len=16, d_model=256, heads=8, layers=8)
LIBC = ctypes.CDLL("libc.so.6")


def resident() -> int:
    """This process's resident bytes, after asking the C allocator to return the memory it keeps free."""
    LIBC.malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def resident_peak(offload):
    """Peak resident bytes during the second ZeRO-2 step above those before the model; state bytes; shards."""
    before = resident()
    torch.manual_seed(0)
    zero = dl.ZeRO(GPT(CFG), stage=2, optim=torch.optim.AdamW, lr=1e-3, bucket_mb=1, offload=offload)
    inner, samples = zero.optimizer.optimizer, []
    for o in inner.optimizers if offload else [inner]:        # sampled after each shard's step
        o.register_step_post_hook(lambda *_: samples.append(resident()))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dl.rank()))
    for _ in range(2):
        zero(x).mean().backward()
        samples.clear()
        zero.optimizer.step()
        zero.optimizer.zero_grad()
    if offload:
        inner.close()
    return max(samples) - before, 12 * sum(s.numel() for s in zero.optimizer.shards), len(zero.optimizer.shards)


peaks = {tier: dl.launch(resident_peak, world_size=2, args=(tier,), output="quiet").results for tier in TIERS}
for rank in range(2):
    (none, state, shards), (cpu, _, _), (disk, _, _) = (peaks[t][rank] for t in TIERS)
    print(f"rank {rank}: {shards} shards, state {state / MB:.0f} MB; resident at the step's peak: none {none / MB:.0f} "
          f"MB, cpu {cpu / MB:.0f} MB, disk {disk / MB:.0f} MB; disk below cpu by {(cpu - disk) / MB:.0f} MB "
          f"(predicted {(1 - 3 / shards) * state / MB:.0f})")
    assert cpu - disk >= 0.5 * state, (cpu, disk, state)

# %% [markdown]
# ## 5 · What it costs: the step time beside the prediction
#
# `dl.theory.offload.step_time` adds up the bytes each tier moves over their bandwidths: gradients down and
# parameters up, 8 Ψ/N over the host copy's bandwidth; for `"disk"` also every shard's masters and state read and
# written, 2 (K + 4) Ψ/N over the file bandwidth, plus a file opened twice per shard. The bandwidths are measured in
# each rank, in every round beside the steps (the machine's load changes from second to second; measured this way it
# changes the probe and the steps alike): a host copy of 8 Ψ/N bytes; one file of the state's size saved with
# `torch.save` and read back with `torch.load` (the page cache included, as for the run's own files); and a small
# file's save and load, for the cost of a file. Then the three tiers train the same GPT (about 1.7 M parameters)
# taking turns, each one's optimizer step timed: that is where offload acts. On a CPU the "host copies" are memcpys
# into fp32 buffers, which the formula prices at almost nothing; the cpu tier's measured extra is mostly work the
# formula leaves out (a host optimizer for each shard, stepped one by one in Python), so it is not asserted against
# its prediction. The disk tier's extra is mostly the files, which is what the formula is about. Asserted: the
# disk tier's measured extra (median over rounds) within a factor 2.5 of the prediction (a shared machine's file
# system is noisy; no files at all, or every shard's files read for each shard, would fall outside), and above
# the cpu tier's.

# %% tags=["nbval-ignore-output"]
def probe(directory: str, shard_params: int) -> dict[str, float]:
    """This rank's bandwidths now: a host copy of 8 Psi/N bytes; one file of the state, (K + 4) Psi/N, saved
    and loaded (each byte counted once each way); the seconds a small file's save or load takes (a file
    as the offload writes it: a master and Adam's state)."""
    x = torch.randn(2 * shard_params)
    y = x.clone()                                          # written once already: no page faults in the timing
    t = time.perf_counter()
    y.copy_(x)
    host = x.nbytes / (time.perf_counter() - t)
    path = os.path.join(directory, f"probe-{dl.rank()}.pt")
    state = torch.randn(3 * shard_params)
    t = time.perf_counter()
    torch.save(state, path)
    torch.load(path, weights_only=True)
    disk = 2 * state.nbytes / (time.perf_counter() - t)
    small = {"master": torch.zeros(16), "state": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(16),
                                                  "exp_avg_sq": torch.zeros(16)}}    # a shard file's format
    t = time.perf_counter()
    for _ in range(4):
        torch.save(small, path)
        torch.load(path, weights_only=True)
    os.remove(path)
    return {"host": host, "disk": disk, "file_s": (time.perf_counter() - t) / 8}


def median(values):
    return sorted(values)[len(values) // 2]


def step_times(directory: str, rounds: int = 8):
    """Per round: this rank's bandwidths (three probes), then a step of each tier, its optimizer step timed
    (from a barrier after backward). Medians over the rounds after the first (which creates Adam's state)."""
    torch.manual_seed(0)
    zeros = {tier: dl.ZeRO(GPT(SMALLER), stage=2, optim=torch.optim.AdamW, lr=1e-3, bucket_mb=2,
                           **({"offload": tier} if tier else {}),
                           **({"offload_dir": directory} if tier == "disk" else {})) for tier in TIERS}
    shard_params = sum(s.numel() for s in zeros[None].optimizer.shards)              # Psi/N
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dl.rank()))
    times, probes = {tier: [] for tier in TIERS}, []
    for r in range(1 + rounds):
        probes += [probe(directory, shard_params) for _ in range(3)]      # the file system's speed varies
        for tier in TIERS if r % 2 else TIERS[::-1]:
            zeros[tier](x).mean().backward()
            dist.barrier()
            t = time.perf_counter()
            zeros[tier].optimizer.step()                    # where offload acts: the step and its transfers
            times[tier].append(time.perf_counter() - t)
            zeros[tier].optimizer.zero_grad()
    zeros["disk"].optimizer.optimizer.close()
    bw = {k: median([p[k] for p in probes[3:]]) for k in probes[0]}
    return {t: median(v[1:]) for t, v in times.items()}, shard_params, len(zeros[None].optimizer.shards), bw


SMALLER = GPTConfig(vocab=256, seq_len=16, d_model=256, heads=8, layers=2)
measured, shard_params, shards, bw = dl.launch(step_times, world_size=2, args=(TMP,), output="quiet").results[0]
print(f"Psi/N = {shard_params:,} parameters in {shards} shards; measured in rank 0: host copy "
      f"{bw['host'] / 1e9:.1f} GB/s, file round trip {bw['disk'] / 1e9:.2f} GB/s, {bw['file_s'] * 1e3:.2f} ms a file")
extra, pred = {}, {}
for tier in ("cpu", "disk"):
    pred[tier] = dl.theory.offload.step_time(shard_params, tier=tier, host_bandwidth=bw["host"],
                                             disk_bandwidth=bw["disk"], shards=shards, disk_latency=bw["file_s"])
    extra[tier] = measured[tier] - measured[None]
    print(f"offload={tier:4}: optimizer step {measured[tier] * 1e3:6.1f} ms vs {measured[None] * 1e3:5.1f} ms "
          f"without; extra {extra[tier] * 1e3:6.1f} ms, predicted {pred[tier].total * 1e3:6.1f} ms "
          f"(host {pred[tier].host * 1e3:.1f} + files {pred[tier].disk * 1e3:.1f})")
assert pred["disk"].total / 2.5 <= extra["disk"] <= 2.5 * pred["disk"].total, (extra, pred)
assert extra["cpu"] < extra["disk"]

# %% [markdown]
# ## When to offload, and when to shard more
#
# Offload buys device memory with transfer time: every step moves 8 Ψ/N bytes over PCIe (about 25 GB/s; 4 Ψ/N with the
# fp16 gradients and parameters ZeRO-Offload sends) and, for NVMe, 24 Ψ/N more over a few GB/s, while more sharding
# (ZeRO-3, or more ranks) buys it with network traffic and needs more devices. ZeRO-Offload overlaps its copies with
# backward and, with its optional one-step delayed update, the CPU step with the next forward; ZeRO-Infinity reads
# ahead, as `offload.py` does. Offload pays when the devices are few (a model that must train on one or two GPUs),
# when the batch is large enough that the step's compute hides the copies, and when the host (or the NVMe array) is
# large. With many GPUs and a fast network, ZeRO-3 across them is usually faster. DeepSpeed's own estimates of the
# model states are in `dl.theory.offload.zero2_offload` and `zero3_offload`: try them for a 7 B model on 1 and on 8
# GPUs.
