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
# # 19 · Mixed precision in depth: what each format keeps, loses and costs on the wire
#
# *Symbols (Ψ, S, N, u, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# Lessons 03 and 14 used `precision="bf16-mixed"` and `"fp16-mixed"` as switches, and lesson 09 `fully_shard`'s
# `param_dtype` / `reduce_dtype`. This lesson opens them. Every
# section states a prediction from the format's bits, measures on this CPU, and asserts the two agree:
#
# | § | question | prediction |
# |---|----------|------------|
# | 1 | how precise and how wide is each format? | u = 2^-(m+1); RMS rounding error ≈ 0.42 u; range from the exponent bits |
# | 2 | which ops does autocast leave in fp32? | matmuls go to bf16, losses stay fp32 (CPU list); reductions accumulate in fp32 |
# | 3 | why fp32 master weights? | a bf16 update smaller than u·|w| is lost entirely |
# | 4 | why accumulate gradients in fp32? | a bf16 running sum of ones stops at 2^8 = 256; errors ≈ 2^16 × fp32's |
# | 5 | why loss scaling for fp16, not for bf16? | gradients under 2^-25 flush to zero in fp16; a scale S moves them up |
# | 6 | what does fp8 save on the wire, and what does it cost? | 1 byte per number; error 0.42 u of e4m3 / e5m2 after scaling |
#
# Papers: Micikevicius et al. 2018, "Mixed Precision Training" (ICLR: fp32 master weights, loss scaling, fp32
# accumulation); Kalamkar et al. 2019 (bf16); Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (e4m3 and
# e5m2, per-tensor scaling); Higham 2002 (rounding-error analysis). The formulas live in
# [distlab/theory/precision.py](../distlab/theory/precision.py); distlab's dynamic loss scaler in
# [distlab/strategies/numerics.py](../distlab/strategies/numerics.py); FP8 here is *emulated*: a scaled cast to
# `torch.float8_e4m3fn` / `float8_e5m2` and back (the rounding is real; the fp8 matmul kernels of a GPU are not).

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab as dl
from distlab.strategies.numerics import LossScaler
from distlab.theory import precision as P

torch.set_num_threads(1)
torch.manual_seed(0)                       # the layers' initial weights below: the same numbers on every run
DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
         "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def gen(seed):
    return torch.Generator().manual_seed(seed)

# %% [markdown]
# ## 1. Precision and range, from the bits
#
# A float with e exponent bits and m mantissa bits rounds any number in its normal range with a relative error of
# at most the **unit roundoff u = 2^-(m+1)**: 2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32, 2^-4 and 2^-3 for the
# two fp8 formats. For values spread over the binade as a Gaussian's are, the error is uniform over ± half a gap,
# so its RMS is 2u·sqrt(E[1/x²]/12) = **0.42 u** (x the significand, log-uniform on [1, 2): E[1/x²] = 3/(8 ln 2)).
# The exponent bits set the range: bf16 keeps fp32's 8, fp16 has 5 (6e-8 to 65504), e4m3 4 (max 448).
#
# First the table `dl.theory.precision` computes from the bits, beside torch's own `finfo`; then 200,000 Gaussian
# numbers (fp64) rounded to each format and back.

# %%
x64 = torch.randn(200_000, generator=gen(0), dtype=torch.float64)
rounding = {}
print(f"{'format':>6} {'bits e|m':>8} {'u':>9} {'min normal':>11} {'max':>9} | {'max rel err / u':>15} "
      f"{'RMS rel err / u':>15} (predicted 1.00 and {P.cast_rms_error('bf16') / P.fmt('bf16').unit_roundoff:.2f})")
for name, dtype in DTYPE.items():
    f, fi = P.fmt(name), torch.finfo(dtype)
    assert (f.eps, f.max_value, f.min_normal, 8 * f.bytes) == (fi.eps, fi.max, fi.smallest_normal, fi.bits)
    x = x64 * P.scale_for(x64.abs().max().item(), name) if f.bytes == 1 else x64   # fp8: scaled into range
    x = x[x.abs() >= f.min_normal]
    rel = (x.to(dtype).double() - x) / x
    rounding[name] = dict(max=rel.abs().max().item(), rms=rel.square().mean().sqrt().item())
    print(f"{name:>6} {f.exponent:>4}|{f.mantissa:<3} {f.unit_roundoff:9.2e} {f.min_normal:11.1e} {f.max_value:9.2e} | "
          f"{rounding[name]['max'] / f.unit_roundoff:15.2f} {rounding[name]['rms'] / f.unit_roundoff:15.2f}")

