"""THE training loop: every strategy of `dl.train` runs its steps here.

A strategy builds the model, the criterion and a `Plan` (what one micro-step computes, which
optimizer steps, how gradients are clipped, what a checkpoint holds); `run` drives it::

    resume from a checkpoint (or start at step 0)     data="text": the loader's position with it (`feed`)
    for step in range(start, steps):
        for micro in range(grad_accum):                  all but the last under plan.no_sync()
            loss = plan.forward(step, micro)             "forward" span
            loss.backward()                              "backward" span (a pipeline does both inside)
        plan.sync_grads()                                finish the gradient all-reduces, if any
        unscale; inf/NaN on any rank? skip everywhere    fp16 loss scaling, agreed skips (`numerics`)
        plan.clip(max_norm)                              the whole model's gradient norm (`parallel.clip`)
        optimizer.step(); optimizer.zero_grad()          "optimizer" span
        checkpoint after the step (and fault injection before it)

Losses: ``plan.forward`` returns the loss this rank backpropagates, already scaled so that the
gradients summed over micro-steps (and averaged over data-parallel replicas) are those of the global
batch's mean loss; ``plan.loss_share`` turns it into this rank's share of the step's reported loss.
Instrumentation lives here, not in the strategies, and in one object: a `StepObserver` (`observer`)
wraps the forward, the backward and the optimizer step (the "step" mark, spans, memory-ledger samples when
``plan.memory`` is given; with ``memory_limit`` the ledger raises the moment the budget is crossed). The
loop itself adds the bytes sent during the steps, the gradient norm of every step, and ``dl.progress``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..checkpoint.state import RankState
from ..parallel import collectives as C
from ..progress import progress
from ..progress import share as progress_share
from ..runtime import device, group_members, group_size, rank
from . import checkpointing, numerics
from . import feed as feeds
from .base import TrainSpec
from .observer import StepObserver

@dataclass
class Plan:
    """What a strategy hands the loop.

    ``forward(step, micro)``: the loss of micro-step ``micro`` of step ``step`` to backpropagate (None
    on a rank that holds no loss); with ``backward=False`` it has already run the backward passes
    itself (a pipeline schedule) and returns the loss only to report it.
    ``optimizer``: ``.step()`` and ``.zero_grad()``. ``state``: what a checkpoint saves and restores.
    ``loss_share``: this rank's reported loss per unit of backpropagated loss (1/N for N replicas
    whose shares are summed at the end, over ``loss_group``: the progress bar sums them the same way).
    ``no_sync()``: a context in which a backward accumulates locally (all micro-steps but the last run
    in it). ``sync_grads()``: finishes gradient communication after the micro-steps.
    ``clip(max_norm)``: scales gradients to the whole model's norm.
    ``memory()``: bytes held by category, sampled into the memory ledger. ``grads()``: after
    ``sync_grads``, the gradient tensors this rank's optimizer will read (fp32), for loss scaling and
    the non-finite check (`numerics`).
    """

    forward: Callable[[int, int], torch.Tensor | None]
    optimizer: object
    state: RankState
    backward: bool = True
    loss_share: float = 1.0
    no_sync: Callable | None = None
    sync_grads: Callable[[], None] | None = None
    clip: Callable[[float], object] | None = None
    memory: Callable[[], dict] | None = None
    grads: Callable[[], list] | None = None
    loss_group: object = None          # the ranks whose shares sum to the reported loss (None: the world)


@dataclass
class Trained:
    """What `run` returns: this rank's loss history (its shares), the first step it ran, the comm
    events of the training steps, and ``info`` (comm totals, memory ledger, checkpoints)."""

    losses: list[float]
    start: int
    events: list
    info: dict


def run(spec: TrainSpec, plan: Plan) -> Trained:
    """Resume (or start), then train steps ``start .. spec.steps - 1`` as ``plan`` says."""
    guard = numerics.StepGuard(spec, rank())              # fp16 loss scale, agreed skips, norms
    feed = feeds.for_spec(spec)                           # data="text": the loader, its position checkpointed
    state = feed.carry(plan.state) if feed is not None else plan.state
    # the checkpoint side holds checkpoint_dir for the run; leaving `with`, however the run ends, frees it
    with feeds.feeding(feed), checkpointing.for_spec(spec, guard.checkpointed(state)) as ckpt:
        start, losses = ckpt.resume()
        if feed is not None:
            feed.start(start)                             # the checkpoint's data position (or step 0's)
        observe = StepObserver(spec, plan)                # spans, marks, memory samples
        for step in range(start, spec.steps):
            ckpt.before_step(step)                        # fault injection (fail_at_step)
            observe.step(step)
            share = _micro_steps(spec, plan, step, observe, guard)
            losses.append(0.0 if share is None else share)
            _optimizer_step(spec, plan, step, observe, guard)
            if feed is not None:
                feed.step_done(step)                      # every rank's position past the step
            ckpt.after_step(step + 1, losses)
            if share is not None:                         # the bar sums the shares, as the report does
                progress_share(step + 1, "loss", share, group_members(plan.loss_group))
            shown = {} if share is None or not plan.loss_share else {"loss": share / plan.loss_share}
            progress(step + 1, spec.steps, **shown)       # (and this rank's own loss, until the sum is in)
        events = observe.comm_events()
        info = {"comm": comm_totals(events, max(1, spec.steps - start)), **ckpt.summary(start),
                "numerics": guard.summary(), **(feed.summary() if feed is not None else {})}
    return Trained(losses, start, events, {**info, **observe.memory()})


def _micro_steps(spec: TrainSpec, plan: Plan, step: int, observe: StepObserver,
                 guard: numerics.StepGuard) -> float | None:
    """Forward and backward of every micro-step of ``step``; returns this rank's share of its loss
    (None on a rank that holds no loss)."""
    total, held = 0.0, False
    for micro in range(spec.grad_accum):
        with _accumulating(plan, last=micro == spec.grad_accum - 1):   # all but the last: without talking
            with observe.forward(step, micro):
                loss = plan.forward(step, micro)
            if loss is not None and plan.backward:
                scaled = guard.loss_to_backward(loss)     # fp16: S * loss
                with observe.backward(step, micro, scaled):
                    scaled.backward()
        if loss is not None:
            total, held = total + _value(loss) * plan.loss_share, True
    observe.gradients_ready()
    return total if held else None


def _value(loss: torch.Tensor) -> float:
    """The loss as a number; NaN in a dry run (`distlab.launch.fake`), whose tensors hold no values."""
    return math.nan if loss.is_meta else loss.item()


def _optimizer_step(spec: TrainSpec, plan: Plan, step: int, observe: StepObserver,
                    guard: numerics.StepGuard) -> None:
    """Finish the gradients, check and clip them, step (or skip the step on every rank), zero them."""
    with observe.optimizer(step):
        if plan.sync_grads is not None:
            with observe.grad_sync(step):
                plan.sync_grads()
        if _checked_and_clipped(spec, plan, step, guard):
            plan.optimizer.step()
        else:
            observe.skipped(step)
    plan.optimizer.zero_grad()


def _accumulating(plan: Plan, last: bool):
    """``plan.no_sync()`` for every micro-step but the last: its backward accumulates locally."""
    return plan.no_sync() if (plan.no_sync is not None and not last) else contextlib.nullcontext()


def _checked_and_clipped(spec: TrainSpec, plan: Plan, step: int, guard: numerics.StepGuard) -> bool:
    """Unscale the gradients (fp16) and check them: an inf/NaN on any rank skips the step on every rank
    (returns False); else clip them to the whole model's norm and record it (returns True)."""
    skip = guard.checks and guard.skip(step, plan.grads(), device())
    norm = None
    if not skip and (spec.clip is not None or guard.checks):
        with C.scope(phase="step", operator="grad_norm"):     # checked runs: the norm, unclipped
            norm = plan.clip(spec.clip if spec.clip is not None else math.inf)
    guard.record(step, None if norm is None or norm.is_meta else norm)   # a dry run's norm has no value
    return not skip


def comm_totals(events, steps: int) -> dict:
    """Bytes this rank sent and received in ``events`` (its comm events of the training steps), in
    all, per step, by op and by group (the name a mesh gave it, `runtime.name_group`; else "unnamed")."""
    by_op: dict[str, int] = {}
    by_group: dict[str, int] = {}
    for e in events:
        by_op[e.name] = by_op.get(e.name, 0) + e.sent
        group = e.args.get("group") or "unnamed"
        by_group[group] = by_group.get(group, 0) + e.sent
    sent, received = sum(e.sent for e in events), sum(e.received for e in events)
    return {"sent": sent, "received": received, "sent_per_step": sent / steps, "sent_by_op": by_op,
            "sent_by_group": by_group}


def sum_losses(losses: list[float], group=None) -> list[float]:
    """Every rank's share of each step's loss summed over ``group`` (metrics only: not traced)."""
    if group_size(group) == 1 or device().type == "meta":      # a dry run: NaNs, nobody else to ask
        return losses
    t = torch.tensor(losses, dtype=torch.float64, device=device())
    dist.all_reduce(t, group=group)
    return t.tolist()
