"""The pipeline executor: run one rank's list of actions from `distlab.parallel.pipeline.schedule`.

``Pipeline.step`` walks ``schedule(name, p, m, v)[rank]`` in order -- the same list the plots and
widgets draw -- and does for each action::

    F s j   receive stage s-1's activation (stage 0: take microbatch j of x), run stage s,
            keep (input, output) for the backward, send the output to stage s+1
            (last stage: loss_j = loss_fn(out, target_j), kept scaled by n_j / n)
    B s j   receive d loss/d output from stage s+1, backpropagate through stage s,
            send d loss/d input to stage s-1, free the kept activations
    I s j   (zero bubble) the input-gradient half of B: only d loss/d input, sent at once
    W s j   (zero bubble) the weight-gradient half, run later in what would be idle time

Scaling each microbatch's loss by its share of the batch, n_j / n, makes the accumulated gradient
the gradient of the whole-batch mean loss: sum_j (n_j/n) grad loss_j = grad loss (GPipe, Huang et
al. 2019). ``step`` returns sum_j (n_j/n) loss_j on the last stage (the mean of the microbatch
losses when they are equal) and ``None`` elsewhere. Gradients accumulate into ``.grad`` as
``loss.backward()`` would; zero them between steps as usual.

Splitting the backward (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"). For a linear
layer y = x W^T + b, the backward has independent products: dx = dy W (needed by the previous
stage *now*) and dW = dy^T x, db = sum dy (needed only by the optimizer). During F, a
``TorchFunctionMode`` hands every operation that takes a parameter its own alias of it
(``w.view_as(w)``) and records (output y_k, aliases a_k). Every *use* of a weight is then a graph
segment of its own, one op long::

    ... x ──(f)──> x' ──┐
                        F.linear ──> y_k ──> ... ──> stage output
    w ──> a_k ──────────┘

    I:  torch.autograd.grad(out, [input, y_1 .. y_K], d_out, retain_graph=True)
        walks the graph once, computing activation gradients only (autograd skips every branch
        that leads to no requested tensor), and keeps d y_k.
    W:  for each use k: torch.autograd.grad(y_k, a_k, d y_k)
        runs just the op that consumed the weight (dW = dy^T x for a linear) -- no Megatron f/g
        operator, no upstream layer lies between y_k and a_k, so W never communicates and never
        recomputes what I did -- then adds the result to .grad (running the parameter's hooks).

So I + W cost about one ordinary backward, not two; the graph (and its saved activations) lives
until W, which is why zero-bubble schedules trade memory for bubble. Weights the mode cannot see
(a custom ``autograd.Function`` takes them directly) get their gradient inside I, with the
activation gradients of the same walk: correct, just not deferred, and still without a second
traversal -- unless the Function defers them itself: sequence parallelism's fused all-gather +
linears leave dW to a `WeightGradStore` that W runs (and W marks ``"deferred weight grads"``).

Communication lives in `distlab.parallel.pipeline.p2p`; tracing: one compute span per action
(name F/B/I/W, args stage, microbatch, step), one comm event per transfer, and after every action
one memory sample ``"pipeline stash"`` with ``activations`` (bytes autograd saved for the
microbatches in flight, measured once per (stage, microbatch) with saved-tensor hooks) and
``microbatches`` (how many are in flight on this rank).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...memory import SavedActivations
from ...runtime import device, tracer
from .p2p import Incoming, Links
from ..weight_grads import WeightGradStore, accumulate_grads
from .zero_bubble import WeightUses
from .schedule import Action, schedule as make_schedule


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for integer targets (logits over the last dim), else mean squared error."""
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())
    return F.mse_loss(output, target)


@dataclass
class _Stash:
    """What one (stage, microbatch) keeps between its forward and its backward."""

    input: torch.Tensor
    output: torch.Tensor                     # stage output; on the last stage, the scaled loss
    uses: "WeightUses | None" = None        # zero bubble: every use of a weight in this forward
    grads: list = field(default_factory=list)    # d y_k after I
    deferred: "WeightGradStore | None" = None   # weight gradients custom Functions left for W
    grad_output: torch.Tensor | None = None
    nbytes: int = 0


