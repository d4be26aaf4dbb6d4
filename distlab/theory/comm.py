"""Collective communication time in the alpha-beta model, nccl-tests bandwidths, step volumes.

A message of m bytes costs alpha + m / B (Hockney 1994). ``nbytes`` = S is the size nccl-tests
reports: the whole buffer of each rank (all_reduce in/out, all_gather output, reduce_scatter
input, all_to_all send buffer). Over n ranks (Thakur, Rabenseifner & Gropp 2005; Patarasuk &
Yuan 2009 for the ring):

    op              ring                             tree                               naive (one root)
    all_reduce      2(n-1) a + 2 (n-1)/n S/B         2 lg n (a + S/B)  reduce + bcast   2 (n-1)(a + S/B)
    reduce_scatter  (n-1) a + (n-1)/n S/B            lg n a + (n-1)/n S/B  halving      (n-1)(a + S/B)
                                                                                          + (n-1)(a + S/(nB))
    all_gather      (n-1) a + (n-1)/n S/B            lg n a + (n-1)/n S/B  doubling     (n-1)(a + S/(nB))
                                                                                          + (n-1)(a + S/B)
    broadcast       (n-1) a + S/B  (pipelined)       lg n (a + S/B)  binomial           (n-1)(a + S/B)
    all_to_all      (n-1) a + (n-1)/n S/B  pairwise  lg n a + lg n S/(2B)  Bruck        (n-1)(a + S/(nB))

nccl-tests PERFORMANCE.md: algbw = S / t, busbw = algbw x factor, factor 2(n-1)/n for
all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast and reduce.
busbw is comparable with the link's peak whatever n is.
"""
from __future__ import annotations

import math

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
ALGORITHMS = ("ring", "tree", "naive")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}


def comm_time(op: str, nbytes: float, n: int, bandwidth: float, latency: float = 0.0,
              algorithm: str = "ring") -> float:
    """Seconds for collective ``op`` of ``nbytes`` over ``n`` ranks (bytes/s, seconds per message)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(OPS)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    if n < 1 or bandwidth <= 0:
        raise ValueError(f"need n >= 1 ranks and bandwidth > 0 bytes/s; got n={n}, bandwidth={bandwidth}")
    if n == 1:
        return 0.0
    a, s, b, steps = latency, nbytes, bandwidth, math.ceil(math.log2(n))
    shard = (n - 1) / n * s / b
    if algorithm == "ring":
        ring = {"all_reduce": 2 * (n - 1) * a + 2 * shard, "broadcast": (n - 1) * a + s / b}
        return ring.get(op, (n - 1) * a + shard)
    if algorithm == "tree":
        return {"all_reduce": 2 * steps * (a + s / b), "broadcast": steps * (a + s / b),
                "all_to_all": steps * a + steps * s / (2 * b)}.get(op, steps * a + shard)
    whole, piece = (n - 1) * (a + s / b), (n - 1) * (a + s / (n * b))
    return {"all_reduce": 2 * whole, "broadcast": whole, "all_to_all": piece}.get(op, whole + piece)


def algbw(nbytes: float, seconds: float) -> float:
    """nccl-tests algorithm bandwidth: S / t (bytes/s)."""
    return nbytes / seconds


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests bus bandwidth: algbw times the op's factor (2(n-1)/n for all_reduce)."""
    if op not in BUS_FACTOR:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(BUS_FACTOR)}")
    return algbw(nbytes, seconds) * BUS_FACTOR[op](n)


