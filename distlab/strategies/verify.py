"""A planned layout checked by a dry run of the code that would train it.

The advisor (`dl.theory.advise`) and the cluster planner (`dl.theory.layouts.rank_layouts`) choose a
layout from formulas (`dl.theory.memory`: the ZeRO paper's bytes per parameter, Korthikanti et al.'s
activations). ``verify_layout`` runs distlab's own strategy for that layout at full size on the fake
backend (`distlab.strategies.dry`), as the first and the last rank (with a pipeline: the first and the last
stage), and reports what the memory ledger measured beside what the formula predicted::

    planned  (dp, tp, pp, zero, recompute)  --dl.theory.memory-->  predicted bytes per GPU
        |                                                                 compare: fits?
        +--> "3d:dp=..,tp=..,pp=..,zero=..,sp=True" --dl.train(backend="fake")--> measured per rank

The layout maps onto distlab's strategies as closely as they allow, and says where it could not follow:
ZeRO-2/3 under tensor or pipeline parallelism runs as ZeRO-1 (distlab's 3D shards only the optimizer over
dp: the measurement is then an upper bound for the model states). Widgets: ``Advisor.verify()``,
``ClusterPlanner.verify()``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..theory import ModelPreset, memory
from ..theory.presets import gpu as gpu_preset
from ..theory.presets import model as model_preset

RECOMPUTE = {"none": False, "selective": "selective", "full": True}


@dataclass
class Verification:
    """A layout's dry run beside its prediction. ``measured``: one ``report.memory`` entry per rank of
    ``ranks``; ``limit``: the bytes a GPU may hold (its memory x headroom); ``notes``: where the dry run
    differs from the plan."""

    strategy: str
    ranks: list[int]
    predicted: object                       # dl.theory.memory's MemoryBreakdown for the first stage
    measured: list[dict]
    limit: float
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether every measured rank's peak stays within the limit."""
        return all(m["peak_total"] <= self.limit for m in self.measured)

    def __str__(self) -> str:
        lines = [f"dry run of {self.strategy} (ranks {self.ranks}): predicted "
                 f"{self.predicted.total / 2**30:.1f} "
                 f"GiB on the first stage; limit {self.limit / 2**30:.1f} GiB"]
        lines += [f"  rank {r}: measured {m['peak_total'] / 2**30:.1f} GiB "
                  f"({'fits' if m['peak_total'] <= self.limit else 'does not fit'})"
                  for r, m in zip(self.ranks, self.measured)]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def strategy_for(dp: int, tp: int, pp: int, zero: int, microbatches: int) -> tuple[str, list[str]]:
    """distlab's strategy string for a planned (dp, tp, pp, zero) and the notes where it differs."""
    if tp == pp == 1:
        return {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}[zero], []
    notes = []
    if zero > 1:
        notes.append(f"zero={zero} runs as zero=1 under tp/pp (distlab's 3D shards only the optimizer over "
                     "dp): "
                     "the measured model states are an upper bound")
    parts = [f"dp={dp}", f"tp={tp}", f"pp={pp}", f"zero={min(zero, 1)}"]
    if tp > 1:
        parts.append("sp=True")
    if pp > 1:
        parts.append(f"microbatches={microbatches}")
    return "3d:" + ",".join(parts), notes


def verify_layout(model: str | ModelPreset, gpu: str, *, dp: int, tp: int = 1, pp: int = 1, zero: int = 0,
                  recompute: str = "none", seq_len: int | None = None, microbatches: int | None = None,
                  headroom: float = 0.9, precision: str = "bf16-mixed") -> Verification:
    """Dry-run the layout (``dl.train(..., backend="fake")``, first and last rank, one step) and compare
    with `dl.theory.memory`. ``microbatches`` per pipeline (default 2 pp, as `dl.train`), micro-batch 1."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {sorted(RECOMPUTE)}, got {recompute!r}")
    import distlab as dl
    shape = model_preset(model) if isinstance(model, str) else model
    if seq_len is not None and seq_len != shape.seq_len:
        shape = dataclasses.replace(shape, seq_len=seq_len)
    m = microbatches or (2 * pp if pp > 1 else 1)
    strategy, notes = strategy_for(dp, tp, pp, zero, m)
    world = dp * tp * pp
    ranks = [0, world - 1] if world > 1 else [0]
    report = dl.train(strategy, model=shape, world_size=world, backend="fake", ranks=ranks,
                      precision=precision, global_batch=dp * m, recompute=RECOMPUTE[recompute])
    predicted = memory(shape, dp=dp, zero=zero, precision=precision, optimizer="adamw", tp=tp, pp=pp,
                       seq_len=shape.seq_len, sp=tp > 1, recompute=recompute, microbatches=m)
    return Verification(strategy, ranks, predicted, list(report.memory), headroom * gpu_preset(gpu).memory,
                        notes)
