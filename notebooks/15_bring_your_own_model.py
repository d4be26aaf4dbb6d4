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
# # 15 · Bring your own model: a Hugging Face Llama through every layout
#
# Lessons 02-09 trained distlab's tiny GPT. Your model is probably a `transformers` one. This lesson takes a
# `LlamaForCausalLM` built from a small `LlamaConfig` (random weights, nothing downloaded) through the layouts
# you would use on it, each time with **the same** AdamW steps on **the same global batch** as one process:
#
# | § | layout | ranks | what you write |
# |---|--------|-------|----------------|
# | 1 | data parallel | 2 | `dl.DDP(model)` |
# | 2 | fully sharded, recomputing, clipped | 2 | `dl.recompute(layer)`, `dl.fully_shard(layer)`, `dl.clip_grad_norm_(model, c)` |
# | 3 | tensor parallel by a plan | 2 | `dl.tp.parallelize(model, plan=PLAN)` |
# | 4 | a pipeline cut between decoder layers | 2 | `dl.pp.cut(dl.pp.chain(model), at=["model.layers.2"])` |
# | 5 | 2D: tensor x fully sharded | 4 | torch's `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))` |
# | 6 | the sharded checkpoint, back to Hugging Face | 2 -> 1 | `dl.checkpoint.save`, `export`, `from_pretrained` |
#
# Each section states a prediction and asserts the measurement: the losses (and the clipped gradient norms) equal
# one process's, and each rank's parameter, gradient and optimizer bytes equal what the layout's formula says, to
# the byte (for the pipeline: the parameters of each stage). The whole lesson runs in well under a minute on 2
# CPU cores.
#
# **What changes from the tiny GPT.** Nothing in the wrappers: `dl.DDP` and `dl.fully_shard` take any
# `nn.Module`. What is new is *naming*: a tensor-parallel plan names the Llama's own projections
# (`model.layers.*.self_attn.q_proj`...), and a pipeline cuts at the names `dl.pp.chain` lists. And three things
# to watch for, each met below: the model returns a `ModelOutput` (take `.logits`), its attention splits
# **whole heads** per rank, and a **tied** embedding and head (`tie_word_embeddings=True`) cannot be cut apart
# by a pipeline.
#
# **The code, in reading order**: [ddp.py](../distlab/parallel/data/ddp.py);
# [fsdp.py](../distlab/parallel/zero/fsdp.py) with [fsdp_unit.py](../distlab/parallel/zero/fsdp_unit.py),
# [recomputation.py](../distlab/recomputation.py) and [clip.py](../distlab/parallel/clip.py);
# [plan.py](../distlab/parallel/tensor/plan.py) (a plan applied to any model) with
# [adapt.py](../distlab/parallel/tensor/adapt.py); [named.py](../distlab/parallel/pipeline/named.py) and
# [decoders.py](../distlab/parallel/pipeline/decoders.py) (what a Hugging Face block needs from its parent);
# [mesh.py](../distlab/parallel/mesh.py); [checkpoint/api.py](../distlab/checkpoint/api.py). Memory is read from
# outside by [memory.py](../distlab/memory.py), predictions come from
# [theory/memory.py](../distlab/theory/memory.py).

# %%
import math
import shutil
import tempfile
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it with the first optimizer: here, once, not in each rank)
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging
from transformers.models.llama import modeling_llama  # noqa: F401  (imported lazily otherwise: in every rank)

import distlab as dl
from distlab.memory import fsdp_memory, replica_memory

CONFIG = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
BATCH, SEQ, STEPS, LR, MAX_NORM = 4, 8, 3, 1e-2, 0.5
TMP = Path(tempfile.mkdtemp(prefix="distlab_15_"))
hf_logging.disable_progress_bar()                # from_pretrained's bar: timings in the output


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)                         # the same full weights on every rank and in the reference
    return LlamaForCausalLM(CONFIG)


def data(step: int):
    """The global batch of ``step``: inputs and next-token targets, (BATCH, SEQ) each."""
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def loss_of(model, x, y):
    logits = model(input_ids=x).logits           # a ModelOutput: take .logits, (b, SEQ, vocab)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def reference():
    """One process, the whole batch: losses and gradient norms (torch's clip, on whole parameters)."""
    model = build()
    opt, losses, norms = torch.optim.AdamW(model.parameters(), lr=LR), [], []
    for step in range(STEPS):
        loss = loss_of(model, *data(step))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


