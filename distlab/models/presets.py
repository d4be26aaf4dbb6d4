"""The named models of `dl.train(model=...)`, the CLI and the lessons, and the data set each trains on."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from .data import MarkovTokens, TeacherRegression
from .gpt import GPT, GPTConfig
from .mlp import MLP

#: Named sizes used by `dl.train(model=...)`, the CLI and the lessons.
PRESETS = {
    "gpt-tiny": GPTConfig(vocab=64, seq_len=32, d_model=64, heads=4, layers=2),
    "gpt-small": GPTConfig(vocab=256, seq_len=64, d_model=128, heads=8, layers=4),
    "gpt-wide": GPTConfig(vocab=128, seq_len=32, d_model=256, heads=8, layers=2),
    "gpt-moe-tiny": GPTConfig(vocab=64, seq_len=32, d_model=32, heads=4, layers=2, mlp_ratio=2, experts=4,
                              top_k=2, capacity_factor=1.25, aux_coef=0.01),
}


def build(name: str, seed: int = 0, vocab: int | None = None) -> nn.Module:
    """A preset by name ("gpt-tiny", "gpt-small", "gpt-wide", "gpt-moe-tiny", "mlp"), initialised from
    ``seed``; ``vocab``: another vocabulary size for a GPT (256 for the byte-level text of `dl.data`)."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP()
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(PRESETS) + ['mlp']}")
    cfg = PRESETS[name] if vocab is None else dataclasses.replace(PRESETS[name], vocab=vocab)
    return GPT(cfg)


def dataset_for(name: str, seed: int = 0):
    """The synthetic data set that matches a model preset."""
    if name == "mlp":
        return TeacherRegression(seed=seed)
    cfg = PRESETS[name]
    return MarkovTokens(cfg.vocab, cfg.seq_len, seed=seed)
