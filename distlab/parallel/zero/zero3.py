"""ZeRO stage 3: parameters sharded at rest, gathered one *unit* at a time (Rajbhandari et al. 2020,
Sec. 5.3).

A unit is a submodule (each transformer block; the root keeps the rest: embeddings, final norm,
head). Its parameters live in one flat padded buffer (`FlatBucket`) whose storage is *freed*
(``untyped_storage().resize_(0)``) except while the unit computes; each rank keeps only its shard.

    forward   unit i:  all-gather params -> compute -> free                 (N-1)/N Psi in all
    backward  unit i:  all-gather params -> compute grads -> reduce-scatter grads -> free
                                                                           (N-1)/N Psi + (N-1)/N Psi
    total per step: 3 (N-1)/N Psi, 1.5x DDP's, for model states of (2+2+K) Psi / N per rank.

The model side owns the flat buffers (``ZeRO3.buckets``, one per unit) and keeps this rank's chunk of
each (``ZeRO3.shards``); it hands the shards to its optimizer (`shards.ShardsFromBackward`), which
updates them in place.
Hooks: a forward pre-hook gathers, a forward hook frees and puts a gradient hook on the unit's
output, which fires just before autograd enters the unit's backward (gather again); a
post-accumulate-grad hook on the unit's last parameter frees the parameters and reduce-scatters the
gradients through the optimizer's `GradReducer`. Every transient buffer, a gathered unit or a unit's
flat gradients, is allocated only after the reducer has made room (`GradReducer.make_room`: the
oldest reduce-scatters waited for and their flat buffers freed until fewer than ``max_inflight``
remain), so ZeRO-3's ``buffers`` stay about max_inflight units (plus the root, gathered through the whole
backward, and any prefetched unit), never a whole gradient:

    backward, max_inflight = 1     gathered           flat gradients in flight
      unit 2: gather, compute       root, unit 2       -
              grads ready           root               unit 2     (params freed, then grads packed)
      unit 1: gather, compute       root, unit 1       -          (unit 2's reduce-scatter retired first)
              grads ready           root               unit 1

Autograd's saved references to the parameters are views into the same storage, so they see the
re-gathered values. Activation recomputation (``torch.utils.checkpoint`` around a unit, reentrant or
not) re-runs the unit's forward, hooks included, *inside* backward (`in_recomputation`): the unit is
gathered and stays gathered until its gradients are ready, and nothing is prefetched for a forward
that is not coming.
``prefetch=True`` starts the next unit's all-gather (in forward, or backward, order) early.

Under ``no_sync()`` a unit's gradients are *not* reduce-scattered: they stay
unsharded in ``p.grad``, where autograd sums the next micro-steps, until a synced backward (or the
optimizer's step) reduce-scatters the sum. The parameters are still gathered and freed per unit.

This is what PyTorch FSDP does (Zhao et al. 2023, "PyTorch FSDP"); FSDP2's ``fully_shard`` shards
per parameter instead of per flat unit, with the same communication volume.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..quantized_collectives import collectives, exact
from ..data.backward_hooks import BackwardWatcher
from ..data.buckets import FlatBucket
from ..data.ddp import broadcast_from_rank0
from .shards import ShardsFromBackward
from .zero1 import ZeROModule


def default_units(module: nn.Module) -> list[nn.Module]:
    """Every child of an ``nn.ModuleList`` (transformer blocks, MLP layers), then the root for the rest."""
    units = [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]
    return units + [module]


def unit_params(units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each unit's trainable parameters, excluding those of units nested inside it; each parameter once."""
    seen: set[int] = set()
    out = []
    for unit in units:                       # inner units first, so the root gets only what is left
        params = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        out.append(params)
    return out


