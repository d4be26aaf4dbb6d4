"""Column- and row-parallel linear layers in Megatron-LM's layout (Shoeybi et al. 2019).

nn.Linear computes Y = X W^T + b with W of shape (out, in). Over t ranks:

    ColumnParallelLinear: split the OUTPUT features = the rows of W (columns of W^T = "A" in the paper)

        W = [ W_0 ]   rank i holds W_i (out/t, in) and b_i (out/t):  Y_i = X W_i^T + b_i
            [ W_1 ]   input X replicated (enter with f), output Y_i = my slice of Y's features
            [ ... ]   (gather_output=True all-gathers the full Y)

    RowParallelLinear: split the INPUT features = the columns of W (rows of W^T = "B")

        W = [ W_0 | W_1 | ... ]   rank i holds W_i (out, in/t):  Z = sum_i X_i W_i^T + b
                                  input X_i = my feature slice (input_is_parallel=True), partial
                                  products summed by g (all-reduce); bias added once, after the sum

Column then row needs no communication in between: the column layer's output slice is exactly the
row layer's input slice. With ``sequence_parallel=True`` the column layer's f becomes an all-gather
along the sequence, fused with the linear (`GatheredLinears`), and the row layer's g a reduce-scatter
(see `regions`); the row bias then acts on sequence shards, so its gradient is all-reduced.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import collectives as C
from ..cuts import mark_cut
from ..mesh import as_group
from . import regions as ops
from .regions import SEQ_DIM


def check_divisible(what: str, size: int, t: int, fix: str = "") -> None:
    """Raise a ValueError saying what to do when ``size`` does not split over ``t`` ranks."""
    if size % t:
        ok = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size {t}: every rank must "
                         f"hold an equal share. Use a TP degree that divides {size} (one of {ok})"
                         + (f" or {fix}" if fix else "") + ".")


def sync_replicated_grad(param: nn.Parameter, group) -> None:
    """Sum ``param``'s gradient over the group as it is produced: for parameters replicated across the
    TP group but applied to sequence shards (LayerNorm, row-parallel bias under SP), each rank's
    gradient covers only its tokens (Korthikanti et al. 2022, Sec. 4.2.2)."""
    if C.group_size(group) == 1 or getattr(param, "sequence_parallel", False):
        return
    param.sequence_parallel = True

    def sum_over_group(grad: torch.Tensor) -> torch.Tensor:
        return C.all_reduce_sum(grad.clone(), group)
    param.register_hook(sum_over_group)


class GatheredLinears(torch.autograd.Function):
    """Sequence-parallel g fused with the column-parallel linears after it, saving only the shard.

        forward   x_shard (b, s/t, h) ──all-gather──> X (b, s, h) ──> Y_j = X W_j^T + b_j (b, s, out_j/t)
        backward  all-gather X again (the "regather"), dW_j = dY_j^T X, db_j = sum dY_j,
                  dX = sum_j dY_j W_j ──reduce-scatter──> (b, s/t, h)

    (attention's q, k, v share one gather.)

    Saving the shard (sbh/t) rather than X (sbh) is how Korthikanti et al. 2022 (Sec. 4.2.2) reach
    activation memory sbh(34 + 5as/h)/t, for one extra all-gather per region in the backward.

    The weight products dW_j = dY_j^T X, db_j = sum dY_j are one closure, ``param_grads``. Whoever drives
    backward may postpone them: set ``grad_fn.postpone`` (None from forward) to a list before backward,
    and backward computes dX only and appends ``(weights and biases, param_grads)`` there, keeping the
    gathered X and dY_j alive until the caller runs it.
    """

    @staticmethod
    def forward(ctx, x_shard, group, *weights_and_biases):
        ctx.group, ctx.params = group, weights_and_biases    # (w_1, b_1 or None, w_2, ...)
        ctx.postpone = None                                 # or a list: backward leaves dW, db there
        x = C.all_gather(x_shard, SEQ_DIM, group)
        ctx.save_for_backward(x_shard)
        return tuple(F.linear(x, w, b) for w, b in zip(weights_and_biases[::2], weights_and_biases[1::2]))

    @staticmethod
    def backward(ctx, *grads):
        (x_shard,) = ctx.saved_tensors
        x = C.all_gather(x_shard, SEQ_DIM, ctx.group)         # (b, s, h) again
        x2d = x.reshape(-1, x.shape[-1])
        g2ds = [g.reshape(-1, g.shape[-1]) for g in grads]     # dY_j: (b s, out_j/t)
        grad_x = sum(g2d @ w for g2d, w in zip(g2ds, ctx.params[::2]))             # (b s, h)
        grad_x = C.reduce_scatter(grad_x.view(x.shape), SEQ_DIM, ctx.group)

        def param_grads() -> list:                                                  # [dW_1, db_1, dW_2, ...]
            return [g for g2d, b in zip(g2ds, ctx.params[1::2])
                    for g in (g2d.t() @ x2d, g2d.sum(0) if b is not None else None)]

        if ctx.postpone is None:
            return (grad_x, None, *param_grads())
        ctx.postpone.append((list(ctx.params), param_grads))
        return (grad_x, None, *[None] * len(ctx.params))


def gathered_linears(x_shard: torch.Tensor, linears: list, group=None) -> tuple:
    """All-gather ``x_shard`` along the sequence, apply each linear's (weight, bias); save the shard only."""
    flat = [t for lin in linears for t in (lin.weight, lin.bias)]
    if C.group_size(group) == 1:
        return tuple(F.linear(x_shard, w, b) for w, b in zip(flat[::2], flat[1::2]))
    return GatheredLinears.apply(x_shard, group, *flat)


def _init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """Y_i = X W_i^T + b_i with W_i this rank's rows of W (output features); see the module docstring.

    ``gather_output``: all-gather the output features so every rank gets the full Y.
    ``sequence_parallel``: the input arrives as sequence shards (b, s/t, in) and is all-gathered.
    """

    def __init__(self, in_f: int, out_f: int, bias: bool = True, gather_output: bool = False, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        group = as_group(group)                          # a 1-D mesh: its process group
        t = C.group_size(group)
        check_divisible("out_features", out_f, t, "choose out_features divisible by the TP degree")
        self.in_features, self.out_features, self.tp = in_f, out_f, t
        self.gather_output, self.group = gather_output, group
        self.sequence_parallel = sequence_parallel and t > 1
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_f // t, in_f, **kw))
        self.bias = nn.Parameter(torch.empty(out_f // t, **kw)) if bias else None
        _init_like_linear(self.weight.data, None if self.bias is None else self.bias.data, in_f)
        mark_cut(self, group)                             # for dl.clip_grad_norm_ on bare parameters

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> "ColumnParallelLinear":
        """This rank's row block of a full ``nn.Linear`` (same outputs as the slice of ``linear``)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kw)
        with torch.no_grad():
            layer.weight.copy_(C.split(linear.weight, 0, layer.group))
            if layer.bias is not None:
                layer.bias.copy_(C.split(linear.bias, 0, layer.group))
        return layer

    @property
    def shard_dims(self) -> dict:
        """Which dimension of each parameter is split over the group (for gathering full weights)."""
        return {"weight": 0, "bias": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            (y,) = gathered_linears(x, [self], self.group)      # (b, s/t, in) -> (b, s, out/t)
        else:
            y = F.linear(ops.copy_to_region(x, self.group), self.weight, self.bias)
        return ops.gather_from_tensor(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.weight.shape[0]}), tp={self.tp}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Z = g(X_i W_i^T) + b with W_i this rank's columns of W (input features); see the module docstring.

    ``input_is_parallel=False``: the input is the full X and each rank takes its feature slice.
    ``sequence_parallel``: g is a reduce-scatter and the output is a sequence shard (b, s/t, out).
    """

    def __init__(self, in_f: int, out_f: int, bias: bool = True, input_is_parallel: bool = True, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        group = as_group(group)                          # a 1-D mesh: its process group
        t = C.group_size(group)
        check_divisible("in_features", in_f, t, "choose in_features divisible by the TP degree")
        self.in_features, self.out_features, self.tp = in_f, out_f, t
        self.input_is_parallel, self.group = input_is_parallel, group
        self.sequence_parallel = sequence_parallel and t > 1
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_f, in_f // t, **kw))
        self.bias = nn.Parameter(torch.empty(out_f, **kw)) if bias else None
        _init_like_linear(self.weight.data, None if self.bias is None else self.bias.data, in_f)
        mark_cut(self, group)                             # for dl.clip_grad_norm_ on bare parameters
        if self.bias is not None and self.sequence_parallel:
            sync_replicated_grad(self.bias, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> "RowParallelLinear":
        """This rank's column block of a full ``nn.Linear``; the bias is replicated."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kw)
        with torch.no_grad():
            layer.weight.copy_(C.split(linear.weight, 1, layer.group))
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    @property
    def shard_dims(self) -> dict:
        return {"weight": 1}            # bias replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = ops.split_to_tensor(x, self.group)
        partial = F.linear(x, self.weight)                     # (b, s, out): my share of the sum
        if self.sequence_parallel:
            z = ops.reduce_scatter_to_sequence(partial, self.group)   # (b, s/t, out)
        else:
            z = ops.reduce_from_region(partial, self.group)
        return z if self.bias is None else z + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, tp={self.tp}, sequence_parallel={self.sequence_parallel}")
