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

    g    (before the column linear)  forward: all-gather along s   backward: reduce-scatter along s
    g-bar (after the row linear)     forward: reduce-scatter along s  backward: all-gather along s

An all-reduce is a reduce-scatter followed by an all-gather, so the bytes moved are unchanged;
what shrinks is the activation memory of everything between the linears, now 1/t per rank.

Sequence layout here is (b, s, h): the sequence axis is ``dim=1``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import collectives as C
from ..weight_grads import DEFERS_WEIGHT_GRAD, WeightGradStore

SEQ_DIM = 1


class CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group, where):
        ctx.group, ctx.where = group, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = C.all_reduce(grad.contiguous(), ctx.group, phase="backward", operator="f", where=ctx.where)
        return grad, None, None


class ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum of the partial products), identity backward."""

    @staticmethod
    def forward(ctx, x, group, where):
        return C.all_reduce(x.contiguous().clone(), group, phase="forward", operator="g", where=where)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence-parallel g: all-gather the sequence shards forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, where, dim):
        ctx.group, ctx.where, ctx.dim = group, where, dim
        return C.all_gather(x, dim, group, phase="forward", operator="sp_gather", where=where)

    @staticmethod
    def backward(ctx, grad):
        grad = C.reduce_scatter(grad, ctx.dim, ctx.group, phase="backward", operator="sp_gather", where=ctx.where)
        return grad, None, None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence-parallel g-bar: reduce-scatter the partial sums forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, where, dim):
        ctx.group, ctx.where, ctx.dim = group, where, dim
        return C.reduce_scatter(x, dim, group, phase="forward", operator="sp_scatter", where=where)

    @staticmethod
    def backward(ctx, grad):
        grad = C.all_gather(grad, ctx.dim, ctx.group, phase="backward", operator="sp_scatter", where=ctx.where)
        return grad, None, None, None


class SplitToSequence(torch.autograd.Function):
    """Enter the sequence-parallel region from a replicated tensor: keep my slice forward (no talk),
    all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, where, dim):
        ctx.group, ctx.where, ctx.dim = group, where, dim
        return C.split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        grad = C.all_gather(grad, ctx.dim, ctx.group, phase="backward", operator="sp_split", where=ctx.where)
        return grad, None, None, None


class GatherFromTensor(torch.autograd.Function):
    """Column-parallel ``gather_output``: all-gather the feature shards forward, keep my slice backward."""

    @staticmethod
    def forward(ctx, x, group, where):
        ctx.group = group
        return C.all_gather(x, -1, group, phase="forward", operator="gather_output", where=where)

    @staticmethod
    def backward(ctx, grad):
        return C.split(grad, -1, ctx.group), None, None


