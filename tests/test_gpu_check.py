"""benchmarks/gpu_check.py, proven on a CPU before any GPU is lent: ``--dry`` runs every stage end to end on
tiny sizes and writes its results and table to a folder of its own; a stage that fails or overruns is
reported and the next one still runs; README's GPU table holds only what benchmarks/results/gpu/ holds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import _gpu_facts  # noqa: E402
import gpu_check  # noqa: E402
import gpu_table  # noqa: E402


def test_dry_run_exercises_every_stage_on_the_cpu_and_leaves_readme_alone(tmp_path):
    readme = gpu_table.README.read_text()
    t0 = time.monotonic()
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--dry", "--out", str(tmp_path / "cpu"),
           "--copy-to", str(tmp_path / "back")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=BENCH.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "cpu" / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == list(gpu_check.STAGES)
    assert all(s["status"] == "ok" for s in summary["stages"]) and summary["dry"]
    step = json.loads((tmp_path / "cpu" / "step.json").read_text())
    assert [(r["model"], r["implementation"]) for r in step["rows"]] == [
        (m, side) for m in ("gpt-tiny", "gpt-big-dry") for side in ("dl.train single", "torch loop")]
    assert [r["batch"] for r in step["rows"]] == [8, 8, 2, 2]              # the bigger model: its own batch
    assert all(r["mfu"] is None and r["median_s"] > 0 for r in step["rows"])     # a CPU: no peak, no MFU
    assert step["measured_matmul_flops"] > 0 and all(0 < r["of_measured_matmul"] for r in step["rows"])
    assert "omitted" in step["labels"]["mfu"] and step["models"]["gpt-tiny"]["loss_max_relative_gap"] < 0.05
    memory = json.loads((tmp_path / "cpu" / "memory.json").read_text())
    assert [r["strategy"] for r in memory["rows"]] == ["ddp", "zero1", "zero2", "zero3", "fsdp"]
    assert all(r["ledger_peak_total"] > 0 and r["allocator_peak"] is None for r in memory["rows"])
    for name, impls in (("allreduce", {"torch", "ring", "textbook"}), ("all_to_all", {"torch", "dl", "p2p"})):
        doc = json.loads((tmp_path / "cpu" / f"{name}.json").read_text())
        assert {r["impl"] for r in doc["results"]} == impls and doc["meta"]["world_size"] == 2
    multirank = json.loads((tmp_path / "cpu" / "multirank.json").read_text())
    assert [(r["strategy"], r["status"]) for r in multirank["rows"]] == [("pp-1f1b", "equal")]
    tests = json.loads((tmp_path / "cpu" / "tests.json").read_text())
    assert tests["skipped"] == tests["tests"] > 0                   # no CUDA here: every gpu test skips
    table = (tmp_path / "cpu" / "table.md").read_text()
    assert "DRY RUN on a CPU" in table and "| dl.train single |" in table and "| zero3 |" in table
    assert "| pp-1f1b | equal |" in table
    assert all(line.startswith(("[", "copied")) for line in done.stdout.splitlines() if line.strip())
    assert gpu_table.README.read_text() == readme == (tmp_path / "back" / "README.md").read_text()
    assert (tmp_path / "back" / "results" / "cpu" / "summary.json").exists()
    assert "multirank: ok" in (tmp_path / "cpu" / "gpu_check.log").read_text()
    print(f"gpu_check --dry took {time.monotonic() - t0:.1f} s")


def _boom(cfg, out):
    raise RuntimeError("planted failure")


def _slow(cfg, out):
    time.sleep(30)


def test_a_failing_or_overrunning_stage_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.STAGES, "boom", (_boom, 5, 5))
    monkeypatch.setitem(gpu_check.STAGES, "slow", (_slow, 1, 1))
    monkeypatch.setitem(gpu_check.STAGES, "facts", (lambda cfg, out: {"meta": {"name": "cpu"}}, 5, 5))
    monkeypatch.setitem(gpu_check.STAGES, "fine", (lambda cfg, out: {"value": 1}, 5, 5))
    out, done = gpu_check.check(gpu_check.stages.DRY, ["facts", "boom", "slow", "fine"], tmp_path)
    by = {s["name"]: s for s in done}
    assert by["boom"]["status"] == "failed" and "planted failure" in by["boom"]["error"]
    assert by["slow"]["status"] == "timeout" and by["slow"]["seconds"] < 10
    assert by["fine"]["status"] == "ok" and json.loads((out / "fine.json").read_text())["value"] == 1


def test_readme_gpu_table_says_only_what_the_recorded_results_say():
    """Made from benchmarks/results/gpu/ (`gpu_table.table`); with nothing recorded, it says so."""
    readme = gpu_table.README.read_text()
    block = readme[readme.index(gpu_table.BEGIN) + len(gpu_table.BEGIN):readme.index(gpu_table.END)]
    assert block.strip() == gpu_table.table().strip()
    assert gpu_table.table(Path("/nonexistent")) == gpu_table.NO_RUN


def test_the_table_shows_only_the_stages_of_the_recorded_run(tmp_path):
    """A file an earlier run left (memory.json) is not shown under a later run's header and date."""
    folder = tmp_path / "nvidia-h100"
    folder.mkdir()
    facts = {"name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "cuda": "12.8", "date": "2026-01-01"}
    stages = [{"name": "facts", "status": "ok"}, {"name": "tests", "status": "ok"}]
    (folder / "summary.json").write_text(json.dumps({"facts": facts, "stages": stages}))
    (folder / "tests.json").write_text(json.dumps({"passed": 3, "failures": 0, "errors": 0, "skipped": 1,
                                                   "failed": []}))
    (folder / "memory.json").write_text(json.dumps({"model": "stale", "rows": []}))
    text = gpu_table.table(tmp_path)
    assert "NVIDIA H100 80GB HBM3" in text and "3 passed, 0 failed, 1 skipped" in text
    assert "stale" not in text
    with pytest.raises(ValueError, match="gpu-table"):
        gpu_table.replaced("no markers here", text)


PEAKS = [("NVIDIA H100 80GB HBM3", "H100 SXM5"), ("NVIDIA H100 PCIe", "H100 PCIe"),
         ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100"),
         ("Tesla T4", None)]


@pytest.mark.parametrize("name, variant", PEAKS)
def test_peak_table_knows_h100_h200_a100_and_nothing_else(name, variant):
    found = _gpu_facts.peak_flops(name)
    assert (found[1] if found else None) == variant
    peak = found[0] if found else None
    assert (_gpu_facts.mfu(10**6, 1000, 1.0, peak) is None) == (peak is None)


def test_budgets_fit_a_retry_in_a_fifteen_minute_loan():
    """Every stage's budget together at most 8 minutes on the GPU; pytest's own limit under its stage's."""
    assert sum(budget for _, budget, _ in gpu_check.STAGES.values()) <= 480
    assert gpu_check.stages.GPU.test_timeout < gpu_check.STAGES["tests"][1]
    assert gpu_check.stages.DRY.test_timeout < gpu_check.STAGES["tests"][2]
