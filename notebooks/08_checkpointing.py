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
# # 08 · Checkpoints: sharded, atomic, resumable
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# A job on thousands of GPUs meets a failure every few hours (Meta's Llama 3 record, and what fails, open
# [lesson 14](14_when_things_go_wrong.ipynb); lesson 14 also restarts a run automatically). Training survives by
# **checkpointing**: saving everything a step depends on, often enough that little work is lost, and resuming from
# the last save. Three things make that hard at scale:
#
# 1. **What to save.** Parameters *and* optimizer state (in fp32, Adam's two moments are half of
#    the 16 bytes per parameter of model states, and two thirds of the 12 a checkpoint saves), the step counter,
#    and the position in the data. Under ZeRO no rank holds all of it: each rank saves **its own shard**.
# 2. **Torn writes.** A node can die in the middle of a save. A checkpoint half written must never be mistaken for a
#    complete one, or the next resume loads garbage.
# 3. **Exactness.** A resumed run should take *the same steps* the uninterrupted run would have: same weights, same
#    optimizer moments, same next batch. Then a crash costs time, never results.
#
# `dl.checkpoint` commits a checkpoint the way file systems and databases commit anything: write everything
# somewhere invisible, make it durable, then publish it with one atomic operation.
#
#     rank 0:  mkdir step_N.tmp                                   -- barrier --
#     rank r:  torch.save(its shard) -> step_N.tmp/rank_r.pt, fsync
#                                                                 -- all-gather (bytes, sha256) --
#     rank 0:  manifest.json (world size, step, per-shard bytes and sha256), fsync
#              rename step_N.tmp -> step_N                        <- the commit point (atomic on POSIX)
#
# A reader looks only at `step_N` directories with a manifest; `step_N.tmp` is an interrupted save, ignored and
# cleaned up by the next save. Loading uses `torch.load(..., weights_only=True)` (tensors and plain containers only:
# a checkpoint file can't run code on your machine) and checks every file against its sha256.
#
# The code this lesson explains:
# [distlab/checkpoint/store.py](../distlab/checkpoint/store.py) (the files and the atomic commit),
# [distlab/checkpoint/state.py](../distlab/checkpoint/state.py) (what a rank hands over to be saved, in one of three
# formats), [distlab/strategies/checkpointing.py](../distlab/strategies/checkpointing.py) (save, resume), with
# [distlab/strategies/faults.py](../distlab/strategies/faults.py) (fault injection),
# [distlab/checkpoint/reshard.py](../distlab/checkpoint/reshard.py) (one tensor per name, cut again for another
# layout), called once per step by the training loop of every strategy,
# [distlab/strategies/loop.py](../distlab/strategies/loop.py).

# %%
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import distlab as dl

MODEL, N, STEPS, EVERY = "gpt-tiny", 4, 8, 2
CKPT = Path(tempfile.mkdtemp(prefix="distlab_08_"))
PSI = sum(p.numel() for p in dl.models.build(MODEL).parameters())
print(f"{MODEL}: Psi = {PSI} parameters; ZeRO-2 on N = {N} ranks, {STEPS} steps, a checkpoint every {EVERY}")


def layout(step_dir):
    """One checkpoint's files with their sizes (the temporary parent path is not printed)."""
    print(f"{step_dir.name}/")
    for f in sorted(step_dir.iterdir()):
        print(f"    {f.name:14} {f.stat().st_size:>9,} bytes")


# %% [markdown]
# ## 1. The run we want to reproduce
#
# First the uninterrupted run, no checkpoints: 8 steps of ZeRO-2 on 4 ranks. Its losses and final parameters are
# the target.

# %%
reference = dl.train("zero2", world_size=N, model=MODEL, steps=STEPS, seed=0)
print("losses:", [round(x, 4) for x in reference.losses])

# %% [markdown]
# ## 2. Crash a rank in the middle of a save
#
# The same run with `checkpoint_dir=..., checkpoint_every=2`, and a failure injected on purpose:
# `fail_at_step=6, fail_in="save"` sends **SIGKILL** to rank 3 while checkpoint 6 is being written, after its shard is
# on disk but before rank 0 can commit. No exception, no cleanup: the way a node dies when its power or its
# network goes. The launcher notices the dead rank, stops the others (they were waiting in the save's barrier)
# and raises `dl.LaunchError` naming the root cause.

# %%
try:
    dl.train("zero2", world_size=N, model=MODEL, steps=STEPS, seed=0,
             checkpoint_dir=str(CKPT), checkpoint_every=EVERY, fail_at_step=6, fail_in="save")
except dl.LaunchError as err:
    crash = err
