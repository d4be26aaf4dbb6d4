"""``train_rank`` for local-sgd and diloco: replicas that step alone and meet every ``sync_every`` steps.

Every rank draws the same global batch and keeps its rows (as `data_parallel`), and trains its own replica
with the spec's optimizer (AdamW by default: DiLoCo's inner optimizer) without communicating in backward.
After every ``sync_every`` = H inner steps the wrapper syncs (`distlab.parallel.data.local_sgd`): local-sgd
averages the parameters, diloco takes the outer Nesterov step (``outer_lr``, ``outer_momentum``) on the
averaged change. Each replica's loss is weighted by N n_r / B as in `data_parallel`, so that with H = 1
and SGD the average of the replicas' steps is DDP's step exactly, uneven rows included.

Reported loss: each step's mean over the replicas of their (weighted) losses, every replica on its own
parameters. The final parameters: rank 0's replica (after the last sync, if ``steps`` is a multiple of H,
the agreed ones). Checkpoints are refused for now: between syncs the replicas differ, and a checkpoint
would have to hold every replica and its inner optimizer, which `distlab.checkpoint` does not yet do.
"""
from __future__ import annotations

from ..checkpoint.state import replicated_state
from ..memory import optimizer_bytes, replica_memory, storage_bytes
from ..parallel.data import DiLoCo, LocalSGD
from ..runtime import rank, world_size
from .base import RankResult, TrainSpec, build_model, rank0_copy, require_rows
from .data_parallel import LOW, LocalOptimizer, _forward
from .loop import Plan, run, sum_losses

STRATEGIES = ("local-sgd", "diloco")


class InnerThenOuter:
    """The loop's optimizer: the replica's own step, then the wrapper's count (and sync every H-th)."""

    def __init__(self, inner: LocalOptimizer, wrapper: LocalSGD):
        self.inner, self.wrapper = inner, wrapper

    def step(self):
        self.inner.step()
        self.wrapper.after_step()

    def zero_grad(self):
        self.inner.zero_grad()

    def clip_grad_norm_(self, max_norm: float):
        return self.inner.clip_grad_norm_(max_norm)          # this replica's own gradient


def check(spec: TrainSpec, n: int) -> None:
    """Refuse, before any rank starts, what local-sgd and diloco cannot run on ``n`` ranks."""
    if spec.strategy not in STRATEGIES:
        raise ValueError(f"local_sgd trains {STRATEGIES}, not {spec.strategy!r}")
    require_rows(spec, n)
    o = spec.data_parallel
    if not 0 <= o.outer_momentum < 1:
        raise ValueError(f"outer_momentum={o.outer_momentum!r}: the outer momentum must be in [0, 1) "
                         "(DiLoCo's: 0.9)")
    if spec.checkpoint.checkpoint_dir is not None or spec.restart.max_restarts:
        raise ValueError(f"{spec.strategy} cannot checkpoint yet (between syncs every replica differs, and a "
                         "checkpoint would need them all): drop checkpoint_dir and max_restarts")
    if spec.steps < o.sync_every:
        raise ValueError(f"sync_every={o.sync_every} > steps={spec.steps}: the replicas would never meet; "
                         f"lower sync_every or raise steps")


def wrap(spec: TrainSpec, model) -> LocalSGD:
    """The wrapper the strategy names, with the spec's knobs."""
    o = spec.data_parallel
    if spec.strategy == "diloco":
        return DiLoCo(model, o.sync_every, outer_lr=o.outer_lr, outer_momentum=o.outer_momentum, comm=o.comm)
    return LocalSGD(model, o.sync_every, comm=o.comm)


def _memory(model, inner: LocalOptimizer, wrapped: LocalSGD):
    """The ledger's model states of a replica: DDP's (a whole model, its gradients, the inner optimizer), and
    DiLoCo's outer state as optimizer bytes too: the agreed theta (fp32) and the outer momentum."""
    replica = replica_memory(model, inner.optimizer, inner.masters if inner.mixed else ())

    def measure() -> dict[str, int]:
        got = replica()
        got["optimizer"] += storage_bytes(getattr(wrapped, "anchor", ())) + optimizer_bytes(
            getattr(wrapped, "outer", None))
        return got
    return measure


def train_rank(spec: TrainSpec) -> RankResult:
    n, r = world_size(), rank()
    check(spec, n)
    model = build_model(spec)
    if spec.precision in LOW:                               # fp32 masters in the inner optimizer
        model = model.to(LOW[spec.precision])
    wrapped = wrap(spec, model)
    inner = LocalOptimizer(model.parameters(), spec)
    opt = InnerThenOuter(inner, wrapped)
    saved = replicated_state(model, inner, keeps_history=r == 0)       # (checkpoints refused: `check`)
    plan = Plan(_forward(spec, wrapped, model, n, r), opt, saved, loss_share=1 / n, clip=opt.clip_grad_norm_,
                grads=inner.grads, memory=_memory(model, inner, wrapped))
    trained = run(spec, plan)
    losses = sum_losses(trained.losses)
    params = rank0_copy(model.state_dict())
    wrapped.comm.close()
    info = {**trained.info, "syncs": wrapped.steps // wrapped.sync_every}
    return RankResult(losses=losses if r == 0 else None, params=params, info=info)
