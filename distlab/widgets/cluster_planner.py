"""Cluster planner: a model, a GPU, a cluster size and a token budget; every layout that fits in memory,
ranked by the step time `dl.theory.sim` predicts, with where each step's time goes.

Search: :func:`distlab.theory.layouts.rank_layouts` (the (dp, tp, pp) of `theory.planner`, ZeRO and
recomputation tried cheapest first); efficiency constants: the ones the published tables were
reproduced with (:func:`distlab.theory.published.calibrated`). A model's figure, not a measurement.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

from distlab import theory
from distlab.theory.layouts import describe, rank_layouts
from distlab.theory.published import calibrated
from distlab.theory.sim import StepResult
from distlab.widgets.base import Explorer, dropdown, new_figure

KINDS = ("compute", "recompute", "tp", "cp", "bubble", "dp", "overhead")
COLORS = dict(zip(KINDS, ("#4C72B0", "#8172B3", "#DD8452", "#937860", "#C44E52", "#55A868", "#8C8C8C")))
SHOWN = 8


@dataclass(frozen=True)
class PlannerResult:
    """``ranked``: fitting layouts, fastest first; ``days``: the token budget at each one's speed."""

    ranked: list[StepResult]
    tokens: float

    @property
    def best(self) -> StepResult | None:
        return self.ranked[0] if self.ranked else None

    @property
    def days(self) -> list[float]:
        return [r.days(self.tokens) for r in self.ranked]


class ClusterPlanner(Explorer):
    title = "Cluster planner: layouts that fit, ranked by predicted step time"

    def __init__(self, model: str = "llama3-70b", gpu: str = "h100-80gb", gpus: int = 2048,
                 tokens: float = 15e12):
        super().__init__({
            "model": dropdown("model", list(theory.MODELS), model),
            "gpu": dropdown("GPU", list(theory.GPUS), gpu),
            "gpus": dropdown("GPUs", [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384], gpus),
            "tokens": dropdown("token budget", [("1T", 1e12), ("2T", 2e12), ("5T", 5e12), ("15T", 15e12)],
                               tokens),
            "global_batch": dropdown("global batch (sequences)", [128, 256, 512, 1024, 2048], 512),
            "seq_len": dropdown("sequence length", [2048, 4096, 8192], 8192),
            "inter": dropdown("network per GPU", ["ib-hdr", "ib-ndr", "ethernet-100g"], "ib-ndr"),
        })

    def compute(self) -> PlannerResult:
        gpu = self.value("gpu")
        ranked = rank_layouts(self.value("model"), gpu, self.value("gpus"),
                              global_batch=self.value("global_batch"), seq_len=self.value("seq_len"),
                              inter=self.value("inter"), efficiency=calibrated(gpu))
        return PlannerResult(ranked, self.value("tokens"))

    def verify(self, index: int = 0):
        """Layout ``index`` of the ranking (0: the fastest) checked by a dry run of distlab's code at full
        size (first and last rank, 1F1B and written-out attention where the simulation assumed
        interleaving and flash attention): a `distlab.strategies.verify.Verification`."""
        from distlab.strategies.verify import verify_layout
        lay = self.result.ranked[index].layout
        found = verify_layout(self.value("model"), self.value("gpu"), dp=lay["dp"], tp=lay["tp"],
                              pp=lay["pp"],
                              zero=lay["zero"], recompute=lay["recompute"], seq_len=lay["seq_len"],
                              microbatches=lay["microbatches"] if lay["pp"] > 1 else None)
        if lay["virtual"] > 1 or lay["flash"]:
            found.notes.append("the simulation assumed flash attention and interleaved stages; the dry run "
                               "runs "
                               "distlab's 1F1B and written-out attention")
        return found

    def render(self, result: PlannerResult):
        if not result.ranked:
            return None, "<p><b>no layout fits</b>: add GPUs, shorten the sequence or the batch</p>"
        shown = result.ranked[:SHOWN]
        fig = new_figure(7.5, 0.45 * len(shown) + 1.2)
        ax = fig.add_subplot()
        labels = [describe(r).split(":")[0] for r in shown]
        left = [0.0] * len(shown)
        for kind in KINDS:
            widths = [r.breakdown[kind] for r in shown]
            ax.barh(labels, widths, left=left, color=COLORS[kind], label=kind)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("predicted seconds per step")
        fig.legend(fontsize=7, ncol=len(KINDS), loc="outside upper center", frameon=False)   # off the bars
        best = result.best
        text = (f"<p><b>{html.escape(describe(best))}</b><br>{best.tokens_per_s:,.0f} tokens/s: "
                f"{result.days[0]:.0f} days for {result.tokens / 1e12:g}T tokens (a model's figure; "
                f"{len(result.ranked)} layouts fit)</p>")
        return fig, text


def cluster_planner(model: str = "llama3-70b", gpu: str = "h100-80gb", gpus: int = 2048,
                    tokens: float = 15e12) -> ClusterPlanner:
    """Interactive cluster planner; see :class:`ClusterPlanner`."""
    return ClusterPlanner(model, gpu, gpus, tokens)
