"""The exercise checkers: every reference passes, and every checker rejects at least three planted
wrong implementations with a message that points at the mistake (a checker that passes everything
would teach nothing)."""
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from distlab.exercises import comm, parallel, pieces

# -- planted mistakes: communication ------------------------------------------------------------


def exchange_from_the_right(t):
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.empty_like(t)
    reqs = [dist.isend(t, (r - 1) % n), dist.irecv(out, (r + 1) % n)]     # directions swapped
    [q.wait() for q in reqs]
    return out


def exchange_returns_own(t):
    return t.clone()


def exchange_receive_first(t):                  # every rank blocks in recv: nobody ever sends
    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.empty_like(t)
    if n > 1:
        dist.recv(out, (r - 1) % n)
        dist.send(t, (r + 1) % n)
    return out


def broadcast_from_the_root(t, src=0):         # right numbers, N-1 messages from the root
    n, r = dist.get_world_size(), dist.get_rank()
    if r == src:
        for dst in range(n):
            if dst != src:
                dist.send(t, dst)
    else:
        dist.recv(t, src)
    return t


def broadcast_ignores_src(t, src=0):
    return comm.tree_broadcast(t, 0)


def broadcast_one_round_short(t, src=0):
    n, r = dist.get_world_size(), dist.get_rank()
    me, step = (r - src) % n, 1
    while step < n - 1:                          # off by one: the last round never happens
        if me < step and me + step < n:
            dist.send(t, (me + step + src) % n)
        elif step <= me < 2 * step:
            dist.recv(t, (me - step + src) % n)
        step *= 2
    return t


def reduce_scatter_next_chunk(t):
    n, r = dist.get_world_size(), dist.get_rank()
    full = comm.ring_all_reduce(t.clone())
    return torch.tensor_split(full, n)[(r + 1) % n]


def reduce_scatter_by_all_reduce(t):
    dist.all_reduce(t)
    return torch.tensor_split(t.flatten(), dist.get_world_size())[dist.get_rank()]


def reduce_scatter_average(t):
    return comm.ring_reduce_scatter(t) / dist.get_world_size()


def all_gather_equal_chunks(chunk, sizes):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = [torch.empty_like(chunk) for _ in range(n)]   # assumes every rank's chunk is as large
    chunks[r] = chunk.clone()
    for s in range(n - 1):
        send, recv = (r - s) % n, (r - s - 1) % n
        reqs = [dist.isend(chunks[send], (r + 1) % n), dist.irecv(chunks[recv], (r - 1) % n)]
        [q.wait() for q in reqs]
    return torch.cat(chunks)


def all_gather_rotated(chunk, sizes):
    out = comm.ring_all_gather(chunk, sizes)
    return torch.cat(torch.split(out, sizes)[1:] + torch.split(out, sizes)[:1])


def all_gather_by_torch(chunk, sizes):
    out = [torch.empty(s) for s in sizes]
    dist.all_gather(out, chunk)
    return torch.cat(out)


def all_reduce_without_gather(t):
    mine = comm.ring_reduce_scatter(t)
    out = torch.zeros_like(t.flatten())
    start = sum(c.numel() for c in torch.tensor_split(t.flatten(), dist.get_world_size())[:dist.get_rank()])
    out[start:start + mine.numel()] = mine
    return t.copy_(out.view_as(t))


def all_reduce_average(t):
    return comm.ring_all_reduce(t).div_(dist.get_world_size())


def all_reduce_by_torch(t):
    dist.all_reduce(t)
    return t


def all_to_all_even(t, send_counts, recv_counts):
    n = dist.get_world_size()
    even = [t.shape[0] // n] * n
    even[-1] += t.shape[0] - sum(even)
    return comm.all_to_all(t, even, recv_counts)


def all_to_all_reversed(t, send_counts, recv_counts):
    out = comm.all_to_all(t, send_counts, recv_counts)
    return torch.cat(list(torch.split(out, recv_counts))[::-1])


def all_to_all_drops_own(t, send_counts, recv_counts):
    out = list(torch.split(comm.all_to_all(t, send_counts, recv_counts), recv_counts))
    out[dist.get_rank()] = out[dist.get_rank()][:0]
    return torch.cat(out)


# -- planted mistakes: no communication -----------------------------------------------------------


def buckets_forward(sizes, cap):
    return [[len(sizes) - 1 - i for i in b] for b in pieces.buckets(sizes[::-1], cap)]


def buckets_full_is_over(sizes, cap):
    out, size = [], 0
    for i in reversed(range(len(sizes))):
        if not out or size + sizes[i] >= cap:
            out.append([])
            size = 0
        out[-1].append(i)
        size += sizes[i]
    return out


def buckets_never_split(sizes, cap):
    return [list(reversed(range(len(sizes))))]


def gpipe_order(p, m):
    return [[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)] for _ in range(p)]


