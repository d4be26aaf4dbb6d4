"""distlab's sharded checkpoints beside torch.distributed.checkpoint (DCP) on FSDP2, in one run.

    python benchmarks/checkpoint.py                      # gpt-small, 2 and 4 ranks, gloo on CPU
    python benchmarks/checkpoint.py --ranks 2 --repeats 3

Both sides hold the same ZeRO-3 training state, built from the same seed and trained one step on the
same batch (so Adam's moments exist): distlab `dl.ZeRO(stage=3)` + AdamW, and torch FSDP2
(`fully_shard` per block and at the root) + AdamW.

    side     save                                                 load
    distlab  `dl.checkpoint.save` of what `dl.train` saves for    `dl.checkpoint.load` + put back into the
             zero3 (each rank its shards; sha256 manifest;         parameter and optimizer shards
             tmp directory then rename)
    torch    `dcp.save(get_state_dict(model, optimizer))`          `dcp.load` + `set_state_dict`
             (each rank its DTensor shards; .metadata)

Time: each repeat from a barrier to the slowest rank's end, both sides alternating which goes first; the
median over repeats. Bytes: the files on disk. Both loads are checked: the parameters after loading equal
the ones saved.

The training stall per save, synchronous vs asynchronous (``async_save``: a copy into CPU memory at the
step boundary, the write in a background thread): ``dl.train("zero3", ...)`` with ``checkpoint_every``,
once each way on the same settings; per save, the slowest rank's time inside the loop's checkpoint
(the stall) and, synchronous, the whole save. Target: the median async stall at most 25% of the median
sync save time (gpt-small). Both runs must end with equal parameters. Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distlab as dl  # noqa: E402
from _results import machine_facts, parser, write  # noqa: E402
from distlab.checkpoint import state, store  # noqa: E402
from distlab.models import build, dataset_for  # noqa: E402

SIDES = ("distlab", "torch DCP")


def _train_one_step(model, optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()


class DistlabSide:
    def __init__(self, model_name: str, seed: int, lr: float):
        self.gpt = build(model_name, seed).to(dl.device())
        self.zero = dl.ZeRO(self.gpt, stage=3, optim=torch.optim.AdamW, lr=lr)
        self.model, self.optimizer = self.zero, self.zero.optimizer
        # what dl.train saves for ZeRO: the flat shards and their layout
        self.state = state.flat_shard_state(self.gpt, self.optimizer, keeps_history=True)

    def snapshot(self) -> list[torch.Tensor]:
        return [s.detach().clone() for s in self.optimizer.shards]

    def save(self, directory: str) -> None:
        own, replicated = self.state.capture()
        store.save(directory, 1, own, replicated=replicated)

    def scramble(self) -> None:
        with torch.no_grad():
            for s in self.optimizer.shards:
                s.zero_()

    def load(self, directory: str) -> None:
        self.state.restore(store.load(directory, 1))


class TorchSide:
    def __init__(self, model_name: str, seed: int, lr: float):
        from torch.distributed.fsdp import fully_shard
        self.gpt = build(model_name, seed).to(dl.device())
        for block in self.gpt.blocks:
            fully_shard(block)
        self.model = fully_shard(self.gpt)
        self.optimizer = torch.optim.AdamW(self.gpt.parameters(), lr=lr)

    def snapshot(self) -> list[torch.Tensor]:
        return [p.to_local().detach().clone() for p in self.gpt.parameters()]

    def save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_state, optim_state = get_state_dict(self.gpt, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)

    def scramble(self) -> None:
        with torch.no_grad():
            for p in self.gpt.parameters():
                p.to_local().zero_()

    def load(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model_state, optim_state = get_state_dict(self.gpt, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(self.gpt, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def measure(model: str, repeats: int, rows: int, seed: int, lr: float, root: str) -> dict:
    n, r, device = dl.world_size(), dl.rank(), dl.device()
    x, y = (t.to(device) for t in dataset_for(model, seed).batch(0, rows * n))
    x, y = x.chunk(n)[r], y.chunk(n)[r]
    sides = {"distlab": DistlabSide(model, seed, lr), "torch DCP": TorchSide(model, seed, lr)}
    for side in sides.values():
        _train_one_step(side.model, side.optimizer, x, y)
    out = {name: {"save_s": [], "load_s": [], "bytes": 0, "loaded_equal": True} for name in sides}
    for k in range(repeats):
        for name in (SIDES if k % 2 == 0 else SIDES[::-1]):
            side, directory = sides[name], os.path.join(root, f"{name.split()[0]}_{k}")
            before = side.snapshot()
            out[name]["save_s"].append(_timed(functools.partial(side.save, directory)))
            side.scramble()
            out[name]["load_s"].append(_timed(functools.partial(side.load, directory)))
            out[name]["loaded_equal"] &= all(torch.equal(a, b) for a, b in zip(before, side.snapshot()))
            if r == 0:
                out[name]["bytes"] = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
                shutil.rmtree(directory)
    return out


def summarise(per_rank: list[dict], n: int) -> dict:
    row = {"world_size": n}
    for name in SIDES:
        row[name] = {"median_save_s": statistics.median(max(r[name]["save_s"][i] for r in per_rank)
                                                        for i in range(len(per_rank[0][name]["save_s"]))),
                     "median_load_s": statistics.median(max(r[name]["load_s"][i] for r in per_rank)
                                                        for i in range(len(per_rank[0][name]["load_s"]))),
                     "bytes": per_rank[0][name]["bytes"],
                     "loaded_equal": all(r[name]["loaded_equal"] for r in per_rank)}
    ours, theirs = row["distlab"], row["torch DCP"]
    row["save_ratio_dl_over_torch"] = ours["median_save_s"] / theirs["median_save_s"]
    row["load_ratio_dl_over_torch"] = ours["median_load_s"] / theirs["median_load_s"]
    row["bytes_ratio_dl_over_torch"] = ours["bytes"] / theirs["bytes"]
    return row


def measure_stall(model: str, n: int, steps: int, every: int, root: str) -> dict:
    """Per save, the slowest rank's stall (sync and async) and sync save time, from `dl.train`'s
    ``info["checkpoint_io"]``; the medians and the 25% target."""
    runs = {}
    for mode in ("sync", "async"):
        runs[mode] = dl.train("zero3", world_size=n, model=model, steps=steps, global_batch=2 * n,
                              timeout=1800, checkpoint_dir=os.path.join(root, f"stall_{mode}"),
                              checkpoint_every=every, async_save=(mode == "async"))
    io = {mode: [r.info["checkpoint_io"] for r in run.results] for mode, run in runs.items()}
    per_save = {f"{mode}_{key}": [max(per_rank) for per_rank in zip(*(rank[key] for rank in io[mode]))]
                for mode in io for key in ("stall_s", "write_s")}      # per save: the slowest rank
    row = {"world_size": n, "model": model, "strategy": "zero3", "steps": steps, "checkpoint_every": every,
           **per_save, **{f"median_{k}": statistics.median(v) for k, v in per_save.items()},
           "params_equal": all(torch.equal(v, runs["async"].params[k])
                               for k, v in runs["sync"].params.items())}
    ratio = row["median_async_stall_s"] / row["median_sync_write_s"]
    row["target"] = {"what": "median async stall <= 25% of the median sync save time", "limit": 0.25,
                     "ratio_async_stall_over_sync_save": ratio, "met": ratio <= 0.25}
    return row


def plot(rows: list[dict], path: str, model: str, stall: dict | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3 if stall else 2, figsize=(13.5 if stall else 9, 3.4))
    width = 0.38
    for ax, key, title in ((axes[0], "median_save_s", "save"), (axes[1], "median_load_s", "load")):
        for i, name in enumerate(SIDES):
            xs = [k + (i - 0.5) * width for k in range(len(rows))]
            ax.bar(xs, [row[name][key] * 1e3 for row in rows], width, label=name)
        ax.set_xticks(range(len(rows)), [f"{row['world_size']} ranks" for row in rows])
        ax.set_ylabel("ms (slowest rank, median)")
        ax.set_title(f"{title}: ZeRO-3 / FSDP2 state of {model}")
        ax.legend(fontsize=8)
    if stall:
        bars = [("sync save", stall["median_sync_write_s"]), ("sync stall", stall["median_sync_stall_s"]),
                ("async stall", stall["median_async_stall_s"]), ("async write\n(background)",
                                                                 stall["median_async_write_s"])]
        axes[2].bar([b[0] for b in bars], [b[1] * 1e3 for b in bars], color=["C0", "C0", "C2", "C7"])
        axes[2].axhline(0.25 * stall["median_sync_write_s"] * 1e3, color="k", ls="--", lw=0.8,
                        label="target: 25% of the sync save")
        axes[2].set_ylabel("ms per save (slowest rank, median)")
        axes[2].set_title(f"training stall per save: {stall['model']} zero3, {stall['world_size']} ranks")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = parser("checkpoint", __doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", type=int, default=4, help="sequences per rank in the one training step")
    p.add_argument("--stall-steps", type=int, default=16, help="steps of each dl.train run for the stall")
    p.add_argument("--stall-every", type=int, default=4, help="checkpoint_every for the stall")
    a = p.parse_args(argv)
    rows, backend, started = [], None, time.time()
    with tempfile.TemporaryDirectory(prefix="distlab_ckpt_bench_") as root:
        for n in [int(x) for x in a.ranks.split(",")]:
            run = dl.launch(measure, world_size=n, backend=a.backend, output="live", timeout=1800,
                            args=(a.model, a.repeats, a.rows, a.seed, a.lr, root))
            backend = run.backend
            rows.append(summarise(run.results, n))
            row = rows[-1]
            for name in SIDES:
                res = row[name]
                print(f"N={n} {name:9}: save {res['median_save_s'] * 1e3:7.1f} ms, load "
                      f"{res['median_load_s'] * 1e3:7.1f} ms, {res['bytes']:,} bytes on disk, "
                      f"loaded state equal to saved: {res['loaded_equal']}", flush=True)
            if not all(row[name]["loaded_equal"] for name in SIDES):
                raise SystemExit("a load did not restore what was saved: the timings would mean nothing")
        n = int(a.ranks.split(",")[0])
        stall = measure_stall(a.model, n, a.stall_steps, a.stall_every, root)
        print(f"N={n} stall per save: sync {stall['median_sync_stall_s'] * 1e3:.1f} ms (save "
              f"{stall['median_sync_write_s'] * 1e3:.1f} ms), async "
              f"{stall['median_async_stall_s'] * 1e3:.1f} ms "
              f"(background write {stall['median_async_write_s'] * 1e3:.1f} ms); async stall / sync save = "
              f"{stall['target']['ratio_async_stall_over_sync_save']:.2f}, target <= 0.25 met: "
              f"{stall['target']['met']}", flush=True)
        if not stall["params_equal"]:
            raise SystemExit("sync and async runs ended with different parameters")
    meta = {**machine_facts(started, backend), "model": a.model, "repeats": a.repeats, "dtype": "float32",
            "optimizer": "AdamW",
            "statistic": "median over repeats of the slowest rank's time, barrier to barrier",
            "bytes": "all files of one checkpoint on disk"}
    write(a.out, {"meta": meta, "results": rows, "stall": stall}, lambda png: plot(rows, png, a.model, stall))


if __name__ == "__main__":
    main()