REF_LOSSES, REF_NORMS = reference()
PSI = sum(p.numel() for p in build().parameters())
print(f"Llama: {CONFIG.num_hidden_layers} decoder layers, hidden {CONFIG.hidden_size}, "
      f"{CONFIG.num_attention_heads} heads ({CONFIG.num_key_value_heads} key-value heads), "
      f"vocab {CONFIG.vocab_size}: Psi = {PSI:,} parameters")
print("one process, losses:", [round(v, 3) for v in REF_LOSSES])
print("one process, gradient norms before clipping:", [round(v, 2) for v in REF_NORMS])


def my_rows(x, y, n, r):
    """Data parallelism: rank r of n takes rows r::n of the global batch (equal halves: the mean of the
    ranks' losses is the global loss, and the averaged gradient the global gradient)."""
    return x[r::n], y[r::n]


def train(model, opt, batch_of, measure=None):
    """STEPS AdamW steps, clipped by dl.clip_grad_norm_; returns (losses, norms, memory after the last step)."""
    losses, norms, mem = [], [], None
    for step in range(STEPS):
        loss = loss_of(model, *batch_of(step))
        loss.backward()
        norms.append(dl.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        if measure is not None and step == STEPS - 1:
            mem = measure()                      # gradients still held, optimizer state built
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, mem


def mean_over(losses, group=None):
    """The mean over the data-parallel ranks of each step's loss (what one process sees)."""
    t = torch.tensor(losses)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


REL = 1e-5      # fp32 sums in another order (split matmuls, all-reduces) differ by ~1e-7 relative


def close(got, want, rel=REL) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want))


def same_as_one_process(name, losses, norms=None):
    assert close(losses, REF_LOSSES), (name, losses, REF_LOSSES)
    if norms is not None:
        assert close(norms, REF_NORMS), (name, norms, REF_NORMS)
    print(f"{name}: losses equal one process's within {REL:.0e} relative" +
          (", and so do the gradient norms" if norms is not None else ""))


def state_bytes(mem):
    return {k: mem[k] for k in ("params", "grads", "optimizer")}


# %% [markdown]
# ## 1. Data parallelism: `dl.DDP(model)`
#
# Nothing Llama-specific: every rank builds the same model (same seed), `dl.DDP` wraps it, and each rank
# trains on its half of the batch; gradients are averaged in buckets while backward runs. Memory is that of one
# process: the whole model on every rank. The prediction, `dl.theory.memory(Psi, dp=2, zero=0,
# precision="fp32")`: 4 bytes a parameter, 4 a gradient, 8 of Adam moments; the measurement adds what no
# formula of the ZeRO paper counts, AdamW's `step` counter, a 4-byte tensor per parameter tensor.

# %%
def ddp():
    n, r = dl.world_size(), dl.rank()
    model = dl.DDP(build())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, mem = train(model, opt, lambda s: my_rows(*data(s), n, r),
                               replica_memory(model.module, opt))
    return {"losses": mean_over(losses), "norms": norms, "memory": state_bytes(mem)}


run = dl.launch(ddp, world_size=2)
for r, res in enumerate(run.results):
    same_as_one_process(f"DDP rank {r}", res["losses"], res["norms"])

TENSORS = len(list(build().parameters()))
b = dl.theory.memory(PSI, dp=2, zero=0, precision="fp32", optimizer="adam")
PREDICTED_DDP = {"params": b.params, "grads": b.grads, "optimizer": b.optimizer + 4 * TENSORS}
print("DDP bytes per rank, measured :", run.results[0]["memory"])
print("DDP bytes per rank, predicted:", PREDICTED_DDP)
assert all(res["memory"] == PREDICTED_DDP for res in run.results)

# %% [markdown]
# ## 2. Fully sharded, recomputing, clipped
#
# FSDP2's recipe (lesson 09) on a Llama: each decoder layer is a unit, then the root (embeddings, final norm,
# head). `dl.recompute(layer)` marks a layer for activation recomputation *before* it is sharded (the order of
# the two does not matter to distlab; torchtitan's is this one); Hugging Face's own switch,
# `model.gradient_checkpointing_enable()`, works too.
#
#     for layer in model.model.layers:
#         dl.recompute(layer)            # its activations are rebuilt in backward, one layer at a time
#         dl.fully_shard(layer)          # its parameters: rows [r c, (r+1) c) of each, c = ceil(d0 / N)
#     dl.fully_shard(model)
#     opt = torch.optim.AdamW(model.parameters())      # built on the shards, after sharding
#
# **Clipping is the trap.** After backward each rank holds the gradient of its *shard*.
# `torch.nn.utils.clip_grad_norm_(model.parameters(), c)` computes the norm of what it is given, this rank's
# part, and clips each rank by a different factor: a silently wrong update. `dl.clip_grad_norm_(model, c)`
# sums the squares over the shards (one all-reduce) and clips every rank by the global norm. Prediction: the
# shard norms differ from rank to rank, are each smaller than the global norm, their squares add up to its
# square, and the global one equals the single-process norm. Recomputation changes no number: the losses and
# norms of every step equal one process's.
#
# Memory: every rank holds its rows of each parameter, so a rank's bytes are the sum over parameters of
# `rows_r x (elements per row)`, `rows_r` being `c` except on the last ranks; with every first dimension even
# here, exactly `Psi / 2` elements of each kind, what `dl.theory.memory(..., zero=3)` says.

# %%
def fsdp():
    n, r = dl.world_size(), dl.rank()
    model = build()
    for layer in model.model.layers:
        dl.recompute(layer)
        dl.fully_shard(layer)
    dl.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    x, y = my_rows(*data(0), n, r)               # step 0's gradients, to look at the norms before clipping
    loss_of(model, x, y).backward()
    grads = [p.grad for p in model.parameters()]
    torch_norm = torch.nn.utils.get_total_norm(grads).item()   # what torch.nn.utils.clip_grad_norm_ computes
    opt.zero_grad()

    losses, norms, mem = train(model, opt, lambda s: my_rows(*data(s), n, r), fsdp_memory(model, opt))
    dl.checkpoint.save(TMP / "fsdp", STEPS, model=model, optimizer=opt)   # every rank writes its shards
    with torch.no_grad():                                                  # the trained model's logits
        logits = model(input_ids=data(STEPS)[0]).logits
    return {"losses": mean_over(losses), "norms": norms, "torch_norm": torch_norm,
            "memory": state_bytes(mem), "logits": logits, "full": dl.full_state_dict(model)}


run_fsdp = dl.launch(fsdp, world_size=2)
res = run_fsdp.results
for r in range(2):
    same_as_one_process(f"fully_shard + recompute + dl.clip_grad_norm_, rank {r}", res[r]["losses"], res[r]["norms"])
shard_norms = [res[r]["torch_norm"] for r in range(2)]
print("step 0 gradient norm: torch's clip on each rank's shards", [round(v, 4) for v in shard_norms],
      f"| dl.clip_grad_norm_ {res[0]['norms'][0]:.4f} | one process {REF_NORMS[0]:.4f}")
assert all(v < REF_NORMS[0] * (1 - 1e-3) for v in shard_norms)                # each shard's is too small
assert close([math.hypot(*shard_norms)], [REF_NORMS[0]])                  # squares add up

# %% [markdown]
# The memory, measured (storages of the shards, their gradients and AdamW's state, read from outside by
# `fsdp_memory`) beside the prediction from the shapes alone:

# %%
def fsdp_rows(shape, n, r):
    """Rows of a parameter of ``shape`` that rank r of n holds: [r c, (r+1) c) clipped to d0."""
    c = math.ceil(shape[0] / n)
    return max(0, min(shape[0], (r + 1) * c) - r * c)