def warmup_off_by_one(p, m):
    plan = []
    for r in range(p):
        w = min(p - r, m)
        plan.append([f"F{i}" for i in range(w)] + [a for i in range(w, m) for a in (f"F{i}", f"B{i - w}")]
                    + [f"B{i}" for i in range(m - w, m)])
    return plan


def warmup_uncapped(p, m):
    plan = []
    for r in range(p):
        w = p - r - 1
        plan.append([f"F{i}" for i in range(w)] + [a for i in range(w, m) for a in (f"F{i}", f"B{i - w}")]
                    + [f"B{i}" for i in range(max(m - w, 0), m)])
    return plan


def mesh_reversed_layout(dp, pp, tp, axis):
    grid = torch.arange(dp * pp * tp).view(tp, pp, dp).permute(2, 1, 0)
    dim = ("dp", "pp", "tp").index(axis)
    return grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()


def mesh_always_tp(dp, pp, tp, axis):
    return pieces.mesh_groups(dp, pp, tp, "tp")


def mesh_strided_wrongly(dp, pp, tp, axis):
    size = {"dp": dp, "pp": pp, "tp": tp}[axis]
    world = dp * pp * tp
    return [list(range(i, world, world // size))[:size] for i in range(world // size)]


def merge_average(o1, l1, o2, l2):
    return (o1 + o2) / 2, torch.maximum(l1, l2)


def merge_max_lse(o1, l1, o2, l2):
    out, _ = pieces.merge_attention(o1, l1, o2, l2)
    return out, torch.maximum(l1, l2)


def merge_raw_exp(o1, l1, o2, l2):           # exp of raw log-sum-exps: overflows for large scores
    e1, e2 = torch.exp(l1), torch.exp(l2)
    return (e1.unsqueeze(-1) * o1 + e2.unsqueeze(-1) * o2) / (e1 + e2).unsqueeze(-1), torch.log(e1 + e2)


def router_softmax_after_topk(logits, k):
    top, expert = logits.topk(k, dim=-1)
    return expert, top.softmax(dim=-1)


def router_unnormalised(logits, k):
    weight, expert = logits.softmax(dim=-1).topk(k, dim=-1)
    return expert, weight


def router_ascending(logits, k):
    weight, expert = logits.softmax(dim=-1).topk(k, dim=-1, largest=True, sorted=True)
    weight = weight / weight.sum(-1, keepdim=True) if k > 1 else weight
    return expert.flip(-1), weight.flip(-1)


def save_in_place(obj, path):
    torch.save(obj, path)


def save_delete_first(obj, path):
    if os.path.exists(path):
        os.remove(path)
    atomic = Path(str(path) + ".tmp")
    torch.save(obj, atomic)
    os.replace(atomic, path)


def save_never_renamed(obj, path):
    torch.save(obj, str(path) + ".tmp")


PLANTED = {
    "neighbour_exchange": [(exchange_from_the_right, "raised"), (exchange_returns_own, "expected")],
    "tree_broadcast": [(broadcast_from_the_root, "binomial tree sends at most"),
                       (broadcast_ignores_src, "from rank"), (broadcast_one_round_short, "expected")],
    "ring_reduce_scatter": [(reduce_scatter_next_chunk, "expected"),
                            (reduce_scatter_by_all_reduce, "made 0 sends"),
                            (reduce_scatter_average, "expected")],
    "ring_all_gather": [(all_gather_equal_chunks, ""), (all_gather_rotated, "expected"),
                        (all_gather_by_torch, "")],
    "ring_all_reduce": [(all_reduce_without_gather, "every rank's sum needs every element"),
                        (all_reduce_average, "expected"),
                        (all_reduce_by_torch, "made 0 sends")],
    "all_to_all": [(all_to_all_even, ""), (all_to_all_reversed, "expected"), (all_to_all_drops_own, "shape")],
    "buckets": [(buckets_forward, "buckets: expected"), (buckets_full_is_over, "buckets: expected"),
                (buckets_never_split, "buckets: expected")],
    "one_f_one_b": [(gpipe_order, "action"), (warmup_off_by_one, "action"), (warmup_uncapped, "p=4, m=2")],
    "mesh_groups": [(mesh_reversed_layout, "groups: expected"), (mesh_always_tp, "groups: expected"),
                    (mesh_strided_wrongly, "groups: expected")],
    "merge_attention": [(merge_average, "element"), (merge_max_lse, "element"), (merge_raw_exp, "got inf")],
    "top_k_router": [(router_softmax_after_topk, "top-1"), (router_unnormalised, "top-2"),
                     (router_ascending, "top-2")],
    "atomic_save": [(save_in_place, "torn"), (save_delete_first, "torn"),
                    (save_never_renamed, "a normal save")],
}


# -- planted mistakes: ZeRO and tensor parallelism ------------------------------------------------
def zero1_by_all_reduce(param, grad, lr):
    dist.all_reduce(grad)
    return param.sub_(lr * grad / dist.get_world_size())


def zero1_sum_not_average(param, grad, lr):
    return parallel.zero1_step(param, grad * dist.get_world_size(), lr)


def zero1_no_gather(param, grad, lr):
    n, r = dist.get_world_size(), dist.get_rank()
    c = -(-param.numel() // n)
    mine = torch.empty(c)
    dist.reduce_scatter_tensor(mine, torch.nn.functional.pad(grad, (0, c * n - grad.numel())))
    flat = torch.nn.functional.pad(param, (0, c * n - param.numel()))
    flat[r * c:(r + 1) * c] -= lr * mine / n                  # only this rank's chunk is ever updated
    return param.copy_(flat[:param.numel()])


def gather_keeps_padding(shard, numel):
    full = torch.empty(shard.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(full, shard)
    return full


def gather_reversed(shard, numel):
    n = dist.get_world_size()
    full = torch.empty(shard.numel() * n)
    dist.all_gather_into_tensor(full, shard)
    return torch.cat(list(full.chunk(n))[::-1])[:numel]


def gather_own_only(shard, numel):
    return torch.nn.functional.pad(shard, (0, max(numel - shard.numel(), 0)))[:numel]


class _F(torch.autograd.Function):                   # a correct f, to plant mistakes around it
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _G(torch.autograd.Function):                   # a correct g
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ReduceBothWays(torch.autograd.Function):      # g that also all-reduces in backward
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def tp_no_f(x, w1, w2):                              # dL/dX is only this rank's part
    return _G.apply(torch.nn.functional.gelu(x @ w1) @ w2)


def tp_g_all_reduces_backward(x, w1, w2):
    return _ReduceBothWays.apply(torch.nn.functional.gelu(_F.apply(x) @ w1) @ w2)


def tp_plain_all_reduce(x, w1, w2):                  # dist.all_reduce has no backward: no gradient flows
    z = torch.nn.functional.gelu(x @ w1) @ w2
    out = z.detach().clone()
    dist.all_reduce(out)
    return out + 0 * z


def ce_without_max(logits, targets, vocab_start):
    total = logits.exp().sum(-1)
    dist.all_reduce(total)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = torch.zeros_like(total)
    picked[mine] = logits[mine, local[mine]]
    dist.all_reduce(picked)
    return (total.log() - picked).mean()


def ce_unmasked(logits, targets, vocab_start):
    return torch.nn.functional.cross_entropy(logits, (targets - vocab_start).clamp(0, logits.shape[-1] - 1))


def ce_summed(logits, targets, vocab_start):
    return parallel.vocab_parallel_cross_entropy(logits, targets, vocab_start) * targets.numel()


PLANTED.update({
    "zero1_step": [(zero1_by_all_reduce, "called all_reduce"), (zero1_sum_not_average, "expected"),
                   (zero1_no_gather, "expected")],
    "gather_full": [(gather_keeps_padding, "shape"), (gather_reversed, "expected"),
                    (gather_own_only, "expected")],
    "tp_mlp": [(tp_no_f, "dL/dX"), (tp_g_all_reduces_backward, "dL/dX"), (tp_plain_all_reduce, "dL/dX")],
    "vocab_parallel_cross_entropy": [(ce_without_max, "scaled by"), (ce_unmasked, "expected"),
                                     (ce_summed, "expected")],
})


def test_there_are_exercises_for_the_lessons_and_every_one_has_planted_mistakes():
    assert set(PLANTED) == set(dl.exercises.names())
    assert all(len(wrong) >= 2 for wrong in PLANTED.values())
    assert sum(len(wrong) >= 3 for wrong in PLANTED.values()) >= len(PLANTED) - 1   # + a hang for exchange
    assert "ring_all_reduce" in dl.exercises.task("ring_all_reduce")
    with pytest.raises(KeyError, match="names"):
        dl.exercises.check("ring_allreduce", comm.ring_all_reduce)


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_reference_passes_and_planted_mistakes_are_caught(name):
    ok = dl.exercises.check(name, dl.exercises.reference(name), quiet=True)
    assert ok.passed and ok.problem is None and "PASSED" in str(ok)
    for wrong, words in PLANTED[name]:
        res = dl.exercises.check(name, wrong, quiet=True)
        assert not res.passed, (name, wrong.__name__)
        assert words in res.problem, (name, wrong.__name__, res.problem)
        assert res.hint and "NOT YET" in str(res)


def test_a_hang_ends_at_the_deadline_saying_who_waited_for_whom():
    res = dl.exercises.check("neighbour_exchange", exchange_receive_first, world_sizes=(2,), timeout=4,
                             quiet=True)
    assert not res.passed
    assert "hung" in res.problem
    assert "rank 0 never received from rank 1 (rank 1 posted 0 sends to rank 0)" in res.problem
    assert "rank 1 never received from rank 0" in res.problem


def test_a_stub_says_not_implemented_in_words():
    def stub(t):
        raise NotImplementedError("write neighbour_exchange here")

    res = dl.exercises.check("neighbour_exchange", stub, world_sizes=(2,), quiet=True)
    assert not res.passed and "NotImplementedError: write neighbour_exchange here" in res.problem
    assert "Traceback" not in str(res)
