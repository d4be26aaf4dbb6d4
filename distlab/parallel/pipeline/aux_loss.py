"""A loss computed in the middle of a model, carried into backward on the activation it rides on: the
MoE layers' load-balancing losses on a pipeline stage, which cannot add them to the final loss."""
from __future__ import annotations

import torch
import torch.nn as nn

from ...models import moe


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
    """Make every MoE layer of ``model`` (`models.moe.MoE`, its experts split or not) carry
    ``coef * share(output) * balance_loss`` into backward on its output (`AuxLoss`), a forward hook each;
    ``share(output)``: that forward's part of the loss (rows of the batch it saw). Returns the list each
    forward appends its term to (`Riders`: ``.remove()``)."""
    values = Riders()

    def hook(module: moe.MoE, args, out: torch.Tensor) -> torch.Tensor:
        aux = module.balance_loss * (coef * share(out))
        values.append(aux.detach())
        return AuxLoss.apply(out, aux)

    values.handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, moe.MoE)]
    return values
