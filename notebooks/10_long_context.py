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
# # 10 · Long context: ring attention and Ulysses
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# Every layer of a transformer but one acts on each token alone: embeddings, LayerNorm, the MLP, the LM head.
# **Attention** is the exception: every query looks at every (earlier) key. That makes long sequences expensive in
# two ways: the score matrix softmax(QKᵀ) is s × s per head (memory **quadratic** in s), and even without storing it,
# one GPU must hold the activations of all s tokens (memory **linear** in s, but with a large constant).
#
# **Context parallelism** (CP) splits the *sequence* over c ranks: each rank holds s/c tokens of every sequence and
# runs the token-wise layers on them unchanged. Only attention must talk, and it can be made **exact**, not
# approximate, in two ways:
#
#     ring attention (Liu et al. 2023)            Ulysses (Jacobs et al. 2023, DeepSpeed)
#     each rank keeps its queries;                all-to-all: sequence split -> head split
#     K/V blocks travel round a ring, c steps;    local attention over the whole sequence, H/c heads
#     partial softmaxes merged by log-sum-exp     all-to-all back: head split -> sequence split
#
# In this lesson you will measure attention memory growing as s², watch the K/V blocks go round the ring, measure
# the **causal imbalance** (under a causal mask the last rank does most of the work) and fix it with the zig-zag
# layout, trace Ulysses' two all-to-alls, and check the bytes every rank sends against `dl.theory`.
#
# **The code, in reading order** ([distlab/parallel/context/](../distlab/parallel/context/__init__.py)):
# [layout.py](../distlab/parallel/context/layout.py) (which chunks each rank holds: contiguous or zig-zag),
# [ring_attention.py](../distlab/parallel/context/ring_attention.py) (the ring, the log-sum-exp merge, the
# hand-written backward), [ulysses.py](../distlab/parallel/context/ulysses.py) (over the all-to-all of
# [distlab/comm/all_to_all.py](../distlab/comm/all_to_all.py)), [gpt.py](../distlab/parallel/context/gpt.py)
# (the GPT's attention swapped for either). K/V hops go through `ring_shift` in
# [distlab/comm/shift.py](../distlab/comm/shift.py), whose one exchange [p2p.py](../distlab/comm/p2p.py) records in
# the trace; the formulas are in
# [distlab/theory/context.py](../distlab/theory/context.py).

# %%
import contextlib
import importlib
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
import distlab as dl
from distlab.memory import measure_layer
from distlab.theory.activations import predicted_layer_bytes, unmodelled_bytes

H, A = 32, 4                       # hidden size and heads of the one-layer GPT we measure (head_dim 8)
SEQS = [64, 128, 256, 512]         # sequence lengths
print(f"hidden {H}, heads {A}, sequence lengths {SEQS}")


# %% [markdown]
# ## 1. Attention memory grows as s², context parallelism removes it
#
# One GPT layer saves, for its backward, Korthikanti et al.'s (2022) **s·b·h·(34 + 5·a·s/h)** bytes at 2-byte
# activations. The first term is per token (linear in s), the second is the attention's softmax and its dropout:
# a·s² per sequence, **quadratic**. Our tiny GPT runs in fp32 without dropout, which leaves 4·s·b·(16h + a·s) bytes
# (`predicted_layer_bytes`, lesson 04), plus what the paper does not count: the LayerNorm statistics and the causal
# mask, s² bytes more (`unmodelled_bytes`). We measure with saved-tensor hooks (`measure_layer` in
# [distlab/memory.py](../distlab/memory.py)) at four lengths.
#
# Under `dl.cp` the same layer on c ranks saves, per rank, only s/c tokens' worth and **no s × s matrix at all**:
# ring attention recomputes its score blocks in backward from the saved log-sum-exp (FlashAttention's trick), and
# Ulysses' local attention is the fused kernel that does the same. Per rank: 4·(s/c)·b·(17h + a) + 16·(s/c)·b bytes
# (`dl.theory.cp_saved_bytes_per_layer`: the output in fp32 and one log-sum-exp per query and head replace the
# softmax).
#
# So the gap between the plain layer and the CP lines below is **two effects multiplied**: not storing the s × s
# matrix, which FlashAttention already saves on one rank, and splitting the tokens c ways, which is what context
# parallelism adds. To separate them we also measure a **one-rank FlashAttention-style layer**: the same ring
# attention on a ring of one rank (c = 1), which computes attention block by block with the running log-sum-exp and
# recomputes the scores in backward, exactly what FlashAttention does on one GPU. Plain -> c = 1 is
# FlashAttention's saving; c = 1 -> c = 4 is what splitting the sequence saves (the printout gives both, at s = 512).

