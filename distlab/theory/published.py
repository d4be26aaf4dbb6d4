"""Published training runs, and the simulator's prediction of each: how `theory.sim` is checked.

The rows live in ``data/published_runs.json`` with their source (paper, table, columns), where each
number was read, and the assumptions every row of a table shares. Each table carries ONE set of
efficiency constants (`sim.Efficiency`) used for all its rows: a table is reproduced when every
row's metric (achieved teraFLOP/s per GPU, or MFU) lies within ``TOLERANCE`` of the paper's.

    Narayanan et al. 2021, Table 1     1.7B .. 1T on 32 .. 3,072 A100s   achieved TFLOP/s per GPU
    Korthikanti et al. 2022, Table 5   22B .. 1T, full vs selective      MFU
    Llama 3 (2024), Table 4            405B on 8,192 and 16,384 H100s    MFU
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from distlab.theory.presets import ModelPreset, model as model_preset
from distlab.theory.sim import Efficiency, StepResult, step

DATA = Path(__file__).resolve().parent / "data" / "published_runs.json"
TOLERANCE = 0.15
TABLES = ("narayanan2021_table1", "korthikanti2022_table5", "llama3_2024_table4")


@dataclass(frozen=True)
class Comparison:
    """One published row beside its prediction."""

    table: str
    name: str
    metric: str
    published: float
    predicted: float
    result: StepResult

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return self.predicted / self.published - 1.0


def tables() -> dict:
    """Every table of the fixture, as read from ``data/published_runs.json``."""
    return json.loads(DATA.read_text())


def _shape(table: dict, row: dict) -> ModelPreset:
    common = table["common"]
    if "model" in common:
        return model_preset(common["model"])
    return ModelPreset(row["name"], row["hidden"], row["layers"], row["heads"], common["vocab"],
                       common["seq_len"])       # GPT: 4h MLP, biases, LayerNorm, tied embeddings


def predict(name: str, row: dict, efficiency: Efficiency | None = None) -> StepResult:
    """The simulator's step for one row of table ``name`` (the table's own constants by default)."""
    table = tables()[name]
    spec = {**table["common"], **row}
    eff = efficiency or Efficiency(**table["efficiency"])
    return step(_shape(table, row), spec["gpu"], spec["gpus"], tp=spec["tp"], pp=spec["pp"],
                cp=spec.get("cp", 1), virtual=spec.get("virtual", 1), zero=spec["zero"],
                global_batch=spec["global_batch"], micro_batch=spec["micro_batch"],
                seq_len=spec["seq_len"], recompute=spec["recompute"], sp=spec.get("sp"),
                flash_attention=spec.get("flash_attention", False), overlap_dp=spec["overlap_dp"],
                efficiency=eff, inter=spec["inter"])


def compare(name: str, efficiency: Efficiency | None = None) -> list[Comparison]:
    """Every row of table ``name`` beside its prediction, on the table's metric."""
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}: choose one of {', '.join(TABLES)}")
    table = tables()[name]
    out = []
    for row in table["rows"]:
        result = predict(name, row, efficiency)
        predicted = getattr(result, table["metric"])
        out.append(Comparison(name, row["name"], table["metric"], row["published"], predicted, result))
    return out


def calibrated(gpu: str) -> Efficiency:
    """The efficiency constants the published tables were reproduced with, for ``gpu``'s generation:
    the A100 tables' set (Narayanan 2021 = Korthikanti 2022) or the H100 set (Llama 3)."""
    table = "llama3_2024_table4" if gpu.lower().startswith(("h100", "h200")) else "narayanan2021_table1"
    return Efficiency(**tables()[table]["efficiency"])
