"""Pipeline parallelism: stages, the executor against a single process, and the executed trace.

Every distributed case trains a small GPT for two steps with plain SGD on the same global batch as a
single-process reference and compares losses and every parameter (fp32, rtol 1e-5); the trace of
the same run is checked against the schedule it was told to run.
"""
from __future__ import annotations

import functools

import pytest
import torch

import distlab as dl
from distlab import models
from distlab.memory import PipelineStash
from distlab.parallel.pipeline.measure import ActionTrace
from distlab.parallel.pipeline.schedule import peak_activations, schedule
from distlab.parallel.pipeline.split import _size, boundaries, partition, split, stage_module, units

CFG = models.GPTConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=6)   # 8 units: embed, 6 blocks, head
BATCH, STEPS, LR = 16, 2, 0.5


def _gpt():
    torch.manual_seed(0)
    return models.GPT(CFG)


def _data():
    return models.MarkovTokens(CFG.vocab, CFG.seq_len, seed=0)


@functools.lru_cache(maxsize=None)
def reference():
    """Single-process training: losses per step and final parameters by name."""
    model, data = _gpt(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = data.batch(step, BATCH)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_pipeline(name, microbatch_counts, virtual=1):
    """On each rank: for every m, train a fresh model through a Pipeline; return losses, params, events."""
    p, r = dl.world_size(), dl.rank()
    out = {}
    for m in microbatch_counts:
        dl.tracer().clear()
        model, data = _gpt(), _data()
        ids = [r + k * p for k in range(virtual)]
        modules = [stage_module(model, s, p * virtual) for s in ids]
        pipe = dl.pp.Pipeline(modules if virtual > 1 else modules[0], ids if virtual > 1 else ids[0],
                              p * virtual, schedule=name, microbatches=m,
                              observers=[ActionTrace(), PipelineStash()])     # measured from outside
        opt = torch.optim.SGD(list(pipe.parameters()), lr=LR)
        losses = []
        for step in range(STEPS):
            x, y = data.batch(step, BATCH)
            opt.zero_grad()
            loss = pipe.step(x if pipe.first else None, y if pipe.last else None)
            opt.step()
            losses.append(None if loss is None else loss.item())
        names = {id(q): n for n, q in model.named_parameters()}
        out[m] = (losses, {names[id(q)]: q.detach().clone() for q in pipe.parameters()}, dl.tracer().events())
    return out


def check_against_reference(results, p, virtual=1):
    ref_losses, ref_params = reference()
    last_rank = (p * virtual - 1) % p
    for m in results[0]:
        losses = results[last_rank][m][0]
        assert all(results[r][m][0] == [None] * STEPS for r in range(p) if r != last_rank)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        params = {}
        for r in range(p):
            assert not set(params) & set(results[r][m][1]), "a parameter lives on two stages"
            params.update(results[r][m][1])
        assert set(params) == set(ref_params), "every parameter lives on exactly one stage"
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=f"{n} (m={m})")


def check_trace(events, name, p, m, virtual=1):
    """The executed trace is the schedule: same actions in the same order, dependencies, stash sizes."""
    trace = dl.Trace(e for rank_events in events for e in rank_events)
    plan = schedule(name, p, m, virtual=virtual)
    done = {}
    for step in range(STEPS):
        for r in range(p):
            spans = [e for e in trace.spans(rank=r, cat="compute") if e.args.get("step") == step]
            assert [(e.name, e.args["stage"], e.args["microbatch"]) for e in spans] == \
                   [(a.kind, a.stage, a.microbatch) for a in plan[r]], f"rank {r} did not run its schedule"
            for e in spans:
                done[(step, e.name, e.args["stage"], e.args["microbatch"])] = e
    # across ranks, causality through the messages (each rank's own clock only): the producer posted
    # the send after its action ended; the consumer's receive completed before its action started
    S = p * virtual
    comms = {(e.rank, e.name, e.args["what"], e.args["step"], e.args["stage"], e.args["microbatch"]): e
             for e in trace.comms()}

    def owner(stage):
        return stage % p
    for (step, kind, s, j), e in done.items():
        if kind == "F" and s > 0:
            producer = done[(step, "F", s - 1, j)]
            assert comms[(owner(s - 1), "send", "activation", step, s - 1, j)].start >= producer.end
            assert comms[(owner(s), "recv", "activation", step, s - 1, j)].end <= e.start
        if kind in ("B", "I"):
            assert e.start >= done[(step, "F", s, j)].end, "backward before forward on a stage"
            if s < S - 1:
                producer = done.get((step, "B", s + 1, j)) or done[(step, "I", s + 1, j)]
                assert comms[(owner(s + 1), "send", "grad", step, s + 1, j)].start >= producer.end
                assert comms[(owner(s), "recv", "grad", step, s + 1, j)].end <= e.start
    peaks = [max(e.args["microbatches"] for e in trace.memory_samples(rank=r) if e.name == "pipeline stash")
             for r in range(p)]
    assert peaks == peak_activations(plan), f"{name}: in-flight microbatches {peaks}"
    act_bytes = BATCH * CFG.seq_len * CFG.d_model * 4 * STEPS
    for r in range(p):
        sent_stages = [s for s in range(r, S, p) if s < S - 1]
        assert trace.bytes_sent(rank=r, what="activation") == act_bytes * len(sent_stages)
        grad_stages = [s for s in range(r, S, p) if s > 0]
        assert trace.bytes_sent(rank=r, what="grad") == act_bytes * len(grad_stages)