# %%
def layer_bytes(attention=None):
    """Bytes one GPT layer saves for backward on this rank, at every length in SEQS."""
    n, saved = dl.world_size(), {}
    for s in SEQS:
        torch.manual_seed(0)
        gpt = dl.models.GPT(dl.models.GPTConfig(vocab=64, seq_len=s, d_model=H, heads=A, layers=1))
        if attention is not None:
            gpt = dl.cp.parallelize(gpt, attention=attention)        # its attention now ring or Ulysses
        saved[s] = measure_layer(gpt.blocks[0], torch.randn(1, s // n, H))   # this rank's s/n tokens
    return saved

plain = layer_bytes()
flash = layer_bytes("ring")        # one rank (this process): ring attention over a ring of one, FlashAttention-style
cp_runs = {(att, n): dl.launch(layer_bytes, world_size=n, args=(att,), output="quiet").results
           for att, n in (("ring", 2), ("ring", 4), ("ulysses", 4))}
print(f"{'s':>5} {'plain layer':>12} {'predicted':>12} {'of which s^2':>13} {'flash c=1':>10} | per rank: "
      + "  ".join(f"{att} c={n}" for att, n in cp_runs))
for s in SEQS:
    predicted = predicted_layer_bytes(s, 1, H, A) + unmodelled_bytes(s, 1)
    quadratic = 4 * A * s * s + s * s                            # softmax (fp32) + causal mask (bool)
    assert plain[s] == predicted
    assert flash[s] == dl.theory.cp_saved_bytes_per_layer(s, 1, H, A, cp=1)   # measured, no s x s matrix kept
    per_rank = []
    for (att, n), results in cp_runs.items():
        want = dl.theory.cp_saved_bytes_per_layer(s, 1, H, A, cp=n)
        assert all(r[s] == want for r in results), (att, n, s)
        per_rank.append(results[0][s])
    print(f"{s:5} {plain[s]:12,} {predicted:12,.0f} {quadratic / plain[s]:12.0%} {flash[s]:10,} | "
          + "  ".join(f"{b:>13,}" for b in per_rank))
s = SEQS[-1]
print(f"at s = {s}: FlashAttention-style on one rank saves {plain[s] / flash[s]:.1f}x (measured); ring attention "
      f"over c = 4 ranks another {flash[s] / cp_runs['ring', 4][0][s]:.1f}x per rank (measured): splitting the sequence")
assert flash[s] == 4 * cp_runs["ring", 4][0][s]         # with no s x s term left, c ranks divide it by exactly c

# %%
fig, ax = plt.subplots(figsize=(7, 3.6))
ax.plot(SEQS, [plain[s] / 1024 for s in SEQS], "o", color="C3", label="one rank, plain attention: measured")
ax.plot(SEQS, [(predicted_layer_bytes(s, 1, H, A) + unmodelled_bytes(s, 1)) / 1024 for s in SEQS], "--",
        color="C3", label="predicted: 4sb(16h + as) + s^2 + stats")
ax.plot(SEQS, [flash[s] / 1024 for s in SEQS], "D", color="C4", label="one rank, FlashAttention-style: measured")
for (att, n), colour in zip(cp_runs, ("C0", "C2", "C1")):
    ax.plot(SEQS, [cp_runs[att, n][0][s] / 1024 for s in SEQS], "s" if att == "ring" else "^", color=colour,
            label=f"{att}, c = {n}: measured per rank")
    ax.plot(SEQS, [dl.theory.cp_saved_bytes_per_layer(s, 1, H, A, cp=n) / 1024 for s in SEQS], ":",
            color=colour)
ax.set(xscale="log", yscale="log", xlabel="sequence length s", ylabel="KiB saved per layer per rank",
       title="activation memory of one layer (dotted: dl.theory.cp_saved_bytes_per_layer)")
ax.set_xticks(SEQS, [str(s) for s in SEQS])
ax.minorticks_off()
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# On the log-log plot the plain layer bends upward (slope → 2: the s² term is already most of it at s = 512, with
# only 4 heads of width 8), while the CP lines are straight with slope 1 and sit 1/c below what one rank with
# FlashAttention-style recomputation would save (c = 1 of the dotted formula, not drawn); most of their distance
# from the plain layer is that recomputation, not the split. Ring attention and Ulysses save exactly the same
# bytes here. At real sizes (s = 128K tokens, 32 heads) the score matrix alone would be 32 × 131,072² × 2 bytes ≈
# 1.1 TB per layer per sequence in bf16 (Korthikanti's 5·a·s², with dropout's mask and output, 2.7 TB); no one
# stores it (FlashAttention), and CP then divides the linear part by c.
#
# ## 2. Ring attention: which K/V block each rank holds at each step
#
# Rank r keeps its queries Q_r. At step t it holds the keys and values of rank r − t, computes its queries
# against them, and merges the partial result into its running output with the log-sum-exp rule
#
#     l = log(exp(l_a) + exp(l_b))        o = exp(l_a − l)·o_a + exp(l_b − l)·o_b
#
# which is exact: after c steps every query has met every key. Each step **posts** the send of the held block to
# rank r + 1 and the receive of the next from rank r − 1 *before* computing, and waits after: the transfer hides
# behind the compute (`start_ring_shift` in [shift.py](../distlab/comm/shift.py)).
#
# We run it on 4 ranks and rebuild the picture **from the trace**: every hop is recorded with the rank it came
# from, so "the block rank r holds at step t" is "the block its sender held at step t − 1". To see the compute, we
# attach a timer to the block computation from outside (the algorithm carries no instrumentation) that records a
# span per (query chunk, key chunk) pair.

# %%
RING = importlib.import_module("distlab.parallel.context.ring_attention")


@contextlib.contextmanager
def timed_blocks(device_s=0.0):
    """A span in dl.tracer() around every block pair ring attention computes; restored on exit.
    ``device_s``: seconds a device would spend per (query row, key row) pair, slept inside the span (a sleeping
    rank holds no CPU core, so 4 ranks on 2 cores behave like 4 devices; lesson 05's TimedStage does the same)."""
    real = RING.block_forward

    def timed(q, k, v, kind, scale):
        with dl.tracer().span(f"block ({kind})", rows=q.shape[2]):
            time.sleep(device_s * q.shape[2] * k.shape[2])
            return real(q, k, v, kind, scale)
    RING.block_forward = timed
    try:
        yield
    finally:
        RING.block_forward = real


def ring_forward(seq, zigzag, heads=4, head_dim=16, device_s=0.0):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))      # the whole sequence, every rank
    mine = [dl.cp.split(t, dim=2, zigzag=zigzag) for t in (q, k, v)]         # (1, heads, seq/n, head_dim)
    with timed_blocks():
        with FlopCounterMode(display=False) as flops:                      # counts q k^T and P v
            dl.cp.ring_attention(*mine, causal=True, zigzag=zigzag)        # (and warms up)
    torch.distributed.barrier()                                            # start the timed call together
    dl.tracer().mark("measured")
    with timed_blocks(device_s):
        dl.cp.ring_attention(*mine, causal=True, zigzag=zigzag)            # the one the timeline shows
    return flops.get_total_flops()

