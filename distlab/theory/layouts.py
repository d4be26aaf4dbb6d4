"""Which layout trains fastest: every (dp, tp, pp) of `theory.planner` that fits in memory, ranked by the
step time `theory.sim` predicts.

    ranked = rank_layouts("llama3-70b", "h100-80gb", gpus=2048, global_batch=512, seq_len=8192)
    ranked[0].layout, ranked[0].step_time, ranked[0].breakdown, ranked[0].days(15e12)

For each (dp, tp, pp) (TP inside a node, as `planner.layouts` enumerates them) it tries ZeRO-1
(same traffic as DDP, the optimizer state sharded), interleaving when the stage count allows it, and
selective recomputation, falling back to full recomputation and then ZeRO-3 only when memory
demands it: the cheaper option first, as the playbook's decision guide orders them.
"""
from __future__ import annotations

from distlab.theory.planner import layouts
from distlab.theory.presets import ModelPreset, model as model_preset
from distlab.theory.sim import Efficiency, StepResult, step


def _virtual(layers: int, pp: int, microbatches: int) -> int:
    """Model chunks per pipeline rank: the most of (4, 2) that the layers and microbatches allow."""
    if pp <= 2:
        return 1
    for v in (4, 2):
        if layers % (pp * v) == 0 and microbatches % pp == 0:
            return v
    return 1


def _options(dp: int):
    """(zero, recompute) in the order the decision guide tries them."""
    yield 1 if dp > 1 else 0, "selective"
    yield 1 if dp > 1 else 0, "full"
    if dp > 1:
        yield 3, "selective"
        yield 3, "full"


def rank_layouts(model: str | ModelPreset, gpu: str = "h100-80gb", gpus: int = 64, *, global_batch: int = 512,
                 seq_len: int | None = None, micro_batch: int = 1, gpus_per_node: int = 8,
                 inter: str = "ib-ndr", efficiency: Efficiency | None = None,
                 max_pp: int = 32) -> list[StepResult]:
    """Every layout of ``gpus`` GPUs that fits, fastest first (the first fitting option per (dp, tp, pp))."""
    shape = model_preset(model) if isinstance(model, str) else model
    found = []
    for dp, tp, pp in layouts(gpus, gpus_per_node):
        if pp > max_pp or pp > shape.layers or global_batch % (dp * micro_batch):
            continue
        m = global_batch // (dp * micro_batch)
        for zero, recompute in _options(dp):
            r = step(shape, gpu, gpus, tp=tp, pp=pp, virtual=_virtual(shape.layers, pp, m), zero=zero,
                     global_batch=global_batch, micro_batch=micro_batch, seq_len=seq_len,
                     recompute=recompute, flash_attention=True, efficiency=efficiency,
                     gpus_per_node=gpus_per_node, inter=inter)
            if r.fits:
                found.append(r)
                break
    return sorted(found, key=lambda r: r.step_time)


def describe(r: StepResult) -> str:
    """One line: the layout and its step time."""
    lay = r.layout
    chunks = f" v={lay['virtual']}" if lay["virtual"] > 1 else ""
    return (f"dp={lay['dp']} tp={lay['tp']} pp={lay['pp']}{chunks} zero={lay['zero']} "
            f"recompute={lay['recompute']}: {r.step_time:.2f} s/step, MFU {r.mfu:.0%}, "
            f"{r.memory.total / 2**30:.0f} GiB/GPU")
