"""Know, during backward, when a group of parameters has all its gradients: the trigger for overlap.

    watcher = BackwardWatcher(groups, on_ready=launch_bucket, on_end=wait_all)

``on_ready(i)`` is called as soon as every parameter of ``groups[i]`` has had its gradient
accumulated in this backward pass (``Tensor.register_post_accumulate_grad_hook``), and always in
group order 0, 1, 2, ... so every rank issues its collectives in the same sequence even when
autograd finishes them in a different order. ``on_end()`` runs once when the backward pass is over
(queued with ``Variable._execution_engine.queue_callback``, so the caller of ``loss.backward()``
needs no extra call), after ``on_ready`` for any group still incomplete (unused parameters).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd import Variable


class BackwardWatcher:
    def __init__(self, groups: list[list[torch.Tensor]], on_ready: Callable[[int], None],
                 on_end: Callable[[], None], on_grad: Callable[[torch.Tensor, int], None] | None = None):
        self.groups = groups
        self.on_ready, self.on_end, self.on_grad = on_ready, on_end, on_grad
        self.group_of: dict[int, int] = {}
        for g, params in enumerate(groups):
            for p in params:
                self.group_of[id(p)] = g
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for ps in groups for p in ps]
        self.enabled = True
        self._reset()

    def _reset(self) -> None:
        self.ready_count = [0] * len(self.groups)
        self.next_group = 0
        self.in_backward = False

    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._end)
        g = self.group_of[id(p)]
        if self.on_grad is not None:
            self.on_grad(p, g)
        self.ready_count[g] += 1
        while self.next_group < len(self.groups) and \
                self.ready_count[self.next_group] == len(self.groups[self.next_group]):
            self.next_group += 1
            self.on_ready(self.next_group - 1)

    def _end(self) -> None:
        try:
            while self.next_group < len(self.groups):     # groups with unused parameters
                self.next_group += 1
                self.on_ready(self.next_group - 1)
            self.on_end()
        finally:
            self._reset()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
