"""What the training loop measures around a step, in one object: the loop says *where* it is, the observer
records it.

    observe = StepObserver(spec, plan)
    observe.step(step)                         a "step" mark (with the CPU seconds this rank has run)
    with observe.forward(step, micro): ...     "forward" span, activations counted, memory sample after
    with observe.backward(step, micro, loss):  "backward" span, memory-limit phase, recompute sample after
    observe.gradients_ready()                  memory sample: the model states after backward
    with observe.optimizer(step): ...          "optimizer" span, memory sample after
    with observe.grad_sync(step): ...          "grad sync" span (inside the optimizer's)

It is composed from two parts: the rank's tracer (`distlab.trace`: marks and spans) and, when the strategy
measures its memory (``plan.memory``), the memory ledger (`distlab.memory`: samples by category, the saved
activations, and with ``memory_limit`` a budget that raises the moment it is crossed, naming the phase).
"""
from __future__ import annotations

import contextlib
import time

from ..memory import Ledger, parse_bytes
from ..runtime import tracer


class StepObserver:
    """The loop's instrumentation for one rank's run of ``plan`` (a `loop.Plan`) under ``spec``."""

    def __init__(self, spec, plan):
        self.plan, self.trace = plan, tracer()
        self.ledger = _ledger(spec, plan)
        self.t_start = self.trace.now()

    def step(self, step: int) -> None:
        """A step begins."""
        self.trace.mark("step", step=step, cpu=time.process_time())   # CPU seconds this rank has run so far

    @contextlib.contextmanager
    def forward(self, step: int, micro: int):
        """Around one micro-step's forward (a pipeline's whole schedule: then no "forward" span, its own
        observers draw the actions)."""
        span = self.trace.span("forward", step=step, micro=micro) if self.plan.backward else _nothing()
        with span, self._activations(), self._phase("forward", step):
            yield
        self._sample("forward")

    @contextlib.contextmanager
    def backward(self, step: int, micro: int, loss):
        """Around ``loss.backward()`` (``loss``: where the memory budget checks each accumulated gradient)."""
        with self.trace.span("backward", step=step, micro=micro), self._phase("backward", step, loss):
            yield
        self._sample_rebuilt()

    def gradients_ready(self) -> None:
        """Every micro-step's backward has run."""
        self._sample("backward")

    @contextlib.contextmanager
    def optimizer(self, step: int):
        """Around finishing the gradients and the optimizer's step."""
        with self.trace.span("optimizer", step=step):
            yield
        self._sample("step")

    def grad_sync(self, step: int):
        return self.trace.span("grad sync", step=step)

    def skipped(self, step: int) -> None:
        self.trace.mark("skipped step", step=step)           # an inf/NaN gradient on some rank

    def comm_events(self) -> list:
        """This rank's comm events from the start of the run until now (the training steps)."""
        t_end = self.trace.now()
        return [e for e in self.trace.events() if e.kind == "comm" and self.t_start <= e.start <= t_end]

    def memory(self) -> dict:
        """``{"memory": the ledger}`` when memory was measured, else ``{}``."""
        return {} if self.ledger is None else {"memory": self.ledger.as_dict()}

    # -- the ledger's part ---------------------------------------------------------------------------
    def _activations(self):
        return self.ledger.activations() if self.ledger is not None else _nothing()

    def _phase(self, phase: str, step: int, root=None):
        """Tell the ledger which phase runs (its memory-limit error names it)."""
        return self.ledger.phase(phase, step, root) if self.ledger is not None else _nothing()

    def _sample(self, label: str) -> None:
        if self.ledger is not None:
            self.ledger.sample(label, **self.plan.memory())

    def _sample_rebuilt(self) -> None:
        """recompute=True: a "recompute" sample with the most activations held while backward rebuilt a
        block, beside the model states as after backward (all gradients there: an upper bound for that
        moment)."""
        rebuilt = self.ledger.saved.take_rebuilt() if self.ledger is not None else 0
        if rebuilt:
            self.ledger.sample("recompute", **{**self.plan.memory(), "activations": rebuilt})


def _ledger(spec, plan) -> Ledger | None:
    """The memory ledger when the strategy measures memory; with ``memory_limit`` (bytes or "64MB") it
    raises `distlab.memory.MemoryLimitExceeded` the moment the bytes held cross the budget."""
    limit = spec.memory.memory_limit
    if plan.memory is None:
        if limit is not None:
            raise ValueError(f"memory_limit: strategy {spec.strategy!r} does not measure its memory")
        return None
    return Ledger(limit=None if limit is None else parse_bytes(limit), measure=plan.memory)


_nothing = contextlib.nullcontext
