"""The stages of `gpu_check.py`, each a function of the `Config` returning one JSON document.

    facts        the device, torch, CUDA, cuDNN and NCCL versions, the peak FLOP/s the MFU is taken against
    tests        ``pytest -m gpu``: every strategy of dl.train on CUDA tensors equal to one process, ...
    memory       the memory ledger (report.memory) beside torch.cuda.max_memory_allocated: ddp, zero1-3, fsdp
    step         a bf16 training step of dl.train beside a plain torch loop of the same model: time and MFU
    allreduce    benchmarks/allreduce.py's measurement on the device's tensors
    all_to_all   benchmarks/all_to_all.py's measurement on the device's tensors

Each stage runs in a child process of its own (`gpu_check.run_stage`) and may use CUDA there; ``memory``
and ``step`` run as a world of one rank (`_gpu_facts.one_rank_world`: NCCL on the GPU, gloo on a CPU),
the collectives as two gloo ranks sharing the one GPU (NCCL refuses two ranks on one GPU).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import distlab as dl
from _gpu_facts import PEAK_SOURCE, device_facts, join_world, mfu, one_rank_world, peak_flops

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Config:
    """Sizes of one check: `GPU` for the real one, `DRY` for the proof on a CPU in seconds."""

    dry: bool
    step_models: tuple           # the presets timed by the step stage (names, or a dl.theory.ModelPreset)
    step_batch: int              # their global batch (rows of seq_len tokens)
    big_batch: int               # the batch of a ModelPreset among them (a bigger model: fewer rows)
    matmul_n: int                # the measured peak: bf16 n x n products on a GPU (fp32 on a CPU)
    warmup: int                  # untimed steps first
    steps: int                   # timed steps
    memory_model: str
    memory_batch: int
    sizes: tuple[int, ...]       # message bytes of the collectives
    budget: float                # seconds of repeats per message size
    test_paths: tuple[str, ...]  # what `pytest -m gpu` runs
    test_timeout: float          # pytest's limit: under the stage's budget (gpu_check.STAGES), so that what
                                 # ran is still reported when it is reached


#: the files holding ``gpu``-marked tests: collecting only these keeps the lesson extras (Jupyter, ipywidgets,
#: jupytext), which a bare GPU image lacks, out of the GPU check
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_launch.py")

#: a model big enough for MFU to mean something (gpt-small is 0.87 M parameters: 0.3-0.5% of an H100 on
#: the first run): GPT-2 medium's width and depth (302 M parameters in the blocks) on 1,024 tokens, with a
#: byte vocabulary (a Markov chain over 50,257 tokens would not fit in memory)
BIG = dl.theory.ModelPreset("gpt-medium-bytes", hidden=1024, layers=24, heads=16, vocab=256, seq_len=1024)
BIG_DRY = dl.theory.ModelPreset("gpt-big-dry", hidden=64, layers=2, heads=4, vocab=256, seq_len=64)

GPU = Config(dry=False, step_models=("gpt-small", "gpt-wide", BIG), step_batch=256, big_batch=4,
             matmul_n=8192, warmup=5, steps=30,
             memory_model="gpt-small", memory_batch=16, sizes=tuple(4**k * 1024 for k in range(9)),  # 1K..64M
             budget=0.5, test_paths=GPU_TEST_FILES, test_timeout=140.0)
DRY = Config(dry=True, step_models=("gpt-tiny", BIG_DRY), step_batch=8, big_batch=2, matmul_n=256, warmup=1,
             steps=2, memory_model="gpt-tiny",
             memory_batch=8, sizes=(4096, 65536), budget=0.01, test_paths=("tests/test_gpu.py",),
             test_timeout=80.0)


def device() -> torch.device:
    """The GPU where there is one (CUDA initialised here: call it in a stage's own process only)."""
    return torch.device("cuda", 0) if torch.cuda.device_count() else torch.device("cpu")


def facts(cfg: Config) -> dict:
    """What the numbers were measured on; the peak the MFU is taken against, or why there is none."""
    found = device_facts(device())
    peak = peak_flops(found["name"]) if device().type == "cuda" else None
    found["peak_bf16_flops"] = peak[0] if peak else None
    found["peak_variant"] = peak[1] if peak else None
    found["peak_source"] = PEAK_SOURCE if peak else f"no peak known for {found['name']!r}: MFU omitted"
    return {"meta": found, "dry": cfg.dry}


# -- tests ----------------------------------------------------------------------------------------------
def tests(cfg: Config, out: Path) -> dict:
    """``pytest -m gpu`` in a child process; its JUnit XML counted. Without CUDA every test skips."""
    xml = out / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *cfg.test_paths, "-v", "-rs",
           "-p", "no:cacheprovider", "-p", "no:nbval",      # (nbval loads Jupyter; no lesson is a gpu test)
           f"--junitxml={xml}"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cfg.test_timeout)
    except subprocess.TimeoutExpired as exc:          # before the stage's budget: what ran is still told
        tail = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise StageFailed(f"pytest ran over {cfg.test_timeout:g} s", {"command": " ".join(cmd[1:]),
                                                                       "tail": tail[-3000:]}) from None
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    doc = {"command": " ".join(cmd[1:]), "returncode": done.returncode, **counts,
           "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
           "failed": failed, "tail": done.stdout[-3000:]}
    if done.returncode not in (0, 5):                  # 5: nothing collected (no test marked gpu)
        raise StageFailed(f"pytest exited {done.returncode}: {len(failed)} failed ({', '.join(failed[:5])})",
                          doc)
    return doc


