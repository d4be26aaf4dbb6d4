"""Which module issued a collective: ``where=<module name>`` attached from outside, by hooks.

The layers of a parallel model pass no labels (algorithms carry no instrumentation); a strategy, lesson
or test calls `label_modules(model)` and every traced collective (`collectives.record`) issued inside
a submodule, in its forward or in the backward of what it computed, is tagged with that submodule's
name: the forward through a scope (`collectives.scope`), the backward through the metadata of the
autograd nodes the forward made, which `collectives.derived_tags` reads while the engine runs them.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from .collectives import scope


def label_modules(model: nn.Module) -> list:
    """Tag every collective issued inside a submodule of ``model`` with ``where=<its name>``, from outside
    (a strategy, lesson or test calls it, never the layers); returns the hook handles.
    forward   a pre-hook opens ``scope(where=name, phase="forward")``, the forward hook closes it
              (nested modules: the innermost name wins);
    backward  the forward hook writes ``name`` into the metadata of each autograd node the module created
              and of the gradient accumulators of its parameters: `collectives.derived_tags` reads it from
              the node the engine runs (backward collectives, parameter gradient hooks, recomputation alike).
    """
    handles, running = [], []      # running: (scope, first autograd node number) of each module in forward
    for name, module in model.named_modules():
        if name:
            handles += [module.register_forward_pre_hook(partial(_enter, name, running)),
                        module.register_forward_hook(partial(_leave, name, running), always_call=True)]
    return handles


def _enter(name: str, running: list, module, args) -> None:
    tags = scope(where=name, phase="forward")
    tags.__enter__()
    running.append((tags, torch._C._autograd._get_sequence_nr()))     # the next node's number


def _leave(name: str, running: list, module, args, output) -> None:
    tags, first = running.pop()
    tags.__exit__(None, None, None)
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    _label_nodes([t.grad_fn for t in outputs if isinstance(t, torch.Tensor)], name, first)


def _label_nodes(stack: list, name: str, first: int) -> None:
    """``metadata["where"] = name`` on the nodes reachable from ``stack`` numbered ``first`` or later
    (created in this forward; inner modules labelled theirs first) and on the accumulators they feed."""
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):                   # AccumulateGrad: a leaf's gradient lands here
            node.metadata.setdefault("where", name)
        elif node._sequence_nr() >= first:
            node.metadata.setdefault("where", name)
            stack += [child for child, _ in node.next_functions]
