"""Every GPU figure distlab lacks, from one command, in a few minutes on one GPU.

    make gpu-check                                    # the same as the next line
    .venv/bin/python benchmarks/gpu_check.py          # on the GPU machine (no internet: the copied .venv)
    python benchmarks/gpu_check.py --dry              # the whole script on a CPU in seconds (CI runs
                                                      # it: tests/test_gpu_check.py), results in a temp folder
    python benchmarks/gpu_check.py --stages step,memory
    make gpu-check GPU_CHECK_ARGS="--copy-to $OUT"    # a lent machine that sends back only $OUT: the
                                                      # results folder and README.md are copied there

Stages, in order, each with its own time budget (seconds, GPU / dry), each in a child process of its own so
that one that fails, crashes or overruns is reported and the next one still runs (`_gpu_stages`):

    facts        20 / 30    device name, torch, CUDA, cuDNN, NCCL, date; the peak bf16 FLOP/s for MFU
    tests       150 / 90    pytest -m gpu (tests/test_gpu.py: every strategy of dl.train on CUDA tensors
                            equal to one process, as a world of one NCCL rank; tests/test_launch.py: NCCL
                            with one GPU per rank)
    memory       45 / 45    the memory ledger beside torch.cuda.max_memory_allocated: ddp, zero1-3, fsdp
    step         45 / 45    bf16 step time and MFU of gpt-small, gpt-wide and a 302 M-parameter GPT (GPT-2
                            medium's blocks), dl.train beside a torch loop; MFU of the data sheet's peak
                            and of the measured matmul peak (bf16 8192 x 8192 products)
    allreduce    60 / 45    benchmarks/allreduce.py's measurement on CUDA tensors (2 gloo ranks, one GPU)
    all_to_all   60 / 45    benchmarks/all_to_all.py's, the same way
    multirank   100 / 60    every strategy on 2 gloo ranks sharing the GPU, CUDA tensors, against single:
                            which ones gloo's CUDA support carries (a finding, `_gpu_multirank`)

Together at most 480 s on the GPU (8 min), so that a second try fits in a 15-minute loan. Progress lines
carry the time of day and the seconds since the start. Results: one JSON per stage and ``summary.json``
under ``benchmarks/results/gpu/<device>/`` (``--dry``: a temporary folder, or ``--out``), then README's GPU
table is made from them (`gpu_table.py`; ``--dry`` writes it to ``table.md`` beside its results instead).
Exit status 1 if any stage failed. Every number is measured; the only figure from outside is the peak
FLOP/s of the data sheet, named in each result (`_gpu_facts`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import _gpu_comm  # noqa: E402
import _gpu_multirank  # noqa: E402
import _gpu_stages as stages  # noqa: E402
import gpu_table  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (else each stage and rank imports it at its first step: ~2.5 s on a CPU)

STAGES = {  # name: (function of (cfg, out), GPU budget s, dry budget s)
    "facts": (lambda cfg, out: stages.facts(cfg), 20, 30),
    "tests": (stages.tests, 150, 90),
    "memory": (lambda cfg, out: stages.memory(cfg), 45, 45),
    "step": (lambda cfg, out: stages.step(cfg), 45, 45),
    "allreduce": (lambda cfg, out: _gpu_comm.allreduce(cfg), 60, 45),
    "all_to_all": (lambda cfg, out: _gpu_comm.all_to_all(cfg), 60, 45),
    "multirank": (lambda cfg, out: _gpu_multirank.multirank(cfg, STAGES["multirank"][1 + cfg.dry] - 5),
                  100, 60),
}
T0 = time.monotonic()


LOG: list[Path] = []          # where the progress lines also go, once the results folder is known


def log(message: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:6.1f}s] {message}"
    print(line, flush=True)
    for path in LOG:
        with open(path, "a") as f:
            f.write(line + "\n")


def _child(fn, cfg, out: Path, conn) -> None:
    """In the stage's process: its own process group (so an overrun kills what it started), run, report."""
    os.setpgrp()
    try:
        conn.send(("ok", fn(cfg, out), None))
    except stages.StageFailed as exc:
        conn.send(("failed", exc.document, str(exc)))
    except BaseException:
        conn.send(("failed", None, traceback.format_exc()))
    finally:
        conn.close()


def run_stage(name: str, cfg, out: Path, budget: float) -> tuple[str, dict | None, str | None]:
    """Run one stage in a forked child within ``budget`` seconds: (status, document, error). This process
    never touches CUDA, so every child can (a forked child cannot use CUDA its parent initialised)."""
    receive, send = mp.Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=_child, args=(STAGES[name][0], cfg, out, send),
                                           name=f"gpu-check-{name}")
    child.start()
    send.close()
    try:
        if not receive.poll(budget):
            return "timeout", None, f"over its budget of {budget:g} s: stopped"
        return receive.recv()
    except EOFError:
        return "failed", None, f"its process died (exit code {child.exitcode}) without a word"
    finally:
        if child.is_alive():
            try:
                os.killpg(child.pid, signal.SIGKILL)      # the stage and what it started (pytest, ranks)
            except ProcessLookupError:                  # it had not made its group yet
                child.kill()
        child.join(10)
        receive.close()