# %% [markdown]
# **Check.** The bits give torch's `finfo` exactly (asserted above). The largest error lies between u/(1+u) (the worst
# case sits just above a power of two) and u, and the RMS is within 3% of 0.42 u, for every format: a format
# mislabelled by one mantissa bit would miss both by a factor of 2.

# %%
for name, r in rounding.items():
    u = P.fmt(name).unit_roundoff
    assert u / (1 + u) * 0.97 < r["max"] <= u, (name, r["max"] / u)
    assert abs(r["rms"] / P.cast_rms_error(name) - 1) < 0.03, (name, r["rms"] / P.cast_rms_error(name))
print("checks passed")

# %% [markdown]
# ## 2. Which ops autocast leaves in fp32
#
# `torch.autocast` does not cast a model to bf16. It runs each op in the dtype a list assigns it: matrix products
# (linear, matmul, conv, bmm) in bf16, where the hardware is fast and a dot product's error is tolerable; some ops
# that **reduce over many values or span a wide range** in fp32. The weights stay fp32 (the *master* copy,
# section 3); autocast casts a copy to bf16 on the way into each matmul. The lists differ by device (PyTorch's
# "Autocast Op Reference"): on CUDA, softmax, log-softmax and layer norm are on the fp32 list; on the **CPU** they
# are not; of the ops called here only the losses (mse, cross-entropy's nll part) are (the CPU's fp32 list is
# mostly losses, linear algebra and FFTs). We call each op on a **bf16** input inside CPU
# autocast and read the output's dtype against the CPU list.

# %%
xb = torch.randn(8, 64, generator=gen(1)).bfloat16()          # an activation that arrives in bf16
lin, norm = nn.Linear(64, 64), nn.LayerNorm(64)
target = torch.zeros(8, dtype=torch.long)
OPS = {"linear": lambda: lin(xb), "matmul": lambda: xb @ xb.T, "softmax": lambda: F.softmax(xb, -1),
       "log_softmax": lambda: F.log_softmax(xb, -1), "layer_norm": lambda: norm(xb),
       "cross_entropy": lambda: F.cross_entropy(xb, target), "mse_loss": lambda: F.mse_loss(xb, xb.flip(0))}
BF16, FP32 = torch.bfloat16, torch.float32
EXPECTED_CPU = {"linear": BF16, "matmul": BF16, "softmax": BF16, "log_softmax": BF16, "layer_norm": BF16,
                "cross_entropy": FP32, "mse_loss": FP32}
CUDA_LIST = {"softmax": FP32, "log_softmax": FP32, "layer_norm": FP32}          # from the reference, not run here
with torch.autocast("cpu", dtype=torch.bfloat16):
    ran_in = {name: op().dtype for name, op in OPS.items()}
for name, dtype in ran_in.items():
    print(f"{name:>13}: CPU autocast output {str(dtype):>15}   (CUDA's list: {CUDA_LIST.get(name, EXPECTED_CPU[name])})")
assert ran_in == EXPECTED_CPU
print(f"the Linear's own weight is still {lin.weight.dtype}: autocast casts a copy into each matmul")

# %% [markdown]
# A bf16 *output* does not mean a bf16 *accumulator*. Log-softmax over a 50,000-word vocabulary sums 50,000
# exponentials; torch's CPU kernel accumulates in fp32 ("opmath") and rounds only the result, so its error should be
# about one rounding, u. A running sum kept in bf16 instead (section 4 explains why it drifts) is what running the
# reduction in the storage dtype would mean:

# %%
logits = (torch.randn(50_000, generator=gen(2)) * 3).bfloat16()
exact = F.log_softmax(logits.double(), -1)
kernel_err = ((F.log_softmax(logits, -1).double() - exact).abs() / exact.abs()).max().item()
terms = logits.float().exp().bfloat16()
running = torch.zeros((), dtype=torch.bfloat16)
for t in terms[:5000]:
    running = running + t                                  # a bf16 accumulator, 5,000 terms
naive_err = abs(running.item() / terms[:5000].double().sum().item() - 1)
print(f"log_softmax of bf16 logits: largest relative error {kernel_err / P.fmt('bf16').unit_roundoff:.2f} u "
      f"(one rounding of the result: about 1 u); a bf16 running sum of 5,000 of its exponentials: "
      f"{naive_err:.1%} off ({naive_err / P.fmt('bf16').unit_roundoff:.0f} u)")
