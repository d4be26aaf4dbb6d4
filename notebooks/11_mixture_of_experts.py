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
# # 11 · Mixture of experts: routing, capacity, and expert parallelism
#
# *Symbols (N, Ψ, S, α, B, b, s, h, ...) as in [docs/notation.md](../docs/notation.md), the one table for every lesson.*
#
# A dense transformer spends the same FLOPs on every token. A **mixture of experts** (MoE) replaces each block's MLP
# by E MLPs, the *experts*, and a small *router* that sends each token to k of them (Shazeer et al. 2017,
# *Outrageously Large Neural Networks*; GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021). The
# model holds E experts' worth of parameters but each token computes with only k (Mixtral 8x7B, Jiang et al. 2024,
# routes each token to 2 of 8 experts per layer).
#
#     x (T, h) -> router: softmax(x W_g) (T, E) -> top-k -> expert (T, k), weight (T, k)
#              -> each expert takes at most C = ceil(capacity_factor * k * T / E) tokens; the rest are dropped
#              -> y(t) = sum over t's kept choices c of weight(t, c) * expert_c(x_t)
#
# Three new problems come with it, and this lesson measures each:
#
# 1. **Load balance.** Nothing stops the router from sending most tokens to a few experts. Switch's auxiliary
#    loss, `E * sum_i f_i P_i` (f_i: the fraction of tokens whose first choice is expert i, P_i: the mean router
#    probability of i), is 1 when the load is uniform and grows as it concentrates; added to the loss, it evens
#    the load out.
# 2. **Capacity.** To keep shapes static, each expert takes at most C tokens. Too small a capacity factor drops
#    tokens (they skip the MLP; the residual carries them on), too large wastes memory and compute.
# 3. **Where the experts live.** Replicating E experts on every rank costs E x the memory of a dense MLP.
#    **Expert parallelism** (GShard; DeepSpeed-MoE, Rajbhandari et al. 2022) keeps E/n experts per rank and
#    moves the *tokens* instead, by two all-to-alls per layer (dispatch and combine) and two more in backward.
#
# The code: the layer with every expert in one process (the router, capacity and the drop rule, the balance loss,
# the experts) in [models/moe.py](../distlab/models/moe.py); then, in the reading order of
# [distlab/parallel/expert/\_\_init\_\_.py](../distlab/parallel/expert/__init__.py), tokens to their experts' ranks
# and back in [dispatch.py](../distlab/parallel/expert/dispatch.py) (the all-to-all itself is traced in
# [collectives.py](../distlab/parallel/collectives.py)) and the same layer with its experts split in
# [moe.py](../distlab/parallel/expert/moe.py); the strategy `ep` in [strategies/expert.py](../distlab/strategies/expert.py);
# the formulas in [theory/moe.py](../distlab/theory/moe.py).

# %%
import dataclasses

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import distlab as dl
from distlab.memory import optimizer_bytes, storage_bytes
from distlab.models import moe

torch.set_num_threads(1)            # the same float rounding, so the same routing, on every run of this lesson
MODEL, N = "gpt-moe-tiny", 2
CFG = dl.models.PRESETS[MODEL]
E, K, H, L = CFG.experts, CFG.top_k, CFG.d_model, CFG.layers
P = dl.theory.gpt_moe_params(CFG.vocab, CFG.seq_len, H, L, E, K, ffn=CFG.mlp_ratio * H, tied=CFG.tied)
assert P.total == sum(p.numel() for p in dl.models.build(MODEL).parameters())
print(f"{MODEL}: h = {H}, {L} MoE layers of E = {E} experts, top_k = {K}, capacity factor {CFG.capacity_factor}, "
      f"aux_coef {CFG.aux_coef}")
print(f"parameters: total {P.total}, active per token {P.active}, in experts {P.experts} "
      f"({P.experts / P.total:.0%}), N = {N} ranks for expert parallelism")
LAB = dataclasses.replace(CFG, experts=8)      # sections 1-3: the same GPT with 8 experts, imbalance shows more
E8 = LAB.experts


