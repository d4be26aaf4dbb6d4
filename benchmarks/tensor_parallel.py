"""dl.tp (Megatron-style TP from autograd functions) beside torch's DTensor `parallelize_module`.

    python benchmarks/tensor_parallel.py                     # gpt-small, 2 and 4 ranks, gloo on CPU
    python benchmarks/tensor_parallel.py --model gpt-wide --ranks 2 --steps 30

Both sides shard the same GPT the same way, from the same full weights:

    q, k, v, mlp.fc   dl.tp: ColumnParallelLinear       torch: ColwiseParallel()
    attn.proj, mlp.proj    RowParallelLinear                   RowwiseParallel()
    tok (embedding)        VocabParallelEmbedding              RowwiseParallel(input_layouts=Replicate())
    head                   ColumnParallelLinear (vocab)        ColwiseParallel(output_layouts=Shard(-1))
    loss                   vocab_parallel_cross_entropy        F.cross_entropy under loss_parallel()

and train with AdamW on the same batches. Reported: the losses of both (they must agree to fp32
rounding) and the step time (forward + backward + optimizer), for each step the slowest rank's, the
median over steps. The two implementations alternate step by step inside one launch, so they see the
same background load. Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import machine_facts, parser, write  # noqa: E402
from distlab.models import GPT, PRESETS, dataset_for  # noqa: E402


def torch_tp(gpt: GPT, mesh) -> GPT:
    """The same sharding with DTensor's tensor-parallel API."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"tok": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(gpt.blocks)):
        plan.update({f"blocks.{i}.attn.q": ColwiseParallel(), f"blocks.{i}.attn.k": ColwiseParallel(),
                     f"blocks.{i}.attn.v": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    return parallelize_module(gpt, mesh, plan)


def measure(model: str, steps: int, warmup: int, batch: int, seed: int, lr: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    cfg, data, device = PRESETS[model], dataset_for(model, seed), dl.device()
    torch.manual_seed(seed)
    ours = dl.tp.parallelize(GPT(cfg).to(device))
    torch.manual_seed(seed)
    theirs = torch_tp(GPT(cfg).to(device), init_device_mesh(device.type, (dl.world_size(),)))
    opts = {"dl.tp": torch.optim.AdamW(ours.parameters(), lr=lr),
            "torch DTensor": torch.optim.AdamW(theirs.parameters(), lr=lr)}

    def step_ours(ids, targets):
        loss = ours.loss(ids, targets)
        loss.backward()
        return loss

    def step_theirs(ids, targets):
        with loss_parallel():
            loss = F.cross_entropy(theirs(ids).flatten(0, 1), targets.flatten())
            loss.backward()
        return loss

    fns = {"dl.tp": step_ours, "torch DTensor": step_theirs}
    times = {k: [] for k in fns}
    losses = {k: [] for k in fns}
    for step in range(warmup + steps):
        ids, targets = (t.to(device) for t in data.batch(step, batch))
        order = list(fns) if step % 2 == 0 else list(fns)[::-1]
        for name in order:
            dl.tracer().clear()
            dist.barrier()
            t0 = time.perf_counter()
            opts[name].zero_grad(set_to_none=True)
            loss = fns[name](ids, targets)
            opts[name].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            loss = loss.detach()
            losses[name].append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
            if step >= warmup:
                times[name].append(elapsed)
    return {"times": times, "losses": losses}


def summarise(per_rank, n):
    out = {"world_size": n}
    for name in per_rank[0]["times"]:
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))]
        out[name] = {"median_step_s": statistics.median(slowest), "steps": len(slowest),
                     "losses": per_rank[0]["losses"][name]}
    out["ratio_dl_over_torch"] = out["dl.tp"]["median_step_s"] / out["torch DTensor"]["median_step_s"]
    a, b = out["dl.tp"]["losses"], out["torch DTensor"]["losses"]
    out["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    return out


def plot(rows, path, model):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [r["world_size"] for r in rows]
    for k, name in enumerate(("dl.tp", "torch DTensor")):
        ax_t.bar([i + (k - 0.5) * 0.38 for i in range(len(ns))],
                 [r[name]["median_step_s"] * 1e3 for r in rows], 0.38, label=name)
    for i, r in enumerate(rows):
        ax_t.text(i, max(r["dl.tp"]["median_step_s"], r["torch DTensor"]["median_step_s"]) * 1e3 * 1.02,
                  f"{r['ratio_dl_over_torch']:.2f}x", ha="center", fontsize=9)
    ax_t.set_xticks(range(len(ns)), [f"t={n}" for n in ns])
    ax_t.set(ylabel="median step time (ms), slowest rank", title=f"{model}: step time (ratio dl/torch above)")
    ax_t.legend(fontsize=8)
    for r in rows:
        ax_l.plot(r["torch DTensor"]["losses"], "k-", lw=3, alpha=0.3)
        ax_l.plot(r["dl.tp"]["losses"], "--", label=f"dl.tp t={r['world_size']} (grey: DTensor)")
    ax_l.set(xlabel="step", ylabel="loss", title="losses (warm-up steps included)")
    ax_l.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = parser("tensor_parallel", __doc__, steps=40, warmup=5)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args(argv)
    rows, backend, started = [], None, time.time()
    for n in [int(x) for x in a.ranks.split(",")]:
        run = dl.launch(measure, world_size=n, args=(a.model, a.steps, a.warmup, a.batch, a.seed, a.lr),
                        backend=a.backend, output="live", timeout=1800)
        backend = run.backend
        rows.append(summarise(run.results, n))
        r = rows[-1]
        print(f"t={n}: dl.tp {r['dl.tp']['median_step_s'] * 1e3:.2f} ms, torch DTensor "
              f"{r['torch DTensor']['median_step_s'] * 1e3:.2f} ms, ratio {r['ratio_dl_over_torch']:.2f} "
              f"(target <= 1.1); max relative loss difference {r['max_rel_loss_diff']:.1e}", flush=True)
    meta = {**machine_facts(started, backend), "model": a.model, "batch": a.batch, "steps": a.steps,
            "warmup": a.warmup, "dtype": "float32", "optimizer": "AdamW",
            "statistic": "median over steps of the slowest rank's step time (zero_grad+fwd+bwd+step)"}
    write(a.out, {"meta": meta, "results": rows}, lambda png: plot(rows, png, a.model))


if __name__ == "__main__":
    main()
