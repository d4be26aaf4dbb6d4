"""Markdown tables of the results in benchmarks/results/*.json, for README.md.

    python benchmarks/summary.py            # prints the tables
    python benchmarks/summary.py --readme   # replaces the block between the markers in README.md

Every number comes from a JSON file that a benchmark script wrote; nothing is typed in by hand.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _load_note(meta: dict) -> str:
    load = meta.get("load_average")
    return f" Load average during the run: {load[0]:.1f}." if load else ""


def launch_latency() -> list[str]:
    d = _load("launch_latency")
    if not d:
        return []
    rows = [f"| {name} | {_ms(s['median_s'])} | {_ms(s['min_s'])} | {s['repeats']} |"
            for name, s in d["results"].items()]
    met = "met" if d["target"]["met"] else "**not met**"
    return [f"**Launch latency** ({d['ranks']} ranks, process group + barrier + trivial function; "
            f"`benchmarks/launch_latency.py`). Target: distlab fork median <= 0.15 s, {met}."
            f"{_load_note(d['machine'])}", "",
            "| launcher | median | min | repeats |", "|---|---|---|---|", *rows, ""]


def allreduce() -> list[str]:
    d = _load("allreduce")
    if not d:
        return []
    by = {}
    for r in d["results"]:
        by.setdefault((r["world_size"], r["bytes"]), {})[r["impl"]] = r["busbw_GBps"]
    rows = []
    for (n, nbytes), v in sorted(by.items()):
        if nbytes >= 1 << 20 and "ring" in v and "torch" in v:
            rows.append(f"| {n} | {nbytes >> 20} MiB | {v['ring']:.3f} | {v['torch']:.3f} | "
                        f"{v['ring'] / v['torch']:.2f}x |")
    ratios = ", ".join(f"{n} ranks: median {r['median_ratio_from_4MB']:.2f}x "
                       f"(min {r['min_ratio_from_4MB']:.2f}x)"
                       for n, r in d["ratio_ring_over_torch"].items())
    return [f"**Ring all-reduce** (distlab's ring built from send/recv vs torch's gloo all_reduce, "
            f"bus bandwidth as nccl-tests define it; `benchmarks/allreduce.py`). "
            f"Target: >= 0.9x gloo from 4 MB up; measured {ratios}.{_load_note(d['meta'])}", "",
            "| ranks | size | distlab ring busbw (GB/s) | gloo busbw (GB/s) | ratio |",
            "|---|---|---|---|---|", *rows, ""]


def data_parallel() -> list[str]:
    d = _load("data_parallel")
    if not d:
        return []
    rows = []
    for r in d["results"]:
        for v in r["pairs"].values():
            ours, theirs = [k for k in v if isinstance(v[k], dict)]
            rows.append(f"| {r['world_size']} | {ours} vs {theirs} | {_ms(v[ours]['median_step_s'])} | "
                        f"{_ms(v[theirs]['median_step_s'])} | {v['time_ratio_dl_over_torch']:.2f}x | "
                        f"{v['memory_ratio_dl_over_torch']:.2f}x | {v['max_rel_loss_diff']:.1e} |")
    return ["**Data parallelism** (gpt-small, AdamW; `benchmarks/data_parallel.py`). "
            "Targets: DDP <= 1.05x torch DDP's step time, ZeRO-3 <= 1.2x FSDP2's, "
            f"ZeRO memory per rank <= torch's.{_load_note(d['meta'])}", "",
            "| ranks | pair | distlab step | torch step | time ratio "
            "| model-state memory ratio | max loss diff |",
            "|---|---|---|---|---|---|---|", *rows, ""]


def tensor_parallel() -> list[str]:
    d = _load("tensor_parallel")
    if not d:
        return []
    rows = [f"| {r['world_size']} | {_ms(r['dl.tp']['median_step_s'])} "
            f"| {_ms(r['torch DTensor']['median_step_s'])} "
            f"| {r['ratio_dl_over_torch']:.2f}x | {r['max_rel_loss_diff']:.1e} |" for r in d["results"]]
    return [f"**Tensor parallelism** ({d['meta']['model']}; distlab's Megatron layers vs DTensor "
            f"`parallelize_module` with ColwiseParallel/RowwiseParallel; `benchmarks/tensor_parallel.py`). "
            f"Target: <= 1.1x.{_load_note(d['meta'])}", "",
            "| ranks | distlab step | DTensor step | ratio | max loss diff |",
            "|---|---|---|---|---|", *rows, ""]


def pipeline() -> list[str]:
    d = _load("pipeline")
    if not d:
        return []
    rows = [f"| {r['p']} | {r['schedule']} vs {r['torch_schedule']} | {r['microbatches']} | "
            f"{_ms(r['distlab_step_s'])} | {_ms(r['torch_step_s'])} | {r['ratio']:.2f}x | "
            f"{r['max_loss_diff']:.1e} |"
            for r in d["rows"]]
    return [f"**Pipeline parallelism** (distlab's executor vs `torch.distributed.pipelining`, median of "
            f"{d['steps']} steps; `benchmarks/pipeline.py`). Target: <= 1.1x.{_load_note(d)}", "",
            "| stages | schedule | microbatches | distlab step | torch step | ratio | max loss diff |",
            "|---|---|---|---|---|---|---|", *rows, ""]


def checkpoint() -> list[str]:
    d = _load("checkpoint")
    if not d:
        return []
    rows = []
    for r in d["results"]:
        ours, theirs = r["distlab"], r["torch DCP"]
        rows.append(f"| {r['world_size']} | {_ms(ours['median_save_s'])} | {_ms(theirs['median_save_s'])} | "
                    f"{_ms(ours['median_load_s'])} | {_ms(theirs['median_load_s'])} | "
                    f"{ours['bytes'] / 2**20:.1f} / {theirs['bytes'] / 2**20:.1f} MiB |")
    return [f"**Checkpoints** ({d['meta']['model']} ZeRO-3 state after one AdamW step: `dl.checkpoint` vs "
            f"`torch.distributed.checkpoint` on FSDP2, both loads checked to restore what was saved; "
            f"`benchmarks/checkpoint.py`). No target: DCP is the general tool "
            f"(it plans every save collectively and reshards any layout), "
            f"distlab's format covers only its own strategies.{_load_note(d['meta'])}",
            "",
            "| ranks | distlab save | DCP save | distlab load | DCP load | bytes on disk (distlab / DCP) |",
            "|---|---|---|---|---|---|", *rows, ""]


def fsdp() -> list[str]:
    d = _load("fsdp")
    if not d:
        return []
    rows = []
    for r in d["results"]:
        for config, v in r["configs"].items():
            if not v["ran"]:
                why = "; ".join(v["errors"].values())
                rows.append(f"| {r['world_size']} | {config} | could not run: {why} | | | | |")
                continue
            ours, theirs = v["dl.fully_shard"], v["torch fully_shard"]
            rows.append(f"| {r['world_size']} | {config} | {_ms(ours['median_step_s'])} | "
                        f"{_ms(theirs['median_step_s'])} | {v['time_ratio_dl_over_torch']:.2f}x | "
                        f"{v['memory_ratio_dl_over_torch']:.2f}x | {v['max_rel_loss_diff']:.1e} |")
    return [f"**FSDP2** ({d['meta']['model']}, AdamW, each block then the root, reshard after forward, "
            "one unit prefetched: `dl.fully_shard` vs `torch.distributed.fsdp.fully_shard`; "
            "`benchmarks/fsdp.py`). "
            "Targets: step time <= 1.1x torch's, model-state memory per rank <= torch's, losses equal."
            f"{_load_note(d['meta'])}", "",
            "| ranks | precision | distlab step | torch step | time ratio | model-state memory ratio "
            "| max loss diff |",
            "|---|---|---|---|---|---|---|", *rows, ""]



def expert_parallel() -> list[str]:
    d = _load("expert_parallel")
    if not d:
        return []
    rows = []
    for r in d["results"]:
        ep, rep = r["ep"], r["replicated"]
        met = "met" if all(v["met"] is not False for v in r["targets"].values()) else "**not met**"
        sent = [sum(x["sent_per_step"].values()) / 2**20 for x in (ep, rep)]
        rows.append(f"| {r['world_size']} | {_ms(ep['median_step_s'])} | {_ms(rep['median_step_s'])} | "
                    f"{r['time_ratio_ep_over_replicated']:.2f}x | {max(ep['memory_per_rank']) / 2**20:.1f} / "
                    f"{max(rep['memory_per_rank']) / 2**20:.1f} MiB | {sent[0]:.2f} / {sent[1]:.2f} MiB | "
                    f"{r['max_rel_loss_diff']:.1e} | {met} |")
    m = d["meta"]["model"]
    return [f"**Expert parallelism** (MoE GPT h={m['d_model']}, E={m['experts']}, k={m['top_k']}, "
            f"{m['layers']} layers; `dl.ep` experts split by all-to-all vs every expert replicated and "
            f"all-reduced, same routing; `benchmarks/expert_parallel.py`). Targets: losses equal, ep memory "
            f"per rank = `dl.theory.ep_memory` within 1%, ep faster where the theory says it sends fewer "
            f"bytes.{_load_note(d['meta'])}", "",
            "| ranks | ep step | replicated step | ratio | model states per rank (ep / replicated) "
            "| sent per rank per step (ep / replicated) | max loss diff | targets |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]
def all_to_all() -> list[str]:
    d = _load("all_to_all")
    if not d:
        return []
    by = {}
    for r in d["results"]:
        by.setdefault((r["world_size"], r["bytes"]), {})[r["impl"]] = r["busbw_GBps"]
    rows = [f"| {n} | {nbytes / 2**20:g} MiB | {v['dl']:.3f} | {v['torch']:.3f} | "
            f"{v['dl'] / v['torch']:.2f}x | " + (f"{v['p2p'] / v['torch']:.2f}x |" if "p2p" in v else "- |")
            for (n, nbytes), v in sorted(by.items()) if nbytes >= 1 << 20 and "dl" in v and "torch" in v]
    cores = d["meta"].get("cpus")
    ratios = ", ".join(f"{n} ranks: min {r['min_ratio_from_1MB']:.2f}x"
                       + (f" (oversubscribed: {n} ranks on {cores} cores, shown, not judged)"
                          if r.get("oversubscribed") else "")
                       for n, r in d["ratio_dl_over_torch"].items())
    ceiling = ", ".join(f"{n} ranks: median {r['median_ratio_from_1MB']:.2f}x"
                        for n, r in d.get("ceiling_p2p_over_torch", {}).items())
    if ceiling:
        ceiling = (f" The same messages from a bare isend/irecv loop (no checks, no tracing: the most a "
                   f"send/recv implementation can reach here): {ceiling}.")
    spread = ", ".join(f"{n} ranks: {min(v)}-{max(v)}x" for n, v in (
        (n, [x for size, xs in sizes.items() if int(size) >= 1 << 20 for x in xs])
        for n, sizes in d.get("ratio_dl_over_torch_by_launch", {}).items()) if v)
    if spread:
        ceiling += f" Single launches alone, from 1 MB up, ranged {spread}: the pooled median is the figure."
    met = "met" if d["target"]["met"] else "**not met**"
    return [f"**All-to-all** (`dl.comm.all_to_all`, pairwise exchange from send/recv, vs torch's "
            f"{d['meta']['backend']} `all_to_all_single`; busbw = S/t (N-1)/N; `benchmarks/all_to_all.py`). "
            f"Time: the {d['meta']['statistic']}. "
            f"Target: >= 0.8x from 1 MB up, {met} ({ratios}).{ceiling}{_load_note(d['meta'])}", "",
            "| ranks | bytes per rank | distlab busbw (GB/s) | torch busbw (GB/s) | ratio "
            "| bare isend/irecv ratio |",
            "|---|---|---|---|---|---|", *rows, ""]


def context_parallel() -> list[str]:
    d = _load("context_parallel")
    if not d:
        return []
    m, single = d["meta"], d["single_process_s"]
    rows = [f"| {r['world_size']} | {r['impl']} | {_ms(r['median_s'])} "
            f"| {_ms(single[str(r['world_size'])])} "
            f"| {r['ratio_over_single']:.2f}x | {r.get('max_abs_error_vs_full', float('nan')):.1e} |"
            for r in d["results"]]
    if d["target"]["applicable"]:
        met = "met" if d["target"]["met"] else "**not met**"
        target = f"Target: <= 1.2x torch's context_parallel, {met}."
    else:
        target = (f"torch's `context_parallel` does not run on {m['backend']}/CPU (its SDPA kernels have no "
                  f"CPU sharding rule: `why_not` in the JSON), so the target (<= 1.2x its time) cannot be "
                  f"checked; compared with single-process attention instead.")
    return [f"**Context parallelism** (causal attention forward + backward, s = {m['seq']}, "
            f"{m['heads']} heads x "
            f"{m['head_dim']}; ring attention (zig-zag) and Ulysses from `dl.cp`; "
            f"`benchmarks/context_parallel.py`). {target}{_load_note(m)}", "",
            "| ranks | attention | step | single process | ratio | max error vs full |",
            "|---|---|---|---|---|---|", *rows, ""]


def checkpoint_stall() -> list[str]:
    d = _load("checkpoint")
    s = d.get("stall") if d else None
    if not s:
        return []
    t = s["target"]
    return [f"**Checkpoint stall** (training time lost per save, {s['model']} {s['strategy']} on "
            f"{s['world_size']} ranks, `dl.train(..., async_save=True)` vs synchronous, slowest rank, "
            f"median of {len(s['sync_stall_s'])} saves; `benchmarks/checkpoint.py`). Target: async stall <= "
            f"{t['limit']:.0%} of the sync save.{_load_note(d['meta'])}", "",
            "| sync save (= its stall) | async stall | async write (background) | async stall / sync save "
            "| met |",
            "|---|---|---|---|---|",
            f"| {_ms(s['median_sync_write_s'])} | {_ms(s['median_async_stall_s'])} | "
            f"{_ms(s['median_async_write_s'])} | {t['ratio_async_stall_over_sync_save']:.2f} | "
            f"{'yes' if t['met'] else 'no'} |", ""]


def dry_run() -> list[str]:
    d = _load("dry_run")
    if not d:
        return []
    rows = []
    for r in d["results"]:
        states = [sum(x["peak"][k] for k in ("params", "grads", "optimizer")) / 2**30 for x in r["ranks"]]
        theory = sum(r["theory"][k] for k in ("params", "grads", "optimizer")) / 2**30
        rows.append(f"| {r['model']} | {r['strategy']} | {r['world_size']} | {r['seconds']:.1f} s | "
                    + " / ".join(f"{v:.2f}" for v in states) + f" | {theory:.2f} |")
    target = d.get("target")
    met = "" if not target else f" Target: {target['what']}: {target['seconds']:.1f} s, " + (
        "met." if target["met"] else "**not met**.")
    return [f"**Dry runs** (the fake backend: one step of the real code on meta tensors, the first and the "
            f"last rank; `benchmarks/dry_run.py`).{met}{_load_note(d['meta'])}", "",
            "| model | layout | ranks | seconds | model states GiB (first / last rank) | theory GiB |",
            "|---|---|---|---|---|---|", *rows, ""]


def _offload_row(r: dict) -> str:
    mem = r["memory_rank0"]
    extra = (f"{_ms(r['measured_extra_s'])} | {_ms(r['predicted_extra_s'])}" if "measured_extra_s" in r
             else "- | -")
    where = " / ".join(f"{mem.get(c, 0) / 1e6:.2f}" for c in ("optimizer", "host", "disk"))
    return (f"| {r['world']} | zero{r['stage']} | {r['tier']} | {_ms(r['step_s'])} | {extra} | {where} | "
            f"{'yes' if r['equal_to_no_offload'] else '**no**'} |")


def offload() -> list[str]:
    d = _load("offload")
    if not d:
        return []
    m, bw = d["meta"], d["meta"]["bandwidth_bytes_per_s"]
    return [f"**Offload** (ZeRO with `offload=\"cpu\"` / `\"disk\"` beside none, {m['model']}, the slowest "
            f"rank's median step, tiers taking turns in one launch; predicted extra: `dl.theory.offload."
            f"step_time` at the measured host copy {bw['host'] / 1e9:.1f} GB/s, file round trip "
            f"{bw['disk'] / 1e9:.2f} GB/s and {bw['file_latency_s'] * 1e3:.2f} ms per file; "
            f"`benchmarks/offload.py`).{_load_note(m)}", "",
            "| ranks | stage | offload | step | extra | predicted extra | optimizer / host / disk MB "
            "(rank 0) | equal to no offload |",
            "|---|---|---|---|---|---|---|---|", *[_offload_row(r) for r in d["results"]], ""]


def talk_less() -> list[str]:
    d = _load("talk_less")
    if not d:
        return []
    rows = []
    for row in d["results"]:
        for name, r in row["impls"].items():
            over = "-" if r["bytes_over_ddp"] is None else f"{r['bytes_over_ddp']:.3f}x"
            rows.append(f"| {row['world_size']} | {name} | {r['sent_per_step'] / 2**10:.1f} ({r['bytes']}) | "
                        f"{over} | {_ms(r['mean_step_s'])} | {r['last_loss']:.3f} |")
    return [f"**Talking less** (DDP, Local SGD and DiLoCo every H steps, ZeRO-3 / FSDP exact and quantized, "
            f"beside torch's DDP, {d['meta']['model']}, one launch; mean step of the slowest rank; "
            f"`benchmarks/talk_less.py`).{_load_note(d['meta'])}", "",
            "| ranks | implementation | KiB sent per step (rank 0) | of dl.DDP's | step | last loss |",
            "|---|---|---|---|---|---|", *rows, ""]


def elastic() -> list[str]:
    d = _load("elastic")
    if not d:
        return []
    m, e, r = d["meta"], d["results"]["elastic"], d["results"]["restart"]
    return [f"**Elastic recovery** (one of {m['replicas']} {m['model']} replicas killed at step "
            f"{m['fault_step']} of {m['steps']}: `dl.elastic.train` restarts that replica alone and heals "
            f"it from a peer, beside `dl.train(\"ddp\", max_restarts=1)` relaunching every rank from a "
            f"checkpoint every {m['checkpoint_every']} steps; {m['statistic']}, {m['repeats']} repeats; "
            f"`benchmarks/elastic.py`). Both checked: the elastic run equals the one-process reference on "
            f"its membership timeline, the restarted run ends with the losses of the run without a fault."
            f"{_load_note(m)}", "",
            "| elastic: survivors stalled | elastic: quorum whole again | elastic: wall time lost | "
            "restart: wall time lost | restart: steps computed twice |",
            "|---|---|---|---|---|",
            f"| {_ms(e['stall_s'])} | {_ms(e['recovery_s'])} | {_ms(e['extra_s'])} | {_ms(r['extra_s'])} | "
            f"{r['lost_steps']} |", ""]


def tables() -> str:
    parts = launch_latency() + allreduce() + data_parallel() + tensor_parallel() + pipeline() + checkpoint()
    parts += expert_parallel()
    parts += fsdp()
    parts += all_to_all() + context_parallel()
    parts += checkpoint_stall() + dry_run()
    parts += offload()
    parts += talk_less()
    parts += elastic()
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="write the tables into README.md")
    args = parser.parse_args()
    text = tables()
    if not args.readme:
        print(text)
        return
    readme = README.read_text()
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(readme[:start] + "\n" + text + readme[end:])
    print(f"updated {README}")


if __name__ == "__main__":
    main()