# %% [markdown]
# ## 1. Who goes where: tokens per expert
#
# `MoE.route(x)` returns the router's probabilities, the gate weights and a `Routing`: the capacity C, whether each
# (token, choice) pair fit in its expert's capacity (`kept`), and the kept pairs sorted by expert (the expert-parallel
# layer's `route` returns a `Dispatch`: the same, and what each rank sends). We hook the input of
# every MoE layer of the untrained model (from outside: the layer carries no probes) and route one batch of 16
# sequences, 512 tokens. Sections 1 to 3 use the same GPT with 8 experts per layer (`LAB`): with more experts
# an uneven load is easier to see. The rule for who gets the C slots is GShard's: first choices before second choices, and in
# token order within a choice.

# %%
def routing(model, ids):
    """Per MoE layer: tokens per expert by choice (k, E), the capacity C, and kept (T, k)."""
    inputs = []
    hooks = [b.mlp.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for b in model.blocks]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    out = []
    for block, x in zip(model.blocks, inputs):
        probs, weight, d = block.mlp.route(x.reshape(-1, H))                   # x: (B, s, h) -> (T, h)
        expert = probs.topk(K, dim=-1).indices                                 # (T, k)
        counts = F.one_hot(expert.t(), block.mlp.experts).sum(dim=1)           # (k, E)
        out.append({"counts": counts, "capacity": d.capacity, "kept": d.kept})
    return out

DATA = dl.models.dataset_for(MODEL, 0)
ids, _ = DATA.batch(1000, 16)                                                  # a batch no run trains on
torch.manual_seed(0)
untrained = routing(dl.models.GPT(LAB), ids)
for i, layer in enumerate(untrained):
    dropped = int((~layer["kept"]).sum())
    print(f"layer {i}: first choices {layer['counts'][0].tolist()}, second {layer['counts'][1].tolist()}; "
          f"C = {layer['capacity']}; dropped {dropped} of {K * ids.numel()} (token, choice) pairs")
    assert layer["capacity"] == dl.theory.expert_capacity(ids.numel(), E8, K, CFG.capacity_factor)

# %% [markdown]
# ## 2. The auxiliary loss evens the load out
#
# We train the same MoE GPT for 30 steps three times, changing only the weight of the balance loss in the loss:
# 0 (none), Switch's 0.01 (this preset's) and 0.1. After every step we route a held-out batch and record the load
# of the busiest expert relative to the mean (1 = perfectly even) and the fraction of (token, choice) pairs dropped.
# We compare the last 10 steps' averages.

# %%
STEPS = 30

def train_moe(aux_coef):
    cfg = dataclasses.replace(LAB, aux_coef=aux_coef)
    torch.manual_seed(0)
    model = dl.models.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = []
    for step in range(STEPS):
        x, y = DATA.batch(step, 16)
        loss = model.loss(x, y)                                  # cross-entropy + aux_coef * sum of balance losses
        opt.zero_grad()
        loss.backward()
        opt.step()
        layers = routing(model, ids)
        load = torch.stack([r["counts"].sum(dim=0) for r in layers]).float()   # (layers, E): all choices
        history.append({"max_over_mean": (load.max(dim=1).values / load.mean(dim=1)).mean().item(),
                        "dropped": sum(float((~r["kept"]).float().mean()) for r in layers) / len(layers)})
    return model, history

COEFS = (0.0, 0.01, 0.1)
trained = {c: train_moe(c) for c in COEFS}
late = {}
for c, (model, hist) in trained.items():
    late[c] = {key: sum(h[key] for h in hist[-10:]) / 10 for key in ("max_over_mean", "dropped")}
    print(f"aux_coef {c:4}: busiest expert / mean load after step 1 {hist[0]['max_over_mean']:.2f}, "
          f"steps 21-30 {late[c]['max_over_mean']:.2f}; dropped {hist[0]['dropped']:.1%}, then {late[c]['dropped']:.1%}")
for c in (0.01, 0.1):           # the balance loss: a flatter load and fewer drops than without it
    assert late[c]["max_over_mean"] < late[0.0]["max_over_mean"] and late[c]["dropped"] < late[0.0]["dropped"]

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
for c, (model, hist) in trained.items():
    axes[0].plot([h["max_over_mean"] for h in hist], label=f"aux_coef {c}")
    axes[1].plot([100 * h["dropped"] for h in hist], label=f"aux_coef {c}")
