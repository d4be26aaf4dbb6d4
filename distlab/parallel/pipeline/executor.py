"""The pipeline executor: run one rank's list of actions from `distlab.parallel.pipeline.schedule`.

``Pipeline.step`` walks ``schedule(name, p, m, v)[rank]`` in order -- the same list the plots and
widgets draw. Every action is the same three moves: receive what it needs, compute, send what it
made::

             receive                      compute                          send
    F s j    activation (s-1, j)          out_j = stage_s(in_j); keep both activation (s, j) -> s+1
             (stage 0: microbatch j of x) (last stage: loss_j = loss_fn(out_j, target_j))
    B s j    d loss/d out_j from s+1      backpropagate through stage s    d loss/d in_j -> s-1
    I s j    d loss/d out_j from s+1      the input-gradient half of B     d loss/d in_j -> s-1
    W s j    --                           the weight-gradient half of B    --

GPipe (Huang et al. 2019) runs all F then all B; 1F1B (Narayanan et al. 2021) alternates them after
a warm-up; ZB-H1 (Qi et al. 2023) splits B into I and W and runs W late, in what would be idle time
(`distlab.parallel.pipeline.zero_bubble`). The executor does not care: the schedule is data.

Each microbatch's loss is scaled by its share of the batch, n_j / n, so the accumulated gradient is
the gradient of the whole-batch mean loss: sum_j (n_j/n) grad loss_j = grad loss. ``step`` returns
sum_j (n_j/n) loss_j on the last stage and ``None`` elsewhere; gradients accumulate into ``.grad``
as ``loss.backward()`` would (zero them between steps as usual).

Measuring happens outside: ``observers`` (like an ``nn.Module``'s forward hooks) are entered around
each step and around the compute of each action, and may read ``pipe.stash``, the activations held
for the microbatches in flight. `distlab.parallel.pipeline.measure.ActionTrace` records a span per
action; `distlab.memory.PipelineStash` the activation bytes in flight. Messages: `p2p.py`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...runtime import device, group_rank, group_size
from ..cuts import Mark
from ..mesh import as_group
from .named import tensor_of
from .p2p import Incoming, Links
from .schedule import Action, schedule as make_schedule
from .zero_bubble import WeightUses, accumulate_grads, postpone_weight_work, run_postponed


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for integer targets (logits over the last dim), else mean squared error."""
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())
    return F.mse_loss(output, target)


@dataclass
class Stash:
    """What one (stage, microbatch) keeps from its forward until its backward (B, or W after I)."""

    input: torch.Tensor
    output: torch.Tensor                       # stage output; on the last stage, the scaled loss
    uses: WeightUses | None = None             # zero bubble: every use of a weight in this forward
    grads: list = field(default_factory=list)  # zero bubble: d y_k for every use, kept by I for W
    deferred: list = field(default_factory=list)  # zero bubble: dW work custom Functions left for W


class Observer:
    """Watches a `Pipeline` from outside. Both methods return a context manager (default: nothing)."""

    def around_step(self, pipe: "Pipeline"):
        return contextlib.nullcontext()

    def around_action(self, pipe: "Pipeline", action: Action):
        return contextlib.nullcontext()


