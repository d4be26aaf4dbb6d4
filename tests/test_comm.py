"""dl.comm: collectives from send/recv, checked against torch.distributed's own and the exact byte formula.

One launch per world size runs every check (`_battery`) so the suite stays fast; the tests then read
its results and its trace.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from distlab.comm import ring_bytes

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
SIZES = [1, 3, 7, 64, 1001]          # below, at and above the world size, not divisible by it
BYTES_NUMEL = 1003                    # a float64 message used only for the byte checks (size 8024)
EVEN_NUMEL = 1200                     # divisible by 1, 2, 3, 4: the closed form 2(N-1)/N * S holds exactly
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


def _battery() -> list[str]:
    """Run on every rank; returns a description of each mismatch (empty when all is well)."""
    r, n = dl.rank(), dl.world_size()
    bad: list[str] = []

    def check(label, ok):
        if not ok:
            bad.append(f"rank {r}: {label}")

    # the byte-count messages first, each size used by nothing else
    dl.comm.ring_all_reduce(_data(r, BYTES_NUMEL, torch.float64))
    dl.comm.ring_reduce_scatter(_data(r, BYTES_NUMEL, torch.float64))
    dl.comm.ring_all_gather(torch.tensor_split(_data(r, BYTES_NUMEL, torch.float64), n)[r])
    dl.comm.ring_all_reduce(_data(r, EVEN_NUMEL, torch.float32))
    dl.comm.naive_all_reduce(_data(r, BYTES_NUMEL, torch.float64))
    dl.comm.broadcast(_data(r, BYTES_NUMEL, torch.float64), src=n - 1)

    for dtype in DTYPES:
        for numel in SIZES:
            x = _data(r, numel, dtype)
            for op in ("sum", "avg", "max", "min", "prod"):
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
            for src in range(n):
                want = x.clone()
                dist.broadcast(want, src)
                check(f"broadcast {dtype} {numel} src={src}", torch.equal(dl.comm.broadcast(x.clone(), src), want))
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

    # large enough that every step is cut into several pipelined segments
    x = _data(r, 600_001, torch.float32)
    for op in ("sum", "avg", "max"):
        want = _torch_all_reduce(x, op)
        check(f"segmented ring_all_reduce {op}", _close(dl.comm.ring_all_reduce(x.clone(), op), want))
        check(f"segmented reduce_scatter {op}", _close(dl.comm.ring_reduce_scatter(x, op),
                                                       torch.tensor_split(want, n)[r]))
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    check("segmented all_gather", torch.equal(dl.comm.ring_all_gather(x, sizes=[x.numel()] * n), torch.cat(parts)))

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
                check(f"group {members} ring_all_reduce", _close(dl.comm.ring_all_reduce(x.clone(), group=g), want))
                check(f"group {members} reduce_scatter", _close(dl.comm.ring_reduce_scatter(x, group=g),
                                                                torch.tensor_split(want, m)[dist.get_rank(g)]))
                check(f"group {members} naive", _close(dl.comm.naive_all_reduce(x.clone(), group=g,
                                                                                root=members[-1]), want))
                shards = [_data(k, k + 1, torch.float32, salt=3) for k in members]
                check(f"group {members} all_gather",
                      torch.equal(dl.comm.ring_all_gather(shards[dist.get_rank(g)], group=g), torch.cat(shards)))
                y = x.clone()
                dist.broadcast(want := x.clone(), src=members[-1], group=g)
                check(f"group {members} broadcast", torch.equal(dl.comm.broadcast(y, src=members[-1], group=g), want))
            else:
                try:
                    dl.comm.ring_all_reduce(torch.ones(3), group=g)
                    bad.append(f"rank {r}: calling on a group it is not in did not raise")
                except ValueError as e:
                    check("not-a-member message", "not a member" in str(e))
    return bad


@functools.lru_cache(maxsize=None)
def _run(n: int):
    return dl.launch(_battery, world_size=n, timeout=120)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_matches_torch_collectives(n):
    problems = [p for rank_problems in _run(n).results for p in rank_problems]
    assert problems == []


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_bytes_are_exact(n):
    trace, size = _run(n).trace, BYTES_NUMEL * 8
    for r in range(n):
        for op, name in (("all_reduce", "ring_all_reduce"), ("reduce_scatter", "ring_reduce_scatter"),
                         ("all_gather", "ring_all_gather")):
            events = trace.comms(rank=r, op=name, size=size)
            sent, received = ring_bytes(BYTES_NUMEL, 8, n, r, op)
            assert (sum(e.sent for e in events), sum(e.received for e in events)) == (sent, received), (r, op)
            assert len(events) == (2 if op == "all_reduce" else 1) * (n - 1)
        # when N divides the message, each rank sends exactly 2 (N-1)/N * S
        S = EVEN_NUMEL * 4
        assert trace.bytes_sent(rank=r, op="ring_all_reduce", size=S) == 2 * (n - 1) * S // n
        assert trace.bytes_received(rank=r, op="ring_all_reduce", size=S) == 2 * (n - 1) * S // n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_steps_move_the_right_chunks(n):
    trace = _run(n).trace
    for r in range(n):
        steps = sorted(trace.comms(rank=r, op="ring_all_reduce", size=EVEN_NUMEL * 4), key=lambda e: e.args["step"])
        assert [e.args["step"] for e in steps] == list(range(2 * (n - 1)))
        for e in steps:
            s = e.args["step"]
            assert e.args["peer"] == (r + 1) % n and e.args["src"] == (r - 1) % n
            assert e.args["phase"] == ("reduce_scatter" if s < n - 1 else "all_gather")
            assert e.args["send_chunk"] == (r - s - 1) % n       # the same rule through both phases
            assert e.args["recv_chunk"] == (r - s - 2) % n
        # what I receive at a step is what my left neighbour sends at that step
        left = {e.args["step"]: e.args["send_chunk"]
                for e in trace.comms(rank=(r - 1) % n, op="ring_all_reduce", size=EVEN_NUMEL * 4)}
        assert {e.args["step"]: e.args["recv_chunk"] for e in steps} == left


@pytest.mark.parametrize("n", [2, 3, 4])
def test_naive_root_carries_everything(n):
    trace, S = _run(n).trace, BYTES_NUMEL * 8
    for r in range(n):
        sent = trace.bytes_sent(rank=r, op="naive_all_reduce", size=S)
        received = trace.bytes_received(rank=r, op="naive_all_reduce", size=S)
        assert (sent, received) == (((n - 1) * S, (n - 1) * S) if r == 0 else (S, S))
    # through the root: (N-1) S against the ring's 2 (N-1)/N S (equal at N = 2, N/2 times more beyond)
    ring = trace.bytes_sent(rank=0, op="ring_all_reduce", size=S)
    assert trace.bytes_sent(rank=0, op="naive_all_reduce", size=S) == pytest.approx(ring * n / 2, rel=0.01)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_broadcast_is_a_binomial_tree(n):
    trace, S = _run(n).trace, BYTES_NUMEL * 8
    events = trace.comms(op="broadcast", size=S)
    assert len(events) == 2 * (n - 1)                          # n-1 sends and n-1 receives
    assert sum(e.received for e in events) == (n - 1) * S
    assert trace.bytes_received(rank=n - 1, op="broadcast", size=S) == 0   # the source
    assert max(e.args["step"] for e in events) + 1 == math.ceil(math.log2(n))


def test_single_process_is_a_no_op_and_errors_are_clear():
    x = torch.arange(6.0).view(2, 3)
    assert dl.comm.ring_all_reduce(x, "avg") is x and torch.equal(x, torch.arange(6.0).view(2, 3))
    assert torch.equal(dl.comm.ring_reduce_scatter(x), x.flatten())
    assert torch.equal(dl.comm.ring_all_gather(x), x.flatten())
    assert torch.equal(dl.comm.broadcast(x.clone()), x)
    assert ring_bytes(10, 4, 1, 0) == (0, 0)
    with pytest.raises(TypeError, match="op='sum' and divide"):
        dl.comm.ring_all_reduce(torch.arange(4), "avg")
    with pytest.raises(ValueError, match="op must be one of"):
        dl.comm.ring_all_reduce(torch.ones(4), "mean")
    with pytest.raises(ValueError, match="out must hold"):
        dl.comm.ring_reduce_scatter(torch.ones(4), out=torch.empty(3))
    with pytest.raises(ValueError, match="sizes must list"):
        dl.comm.ring_all_gather(torch.ones(4), sizes=[5])
    with pytest.raises(ValueError, match="global rank"):
        dl.comm.broadcast(torch.ones(2), src=3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        dl.comm.ring_all_reduce([1.0, 2.0])


def test_eight_ranks():
    def fn():
        r = dl.rank()
        x = torch.arange(13.0) * (r + 1)
        shard = torch.full((r % 3,), float(r))
        return (dl.comm.ring_all_reduce(x.clone()).tolist(), dl.comm.ring_all_gather(shard).tolist(),
                dl.comm.broadcast(x.clone(), src=5).tolist())

    results = dl.launch(fn, world_size=8, timeout=120).results
    want_sum = (torch.arange(13.0) * 36).tolist()
    want_gather = [float(k) for k in range(8) for _ in range(k % 3)]
    want_bcast = (torch.arange(13.0) * 6).tolist()
    assert all(res == (want_sum, want_gather, want_bcast) for res in results)


def test_plots_read_the_trace():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = _run(4).trace
    fig = dl.viz.comm(trace, model=(1e-4, 1e9), ops=["ring_all_reduce", "naive_all_reduce"])
    assert isinstance(fig, matplotlib.figure.Figure)
    from distlab.viz.comm import calls as comm_calls
    calls = comm_calls(trace, "ring_all_reduce")
    assert {c["size"] for c in calls} >= {BYTES_NUMEL * 8, EVEN_NUMEL * 4} and all(c["seconds"] > 0 for c in calls)
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
