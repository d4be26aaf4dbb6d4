"""`MLP`: a stack of Linear+GELU layers, the simplest model to shard; and the initialisation every model
here starts from (GPT-2's: N(0, 0.02) weights, zero biases; Radford et al. 2019)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """sizes=(16, 64, 64, 1): Linear+GELU between every pair, no activation after the last."""

    def __init__(self, sizes=(16, 64, 64, 1), bias: bool = True):
        super().__init__()
        if len(sizes) < 2:
            raise ValueError("MLP needs at least an input and an output size, e.g. sizes=(16, 1)")
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes, sizes[1:]))
        self.apply(init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
