"""Talking less: bytes per step and step time of DDP, local SGD, DiLoCo and quantized ZeRO-3 / FSDP, beside
torch's DDP, in one run.

    python benchmarks/talk_less.py                         # gpt-tiny, 2 ranks, gloo on CPU
    python benchmarks/talk_less.py --ranks 2,4 --model gpt-small --steps 32

Implementations (every one built from the same seed and fed the same batches, each rank its rows):

    torch DDP                 DistributedDataParallel + AdamW (bytes modelled: 2 (N-1)/N Psi, torch's
                              collectives are not observable from Python)
    dl.DDP                    dl.DDP + AdamW
    local-sgd H=4, H=8        dl.LocalSGD + AdamW inside: parameters averaged every H steps
    diloco H=4, H=8           dl.DiLoCo: AdamW inside, outer Nesterov SGD (0.7, 0.9) every H steps
    zero3, zero3 int8         dl.ZeRO(stage=3), exact and with quantize="int8" (ZeRO++ qwZ + qgZ)
    fsdp, fsdp int8, fsdp fp8 dl.fully_shard per block then the root, exact / quantize="int8" / "fp8"

Bytes per step: what rank 0 sent during the timed steps (distlab's traced collectives), over the steps.
Step time: zero_grad + forward + backward + optimizer step (+ the sync every H-th step), behind a barrier,
the slowest rank's; the *mean* over the timed steps (a sync every H steps is part of the average; steps
is a multiple of 8). The loss column: the global batch's mean loss at the last step, each rank on its own
replica (local SGD and DiLoCo between syncs). Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import machine_facts, parser, write  # noqa: E402
from distlab.models import build, dataset_for  # noqa: E402

IMPLS = ["torch DDP", "dl.DDP", "local-sgd H=4", "local-sgd H=8", "diloco H=4", "diloco H=8", "zero3",
         "zero3 int8", "fsdp", "fsdp int8", "fsdp fp8"]


def build_impl(name: str, model: str, seed: int, lr: float):
    """(module to call, optimizer, after_step or None) for implementation ``name``."""
    gpt = build(model, seed).to(dl.device())
    after = None
    if name == "torch DDP":
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(gpt)
    elif name == "dl.DDP":
        wrapped = dl.DDP(gpt)
    elif name.startswith(("local-sgd", "diloco")):
        h = int(name.split("H=")[1])
        wrapped = dl.LocalSGD(gpt, sync_every=h) if name.startswith("local") else dl.DiLoCo(gpt, sync_every=h)
        after = wrapped.after_step
    elif name.startswith("zero3"):
        quantize = name.split()[1] if " " in name else None
        wrapped = dl.ZeRO(gpt, stage=3, optim=torch.optim.AdamW, lr=lr, quantize=quantize)
        return wrapped, wrapped.optimizer, None
    else:
        quantize = name.split()[1] if " " in name else None
        for block in gpt.blocks:
            dl.fully_shard(block, quantize=quantize)
        wrapped = dl.fully_shard(gpt, quantize=quantize)
    return wrapped, torch.optim.AdamW(wrapped.parameters() if name.startswith("fsdp") else gpt.parameters(),
                                      lr=lr), after


def measure(model: str, steps: int, warmup: int, rows: int, seed: int, lr: float, names: list[str]):
    n, r = dl.world_size(), dl.rank()
    data = dataset_for(model, seed)
    batches = [tuple(t.to(dl.device()) for t in data.batch(s, rows * n)) for s in range(warmup + steps)]
    out = {}
    for name in names:
        wrapped, opt, after = build_impl(name, model, seed, lr)
        times, sent = [], 0
        for s, (x, y) in enumerate(batches):
            torch.distributed.barrier()
            before, t0 = len(dl.tracer().events()), time.perf_counter()
            opt.zero_grad()
            logits = wrapped(x.chunk(n)[r])
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.chunk(n)[r].flatten())
            loss.backward()
            opt.step()
            if after is not None:
                after()
            if s >= warmup:
                times.append(time.perf_counter() - t0)
                sent += sum(e.sent for e in dl.tracer().events()[before:] if e.kind == "comm")
        last = torch.tensor([loss.item()])
        torch.distributed.all_reduce(last)
        out[name] = {"times": times, "sent_per_step": sent / steps, "last_loss": last.item() / n}
        if hasattr(getattr(wrapped, "comm", None), "close"):
            wrapped.comm.close()
    return out


def summarise(per_rank: list[dict], n: int, names: list[str], psi_bytes: int) -> dict:
    row = {"world_size": n, "psi_bytes": psi_bytes, "impls": {}}
    for name in names:
        k = len(per_rank[0][name]["times"])
        slowest = [max(rk[name]["times"][i] for rk in per_rank) for i in range(k)]
        sent = per_rank[0][name]["sent_per_step"]
        modelled = name == "torch DDP"
        if modelled:
            sent = dl.theory.dp_volume(psi_bytes, n)
        row["impls"][name] = {"mean_step_s": sum(slowest) / k, "sent_per_step": sent,
                              "bytes": "modelled" if modelled else "measured",
                              "last_loss": per_rank[0][name]["last_loss"]}
    ddp = row["impls"].get("dl.DDP", {}).get("sent_per_step")
    for res in row["impls"].values():
        res["bytes_over_ddp"] = res["sent_per_step"] / ddp if ddp else None
    return row


def plot(rows: list[dict], path: str, model: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(13, 4.4))
    width = 0.8 / len(rows)
    for k, row in enumerate(rows):
        names = list(row["impls"])
        xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(names))]
        label = f"N={row['world_size']}"
        ax_b.bar(xs, [row["impls"][m]["sent_per_step"] / 2**20 for m in names], width, label=label)
        ax_t.bar(xs, [row["impls"][m]["mean_step_s"] * 1e3 for m in names], width, label=label)
    for ax in (ax_b, ax_t):
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    ax_b.set(ylabel="MiB sent per step, rank 0", title=f"{model}: bytes per step (torch DDP: modelled)")
    ax_t.set(ylabel="mean step time (ms), slowest rank", title="step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = parser("talk_less", __doc__, steps=16, warmup=2)
    p.set_defaults(model="gpt-tiny", ranks="2")
    p.add_argument("--rows", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--impls", default=",".join(IMPLS))
    a = p.parse_args(argv)
    names = a.impls.split(",")
    if set(names) - set(IMPLS) or a.steps % 8:
        p.error(f"--impls from {IMPLS}; --steps a multiple of 8 (every H syncs inside the timed steps)")
    psi_bytes = 4 * sum(t.numel() for t in build(a.model, a.seed).parameters())
    rows, backend, started = [], None, time.time()
    for n in [int(x) for x in a.ranks.split(",")]:
        run = dl.launch(measure, world_size=n, backend=a.backend, output="quiet", timeout=1800,
                        args=(a.model, a.steps, a.warmup, a.rows, a.seed, a.lr, names))
        backend = run.backend
        rows.append(summarise(run.results, n, names, psi_bytes))
        for name, res in rows[-1]["impls"].items():
            print(f"N={n} {name:14s} {res['sent_per_step'] / 2**10:9.1f} KiB/step ({res['bytes']}, "
                  f"x{res['bytes_over_ddp']:.3f} of dl.DDP)  {res['mean_step_s'] * 1e3:7.1f} ms  "
                  f"loss {res['last_loss']:.3f}", flush=True)
    meta = {**machine_facts(started, backend), "model": a.model, "rows_per_rank": a.rows, "steps": a.steps,
            "warmup": a.warmup, "optimizer": "AdamW (inner, for local-sgd and diloco)",
            "statistic": "mean over timed steps of the slowest rank's step time; bytes: rank 0's traced "
                         "sends",
            "torch DDP bytes": "modelled: 2 (N-1)/N Psi (dl.theory.dp_volume)"}
    write(a.out, {"meta": meta, "results": rows}, lambda png: plot(rows, png, a.model))


if __name__ == "__main__":
    main()