print(f"LaunchError, root cause rank {crash.rank}:")
print(crash.failures[crash.rank])
assert crash.rank == N - 1 and "SIGKILL" in crash.failures[crash.rank]

# %% [markdown]
# What is on disk: `step_2` and `step_4` are complete (each has its manifest); `step_6.tmp` is the torn save. Which
# shard files made it into it depends on how far each rank got before it was stopped, so we only check that it has
# no manifest. `dl.checkpoint.latest` sees step 4.

# %%
complete = sorted(p.name for p in CKPT.iterdir() if not p.name.endswith(".tmp"))
torn = sorted(p.name for p in CKPT.iterdir() if p.name.endswith(".tmp"))
print("complete:", complete, "  interrupted:", torn)
print("step_6.tmp has a manifest:", (CKPT / "step_6.tmp" / "manifest.json").exists())
print("latest complete step:", dl.checkpoint.latest(CKPT))
assert complete == ["step_2", "step_4"] and torn == ["step_6.tmp"] and dl.checkpoint.latest(CKPT) == 4

# %% [markdown]
# ## 3. Resume
#
# Relaunch with `resume=True`: every rank loads the latest complete checkpoint (verifying sizes and sha256
# against the manifest), restores the parameters and *its own* optimizer shard, the loss history so far, and
# continues at step 4. The data is a pure function of (seed, step), so step 4 sees the batch it would have seen.
# The first save of the new run cleans up `step_6.tmp`.

# %%
resumed = dl.train("zero2", world_size=N, model=MODEL, steps=STEPS, seed=0,
                   checkpoint_dir=str(CKPT), checkpoint_every=EVERY, resume=True)
info = resumed.results[0].info["checkpoint"]
steps_run = [e.args["step"] for e in resumed.trace.select("mark", rank=0, name="step")]
print(f"resumed from step {info['resumed_from']}, ran steps {steps_run}, saved {info['saved']}")
print("directory now:", sorted(p.name for p in CKPT.iterdir()))
print(" step   uninterrupted   resumed")
for s, (a, b) in enumerate(zip(reference.losses, resumed.losses)):
    print(f"{s:5}   {a:13.4f}   {b:7.4f}" + ("   <- after the crash" if s == info["resumed_from"] else ""))

# %% [markdown]
# The claim is not "close": in fp32, with the same seed, the resumed run is **bit-for-bit** the uninterrupted one.

# %%
assert info["resumed_from"] == 4 and steps_run == [4, 5, 6, 7]
assert resumed.losses == reference.losses
assert all(torch.equal(reference.params[k], resumed.params[k]) for k in reference.params)
print(f"all {STEPS} losses equal and all {len(reference.params)} parameter tensors identical")

# %% [markdown]
# ## 4. Inside a rank: `save` and `load`
#
# `dl.train` does nothing magic. Each strategy hands the checkpoint layer a `RankState`
# ([distlab/checkpoint/state.py](../distlab/checkpoint/state.py)): how to capture this rank's state and how to put
# it back. The checkpoint layer never asks which strategy it serves, only which of three formats the state has (one
# replicated copy, ZeRO's flat shards, or model-parallel pieces). After a step, inside each rank, the training loop
# calls `dl.checkpoint.save(directory, step, state, replicated=...)`, a collective, with `state` what this rank
# alone owns and `replicated` what its replica group shares (written by the group's first rank only). Here is the same by hand for ZeRO-3, where a rank owns 1/N of the
# parameters and 1/N of Adam's moments, and nothing is replicated but the module's buffers:

# %%
import torch.nn.functional as F


def zero3_save_and_load(directory):
    model = dl.ZeRO(dl.models.build(MODEL, seed=0), stage=3, optim=torch.optim.AdamW, lr=1e-3)
    x, y = dl.models.dataset_for(MODEL, 0).batch(0, 16)
    rows = torch.tensor_split(torch.arange(16), dl.world_size())[dl.rank()]
    logits = model(x[rows])
    F.cross_entropy(logits.flatten(0, 1), y[rows].flatten()).backward()
    model.optimizer.step()
    opt = model.optimizer
    mine = {"params": opt.shards, "optimizer": opt.state_dict()}          # this rank's shards, nothing else
    dl.checkpoint.save(directory, 1, mine, replicated={"buffers": dict(model.module.named_buffers())})
    back = dl.checkpoint.load(directory)                                   # weights_only=True, sha256 checked
    return {"keys": sorted(back), "identical": all(torch.equal(a, b) for a, b in zip(opt.shards, back["params"])),
            "adam_state": sorted(back["optimizer"]["optimizer"]["state"][0]),
            "elements": sum(s.numel() for s in opt.shards), "buckets": len(opt.shards)}


