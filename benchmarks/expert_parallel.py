"""Expert parallelism (dl.ep, experts split, tokens by all-to-all) beside replicated experts (every expert on
every rank, gradients all-reduced): same MoE GPT, same global batch, same routing.

    python benchmarks/expert_parallel.py                    # 2 and 4 ranks, gloo on CPU
    python benchmarks/expert_parallel.py --ranks 2 --steps 10 --experts 4

There is no torch implementation of expert parallelism to set beside it; the question a practitioner
asks is whether splitting the experts pays against simply replicating them (data parallelism):

    replicated   holds dense + E experts       sends 2 (n-1)/n x (all gradients)          all-reduce
    ep           holds dense + E/n experts     sends 2 (n-1)/n x (dense gradients)         all-reduce
                                                   + 4 L x k T h b (n-1)/n (balanced)       all-to-all

Both route over the whole global batch (`dl.ep.MoE`, ``replicate=True`` for the copies), so they drop the
same tokens and their losses agree to fp32 rounding. Reported per world size: the step time (zero_grad,
forward, backward, gradient sum, AdamW step; for each step the slowest rank's, the median over steps; the
two alternate step by step inside one launch so they see the same background load), the model-state
memory per rank (parameters, gradients, AdamW state, measured by `distlab.memory`) beside
`dl.theory.ep_memory`, and the bytes each rank sent per step by collective (traced) beside the formulas.
Targets (computed): losses equal (max relative difference <= 1e-5); ep's model-state memory per rank
within 1% of the theory; ep's step time <= the replicated run's wherever the theory says ep sends fewer
bytes. Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import machine_facts, parser, write  # noqa: E402
from distlab.memory import optimizer_bytes, storage_bytes  # noqa: E402
from distlab.models import GPT, GPTConfig, MarkovTokens, shard  # noqa: E402
from distlab.parallel.data.buckets import grad_summer  # noqa: E402

SIDES = ("ep", "replicated")


def build(cfg: GPTConfig, seed: int, replicate: bool, lr: float):
    """The MoE GPT from ``seed``, its experts split (or replicated), AdamW, and its gradient sum."""
    torch.manual_seed(seed)
    model = dl.ep.parallelize(GPT(cfg).to(dl.device()), replicate=replicate)
    split = {id(p) for p in dl.ep.expert_params(model)} if not replicate else set()
    dense = [p for p in model.parameters() if id(p) not in split]
    return model, torch.optim.AdamW(model.parameters(), lr=lr), grad_summer(dense)


def one_step(model, opt, sync, ids, targets, batch: int) -> float:
    """A training step of this rank's rows; returns the whole batch's loss (shares summed, untimed)."""
    opt.zero_grad(set_to_none=True)
    ce = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss = ce * ids.shape[0] / batch + model.aux_loss()          # this rank's share of the batch's loss
    loss.backward()
    sync()
    opt.step()
    return loss.detach()


def measure(cfg: GPTConfig, steps: int, warmup: int, batch: int, seed: int, lr: float) -> dict:
    n, r = dl.world_size(), dl.rank()
    data = MarkovTokens(cfg.vocab, cfg.seq_len, seed=seed)
    sides = {"ep": build(cfg, seed, False, lr), "replicated": build(cfg, seed, True, lr)}
    times = {k: [] for k in SIDES}
    losses = {k: [] for k in SIDES}
    sent = {k: {} for k in SIDES}
    for step in range(warmup + steps):
        x, y = data.batch(step, batch)
        ids, targets = shard(x, r, n).to(dl.device()), shard(y, r, n).to(dl.device())   # (B_r, s)
        for name in (SIDES if step % 2 == 0 else SIDES[::-1]):
            dl.tracer().clear()
            dist.barrier()
            t0 = time.perf_counter()
            loss = one_step(*sides[name], ids, targets, batch)
            elapsed = time.perf_counter() - t0
            for e in dl.tracer().events():
                if e.kind == "comm":
                    sent[name][e.name] = sent[name].get(e.name, 0) + e.sent
            dist.all_reduce(loss)                                  # metrics only
            losses[name].append(loss.item())
            if step >= warmup:
                times[name].append(elapsed)
    memory = {}
    for name, (model, opt, _) in sides.items():
        params = list(model.parameters())
        memory[name] = storage_bytes(params) + storage_bytes(p.grad for p in params) + optimizer_bytes(opt)
    per_step = {k: {op: b / (warmup + steps) for op, b in v.items()} for k, v in sent.items()}
    return {"times": times, "losses": losses, "memory": memory, "sent_per_step": per_step}


def predicted(cfg: GPTConfig, n: int, batch: int) -> dict:
    """dl.theory's numbers for one rank: model-state bytes (fp32 AdamW: 16 per parameter) and bytes sent
    per step by all-reduce (ring: 2 (n-1)/n of the gradients) and by all-to-all (balanced routing)."""
    p = dl.theory.gpt_moe_params(cfg.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.experts, cfg.top_k,
                                 ffn=cfg.mlp_ratio * cfg.d_model, tied=cfg.tied)
    ring = 2 * (n - 1) / n * 4                                     # bytes sent per fp32 gradient element
    tokens = batch // n * cfg.seq_len if batch % n == 0 else batch / n * cfg.seq_len
    a2a = dl.theory.moe_step_all_to_all_bytes(tokens, cfg.d_model, cfg.top_k, n, cfg.layers)
    return {"ep": {"memory": dl.theory.ep_memory(p, n), "all_reduce": ring * p.dense, "all_to_all": a2a},
            "replicated": {"memory": dl.theory.ep_memory(p, 1), "all_reduce": ring * p.total,
                           "all_to_all": 0.0}}


def summarise(per_rank: list[dict], n: int, cfg: GPTConfig, batch: int) -> dict:
    out = {"world_size": n, "predicted": predicted(cfg, n, batch)}
    for name in SIDES:
        count = len(per_rank[0]["times"][name])
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(count)]
        out[name] = {"median_step_s": statistics.median(slowest), "steps": count,
                     "losses": per_rank[0]["losses"][name],
                     "memory_per_rank": [r["memory"][name] for r in per_rank],
                     "sent_per_step": per_rank[0]["sent_per_step"][name]}
    a, b = out["ep"]["losses"], out["replicated"]["losses"]
    out["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    out["time_ratio_ep_over_replicated"] = out["ep"]["median_step_s"] / out["replicated"]["median_step_s"]
    pred = out["predicted"]
    out["memory_ratio_measured_over_theory"] = max(out["ep"]["memory_per_rank"]) / pred["ep"]["memory"]
    fewer = pred["ep"]["all_reduce"] + pred["ep"]["all_to_all"] < pred["replicated"]["all_reduce"]
    out["targets"] = {
        "losses_equal": {"want": "max relative loss difference <= 1e-5",
                         "met": out["max_rel_loss_diff"] <= 1e-5},
        "memory": {"want": "ep model-state bytes per rank within 1% of dl.theory.ep_memory",
                   "met": abs(out["memory_ratio_measured_over_theory"] - 1) <= 0.01},
        "time": {"want": "ep step <= replicated step where theory predicts ep sends fewer bytes",
                 "theory_ep_sends_fewer": fewer,
                 "met": (out["time_ratio_ep_over_replicated"] <= 1.0) if fewer else None}}
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ns, w = [r["world_size"] for r in rows], 0.38
    for k, name in enumerate(SIDES):
        xs = [i + (k - 0.5) * w for i in range(len(ns))]
        axes[0].bar(xs, [r[name]["median_step_s"] * 1e3 for r in rows], w, label=name)
        axes[1].bar(xs, [max(r[name]["memory_per_rank"]) / 2**20 for r in rows], w, label=f"{name} measured")
        axes[1].plot(xs, [r["predicted"][name]["memory"] / 2**20 for r in rows], "k_", ms=18,
                     label="dl.theory" if k else None)
        for op, hatch in (("all_reduce", ""), ("all_to_all", "//")):
            bottom = [r[name]["sent_per_step"].get("all_reduce", 0) / 2**20 if op == "all_to_all" else 0
                      for r in rows]
            axes[2].bar(xs, [r[name]["sent_per_step"].get(op, 0) / 2**20 for r in rows], w, bottom=bottom,
                        hatch=hatch, color=f"C{k}", alpha=0.8, label=f"{name} {op}")
        axes[2].plot(xs, [(r["predicted"][name]["all_reduce"] + r["predicted"][name]["all_to_all"]) / 2**20
                          for r in rows], "k_", ms=18, label="dl.theory (balanced)" if k else None)
    for i, r in enumerate(rows):
        axes[0].text(i, max(r[s]["median_step_s"] for s in SIDES) * 1e3 * 1.02,
                     f"{r['time_ratio_ep_over_replicated']:.2f}x", ha="center", fontsize=9)
    labels = [f"n={n}" for n in ns]
    for ax, ylabel, t in ((axes[0], "median step (ms), slowest rank", f"{title}: step time (ep/replicated)"),
                          (axes[1], "MiB per rank", "model states (params, grads, AdamW)"),
                          (axes[2], "MiB sent per rank per step", "bytes sent, traced")):
        ax.set_xticks(range(len(ns)), labels)
        ax.set(ylabel=ylabel, title=t)
        ax.margins(y=0.12)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = parser("expert_parallel", __doc__, model=False, steps=30, warmup=3)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    a = p.parse_args(argv)
    cfg = GPTConfig(vocab=256, seq_len=a.seq_len, d_model=a.d_model, heads=4, layers=a.layers, mlp_ratio=4,
                    experts=a.experts, top_k=2, capacity_factor=1.25, aux_coef=0.01)
    rows, backend, started = [], None, time.time()
    for n in [int(x) for x in a.ranks.split(",")]:
        if a.experts % n:
            raise SystemExit(f"--experts {a.experts} do not split over {n} ranks: choose --ranks dividing it")
        run = dl.launch(measure, world_size=n, args=(cfg, a.steps, a.warmup, a.batch, a.seed, a.lr),
                        backend=a.backend, output="live", timeout=1800)
        backend = run.backend
        rows.append(summarise(run.results, n, cfg, a.batch))
        r = rows[-1]
        print(f"n={n}: ep {r['ep']['median_step_s'] * 1e3:.2f} ms, replicated "
              f"{r['replicated']['median_step_s'] * 1e3:.2f} ms ({r['time_ratio_ep_over_replicated']:.2f}x); "
              f"memory per rank {max(r['ep']['memory_per_rank']) / 2**20:.2f} vs "
              f"{max(r['replicated']['memory_per_rank']) / 2**20:.2f} MiB; max relative loss difference "
              f"{r['max_rel_loss_diff']:.1e}", flush=True)
    meta = {**machine_facts(started, backend), "model": {k: v for k, v in vars(cfg).items()},
            "batch": a.batch, "steps": a.steps, "warmup": a.warmup, "dtype": "float32", "optimizer": "AdamW",
            "statistic": "median over steps of the slowest rank's step time (zero_grad+fwd+bwd+sum+step)",
            "memory": "model states (params, grads, AdamW state) by distinct storage, after the last step"}
    write(a.out, {"meta": meta, "results": rows}, lambda png: plot(rows, png, f"MoE GPT E={a.experts}"))


if __name__ == "__main__":
    main()
