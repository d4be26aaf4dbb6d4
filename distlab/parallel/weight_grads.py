"""Weight-gradient work postponed from a backward pass to a later one (zero-bubble pipelining's W).

Zero-bubble schedules (Qi et al. 2023) split a layer's backward into I (dX = dY W, on the critical
path) and W (dW = dY^T X, free to fill idle time). A custom ``autograd.Function`` that holds its
weights directly (sequence parallelism's fused all-gather + linears) cannot be split from outside,
so it marks its weights (`DEFERS_WEIGHT_GRAD`) and, while a `WeightGradStore` is active, leaves its
dW work in the store for the W pass. Both tensor parallelism (which defers) and the pipeline
executor (which runs W) use this module; neither imports the other.
"""
from __future__ import annotations

import torch


DEFERS_WEIGHT_GRAD = "_distlab_defers_weight_grad"
"""Attribute set on a parameter whose custom ``autograd.Function`` hands its weight gradient to the
active `WeightGradStore` (so `WeightUses` does not differentiate it in I)."""


class WeightGradStore:
    """Weight-gradient work that a custom ``autograd.Function`` postpones from I to W.

    `WeightUses` cannot isolate a weight that a custom Function holds directly (sequence parallelism's
    fused all-gather + linears, `tensor.regions.GatheredLinears`): its backward yields dX and dW from one
    node. Such a Function marks its weights (`DEFERS_WEIGHT_GRAD`) and, while a store is active (the
    I pass), computes dX only and leaves ``compute() -> [dW, db, ...]`` here, holding the tensors it
    needs (the gathered input and dY); W runs it. Megatron's zero-bubble ``WeightGradStore`` does the
    same for its fused linears.
    """

    _active: list["WeightGradStore"] = []        # not thread-local: CUDA autograd runs on its own threads

    def __init__(self):
        self.work: list[tuple[list, object]] = []

    def __enter__(self) -> "WeightGradStore":
        WeightGradStore._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        WeightGradStore._active.remove(self)

    @classmethod
    def current(cls) -> "WeightGradStore | None":
        return cls._active[-1] if cls._active else None

    def defer(self, params: list, compute) -> None:
        """Keep ``compute() -> gradients`` for ``params`` (None entries allowed) until `run`."""
        self.work.append((params, compute))

    def run(self) -> list[tuple[object, torch.Tensor]]:
        """Run the postponed work: (parameter, gradient) pairs; the store is then empty."""
        out = [(p, g) for params, compute in self.work for p, g in zip(params, compute())
               if p is not None and g is not None]
        self.work = []
        return out


def accumulate_grads(params, grads, hooks: bool = True) -> None:
    """Add ``grads`` to ``.grad`` as ``backward()`` would, after each parameter's own hooks
    (``register_hook``), which autograd does not run for the aliases W differentiates."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        for hook in (getattr(p, "_backward_hooks", None) or {}).values() if hooks else ():
            changed = hook(g)
            g = g if changed is None else changed
        p.grad = g if p.grad is None else p.grad + g