run = dl.launch(zero3_save_and_load, world_size=N, args=(str(CKPT / "by_hand"),), output="quiet")
for r, res in enumerate(run.results):
    print(f"rank {r}: loaded {res['keys']}, Adam state {res['adam_state']}, {res['elements']} parameter "
          f"elements of {PSI}, identical to what it saved: {res['identical']}")
assert all(res["identical"] for res in run.results)
padding = sum(res["elements"] for res in run.results) - PSI                  # < N per flat bucket
assert 0 <= padding < N * run.results[0]["buckets"]

# %% [markdown]
# ## 5. Who writes what: the layout, and bytes per rank
#
# Inside a complete checkpoint: one file per rank and the manifest. Under ZeRO-2 every rank owns 1/N of Adam's
# moments (8Ψ/N bytes in fp32), so every rank writes its shard, in parallel. The parameters are *replicated* on
# every rank, so only rank 0 writes them (4Ψ): writing N copies would be waste. The manifest records, for each
# rank, where to read its replicated state from.

# %%
layout(CKPT / "step_8")
m = dl.checkpoint.manifest(CKPT, 8)
print(f"manifest: step {m['step']}, world_size {m['world_size']}, strategy {m['meta']['strategy']!r}, "
      f"replicated state read from ranks {[s['replicated_from'] for s in m['shards']]}")

# %% [markdown]
# Predicted bytes per rank from `dl.theory.memory(Ψ, dp=N, zero=stage, precision="fp32", optimizer="adam")`,
# whose `params` and `optimizer` fields are what each rank holds, hence what it must save:
#
#     strategy   rank 0 saves                    ranks 1..N-1 save
#     ddp        params 4Ψ + optimizer 8Ψ        nothing (the replicas are identical)
#     zero1/2    params 4Ψ + optimizer 8Ψ/N      optimizer 8Ψ/N   (gradients are not saved: ZeRO-2 = ZeRO-1 here)
#     zero3      params 4Ψ/N + optimizer 8Ψ/N    the same: every rank 12Ψ/N
#
# We save one step of each strategy, in one launch, by calling on every rank the very `train_rank` that `dl.train`
# runs there, and compare. The file format adds a little (zip headers, the pickled structure, Adam's step
# counters, the loss history), and ZeRO pads each flat bucket to a multiple of N.

# %%
from distlab.strategies import load, parse

STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def save_every_strategy(root):
    for strategy in STAGES:
        spec = parse(strategy, model=MODEL, steps=1, seed=0, checkpoint_dir=f"{root}/{strategy}",
                     checkpoint_every=1)
        load(strategy)(spec)


def predicted_bytes(strategy):
    b = dl.theory.memory(PSI, dp=N, zero=STAGES[strategy], precision="fp32", optimizer="adam")
    if strategy == "ddp":
        return [b.params + b.optimizer] + [0] * (N - 1)
    if strategy == "zero3":
        return [b.params + b.optimizer] * N
    return [b.params + b.optimizer] + [b.optimizer] * (N - 1)


dl.launch(save_every_strategy, world_size=N, args=(str(CKPT / "sizes"),), output="quiet")
measured, predicted = {}, {}
for strategy in STAGES:
    measured[strategy] = [s["bytes"] for s in dl.checkpoint.manifest(CKPT / "sizes" / strategy)["shards"]]
    predicted[strategy] = predicted_bytes(strategy)
    print(f"{strategy:6} measured  " + "  ".join(f"{x:>9,}" for x in measured[strategy]))
    print(f"{'':6} predicted " + "  ".join(f"{x:>9,.0f}" for x in predicted[strategy]))

# %%
KIB = 1024
for strategy in STAGES:
    for r, (got, want) in enumerate(zip(measured[strategy], predicted[strategy])):
        assert want <= got <= 1.05 * want + 16 * KIB, (strategy, r, got, want)   # format overhead: < 5% + 16 KiB
zero3 = measured["zero3"]
print(f"ZeRO-3: each rank writes {min(zero3) / sum(zero3):.3f} to {max(zero3) / sum(zero3):.3f} of the checkpoint "
      f"(1/N = {1 / N})")
print(f"total on disk / DDP's: " + ", ".join(f"{s} {sum(measured[s]) / sum(measured['ddp']):.2f}" for s in STAGES))
assert max(zero3) / sum(zero3) < 1 / N + 0.01