class StageFailed(Exception):
    """A stage that measured something but failed its check: the document is still written."""

    def __init__(self, message: str, document: dict):
        super().__init__(message)
        self.document = document


# -- memory: the ledger beside the caching allocator ---------------------------------------------------
MEMORY_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def memory(cfg: Config) -> dict:
    """Per strategy (one rank), the ledger's peak (sum of its categories at one sample, measured by
    `distlab.memory` from storages and saved tensors) beside the allocator's: torch.cuda.max_memory_allocated
    over the run, less what was allocated before it. Both are measurements; the ratio is ledger / allocator.
    On a CPU the allocator column is None."""
    rows = []
    with one_rank_world():
        join_world()
        cuda = dl.device().type == "cuda"
        for strategy in MEMORY_STRATEGIES:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if cuda else 0
            r = dl.train(strategy, world_size=1, model=cfg.memory_model, steps=3,
                         global_batch=cfg.memory_batch)
            allocator = torch.cuda.max_memory_allocated() - before if cuda else None
            total = r.memory[0]["peak_total"]
            rows.append({"strategy": strategy, "ledger_peak_total": total, "ledger_peak": r.memory[0]["peak"],
                         "allocator_peak": allocator,
                         "ratio_ledger_over_allocator": total / allocator if allocator else None,
                         "backend": r.run.backend, "losses": r.losses})
            del r
    return {"model": cfg.memory_model, "global_batch": cfg.memory_batch, "world_size": 1, "rows": rows,
            "note": "a world of one rank (one GPU: NCCL takes one rank per GPU), so every shard is whole: "
                    "this checks the ledger's accounting against the allocator, not the sharding (the CPU "
                    "suite's multi-rank tests check that)",
            "labels": {"ledger_peak_total": "measured (distlab.memory: storages and saved tensors)",
                       "allocator_peak": "measured (torch.cuda.max_memory_allocated, less the bytes "
                                         "allocated before the run)"}}


