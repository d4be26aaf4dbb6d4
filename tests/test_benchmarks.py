"""The benchmark scripts run end to end on tiny settings and write what README's tables are made from.

No timing is asserted here (speed targets live in the benchmarks' own results): these tests only keep
the scripts, their JSON and `benchmarks/summary.py` working, and check the correctness each benchmark
asserts about itself (equal losses, loads that restore what was saved).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
# ~90 s for the fourteen scripts: run by `make test-slow` (CI runs it after `make test`), so that `make test`
# stays under 15 minutes on 2 cores
pytestmark = pytest.mark.slow

TINY = {  # script -> arguments that make it take seconds
    "allreduce": ["--ranks", "2", "--sizes", "4K,4M", "--budget", "0.05", "--min-reps", "2",
                  "--max-reps", "3"],
    "data_parallel": ["--ranks", "2", "--steps", "2", "--warmup", "1", "--rows", "2", "--model", "gpt-tiny"],
    "tensor_parallel": ["--ranks", "2", "--steps", "2", "--warmup", "1", "--model", "gpt-tiny"],
    "pipeline": ["--steps", "1", "--warmup", "0"],
    "checkpoint": ["--ranks", "2", "--repeats", "1", "--model", "gpt-tiny"],
    "expert_parallel": ["--ranks", "2", "--steps", "2", "--warmup", "1", "--d-model", "32", "--experts", "4"],
    "fsdp": ["--ranks", "2", "--steps", "2", "--warmup", "1", "--rows", "2", "--model", "gpt-tiny"],
    "all_to_all": ["--ranks", "2", "--sizes", "4K,1M", "--budget", "0.05", "--min-reps", "2",
                   "--max-reps", "3", "--calls", "2", "--launches", "1"],
    "context_parallel": ["--ranks", "2", "--seq", "64", "--repeats", "2"],
    "dry_run": ["--cases", "quick"],
    "offload": ["--ranks", "2", "--steps", "2", "--warmup", "1", "--model", "gpt-tiny", "--stages", "2"],
    "talk_less": ["--steps", "8", "--warmup", "0", "--rows", "2",
                  "--impls", "torch DDP,dl.DDP,local-sgd H=4,diloco H=8,zero3,zero3 int8,fsdp fp8"],
    "elastic": ["--replicas", "2", "--steps", "4", "--fault-step", "3", "--checkpoint-every", "2",
                "--repeats", "1", "--rows", "4", "--warmup", "0"],
}


def _summary(results_dir: Path):
    spec = importlib.util.spec_from_file_location("bench_summary", BENCH / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.RESULTS = results_dir
    return module


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("results")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, args in TINY.items():
        done = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args, "--out", str(out / name)],
                              capture_output=True, text=True, timeout=600, env=env, cwd=BENCH.parent)
        assert done.returncode == 0, (name, done.stdout[-2000:], done.stderr[-2000:])
    return out


@pytest.mark.parametrize("name", sorted(TINY))
def test_benchmark_writes_json_and_plot(name, results):
    document = json.loads((results / f"{name}.json").read_text())
    assert (results / f"{name}.png").stat().st_size > 1000
    if name in ("data_parallel", "tensor_parallel", "checkpoint", "allreduce", "fsdp"):
        assert document["meta"]["torch"] and "load_average" in document["meta"]


def test_benchmarks_check_their_own_correctness(results):
    dp = json.loads((results / "data_parallel.json").read_text())["results"]
    assert all(pair["max_rel_loss_diff"] < 1e-4 for row in dp for pair in row["pairs"].values())
    tp = json.loads((results / "tensor_parallel.json").read_text())["results"]
    assert all(row["max_rel_loss_diff"] < 1e-4 for row in tp)
    pp = json.loads((results / "pipeline.json").read_text())["rows"]
    assert pp and all(row["max_loss_diff"] < 1e-4 for row in pp)
    ckpt = json.loads((results / "checkpoint.json").read_text())["results"]
    assert all(row[side]["loaded_equal"] for row in ckpt for side in ("distlab", "torch DCP"))
    ep = json.loads((results / "expert_parallel.json").read_text())["results"]
    assert all(row["targets"]["losses_equal"]["met"] and row["targets"]["memory"]["met"] for row in ep)
    fsdp = json.loads((results / "fsdp.json").read_text())["results"]
    assert all(c["ran"] and all(t["met"] for k, t in c["targets"].items() if k.startswith("losses"))
               for row in fsdp for c in row["configs"].values())
    cp = json.loads((results / "context_parallel.json").read_text())
    assert all(row["max_abs_error_vs_full"] < 1e-4 for row in cp["results"] if row["impl"].startswith("dl"))
    assert cp["torch_context_parallel"]["runs"] or all(cp["torch_context_parallel"]["why_not"].values())
    off = json.loads((results / "offload.json").read_text())["results"]
    assert off and all(row["equal_to_no_offload"] for row in off)
    talk = json.loads((results / "talk_less.json").read_text())["results"][0]["impls"]
    assert talk["local-sgd H=4"]["bytes_over_ddp"] == pytest.approx(1 / 4, rel=1e-3)
    assert talk["diloco H=8"]["bytes_over_ddp"] == pytest.approx(1 / 8, rel=1e-3)
    assert 0.25 < talk["zero3 int8"]["sent_per_step"] / talk["zero3"]["sent_per_step"] < 0.27
    el = json.loads((results / "elastic.json").read_text())["results"]
    assert el["elastic"]["max_reference_rel_diff"] < 1e-5 and el["restart"]["losses_equal_to_no_fault"]
    stall = json.loads((results / "checkpoint.json").read_text())["stall"]    # sync and async runs agree
    assert stall["params_equal"] and len(stall["async_stall_s"]) == len(stall["sync_write_s"]) > 0


def test_summary_renders_a_table_for_every_result(results):
    text = _summary(results).tables()
    for title in ("Ring all-reduce", "Data parallelism", "Tensor parallelism", "Pipeline parallelism",
                  "Checkpoints", "Expert parallelism", "FSDP2", "All-to-all", "Context parallelism",
                  "Checkpoint stall", "Dry runs", "Offload", "Talking less", "Elastic recovery"):
        assert f"**{title}**" in text, title
    assert text.count("\n|---") >= 6
