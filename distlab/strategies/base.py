"""What every strategy's ``train_rank(spec)`` shares: the spec, the result, model, optimizer, data, loss.

A strategy module exposes one function, ``train_rank(spec: TrainSpec) -> RankResult``, run on every
rank by `distlab.train` (or in this process for ``single``); the spec is `distlab.strategies.spec`'s.
Everything here is deterministic given ``spec.seed``, so every strategy sees the same initial weights and
the same *global* batch on any world size, and can be compared with the single-process reference step
by step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import models
from ..recomputation import recompute_context
from ..runtime import current_run, device, rank, world_size
from .spec import TrainSpec


@dataclass
class RankResult:
    """What each rank's train function returns."""

    losses: list[float] | None                  # per step, on the rank(s) that hold the loss, else None
    params: dict[str, torch.Tensor] | None      # full (gathered) final parameters by name, rank 0 only
    info: dict = field(default_factory=dict)    # e.g. memory ledger, comm totals


def build_model(spec: TrainSpec) -> nn.Module:
    """``dl.models.build(spec.model, spec.seed)`` on ``dl.device()``: identical weights on every rank
    (``data="text"``: a vocabulary of 256, bytes); ``spec.memory.recompute``: True or "full" (every
    transformer block recomputes in backward), "selective" (only attention's scores and softmax,
    `models.attention_core`)."""
    vocab = 256 if spec.data_loading.data == "text" else None           # bytes (`dl.data`)
    cfg, tp = models.config(spec.model), spec.layout.degrees(world_size())["tp"]
    if vocab is None and cfg is not None and cfg.vocab % tp:
        vocab = padded_vocab(cfg.vocab, tp)                              # GPT-3's 50,257 under tp=8
    where = device()
    if where.type == "meta":                      # a dry run: built without a byte (nor initialised)
        from .dry import skip_init
        with torch.device(where), skip_init():
            model = models.build(spec.model, spec.seed, vocab=vocab)
    else:                                         # initialised by the CPU's generator, then moved: the same
        model = models.build(spec.model, spec.seed, vocab=vocab).to(where)   # weights on any device
    how = spec.memory.recompute
    for block in getattr(model, "blocks", ()):
        block.recompute = how in (True, "full")
        block.attn.selective = how == "selective"
        block.recompute_context = block.attn.recompute_context = recompute_context   # the ledger counts
    return model                                                                     # what backward rebuilds


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """The vocabulary padded, as Megatron-LM pads it (``--make-vocab-size-divisible-by 128``), to a
    multiple of ``multiple x tp``, so every tensor-parallel rank holds an equal slice of the embedding
    and the head: GPT-3's 50,257 becomes 50,304 at tp=1 and 51,200 at tp=8. Only a vocabulary that tp
    does not divide is padded (the padded rows are never a target; their logits still join the
    softmax's denominator, as in Megatron)."""
    step = multiple * tp
    return -(-vocab // step) * step


def make_optimizer(params, spec: TrainSpec) -> torch.optim.Optimizer:
    """The optimizer named by ``spec.optimizer`` over ``params`` (an iterable of tensors or param groups)."""
    return optimizer_class(spec)(params, **optimizer_kwargs(spec))


def optimizer_class(spec: TrainSpec) -> type[torch.optim.Optimizer]:
    return {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[spec.optimizer]


def optimizer_kwargs(spec: TrainSpec) -> dict:
    """Keyword arguments for `optimizer_class` (so ZeRO can build the same optimizer over its shard)."""
    return {"lr": spec.lr, "weight_decay": spec.weight_decay}


_DATASETS: dict = {}


def _dataset(spec: TrainSpec):
    key = (spec.model, spec.seed)
    if key not in _DATASETS:
        _DATASETS[key] = models.dataset_for(spec.model, spec.seed)
    return _DATASETS[key]


def global_batch(spec: TrainSpec, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro`` of step ``step``'s global batch, on ``dl.device()``.

    The same on every rank and every world size: the full step's batch is drawn from the data set by
    (seed, step) and cut into ``grad_accum`` equal slices, so accumulation and a big batch agree.
    With ``data="text"`` it is the next micro-batch of the run's loader (`feed`), whose position the
    checkpoints hold: the same on every rank and world size too.
    """
    if not 0 <= micro < spec.grad_accum:
        raise ValueError(f"micro={micro} out of range for grad_accum={spec.grad_accum}")
    if dry_run():
        return dry_batch(spec)
    if spec.data_loading.data != "synthetic":
        x, y = current_run().feed.batch(step, micro)
        return x.to(device()), y.to(device())
    x, y = _dataset(spec).batch(step, spec.global_batch)
    rows = slice(micro * spec.micro_batch, (micro + 1) * spec.micro_batch)
    return x[rows].to(device()), y[rows].to(device())


def local_batch(spec: TrainSpec, step: int, micro: int, rank: int, n: int):
    """(x, y, B): data-parallel rank ``rank`` of ``n``'s rows of micro-batch ``micro`` (``tensor_split``,
    uneven allowed) and the micro-batch's size B. Synthetic data is drawn whole and cut; with
    ``data="text"`` the rank's loader reads only its rows (each rank its shard of the storage)."""
    if spec.data_loading.data != "synthetic" and not dry_run():
        x, y = current_run().feed.batch(step, micro, part=(rank, n))
        return x.to(device()), y.to(device()), spec.micro_batch
    x, y = global_batch(spec, step, micro)
    return models.shard(x, rank, n), models.shard(y, rank, n), x.shape[0]


def dry_run() -> bool:
    """On the meta device of a dry run (`distlab.launch.fake`): tensors have shapes, not values."""
    return device().type == "meta"


def dry_batch(spec: TrainSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of the right shape and dtype, without values: (micro_batch, seq_len) token ids and
    targets (no data set is built: a Markov chain over Llama 3's 128,256 tokens would not fit)."""
    cfg = models.config(spec.model)
    if cfg is None:
        return (torch.empty(spec.micro_batch, 16, device=device()),
                torch.empty(spec.micro_batch, 1, device=device()))
    ids = torch.empty(spec.micro_batch, cfg.seq_len, dtype=torch.long, device=device())
    return ids, torch.empty_like(ids)


def loss_fn(spec: TrainSpec):
    """Mean cross-entropy over tokens for GPT presets, mean squared error for ``"mlp"``."""
    if spec.model == "mlp":
        return F.mse_loss

    def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
    return cross_entropy


def autocast(spec: TrainSpec):
    """bf16 autocast on this rank's device for ``precision="bf16-mixed"`` (weights stay fp32), else none."""
    if spec.precision != "bf16-mixed":
        return contextlib.nullcontext()
    if dry_run():                                  # autocast has no meta device: the same policy, emulated
        from .dry import MetaAutocast
        return MetaAutocast(torch.bfloat16)
    return torch.autocast(device().type, dtype=torch.bfloat16)


def microbatch_count(requested: int | None, rows: int, p: int, schedule: str, where: str) -> int:
    """Microbatches for a p-stage pipeline over ``rows`` rows: ``requested``, else 2p when the rows allow
    (a smaller bubble, (p-1)/(m+p-1)), else p. ``where`` names the rows in the error message."""
    m = requested if requested is not None else (2 * p if rows >= 2 * p else p)
    if m > rows:
        raise ValueError(f"{m} microbatches need at least {m} rows per {where}, got {rows}: raise "
                         "global_batch or pass fewer microbatches=...")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"the interleaved schedule needs microbatches to be a multiple of the {p} pipeline "
                         f"ranks, got {m}")
    return m


def check_pieces(spec: TrainSpec, stages: int, virtual: int = 1) -> None:
    """A pipeline of ``stages`` stages (``virtual`` per rank) needs as many pieces of the model to cut."""
    cfg = models.config(spec.model)
    layers = cfg.layers if cfg is not None else None
    pieces = layers + 2 if layers is not None else 3          # GPT: embeddings, blocks, head; mlp: 3 linears
    if stages > pieces:
        what = (f"the embeddings, {layers} blocks and the head" if layers is not None else "its 3 layers")
        per_rank = f" ({virtual} per rank)" if virtual > 1 else ""
        smaller = ", or a smaller virtual" if virtual > 1 else ""
        raise ValueError(f"{stages} pipeline stages{per_rank} but model {spec.model!r} has only {pieces} "
                         f"pieces to cut ({what}): use at most {pieces} stages (fewer pipeline "
                         f"ranks{smaller}), or a deeper model (e.g. model='gpt-small', "
                         f"{models.PRESETS['gpt-small'].layers + 2} pieces)")


def check_gpt(spec: TrainSpec, who: str) -> None:
    """Strategies that cut a GPT's heads, vocabulary or sequence refuse the MLP."""
    if models.config(spec.model) is None:
        raise ValueError(f"{who} shards a GPT (heads, MLP, vocabulary): choose a GPT preset such as "
                         f"model='gpt-tiny', not {spec.model!r}")


def require_rows(spec: TrainSpec, parts: int, who: str = "ranks") -> None:
    """Every one of ``parts`` data-parallel parts (ranks, replicas) needs a row of each micro-batch."""
    if spec.micro_batch < parts:
        raise ValueError(f"each micro-batch of {spec.micro_batch} rows must give every one of the {parts} "
                         f"{who} a row: raise global_batch or lower grad_accum")


def rank0_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The final parameters a `RankResult` reports: fp32 CPU copies on rank 0, None elsewhere."""
    if rank() != 0 or dry_run():                  # a dry run's parameters have no values to copy
        return None
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def gather_params(mine: dict[str, torch.Tensor], order: list[str]) -> dict[str, torch.Tensor] | None:
    """The full model's parameters on rank 0 (None elsewhere), in ``order``: every rank sends ``mine``
    (the full-size tensors it holds, name -> tensor; ``{}`` from ranks whose copies another rank sends)."""
    if dry_run():
        return None
    mine = {n: t.detach().cpu().clone() for n, t in mine.items()}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if gathered is None:
        return None
    merged = {k: v for part in gathered for k, v in part.items()}
    return {n: merged[n] for n in order if n in merged}
