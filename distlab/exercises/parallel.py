"""Exercises of lessons 03 (ZeRO) and 04 (tensor parallelism): the steps that make a strategy, written
with torch.distributed's collectives and checked on real ranks against one process holding everything.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.exercises.harness import Exercise, compare_tensors, register
from distlab.exercises.comm import rank_input

HIDDEN = 8


def _seeded(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# -- lesson 03: the ZeRO-1 step -------------------------------------------------------------------
def zero1_step(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """One SGD step of ZeRO-1 on a flat parameter, in place: reduce-scatter the gradient (each rank gets
    the average of its 1/N chunk), update that chunk only, all-gather the parameters. The flat buffers
    are padded to a multiple of N so every chunk has the same size (Rajbhandari et al. 2020, P_os)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunk = -(-param.numel() // n)                                   # ceil(numel / N)
    padded_grad = F.pad(grad.flatten(), (0, chunk * n - grad.numel()))
    padded_param = F.pad(param.flatten(), (0, chunk * n - param.numel()))
    mine = torch.empty(chunk)
    dist.reduce_scatter_tensor(mine, padded_grad)                    # sum of chunk r over ranks
    shard = padded_param[r * chunk:(r + 1) * chunk] - lr * mine / n  # the local optimizer step
    dist.all_gather_into_tensor(padded_param, shard.contiguous())
    param.copy_(padded_param[: param.numel()].view_as(param))
    return param


def _zero1_run(fn, case):
    r = dist.get_rank()
    param = rank_input({"seed": case["seed"], "numel": case["numel"]}, 0)      # equal on every rank
    grad = rank_input({"seed": case["seed"] + 50, "numel": case["numel"]}, r)  # each rank its own
    out, calls = collectives_during(lambda: fn(param, grad, 0.5))
    return {"out": out, "calls": calls}


def _zero1_expect(case, r, n):
    param = rank_input({"seed": case["seed"], "numel": case["numel"]}, 0)
    mean = sum(rank_input({"seed": case["seed"] + 50, "numel": case["numel"]}, k) for k in range(n)) / n
    return {"out": param - 0.5 * mean, "n": n}


def _zero1_compare(got, expected):
    if "all_reduce" in got["calls"] and expected["n"] > 1:
        return ("called all_reduce: ZeRO-1 reduce-scatters the gradient (each rank keeps the average of its "
                "chunk) and all-gathers the updated parameters instead")
    return compare_tensors(got["out"], expected["out"])


register(Exercise(
    name="zero1_step", lesson="03",
    task="zero1_step(param, grad, lr) -> param after one SGD step with the gradient averaged over ranks, by "
         "reduce-scatter, a step on this rank's chunk, all-gather (no all-reduce)",
    reference=zero1_step,
    cases=lambda n: [{"label": f"{k} parameters", "numel": k, "seed": i} for i, k in enumerate((4, 7, 30))],
    run=_zero1_run, expect=_zero1_expect, compare=_zero1_compare,
    hint="pad both flat tensors to a multiple of N (F.pad), dist.reduce_scatter_tensor the gradient into a "
         "chunk and divide by N, step your chunk of the parameters, dist.all_gather_into_tensor them back, "
         "then copy the unpadded part into param"))


def collectives_during(call):
    """``call()`` and the names of the torch.distributed collectives it made on this rank."""
    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter")
    saved, calls = {name: getattr(dist, name) for name in names}, []

    def counted(name):
        def call_it(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)
        return call_it
    for name in names:
        setattr(dist, name, counted(name))
    try:
        return call(), calls
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


# -- lesson 03/09: gathering a padded shard -------------------------------------------------------
def gather_full(shard: torch.Tensor, numel: int) -> torch.Tensor:
    """The full flat parameter from every rank's shard: rank r holds elements [r c, (r+1) c) of the
    parameter padded to N c elements, c = ceil(numel / N); all-gather, then drop the padding (FSDP's
    unshard, Zhao et al. 2023)."""
    n = dist.get_world_size()
    full = torch.empty(shard.numel() * n, dtype=shard.dtype)
    dist.all_gather_into_tensor(full, shard.contiguous())
    return full[:numel]


def _shard_of(case, r, n):
    full = rank_input(case, 0)
    c = -(-case["numel"] // n)
    return F.pad(full, (0, c * n - full.numel()))[r * c:(r + 1) * c].clone()


register(Exercise(
    name="gather_full", lesson="03",
    task="gather_full(shard, numel) -> the full flat parameter (numel elements) from every rank's padded "
         "shard of ceil(numel / N) elements",
    reference=gather_full,
    cases=lambda n: [{"label": f"{k} elements", "numel": k, "seed": i} for i, k in enumerate((1, 6, 7, 13))],
    run=lambda fn, case: fn(_shard_of(case, dist.get_rank(), dist.get_world_size()), case["numel"]),
    expect=lambda case, r, n: rank_input(case, 0),
    hint="allocate N x shard.numel() elements, dist.all_gather_into_tensor into it, and return the first "
         "numel: the last rank's shard ends with padding"))


# -- lesson 04: Megatron's f and g ----------------------------------------------------------------
def tp_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Z = GeLU(X A) B with A split by columns (``w1``: this rank's (h, 4h/t)) and B by rows (``w2``:
    (4h/t, h)): f before the column linear (identity forward, all-reduce backward), g after the row
    linear (all-reduce forward, identity backward), as autograd Functions (Shoeybi et al. 2019)."""
    class CopyToRegion(torch.autograd.Function):           # f
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
            return grad

    class ReduceFromRegion(torch.autograd.Function):       # g
        @staticmethod
        def forward(ctx, x):
            x = x.contiguous().clone()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    return ReduceFromRegion.apply(F.gelu(CopyToRegion.apply(x) @ w1) @ w2)


def _tp_weights(seed, n):
    return _seeded(seed, HIDDEN, 4 * HIDDEN, scale=0.3), _seeded(seed + 1, 4 * HIDDEN, HIDDEN, scale=0.3)


PARTS = ("the output Z", "dL/dX", "your dL/dA_i (w1.grad)", "your dL/dB_i (w2.grad)")


def _tp_run(fn, case):
    n, r = dist.get_world_size(), dist.get_rank()
    a, b = _tp_weights(case["seed"], n)
    x = _seeded(case["seed"] + 2, case["rows"], HIDDEN).requires_grad_()
    w1 = a.chunk(n, dim=1)[r].clone().requires_grad_()
    w2 = b.chunk(n, dim=0)[r].clone().requires_grad_()
    z = fn(x, w1, w2)
    (z * _seeded(case["seed"] + 3, *z.shape)).sum().backward()     # a loss that weighs every output
    return [t if t is None else t.detach() for t in (z, x.grad, w1.grad, w2.grad)]


def _tp_expect(case, r, n):
    a, b = _tp_weights(case["seed"], n)
    a.requires_grad_(), b.requires_grad_()
    x = _seeded(case["seed"] + 2, case["rows"], HIDDEN).requires_grad_()
    z = F.gelu(x @ a) @ b
    (z * _seeded(case["seed"] + 3, *z.shape)).sum().backward()
    return [z.detach(), x.grad, a.grad.chunk(n, dim=1)[r], b.grad.chunk(n, dim=0)[r]]


def _tp_compare(got, expected):
    for part, mine, right in zip(PARTS, got, expected):
        problem = f"no gradient reached {part}" if mine is None else compare_tensors(mine, right, atol=1e-4)
        if problem:
            return f"{part}: {problem}"
    return None


register(Exercise(
    name="tp_mlp", lesson="04",
    task="tp_mlp(x, w1, w2) -> GeLU(x @ A) @ B on t ranks, w1 this rank's columns of A and w2 its rows of B, "
         "with Megatron's f and g written as torch.autograd.Function (forward and backward)",
    reference=tp_mlp,
    cases=lambda n: [{"label": f"{k} rows", "rows": k, "seed": i} for i, k in enumerate((1, 5))],
    run=_tp_run, expect=_tp_expect, compare=_tp_compare, world_sizes=(1, 2, 4),
    hint="f: forward returns x unchanged, backward all-reduces the gradient; g: forward all-reduces the "
         "partial products, backward passes the gradient through; tp_mlp = g(gelu(f(x) @ w1) @ w2)"))


# -- lesson 04: vocabulary-parallel cross-entropy -------------------------------------------------
def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 vocab_start: int) -> torch.Tensor:
    """The mean cross-entropy over tokens when each rank holds the logits of its vocabulary slice
    [vocab_start, vocab_start + V_r) (Megatron-LM): three all-reduces of one number per token (the
    max, for stability; the sum of exponentials; the target's logit, from the rank that holds it)."""
    top = logits.max(dim=-1).values                                   # (T,)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = logits - top[:, None]                                   # every exponent <= 0: no overflow
    total = shifted.exp().sum(dim=-1)
    dist.all_reduce(total)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = torch.zeros_like(total)
    picked[mine] = shifted[mine, local[mine]]
    dist.all_reduce(picked)
    return (total.log() - picked).mean()


VOCAB = 10                            # splits unevenly over 3 and 4 ranks


def _vocab_case(seed: int, scale: float) -> dict:
    return {"label": f"logits scaled by {scale:g}", "seed": seed, "scale": scale}


def _vocab_inputs(case):
    logits = _seeded(case["seed"], 6, VOCAB, scale=case["scale"])
    targets = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(case["seed"] + 1))
    return logits, targets


def _vocab_run(fn, case):
    n, r = dist.get_world_size(), dist.get_rank()
    logits, targets = _vocab_inputs(case)
    pieces = torch.tensor_split(logits, n, dim=-1)
    start = sum(p.shape[-1] for p in pieces[:r])
    return fn(pieces[r].contiguous(), targets, start).reshape(())


register(Exercise(
    name="vocab_parallel_cross_entropy", lesson="04",
    task="vocab_parallel_cross_entropy(logits, targets, vocab_start) -> the mean cross-entropy, each rank "
         "holding the logits of vocabulary ids [vocab_start, vocab_start + logits.shape[-1])",
    reference=vocab_parallel_cross_entropy,
    cases=lambda n: [_vocab_case(0, 1.0), _vocab_case(1, 30.0), _vocab_case(2, 200.0)],
    run=_vocab_run,
    expect=lambda case, r, n: F.cross_entropy(*_vocab_inputs(case)).reshape(()),
    atol=1e-4,
    hint="all-reduce (MAX) each token's largest logit and subtract it; all-reduce the sum of exponentials; "
         "the rank whose slice holds the target contributes its logit (the others 0) to a third all-reduce; "
         "loss = log(sum) - target logit, averaged over tokens"))