class Pipeline:
    """One rank's share of a pipeline-parallel model and the executor of its schedule.

    ``stage_module`` runs stage ``stage_id`` of ``num_stages``; for ``schedule="interleaved"`` pass
    lists: this rank's modules and their stage ids, which must be ``r, r + p, r + 2p, ...``
    (``num_stages = p * v``). ``schedule`` is a name from `distlab.parallel.pipeline.schedule` or the per-rank
    action lists themselves. ``group`` is the pipeline's process group (default: every rank).
    """

    def __init__(self, stage_module, stage_id, num_stages: int, schedule="1f1b", microbatches: int = 8,
                 loss_fn=None, group=None, static_shapes: bool = True):
        modules = list(stage_module) if isinstance(stage_module, (list, tuple)) else [stage_module]
        ids = list(stage_id) if isinstance(stage_id, (list, tuple)) else [stage_id]
        if len(modules) != len(ids):
            raise ValueError(f"got {len(modules)} stage modules but {len(ids)} stage ids: pass one id per module")
        distributed = dist.is_available() and dist.is_initialized()
        self.p = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        v = len(modules)
        if num_stages != self.p * v:
            raise ValueError(f"num_stages={num_stages} but {self.p} pipeline ranks x {v} module(s) per rank = "
                             f"{self.p * v}: every rank holds the same number of stages")
        expected = [self.rank + k * self.p for k in range(v)]
        if sorted(ids) != expected:
            raise ValueError(f"pipeline rank {self.rank} of {self.p} must hold stages {expected}, got {ids}")
        self.modules = dict(zip(ids, modules))
        self.num_stages, self.microbatches = num_stages, microbatches
        self.loss_fn = loss_fn or default_loss
        if isinstance(schedule, str):
            self.schedule_name = schedule
            self.actions: list[Action] = make_schedule(schedule, self.p, microbatches, virtual=v)[self.rank]
        else:
            self.schedule_name = "custom"
            self.actions = list(schedule[self.rank])
        self.links = Links(group, num_stages, device(), static_shapes)
        self.steps = 0
        self._saved_bytes: dict[tuple[int, int], int] = {}

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
        `DDP.start_grad_sync()`, so data parallelism starts its all-reduces during that backward.
        """
        tr = tracer()
        self.links.step = self.steps
        self._inputs = self._split(x, "x", "input batch") if self.first else None
        if self.last:
            self._targets = self._split(target, "target", "targets")
            rows = sum(t.shape[0] for t in self._targets)
            self._weights = [t.shape[0] / rows for t in self._targets]
        self._losses: dict[int, torch.Tensor] = {}
        self._stash: dict[tuple[int, int], _Stash] = {}
        self._incoming: dict[tuple[str, int, int], Incoming] = {}
        tr.mark("pipeline step", step=self.steps)
        grouped = self.links.grouped
        if self.actions:
            self._post_receives(self.actions[0])
        final_b = max((i for i, a in enumerate(self.actions) if a.kind == "B"), default=None)
        for i, action in enumerate(self.actions):
            following = self.actions[i + 1] if i + 1 < len(self.actions) else None
            if following is not None and not grouped:
                self._post_receives(following)       # gloo: post early, the data lands meanwhile
            run = {"F": self._forward, "B": self._backward, "I": self._backward_input,
                   "W": self._backward_weight}[action.kind]
            with last_backward if (i == final_b and last_backward is not None) else _nothing():
                run(action)
            if following is not None and grouped:
                self._post_receives(following)       # NCCL: one group with this action's sends
            self.links.flush()
            tr.memory("pipeline stash", activations=sum(s.nbytes for s in self._stash.values()),
                      microbatches=len(self._stash))
        self.links.wait_sends()
        self.steps += 1
        if self._stash:
            raise RuntimeError(f"schedule left activations of {sorted(self._stash)} without a backward")
        if not self.last:
            return None
        return sum(self._weights[j] * loss for j, loss in sorted(self._losses.items()))

    def _split(self, batch, name: str, what: str) -> list[torch.Tensor]:
        role = "stage 0" if name == "x" else f"the last stage ({self.num_stages - 1})"
        if batch is None:
            raise ValueError(f"Pipeline.step: this rank holds {role}; pass the {what} as {name}=")
        if batch.shape[0] < self.microbatches:
            raise ValueError(f"a batch of {batch.shape[0]} rows cannot make {self.microbatches} microbatches: "
                             "use a bigger batch or fewer microbatches")
        return list(batch.to(device()).tensor_split(self.microbatches))

    def _post_receives(self, action: Action) -> None:
        """Post the receive ``action`` will wait for, if it needs one and its shape is known."""
        kind, s, j = action.kind, action.stage, action.microbatch
        key = (kind, s, j)
        if key in self._incoming:
            return
        if kind == "F" and s > 0:
            self._incoming[key] = self.links.recv_activation(s, j)
        elif kind in ("B", "I") and s < self.num_stages - 1 and (s, j) in self.links.shapes:
            if self.links.shapes[(s, j)][1].is_floating_point:
                self._incoming[key] = self.links.recv_grad(s, j)

    def _receive(self, action: Action) -> torch.Tensor:
        self._post_receives(action)
        return self._incoming.pop((action.kind, action.stage, action.microbatch)).take()

    # -- the four kinds of action ----------------------------------------------------------
    def _forward(self, a: Action) -> None:
        s, j = a.stage, a.microbatch
        if s == 0:
            inp = self._inputs[j]
        else:
            inp = self._receive(a)
            if inp.is_floating_point():
                inp.requires_grad_(True)
        module, stash = self.modules[s], _Stash(inp, None)
        measure = (s, j) not in self._saved_bytes
        with tracer().span("F", stage=s, microbatch=j, step=self.steps):
            if self.split_backward:
                stash.uses = WeightUses(module)
            with SavedActivations(module) if measure else _nothing() as counter, stash.uses or _nothing():
                out = module(inp)
                if s == self.num_stages - 1:
                    loss = self.loss_fn(out, self._targets[j])
                    self._losses[j] = loss.detach()
                    out = loss * self._weights[j]
        if measure:
            self._saved_bytes[(s, j)] = counter.bytes
        stash.output, stash.nbytes = out, self._saved_bytes[(s, j)]
        self._stash[(s, j)] = stash
        if s < self.num_stages - 1:
            self.links.send_activation(s, j, out.detach())

    @property
    def split_backward(self) -> bool:
        return any(a.kind == "I" for a in self.actions)

    def _grad_output(self, a: Action, stash: _Stash) -> torch.Tensor | None:
        """d loss / d (stage output): from the next stage, or None on the last stage (output is the loss)."""
        if a.stage == self.num_stages - 1 or not stash.output.is_floating_point():
            return None
        return self._receive(a)

    def _send_input_grad(self, a: Action, stash: _Stash, grad: torch.Tensor | None) -> None:
        if a.stage > 0 and stash.input.is_floating_point():
            self.links.send_grad(a.stage, a.microbatch, grad if grad is not None else torch.zeros_like(stash.input))

    def _backward(self, a: Action) -> None:
        stash = self._stash.pop((a.stage, a.microbatch))
        grad_out = self._grad_output(a, stash)
        with tracer().span("B", stage=a.stage, microbatch=a.microbatch, step=self.steps):
            if stash.output.requires_grad:
                torch.autograd.backward(stash.output, grad_out)
        self._send_input_grad(a, stash, stash.input.grad)

    def _backward_input(self, a: Action) -> None:
        stash = self._stash[(a.stage, a.microbatch)]
        stash.grad_output = self._grad_output(a, stash)
        wants_input = stash.input.requires_grad
        with tracer().span("I", stage=a.stage, microbatch=a.microbatch, step=self.steps):
            eager = stash.uses.unseen_parameters(stash.output) if stash.output.requires_grad else []
            ys = [y for outputs, _ in stash.uses.deferred for y in outputs]
            targets = ([stash.input] if wants_input else []) + ys + eager
            with WeightGradStore() as stash.deferred:
                grads = (list(torch.autograd.grad(stash.output, targets, stash.grad_output,
                                                  retain_graph=bool(ys), allow_unused=True))
                         if targets and stash.output.requires_grad else [None] * len(targets))
            input_grad = grads.pop(0) if wants_input else None
            stash.grads = grads[:len(ys)]
            accumulate_grads(eager, grads[len(ys):], hooks=False)   # autograd ran their hooks; done in this walk
        self._send_input_grad(a, stash, input_grad)

    def _backward_weight(self, a: Action) -> None:
        stash = self._stash.pop((a.stage, a.microbatch))
        with tracer().span("W", stage=a.stage, microbatch=a.microbatch, step=self.steps):
            dys = iter(stash.grads)
            total: dict[int, list] = {}                    # id(param) -> [param, summed gradient]
            for outputs, aliases in stash.uses.deferred:
                pairs = [(y, dy) for y, dy in zip(outputs, [next(dys) for _ in outputs]) if dy is not None]
                if not pairs:
                    continue
                ys, dy = zip(*pairs)
                grads = torch.autograd.grad(ys, [alias for _, alias in aliases], dy, retain_graph=True,
                                            allow_unused=True)
                for (p, _), g in zip(aliases, grads):
                    _add_grad(total, p, g)
            deferred = stash.deferred.run()
            if deferred:
                tracer().mark("deferred weight grads", stage=a.stage, microbatch=a.microbatch, count=len(deferred))
            for p, g in deferred:                           # e.g. sequence parallelism's fused linears
                _add_grad(total, p, g)
            accumulate_grads([p for p, _ in total.values()], [g for _, g in total.values()])
        stash.uses = stash.deferred = None


def _add_grad(total: dict, p, g) -> None:
    """Sum ``g`` into ``total[id(p)] = [p, gradient so far]`` (a weight may have several uses)."""
    if g is not None:
        entry = total.setdefault(id(p), [p, None])
        entry[1] = g if entry[1] is None else entry[1] + g


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None
