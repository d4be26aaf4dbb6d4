"""The machinery of `fsdp.fully_shard`: one parameter's shard (`ShardedParam`), one module's unit
(`FSDPUnit`: gather before forward and backward, free after, reduce-scatter the gradients), the coordinator
of the units a root drives (forward order for prefetching, the shared reduce-scatter queue), and the autograd
function that hands the gathered parameters to the module (`_Unshard`).

One unit's all-gather, with S the padded elements per rank of the unit (sum of its parameters' chunks):

    copy-in    send = [ W0 rows r c.. | pad | W1 rows r c.. | pad ]           (S,)   this rank's shards
    gather     out  = send of rank 0, rank 1, ..., rank N-1                  (N, S)
    copy-out   W0   = out[:, 0:c0 k0].reshape(-1)[:numel].view(shape)         per parameter, contiguous

The reduce-scatter runs the same picture backwards on the gradients (packed into (N, S), averaged,
rank r keeps row r), through `reducer.GradReducer`: ZeRO's bounded queue of reduce-scatters.

Activation recomputation (Chen et al. 2016; ``torch.utils.checkpoint``) runs a forward again inside
backward. Around a unit (``checkpoint(block, x)``) the unit's own hooks run again: `FSDPUnit._recompute`
shows the module its gathered tensors, prefetches nothing (no forward is coming: a prefetch there would
be consumed by the next step's forward, with the pre-step weights) and keeps them until the gradients
are reduced. Inside a unit (``fully_shard(checkpoint_wrapper(block))``) only its modules run again:
the pre-backward hook has put the gathered tensors in them. A forward without grad between a forward
and its backward refills the tensors that backward saved instead of replacing them.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.autograd import Variable

from ..flat_collectives import Collectives
from .reducer import GradReducer
from .zero3 import _alloc, _free, _tensors, in_recomputation


class ShardedParam:
    """One parameter's dim-0 shard: ``shard`` (local rows, master dtype), the slots (module, name) it
    fills (tied weights: several), and ``full`` (the gathered tensor, storage freed at rest)."""

    def __init__(self, p: nn.Parameter, slots: list, n: int, r: int):
        self.slots, self.shape, self.dtype = slots, tuple(p.shape), p.dtype
        self.rows = math.ceil(self.shape[0] / n)                      # c: padded rows per rank
        self.inner = p[0].numel() if self.shape[0] else 0             # elements per row
        lo = min(r * self.rows, self.shape[0])
        self.local_rows = min(lo + self.rows, self.shape[0]) - lo
        self.shard = nn.Parameter(p.detach()[lo:lo + self.local_rows].clone(), requires_grad=p.requires_grad)
        self.shard._fsdp_shard = True                                 # marks "already sharded"
        self.full: torch.Tensor | None = None
        self.accum: torch.Tensor | None = None                        # no_sync: the unsharded grad sum

    @property
    def chunk(self) -> int:
        return self.rows * self.inner                                 # elements per rank, padded

    def padded(self, t: torch.Tensor, dtype) -> torch.Tensor:
        """(rows, ...) -> flat (chunk,): ``t`` in ``dtype`` with zero rows appended."""
        out = torch.zeros(self.chunk, dtype=dtype, device=t.device)
        out[:t.numel()] = t.reshape(-1)
        return out

    def unpad(self, rows: torch.Tensor) -> torch.Tensor:
        """(N, chunk), every rank's padded piece -> the full parameter (a view where it can)."""
        return rows.reshape(-1)[:math.prod(self.shape)].view(self.shape)

    def install(self, tensor) -> None:
        for m, name in self.slots:
            m._parameters[name] = tensor          # the shard at rest; the gathered tensor in forward


class _Unshard(torch.autograd.Function):
    """Forward: hand out the unit's gathered parameters. Backward (all their gradients are in): free
    them and reduce-scatter the gradients into the shards' ``.grad`` (returned as None: set by hand)."""

    @staticmethod
    def forward(ctx, unit, *shards):
        ctx.unit = unit
        return tuple(p.full for p in unit.trainable)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.reduce(grads)
        return (None,) * (1 + len(grads))


class Coordinator:
    """What one root coordinates for all its units: forward order, gradient sync switch, the shared
    reduce-scatter queue."""

    def __init__(self, comm: Collectives):
        self.units: list[FSDPUnit] = []
        self.order: list[FSDPUnit] = []
        self.sync, self.in_backward = True, False
        self.reducer = GradReducer(comm, lambda b, shard: self.units[b].take_grad_shard(shard))

    def neighbour(self, unit, step: int):
        if unit not in self.order:
            return None
        k = self.order.index(unit) + step
        return self.order[k] if 0 <= k < len(self.order) else None

    def backward_done(self) -> None:
        self.reducer.drain()
        for unit in self.units:
            unit.finish_backward()
        self.in_backward = False


