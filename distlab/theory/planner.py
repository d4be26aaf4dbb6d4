"""Which parallel layout fits: the decision guide of the Ultra-Scale Playbook (Tazi et al. 2025,
"Finding the best training configuration") and a search for the cheapest configuration.

Guide, in order: fits on one GPU -> plain DDP; else recompute activations; else shard the
optimizer and gradients (ZeRO-1/2, same traffic as DDP); else shard parameters too (ZeRO-3 /
FSDP, 1.5x traffic), with full recomputation if need be; else tensor parallelism inside a node
(fast NVLink, per-layer all-reduces); else pipeline parallelism across nodes (only point-to-point
activations cross the slow links).
A GPU "fits" when the estimate stays under ``headroom`` (default 90%) of its memory: the rest
goes to the CUDA context, communication buffers and fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from distlab.theory.memory import MemoryBreakdown, memory
from distlab.theory.presets import GPUS, GPUPreset, ModelPreset, gpu as gpu_preset, model as model_preset
from distlab.theory.units import GB

HEADROOM = 0.9


@dataclass(frozen=True)
class Plan:
    """A layout: GPU type and count, parallel degrees, ZeRO stage, recomputation, its memory."""

    gpu: str
    dp: int
    tp: int
    pp: int
    zero: int
    recompute: str
    memory: MemoryBreakdown

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return (f"{self.gpus} x {self.gpu}: dp={self.dp} tp={self.tp} pp={self.pp} zero={self.zero} "
                f"recompute={self.recompute} ({self.memory.total / GB:.1f} GB per GPU)")


@dataclass(frozen=True)
class Advice:
    """The guide's answer: ``steps`` as (question, answer) lines and the ``plan`` chosen (or None)."""

    steps: list[tuple[str, str]] = field(default_factory=list)
    plan: Plan | None = None


def fits(breakdown: MemoryBreakdown, gpu: str | GPUPreset, headroom: float = HEADROOM) -> bool:
    """Whether ``breakdown.total`` stays within ``headroom`` of the GPU's memory."""
    card = gpu_preset(gpu) if isinstance(gpu, str) else gpu
    return breakdown.total <= headroom * card.memory


def _plan(model: ModelPreset, card: GPUPreset, dp: int, tp: int, pp: int, zero: int, recompute: str,
          seq_len: int, micro_batch: int, **kw) -> Plan:
    mem = memory(model, dp=dp, zero=zero, tp=tp, pp=pp, seq_len=seq_len, micro_batch=micro_batch,
                 sp=tp > 1, recompute=recompute, **kw)
    return Plan(card.name, dp, tp, pp, zero, recompute, mem)


def layouts(gpus: int, gpus_per_node: int):
    """(dp, tp, pp) from the simplest up: DP only, then TP inside a node, then PP."""
    for pp in (1, 2, 4, 8, 16, 32):
        for tp in (1, 2, 4, 8):
            if tp <= gpus_per_node and gpus % (tp * pp) == 0:
                yield gpus // (tp * pp), tp, pp


def cheapest_plan(model: str | ModelPreset, seq_len: int = 0, micro_batch: int = 1,
                  gpus: tuple[str, ...] | None = None, max_gpus: int = 1024, gpus_per_node: int = 8,
                  headroom: float = HEADROOM, **kw) -> Plan | None:
    """Fewest GPUs (then the smallest card) whose simplest fitting layout holds ``model``.

    ``kw`` passes precision/optimizer/master_weights to :func:`memory`.
    """
    shape = model_preset(model) if isinstance(model, str) else model
    cards = sorted((gpu_preset(g) for g in (gpus or GPUS)), key=lambda c: c.memory)
    count = 1
    while count <= max_gpus:
        for card in cards:
            for dp, tp, pp in layouts(count, gpus_per_node):
                for recompute in ("none", "selective", "full"):
                    for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                        plan = _plan(shape, card, dp, tp, pp, zero, recompute, seq_len, micro_batch, **kw)
                        if pp <= shape.layers and fits(plan.memory, card, headroom):
                            return plan
        count *= 2
    return None


