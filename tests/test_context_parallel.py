"""dl.cp: ring attention and Ulysses equal plain attention on the gathered sequence, forward and backward.

One launch per world size (2, 3, 4) runs every case: both attentions x causal or not x zig-zag or
contiguous. Every rank draws the same full q, k, v, computes the reference in float64 on the whole
sequence, and checks its own float32 rows and gradients against the reference's rows (`dl.cp.split`).
Tolerance: |got - want| <= ATOL + RTOL |want|, fp32 rounding of O(1) values over a few dozen terms
(the observed error is ~1e-6).
"""
from __future__ import annotations

import functools

import pytest
import torch

import distlab as dl

ATOL, RTOL = 2e-5, 1e-5
WORLDS = [2, 3, 4]
CASES = [(attn, causal, zigzag) for attn in ("ring", "ulysses") for causal in (True, False)
         for zigzag in (True, False)]


def _shape(n: int) -> tuple[int, int, int, int]:
    """(batch, heads, seq, head_dim): heads divisible by n (Ulysses), seq by 2n (zig-zag), chunks of 3."""
    return 2, 2 * n, 6 * n, 4


def _reference(q, k, v, causal):
    """Plain attention in float64 on the whole sequence: (out, (dq, dk, dv)) for loss = sum(out * w)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    return out, (q, k, v)


def _case(attn: str, causal: bool, zigzag: bool, seed: int) -> list[str]:
    n = dl.world_size()
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(_shape(n), generator=g) for _ in range(4))     # the same on every rank
    out, leaves = _reference(q, k, v, causal)
    grads = torch.autograd.grad((out * w.double()).sum(), leaves)

    mine = [dl.cp.split(t, dim=2, zigzag=zigzag).clone().requires_grad_() for t in (q, k, v)]
    fn = dl.cp.ring_attention if attn == "ring" else dl.cp.ulysses_attention
    got = fn(*mine, causal=causal, zigzag=zigzag)                           # (B, H, s/n, D)
    (got * dl.cp.split(w, dim=2, zigzag=zigzag)).sum().backward()
    label = f"rank {dl.rank()}: {attn} causal={causal} zigzag={zigzag}"
    bad = []
    for name, a, b in [("out", got, out)] + [(f"d{x}", t.grad, gr) for x, t, gr in zip("qkv", mine, grads)]:
        want = dl.cp.split(b.float(), dim=2, zigzag=zigzag)
        if a is None or a.dtype != torch.float32 or not torch.allclose(a, want, atol=ATOL, rtol=RTOL):
            err = None if a is None else (a - want).abs().max().item()
            bad.append(f"{label}: {name} differs (max error {err})")
    if not torch.allclose(dl.cp.unsplit(got, dim=2, zigzag=zigzag), out.float(), atol=ATOL, rtol=RTOL):
        bad.append(f"{label}: unsplit output differs from the full attention")
    return bad


def _float64() -> list[str]:
    """float64 inputs keep float64 precision (issue 19: ring attention accumulated in float32, 5.7e-7 off)."""
    n, bad = dl.world_size(), []
    g = torch.Generator().manual_seed(99)
    q, k, v, w = (torch.randn(_shape(n), generator=g, dtype=torch.float64) for _ in range(4))
    out, leaves = _reference(q, k, v, causal=True)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    for attn, fn in (("ring", dl.cp.ring_attention), ("ulysses", dl.cp.ulysses_attention)):
        mine = [dl.cp.split(t.detach(), dim=2).clone().requires_grad_() for t in (q, k, v)]
        got = fn(*mine, causal=True, zigzag=True)
        (got * dl.cp.split(w, dim=2)).sum().backward()
        pairs = [("out", got, out)] + [(f"d{x}", t.grad, gr) for x, t, gr in zip("qkv", mine, grads)]
        for name, a, b in pairs:
            err = (a - dl.cp.split(b.detach(), dim=2)).abs().max().item()
            if a.dtype != torch.float64 or err > 1e-12:
                bad.append(f"rank {dl.rank()}: {attn} float64 {name}: dtype {a.dtype}, max error {err:.1e}")
    return bad


def _layouts() -> list[str]:
    """split/unsplit: the chunks each rank holds, and the round trip on other dims."""
    r, n = dl.rank(), dl.world_size()
    bad = []
    x = torch.arange(4 * n * 3 * 2).view(2, 4 * n, 3)                        # sequence on dim 1
    chunks = x.chunk(2 * n, 1)
    if not torch.equal(dl.cp.split(x, dim=1), torch.cat([chunks[r], chunks[2 * n - 1 - r]], 1)):
        bad.append(f"rank {r}: zig-zag split is not chunks r and 2n-1-r")
    if not torch.equal(dl.cp.split(x, dim=1, zigzag=False), x.chunk(n, 1)[r]):
        bad.append(f"rank {r}: contiguous split is not chunk r")
    for zigzag in (True, False):
        for dim in (1, -2):
            if not torch.equal(dl.cp.unsplit(dl.cp.split(x, dim, zigzag=zigzag), dim, zigzag=zigzag), x):
                bad.append(f"rank {r}: unsplit(split(x, dim={dim}, zigzag={zigzag})) != x")
    return bad


def _bad_input() -> list[str]:
    """Errors raised inside ranks, with what to change."""
    n = dl.world_size()
    bad = []
    cases = [(lambda: dl.cp.split(torch.ones(1, 1, 2 * n + 1, 2)), "multiple of 2 x cp"),
             (lambda: dl.cp.split(torch.ones(1, 1, n + 1, 2), zigzag=False), f"multiple of cp = {n}"),
             (lambda: dl.cp.ring_attention(*[torch.ones(1, 1, 3, 2)] * 3), "zigzag=False"),
             (lambda: dl.cp.ulysses_attention(*[torch.ones(1, n + 1, 2, 2)] * 3), "heads must be a multiple"),
             (lambda: dl.cp.ring_attention(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 4, 2),
                                           torch.ones(1, 1, 2, 2)), "same shape")]
    for call, message in cases:
        try:
            call()
            bad.append(f"no error (wanted {message!r})")
        except ValueError as e:
            if message not in str(e):
                bad.append(f"unclear error {e} (wanted {message!r})")
    return bad


def _traced() -> None:
    """Ring attention and Ulysses forward and backward on local parts of 2n tokens (batch 1: a shape no
    other call has), for the trace."""
    n = dl.world_size()
    q, k, v = (torch.randn(1, 2 * n, 2 * n, 4, requires_grad=True) for _ in range(3))
    dl.cp.ring_attention(q, k, v).sum().backward()
    dl.cp.ulysses_attention(q, k, v).sum().backward()


def _saved_bytes() -> list[str]:
    """What one GPT layer saves for backward per rank under dl.cp, against `cp_saved_bytes_per_layer`."""
    from distlab.memory import measure_layer
    n, bad = dl.world_size(), []
    for attention in ("ring", "ulysses"):
        for s in (4 * n, 8 * n):
            torch.manual_seed(0)
            cfg = dl.models.GPTConfig(vocab=16, seq_len=s, d_model=4 * n, heads=2 * n, layers=1)
            gpt = dl.cp.parallelize(dl.models.GPT(cfg), attention=attention)
            got = measure_layer(gpt.blocks[0], torch.randn(2, s // n, 4 * n))
            want = dl.theory.cp_saved_bytes_per_layer(s, 2, 4 * n, 2 * n, cp=n)
            if got != want:
                bad.append(f"rank {dl.rank()}: {attention} s={s} saves {got} bytes, formula {want}")
    return bad


def _flops() -> list[str]:
    """Forward matmul FLOPs counted by torch's FlopCounterMode against `ring_attention_flops`."""
    from torch.utils.flop_counter import FlopCounterMode
    n, r, bad = dl.world_size(), dl.rank(), []
    for causal in (True, False):
        for zigzag in (True, False):
            q, k, v = (torch.randn(2, 3, 4, 5) for _ in range(3))              # s = 4n, h = 3 x 5
            with FlopCounterMode(display=False) as counter:
                dl.cp.ring_attention(q, k, v, causal=causal, zigzag=zigzag)
            want = dl.theory.ring_attention_flops(4 * n, 2, 15, n, causal=causal, zigzag=zigzag)[r]
            if counter.get_total_flops() != want:
                bad.append(f"rank {r} causal={causal} zigzag={zigzag}: {counter.get_total_flops()} FLOPs, "
                           f"formula {want}")
    return bad