class SplitToTensor(torch.autograd.Function):
    """Row-parallel with ``input_is_parallel=False``: keep my feature slice forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, where):
        ctx.group, ctx.where = group, where
        return C.split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        grad = C.all_gather(grad, -1, ctx.group, phase="backward", operator="split_input", where=ctx.where)
        return grad, None, None


class GatheredLinears(torch.autograd.Function):
    """Sequence-parallel entry into column-parallel linears, saving only the sequence shard.

    Forward: all-gather X's sequence shards (g), then Y_j = X W_j^T + b_j for each linear j
    (attention's q, k, v share one gather). Backward: all-gather X again, form dW_j = dY_j^T X and
    dX = sum_j dY_j W_j, and reduce-scatter dX back to sequence shards (g's backward).

    Keeping the shard (s b h / t) rather than the gathered X (s b h) for the backward is how
    Korthikanti et al. 2022 (Sec. 4.2.2) reach activation memory sbh(34 + 5as/h)/t: the price is one
    extra all-gather per region in the backward (recorded with ``operator="sp_regather"``).

    Under a zero-bubble schedule the backward computes dX only, on the critical path (I), and hands
    dW_j = dY_j^T X, db_j = sum dY_j to the active `WeightGradStore` for the W pass, keeping the
    gathered X and dY_j alive until then (the memory zero bubble trades for its smaller bubble).
    """

    @staticmethod
    def forward(ctx, x_shard, group, where, dim, *weights_and_biases):
        ctx.group, ctx.where, ctx.dim = group, where, dim
        ctx.params = weights_and_biases                       # (w_1, b_1 or None, w_2, ...)
        x = C.all_gather(x_shard, dim, group, phase="forward", operator="sp_gather", where=where)
        ctx.save_for_backward(x_shard, *[t for t in weights_and_biases if t is not None])
        return tuple(F.linear(x, w, b) for w, b in zip(weights_and_biases[::2], weights_and_biases[1::2]))

    @staticmethod
    def backward(ctx, *grads):
        x_shard, *_ = ctx.saved_tensors
        x = C.all_gather(x_shard, ctx.dim, ctx.group, phase="backward", operator="sp_regather", where=ctx.where)
        x2d = x.reshape(-1, x.shape[-1])
        g2ds = [g.reshape(-1, g.shape[-1]) for g in grads]
        grad_x = None
        for g2d, w in zip(g2ds, ctx.params[::2]):
            grad_x = g2d @ w if grad_x is None else grad_x.addmm_(g2d, w)
        grad_x = C.reduce_scatter(grad_x.view(x.shape), ctx.dim, ctx.group, phase="backward",
                                  operator="sp_gather", where=ctx.where)

        def weight_grads() -> list:
            out = []
            for g2d, b in zip(g2ds, ctx.params[1::2]):
                out += [g2d.t() @ x2d, g2d.sum(0) if b is not None else None]
            return out

        store = WeightGradStore.current()
        if store is None:
            return (grad_x, None, None, None, *weight_grads())
        store.defer(list(ctx.params), weight_grads)
        return (grad_x, None, None, None, *[None] * len(ctx.params))


# -- functional forms (what the layers call) ---------------------------------------------------
def copy_to_region(x, group=None, where=None):
    """f: enter a tensor-parallel region (identity forward, all-reduce backward)."""
    return CopyToRegion.apply(x, group, where) if C.group_size(group) > 1 else x


def reduce_from_region(x, group=None, where=None):
    """g: leave a tensor-parallel region (all-reduce forward, identity backward)."""
    return ReduceFromRegion.apply(x, group, where) if C.group_size(group) > 1 else x


def gather_from_sequence(x, group=None, where=None, dim=SEQ_DIM):
    """SP g: all-gather along the sequence forward, reduce-scatter backward."""
    return GatherFromSequence.apply(x, group, where, dim) if C.group_size(group) > 1 else x


def reduce_scatter_to_sequence(x, group=None, where=None, dim=SEQ_DIM):
    """SP g-bar: reduce-scatter along the sequence forward, all-gather backward."""
    return ReduceScatterToSequence.apply(x, group, where, dim) if C.group_size(group) > 1 else x


def split_to_sequence(x, group=None, where=None, dim=SEQ_DIM):
    """Replicated -> sequence shard (my slice forward, all-gather backward)."""
    return SplitToSequence.apply(x, group, where, dim) if C.group_size(group) > 1 else x


def gather_from_tensor(x, group=None, where=None):
    """Feature shards -> full features (all-gather forward, split backward)."""
    return GatherFromTensor.apply(x, group, where) if C.group_size(group) > 1 else x


def split_to_tensor(x, group=None, where=None):
    """Full features -> my feature shard (split forward, all-gather backward)."""
    return SplitToTensor.apply(x, group, where) if C.group_size(group) > 1 else x


def gathered_linears(x_shard, linears, group=None, where=None, dim=SEQ_DIM):
    """All-gather ``x_shard`` along the sequence and apply each (weight, bias) pair, saving only the shard."""
    flat = [t for lin in linears for t in (lin.weight, lin.bias)]
    if C.group_size(group) == 1:
        return tuple(F.linear(x_shard, w, b) for w, b in zip(flat[::2], flat[1::2]))
    for t in flat:
        if t is not None:
            setattr(t, DEFERS_WEIGHT_GRAD, True)            # zero bubble: its W comes from the store
    return GatheredLinears.apply(x_shard, group, where, dim, *flat)