class ZeRO3(ZeROModule):
    """``ZeRO3(module, torch.optim.AdamW, lr=1e-3)``: parameters, gradients and optimizer state sharded.

    ``units``: the gather units (default: the children of every ``nn.ModuleList``, then the root);
    ``prefetch``: gather the next unit early; ``max_inflight``: transient buffers alive at once
    (gathered units and flat gradients waiting for their reduce-scatter, `GradReducer`);
    ``quantize``: "int8" or "fp8", parameters all-gathered and gradients reduce-scattered as block-scaled
    packets (ZeRO++'s qwZ and qgZ, `..quantized_collectives`); the shards and the optimizer stay fp32.
    """

    stage = 3

    def __init__(self, module: nn.Module, optim: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 units: list[nn.Module] | None = None, prefetch: bool = False, comm: str = "torch",
                 group=None, max_inflight: int = 1, quantize: str | None = None, **optim_kwargs):
        super().__init__()
        self.module, self.prefetch = module, prefetch
        self.comm = collectives(comm, group, quantize)
        broadcast_from_rank0(module, self.comm)           # identical starting point on every rank
        units = units if units is not None else default_units(module)
        groups = unit_params(units)
        self.units = [u for u, g in zip(units, groups) if g]
        # the model's flat buffers, one per unit (its parameters become views into it); at rest each
        # rank keeps only chunk `rank` of each, and the buffers' storage is freed
        self.buckets = [FlatBucket(g, self.comm.size) for g in groups if g]
        self.shards = [b.chunk(b.full, self.comm.rank).clone() for b in self.buckets]   # (padded / N,) each
        for b in self.buckets:
            _free(b.full)
        self.optimizer = ShardsFromBackward(self.buckets, self.shards, optim, self.comm, max_inflight,
                                            sharded_params=True, **optim_kwargs)
        self.reducer = self.optimizer.reducer      # flat gradient units being reduce-scattered
        self._sync = True                           # False under no_sync(): keep gradients local
        self._gathers: dict[int, object] = {}      # unit -> pending all-gather handle
        self._live: set[int] = set()                # units whose full parameters are allocated
        self._fwd_order: list[int] = []
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
            unit.register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))
        # gradients complete in reverse forward order, the root (embeddings) last
        self._bwd_order = list(reversed(range(len(self.units) - 1))) + [len(self.units) - 1]
        self.watcher = BackwardWatcher([self.buckets[i].params for i in self._bwd_order],
                                       on_ready=lambda k: self._grads_ready(self._bwd_order[k]),
                                       on_end=self._backward_done)

    # -- gather and free -----------------------------------------------------------------------
    def gather(self, i: int, async_op: bool = False) -> None:
        """All-gather unit i's shards into its flat buffer: every rank's parameters of the unit."""
        if i in self._live or i in self._gathers:
            if not async_op and i in self._gathers:
                self._gathers.pop(i).wait()
            return
        b = self.buckets[i]
        self.reducer.make_room()                    # a gathered unit takes an in-flight slot too
        _alloc(b.full)
        self._live.add(i)
        handle = self.comm.all_gather(b.full.data, self.shards[i], async_op=async_op)
        if async_op:
            self._gathers[i] = handle

    def free(self, i: int) -> None:
        if i in self._gathers:
            self._gathers.pop(i).wait()
        if i in self._live:
            _free(self.buckets[i].full)
            self._live.discard(i)

    def gather_all(self) -> None:
        for i in range(len(self.buckets)):
            self.gather(i)

    def free_all(self) -> None:
        for i in range(len(self.buckets)):
            self.free(i)

    def gathered(self) -> list[torch.Tensor]:
        """The flat buffers of the units gathered now."""
        return [self.buckets[i].full for i in sorted(self._live)]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, cloned, on every rank (a collective)."""
        self.free_all()                             # gathered exactly, even where the steps quantize
        with exact(self.comm):
            self.gather_all()
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        self.free_all()
        return state

    # -- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, i: int) -> None:
        if in_recomputation():                      # checkpoint re-running the unit: gather, prefetch nothing
            self.gather(i)
            return
        if torch.is_grad_enabled() and i not in self._fwd_order:
            self._fwd_order.append(i)
        self.gather(i)
        if self.prefetch:
            nxt = self._neighbour(i, +1)
            if nxt is not None:
                self.gather(nxt, async_op=True)

    def _post_forward(self, i: int, out) -> None:
        if not in_recomputation():                  # recomputed: backward needs them (freed in _grads_ready)
            self.free(i)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, i=i: self._pre_backward(i))

    def _pre_backward(self, i: int) -> None:
        self.gather(i)
        if self.prefetch:
            prev = self._neighbour(i, -1)
            if prev is not None:
                self.gather(prev, async_op=True)

    def _neighbour(self, i: int, direction: int) -> int | None:
        if i not in self._fwd_order:
            return None
        k = self._fwd_order.index(i) + direction
        return self._fwd_order[k] if 0 <= k < len(self._fwd_order) else None

    def _grads_ready(self, i: int) -> None:
        """Unit i's gradients are complete: free its gathered parameters (backward no longer needs them),
        then reduce-scatter its gradients into this rank's shard (``p.grad`` dropped; the flat copy freed
        once the reduce-scatter is retired). Under no_sync: only the free; ``p.grad`` keeps the gradients."""
        self.free(i)
        if self._sync:
            self.reducer.submit(i, self.buckets[i], async_op=True)

    def _backward_done(self) -> None:
        self.reducer.drain()
        self.free_all()


def in_recomputation() -> bool:
    """Whether a forward running now is an activation recomputation: autograd's engine is running a
    backward on this thread (``torch.utils.checkpoint`` re-runs a module's forward, hooks included,
    inside backward; torch's FSDP2 asks the same through its PRE_BACKWARD state). Such a forward needs
    its parameters at once and until its gradients are in, and no next unit's forward is coming."""
    return torch._C._current_graph_task_id() != -1


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)