def fit_alpha_beta(sizes: list[float], seconds: list[float], n: int) -> tuple[float, float]:
    """Fit the ring all-reduce's alpha-beta model to measured times: (alpha in s, B in bytes/s).

    Model (`comm_time`): t(S) = 2(n-1) alpha + 2(n-1)/n S / B, linear in x = (alpha, 1/B). Timings
    span orders of magnitude, so the fit minimises the *relative* error: each row divided by its
    measured t, least squares on

        sum_i ( (a_i . x) / t_i - 1 )^2,      a_i = (2(n-1), 2(n-1)/n S_i)

    solved by the 2 x 2 normal equations. A negative alpha (latency lost in the noise) is refitted
    with bandwidth alone. Lessons 01 and 12 fit this machine's loopback with it.
    """
    if n < 2 or len(sizes) != len(seconds) or len(sizes) < 2 or min(seconds) <= 0:
        raise ValueError(f"need n >= 2 and at least two (size, seconds > 0) pairs, got n={n}, "
                         f"{len(sizes)} sizes and {len(seconds)} times")
    rows = [(2.0 * (n - 1) / t, 2.0 * (n - 1) / n * s / t) for s, t in zip(sizes, seconds)]
    p = sum(a * a for a, _ in rows)
    q = sum(a * b for a, b in rows)
    r = sum(b * b for _, b in rows)
    u, v = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = p * r - q * q
    alpha, inv_b = ((r * u - q * v) / det, (p * v - q * u) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:                                  # or every size the same: bandwidth alone
        alpha, inv_b = 0.0, v / r
    return float(alpha), float(1.0 / inv_b)


def dp_volume(param_bytes: float, n: int) -> float:
    """Bytes each rank sends per step in DDP: a ring all-reduce of the gradients, 2 (n-1)/n Psi."""
    return 2 * (n - 1) / n * param_bytes


def zero_volume(stage: int, param_bytes: float, n: int) -> float:
    """Bytes sent per rank per step (ZeRO paper Sec. 7): stages 0-2 2 (n-1)/n Psi
    (reduce-scatter of grads + all-gather of params), stage 3 3 (n-1)/n Psi (params gathered
    for the forward and again for the backward)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    return (3 if stage == 3 else 2) * (n - 1) / n * param_bytes


def fsdp_volume(param_bytes: float, shards: int, replicas: int = 1, reshard_after_forward: bool = True,
                grad_bytes: float | None = None) -> dict[str, float]:
    """Bytes each rank sends per step under FSDP (``replicas=1``) or HSDP, by link type (Zhao et al.
    2023, "PyTorch FSDP", Sec. 3.2: hybrid sharding). ``param_bytes``: one full copy of the parameters
    in the gather dtype (``param_dtype``); ``grad_bytes``: of the gradients in the reduce dtype (default
    the same). World = replicas x shards::

        grid  arange(R S).view(R, S)     "shard": a row (S ranks, fast links: inside a node)
                                         "replicate": a column (R ranks holding the same shard)

        shard      (2 or 3) (S-1)/S P_param ... all-gather forward, again backward if resharded
                   + (S-1)/S P_grad         ... reduce-scatter of the gradients
        replicate  2 (R-1)/R P_grad / S     ... all-reduce of this rank's 1/S gradient shard

    With R = 1 it is ZeRO-3's 3 (N-1)/N Psi (2 without resharding); only 1/S of the gradients ever
    crosses the slow links, whatever the model size."""
    if shards < 1 or replicas < 1:
        raise ValueError(f"need shards >= 1 and replicas >= 1, got shards={shards}, replicas={replicas}")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    gathers = 2 if reshard_after_forward else 1
    s, r = shards, replicas
    return {"shard": (gathers * param_bytes + grad_bytes) * (s - 1) / s,
            "replicate": 2 * (r - 1) / r * grad_bytes / s}


def tp_volume(seq_len: int, micro_batch: int, hidden: int, tp: int, layers: int = 1,
              bytes_per_element: int = 2) -> float:
    """Bytes sent per rank per microbatch under Megatron TP (Shoeybi et al. 2019): each layer
    all-reduces its b s h activations twice forward (attention, MLP: operator g) and twice
    backward (operator f). With sequence parallelism each becomes a reduce-scatter plus an
    all-gather: the same volume."""
    message = seq_len * micro_batch * hidden * bytes_per_element
    return 4 * layers * 2 * (tp - 1) / tp * message


def pp_volume(seq_len: int, micro_batch: int, hidden: int, microbatches: int,
              bytes_per_element: int = 2) -> float:
    """Bytes a middle pipeline stage sends per step: one b s h activation forward and one
    gradient backward per microbatch (point-to-point, no collective)."""
    return 2 * microbatches * seq_len * micro_batch * hidden * bytes_per_element
