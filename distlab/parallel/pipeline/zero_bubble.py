"""Zero-bubble pipelining's split backward (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

A layer's backward is two independent products: the input gradient dX = dY W^T, which the previous
stage is waiting for (I, on the critical path), and the weight gradient dW = dY^T X, which nobody
waits for (W, free to fill the pipeline's idle slots). ZB-H1 runs I as soon as it can and delays W.

To compute W without re-running anything else, every use of a weight during the forward is recorded
(`WeightUses`): the op gets a private alias of the parameter, so W can differentiate that op's output
with respect to that alias alone. Differentiating the stage output instead would re-run the whole
backward, and with it every collective inside the stage (the tensor-parallel f/g all-reduces).

A custom ``autograd.Function`` that holds its weights directly (sequence parallelism's fused all-gather +
linears, `distlab.parallel.tensor.linear.GatheredLinears`) yields dX and dW from one node, so it cannot be
split from outside. Such a Function offers a slot on its node, ``ctx.postpone`` (`POSTPONE`, None by
default): given a list before backward, its backward computes dX only and appends ``(weights,
compute)`` there, ``compute() -> [dW, db, ...]`` holding the tensors it needs. The I pass gives every such
node of the microbatch's graph one list (`postpone_weight_work`), the W pass runs it (`run_postponed`):
the deferral state belongs to the microbatch's stash, nothing global (Megatron's zero-bubble
``WeightGradStore`` plays this part for its fused linears).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode


POSTPONE = "postpone"
"""The node slot of a custom ``autograd.Function`` that can leave its weight-gradient work for later: None
(compute it in backward, the default its forward sets) or a list to append ``(weights, compute)`` to."""


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
        self.postponing: list = []                         # nodes that can postpone their weight work

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
        took them directly) and whose Function cannot postpone their gradient (no `POSTPONE` slot). Their
        gradient is computed in I over every use, so their aliased uses leave the W list. The nodes that
        can postpone are kept in ``postponing``."""
        raw, seen, stack = set(), set(), [output.grad_fn]
        self.postponing = []
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            can_postpone = hasattr(node, POSTPONE)
            if can_postpone:
                self.postponing.append(node)
            for child, _ in node.next_functions:
                if child is None:
                    continue
                variable = getattr(child, "variable", None)
                if variable is not None:
                    if id(variable) in self.params and node not in self.alias_nodes and not can_postpone:
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


def postpone_weight_work(nodes: list) -> list:
    """Give every node that can postpone its weight gradients (`POSTPONE`) one list to leave them in."""
    work: list = []
    for node in nodes:
        setattr(node, POSTPONE, work)
    return work


def run_postponed(work: list) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Run the weight-gradient work nodes postponed: (parameter, gradient) pairs; ``work`` is then empty."""
    out = [(p, g) for params, compute in work for p, g in zip(params, compute())
           if p is not None and g is not None]
    work.clear()
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
