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
# # 09 · FSDP2 and HSDP: one shard per parameter, and sharding inside a node
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# Lesson 03 built ZeRO-3 the way DeepSpeed and PyTorch's first FSDP do: each *unit* (a transformer block, the
# root) flattens its parameters into **one padded buffer**, and rank r keeps chunk r of it. PyTorch's current
# answer, **FSDP2** (`torch.distributed.fsdp.fully_shard`; Zhao et al. 2023, *PyTorch FSDP*, and the per-parameter
# rewrite of it), keeps every parameter a parameter and shards **each one on dim 0**:
#
#     FSDP1 / ZeRO-3 (flat)                          FSDP2 (per parameter)
#     unit = [ W0 | b0 | W1 | pad ]   cut in N        W0: rows [r c0, (r+1) c0)     c0 = ceil(d0 / N)
#     rank r: chunk r (may cut W0 mid-row)            b0: rows [r c1, (r+1) c1)     ... each an nn.Parameter
#     the optimizer sees flat shards                  the optimizer sees model.parameters(): the shards
#
#     for block in model.blocks:
#         dl.fully_shard(block)                       # bottom-up: each block is a unit, then the root
#     dl.fully_shard(model)
#     opt = torch.optim.AdamW(model.parameters())     # any optimizer, built after sharding
#
# The communication is the same (gather each unit before its forward and its backward, reduce-scatter its
# gradients: 3 (N-1)/N · 4Ψ bytes per step in fp32); what changes is what a rank holds, what it must copy, and what a user can do
# with the parameters. This lesson measures each difference, then the two knobs FSDP2 adds, and **HSDP**: shard
# inside a node, replicate across nodes.
#
# **The code, in reading order**: [fsdp.py](../distlab/parallel/zero/fsdp.py) (`fully_shard`, HSDP's groups,
# `full_state_dict`), then [fsdp_unit.py](../distlab/parallel/zero/fsdp_unit.py) (one unit: gather, free,
# reduce-scatter), beside [zero3.py](../distlab/parallel/zero/zero3.py) (the flat design) and the queue they share,
# [reducer.py](../distlab/parallel/zero/reducer.py). Every collective below is recorded by
# [collectives.py](../distlab/parallel/collectives.py) (the call measured, its bytes the ring's: section 3); memory is read from outside by
# [memory.py](../distlab/memory.py); predictions come from [theory/comm.py](../distlab/theory/comm.py) and
# [theory/memory.py](../distlab/theory/memory.py).

# %%
import math
from collections import Counter

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import distlab as dl
from distlab.memory import fsdp_memory
from distlab.parallel.zero import fsdp
from distlab.parallel.zero.fsdp_unit import FSDPUnit
from distlab.parallel.zero.reducer import GradReducer
from distlab.parallel.zero.zero3 import ZeRO3

MODEL = dl.models.GPTConfig(vocab=64, seq_len=32, d_model=64, heads=4, layers=4)   # gpt-tiny, 4 blocks


def build_model():
    torch.manual_seed(0)
    return dl.models.GPT(MODEL)


DATA = dl.models.dataset_for("gpt-tiny")                      # token sequences of gpt-tiny's vocab and length
PSI = sum(p.numel() for p in build_model().parameters())
print(f"gpt-tiny with {MODEL.layers} blocks: Psi = {PSI} parameters in {len(list(build_model().parameters()))} "
      "tensors")


# %% [markdown]
# ## 1. Flat buffers or per-parameter shards: what each costs
#
# Three costs, each measured on N = 3 ranks (3 divides none of the model's dimensions, so padding shows):
#
# * **padding**: a flat unit is padded once, to a multiple of N (fewer than N elements); FSDP2 pads *every*
#   parameter to `N ceil(d0 / N)` rows. `dl.theory.fsdp_padding(shapes, N, layout)` predicts both.
# * **copy-in / copy-out**: FSDP1 all-gathers straight into the unit's flat buffer, and the parameters are
#   views of it: nothing to copy. FSDP2 must *copy in* (pack this rank's shards, padded, into one send buffer, so
#   a unit is still one all-gather) and *copy out* (cut the gathered `(N, S)` rows back into one tensor per
#   parameter).
# * **allocations** (what fragments a GPU's caching allocator): FSDP1 resizes one storage per unit, the same size
#   every step; FSDP2 allocates a send buffer, a receive buffer and one tensor per parameter, of many sizes.
#
# The copies and allocations are counted from outside: a `TorchDispatchMode` sees every aten operator run while a
# unit gathers (the collective itself excluded), and we wrap the two gather methods with it. Neither algorithm
# file knows.

