"""Exercises of lessons 00, 01 and 10: collectives built from send and receive.

Each checks the numbers on 1 to 5 ranks (sizes that do not divide by the world size included) and,
where the algorithm is the point, the messages too: a ring sends only to its right neighbour and
receives only from its left one, one chunk per message, at most (N-1) chunks per phase per rank (a
correct ring may skip an empty chunk, so bytes are judged, not a count of sends); a binomial-tree
broadcast sends at most ceil(log2 N) messages from any rank.
Inputs are small integers stored as floats, so every sum is exact and any difference is a mistake.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distlab.exercises.harness import Exercise, compare_tensors, p2p_during, register, sends_during

SIZES = (1, 4, 7, 12, 100)            # numbers of elements: 7 and 100 do not divide by 3 or 4 ranks


def rank_input(case: dict, rank: int) -> torch.Tensor:
    """The tensor rank ``rank`` starts from in ``case``: small integers, so sums are exact in fp32."""
    g = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    return torch.randint(-8, 9, (case["numel"],), generator=g).float()


def size_cases(world_size: int) -> list[dict]:
    return [{"label": f"{n} element{'s' * (n != 1)}", "numel": n, "seed": i} for i, n in enumerate(SIZES)]


def total(case: dict, world_size: int) -> torch.Tensor:
    return sum(rank_input(case, r) for r in range(world_size))


def ring_traffic(got: dict, expected: dict) -> str | None:
    """The numbers first, then what a ring must do, judged by the bytes rather than a count of messages
    (a correct ring may skip an empty chunk): every send goes right and every receive comes from the left;
    no message is larger than one chunk (no rank is handed the whole tensor at once); each rank sends and
    receives at most the ring's (N-1) chunks per phase, and sends at least what must leave it."""
    problem = compare_tensors(got["out"], expected["out"])
    if problem:
        return problem
    n, numel, size = expected["n"], expected["numel"], expected["out"].element_size()
    for kind, did, rule, side in (("send", "sent to", "sends only to", "right"),
                                  ("recv", "received from", "receives only from", "left")):
        wrong = [p for k, p, _ in got["messages"] if k == kind and p != expected[side]]
        if wrong:
            return (f"{did} rank {wrong[0]}, but in a ring a rank {rule} its {side} neighbour, "
                    f"rank {expected[side]}")
    chunk = -(-numel // n)                                   # ceil: the largest chunk of tensor_split
    sent = sum(b for k, _, b in got["messages"] if k == "send") // size
    received = sum(b for k, _, b in got["messages"] if k == "recv") // size
    largest = max((b // size for _, _, b in got["messages"]), default=0)
    most = expected["phases"] * (n - 1) * chunk
    if largest > chunk:
        return (f"one message carried {largest} elements; a ring moves one chunk at a time, at most "
                f"ceil({numel}/{n}) = {chunk} (no rank is sent the whole tensor)")
    if sent > most or received > most:
        return (f"sent {sent} and received {received} elements; a ring moves at most {expected['phases']} x "
                f"(N-1) chunks of {chunk} = {most} per rank")
    if sent < expected["must"]:
        sends = sum(k == "send" for k, _, _ in got["messages"])
        own = "" if sends else " (torch's collectives do not count: build it from dist.isend / dist.irecv)"
        return (f"made {sends} sends carrying {sent} elements, but at least {expected['must']} must leave "
                f"this rank: {expected['why']}{own}")
    return None


# -- 1. neighbour exchange ------------------------------------------------------------------------
def neighbour_exchange(t: torch.Tensor) -> torch.Tensor:
    """Send ``t`` to the right neighbour (rank + 1) mod N and return what the left one sent. Posting
    both with isend/irecv before waiting cannot deadlock, whatever the message size."""
    n, r = dist.get_world_size(), dist.get_rank()
    received = torch.empty_like(t)
    if n == 1:
        return received.copy_(t)
    requests = [dist.isend(t, (r + 1) % n), dist.irecv(received, (r - 1) % n)]
    for request in requests:
        request.wait()
    return received


register(Exercise(
    name="neighbour_exchange", lesson="00",
    task="neighbour_exchange(t) -> the tensor the left neighbour (rank - 1) mod N sent; "
         "send t to (rank + 1) mod N",
    reference=neighbour_exchange, cases=size_cases,
    run=lambda fn, case: fn(rank_input(case, dist.get_rank())),
    expect=lambda case, r, n: rank_input(case, (r - 1) % n),
    hint="post the send and the receive with dist.isend / dist.irecv, then wait for both; "
         "the left neighbour of rank r is (r - 1) % N"))


# -- 2. binomial-tree broadcast -------------------------------------------------------------------
def tree_broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Broadcast ``t`` from ``src`` in place down a binomial tree: in round k, every rank that has
    the data (relative rank < 2^k) sends it to relative rank + 2^k. ceil(log2 N) rounds."""
    n, r = dist.get_world_size(), dist.get_rank()
    me = (r - src) % n                                   # rank relative to the source
    step = 1
    while step < n:
        if me < step and me + step < n:
            dist.send(t, (me + step + src) % n)
        elif step <= me < 2 * step:
            dist.recv(t, (me - step + src) % n)
        step *= 2
    return t


def _tree_cases(world_size: int) -> list[dict]:
    return [{"label": f"{n} elements from rank {src}", "numel": n, "seed": i, "src": src}
            for i, (n, src) in enumerate([(1, 0), (10, 0), (10, world_size - 1), (7, world_size // 2)])]


def _tree_run(fn, case):
    r = dist.get_rank()
    t = rank_input(case, r) if r == case["src"] else torch.zeros(case["numel"])
    out, sends = sends_during(lambda: fn(t, case["src"]))
    return {"out": out, "sends": sends}


def _tree_compare(got, expected):
    problem = compare_tensors(got["out"], expected["out"])
    if problem:
        return problem
    if len(got["sends"]) > expected["most"]:
        return (f"sent {len(got['sends'])} messages; a binomial tree sends at most ceil(log2 N) = "
                f"{expected['most']} from any rank (the source sending to everyone is the naive broadcast)")
    return None


register(Exercise(
    name="tree_broadcast", lesson="01",
    task="tree_broadcast(t, src) -> t, filled in place on every rank with the source's tensor, "
         "in ceil(log2 N) rounds of send/recv",
    reference=tree_broadcast, cases=_tree_cases, run=_tree_run, compare=_tree_compare,
    expect=lambda case, r, n: {"out": rank_input(case, case["src"]), "most": math.ceil(math.log2(n))},
    hint="work with ranks relative to the source, me = (rank - src) % N; in the round with step 2^k, "
         "ranks me < 2^k send to me + 2^k, ranks 2^k <= me < 2^(k+1) receive from me - 2^k",
    world_sizes=(1, 2, 3, 5)))


# -- 3-5. the ring: reduce-scatter, all-gather, all-reduce ----------------------------------------
def ring_reduce_scatter(t: torch.Tensor) -> torch.Tensor:
    """Chunk ``rank`` of the sum over ranks, chunks from ``torch.tensor_split(t.flatten(), N)``.
    Step s = 0..N-2: send chunk (r-s-1) mod N right, receive chunk (r-s-2) mod N from the left, add."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in torch.tensor_split(t.flatten(), n)]
    for s in range(n - 1):
        send, recv = (r - s - 1) % n, (r - s - 2) % n
        incoming = torch.empty_like(chunks[recv])
        requests = [dist.isend(chunks[send], (r + 1) % n), dist.irecv(incoming, (r - 1) % n)]
        for request in requests:
            request.wait()
        chunks[recv] += incoming
    return chunks[r]


def ring_all_gather(chunk: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's chunk, concatenated in rank order; ``sizes[j]`` is rank j's number of elements.
    Step s = 0..N-2: send chunk (r-s) mod N right, receive chunk (r-s-1) mod N from the left."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = [torch.empty(size, dtype=chunk.dtype) for size in sizes]
    chunks[r] = chunk.flatten().clone()
    for s in range(n - 1):
        send, recv = (r - s) % n, (r - s - 1) % n
        requests = [dist.isend(chunks[send], (r + 1) % n), dist.irecv(chunks[recv], (r - 1) % n)]
        for request in requests:
            request.wait()
    return torch.cat(chunks)


def ring_all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In place, the sum over ranks: ring reduce-scatter, then ring all-gather (2 (N-1) steps).
    Same signature as `dl.comm.ring_all_reduce`; this exercise builds the sum over the whole world."""
    if op != "sum" or group is not None:
        raise NotImplementedError("this exercise's ring sums over the world: op='sum', group=None")
    n = dist.get_world_size()
    if n == 1:
        return t
    mine = ring_reduce_scatter(t)
    sizes = [c.numel() for c in torch.tensor_split(t.flatten(), n)]
    t.copy_(ring_all_gather(mine, sizes).view_as(t))
    return t


def _ring_run(call):
    def run(fn, case):
        out, messages = p2p_during(lambda: call(fn, case, dist.get_rank(), dist.get_world_size()))
        return {"out": out, "messages": messages}
    return run


def _ring_expect(answer, phases: int, must, why: str):
    """What rank r must end with, and the ring's bounds: ``must(numel, own)`` the elements that have to
    leave rank r (``own`` the size of its chunk) for any algorithm to be right, ``why`` in words."""
    def expect(case, r, n):
        own = _split_sizes(case["numel"], n)[r]
        return {"out": answer(case, r, n), "right": (r + 1) % n, "left": (r - 1) % n, "n": n, "why": why,
                "numel": case["numel"], "phases": phases, "must": must(case["numel"], own) if n > 1 else 0}
    return expect


def _split_sizes(numel: int, n: int) -> list[int]:
    return [c.numel() for c in torch.tensor_split(torch.empty(numel), n)]


register(Exercise(
    name="ring_reduce_scatter", lesson="01",
    task="ring_reduce_scatter(t) -> chunk `rank` of the sum over ranks, "
         "chunks = torch.tensor_split(t.flatten(), N); "
         "N-1 steps, sending only to the right neighbour",
    reference=ring_reduce_scatter, cases=size_cases,
    run=_ring_run(lambda fn, case, r, n: fn(rank_input(case, r))),
    expect=_ring_expect(lambda case, r, n: torch.tensor_split(total(case, n), n)[r], phases=1,
                        must=lambda numel, own: numel - own,
                        why="every other rank's chunk of the sum needs this rank's part of it"),
    compare=ring_traffic,
    hint="in step s rank r sends chunk (r - s - 1) % N to rank r + 1 and adds the chunk (r - s - 2) % N it "
         "receives from rank r - 1 into its own copy; after N - 1 steps chunk r is complete",
    world_sizes=(1, 2, 3, 4)))

register(Exercise(
    name="ring_all_gather", lesson="01",
    task="ring_all_gather(chunk, sizes) -> every rank's chunk concatenated in rank order "
         "(sizes[j] = rank j's "
         "number of elements); N-1 steps, sending only to the right neighbour",
    reference=ring_all_gather, cases=size_cases,
    run=_ring_run(lambda fn, case, r, n: fn(torch.tensor_split(rank_input(case, 0), n)[r].clone(),
                                            _split_sizes(case["numel"], n))),
    expect=_ring_expect(lambda case, r, n: rank_input(case, 0), phases=1,
                        must=lambda numel, own: own, why="every other rank needs this rank's chunk"),
    compare=ring_traffic,
    hint="in step s rank r forwards chunk (r - s) % N to rank r + 1 and stores chunk (r - s - 1) % N from "
         "rank r - 1; allocate every chunk with its own size (sizes[j]) so uneven splits work",
    world_sizes=(1, 2, 3, 4)))

register(Exercise(
    name="ring_all_reduce", lesson="01",
    task="ring_all_reduce(t) -> t, the sum over ranks in place: your reduce-scatter then your all-gather, "
         "2(N-1) steps, each rank sending 2(N-1)/N of the data",
    reference=ring_all_reduce, cases=size_cases,
    run=_ring_run(lambda fn, case, r, n: fn(rank_input(case, r))),
    expect=_ring_expect(lambda case, r, n: total(case, n), phases=2,
                        must=lambda numel, own: numel,
                        why="every rank's sum needs every element of this rank's tensor"),
    compare=ring_traffic,
    hint="reduce-scatter (N-1 steps) leaves rank r with chunk r of the sum; an all-gather (N-1 more) hands "
         "every chunk to everyone; write the result back into t", world_sizes=(1, 2, 3, 4)))


# -- 6. all-to-all --------------------------------------------------------------------------------
def all_to_all(t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rank r sends its rows ``t[offset_j : offset_j + send_counts[j]]`` to rank j and returns the rows
    it receives, ``recv_counts[j]`` from rank j, concatenated in rank order (pairwise exchange: in step
    s it sends to (r + s) mod N and receives from (r - s) mod N)."""
    n, r = dist.get_world_size(), dist.get_rank()
    blocks = list(torch.split(t, send_counts))
    out = [torch.empty((c, *t.shape[1:]), dtype=t.dtype) for c in recv_counts]
    out[r] = blocks[r].clone()
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        requests = [dist.isend(blocks[to].contiguous(), to), dist.irecv(out[frm], frm)]
        for request in requests:
            request.wait()
    return torch.cat(out)


def _counts(case: dict, n: int) -> list[list[int]]:
    """counts[i][j]: rows rank i sends to rank j (zeros included)."""
    g = torch.Generator().manual_seed(case["seed"])
    return torch.randint(0, case["most"] + 1, (n, n), generator=g).tolist()


def _rows(case: dict, rank: int, n: int) -> torch.Tensor:
    rows = sum(_counts(case, n)[rank])
    return rank_input({"seed": case["seed"], "numel": rows * 3}, rank).view(rows, 3)


def _a2a_expect(case, r, n):
    counts = _counts(case, n)
    pieces = [torch.split(_rows(case, j, n), counts[j])[r] for j in range(n)]
    return torch.cat(pieces)


register(Exercise(
    name="all_to_all", lesson="10",
    task="all_to_all(t, send_counts, recv_counts) -> the rows received from every rank, in rank order; "
         "rank r sends the j-th block of send_counts[j] rows of t to rank j",
    reference=all_to_all,
    cases=lambda n: [{"label": f"up to {m} rows per pair", "seed": i, "most": m}
                     for i, m in enumerate((0, 1, 4))],
    run=lambda fn, case: fn(_rows(case, dist.get_rank(), dist.get_world_size()),
                            _counts(case, dist.get_world_size())[dist.get_rank()],
                            [row[dist.get_rank()] for row in _counts(case, dist.get_world_size())]),
    expect=_a2a_expect,
    hint="split t into blocks with torch.split(t, send_counts); allocate one receive buffer per rank with "
         "recv_counts[j] rows; in step s exchange with (r + s) % N and (r - s) % N; keep your own block"))
