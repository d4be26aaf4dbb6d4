"""Zero-bubble pipelining's split backward (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

A layer's backward is two independent products: the input gradient dX = dY W^T, which the previous
stage is waiting for (I, on the critical path), and the weight gradient dW = dY^T X, which nobody
waits for (W, free to fill the pipeline's idle slots). ZB-H1 runs I as soon as it can and delays W.

To compute W without re-running anything else, every use of a weight during the forward is recorded
(`WeightUses`): the op gets a private alias of the parameter, so W can differentiate that op's output
with respect to that alias alone. Differentiating the stage output instead would re-run the whole
backward, and with it every collective inside the stage (the tensor-parallel f/g all-reduces).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..weight_grads import DEFERS_WEIGHT_GRAD


class WeightUses(TorchFunctionMode):
    """While active, every torch operation that takes one of ``module``'s parameters gets a fresh alias
    of it (``p.view_as(p)``) instead; the op's output and its aliases are recorded in ``deferred``.

    The W pass then differentiates each output with respect to its own aliases only: the one op that
    consumed the weight, whatever else (communication, other layers, a tied use elsewhere) lies
    upstream. Inside a custom ``autograd.Function``'s forward, grad mode is off and the mode leaves
    parameters alone: such a Function holds its weights directly (see `unseen_parameters`).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.params = {id(p): p for p in module.parameters() if p.requires_grad}
        self.deferred: list[tuple[tuple, list]] = []      # (outputs y, [(param, alias), ...]) per use
        self.alias_nodes: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled() or not self.params:
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":     # attributes: alias only graph-connected views (.T)
            out = func(*args, **kwargs)
            if not (isinstance(out, torch.Tensor) and out.grad_fn is not None and id(args[0]) in self.params):
                return out
        aliases: dict[int, tuple] = {}

        def swap(x):
            if isinstance(x, torch.Tensor):
                if id(x) not in self.params:
                    return x
                if id(x) not in aliases:
                    alias = x.view_as(x)
                    self.alias_nodes.add(alias.grad_fn)
                    aliases[id(x)] = (x, alias)
                return aliases[id(x)][1]
            if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
                return type(x)(swap(t) for t in x)     # torch.cat([...]) and friends
            return x

        args = tuple(swap(a) for a in args)
        kwargs = {k: swap(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if aliases:
            outs = out if isinstance(out, (list, tuple)) else (out,)
            ys = tuple(t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad)
            if ys:
                self.deferred.append((ys, list(aliases.values())))
        return out

    def unseen_parameters(self, output: torch.Tensor) -> list[nn.Parameter]:
        """Parameters the graph of ``output`` reaches other than through an alias (a custom Function
        took them directly) and that their Function does not defer to a `WeightGradStore`. Their
        gradient is computed in I over every use, so their aliased uses leave the W list."""
        raw, seen, stack = set(), set(), [output.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for child, _ in node.next_functions:
                if child is None:
                    continue
                variable = getattr(child, "variable", None)
                if variable is not None:
                    if (id(variable) in self.params and node not in self.alias_nodes
                            and not getattr(variable, DEFERS_WEIGHT_GRAD, False)):
                        raw.add(id(variable))
                elif child not in seen:
                    stack.append(child)
        if raw:
            keep = []
            for ys, aliases in self.deferred:
                aliases = [(p, a) for p, a in aliases if id(p) not in raw]
                if aliases:
                    keep.append((ys, aliases))
            self.deferred = keep
        self.alias_nodes = set()
        return [self.params[i] for i in raw]
