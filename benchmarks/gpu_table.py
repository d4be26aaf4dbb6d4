"""README's GPU table, made from what `gpu_check.py` wrote under benchmarks/results/gpu/ (one folder per
device); with nothing there, it says that no GPU run has been recorded. It never writes a number that is not
in those files.

    python benchmarks/gpu_table.py             # print the table
    python benchmarks/gpu_table.py --readme    # replace the block between the markers in README.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "gpu"
README = HERE.parent / "README.md"
BEGIN, END = "<!-- gpu-table:begin -->", "<!-- gpu-table:end -->"
NO_RUN = ("No GPU run has been recorded yet: every figure above is from a CPU. `make gpu-check` on a machine "
          "with an NVIDIA GPU writes `benchmarks/results/gpu/` and this table.")


def _load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:.1f} MiB"


def _size(b: int) -> str:
    return f"{b / 2**20:g} MiB" if b >= 2**20 else f"{b / 2**10:g} KiB"


def device_block(folder: Path) -> list[str]:
    """The lines for one device's run: where and when, then each stage's figures or its failure."""
    summary = _load(folder, "summary")
    if summary is None:
        return []
    f = summary["facts"]
    dry = ", DRY RUN on a CPU" if summary.get("dry") else ""
    lines = [f"**{f.get('name')}** (torch {f.get('torch')}, CUDA {f.get('cuda')}, NCCL {f.get('nccl')}, "
             f"{f.get('date')}; `benchmarks/gpu_check.py`{dry}). "
             "All times measured; MFU = 6 N T / measured step time / the data sheet's dense bf16 peak "
             f"({f.get('peak_variant') or 'none known: MFU omitted'}).", ""]
    failed = [f"{s['name']} ({s['status']}: {s.get('error') or ''})" for s in summary["stages"]
              if s["status"] != "ok"]
    if failed:
        lines += ["Stages that did not finish: " + "; ".join(failed), ""]
    ran = {s["name"] for s in summary["stages"]}         # not a file left by an earlier run of another stage
    for name, part in (("tests", _tests), ("step", _step), ("memory", _memory), ("allreduce", _collective),
                       ("all_to_all", _collective), ("multirank", _multirank)):
        doc = _load(folder, name) if name in ran else None
        lines += part(doc, name) if doc is not None else []
    return lines


def _tests(t: dict, name: str) -> list[str]:
    text = (f"`pytest -m gpu`: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
            f"{t['skipped']} skipped.")
    return [text + (" Failed: " + ", ".join(t["failed"]) if t["failed"] else ""), ""]


def _step(s: dict, name: str) -> list[str]:
    measured = "measured_matmul_flops" in s             # results from before the measured peak lack it
    big = f" ({s['big_batch']} for the bigger model)" if "big_batch" in s else ""
    lines = [f"bf16 training step on one device, global batch {s['global_batch']}{big}:", "",
             "| model | parameters | tokens/step | implementation | median step | tokens/s | model TFLOP/s "
             "| MFU |" + (" of the measured matmul peak |" if measured else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if measured else "")]
    for r in s["rows"]:
        m = s["models"][r["model"]]
        mfu = "omitted" if r["mfu"] is None else f"{r['mfu'] * 100:.2f}%"
        lines.append(f"| {r['model']} | {m['params'] / 1e6:.2f} M | {m['tokens_per_step']} | "
                     f"{r['implementation']} | {_ms(r['median_s'])} | {r['tokens_per_s']:,.0f} | "
                     f"{r['model_flops_per_s'] / 1e12:.3f} | {mfu} |"
                     + (f" {r['of_measured_matmul'] * 100:.2f}% |" if measured else ""))
    if measured:
        lines += ["", f"Measured matmul peak: {s['measured_matmul_flops'] / 1e12:.1f} TFLOP/s "
                      f"({s['measured_matmul']})."]
    return lines + [""]


def _memory(m: dict, name: str) -> list[str]:
    lines = [f"Memory ledger (`report.memory`, peak total) beside `torch.cuda.max_memory_allocated`, "
             f"{m['model']}, one rank:", "",
             "| strategy | ledger peak | allocator peak | ledger / allocator |", "|---|---|---|---|"]
    for r in m["rows"]:
        ratio = "-" if r["ratio_ledger_over_allocator"] is None else f"{r['ratio_ledger_over_allocator']:.2f}"
        lines.append(f"| {r['strategy']} | {_mib(r['ledger_peak_total'])} | {_mib(r['allocator_peak'])} | "
                     f"{ratio} |")
    return lines + [""]


def _collective(doc: dict, name: str) -> list[str]:
    """The all-reduce or all-to-all rows near 1 MiB and at the largest size."""
    meta, rows = doc["meta"], doc["results"]
    near_1mib = min(rows, key=lambda r: abs(r["bytes"] - 2**20))["bytes"]
    shown = [r for r in rows if r["bytes"] in (near_1mib, max(r["bytes"] for r in rows))]
    title = {"allreduce": "all-reduce", "all_to_all": "all-to-all"}[name]
    lines = [f"{title}, {meta['world_size']} gloo ranks on {meta['device']} tensors ({meta['why_gloo']}); "
             f"{meta['dl_on_device']}:", "", "| implementation | size | median | busbw |",
             "|---|---|---|---|"]
    lines += [f"| {r['impl']} | {_size(r['bytes'])} | {_ms(r['median_s'])} | {r['busbw_GBps']:.2f} GB/s |"
              for r in sorted(shown, key=lambda r: (r["bytes"], r["impl"]))]
    return lines + [""]


def _multirank(doc: dict, name: str) -> list[str]:
    lines = [f"Every strategy on {doc['world_size']} gloo ranks sharing {doc['device']} (its tensors through "
             f"gloo), against single on the same device ({doc['equal_means']}):", "",
             "| strategy | result | detail |", "|---|---|---|"]
    for r in doc["rows"]:
        detail = r.get("detail") or f"gap {r['gap']:.1e}"
        lines.append(f"| {r['strategy']} | {r['status']} | {detail.replace('|', '/')} |")
    return lines + [""]


def table(results: Path = RESULTS) -> str:
    """The markdown of every recorded device, or the sentence that none is."""
    blocks = [device_block(d) for d in sorted(results.iterdir())] if results.is_dir() else []
    lines = [line for block in blocks for line in block]
    return "\n".join(lines).strip() if lines else NO_RUN


def replaced(readme: str, text: str) -> str:
    """``readme`` with the block between the gpu-table markers replaced by ``text``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return readme[:start + len(BEGIN)] + "\n" + text + "\n" + readme[end:]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--readme", action="store_true", help="write the table into README.md")
    a = p.parse_args(argv)
    text = table(a.results)
    if a.readme:
        README.write_text(replaced(README.read_text(), text))
        print(f"updated {README}")
    else:
        print(text)


if __name__ == "__main__":
    main()
