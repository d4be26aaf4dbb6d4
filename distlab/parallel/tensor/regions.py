"""Megatron's conjugate operators as autograd functions: the only places tensor parallelism talks.

Shoeybi et al. 2019 ("Megatron-LM", Sec. 3) split an MLP  Y = GeLU(X A),  Z = Y B  over t ranks:

    A = [A_1 | A_2 | ... | A_t]   (column split: rank i owns output features i)
    B = [B_1 ; B_2 ; ... ; B_t]   (row split:    rank i owns input features i)

         X ──f──> X A_i ──GeLU──> Y_i ──> Y_i B_i ──g──> Z = sum_i Y_i B_i
                  (no talking in between: GeLU acts element-wise on each rank's columns)

    f  forward: identity (every rank already holds X)   backward: all-reduce dL/dX
    g  forward: all-reduce the partial products Y_i B_i  backward: identity

Each layer of a transformer has two such regions (attention, MLP), so plain TP all-reduces b*s*h
activations twice forward (g) and twice backward (f).

Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) keeps the LayerNorm/dropout regions
split along the sequence instead of replicated, and swaps the operators for their halves:

    (b, s/t, h) ──g──> (b, s, h) ── column ... row ──g-bar──> (b, s/t, h)

    g     (before the column linear)  forward: all-gather along s     backward: reduce-scatter along s
    g-bar (after the row linear)      forward: reduce-scatter along s  backward: all-gather along s

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved are unchanged;
what shrinks is the activation memory of everything between the linears, now 1/t per rank. (The
layers fuse g with the column linears, `linear.GatheredLinears`, to save only the sequence shard.)
Layout (b, s, h): the sequence is ``dim=1``; rank i holds block i of t (`sequence_positions`).
"""
from __future__ import annotations

import torch

from .. import collectives as C

SEQ_DIM = 1


class CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce_sum(grad.contiguous(), ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum of the partial products), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce_sum(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence-parallel g: all-gather the sequence shards forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather(x, SEQ_DIM, group)               # (b, s/t, h) -> (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        return C.reduce_scatter(grad, SEQ_DIM, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence-parallel g-bar: reduce-scatter the partial sums forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter(x, SEQ_DIM, group)           # (b, s, h) partial -> (b, s/t, h) summed

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, SEQ_DIM, ctx.group), None


class GatherFromTensor(torch.autograd.Function):
    """Column-parallel ``gather_output``: all-gather the feature shards forward, keep my slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather(x, -1, group)                    # (..., out/t) -> (..., out)

    @staticmethod
    def backward(ctx, grad):
        return C.split(grad, -1, ctx.group), None


class SplitToTensor(torch.autograd.Function):
    """Row-parallel with ``input_is_parallel=False``: keep my feature slice forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.split(x, -1, group)                         # (..., in) -> (..., in/t)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, -1, ctx.group), None


# -- functional forms (what the layers call; the identity on a group of one) -------------------
def copy_to_region(x, group=None):
    """f: enter a tensor-parallel region (identity forward, all-reduce backward)."""
    return CopyToRegion.apply(x, group) if C.group_size(group) > 1 else x


def reduce_from_region(x, group=None):
    """g: leave a tensor-parallel region (all-reduce forward, identity backward)."""
    return ReduceFromRegion.apply(x, group) if C.group_size(group) > 1 else x


def gather_from_sequence(x, group=None):
    """SP g: all-gather along the sequence forward, reduce-scatter backward."""
    return GatherFromSequence.apply(x, group) if C.group_size(group) > 1 else x


def reduce_scatter_to_sequence(x, group=None):
    """SP g-bar: reduce-scatter along the sequence forward, all-gather backward."""
    return ReduceScatterToSequence.apply(x, group) if C.group_size(group) > 1 else x


def gather_from_tensor(x, group=None):
    """Feature shards -> full features (all-gather forward, split backward)."""
    return GatherFromTensor.apply(x, group) if C.group_size(group) > 1 else x


def split_to_tensor(x, group=None):
    """Full features -> my feature shard (split forward, all-gather backward)."""
    return SplitToTensor.apply(x, group) if C.group_size(group) > 1 else x


def sequence_positions(seq_len: int, group=None, device=None) -> torch.Tensor:
    """The positions of a length-``seq_len`` sequence this rank holds under sequence parallelism:
    block r of t of ``arange(seq_len)`` (the block ``reduce_scatter_to_sequence`` leaves here)."""
    return C.split(torch.arange(seq_len, device=device), 0, group)
