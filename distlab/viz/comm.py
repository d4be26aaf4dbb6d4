"""Communication charts: bytes per op and rank with bus bandwidth beside the model (`comm`), and the
ring all-reduce drawn step by step (`ring_steps`).

Bus bandwidth is the nccl-tests definition (``dl.theory.busbw``): algbw = S / t times
2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter and all-gather, 1 for broadcast. The model
curve is the alpha-beta time ``dl.theory.comm_time`` turned into the same bus bandwidth.
"""
from __future__ import annotations

from collections import defaultdict

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ..theory.comm import busbw, comm_time
from ..trace import Trace

# dl.comm op name -> (collective in dl.theory, algorithm)
COLLECTIVE = {"ring_all_reduce": ("all_reduce", "ring"), "naive_all_reduce": ("all_reduce", "naive"),
              "ring_reduce_scatter": ("reduce_scatter", "ring"), "ring_all_gather": ("all_gather", "ring"),
              "broadcast": ("broadcast", "tree")}


def calls(trace: Trace, op: str) -> list[dict]:
    """Each call of ``op`` in the trace: its message size, ranks, and time (the slowest rank's).

    A rank's time for a call runs from its first step's start to its last step's end; the k-th
    call of a given size on every rank is the same collective (all members call in the same order).
    """
    per_rank: dict[tuple[int, int], dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for e in trace.comms(op=op):
        per_rank[(e.args.get("size", 0), e.args.get("world", 1))][e.rank].append(e)
    out = []
    for (size, n), by_rank in sorted(per_rank.items()):
        per_call = {}
        for rank, events in by_rank.items():
            grouped = defaultdict(list)
            for e in events:
                grouped[e.args.get("call")].append(e)
            per_call[rank] = [(min(e.start for e in g), max(e.end for e in g))
                              for _, g in sorted(grouped.items())]
        count = min(len(v) for v in per_call.values())
        for k in range(count):
            seconds = max(v[k][1] - v[k][0] for v in per_call.values())
            out.append({"op": op, "size": size, "world": n, "seconds": seconds, "ranks": sorted(per_call)})
    return out


def _as_model(model) -> tuple[float, float] | None:
    """``model``: (latency_s, bandwidth_Bps), or a dict with "latency" and "bandwidth"."""
    if model is None:
        return None
    if isinstance(model, dict):
        return float(model.get("latency", 0.0)), float(model["bandwidth"])
    latency, bandwidth = model
    return float(latency), float(bandwidth)


def comm(trace: Trace, model=None, ops: list[str] | None = None, title: str | None = None):
    """Bytes sent and received per op and rank (left) and measured bus bandwidth per call (right).

    ``model=(latency_s, bandwidth_Bps)`` draws the alpha-beta prediction (dl.theory.comm_time)
    beside each measured op as a line over message sizes. Returns the Figure.
    """
    ops = ops or sorted({e.name for e in trace.comms()})
    ranks = trace.ranks
    fig, (ax_bytes, ax_bw) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(ops), 1)
    for i, op in enumerate(ops):
        xs = [r + (i - (len(ops) - 1) / 2) * width for r in ranks]
        sent = [trace.bytes_sent(rank=r, op=op) for r in ranks]
        received = [trace.bytes_received(rank=r, op=op) for r in ranks]
        colour = plt.cm.tab10(i % 10)
        ax_bytes.bar(xs, sent, width * 0.48, color=colour, label=f"{op} sent", align="edge")
        ax_bytes.bar([x - width * 0.48 for x in xs], received, width * 0.48, color=colour, alpha=0.45,
                     label=f"{op} received", align="edge")
    ax_bytes.set_xticks(ranks)
    ax_bytes.set_xticklabels([f"rank {r}" for r in ranks])
    ax_bytes.set_ylabel("bytes")
    ax_bytes.set_title("bytes per rank and op (light: received)")
    ax_bytes.legend(fontsize=7)

    alpha_beta = _as_model(model)
    for i, op in enumerate(ops):
        if op not in COLLECTIVE:
            continue
        collective, algorithm = COLLECTIVE[op]
        measured = [c for c in calls(trace, op) if c["size"] > 0 and c["seconds"] > 0 and c["world"] > 1]
        if not measured:
            continue
        colour = plt.cm.tab10(i % 10)
        ax_bw.scatter([c["size"] for c in measured],
                      [busbw(collective, c["size"], c["seconds"], c["world"]) / 1e9 for c in measured],
                      s=12, color=colour, label=f"{op} measured")
        if alpha_beta is not None:
            latency, bandwidth = alpha_beta
            for n in sorted({c["world"] for c in measured}):
                ends = [c["size"] for c in measured if c["world"] == n]
                sizes = np.geomspace(min(ends), max(ends), 40) if max(ends) > min(ends) else ends
                predicted = [busbw(collective, s,
                                   comm_time(collective, s, n, bandwidth, latency, algorithm), n) / 1e9
                             for s in sizes]
                ax_bw.plot(sizes, predicted, "-", color=colour, alpha=0.7, label=f"{op} model (N={n})")
    ax_bw.set_xscale("log")
    ax_bw.set_xlabel("message size S (bytes)")
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    ax_bw.set_title("measured bus bandwidth" + (" and alpha-beta model" if alpha_beta else ""))
    ax_bw.grid(alpha=0.3)
    if ax_bw.has_data():
        ax_bw.legend(fontsize=7)
    fig.suptitle(title or "communication")
    fig.tight_layout()
    return fig


def _ring_moves(n: int, trace: Trace | None, op: str) -> list[list[tuple[int, int]]]:
    """For each step, each rank's (chunk sent, chunk received): from the trace, or the ring's rule."""
    if trace is None:
        return [[((r - s - 1) % n, (r - s - 2) % n) for r in range(n)] for s in range(2 * (n - 1))]
    moves = [[None] * n for _ in range(2 * (n - 1))]
    for r in range(n):
        events = [e for e in trace.comms(rank=r, op=op) if e.args.get("world") == n]
        if not events:
            raise ValueError(f"no {op!r} events over {n} ranks on rank {r} in the trace")
        first = min(e.args["call"] for e in events)
        for e in events:
            if e.args["call"] == first:
                moves[e.args["step"]][r] = (e.args["send_chunk"], e.args["recv_chunk"])
    return moves


def ring_steps(n: int = 4, trace: Trace | None = None, op: str = "ring_all_reduce", title: str | None = None):
    """Draw the ring all-reduce over ``n`` ranks step by step; returns the Figure.

    One row per step, each rank's buffer as N chunks. A chunk's label lists the ranks whose data it
    already contains and its shade deepens as contributions add up; the outlined chunk is the one
    the rank sends to its right neighbour at that step. Reduce-scatter: N-1 steps, after which rank
    r owns chunk r fully reduced; all-gather: N-1 more steps passing the reduced chunks around.
    With ``trace``, the chunk moves are read from the first recorded call instead of the rule
    "at step s rank r sends chunk (r-s-1) mod N" - so the drawing shows what the code did.
    """
    if n < 2:
        raise ValueError(f"a ring needs n >= 2 ranks, got {n}")
    moves = _ring_moves(n, trace, op)
    state = [[{r} for _ in range(n)] for r in range(n)]          # state[rank][chunk] = contributors
    rows = 2 * (n - 1) + 1
    fig, axes = plt.subplots(rows, 1, figsize=(1.3 + 1.9 * n, 0.95 * rows + 0.3))
    cmap = plt.cm.Greens
    for s in range(rows):
        ax = axes[s]
        final = s == rows - 1
        for r in range(n):
            x0 = r * (n + 1)
            for c in range(n):
                who = state[r][c]
                ax.add_patch(Rectangle((x0 + c, 0), 0.92, 0.9,
                                       facecolor=cmap(0.15 + 0.75 * len(who) / n), edgecolor="black",
                                       lw=2.2 if not final and moves[s][r][0] == c else 0.3))
                label = ("all" if len(who) == n
                         else "".join(str(k) for k in sorted(who)) if n <= 5 else str(len(who)))
                ax.text(x0 + c + 0.46, 0.45, label, ha="center", va="center", fontsize=7)
            if s == 0:
                ax.text(x0 + n / 2, 1.15, f"rank {r}", ha="center", fontsize=9)
            if not final:
                ax.text(x0 + n / 2, -0.35, f"sends c{moves[s][r][0]} -> rank {(r + 1) % n}", ha="center",
                        fontsize=7)
        phase = "final" if final else ("reduce-scatter" if s < n - 1 else "all-gather")
        ax.text(-0.4, 0.45, f"{phase}\nstep {s}" if not final else "after\n" + str(rows - 1) + " steps",
                ha="right", va="center", fontsize=8)
        ax.set_xlim(-2.6, n * (n + 1))
        ax.set_ylim(-0.6, 1.5 if s == 0 else 1.0)
        ax.axis("off")
        if final:
            break
        sent = [(r, moves[s][r][0], set(state[r][moves[s][r][0]])) for r in range(n)]
        for r, c, who in sent:
            dst = (r + 1) % n
            if moves[s][dst][1] != c:
                raise ValueError(f"step {s}: rank {dst} receives chunk {moves[s][dst][1]} "
                                 f"but rank {r} sends {c}")
            state[dst][c] = state[dst][c] | who if s < n - 1 else who
    fig.suptitle(title or f"ring all-reduce over {n} ranks: labels = ranks summed into each chunk, "
                 "outline = chunk sent this step", fontsize=10)
    fig.tight_layout()
    return fig