def fsdp_prediction(shapes, n, r):
    """Bytes of rank r of n: its own rows of each parameter (fp32), their AdamW moments and step counters;
    gradients as the reduce-scatter delivers them, c rows of each, the padding included:
    (sum of numels + dl.theory.fsdp_padding) / n elements."""
    own = sum(fsdp_rows(s, n, r) * math.prod(s[1:]) for s in shapes)
    padded = sum(math.prod(s) for s in shapes) + dl.theory.fsdp_padding(shapes, n)
    return {"params": 4 * own, "grads": 4 * padded // n, "optimizer": 8 * own + 4 * len(shapes)}


SHAPES = [tuple(p.shape) for p in build().parameters()]
b = dl.theory.memory(PSI, dp=2, zero=3, precision="fp32", optimizer="adam")
print(f"dl.theory.memory(Psi, dp=2, zero=3): params {b.params:,.0f}, grads {b.grads:,.0f}, "
      f"optimizer {b.optimizer:,.0f} (+ {4 * len(SHAPES)} for the step counters)")
for r in range(2):
    want = fsdp_prediction(SHAPES, 2, r)
    print(f"rank {r}: measured {res[r]['memory']}, predicted {want}")
    assert res[r]["memory"] == want
assert want["params"] == b.params and want["optimizer"] == b.optimizer + 4 * len(SHAPES)   # no padding here

# %% [markdown]
# ## 3. Tensor parallelism by a plan
#
# Megatron's split (lesson 04) applied to a model distlab has never seen: a **plan** maps module names
# (wildcards allowed) to a style. In each decoder layer, q, k, v and the MLP's gate and up projections are
# column-parallel (each rank computes some heads, some hidden units), o and down row-parallel (their partial
# sums all-reduced); the embedding is split by vocabulary rows, the head by output rows then gathered.
#
# Llama's attention reads its head count from the tensor it gets (`view(..., -1, head_dim)`), so a rank with
# half of q's rows simply runs half of the heads: no change to the model. Two things to watch:
#
# * **whole heads per rank**: tp must divide `num_attention_heads` *and* `num_key_value_heads` (here 4 and 2:
#   tp = 2 works, tp = 4 is refused with the valid degrees listed);
# * **tensor parallelism first, then data parallelism** (§5): `parallelize` replaces the projections' weights
#   by their blocks, which a module already `fully_shard`-ed no longer has (refused, saying so).
#
# Every rank sees the whole batch. Norm weights are not in the plan: they stay whole on every rank, so a
# rank's parameters are *not* Psi / 2: the prediction counts each planned weight over 2 and the rest whole.

# %%
PLAN = {"model.embed_tokens": "embedding",
        "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather"}


def tp():
    model = dl.tp.parallelize(build(), plan=PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, mem = train(model, opt, data, replica_memory(model, opt))
    return {"losses": losses, "norms": norms, "memory": state_bytes(mem)}


def tp_shapes(tp, names_shapes=None):
    """Each parameter's shape on a tensor-parallel rank, from the plan: colwise and embedding split dim 0,
    rowwise dim 1 (Linear's input features), everything else whole."""
    import fnmatch
    out = []
    for name, p in (names_shapes or build().named_parameters()):
        module = name.rsplit(".", 1)[0]
        style = next((s for pat, s in PLAN.items() if fnmatch.fnmatchcase(module, pat)), None)
        shape = list(p.shape)
        if style in ("colwise", "colwise_gather", "embedding"):
            shape[0] //= tp
        elif style == "rowwise":
            shape[1] //= tp
        out.append(tuple(shape))
    return out


run_tp = dl.launch(tp, world_size=2)
TP_SHAPES = tp_shapes(2)
numel = sum(math.prod(s) for s in TP_SHAPES)
PREDICTED_TP = {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel + 4 * len(TP_SHAPES)}
for r, res in enumerate(run_tp.results):
    same_as_one_process(f"tensor parallel by plan, rank {r}", res["losses"], res["norms"])
    assert res["memory"] == PREDICTED_TP
print("tp bytes per rank, measured :", run_tp.results[0]["memory"])
print("tp bytes per rank, predicted:", PREDICTED_TP)
b = dl.theory.memory(PSI, tp=2, precision="fp32", optimizer="adam")       # assumes every parameter splits
norms = sum(p.numel() for n, p in build().named_parameters() if "norm" in n)
print(f"dl.theory.memory(Psi, tp=2): {b.params / 4:,.0f} parameters a rank; the {norms} norm weights stay whole: "
      f"+ {norms // 2} = {numel:,}")
assert run_tp.results[0]["memory"]["params"] == b.params + 4 * norms // 2

# %% [markdown]
# ## 4. A pipeline cut between decoder layers
#
# A pipeline needs the model as a *chain* of modules, each feeding the next. A Hugging Face decoder is one,
# except for what its parent hands every layer: the rotary `position_embeddings`, the positions, the causal
# mask. `dl.pp.chain(model)` recognises the family and lists `model.embed_tokens, model.layers.0, ...,
# model.norm, lm_head`; a stage built by `dl.pp.named_stage(model, names)` recomputes what its layers need from
# the tensor it receives. `dl.pp.cut(chain, at=["model.layers.2"])` puts two layers on each of 2 stages.
#
# Watch for: a **tied** embedding and head (`tie_word_embeddings=True`, GPT-2's default) would live on the
# first *and* the last stage, one parameter on two ranks: `dl.pp.check_stages` refuses it; untie it (as this
# config does). And a stage that returns a `ModelOutput` (say `model.model` whole as a stage) passes on its
# `last_hidden_state`; `named_stage(..., output="name")` picks another field.
#
# The last stage computes the loss of each microbatch (cross-entropy on the logits, the same as `loss_of`);
# `dl.clip_grad_norm_(stage, c)` adds the stages' squares into the whole model's norm.

# %%
CHAIN = dl.pp.chain(build())
STAGES = dl.pp.cut(CHAIN, at=["model.layers.2"])
print("chain:", CHAIN)
print("stages:", STAGES)
try:
    tied = LlamaForCausalLM(LlamaConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True}))
    dl.pp.check_stages(tied, dl.pp.cut(dl.pp.chain(tied), at=["model.layers.2"]))