N = 4
ring_run = dl.launch(ring_forward, world_size=N, args=(64, False), output="quiet")


def held_blocks(trace, n):
    """held[r][t]: whose K/V block rank r computes with at step t, followed through the traced hops."""
    hops = {r: [e for e in trace.comms(rank=r, op="ring_shift")][-(n - 1):] for r in range(n)}  # last call
    held = {r: [r] for r in range(n)}
    for t in range(1, n):
        for r in range(n):
            held[r].append(held[hops[r][t - 1].args["src"]][t - 1])   # what my sender held a step before
    return held

held = held_blocks(ring_run.trace, N)
for r in range(N):
    print(f"rank {r} holds the K/V of rank", held[r])
    assert held[r] == [(r - t) % N for t in range(N)]

# %%
fig, ax = plt.subplots(figsize=(6.5, 2.6))
for r in range(N):
    for t in range(N):
        owner = held[r][t]
        ax.add_patch(plt.Rectangle((t, N - 1 - r), 0.92, 0.85, color=f"C{owner}", alpha=0.75))
        ax.text(t + 0.46, N - 1 - r + 0.42, f"KV{owner}", ha="center", va="center", fontsize=9)
        if t < N - 1:
            ax.annotate("", xy=(t + 1.0, N - 1 - (r + 1) % N + 0.42), xytext=(t + 0.92, N - 1 - r + 0.42),
                        arrowprops=dict(arrowstyle="->", lw=0.6, color="grey"))
