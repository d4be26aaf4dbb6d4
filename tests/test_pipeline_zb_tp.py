"""Zero bubble on tensor-parallel stages: the W pass computes weight gradients locally.

ZB-H1 splits each backward into I (activation gradients, sent upstream at once) and W (weight
gradients, later). On a Megatron stage the activation path crosses the f operator, whose backward
all-reduces; W must not cross it again. So, per step and per rank, ZB-H1 moves exactly the
tensor-parallel bytes 1F1B moves, no collective of the activation path runs inside a W span, and
training still equals the single process; under sequence parallelism the fused all-gather + linears
hand their weight gradients to W too (``grad_fn.postpone``). The single-process tests pin the bookkeeping
that makes W local: a weight used twice (tied embeddings) counted once, and a weight held by a custom
``autograd.Function`` that does not defer (which W cannot isolate) differentiated inside I, never twice.
"""
from __future__ import annotations

import collections

import pytest
import torch

import distlab as dl
from distlab import models
from distlab.strategies.mesh import axis_of

SGD = dict(model="gpt-tiny", steps=2, seed=0, optimizer="sgd", lr=0.1)
# replicated weights' gradients under SP (LayerNorm, row bias) are summed by a gradient hook: W's own traffic
WEIGHT_GRAD_OPERATORS = {"sync_replicated_grad.sum_over_group"}


def _tp_traffic(report):
    """Per rank: TP bytes sent (training steps and the final gather of full weights, equal for every
    schedule), and the TP collectives inside W spans by the function that issued them."""
    out = []
    for r in range(report.world_size):
        trace = report.run.trace
        comms = [e for e in trace.comms(rank=r) if axis_of(e) == "tp"]
        w_spans = [s for s in trace.spans(rank=r, cat="compute") if s.name == "W"]
        in_w = collections.Counter(c.args["operator"] for c in comms
                                   if any(s.start <= c.start and c.end <= s.end for s in w_spans))
        out.append((sum(c.args["sent"] for c in comms), in_w))
    return out


def _assert_matches(report, ref):
    assert report.losses == pytest.approx(ref.losses, rel=1e-5)
    assert sorted(report.params) == sorted(ref.params)
    for name, want in ref.params.items():
        err = (report.params[name] - want).norm().item()
        assert err <= 1e-5 * want.norm().item() + 1e-7, (name, err)


@pytest.fixture(scope="module")
def single():
    return dl.train("single", **SGD)


@pytest.mark.parametrize("sp", [0, 1])
def test_zb_h1_moves_exactly_the_tp_bytes_of_1f1b(sp, single):
    runs = {name: dl.train(f"3d:dp=1,tp=2,pp=2,sp={sp}", world_size=4, options={"schedule": name}, **SGD)
            for name in ("1f1b", "zb-h1")}
    for report in runs.values():
        _assert_matches(report, single)
    one_f_one_b, zero_bubble = _tp_traffic(runs["1f1b"]), _tp_traffic(runs["zb-h1"])
    assert all(sent > 0 for sent, _ in one_f_one_b)
    assert [sent for sent, _ in zero_bubble] == [sent for sent, _ in one_f_one_b]
    executed = {s.name for s in runs["zb-h1"].run.trace.spans(cat="compute")}
    assert {"F", "I", "W"} <= executed and "B" not in executed
    for _, in_w in zero_bubble:
        assert set(in_w) <= (WEIGHT_GRAD_OPERATORS if sp else set()), in_w   # no f/g, no SP gather in W
    trace = runs["zb-h1"].run.trace
    for r in range(4):                                 # SP's fused linears leave their dW to W, not I
        marks = trace.select("mark", rank=r, name="deferred weight grads")
        w_spans = [s for s in trace.spans(rank=r, cat="compute") if s.name == "W"]
        inside = [[m for m in marks if s.start <= m.start <= s.end] for s in w_spans]
        if sp:   # per W: q, k, v and the MLP's first linear of the stage's block, weights and biases
            assert all(len(found) == 1 and found[0].args["count"] >= 8 for found in inside), inside
            assert len(marks) == len(w_spans)
        else:
            assert marks == []


# -- single process: the split is exact where weights are shared or hidden -----------------------
def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_split_equals_backward(build, x, y, loss_fn=None):
    """One ZB-H1 step on a one-stage pipeline leaves the gradients of ``loss.backward()``."""
    torch.manual_seed(0)
    ref = build()
    (dl.pp.default_loss if loss_fn is None else loss_fn)(ref(x), y).backward()
    torch.manual_seed(0)
    model = build()
    dl.pp.Pipeline(model, 0, 1, schedule="zb-h1", microbatches=1, loss_fn=loss_fn).step(x, y)
    want, got = _grads(ref), _grads(model)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_tied_embedding_gradient_is_counted_once():
    cfg = models.GPTConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=2, tied=True)
    x, y = models.MarkovTokens(32, 8, seed=0).batch(0, 4)
    _check_split_equals_backward(lambda: models.GPT(cfg), x, y)


class _Scale(torch.autograd.Function):
    """y = x * w, a custom Function: its backward gives dx and dw in one node, so W cannot have dw alone."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        _Scale.calls += 1
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class _Hidden(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x):
        h = self.lin(x) * self.scale                  # `scale` used where the mode sees it ...
        return _Scale.apply(h, self.scale)            # ... and again where it cannot look


def test_weight_inside_a_custom_function_is_differentiated_once_in_i():
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    _Scale.calls = 0
    _check_split_equals_backward(_Hidden, x, y, loss_fn=torch.nn.functional.mse_loss)
    assert _Scale.calls == 2                          # once for the reference, once in I: never again in W


# -- labels attached from outside survive the split backward -------------------------------------
def _labelled_backward(sp: bool, schedule: str | None):
    """Backward TP collectives of one step, as (where, op, operator) per pass, of a TP GPT labelled by
    `label_modules`: plain ``loss.backward()`` (schedule None) or a one-stage pipeline (I and W)."""
    import torch.distributed as dist
    from distlab.parallel import labels
    alone = [dist.new_group([r]) for r in range(dl.world_size())][dl.rank()]   # a pipeline of one stage
    torch.manual_seed(0)
    gpt = dl.tp.parallelize(models.GPT(models.GPTConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=2)),
                            sequence_parallel=sp)
    labels.label_modules(gpt)
    ids, targets = models.MarkovTokens(32, 8, seed=0).batch(0, 4)

    def loss_fn(logits, y):
        start = gpt.tok.vocab_start
        return dl.tp.vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), start).mean()

    dl.tracer().clear()
    if schedule is None:
        loss_fn(gpt(ids), targets).backward()
    else:
        pipe = dl.pp.Pipeline(gpt, 0, 1, schedule=schedule, microbatches=1, loss_fn=loss_fn, group=alone,
                              observers=[dl.pp.ActionTrace()])          # the I and W spans
        pipe.step(ids, targets)
    spans = {s.name: s for s in dl.tracer().events() if s.kind == "span" and s.name in ("B", "I", "W")}
    out = collections.defaultdict(list)
    for e in dl.tracer().events():
        if e.kind == "comm" and e.args.get("phase") == "backward" or any(
                e.kind == "comm" and s.start <= e.start <= s.end for s in spans.values()):
            where = next((name for name, s in spans.items() if s.start <= e.start <= s.end), "backward")
            out[where].append((e.args.get("where"), e.name, e.args["operator"]))
    return dict(out)


@pytest.mark.parametrize("sp", [False, True])
def test_module_labels_survive_the_split_backward(sp):
    """I runs every TP collective of the plain backward, each labelled with the same module; W runs
    none but the replicated weights' gradient sums (SP)."""
    plain = dl.launch(_labelled_backward, world_size=2, args=(sp, None), output="quiet").results
    split = dl.launch(_labelled_backward, world_size=2, args=(sp, "zb-h1"), output="quiet").results
    for want, got in zip(plain, split):
        backward = want["backward"]
        assert all(where for where, _, _ in backward) and len(backward) >= 5     # 2 per layer, the head
        in_w = [op for _, _, op in got.get("W", [])]
        if sp:
            backward = [c for c in backward if c[2] not in WEIGHT_GRAD_OPERATORS]
            assert in_w and set(in_w) <= WEIGHT_GRAD_OPERATORS
        else:
            assert in_w == []
        assert sorted(c for c in got["I"] if c[2] not in WEIGHT_GRAD_OPERATORS) == sorted(backward)
