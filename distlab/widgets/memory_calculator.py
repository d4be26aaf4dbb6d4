"""Memory calculator: bytes per GPU by category, which GPUs it fits on, the cheapest layout.

Formulas: :func:`distlab.theory.memory` (ZeRO paper model states, Korthikanti et al. 2022
activations); verdicts: :func:`distlab.theory.fits`; search: :func:`distlab.theory.cheapest_plan`.
"""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W

from distlab import theory
from distlab.theory import GB, GiB
from distlab.widgets.base import Explorer, dropdown, int_slider, new_figure

CATEGORIES = ("params", "grads", "optimizer", "activations")
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}


@dataclass(frozen=True)
class MemoryResult:
    """``memory`` of the fullest GPU, ``stages`` per pipeline rank, ``fits`` per GPU preset."""

    memory: theory.MemoryBreakdown
    stages: list[theory.MemoryBreakdown]
    fits: dict[str, bool]
    cheapest: theory.Plan | None

    @property
    def total_gb(self) -> float:
        return self.memory.total / GB


class MemoryCalculator(Explorer):
    title = "Memory per GPU"

    def __init__(self, model: str = "llama2-7b"):
        powers = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
        super().__init__({
            "model": dropdown("model", [*theory.MODELS, "custom"], model),
            "params_b": W.FloatText(value=7.0, description="custom params (B)",
                                     style={"description_width": "initial"}),
            "precision": dropdown("precision", ["bf16-mixed", "fp16-mixed", "fp32"], "bf16-mixed"),
            "master_weights": W.Checkbox(value=True, description="fp32 master weights"),
            "optimizer": dropdown("optimizer", ["adam", "adamw", "sgd-momentum", "sgd"], "adam"),
            "zero": int_slider("ZeRO stage", 0, 0, 3),
            "dp": dropdown("dp", powers, 8),
            "tp": dropdown("tp", [1, 2, 4, 8], 1),
            "pp": dropdown("pp", [1, 2, 4, 8, 16], 1),
            "sp": W.Checkbox(value=False, description="sequence parallel"),
            "recompute": dropdown("recompute", ["none", "selective", "full"], "none"),
            "micro_batch": int_slider("micro-batch", 1, 1, 32),
            "seq_len": dropdown("sequence length", [0, 512, 1024, 2048, 4096, 8192, 16384], 2048),
            "schedule": dropdown("pipeline schedule", ["1f1b", "gpipe", "zb-h1"], "1f1b"),
        })

    def _model(self):
        if self.value("model") == "custom":
            return self.value("params_b") * 1e9
        return self.value("model")

    def compute(self) -> MemoryResult:
        model = self._model()
        common = dict(precision=self.value("precision"), optimizer=self.value("optimizer"),
                      master_weights=self.value("master_weights"))
        seq_len = self.value("seq_len") if self.value("model") != "custom" else 0
        layout = dict(dp=self.value("dp"), zero=self.value("zero"), tp=self.value("tp"), pp=self.value("pp"),
                      seq_len=seq_len, micro_batch=self.value("micro_batch"), sp=self.value("sp"),
                      recompute=self.value("recompute"), schedule=self.value("schedule"))
        stages = [theory.memory(model, **common, **layout, stage=s) for s in range(layout["pp"])]
        fullest = max(stages, key=lambda b: b.total)
        shape = theory.model(model) if isinstance(model, str) else None
        cheapest = (theory.cheapest_plan(shape, seq_len, self.value("micro_batch"), **common)
                    if shape else None)
        return MemoryResult(fullest, stages, {g: theory.fits(fullest, g) for g in theory.GPUS}, cheapest)

    def render(self, result: MemoryResult):
        """The bars, the title and the text in one unit, GB (1e9 bytes, as the papers' figures and the
        planner's); a card's line sits at its capacity in GB and its label names it in GiB, as sold."""
        fig = new_figure(7, 3.2)
        ax = fig.add_subplot()
        labels = [f"stage {i}" for i in range(len(result.stages))]
        bottom = [0.0] * len(labels)
        for category in CATEGORIES:
            heights = [getattr(b, category) / GB for b in result.stages]
            ax.bar(labels, heights, bottom=bottom, color=COLORS[category], label=category)
            bottom = [b + h for b, h in zip(bottom, heights)]
        cards_by_size: dict[int, list[str]] = {}            # one line and one label per memory size
        for name, card in theory.GPUS.items():
            cards_by_size.setdefault(card.memory, []).append(name)
        for size, names in cards_by_size.items():
            ax.axhline(size / GB, ls="--", lw=0.8, color="grey")
            ax.annotate(f"{', '.join(names)} ({size / GiB:g} GiB)", (1.0, size / GB),
                        xycoords=("axes fraction", "data"), fontsize=7, ha="right", va="bottom")
        ax.set_ylabel("GB per GPU")
        ax.set_title(f"{self.value('model')}: {result.total_gb:.1f} GB on the fullest GPU")
        fig.legend(fontsize=7, loc="outside right upper")                # beside the bars, never on one
        verdicts = ", ".join(f"{g} {'fits' if ok else 'no'}" for g, ok in result.fits.items())
        cheapest = f"<br>cheapest that fits: {result.cheapest}" if result.cheapest else ""
        return fig, (f"<p><b>{result.total_gb:.1f} GB</b> per GPU on the fullest stage<br>"
                     f"{verdicts}{cheapest}</p>")


def memory_calculator(model: str = "llama2-7b") -> MemoryCalculator:
    """Interactive memory calculator; see :class:`MemoryCalculator`."""
    return MemoryCalculator(model)
