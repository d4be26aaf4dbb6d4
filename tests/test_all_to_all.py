"""dl.comm.all_to_all (pairwise exchange from send/recv) against torch.distributed's all_to_all_single,
and dl.comm.ring_shift; one launch per world size runs every check, the tests read its results and trace.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import distlab as dl

WORLDS = list(range(1, 9))   # every world size 1-8: the whole file runs in a few seconds on 2 cores
MULTI = WORLDS[1:]
TRACED_ROWS = 7              # rows per block of the traced call (float64, 3 columns): a size of its own


def _splits(n: int, seed: int) -> list[list[int]]:
    """splits[r][i]: rows rank r sends to rank i, the same table on every rank; about a third empty."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 4, (n, n), generator=g)
    return (table * (torch.rand(n, n, generator=g) > 0.33)).tolist()


def _torch_all_to_all(x: torch.Tensor, splits: list[int], out_splits: list[int], group=None) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, splits, group=group)
    return out


def _battery() -> list[str]:
    r, n = dl.rank(), dl.world_size()
    bad: list[str] = []

    def same(label, got, want):
        if not (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
            bad.append(f"rank {r}: {label}")

    g = torch.Generator().manual_seed(r)
    # equal blocks: 2-D float, 3-D int64, a non-contiguous input
    for dtype, shape in ((torch.float32, (2 * n, 5)), (torch.int64, (3 * n, 2, 2)), (torch.float64, (n,))):
        x = (torch.randn(shape, generator=g) * 10).to(dtype)
        same(f"equal {dtype} {shape}", dl.comm.all_to_all(x), _torch_all_to_all(x, [shape[0] // n] * n,
                                                                                  [shape[0] // n] * n))
    x = torch.randn(4, 2 * n, generator=g).t()
    same("non-contiguous", dl.comm.all_to_all(x), _torch_all_to_all(x, [2] * n, [2] * n))
    # uneven blocks, some empty (a whole rank may send nothing), with and without out_splits
    for seed in range(3):
        table = _splits(n, seed)
        mine, for_me = table[r], [table[j][r] for j in range(n)]
        x = torch.randn(sum(mine), 3, generator=g)
        want = _torch_all_to_all(x, mine, for_me)
        same(f"uneven {table}", dl.comm.all_to_all(x, mine), want)
        same(f"uneven out_splits {table}", dl.comm.all_to_all(x, mine, out_splits=for_me), want)
        same(f"uneven textbook {table}", dl.comm.all_to_all(x, mine, posted=False), want)
    # ring_shift: what the previous rank sent
    t = torch.full((2, 3), float(r))
    same("ring_shift", dl.comm.ring_shift(t), torch.full((2, 3), float((r - 1) % n)))
    if n == 4:                                       # a subgroup, in its own rank order
        members = [3, 1, 0]
        sub = dist.new_group(members)
        if r in members:
            x = torch.arange(6.0).view(6, 1) + 10 * r
            same("group", dl.comm.all_to_all(x, group=sub), _torch_all_to_all(x, [2] * 3, [2] * 3, group=sub))
    if n == 3:
        try:
            dl.comm.all_to_all(torch.ones(4))
            bad.append("4 rows over 3 ranks did not raise")
        except ValueError as e:
            if "pass splits=" not in str(e):
                bad.append(f"unclear error: {e}")
    # the traced calls: equal blocks of TRACED_ROWS x 3 float64, the fast path and the textbook loop
    x = torch.randn(n * TRACED_ROWS, 3, generator=g, dtype=torch.float64)
    same("textbook equals posted", dl.comm.all_to_all(x, posted=False), dl.comm.all_to_all(x))
    return bad


@functools.lru_cache(maxsize=None)
def _run(n: int):
    return dl.launch(_battery, world_size=n, timeout=300)


@pytest.mark.parametrize("n", WORLDS)
def test_equals_torch_all_to_all_single(n):
    assert [p for problems in _run(n).results for p in problems] == []


@pytest.mark.parametrize("n", MULTI)
def test_pairwise_steps_in_the_trace(n):
    trace = _run(n).trace
    size = n * TRACED_ROWS * 3 * 8
    block = TRACED_ROWS * 3 * 8
    for r in range(n):
        both = trace.comms(rank=r, op="all_to_all", size=size)                 # textbook, then posted
        assert len({e.args["call"] for e in both}) == 2
        assert sorted(e.args["step"] for e in both) == sorted(list(range(n - 1)) * 2)   # N-1 steps each
        for e in both:
            s = e.args["step"] + 1
            assert (e.args["peer"], e.args["src"]) == ((r + s) % n, (r - s) % n)
            assert (e.sent, e.received) == (block, block)
        # (N-1)/N * S each way: its own block never leaves the rank
        assert trace.bytes_sent(rank=r, op="all_to_all", size=size) == 2 * (n - 1) * size // n
    assert trace.comms(op="exchange_sizes")                              # the uneven calls exchanged counts


def test_single_process_and_bad_input():
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(dl.comm.all_to_all(x), x)
    assert torch.equal(dl.comm.all_to_all(x, [3]), x)
    assert torch.equal(dl.comm.ring_shift(x), x)
    with pytest.raises(ValueError, match="summing to"):
        dl.comm.all_to_all(x, [2])
    with pytest.raises(ValueError, match="one per rank"):
        dl.comm.all_to_all(x, [1, 2])
    with pytest.raises(ValueError, match="at least one dimension"):
        dl.comm.all_to_all(torch.tensor(1.0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        dl.comm.all_to_all([1.0])