ax.set(xlim=(0, N), ylim=(0, N), xlabel="step t", title="ring attention, c = 4: the K/V block each rank holds")
ax.set_xticks([t + 0.46 for t in range(N)], [str(t) for t in range(N)])
ax.set_yticks([N - 1 - r + 0.42 for r in range(N)], [f"rank {r}" for r in range(N)])
fig.tight_layout()
plt.show()

# %% [markdown]
# Every rank holds at most two blocks at once: the one it computes with and the one arriving. The grey arrows are
# the hops: rank r passes its block to rank r + 1 after each step, c − 1 hops in the forward.
#
# ## 3. The causal imbalance, and the zig-zag fix
#
# With a causal mask, query chunk a needs only key chunks b ≤ a: a pair with b > a is skipped, b = a is the lower
# triangle. Cut the sequence contiguously and rank 0 (the first tokens) computes 1 block pair, rank c − 1 computes
# c of them; since every step ends only when the slowest rank is done, everyone waits for the last rank.
#
# The **zig-zag** layout (Megatron-LM's CP, Llama 3) cuts the sequence into 2c chunks and gives rank r chunks r and
# 2c − 1 − r: an early chunk and a late one. Every rank then computes 2c + 1 pairs of half-length chunks:
#
#     contiguous, c = 4:  r0: [0]       r1: [1]       r2: [2]       r3: [3]       pairs 1, 2, 3, 4 of (s/4)²
#     zig-zag,    c = 4:  r0: [0 | 7]   r1: [1 | 6]   r2: [2 | 5]   r3: [3 | 4]   pairs 9, 9, 9, 9 of (s/8)²
#
# We **count** the work on each rank with PyTorch's `FlopCounterMode` (the matmul FLOPs of q·kᵀ and P·v) and put
# `dl.theory.ring_attention_flops` beside it; the timeline shows the same thing in time.

# %%
SEQ, HEADS, HEAD_DIM = 1024, 4, 16
layouts = {zigzag: dl.launch(ring_forward, world_size=N, args=(SEQ, zigzag), output="quiet")
           for zigzag in (False, True)}
for zigzag, run in layouts.items():
    predicted = dl.theory.ring_attention_flops(SEQ, 1, HEADS * HEAD_DIM, N, causal=True, zigzag=zigzag)
    counted = run.results
    name = "zig-zag   " if zigzag else "contiguous"
    print(f"{name} MFLOP per rank: counted {[f / 1e6 for f in counted]}  predicted {[f / 1e6 for f in predicted]}"
          f"   slowest / mean = {max(counted) * N / sum(counted):.2f}")
    assert counted == predicted


# %%
def pairs_per_step(n, zigzag):
    """pairs[r][t]: block pairs rank r computes at step t, holding rank (r - t)'s K/V: every (query chunk a,
    key chunk b) of the two ranks' chunks (dl.cp.chunk_ids) with b <= a."""
    return [[sum(b <= a for a in dl.cp.chunk_ids(r, n, zigzag) for b in dl.cp.chunk_ids((r - t) % n, n, zigzag))
             for t in range(n)] for r in range(n)]

fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), sharey=True)
for ax, zigzag in zip(axes, (False, True)):
    pairs = pairs_per_step(N, zigzag)
    unit = 1 / 4 if zigzag else 1                                  # a pair of s/2c chunks is 1/4 of s/c
    work = [[p * unit for p in row] for row in pairs]              # per step, in (s/c)^2 block pairs
    c = SEQ // (2 * N if zigzag else N)                            # chunk length
    assert [4 * c * c * HEADS * HEAD_DIM * sum(row) for row in pairs] == layouts[zigzag].results   # counted
    x = 0.0
    for t in range(N):
        step = max(work[r][t] for r in range(N))                   # the ring moves at the slowest rank's pace
        for r in range(N):
            ax.barh(N - 1 - r, work[r][t], left=x, color=f"C{(r - t) % N}", edgecolor="k", lw=0.5)
            ax.barh(N - 1 - r, step - work[r][t], left=x + work[r][t], color="white", hatch="///",
                    edgecolor="grey", lw=0.5)
        x += step
    ax.set(title=f"{'zig-zag' if zigzag else 'contiguous'}: {x:g} units of time", xlabel="time, in (s/c)^2 "
           "block pairs (colour: whose K/V)")
    ax.set_yticks(range(N), [f"rank {r}" for r in reversed(range(N))])
fig.suptitle("causal ring attention, c = 4: work per step (hatched: waiting for the slowest rank)", fontsize=10)
fig.tight_layout()
plt.show()


