"""distlab's ``dl.fully_shard`` beside torch's ``torch.distributed.fsdp.fully_shard`` (FSDP2), in one run.

    python benchmarks/fsdp.py                              # gpt-small, 2 and 4 ranks, gloo on CPU
    python benchmarks/fsdp.py --ranks 2 --steps 30 --configs fp32

Both sides are built from the same seed (identical weights), sharded the same way (each transformer block,
then the root: embeddings, final norm, head), trained with AdamW built after sharding on
``model.parameters()``, and fed the same batches. Per configuration:

    config   param_dtype   reduce_dtype   reshard_after_forward
    fp32     -             -              True
    bf16     bfloat16      float32        True     (torch: MixedPrecisionPolicy(bf16, fp32))

Prefetch: both gather the next unit one step ahead in forward and backward (torch's default implicit
prefetch; distlab's from the forward order recorded on the first step). Step time: zero_grad + forward +
backward + optimizer step behind a barrier, the slowest rank's time per step, the median over the steps after
warm-up; the two sides alternate which goes first, so they see the same background load. Memory per rank:
model states (parameters, gradients, optimizer state) by distinct storage, each category the larger of after
backward and after the step (a DTensor counts its local shard). Losses: the global mean per step; equal within
1e-4 relative in fp32, 2e-2 in bf16 (the two sides round in different places).
Writes <out>.json and <out>.png.
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
from _sides import STATES, Side, global_mean, sampled_states, take_turns, torch_states  # noqa: E402
from distlab.memory import fsdp_memory  # noqa: E402
from distlab.models import build, dataset_for  # noqa: E402

SIDES = ("dl.fully_shard", "torch fully_shard")
CONFIGS = {"fp32": dict(param_dtype=None, reduce_dtype=None),
           "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
LOSS_TOL = {"fp32": 1e-4, "bf16": 2e-2}
TARGETS = {"time": 1.1, "memory": 1.0}


class Impl(Side):
    """One implementation on one configuration: ``step(x, y) -> loss``, ``states()`` in bytes."""

    def __init__(self, side: str, config: str, model_name: str, seed: int, lr: float):
        gpt = build(model_name, seed).to(dl.device())
        mp = CONFIGS[config]
        if side == "dl.fully_shard":
            for block in gpt.blocks:
                dl.fully_shard(block, **mp)
            self.model = dl.fully_shard(gpt, **mp)
            self.opt = torch.optim.AdamW(gpt.parameters(), lr=lr)
            measure = fsdp_memory(gpt, self.opt)
            self.states = lambda: {k: v for k, v in measure().items() if k in STATES}
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            policy = MixedPrecisionPolicy(**mp)
            for block in gpt.blocks:
                fully_shard(block, mp_policy=policy)
            self.model = fully_shard(gpt, mp_policy=policy)
            self.opt = torch.optim.AdamW(gpt.parameters(), lr=lr)
            self.states = lambda: torch_states(gpt, self.opt)


def _try_side(side: str, config: str, model: str, seed: int, lr: float, x, y):
    """(the side, the loss of its first step), or (None, the error) on every rank if it cannot run here."""
    try:
        impl = Impl(side, config, model, seed, lr)
        loss, error = impl.step(x, y), ""
    except Exception as e:                       # noqa: BLE001 -- reported in the JSON, not hidden
        impl, loss, error = None, None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, error)
    failed = next((f for f in flags if f), "")
    return (None, failed) if failed else (impl, loss)


def measure(model: str, steps: int, warmup: int, rows: int, seed: int, lr: float, configs: list[str]):
    n, r, device = dl.world_size(), dl.rank(), dl.device()
    data = dataset_for(model, seed)
    batches = [tuple(t.to(device) for t in data.batch(step, rows * n)) for step in range(warmup + steps)]
    mine = lambda t: t.chunk(n)[r]                                          # noqa: E731
    out = {}
    for config in configs:
        x0, y0 = batches[0]                       # step 0 (warm-up): does the side run here at all?
        built = {side: _try_side(side, config, model, seed, lr, mine(x0), mine(y0)) for side in SIDES}
        errors = {side: e for side, (i, e) in built.items() if i is None}
        if errors:
            out[config] = {"errors": errors}
            continue
        impls = {side: i for side, (i, _) in built.items()}
        times, losses = take_turns(impls, [SIDES], batches[1:], warmup, mine, first_step=1)
        for side in SIDES:
            losses[side].insert(0, built[side][1])                # step 0's loss, from the trial above
        states = sampled_states(impls, batches[-1], mine)
        losses = global_mean(losses)
        out[config] = {"times": times, "losses": losses, "states": states}
        dl.tracer().clear()
    return out


def summarise(per_rank: list[dict], n: int, configs: list[str]) -> dict:
    row = {"world_size": n, "configs": {}}
    for config in configs:
        first = per_rank[0][config]
        if "errors" in first:
            row["configs"][config] = {"errors": first["errors"], "ran": False}
            continue
        res = {"ran": True}
        for side in SIDES:
            k = len(first["times"][side])
            slowest = [max(rk[config]["times"][side][i] for rk in per_rank) for i in range(k)]
            states = [rk[config]["states"][side] for rk in per_rank]
            res[side] = {"median_step_s": statistics.median(slowest), "steps": k,
                         "states_per_rank": states,
                         "max_states_bytes": max(sum(s[c] for c in STATES) for s in states),
                         "losses": first["losses"][side]}
        ours, theirs = res[SIDES[0]], res[SIDES[1]]
        time_ratio = ours["median_step_s"] / theirs["median_step_s"]
        memory_ratio = ours["max_states_bytes"] / theirs["max_states_bytes"]
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
        res.update(time_ratio_dl_over_torch=time_ratio, memory_ratio_dl_over_torch=memory_ratio,
                   max_rel_loss_diff=loss_diff, targets={
                       "step time <= 1.1x torch": {"value": time_ratio, "met": time_ratio <= TARGETS["time"]},
                       "memory per rank <= torch": {"value": memory_ratio,
                                                    "met": memory_ratio <= TARGETS["memory"]},
                       f"losses equal (rel <= {LOSS_TOL[config]:g})": {
                           "value": loss_diff, "met": loss_diff <= LOSS_TOL[config]}})
        row["configs"][config] = res
    return row


def plot(rows: list[dict], path: str, model: str, configs: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels, width = [], 0.38
    cells = [(row, c) for row in rows for c in configs if row["configs"][c]["ran"]]
    for i, (row, config) in enumerate(cells):
        res = row["configs"][config]
        labels.append(f"{config}\nN={row['world_size']}")
        for k, (side, colour) in enumerate(zip(SIDES, ("#4C72B0", "#DD8452"))):
            label = side if i == 0 else None
            x = i + (k - 0.5) * width
            ax_t.bar(x, res[side]["median_step_s"] * 1e3, width, color=colour, label=label)
            ax_m.bar(x, res[side]["max_states_bytes"] / 2**20, width, color=colour, label=label)
        top = max(res[s]["median_step_s"] for s in SIDES) * 1e3
        ax_t.text(i, top * 1.02, f"{res['time_ratio_dl_over_torch']:.2f}x", ha="center", fontsize=8)
        top = max(res[s]["max_states_bytes"] for s in SIDES) / 2**20
        ax_m.text(i, top * 1.02, f"{res['memory_ratio_dl_over_torch']:.3f}x", ha="center", fontsize=8)
    for ax in (ax_t, ax_m):
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.legend(fontsize=8)
    ax_t.set(ylabel="median step time (ms), slowest rank",
             title=f"{model}: step time (ratio distlab/torch; target <= 1.1x)")
    ax_m.set(ylabel="model states per rank (MiB), largest rank",
             title="params + grads + optimizer state (target <= 1x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = parser("fsdp", __doc__, steps=30, warmup=5)
    p.add_argument("--configs", default="fp32,bf16")
    p.add_argument("--rows", type=int, default=8, help="sequences per rank per step")
    a = p.parse_args(argv)
    configs = a.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}: choose from {sorted(CONFIGS)}")
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first step checks that each side runs here)")
    rows, backend, started = [], None, time.time()
    for n in [int(x) for x in a.ranks.split(",")]:
        run = dl.launch(measure, world_size=n, backend=a.backend, output="live", timeout=1800,
                        args=(a.model, a.steps, a.warmup, a.rows, a.seed, a.lr, configs))
        backend = run.backend
        rows.append(summarise(run.results, n, configs))
        for config, res in rows[-1]["configs"].items():
            if not res["ran"]:
                print(f"N={n} {config}: could not run: {res['errors']}", flush=True)
                continue
            ours, theirs = res[SIDES[0]], res[SIDES[1]]
            print(f"N={n} {config}: dl {ours['median_step_s'] * 1e3:7.1f} ms, torch "
                  f"{theirs['median_step_s'] * 1e3:7.1f} ms (x{res['time_ratio_dl_over_torch']:.2f}); model "
                  f"states {ours['max_states_bytes']} vs {theirs['max_states_bytes']} B "
                  f"(x{res['memory_ratio_dl_over_torch']:.3f}); loss diff {res['max_rel_loss_diff']:.1e}",
                  flush=True)
    meta = {**machine_facts(started, backend), "model": a.model, "rows_per_rank": a.rows, "steps": a.steps,
            "warmup": a.warmup, "optimizer": "AdamW", "units": "each transformer block, then the root",
            "configs": {c: {k: str(v).replace("torch.", "") if v is not None else None
                            for k, v in CONFIGS[c].items()} for c in configs},
            "reshard_after_forward": True,
            "prefetch": "one unit ahead in forward and backward on both sides (torch: its default implicit "
                        "prefetch; distlab: from the forward order recorded on the first step)",
            "statistic": "median over steps of the slowest rank's step time (zero_grad+fwd+bwd+step)",
            "memory": "model states (params, grads, optimizer state) by distinct storage, per category "
                      "the larger of after-backward and after-step; DTensors count their local shard",
            "targets": "step time <= 1.1x torch's, memory per rank <= torch's, losses equal "
                       "(fp32: 1e-4 relative, bf16: 2e-2)"}
    write(a.out, {"meta": meta, "results": rows}, lambda png: plot(rows, png, a.model, configs))


if __name__ == "__main__":
    main()
