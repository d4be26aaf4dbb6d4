"""Activation recomputation for any module (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; Korthikanti et al. 2022, Sec. 4, Megatron's "full" recomputation):

    for block in model.blocks:
        dl.recompute(block)       # forward keeps only each block's inputs; backward runs the block again

    forward                      backward of the block
    x ──[block]──> y             rebuild: y' = block(x) (its activations saved again, for this block only)
    keeps x                      then its backward as usual, and the rebuilt activations are freed

Activation memory per block falls from everything its forward saves to its inputs, for one more forward
of compute. The module's ``forward`` runs under ``torch.utils.checkpoint`` (non-reentrant) whenever grad
is enabled; the module's own hooks stay outside the checkpoint (torchtitan's order,
``fully_shard(checkpoint_wrapper(block))``), so a wrapper that gathers parameters in its hooks (`fully_shard`,
``ZeRO(stage=3)``) does it once before forward and once before backward, whichever of ``dl.recompute``
and the wrapper came first. The memory ledger counts what the recomputation saves again
(`recompute_context`, the checkpoint's ``context_fn``, into the run's `memory.SavedTensors`).
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from .memory import SavedTensors
from .runtime import current_run


def recompute(module: nn.Module) -> nn.Module:
    """Mark ``module`` for activation recomputation, in place (its ``forward`` replaced on the instance);
    returns it. Calling it again changes nothing."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"dl.recompute takes an nn.Module (a block of a model), got {type(module).__name__}")
    if not isinstance(module.__dict__.get("forward"), Recomputed):
        module.forward = Recomputed(module)
    return module


class Recomputed:
    """A module's forward under ``torch.utils.checkpoint``: the module's class forward (or the forward it
    had on the instance before), run again in backward. Holds the module, not a bound method, so a
    ``copy.deepcopy`` of the module recomputes its own copy."""

    def __init__(self, module: nn.Module):
        self.module, self.inner = module, module.__dict__.get("forward")

    def run(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():                 # no backward coming: nothing to save or rebuild
            return self.run(*args, **kwargs)
        return checkpoint(partial(self.run, **kwargs), *args, use_reentrant=False,
                          context_fn=recompute_context)


def recompute_context():
    """``torch.utils.checkpoint``'s ``context_fn`` for a recomputing module (`recompute`; `models.Block`,
    attached by the strategies): forward as usual; in the recomputation, what it saves again for backward
    is counted by the memory ledger of the run in progress (saved-tensor hooks cannot see it: the
    checkpoint's own take those tensors); with no ledger, counted nowhere. Under a dry run's emulated
    autocast (`strategies.dry.MetaAutocast`) the recomputation runs under it again, as torch's checkpoint
    does for ``torch.autocast``, so it rebuilds the bf16 tensors forward saved."""
    saved, cast = current_run().saved_tensors, current_run().dry_autocast
    return contextlib.nullcontext(), _rebuilding(saved, cast)


@contextlib.contextmanager
def _rebuilding(saved: SavedTensors | None, cast):
    """The recomputation's context: counted into ``saved``, under ``cast()`` (a dry run's emulated
    autocast, which torch's checkpoint cannot restore as it restores ``torch.autocast``)."""
    with contextlib.ExitStack() as stack:
        if cast is not None:
            stack.enter_context(cast())
        if saved is not None:
            stack.enter_context(_Rebuilt(saved))
        yield


class _Rebuilt(TorchDispatchMode):
    """Counts into a `SavedTensors`, while they live, the tensors a recomputation saves for backward: the
    checkpoint keeps ``x.detach()`` of each (a parameter's is no activation; temporaries are not saved)."""

    def __init__(self, saved: SavedTensors):
        super().__init__()
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.detach.default and not (args[0].is_leaf and args[0].requires_grad):
            self.saved.count(out, out)             # what the checkpoint keeps: x.detach() of each saved x
        self.saved.rebuilt_peak = max(self.saved.rebuilt_peak, self.saved.current)
        return out
