"""A mixture-of-experts feed-forward layer with every expert in this process: the textbook layer.

The dense MLP of a transformer block, GELU(x W1 + b1) W2 + b2, becomes E such MLPs ("experts") and a
router picking k of them per token (Shazeer et al. 2017, "Outrageously Large Neural Networks"; GShard,
Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021)::

    x (T, h) --gate--> logits (T, E) --softmax--> probs (T, E) --top-k--> expert (T, k), weight (T, k)
             -> each expert takes at most C of them, the rest are dropped        `plan`
             -> the kept rows, sorted by expert, each through its own MLP        `Experts`
             -> y(t) = sum over t's kept choices c of weight(t, c) * expert_c(x_t)   `combine`

Router: ``weight`` is the chosen probabilities, renormalised to sum to 1 when k > 1 (GShard's
gate1 / (gate1 + gate2)); k = 1 keeps the raw probability (Switch), so the router still gets a gradient.

Capacity (GShard section 2.2, Switch section 2.2): each expert takes at most

    C = ceil(capacity_factor * k * T / E)        tokens per batch of T tokens,

the rest are *dropped* (they get no expert output; the residual connection carries them). Which ones
is defined by one rule, `slots`: an expert fills its C slots with first choices before second
choices, and within one choice in token order (GShard, Algorithm 1: "top-1 before top-2"). The rule
counts over a batch given as parts in order (`offsets`); here the batch is one part. Expert parallelism
(`distlab.parallel.expert`: the same layer, its experts split over ranks, tokens moved by all-to-all)
gives each rank a contiguous part of the batch, so it drops exactly the tokens this layer drops.

Load balance (Switch Eq. 4; GShard's l_aux): with f_i the fraction of tokens whose first choice is
expert i and P_i the mean router probability of expert i over the batch,

    loss_aux = E * sum_i f_i * P_i             (= 1 when routing is perfectly uniform)

f is a count (no gradient); P carries the gradient that evens the load out. After each forward the
layer holds it in ``balance_loss``; a model adds it to its loss times a coefficient (``GPT.aux_loss``).

Parameters: ``router.gate.weight`` (E, h); in ``local`` (the experts computed here: all of them), the
stacks ``w1`` (E, h, f), ``b1`` (E, f), ``w2`` (E, f, h), ``b2`` (E, h).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- the router ------------------------------------------------------------------------------------
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


# -- capacity and the drop rule --------------------------------------------------------------------
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


def by_expert(kept_pairs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """(R,): flat indices t*k + c of the kept (token, choice) pairs, sorted by expert (stable: token order
    within an expert). ``kept_pairs`` (T, k) bool, ``expert`` (T, k)."""
    flat = kept_pairs.flatten().nonzero().squeeze(1)                 # kept t*k + c
    return flat[expert.flatten()[flat].sort(stable=True).indices]


# -- the load-balancing loss -----------------------------------------------------------------------
def load_balancing_loss(probs: torch.Tensor, first_counts: torch.Tensor, tokens: int) -> torch.Tensor:
    """This part's share of Switch's ``E * sum_i f_i P_i`` over a batch of ``tokens`` tokens.

    probs: (T_part, E) this part's router probabilities; first_counts: (E,) first choices per expert
    over the *whole* batch (f_i = first_counts_i / tokens). Summed over the parts, the shares give the
    loss of the whole batch, and each part's gradient is exact: d loss / d p_ti = E f_i / tokens.
    """
    experts = probs.shape[-1]
    f = first_counts.to(probs.dtype) / tokens                        # (E,) no gradient: a count
    return experts * (f * probs.sum(dim=0) / tokens).sum()


# -- the layer -------------------------------------------------------------------------------------
@dataclass
class Routing:
    """Who goes where in one batch, and who is dropped.

    kept:   (T, k) bool, whether each (token, choice) fit in its expert's capacity
    order:  (R,) flat indices t*k + c of the kept pairs, sorted by expert (`by_expert`)
    local_expert: (R',) the expert, among those computed here, of each row they compute
    first_counts: (E,) first choices per expert over the whole batch; tokens: the batch's token count
    capacity: C, the slots of each expert
    """

    kept: torch.Tensor
    order: torch.Tensor
    local_expert: torch.Tensor
    first_counts: torch.Tensor
    tokens: int
    capacity: int


def plan(expert: torch.Tensor, experts: int, capacity_factor: float) -> Routing:
    """The `Routing` of a batch's choices ``expert`` (T, k) over ``experts`` experts, all in this process
    (the whole batch is one part)."""
    tokens, top_k = expert.shape
    per_choice = counts(expert, experts)                                          # (k, E)
    cap = capacity(tokens, experts, top_k, capacity_factor)
    kept_pairs = slots(expert, experts, offsets(per_choice[None])[0]) < cap       # (T, k)
    order = by_expert(kept_pairs, expert)
    return Routing(kept_pairs, order, expert.flatten()[order], per_choice[0], tokens, cap)


def combine(y: torch.Tensor, r: Routing, weight: torch.Tensor) -> torch.Tensor:
    """Expert outputs y (R, h), one per kept pair in ``r.order`` -> (T, h): weighted by the gate, summed
    per token. A token whose every choice was dropped gets zeros (its residual connection carries it on)."""
    top_k = r.kept.shape[1]
    gate = weight.flatten()[r.order].to(y.dtype)[:, None]                         # (R, 1)
    out = y.new_zeros((r.kept.shape[0], y.shape[1]))
    return out.index_add(0, r.order // top_k, y * gate)


class Experts(nn.Module):
    """``experts`` independent MLPs h -> f -> h, stacked: ``w1`` (E, h, f), ``w2`` (E, f, h)."""

    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(experts, ffn))
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(experts, hidden))

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
    ``capacity_factor``, every expert in this process.

    ``forward(x)``: x (..., hidden) -> (..., hidden). After it, ``balance_loss`` holds the Switch
    load-balancing loss of that batch (`load_balancing_loss`).
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int = 2, capacity_factor: float = 1.25):
        super().__init__()
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = Router(hidden, experts, top_k)
        self.local = Experts(hidden, ffn, experts)                     # the experts computed here: all
        self.balance_loss = torch.zeros(())

    def route(self, x: torch.Tensor):
        """x (T, h) -> (probs (T, E), weight (T, k), `Routing`): who goes where, who is dropped."""
        probs, expert, weight = self.router(x)
        return probs, weight, plan(expert, self.experts, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # (T, h): every token
        probs, weight, r = self.route(x)
        y = self.local(x[r.order // self.top_k], r.local_expert)       # (R, h): the kept pairs, by expert
        out = combine(y, r, weight)                                    # (T, h)
        self.balance_loss = load_balancing_loss(probs, r.first_counts, r.tokens)
        return out.view(shape)
