"""Gradient-norm clipping when no rank holds the whole gradient.

``torch.nn.utils.clip_grad_norm_`` scales every gradient by

    coef = min(1, max_norm / (||g|| + 1e-6)),     ||g||^2 = sum over every parameter p of ||g_p||^2

(Pascanu et al. 2013, "On the difficulty of training recurrent neural networks"). Under model
parallelism ||g||^2 is still the norm of the *whole* model's gradient, but its terms live on
different ranks, so each rank sums the squares it holds and the sums are all-reduced::

    tensor parallel (group of T)       pipeline (group of P stages)
    rank 0: [W_0] [ln]                 stage 0: [embed, block 0]
    rank 1: [W_1] [ln]   <- same ln    stage 1: [block 1, head]

    ||g||^2 = (sum over the group of ||g_W shard||^2) + ||g_ln||^2      (replicated: counted once)
            then summed over the pipeline stages, which hold different parameters

``clip_grad_norm_(params, max_norm, sharded=..., groups=[tp_group, pp_group])`` does exactly that:
over ``groups[0]`` only the ``sharded`` parameters' squares are summed (the others are replicated
there and counted once); every later group holds different parameters on each rank, so the whole
sum adds over it. With no groups it is torch's rule on one process.
"""
from __future__ import annotations

import torch

from . import collectives as C


def grad_square_sum(params, sharded=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of ||g_p||^2 over the ``sharded`` parameters, the same over the others), in fp32.

    ``sharded``: a collection of parameters (compared by identity); None means every parameter."""
    ids = None if sharded is None else {id(p) for p in sharded}
    grads = [p for p in params if p.grad is not None]
    device = grads[0].grad.device if grads else torch.device("cpu")
    sq_sharded = torch.zeros(1, device=device)          # (1,): all-reduced as a one-element tensor
    sq_replicated = torch.zeros(1, device=device)
    for p in grads:
        (sq_sharded if ids is None or id(p) in ids else sq_replicated).add_(p.grad.float().pow(2).sum())
    return sq_sharded, sq_replicated


def sum_over(sq: torch.Tensor, groups) -> torch.Tensor:
    """``sq`` summed over every group of ``groups`` in turn (each holds different parameters per rank)."""
    for group in groups:
        sq = C.all_reduce(sq, group)
    return sq


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, *, sharded=None, groups=()) -> torch.Tensor:
    """Scale the gradients of ``params`` so the whole model's gradient norm is at most ``max_norm``;
    returns that norm (before clipping), the same on every rank.

    ``sharded``: the parameters split over ``groups[0]`` (None: all of them, e.g. pipeline stages);
    ``groups``: the process groups to sum over, innermost first (e.g. ``[tp_group, pp_group]``).
    """
    params = list(params)
    groups = list(groups)
    sq_sharded, sq_replicated = grad_square_sum(params, sharded)
    if groups:
        sq_sharded = C.all_reduce(sq_sharded, groups[0])
    sq = sum_over(sq_sharded + sq_replicated, groups[1:])
    return scale_to_norm([p.grad for p in params if p.grad is not None], sq, max_norm)


def scale_to_norm(grads, squared_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's rule, once the whole model's ``squared_norm`` is known (a one-element tensor, equal on
    every rank): scale every tensor of ``grads`` by min(1, max_norm / (||g|| + 1e-6)); returns ||g||.
    Every clipper of distlab ends here (ZeRO's `ShardedOptimizer.clip_grad_norm_` on its shards too)."""
    norm = squared_norm.reshape(-1).sqrt()[0]
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm
