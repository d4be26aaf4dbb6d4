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
# # 04 · Tensor parallelism and sequence parallelism
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# Data parallelism copies the model; **tensor parallelism (TP)** cuts every big matrix into t pieces, one per rank,
# so a model too large for one GPU fits on t of them (Shoeybi et al. 2019, *Megatron-LM*). The ranks then have to
# talk *inside* every layer, which is why TP lives within a node, on the fastest links.
#
# In this lesson you will
#
# 1. see how a linear layer is split (by output features, by input features) and check it against `nn.Linear`;
# 2. turn a whole GPT into its TP form with `dl.tp.parallelize` and get the same loss and gradients;
# 3. **predict** the communication per layer (two all-reduces of b·s·h forward, two backward) and **measure** the
#    calls (how many, of what size, where); their bytes per rank are *modelled* as a ring's (gloo does not say what
#    it puts on the wire);
# 4. add **sequence parallelism (SP)** (Korthikanti et al. 2022) and measure how it cuts activation memory by t;
# 5. train with `tp` and match single-process training;
# 6. split a model you wrote yourself with a **plan** (`dl.tp.parallelize(model, plan={...})`).
#
# The code, read in this order ([distlab/parallel/tensor/__init__.py](../distlab/parallel/tensor/__init__.py)):
# [regions.py](../distlab/parallel/tensor/regions.py) (Megatron's *f* and *g* and the sequence-parallel pair,
# the only places TP talks), [linear.py](../distlab/parallel/tensor/linear.py) (column- and row-parallel
# linears), [layers.py](../distlab/parallel/tensor/layers.py) (attention and MLP),
# [vocab.py](../distlab/parallel/tensor/vocab.py) (embedding and cross-entropy) and
# [gpt.py](../distlab/parallel/tensor/gpt.py) (`parallelize`), then [plan.py](../distlab/parallel/tensor/plan.py)
# (`parallelize(model, plan=...)` for any model). The layers carry no trace labels: every
# collective is recorded by [distlab/parallel/collectives.py](../distlab/parallel/collectives.py), and we
# name the modules from outside with `label_modules` ([labels.py](../distlab/parallel/labels.py)).

# %%
import torch
import torch.nn as nn
import matplotlib.pyplot as plt
import distlab as dl
from distlab.models import GPT, GPTConfig, MarkovTokens
from distlab.memory import measure_layer
from distlab.parallel import labels
from distlab.theory.activations import predicted_layer_bytes, unmodelled_bytes

CFG = GPTConfig(vocab=64, seq_len=32, d_model=64, heads=4, layers=2)   # the "gpt-tiny" preset
B, S, H, A, L = 8, CFG.seq_len, CFG.d_model, CFG.heads, CFG.layers


# %% [markdown]
# ## 1. Two ways to split  Y = X Wᵀ
#
# `nn.Linear(in, out)` stores W as (out, in). Over t ranks:
#
# * **ColumnParallelLinear** keeps a block of W's **rows** = output features. Every rank needs the whole X and
#   produces a slice of Y's features. No sum needed.
# * **RowParallelLinear** keeps a block of W's **columns** = input features. Every rank needs only its slice of
#   X's features and produces a *partial* Y; the ranks **sum** them (an all-reduce).
#
# Put a column layer first and a row layer second (attention: q, k, v then proj; MLP: fc then proj) and the
# column layer's output slice is exactly the row layer's input slice: **no communication in between**. The whole
# region costs one all-reduce forward (Megatron's *g*) and, by symmetry, one backward (*f*, for dL/dX).
# The drawing shows the blocks each of t = 4 ranks holds:

# %%
def draw_split(ax, title, rows, cols, by):
    colors = plt.cm.tab10.colors
    t = 4
    for r in range(t):
        if by == "rows":
            ax.add_patch(plt.Rectangle((0, rows - (r + 1) * rows / t), cols, rows / t, color=colors[r], alpha=0.7))
        else:
            ax.add_patch(plt.Rectangle((r * cols / t, 0), cols / t, rows, color=colors[r], alpha=0.7))
        x, y = ((cols / 2, rows - (r + .5) * rows / t) if by == "rows" else ((r + .5) * cols / t, rows / 2))
        ax.text(x, y, f"rank {r}", ha="center", va="center", fontsize=9)
    ax.set_xlim(0, cols); ax.set_ylim(0, rows); ax.set_aspect("equal")
    ax.set_xlabel("in features"); ax.set_ylabel("out features"); ax.set_title(title, fontsize=10)
    ax.set_xticks([]); ax.set_yticks([])

fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
draw_split(axes[0], "ColumnParallelLinear: W (4h x h)\nrows = output features split", 4 * H, H, "rows")
draw_split(axes[1], "RowParallelLinear: W (h x 4h)\ncolumns = input features split", H, 4 * H, "cols")
fig.suptitle("MLP  h -> 4h -> h  over t = 4 ranks: each colour is one rank's .weight")
fig.tight_layout()
plt.show()


# %% [markdown]
# Check it on real layers: on each of 4 ranks, the column layer's output must equal the matching slice of the
# full layer's output, and the row layer (after its all-reduce) must equal the full output; the weight gradients
# must equal the matching slices of the full gradient.

# %%
def check_layers():
    n, r = dl.world_size(), dl.rank()
    torch.manual_seed(0)
    fc, proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)      # the full layers, identical on every rank
    x = torch.randn(B, S, H)
    col, row = dl.tp.ColumnParallelLinear.from_linear(fc), dl.tp.RowParallelLinear.from_linear(proj)
    mine = slice(r * 4 * H // n, (r + 1) * 4 * H // n)
    hidden = col(x)            # (B, S, 4H/n): my slice of the hidden features, no communication
    out = row(hidden)          # my partial product, summed over ranks by the all-reduce g
    return (tuple(col.weight.shape), tuple(row.weight.shape),
            torch.allclose(hidden, fc(x)[..., mine], atol=1e-6), torch.allclose(out, proj(fc(x)), atol=1e-5))

for r, (cw, rw, col_ok, row_ok) in enumerate(dl.launch(check_layers, world_size=4).results):
    print(f"rank {r}: column .weight {cw}, row .weight {rw}; column output == slice of nn.Linear: {col_ok}; "
          f"column -> row == full: {row_ok}")
    assert cw == (4 * H // 4, H) and rw == (H, 4 * H // 4) and col_ok and row_ok


# %% [markdown]
# (`tests/test_tensor_parallel.py` checks outputs *and* gradients of both layers against `nn.Linear` at 2, 3 and 4 ranks.)
#
# ## 2. A whole GPT, sharded
#
# `dl.tp.parallelize(gpt)` replaces, from the full weights, each block's attention (q, k, v column-parallel: the
# **heads** are split, a/t per rank; proj row-parallel), each MLP (fc column, proj row), the token embedding
# (**vocabulary-parallel**: each rank owns V/t rows, looks up the ids it owns, the ranks sum) and the LM head
# (column-parallel over the vocabulary). The loss is a **vocabulary-parallel cross-entropy**: each rank holds
# logits for V/t tokens only; three all-reduces of b·s numbers (the max, the sum of exponentials, the target
# logit) give the exact loss without ever gathering the b·s·V logits.

# %%
def compare_with_full(sequence_parallel):
    torch.manual_seed(0); full = GPT(CFG)
    torch.manual_seed(0); tp = dl.tp.parallelize(GPT(CFG), sequence_parallel=sequence_parallel)
    ids, targets = MarkovTokens(CFG.vocab, CFG.seq_len).batch(0, B)
    ref, loss = full.loss(ids, targets), tp.loss(ids, targets)
    ref.backward(); loss.backward()
    grads = dl.tp.full_grads(tp)          # gather the shards back to full size
    worst = max(((grads[n] - p.grad).norm() / p.grad.norm()).item()
                for n, p in full.named_parameters() if not n.endswith("k.bias"))   # k.bias: true grad is 0
    mine = sum(p.numel() for p in tp.parameters())
    return ref.item(), loss.item(), worst, mine, sum(p.numel() for p in full.parameters())

for sp in (False, True):
    ref, loss, worst, mine, total = dl.launch(compare_with_full, world_size=4, args=(sp,)).results[0]
    print(f"SP={sp!s:5}  full loss {ref:.4f}  TP loss {loss:.4f}  worst grad error {'<1e-5' if worst < 1e-5 else worst}"
          f"  params on rank 0: {mine} of {total}")
    assert abs(loss - ref) < 1e-5 * ref and worst < 1e-5


# %% [markdown]
# Rank 0 holds about a quarter of the weights: the attention, MLP, embedding and head matrices are split; the
# LayerNorms and position embeddings (small) are replicated.
#
# ## 3. Communication per layer: predicted, then measured (calls) and modelled (bytes)
#
# Each layer has two TP regions (attention, MLP). Forward, each ends with *g*: an **all-reduce of the b·s·h
# activations**. Backward, each begins (in reverse) with *f*: an all-reduce of dL/dX, also b·s·h. So per layer
# **2 all-reduces forward + 2 backward**, each of b·s·h elements. A ring all-reduce sends 2(t-1)/t of the message
# per rank, so per step (`dl.theory.tp_volume`):
#
#   bytes sent per rank = 4 · L · 2(t-1)/t · b·s·h · bytes per element
#
# Every collective records its op, message size and bytes in the trace. The op and the message size are measured:
# they are the call torch actually received. The bytes are not: torch's gloo all-reduce does not report what it
# sends, so the wrapper records the bytes a ring moves for a message of that size (`bytes="ring-model"`; distlab's
# own ring, built from send/recv, sends exactly these, `tests/test_comm.py`). The printout calls them "recorded
# (ring model)", and an equality of those with `tp_volume` checks only the number and size of the calls. So the
# bytes are then **measured** another way: `dl.comm.replay` re-runs every recorded call, same op and same size, on
# distlab's own ring (send/recv, every byte counted where it is sent) on T ranks, and that count must equal
# `tp_volume`: a wrong constant in the formula, or a ring that moved other bytes, fails it. The trace also carries two tags the wrapper finds out by
# itself: `operator`, the function that called it (`ReduceFromRegion.forward` is *g*, `CopyToRegion.backward` is
# *f*), and `phase="backward"` when autograd's engine is running. Which layer? `labels.label_modules(gpt)`
# puts hooks on every submodule (from outside the model): forward hooks open a `scope(where=<module name>)`, and
# write the name into the autograd nodes the module creates, which the backward collectives read. Let's compare.

# %%
def one_step(sequence_parallel):
    torch.manual_seed(0)
    gpt = dl.tp.parallelize(GPT(CFG), sequence_parallel=sequence_parallel)
    labels.label_modules(gpt)              # where=<module name> on each collective, by hooks
    ids, targets = MarkovTokens(CFG.vocab, CFG.seq_len).batch(0, B)
    dl.tracer().clear()
    gpt.loss(ids, targets).backward()

def inside(event, module):          # the event ran in `module` or one of its submodules
    where = event.args.get("where", "")
    return where == module or where.startswith(module + ".")

T = 4
tp_trace = dl.launch(one_step, world_size=T, args=(False,)).trace
message = B * S * H * 4                                   # fp32 activations: 4 bytes each
print(f"predicted per layer: 2 x all_reduce({message} B) forward, 2 x all_reduce({message} B) backward")
for i in range(L):
    for phase in ("forward", "backward"):
        ev = [e for e in tp_trace.comms(rank=0) if inside(e, f"blocks.{i}") and e.args.get("phase") == phase]
        print(f"measured  layer {i} {phase:8}: " + ", ".join(
            f"{e.name}({e.args['size']} B) by {e.args['operator']} in {e.args['where']}" for e in ev))
        assert [(e.name, e.args["size"]) for e in ev] == [("all_reduce", message)] * 2
predicted = dl.theory.tp_volume(S, B, H, T, layers=L, bytes_per_element=4)
measured = sum(e.sent for e in tp_trace.comms(rank=0) if inside(e, "blocks"))
def replayed(trace, where="blocks"):  # rank 0's calls inside `where`, re-run on distlab's ring: bytes counted at send
    calls = [(e.name, e.args["size"]) for e in trace.comms(rank=0) if inside(e, where)]
    return dl.launch(dl.comm.replay, world_size=T, args=(calls,)).results[0]

on_wire = replayed(tp_trace)
print(f"bytes sent by rank 0 inside the layers: predicted {predicted:.0f}, recorded (ring model) {measured}, "
      f"measured (the calls replayed on distlab's ring) {on_wire}")
assert measured == predicted                  # the number and size of the calls
assert on_wire == predicted                   # the bytes: counted at each send, independent of the formula

# %% [markdown]
# Outside the layers the trace also shows the embedding's *g* (one all-reduce forward), the head's *f* (one
# backward) and the three small all-reduces of the vocabulary-parallel loss (b·s numbers each).
#
# ## 4. Sequence parallelism
#
# Between the TP regions sit LayerNorms, residual adds and dropouts. Plain TP runs them **replicated**: every
# rank stores the same b·s·h activations for them. Korthikanti et al. noticed these ops are independent along
# the sequence, so each rank can keep just **s/t of the tokens** there. The conjugate operators change:
#
#     plain TP:   ...replicated... ─f─> [column ... row] ─g (all-reduce)─> ...replicated...
#     TP + SP:    ...seq shard...  ─g (all-gather along s)─> [column ... row] ─ḡ (reduce-scatter along s)─> ...seq shard...
#
# An all-reduce *is* a reduce-scatter followed by an all-gather, so the conjugates move the same bytes as the
# all-reduces they replace; what changes is memory. Not quite the same bytes in all, though: distlab keeps only the sequence shard of each region's input for the backward and all-gathers it
# again there, as Megatron does: one extra all-gather per region in the backward of `GatheredLinears`, the
# *g* fused with the column linears in [linear.py](../distlab/parallel/tensor/linear.py). That re-gather is
# (t-1)/t·bsh per region, against 2·2(t-1)/t·bsh for the region's two all-reduces: **+25%** of plain TP's bytes,
# the price of not storing the gathered input. LayerNorm weights and the row bias, now applied to different tokens
# on each rank, get their gradients all-reduced by a gradient hook, `sync_replicated_grad`: h numbers each.

# %%
sp_trace = dl.launch(one_step, world_size=T, args=(True,)).trace
for phase in ("forward", "backward"):
    ev = [e for e in sp_trace.comms(rank=0) if inside(e, "blocks.0.attn") and e.args.get("phase") == phase]
    print(f"layer 0 attention {phase:8}: "
          + ", ".join(f"{e.name}[{e.args['operator']}]({e.args['size']} B)" for e in ev))

def operator(e):                    # the lesson's name for the operator behind a recorded collective
    by = e.args["operator"]
    if by.startswith("GatheredLinears"):
        return "SP regather" if (e.name, by) == ("all_gather", "GatheredLinears.backward") else "SP g"
    if by.startswith("ReduceScatterToSequence"):
        return "SP g-bar"
    return {"CopyToRegion.backward": "f", "ReduceFromRegion.forward": "g",
            "sync_replicated_grad.sum_over_group": "grad sum"}[by]

def layer_bytes(trace, operators):
    return sum(e.sent for e in trace.comms(rank=0) if inside(e, "blocks") and operator(e) in operators)

tp_bytes = layer_bytes(tp_trace, ("f", "g"))
sp_bytes = layer_bytes(sp_trace, ("SP g", "SP g-bar"))
regather = layer_bytes(sp_trace, ("SP regather",))
sp_wire = replayed(sp_trace)                            # every SP call in the layers, bytes counted at send
print(f"TP all-reduces: {tp_bytes} B   SP all-gathers + reduce-scatters: {sp_bytes} B   (+ re-gathers {regather} B)"
      f"; SP measured on distlab's ring: {sp_wire} B")
assert sp_bytes == tp_bytes == predicted                # the calls: as many, as large
assert regather == 2 * L * (T - 1) * message // T      # one all-gather of b*s*h per region, backward
assert sp_wire == sp_bytes + regather + layer_bytes(sp_trace, ("grad sum",))   # the bytes, counted
assert 4 * regather == tp_bytes                         # +25% over plain TP, in exchange for memory
print(f"SP in all: {(sp_bytes + regather) / tp_bytes:.2f} x plain TP's bytes")

# %%
ops = ["f", "g", "SP g", "SP g-bar", "SP regather", "grad sum"]
fig, ax = plt.subplots(figsize=(8, 3.2))
for k, (name, trace) in enumerate([("TP", tp_trace), ("TP + SP", sp_trace)]):
    left = 0
    for j, op in enumerate(ops):
        v = layer_bytes(trace, (op,)) / 1e3
        if v:
            ax.barh(k, v, left=left, color=plt.cm.tab10.colors[j], label=op if k or op in ("f", "g") else None)
            left += v
ax.axvline(predicted / 1e3, color="k", ls="--", label="predicted 4L·2(t-1)/t·bsh")
ax.set_yticks([0, 1], ["TP", "TP + SP"]); ax.set_xlabel("kB sent by rank 0 inside the layers, one step")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1)); fig.tight_layout()
plt.show()


