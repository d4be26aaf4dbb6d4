"""Advisor: walk the parallelism decision guide (:func:`distlab.theory.advise`) for a model on a
cluster, with the reason for every step."""
from __future__ import annotations

import html

import ipywidgets as W

from distlab import theory
from distlab.widgets.base import Explorer, dropdown, int_slider


class Advisor(Explorer):
    title = "Which parallelism? (DDP -> recompute -> ZeRO -> TP in a node -> PP across nodes)"

    def __init__(self, model: str = "llama2-7b", gpu: str = "h100-80gb", gpus: int = 8):
        super().__init__({
            "model": dropdown("model", list(theory.MODELS), model),
            "gpu": dropdown("GPU", list(theory.GPUS), gpu),
            "gpus": dropdown("GPUs", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], gpus),
            "gpus_per_node": dropdown("GPUs per node", [1, 2, 4, 8], 8),
            "seq_len": dropdown("sequence length", [512, 1024, 2048, 4096, 8192], 4096),
            "micro_batch": int_slider("micro-batch", 1, 1, 16),
            "full_recompute": W.Checkbox(value=True, description="accept full recomputation (+33% compute)"),
        })

    def compute(self) -> theory.Advice:
        return theory.advise(self.value("model"), gpu=self.value("gpu"), gpus=self.value("gpus"),
                             seq_len=self.value("seq_len"), micro_batch=self.value("micro_batch"),
                             gpus_per_node=self.value("gpus_per_node"),
                             full_recompute=self.value("full_recompute"))

    def verify(self):
        """The advised plan checked by a dry run of distlab's code at full size (first and last rank):
        a `distlab.strategies.verify.Verification` (``.fits``, ``.measured``, ``.predicted``); None when
        nothing fits. Seconds to a minute for a real-size model."""
        from distlab.strategies.verify import verify_layout
        plan = self.result.plan
        if plan is None:
            return None
        return verify_layout(self.value("model"), plan.gpu, dp=plan.dp, tp=plan.tp, pp=plan.pp,
                             zero=plan.zero,
                             recompute=plan.recompute, seq_len=self.value("seq_len"))

    def render(self, result: theory.Advice):
        items = "".join(f"<li>{html.escape(q)} <i>{html.escape(a)}</i></li>" for q, a in result.steps)
        verdict = f"<b>use {html.escape(str(result.plan))}</b>" if result.plan else "<b>does not fit</b>"
        return None, f"<ol>{items}</ol>{verdict}"


def advisor(model: str = "llama2-7b", gpu: str = "h100-80gb", gpus: int = 8) -> Advisor:
    """Interactive decision guide; see :class:`Advisor`."""
    return Advisor(model, gpu, gpus)
