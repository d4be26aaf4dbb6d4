"""distlab's data parallelism beside torch's own, on the same model and data, in one run.

    python benchmarks/data_parallel.py                        # gpt-small, 2 and 4 ranks, gloo on CPU
    python benchmarks/data_parallel.py --ranks 2 --steps 30 --rows 16

Three pairs, each side built from the same seed (identical weights) and fed the same batches:

    pair    distlab                               torch
    ddp     dl.DDP(model) + AdamW                 DistributedDataParallel(model, gradient_as_bucket_view=True)
                                                  + AdamW
    zero1   model + dl.ShardedOptimizer(AdamW)    DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)
    zero3   dl.ZeRO(model, stage=3, AdamW)        fully_shard(each block), fully_shard(model) (FSDP2) + AdamW

Both DDPs use 25 MB buckets and overlap communication with backward; both ZeRO-3s gather per transformer
block (the root module holds the embeddings, final norm and head) and reshard after forward.

Step time: zero_grad + forward + backward + optimizer step, behind a barrier; for each step the slowest
rank's time; the median over the steps after warm-up. All six implementations live in one launch and take
their steps in turn (the two sides of a pair alternating which goes first), so they see the same background
load. Memory per rank: the model states (parameters, gradients, optimizer state) counted by distinct storage
after backward and after the optimizer step (the larger of the two per category: a ZeRO optimizer may free
its gradient shards inside ``step``), from each side's own tensors (a DTensor counts its local shard); on
CUDA also the allocator's peak for each implementation run alone. Losses of the two sides of a pair must
agree.
Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import machine_facts, parser, write  # noqa: E402
from _sides import STATES, Side, global_mean, sampled_states, sync, take_turns, torch_states  # noqa: E402
from distlab.models import build, dataset_for  # noqa: E402
from distlab.memory import optimizer_bytes, replica_memory, storage_bytes, zero_memory  # noqa: E402

PAIRS = {"ddp": ("dl.DDP", "torch DDP"), "zero1": ("dl.ShardedOptimizer", "torch ZeroRedundancyOptimizer"),
         "zero3": ("dl.ZeRO stage 3", "torch FSDP2 fully_shard")}


class Impl(Side):
    """One implementation: ``step(x, y) -> loss`` and ``states()`` (model-state bytes on this rank)."""

    def __init__(self, name: str, model_name: str, seed: int, lr: float, zero3_prefetch: bool):
        self.name = name
        gpt = build(model_name, seed).to(dl.device())
        adamw = dict(lr=lr)
        if name == "dl.DDP":
            self.model = dl.DDP(gpt)
            self.opt = torch.optim.AdamW(gpt.parameters(), **adamw)
            self.states = replica_memory(gpt, self.opt)
        elif name == "torch DDP":
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(gpt, gradient_as_bucket_view=True)
            self.opt = torch.optim.AdamW(gpt.parameters(), **adamw)
            self.states = lambda: torch_states(gpt, self.opt)
        elif name == "dl.ShardedOptimizer":
            self.model = gpt
            self.opt = dl.ShardedOptimizer(gpt.parameters(), torch.optim.AdamW, **adamw)
            self.states = lambda: {"params": storage_bytes(b.full for b in self.opt.buckets),
                                   "grads": storage_bytes(p.grad for p in gpt.parameters()),
                                   "optimizer": optimizer_bytes(self.opt.optimizer)}
        elif name == "torch ZeroRedundancyOptimizer":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel
            self.model = DistributedDataParallel(gpt, gradient_as_bucket_view=True)
            self.opt = ZeroRedundancyOptimizer(gpt.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
            self.states = lambda: torch_states(gpt, self.opt)
        elif name == "dl.ZeRO stage 3":
            self.model = dl.ZeRO(gpt, stage=3, optim=torch.optim.AdamW, prefetch=zero3_prefetch, **adamw)
            self.opt = self.model.optimizer
            measure = zero_memory(self.model)
            self.states = lambda: {k: v for k, v in measure().items() if k in STATES}
        elif name == "torch FSDP2 fully_shard":
            from torch.distributed.fsdp import fully_shard
            for block in gpt.blocks:
                fully_shard(block)
            self.model = fully_shard(gpt)
            self.opt = torch.optim.AdamW(gpt.parameters(), **adamw)
            self.states = lambda: torch_states(gpt, self.opt)
        else:
            raise ValueError(f"unknown implementation {name!r}")

def measure(model: str, steps: int, warmup: int, rows: int, seed: int, lr: float, pairs: list[str],
            zero3_prefetch: bool):
    n, r, device = dl.world_size(), dl.rank(), dl.device()
    data = dataset_for(model, seed)
    names = [name for p in pairs for name in PAIRS[p]]
    batches = [tuple(t.to(device) for t in data.batch(step, rows * n)) for step in range(warmup + steps)]
    mine = lambda t: t.chunk(n)[r]                                          # noqa: E731
    cuda_peak = {}
    if device.type == "cuda":                     # each implementation alone, for the allocator's peak
        for name in names:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            impl = Impl(name, model, seed, lr, zero3_prefetch)
            for x, y in batches[:2]:
                impl.step(mine(x), mine(y))
            sync()
            cuda_peak[name] = torch.cuda.max_memory_allocated(device) - base
            del impl
    impls = {name: Impl(name, model, seed, lr, zero3_prefetch) for name in names}
    times, losses = take_turns(impls, [PAIRS[pair] for pair in pairs], batches, warmup, mine)
    states = sampled_states(impls, batches[-1], mine)
    losses = global_mean(losses)                 # the global mean loss, for comparing the two sides
    return {"times": times, "losses": losses, "states": states, "cuda_peak": cuda_peak}


def summarise(per_rank: list[dict], n: int, pairs: list[str]) -> dict:
    out = {"world_size": n, "pairs": {}}
    for pair in pairs:
        row = {}
        for name in PAIRS[pair]:
            k = len(per_rank[0]["times"][name])
            slowest = [max(rk["times"][name][i] for rk in per_rank) for i in range(k)]
            states = [rk["states"][name] for rk in per_rank]
            row[name] = {"median_step_s": statistics.median(slowest), "steps": k,
                         "states_per_rank": [{c: s[c] for c in STATES} for s in states],
                         "max_states_bytes": max(sum(s[c] for c in STATES) for s in states),
                         "losses": per_rank[0]["losses"][name]}
            if per_rank[0]["cuda_peak"]:
                row[name]["cuda_peak_bytes"] = max(rk["cuda_peak"][name] for rk in per_rank)
        ours, theirs = PAIRS[pair]
        row["time_ratio_dl_over_torch"] = row[ours]["median_step_s"] / row[theirs]["median_step_s"]
        row["memory_ratio_dl_over_torch"] = row[ours]["max_states_bytes"] / row[theirs]["max_states_bytes"]
        a, b = row[ours]["losses"], row[theirs]["losses"]
        row["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        out["pairs"][pair] = row
    return out


def plot(rows: list[dict], path: str, model: str, pairs: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.4))
    labels, width = [], 0.38
    for i, (row, pair) in enumerate((row, pair) for row in rows for pair in pairs):
        ours, theirs = PAIRS[pair]
        res = row["pairs"][pair]
        labels.append(f"{pair}\nN={row['world_size']}")
        for k, (name, colour) in enumerate(((ours, "#4C72B0"), (theirs, "#DD8452"))):
            ax_t.bar(i + (k - 0.5) * width, res[name]["median_step_s"] * 1e3, width, color=colour,
                     label=("distlab" if k == 0 else "torch") if i == 0 else None)
            ax_m.bar(i + (k - 0.5) * width, res[name]["max_states_bytes"] / 2**20, width, color=colour,
                     label=("distlab" if k == 0 else "torch") if i == 0 else None)
        top = max(res[ours]["median_step_s"], res[theirs]["median_step_s"]) * 1e3
        ax_t.text(i, top * 1.02, f"{res['time_ratio_dl_over_torch']:.2f}x", ha="center", fontsize=8)
        top = max(res[ours]["max_states_bytes"], res[theirs]["max_states_bytes"]) / 2**20
        ax_m.text(i, top * 1.02, f"{res['memory_ratio_dl_over_torch']:.3f}x", ha="center", fontsize=8)
    for ax in (ax_t, ax_m):
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.legend(fontsize=8)
    ax_t.set(ylabel="median step time (ms), slowest rank", title=f"{model}: step time (ratio distlab/torch)")
    ax_m.set(ylabel="model states per rank (MiB), largest rank",
             title="params + grads + optimizer state (ratio distlab/torch)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = parser("data_parallel", __doc__, steps=40, warmup=5)
    p.add_argument("--pairs", default="ddp,zero1,zero3")
    p.add_argument("--rows", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--zero3-prefetch", action="store_true", help="dl.ZeRO stage 3 with prefetch=True")
    a = p.parse_args(argv)
    pairs = a.pairs.split(",")
    unknown = set(pairs) - set(PAIRS)
    if unknown:
        p.error(f"unknown pairs {sorted(unknown)}: choose from {sorted(PAIRS)}")
    rows, backend, started = [], None, time.time()
    for n in [int(x) for x in a.ranks.split(",")]:
        run = dl.launch(measure, world_size=n, backend=a.backend, output="live", timeout=1800,
                        args=(a.model, a.steps, a.warmup, a.rows, a.seed, a.lr, pairs, a.zero3_prefetch))
        backend = run.backend
        rows.append(summarise(run.results, n, pairs))
        for pair in pairs:
            res, (ours, theirs) = rows[-1]["pairs"][pair], PAIRS[pair]
            print(f"N={n} {pair:5}: {ours} {res[ours]['median_step_s'] * 1e3:7.1f} ms, {theirs} "
                  f"{res[theirs]['median_step_s'] * 1e3:7.1f} ms (x{res['time_ratio_dl_over_torch']:.2f}); "
                  f"model states {res[ours]['max_states_bytes']} vs {res[theirs]['max_states_bytes']} B "
                  f"(x{res['memory_ratio_dl_over_torch']:.3f}); loss diff {res['max_rel_loss_diff']:.1e}",
                  flush=True)
    meta = {**machine_facts(started, backend), "model": a.model, "rows_per_rank": a.rows, "steps": a.steps,
            "warmup": a.warmup, "zero3_prefetch": a.zero3_prefetch, "dtype": "float32", "optimizer": "AdamW",
            "statistic": "median over steps of the slowest rank's step time (zero_grad+fwd+bwd+step)",
            "memory": "model states (params, grads, optimizer state) by distinct storage, per category "
                      "the larger of after-backward and after-step; "
                      "cuda_peak_bytes: allocator peak of each implementation alone (CUDA only)",
            "targets": {"ddp": "time <= 1.05x torch DDP", "zero1": "memory <= torch ZeroRedundancyOptimizer",
                        "zero3": "time <= 1.2x FSDP2, memory <= FSDP2"}}
    write(a.out, {"meta": meta, "results": rows}, lambda png: plot(rows, png, a.model, pairs))


if __name__ == "__main__":
    main()