def _everything() -> dict:
    _traced()
    dl.tracer().enabled = False
    problems = [p for i, case in enumerate(CASES) for p in _case(*case, seed=i)]
    return {"attention": problems, "layout": _layouts(), "errors": _bad_input(), "memory": _saved_bytes(),
            "flops": _flops(), "float64": _float64()}


@functools.lru_cache(maxsize=None)
def _run(n: int):
    return dl.launch(_everything, world_size=n, timeout=300)


@pytest.mark.parametrize("n", WORLDS)
def test_attention_equals_full_attention_forward_and_backward(n):
    assert [p for res in _run(n).results for p in res["attention"]] == []


@pytest.mark.parametrize("n", WORLDS)
def test_float64_inputs_keep_float64_precision(n):
    assert [p for res in _run(n).results for p in res["float64"]] == []


@pytest.mark.parametrize("n", WORLDS)
def test_split_and_unsplit(n):
    assert [p for res in _run(n).results for p in res["layout"]] == []


@pytest.mark.parametrize("n", WORLDS)
def test_bad_input_is_explained(n):
    assert [p for res in _run(n).results for p in res["errors"]] == []


@pytest.mark.parametrize("n", WORLDS)
def test_saved_activations_per_rank_equal_the_formula(n):
    """Measured by saved-tensor hooks, to the byte: linear in s/n, no s x s matrix kept."""
    assert [p for res in _run(n).results for p in res["memory"]] == []


