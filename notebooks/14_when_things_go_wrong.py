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
# # 14 · When things go wrong
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# At scale, failure is the normal case: Meta's Llama 3 pre-training logged 419 unexpected interruptions in 54 days
# on up to 16,384 GPUs (Dubey et al. 2024, *The Llama 3 Herd of Models*, Sec. 3.3.4), 54 x 24 / 419 = one every
# 3.1 hours (this is the lesson the others point to for it). This lesson causes each classic failure **on
# purpose**, on a laptop, looks at what distlab shows about it, and fixes it:
#
# | # | failure | seen with | fixed by |
# |---|---------|-----------|----------|
# | 1 | a rank never enters a collective (the "NCCL timeout") | the flight recorder | finding the rank and the call |
# | 2 | a straggler | the per-rank step timeline | knowing which rank to look at |
# | 3 | NaN / overflow in fp16 | skipped steps, the loss scale | dynamic loss scaling, bf16, skipping on every rank |
# | 4 | out of memory in backward | the memory ledger | ZeRO-3 (shard the gradients and the weights) |
# | 5 | a rank killed | the restart report | automatic restart from the newest checkpoint |
# | 6 | a corrupt checkpoint | sha256 of every shard | falling back to the newest one that verifies |
# | 7 | checkpoints that stall training | the stall per save | async saves, and Young/Daly's cadence |
#
# The code this lesson explains:
# [distlab/launch/flight.py](../distlab/launch/flight.py) (each rank's last collectives, and the diagnosis of a hang),
# [distlab/stragglers.py](../distlab/stragglers.py) (per-step skew between ranks),
# [distlab/strategies/numerics.py](../distlab/strategies/numerics.py) (loss scaling, non-finite steps agreed across
# ranks), [distlab/memory_budget.py](../distlab/memory_budget.py) and [distlab/memory.py](../distlab/memory.py)
# (a memory limit on a CPU), [distlab/strategies/restart.py](../distlab/strategies/restart.py) (automatic restart),
# [distlab/checkpoint/store.py](../distlab/checkpoint/store.py) (verified shards),
# [distlab/checkpoint/background.py](../distlab/checkpoint/background.py) (async saves) and
# [distlab/theory/checkpoint.py](../distlab/theory/checkpoint.py) (how often to save).

# %%
import math
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import distlab as dl
from distlab.strategies import loop

TMP = Path(tempfile.mkdtemp(prefix="distlab_14_"))


