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
# # 06 · 3D parallelism: data x tensor x pipeline on one mesh
#
# Each parallelism so far fixed one bottleneck and paid for it with communication:
#
# | | splits | talks | per step, per rank |
# |---|---|---|---|
# | **DP** (lesson 02) | the batch | all-reduce of gradients | 2 (D-1)/D x 4Ψ bytes (fp32), once per step |
# | **TP** (lesson 04) | every weight matrix | all-reduce of activations | 4 per layer per microbatch, blocking |
# | **PP** (lesson 05) | the layers | activations and gradients, point to point | one b s h message per microbatch and boundary |
#
# Large models use all three at once (Megatron-LM's "PTD-P", Narayanan et al. 2021): **TP inside a node**, where
# the links are fastest, because its all-reduces sit on the critical path of every layer; **PP and DP across
# nodes**: PP because it sends the least, DP because its one all-reduce per step can hide behind the backward.
# On thousands of GPUs both axes span nodes; which one is outermost, and so alone crosses nodes on a small
# cluster, is a choice of layout (section 1: Megatron puts PP outermost, distlab DP). The ranks form a 3D grid,
# the *mesh*, and each rank belongs to exactly one group along each axis. (Ψ, D, T, P: [docs/notation.md](../docs/notation.md).)
#
# In this lesson you will
#
# 1. build the mesh in one expression, `torch.arange(world).view(dp, pp, tp)`, and find a rank's coordinates and
#    groups by lookup;
# 2. draw it: which ranks talk over which links;
# 3. train a GPT on 4 ranks three ways (`3d:dp=2,tp=1,pp=2`, `3d:dp=1,tp=2,pp=2`, `3d:dp=2,tp=2,pp=1`) and get
#    exactly the single-process result;
# 4. run the full `3d:dp=2,tp=2,pp=2` on 8 ranks and account for every byte each group type carries, predicted by
#    `dl.theory` and measured from the trace;
# 5. find a layout for a device too small for plain DDP the Playbook's way (fit memory, reach the batch, maximise
#    throughput), each step predicted by `dl.theory` first and then run.
#
# The code this lesson explains: the mesh, [distlab/parallel/mesh.py](../distlab/parallel/mesh.py); the 3D strategy
# that composes tensor, pipeline and data parallelism on it, [distlab/strategies/mesh.py](../distlab/strategies/mesh.py)
# (its short functions in the order they run: `_tensor_then_pipeline`, `_criterion`, `_data_parallel`, `_plan`); the
# one training loop every strategy runs, [distlab/strategies/loop.py](../distlab/strategies/loop.py); and the
# gradient-norm clipper that sums over the tp and pp groups, [distlab/parallel/clip.py](../distlab/parallel/clip.py).

# %%
import matplotlib.pyplot as plt
import torch

import distlab as dl
from distlab.parallel.mesh import AXES, Mesh
from distlab.strategies.mesh import bytes_by_axis

COLORS = {"dp": "#17becf", "pp": "#ff7f0e", "tp": "#d62728"}

# %% [markdown]
# ## 1. The mesh is one tensor
#
# Lay the ranks out in a tensor of shape (dp, pp, tp): entry `[d, p, t]` is the global rank. Tensor parallelism is
# the **last** (fastest-varying) axis, so a TP group is a run of consecutive ranks: on a real cluster, GPUs of one
# node, joined by NVLink. A rank's coordinates are where its number sits in the tensor; its group along an axis is
# the line through it along that axis (fix the two other coordinates).

# %%
grid = torch.arange(8).view(2, 2, 2)            # (dp, pp, tp)
print(grid)
mesh = Mesh(dp=2, tp=2, pp=2, world_size=8)     # the same grid, plus lookups and (inside ranks) process groups
assert torch.equal(mesh.grid, grid)
print(mesh.table())
print("rank 5 sits at", mesh.coords(5))
for axis in AXES:
    print(f"{axis} groups: {mesh.all_groups(axis)}")

# %% [markdown]
# Every family of groups **partitions** the world: each rank is in exactly one TP group, one pipeline and one
# data-parallel group. Inside a launched rank, `Mesh(...)` calls `torch.distributed.new_group` for every group of
# every axis, on every rank, in the same order (group creation is collective over the world), and keeps its own
# three: `mesh.tp_group`, `mesh.pp_group`, `mesh.dp_group`.

# %%
for axis in AXES:
    groups = mesh.all_groups(axis)
    assert sorted(r for g in groups for r in g) == list(range(8))
    for r in range(8):
        assert sum(r in g for g in groups) == 1
print("each axis partitions the 8 ranks")


# %% [markdown]
# **Which axis lands inside a node?** Ranks are numbered node by node (8 GPUs of node 0 are ranks 0-7, and so on),
# so the axes that vary fastest in the grid stay inside a node. distlab's order is (dp, pp, tp): TP fastest, then
# PP, DP slowest. Megatron-LM's default order, written fastest first, is `tp-cp-ep-dp-pp`: TP fastest, then DP,
# **PP slowest**. Take these 8 ranks on two 4-GPU nodes and ask, for each order, which groups cross a node:

# %%
def groups_crossing_nodes(order, sizes, gpus_per_node):
    """For a rank grid laid out in ``order`` (slowest axis first), the axes whose groups span two nodes."""
    grid = torch.arange(8).view(*(sizes[a] for a in order))
    crossing = []
    for i, axis in enumerate(order):
        lines = grid.movedim(i, -1).reshape(-1, sizes[axis])        # every group along this axis
        if any(len(set((line // gpus_per_node).tolist())) > 1 for line in lines):
            crossing.append(axis)
    return crossing

SIZES = {"dp": 2, "pp": 2, "tp": 2}
for name, order in (("distlab (dp, pp, tp)", ("dp", "pp", "tp")), ("Megatron tp-dp-pp", ("pp", "dp", "tp"))):
    print(f"{name:22} groups crossing nodes: {groups_crossing_nodes(order, SIZES, 4)}")
assert groups_crossing_nodes(("dp", "pp", "tp"), SIZES, 4) == ["dp"]
assert groups_crossing_nodes(("pp", "dp", "tp"), SIZES, 4) == ["pp"]


# %% [markdown]
# Both keep TP inside the node, where its blocking per-layer all-reduces need NVLink. They differ on the slow
# links: distlab sends the DP gradient all-reduce across nodes (large, but once per step and overlapped with the
# backward, section 5); Megatron sends the pipeline's point-to-point activations across (the least traffic of the
# three, section 4) and keeps DP inside, which pays when the DP all-reduce cannot be hidden. Count the bytes in
# section 4 and you can argue either way for your cluster.

# %% [markdown]
# ## 2. Who talks to whom
#
# Below, each box is a rank with its (dp, pp, tp) coordinates. Red lines join TP partners (all-reduces of
# activations, every layer), orange PP neighbours (activations forward, gradients backward), cyan DP replicas
# (one gradient all-reduce per step). A rank has exactly one partner of each colour here because every degree is 2.

# %%
def draw_mesh(mesh, ax):
    pos = {}
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        pos[r] = (c.dp * (mesh.tp + 1.2) + c.tp, -c.pp)
    for axis, style in (("dp", ":"), ("pp", "--"), ("tp", "-")):
        for group in mesh.all_groups(axis):
            for a, b in zip(group, group[1:]):
                (xa, ya), (xb, yb) = pos[a], pos[b]
                c = mesh.coords(a)
                # DP arcs: above the top row, below the bottom one, nested by tp so they stay apart
                bend = (0.75 - 0.25 * c.tp) * (1 if c.pp == 0 else -1) if axis == "dp" else 0.0
                u = torch.linspace(0, 1, 30)
                ax.plot(xa + (xb - xa) * u, ya + (yb - ya) * u + bend * 4 * u * (1 - u), style,
                        color=COLORS[axis], lw=2.5, zorder=1)
    for r, (x, y) in pos.items():
        c = mesh.coords(r)
        ax.add_patch(plt.Rectangle((x - 0.35, y - 0.3), 0.7, 0.6, fc="white", ec="black", zorder=2))
        ax.text(x, y + 0.08, f"rank {r}", ha="center", va="center", fontsize=10, weight="bold", zorder=3)
        ax.text(x, y - 0.14, f"d{c.dp} p{c.pp} t{c.tp}", ha="center", va="center", fontsize=8, zorder=3)
    for axis in AXES:
        ax.plot([], [], {"dp": ":", "pp": "--", "tp": "-"}[axis], color=COLORS[axis], lw=2.5, label=f"{axis} link")
    ax.legend(loc="upper right", bbox_to_anchor=(1.28, 1.0))
    ax.set_xlim(-0.6, mesh.dp * (mesh.tp + 1.2) - 0.6)
    ax.set_ylim(-mesh.pp + 0.2, 0.95)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"dp={mesh.dp} x pp={mesh.pp} x tp={mesh.tp}: one block per data-parallel replica")

fig, ax = plt.subplots(figsize=(8, 4))
draw_mesh(mesh, ax)
plt.show()

# %%
for r in range(8):
    print(f"rank {r} {mesh.coords(r)}  talks to  {mesh.links(r)}")

# %% [markdown]
# ## 3. Three 4-rank meshes, one answer
#
# `dl.train("3d:dp=D,tp=T,pp=P")` composes what the earlier lessons built, on each rank by its coordinates:
#
# 1. `dl.tp.parallelize(gpt, group=mesh.tp_group)`: keep 1/T of every large matrix;
# 2. `dl.pp.stage_module(gpt, pp_rank, P)` and `dl.pp.Pipeline(..., group=mesh.pp_group)`: keep one stage's layers
#    and run the 1F1B schedule with the other stages;
# 3. `dl.DDP(stage, group=mesh.dp_group)` (or ZeRO-1 with `zero=1`): average gradients with the other replicas,
#    once per step: DDP starts each bucket's all-reduce during the rank's last backward, as soon as the bucket
#    is full (`dl.pp.ReplicaGradSync.last_backward`), and waits for them after the pipeline flush (`.finish`).
#
# Each replica trains on its rows of the global batch, the last stage computes the vocabulary-parallel loss. With
# plain SGD in fp32, every mesh must reproduce single-process training to rounding error: same losses, same
# final weights (gathered back to full size on rank 0).

# %%
SGD = dict(model="gpt-tiny", steps=3, seed=0, optimizer="sgd", lr=0.1)
single = dl.train("single", **SGD)


def max_rel_err(report, ref):
    return max((report.params[n] - p).norm().item() / max(p.norm().item(), 1e-2) for n, p in ref.params.items())


for name in ("3d:dp=2,tp=1,pp=2", "3d:dp=1,tp=2,pp=2", "3d:dp=2,tp=2,pp=1"):
    report = dl.train(name, world_size=4, **SGD)
    loss_err = max(abs(a - b) / b for a, b in zip(report.losses, single.losses))
    assert loss_err < 1e-5 and max_rel_err(report, single) < 1e-5, name
    print(f"{name}: losses {[round(x, 4) for x in report.losses]}  (single {[round(x, 4) for x in single.losses]})"
          f"  params within 1e-5: True")

# %% [markdown]
# (Every parameter is compared relative to its own size, floored at 0.01: `attn.k.bias` starts at zero and has a
# true gradient of exactly zero, since softmax ignores a constant added to every score of a query, so both runs
# keep it at rounding noise.)
#
# ## 4. Eight ranks: every byte accounted for
#
# Now all three axes at once, on 8 ranks. Each rank records every transfer in its trace. The mesh names each group
# it creates after its axis (`collectives.name_group`), so every collective on it is tagged with that name, and
# `bytes_by_axis` files each transfer under the group it travelled on (the pipeline's send/recv: pp). We count step 1, from its start to the start of step 2 (step 0 also sends the pipeline's one-time shape
# headers).
#
# **Predictions** (per rank, per step; b = rows per microbatch, s sequence, h hidden, m microbatches, 4 bytes
# per fp32 element, L = transformer layers on this rank's stage):
#
# * **TP** (`dl.theory.tp_volume`): 4 all-reduces of b s h per layer per microbatch, 2 (T-1)/T of the message
#   each (ring). Plus, outside the layers, one more b s h all-reduce on the first stage (the vocabulary-parallel
#   embedding's g) and on the last (the LM head's f, in the backward), and three all-reduces of b s numbers on the
#   last stage (the vocabulary-parallel cross-entropy: max, sum of exponentials, target logit).
# * **PP** (`dl.theory.pp_volume`, which counts a middle stage's both directions): with P = 2 the first stage sends
#   only activations and the last only gradients, m b s h elements each.
# * **DP** (`dl.theory.dp_volume`): a ring all-reduce of this rank's gradients, 2 (D-1)/D x its parameter bytes.

# %%
D = T = P = 2
report = dl.train("3d:dp=2,tp=2,pp=2", world_size=8, **SGD)
assert max(abs(a - b) / b for a, b in zip(report.losses, single.losses)) < 1e-5
assert max_rel_err(report, single) < 1e-5
trace, cfg = report.run.trace, dl.models.PRESETS["gpt-tiny"]
s, h = cfg.seq_len, cfg.d_model

measured, predicted = {}, {}
for r in range(8):
    info = report.results[r].info
    c, m = info["coords"], info["microbatches"]
    b = report.spec.global_batch // D // m
    layers = sum(n.endswith("ln1.weight") for n in info["shapes"])
    first, last = c.pp == 0, c.pp == P - 1
    ring = 2 * (T - 1) / T * 4
    tp = m * (dl.theory.tp_volume(s, b, h, T, layers=layers, bytes_per_element=4)
              + ring * b * s * h * (first + last) + (ring * 3 * b * s if last else 0))
    pp = dl.theory.pp_volume(s, b, h, m, bytes_per_element=4) / 2
    dp = dl.theory.dp_volume(info["param_bytes"], D)
    predicted[r] = {"dp": dp, "pp": pp, "tp": tp}
    marks = {e.args["step"]: e.start for e in trace.select("mark", rank=r, name="step")}
    measured[r] = bytes_by_axis(e for e in trace.comms(rank=r) if marks[1] <= e.start < marks[2])
    assert measured[r] == predicted[r], (r, measured[r], predicted[r])

print("rank  coords                   tp bytes   pp bytes   dp bytes   (recorded = predicted)")
for r in range(8):
    print(f"{r:4d}  {str(report.results[r].info['coords']):22} {measured[r]['tp']:9d}  {measured[r]['pp']:9d}"
          f"  {measured[r]['dp']:9d}")

# %% [markdown]
# The pp bytes are the tensors each send was handed: measured. The tp and dp bytes ran on torch's gloo and are
# recorded with a ring's formula (`bytes="ring-model"`), so the equality above checks the number and size of the
# calls (a missed or extra all-reduce fails it), not the bytes. To measure those too, `dl.comm.replay` re-runs a
# rank's step-1 calls, same op and size, on distlab's own ring of send/recv (T = D = 2 ranks), where every byte is
# counted as it is sent: a wrong constant in `tp_volume` or `dp_volume`, or a formula that disagreed with the real
# ring, would fail this check. One rank of each stage is enough (the others mirror them).

# %%
def step1_calls(r, axis):
    marks = {e.args["step"]: e.start for e in trace.select("mark", rank=r, name="step")}
    return [(e.name, e.args["size"]) for e in trace.comms(rank=r, group=axis) if marks[1] <= e.start < marks[2]]

def replay_axes(tp_calls, dp_calls):         # both axes have 2 ranks here: one launch replays both
    return {"tp": dl.comm.replay(tp_calls), "dp": dl.comm.replay(dp_calls)}

for r in (0, 7):
    wire = dl.launch(replay_axes, world_size=2, args=(step1_calls(r, "tp"), step1_calls(r, "dp"))).results[0]
    print(f"rank {r}: measured on distlab's ring  tp {wire['tp']}  dp {wire['dp']}   (predicted tp "
          f"{predicted[r]['tp']:.0f}, dp {predicted[r]['dp']:.0f})")
    assert wire == {"tp": predicted[r]["tp"], "dp": predicted[r]["dp"]}, (r, wire, predicted[r])

# %%
fig, ax = plt.subplots(figsize=(10, 3.5))
width = 0.27
for k, axis in enumerate(("tp", "pp", "dp")):
    xs = [r + (k - 1) * width for r in range(8)]
    ax.bar(xs, [measured[r][axis] / 1024 for r in range(8)], width, color=COLORS[axis], label=f"{axis} recorded")
    ax.scatter(xs, [predicted[r][axis] / 1024 for r in range(8)], marker="_", s=200, color="black", zorder=3)
ax.scatter([], [], marker="_", s=200, color="black", label="predicted")
ax.set_xticks(range(8), [f"rank {r}\n{'first' if report.results[r].info['coords'].pp == 0 else 'last'} stage"
                         for r in range(8)])
ax.set_ylabel("KiB sent in one step")
ax.set_title("3d:dp=2,tp=2,pp=2 on gpt-tiny: bytes each rank sends per step, by group type")
ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# **What "recorded" means here.** The pipeline's sends are point to point: their sizes are the bytes on the wire,
# measured. TP's and DP's collectives run on torch's gloo, which does not say what it put on the wire, so each call
# is recorded with the bytes a ring moves for it (`bytes="ring-model"`, see
# [collectives.py](../distlab/parallel/collectives.py)). For those two the equality checks that every rank
# issued exactly the collectives the formulas count, of exactly the predicted sizes; the bytes themselves are the
# ring's. (Lessons 02 and 03 run DP on distlab's own ring, built from send/recv, and measure them.)
#
# What to read in the chart:
#
# * **TP carries the most**, several times the pipeline's traffic (the ratio is printed below), and it is
#   *blocking*: the layer cannot go on until its all-reduce returns. That is why TP stays inside a node.
# * **PP carries the least**: one activation (or gradient) per microbatch per stage boundary, point to point, which
#   is why PP can cross the slow links between nodes (Megatron's layout; this mesh sends DP across instead).
# * **DP** all-reduces the fp32 gradients of this rank's share of the parameters, 4Ψ/(T P) bytes (a little more:
#   LayerNorms are replicated across TP), so it sends 2(D-1)/D · 4Ψ/(T P) per step: here, at D = 2, exactly the
#   share, and towards twice the share as D grows. For a large model that is large, but it overlaps the backward
#   (lesson 02) and ZeRO can shard the optimizer behind it (`3d:dp=2,tp=2,pp=2,zero=1`).
# * The last stage's TP bytes exceed the first's by exactly the three small cross-entropy all-reduces.

# %%
tp_total = sum(measured[r]["tp"] for r in range(8))
pp_total = sum(measured[r]["pp"] for r in range(8))
assert tp_total > 4 * pp_total
per_rank_params = report.results[0].info["param_bytes"]
full_params = sum(p.numel() * 4 for p in single.params.values())
print(f"TP / PP bytes: {tp_total / pp_total:.2f}")
print(f"rank 0 holds {per_rank_params} of {full_params} parameter bytes ({per_rank_params / full_params:.1%}; "
      f"1/(T P) would be {1 / (T * P):.0%}: LayerNorms and position embeddings are replicated across TP)")

# %% [markdown]
# ## 5. One step on the clock
#
# The bytes say how much each group carries; the timeline says when. Step 1 of the same 8-rank run, for the four
# ranks of replica 0 (replica 1 looks the same): each rank's compute on the upper lane and its communication
# underneath, coloured by the group it travelled on. TP's all-reduces sit inside every forward and backward
# (blocking); PP's sends sit between a stage's actions; DP's gradient all-reduce comes once, at the end. A
# pipeline *receive* is drawn in grey: most of its length is the rank waiting for its neighbour stage to send,
# idle time rather than traffic.
#
# **Prediction:** DDP starts a bucket's all-reduce as soon as the last microbatch's backward has filled it and
# does not wait for it there (`dl.pp.ReplicaGradSync`); the wait comes after the pipeline flush. So on every rank,
# every DP all-reduce of the step starts *inside* that rank's last backward.

# %%
from distlab.strategies.mesh import axis_of

def comm_or_wait(event):
    """A receive is mostly waiting for the sender: draw it as waiting, not as traffic."""
    return "waiting for a pp message" if event.name == "recv" else axis_of(event)

step_start = {r: {e.args["step"]: e.start for e in trace.select("mark", rank=r, name="step")} for r in range(8)}
REPLICA = [0, 1, 2, 3]                 # one data-parallel replica: both stages, both TP ranks of each
fig = dl.viz.timeline(trace, ranks=REPLICA, start=min(step_start[r][1] for r in REPLICA),
                      end=max(step_start[r][2] for r in REPLICA), comm_kind=comm_or_wait,
                      comm_colours={**COLORS, "waiting for a pp message": "#cccccc"},
                      title="step 1, replica 0 of 3d:dp=2,tp=2,pp=2: compute (upper lane), communication below")
plt.show()

# %%
for r in range(8):
    backwards = [e for e in trace.spans(rank=r, cat="compute") if e.name == "B" and e.args.get("step") == 1]
    last = max(backwards, key=lambda e: e.end)
    dp = [e for e in trace.comms(rank=r) if axis_of(e) == "dp" and step_start[r][1] <= e.start < step_start[r][2]]
    assert dp and all(last.start < e.start < last.end for e in dp), r
print("on all 8 ranks, every dp all-reduce of step 1 starts inside the rank's last backward")

# %% [markdown]
# ## 6. Finding a layout by measuring
#
# The Ultra-Scale Playbook (Hugging Face, 2025) picks a layout in three steps: **fit memory** (keep only the layouts
# whose per-rank memory fits the device), **reach the batch** (give each the global batch, with micro-batches and
# accumulation where its rank cannot hold its share at once), **maximise throughput** (of what is left, the fastest).
# Here on `gpt-wide` (Ψ = 1.65 M parameters, fp32 Adam: 16 bytes of state per parameter), 4 ranks, a
# global batch of 16 sequences, five candidate layouts. Each step is predicted first, then run.
#
# **1. Fit memory.** The device is given the size of plain DDP's model state alone (parameters, gradients, Adam's
# two moments: 16 Ψ bytes), `memory_limit` = `dl.theory.memory(Ψ, dp=4).total` without activations: DDP cannot
# fit whatever its activations. `dl.theory.memory` predicts every layout's peak (states plus Korthikanti's
# activations, rank 0's stage); a layout is predicted to fit if that is under the limit. Then each runs 3 steps
# under the limit, and either trains or raises the ledger's out-of-memory error.

# %%
MODEL, B, WORLD = "gpt-wide", 16, 4
wide = dl.models.PRESETS[MODEL]
PSI = sum(p.numel() for p in dl.models.build(MODEL).parameters())
CANDIDATES = {                  # name: (dp, tp, pp, zero, microbatches), 4 ranks each
    "ddp": (4, 1, 1, 0, 1), "zero2": (4, 1, 1, 2, 1), "zero3": (4, 1, 1, 3, 1),
    "3d:dp=2,tp=2,pp=1": (2, 2, 1, 0, 2), "3d:dp=2,tp=1,pp=2": (2, 1, 2, 0, 4)}


def predicted_memory(dp, tp, pp, zero, m):
    return dl.theory.memory(PSI, dp=dp, zero=zero, tp=tp, pp=pp, precision="fp32", optimizer="adam",
                            seq_len=wide.seq_len, micro_batch=B // dp // m, hidden=wide.d_model, heads=wide.heads,
                            layers=wide.layers, microbatches=m).total


LIMIT = int(dl.theory.memory(PSI, dp=WORLD, precision="fp32", optimizer="adam").total)
print(f"Ψ = {PSI} parameters; memory_limit = {LIMIT / 1e6:.2f} MB per rank (plain DDP's 16 Ψ bytes of state)")
runs, fits_measured = {}, []
for name, layout in CANDIDATES.items():
    try:
        runs[name] = dl.train(name, world_size=WORLD, model=MODEL, steps=3, seed=0, global_batch=B,
                              memory_limit=LIMIT)
        fits_measured.append(name)
        outcome = "trains"
    except dl.LaunchError as e:
        outcome = str(e)[str(e).index("out of memory"):].split(" (")[0]
    print(f"{name:18} predicted {predicted_memory(*layout) / 1e6:5.2f} MB | {outcome}")
fits_predicted = [name for name, layout in CANDIDATES.items() if predicted_memory(*layout) <= LIMIT]
print("fit, predicted:", fits_predicted)
print("fit, measured: ", fits_measured)
assert fits_predicted == fits_measured and "ddp" not in fits_measured

# %% [markdown]
# The lists agree, but not because `dl.theory.memory` gets the activations right here: Korthikanti's formula counts
# a large model's 16-bit activations per layer, the ledger counts every fp32 tensor autograd keeps in this small
# model (the logits, the loss, the embeddings' outputs), and ZeRO-2 also holds a full-size gradient buffer for its
# reduce-scatter. For ZeRO (below) the ledger holds several times the formula's activations, yet both still fit:
# the prediction holds because the margins are wider than that miss, the survivors' predicted states filling at most
# half the device. (ZeRO-3's ledger peak is not printed: it is not the same from one run to the next, by a few MB.) On a layout near the limit, measure before trusting it.

# %%
for name in ("zero2", "zero3"):                 # the data-parallel runs: one micro-batch, no pipeline
    dp, tp, pp, zero, m = CANDIDATES[name]
    theory = dl.theory.memory(PSI, dp=dp, zero=zero, tp=tp, pp=pp, precision="fp32", optimizer="adam",
                              seq_len=wide.seq_len, micro_batch=B // dp // m, hidden=wide.d_model,
                              heads=wide.heads, layers=wide.layers, microbatches=m)
    held = runs[name].memory[0]["peak"]
    print(f"{name:18} activations: ledger {held['activations'] / theory.activations:4.1f} x the formula")
peak = max(m["peak_total"] for m in runs["zero2"].memory)
print(f"zero2's ledger peak (parameters, gradients, Adam, activations, buffers): {peak / 1e6:5.2f} MB, "
      f"{1 - peak / LIMIT:4.0%} under the limit")

# %% [markdown]
# **2. Reach the batch.** Every survivor must train on the same 16 sequences per step. A data-parallel rank holds
# B / D of them; the pipeline splits its replica's share into m micro-batches (the 3D strategy's default, m = 2 P
# here; with P = 1, two micro-batches of gradient accumulation), so each forward sees b = B / (D m) sequences:
#
#     B = D x m x b      ZeRO (D = 4): 4 x 1 x 4;   tp=2 x dp=2: 2 x 2 x 4;   pp=2 x dp=2: 2 x 4 x 2
#
# The runs report the micro-batches they used; the same global batch means the same losses (to Adam's rounding).

# %%
for name in fits_measured:
    dp, tp, pp, zero, m = CANDIDATES[name]
    used = runs[name].results[0].info.get("microbatches") or 1
    b = B // dp // m
    assert used == m and dp * m * b == B, (name, used)
    assert max(abs(x - y) / y for x, y in zip(runs[name].losses, runs["zero2"].losses)) < 1e-4, name
    print(f"{name:18} D = {dp}, m = {m}, b = {b}:  {dp} x {m} x {b} = {B} sequences per step")

# %% [markdown]
# **3. Maximise throughput.** Of the four, which is fastest? All four do the same FLOPs per step (the same model
# on the same 16 sequences, nothing recomputed), so on a cluster they differ in what they send and in whether it
# hides. First the prediction, per rank and step, from `dl.theory`'s formulas (section 4's, P = parameter bytes the
# rank holds, 4 bytes per element): ZeRO-2 2 (D-1)/D P and ZeRO-3 3 (D-1)/D P (`zero_volume`: stage 3 gathers the
# parameters again for the backward); tp=2 x dp=2 section 4's TP bytes plus DP's 2 (D-1)/D P of its half of
# the model; pp=2 x dp=2 DP's all-reduce of its stage plus one b s h message per micro-batch. The layout to run is
# the one whose busiest rank sends the least. Then the runs' traces, step 1, exactly as in section 4.

# %%
def bytes_predicted(name, r):
    dp, tp, pp, zero, m = CANDIDATES[name]
    info, b, s, h = runs[name].results[r].info, B // dp // m, wide.seq_len, wide.d_model
    if tp == pp == 1:
        return dl.theory.zero_volume(zero, 4 * PSI, dp)
    if tp > 1:                            # one stage: the first and the last, as in section 4
        ring = 2 * (tp - 1) / tp * 4
        per_micro = (dl.theory.tp_volume(s, b, h, tp, layers=wide.layers, bytes_per_element=4)
                     + ring * b * s * h * 2 + ring * 3 * b * s)
        return m * per_micro + dl.theory.dp_volume(info["param_bytes"], dp)
    return dl.theory.dp_volume(info["param_bytes"], dp) + dl.theory.pp_volume(s, b, h, m, bytes_per_element=4) / 2


def bytes_measured(name, r):
    trace = runs[name].run.trace
    marks = {e.args["step"]: e.start for e in trace.select("mark", rank=r, name="step")}
    return sum(e.sent for e in trace.comms(rank=r) if marks[1] <= e.start < marks[2])


predicted = {name: max(bytes_predicted(name, r) for r in range(WORLD)) for name in fits_measured}
ranked = sorted(predicted, key=predicted.get)
print("predicted, fewest bytes on the busiest rank first:", " < ".join(ranked),
      f"(the runner-up sends {predicted[ranked[1]] / predicted[ranked[0]]:.2f}x the winner)")
busiest = {}
for name in fits_measured:
    sent = [bytes_measured(name, r) for r in range(WORLD)]
    assert sent == [bytes_predicted(name, r) for r in range(WORLD)], name
    busiest[name] = max(sent)
    print(f"{name:18} bytes sent in step 1, ranks 0-3: {sent}  (= predicted)")
assert sorted(busiest, key=busiest.get) == ranked
print("measured: the same order; the layout to run is", ranked[0])

# %% [markdown]
# The bytes are exact (counts of calls and their sizes, section 4), so the prediction can be asserted, winner and
# order, whatever the load. The pipeline wins by a wide margin (printed): it all-reduces only its stage's
# half of the gradients over D = 2 and sends a few small activations, where ZeRO moves the whole model's gradients
# and parameters among 4 ranks and TP all-reduces activations in every layer.
#
# The clock is another matter, and nothing about it is asserted here. The four do the same FLOPs, so what
# separates their CPU time on this machine is Python overhead per micro-batch, per collective and per pipeline
# action, and gloo's copies: the constants lesson 13 fits (`dl.theory.calibrate`), and predicts each run's CPU time
# with only to within 60%. Their wall time also depends on what else this shared machine runs. The CPU seconds per
# step (summed over the 4 ranks, the least disturbed of steps 1 and 2) are printed below for reading, not checked.
# Their order need not be the bytes' order: on a CPU, copying a megabyte is cheap next to the Python of a pipeline
# action or of a tensor-parallel collective, which a GPU cluster's bandwidth-bound step barely notices.

# %% tags=["nbval-ignore-output"]
for name in fits_measured:
    cpu = []
    for r in range(WORLD):
        marks = sorted(runs[name].run.trace.select("mark", rank=r, name="step"), key=lambda e: e.start)
        cpu.append(min(b.args["cpu"] - a.args["cpu"] for a, b in zip(marks[1:], marks[2:])))
    print(f"{name:18} {sum(cpu) * 1e3:5.0f} CPU ms per step over 4 ranks")

# %% [markdown]
# ## What to remember
#
# * The mesh is `torch.arange(world).view(dp, pp, tp)`; a rank's coordinates come from looking itself up, its
#   group along an axis is the line through it. TP is the fastest axis, so TP groups are neighbouring ranks.
# * 3D training is composition, not a new algorithm: TP inside each stage, a pipeline over the pp group, DP over the
#   replicas. Done right it is exactly single-process training on the same global batch.
# * The pipeline accumulates gradients over microbatches, so DP communicates once per step, overlapped with the
#   last microbatch's backward and finished after the flush.
# * Per step, TP traffic >> PP traffic, and TP's is blocking: put TP on the fastest links; PP and DP go across
#   nodes (which of them is outermost is the layout's choice: Megatron PP, distlab DP).
# * Choosing a layout: drop what does not fit (`dl.theory.memory`, then a run under `memory_limit`), give each
#   survivor the global batch as D x m x b, and among the rest prefer the one that sends least, a prediction exact
#   enough to assert; CPU and wall time on a shared machine are read, not asserted.
#
# **Try it**: `dl.train("3d:dp=1,tp=2,pp=2,sp=1", world_size=4)` (sequence parallelism inside the stages: the
# pipeline's messages shrink by T), or `"3d:dp=2,tp=1,pp=2,zero=1"` (ZeRO-1 over the replicas), or
# `schedule=gpipe` in the name.

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
# **mesh_groups**: mesh_groups(dp, pp, tp, axis) -> the process groups along axis ('dp', 'pp' or 'tp') of the grid arange(dp*pp*tp).view(dp, pp, tp)

# %% nbgrader={"grade": false, "grade_id": "mesh_groups", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def mesh_groups(dp: int, pp: int, tp: int, axis: str) -> list[list[int]]:
    """The groups along ``axis`` of the grid ``torch.arange(dp * pp * tp).view(dp, pp, tp)``: fix the two
    other coordinates, the ranks on the line that remains form a group."""
    ### BEGIN SOLUTION
    grid = torch.arange(dp * pp * tp).view(dp, pp, tp)
    dim = ("dp", "pp", "tp").index(axis)
    return grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_mesh_groups", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("mesh_groups", mesh_groups).require();