axes[0].axhline(1.0, color="k", lw=0.8, ls=":")
axes[0].set(xlabel="step", ylabel="busiest expert / mean load", title="load imbalance (held-out batch)")
axes[1].set(xlabel="step", ylabel="% (token, choice) pairs dropped", title=f"dropped at capacity factor {CFG.capacity_factor}")
w = 0.8 / (len(COEFS) + 1)
for j, (label, layers) in enumerate([("untrained", untrained)] + [(f"aux_coef {c}", routing(m, ids))
                                                                  for c, (m, _) in trained.items()]):
    load = layers[0]["counts"].sum(dim=0)                                      # layer 0, all choices
    axes[2].bar([e + (j - len(COEFS) / 2) * w for e in range(E8)], load.tolist(), w, label=label)
axes[2].axhline(untrained[0]["capacity"], color="k", lw=1, ls="--", label="capacity C")
axes[2].set(xlabel="expert", ylabel="tokens routed (both choices)", title="layer 0: tokens per expert after training",
            xticks=range(E8))
for ax in axes:
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# The imbalance is not the router learning favourites: the untrained router of section 1 is already uneven (its
# busiest expert takes about 1.5 times the mean load), the first AdamW step makes it worse in every run (2.2 to 2.5
# times the mean, a fifth to a quarter of the pairs dropped), and from there training *without* the auxiliary
# loss flattens it (busiest / mean 2.50 -> 1.91 over 30 steps, dropped pairs 26% -> 12%). With the loss it
# flattens further: 1.52 at 0.01, 1.44 at 0.1, with 4% and 2.5% of the pairs dropped. What the loss buys here is the
# difference between those rows. (A router collapsing onto a few experts is real on long runs, which is why
# Switch and GShard add the loss; 30 steps of this tiny model do not show it.) The weight is a trade: too large and the balance term
# fights the language-modelling loss (Switch found 1e-2 a good compromise; here, on a tiny model trained 30 steps,
# a larger weight shows the effect more clearly).
#
# ## 3. Capacity factor vs dropped tokens
#
# If routing were uniform at random, expert e's load would be Binomial(T, k/E), and the expected fraction of pairs
# dropped at capacity C is `E * sum_{l > C} (l - C) P(L = l) / (k T)`: `dl.theory.expected_drop_fraction`. We
# check it with a router whose logits are independent and identically distributed (orthogonal gate rows of equal
# norm, Gaussian tokens: every top-k choice equally likely), averaged over 32 batches of 2048 tokens, then measure
# the trained routers of section 2 on the held-out batch, re-planning their choices at each capacity factor.

# %%
FACTORS = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)
T_UNIFORM = 2048
torch.manual_seed(0)
uniform = moe.MoE(H, 2 * H, E8, top_k=K)                               # every expert in this process
torch.nn.init.orthogonal_(uniform.router.gate.weight)                  # (E, h) rows orthonormal: iid logits
draws = [uniform.router(torch.randn(T_UNIFORM, H))[1] for _ in range(32)]  # expert (T, k) per draw

def dropped_fraction(expert, factor):
    return float((~moe.plan(expert, E8, factor).kept).float().mean())

measured_uniform = [sum(dropped_fraction(x, f) for x in draws) / len(draws) for f in FACTORS]
expected = [dl.theory.expected_drop_fraction(T_UNIFORM, E8, K, f) for f in FACTORS]
print("capacity factor:          " + "  ".join(f"{f:6}" for f in FACTORS))
print("uniform routing, measured " + "  ".join(f"{m:6.1%}" for m in measured_uniform))
print("dl.theory, expected       " + "  ".join(f"{e:6.1%}" for e in expected))
for m, e, f in zip(measured_uniform, expected, FACTORS):
    floor = max(0.0, 1 - f)                    # the fluid limit: what a formula without the binomial tail gives
    if e - floor > 0.005:                      # where the tail matters (here c = 1.0): within 20% of it (32
                                               # batches: sampling noise about 5% of the tail)
        assert abs(m - e) <= 0.2 * (e - floor), (f, m, e)
    else:                                      # elsewhere within 0.2 percentage points
        assert abs(m - e) <= 0.002, (f, m, e)
assert any(e - max(0.0, 1 - f) > 0.005 for e, f in zip(expected, FACTORS))   # the tail is tested somewhere

def model_choices(model):
    inputs = []
    hook = model.blocks[0].mlp.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return model.blocks[0].mlp.router(inputs[0].reshape(-1, H))[1]         # layer 0's expert (T, k)

measured_trained = {c: [dropped_fraction(model_choices(m), f) for f in FACTORS] for c, (m, _) in trained.items()}
for c, row in measured_trained.items():
    print(f"trained, aux_coef {c:4}  " + "  ".join(f"{m:6.1%}" for m in row))