# %%
class Copies(TorchDispatchMode):
    """Bytes written and fresh tensors allocated by aten operators (views, and the collectives, excluded)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and not func.is_view:
            inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                fresh = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                op = func.__name__.split(".")[0]
                in_place = isinstance(t, torch.Tensor) and not fresh and op.endswith("_")
                if fresh or in_place:
                    written = 0 if op.startswith("empty") else t.numel() * t.element_size()
                    self.log.append((op, written, fresh))
        return out


def counted(cls, name, log):
    """Run ``cls.name`` under `Copies`; a reduce-scatter retired meanwhile (make_room) is not counted."""
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        with Copies(log):
            return original(*args, **kwargs)
    setattr(cls, name, wrapped)


def quiet(cls, name):
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        with _disable_current_modes():
            return original(*args, **kwargs)
    setattr(cls, name, wrapped)


def two_layouts():
    n, r = dl.world_size(), dl.rank()
    logs = {"FSDP1 (flat)": [], "FSDP2 (per param)": []}
    counted(ZeRO3, "gather", logs["FSDP1 (flat)"])
    counted(FSDPUnit, "unshard", logs["FSDP2 (per param)"])
    quiet(GradReducer, "make_room")
    x, y = DATA.batch(0, 4 * n)
    x, y = x.chunk(n)[r], y.chunk(n)[r]

    flat_model = build_model()
    flat = dl.ZeRO(flat_model, stage=3, optim=torch.optim.AdamW, lr=1e-3, prefetch=True)
    per_param = build_model()
    for block in per_param.blocks:
        dl.fully_shard(block)
    dl.fully_shard(per_param)
    opt = torch.optim.AdamW(per_param.parameters(), lr=1e-3)
    storages = {}                    # registered after the sharding hooks: sees block 0 gathered, in forward
    for name, model in (("FSDP1 (flat)", flat_model), ("FSDP2 (per param)", per_param)):
        model.blocks[0].register_forward_pre_hook(lambda m, a, name=name: storages.__setitem__(
            name, len({p.untyped_storage().data_ptr() for p in m.parameters()})))
    steppers = {"FSDP1 (flat)": (flat, flat.optimizer), "FSDP2 (per param)": (per_param, opt)}
    for name, (model, optimizer) in steppers.items():
        for step in range(2):                        # step 0 records the order; step 1 is measured
            logs[name].clear()
            dl.tracer().clear()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
        logs[name] = logs[name][:]
        logs[name + " gathered"] = sum(e.args["size"] for e in dl.tracer().events() if e.name == "all_gather")

    units = fsdp.units(per_param)
    bounds = [(b.offsets[i], b.offsets[i] + p.numel(), b.shard_numel, math.prod(p.shape[1:]))
              for b in flat.buckets for i, p in enumerate(b.params)]
    return {"logs": logs,
            "padding": {"FSDP1 (flat)": sum(b.padded - b.numel for b in flat.buckets),
                        "FSDP2 (per param)": sum(u.total * n - sum(math.prod(p.shape) for p in u.params)
                                                 for u in units)},
            "shapes": {"FSDP1 (flat)": [[tuple(p.shape) for p in b.params] for b in flat.buckets],
                       "FSDP2 (per param)": [[p.shape for p in u.params] for u in units]},
            # a parameter cut mid-row on this rank: its slice of the flat buffer starts or ends inside a row
            "cut_mid_row": sum(1 for lo, hi, c, row in bounds
                               if any(lo < e < hi and (e - lo) % row for e in (r * c, (r + 1) * c))),
            "storages_per_unit": storages,
            "shard_is_a_parameter": all(isinstance(p, torch.nn.Parameter) for p in per_param.parameters())}


N1 = 3
layouts = dl.launch(two_layouts, world_size=N1, output="quiet")
res = layouts.results[0]
LAYOUTS = ("FSDP1 (flat)", "FSDP2 (per param)")
for name, kind in zip(LAYOUTS, ("flat", "per-param")):
    predicted = sum(dl.theory.fsdp_padding(shapes, N1, kind) for shapes in res["shapes"][name])
    print(f"{name:18} padding: {res['padding'][name]:6d} elements gathered beyond Psi (predicted {predicted}), "
          f"{res['padding'][name] / PSI:.2%} of Psi")
    assert res["padding"][name] == predicted

# %% [markdown]
# Flat padding is a handful of elements per unit; per-parameter padding is up to N-1 *rows* of every parameter. It
# costs bytes on the wire and in the gathered buffer, never in what a rank stores: the padding lives only in the
# send and receive buffers (the shards are exact; `tests/test_fsdp.py` measures their storage).
#
# Now the copies and allocations of one training step (forward and backward gathers of every unit), per rank:

# %%
for name in LAYOUTS:
    for r, rank_res in enumerate(layouts.results):
        log, gathered = rank_res["logs"][name], rank_res["logs"][name + " gathered"]
        written = sum(b for _, b, _ in log)
        allocations = sum(fresh for *_, fresh in log)
        by_op = Counter()
        for op, b, _ in log:
            by_op[op] += b
        if r == 0:
            print(f"{name:18} rank 0: copied {written:8d} B = {written / gathered:4.2f} x the {gathered} B gathered; "
                  f"{allocations:3d} allocations; by operator: {dict(sorted(by_op.items()))}")
        if name == "FSDP1 (flat)":
            assert written == 0 and allocations == 0               # gathered in place, parameters are views
        else:
            assert written >= gathered * (1 + 1 / N1)               # copy-out of everything, copy-in of 1/N
            assert allocations >= 2 * len(res["shapes"][name][0])  # per parameter, every gather
print(f"parameters that FSDP1 cuts mid-row on rank 0: {res['cut_mid_row']}; FSDP2: 0 (whole rows, always)")
storages = res["storages_per_unit"]
print(f"separate storages holding block 0 while it computes: FSDP1 {storages['FSDP1 (flat)']}, "
      f"FSDP2 {storages['FSDP2 (per param)']} (one per parameter: {len(res['shapes']['FSDP2 (per param)'][0])})")
assert storages["FSDP1 (flat)"] == 1 and storages["FSDP2 (per param)"] == len(res["shapes"]["FSDP2 (per param)"][0])
assert res["shard_is_a_parameter"]                 # FSDP2's shards: plain nn.Parameters of whole rows

# %% [markdown]
# What each design buys with its costs:
#
# | | FSDP1 / ZeRO-3 (flat) | FSDP2 (per parameter) |
# |---|---|---|
# | padding | < N elements per unit | up to N-1 rows per parameter |
# | copies per gather | none: gathered in place, parameters are views | copy-in (1/N), copy-out (all) |
# | allocations | one storage per unit, reused every step | one per parameter per gather, many sizes |
# | what the optimizer sees | flat shards, parameters cut mid-row | `model.parameters()`: each a whole-row shard |
# | frozen / mixed dtypes in a unit | awkward: one buffer, one dtype, one `requires_grad` | per parameter |
# | state dict, checkpoints | unflatten first | a shard is a slice of the named tensor |
#
# FSDP2 pays copies (cheap on a GPU next to the all-gather, and hidden by prefetch) to make sharding invisible
# to everything else: any optimizer, per-parameter learning rates, frozen layers, a state dict by name. (distlab's
# copy-out copies a padded parameter twice, a reshape of the strided rows and then a clone into an exact-size
# tensor: the `clone` above; torch copies once, with `split_with_sizes_copy`.) Many allocations of many sizes
# are what fragments a GPU's caching allocator; torch's FSDP2 frees them with explicit stream synchronisation
# instead of FSDP1's `recordStream`, which keeps its memory use deterministic. On our CPUs we count the
# allocations; fragmentation itself needs a GPU allocator to show.
#
# ## 2. A step on a timeline: one all-gather per unit, each way, and one reduce-scatter
#
# From here on N = 4 ranks, the model sharded as its four blocks and the root (5 units). One function runs every
# configuration of this lesson in a single launch; each step is traced, and memory is sampled by
# `fsdp_memory` (the ledger `dl.train("fsdp")` uses) after every collective launch.

# %%
N = 4
CONFIGS = {
    "fsdp": {},
    "no reshard": {"reshard_after_forward": False},
    "bf16 params": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "bf16 both": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
    "hsdp 2x2": {"mesh": (2, 2)},
}


def one_config(name, kw, x, y):
    tr = dl.tracer()
    model = build_model()
    for block in model.blocks:
        dl.fully_shard(block, **kw)
    dl.fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ledger = fsdp_memory(model, opt)
    units = fsdp.units(model)
    for step in range(2):                                          # step 1: prefetching, measured
        with tr.span("forward", config=name, step=step):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        held = sum(t.untyped_storage().nbytes() for u in units for t in u.gathered())
        ledger()                                                   # peak buffers since: backward's
        with tr.span("backward", config=name, step=step):
            loss.backward()
        buffers = ledger()["buffers"]
        with tr.span("optimizer", config=name, step=step):
            opt.step()
            opt.zero_grad()
    return {"held_after_forward": held, "peak_buffers_backward": buffers,
            "padded_psi": sum(u.total * u.shard_comm.size for u in units),
            "loss": loss.item(), "state": {k: v for k, v in fsdp.full_state_dict(model).items()}}


def all_configs():
    n, r = dl.world_size(), dl.rank()
    x, y = DATA.batch(0, 4 * n)
    return {name: one_config(name, kw, x.chunk(n)[r], y.chunk(n)[r]) for name, kw in CONFIGS.items()}


run = dl.launch(all_configs, world_size=N, output="quiet")
results = run.results
flat = lambda state: torch.cat([v.flatten().float() for _, v in sorted(state.items())])   # noqa: E731
reference = flat(results[0]["fsdp"]["state"])
for name in CONFIGS:                                  # every configuration trains the same model
    tol = 1e-6 if "bf16" not in name else 2**-8       # bf16 keeps 8 bits: its rounding step; relative to
                                                      # the norm of all the parameters
    for r in range(N):
        err = ((flat(results[r][name]["state"]) - reference).norm() / reference.norm()).item()
        assert err <= tol, (name, r, err)
print("all five configurations, all ranks: the same parameters after 2 steps (fp32 within 1e-6, bf16 within 2^-8)")


def window(config, rank=None, step=1):
    """(start, end) of a configuration's measured step: on one rank, or spanning all of them."""
    spans = [e for e in run.trace.spans(rank=rank) if (e.args.get("config"), e.args.get("step")) == (config, step)]
    return min(e.start for e in spans), max(e.end for e in spans)


