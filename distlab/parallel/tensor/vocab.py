"""Vocabulary-parallel embedding and cross-entropy (Shoeybi et al. 2019, Sec. 3).

The vocabulary V is split into t contiguous ranges, rank i owning ids [i V/t, (i+1) V/t):

    embedding table E (V, h):   [ E_0 ; E_1 ; ... ]   rank i holds E_i (V/t, h)

    embedding:  each rank looks up the ids it owns and writes zeros for the others; summing over
                ranks (g: all-reduce, or reduce-scatter along the sequence under SP) gives E[ids].

    cross-entropy on logits split by vocabulary (never gathering the b s V logits):
        m   = max_j z_j                 all-reduce(max) of each rank's local max
        S   = sum_j exp(z_j - m)        all-reduce(sum) of local sums
        z_y = target logit              all-reduce(sum): only the owner of y contributes
        loss = log S - (z_y - m)
        dloss/dz_j = softmax_j - [j == y], computed locally from the saved softmax shard

    Three all-reduces of b*s numbers instead of an all-gather of b*s*V.

The LM head that produces the logits is a column-parallel linear over V; with tied embeddings it
shares E_i, the same row block, so the tie survives sharding.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import collectives as C
from ..cuts import mark_cut
from . import regions as ops
from ..mesh import as_group
from .linear import check_divisible


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows (the vocabulary) split over the group."""

    def __init__(self, num_embeddings: int, dim: int, group=None, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        group = as_group(group)                          # a 1-D mesh: its process group
        t = C.group_size(group)
        check_divisible("vocab", num_embeddings, t, "pad the vocabulary to a multiple of the TP degree")
        self.num_embeddings, self.dim, self.group, self.tp = num_embeddings, dim, group, t
        self.sequence_parallel = sequence_parallel and t > 1
        per_rank = num_embeddings // t
        self.vocab_start = C.group_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, dim, device=device, dtype=dtype).normal_())
        mark_cut(self, group)                             # for dl.clip_grad_norm_ on bare parameters

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None, **kw) -> "VocabParallelEmbedding":
        layer = cls(emb.num_embeddings, emb.embedding_dim, group=group, device=emb.weight.device,
                    dtype=emb.weight.dtype, **kw)
        with torch.no_grad():
            layer.weight.copy_(emb.weight[layer.vocab_start:layer.vocab_end])
        return layer

    @property
    def shard_dims(self) -> dict:
        return {"weight": 0}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return ops.reduce_scatter_to_sequence(partial, self.group)     # (b, s/t, h)
        return ops.reduce_from_region(partial, self.group)                  # (b, s, h)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.dim}, this rank: ids [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.tp}, sequence_parallel={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        z = logits.float()                                        # (N, V/t)
        m = C.all_reduce_max(z.max(dim=-1).values, group)  # (N,)
        shifted = z - m.unsqueeze(-1)
        owned = (targets >= vocab_start) & (targets < vocab_start + z.shape[-1])
        local_target = (targets - vocab_start).masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        target_logit = C.all_reduce_sum(target_logit, group)
        exp = shifted.exp()
        sum_exp = C.all_reduce_sum(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), owned, local_target)
        ctx.dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, owned, local_target = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group=None) -> torch.Tensor:
    """Per-token cross-entropy from logits split by vocabulary: ``logits`` (N, V/t) holds ids
    [vocab_start, vocab_start + V/t); ``targets`` (N,) are global ids. Returns (N,) losses."""
    if C.group_size(group) == 1:
        return F.cross_entropy(logits, targets, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group)