# %% [markdown]
# The same in wall-clock time. On this machine a block pair takes about a millisecond of CPU, as long as a rank
# being descheduled (4 ranks share 2 cores and other programs), so timed as it is the imbalance drowns in noise.
# We therefore give each block pair a **device's time**: 250 ms per (s/c)² pair, proportional to its query rows x key
# rows, slept inside the block's span (`timed_blocks(device_s)`; a sleeping rank holds no core, so the 4 ranks
# behave like 4 devices, as lesson 05's `TimedStage` does). The work per rank and the waiting are then the schedule's.
# **Prediction** (the work figure above, 250 ms a unit): the forward takes 4 units contiguous and 9/4 zig-zag,
# 1000 ms against 563 ms, a ratio of 1.78; busy time per rank, slowest / mean, 1.60 contiguous and 1.00 zig-zag.
# The CPU's own time per block (a few ms, but up to tens of ms on a loaded machine) adds noise to both.
# (blue and green: block computations, red: K/V hops, each from posting to completion, so a red bar under a green
# one is a transfer hidden behind compute.)

# %%
def measured_window(trace, rank):
    return [e for e in trace.select("mark", rank=rank, name="measured")][-1].start

UNIT_S = 0.250                                                  # a device's time for one (s/c)^2 block pair
device = {zigzag: dl.launch(ring_forward, world_size=N, args=(SEQ, zigzag, HEADS, HEAD_DIM, UNIT_S / (SEQ // N) ** 2),
                            output="quiet") for zigzag in (False, True)}
fig, axes = plt.subplots(2, 1, figsize=(10, 4.8), sharex=True)
for ax, zigzag in zip(axes, (False, True)):
    trace = device[zigzag].trace
    for r in range(N):
        t0, y = measured_window(trace, r), N - 1 - r          # each rank on its own clock, from the barrier
        for e in trace.spans(rank=r):
            if e.start >= t0:
                ax.barh(y + 0.15, e.duration * 1e3, left=(e.start - t0) * 1e3, height=0.4,
                        color="C0" if "diagonal" in e.name else "C2")
        for e in trace.comms(rank=r, op="ring_shift"):
            if e.start >= t0:
                ax.barh(y - 0.22, e.duration * 1e3, left=(e.start - t0) * 1e3, height=0.2, color="C3",
                        edgecolor="white", lw=0.5)
    ax.set_yticks(range(N), [f"rank {r}" for r in reversed(range(N))])
    ax.set_title(f"ring attention forward, c = {N}, causal, {'zig-zag' if zigzag else 'contiguous'}: wall clock, "
                 f"{UNIT_S * 1e3:.0f} ms of device time per (s/c)^2 pair", fontsize=10)
axes[-1].set_xlabel("ms since the barrier")
axes[0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("C0", "C2", "C3")],
               labels=["block pair on the diagonal", "block pair, full", "K/V hop in flight"], fontsize=8,
               loc="upper right")
fig.tight_layout()
plt.show()

# %% tags=["nbval-ignore-output"]
wall, spread = {}, {}
for zigzag, run in device.items():
    busy, ends = [], []
    for r in range(N):
        start = measured_window(run.trace, r)
        spans = [e for e in run.trace.spans(rank=r) if e.start >= start]
        busy.append(sum(e.duration for e in spans))
        ends.append(max(e.end for e in spans) - start)
    wall[zigzag], spread[zigzag] = max(ends), max(busy) * N / sum(busy)
    print(f"{'zig-zag   ' if zigzag else 'contiguous'} busy per rank (ms): " + "  ".join(f"{b * 1e3:5.0f}" for b in busy)
          + f"   slowest / mean {spread[zigzag]:.2f};  forward {wall[zigzag] * 1e3:.0f} ms")
print(f"contiguous / zig-zag wall clock: {wall[False] / wall[True]:.2f} (predicted 1.78)")
assert spread[False] >= 1.4 and spread[True] <= 1.2                  # the imbalance, in time: 1.60 against 1.00
assert 1.45 <= wall[False] / wall[True] <= 2.1                          # and the forward it costs: 1.78

# %% [markdown]
# The time follows the FLOPs once a block pair costs what it would on a device: in the contiguous run rank 3
# computes four pairs of s/4 while rank 0 computes one and then waits in its hops; in the zig-zag run every rank
# computes nine pairs of s/8, and the forward takes about 9/4 units instead of 4. (The printed numbers change from
# run to run; the cell asserts the wall-clock ratio within [1.45, 2.1] and the spreads at least 1.4 and at most 1.2,
# which a zig-zag that left the imbalance in place would miss: its forward would take as long as the contiguous
# one, a ratio of 1, and its spread would be 1.60.) Without the device time,
# CPU timings of 1 ms blocks on 2 shared cores are uneven in both layouts; the exact evidence stays the FLOP count.

# %% [markdown]
# ## 4. Ulysses: two all-to-alls
#
# Attention mixes tokens but never heads. Ulysses swaps which axis is split: an **all-to-all** sends head group j
# of every rank's s/c tokens to rank j, so rank j holds H/c heads over the **whole** sequence; it runs ordinary
# attention (causal or not, no communication); a second all-to-all swaps back:
#
#     (B, H, s/c, D)  --all-to-all-->  (B, H/c, s, D)  --attention-->  (B, H/c, s, D)  --all-to-all-->  (B, H, s/c, D)
#
# The all-to-all ([all_to_all.py](../distlab/comm/all_to_all.py)) is c − 1 steps of pairwise exchange: at step
# t rank r sends its block for rank r + t and receives from rank r − t (all steps posted at once, then completed in
# step order, so no step waits for the previous one's round trip). The first one carries q, k and v together (3 tensors), the second the
# output (1 tensor). We trace one forward on 4 ranks and tabulate, for each all-to-all, the bytes rank i sent to
# rank j.

# %%
def ulysses_forward(seq, heads=8, head_dim=4):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    mine = [dl.cp.split(t, dim=2, zigzag=False) for t in (q, k, v)]         # (1, 8, seq/4, 4)
    dl.cp.ulysses_attention(*mine, causal=True)

SEQ_U = 64
u_run = dl.launch(ulysses_forward, world_size=N, args=(SEQ_U,), output="quiet")
calls = sorted({e.args["call"] for e in u_run.trace.comms(rank=0, op="all_to_all")})
print("all-to-all calls per rank in one forward:", len(calls))
assert len(calls) == 2
matrices = []
for which in range(2):
    m = torch.zeros(N, N, dtype=torch.long)
    for r in range(N):
        mine = sorted({e.args["call"] for e in u_run.trace.comms(rank=r, op="all_to_all")})[which]
        for e in u_run.trace.comms(rank=r, op="all_to_all", call=mine):
            m[r, e.args["peer"]] += e.sent
    matrices.append(m)
block = 4 * 1 * (8 // N) * (SEQ_U // N) * 4                    # one tensor's block: (1, H/c, s/c, D) fp32
for name, m, tensors in zip(("q, k, v", "output"), matrices, (3, 1)):
    print(f"all-to-all of {name}: bytes rank i -> rank j\n{m.numpy()}")
    assert torch.equal(m, (torch.ones(N, N, dtype=torch.long) - torch.eye(N, dtype=torch.long)) * tensors * block)

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
for ax, m, name in zip(axes, matrices, ("1st all-to-all: q, k, v", "2nd all-to-all: output")):
    ax.imshow(m.numpy(), cmap="Blues", vmin=0, vmax=int(matrices[0].max()))
    for i in range(N):
        for j in range(N):
            ax.text(j, i, f"{int(m[i, j])}", ha="center", va="center", fontsize=8)
    ax.set(title=name, xlabel="to rank", ylabel="from rank", xticks=range(N), yticks=range(N))
fig.suptitle("Ulysses on 4 ranks: bytes sent, measured from the trace (the diagonal stays home)", fontsize=10)
fig.tight_layout()
plt.show()


# %% [markdown]
# ## 5. Bytes per rank: ring vs Ulysses, measured beside the formulas
#
# Per layer, forward and backward, each rank sends (`dl.theory.cp_bytes_per_layer`; b micro-batch, h = H·D, e bytes
# per element):
#
# * **ring**: K and V (2·b·s·h/c elements) hop c − 1 times forward; backward K/V again c − 1 times and dK/dV c
#   times (they travel with their block and need one last hop home): 2bsh·(c−1)/c·e forward, the same plus
#   2bsh·e backward. Roughly 2bsh whatever c: it grows with s.
# * **Ulysses**: (c − 1)/c of q, k, v and of the output, each b·s·h/c: 4bsh·(c−1)/c²·e forward, the same backward.
#   When s and c grow together it stays constant; the price is that c must divide the number of heads.
#
# We measure forward plus backward on 2 and 4 ranks with s = 32·c (the sequence grows with the ranks, as when
# CP is used to reach longer contexts), and assert exact equality.

# %%
def both_directions(seq, heads=4, head_dim=8):
    torch.manual_seed(0)
    for attention in (dl.cp.ring_attention, dl.cp.ulysses_attention):
        q, k, v = (dl.cp.split(torch.randn(1, heads, seq, head_dim), dim=2).requires_grad_() for _ in range(3))
        attention(q, k, v, causal=True, zigzag=True).sum().backward()

measured, predicted = {}, {}
for n in (2, 4):
    seq = 32 * n
    run = dl.launch(both_directions, world_size=n, args=(seq,), output="quiet")
    for op, att in (("ring_shift", "ring"), ("all_to_all", "ulysses")):
        want = dl.theory.cp_bytes_per_layer(att, seq, 1, 4 * 8, n, bytes_per_element=4, heads=4)["total"]
        got = {run.trace.bytes_sent(rank=r, op=op) for r in range(n)}
        print(f"c={n}, s={seq:3}: {att:8} bytes sent per rank, measured {sorted(got)}, predicted {want:.0f}")
        assert got == {want}
        measured[att, n], predicted[att, n] = got.pop(), want
for att in ("ring", "ulysses"):
    print(f"{att:8} c=4, s=128 over c=2, s=64: measured x{measured[att, 4] / measured[att, 2]:.2f}, "
          f"predicted x{predicted[att, 4] / predicted[att, 2]:.2f}")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.2))