def comms(config, rank, step=1):
    """The comm events a rank launched during a configuration's measured step."""
    lo, hi = window(config, rank, step)
    return [e for e in run.trace.comms(rank=rank) if lo <= e.start <= hi]


def on_wire(lists, world):
    """{key: [(op, size), ...]}: each list of recorded calls re-run, same op and size, on distlab's own ring
    of send/recv over ``world`` ranks (`dl.comm.replay`); {key: bytes rank 0 really sent}, counted at each send."""
    return dl.launch(lambda: {k: dl.comm.replay(v) for k, v in lists.items()}, world_size=world).results[0]


def calls(config, rank=0, group=None):
    return [(e.name, e.args["size"]) for e in comms(config, rank) if group in (None, e.args.get("group"))]


wire = on_wire({name: calls(name) for name in ("fsdp", "no reshard", "bf16 params", "bf16 both")}, N)


# %%
UNITS = MODEL.layers + 1                                         # the blocks, and the root
for phase in ("forward", "backward"):
    span = next(e for e in run.trace.spans(rank=0, name=phase)
                if (e.args.get("config"), e.args.get("step")) == ("fsdp", 1))
    ops = [e.name for e in comms("fsdp", 0) if span.start <= e.start <= span.end]
    print(f"{phase:8}: " + ", ".join(f"{ops.count(op)} x {op}" for op in ("all_gather", "reduce_scatter")))
    assert ops.count("all_gather") == UNITS
    assert ops.count("reduce_scatter") == (UNITS if phase == "backward" else 0)