# %%
fig, ax = plt.subplots(figsize=(9, 3.5))
width = 0.8 / N
for i, strategy in enumerate(STAGES):
    for r in range(N):
        x = i + (r - (N - 1) / 2) * width
        ax.bar(x, measured[strategy][r] / KIB, width * 0.9, color=f"C{r}", label=f"rank {r}" if i == 0 else None)
        ax.plot([x - width / 2, x + width / 2], [predicted[strategy][r] / KIB] * 2, color="k", lw=1.5)
ax.set_xticks(range(len(STAGES)), list(STAGES))
ax.set_ylabel("KiB written")
ax.set_title(f"Checkpoint bytes per rank, {MODEL}, N = {N} (bars measured, black lines dl.theory)")
ax.legend(ncols=N, fontsize=8)
plt.show()

# %% [markdown]
# ### Model parallelism: each rank writes the part it holds
#
# Tensor and pipeline parallelism split the *parameters* themselves, so there is no one copy for rank 0 to write:
# every model-parallel rank writes its own part, as DeepSpeed's `mp_rank_*` files do. In a 3D mesh the dp replicas
# of a stage hold identical copies again, so per stage only the first dp rank writes the model and (with DDP) its
# optimizer state. Here `3d:dp=2,tp=1,pp=2` on 4 ranks: ranks 0 and 1 are pipeline stages 0 and 1 of replica 0,
# ranks 2 and 3 the same stages of replica 1 (`dl.parallel.mesh` orders tp fastest, then pp, then dp).
#
# **Prediction:** a writing rank saves 12 bytes per parameter of its stage (fp32 weights 4 + Adam's two moments
# 8, `dl.theory.memory`); the other replica's ranks save only their loss history and their layout (a few KB).

