"""Measured memory: exact bytes per rank by category, a per-step timeline and its peak.

Categories (the ZeRO paper's "model states" plus the "residual states", Rajbhandari et al. 2020):

    params       parameter storage this rank holds (a ZeRO-3 rank: its shards; gathered units while live)
    grads        gradient storage (DDP buckets; ZeRO-2/3: gradient shards)
    optimizer    optimizer state (Adam: exp_avg, exp_avg_sq, step) and fp32 master weights
    activations  tensors autograd saved for backward, counted by `saved_tensors_hooks`
    buffers      communication buffers (flat gradient buckets in flight, gathered copies)
    host, disk   off the device (`parallel.zero.offload`): in rows if sampled; not in peak_total nor a limit

Bytes are counted by distinct storage (`storage_bytes`): views into one flat buffer count once,
padding included, so a ZeRO ledger is comparable with `dl.theory.memory` exactly. On CUDA each
sample also carries the caching allocator's ``cuda_allocated`` and ``cuda_peak``.

The algorithms carry no memory probes: `replica_memory`, `zero_memory` and `fsdp_memory` read a DDP,
ZeRO or FSDP rank's state from outside (storages, and the plain queries ``reducer.in_flight()`` and
``gathered()``), sampling transient buffers from a launch hook on the wrapper's collectives.

    ledger = dl.memory.Ledger()
    with ledger.activations():              # count what autograd saves
        loss = model(x).sum()
    ledger.sample("after forward", params=..., grads=..., optimizer=...)
    ledger.peak          # {"params": ..., "grads": ..., ...} max over samples, per category
    ledger.record()      # into dl.tracer(), for dl.viz.memory(run.trace)

A budget: ``Ledger(limit="64MB", measure=state_bytes)`` checks the bytes held (the model states
``measure()`` returns, plus the live activations) at every sample, at every tensor autograd saves
(forward) and every one it reads back (backward), and raises `MemoryLimitExceeded` the moment the
total crosses the limit, naming the phase and the category that grew: an out-of-memory in backward,
shown on a CPU (``dl.train(..., memory_limit="64MB")``).

Two saved-tensor counters: `SavedTensors` follows what is *alive* over a whole step (released as
backward frees it, with its peak), for the ledger; `SavedActivations` totals what one forward saved
(the pipeline's stash per microbatch; `measure_layer`, the per-layer check against Korthikanti
et al.). `PipelineStash` watches a `dl.pp.Pipeline` from outside and samples its activations in flight.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn

from .memory_budget import OFF_DEVICE, Budget, MemoryLimitExceeded, parse_bytes  # noqa: F401  (re-exported)
from .runtime import current_run, tracer

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")     # on the device


def storage_key(storage) -> int:
    """What tells storages apart: the address of their data; for a storage without data (a ``meta`` or a
    FakeTensor's, the tensors of a dry run, `distlab.launch.fake`) its address is 0 for all of them, so
    the storage object's own (``_cdata``, the C++ StorageImpl that every view shares)."""
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once, padding
    included); tensors without storage (meta, fake) by the ``nbytes`` their storage would hold."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or storage_key(s) in seen:
            continue
        seen.add(storage_key(s))
        total += s.nbytes()
    return total


def optimizer_bytes(optimizer, masters=()) -> int:
    """Bytes of a torch optimizer's state tensors, plus ``masters``: fp32 master copies of low-precision
    parameters, which are optimizer state too (the ZeRO paper's K = 12 for mixed-precision Adam)."""
    state = [t for st in (optimizer.state.values() if optimizer is not None else ()) for t in st.values()
             if isinstance(t, torch.Tensor)]
    return storage_bytes(state) + storage_bytes(masters)


def offload_bytes(optimizer) -> dict[str, int]:
    """An offloaded optimizer's (or ZeRO's, around one) ``host`` tensors (``held()``) and ``disk`` bytes."""
    inner = optimizer if hasattr(optimizer, "held") else getattr(optimizer, "optimizer", None)
    held = hasattr(inner, "held")
    return {"optimizer": 0, "host": storage_bytes(inner.held()), "disk": inner.disk_bytes()} if held else {}


# -- model states of a data-parallel rank, measured from outside the algorithm ---------------------
class PeakBytes:
    """The most bytes a set of transient tensors held at once: ``live()`` returns those alive now,
    `sample` is attached to the moments they can grow, `take` returns the peak since the last take
    (then restarts from what is alive now)."""

    def __init__(self, live):
        self.live, self.peak = live, 0

    def sample(self) -> None:
        self.peak = max(self.peak, storage_bytes(self.live()))

    def take(self) -> int:
        peak, self.peak = self.peak, storage_bytes(self.live())
        return peak


def replica_memory(model: nn.Module, optimizer, masters=()):
    """A callable returning the model states of a rank that holds the whole model (single, DDP):
    params, grads (DDP: its flat buckets, which ``p.grad`` are views of) and optimizer state."""
    def measure() -> dict[str, int]:
        params = list(model.parameters())
        return {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
                "optimizer": optimizer_bytes(optimizer, masters)}
    return measure


def zero_memory(zero):
    """A callable returning the model states of a rank under a ``dl.ZeRO`` wrapper, and its ``buffers``.

    params: the shards (stage 3) or the flat buckets holding the parameters (1, 2); grads: the local
    ``p.grad`` plus the gradient shards; optimizer: the inner optimizer's state (of the shards) and any
    fp32 master copies; buffers: the most transient bytes alive at once since the last call: flat
    gradient buckets waiting for their reduce-scatter (``optimizer.reducer.in_flight()``) and, under
    stage 3, the gathered units (``zero.gathered()``). Both can only grow when the wrapper launches a
    collective, so they are sampled right after every launch (``comm.register_launch_hook``).
    """
    opt = zero.optimizer
    gathered = getattr(zero, "gathered", list)
    peak = PeakBytes(lambda: [*opt.reducer.in_flight(), *gathered()])
    zero.comm.register_launch_hook(peak.sample)

    def measure() -> dict[str, int]:
        params = opt.shards if opt.sharded_params else [b.full for b in opt.buckets]
        masters = [m for m, s in zip(opt.masters, opt.shards) if m is not s]
        return {"params": storage_bytes(params),
                "grads": storage_bytes([*(p.grad for p in opt.params), *opt.grad_shards]),
                "optimizer": optimizer_bytes(opt.optimizer, masters), "buffers": peak.take(),
                **offload_bytes(opt)}
    return measure


def fsdp_memory(model: nn.Module, optimizer):
    """A callable returning the model states of a rank of a ``dl.fully_shard``-ed model, and its ``buffers``.

    params: the shards (``model.parameters()`` at rest); grads: their ``.grad`` and any unsharded sums
    kept under no_sync; optimizer: the user's optimizer's state; buffers: the most transient bytes
    alive at once since the last call, gathered units (``unit.gathered()``, a prefetch in flight
    included) and gradients waiting for their reduce-scatter, sampled after every collective launch.
    """
    units = [m._fsdp for m in model.modules() if hasattr(m, "_fsdp")]
    reducer = units[0].coordinator.reducer
    peak = PeakBytes(lambda: [*reducer.in_flight(), *(t for u in units for t in u.gathered())])
    comms = {id(c): c for u in units for c in (u.dp, u.shard_comm, u.replica_comm) if c is not None}
    for comm in comms.values():
        comm.register_launch_hook(peak.sample)

    def measure() -> dict[str, int]:
        params = list(model.parameters())
        sums = [p.accum for u in units for p in u.params]
        return {"params": storage_bytes(params), "grads": storage_bytes([*(p.grad for p in params), *sums]),
                "optimizer": optimizer_bytes(optimizer), "buffers": peak.take(),
                **offload_bytes(optimizer)}
    return measure


def pipeline_memory(modules, optimizer, stash: "PipelineStash"):
    """A callable returning the model states of a pipeline rank (its stage modules, whole or tensor-
    parallel shards; ``p.grad`` or the DDP buckets they view; the optimizer's state, or its inner
    optimizer's for a sharded one) and ``activations``: the most bytes the rank's stash held at once
    since the last call (`PipelineStash.take`: the schedule runs forward and backward in one step)."""
    states = replica_memory(nn.ModuleList(modules), getattr(optimizer, "optimizer", optimizer))

    def measure() -> dict[str, int]:
        return {**states(), "activations": stash.take()}
    return measure


class SavedTensors:
    """Bytes autograd keeps alive for backward, via ``torch.autograd.graph.saved_tensors_hooks``.

    Each saved tensor is counted once per distinct storage while some saved reference to it lives
    (a storage saved by two ops counts once); parameters (leaf tensors that require grad) are not
    activations and are skipped. ``current`` and ``peak`` are in bytes.
    """

    def __init__(self, on_change=None):
        self.current = 0
        self.peak = 0
        self.rebuilt_peak = 0               # the most held during recomputations since `take_rebuilt`
        self._refs: dict[int, int] = {}
        self.on_change = on_change          # called after every pack / unpack (a `Ledger`'s budget)

    class _Held:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def _pack(self, t: torch.Tensor):
        if (t.is_leaf and t.requires_grad) or isinstance(t, torch.nn.Parameter):
            return t
        held = SavedTensors._Held(t)
        return held if self.count(t, held) else t

    def count(self, t: torch.Tensor, owner) -> bool:
        """Count ``t``'s storage while ``owner`` lives (once per storage however many hold it)."""
        storage = t.untyped_storage()
        key = storage_key(storage) if storage.nbytes() else 0
        if key == 0:
            return False
        if self._refs.get(key, 0) == 0:
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(owner, self._release, key, storage.nbytes())
        if self.on_change is not None:
            self.on_change()
        return True

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.current -= nbytes

    def _unpack(self, x):
        if self.on_change is not None:
            self.on_change()
        return x.tensor if isinstance(x, SavedTensors._Held) else x

    @contextlib.contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def take_rebuilt(self) -> int:
        """The most bytes held during a recomputation since the last call (0: none ran)."""
        peak, self.rebuilt_peak = self.rebuilt_peak, 0
        return peak


class SavedActivations:
    """``with SavedActivations(model) as m: loss = model(x)...`` then ``m.bytes``: bytes saved for backward.

    Tensors sharing a storage are counted once (the storage's size); ``model``'s parameters are
    excluded. ``m.tensors`` lists (shape, dtype, bytes) of each distinct storage, in saving order.
    """

    def __init__(self, *modules: nn.Module):
        self._param_storages = {storage_key(p.untyped_storage()) for m in modules for p in m.parameters()}
        self._seen: dict[int, int] = {}
        self.tensors: list[tuple[tuple, torch.dtype, int]] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage_key(storage)
        if ptr not in self._param_storages and ptr not in self._seen:
            self._seen[ptr] = storage.nbytes()
            self.tensors.append((tuple(t.shape), t.dtype, storage.nbytes()))
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def measure_layer(block: nn.Module, x: torch.Tensor) -> int:
    """Bytes one transformer block saves for its backward on input ``x`` (its own input included),
    each storage once, parameters left out: what Korthikanti et al. 2022 count per layer
    (`dl.theory.activations.predicted_layer_bytes` is the prediction to compare with)."""
    x = x.detach().requires_grad_(True)
    with SavedActivations(block) as meter:
        y = block(x)
    del y
    return meter.bytes


class PipelineStash:
    """A `dl.pp.Pipeline` observer: after every action, the activations the rank holds for its backwards.

    ``Pipeline(..., observers=[PipelineStash()])`` records a memory sample ``"pipeline stash"`` with
    ``microbatches`` (how many (stage, microbatch) forwards wait for their backward: ``pipe.stash``) and
    ``activations`` (the bytes autograd saved for them, each measured by `SavedActivations` around its
    first forward, parameters excluded). GPipe holds m microbatches at its peak, 1F1B p - i on rank i.
    Inside a run (a memory ledger counts saved tensors: `Ledger`, the run's ``saved_tensors``) the bytes
    are the ledger's live count instead: what every forward saved and autograd still holds, so a backward
    that frees a microbatch's tensors lowers it, and with recomputation (a forward keeps only each block's
    input) the block a backward rebuilds is counted on top of what is alive at that moment.
    """

    LABEL = "pipeline stash"

    def __init__(self):
        self.saved: dict[tuple[int, int], int] = {}     # (stage, microbatch) -> bytes saved by its forward
        self.peak = 0                                   # most bytes held at once since the last `take`

    def around_step(self, pipe):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def around_action(self, pipe, action):
        key, live = (action.stage, action.microbatch), current_run().saved_tensors
        if live is None:                           # bare: each forward's saved bytes, by SavedActivations
            if action.kind == "F" and key not in self.saved:
                with SavedActivations(pipe.modules[action.stage]) as counter:
                    yield
                self.saved[key] = counter.bytes
            else:
                yield
            held_bytes = sum(self.saved.get(k, 0) for k in pipe.stash)
        else:                                           # in a run: the ledger's count of what is alive
            before = live.current
            live.take_rebuilt()
            yield
            if action.kind == "F":
                self.saved.setdefault(key, live.current - before)
            held_bytes = live.current
            self.peak = max(self.peak, live.take_rebuilt())    # a backward rebuilding a block on top
        self.peak = max(self.peak, held_bytes)
        tracer().memory(self.LABEL, activations=held_bytes, microbatches=len(pipe.stash))

    def take(self) -> int:
        """The most activation bytes held at once since the last call (then starts again from 0)."""
        peak, self.peak = self.peak, 0
        return peak


