"""`MoE`: a mixture-of-experts feed-forward layer, its experts split over a group of ranks.

The dense MLP of a transformer block, GELU(x W1 + b1) W2 + b2, becomes E such MLPs ("experts") and a
router picking k of them per token (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021)::

    x (T, h) -> router -> expert (T, k), weight (T, k)          router.py
             -> dispatch: all-to-all to the experts' ranks       dispatch.py
             -> rank r runs its experts E*r/n .. E*(r+1)/n - 1   this file
             -> combine: all-to-all back, y = sum_c weight_c * expert_c(x)

Expert parallelism (GShard; DeepSpeed-MoE, Rajbhandari et al. 2022) keeps E/n experts per rank: the
expert parameters are split n ways, each rank computing only the tokens routed to its experts, while
everything else in the model is data parallel. ``group=dispatch.LOCAL`` keeps every expert in this
process: the single-process layer the models use, and the reference the expert-parallel one equals
(same outputs, same dropped tokens, same gradients) when each rank holds a contiguous part of the batch.

Parameters: ``router.gate.weight`` (E, h), replicated; the experts' ``w1`` (E/n, h, f), ``b1`` (E/n, f),
``w2`` (E/n, f, h), ``b2`` (E/n, h), this rank's block of the (E, ...) stacks (``shard_dims`` says the
cut, as in tensor parallelism, so the checkpoint layer and the clipper read it the same way).
Initialisation draws the whole (E, ...) stack from the generator and keeps this rank's block, so an
expert has the same weights on any world size.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...runtime import group_members
from .. import collectives as C
from . import dispatch as D
from .router import Router, load_balancing_loss


class Experts(nn.Module):
    """``count`` independent MLPs h -> f -> h, stacked: ``w1`` (count, h, f), ``w2`` (count, f, h)."""

    def __init__(self, hidden: int, ffn: int, experts: int, first: int, count: int, group=None):
        super().__init__()
        # the cut, read by the checkpoint layer and the clipper (none when every expert is here)
        self.shard_dims = {} if group is D.LOCAL else {"w1": 0, "b1": 0, "w2": 0, "b2": 0}
        self.group = None if group is D.LOCAL else group
        block = slice(first, first + count)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn)[block] * 0.02)
        self.b1 = nn.Parameter(torch.zeros(count, ffn))
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden)[block] * 0.02)
        self.b2 = nn.Parameter(torch.zeros(count, hidden))

    def forward(self, x: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """x (R, h), local_expert (R,) -> (R, h): each row through its own expert, one matmul per expert."""
        perm = local_expert.argsort(stable=True)                       # rows grouped by expert, in order
        sizes = torch.bincount(local_expert, minlength=self.w1.shape[0]).tolist()
        outs = [F.gelu(rows @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]   # (R_e, h)
                for e, rows in enumerate(x[perm].split(sizes))]
        y = torch.cat(outs) if outs else x[:0]
        return y[perm.argsort()]                                       # back to the rows' order


class MoE(nn.Module):
    """Mixture of ``experts`` MLPs (hidden -> ffn -> hidden), ``top_k`` per token, capacity factor
    ``capacity_factor``, experts split over ``group`` (None: the world; `dispatch.LOCAL`: all here).

    ``forward(x)``: x (..., hidden) -> (..., hidden). After it, ``balance_loss`` holds this rank's share
    of the Switch load-balancing loss of the whole group's batch (`router.load_balancing_loss`; summed
    over the group it is the loss of all tokens; a model adds it to its loss times a coefficient).

    ``replicate=True``: every expert on every rank (the data-parallel alternative to expert parallelism,
    drawn beside it in lesson 11), routed as above over the group's whole batch, no all-to-all.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int = 2, capacity_factor: float = 1.25,
                 group=None, replicate: bool = False, batch_group=None):
        super().__init__()
        n = 1 if replicate else D.size(group)
        if experts % n:
            raise ValueError(f"experts={experts} cannot be split over {n} ranks: choose a number of experts "
                             f"divisible by the expert-parallel group size {n} (or a group of a divisor)")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.experts, self.top_k, self.capacity_factor, self.group = experts, top_k, capacity_factor, group
        self.replicate = replicate
        if batch_group is not None and group is not D.LOCAL:
            _check_run(group, batch_group)
        self.batch_group = batch_group           # the ranks the batch is split over (None: ``group``)
        self.router = Router(hidden, experts, top_k)
        per_rank = experts // n
        first = 0 if replicate else D.rank(group) * per_rank
        self.local = Experts(hidden, ffn, experts, first, per_rank, D.LOCAL if replicate else group)
        self.balance_loss = torch.zeros(())

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
        self.balance_loss = load_balancing_loss(probs, d.first_counts, d.tokens)
        return out.view(shape)

    def shard(self, group=None, replicate: bool = False, batch_group=None) -> "MoE":
        """A new `MoE` with the same weights, its experts split over ``group`` (this rank's block copied),
        or, ``replicate``, all of them here and routed over ``group``; ``batch_group``: the ranks the
        batch is split over, when larger (`dispatch.plan`)."""
        new = MoE(self.router.gate.in_features, self.local.w1.shape[2], self.experts, self.top_k,
                  self.capacity_factor, group, replicate, batch_group)
        count = new.local.w1.shape[0]
        first = 0 if replicate else D.rank(group) * count
        with torch.no_grad():
            new.router.gate.weight.copy_(self.router.gate.weight)
            for name, param in new.local.named_parameters():
                param.copy_(getattr(self.local, name)[first:first + count])
        return new.to(self.router.gate.weight.device, self.router.gate.weight.dtype)


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
    """Replace every `MoE` of ``model`` (built with all experts here) by one split over ``group``, in
    place; returns ``model``. Every other parameter stays whole: data parallel over the same ranks (over
    ``batch_group`` when the batch is split over more ranks than ``group``: expert x data parallelism).
    ``replicate``: keep every expert on every rank instead, routed over ``group`` (`MoE`)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoE):
                setattr(parent, name, child.shard(group, replicate, batch_group))
    return model


def expert_params(model: nn.Module) -> list[torch.Tensor]:
    """The experts' parameters (split over the expert-parallel group unless replicated: ``shard_dims``)."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (experts all-gathered along dim 0 over their group), on every rank, on CPU."""
    split = {id(p): m.group for m in model.modules() if isinstance(m, Experts) and m.shard_dims
             for p in m.parameters()}
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if id(p) in split:
            t = C.all_gather(t.contiguous(), 0, split[id(p)])
        out[name] = t.float().cpu().clone()
    return out


class AuxLoss(torch.autograd.Function):
    """``x`` unchanged in forward; in backward ``aux`` also receives d(total loss)/d(aux) = 1, so a loss
    computed in the middle of a model joins the backward of the activation it rides on (Megatron-LM's
    ``MoEAuxLossAutoScaler``). For callers that cannot add it to the final loss: a pipeline stage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.meta = aux.shape, aux.dtype, aux.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, dev = ctx.meta
        return grad, torch.ones(shape, dtype=dtype, device=dev)


class Riders(list):
    """The (detached) balance-loss term of each forward, for reporting; ``remove()`` takes the hooks off."""

    def __init__(self):
        super().__init__()
        self.handles: list = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def ride_balance_losses(model: nn.Module, coef: float, share) -> Riders:
    """Make every `MoE` of ``model`` carry ``coef * share(output) * balance_loss`` into backward on its
    output (`AuxLoss`), a forward hook each; ``share(output)``: that forward's part of the loss (rows of
    the batch it saw). Returns the list each forward appends its term to (`Riders`: ``.remove()``)."""
    values = Riders()

    def hook(module: MoE, args, out: torch.Tensor) -> torch.Tensor:
        aux = module.balance_loss * (coef * share(out))
        values.append(aux.detach())
        return AuxLoss.apply(out, aux)

    values.handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    return values