class FSDPUnit:
    """The state ``fully_shard`` attaches to a module (``module._fsdp``)."""

    def __init__(self, module, params, replicated, comms, *, param_dtype, reduce_dtype, reshard, device):
        self.module, self.params, self.device = module, params, device
        self.replicated = replicated                                  # [(module, name, parameter)]
        self.dp, self.shard_comm, self.replica_comm = comms
        self.trainable = [p for p in params if p.shard.requires_grad]
        self.param_dtype, self.reduce_dtype, self.reshard = param_dtype, reduce_dtype, reshard
        self.cast_inputs = False                                      # set when param_dtype is asked for
        self.offsets = [sum(p.chunk for p in params[:i]) for i in range(len(params))]
        self.trainable_offsets = [o for o, p in zip(self.offsets, params) if p.shard.requires_grad]
        self.total = sum(p.chunk for p in params)                     # S: elements per rank, padded
        self._pending = None                                          # (buffer, handle) in flight
        self.graph = False                  # a forward with grad ran: its backward (and p.full) still to come
        self.coordinator = Coordinator(self.shard_comm)
        self.coordinator.units.append(self)

    # -- gather and free ---------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """All-gather every shard of the unit into ``p.full`` (launched, or launched and finished)."""
        if not self.params:
            return
        if self._pending is None and not self.is_gathered():
            self.coordinator.reducer.make_room()        # a gathered unit takes an in-flight slot too
            send = torch.cat([p.padded(p.shard.detach(), self.param_dtype) for p in self.params])  # (S,)
            out = torch.empty(self.shard_comm.size * self.total, dtype=send.dtype, device=send.device)
            self._pending = (out, self.shard_comm.all_gather(out, send, async_op=True))
        if not async_op and self._pending is not None:
            out, handle = self._pending
            handle.wait()
            self._pending = None
            self._copy_out(out.view(self.shard_comm.size, self.total))            # (N, S)

    @torch.no_grad()
    def _copy_out(self, rows: torch.Tensor) -> None:
        for p, off in zip(self.params, self.offsets):
            full = p.unpad(rows[:, off:off + p.chunk])     # a copy already, unless N = 1 or one parameter
            if p.full is None:                             # a fresh tensor for this forward, its own storage
                storage = full.untyped_storage()
                own = storage.nbytes() == full.numel() * full.element_size() \
                    and storage.data_ptr() != rows.untyped_storage().data_ptr()
                p.full = full if own else full.clone()
            else:
                _alloc(p.full)                          # backward: refill the storage autograd saved
                p.full.data.copy_(full)

    def free(self) -> None:
        for p in self.params:
            if p.full is not None:
                _free(p.full)

    def is_gathered(self) -> bool:
        return bool(self.params) and all(p.full is not None and p.full.untyped_storage().nbytes() > 0
                                         for p in self.params)

    def gathered(self) -> list[torch.Tensor]:
        """What the unit holds gathered now: its full parameters, or the buffer of an all-gather in flight
        (a prefetch); empty at rest."""
        pending = [self._pending[0]] if self._pending is not None else []
        return pending + [p.full for p in self.params
                          if p.full is not None and p.full.untyped_storage().nbytes()]

    # -- hooks ------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        if in_recomputation():
            return self._recompute(args, kwargs)
        training = torch.is_grad_enabled()
        if training and self not in self.coordinator.order:
            self.coordinator.order.append(self)
        self._fresh()
        self.unshard()
        nxt = self.coordinator.neighbour(self, +1)
        if nxt is not None:
            nxt.prepare_forward()
        if training and self.trainable:
            self._connect()
        self.graph |= training
        self._install(full=True)
        if self.cast_inputs:                            # FSDP2 casts floating inputs to the compute dtype
            args, kwargs = _cast((args, kwargs), self.param_dtype)
        return args, kwargs

    def _fresh(self) -> None:
        """New tensors for a forward with grad (the last step's graph is gone). A forward without grad
        (a metric between forward and backward) refills the tensors a pending backward has saved."""
        if self._pending is None and (torch.is_grad_enabled() or not self.graph):
            for p in self.params:
                p.full = None

    def _connect(self) -> None:
        """Hand the gathered tensors to the module through `_Unshard`: their gradients come back to it."""
        fulls = _Unshard.apply(self, *[p.shard for p in self.trainable])
        for p, full in zip(self.trainable, fulls):
            p.full = full

    def _recompute(self, args, kwargs):
        """The forward again, inside backward (`torch.utils.checkpoint`; Chen et al. 2016): gathered now
        (its pre-backward hook usually did it), nothing prefetched, kept until its gradients are reduced.
        A reentrant checkpoint ran the first forward without grad: this forward's graph is the one its
        backward runs, so it connects the parameters to `_Unshard` here."""
        self.unshard()
        if torch.is_grad_enabled() and self.trainable and not self.graph:
            self._connect()
            self.graph = True
        self._install(full=True)
        if self.cast_inputs:
            args, kwargs = _cast((args, kwargs), self.param_dtype)
        return args, kwargs

    def prepare_forward(self) -> None:
        """Prefetch: start this unit's all-gather for its coming forward."""
        self._fresh()
        self.unshard(async_op=True)

    def post_forward(self, module, args, out):
        if not in_recomputation():                     # recomputed: backward needs them now
            self._install(full=False)
            if self.reshard:
                self.free()
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g: self.pre_backward())
        return out

    def pre_backward(self) -> None:
        shared = self.coordinator
        if not shared.in_backward:
            shared.in_backward = True
            Variable._execution_engine.queue_callback(shared.backward_done)
        self.unshard()
        # a recomputation inside the unit (checkpoint_wrapper, dl.recompute) reruns its modules without the
        # unit's hooks: they see these tensors
        self._install(full=True)
        prev = shared.neighbour(self, -1)
        if prev is not None:
            prev.unshard(async_op=True)

    def _install(self, full: bool) -> None:
        """Put the gathered parameters (cast to the compute dtype where kept whole) into the unit's modules,
        or back the shards; the modules show the shards at rest (state_dict, the optimizer)."""
        for p in self.params:
            p.install(p.full if full and p.full is not None else p.shard)
        for m, name, p in self.replicated:
            m._parameters[name] = p.to(self.param_dtype) if full else p

    # -- gradients --------------------------------------------------------------------------
    def reduce(self, grads) -> None:
        """The unit's full gradients are complete: free the parameters, then reduce-scatter them into
        the shards (under no_sync: add them to the local fp32 sums instead)."""
        self._install(full=False)
        self.free()
        sync, packed = self.coordinator.sync, []
        for p, g in zip(self.trainable, grads):
            if p.accum is not None:
                g = p.accum.add_(g)
            elif not sync:
                g = g.float().clone()
            p.accum = None if sync else g
            packed.append(g)
        if not sync:
            return
        rows = torch.zeros(self.shard_comm.size, self.total, dtype=self.reduce_dtype, device=self.device)
        for p, off, g in zip(self.trainable, self.trainable_offsets, packed):   # rows: (N, S)
            padded = torch.zeros(rows.shape[0] * p.chunk, dtype=rows.dtype, device=rows.device)
            padded[:g.numel()] = g.reshape(-1)
            rows[:, off:off + p.chunk] = padded.view(rows.shape[0], p.chunk)      # rank k's rows -> row k
        shared = self.coordinator
        shared.reducer.submit(shared.units.index(self), _Packed(rows.view(-1), self.total),
                              release_grads=False)

    def take_grad_shard(self, shard: torch.Tensor) -> None:
        """This rank's averaged (S,) slice: all-reduced across replicas (HSDP), then cut into .grad."""
        if self.replica_comm is not None:
            self.replica_comm.all_reduce(shard, op="avg")
        for p, off in zip(self.trainable, self.trainable_offsets):
            g = shard[off:off + p.local_rows * p.inner].view(p.shard.shape).to(p.dtype)
            p.shard.grad = g if p.shard.grad is None else p.shard.grad.add_(g)

    def finish_backward(self) -> None:
        if self._pending is not None:                  # a prefetch nothing used: its values are pre-step
            self._pending[1].wait()
            self._pending = None
        self._install(full=False)
        self.free()
        self.graph = False
        if not self.coordinator.sync:
            return
        for p in {id(p): p for _, _, p in self.replicated}.values():   # DDP for what stays whole (tied: once)
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.dp.all_reduce(p.grad, op="avg")


class _Packed:
    """A unit's packed gradients in the shape `GradReducer.submit` takes a bucket."""

    def __init__(self, flat: torch.Tensor, shard_numel: int):
        self.flat, self.shard_numel, self.params = flat, shard_numel, []

    def flat_grads(self) -> torch.Tensor:
        return self.flat


def _cast(obj, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj
