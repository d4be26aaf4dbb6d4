"""Activation memory of a transformer layer: measured with saved-tensor hooks, predicted from theory.

Measured: `SavedActivations` wraps a forward pass in ``torch.autograd.graph.saved_tensors_hooks``
and adds up every tensor autograd keeps for the backward, each storage counted once (q, k and v
all save the same LayerNorm output: one tensor in memory) and parameters left out.

Predicted: Korthikanti et al. 2022 count per layer, with 2-byte activations and 1-byte dropout masks,

    attention  QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b, softmax-dropout mask as^2b,
               dropout output 2as^2b, V 2sbh, proj input 2sbh, dropout mask sbh  = 11sbh + 5as^2b
    MLP        fc input 2sbh, GeLU input 8sbh, proj input 8sbh, dropout mask sbh = 19sbh
    LayerNorm  two inputs 4sbh                                                    = sbh(34 + 5as/h)

(`dl.theory.activation_bytes_per_layer`, with its TP and TP+SP forms). distlab's GPT has no
dropout, so three terms do not exist here: the two residual-dropout masks (2sbh, split by t only
under SP), the attention-dropout mask (as^2b) and the dropout output (2as^2b; attention @ V reuses
the saved softmax), both split by heads. Removing them leaves, in *elements*,

    sbh(16 + as/h)    ->   TP: sbh(4 + 12/t + as/(ht))    ->   TP+SP: sbh(16 + as/h)/t

times the element size (4 bytes in fp32). What the formula ignores and the measurement sees:
LayerNorm's per-token mean and 1/std (2bs fp32 numbers per LayerNorm) and the causal mask (s^2
bools): well under 1% here, which is the tolerance the checks allow.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...memory import SavedActivations
from ...theory import activation_bytes_per_layer


def measure_layer(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes one transformer block saves for its backward on input ``x`` (its own input included)."""
    x = x.detach().requires_grad_(True)
    with SavedActivations(block) as meter:
        y = block(x)
    del y
    return meter.bytes


def dropout_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, sp: bool = False) -> float:
    """The dropout terms of Korthikanti's count (2-byte activations, 1-byte masks), split as in Eq. 2/3:
    residual masks 2sbh (/t under SP), attention mask + dropout output 3as^2b (/t by heads)."""
    sbh, as2b = seq_len * micro_batch * hidden, heads * seq_len * seq_len * micro_batch
    return 2 * sbh / (tp if sp and tp > 1 else 1) + 3 * as2b / tp


def predicted_layer_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                          sp: bool = False, element_size: int = 4, dropout: bool = False) -> float:
    """Korthikanti et al.'s per-layer activation bytes (`dl.theory.activation_bytes_per_layer`),
    without the dropout terms unless ``dropout``, rescaled from 2-byte to ``element_size`` activations.
    (Only valid without dropout for element_size != 2, since masks are 1 byte whatever the dtype.)"""
    total = activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, tp=tp, sp=sp)
    if dropout:
        if element_size != 2:
            raise ValueError("with dropout the masks stay 1 byte: only element_size=2 matches the paper")
        return total
    return (total - dropout_bytes(seq_len, micro_batch, hidden, heads, tp, sp)) * element_size / 2


def unmodelled_bytes(seq_len: int, micro_batch: int, tp: int = 1, sp: bool = False,
                     stats_element_size: int = 4) -> int:
    """What the layer saves beyond Korthikanti's count, in distlab's GPT: each of the two LayerNorms
    keeps a mean and a 1/std per token (fp32; per *local* token under SP), and attention keeps its
    causal mask (s^2 bools)."""
    tokens = seq_len * micro_batch // (tp if sp and tp > 1 else 1)
    return 2 * 2 * tokens * stats_element_size + seq_len * seq_len
