"""Expert parallelism (`dl.ep`): a mixture-of-experts layer whose experts are split over ranks.

Reading order:

    router.py    top-k softmax gating, capacity and which tokens are dropped, the load-balancing loss
    dispatch.py  tokens to their experts' ranks by all-to-all, and back (combine)
    moe.py       `MoE`: router + dispatch + this rank's experts (or all of them, ``replicate=True``);
                 `parallelize` a model's MoE layers; `ride_balance_losses` for a pipeline stage

    layer = dl.ep.MoE(hidden=64, ffn=128, experts=8, top_k=2, capacity_factor=1.25, group=None)
    y = layer(x)                      # x (..., hidden): this rank's tokens; layer.balance_loss after it

``group=dl.ep.LOCAL`` keeps every expert in this process (the single-process reference).
"""
from .dispatch import LOCAL, AllToAll, Dispatch
from .moe import AuxLoss, MoE, Experts, expert_params, full_state_dict, parallelize, ride_balance_losses
from .router import Router, capacity, load_balancing_loss

__all__ = ["LOCAL", "AllToAll", "Dispatch", "MoE", "Experts", "expert_params", "full_state_dict",
           "parallelize", "Router", "capacity", "load_balancing_loss", "AuxLoss", "ride_balance_losses"]