# -- step: bf16 step time and MFU, dl.train beside a plain torch loop ----------------------------------
def step(cfg: Config) -> dict:
    """A bf16-mixed training step of each of ``cfg.step_models`` on one device, timed the same way on both
    sides: from one step's start to the next's (each step ends in ``loss.item()``, which waits for the
    device), median over ``cfg.steps`` steps after ``cfg.warmup``; the batch is drawn inside the step on both
    sides, as `dl.train` does. MFU: 6 N T / step time / the device's peak (`_gpu_facts`), None where the peak
    is not known (a CPU, a GPU not in the table)."""
    rows, models = [], {}
    with one_rank_world():
        join_world()
        dev = dl.device()
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        peak = peak_flops(name)[0] if dev.type == "cuda" and peak_flops(name) else None
        measured = matmul_peak(dev, cfg.matmul_n)
        for model in cfg.step_models:
            found, models[getattr(model, "name", model)] = _step_of(cfg, model, dev, peak, measured)
            rows += found
    return {"models": models, "global_batch": cfg.step_batch, "big_batch": cfg.big_batch, "device": str(dev),
            "peak_bf16_flops": peak, "measured_matmul_flops": measured,
            "measured_matmul": f"{cfg.matmul_n} x {cfg.matmul_n} products, "
                               f"{'bf16' if dev.type == 'cuda' else 'fp32'}, median of 3 timings",
            "precision": "bf16-mixed (autocast, fp32 weights)", "optimizer": "AdamW lr 1e-3", "rows": rows,
            "labels": {"median_s": "measured", "mfu": "6 N T / measured time / data-sheet peak"
                       if peak else "omitted: no peak known for this device"}}


def matmul_peak(dev: torch.device, n: int, reps: int = 10) -> float:
    """The measured matmul peak, FLOP/s: ``reps`` products of two n x n matrices (bf16 on a GPU, where the
    tensor cores reach their peak at large n; fp32 on a CPU), the median of 3 timings after a warm-up."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b
    sync()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 * reps / statistics.median(times)


def _step_of(cfg: Config, model, dev: torch.device, peak: float | None,
             measured: float) -> tuple[list[dict], dict]:
    """Both sides' rows for ``model``, and its facts: parameters, tokens, time ratio, loss gap."""
    batch = cfg.big_batch if isinstance(model, dl.theory.ModelPreset) else cfg.step_batch
    r = dl.train("single", model=model, steps=cfg.warmup + cfg.steps + 1, global_batch=batch,
                 precision="bf16-mixed")
    starts = sorted(e.start for e in r.trace.select("mark", name="step"))
    dl_times = [b - a for a, b in zip(starts, starts[1:])][cfg.warmup:]
    torch_times, torch_losses, params = _torch_loop(cfg, model, dev, batch)
    tokens = batch * dl.models.config(model).seq_len
    sides = {"dl.train single": dl_times, "torch loop": torch_times}
    rows = [{"model": getattr(model, "name", model), "batch": batch,
             **_step_row(side, times, params, tokens, peak, measured)} for side, times in sides.items()]
    return rows, {"params": params, "tokens_per_step": tokens,
                  "time_ratio_dl_over_torch": rows[0]["median_s"] / rows[1]["median_s"],
                  "loss_max_relative_gap": max(abs(a - b) / abs(b) for a, b in zip(r.losses, torch_losses))}


def _torch_loop(cfg: Config, name, dev: torch.device, batch: int) -> tuple[list[float], list[float], int]:
    """The same model, data, optimizer and autocast as `dl.train("single")`, written as plain torch."""
    model = dl.models.build(name, 0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data = dl.models.dataset_for(name, 0)
    starts, losses = [], []
    for s in range(cfg.warmup + cfg.steps + 1):
        starts.append(time.perf_counter())
        x, y = (t.to(dev) for t in data.batch(s, batch))
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(x)                                               # (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = [b - a for a, b in zip(starts, starts[1:])][cfg.warmup:]
    return times, losses, sum(p.numel() for p in model.parameters())


def _step_row(side: str, times: list[float], params: int, tokens: int, peak: float | None,
              measured: float) -> dict:
    t = statistics.median(times)
    achieved = 6 * params * tokens / t
    return {"implementation": side, "median_s": t, "min_s": min(times), "steps_timed": len(times),
            "tokens_per_s": tokens / t, "model_flops_per_s": achieved, "mfu": mfu(params, tokens, t, peak),
            "of_measured_matmul": achieved / measured}