bounds = {r: window("fsdp", r) for r in range(N)}                           # each rank's own step 2
step = dl.Trace([e for e in run.trace.events if e.kind in ("span", "comm")
                 and bounds[e.rank][0] <= e.start <= bounds[e.rank][1]])
fig = dl.viz.timeline(step, comm_kind=lambda e: e.name,
                      comm_colours={"all_gather": "#ff7f0e", "reduce_scatter": "#d62728"},
                      title="FSDP2, N = 4, step 2: all-gather (orange) before each unit's forward and backward, "
                            "reduce-scatter (red) after")
plt.show()

# %% [markdown]
# Read the lower lane of each rank: five all-gathers in forward (root, then blocks 0 to 3: the next one launched
# while the current unit computes, the prefetch), five more in backward in reverse order, and a reduce-scatter
# as soon as each unit's gradients are complete. Per step that is 2 gathers and 1 reduce-scatter per unit:
# 3 (N-1)/N · 4Ψ bytes in fp32, as for ZeRO-3.
#
# ## 3. `reshard_after_forward`: True (ZeRO-3) or False (ZeRO-2-like)
#
# `reshard_after_forward=False` keeps each unit's gathered parameters from its forward to its backward: no second
# all-gather (2 (N-1)/N · 4Ψ bytes per step instead of 3), but every unit stays gathered through the whole step,
# so the full model sits on every rank between forward and backward. FSDP1 called this `SHARD_GRAD_OP` (its other
# strategies: `FULL_SHARD`, the default, is ZeRO-3; `NO_SHARD` is DDP; `HYBRID_SHARD` is section 5's HSDP).
# `dl.theory.fsdp_volume(4Ψ, shards=N, reshard_after_forward=...)` predicts the bytes (Ψ here includes the
# per-parameter padding measured in section 1: it is what travels).
#
# **Recorded, not measured, bytes.** These collectives run on torch's gloo, which does not say what it puts on the
# wire. What the trace measures is each call: its op, its message size, its group, when it ran. The bytes a rank
# sends are then *modelled*: the wrapper records the bytes a ring moves for that message (`bytes="ring-model"`;
# distlab's own ring, built from send/recv, sends exactly these, `tests/test_comm.py`). So the byte checks in
# sections 3 to 5 check the number and size of the calls against `fsdp_volume`, and the printouts say "recorded".
# The bytes themselves are then measured apart: `on_wire` re-runs rank 0's calls of the step, same op and size, on
# distlab's own ring of send/recv (`dl.comm.replay`), where every byte is counted as it is sent, and that count must
# equal `fsdp_volume` too. A wrong constant in the formula (say 2 gathers per unit instead of 3 collectives) fails it.