def slug(name: str) -> str:
    """A folder name for a device: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def check(cfg, names: list[str], out: Path | None) -> tuple[Path, list[dict]]:
    """Every stage in ``names`` (facts always first); each stage's JSON written as it ends."""
    log(f"gpu_check{' --dry' if cfg.dry else ''}: stages {', '.join(names)}")
    status, facts, error = run_stage("facts", cfg, Path(tempfile.gettempdir()), STAGES["facts"][1 + cfg.dry])
    facts = (facts or {}).get("meta", {"name": "unknown device", "error": error})
    no_gpu = not cfg.dry and facts.get("device") != "cuda:0"     # CPU numbers must not pass for a GPU run
    if no_gpu:
        out = Path(tempfile.mkdtemp(prefix="gpu_check_no_gpu_"))        # nothing for README's table
    out = out or stages.ROOT / "benchmarks" / "results" / "gpu" / slug(facts["name"])
    out.mkdir(parents=True, exist_ok=True)
    LOG[:] = [out / "gpu_check.log"]
    log(f"facts: {status}; {facts.get('name')}, torch {facts.get('torch')}, CUDA {facts.get('cuda')}; "
        f"results in {out}")
    done = [{"name": "facts", "status": status, "seconds": None, "error": error}]
    if no_gpu:
        why = (f"no CUDA device visible to torch {facts.get('torch')} (built for CUDA {facts.get('cuda')}): "
               "nothing measured; --dry is the CPU rehearsal") if status == "ok" else error
        done[0].update(status="failed", error=why)
        log(f"facts: FAILED: {done[0]['error']}")
        return out, done
    for name in (n for n in names if n != "facts"):
        budget = STAGES[name][1 + cfg.dry]
        log(f"{name}: start (budget {budget} s)")
        start = time.monotonic()
        status, document, error = run_stage(name, cfg, out, budget)
        seconds = round(time.monotonic() - start, 1)
        if document is not None:
            document = {"stage": name, "status": status, "facts": facts, **document}
            (out / f"{name}.json").write_text(json.dumps(document, indent=1, default=str))
        first = (error or "").strip().splitlines()[-1:] or [""]
        log(f"{name}: {status} in {seconds} s" + (f": {first[0]}" if status != "ok" else ""))
        done.append({"name": name, "status": status, "seconds": seconds, "budget": budget, "error": error})
    summary = {"facts": facts, "dry": cfg.dry, "stages": done, "command": " ".join(sys.argv),
               "seconds": round(time.monotonic() - T0, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return out, done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry", action="store_true", help="tiny sizes on the CPU, results in a temporary folder")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results/gpu/"
                                                          "<device>/, or a temporary folder with --dry)")
    p.add_argument("--no-readme", action="store_true", help="do not write README's GPU table")
    p.add_argument("--copy-to", type=Path, default=None,
                   help="at the end, copy the results folder and README.md here (a lent machine's $OUT)")
    a = p.parse_args(argv)
    names = [s.strip() for s in a.stages.split(",") if s.strip()]
    if unknown := sorted(set(names) - set(STAGES)):
        p.error(f"unknown stages {unknown}: choose from {', '.join(STAGES)}")
    cfg = stages.DRY if a.dry else stages.GPU
    out = a.out or (Path(tempfile.mkdtemp(prefix="gpu_check_dry_")) / "cpu" if a.dry else None)
    out, done = check(cfg, names, out)
    if a.dry:                                   # the table from these results, README itself untouched
        text = gpu_table.table(out.parent)
        gpu_table.replaced(gpu_table.README.read_text(), text)
        (out / "table.md").write_text(text + "\n")
        log(f"table: written to {out / 'table.md'} (README.md untouched)")
    elif not a.no_readme and done[0]["status"] == "ok":
        gpu_table.main(["--readme"])
        log("table: README.md updated from benchmarks/results/gpu/")
    failed = [s["name"] for s in done if s["status"] != "ok"]
    log(f"done: {len(done) - len(failed)} stages ok" + (f", FAILED: {', '.join(failed)}" if failed else ""))
    if a.copy_to is not None:
        shutil.copytree(out, a.copy_to / "results" / out.name, dirs_exist_ok=True)
        shutil.copy(gpu_table.README, a.copy_to / "README.md")
        print(f"copied {out} and README.md to {a.copy_to}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
