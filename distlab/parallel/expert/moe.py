"""`MoE`: the model's mixture-of-experts layer (`distlab.models.moe.MoE`) with its experts split over a
group of ranks: the same router, drop rule, experts and balance loss, and two all-to-alls.

    x (T, h) -> router -> expert (T, k), weight (T, k)          models/moe.py (as in one process)
             -> plan over the group: one all-gather of counts    dispatch.py
             -> dispatch: all-to-all to the experts' ranks       dispatch.py
             -> rank r runs its experts E*r/n .. E*(r+1)/n - 1   this file (`ExpertShard`)
             -> combine: all-to-all back, y = sum_c weight_c * expert_c(x)

Expert parallelism (GShard, Lepikhin et al. 2020; DeepSpeed-MoE, Rajbhandari et al. 2022) keeps E/n
experts per rank: the expert parameters are split n ways, each rank computing only the tokens routed
to its experts, while everything else in the model is data parallel. The layer equals the one-process
`models.moe.MoE` (same outputs, same dropped tokens, same gradients) when each rank holds a contiguous
part of the batch. ``group=dispatch.LOCAL`` keeps every expert in this process.

Parameters, named as in the model: ``router.gate.weight`` (E, h), replicated; the experts' ``w1``
(E/n, h, f), ``b1`` (E/n, f), ``w2`` (E/n, f, h), ``b2`` (E/n, h), this rank's block of the (E, ...)
stacks (``shard_dims`` says the cut, as in tensor parallelism, so the checkpoint layer and the clipper
read it the same way). Initialisation draws the whole (E, ...) stack and keeps this rank's block, so an
expert has the same weights on any world size.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...models import moe
from ...runtime import group_members
from .. import collectives as C
from ..cuts import mark_cut
from ..mesh import as_group
from . import dispatch as D


class ExpertShard(moe.Experts):
    """Experts ``first .. first + count - 1`` of a whole `models.moe.Experts`: this rank's block, copied.
    ``shard_dims``: the cut (dim 0 of every stack), read by the checkpoint layer and the clipper;
    ``group``: the ranks the stacks are split over."""

    def __init__(self, whole: moe.Experts, first: int, count: int, group):
        nn.Module.__init__(self)                 # not Experts.__init__: nothing is drawn, the block is copied
        for name, p in whole.named_parameters():
            self.register_parameter(name, nn.Parameter(p.detach()[first:first + count].clone()))
        self.shard_dims = dict.fromkeys(("w1", "b1", "w2", "b2"), 0)
        self.group = group
        mark_cut(self, group)                             # for dl.clip_grad_norm_ on bare parameters


class MoE(moe.MoE):
    """Mixture of ``experts`` MLPs (hidden -> ffn -> hidden), ``top_k`` per token, capacity factor
    ``capacity_factor``, experts split over ``group`` (None: the world; `dispatch.LOCAL`: all here).

    ``forward(x)``: x (..., hidden) -> (..., hidden). After it, ``balance_loss`` holds this rank's share
    of the Switch load-balancing loss of the whole group's batch (`models.moe.load_balancing_loss`;
    summed over the group it is the loss of all tokens).

    ``replicate=True``: every expert on every rank (the data-parallel alternative to expert parallelism,
    drawn beside it in lesson 11), routed as above over the group's whole batch, no all-to-all.
    ``batch_group``: the ranks the batch is split over, when larger than ``group`` (`dispatch.plan`).
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int = 2, capacity_factor: float = 1.25,
                 group=None, replicate: bool = False, batch_group=None):
        group, batch_group = as_group(group), as_group(batch_group)   # a 1-D mesh (mesh["ep"]): its group
        n = 1 if replicate else D.group_size(group)
        if experts % n:
            raise ValueError(f"experts={experts} cannot be split over {n} ranks: choose a number of experts "
                             f"divisible by the expert-parallel group size {n} (or a group of a divisor)")
        super().__init__(hidden, ffn, experts, top_k, capacity_factor)   # the router, every expert drawn
        if batch_group is not None and group is not D.LOCAL:
            _check_run(group, batch_group)
        self.group, self.replicate = group, replicate
        self.batch_group = batch_group           # the ranks the batch is split over (None: ``group``)
        if not replicate and group is not D.LOCAL:                     # keep this rank's block
            self.local = ExpertShard(self.local, D.group_rank(group) * (experts // n), experts // n, group)

    def route(self, x: torch.Tensor):
        """x (T, h) -> (probs (T, E), weight (T, k), `dispatch.Dispatch`): who goes where, who is dropped."""
        probs, expert, weight = self.router(x)
        return probs, weight, D.plan(expert, self.experts, self.capacity_factor, self.group, self.replicate,
                                     self.batch_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # (T, h): every token of this rank
        probs, weight, d = self.route(x)
        received = D.dispatch(x, d, self.group)                        # (R_recv, h) for our experts
        y = self.local(received, d.local_expert)                       # (R_recv, h)
        out = D.combine(y, d, weight, self.group)                      # (T, h)
        self.balance_loss = moe.load_balancing_loss(probs, d.first_counts, d.tokens)
        return out.view(shape)

    def shard(self, group=None, replicate: bool = False, batch_group=None) -> "MoE":
        """`split` this layer (built with every expert here) over ``group``."""
        return split(self, group, replicate, batch_group)


def split(layer: moe.MoE, group=None, replicate: bool = False, batch_group=None) -> MoE:
    """A new `MoE` with ``layer``'s weights (``layer``: every expert here, as a model builds it), its
    experts split over ``group`` (this rank's block copied), or, ``replicate``, all of them here and
    routed over ``group``; ``batch_group``: the ranks the batch is split over, when larger
    (`dispatch.plan`)."""
    with torch.device(layer.router.gate.weight.device):         # meta in a dry run: nothing drawn
        new = MoE(layer.router.gate.in_features, layer.local.w1.shape[2], layer.experts, layer.top_k,
                  layer.capacity_factor, group, replicate, batch_group)
    count = new.local.w1.shape[0]
    first = 0 if replicate else D.group_rank(new.group) * count
    with torch.no_grad():
        new.router.gate.weight.copy_(layer.router.gate.weight)
        for name, param in new.local.named_parameters():
            param.copy_(getattr(layer.local, name)[first:first + count])
    return new.to(layer.router.gate.weight.device, layer.router.gate.weight.dtype)


def _check_run(group, batch_group) -> None:
    """`dispatch.plan` finds the parts of ``group``'s ranks in ``batch_group`` by one offset: ``group``
    must be a run of consecutive ranks of ``batch_group`` (a row of ``arange(world).view(dp, ep)``)."""
    inner, outer = group_members(group), group_members(batch_group)
    at = outer.index(inner[0]) if inner[0] in outer else -1
    if at < 0 or outer[at:at + len(inner)] != inner:
        raise ValueError(f"the expert-parallel group (ranks {list(inner)}) must be consecutive ranks of "
                         f"batch_group (ranks {list(outer)}): make the ep groups the rows of "
                         "arange(world).view(dp, ep), as distlab.parallel.mesh.grid_groups does")


def parallelize(model: nn.Module, group=None, replicate: bool = False, batch_group=None) -> nn.Module:
    """Replace every MoE layer of ``model`` (`models.moe.MoE`, every expert here) by one split over
    ``group`` (`split`), in place; returns ``model``. Every other parameter stays whole: data parallel over
    the same ranks (over ``batch_group`` when the batch is split over more ranks than ``group``: expert x
    data parallelism). ``replicate``: keep every expert on every rank instead, routed over ``group``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, moe.MoE):
                setattr(parent, name, split(child, group, replicate, batch_group))
    return model


def expert_params(model: nn.Module) -> list[torch.Tensor]:
    """The experts' parameters (split over the expert-parallel group where they are `ExpertShard`s)."""
    return [p for m in model.modules() if isinstance(m, moe.Experts) for p in m.parameters()]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (experts all-gathered along dim 0 over their group), on every rank, on CPU."""
    split_over = {id(p): m.group for m in model.modules() if isinstance(m, ExpertShard)
                  for p in m.parameters()}
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if id(p) in split_over:
            t = C.all_gather(t.contiguous(), 0, split_over[id(p)])
        out[name] = t.float().cpu().clone()
    return out