labels = [f"{att}\nc={n}, s={32 * n}" for att in ("ring", "ulysses") for n in (2, 4)]
keys = [(att, n) for att in ("ring", "ulysses") for n in (2, 4)]
xs = range(len(keys))
ax.bar([x - 0.2 for x in xs], [predicted[k] / 1024 for k in keys], 0.4, label="predicted (dl.theory)")
ax.bar([x + 0.2 for x in xs], [measured[k] / 1024 for k in keys], 0.4, label="measured (trace)")
ax.set_xticks(list(xs), labels, fontsize=8)
ax.set(ylabel="KiB sent per rank per layer", title="forward + backward, s = 32 c, 4 heads x 8, fp32")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()


# %% [markdown]
# Doubling c and s together multiplies what each ring rank sends by 2.5 here: the bsh volume doubles with s, and
# (c−1)/c grows from 1/2 to 3/4 in the forward and the K/V part of the backward. Ulysses' bytes grow only by that
# (c−1)/c factor (×1.5), and not at all once c is large: per layer they are ~4bsh·e/c, constant when s/c is.
# Ring attention's advantage is elsewhere: its transfers overlap compute (section 2),
# its degree is not limited by the number of heads, and it composes with Ulysses (ring across nodes, Ulysses
# within one, as in USP, Fang & Zhao 2024).
#
# ## 6. Exact: equal to attention on the gathered sequence
#
# Both are exact rearrangements of the same sums, so they must match plain attention on the whole sequence,
# forward and backward, up to fp32 rounding. Every rank draws the full q, k, v, computes the reference with
# `F.scaled_dot_product_attention` in float64, and compares its own rows and gradients (tolerance 1e-5,
# the observed error is ~1e-7).