# %%
fig, ax = plt.subplots(figsize=(7, 3.8))
ax.plot(FACTORS, [100 * e for e in expected], "k-", lw=3, alpha=0.35, label="dl.theory: uniform routing")
ax.plot(FACTORS, [100 * m for m in measured_uniform], "ko", label="measured: uniform router")
for c, row in measured_trained.items():
    ax.plot(FACTORS, [100 * m for m in row], "o--", label=f"measured: trained, aux_coef {c} (layer 0)")
ax.set(xlabel="capacity factor", ylabel="% (token, choice) pairs dropped",
       title=f"E = {E8}, k = {K}: what a capacity factor drops")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Below factor 1 at least 1 - factor of the pairs must drop. Even perfectly uniform routing drops some at factor 1:
# the loads fluctuate around their mean
# (by about sqrt(T k / E)). A trained router without the balance loss drops far more; with it, the curve comes
# back towards the uniform one. That is why Switch and GShard train with both a balance loss and a capacity
# factor of 1.0 to 1.25 (and why recent dropless MoEs, such as MegaBlocks, change the kernels instead).
#
# ## 4. Expert parallelism equals one process
#
# Back to `gpt-moe-tiny` (E = 4). `dl.train("ep", world_size=n)` keeps E/n experts per rank (`dl.ep.parallelize`) and every other parameter whole;
# each rank takes its rows of the global batch. Every rank first all-gathers how many tokens it routes to each
# expert, so each one computes the same capacity C from the *global* token count and drops exactly the pairs one
# process would. Equal losses and equal final parameters (within fp32 rounding) at n = 2 and 4, with 6 rows over
# 4 ranks (uneven), and with `options={"experts": "replicated"}` (every expert on every rank, the alternative of
# section 6, routed the same way):

# %%
KW = dict(model=MODEL, steps=3, seed=0, global_batch=6, optimizer="sgd", lr=0.1)   # SGD: rounding stays rounding
single = dl.train("single", **KW)
runs = {"ep n=2": dl.train("ep", world_size=2, **KW), "ep n=4": dl.train("ep", world_size=4, **KW),
        "replicated n=2": dl.train("ep", world_size=2, options={"experts": "replicated"}, **KW)}
print("single         " + " ".join(f"{x:.5f}" for x in single.losses))
for name, rep in runs.items():
    same = all((rep.params[k] - v).norm() <= 1e-5 * v.norm() + 1e-7 for k, v in single.params.items())
    print(f"{name:15}" + " ".join(f"{x:.5f}" for x in rep.losses) + f"   every parameter within 1e-5: {same}")
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(rep.losses, single.losses)) and same


# %% [markdown]
# ## 5. Tokens per rank, and the all-to-all's bytes
#
# Inside a launch on N ranks, each rank routes its own rows; the `Dispatch` says how many rows it sends to each rank
# (`send`) and receives from each (`recv`). The all-to-all is traced by the collective wrapper with the exact bytes
# that leave and arrive (a rank's rows for its own experts stay in memory). Below: for each rank, the rows its
# experts receive, by source rank, beside its experts' total capacity.

# %%
def routed_on_ranks(rows_per_batch):
    model = dl.ep.parallelize(dl.models.build(MODEL, 0))                   # E/N experts here
    x, y = DATA.batch(1000, rows_per_batch)
    mine = dl.models.shard(x, dl.rank(), dl.world_size())                  # (B_r, s): this rank's rows
    inputs = []
    hooks = [b.mlp.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for b in model.blocks]
    mark = len(dl.tracer().events())
    model(mine).sum().backward()                                           # dispatch, combine and their backwards
    for h in hooks:
        h.remove()
    plans = [b.mlp.route(x_in.detach().reshape(-1, H))[2] for b, x_in in zip(model.blocks, inputs)]
    a2a = [(e.sent, e.received) for e in dl.tracer().events()[mark:] if e.name == "all_to_all"]
    return {"send": [d.send for d in plans], "recv": [d.recv for d in plans], "capacity": plans[0].capacity,
            "tokens": mine.numel(), "a2a": a2a}