class Pipeline:
    """One rank's share of a pipeline-parallel model and the executor of its schedule.

    ``stage_module`` runs stage ``stage_id`` of ``num_stages``; for ``schedule="interleaved"`` pass
    lists: this rank's modules and their stage ids, which must be ``r, r + p, r + 2p, ...``
    (``num_stages = p * v``). ``schedule`` is a name from `distlab.parallel.pipeline.schedule` or the
    per-rank action lists themselves. ``group`` is the pipeline's process group (default: every rank).
    ``observers``: see `Observer`; append to ``pipe.observers`` to attach one later. ``output``: which
    tensor flows on when a stage returns a ``ModelOutput``, tuple or dict (`named.tensor_of`: a key or
    index; by default ``last_hidden_state``, ``logits`` or the first tensor).
    """

    def __init__(self, stage_module, stage_id, num_stages: int, schedule="1f1b", microbatches: int = 8,
                 loss_fn=None, group=None, static_shapes: bool = True, observers=(), output=None):
        modules = list(stage_module) if isinstance(stage_module, (list, tuple)) else [stage_module]
        ids = list(stage_id) if isinstance(stage_id, (list, tuple)) else [stage_id]
        if len(modules) != len(ids):
            raise ValueError(f"got {len(modules)} stage modules but {len(ids)} stage ids: "
                             "pass one id per module")
        group = as_group(group)                       # a 1-D mesh (mesh["pp"]): its process group
        self.p, self.rank = group_size(group), group_rank(group)
        v = len(modules)
        if num_stages != self.p * v:
            raise ValueError(f"num_stages={num_stages} but {self.p} pipeline ranks x {v} module(s) per rank"
                             f" = {self.p * v}: every rank holds the same number of stages")
        expected = [self.rank + k * self.p for k in range(v)]
        if sorted(ids) != expected:
            raise ValueError(f"pipeline rank {self.rank} of {self.p} must hold stages {expected}, got {ids}")
        self.modules = dict(zip(ids, modules))
        for param in (q for m in modules for q in m.parameters()) if self.p > 1 else ():
            param._pipeline_of = Mark((group,))         # a stage's: dl.clip_grad_norm_ on bare parameters
        self.num_stages, self.microbatches = num_stages, microbatches
        self.loss_fn, self.output = loss_fn or default_loss, output
        if isinstance(schedule, str):
            self.schedule_name = schedule
            self.actions: list[Action] = make_schedule(schedule, self.p, microbatches, virtual=v)[self.rank]
        else:
            self.schedule_name = "custom"
            self.actions = list(schedule[self.rank])
        self.split_backward = any(a.kind == "I" for a in self.actions)
        self.links = Links(group, num_stages, device(), static_shapes)
        self.observers = list(observers)
        self.stash: dict[tuple[int, int], Stash] = {}       # (stage, microbatch) -> kept for the backward
        self.steps = 0

    @property
    def first(self) -> bool:
        """Does this rank hold stage 0 (and so take ``x``)?"""
        return 0 in self.modules

    @property
    def last(self) -> bool:
        """Does this rank hold the last stage (and so take ``target`` and return the loss)?"""
        return self.num_stages - 1 in self.modules

    def parameters(self):
        for module in self.modules.values():
            yield from module.parameters()

    # -- one training step -------------------------------------------------------------------
    def step(self, x: torch.Tensor | None = None, target: torch.Tensor | None = None, *,
             last_backward=None) -> torch.Tensor | None:
        """Forward and backward every microbatch of one batch, in this rank's schedule order.

        ``last_backward``: a context manager entered around this rank's final B action (not I/W), e.g.
        `grad_sync.ReplicaGradSync.last_backward()`, so data parallelism starts its all-reduces during
        that backward.
        """
        self._begin(x, target)
        final_b = max((i for i, a in enumerate(self.actions) if a.kind == "B"), default=None)
        around = {final_b: last_backward} if last_backward is not None else {}
        compute = {"F": self._forward, "B": self._backward, "I": self._backward_input,
                   "W": self._backward_weight}
        with self._observed():
            for i, action in enumerate(self.actions):
                following = self.actions[i + 1] if i + 1 < len(self.actions) else None
                if following is not None and not self.links.grouped:
                    self._post_receive(following)        # gloo: post early, the data lands meanwhile
                incoming = self._receive(action)
                with around.get(i, contextlib.nullcontext()), self._observed(action):
                    outgoing = compute[action.kind](action, incoming)
                self._send(action, outgoing)
                if following is not None and self.links.grouped:
                    self._post_receive(following)        # NCCL: one group with this action's sends
                self.links.flush()
            self.links.wait_sends()
        self.steps += 1
        if self.stash:
            raise RuntimeError(f"schedule left activations of {sorted(self.stash)} without a backward")
        return sum(self._weights[j] * loss for j, loss in sorted(self._losses.items())) if self.last else None

    def _begin(self, x, target) -> None:
        """Cut the batch into microbatches (``tensor_split`` along dim 0); forget the last step's messages."""
        self._inputs = self._split(x, "x", "input batch") if self.first else None
        if self.last:
            self._targets = self._split(target, "target", "targets")
            rows = sum(t.shape[0] for t in self._targets)
            self._weights = [t.shape[0] / rows for t in self._targets]      # n_j / n
        self._losses: dict[int, torch.Tensor] = {}
        self._incoming: dict[tuple[str, int, int], Incoming] = {}

    def _split(self, batch, name: str, what: str) -> list[torch.Tensor]:
        role = "stage 0" if name == "x" else f"the last stage ({self.num_stages - 1})"
        if batch is None:
            raise ValueError(f"Pipeline.step: this rank holds {role}; pass the {what} as {name}=")
        if batch.shape[0] < self.microbatches:
            raise ValueError(f"a batch of {batch.shape[0]} rows cannot make {self.microbatches} microbatches:"
                             " use a bigger batch or fewer microbatches")
        return list(batch.to(device()).tensor_split(self.microbatches))

    @contextlib.contextmanager
    def _observed(self, action: Action | None = None):
        """Every observer's ``around_step`` (no action) or ``around_action``, entered in order."""
        with contextlib.ExitStack() as stack:
            for obs in self.observers:
                around = obs.around_step(self) if action is None else obs.around_action(self, action)
                stack.enter_context(around)
            yield

    # -- messages: what an action receives and sends -------------------------------------------
    def _post_receive(self, a: Action) -> None:
        """Post the receive ``a`` will wait for, if it needs one and its shape is known."""
        key, s, j = (a.kind, a.stage, a.microbatch), a.stage, a.microbatch
        if key in self._incoming:
            return
        if a.kind == "F" and s > 0:
            self._incoming[key] = self.links.recv_activation(s, j)
        elif a.kind in ("B", "I") and s < self.num_stages - 1 and (s, j) in self.links.shapes:
            if self.links.shapes[(s, j)][1].is_floating_point:
                self._incoming[key] = self.links.recv_grad(s, j)

    def _receive(self, a: Action) -> torch.Tensor | None:
        """What action ``a`` consumes: F its stage's input, B and I d loss / d (stage output), W nothing."""
        s, j = a.stage, a.microbatch
        if a.kind == "F" and s == 0:
            return self._inputs[j]                       # microbatch j of x
        if a.kind == "W":
            return None
        if a.kind in ("B", "I"):
            output = self.stash[(s, j)].output
            if s == self.num_stages - 1 or not output.is_floating_point():
                return None                              # the output is the loss, or carries no gradient
        self._post_receive(a)
        data = self._incoming.pop((a.kind, s, j)).take()
        return data.requires_grad_(True) if a.kind == "F" and data.is_floating_point() else data

    def _send(self, a: Action, out: torch.Tensor | None) -> None:
        if out is None:
            return
        if a.kind == "F":
            self.links.send_activation(a.stage, a.microbatch, out)
        else:
            self.links.send_grad(a.stage, a.microbatch, out)

    def _input_grad(self, a: Action, stash: Stash, grad: torch.Tensor | None) -> torch.Tensor | None:
        """What goes back to stage s-1: d loss / d (this stage's input) (zeros if it did not reach it)."""
        if a.stage == 0 or not stash.input.is_floating_point():
            return None
        return grad if grad is not None else torch.zeros_like(stash.input)

    # -- the four kinds of action ----------------------------------------------------------
    def _forward(self, a: Action, inp: torch.Tensor) -> torch.Tensor | None:
        s, j = a.stage, a.microbatch
        uses = WeightUses(self.modules[s]) if self.split_backward else None
        stash = self.stash[(s, j)] = Stash(inp, None, uses)
        with uses or contextlib.nullcontext():
            out = tensor_of(self.modules[s](inp), self.output, f"stage {s}")   # microbatch j through stage s
            if s == self.num_stages - 1:
                loss = self.loss_fn(out, self._targets[j])
                self._losses[j] = loss.detach()
                out = loss * self._weights[j]            # backward from (n_j / n) loss_j
        stash.output = out
        return out.detach() if s < self.num_stages - 1 else None

    def _backward(self, a: Action, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        stash = self.stash.pop((a.stage, a.microbatch))
        if stash.output.requires_grad:
            torch.autograd.backward(stash.output, grad_out)
        return self._input_grad(a, stash, stash.input.grad)

    def _backward_input(self, a: Action, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """I: one walk of the graph for d loss/d input and d loss/d y_k of every weight use (kept for W)."""
        stash = self.stash[(a.stage, a.microbatch)]
        wants_input = stash.input.requires_grad
        eager = stash.uses.unseen_parameters(stash.output) if stash.output.requires_grad else []
        ys = [y for outputs, _ in stash.uses.deferred for y in outputs]
        targets = ([stash.input] if wants_input else []) + ys + eager
        stash.deferred = postpone_weight_work(stash.uses.postponing)    # fused custom Functions leave dW here
        grads = (list(torch.autograd.grad(stash.output, targets, grad_out, retain_graph=bool(ys),
                                          allow_unused=True))
                 if targets and stash.output.requires_grad else [None] * len(targets))
        input_grad = grads.pop(0) if wants_input else None
        stash.grads = grads[:len(ys)]
        accumulate_grads(eager, grads[len(ys):], hooks=False)    # autograd ran their hooks in this walk
        return self._input_grad(a, stash, input_grad)

    def _backward_weight(self, a: Action, _: None) -> None:
        """W: dW = dy_k^T x for every use k of a weight (one op each), plus what custom Functions deferred."""
        stash = self.stash.pop((a.stage, a.microbatch))
        dys = iter(stash.grads)
        total: dict[int, list] = {}                      # id(param) -> [param, summed gradient]
        for outputs, aliases in stash.uses.deferred:
            pairs = [(y, dy) for y, dy in zip(outputs, [next(dys) for _ in outputs]) if dy is not None]
            if not pairs:
                continue
            ys, dy = zip(*pairs)
            grads = torch.autograd.grad(ys, [alias for _, alias in aliases], dy, retain_graph=True,
                                        allow_unused=True)
            for (p, _), g in zip(aliases, grads):
                _add_grad(total, p, g)
        for p, g in run_postponed(stash.deferred):        # e.g. sequence parallelism's fused linears
            _add_grad(total, p, g)
        accumulate_grads([p for p, _ in total.values()], [g for _, g in total.values()])


def _add_grad(total: dict, p, g) -> None:
    """Sum ``g`` into ``total[id(p)] = [p, gradient so far]`` (a weight may have several uses)."""
    if g is not None:
        entry = total.setdefault(id(p), [p, None])
        entry[1] = g if entry[1] is None else entry[1] + g