# %%
def compare(seq=48, heads=12, head_dim=4):                  # heads divisible by 2, 3, 4 (Ulysses)
    torch.manual_seed(1)
    q, k, v, w = (torch.randn(1, heads, seq, head_dim, dtype=torch.float64) for _ in range(4))
    errors = {}
    for causal in (True, False):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, is_causal=causal)
        (want * w).sum().backward()
        for name, fn, zigzag in (("ring", dl.cp.ring_attention, True), ("ulysses", dl.cp.ulysses_attention, False)):
            mine = [dl.cp.split(t.float(), dim=2, zigzag=zigzag).requires_grad_() for t in (q, k, v)]
            out = fn(*mine, causal=causal, zigzag=zigzag)
            (out * dl.cp.split(w.float(), dim=2, zigzag=zigzag)).sum().backward()
            pairs = [(out, want)] + [(m.grad, f.grad) for m, f in zip(mine, full)]
            errors[name, causal] = max((a - dl.cp.split(b.float(), dim=2, zigzag=zigzag)).abs().max().item()
                                       for a, b in pairs)
    return errors

for n in (2, 3, 4):
    worst = {key: max(r[key] for r in dl.launch(compare, world_size=n, output="quiet").results)
             for key in (("ring", True), ("ring", False), ("ulysses", True), ("ulysses", False))}
    print(f"c={n}: largest |difference| in output, dq, dk, dv over all ranks:",
          ", ".join(f"{att} causal={c}: {'< 1e-5' if e < 1e-5 else f'{e:.1e}'}" for (att, c), e in worst.items()))
    assert max(worst.values()) < 1e-5