assert kernel_err < 2 * P.fmt("bf16").unit_roundoff and naive_err > 10 * P.fmt("bf16").unit_roundoff

# %% [markdown]
# The price of reducing in fp32 is small: these ops are memory-bound, a few percent of a transformer's FLOPs.
#
# ## 3. fp32 master weights: an update smaller than u·|w| is lost
#
# The optimizer adds lr·update to every weight. In bf16 a weight of 1.0 has neighbours 1 + 2^-7 above and
# 1 - 2^-8 below, so any increment under **u·|w| = 2^-8 ≈ 0.0039** rounds back to 1.0 (ties go to even): the step
# is lost, every step, forever. An increment a little above is rounded to a whole gap of 2^-7 instead. Micikevicius
# et al. keep an fp32 **master copy** the optimizer updates, and cast it to bf16/fp16 for the forward. Prediction
# for 1,000 steps of +0.001 and of +0.005 from w = 1: fp32 ends at 2 and 6. bf16 stays at 1 exactly under +0.001;
# under +0.005 each step adds a whole gap of 2^-7 (0.0078, half as much again as asked) until w = 2, where
# u·|w| = 2^-7 > 0.005 and every later step is lost: it stops at exactly 2.

# %%
def run_updates(step, dtype, n=1000):
    w = torch.ones((), dtype=dtype)
    for _ in range(n):
        w = w + torch.tensor(step, dtype=dtype)
    return w.item()

updates = {(step, name): run_updates(step, DTYPE[name]) for step in (1e-3, 5e-3) for name in ("fp32", "bf16")}
for (step, name), w in updates.items():
    print(f"1000 x (+{step:g}) from w = 1 in {name}: w = {w:.4f}")
u_bf16 = P.fmt("bf16").unit_roundoff
assert 1e-3 < u_bf16 < 5e-3
assert updates[1e-3, "bf16"] == 1.0                            # every update lost
assert updates[5e-3, "bf16"] == 2.0                            # grows by whole gaps until the gap is 2^-6 > 2 x 0.005
assert abs(updates[1e-3, "fp32"] - 2.0) < 1e-3 and abs(updates[5e-3, "fp32"] - 6.0) < 1e-3
print("checks passed")

# %% [markdown]
# ## 4. Gradient accumulation: accumulate in fp32
#
# Accumulating k micro-batches adds k gradients into one buffer. A running sum in a format with m mantissa bits
# stops growing under an increment of 1 at **2^(m+1)**: there the gap between neighbours is 2 and x + 1 is a tie
# that rounds to even (256 for bf16, 2048 for fp16). More generally, Higham's bound for summing k terms is
# (k-1)u / (1 - (k-1)u) relative to Σ|g_i|; typically the error grows as about sqrt(k)·u. So the accumulation
# dtype's u sets the error: a bf16 buffer should be about 2^16 times worse than an fp32 one.

# %%
stall = {}
for name in ("bf16", "fp16"):
    acc, one = torch.zeros((), dtype=DTYPE[name]), torch.ones((), dtype=DTYPE[name])
    for _ in range(4096):
        acc = acc + one
    stall[name] = acc.item()
    print(f"{name}: 4,096 additions of 1.0 give {stall[name]:,.0f}  (predicted 2^(m+1) = {P.fmt(name).stall:,})")
assert all(stall[name] == P.fmt(name).stall for name in stall)

K = 64                                                    # micro-batches accumulated into one step
model = nn.Linear(256, 256)
micro = []
for i in range(K):                                        # per-micro-batch gradients of a real layer
    x, y = torch.randn(4, 256, generator=gen(100 + i)), torch.randn(4, 256, generator=gen(200 + i))
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    micro.append(model.weight.grad.clone())
exact = torch.stack(micro).double().sum(0)                # fp64 reference
acc_err = {}
for name in ("fp32", "bf16"):
    acc = torch.zeros_like(micro[0], dtype=DTYPE[name])
    for g in micro:
        acc = (acc.float() + g).to(DTYPE[name])           # add in fp32, store the buffer in the buffer's dtype
    acc_err[name] = ((acc.double() - exact).norm() / exact.norm()).item()
