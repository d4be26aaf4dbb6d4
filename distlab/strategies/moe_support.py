"""Which strategies may train a mixture-of-experts model, checked before any rank starts.

Apart from `expert.py` (the ``ep`` strategy itself), which the mesh imports for its ep= axis.
"""
from __future__ import annotations

from .. import models
from .base import TrainSpec


#: Strategies that train a mixture-of-experts model, and how. The data-parallel ones replicate the experts
#: and each replica routes its own rows (capacity and balance loss per replica, as DeepSpeed with ep=1);
#: ``ep`` splits them and routes over the whole batch, so it equals ``single`` on the same global batch.
MOE_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "ep")
#: and the pipelines (pp-*), which route per microbatch: as single with grad_accum x microbatches.


def refuse_moe(spec: TrainSpec) -> None:
    """Refuse a mixture-of-experts model under a strategy that would silently train it wrong (called
    before any rank starts): tensor parallelism does not split experts, context parallelism routes a
    part of each sequence and its loss carries no load-balancing term, and the 3d mesh (whose pipeline
    criterion has none either) runs it only on an ep= axis."""
    cfg = models.config(spec.model)
    if cfg is None or not cfg.experts:
        return
    s, why = spec.strategy, None
    if s.startswith("3d:"):
        d = spec.layout
        if d.ep == 1 or any(getattr(d, k) != 1 for k in ("tp", "pp", "cp")):
            why = ("tensor parallelism does not split experts and the mesh's pipeline loss has no "
                   "load-balancing term (a mesh runs it only on an ep= axis with dp, where it has one)")
    elif s not in MOE_STRATEGIES and not s.startswith("pp-"):
        why = {"tp": "tensor parallelism does not split experts",
               "cp": "context parallelism routes each rank's part of a sequence on its own and its loss "
                     "has no load-balancing term"}.get(s[:2], "it has no mixture-of-experts support")
    if why:
        raise ValueError(f"strategy {s!r} cannot train the mixture-of-experts model {spec.model!r}: {why}. "
                         f"Use strategy='ep' (experts split over the ranks, equal to single) or one of "
                         f"{MOE_STRATEGIES[:-1]} (experts replicated, each replica routing its own rows), "
                         f"a pp-* pipeline (routing per microbatch), or a dense model (model='gpt-tiny')")
