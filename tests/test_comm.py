"""dl.comm: collectives from send/recv, checked against torch.distributed's own, against the exact byte
formula, and the textbook ring (`comm/ring.py`) against the pipelined one (`comm/ring_pipelined.py`).

One launch per world size (1 to 8) runs every check (`_everything`) so the suite stays fast; the tests then
read its results and its trace.
"""
from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from distlab.comm import OPS, p2p, ring_bytes, ring_pipelined

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
SIZES = [1, 3, 7, 64, 1001]          # below, at and above the world size, not divisible by it
WORLDS = [1, 2, 3, 4, 8] + [pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7)]   # 8 ranks: ~15 s
MULTI = WORLDS[1:]                   # the world sizes with a ring to trace
TORCH_WORLDS = [1, 2, 3, 4, 8]       # where dl.comm is also checked against torch.distributed
IMPLS = {"textbook": (dl.comm.ring_all_reduce, dl.comm.ring_reduce_scatter, dl.comm.ring_all_gather),
         "pipelined": (dl.comm.pipelined_all_reduce, dl.comm.pipelined_reduce_scatter,
                       dl.comm.pipelined_all_gather)}
# The messages the trace tests read, each size used by no other call: (float64 numel for the exact byte
# counts, float32 numel that every N up to 8 divides, so the closed form 2(N-1)/N * S holds exactly).
TRACED = {"textbook": (1003, 840), "pipelined": (1005, 1680)}
BYTES_NUMEL = TRACED["textbook"][0]   # also the size of the traced naive all-reduce and broadcast
TORCH_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "prod": dist.ReduceOp.PRODUCT}


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Deterministic per-rank data; small integers for bf16/int64 so that every sum order is exact."""
    g = torch.Generator().manual_seed(1000 * rank + 7 * numel + salt)
    if dtype in (torch.bfloat16, torch.int64):
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.int64, torch.bfloat16):
        return torch.equal(a, b)
    tol = 1e-5 if a.dtype == torch.float32 else 1e-12
    return torch.allclose(a, b, rtol=tol, atol=tol)


def _torch_all_reduce(x: torch.Tensor, op: str, group=None) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, TORCH_OP["sum" if op == "avg" else op], group=group)
    return y / dist.get_world_size(group) if op == "avg" else y


def _traced_messages() -> None:
    """The calls whose trace events the byte and step tests read."""
    r, n = dl.rank(), dl.world_size()
    for impl, (all_reduce, reduce_scatter, all_gather) in IMPLS.items():
        numel, even = TRACED[impl]
        all_reduce(_data(r, numel, torch.float64))
        reduce_scatter(_data(r, numel, torch.float64))
        all_gather(torch.tensor_split(_data(r, numel, torch.float64), n)[r])
        all_reduce(_data(r, even, torch.float32))
    dl.comm.naive_all_reduce(_data(r, BYTES_NUMEL, torch.float64))
    dl.comm.broadcast(_data(r, BYTES_NUMEL, torch.float64), src=n - 1)


def _battery() -> list[str]:
    """Run on every rank: dl.comm's contract names against torch.distributed; returns each mismatch."""
    r, n = dl.rank(), dl.world_size()
    bad: list[str] = []

    def check(label, ok):
        if not ok:
            bad.append(f"rank {r}: {label}")

    many = n <= 4                        # on 8 ranks (slow on 2 cores) a sample of the cases
    for dtype in DTYPES if many else [torch.float32, torch.int64]:
        for numel in SIZES if many else [3, 1001]:
            x = _data(r, numel, dtype)
            for op in OPS:
                if op == "avg" and dtype == torch.int64:
                    continue
                if op == "prod":                 # keep products small and exact
                    x = x.clamp(-2, 2) if dtype in (torch.bfloat16, torch.int64) else x
                want = _torch_all_reduce(x, op)
                got = dl.comm.ring_all_reduce(x.clone(), op)
                check(f"ring_all_reduce {dtype} {numel} {op}", _close(got, want))
                check(f"naive_all_reduce {dtype} {numel} {op}",
                      _close(dl.comm.naive_all_reduce(x.clone(), op, root=n // 2), want))
                rs = dl.comm.ring_reduce_scatter(x, op)
                check(f"ring_reduce_scatter {dtype} {numel} {op}", _close(rs, torch.tensor_split(want, n)[r]))
            for src in range(n) if many else sorted({0, n // 2, n - 1}):
                want = x.clone()
                dist.broadcast(want, src)
                check(f"broadcast {dtype} {numel} src={src}",
                      torch.equal(dl.comm.broadcast(x.clone(), src), want))
        # all-gather: equal shards vs torch's all_gather, uneven shards vs a local reference
        shard = _data(r, 5, dtype, salt=1)
        parts = [torch.empty_like(shard) for _ in range(n)]
        dist.all_gather(parts, shard)
        check(f"ring_all_gather equal {dtype}", torch.equal(dl.comm.ring_all_gather(shard), torch.cat(parts)))
        uneven = [_data(k, 2 * k + (k % 2), dtype, salt=2) for k in range(n)]   # rank 0's shard is empty
        want = torch.cat(uneven)
        check(f"ring_all_gather uneven {dtype}", torch.equal(dl.comm.ring_all_gather(uneven[r]), want))
        out = torch.empty_like(want)
        got = dl.comm.ring_all_gather(uneven[r], sizes=[u.numel() for u in uneven], out=out)
        check(f"ring_all_gather sizes/out {dtype}", got is out and torch.equal(out, want))

    # a large message (2.4 MB, steps of up to 1.2 MB), both rings against torch
    x = _data(r, 600_001, torch.float32)
    for impl, (all_reduce, reduce_scatter, all_gather) in IMPLS.items():
        for op in ("sum", "avg", "max"):
            want = _torch_all_reduce(x, op)
            check(f"{impl} large all_reduce {op}", _close(all_reduce(x.clone(), op), want))
            check(f"{impl} large reduce_scatter {op}",
                  _close(reduce_scatter(x, op), torch.tensor_split(want, n)[r]))
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
        check(f"{impl} large all_gather", torch.equal(all_gather(x, sizes=[x.numel()] * n), torch.cat(parts)))

    # shapes: in place on a non-contiguous 2-D tensor, reduce-scatter of a 2-D tensor, out=
    x = _data(r, 30, torch.float64).view(6, 5).t()
    want = _torch_all_reduce(x.contiguous(), "sum")
    got = dl.comm.ring_all_reduce(x, "sum")
    check("non-contiguous all-reduce in place", got is x and _close(x.contiguous(), want))
    x2 = _data(r, 30, torch.float64).view(3, 10)
    out = torch.empty(torch.tensor_split(torch.empty(30), n)[r].numel(), dtype=torch.float64)
    rs = dl.comm.ring_reduce_scatter(x2, out=out)
    want = torch.tensor_split(_torch_all_reduce(x2.reshape(-1), "sum"), n)[r]
    check("reduce-scatter 2-D with out", rs is out and _close(out, want))
    check("reduce-scatter leaves input alone", torch.equal(x2, _data(r, 30, torch.float64).view(3, 10)))

    # subgroups (every rank must take part in new_group, only members call the collective)
    if n == 4:
        for members in ([1, 2], [0, 2], [3, 1, 0]):
            g = dist.new_group(members)
            if r in members:
                m = len(members)
                x = _data(r, 11, torch.float32)
                want = _torch_all_reduce(x, "sum", group=g)
                check(f"group {members} ring_all_reduce",
                      _close(dl.comm.ring_all_reduce(x.clone(), group=g), want))
                want_chunk = torch.tensor_split(want, m)[dist.get_rank(g)]
                check(f"group {members} reduce_scatter",
                      _close(dl.comm.ring_reduce_scatter(x, group=g), want_chunk))
                check(f"group {members} naive", _close(dl.comm.naive_all_reduce(x.clone(), group=g,
                                                                                root=members[-1]), want))
                shards = [_data(k, k + 1, torch.float32, salt=3) for k in members]
                mine = shards[dist.get_rank(g)]
                check(f"group {members} all_gather",
                      torch.equal(dl.comm.ring_all_gather(mine, group=g), torch.cat(shards)))
                y = x.clone()
                dist.broadcast(want := x.clone(), src=members[-1], group=g)
                check(f"group {members} broadcast",
                      torch.equal(dl.comm.broadcast(y, src=members[-1], group=g), want))
            else:
                for all_reduce, _, _ in IMPLS.values():
                    try:
                        all_reduce(torch.ones(3), group=g)
                        bad.append(f"rank {r}: calling on a group it is not in did not raise")
                    except ValueError as e:
                        check("not-a-member message", "not a member" in str(e))
    return bad


@contextlib.contextmanager
def _segment_bytes(nbytes: int | None):
    """Cut every transfer into segments of ``nbytes`` (None: the defaults), in both rings' machinery."""
    saved = ring_pipelined.SEGMENT_BYTES, p2p.SEGMENT_BYTES
    if nbytes is not None:
        ring_pipelined.SEGMENT_BYTES = p2p.SEGMENT_BYTES = nbytes
    try:
        yield
    finally:
        ring_pipelined.SEGMENT_BYTES, p2p.SEGMENT_BYTES = saved


def _equal_battery() -> list[str]:
    """Textbook ring and pipelined ring on the same random data; returns each difference.

    Both reduce every element in the same order (the partial result of chunk c starts on rank c+1 and
    takes in one rank per step; the pipelined ring only cuts each step into segments), and +, max, min
    and * are commutative in floating point, so the results must be bit-identical: torch.equal, no tolerance.
    """
    r, n = dl.rank(), dl.world_size()
    bad: list[str] = []
    shared = torch.Generator().manual_seed(n)            # the same on every rank: shard sizes
    own = torch.Generator().manual_seed(100 + r)         # this rank's data

    def rand(numel: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point and dtype != torch.bfloat16:
            return torch.randn(numel, generator=own, dtype=dtype)
        return torch.randint(-3, 4, (numel,), generator=own).to(dtype)

    def same(label, a, b):
        if not (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            bad.append(f"rank {r}: {label}")

    textbook, pipelined = IMPLS["textbook"], IMPLS["pipelined"]
    uneven = 3 * n + 2
    cases = [(None, torch.float32, numel, ("sum",)) for numel in sorted({0, 1, max(n - 1, 0), n + 1})]
    cases += [(None, torch.float32, uneven, OPS), (None, torch.float32, 257, ("sum",))]   # empty, < N, uneven
    cases += [(None, dtype, uneven, ("sum", "max")) for dtype in DTYPES[1:]]
    cases += [(64, torch.float32, 257, ("sum", "avg")), (64, torch.float64, 12 * n + 5, OPS)]   # 64-byte
    for segment_bytes, dtype, numel, ops in cases:             # segments: K = 9 and K = 2 a step
        with _segment_bytes(segment_bytes):
            x = rand(numel, dtype)
            for op in ops:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                label = f"{dtype} numel={numel} op={op} segment={segment_bytes}"
                same(f"all_reduce {label}", textbook[0](x.clone(), op), pipelined[0](x.clone(), op))
                same(f"reduce_scatter {label}", textbook[1](x, op), pipelined[1](x, op))
    for segment_bytes, dtype in dict.fromkeys((c[0], c[1]) for c in cases):
        with _segment_bytes(segment_bytes):
            sizes = torch.randint(0, 6, (n,), generator=shared).tolist()
            shard = rand(sizes[r], dtype)
            same(f"all_gather {dtype} sizes={sizes}", textbook[2](shard), pipelined[2](shard))
            same(f"all_gather sizes= {dtype}", textbook[2](shard, sizes=sizes),
                 pipelined[2](shard, sizes=sizes))

    x = rand(6 * (2 * n + 1), torch.float64).view(6, 2 * n + 1).t()   # non-contiguous
    a, b = x.clone(), x.clone()
    same("non-contiguous reduce_scatter", textbook[1](x, "avg"), pipelined[1](x, "avg"))
    if not (textbook[0](a) is a and pipelined[0](b) is b and not a.is_contiguous()):
        bad.append(f"rank {r}: all_reduce of a non-contiguous tensor is not in place")
    same("non-contiguous all_reduce", a, b)
    outs = [torch.empty(torch.tensor_split(x.reshape(-1), n)[r].numel(), dtype=x.dtype) for _ in range(2)]
    if not (textbook[1](x, out=outs[0]) is outs[0] and pipelined[1](x, out=outs[1]) is outs[1]):
        bad.append(f"rank {r}: reduce_scatter did not return out")
    same("reduce_scatter out=", *outs)

    if n >= 3:                                          # a subgroup that leaves out rank 1
        members = [k for k in range(n) if k != 1]
        g = dist.new_group(members)
        if r in members:
            x = rand(4 * n + 1, torch.float32)
            for op in ("sum", "max"):
                same(f"group all_reduce {op}", textbook[0](x.clone(), op, group=g),
                     pipelined[0](x.clone(), op, group=g))
                same(f"group reduce_scatter {op}", textbook[1](x, op, group=g), pipelined[1](x, op, group=g))
            shard = rand(r % 3, torch.float32)
            same("group all_gather", textbook[2](shard, group=g), pipelined[2](shard, group=g))
    return bad


def _everything() -> dict:
    _traced_messages()
    problems = {"torch": _battery() if dl.world_size() in TORCH_WORLDS else []}
    dl.tracer().enabled = False                          # the equality checks are many: keep the trace small
    problems["equal"] = _equal_battery()
    return problems


@functools.lru_cache(maxsize=None)
def _run(n: int):
    return dl.launch(_everything, world_size=n, timeout=300)


@pytest.mark.parametrize("n", TORCH_WORLDS)
def test_matches_torch_collectives(n):
    problems = [p for rank_problems in _run(n).results for p in rank_problems["torch"]]
    assert problems == []


@pytest.mark.parametrize("n", WORLDS)
def test_textbook_ring_equals_pipelined_ring(n):
    problems = [p for rank_problems in _run(n).results for p in rank_problems["equal"]]
    assert problems == []


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("n", MULTI)
def test_ring_bytes_are_exact(n, impl):
    trace = _run(n).trace
    numel, even = TRACED[impl]
    for r in range(n):
        for op, name in (("all_reduce", "ring_all_reduce"), ("reduce_scatter", "ring_reduce_scatter"),
                         ("all_gather", "ring_all_gather")):
            events = trace.comms(rank=r, op=name, size=numel * 8)
            sent, received = ring_bytes(numel, 8, n, r, op)
            assert (sum(e.sent for e in events), sum(e.received for e in events)) == (sent, received), (r, op)
            assert len(events) == (2 if op == "all_reduce" else 1) * (n - 1)
        # when N divides the message, each rank sends exactly 2 (N-1)/N * S
        S = even * 4
        assert trace.bytes_sent(rank=r, op="ring_all_reduce", size=S) == 2 * (n - 1) * S // n
        assert trace.bytes_received(rank=r, op="ring_all_reduce", size=S) == 2 * (n - 1) * S // n


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("n", MULTI)
def test_ring_steps_move_the_right_chunks(n, impl):
    trace, size = _run(n).trace, TRACED[impl][1] * 4
    for r in range(n):
        steps = sorted(trace.comms(rank=r, op="ring_all_reduce", size=size), key=lambda e: e.args["step"])
        assert [e.args["step"] for e in steps] == list(range(2 * (n - 1)))
        for e in steps:
            s = e.args["step"]
            assert e.args["peer"] == (r + 1) % n and e.args["src"] == (r - 1) % n
            assert e.args["phase"] == ("reduce_scatter" if s < n - 1 else "all_gather")
            assert e.args["send_chunk"] == (r - s - 1) % n       # the same rule through both phases
            assert e.args["recv_chunk"] == (r - s - 2) % n
        # what I receive at a step is what my left neighbour sends at that step
        left = {e.args["step"]: e.args["send_chunk"]
                for e in trace.comms(rank=(r - 1) % n, op="ring_all_reduce", size=size)}
        assert {e.args["step"]: e.args["recv_chunk"] for e in steps} == left


@pytest.mark.parametrize("n", MULTI)
def test_naive_root_carries_everything(n):
    trace, S = _run(n).trace, BYTES_NUMEL * 8
    for r in range(n):
        sent = trace.bytes_sent(rank=r, op="naive_all_reduce", size=S)
        received = trace.bytes_received(rank=r, op="naive_all_reduce", size=S)
        assert (sent, received) == (((n - 1) * S, (n - 1) * S) if r == 0 else (S, S))
    # through the root: (N-1) S against the ring's 2 (N-1)/N S (equal at N = 2, N/2 times more beyond)
    ring = trace.bytes_sent(rank=0, op="ring_all_reduce", size=S)
    assert trace.bytes_sent(rank=0, op="naive_all_reduce", size=S) == pytest.approx(ring * n / 2, rel=0.01)


@pytest.mark.parametrize("n", MULTI)
def test_broadcast_is_a_binomial_tree(n):
    trace, S = _run(n).trace, BYTES_NUMEL * 8
    events = trace.comms(op="broadcast", size=S)
    assert len(events) == 2 * (n - 1)                          # n-1 sends and n-1 receives
    assert sum(e.received for e in events) == (n - 1) * S
    assert trace.bytes_received(rank=n - 1, op="broadcast", size=S) == 0   # the source
    assert max(e.args["step"] for e in events) + 1 == math.ceil(math.log2(n))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_single_process_is_a_no_op_and_errors_are_clear(impl):
    all_reduce, reduce_scatter, all_gather = IMPLS[impl]
    x = torch.arange(6.0).view(2, 3)
    assert all_reduce(x, "avg") is x and torch.equal(x, torch.arange(6.0).view(2, 3))
    assert torch.equal(reduce_scatter(x), x.flatten())
    assert torch.equal(all_gather(x), x.flatten())
    assert torch.equal(dl.comm.broadcast(x.clone()), x)
    assert ring_bytes(10, 4, 1, 0) == (0, 0)
    with pytest.raises(TypeError, match="op='sum' and divide"):
        all_reduce(torch.arange(4), "avg")
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce(torch.ones(4), "mean")
    with pytest.raises(ValueError, match="out must hold"):
        reduce_scatter(torch.ones(4), out=torch.empty(3))
    with pytest.raises(ValueError, match="out must hold"):
        all_gather(torch.ones(4), out=torch.empty(2, 2).t())
    with pytest.raises(ValueError, match="sizes must list"):
        all_gather(torch.ones(4), sizes=[5])
    with pytest.raises(ValueError, match="global rank"):
        dl.comm.broadcast(torch.ones(2), src=3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        all_gather([1.0, 2.0])


def test_plots_read_the_trace():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = _run(4).trace
    fig = dl.viz.comm(trace, model=(1e-4, 1e9), ops=["ring_all_reduce", "naive_all_reduce"])
    assert isinstance(fig, matplotlib.figure.Figure)
    from distlab.viz.comm import calls as comm_calls
    calls = comm_calls(trace, "ring_all_reduce")
    assert {c["size"] for c in calls} >= {BYTES_NUMEL * 8, TRACED["textbook"][1] * 4}
    assert all(c["seconds"] > 0 for c in calls)
    fig2 = dl.viz.ring_steps(4, trace=trace)
    assert len(fig2.axes) == 2 * (4 - 1) + 1
    with pytest.raises(ValueError, match="no 'ring_all_reduce' events over 3 ranks"):
        dl.viz.ring_steps(3, trace=trace)
    kinds = {e.name for e in trace.comms()}          # communication coloured by kind, one legend entry each
    fig3 = dl.viz.timeline(trace, comm_kind=lambda e: e.name, comm_colours={"ring_all_reduce": "#000000"})
    legend = {t.get_text(): h for t, h in zip(fig3.axes[0].get_legend().get_texts(),
                                              fig3.axes[0].get_legend().legend_handles)}
    assert {f"{k} communication" for k in kinds} <= set(legend)
    assert matplotlib.colors.to_hex(legend["ring_all_reduce communication"].get_facecolor()) == "#000000"
    plt.close("all")


def _shift_twice():
    t = torch.full((3,), float(dl.rank()))
    pending = dl.comm.start_ring_shift(t)
    first = pending.wait().clone()
    return first.tolist(), pending.wait().tolist()


def test_start_ring_shift_waits_once_and_returns_the_received_block_again():
    for n in (1, 3):
        results = dl.launch(_shift_twice, world_size=n, output="quiet").results
        for r, (first, again) in enumerate(results):
            assert first == again == [float((r - 1) % n)] * 3
