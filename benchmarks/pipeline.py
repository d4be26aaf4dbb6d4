"""distlab's pipeline executor beside torch.distributed.pipelining, on the same model, data and stages.

For p in (2, 4) and each schedule pair

    distlab "gpipe"        vs  torch ScheduleGPipe
    distlab "1f1b"         vs  torch Schedule1F1B
    distlab "interleaved"  vs  torch ScheduleInterleaved1F1B   (v = 2 chunks per rank)

both train the same GPT (cut into the same stages by `dl.pp.stage_module`) with SGD from the same seed
on the same batches, ``--steps`` steps after ``--warmup``, alternating one distlab step and one torch
step inside the same processes so that other load on the machine falls on both alike. Reported: per-step
losses (must agree to fp32 rounding), the median step time of each and their ratio distlab / torch (target
<= 1.1).
Writes benchmarks/results/pipeline.json and pipeline.png.

    .venv/bin/python benchmarks/pipeline.py [--steps 6] [--warmup 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab as dl
from _results import default_out, write
from distlab.models import GPT, GPTConfig, MarkovTokens

CFG = GPTConfig(vocab=256, seq_len=64, d_model=128, heads=4, layers=6)   # 8 units: embed, 6 blocks, head
BATCH, M, LR = 32, 8, 0.1
PAIRS = [("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
         ("interleaved", "ScheduleInterleaved1F1B", 2)]


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _setup(v):
    torch.manual_seed(0)
    model, data = GPT(CFG), MarkovTokens(CFG.vocab, CFG.seq_len, seed=0)
    p, r = dl.world_size(), dl.rank()
    ids = [r + k * p for k in range(v)]
    return model, data, ids, [dl.pp.stage_module(model, s, p * v) for s in ids]


def distlab_step(name, v):
    model, data, ids, modules = _setup(v)
    p = dl.world_size()
    pipe = dl.pp.Pipeline(modules if v > 1 else modules[0], ids if v > 1 else ids[0], p * v, schedule=name,
                          microbatches=M, loss_fn=_loss)
    opt = torch.optim.SGD(list(pipe.parameters()), lr=LR)

    def step(x, y):
        opt.zero_grad()
        loss = pipe.step(x if pipe.first else None, y if pipe.last else None)
        opt.step()
        return None if loss is None else loss.item()
    return data, step


def torch_step(schedule_cls, v):
    from torch.distributed import pipelining
    model, data, ids, modules = _setup(v)
    p = dl.world_size()
    stages = [pipelining.PipelineStage(mod, s, p * v, torch.device("cpu")) for mod, s in zip(modules, ids)]
    sched = getattr(pipelining, schedule_cls)(stages if v > 1 else stages[0], n_microbatches=M, loss_fn=_loss)
    opt = torch.optim.SGD([q for mod in modules for q in mod.parameters()], lr=LR)
    first, last = 0 in ids, p * v - 1 in ids

    def step(x, y):
        opt.zero_grad()
        losses = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(x, **kwargs) if first else sched.step(**kwargs)
        opt.step()
        return torch.stack(losses).mean().item() if last else None
    return step


def both(name, schedule_cls, v, steps, warmup):
    """Alternate one distlab step and one torch step (so load on the machine hits both alike)."""
    data, ours = distlab_step(name, v)
    theirs = torch_step(schedule_cls, v)
    out = {"distlab": ([], []), "torch": ([], [])}
    for step in range(warmup + steps):
        x, y = data.batch(step, BATCH)
        for key, fn in (("distlab", ours), ("torch", theirs)):
            dist.barrier()
            t0 = time.perf_counter()
            loss = fn(x, y)
            dist.barrier()
            out[key][0].append(loss)
            if step >= warmup:
                out[key][1].append(time.perf_counter() - t0)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=default_out("pipeline"))
    args = parser.parse_args()
    rows = []
    for p in (2, 4):
        for name, cls, v in PAIRS:
            run = dl.launch(both, world_size=p, args=(name, cls, v, args.steps, args.warmup), output="quiet")
            last = (p * v - 1) % p
            out = run.results[last]
            ours, theirs = out["distlab"], out["torch"]
            t_ours, t_theirs = (statistics.median(max(r[side][1][i] for r in run.results)
                                                  for i in range(args.steps))
                                for side in ("distlab", "torch"))
            loss_diff = max(abs(a - b) for a, b in zip(ours[0], theirs[0]))
            rows.append({"p": p, "schedule": name, "torch_schedule": cls, "virtual": v, "microbatches": M,
                         "distlab_step_s": t_ours, "torch_step_s": t_theirs, "ratio": t_ours / t_theirs,
                         "max_loss_diff": loss_diff, "losses_distlab": ours[0], "losses_torch": theirs[0]})
            print(f"p={p} {name:12} distlab {t_ours * 1e3:7.1f} ms  torch {t_theirs * 1e3:7.1f} ms  "
                  f"ratio {t_ours / t_theirs:.2f}  max |loss diff| {loss_diff:.1e}")
    meta = {"model": vars(CFG), "batch": BATCH, "microbatches": M, "steps": args.steps, "warmup": args.warmup,
            "torch": torch.__version__, "backend": "gloo (CPU)", "load_average": list(os.getloadavg()),
            "rows": rows}
    write(args.out, meta, lambda png: _plot(rows, png))


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['schedule']}\np={r['p']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar([x - 0.2 for x in xs], [r["distlab_step_s"] * 1e3 for r in rows], 0.4, label="distlab")
    ax.bar([x + 0.2 for x in xs], [r["torch_step_s"] * 1e3 for r in rows], 0.4,
           label="torch.distributed.pipelining")
    for x, r in zip(xs, rows):
        ax.text(x, max(r["distlab_step_s"], r["torch_step_s"]) * 1e3, f"{r['ratio']:.2f}x", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("Pipeline step time, same model and stages (gloo, CPU); label: distlab / torch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