bound = P.sum_error_bound(K, "bf16") * (torch.stack(micro).double().abs().sum(0).norm() / exact.norm()).item()
ratio = acc_err["bf16"] / acc_err["fp32"]
print(f"{K} micro-batches: relative error of the accumulated gradient, fp32 buffer {acc_err['fp32']:.1e}, "
      f"bf16 buffer {acc_err['bf16']:.1e} ({ratio:,.0f}x; u ratio 2^16 = 65,536); Higham's worst case for bf16 "
      f"{bound:.2f}")
assert 2 ** 14 < ratio < 2 ** 18 and acc_err["bf16"] < bound
print("checks passed")

# %% [markdown]
# About 1% error on a 64-micro-batch gradient, from the buffer's dtype alone: that is why mixed-precision recipes
# keep the gradient-accumulation buffer and the master gradient in fp32 (distlab's `fully_shard` hands each shard's
# gradient back in fp32, its master dtype).
#
# ## 5. Loss scaling: fp16 underflow shown and fixed
#
# fp16's smallest subnormal is 2^-24 ≈ 6e-8: any gradient under half of it, **2^-25**, becomes 0, and those a
# little above keep only a few bits. Late in training many gradients are that small. Here a linear layer with its
# loss multiplied by 2^-14 (standing in for a small loss). Backward first produces the gradient of the layer's
# output, δ = ∂L/∂y, and then the weight gradient δᵀx from it, so an underflow in δ is lost for good. The fp32
# backward tells us in advance which entries of δ fp16 will flush (prediction: those with |δ| < 2^-25), and the fp16
# backward shows what it did. Then Micikevicius et al.'s fix: multiply the loss by S before backward, divide the
# gradients by S in fp32 after (`LossScaler`, the one `dl.train(precision="fp16-mixed")` uses).

# %%
layer = nn.Linear(256, 256)
xs, ys = torch.randn(32, 256, generator=gen(3)), torch.randn(32, 256, generator=gen(4))
SMALL, SCALE = 2.0 ** -14, 2.0 ** 16


def grads(dtype, scale=1.0):
    """Backward of SMALL x mse in ``dtype`` with the loss multiplied by ``scale``: (weight gradient, output
    gradient delta, both divided back by ``scale`` in fp32; the largest |gradient| backward met)."""
    m = nn.Linear(256, 256).to(dtype)
    m.load_state_dict(layer.state_dict())
    out = m(xs.to(dtype))                                                   # (32, 256)
    out.retain_grad()
    (F.mse_loss(out.float(), ys) * SMALL * scale).backward()
    top = max(out.grad.abs().max().item(), m.weight.grad.abs().max().item())
    return m.weight.grad.float() / scale, out.grad.float() / scale, top


def rel_err(g, ref):
    return ((g - ref).norm() / ref.norm()).item()

g32, d32, top32 = grads(torch.float32)
flush = P.underflow_threshold("fp16")
zeros = lambda t: (t == 0).float().mean().item()                            # noqa: E731
predicted_zero = {S: (d32.abs() * S < flush).float().mean().item() for S in (1.0, SCALE)}
fp16 = {S: grads(torch.float16, S) for S in (1.0, SCALE)}
for S, (g, d, _) in fp16.items():
    print(f"fp16, loss scale 2^{math.log2(S):<2.0f}: {zeros(d):6.1%} of δ flushed to zero (predicted "
          f"{predicted_zero[S]:6.1%}); weight gradient's relative error {rel_err(g, g32):.1e}")
g_bf16, d_bf16, _ = grads(torch.bfloat16)
print(f"bf16, no scaling:      {zeros(d_bf16):6.1%} of δ flushed (its min subnormal is 9e-41); weight gradient's "
      f"relative error {rel_err(g_bf16, g32):.1e}")

# %% [markdown]
# **Check.** Without scaling fp16 flushes the entries of δ the fp32 backward predicted, to within a percentage point
# (fp16 rounds the forward's output first, so entries at the threshold can go either way), and the weight gradient
# is badly wrong. With S = 2^16 under one entry of δ in a thousand underflows (asserted) and the error is fp16's
# rounding. bf16 needs no scale (fp32's exponent range) but rounds 8 times coarser than fp16 (2^-8 against
# 2^-11): asserted as the ratio of the two errors.

