"""Mixture of experts in numbers: total vs active parameters, expert-parallel memory, all-to-all volume.

A GPT block with a dense MLP h -> f -> h holds 2hf + f + h MLP parameters (biases included). Its
mixture-of-experts version holds E such experts and a router (h x E, no bias), and each token runs
only k of them (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021)::

    total  per layer = E * (2hf + f + h) + hE          what memory must hold
    active per layer = k * (2hf + f + h) + hE          what one token computes with (FLOPs ~ 6 * active)

Expert parallelism over n ranks (GShard; DeepSpeed-MoE, Rajbhandari et al. 2022) keeps E/n experts per
rank and every other parameter whole, so a rank holds  dense + experts / n  parameters.

All-to-all volume (GShard section 3.2; DeepSpeed-MoE section 5): a rank routes its T tokens to k experts
each, k T rows of h elements; under balanced routing a fraction (n-1)/n of them lives on other ranks, so
one all-to-all sends (and receives)

    k * T * h * bytes * (n - 1) / n          per rank,

and a training step runs four per MoE layer: dispatch and combine, forward and backward. Capacity
(Switch section 2.2, with k choices as in GShard): an expert takes C = ceil(capacity_factor * k * T / E)
tokens of a batch of T; the rest are dropped and not sent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MoEParams:
    """Parameter counts of a mixture-of-experts model: ``total`` held, ``active`` used per token,
    ``experts``: the part in expert MLPs (what expert parallelism splits), ``dense``: all the rest."""

    total: int
    active: int
    experts: int
    dense: int


def expert_params(hidden: int, ffn: int, bias: bool = True) -> int:
    """One expert MLP h -> f -> h: 2hf weights, f + h biases."""
    return 2 * hidden * ffn + ((ffn + hidden) if bias else 0)


def moe_layer_params(hidden: int, ffn: int, experts: int, top_k: int, bias: bool = True) -> tuple[int, int]:
    """(total, active) parameters of one MoE layer: E (or k) experts plus the h x E router."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
    one, gate = expert_params(hidden, ffn, bias), hidden * experts
    return experts * one + gate, top_k * one + gate


def gpt_moe_params(vocab: int, seq_len: int, hidden: int, layers: int, experts: int, top_k: int,
                   ffn: int | None = None, tied: bool = False, bias: bool = True) -> MoEParams:
    """A GPT (as `distlab.models.GPT`) whose every block's MLP is a mixture of experts.

    Outside the MLPs: embeddings V h + S h, per layer attention 4h^2 (+4h biases) and two LayerNorms 4h,
    a final LayerNorm 2h, and the head h V unless tied (the dense GPT's L (12h^2 + 13h) with its 8h^2 + 5h
    MLP taken out)."""
    ffn = 4 * hidden if ffn is None else ffn
    attention = 4 * hidden * hidden + (4 * hidden if bias else 0) + 4 * hidden
    head = 0 if tied else hidden * vocab
    outside = vocab * hidden + seq_len * hidden + layers * attention + 2 * hidden + head
    total, active = moe_layer_params(hidden, ffn, experts, top_k, bias)
    in_experts = layers * experts * expert_params(hidden, ffn, bias)
    return MoEParams(total=outside + layers * total, active=outside + layers * active, experts=in_experts,
                     dense=outside + layers * total - in_experts)


def ep_params_per_rank(p: MoEParams, ep: int) -> float:
    """Parameters one rank holds under expert parallelism of degree ``ep``: dense + experts / ep."""
    if p.experts and ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    return p.dense + p.experts / ep


def ep_memory(p: MoEParams, ep: int, bytes_per_param: float = 16.0) -> float:
    """Bytes of model state per rank: `ep_params_per_rank` x ``bytes_per_param`` (16: bf16 weights and
    gradients, fp32 master weights and Adam's two moments, ZeRO paper's 2 + 2 + 12; 4: fp32 weights)."""
    return ep_params_per_rank(p, ep) * bytes_per_param


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * k * T / E) slots per expert (Switch Eq. 3 with k choices per token)."""
    return math.ceil(capacity_factor * top_k * tokens / experts)


def moe_all_to_all_bytes(tokens: int, hidden: int, top_k: int, ep: int, dtype_bytes: int = 4) -> float:
    """Bytes one rank sends in one all-to-all of an MoE layer, T = ``tokens`` on that rank, balanced
    routing, nothing dropped: k T h bytes (ep - 1) / ep (its own share stays in memory)."""
    return top_k * tokens * hidden * dtype_bytes * (ep - 1) / ep


def moe_step_all_to_all_bytes(tokens: int, hidden: int, top_k: int, ep: int, moe_layers: int,
                              dtype_bytes: int = 4) -> float:
    """Bytes one rank sends by all-to-all in a training step: 4 per MoE layer (dispatch, combine, and
    the backward of each)."""
    return 4 * moe_layers * moe_all_to_all_bytes(tokens, hidden, top_k, ep, dtype_bytes)


def expected_drop_fraction(tokens: int, experts: int, top_k: int, capacity_factor: float) -> float:
    """Expected fraction of the k T (token, choice) pairs dropped when routing is uniform at random.

    Each token picks k distinct experts, so expert e's load is L ~ Binomial(T, k/E) (the loads are not
    independent, but each one is binomial, and the expectation is linear). Dropped at e: max(0, L - C),
    C = `expert_capacity`; over the E experts, out of k T pairs::

        drop = E * sum_{l > C} (l - C) P(L = l) / (k T)

    A trained router is not uniform: lesson 11 measures how much more it drops without the balance loss.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    cap = expert_capacity(tokens, experts, top_k, capacity_factor)
    p = top_k / experts
    if p >= 1.0:                                                     # every token visits every expert
        return max(0, tokens - cap) / tokens

    def log_pmf(n: int) -> float:                                    # log P(L = n), in logs: no overflow
        return (math.lgamma(tokens + 1) - math.lgamma(n + 1) - math.lgamma(tokens - n + 1)
                + n * math.log(p) + (tokens - n) * math.log1p(-p))
    over = sum((n - cap) * math.exp(log_pmf(n)) for n in range(cap + 1, tokens + 1))
    return experts * over / (top_k * tokens)
