"""``train_rank`` for single, ddp, zero1, zero2 and zero3: one loop, five ways to hold the model.

Every rank draws the same global batch and keeps its rows (``torch.tensor_split``, uneven allowed).
Exactness on uneven splits: rank r's mean loss is weighted by its share n_r / B of the batch, and
the strategies *average* over N ranks, so the loss backpropagated is

    L_r = (N n_r / B) * mean_r(loss)
      =>   (1/N) sum_r grad L_r = sum_r (n_r / B) grad mean_r = grad mean(loss)

i.e. exactly the single-process gradient of the global batch. Gradient accumulation divides by
``grad_accum`` the same way, and runs the first ``grad_accum - 1`` micro-steps under the wrapper's
``no_sync()``, so a step sends what one big-batch step sends (DDP, ZeRO-1, ZeRO-2: 2 (N-1)/N Psi)
whatever ``grad_accum`` is. ZeRO-3 does not by default: there ``no_sync`` saves only the k-1
reduce-scatters and holds full gradients meanwhile, undoing ZeRO-3's gradient sharding (see
`distlab.parallel.zero`); pass ``no_sync=True`` to make that trade.

The ZeRO stage is ``spec.layout.zero`` (``zero1``: 1, ...); the wrapper's knobs are
``spec.data_parallel`` (`spec.DataParallel`): ``bucket_mb`` (25.0), ``overlap`` (True), ``comm`` ("torch"
or "ring"), ``naive`` (DDP, False), ``compression`` (DDP: None or "powersgd", with ``powersgd_rank``, 4,
and ``error_feedback``, True; `distlab.parallel.data.powersgd`), ``prefetch`` (ZeRO-3, False),
``max_inflight`` (ZeRO, 1: flat gradient buckets alive at once), ``quantize`` (ZeRO-3: "int8"/"fp8",
ZeRO++'s quantized gathers and reduce-scatters), ``no_sync`` (accumulate locally;
True except for ZeRO-3); ``offload`` ("cpu" or "disk", + ``offload_dir``: `distlab.parallel.zero.offload`).
Checkpoints: ``checkpoint_dir``, ``checkpoint_every``, ``keep_last``, ``resume`` (True: the latest; or a
step), and fault injection ``fail_at_step``/``fail_rank``/``fail_in``
(see `distlab.strategies.checkpointing`). The steps themselves run in `distlab.strategies.loop`, whose own
options apply here too: ``memory_limit``, and the numerics of `distlab.strategies.numerics` (fp16 loss
scaling: ``loss_scale``, ``growth_interval``; ``skip_nonfinite``; ``spike_factor``; ``nan_at_step``).
"""
from __future__ import annotations

from functools import partial

import torch

from ..checkpoint.state import flat_shard_state, replicated_state, with_part
from ..comm.quantized import check_kind
from ..memory import replica_memory, zero_memory
from ..runtime import rank, world_size
from .base import (
    RankResult,
    TrainSpec,
    build_model,
    local_batch,
    loss_fn,
    make_optimizer,
    optimizer_class,
    optimizer_kwargs,
    rank0_copy,
    require_rows,
)
from .compose import parallelize
from .loop import Plan, run, sum_losses

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3")
LOW = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}     # the model's dtype under each