class Ledger:
    """Memory samples by category for one rank; `peak` per category and `peak_total` over samples."""

    def __init__(self, limit: int | None = None, measure=None):
        self.timeline: list[tuple[str, dict[str, int]]] = []
        self.saved = SavedTensors()
        current_run().saved_tensors = self.saved    # recomputations count here (`recomputation`)
        self.budget = None
        if limit is not None:                       # checked at every saved tensor (see `Budget`)
            self.budget = Budget(limit, measure, lambda: self.saved.current)
            self.saved.on_change = self.budget.check

    def phase(self, name: str, step: int, root=None):
        """Context manager: the phase (forward, backward) a budget error names; ``root``: the loss a
        backward runs from (the budget is then checked as each gradient is accumulated)."""
        if self.budget is None:
            return contextlib.nullcontext()
        return self.budget.phase(name, step, root)

    def activations(self):
        """Context manager: count tensors saved for backward by what runs inside (usually the forward)."""
        return self.saved.hooks()

    def sample(self, label: str, trace: bool = True, **bytes_by_category: int) -> dict[str, int]:
        """Record bytes by category (missing ones 0, host/disk absent; activations: the live count)."""
        unknown = set(bytes_by_category) - set(CATEGORIES) - set(OFF_DEVICE)
        if unknown:
            raise ValueError(f"unknown memory categories {sorted(unknown)}: use {CATEGORIES + OFF_DEVICE}")
        row = {c: int(bytes_by_category.get(c, 0)) for c in CATEGORIES}
        if "activations" not in bytes_by_category:
            row["activations"] = self.saved.current
        if self.budget is not None:                 # what the budget's checks took from measure() meanwhile
            row["buffers"] = max(row["buffers"], self.budget.take_buffers())
            row["activations"] = max(row["activations"], self.budget.take_activations())
            self.budget.check_row(row, label)
        row.update({c: int(bytes_by_category[c]) for c in OFF_DEVICE if c in bytes_by_category})
        extra = {}
        if torch.cuda.is_initialized():            # (is_available() first would cuInit: no fork after)
            extra = {"cuda_allocated": torch.cuda.memory_allocated(),
                     "cuda_peak": torch.cuda.max_memory_allocated()}
        self.timeline.append((label, {**row, **extra}))
        if trace:
            tracer().memory(label, **row, **extra)
        return row

    @property
    def peak(self) -> dict[str, int]:
        """Largest value of each category over all samples (``host``/``disk`` where sampled)."""
        present = CATEGORIES + tuple(c for c in OFF_DEVICE if any(c in row for _, row in self.timeline))
        return {c: max((row.get(c, 0) for _, row in self.timeline), default=0) for c in present}

    @property
    def peak_total(self) -> int:
        """Largest sum over the device's categories at any one sample."""
        return max((sum(row[c] for c in CATEGORIES) for _, row in self.timeline), default=0)

    def as_dict(self) -> dict:
        """Plain values, picklable: peak, peak_total, timeline."""
        return {"peak": self.peak, "peak_total": self.peak_total,
                "timeline": [(label, dict(row)) for label, row in self.timeline]}
