"""The typed spec of a training run: everything `dl.train` and the ``distlab`` command are told, one
dataclass per concern, each field with its default, its rule (`distlab.rules`) and its docstring.

    TrainSpec               strategy, model, steps, seed, global_batch, lr, optimizer, weight_decay,
    |                       grad_accum, precision, clip          (dl.train's own parameters)
    +- layout: Layout       dp tp pp cp ep zero, sequence_parallel, schedule, microbatches, ...
    +- data_parallel:       the data-parallel wrapper's knobs: buckets, overlap, comm, compression,
    |  DataParallel         ZeRO-3's prefetch, FSDP's hsdp / param_dtype / reshard_after_forward
    +- numerics: Numerics   fp16 loss scaling, non-finite steps, spikes, a planted NaN
    +- memory: Memory       recompute, memory_limit, offload, offload_dir
    +- checkpoint:          checkpoint_dir, checkpoint_every, keep_last, resume, async_save, fault
    |  Checkpointing        injection (`distlab.checkpoint.options`)
    +- restart: Restart     max_restarts, shrink, engine
    +- data_loading:        data ("synthetic" | "text"), workers, read_ahead, data_latency,
       DataLoading          shuffle, drop_last (`distlab.data`)
    +- profiling: Profiling profile (a directory for torch.profiler's traces)

A field's name is the keyword that sets it (``dl.train(..., bucket_mb=1)`` sets
``spec.data_parallel.bucket_mb``). Specs are made by `distlab.strategies.parse` from a strategy name
(``"zero2"``, ``"3d:dp=2,tp=2,pp=2"``) and keywords, checked field by field when made (each concern's
``__post_init__``), then as a whole against the world size by `distlab.strategies.validate`, once, in
the parent, before any rank starts. Frozen and made of plain values: a spec pickles to every rank (fork,
spawn, torchrun) and never changes on the way. Like torchtitan's ``JobConfig`` and ``ParallelDims``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..checkpoint.options import Checkpointing
from ..memory import parse_bytes
from ..rules import Custom, Directory, Either, Flag, Number, OneOf, Text, Whole, check_fields, option

OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")     # fp16: with dynamic loss scaling (`numerics`)
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
#: step s of the data is drawn from torch's generator seeded with seed * 1_000_003 + s (`dl.models`), a
#: 64-bit seed: any seed below 2**32 fits it for any run shorter than 2**44 steps
MAX_SEED = 2**32 - 1
AXES = ("dp", "pp", "cp", "ep", "tp")                  # the degrees, in the mesh's order (`parallel.mesh`)
_FILL = "the ranks the other degrees leave"


def _shape(value) -> None:
    from ..theory.presets import ModelPreset
    if not isinstance(value, ModelPreset):
        raise TypeError


def _degree(what: str):
    return option(1, Whole(1, example=2, none=_FILL), what)


@dataclass(frozen=True)
class Layout:
    """How the ranks divide the work: one degree per parallelism, whose product is the world size (a
    degree of None takes the ranks the others leave: ``ddp`` is dp=None), and how each one runs."""

    dp: int | None = _degree("data-parallel replicas: each takes its rows of every batch, gradients averaged")
    tp: int | None = _degree("tensor-parallel ranks: each holds 1/tp of every big matrix (Megatron)")
    pp: int | None = _degree("pipeline stages: each rank holds a run of layers, microbatches flow through")
    cp: int | None = _degree("context-parallel ranks: each holds a part of every sequence")
    ep: int | None = _degree("expert-parallel ranks: each holds 1/ep of the experts of every MoE layer")
    zero: int = option(0, OneOf(0, 1, 2, 3), "ZeRO stage of the data-parallel wrapper: 0 (DDP), 1 (optimizer "
                                             "states sharded), 2 (+ gradients), 3 (+ parameters)")
    sequence_parallel: bool = option(False, Flag(), "Megatron sequence parallelism inside tp: LayerNorms and "
                                                    "dropout on 1/tp of the sequence (alias sp)")
    schedule: str = option("1f1b", OneOf(*SCHEDULES), "the pipeline schedule (`dl.pp.schedule`)")
    microbatches: int | None = option(None, Whole(1, example=8, none="2 pp when the rows allow, else pp"),
                                      "microbatches per pipeline step")
    virtual: int = option(2, Whole(1, example=2), "stages per rank of the interleaved schedule (others: 1)")
    balance: str = option("layers", OneOf("layers", "params"), "how the model is cut into stages: equal "
                                                               "layers, or equal parameters")
    attention: str = option("ring", OneOf("ring", "ulysses"), "context-parallel attention: ring attention (K "
                                                              "and V travel) or Ulysses (heads all-to-all)")
    zigzag: bool | None = option(None, Flag(none="ring: True, Ulysses: False"),
                                 "each cp rank holds chunks r and 2n-1-r of 2n (balanced causal work)")
    experts: str = option("split", OneOf("split", "replicated"), "ep: experts split over the ranks, or every "
                                                                 "expert on every rank (the baseline)")

    def __post_init__(self):
        check_fields(self)

    def degrees(self, world: int) -> dict[str, int]:
        """Every degree, the one left None (if any) filled with the ranks the others leave:
        ``Layout(dp=None, tp=2).degrees(8) == {"dp": 4, "pp": 1, "cp": 1, "ep": 1, "tp": 2}``."""
        given = {a: getattr(self, a) for a in AXES}
        fill = [a for a, n in given.items() if n is None]
        if len(fill) > 1:
            raise ValueError(f"{' and '.join(fill)} are both None: at most one degree takes the ranks the "
                             "others leave")
        rest = math.prod(n for n in given.values() if n is not None)
        if fill:
            if world % rest:
                raise ValueError(f"the degrees given multiply to {rest}, which does not divide world_size="
                                 f"{world}: {fill[0]} cannot take the ranks left")
            given[fill[0]] = world // rest
        return given


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel wrapper: DDP's buckets and collectives, ZeRO's, FSDP's (`distlab.parallel`)."""

    bucket_mb: float = option(25.0, Number(0, strict=True, example=25.0), "gradient bucket size in MiB")
    overlap: bool = option(True, Flag(), "all-reduce each bucket during backward, as soon as it fills")
    comm: str = option("torch", OneOf("torch", "ring"), "torch's collectives, or distlab's pipelined ring")
    naive: bool = option(False, Flag(), "ddp: one all-reduce per parameter after backward (the textbook)")
    no_sync: bool | None = option(None, Flag(none="True, except zero3"),
                                  "accumulate micro-steps locally, communicating on the last only")
    compression: str | None = option(None, OneOf("none", "powersgd", none="plain DDP"),
                                     "ddp: gradient compression")
    powersgd_rank: int = option(4, Whole(1, example=4), "PowerSGD's rank (its low-rank factors' width)")
    error_feedback: bool = option(True, Flag(), "PowerSGD: carry the compression error into the next step")
    max_inflight: int = option(1, Whole(1, example=1), "ZeRO: flat gradient buckets alive at once")
    prefetch: bool = option(False, Flag(), "ZeRO-3: gather the next unit's parameters early")
    hsdp: int = option(1, Whole(1, example=2), "fsdp: replicas of the sharded model, mesh (hsdp, world/hsdp)")
    param_dtype: str | None = option(None, OneOf("bf16", "fp16", none="fp32, or the precision's"),
                                     "fsdp: the dtype parameters are gathered and computed in")
    reshard_after_forward: bool = option(True, Flag(), "fsdp: free gathered parameters after forward")
    quantize: str | None = option(None, OneOf("int8", "fp8", none="exact collectives"),
                                  "zero3, fsdp: all-gather weights and reduce-scatter gradients as block-"
                                  "scaled int8 or fp8 packets (ZeRO++ qwZ/qgZ)")
    sync_every: int = option(8, Whole(1, example=8), "local-sgd, diloco: inner steps between syncs (H)")
    outer_lr: float = option(0.7, Number(0, strict=True, example=0.7), "diloco: the outer Nesterov SGD's "
                                                                       "learning rate")
    outer_momentum: float = option(0.9, Number(0, example=0.9), "diloco: the outer SGD's momentum")

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class Numerics:
    """fp16 loss scaling and the step's checks (`distlab.strategies.numerics`)."""

    loss_scale: float = option(2.0 ** 16, Number(0, strict=True, example=2.0 ** 16),
                               "fp16: the initial loss scale S")
    growth_interval: int = option(2000, Whole(1, example=2000), "fp16: good steps in a row before S doubles")
    skip_nonfinite: bool = option(False, Flag(), "skip, on every rank, a step with an inf/NaN gradient")
    spike_factor: float = option(5.0, Number(1, strict=True, example=5.0),
                                 "a gradient norm above factor x the median so far is a spike")
    nan_at_step: int | None = option(None, Whole(0, example=3, none="none planted"),
                                     "fault injection: a NaN in one gradient at this step")
    nan_rank: int = option(0, Whole(0, example=0), "the rank whose gradient gets the planted NaN")

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class Memory:
    """What a rank keeps, and the budget it must keep within (`distlab.memory`)."""

    recompute: bool | str = option(False, OneOf(True, "full", "selective", False),
                                   "recompute activations in backward: every block (True, 'full') or only "
                                   "attention's scores and softmax ('selective')")
    memory_limit: int | str | None = option(None, Custom(parse_bytes, "a number of bytes (an int) or a "
                                                         "string like '64MB'", example="64MB",
                                                         none="no limit"),
                                            "out of memory the moment the ledger crosses this")
    offload: str | None = option(None, OneOf("cpu", "disk", none="on the device"),
                                 "zero1-3, fsdp: the optimizer state and fp32 masters in host memory ('cpu', "
                                 "ZeRO-Offload) or in files under offload_dir ('disk', ZeRO-Infinity); the "
                                 "optimizer steps there")
    offload_dir: object = option(None, Directory(example="offload", none="a temporary directory"),
                                 "offload='disk': the directory its files go under")

    def __post_init__(self):
        check_fields(self)


