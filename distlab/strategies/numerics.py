"""Numerics of a training step: fp16 loss scaling, non-finite steps skipped on every rank, norm spikes.

fp16 has 5 exponent bits: its smallest normal number is 2^-14 (6.1e-5) and its largest 65504, so
small gradients underflow to zero. Micikevicius et al. 2018 ("Mixed Precision Training", ICLR)
multiply the loss by a scale S before backward, so every gradient is computed as S g and stays
representable, then divide by S in fp32 before the optimizer steps::

    loss --x S--> backward in fp16 --> S g --(fp32) x 1/S--> g --> finite everywhere? --> step
                                                                     |  no: skip the step, S <- S / 2
                                                                     +- N good steps in a row: S <- 2 S

Dynamic loss scaling (their section 3.2, and torch's ``GradScaler``): start high (2^16), halve S on
every step whose gradients hold an inf or a NaN (the step is skipped: the weights and the optimizer
state do not move), double it after ``growth_interval`` good steps in a row.

Skipping must be *agreed*: under ZeRO or FSDP each rank holds only its shard of the gradient, and a
replica's gradient can go bad on one rank alone, so a rank that steps while another skips leaves the
replicas different forever. `agree_nonfinite` all-reduces one flag (MAX over every rank): a step is
skipped everywhere or nowhere.

`SpikeWatch` records the gradient norm of every step (the global norm the clipper computes) and
names the steps whose norm exceeds ``factor`` times the median of the steps before it, a usual sign
of a loss spike on its way (Chowdhery et al. 2022, PaLM, section 5.1).
"""
from __future__ import annotations

import dataclasses
import math
import statistics

import torch