class LocalOptimizer:
    """The optimizer of single and DDP: plain, or over fp32 master copies when the model is bf16."""

    def __init__(self, params, spec: TrainSpec):
        self.params = [p for p in params if p.requires_grad]
        self.mixed = self.params[0].dtype != torch.float32
        self.masters = self.params
        if self.mixed:                                   # fp32 master copies of bf16 parameters
            self.masters = [p.detach().float().requires_grad_(True) for p in self.params]
        self.optimizer = make_optimizer(self.masters, spec)

    def clip_grad_norm_(self, max_norm: float):
        self._grads_to_masters()
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm)

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the optimizer will read (masters' copies under mixed precision)."""
        self._grads_to_masters()
        return [m.grad for m in self.masters if m.grad is not None]

    def _grads_to_masters(self):
        if self.mixed:
            for m, p in zip(self.masters, self.params):
                if m.grad is None and p.grad is not None:
                    m.grad = p.grad.float()

    @torch.no_grad()
    def step(self):
        self._grads_to_masters()
        self.optimizer.step()
        if self.mixed:
            for m, p in zip(self.masters, self.params):
                p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        if self.mixed:
            for m in self.masters:
                m.grad = None


def _wrap(spec: TrainSpec, model: torch.nn.Module):
    """(model to call, optimizer with clip_grad_norm_/step/zero_grad, a callable returning the ledger's
    bytes by category), the last measured from outside by `distlab.memory`. The wrapper is THE composition
    function's DP step (`distlab.strategies.compose`): DDP (NaiveDDP, PowerSGDDDP) for ddp, none for
    single, ZeRO's engine, built with its optimizer, for zero1-3."""
    par = parallelize(model, spec.layout, data_parallel=spec.data_parallel)
    if spec.layout.zero == 0:
        opt = LocalOptimizer(model.parameters(), spec)
        return par.wrapped, opt, replica_memory(model, opt.optimizer, opt.masters if opt.mixed else ())
    par.optimizer(optimizer_class(spec), **offload_options(spec), **optimizer_kwargs(spec))
    return par.ddp, par.ddp.optimizer, zero_memory(par.ddp)


def offload_options(spec: TrainSpec) -> dict:
    """``offload``/``offload_dir`` for the ZeRO optimizer or `OffloadedOptimizer`, where asked for."""
    m = spec.memory
    return {} if m.offload is None else {"offload": m.offload, "offload_dir": m.offload_dir}


def train_rank(spec: TrainSpec) -> RankResult:
    n, r = _check(spec)
    model = build_model(spec)
    if spec.precision in LOW:                               # fp32 masters in the optimizer
        model = model.to(LOW[spec.precision])
    wrapped, opt, memory_bytes = _wrap(spec, model)
    no_sync = getattr(wrapped, "no_sync", None)
    o = spec.data_parallel
    if not (o.no_sync if o.no_sync is not None else spec.layout.zero != 3):
        no_sync = None                                    # communicate on every micro-step
    saved = rank_state(model, opt, keeps_history=r == 0)
    if hasattr(wrapped, "compressor"):                    # PowerSGD: its Q's and this rank's errors
        saved = with_part(saved, "powersgd", wrapped.compressor.state, wrapped.compressor.load_state,
                          layout={"powersgd_rank": o.powersgd_rank, "error_feedback": o.error_feedback})
    plan = Plan(_forward(spec, wrapped, model, n, r), opt, saved,
                loss_share=1 / n, no_sync=no_sync, clip=opt.clip_grad_norm_, memory=memory_bytes,
                grads=opt.grads if isinstance(opt, LocalOptimizer) else partial(shard_grads, opt))
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)                   # each rank's weighted share, summed
    state = wrapped.full_state_dict() if hasattr(wrapped, "full_state_dict") else model.state_dict()
    params = rank0_copy(state)
    if hasattr(wrapped, "comm"):
        wrapped.comm.close()
    if spec.memory.offload is not None:
        opt.optimizer.close()                             # offload="disk": its files
    return RankResult(losses=losses if r == 0 else None, params=params, info=trained.info)


def check(spec: TrainSpec, n: int) -> None:
    """Refuse what this family cannot run on ``n`` ranks (before any rank starts, and in each)."""
    if spec.strategy not in STRATEGIES:
        raise ValueError(f"data_parallel trains {STRATEGIES}, not {spec.strategy!r}")
    if spec.strategy == "single" and n != 1:
        raise ValueError("strategy 'single' runs on one process: use world_size=1 (or pick ddp, zero1, ...)")
    require_rows(spec, n)                   # each option's type and range: its field's rule (`spec`)
    if spec.data_parallel.quantize is not None:             # (parse lets only zero3 and fsdp take it)
        check_kind(spec.data_parallel.quantize)             # fp8 needs torch's float8_e4m3fn
        if spec.data_parallel.comm != "torch":
            raise ValueError("quantize= sends its packets through torch.distributed: drop comm='ring'")


def _check(spec: TrainSpec) -> tuple[int, int]:
    """(world size, rank), after refusing what this family cannot run."""
    check(spec, world_size())
    return world_size(), rank()


def _forward(spec: TrainSpec, wrapped, model, n: int, r: int):
    """The micro-step: this rank's rows of the micro-batch through the model, the loss weighted by its
    share of the rows (n n_r / B, divided by grad_accum; see the module docstring)."""
    criterion = loss_fn(spec)
    compute_dtype = next(model.parameters()).dtype

    def forward(step: int, micro: int) -> torch.Tensor:
        xs, ys, total = local_batch(spec, step, micro, r, n)   # (B/n, ...): this rank's rows, uneven allowed
        if xs.is_floating_point():
            xs = xs.to(compute_dtype)
        weight = n * xs.shape[0] / total / spec.grad_accum
        out = wrapped(xs)
        aux = model.aux_loss() if hasattr(model, "aux_loss") else 0.0   # mixture of experts: load balance
        return (criterion(out.float() if spec.model == "mlp" else out, ys) + aux) * weight

    return forward


def shard_grads(opt) -> list[torch.Tensor]:
    """A ZeRO rank's gradient shards, reduced and in fp32 (as its step reads them): for loss scaling
    and the non-finite check of `distlab.strategies.numerics`."""
    opt.reduce_grads()
    opt.grad_shards = [g if g is None or g.dtype == torch.float32 else g.float() for g in opt.grad_shards]
    return [g for g in opt.grad_shards if g is not None]


def rank_state(model, opt, keeps_history: bool):
    """What a checkpoint of this rank holds: one whole copy (single, ddp) or ZeRO's flat shards."""
    if hasattr(opt, "buckets"):
        return flat_shard_state(model, opt, keeps_history)
    return replicated_state(model, opt, keeps_history)
