"""Expert parallelism (`dl.ep`): the model's mixture-of-experts layer with its experts split over ranks.

Read the layer itself first, every expert in one process: `distlab/models/moe.py` (the top-k router,
capacity and which tokens are dropped, the load-balancing loss, the experts). Then, here:

    dispatch.py  the drop rule over a group (one all-gather of counts); tokens to their experts' ranks
                 by all-to-all, and back (combine)
    moe.py       `MoE`: that layer with this rank's block of experts (or all of them, ``replicate=True``)
                 and the two all-to-alls; `parallelize` a model's MoE layers

    layer = dl.ep.MoE(hidden=64, ffn=128, experts=8, top_k=2, capacity_factor=1.25, group=None)
    y = layer(x)                      # x (..., hidden): this rank's tokens; layer.balance_loss after it

``group=dl.ep.LOCAL`` keeps every expert in this process (the single-process reference).
"""
from ...models.moe import Experts, Router, capacity, load_balancing_loss
from .dispatch import LOCAL, Dispatch, RowExchange
from .moe import ExpertShard, MoE, expert_params, full_state_dict, parallelize, split

__all__ = ["LOCAL", "RowExchange", "Dispatch", "MoE", "Experts", "ExpertShard", "expert_params",
           "full_state_dict", "parallelize", "split", "Router", "capacity", "load_balancing_loss"]