def same(a: dict, b: dict) -> bool:
    """Two state dicts equal bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


print("ready")

# %% [markdown]
# ## 1. A rank that never enters a collective
#
# The most common "hang" at scale: every rank but one calls `all_reduce`, and the one that does not is busy
# elsewhere (a data loader stuck on a file system, a branch taken on one rank only, an exception swallowed). The
# others wait until a timeout, and NCCL's message names only the collective that timed out, on every rank. What
# you need is *which rank did not come*, and what it did last. Each distlab rank keeps a **flight recorder** (like
# PyTorch's NCCL flight recorder): its last collectives in a ring buffer in a memory-mapped file, which outlives
# the rank when the launcher kills it at the deadline.
#
# Below, rank 2 skips the second collective; the launch has a 5 s deadline.

# %%
def skips_an_all_reduce():
    t = torch.ones(4)
    dist.broadcast(t, src=0)                 # collective #1: everyone
    if dl.rank() == 2:
        time.sleep(60)                       # rank 2 never reaches collective #2
    dist.all_reduce(t)


try:
    dl.launch(skips_an_all_reduce, world_size=3, timeout=5, output="quiet")
    raise AssertionError("the launch should have hit its deadline")
except dl.LaunchError as e:
    err = e
print("LaunchError; ranks that never finished:", sorted(err.unfinished))

# %% tags=["nbval-ignore-output"]
print(str(err)[-600:])      # the diagnosis, at the end of the message

# %%
message = str(err)
assert "ranks 0, 1 wait in all_reduce #2 of group world" in message
assert "rank 2 never entered it" in message and "last finished broadcast #1" in message
last = {r: (rec[-1]["op"], rec[-1]["seq"], rec[-1]["finished"] is not None) for r, rec in err.flight.items()}
print("last record of each rank (op, seq, finished):", last)
assert last == {0: ("all_reduce", 2, False), 1: ("all_reduce", 2, False), 2: ("broadcast", 1, True)}

# %% [markdown]
# The same records on a time line: each bar is a collective from the moment a rank entered it to the moment it
# finished; an unfinished one runs on to the launch's deadline (5 s after the launch, drawn at 5 s after the first
# record). Ranks 0 and 1 sit in all_reduce #2; rank 2's lane ends after broadcast #1.

# %%
t0 = min(rec["entered"] for recs in err.flight.values() for rec in recs)
fig, ax = plt.subplots(figsize=(8, 2.6))
for r, recs in sorted(err.flight.items()):
    for rec in recs:
        done = rec["finished"] is not None
        end = rec["finished"] - t0 if done else 5.0
        ax.barh(r, max(end - (rec["entered"] - t0), 0.03), left=rec["entered"] - t0, height=0.5,
                color="tab:green" if done else "tab:red")
        ax.text(rec["entered"] - t0 + (0.05 if done else 0.6), r + (0.42 if done else 0.0),
                f"{rec['op']} #{rec['seq']}" + (" (finished)" if done else ": waiting"), va="center", fontsize=8,
                color="black" if done else "white")
ax.axvline(5.0, color="k", ls=":", lw=1)
ax.text(4.95, 2.3, "deadline", ha="right", fontsize=8)
ax.set(yticks=sorted(err.flight), yticklabels=[f"rank {r}" for r in sorted(err.flight)], xlim=(0, 5.2), ylim=(-0.5, 2.8),
       xlabel="seconds after the first collective (measured, flight recorder)", title="the hang: who never came")
ax.invert_yaxis()
fig.tight_layout()
plt.show()

# %% [markdown]
# The fix is in the program, not the launcher: rank 2 must reach the same collectives in the same order. The
# flight recorder tells you where to look: rank 2, between broadcast #1 and all_reduce #2.
#
# ## 2. A straggler
#
# One slow rank (a throttled GPU, a slow disk, a noisy neighbour) slows *everyone*: the others wait for it in the
# gradient all-reduce. Here rank 1 sleeps 0.3 s in each step (we patch the step loop's micro-step before the launch;
# forked ranks inherit the patch). `report.stragglers()` splits each rank's step into busy time and time waiting.

# %%
DELAY = 0.3
original = loop._micro_steps


def slowed(*args):
    if dl.rank() == 1:
        time.sleep(DELAY)
    return original(*args)


loop._micro_steps = slowed
try:
    slow = dl.train("ddp", world_size=3, model="mlp", steps=3, global_batch=12, timeout=120)
finally:
    loop._micro_steps = original
s = slow.stragglers()
print("slowest rank at each step:", s.slowest, "; straggler:", s.straggler)
assert s.straggler == 1 and s.slowest == [1, 1, 1]

# %% tags=["nbval-ignore-output"]
print(s)

# %%
assert all(skew >= DELAY / 2 for skew in s.skew)
assert all(w >= DELAY * 0.9 for w in s.waited[0][1:])       # rank 0 waited for rank 1 in every step after the first
print("every step skewed by at least", DELAY / 2, "s; the fast ranks waited for rank 1")

# %% [markdown]
# Per rank and step, the two parts `stragglers()` measured: busy (computing) and waiting (in the all-reduce, for
# rank 1). The step takes as long on every rank; only the split differs.

# %%
fig, ax = plt.subplots(figsize=(8, 2.6))
width = 0.25
for r in range(3):
    xs = [step + (r - 1) * width for step in range(len(s.skew))]
    busy = [s.busy[r][step] for step in range(len(s.skew))]
    ax.bar(xs, busy, width, color=f"C{r}", label=f"rank {r} busy")
    ax.bar(xs, s.waited[r], width, bottom=busy, color="none", edgecolor=f"C{r}", hatch="//")
ax.bar([0], [0], color="none", edgecolor="grey", hatch="//", label="waiting (in the all-reduce)")
ax.set(xticks=range(len(s.skew)), xticklabels=[f"step {k}" for k in range(len(s.skew))],
       ylabel="seconds (measured)", title=f"a straggler: rank 1 sleeps {DELAY} s per step, ranks 0 and 2 wait")
ax.legend(fontsize=8, ncol=4, loc="lower center")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. NaN and overflow: fp16 vs bf16
#
# fp16 has 5 exponent bits: its largest value is 65504, and small gradients underflow to zero. Mixed precision in
# fp16 therefore multiplies the loss by a **loss scale** S before backward and divides the gradients by S after.
# With S too large the scaled gradients overflow to inf: the step is **skipped** (on every rank, agreed by an
# all-reduce of one flag) and S halves; after `growth_interval` good steps S doubles again. bf16 has fp32's 8
# exponent bits: no overflow, no scaler needed (at the price of 3 fewer mantissa bits).
#
# Start fp16 with a scale far too large (2^20):

# %% tags=["nbval-ignore-output"]
NUM = dict(steps=6, global_batch=10, clip=1.0)
fp16 = dl.train("ddp", world_size=2, **NUM, precision="fp16-mixed", loss_scale=2.0 ** 20, growth_interval=2)
bf16 = dl.train("ddp", world_size=2, **NUM, precision="bf16-mixed")
n16, nbf = fp16.numerics, bf16.numerics
print("fp16: skipped steps", n16["skipped"], "; loss scale per step, log2:",
      [int(math.log2(x)) for x in n16["loss_scales"]])

# %%
print("fp16: steps 0 and 1 skipped:", n16["skipped"][:2] == [0, 1], "; bf16: skipped steps", nbf["skipped"])
assert n16["skipped"][:2] == [0, 1] and nbf["skipped"] == []
assert all(math.isfinite(v) for v in fp16.losses + bf16.losses)
every = [r.info["numerics"] for r in fp16.results]
assert all(e["skipped"] == n16["skipped"] for e in every)   # the same steps skipped on every rank
# the rule: S halves after an overflow, doubles after growth_interval=2 good steps in a row
S, good = 2.0 ** 20, 0
for step, scale in enumerate(n16["loss_scales"]):
    assert scale == S, (step, scale, S)
    if step in n16["skipped"]:
        S, good = S / 2, 0
    else:
        good += 1
        if good == 2:
            S, good = S * 2, 0
print("the loss scale followed the rule at every step")

# %%
fig, ax = plt.subplots(figsize=(8, 2.6))
steps = range(len(n16["loss_scales"]))
ax.step(steps, [math.log2(x) for x in n16["loss_scales"]], where="post", label="fp16 loss scale (log2)")
ax.plot(n16["skipped"], [math.log2(n16["loss_scales"][k]) for k in n16["skipped"]], "rx", ms=9,
        label="overflow: step skipped, scale halved")
ax.set(xlabel="step", ylabel="log2 S", title="dynamic loss scaling, measured (bf16 needs none: no step skipped)")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# A NaN on **one** rank is the dangerous case: if only that rank skipped its step, the replicas would drift apart
# for ever. Plant a NaN in rank 1's gradient at step 1 (`nan_at_step`, `nan_rank`): every rank skips step 1.

# %%
nan = dl.train("ddp", world_size=3, **NUM, nan_at_step=1, nan_rank=1)
seen = [r.info["numerics"]["nonfinite_here"] for r in nan.results]
skipped = [r.info["numerics"]["skipped"] for r in nan.results]
print("non-finite gradient seen on rank:", seen, "; skipped on rank:", skipped)
assert seen == [[], [1], []] and skipped == [[1], [1], [1]]
assert all(math.isfinite(v) for v in nan.losses)

# %% [markdown]
# ## 4. Out of memory: in backward, cured by ZeRO; in forward, cured by recomputation
#
# A large model with a small batch: weights plus gradients (at the peak of backward) outweigh weights plus
# activations (forward). `memory_limit=` gives a CPU run a memory budget: the ledger raises
# `MemoryLimitExceeded` (a `torch.OutOfMemoryError`) the moment the budget is crossed, inside `loss.backward()`,
# as a GPU would.

# %%
MEM = dict(model="mlp", global_batch=4, steps=2, optimizer="sgd")
free = dl.train("single", **MEM).memory[0]["timeline"]
total = {label: sum(row[c] for c in dl.memory.CATEGORIES) for label, row in free[3:5]}    # step 1
limit = (total["forward"] + total["backward"]) // 2
print("backward needs more than forward:", total["backward"] > total["forward"])


def out_of_memory(**run) -> dl.memory.MemoryLimitExceeded:
    """The error a run over its memory budget raises (it must not fit)."""
    try:
        dl.train("single", **run)
    except dl.memory.MemoryLimitExceeded as e:
        return e
    raise AssertionError("should not fit")


oom = out_of_memory(**MEM, memory_limit=limit)
print("out of memory in", oom.phase, "; category:", oom.category)
assert oom.phase == "backward" and oom.category == "grads" and "zero3" in str(oom)

# %% tags=["nbval-ignore-output"]
print(str(oom))

# %% [markdown]
# ZeRO-3 on 4 ranks keeps a quarter of the weights and of the gradients on each rank: the same model fits under
# the same limit.

# %%
fits = dl.train("zero3", world_size=4, **MEM, memory_limit=limit)
print("zero3 on 4 ranks fits under the limit:", max(m["peak_total"] for m in fits.memory) <= limit)
assert max(m["peak_total"] for m in fits.memory) <= limit

# %% [markdown]
# Step 1 of both runs, each phase's peak by category (the ledger's timeline), against the limit. The limit was set
# halfway between the single rank's forward and backward peaks, so the margins are small on that side (the totals are
# printed on the bars): forward fits, backward does not. ZeRO-3's rank holds a quarter of the parameters and
# gradients, plus gathered buffers for one layer at a time.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=True)
for ax, (name, timeline) in zip(axes, (("single rank", free), ("zero3, rank 0 of 4", fits.memory[0]["timeline"]))):
    phases = timeline[3:6]                                          # step 1: forward, backward, step
    bottom = [0] * len(phases)
    for c, cat in enumerate(dl.memory.CATEGORIES):
        v = [row[cat] / 1024 for _, row in phases]
        if any(v):
            ax.bar(range(len(phases)), v, bottom=bottom, color=f"C{c}", label=cat)
            bottom = [b + x for b, x in zip(bottom, v)]
    for x, top in enumerate(bottom):
        over = top * 1024 > limit
        ax.text(x, top + 0.5, f"{top:.2f} KiB" + (" > limit" if over else ""), ha="center", fontsize=8,
                color="red" if over else "black")
    ax.axhline(limit / 1024, color="red", ls="--", label=f"memory_limit ({limit / 1024:.2f} KiB)")
    ax.set(xticks=range(len(phases)), title=name, ylim=(0, 1.25 * limit / 1024))
    ax.set_xticklabels([label for label, _ in phases], fontsize=8)
axes[0].set_ylabel("KiB (measured, memory ledger)")
axes[1].legend(fontsize=7, loc="upper right")
fig.suptitle("out of memory in backward: over the limit on one rank, under it with ZeRO-3 on 4", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# The other way to run out: activations. A GPT on a bigger batch keeps far more activations than model states, so a
# budget of three quarters of its peak trips in forward, on the activations. Sharding the model states barely
# helps; recomputation does: with `recompute=True` each transformer block keeps only its input during forward and
# runs its forward again in backward (Chen et al. 2016), one block at a time. Prediction: the activation peak is
# at least one block's activations (measured on its own below) and at most that plus what forward keeps; the
# arithmetic is the same, so the losses must come out identical.

# %%
from distlab.memory import SavedActivations

ACT = dict(model="gpt-tiny", global_batch=16, steps=1)
kept = dl.train("single", **ACT)
act_limit = kept.memory[0]["peak_total"] * 3 // 4
act_oom = out_of_memory(**ACT, memory_limit=act_limit)
print("out of memory in", act_oom.phase, "; category:", act_oom.category)
recomputed = dl.train("single", **ACT, recompute=True, memory_limit=act_limit)
rows = dict(recomputed.memory[0]["timeline"])
gpt = dl.models.build("gpt-tiny", 0)
with SavedActivations(gpt) as one:
    gpt.blocks[0](torch.randn(16, 32, 64, requires_grad=True))      # one block, at the batch's shape
low, high = one.bytes, one.bytes + rows["forward"]["activations"]
measured = rows["recompute"]["activations"]
print(f"recompute=True fits; activation peak {measured / 2**20:.2f} MiB, predicted between {low / 2**20:.2f} "
      f"and {high / 2**20:.2f} MiB ({kept.memory[0]['peak']['activations'] / measured:.1f}x less than without)")
print("same losses:", recomputed.losses == kept.losses)
assert act_oom.phase == "forward" and act_oom.category == "activations" and "recompute=True" in str(act_oom)
assert low <= measured <= high and recomputed.losses == kept.losses

# %% [markdown]
# ## 5. A rank killed, restarted automatically
#
# `fail_at_step=5` kills rank 2 (SIGKILL) as it reaches step 5, in the first attempt only. With `max_restarts=1`
# distlab sees the failure, relaunches from the newest complete checkpoint (step 4), and reports the restart. The
# result is bit for bit the uninterrupted run's.

# %%
RUN = dict(model="gpt-tiny", steps=6, global_batch=10, seed=0)
plain = dl.train("zero2", world_size=3, **RUN)

# %% tags=["nbval-ignore-output"]
restarted = dl.train("zero2", world_size=3, **RUN, checkpoint_dir=str(TMP / "restart"), checkpoint_every=2,
                     fail_at_step=5, max_restarts=1)

# %%
[r] = restarted.restarts
print(f"restart {r.attempt}: rank {r.failed_rank} failed at step {r.reached_step}; resumed from step "
      f"{r.resumed_from} on {r.next_world_size} ranks; {r.lost_steps} step(s) lost")
print("equal to the uninterrupted run:", restarted.losses == plain.losses and same(restarted.params, plain.params))
assert (r.failed_rank, r.reached_step, r.resumed_from, r.lost_steps) == (2, 5, 4, 1)
assert restarted.losses == plain.losses and same(restarted.params, plain.params)

# %% [markdown]
# ## 6. A corrupt checkpoint
#
# A bit flipped on disk, a truncated copy: the manifest holds every shard's sha256, and a resume checks every
# file. When the newest checkpoint does not verify, the resume falls back to the newest one that does, and says so.

# %%
CK = dict(steps=4, global_batch=8, checkpoint_every=2)
whole = dl.train("single", steps=6, global_batch=8)
dl.train("single", **CK, checkpoint_dir=str(TMP / "corrupt"))
shard = TMP / "corrupt" / "step_4" / "rank_0.pt"
data = bytearray(shard.read_bytes())
data[len(data) // 2] ^= 0xFF                          # one flipped byte
n = shard.write_bytes(bytes(data))

# %% tags=["nbval-ignore-output"]
resumed = dl.train("single", **{**CK, "steps": 6}, checkpoint_dir=str(TMP / "corrupt"), resume=True)

# %%
info = resumed.results[0].info["checkpoint"]
print("resumed from step", info["resumed_from"], "; saved", info["saved"])
print("equal to the uninterrupted run:", resumed.losses == whole.losses)
assert info["resumed_from"] == 2 and resumed.losses == whole.losses

# %% [markdown]
# ## 7. Checkpoints that stall training: sync vs async, and how often to save
#
# A synchronous save stops training until every byte is on disk. An **async** save copies the state to CPU memory
# at the step boundary (the stall) and writes it in a background thread while training goes on, with the same
# atomic commit (`step_N.tmp`, then one rename).

# %%
IO = dict(model="gpt-tiny", steps=6, global_batch=8, checkpoint_every=2)
sync = dl.train("ddp", world_size=2, **IO, checkpoint_dir=str(TMP / "sync"))
asyn = dl.train("ddp", world_size=2, **IO, checkpoint_dir=str(TMP / "async"), async_save=True)
io_s, io_a = sync.results[0].info["checkpoint_io"], asyn.results[0].info["checkpoint_io"]
print("modes:", io_s["mode"], io_a["mode"], "; saves:", len(io_s["stall_s"]), len(io_a["stall_s"]))
print("same result:", same(sync.params, asyn.params))
assert io_a["mode"] == "async" and same(sync.params, asyn.params)
less = sum(io_a["stall_s"]) < sum(io_s["stall_s"])    # a snapshot to CPU memory is cheaper than a write + fsync
print("async stalls training less than sync:", less)
assert less

# %% tags=["nbval-ignore-output"]
print(f"sync stall per save:  {[round(x * 1e3, 1) for x in io_s['stall_s']]} ms")
print(f"async stall per save: {[round(x * 1e3, 1) for x in io_a['stall_s']]} ms "
      f"(background write {[round(x * 1e3, 1) for x in io_a['write_s']]} ms)")

# %% [markdown]
# How often to save? Saving costs `save_s` each time; a failure loses, on average, half the work since the last
# save. Young (1974) balanced the two: save every `sqrt(2 * save_s * MTBF)` seconds of work; Daly (2006) refined
# it. For a 30 s save and a failure every 3 hours:

# %%
save_s, mtbf_s = 30.0, 3 * 3600.0
young, daly = dl.theory.young_interval(save_s, mtbf_s), dl.theory.daly_interval(save_s, mtbf_s)
print(f"Young: save every {young / 60:.1f} min; Daly: every {daly / 60:.1f} min")

# %% [markdown]
# Checked against the models they come from, minimised by brute force here rather than by their formulas. Young's
# first-order waste per second of work is `save_s / T + T / (2 MTBF)`. Daly's is the exact expectation with
# exponential failures: a segment of T seconds of work plus a save succeeds with probability e^(-(T+save)/MTBF),
# so finishing W seconds of work takes `W / T * MTBF * (e^((T + save) / MTBF) - 1)` on average. Each interval
# must sit at its model's minimum, found on a grid of 1 s steps: a wrong constant (sqrt(save MTBF), a missing
# `- save_s`) moves it by tens of seconds.

# %%
grid = [float(t) for t in range(60, 3 * 3600)]
first_order = min(grid, key=lambda t: save_s / t + t / (2 * mtbf_s))
exact = min(grid, key=lambda t: mtbf_s * math.expm1((t + save_s) / mtbf_s) / t)
print(f"argmin of Young's waste: {first_order:.0f} s (Young {young:.1f} s); argmin of the exact expectation: "
      f"{exact:.0f} s (Daly {daly:.1f} s)")
assert abs(first_order - young) <= 1 and abs(exact - daly) <= 1 and daly < young
print(f"an async save stalling 3 s instead of 30 s: every {dl.theory.young_interval(3.0, mtbf_s) / 60:.1f} min")

# %% [markdown]
# ## What to remember
#
# - A hang is a rank that did not come: find it with each rank's last collectives (op, group, sequence number),
#   not with the timeout message every waiting rank prints.
# - One slow rank makes every step slow: look at per-rank busy time, not the step time (equal on every rank).
# - fp16 needs dynamic loss scaling; a non-finite gradient must skip the step on **every** rank; bf16 avoids
#   overflow altogether.
# - OOM in backward from weights + gradients: shard them (ZeRO-3, FSDP). OOM in forward from activations:
#   recompute them (`recompute=True`), the same training for one more forward per block.
# - Automatic restart from the newest complete checkpoint is the minimum viable fault tolerance; with exact
#   resume, a crash costs time, never results.
# - Verify every shard (sha256) before trusting a checkpoint; keep more than one.
# - Async saves turn the save time into a short stall; save about every `sqrt(2 * save_s * MTBF)`.
#
# **Try it**: in section 5, pass `shrink=True` and `fail_in="save"` with `fail_at_step=4`: the restart runs on
# fewer ranks, resharding the checkpoint. In section 3, start fp16 at `loss_scale=2.0 ** 15`: which steps are
# skipped now?