def advise(model: str | ModelPreset, gpu: str = "h100-80gb", gpus: int = 8, seq_len: int = 4096,
           micro_batch: int = 1, gpus_per_node: int = 8, headroom: float = HEADROOM,
           full_recompute: bool = True, **kw) -> Advice:
    """Walk the decision guide for ``gpus`` cards of type ``gpu``; every step says why.

    The guide is about memory. By memory alone ZeRO-3 with full recomputation beats tensor
    parallelism (states 16 Psi / N against TP's 4 Psi / t + 12 Psi / N, activations of two bytes
    per element of each layer's input against TP+SP's 34 / t), at the price of ~33% more compute
    and all-gathers across every node. ``full_recompute=False`` refuses that price and moves on
    to TP and PP, as large runs do for throughput.
    """
    shape = model_preset(model) if isinstance(model, str) else model
    card = gpu_preset(gpu)
    steps: list[tuple[str, str]] = []

    def attempt(question: str, dp: int, tp: int, pp: int, zero: int, recompute: str, why: str) -> Plan | None:
        plan = _plan(shape, card, dp, tp, pp, zero, recompute, seq_len, micro_batch, **kw)
        ok = fits(plan.memory, card, headroom)
        verdict = f"yes, {plan.memory.total / GB:.1f} GB per GPU: {why}" if ok else \
            f"no, needs {plan.memory.total / GB:.1f} GB of {headroom * card.memory / GB:.1f} GB usable"
        steps.append((question, verdict))
        return plan if ok else None

    plan = (attempt("Fits on one GPU? (DDP replicates everything)", gpus, 1, 1, 0, "none",
                    "use DDP; one all-reduce of the gradients per step, 2(N-1)/N x Psi")
            or attempt("Fits with selective recomputation?", gpus, 1, 1, 0, "selective",
                       "recompute the attention scores, ~3% more compute, then DDP")
            or attempt("Fits with full recomputation?", gpus, 1, 1, 0, "full",
                       "store only layer inputs, ~33% more compute, then DDP"))
    for zero, why in ((1, "ZeRO-1 shards the optimizer state, same traffic as DDP"),
                      (2, "ZeRO-2 also shards gradients, same traffic as DDP"),
                      (3, "ZeRO-3/FSDP also shards parameters, 1.5x DDP's traffic")):
        if plan is None and gpus > 1:
            plan = attempt(f"Fits with ZeRO-{zero} over dp={gpus} (+ selective recompute)?", gpus, 1, 1,
                           zero, "selective", why)
    if plan is None and gpus > 1 and full_recompute:
        plan = attempt(f"Fits with ZeRO-3 over dp={gpus} and full recomputation?", gpus, 1, 1, 3, "full",
                       "store only each layer's input, ~33% more compute, still no per-layer all-reduces")
    tp = 2
    while plan is None and tp <= min(gpus_per_node, gpus) and gpus % tp == 0:
        plan = attempt(f"Fits with tensor parallel tp={tp} inside a node (+SP, ZeRO-1)?", gpus // tp, tp, 1,
                       1, "selective", "TP's per-layer all-reduces stay on NVLink")
        tp *= 2
    tp //= 2
    pp = 2
    while plan is None and tp > 1 and pp * tp <= gpus and gpus % (pp * tp) == 0 and pp <= shape.layers:
        plan = attempt(f"Fits with pipeline pp={pp} across nodes (tp={tp})?", gpus // (tp * pp), tp, pp, 1,
                       "selective", "only activations cross the slower inter-node links")
        pp *= 2
    if plan is None:
        steps.append(("Anything else?", "no layout of these GPUs fits: add GPUs, shorten the sequence, "
                                        "or offload to CPU (see theory.zero3_offload)"))
    return Advice(steps, plan)