# %%
for name, reshard in (("fsdp", True), ("no reshard", False)):
    for r in range(N):
        res = results[r][name]
        psi_bytes = 4 * res["padded_psi"]
        predicted = dl.theory.fsdp_volume(psi_bytes, shards=N, reshard_after_forward=reshard)["shard"]
        events = comms(name, r)
        sent = sum(e.sent for e in events)
        assert abs(sent - predicted) <= 0.01 * predicted, (name, r, sent, predicted)
        held = res["held_after_forward"]
        assert held == (0 if reshard else 4 * PSI), (name, held)      # False: every parameter, exactly
    gathers = sum(e.name == "all_gather" for e in comms(name, 0))
    print(f"reshard_after_forward={reshard!s:5}: {gathers} all-gathers, recorded {sent:7d} B per step "
          f"(predicted {predicted:7.0f}); gathered parameters held between forward and backward: {held:6d} B "
          f"= {held / (4 * PSI):.0%} of the fp32 model; peak transient in backward {res['peak_buffers_backward']} B")
    psi_bytes = 4 * results[0][name]["padded_psi"]
    want = dl.theory.fsdp_volume(psi_bytes, shards=N, reshard_after_forward=reshard)["shard"]
    print(f"{'':27}measured on distlab's ring: {wire[name]} B (rank 0)")
    assert wire[name] == want, (name, wire[name], want)               # bytes, counted at each send