# %% [markdown]
# And a whole GPT: `dl.train(strategy="cp-ring")` on 2 ranks (zig-zag) and `cp-ulysses` on 2 ranks take the same
# steps as one process on the same batches: same losses, same final parameters.

# %%
TRAIN = dict(model="gpt-tiny", steps=3, seed=0, optimizer="sgd", lr=0.1, global_batch=8)
single = dl.train("single", **TRAIN)
for strategy in ("cp-ring", "cp-ulysses"):
    report = dl.train(strategy, world_size=2, **TRAIN)
    diff = sum((report.params[k] - v).pow(2).sum() for k, v in single.params.items())
    rel = (diff / sum(v.pow(2).sum() for v in single.params.values())).sqrt().item()
    print(f"{strategy:10}: losses {' '.join(f'{l:.4f}' for l in report.losses)}   single: "
          f"{' '.join(f'{l:.4f}' for l in single.losses)}   final parameters, relative difference "
          + ("< 1e-5" if rel < 1e-5 else f"{rel:.1e}"))
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(report.losses, single.losses)) and rel < 1e-5

# %% [markdown]
# ## What to remember
#
# * Only attention mixes tokens, so only attention talks: CP splits the sequence and every other layer runs on
#   s/c tokens unchanged. Activation memory per rank drops by c, and with blockwise attention the s² term is gone.
# * **Ring attention**: K/V blocks round a ring, c steps, partial softmaxes merged exactly by log-sum-exp; the next
#   block's transfer is posted before the current block's compute. Per rank ~2bsh·e per layer forward, whatever c.
# * **Causal imbalance**: with a contiguous split the last rank does c times the first's work (counted above);
#   **zig-zag** (chunks r and 2c−1−r) gives every rank 2c + 1 equal half-size blocks.
# * **Ulysses**: all-to-all to a head split, local attention, all-to-all back; 4bsh·(c−1)/c²·e per layer forward,
#   constant as s and c grow together; c must divide the heads.
# * Both are exact: equal to attention on the gathered sequence, forward and backward, and `dl.train` with CP
#   equals single-process training.
#
# **Try it**: in section 3 set `N = 3` (and `SEQ = 480`, divisible by 2 × 3): how much more work does the last rank
# do without zig-zag? In section 5, replace `seq = 32 * n` by `seq = 128` (fixed s) and compare the two attentions
# again.

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
# **all_to_all**: all_to_all(t, send_counts, recv_counts) -> the rows received from every rank, in rank order; rank r sends the j-th block of send_counts[j] rows of t to rank j

# %% nbgrader={"grade": false, "grade_id": "all_to_all", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def all_to_all(t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rank r sends its rows ``t[offset_j : offset_j + send_counts[j]]`` to rank j and returns the rows
    it receives, ``recv_counts[j]`` from rank j, concatenated in rank order (pairwise exchange: in step
    s it sends to (r + s) mod N and receives from (r - s) mod N)."""
    ### BEGIN SOLUTION
    n, r = dist.get_world_size(), dist.get_rank()
    blocks = list(torch.split(t, send_counts))
    out = [torch.empty((c, *t.shape[1:]), dtype=t.dtype) for c in recv_counts]
    out[r] = blocks[r].clone()
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        requests = [dist.isend(blocks[to].contiguous(), to), dist.irecv(out[frm], frm)]
        for request in requests:
            request.wait()
    return torch.cat(out)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_all_to_all", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("all_to_all", all_to_all).require();


# %% [markdown]
# **merge_attention**: merge_attention(out1, lse1, out2, lse2) -> (out, lse): attention over two key blocks from each block's output and log-sum-exp of its scores

# %% nbgrader={"grade": false, "grade_id": "merge_attention", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def merge_attention(out1, lse1, out2, lse2):
    """The attention over keys K1 + K2 from the attentions over each: lse = log(e^lse1 + e^lse2) and
    out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2 (Milakov & Gimelshein 2018; ring attention's step)."""
    ### BEGIN SOLUTION
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2, lse
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_merge_attention", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("merge_attention", merge_attention).require();
