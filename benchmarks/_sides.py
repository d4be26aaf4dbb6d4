"""What the training benchmarks share: one implementation's step (model states sampled from outside),
torch's model-state bytes, and the timed loop in which the implementations take turns.

    impls = {"dl.DDP": Impl(...), "torch DDP": Impl(...)}             # each a `Side`
    times, losses = take_turns(impls, [("dl.DDP", "torch DDP")], batches, warmup, mine)
    states = sampled_states(impls, batches[-1], mine)                  # one more, untimed step
    losses = global_mean(losses)
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.memory import storage_bytes
from distlab.runtime import device, tracer

STATES = ("params", "grads", "optimizer")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def torch_states(model, optimizer) -> dict[str, int]:
    """Model-state bytes of a torch-side implementation, by distinct storage (DTensors: the local shard)."""
    inner = getattr(optimizer, "optim", optimizer)            # ZeroRedundancyOptimizer wraps the local one
    state = [local(t) for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    params = list(model.parameters())
    return {"params": storage_bytes(local(p) for p in params),
            "grads": storage_bytes(local(p.grad) for p in params if p.grad is not None),
            "optimizer": storage_bytes(state)}


class Side:
    """One implementation: a subclass sets ``model``, ``opt`` and ``states()`` (bytes per category)."""

    def step(self, x, y, sample: bool = False) -> torch.Tensor:
        """One training step; with ``sample``, ``self.peak`` gets each model-state category's larger value
        of two samples, after backward (gradients present) and after the step (optimizer state present)."""
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        before = self.states() if sample else None
        self.opt.step()
        if sample:
            after = self.states()
            self.peak = {c: max(before[c], after[c]) for c in STATES}
        return loss.detach()


def sync() -> None:
    if device().type == "cuda":
        torch.cuda.synchronize(device())


def take_turns(impls: dict, groups: list[tuple], batches, warmup: int, mine, first_step: int = 0):
    """Per batch and per group of rival implementations, one step each behind a barrier, the group's
    order reversed every other step (so rivals see the same background load). Returns ({name: step
    seconds from step ``warmup`` on}, {name: losses})."""
    times, losses = {name: [] for name in impls}, {name: [] for name in impls}
    for step, (x, y) in enumerate(batches, start=first_step):
        for group in groups:
            for name in (group if step % 2 == 0 else group[::-1]):
                tracer().clear()                       # (a long run's events are not needed)
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                loss = impls[name].step(mine(x), mine(y))
                sync()
                if step >= warmup:
                    times[name].append(time.perf_counter() - t0)
                losses[name].append(loss)
    return times, losses


def sampled_states(impls: dict, batch, mine) -> dict:
    """One more, untimed step per implementation that samples its model states (`Side.step`)."""
    x, y = batch
    for impl in impls.values():
        impl.step(mine(x), mine(y), sample=True)
    return {name: impl.peak for name, impl in impls.items()}


def global_mean(losses: dict) -> dict:
    """Each implementation's per-step losses averaged over the ranks (their shares of the batch)."""
    out = {}
    for name, values in losses.items():
        t = torch.stack(values).float()
        dist.all_reduce(t)
        out[name] = (t / dist.get_world_size()).tolist()
    return out