def _sizes(value) -> None:
    if not (value is True or value is False or (isinstance(value, (list, tuple)) and value and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value))):
        raise ValueError


@dataclass(frozen=True)
class Restart:
    """Relaunching a failed run from its newest checkpoint (`distlab.strategies.restart`)."""

    max_restarts: int = option(0, Whole(0, example=2), "relaunch a failed run up to k times")
    shrink: bool | list | None = option(False, Custom(_sizes, "True (one rank fewer per restart), False, or "
                                                      "a list of world sizes for the restarts (e.g. [3, 2])",
                                                      none="no shrink"), "where each restart runs")
    engine: str = option("local", OneOf("local", "ray"), "who starts and restarts the ranks: 'local' "
                         "(dl.launch here) or 'ray' (Ray Train, pip install 'distlab[ray]'; max_restarts is "
                         "its FailureConfig(max_failures))")

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class DataLoading:
    """What the ranks train on and how it is read (`distlab.data`, `distlab.strategies.feed`)."""

    data: str = option("synthetic", OneOf("synthetic", "text"),
                       "'synthetic': the model's data set, a pure function of (seed, step); 'text': the "
                       "shipped public-domain corpus, bytes (vocab 256), through a sampler and loader whose "
                       "position every checkpoint holds")
    workers: int = option(0, Whole(0, example=2), "text: loader threads reading ahead (0: each step reads "
                                                  "its own batch)")
    read_ahead: int = option(2, Whole(1, example=2), "text: batches in flight per worker (torch's "
                                                     "prefetch_factor)")
    data_latency: float = option(0.0, Number(0, example=0.05), "text: seconds of (simulated) slow storage "
                                                               "per batch read")
    shuffle: bool = option(True, Flag(), "text: shuffle the order each epoch (by seed + epoch)")
    drop_last: bool = option(False, Flag(), "text: skip an epoch's tail shorter than a batch (else a "
                                            "batch runs on into the next epoch)")

    def __post_init__(self):
        check_fields(self)
        if self.data == "synthetic":
            given = [f.name for f in dataclasses.fields(self) if f.name != "data"
                     and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{', '.join(given)} set(s) the text loader: pass data='text' too "
                                 "(synthetic data is computed in each rank, not read)")