# %%
MESH = "3d:dp=2,tp=1,pp=2"
mesh_run = dl.train(MESH, world_size=N, model=MODEL, steps=2, checkpoint_dir=str(CKPT / "mesh"), checkpoint_every=2)
shards = dl.checkpoint.manifest(CKPT / "mesh", 2)["shards"]
mesh_measured = [s["bytes"] for s in shards]
stage_params = [res.info["param_bytes"] // 4 for res in mesh_run.results]         # fp32: 4 bytes each
mesh_predicted = []
for r, (s, params) in enumerate(zip(shards, stage_params)):
    m = dl.theory.memory(params, precision="fp32", optimizer="adam")
    mesh_predicted.append(m.params + m.optimizer if s["replicated_from"] == r else 0)
for r in range(N):
    print(f"rank {r}: stage params {stage_params[r]:>6,}  writes the stage: {shards[r]['replicated_from'] == r!s:5}  "
          f"measured {mesh_measured[r]:>7,} bytes  predicted {mesh_predicted[r]:>7,.0f}")
for got, want in zip(mesh_measured, mesh_predicted):
    assert want <= got <= 1.05 * want + 16 * KIB, (got, want)

# %% [markdown]
# ## 6. Resharding: resume on fewer ranks
#
# A node is gone for good and the job restarts on 3 ranks instead of 4. A checkpoint's shards belong to the ranks
# that wrote them: ZeRO rank 2's file holds the optimizer state of the third slice of each flat bucket *for N = 4*,
# meaningless under another N. So `dl.checkpoint.load`, which reads one rank's own file, refuses a world of another
# size; this notebook's process is a world of one:

# %%
try:
    dl.checkpoint.load(CKPT)
except dl.checkpoint.CheckpointError as err:
    print(str(err).replace(str(CKPT), "<checkpoint_dir>"))

# %% [markdown]
# What makes the shards readable anyway is the **layout** each ZeRO rank saves beside them: per flat bucket, the
# parameters' names and shapes in bucket order and the shard size. Concatenating the N shards in rank order gives
# the padded bucket back; cutting it at the parameters' offsets gives one tensor per name. That is
# `dl.checkpoint.consolidate` (DeepSpeed's `zero_to_fp32.py` does the same from its `param_shapes`), and what
# `resume=True` uses when the world size, the strategy or the layout changed: it rebuilds this logical state
# from every rank's file and cuts it again for the new layout.

# %%
full = dl.checkpoint.consolidate(CKPT, 4)
moments = sum(v.numel() for state in full["optimizer"].values() for k, v in state.items() if k != "step")
print(f"step {full['step']}, saved by {full['world_size']} ranks with {full['strategy']}: "
      f"{len(full['params'])} parameter tensors, {sum(v.numel() for v in full['params'].values())} elements; "
      f"Adam moments {moments} elements (2 per parameter), Adam step {full['optimizer']['tok.weight']['step'].item():g}")
assert sum(v.numel() for v in full["params"].values()) == PSI and moments == 2 * PSI

# %% [markdown]
# **Prediction:** resuming step 4 of the 4-rank ZeRO-2 run as ZeRO-1 on **3** ranks continues the same training:
# the same parameters and optimizer state, the same global batches. Only the order in which gradients are summed
# changes (three partial sums instead of four), so the losses equal the uninterrupted run's up to float32 rounding,
# within 1e-5 relative, but no longer bit for bit.

# %%
elastic = dl.train("zero1", world_size=3, model=MODEL, steps=STEPS, seed=0, checkpoint_dir=str(CKPT), resume=4)
worst = max(abs(a - b) / b for a, b in zip(elastic.losses, reference.losses))
print(f"resumed from step {elastic.results[0].info['checkpoint']['resumed_from']} on 3 ranks; "
      f"largest relative loss difference over {STEPS} steps: {'< 1e-5' if worst < 1e-5 else worst}")
assert elastic.results[0].info["checkpoint"]["resumed_from"] == 4
assert worst < 1e-5

# %% [markdown]
# Model-parallel ranks save their layout too: for each parameter they hold, its name in the full model and which
# block of it (Megatron's layers give tensor-parallel rank r the r-th equal block along one dimension). So the 3D
# checkpoint of section 5, pipeline stages on 2 ranks times 2 replicas, opens as **tensor parallelism on 2 ranks**,
# where every weight matrix is cut by rows or columns instead of by layers. **Prediction:** resharding only copies,
# so the parameters the tensor-parallel run holds, gathered back, equal the consolidated checkpoint bit for bit.

# %%
mesh_full = dl.checkpoint.consolidate(CKPT / "mesh")
as_tp = dl.train("tp", world_size=2, model=MODEL, steps=2, checkpoint_dir=str(CKPT / "mesh"), resume=2)
same = as_tp.params.keys() == mesh_full["params"].keys() and all(
    torch.equal(as_tp.params[k], v) for k, v in mesh_full["params"].items())
print(f"{MESH} checkpoint resumed as tp on 2 ranks: all {len(mesh_full['params'])} parameter tensors identical: {same}")
assert same

# %%
import shutil
shutil.rmtree(CKPT)                       # this lesson's checkpoints were in a temporary directory

# %% [markdown]
# ## How the big frameworks do it
#
# * **PyTorch Distributed Checkpoint** (`torch.distributed.checkpoint`, DCP): every rank saves its shards, rank 0
#   writes a `.metadata` file describing each tensor's global shape and each shard's offsets, so a checkpoint can
#   be **resharded** on load to another world size or parallel layout (section 6 did the same for ZeRO). `async_save` copies to CPU, then writes in
#   the background while training goes on.
# * **DeepSpeed** writes `mp_rank_*_model_states.pt` (the model, once per model-parallel rank) and one
#   `zero_pp_rank_*_optim_states.pt` per data-parallel rank (the ZeRO shards), exactly the split above; a `latest`
#   file names the newest tag, and `zero_to_fp32.py` consolidates the shards into one state dict.
# * **Megatron-LM** writes `iter_NNNNNNN/mp_rank_XX/` directories and updates `latest_checkpointed_iteration.txt`
#   only after all ranks finish, the same publish-last idea as our rename; its `dist_checkpointing` adds resharding.
#
# ## What to remember
#
# * Save what the next step depends on: parameters, optimizer state, step, loss history; data as a function of step.
# * Each rank writes what it **owns**: replicated state once, ZeRO shards from every rank (about 1/N each for ZeRO-3).
# * Write to `.tmp`, fsync, then **rename**: a crash leaves either the old checkpoint set or the new one, never a
#   torn one. Verify with checksums; load with `weights_only=True`.
# * A resumed run is the uninterrupted run, bit for bit: checked here after killing a rank mid-save.
# * With the layout saved beside the shards, a checkpoint can be **resharded**: consolidated into one tensor per
#   name, resumed on another world size or parallel layout (equal up to rounding).
#
# **Try it**: change `fail_at_step=6` to `fail_at_step=5, fail_in="step"` (a crash during training, not during a
# save): which checkpoint does the resume start from, and which steps does it redo?

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
# **atomic_save**: atomic_save(obj, path): save so that a crash in the middle of the write leaves the previous file at path complete

# %% nbgrader={"grade": false, "grade_id": "atomic_save", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def atomic_save(obj, path) -> None:
    """``torch.save`` to a temporary name in the same folder, flush and fsync, then ``os.replace`` onto
    ``path``: a reader sees the old file or the new one, never half of one."""
    ### BEGIN SOLUTION
    import os
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_atomic_save", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("atomic_save", atomic_save).require();