except ValueError as e:
    print("tied:", e)


def pipeline():
    r, model = dl.rank(), build()
    stage = dl.pp.named_stage(model, STAGES[r])
    pipe = dl.pp.Pipeline(stage, r, 2, schedule="1f1b", microbatches=2)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = data(step)
        loss = pipe.step(x if pipe.first else None, y if pipe.last else None)
        norms.append(dl.clip_grad_norm_(stage, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    return {"losses": losses, "norms": norms, "params": sum(p.numel() for p in stage.parameters())}


run_pp = dl.launch(pipeline, world_size=2)
same_as_one_process("pipeline, last stage", run_pp.results[1]["losses"], run_pp.results[1]["norms"])
assert run_pp.results[0]["norms"] == run_pp.results[1]["norms"]          # one global norm on both stages
held = [res["params"] for res in run_pp.results]
print("parameters per stage:", held)
assert sum(held) == PSI

# %% [markdown]
# ## 5. Two dimensions: tensor x fully sharded on torch's `DeviceMesh`
#
# torchtitan's composition: 4 ranks as a 2 x 2 mesh, tensor parallelism along `tp` (ranks next to each other:
# on GPUs, inside a node) and `fully_shard` along `dp`. distlab takes torch's `DeviceMesh` (or its own
# `dl.Mesh(dp=2, tp=2)`) wherever it takes a group: `mesh["tp"]` for the plan, `mesh["dp"]` for the shards.
# The order is the one warned about in §3: **tensor parallelism first**, then `fully_shard` over the blocks.
#
#     rank:   tp=0  tp=1
#     dp=0     0     1        each row: one tensor-parallel model, half of the batch
#     dp=1     2     3        each column: the same tp block, sharded by rows over dp
#
# Prediction per rank: the tensor-parallel shapes of §3, then each cut by rows over dp=2. The vocabulary, 50,
# gives 25 rows per tp rank, and 25 rows do not split in two: c = 13 rows on dp rank 0, 12 on dp rank 1.
# FSDP2 pads each parameter to `N c` rows for its collectives (`dl.theory.fsdp_padding`: here one row of the
# embedding and one of the head). A rank *stores* only its own rows, so dp rank 1 holds less parameter and
# optimizer memory than dp rank 0; but its gradients arrive from the reduce-scatter as a padded chunk of c rows,
# of which `.grad` is a view: every rank's gradient storage is `(numel + padding) / N`.
#
# With 4 ranks at hand, the two mistakes of §3 are tried too: tp = 4 over 2 key-value heads, and a plan applied
# to a model already `fully_shard`-ed. Each is refused with what to do instead.

# %%
def mesh_2d():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d = mesh.get_local_rank("dp")
    model = dl.tp.parallelize(build(), plan=PLAN, group=mesh["tp"])      # first: tensor parallelism
    for layer in model.model.layers:
        dl.fully_shard(layer, group=mesh["dp"])                         # then: shard the tp blocks over dp
    dl.fully_shard(model, group=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, mem = train(model, opt, lambda s: my_rows(*data(s), 2, d), fsdp_memory(model, opt))
    return {"losses": mean_over(losses, mesh["dp"].get_group()), "norms": norms, "dp": d,
            "memory": state_bytes(mem), "refused": refusals()}


def refusals():
    """The two mistakes of §3, on 4 ranks: tp = 4 over 2 key-value heads, and tp after fully_shard."""
    said = []
    try:
        dl.tp.parallelize(build(), plan=PLAN)                          # tp over all 4 ranks
    except ValueError as e:
        said.append(str(e))
    sharded = build()
    dl.fully_shard(sharded)
    try:
        dl.tp.parallelize(sharded, plan=PLAN)
    except ValueError as e:
        said.append(str(e))
    return said


run_2d = dl.launch(mesh_2d, world_size=4)
print(f"dl.theory.fsdp_padding(tp shapes, 2) = {dl.theory.fsdp_padding(TP_SHAPES, 2)} padding elements "
      "(one row of the embedding's and of the head's block)")
for r, res in enumerate(run_2d.results):
    same_as_one_process(f"tp x fully_shard, rank {r}", res["losses"], res["norms"])
    want = fsdp_prediction(TP_SHAPES, 2, res["dp"])
    print(f"rank {r} (dp {res['dp']}): measured {res['memory']}, predicted {want}")
    assert res["memory"] == want
heads, order = run_2d.results[0]["refused"]
print("tp=4:", heads)
print("tp after fully_shard:", order)
assert "do not split over tp=4" in heads and "apply tensor parallelism first, then fully_shard" in order

# %% [markdown]
# ## 6. The sharded checkpoint, back into Hugging Face
#
# In §2 every rank called `dl.checkpoint.save(directory, step, model=model, optimizer=opt)`: each wrote its own
# rows, and the manifest records the cut (`fully_shard`'s rows of each parameter), so the checkpoint can be
# loaded into any other layout at any world size (`dl.checkpoint.load(directory, model=..., optimizer=...)`), or
# consolidated in one process. For Hugging Face, `dl.checkpoint.export(directory, folder)` writes
# `folder/model.safetensors` with the model's own parameter names (a tied weight once, as `save_pretrained`
# does); beside the config's `config.json` it is a folder `from_pretrained` loads.
#
# Prediction: the reloaded model's logits equal those the sharded model computed on the ranks, bit for bit
# (the same weights, the same arithmetic).

# %%
from distlab.launch.parent import threads_per_rank

folder = TMP / "hf"
CONFIG.save_pretrained(folder)                              # config.json
print("exported", dl.checkpoint.export(TMP / "fsdp", folder).name)
back = LlamaForCausalLM.from_pretrained(folder).eval()
threads = torch.get_num_threads()
torch.set_num_threads(threads_per_rank(2))    # as many threads as each of the 2 ranks: sums in the same order
with torch.no_grad():
    logits = back(input_ids=data(STEPS)[0]).logits
torch.set_num_threads(threads)
full = run_fsdp.results[0]["full"]                          # dl.full_state_dict on the ranks
assert all(torch.equal(back.state_dict()[k], v) for k, v in full.items())
for r in range(2):
    assert torch.equal(logits, run_fsdp.results[r]["logits"])
print(f"from_pretrained: {len(full)} tensors equal the gathered model's; logits {tuple(logits.shape)} equal "
      "bit for bit on both ranks")

# %% [markdown]
# ## What to take away
#
# * Your model needs no change: `dl.DDP`, `dl.fully_shard`, a tp plan, a pipeline cut and a mesh take it as it is;
#   what you supply are **names** (the plan's, the cut's).
# * Apply **tensor parallelism first**, data parallelism last; tp must split **whole heads** (query and
#   key-value); a pipeline cannot split a **tied** embedding from its head; take `.logits` from the `ModelOutput`.
# * Clip with `dl.clip_grad_norm_`: torch's clip on shards uses this rank's part of the norm, silently.
# * Check the layout the way this lesson did: the same global batch in one process, losses within rounding, and
#   each rank's bytes equal to what the layout says it holds.

# %%
shutil.rmtree(TMP)                               # the checkpoint and the exported folder
