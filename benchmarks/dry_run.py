"""Dry runs at real size: seconds per preset and layout on this machine, and the bytes each listed rank holds.

Each case is one `dl.train(..., backend="fake", ranks=[first, last])` (`distlab.strategies.dry`): the
strategy's own code builds the model on the meta device, shards it and runs one step on a fake process
group, here, for the first and the last rank (with a pipeline: the first and the last stage). Recorded per
case: wall seconds for both ranks, and per rank the peak bytes by category beside `dl.theory.memory`'s
model states (which test_dry_run.py checks to the byte) and the bytes sent per step by collective.
Target (issue 22): Llama 3 70B on 1,024 ranks (dp=16, tp=8, pp=8, seq 8192), both stages, under a minute
on a 2-core laptop. Not a timed unit test.

    python benchmarks/dry_run.py                  # the real-size cases
    python benchmarks/dry_run.py --cases quick    # seconds: a small model at 1,024 ranks
Writes benchmarks/results/dry_run.json and .png.
"""
from __future__ import annotations

import argparse
import time

import distlab as dl
from _results import default_out, machine_facts, write

CASES = {
    "real": [("llama3-70b", "3d:dp=16,tp=8,pp=8", 1024), ("llama3-8b", "fsdp", 1024),
             ("llama3-8b", "zero3", 16384), ("gpt3-175b", "zero1", 1024), ("llama3-8b", "tp", 8),
             ("llama3-405b", "3d:dp=128,tp=8,pp=16", 16384)],
    "quick": [("gpt-small", "zero3", 1024), ("gpt-small", "3d:dp=32,tp=8,pp=4", 1024)],
}


def _theory(model: str, strategy: str, world: int) -> dict:
    """`dl.theory.memory`'s model states for the case (fp32 Adam, as the dry run trains)."""
    from distlab.strategies import parse
    from distlab.theory import memory, transformer_params
    cfg = dl.models.config(model)
    n = transformer_params(cfg.d_model, cfg.layers, cfg.vocab, heads=cfg.heads, kv_heads=cfg.kv_heads,
                           ffn=cfg.ffn or cfg.mlp_ratio * cfg.d_model, swiglu=cfg.swiglu, bias=cfg.bias,
                           norm=cfg.norm, tied=cfg.tied,
                           positions=cfg.seq_len if cfg.positions is None else cfg.positions)
    d = parse(strategy).layout.degrees(world)
    zero = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}.get(strategy, 0)
    b = memory(n, dp=d["dp"], zero=zero, precision="fp32", optimizer="adamw", tp=d["tp"], pp=d["pp"])
    return {"params": b.params, "grads": b.grads, "optimizer": b.optimizer, "parameters": n}


def run_case(model: str, strategy: str, world: int) -> dict:
    ranks = [0, world - 1]
    start = time.perf_counter()
    report = dl.train(strategy, model=model, world_size=world, backend="fake", ranks=ranks)
    seconds = time.perf_counter() - start
    per_rank = [{"rank": r, "peak": m["peak"], "peak_total": m.get("peak_total"),
                 "sent_per_step": c["sent_per_step"], "sent_by_op": c["sent_by_op"]}
                for r, m, c in zip(ranks, report.memory, report.comm)]
    print(f"{model:12s} {strategy:22s} {world:6d} ranks: {seconds:6.1f} s  " + "  ".join(
        f"rank {p['rank']}: {sum(p['peak'][k] for k in ('params', 'grads', 'optimizer')) / 2**30:.2f} GiB "
        "model states" for p in per_rank), flush=True)
    return {"model": model, "strategy": strategy, "world_size": world, "seconds": round(seconds, 2),
            "global_batch": report.spec.global_batch, "theory": _theory(model, strategy, world),
            "ranks": per_rank}


def plot(rows: list[dict], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 1.5 + 0.8 * len(rows)))
    names = [f"{r['model']} {r['strategy']}\n{r['world_size']} ranks" for r in rows]
    left.barh(names, [r["seconds"] for r in rows], color="tab:blue")
    left.axvline(60, color="tab:red", ls="--", label="target for Llama 3 70B: 60 s")
    left.set_xlabel("seconds for the first and the last rank (this machine)")
    left.tick_params(axis="y", labelsize=7)
    left.legend(fontsize=8)
    left.invert_yaxis()
    for i, row in enumerate(rows):
        bottom = 0.0
        for k, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
            v = row["ranks"][0]["peak"][k] / 2**30
            right.bar(i, v, bottom=bottom, color=color, label=k if i == 0 else None)
            bottom += v
        theory = sum(row["theory"][k] for k in ("params", "grads", "optimizer")) / 2**30
        right.plot([i - 0.4, i + 0.4], [theory, theory], color="k",
                   label="dl.theory.memory" if i == 0 else None)
    right.set_xticks(range(len(rows)), [n.replace("\n", " ") for n in names], rotation=30, ha="right",
                     fontsize=7)
    right.set_ylabel("GiB on rank 0 (fp32 Adam)")
    right.set_yscale("log")
    right.legend(fontsize=8)
    fig.suptitle("Dry runs on the fake backend: one step of the real code, tensors without storage")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="real", choices=sorted(CASES))
    p.add_argument("--out", default=default_out("dry_run"))
    args = p.parse_args()
    started = time.time()
    rows = [run_case(*case) for case in CASES[args.cases]]
    target = next((r for r in rows if r["model"] == "llama3-70b" and r["world_size"] == 1024), None)
    meta = {**machine_facts(started, "fake"), "cases": args.cases, "precision": "fp32", "steps": 1}
    document = {"meta": meta, "results": rows,
                "target": None if target is None else {"what": "llama3-70b 3d:dp=16,tp=8,pp=8 on 1024 ranks, "
                                                               "ranks 0 and 1023, < 60 s",
                                                       "seconds": target["seconds"],
                                                       "met": target["seconds"] < 60}}
    write(args.out, document, lambda png: plot(rows, png))


if __name__ == "__main__":
    main()
