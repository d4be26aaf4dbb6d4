"""Parallel attention and parallel MLP: one tensor-parallel region each (Shoeybi et al. 2019, Fig. 3).

    attention:  X ─f─> [Q_i K_i V_i = X W_q,i  X W_k,i  X W_v,i]  (column: heads a/t per rank)
                       softmax(Q_i K_i^T / sqrt(d)) V_i  on my heads only, no communication
                       ─> Y_i W_o,i  (row) ─g─> sum over ranks + b_o

    MLP:        X ─f─> GeLU(X W_fc,i + b_fc,i)  (column: 4h/t per rank)
                       ─> . W_proj,i (row) ─g─> + b_proj

q, k and v share one f (one all-reduce of dL/dX in the backward, as Megatron's fused QKV does), so
each region costs exactly one all-reduce forward (g) and one backward (f). Under sequence
parallelism f/g become all-gather/reduce-scatter along the sequence (`regions`), and the shared
entry saves only the sequence shard of X for the backward (`linear.GatheredLinears`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...models import attention_core
from .. import collectives as C
from ..mesh import as_group
from . import regions as ops
from .linear import ColumnParallelLinear, RowParallelLinear, check_divisible, gathered_linears


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split over the group: a/t heads per rank."""

    def __init__(self, q: ColumnParallelLinear, k: ColumnParallelLinear, v: ColumnParallelLinear,
                 proj: RowParallelLinear, head_dim: int, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.proj = q, k, v, proj
        self.head_dim, self.group = head_dim, group
        self.selective, self.recompute_context = False, None     # `models.attention_core`
        self.sequence_parallel = sequence_parallel and C.group_size(group) > 1

    @classmethod
    def from_module(cls, attn: nn.Module, group=None, sequence_parallel: bool = False) -> "ParallelAttention":
        """Shard a `distlab.models.CausalSelfAttention` (q, k, v, proj linears) by heads."""
        group = as_group(group)                          # a 1-D mesh: its process group
        t = C.group_size(group)
        heads = attn.q.out_features // attn.head_dim
        check_divisible("heads", heads, t, "build the model with GPTConfig(heads=...) a multiple of the TP "
                        "degree")
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        new = cls(*(ColumnParallelLinear.from_linear(lin, **kw) for lin in (attn.q, attn.k, attn.v)),
                  RowParallelLinear.from_linear(attn.proj, **kw), attn.head_dim, group, sequence_parallel)
        new.selective = getattr(attn, "selective", False)            # selective recomputation carries over
        new.recompute_context = getattr(attn, "recompute_context", None)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = shared_input(x, [self.q, self.k, self.v], self.group, self.sequence_parallel)
        return self.proj(attention_core(self, q, k, v))                 # (b, s, h/t): my heads only


def shared_input(x: torch.Tensor, linears: list, group=None, sequence_parallel: bool = False) -> tuple:
    """Column-parallel ``linears`` (q, k, v) on one input: Megatron's f once for all of them, not once
    each (its backward all-reduces the sum of their input gradients in one call); with sequence
    parallelism one all-gather of the (b, s/t, h) shard instead. One (b, s, out/t) output per linear."""
    if sequence_parallel:
        return gathered_linears(x, linears, group)
    x = ops.copy_to_region(x, group)
    return tuple(F.linear(x, lin.weight, lin.bias) for lin in linears)


class ParallelMLP(nn.Module):
    """GeLU(X W_fc^T + b) W_proj^T + b with the 4h hidden features split over the group; with a
    ``gate`` (SwiGLU, Llama), (SiLU(X W_gate^T) * X W_fc^T) W_proj^T, gate split like fc (the product
    is elementwise, so each rank multiplies its own columns of both)."""

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear,
                 gate: ColumnParallelLinear | None = None):
        super().__init__()
        self.fc, self.proj, self.gate = fc, proj, gate

    @classmethod
    def from_module(cls, mlp: nn.Module, group=None, sequence_parallel: bool = False) -> "ParallelMLP":
        """Shard a `distlab.models.FeedForward` (fc, proj linears) by its hidden features."""
        group = as_group(group)                          # a 1-D mesh: its process group
        check_divisible("mlp hidden size", mlp.fc.out_features, C.group_size(group),
                        "change GPTConfig.d_model or mlp_ratio")
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        gate = getattr(mlp, "gate", None)
        return cls(ColumnParallelLinear.from_linear(mlp.fc, **kw),
                   RowParallelLinear.from_linear(mlp.proj, **kw),
                   ColumnParallelLinear.from_linear(gate, **kw) if gate is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:                        # one f (or SP all-gather) for gate and fc
            g, u = shared_input(x, [self.gate, self.fc], self.fc.group, self.fc.sequence_parallel)
            return self.proj(F.silu(g) * u)
        return self.proj(F.gelu(self.fc(x)))