assert results[0]["fsdp"]["peak_buffers_backward"] < results[0]["no reshard"]["peak_buffers_backward"]

# %% [markdown]
# The trade is exact: one third less traffic (counted: 5 all-gathers per step instead of 10, so the ring-model bytes
# fall by a third) for a whole unsharded model held through the step (measured, in memory: 100% of the fp32
# parameters between forward and backward, against 0% with resharding). Torch's FSDP2 also accepts an
# int (reshard to a smaller group, e.g. the 8 GPUs of a node): the backward gather then stays on fast links.
#
# ## 4. Mixed precision: the gathers travel in bf16
#
# `param_dtype=torch.bfloat16` gathers (and computes) in bf16 while the shards stay fp32 masters;
# `reduce_dtype` picks the reduce-scatter's dtype. Its default, in torch's FSDP2 (`MixedPrecisionPolicy`) and in
# `dl.fully_shard`, is `param_dtype`: set `param_dtype` alone and the gradients are reduced in bf16 too. Pass
# `reduce_dtype=torch.float32` to keep the sum in fp32 (summing N bf16 gradients loses bits), at twice the
# reduce-scatter's bytes; the "bf16 params" run below does.
# The all-gathers are two thirds of FSDP's traffic, so bf16 parameters alone save a third; bf16 gradients too
# halve the whole step.

# %%
sent_by_op = {name: Counter() for name in ("fsdp", "bf16 params", "bf16 both")}
for name in sent_by_op:
    for e in comms(name, 0):
        sent_by_op[name][e.name] += e.sent
base = sent_by_op["fsdp"]
for name, (param_bytes, grad_bytes) in {"fsdp": (4, 4), "bf16 params": (2, 4), "bf16 both": (2, 2)}.items():
    psi = results[0][name]["padded_psi"]
    predicted = dl.theory.fsdp_volume(param_bytes * psi, N, grad_bytes=grad_bytes * psi)["shard"]
    got = sum(sent_by_op[name].values())
    ratios = {op: sent_by_op[name][op] / base[op] for op in ("all_gather", "reduce_scatter")}
    print(f"{name:12} recorded {got:7d} B (predicted {predicted:7.0f}); vs fp32: all_gather x{ratios['all_gather']:.2f}, "
          f"reduce_scatter x{ratios['reduce_scatter']:.2f}")
    if name != "fsdp":
        print(f"{'':13}measured on distlab's ring {wire[name]:7d} B")
    assert abs(got - predicted) <= 0.01 * predicted and wire[name] == predicted       # calls; bytes counted
    assert ratios["all_gather"] == param_bytes / 4 and ratios["reduce_scatter"] == grad_bytes / 4