from ..parallel import collectives as C
from .spec import changed


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018): `scale` the loss, `unscale_` the gradients,
    then `update` with whether any was inf/NaN. ``scale``: S now; ``history``: S at every step."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 backoff: float = 0.5, growth: float = 2.0):
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"loss_scale must be a positive finite number, got {init_scale!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale, self.growth_interval = float(init_scale), growth_interval
        self.backoff, self.growth = backoff, growth
        self.good_steps = 0                     # finite steps since the last change of S

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """S * loss: what backward runs on (gradients come out multiplied by S)."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, grads) -> None:
        """Divide every gradient by S, in place (fp32 gradients: 1/S is a power of two, exact)."""
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)

    def update(self, found_nonfinite: bool) -> None:
        """After the step: halve S on an overflow (that step was skipped), double it after
        ``growth_interval`` good steps in a row."""
        if found_nonfinite:
            self.scale, self.good_steps = self.scale * self.backoff, 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * self.growth, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def local_nonfinite(grads) -> bool:
    """Whether any of ``grads`` (the gradient tensors this rank holds) has an inf or a NaN."""
    return any(not bool(torch.isfinite(g).all()) for g in grads if g.numel())


def agree_nonfinite(found: bool, device) -> bool:
    """``found`` OR-ed over every rank: one all-reduce (MAX) of a one-element flag, so all ranks skip
    a step together or none does."""
    flag = torch.tensor([1.0 if found else 0.0], device=device)      # (1,)
    with C.scope(phase="step", operator="nonfinite"):
        C.all_reduce_max(flag)
    return bool(flag.item() > 0)


class SpikeWatch:
    """Per-step gradient norms, and the steps whose norm is above ``factor`` x the running median of
    the earlier finite norms (after ``warmup`` of them)."""

    def __init__(self, factor: float = 5.0, warmup: int = 3):
        if not (isinstance(factor, (int, float)) and factor > 1):
            raise ValueError(f"spike_factor must be a number > 1, got {factor!r}")
        self.factor, self.warmup = float(factor), warmup
        self.norms: dict[int, float] = {}       # step -> global gradient norm (nan: a skipped step)
        self.spikes: list[dict] = []

    def record(self, step: int, norm: float) -> None:
        earlier = [v for v in self.norms.values() if math.isfinite(v)]
        self.norms[step] = norm
        if len(earlier) >= self.warmup and math.isfinite(norm):
            median = statistics.median(earlier)
            if norm > self.factor * median:
                self.spikes.append({"step": step, "norm": norm, "median": median,
                                    "ratio": norm / median if median else math.inf})


#: the strategies that hand the loop their gradients (`loop.Plan.grads`), where fp16 and the options of
#: `spec.Numerics` apply (each option's type and range: its field's rule)
SUPPORTED = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")


def check(spec, world: int) -> None:
    """Refuse, before any rank starts, fp16 or a numerics option on a strategy that does not hand the
    loop its gradients (`loop.Plan.grads`), and a planted NaN on a rank or a step that does not exist."""
    asked = list(changed(spec.numerics))                 # the options set to other than their defaults
    if (spec.precision == "fp16-mixed" or asked) and spec.strategy not in SUPPORTED:
        what = "precision='fp16-mixed'" if spec.precision == "fp16-mixed" else f"option {asked[0]!r}"
        raise ValueError(f"{what} is supported by {', '.join(SUPPORTED)}, not by {spec.strategy!r}: "
                         "use precision='bf16-mixed' (no loss scaling needed) or one of those strategies")
    o = spec.numerics                                    # each value's type and range: its field's rule
    if o.nan_rank >= world:
        raise ValueError(f"nan_rank={o.nan_rank} but the ranks are 0 .. {world - 1}")
    if o.nan_at_step is not None and o.nan_at_step >= spec.steps:
        raise ValueError(f"nan_at_step={o.nan_at_step} is never reached: the steps are 0 .. "
                         f"{spec.steps - 1} (steps={spec.steps})")


class StepGuard:
    """The loop's side of the numerics for one rank: scales the loss it backpropagates; before the
    optimizer steps, unscales the gradients and decides (with every rank) whether to skip the step;
    records the norm. ``checks``: whether steps are checked at all (fp16, ``skip_nonfinite=True`` or a
    planted NaN); without, only the norms the clipper returns are recorded."""

    def __init__(self, spec, rank: int):
        o = spec.numerics
        fp16 = spec.precision == "fp16-mixed"
        self.scaler = LossScaler(o.loss_scale, o.growth_interval) if fp16 else None
        self.plant = (o.nan_at_step, o.nan_rank) if o.nan_at_step is not None else None
        self.checks = fp16 or o.skip_nonfinite or self.plant is not None
        self.rank, self.watch = rank, SpikeWatch(o.spike_factor)
        self.skipped: list[int] = []            # steps skipped by every rank
        self.seen_here: list[int] = []          # steps whose gradients on this rank were non-finite
        self.scales: list[float] = []           # S used at each step (fp16)

    def loss_to_backward(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def skip(self, step: int, grads: list[torch.Tensor], device) -> bool:
        """Unscale ``grads`` (this rank's, as the optimizer will read them), plant the NaN asked for,
        and return whether any rank found an inf/NaN (then every rank skips this step)."""
        if self.scaler is not None:
            self.scales.append(self.scaler.scale)
            self.scaler.unscale_(grads)
        if self.plant == (step, self.rank):     # fault injection: one element of one rank's gradient
            g = next(g for g in grads if g.numel())
            g.view(-1)[0] = float("nan")
        found = local_nonfinite(grads)
        if found:
            self.seen_here.append(step)
        skip = agree_nonfinite(found, device)
        if skip:
            self.skipped.append(step)
        if self.scaler is not None:
            self.scaler.update(skip)
        return skip

    def checkpointed(self, state):
        """``state`` (a `RankState`) with the loss scale in each rank's own part, so a resume goes on
        with the same S (a resharded resume starts again from the initial S)."""
        if self.scaler is None:
            return state
        capture, restore, scaler = state.capture, state.restore, self.scaler

        def capture_with_scale():
            own, replicated = capture()
            kept = torch.tensor([scaler.scale, scaler.good_steps], dtype=torch.float64)   # (2,)
            return {**own, "loss_scaler": kept}, replicated

        def restore_with_scale(saved: dict):
            kept = saved.pop("loss_scaler", None)
            if kept is not None:
                scaler.load_state_dict({"scale": kept[0].item(), "good_steps": int(kept[1].item())})
            restore(saved)
        return dataclasses.replace(state, capture=capture_with_scale, restore=restore_with_scale)

    def record(self, step: int, norm) -> None:
        """The step's global gradient norm (None: not computed, unless the step was skipped: nan)."""
        if norm is not None or step in self.skipped:
            self.watch.record(step, math.nan if norm is None else float(norm))

    def summary(self) -> dict:
        """Plain values for `RankResult.info["numerics"]`."""
        return {"skipped": list(self.skipped), "nonfinite_here": list(self.seen_here),
                "grad_norms": dict(self.watch.norms), "spikes": list(self.watch.spikes),
                "loss_scales": list(self.scales),
                "loss_scale": None if self.scaler is None else self.scaler.scale}


def notes(summary: dict) -> list[str]:
    """What `dl.train` tells the user about a run's numerics (``StepGuard.summary``): skipped steps,
    the final fp16 loss scale, gradient-norm spikes."""
    out = []
    skipped, norms = summary.get("skipped", []), summary.get("grad_norms", {})
    if skipped:
        scale = summary.get("loss_scale")
        tail = f"; fp16 loss scale now {scale:g}" if scale is not None else ""
        shown = ", ".join(map(str, skipped[:8])) + (", ..." if len(skipped) > 8 else "")
        out.append(f"{len(skipped)} step(s) skipped on every rank for an inf/NaN gradient "
                   f"(step {shown}){tail}")
    for s in summary.get("spikes", []):
        out.append(f"gradient-norm spike at step {s['step']}: {s['norm']:.3g}, {s['ratio']:.1f} x the median "
                   f"of the {sum(1 for k in norms if k < s['step'])} steps before")
    return out