# %% [markdown]
# ## 5. Activation memory with and without SP
#
# Korthikanti et al. count the bytes one layer keeps for the backward (16-bit activations, 1-byte dropout masks):
#
# * no parallelism: **s·b·h·(34 + 5·a·s/h)**
# * TP: **s·b·h·(10 + 24/t + 5·a·s/(h·t))**: the 10 are the replicated LayerNorm/dropout/linear inputs
# * TP + SP: **s·b·h·(34 + 5·a·s/h) / t**: everything is split
#
# Our tiny GPT has **no dropout** and runs in **fp32**, so we drop the dropout terms (two residual masks 2sbh,
# the attention-dropout mask a·s²·b and its output 2a·s²·b) and double the rest. That leaves
# sbh(16 + as/h) elements, TP: sbh(4 + 12/t + as/(ht)), TP+SP: sbh(16 + as/h)/t, times 4 bytes.
# We measure with **saved-tensor hooks** (`measure_layer` in [distlab/memory.py](../distlab/memory.py)): every
# tensor autograd keeps for the backward of one block, each storage counted once, parameters excluded. The
# prediction is `predicted_layer_bytes` in [distlab/theory/activations.py](../distlab/theory/activations.py).

# %%
def layer_memory(sequence_parallel):
    torch.manual_seed(0)
    gpt = dl.tp.parallelize(GPT(CFG), sequence_parallel=sequence_parallel)
    t = dl.world_size()
    x = torch.randn(B, S // t if sequence_parallel and t > 1 else S, H)
    return measure_layer(gpt.blocks[0], x)

rows = []
for t in (1, 2, 4):
    for sp in ((False,) if t == 1 else (False, True)):
        measured = dl.launch(layer_memory, world_size=t, args=(sp,)).results[0]
        predicted_b = predicted_layer_bytes(S, B, H, A, tp=t, sp=sp)
        rows.append((f"t={t}" + (" +SP" if sp else ""), predicted_b, measured))
        extra = unmodelled_bytes(S, B, t, sp)
        print(f"{rows[-1][0]:8} predicted {predicted_b / 1024:7.1f} KiB   measured {measured / 1024:7.1f} KiB"
              f"   difference {measured - predicted_b:.0f} B = LayerNorm stats + causal mask ({extra} B)")
        assert abs(measured - predicted_b) <= 0.02 * predicted_b
        assert measured - predicted_b == extra

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
xs = range(len(rows))
ax.bar([x - 0.2 for x in xs], [p / 1024 for _, p, _ in rows], 0.4, label="predicted (Korthikanti, no dropout, fp32)")
ax.bar([x + 0.2 for x in xs], [m / 1024 for _, _, m in rows], 0.4, label="measured (saved-tensor hooks)")
ax.set_xticks(list(xs), [n for n, _, _ in rows]); ax.set_ylabel("KiB per layer per rank")
ax.set_title(f"Activation memory of one layer, b={B}, s={S}, h={H}, a={A}"); ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# What to look at: plain TP stops shrinking, because the LayerNorm and linear inputs (4·sbh elements) stay
# replicated whatever t is; with SP every bar is the t = 1 bar divided by t. At real sizes the 5as/h attention
# term dominates (a = 96, s = 2048, h = 12288 gives 80 vs 34), which is why selective recomputation of attention
# is the other half of Korthikanti's paper.
#
# Both kinds of recomputation are options of `dl.train` (`recompute="selective"` or `True`). Selective keeps
# everything but the attention scores (the a·s²·b terms, and our causal mask) and recomputes those in backward;
# full keeps only the block's input, s·b·h elements. Prediction: `predicted_layer_bytes(recompute=...)`; the
# measurement uses the same hooks, the blocks set as `dl.train` sets them.

# %%
def recomputed_layer_memory(sequence_parallel, recompute):
    torch.manual_seed(0)
    gpt = GPT(CFG)
    for block in gpt.blocks:
        block.recompute, block.attn.selective = recompute == "full", recompute == "selective"
    gpt = dl.tp.parallelize(gpt, sequence_parallel=sequence_parallel)
    t = dl.world_size()
    x = torch.randn(B, S // t if sequence_parallel and t > 1 else S, H)
    return measure_layer(gpt.blocks[0], x)

for t, sp in ((1, False), (2, True)):
    for recompute in ("selective", "full"):
        measured = dl.launch(recomputed_layer_memory, world_size=t, args=(sp, recompute)).results[0]
        predicted_b = predicted_layer_bytes(S, B, H, A, tp=t, sp=sp, recompute=recompute)
        extra = unmodelled_bytes(S, B, t, sp, recompute=recompute)
        print(f"t={t}{' +SP' if sp else '':4} {recompute:9}  predicted {predicted_b / 1024:6.1f} KiB   measured "
              f"{measured / 1024:6.1f} KiB   (LayerNorm stats {extra} B)")
        assert measured == predicted_b + extra

# %% [markdown]
# ## 6. Training with TP matches single-process training
#
# `dl.train(strategy="tp")` runs every rank on the **whole** global batch (TP splits the model, not the data) and
# an ordinary optimizer on each rank's shards. The losses must match the single-process run to fp32 rounding.

# %%
single = dl.train("single", model="gpt-tiny", steps=10, seed=0)
tp = dl.train("tp", world_size=2, model="gpt-tiny", steps=10, seed=0)
tp_sp = dl.train("tp-sp", world_size=4, model="gpt-tiny", steps=10, seed=0)
for name, rep in [("single", single), ("tp x2", tp), ("tp-sp x4", tp_sp)]:
    print(f"{name:9} losses " + " ".join(f"{l:.4f}" for l in rep.losses))
for rep in (tp, tp_sp):
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(rep.losses, single.losses))

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(single.losses, "k-", lw=3, alpha=0.4, label="single")
ax.plot(tp.losses, "o--", label="tp, t=2")
ax.plot(tp_sp.losses, "x:", label="tp-sp, t=4")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(); fig.tight_layout()
plt.show()

# %% [markdown]
# ## 7. Your own model: a plan
#
# `dl.tp.parallelize(gpt)` knows distlab's GPT. For a model you wrote yourself, give it a **plan**, as torch's
# `parallelize_module` takes one: module names (a `*` stands for one name part) mapped to a style, `"colwise"`,
# `"rowwise"`, `"embedding"`, `"colwise_gather"` (split, then gather the outputs back) or `dl.tp.Colwise(packed=3)`
# for a fused q|k|v matrix (a plain `"colwise"` would give rank 0 all of q and half of k). The plan swaps the layers,
# not the arithmetic around them: the block below reads its head count from the tensor (`view(b, s, -1, d)`), so
# on each rank it attends over its own a/t heads. Nothing else changes, and the communication is the same
# Megatron pairing as in section 3. The code: [plan.py](../distlab/parallel/tensor/plan.py).

# %%
import torch.nn.functional as F

class MyBlock(nn.Module):                       # written the plain way, nothing distributed in it
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2, self.head_dim = nn.LayerNorm(d), nn.LayerNorm(d), d // heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)         # one fused q|k|v matrix
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)   # -1: heads read from the tensor
                   for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

class MyLM(nn.Module):
    def __init__(self, vocab=CFG.vocab, d=H, heads=A, layers=L):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(S, d)
        self.blocks = nn.ModuleList(MyBlock(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

PLAN = {"tok": "embedding",                        # vocabulary rows split, the ranks sum (g)
        "blocks.*.qkv": dl.tp.Colwise(packed=3),   # q, k, v each split by heads: rank i gets [q_i; k_i; v_i]
        "blocks.*.proj": "rowwise",
        "blocks.*.fc": "colwise",
        "blocks.*.out": "rowwise",
        "head": "colwise_gather"}                  # vocabulary split, logits gathered back: plain cross-entropy

def my_model_step():
    ids, targets = MarkovTokens(CFG.vocab, CFG.seq_len).batch(0, B)
    torch.manual_seed(0); full = MyLM()
    torch.manual_seed(0); tp = dl.tp.parallelize(MyLM(), plan=PLAN)
    labels.label_modules(tp)
    dl.tracer().clear()
    losses = [F.cross_entropy(m(ids).flatten(0, 1), targets.flatten()) for m in (full, tp)]
    for loss in losses:
        loss.backward()
    grads = dl.tp.full_grads(tp)
    worst = max(((grads[n] - p.grad).norm() / p.grad.norm()).item()
                for n, p in full.named_parameters() if not n.endswith("qkv.bias"))   # k's bias: true grad 0
    replicated = sum(p.numel() for n, p in full.named_parameters()      # LayerNorms, positions, row biases
                     if n.startswith("pos") or ".ln" in n or n.endswith(("proj.bias", "out.bias")))
    return ([l.item() for l in losses], worst, tuple(tp.blocks[0].qkv.weight.shape),
            sum(p.numel() for p in tp.parameters()), sum(p.numel() for p in full.parameters()), replicated)

run = dl.launch(my_model_step, world_size=T)
(ref, loss), worst, qkv_shape, mine, total, replicated = run.results[0]
print(f"full loss {ref:.4f}  TP loss {loss:.4f}  worst grad error {'<1e-5' if worst < 1e-5 else worst}")
print(f"rank 0 holds qkv.weight {qkv_shape} of {(3 * H, H)}; parameters: predicted (total - replicated)/T + "
      f"replicated = {(total - replicated) // T + replicated}, measured {mine} of {total}")
assert abs(loss - ref) < 1e-5 * ref and worst < 1e-5 and qkv_shape == (3 * H // T, H)
assert mine == (total - replicated) // T + replicated
predicted = dl.theory.tp_volume(S, B, H, T, layers=L, bytes_per_element=4)
measured = sum(e.sent for e in run.trace.comms(rank=0) if inside(e, "blocks"))
on_wire = replayed(run.trace)
print(f"bytes sent by rank 0 inside the blocks: predicted {predicted:.0f}, recorded (ring model) {measured}, "
      f"measured on distlab's ring {on_wire}")
assert measured == predicted and on_wire == predicted

# %% [markdown]
# ## What to remember
#
# * Column-parallel splits output features, row-parallel input features; pairing them leaves one all-reduce per
#   region forward (*g*) and one backward (*f*): 4 all-reduces of b·s·h per layer per step. The calls and their sizes
#   were measured above exactly; the bytes per rank are the ring's formula applied to them (modelled).
# * That traffic grows with b·s·h and happens on the critical path of every layer, so TP stays inside a node
#   (NVLink); across nodes go PP and DP (lesson 06: which of them is outermost is the layout's choice).
# * Sequence parallelism turns each all-reduce into a reduce-scatter + all-gather (same bytes), plus a re-gather
#   in the backward (+25%) so that it need not store the gathered input, and makes every activation 1/t: sbh(34 + 5as/h)/t instead of sbh(10 + 24/t + 5as/(ht)).
# * Vocabulary parallelism shards the two largest matrices of a small model (embedding, head) and computes the
#   loss with three tiny all-reduces instead of gathering b·s·V logits.
# * Your own model takes a plan, `dl.tp.parallelize(model, plan={"blocks.*.fc": "colwise", ...})`: the same
#   column/row pairing by module name, with the head count read from the tensors.
#
# **Try it**: set `T = 2` in section 3, or a bigger `B`: the calls stay four per layer of b·s·h each, so the
# recorded (ring-model) bytes follow the formula exactly.

# %% [markdown]
# ## Build it yourself
#
# Write each function below, then run the check under it: `dl.exercises.check` runs your code on real ranks (several world sizes, sizes that do not divide) beside the reference and says the first difference in words. The teacher's version of this notebook shows a solution; the student version has a stub instead: `make lab` opens it (`lab/student/`), and `distlab lessons DIR` writes it to `DIR/student/`.

# %%
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab as dl


# %% [markdown]
# **tp_mlp**: tp_mlp(x, w1, w2) -> GeLU(x @ A) @ B on t ranks, w1 this rank's columns of A and w2 its rows of B, with Megatron's f and g written as torch.autograd.Function (forward and backward)

# %% nbgrader={"grade": false, "grade_id": "tp_mlp", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def tp_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Z = GeLU(X A) B with A split by columns (``w1``: this rank's (h, 4h/t)) and B by rows (``w2``:
    (4h/t, h)): f before the column linear (identity forward, all-reduce backward), g after the row
    linear (all-reduce forward, identity backward), as autograd Functions (Shoeybi et al. 2019)."""
    ### BEGIN SOLUTION
    class CopyToRegion(torch.autograd.Function):           # f
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad

    class ReduceFromRegion(torch.autograd.Function):       # g
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous().clone()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    return ReduceFromRegion.apply(F.gelu(CopyToRegion.apply(x) @ w1) @ w2)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_tp_mlp", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("tp_mlp", tp_mlp).require();


# %% [markdown]
# **vocab_parallel_cross_entropy**: vocab_parallel_cross_entropy(logits, targets, vocab_start) -> the mean cross-entropy, each rank holding the logits of vocabulary ids [vocab_start, vocab_start + logits.shape[-1])

# %% nbgrader={"grade": false, "grade_id": "vocab_parallel_cross_entropy", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 vocab_start: int) -> torch.Tensor:
    """The mean cross-entropy over tokens when each rank holds the logits of its vocabulary slice
    [vocab_start, vocab_start + V_r) (Megatron-LM): three all-reduces of one number per token (the
    max, for stability; the sum of exponentials; the target's logit, from the rank that holds it)."""
    ### BEGIN SOLUTION
    top = logits.max(dim=-1).values                                   # (T,)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = logits - top[:, None]                                   # every exponent <= 0: no overflow
    total = shifted.exp().sum(dim=-1)
    dist.all_reduce(total)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = torch.zeros_like(total)
    picked[mine] = shifted[mine, local[mine]]
    dist.all_reduce(picked)
    return (total.log() - picked).mean()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_vocab_parallel_cross_entropy", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("vocab_parallel_cross_entropy", vocab_parallel_cross_entropy).require();