@pytest.mark.parametrize("n", WORLDS)
def test_ring_attention_flops_per_rank_equal_the_formula(n):
    """Counted per rank: zig-zag evens out the causal work, contiguous gives rank r r+1 block pairs."""
    assert [p for res in _run(n).results for p in res["flops"]] == []
    s = 24 * n
    assert dl.theory.ring_attention_flops(s, 1, 8, n) == [4 * (s // (2 * n)) ** 2 * 8 * (2 * n + 1)] * n
    assert dl.theory.ring_attention_flops(s, 1, 8, n, zigzag=False) == [
        4 * (s // n) ** 2 * 8 * (r + 1) for r in range(n)]


@pytest.mark.parametrize("n", WORLDS)
def test_ring_and_ulysses_traffic(n):
    """Ring: K/V n-1 hops forward; backward K/V again (n-1 hops) and dK/dV (n hops, the last one home),
    each hop 2 x (s/n) x H x D floats.
    Ulysses: all-to-alls of q,k,v and of the output forward, and their gradients backward."""
    trace = _run(n).trace
    block = 2 * (2 * n) * (2 * n) * 4 * 4           # (2, B=1, H=2n, s/n=2n, D=4) float32
    for r in range(n):
        hops = trace.comms(rank=r, op="ring_shift")
        assert len(hops) == 3 * n - 2 and all(e.sent == e.received == block for e in hops)
        calls = {e.args["call"] for e in trace.comms(rank=r, op="all_to_all")}
        assert len(calls) == 4                                  # qkv and out, forward and backward
        qkv = 3 * (2 * n) * (2 * n) * 4 * 4                       # (3, 1, 2n, s/n=2n, 4) float32
        assert trace.bytes_sent(rank=r, op="all_to_all", size=qkv) == 2 * (n - 1) * qkv // n


def test_one_rank_is_plain_attention_and_errors_name_the_fix():
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    for causal in (True, False):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(dl.cp.ring_attention(q, k, v, causal=causal), want, atol=1e-6)
        assert torch.allclose(dl.cp.ulysses_attention(q, k, v, causal=causal), want, atol=1e-6)
    assert torch.equal(dl.cp.unsplit(dl.cp.split(q)), q)
    with pytest.raises(ValueError, match=r"multiple of 2 x cp = 2 .*zigzag=False"):
        dl.cp.ring_attention(*[torch.ones(1, 1, 3, 2)] * 3)
    with pytest.raises(ValueError, match="batch, heads, local_seq, head_dim"):
        dl.cp.ring_attention(*[torch.ones(3, 2)] * 3)


# -- dl.train(strategy="cp-ring" | "cp-ulysses") equals single on the same global batch ---------------
TRAIN = dict(model="gpt-tiny", steps=2, seed=0, optimizer="sgd", lr=0.1, global_batch=8, grad_accum=2)
TRAINED = [("cp-ring", 2, {}), ("cp-ring", 4, {}), ("cp-ring", 2, {"zigzag": False}), ("cp-ulysses", 2, {}),
           ("cp-ulysses", 4, {}), ("cp-ulysses", 2, {"zigzag": True}), ("cp-ring", 4, {"dp": 2}),
           ("cp-ulysses", 6, {"dp": 3})]                  # dp = 3: micro-batches of 4 rows split 2, 1, 1


@functools.lru_cache(maxsize=None)
def _single():
    return dl.train("single", **TRAIN)


@pytest.mark.parametrize("strategy, world, options", TRAINED, ids=[f"{s}-{n}-{o}" for s, n, o in TRAINED])
def test_train_matches_single(strategy, world, options):
    """Losses within 1e-5 relative and every final parameter within 1e-5 of its norm (fp32 rounding of
    sums taken in another order), after two steps of two accumulated micro-steps."""
    report, ref = dl.train(strategy, world_size=world, **TRAIN, **options), _single()
    assert report.losses == pytest.approx(ref.losses, rel=1e-5)
    assert sorted(report.params) == sorted(ref.params)
    for name, want in ref.params.items():
        err = (report.params[name] - want).norm().item()
        assert err <= 1e-5 * want.norm().item() + 1e-7, (name, err / want.norm().item())
    assert report.results[0].info["zigzag"] == options.get("zigzag", strategy == "cp-ring")
    assert report.trace.comms(op="ring_shift" if strategy == "cp-ring" else "all_to_all")
    dp = options.get("dp", 1)
    assert (report.results[0].info["dp"], report.results[0].info["cp"]) == (dp, world // dp)
    if dp > 1:                                 # attention talks inside each row of the (dp, cp) grid only
        cp = world // dp
        for e in report.trace.comms(op="ring_shift" if strategy == "cp-ring" else "all_to_all"):
            assert e.rank // cp == e.args["peer"] // cp


def test_train_refuses_what_it_cannot_split():
    from distlab.strategies import context, parse
    with pytest.raises(ValueError, match="multiple of 2 x cp = 6"):       # gpt-tiny: 32 tokens
        context.check(parse("cp-ring"), 3)
    with pytest.raises(ValueError, match="multiple of cp = 3"):
        context.check(parse("cp-ulysses"), 3)
    with pytest.raises(ValueError, match="4 heads over 8 ranks"):
        context.check(parse("cp-ulysses"), 8)
    with pytest.raises(ValueError, match="GPT preset"):
        context.check(parse("cp-ring", model="mlp"), 2)
    with pytest.raises(ValueError, match="dividing the world size 4"):
        context.check(parse("cp-ring", dp=3), 4)
    assert context.check(parse("cp-ring", dp=2), 8) == (2, 4, True)
    with pytest.raises(ValueError, match="zigzag must be True or False"):
        parse("cp-ring", zigzag="yes")
    # before any rank starts: dl.train raises in this process, launching nothing
    import importlib
    launch_module = importlib.import_module("distlab.launch")
    real, launched = launch_module.launch, []
    launch_module.launch = lambda *a, **k: launched.append(a) or real(*a, **k)
    try:
        for strategy, world, kw, message in [
                ("cp-ring", 3, {}, "multiple of 2 x cp = 6"),                  # zig-zag: 32 tokens, 6 chunks
                ("cp-ring", 3, {"zigzag": False}, "multiple of cp = 3"),
                ("cp-ulysses", 8, {}, "4 heads over 8 ranks"),                 # gpt-tiny: 4 heads
                ("cp-ulysses", 2, {"precision": "bf16-mixed"}, "precision='fp32'")]:
            with pytest.raises(ValueError, match=message):
                dl.train(strategy, world_size=world, **kw)
    finally:
        launch_module.launch = real
    assert launched == []


# -- theory: the formulas of dl.theory.context against the papers and against the trace ----------------
@pytest.mark.parametrize("n", WORLDS)
def test_measured_bytes_equal_the_formula(n):
    """The traced ring attention and Ulysses (fp32, batch 1, s = 2n x n, h = 2n heads x 4) send, per rank,
    exactly what `dl.theory.cp_bytes_per_layer` predicts, forward plus backward."""
    trace, s, h = _run(n).trace, 2 * n * n, 2 * n * 4
    for r in range(n):
        ring = dl.theory.cp_bytes_per_layer("ring", s, 1, h, n, bytes_per_element=4, grad_bytes_per_element=4)
        assert trace.bytes_sent(rank=r, op="ring_shift") == ring["total"]
        ulysses = dl.theory.cp_bytes_per_layer("ulysses", s, 1, h, n, bytes_per_element=4, heads=2 * n)
        assert trace.bytes_sent(rank=r, op="all_to_all") == pytest.approx(ulysses["total"])


def test_cp_formulas_follow_the_papers():
    from distlab.theory import activation_bytes_per_layer, cp_activation_bytes_per_layer, cp_bytes_per_layer
    s, b, h, a = 8192, 1, 4096, 32
    # activations: Korthikanti Eq. 1, s b h (34 + 5 a s / h), split c ways (the s^2 term too)
    for c in (1, 2, 8):
        assert cp_activation_bytes_per_layer(s, b, h, a, cp=c) == s * b * h * (34 + 5 * a * s / h) / c
    assert cp_activation_bytes_per_layer(s, b, h, a, cp=4, recompute="selective") == \
        activation_bytes_per_layer(s, b, h, a, recompute="selective") / 4 == 34 * s * b * h / 4
    # Ulysses: 4 N h / P per link forward (Jacobs et al. 2023, Sec. 3.2), times (P-1)/P: the own block stays
    for p in (2, 4, 8, 16):
        fwd = cp_bytes_per_layer("ulysses", s, b, h, p, bytes_per_element=1)["forward"]
        assert fwd == pytest.approx(4 * s * h / p * (p - 1) / p)
    # about constant when s and c grow together (the (c-1)/c factor aside); ring attention's grows with s
    u = [cp_bytes_per_layer("ulysses", 1024 * c, b, h, c)["total"] for c in (8, 16, 32)]
    r = [cp_bytes_per_layer("ring", 1024 * c, b, h, c)["total"] for c in (8, 16, 32)]
    assert max(u) / min(u) < 1.2 and r[2] / r[0] > 3
    # ring forward: K and V, 2 b s h / c elements, c-1 hops (Liu et al. 2023)
    assert cp_bytes_per_layer("ring", s, b, h, 8, bytes_per_element=2)["forward"] == 2 * b * s * h * 7 / 8 * 2
    assert cp_bytes_per_layer("ring", s, b, h, 1)["total"] == 0
    with pytest.raises(ValueError, match="cp must divide"):
        cp_bytes_per_layer("ulysses", 3 * 1024, b, h, 3, heads=32)
    with pytest.raises(ValueError, match="attention must be one of"):
        cp_bytes_per_layer("stripes", s, b, h, 2)
    # the saved bytes under dl.cp: Korthikanti's 16 h per token (fp32, no dropout), the fp32 output and
    # log-sum-exp in place of the a s^2 b softmax, LayerNorm stats; 1/c of it per rank, linear in s
    from distlab.theory import cp_saved_bytes_per_layer
    assert cp_saved_bytes_per_layer(s, b, h, a, cp=4) == 4 * s // 4 * b * (17 * h + a) + 16 * s // 4 * b
    assert cp_saved_bytes_per_layer(2 * s, b, h, a, cp=8) == cp_saved_bytes_per_layer(s, b, h, a, cp=4)
    with pytest.raises(ValueError, match="divide seq_len"):
        cp_saved_bytes_per_layer(10, b, h, a, cp=4)


@pytest.mark.parametrize("strategy", ["cp-ring", "cp-ulysses"])
def test_context_parallel_runs_checkpoint_and_resume_bit_for_bit(strategy, tmp_path):
    full = dl.train(strategy, world_size=2, steps=4, seed=0)
    dl.train(strategy, world_size=2, steps=2, seed=0, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    resumed = dl.train(strategy, world_size=2, steps=4, seed=0, checkpoint_dir=str(tmp_path), resume=True)
    assert resumed.losses == full.losses


# -- overlap: the next K/V block is in flight while the held one is computed on -----------------------
def _overlap() -> list[str]:
    """Time stamps of every block computation (forward and backward) beside the ring_shift events: a K/V
    hop posted before the compute and waited after spans at least one block computation."""
    import importlib
    ra = importlib.import_module("distlab.parallel.context.ring_attention")
    tr, stamps = dl.tracer(), []

    def stamped(f):
        def call(*args):
            stamps.append(tr.now())
            return f(*args)
        return call
    for name in ("block_forward", "block_backward"):
        setattr(ra, name, stamped(getattr(ra, name)))
    n = dl.world_size()
    q, k, v = (torch.randn(1, 2, 4 * n, 4, requires_grad=True) for _ in range(3))
    mark = len(tr.events())
    dl.cp.ring_attention(q, k, v).sum().backward()
    hops = [e for e in tr.events()[mark:] if e.kind == "comm" and e.name == "ring_shift"]
    # recorded when waited: forward n-1 K/V hops; backward per step a K/V hop then a dK/dV hop, one dK/dV last
    kv = hops[:n - 1] + hops[n - 1:-1:2]
    assert len(hops) == 3 * n - 2 and len(kv) == 2 * (n - 1)
    return [f"rank {dl.rank()}: K/V hop {i} overlaps no block computation"
            for i, e in enumerate(kv) if not any(e.start < t < e.end for t in stamps)]


def test_ring_attention_overlaps_the_next_block_with_compute():
    assert [p for res in dl.launch(_overlap, world_size=3, timeout=120).results for p in res] == []