CASES = [("gpipe", 2), ("1f1b", 2), ("zb-h1", 2), ("gpipe", 3), ("1f1b", 3), ("zb-h1", 3),
         ("gpipe", 4), ("1f1b", 4), ("zb-h1", 4)]


@pytest.mark.parametrize("name, p", CASES)
def test_schedule_matches_single_process_for_every_m(name, p):
    ms = (1, 2, 5, 8)
    results = dl.launch(train_pipeline, world_size=p, args=(name, ms), output="quiet").results
    check_against_reference(results, p)
    for m in ms:
        check_trace([results[r][m][2] for r in range(p)], name, p, m)
    if name == "gpipe":
        assert peak_activations(schedule(name, p, 8)) == [8] * p
    if name == "1f1b":
        assert peak_activations(schedule(name, p, 8)) == [p - i for i in range(p)]


@pytest.mark.parametrize("p, ms", [(2, (2, 4)), (4, (4, 8))])
def test_interleaved_matches_single_process(p, ms):
    results = dl.launch(train_pipeline, world_size=p, args=("interleaved", ms, 2), output="quiet").results
    check_against_reference(results, p, virtual=2)
    for m in ms:
        check_trace([results[r][m][2] for r in range(p)], "interleaved", p, m, virtual=2)


def test_eight_stages_with_fewer_microbatches_than_stages():
    results = dl.launch(train_pipeline, world_size=8, args=("1f1b", (3,)), output="quiet").results
    check_against_reference(results, 8)
    check_trace([results[r][3][2] for r in range(8)], "1f1b", 8, 3)


# -- single process: the executor with p = 1, the split backward, stages, errors ------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_one_stage_pipeline_is_gradient_accumulation(name):
    ref_losses, ref_params = reference()
    model, data = _gpt(), _data()
    pipe = dl.pp.Pipeline(model, 0, 1, schedule=name, microbatches=5)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data.batch(step, BATCH)
        opt.zero_grad()
        loss = pipe.step(x, y)
        opt.step()
        assert loss.item() == pytest.approx(ref_losses[step], rel=1e-5)
    for n, q in model.named_parameters():
        torch.testing.assert_close(q.detach(), ref_params[n], rtol=1e-5, atol=1e-6)


def test_zero_bubble_input_pass_computes_no_weight_gradient():
    """Every weight gradient is computed inside a W span, none inside an I span."""
    model, data = _gpt(), _data()
    tr = dl.tracer()
    tr.clear()
    fired = []
    for q in model.parameters():
        q.register_hook(lambda g: fired.append(tr.now()) or g)
    pipe = dl.pp.Pipeline(model, 0, 1, schedule="zb-h1", microbatches=2, observers=[ActionTrace()])
    pipe.step(*data.batch(0, BATCH))
    spans = tr.events()

    def inside(t, kind):
        return any(e.kind == "span" and e.name == kind and e.start <= t <= e.end for e in spans)
    assert fired and all(inside(t, "W") for t in fired)
    assert not any(inside(t, "I") for t in fired)
    assert {e.name for e in spans if e.kind == "span"} == {"F", "I", "W"}


