"""The router of a mixture-of-experts layer: which experts each token goes to, which tokens fit.

Top-k softmax gating (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021)::

    x (T, h) --gate--> logits (T, E) --softmax--> probs (T, E) --top-k--> expert (T, k), weight (T, k)

``weight`` is the chosen probabilities, renormalised to sum to 1 when k > 1 (GShard's
gate1 / (gate1 + gate2)); k = 1 keeps the raw probability (Switch), so the router still gets a gradient.

Capacity (GShard section 2.2, Switch section 2.2): each expert takes at most

    C = ceil(capacity_factor * k * T / E)        tokens per batch of T tokens,

the rest are *dropped* (they get no expert output; the residual connection carries them). Which ones
is defined by one rule, `slots`: an expert fills its C slots with first choices before second
choices, and within one choice in token order (GShard, Algorithm 1: "top-1 before top-2"). Token order
is the order of the whole batch, so an expert-parallel run, where each rank holds a contiguous part of
the batch, drops exactly the tokens one process would.

Load balance (Switch Eq. 4; GShard's l_aux): with f_i the fraction of tokens whose first choice is
expert i and P_i the mean router probability of expert i over the batch,

    loss_aux = E * sum_i f_i * P_i             (= 1 when routing is perfectly uniform)

f is a count (no gradient); P carries the gradient that evens the load out.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def check(experts: int, top_k: int) -> None:
    """A clear error for a router that cannot exist."""
    if experts < 1:
        raise ValueError(f"a mixture of experts needs experts >= 1, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}: each token picks top_k "
                         f"distinct experts (use top_k=1 (Switch) or 2 (GShard), or add experts)")


class Router(nn.Module):
    """x (T, h) -> (probs (T, E), expert (T, k), weight (T, k)): a linear gate, softmax, top-k."""

    def __init__(self, hidden: int, experts: int, top_k: int = 2):
        super().__init__()
        check(experts, top_k)
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor):
        probs = self.gate(x).float().softmax(dim=-1)                # (T, E), routed in fp32
        weight, expert = probs.topk(self.top_k, dim=-1)              # (T, k) each, best choice first
        if self.top_k > 1:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return probs, expert, weight


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * k * T / E): slots per expert for a batch of ``tokens`` tokens."""
    return math.ceil(capacity_factor * top_k * tokens / experts)


def counts(expert: torch.Tensor, experts: int) -> torch.Tensor:
    """(k, E): how many tokens chose expert e as their c-th choice."""
    return F.one_hot(expert.t(), experts).sum(dim=1)                 # (k, T, E) -> (k, E)


def offsets(all_counts: torch.Tensor) -> torch.Tensor:
    """(n, k, E): slots of expert e taken before part r's c-th choices, the batch being parts 0..n-1 in
    order (``all_counts``: (n, k, E), every part's `counts`). Every first choice precedes every second
    choice; within a choice, earlier parts come first."""
    per_choice = all_counts.sum(dim=0)                               # (k, E) over the whole batch
    before_choice = per_choice.cumsum(dim=0) - per_choice            # (k, E) earlier choices
    before_part = all_counts.cumsum(dim=0) - all_counts              # (n, k, E) earlier parts
    return before_choice[None] + before_part


def slots(expert: torch.Tensor, experts: int, offset: torch.Tensor) -> torch.Tensor:
    """(T, k): the slot each (token, choice) takes in its expert, counted over the whole batch; a slot
    >= C means dropped. ``offset``: (k, E), this part's row of `offsets`."""
    onehot = F.one_hot(expert.t(), experts)                          # (k, T, E)
    within = onehot.cumsum(dim=1) - 1 + offset[:, None, :]           # (k, T, E) token order per choice
    return (within * onehot).sum(dim=-1).t()                         # (T, k)


def kept(all_counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """(n, k, E): how many of part r's c-th choices of expert e fit in its ``capacity`` slots."""
    free = (capacity - offsets(all_counts)).clamp(min=0)
    return torch.minimum(free, all_counts)


def load_balancing_loss(probs: torch.Tensor, first_counts: torch.Tensor, tokens: int) -> torch.Tensor:
    """This part's share of Switch's ``E * sum_i f_i P_i`` over a batch of ``tokens`` tokens.

    probs: (T_part, E) this part's router probabilities; first_counts: (E,) first choices per expert
    over the *whole* batch (f_i = first_counts_i / tokens). Summed over the parts, the shares give the
    loss of the whole batch, and each part's gradient is exact: d loss / d p_ti = E f_i / tokens.
    """
    experts = probs.shape[-1]
    f = first_counts.to(probs.dtype) / tokens                        # (E,) no gradient: a count
    return experts * (f * probs.sum(dim=0) / tokens).sum()