@dataclass(frozen=True)
class Profiling:
    """torch.profiler around the run, distlab's spans and collectives as its ranges
    (`distlab.launch.profiler`; measured from: `distlab.viz.profile`)."""

    profile: object = option(None, Directory(example="prof", none="no profile"),
                             "a directory: each rank's torch.profiler trace (rank{r}.json) and the merged "
                             "trace.json, one process per rank (Perfetto, Holistic Trace Analysis)")

    def __post_init__(self):
        check_fields(self)


#: the concerns, by the TrainSpec field that holds each
CONCERNS = {"layout": Layout, "data_parallel": DataParallel, "numerics": Numerics, "memory": Memory,
            "checkpoint": Checkpointing, "restart": Restart, "data_loading": DataLoading,
            "profiling": Profiling}


@dataclass(frozen=True)
class TrainSpec:
    """Everything a rank needs to train: `dl.train`'s own parameters, then one field per concern."""

    strategy: str = option("single", Text(example="ddp"), "the strategy's name (`distlab.strategies`)")
    model: str = option("gpt-tiny", Either(Text(), Custom(_shape, "a dl.theory.ModelPreset"),
                                           description="a preset name or a dl.theory.ModelPreset",
                                           example="gpt-tiny"),
                        "a preset of `dl.models`, 'mlp', or a `dl.theory.ModelPreset` (its shape)")
    steps: int = option(20, Whole(1, example=20), "optimizer steps")
    seed: int = option(0, Whole(0, MAX_SEED, example=0), "initial weights and data")
    global_batch: int = option(16, Whole(1, example=16), "rows per step, over all ranks")
    lr: float = option(1e-3, Number(0, strict=True, example=1e-3), "learning rate")
    optimizer: str = option("adamw", OneOf(*OPTIMIZERS), "the torch optimizer")
    weight_decay: float = option(0.0, Number(0, example=0.01), "weight decay")
    grad_accum: int = option(1, Whole(1, example=1), "micro-steps per step (gradient accumulation)")
    precision: str = option("fp32", OneOf(*PRECISIONS), "compute precision (mixed: fp32 master weights)")
    clip: float | None = option(None, Number(0, strict=True, example=1.0, none="no clipping"),
                                "clip the whole model's gradient norm to this")
    layout: Layout = field(default_factory=Layout, metadata={"doc": "the degrees and how each runs"})
    data_parallel: DataParallel = field(default_factory=DataParallel,
                                        metadata={"doc": "the data-parallel wrapper's knobs"})
    numerics: Numerics = field(default_factory=Numerics, metadata={"doc": "loss scaling and step checks"})
    memory: Memory = field(default_factory=Memory, metadata={"doc": "recompute and the memory budget"})
    checkpoint: Checkpointing = field(default_factory=Checkpointing,
                                      metadata={"doc": "saving, resuming, planted failures"})
    restart: Restart = field(default_factory=Restart, metadata={"doc": "relaunching after a failure"})
    data_loading: DataLoading = field(default_factory=DataLoading,
                                      metadata={"doc": "synthetic data or the text corpus, and its loader"})
    profiling: Profiling = field(default_factory=Profiling, metadata={"doc": "torch.profiler traces"})

    def __post_init__(self):
        check_fields(self)
        if self.global_batch % self.grad_accum:
            raise ValueError(f"global_batch={self.global_batch} must be divisible by "
                             f"grad_accum={self.grad_accum} (each micro-step takes an equal slice)")

    @property
    def micro_batch(self) -> int:
        """Rows per gradient-accumulation micro-step (of the global batch, before any split by rank)."""
        return self.global_batch // self.grad_accum

    def replace(self, **keywords) -> "TrainSpec":
        """A copy with some keywords changed, each put in its concern: ``spec.replace(resume=True)``."""
        top = {k: v for k, v in keywords.items() if k not in WHERE}
        parts = {}
        for name, value in keywords.items():
            if name in WHERE:
                parts.setdefault(WHERE[name], {})[name] = value
        return dataclasses.replace(self, **top, **{c: dataclasses.replace(getattr(self, c), **kw)
                                                   for c, kw in parts.items()})


def changed(concern) -> dict:
    """The fields of ``concern`` whose value is not the default: what was asked for."""
    return {f.name: getattr(concern, f.name) for f in dataclasses.fields(concern)
            if getattr(concern, f.name) != f.default}


#: keyword -> the concern (TrainSpec field) that holds it
WHERE = {f.name: concern for concern, cls in CONCERNS.items() for f in dataclasses.fields(cls)}
