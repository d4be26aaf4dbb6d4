"""Local SGD and DiLoCo: replicas that train on their own for H steps, then meet.

DDP averages gradients every step: 2 (N-1)/N Psi bytes per rank per step. Local SGD (Stich 2019,
"Local SGD Converges Fast and Communicates Little"; Lin et al. 2020, "Don't Use Large Mini-Batches,
Use Local SGD") lets every replica take H = ``sync_every`` optimizer steps on its own data, then
averages the *parameters*: the same all-reduce, once every H steps, so Psi / H per step.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models")
keeps the inner optimizer (AdamW) and treats the averaged change of the H steps as a gradient for an
*outer* optimizer, Nesterov SGD (lr 0.7, momentum 0.9 in the paper):

    theta            the parameters every replica agreed on at the last sync (kept here, fp32)
    inner:  theta_r <- H steps of AdamW from theta on rank r's data        (no communication)
    outer:  delta    = (1/N) sum_r (theta - theta_r)                       (one all-reduce of Psi)
            theta   <- OuterSGD(theta, grad=delta, lr, momentum, nesterov)
            theta_r <- theta                                               (every replica)

    rank 0  |AdamW|AdamW|AdamW|AdamW|--.              .--|AdamW|AdamW| ...
    rank 1  |AdamW|AdamW|AdamW|AdamW|---> mean delta ---|AdamW|AdamW| ...
                    H = 4 steps alone      all-reduce, outer Nesterov step

Local SGD is the outer step with lr 1 and no momentum (theta - delta = the mean of the theta_r), which
is how `LocalSGD` computes it. Each replica keeps its own inner optimizer state (the paper's choice: it
is never communicated). With H = 1 and plain SGD inside, local SGD *is* DDP: averaging the parameters
after one SGD step from the same point averages the gradients.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..flat_collectives import Collectives
from .buckets import trainable
from .ddp import broadcast_from_rank0


class LocalSGD(nn.Module):
    """``LocalSGD(module, sync_every=H)``: call ``model.after_step()`` after every inner optimizer step;
    every H-th call averages the parameters over ``group``. Backward never communicates."""

    def __init__(self, module: nn.Module, sync_every: int, comm: str = "torch", group=None):
        super().__init__()
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer (e.g. 8), got {sync_every!r}")
        self.module, self.sync_every = module, sync_every
        self.comm = Collectives(comm, group)
        broadcast_from_rank0(module, self.comm)           # every replica starts at the same theta
        self.params = trainable(module.parameters())
        self.steps = 0                                    # inner steps taken (restored by a checkpoint)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def after_step(self) -> bool:
        """Count one inner step; on every H-th, sync (returns whether it did)."""
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """theta_r <- (1/N) sum theta_r: one all-reduce of every parameter, flattened together."""
        flat = torch.cat([p.detach().float().reshape(-1) for p in self.params])        # (Psi,)
        self.comm.all_reduce(flat, op="avg")
        _unflatten_into(flat, self.params)


class DiLoCo(LocalSGD):
    """``DiLoCo(module, sync_every=H, outer_lr=0.7, outer_momentum=0.9)``: every H-th ``after_step`` takes
    the outer Nesterov step on the averaged delta (the module docstring's algorithm)."""

    def __init__(self, module: nn.Module, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, comm: str = "torch", group=None):
        super().__init__(module, sync_every, comm, group)
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1) (the paper: 0.9), got {outer_momentum!r}")
        # theta: the agreed parameters, fp32, outside the module; the outer optimizer steps them
        self.anchor = [p.detach().float().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)

    @torch.no_grad()
    def sync(self) -> None:
        delta = torch.cat([(a - p.float()).reshape(-1) for a, p in zip(self.anchor, self.params)])  # (Psi,)
        self.comm.all_reduce(delta, op="avg")                   # the only communication: Psi numbers
        _unflatten_into(delta, self.anchor, grad=True)          # the outer gradient
        self.outer.step()                                       # theta <- Nesterov SGD step
        self.outer.zero_grad()
        for a, p in zip(self.anchor, self.params):
            p.copy_(a)                                          # every replica restarts from theta


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor], grad: bool = False) -> None:
    """Cut ``flat`` into ``tensors``' shapes and copy each piece in (into ``.grad`` with ``grad``)."""
    offset = 0
    for t in tensors:
        piece = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
        if grad:
            t.grad = piece.to(t.dtype).clone()
        else:
            t.copy_(piece)
