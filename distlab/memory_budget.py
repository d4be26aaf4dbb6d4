"""A memory budget for `distlab.memory.Ledger`: the out-of-memory error of a GPU, on any machine.

On a GPU, training stops the moment an allocation does not fit: often in backward, where gradients
are allocated while most activations are still alive::

    bytes held   forward: params + optimizer + activations (growing)
                 backward: + grads (growing) - activations (freed as their backward runs)
                 ------------------------------------------------------ limit: crossed here

`Budget` adds up the bytes a ledger counts (the model states its ``measure()`` returns, plus the
activations alive) at every moment autograd saves a tensor (forward), reads one back or accumulates
a parameter's gradient (backward), and at each of the ledger's samples (the end of every forward,
backward and optimizer step), and raises `MemoryLimitExceeded` as soon as they exceed ``limit``,
naming the phase, the step and the category that grew since the previous check. The cures are the
textbook ones: shard the model states (ZeRO-3 / FSDP, Rajbhandari et al. 2020: (2 + 2 + K) Psi / N),
recompute activations (Chen et al. 2016), or a smaller micro-batch.
"""
from __future__ import annotations

import contextlib
import re

import torch

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30}
#: where offloaded bytes live (ZeRO-Offload, ZeRO-Infinity): off the device, so never counted against a
#: limit (a GPU's memory); on a CPU the "device" and the host are one memory, and these say what moved
OFF_DEVICE = ("host", "disk")
CURES = ("shard the model states (strategy='zero3' or 'fsdp': params, grads and optimizer state / N), "
         "recompute activations instead of keeping them (recompute=True), or lower global_batch / raise "
         "grad_accum")


def parse_bytes(value) -> int:
    """A byte count from an int or a string such as "64MB", "1.5GiB", "512kB" (MB = 10^6, MiB = 2^20)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"memory_limit={value!r}: give bytes (an int) or a string like '64MB'")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"memory_limit={value!r}: give a positive number of bytes or a string like "
                         "'64MB' (units: B, kB, MB, GB, KiB, MiB, GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def megabytes(n: int) -> str:
    """Bytes for a message: MB from 1 MB up, kB below (3 decimals: small budgets stay readable)."""
    return f"{n / 1e6:.3f} MB" if n >= 10 ** 6 else f"{n / 1e3:.3f} kB"


def leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors (parameters) whose gradients a backward from ``root`` accumulates: the
    ``AccumulateGrad`` nodes of its graph."""
    found, seen, todo = {}, set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found[id(node.variable)] = node.variable
        todo.extend(fn for fn, _ in node.next_functions)
    return list(found.values())


class MemoryLimitExceeded(torch.OutOfMemoryError):
    """Raised by a `Ledger` with a ``limit`` the moment the bytes it counts cross it (``.phase``,
    ``.category``, ``.held`` and ``.limit`` say where and how much)."""

    def __init__(self, message: str, phase: str = "", category: str = "", held: int = 0, limit: int = 0):
        super().__init__(message)
        self.phase, self.category, self.held, self.limit = phase, category, held, limit


class Budget:
    """``limit`` bytes; ``measure()`` -> model states by category; ``activations()`` -> live bytes."""

    def __init__(self, limit: int, measure, activations):
        if measure is None:
            raise ValueError("a memory limit needs measure(): the model states' bytes by category")
        self.limit, self.measure, self.activations = int(limit), measure, activations
        self.where: tuple[str, int | None] = ("setup", None)
        self.step: int | None = None            # the step of the latest phase (samples follow it)
        self.buffers = 0                        # most transient buffer bytes seen since the last sample
        self.stashed = 0                        # most activations measure() reported since (a pipeline's)
        self.last: dict[str, int] = {}          # the row of the previous check: what grew since
        self.last = self._row()                 # (at the start: the model states as built)

    @contextlib.contextmanager
    def phase(self, name: str, step: int, root: torch.Tensor | None = None):
        """Inside, errors name ``name`` and ``step``; with ``root`` (the loss about to be
        backpropagated), a check also runs as each leaf's gradient is accumulated."""
        before, self.where, self.step = self.where, (name, step), step
        hooks = [] if root is None else [p.register_post_accumulate_grad_hook(lambda _: self.check())
                                         for p in leaves(root)]
        try:
            yield
        finally:
            self.where = before
            for h in hooks:
                h.remove()

    def take_buffers(self) -> int:
        """The buffer peak seen by the checks since the last ledger sample (``measure()`` resets the
        strategy's own peak, so the ledger's sample folds this in)."""
        seen, self.buffers = self.buffers, 0
        return seen

    def take_activations(self) -> int:
        """The most activations ``measure()`` itself reported since the last ledger sample (a pipeline's
        stash peak, which each call resets: the checks took it, so the ledger's sample folds it in)."""
        seen, self.stashed = self.stashed, 0
        return seen

    def check(self) -> None:
        """Measure now (called at every saved tensor packed or unpacked) and compare with the limit."""
        self.check_row(self._row(), self.where[0])

    def _row(self) -> dict[str, int]:
        row = {c: v for c, v in self.measure().items() if c not in OFF_DEVICE}
        self.buffers = max(self.buffers, row.get("buffers", 0))
        self.stashed = max(self.stashed, row.get("activations", 0))
        row["activations"] = self.activations()
        return row

    def check_row(self, row: dict, phase: str) -> None:
        held = sum(row.values())
        grew = {c: row[c] - self.last.get(c, 0) for c in row}
        self.last = dict(row)
        if held <= self.limit:
            return
        category = max(grew, key=lambda c: (grew[c], row[c]))
        at = f"{phase} of step {self.step}" if self.step is not None else phase
        parts = ", ".join(f"{c} {megabytes(v)}" for c, v in row.items())
        raise MemoryLimitExceeded(
            f"out of memory in {at}: {megabytes(held)} held > memory_limit {megabytes(self.limit)} "
            f"when {category} grew to {megabytes(row[category])} ({parts}). To fit: {CURES}",
            phase, category, held, self.limit)