def observed_and_bare(name):
    """On each rank: one step with no observers, then one with both; every event of each."""
    p, r = dl.world_size(), dl.rank()
    model, data = _gpt(), _data()
    pipe = dl.pp.Pipeline(stage_module(model, r, p), r, p, schedule=name, microbatches=4)
    x, y = data.batch(0, BATCH)
    tr = dl.tracer()
    tr.clear()
    pipe.step(x if pipe.first else None, y if pipe.last else None)
    bare = tr.events()
    tr.clear()
    pipe.observers += [ActionTrace(), PipelineStash()]
    pipe.step(x if pipe.first else None, y if pipe.last else None)
    saved = None
    if pipe.first:                                     # stage 0's forward of microbatch 0, measured alone
        with dl.memory.SavedActivations(pipe.modules[0]) as counter:
            pipe.modules[0](x.tensor_split(4)[0])
        saved = counter.bytes
    return bare, tr.events(), saved


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_the_executor_records_nothing_itself_observers_record_from_outside(name):
    """Without observers a step leaves only the comm events (written by collectives.record, with the
    message's own what/stage/microbatch and no step); with them, a span per action, the step mark, the
    step tag on every message, and a stash sample after every action whose bytes are the forward's."""
    results = dl.launch(observed_and_bare, world_size=2, args=(name,), output="quiet").results
    plan = schedule(name, 2, 4)
    for r, (bare, observed, saved) in enumerate(results):
        assert {e.kind for e in bare} == {"comm"}
        assert all("step" not in e.args and {"what", "stage", "microbatch"} <= set(e.args) for e in bare)
        spans = [(e.name, e.args["stage"], e.args["microbatch"]) for e in observed if e.kind == "span"]
        assert spans == [(a.kind, a.stage, a.microbatch) for a in plan[r]]
        assert [e.name for e in observed if e.kind == "mark"] == ["pipeline step"]
        comms = [e for e in observed if e.kind == "comm"]
        assert comms and all(e.args["step"] == 1 for e in comms)

        def messages(events):
            return sorted((e.name, e.args["what"], e.args["stage"], e.args["microbatch"], e.sent, e.received)
                          for e in events if e.args["what"] != "shape")
        assert messages(comms) == messages(bare)
        samples = [e for e in observed if e.kind == "memory"]
        assert len(samples) == len(plan[r]) and max(e.args["microbatches"] for e in samples) == \
            peak_activations(plan)[r]
        if r == 0:
            assert samples[0].args == {"activations": saved, "microbatches": 1} and saved > 0


def test_stage_split_keeps_names_shares_parameters_and_balances():
    model = _gpt()
    parts = split(model, 3)
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert names[:2] == ["tok.weight", "pos.weight"]
    assert all(q is dict(model.named_parameters())[n] for part in parts for n, q in part.named_parameters())
    x, _ = _data().batch(0, 4)
    h = x
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, model(x))
    assert partition([1] * 8, 3) == [(0, 2), (2, 5), (5, 8)]
    assert partition([5, 1, 1, 1, 1, 5], 3) == [(0, 1), (1, 5), (5, 6)]     # minimises the largest
    by_params = boundaries(model, 3, balance="params")
    sizes = [sum(_size(u) for u in units(model)[a:b]) for a, b in by_params]
    even = [sum(_size(u) for u in units(model)[a:b]) for a, b in boundaries(model, 3)]
    assert max(sizes) <= max(even)
    mlp = models.MLP((4, 8, 8, 8, 2))
    mx = torch.randn(3, 4)
    torch.testing.assert_close(split(mlp, 2)[1](split(mlp, 2)[0](mx)), mlp(mx))


def test_clear_errors():
    model = _gpt()
    with pytest.raises(ValueError, match="num_stages=2"):
        dl.pp.Pipeline(model, 0, 2)
    with pytest.raises(ValueError, match="must hold stages"):
        dl.pp.Pipeline(model, 1, 1)
    pipe = dl.pp.Pipeline(model, 0, 1, microbatches=4)
    with pytest.raises(ValueError, match="pass the input batch as x="):
        pipe.step(None, torch.zeros(4, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot make 4 microbatches"):
        pipe.step(*_data().batch(0, 2))
    with pytest.raises(ValueError, match="multiple of stages"):
        dl.pp.schedule("interleaved", 2, 3, virtual=2)
    with pytest.raises(ValueError, match="tied"):
        split(models.GPT(models.GPTConfig(tied=True)), 2)
    with pytest.raises(TypeError, match="cannot split"):
        split(torch.nn.Linear(2, 2), 2)


@pytest.mark.parametrize("strategy, world",
                         [("pp-gpipe", 4), ("pp-1f1b", 2), ("pp-interleaved", 2), ("pp-zb-h1", 4)])
def test_strategy_runner_matches_single(strategy, world):
    kw = dict(model="gpt-tiny", steps=3, seed=0, optimizer="sgd", lr=0.5, grad_accum=2, clip=1.0)
    ref = dl.train(strategy="single", world_size=1, **kw)
    rep = dl.train(strategy=strategy, world_size=world, output="quiet", **kw)
    torch.testing.assert_close(torch.tensor(rep.losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6)
    assert set(rep.params) == set(ref.params)
    for n, t in ref.params.items():
        torch.testing.assert_close(rep.params[n], t, rtol=1e-5, atol=1e-6)