# %% [markdown]
# Exactly half, per collective: the message sizes are what torch received, so the halving is measured, whatever
# the load on the machine (the bytes per rank are the ring's formula on those sizes). (The losses and parameters
# still match fp32 to within bf16's rounding, asserted at the top of section 2: within 2^-8 of the parameters' norm.)
#
# ## 5. HSDP: shard inside a replica, all-reduce across replicas
#
# Full sharding over 1024 GPUs puts every gather and reduce-scatter on the slow inter-node links, in messages of
# Ψ_unit / 1024. **Hybrid sharding** (FSDP's `HYBRID_SHARD`, FSDP2's 2-D mesh, `mesh=(R, S)` here) shards over
# the S GPUs of a node and keeps R replicas:
#
#     grid = arange(R S).view(R, S)       R = 2, S = 2:     [[0, 1],     rows: shard groups (fast links)
#                                                             [2, 3]]     columns: replica groups (slow links)
#
#     inside a row:    all-gather, all-gather, reduce-scatter      (2 + 1) (S-1)/S · 4Ψ
#     down a column:   all-reduce of this rank's gradient shard     2 (R-1)/R · 4Ψ / S
#
# Only 1/S of the gradients ever crosses a slow link, once per step. The price: memory is sharded S ways, not N.
# `dl.theory.fsdp_volume(4Ψ, shards=S, replicas=R)` returns the bytes per link type; each event is tagged with the
# group it ran on (`name_group` in `hsdp_groups`), so the recorded calls split the same way (their bytes, as in
# section 3, the ring's).

# %%
R, S = CONFIGS["hsdp 2x2"]["mesh"]
measured = {}
for r in range(N):
    psi_bytes = 4 * results[r]["hsdp 2x2"]["padded_psi"]
    predicted = dl.theory.fsdp_volume(psi_bytes, shards=S, replicas=R)
    events = comms("hsdp 2x2", r)
    by_link = {link: sum(e.sent for e in events if e.args.get("group") == link) for link in predicted}
    assert sum(by_link.values()) == sum(e.sent for e in events)       # every byte on one of the two links
    for link in predicted:
        assert abs(by_link[link] - predicted[link]) <= 0.01 * predicted[link], (r, link, by_link, predicted)
    measured[r] = by_link
hsdp_wire = on_wire({link: calls("hsdp 2x2", 0, link) for link in predicted}, 2)   # both groups have 2 ranks
predicted = dl.theory.fsdp_volume(4 * results[0]["hsdp 2x2"]["padded_psi"], shards=S, replicas=R)
assert hsdp_wire == predicted, (hsdp_wire, predicted)         # rank 0's bytes on each link, counted at each send
ops = Counter((e.name, e.args.get("group")) for e in comms("hsdp 2x2", 0))
print("rank 0's collectives in one step:", dict(sorted(ops.items())))
for link in predicted:
    print(f"  {link:9} link: recorded (ring model) {measured[0][link]:7d} B, measured on distlab's ring "
          f"{hsdp_wire[link]:7d} B, predicted {predicted[link]:7.0f} B")
plain = sum(e.sent for e in comms("fsdp", 0))
print(f"plain FSDP over all {N} ranks: {plain} B per rank (ring model), on rings that span both replicas")

# %%
fig, (ax, ax_scale) = plt.subplots(1, 2, figsize=(12, 3.8))
links = list(predicted)
for i, link in enumerate(links):
    ax.bar(i - 0.2, measured[0][link] / 1024, 0.4, color="#1f77b4",
           label="recorded: the real calls, ring-model bytes" if i == 0 else None)
    ax.bar(i + 0.2, predicted[link] / 1024, 0.4, color="none", edgecolor="k", hatch="//",
           label="dl.theory.fsdp_volume" if i == 0 else None)
ax.set_xticks(range(len(links)), [f"{link} group\n({'inside' if link == 'shard' else 'across'} replicas)"
                                  for link in links])
