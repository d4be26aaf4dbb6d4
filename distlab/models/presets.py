"""The named models of `dl.train(model=...)`, the CLI and the lessons, and the data set each trains on.

Two kinds: laptop sizes (``gpt-tiny`` ... ``gpt-moe-tiny``) that train for real, and published sizes at
full scale (``gpt3-175b``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``; shapes from
`dl.theory.presets`: Brown et al. 2020, Table 2.1; Dubey et al. 2024, Table 3) for dry runs
(``backend="fake"``), where they are built on the ``meta`` device and never hold a byte. A
`dl.theory.ModelPreset` of your own works wherever a name does (`config`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..theory.presets import MODELS as SHAPES
from .data import MarkovTokens, TeacherRegression
from .gpt import GPT, GPTConfig
from .mlp import MLP


def from_shape(shape) -> GPTConfig:
    """The `GPTConfig` of a `dl.theory.ModelPreset`: its parameters equal ``shape.params`` exactly (the
    Llama ones: GQA, SwiGLU, RMSNorm, no biases, untied head, no position table; see `gpt`)."""
    llama = shape.llama
    return GPTConfig(vocab=shape.vocab, seq_len=shape.seq_len, d_model=shape.hidden, heads=shape.heads,
                     layers=shape.layers, tied=not llama, bias=not llama, ffn=shape.ffn,
                     kv_heads=shape.kv_heads,
                     swiglu=llama, norm="rmsnorm" if llama else "layernorm", positions=shape.positions)


#: Named sizes used by `dl.train(model=...)`, the CLI and the lessons.
PRESETS = {
    "gpt-tiny": GPTConfig(vocab=64, seq_len=32, d_model=64, heads=4, layers=2),
    "gpt-small": GPTConfig(vocab=256, seq_len=64, d_model=128, heads=8, layers=4),
    "gpt-wide": GPTConfig(vocab=128, seq_len=32, d_model=256, heads=8, layers=2),
    "gpt-moe-tiny": GPTConfig(vocab=64, seq_len=32, d_model=32, heads=4, layers=2, mlp_ratio=2, experts=4,
                              top_k=2, capacity_factor=1.25, aux_coef=0.01),
    **{name: from_shape(SHAPES[name]) for name in ("gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b")},
}
#: the presets too big to build anywhere but on the meta device of a dry run
REAL_SIZE = ("gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b")


def config(model, vocab: int | None = None) -> GPTConfig | None:
    """The `GPTConfig` of ``model``: a preset name, or a `dl.theory.ModelPreset`; None for ``"mlp"``;
    ``vocab``: another vocabulary size (256 for the byte-level text of `dl.data`)."""
    if hasattr(model, "hidden") and hasattr(model, "layers"):
        cfg = from_shape(model)
    elif model == "mlp":
        return None
    elif model not in PRESETS:
        raise ValueError(f"unknown model {model!r}: choose one of {sorted(PRESETS) + ['mlp']}")
    else:
        cfg = PRESETS[model]
    return cfg if vocab is None else dataclasses.replace(cfg, vocab=vocab)


def build(name, seed: int = 0, vocab: int | None = None) -> nn.Module:
    """A preset by name ("gpt-tiny", "gpt-small", "gpt-wide", "gpt-moe-tiny", "mlp", the real sizes) or a
    `dl.theory.ModelPreset`, initialised from ``seed`` (on the default device: ``with torch.device("meta")``
    for a real size); ``vocab``: another vocabulary size for a GPT."""
    torch.manual_seed(seed)
    cfg = config(name, vocab)
    return MLP() if cfg is None else GPT(cfg)


def dataset_for(name, seed: int = 0):
    """The synthetic data set that matches a model preset."""
    cfg = config(name)
    if cfg is None:
        return TeacherRegression(seed=seed)
    return MarkovTokens(cfg.vocab, cfg.seq_len, seed=seed)