routed = dl.launch(routed_on_ranks, world_size=N, args=(16,), output="quiet").results
ROW = H * 4                                                                # bytes of one fp32 token row
for r, res in enumerate(routed):
    for layer in range(L):
        send, recv = res["send"][layer], res["recv"][layer]
        out_, in_ = (sum(send) - send[r]) * ROW, (sum(recv) - recv[r]) * ROW
        assert res["a2a"][2 * layer: 2 * layer + 2] == [(out_, in_), (in_, out_)]   # forward: dispatch, combine
    print(f"rank {r}: layer 0 sends rows {res['send'][0]} and receives {res['recv'][0]} (from ranks 0..{N - 1})")

# %%
fig, axes = plt.subplots(1, L, figsize=(5 * L, 3.6), sharey=True)
for layer, ax in enumerate(axes):
    for r in range(N):
        bottom = 0
        for src in range(N):
            got = routed[r]["recv"][layer][src]
            ax.bar(r, got, 0.6, bottom=bottom, color=f"C{src}", label=f"from rank {src}" if r == 0 else None)
            bottom += got
    ax.axhline(routed[0]["capacity"] * E // N, color="k", ls="--", lw=1, label="capacity of its E/N experts")
    ax.set(xlabel="rank (its experts)", ylabel="token rows received", title=f"layer {layer}: rows per rank",
           xticks=range(N))
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# The formula of `dl.theory.moe_all_to_all_bytes` assumes balanced routing and nothing dropped: a rank routes its
# T tokens to k experts each, and (n-1)/n of those k T rows of h fp32 values live on other ranks, so one all-to-all
# sends `k T h 4 (n-1)/n` bytes, and a training step runs four per MoE layer. We compare it with the bytes the
# training run `ep n=2` of section 4 sent by all-to-all per step, and with a router made exactly balanced (token t's
# choices t mod E and t+1 mod E, a capacity that fits them all), where the prediction must be exact.

# %%
ep_run = dl.train("ep", world_size=N, model=MODEL, steps=2, seed=0, global_batch=16)
tokens = 16 // N * CFG.seq_len                                             # per rank
predicted_step = dl.theory.moe_step_all_to_all_bytes(tokens, H, K, N, L)
for r in range(N):
    sent = ep_run.comm[r]["sent_by_op"]["all_to_all"] / 2
    print(f"rank {r}: all-to-all bytes sent per step {sent:8.0f}, dl.theory (balanced) {predicted_step:8.0f}, "
          f"ratio {sent / predicted_step:.2f}")
    assert abs(sent / predicted_step - 1) <= 0.25                          # routing is only roughly balanced

def balanced(tokens_per_rank):
    layer = dl.ep.MoE(H, 2 * H, E, top_k=2, capacity_factor=1.0)              # experts over the world
    with torch.no_grad():
        layer.router.gate.weight.copy_(10 * torch.eye(E, H))
    t = torch.arange(tokens_per_rank * dl.rank(), tokens_per_rank * (dl.rank() + 1))
    x = 2.0 * F.one_hot(t % E, H) + F.one_hot((t + 1) % E, H)              # first choice t mod E, then t+1
    mark = len(dl.tracer().events())
    layer(x.float().requires_grad_()).sum().backward()
    return [e.sent for e in dl.tracer().events()[mark:] if e.name == "all_to_all"]

exact = dl.launch(balanced, world_size=N, args=(tokens,), output="quiet").results
one = dl.theory.moe_all_to_all_bytes(tokens, H, K, N)
print(f"balanced router: 4 all-to-alls of {exact[0]} bytes on every rank; dl.theory: {one:.0f} each")
assert all(sent == [one] * 4 for sent in exact)


# %% [markdown]
# ## 6. When does expert parallelism beat replicating the experts?
#
# Two ways to train an MoE on n ranks, both data parallel for everything else:
#
#     replicated   every rank: dense + E experts     sends: all-reduce of every gradient    2 (n-1)/n x 4 P_total
#     ep           every rank: dense + E/n experts   sends: all-reduce of dense gradients   2 (n-1)/n x 4 P_dense
#                                                         + all-to-all of tokens            4 L x k T h 4 (n-1)/n
#
# **Memory**: expert parallelism always wins, by (n-1)/n of the experts' share (with AdamW in fp32, 16 bytes a
# parameter). **Bytes**: the all-to-all grows with the tokens per rank T, the expert all-reduce with the expert
# parameters; expert parallelism sends less while
#
#     4 L k T h < 2 P_experts,     i.e.   T < T* = P_experts / (2 L k h)
#
# We measure the memory, on N = 2 ranks: model-state bytes after one AdamW step. The bytes per step, at two batch
# sizes, one on each side of T*, are half measured: the all-to-all's bytes are counted exactly (each rank's rows
# times their size, `bytes="exact"`), while the gradients' all-reduce runs on torch's gloo and is recorded with a
# ring's bytes for the real calls (`bytes="ring-model"`, as in lessons 04, 06 and 09): modelled. So we also
# measure them: `dl.comm.replay` re-runs those all-reduce calls, same sizes, on distlab's own ring of send/recv,
# where every byte is counted as it is sent, and the count must equal 2 (n-1)/n x 4 P exactly (a wrong P_dense or
# a wrong ring factor fails it).

# %%
def model_states(replicate):
    model = dl.ep.parallelize(dl.models.build(MODEL, 0), replicate=replicate)
    opt = torch.optim.AdamW(model.parameters())
    x, y = DATA.batch(0, 4)
    mine = lambda t: dl.models.shard(t, dl.rank(), dl.world_size())      # noqa: E731
    model.loss(mine(x), mine(y)).backward()
    opt.step()
    params = list(model.parameters())
    return storage_bytes(params) + storage_bytes(p.grad for p in params) + optimizer_bytes(opt)

memory = {side: dl.launch(model_states, world_size=N, args=(side == "replicated",), output="quiet").results
          for side in ("ep", "replicated")}
for side, ranks in memory.items():
    want = dl.theory.ep_memory(P, N if side == "ep" else 1)                # 16 bytes per parameter held
    print(f"{side:10}: model states per rank {ranks}, dl.theory {want:.0f}")
    assert all(abs(b - want) <= 0.01 * want for b in ranks)             # Adam's step counters: the rest

# %%
T_STAR = P.experts / (2 * L * K * H)
ring = 2 * (N - 1) / N * 4                                                 # bytes sent per fp32 gradient element
sent, predicted, SIZES = {}, {}, [4 // N * CFG.seq_len, 32 // N * CFG.seq_len]   # tokens per rank
for batch in (4, 32):
    t = batch // N * CFG.seq_len
    for side in ("ep", "replicated"):
        opts = {} if side == "ep" else {"experts": "replicated"}
        rep = dl.train("ep", world_size=N, model=MODEL, steps=1, seed=0, global_batch=batch, options=opts)
        by_op = rep.comm[0]["sent_by_op"]
        sent[side, t] = by_op.get("all_reduce", 0) + by_op.get("all_to_all", 0)
        predicted[side, t] = ring * (P.dense if side == "ep" else P.total) + (
            dl.theory.moe_step_all_to_all_bytes(t, H, K, N, L) if side == "ep" else 0)
        grads = [(e.name, e.args["size"]) for e in rep.run.trace.comms(rank=0, op="all_reduce")]
        wire = dl.launch(dl.comm.replay, world_size=N, args=(grads,)).results[0]   # counted at each send
        assert by_op["all_reduce"] == wire == ring * (P.dense if side == "ep" else P.total), (side, wire)
    print(f"T = {t:4} tokens per rank (T* = {T_STAR:.0f}): bytes recorded per step  ep {sent['ep', t]:7.0f} "
          f"(predicted {predicted['ep', t]:7.0f}),  replicated {sent['replicated', t]:7.0f} "
          f"(predicted {predicted['replicated', t]:7.0f})")
small, large = SIZES
assert small < T_STAR < large
assert sent["ep", small] < sent["replicated", small] and sent["ep", large] > sent["replicated", large]

# %%
fig, (ax_b, ax_m) = plt.subplots(1, 2, figsize=(12, 3.8))
ts = list(range(16, 1025, 16))
ax_b.plot(ts, [(ring * P.dense + dl.theory.moe_step_all_to_all_bytes(t, H, K, N, L)) / 1024 for t in ts],
          "C0-", label="ep: dense all-reduce + all-to-all (theory)")
ax_b.plot(ts, [ring * P.total / 1024] * len(ts), "C1-", label="replicated: all-reduce (theory)")
for (side, t), b in sent.items():
    ax_b.plot(t, b / 1024, "o", color="C0" if side == "ep" else "C1")
ax_b.axvline(T_STAR, color="k", ls=":", label=f"T* = {T_STAR:.0f}")
ax_b.set(xlabel="tokens per rank per step", ylabel="KiB sent per rank per step",
         title=f"{MODEL}, N = {N}: dots recorded (all-to-all exact, all-reduce ring-model)")
ax_b.legend(fontsize=8)
ns = [1, 2, 4, 8]
mixtral = dl.theory.gpt_moe_params(32000, 4096, 4096, 32, 8, 2, ffn=14336, tied=False, bias=False)   # 2-matrix experts
ax_m.bar([str(n) for n in ns], [dl.theory.ep_memory(mixtral, n) / 1e9 for n in ns], color="C0", label="ep")
ax_m.axhline(dl.theory.ep_memory(mixtral, 1) / 1e9, color="C1", label="replicated")
ax_m.set(xlabel="expert-parallel degree n", ylabel="GB of model states per GPU (16 B/param)",
         title="Mixtral-shaped: h 4096, 32 layers, 8 experts of f 14336 (theory)")
ax_m.legend(fontsize=8)
fig.tight_layout()
plt.show()
t_star_big = mixtral.experts / (2 * 32 * 2 * 4096)
print(f"Mixtral-shaped (two-matrix experts; Mixtral's SwiGLU experts have three): {mixtral.total / 1e9:.1f}B "
      f"parameters, {mixtral.active / 1e9:.1f}B active per token; replicated model states "
      f"{dl.theory.ep_memory(mixtral, 1) / 1e9:.0f} GB per GPU, ep over 8: {dl.theory.ep_memory(mixtral, 8) / 1e9:.0f} GB; "
      f"T* = {t_star_big:,.0f} tokens per GPU per step")

# %% [markdown]
# At the tiny scale of this lesson the crossover sits at a couple of hundred tokens per rank, because the experts
# are small. At the scale MoEs are built for, T* is tens of thousands of tokens per GPU, more than a micro-batch
# usually holds, and the replicated model states exceed any GPU's memory: expert parallelism is not an
# optimisation there but the only way the model fits. Real systems combine it with the rest: experts split over an
# `ep` group inside a node (the all-to-all wants fast links), data parallelism across, and tensor or pipeline
# parallelism for the dense part.
#
# ## What to remember
#
# * An MoE holds E experts but each token computes with k: parameters (memory) and FLOPs come apart.
#   `dl.theory.gpt_moe_params` gives total and active.
# * Capacity C = ceil(capacity_factor k T / E): what does not fit is dropped, first choices before second, in
#   token order. Even uniform routing drops a few percent at factor 1 (`dl.theory.expected_drop_fraction`).
# * The Switch balance loss `E sum f_i P_i` (1 when even) flattens the load: here the imbalance was there from the
#   start, training alone reduced it, and the loss reduced it further (fewer drops, a flatter load, measured).
# * Expert parallelism splits the experts and moves tokens: four all-to-alls per MoE layer per step, `k T h (n-1)/n`
#   values each under balance. With the token counts all-gathered first, it drops exactly what one process drops,
#   so it equals single.
# * It always saves memory; it also saves bytes while T < T* = P_experts / (2 L k h).
# * Strategies that would train an MoE wrongly (tp, cp, a 3d mesh without an ep axis) refuse it, naming the ones
#   that run it. A pipeline routes per microbatch, and each stage's MoE layers carry their balance loss into
#   backward themselves (`dl.pp.ride_balance_losses`), since the loss lives on the last stage.
#
# **Try it**: set `N = 4` in the first cell (one expert per rank) and re-run: the rows per rank split four ways,
# the all-to-all sends 3/4 of the rows instead of 1/2, and T* stays where it was (it does not depend on n).

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
# **top_k_router**: top_k_router(logits (T, E), k) -> (expert (T, k), weight (T, k)): softmax over experts, top k, weights renormalised when k > 1

# %% nbgrader={"grade": false, "grade_id": "top_k_router", "locked": false, "points": 0, "schema_version": 3, "solution": true}
def top_k_router(logits: torch.Tensor, k: int):
    """(expert (T, k), weight (T, k)): softmax over all experts, the k largest, renormalised to sum to 1
    when k > 1 (GShard; Switch keeps k = 1 unnormalised). As `distlab/models/moe.py`'s `Router`."""
    ### BEGIN SOLUTION
    weight, expert = logits.float().softmax(dim=-1).topk(k, dim=-1)
    if k > 1:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    return expert, weight
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "check_top_k_router", "locked": true, "points": 1, "schema_version": 3, "solution": false}
dl.exercises.check("top_k_router", top_k_router).require();