# %%
assert predicted_zero[1.0] > 0.2 and abs(zeros(fp16[1.0][1]) - predicted_zero[1.0]) < 0.01
assert rel_err(fp16[1.0][0], g32) > 0.5
assert max(zeros(fp16[SCALE][1]), predicted_zero[SCALE], zeros(d_bf16)) < 1e-3        # 8 of 8,192 at most
ratio16 = rel_err(g_bf16, g32) / rel_err(fp16[SCALE][0], g32)
print(f"bf16 error / scaled fp16 error = {ratio16:.1f} (u ratio 2^3 = 8)")
assert 4 < ratio16 < 16
print("checks passed")

# %% [markdown]
# **Dynamic loss scaling** picks S by trial: start high (here 2^40), halve on every step whose gradients overflow
# (that step is skipped), grow again after a run of good steps. The prediction: backward overflows while
# S · (largest |gradient| it meets) exceeds fp16's max 65504, so the first good scale is the largest power of two
# under 65504 / max|g|, read off the fp32 backward.

# %%
scaler, tries = LossScaler(init_scale=2.0 ** 40, growth_interval=1000), []
while True:
    g, _, _ = grads(torch.float16, scaler.scale)
    overflow = not bool(torch.isfinite(g).all())
    tries.append((scaler.scale, overflow))
    scaler.update(overflow)
    if not overflow:
        break
predicted_scale = 2.0 ** math.floor(math.log2(P.fmt("fp16").max_value / top32))
print("scales tried:", ", ".join(f"2^{math.log2(s):.0f}{' overflow' if bad else ' ok'}" for s, bad in tries))
print(f"first finite: 2^{math.log2(tries[-1][0]):.0f}; predicted 2^{math.log2(predicted_scale):.0f} "
      f"(65504 / max|g| = 65504 / {top32:.2e})")
assert tries[-1][0] in (predicted_scale, predicted_scale / 2)   # fp16's own rounding can push the top one over
print("checks passed")

# %% [markdown]
# Lesson 14 runs this inside `dl.train(precision="fp16-mixed")` and shows the skipped steps on every rank.
#
# ## 6. FP8 on the wire: bytes saved, error paid
#
# FP8 halves bf16's bytes again. Its range is too narrow to cast a tensor as it is (e4m3: 2^-9 to 448), so each
# tensor is multiplied by a **scale** s = max_format / amax(tensor) first, cast, and the scale (one fp32 number)
# travels with it (Micikevicius et al. 2022; NVIDIA's Transformer Engine takes the amax from past steps, "delayed
# scaling"). What it costs is the
# format's rounding, 0.42 u: 2.6% RMS for e4m3, 5.3% for e5m2, against 0.16% for bf16.
#
# We gather a weight matrix (1,048,576 numbers, a layer of 1024 x 1024) across 2 ranks on distlab's ring, as FSDP
# does before every forward, in fp32, bf16 and fp8 (e4m3 bytes viewed as `uint8`, plus each shard's scale), count
# the bytes each rank sent from the trace, and measure the gathered weight's error. Prediction per rank, from
# `dl.theory.precision.collective_bytes`: (N-1)/N · Ψ · bytes per number (+ the scales), plus 8 bytes per call (the
# ring first passes each shard's length: `dl.comm.ring_all_gather` takes shards of any size).

# %%
PSI_W = 1 << 20
WIRE = ("fp32", "bf16", "e4m3", "e5m2")


def shard_of(rank, world):
    w = torch.randn(PSI_W, generator=gen(7)) * 0.02       # the same full weight everywhere; rank r holds a chunk
    return w, w.chunk(world)[rank]


def gather_rank():
    tr, (full, mine), out = dl.tracer(), shard_of(dl.rank(), dl.world_size()), {}
    for name in WIRE:
        before = len(tr.events())
        if P.fmt(name).bytes == 1:                        # scaled cast: payload bytes + one fp32 scale per shard
            scale = P.scale_for(mine.abs().max().item(), name)
            payload = (mine * scale).to(DTYPE[name]).view(torch.uint8)
            got = dl.comm.ring_all_gather(payload).view(DTYPE[name]).float()
            scales = dl.comm.ring_all_gather(torch.tensor([scale]))
            got = torch.cat([c / s for c, s in zip(got.chunk(dl.world_size()), scales)])
            calls = 2
        else:
            got, calls = dl.comm.ring_all_gather(mine.to(DTYPE[name])).float(), 1
        sent = sum(e.sent for e in tr.events()[before:] if e.kind == "comm")
        rel = ((got - full) / full)[full.abs() > 1e-6]
        out[name] = dict(sent=sent, calls=calls, rms=rel.square().mean().sqrt().item())
    return out

wire = dl.launch(gather_rank, world_size=2, output="quiet").results
for name in WIRE:
    r, f = wire[0][name], P.fmt(name)
    scales = 2 if f.bytes == 1 else 0
    predicted = P.collective_bytes(PSI_W, name, 2, "all_gather", scales=scales) + 8 * r["calls"]
    r["predicted"] = predicted
    print(f"{name:>5}: sent {r['sent']:>9,} B per rank (predicted {predicted:>11,.0f}), "
          f"{4 * PSI_W / 2 / r['sent']:4.1f}x fewer than fp32; RMS relative error {r['rms']:.2e} "
          f"(predicted {'0: no cast' if name == 'fp32' else f'0.42 u = {P.cast_rms_error(name):.2e}'})")

# %% [markdown]
# **Check.** The bytes are exact (every byte through distlab's ring is counted). The errors: fp32 loses nothing;
# each other format is within 5% of its 0.42 u (a shard whose largest value maps to the format's max, so the
# numbers sit in the normal range; those within 1e-6 of zero are left out of the relative error, they are a handful).

# %%
for name in WIRE:
    assert all(rank[name]["sent"] == wire[0][name]["predicted"] for rank in wire), name
    if name == "fp32":
        assert wire[0][name]["rms"] == 0.0
    else:
        assert abs(wire[0][name]["rms"] / P.cast_rms_error(name) - 1) < 0.05, (name, wire[0][name]["rms"])
print("checks passed")

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
for i, name in enumerate(WIRE[1:]):
    r = wire[0][name]
    ax.plot(r["sent"] / 1e6, r["rms"], "o", ms=9, color=f"C{i}", label=f"{name}: measured")
    ax.plot(r["predicted"] / 1e6, P.cast_rms_error(name), "x", ms=12, mew=2, color=f"C{i}",
            label=f"{name}: predicted (0.42 u, bytes formula)")
ax.set(yscale="log", xlabel="MB sent per rank for one all-gather of a 1M-number weight (N = 2)",
       ylabel="RMS relative error", title="bytes against error: bf16 half of fp32's bytes, fp8 a quarter; error 0.42 u")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Which tensor gets which format in FP8 training (Micikevicius et al. 2022): e4m3, more precision, for weights and
# activations in the forward; e5m2, more range, for gradients (their spread over a step is wider). Reductions are
# the hard part: an fp8 *all-reduce* would round its partial sums at every ring hop, so recipes gather weights in
# fp8 (one rounding, measured here) and reduce gradients in bf16 or fp32 (not measured here). distlab's own fp8
# all-gather inside ZeRO-3 and FSDP, `quantize="fp8"` ([distlab/comm/quantized.py](../distlab/comm/quantized.py),
# lesson 18), scales per block of 256 numbers instead of per tensor: one outlier then coarsens only its block, for
# 4 bytes of scale per block.
#
# ## What to remember
#
# * u = 2^-(m+1) from the mantissa bits: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32, 2^-4 e4m3, 2^-3 e5m2; RMS rounding
#   error 0.42 u. The exponent bits give the range: bf16 = fp32's, fp16 up to 65504 and down to 6e-8.
# * Autocast computes matmuls in bf16 and keeps some ops in fp32 (the losses; on CUDA also softmax and layer norm),
#   with fp32 weights; reductions accumulate in fp32 inside the kernel even when their output is bf16.
# * An update smaller than u·|w| vanishes in a bf16 weight: keep fp32 master weights.
# * A bf16 running sum stalls at 256 ones; accumulate and reduce gradients in fp32.
# * fp16 flushes gradients under 2^-25: scale the loss (dynamically); bf16 needs no scale but rounds 8x coarser.
# * fp8 halves bf16's bytes on the wire at 0.42 u of error per cast, only with a scale (per tensor here;
#   per block of 256 in distlab's `quantize="fp8"`).
#
# **Try it**: in section 3 try `step = 3.8e-3` and `4.0e-3` (either side of u once cast to bf16:
# 3.9e-3 rounds to u itself, a tie); in section 5 set `SMALL = 2.0 ** -10`
# (fewer underflows) and predict the scale the dynamic scaler settles on; in section 6 add `"bf16"` scaling, or gather
# a weight with one large outlier (`w[0] = 10`) and watch e4m3's error grow: one amax scales the whole tensor.