ax.set(ylabel="KiB sent per rank per step (modelled)", title=f"HSDP {R} x {S}: bytes per link type")
ax.legend(fontsize=8)
psi7b = 2 * 7e9                                                # a 7B model's bf16 parameters
gpus = [16, 64, 256, 1024]
hsdp = [dl.theory.fsdp_volume(psi7b, shards=8, replicas=n // 8)["replicate"] for n in gpus]   # every hop crosses
fsdp = [dl.theory.fsdp_volume(psi7b, shards=n)["shard"] for n in gpus]     # per GPU, on a ring over all n GPUs
ax_scale.plot(gpus, [a / 1e9 for a in hsdp], "o-", label="HSDP, S = 8 (a node): all-reduce across nodes")
ax_scale.plot(gpus, [f / 8 / 1e9 for f in fsdp], "s--",                    # NCCL's rings: 1 hop in 8 leaves a node
              label="FSDP over all GPUs, node-contiguous rings (NCCL)")
ax_scale.plot(gpus, [f / 1e9 for f in fsdp], ":", color="grey", label="FSDP if every hop crossed nodes (none does)")
ax_scale.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="GB per GPU per step leaving its node",
             title="7B, bf16, modelled: what crosses node boundaries")
ax_scale.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# How many bytes cross the slow links depends on how the rings are built, so the right panel builds them as NCCL
# does: ranks numbered node by node, each ring running through the 8 GPUs of a node before it leaves, so of every
# 8 hops only **one** crosses a node. Per GPU (the bytes leaving a node, over its 8 GPUs), with 2Ψ bytes of bf16
# parameters:
#
#     plain FSDP over N GPUs:   3 (N-1)/N · 2Ψ / 8      every collective's ring leaves each node once
#     HSDP, S = 8, R = N/8:     2 (R-1)/R · 2Ψ / 8      every hop of the replica all-reduce crosses, on 1/8 of it
#
# That is 3/2 as many bytes for plain FSDP at scale (2.8x at 16 GPUs, 1.7x at 64, 1.5x at 1,024), not the 12x one
# would get by letting every hop of FSDP's ring cross a node (the dotted line). HSDP's larger gains on the slow
# links are elsewhere: **latency**, since a gather or reduce-scatter over a ring of N = 1,024 GPUs takes N - 1 =
# 1,023 steps, each waiting on its cross-node hop, against 2(R - 1) = 254 steps for HSDP's all-reduce over R = 128
# nodes (its in-node gathers take 7 steps on NVLink); and **fewer cross-node collectives**, one all-reduce per unit
# per step instead of three (two gathers, one reduce-scatter), none of them before a forward. The price is
# memory: model states divided by S = 8, not by N. (The 1.5x is a model of NCCL's rings, not a measurement; NCCL
# may also pick other algorithms at scale.)
#
# ## What to remember
#
# * FSDP1 / ZeRO-3 flatten a unit into one buffer: tiny padding, no copies, one allocation, but the optimizer sees
#   flat shards that cut parameters mid-row. FSDP2 shards each parameter on dim 0: `model.parameters()` *are* the
#   shards, at the cost of per-parameter padding, a copy-in and a copy-out per gather, and many allocations
#   (all measured above).
# * Per step each unit is gathered before its forward and its backward and reduce-scattered once: 3 (N-1)/N · 4Ψ
#   bytes in fp32. `reshard_after_forward=False` drops the second gather (2 (N-1)/N · 4Ψ) and keeps the whole model gathered
#   through the step.
# * `param_dtype=bf16` halves the gathers, `reduce_dtype=bf16` the reduce-scatters: exactly, in bytes.
# * HSDP `mesh=(R, S)`: gathers and reduce-scatters inside S ranks, one all-reduce of a 1/S shard across R
#   replicas: `dl.theory.fsdp_volume` gives the bytes on each link; the calls and their sizes were measured here,
#   their bytes modelled as a ring's (equal to the formula within 1%: padding). Across nodes HSDP sends about 1.5x
#   fewer bytes than FSDP's node-contiguous rings; its bigger wins are fewer, shorter rings over the slow links.
#
# **Try it**: set `N1 = 4` in section 1 (the model's 32-, 64- and 256-row parameters then divide evenly: FSDP2's
# padding vanishes, and with it most of the gap in gathered bytes), or add `"reshard_after_forward": False` to the
# `"hsdp 2x2"` configuration and pass `reshard_after_forward=False` to `dl.theory.fsdp_volume` in section 5: the
# shard link loses a third of its bytes, the replicate link keeps all of its own.
