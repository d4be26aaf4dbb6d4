"""PowerSGD: data parallelism that all-reduces a rank-r approximation of each gradient matrix.

Vogels, Karimireddy and Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS), Algorithms 1 and 2. A gradient matrix M (n x m; a conv or
embedding weight is viewed as (shape[0], rest)) is replaced by P Q^T with P (n x r), Q (m x r),
found by one step of power iteration warm-started from the previous step's Q:

    M_i = G_i + e_i                  rank i's gradient plus its error-feedback memory   (n, m)
    P   = mean_i (M_i Q)             all-reduce #1: n r numbers                         (n, r)
    P^  = orthonormalize(P)          the same on every rank (QR here; the paper: Gram-Schmidt)
    Q_i = M_i^T P^                   this rank's part                                   (m, r)
    Q   = mean_i Q_i                 all-reduce #2: m r numbers                         (m, r)
    G   = P^ Q^T  = P^ P^T^ mean_i M_i      the update every rank applies (identical everywhere)
    e_i = M_i - P^ Q_i^T             what the projection lost of *this* rank's M (error feedback)

So a matrix costs (n + m) r numbers on the wire instead of n m; vectors (biases, norms) are
all-reduced whole, as in the paper. Because P^ is shared, the mean over ranks of e_i is exactly
mean M - G: nothing is thrown away, only postponed, and that is why convergence survives rank 1.
When r = min(n, m) the projection is the identity (P^ spans the columns of mean M), G = mean M and
e = 0: plain DDP, up to rounding.

    rank 0   G_0 + e_0 -> M_0 --.        .-- P^ --.               .-- G = P^ Q^T
    rank 1   G_1 + e_1 -> M_1 ---> mean(M Q) -> QR ---> mean(M^T P^) ---> (every rank)
                                 [n r]                    [m r]

Gradient accumulation: like `DDP`, ``no_sync()`` keeps gradients local; the first backward outside
compresses and averages the sum. Checkpoints keep the warm-start Q's (once) and every rank's error
memory (`PowerSGD.state`), so a resume on the same ranks is exact; a resharded resume (other world size)
restarts them (zero error, the seeded Q), as torch's ``PowerSGDState`` does unless pickled.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..flat_collectives import Collectives
from .ddp import NaiveDDP


def matrix_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the matrix PowerSGD compresses: (shape[0], numel / shape[0])."""
    return t.view(t.shape[0], -1)


class PowerSGD:
    """The compressor's state for a list of gradient matrices: warm-start Q and error memory per matrix.

    ``rank``: r, capped per matrix at min(n, m); ``error_feedback``: keep e_i (Algorithm 2) or drop
    what the projection loses (Algorithm 1 alone); ``seed``: the initial Q, identical on every rank.
    """

    def __init__(self, shapes: list[tuple[int, int]], rank: int, error_feedback: bool = True, seed: int = 0):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer (try 1, 2 or 4), got {rank!r}")
        self.shapes = shapes
        self.ranks = [min(rank, n, m) for n, m in shapes]
        self.error_feedback = error_feedback
        gen = torch.Generator().manual_seed(seed)
        self.qs = [torch.randn(m, r, generator=gen) for (n, m), r in zip(shapes, self.ranks)]   # (m, r)
        self.errors: list[torch.Tensor | None] = [None] * len(shapes)

    @torch.no_grad()
    def reduce(self, grads: list[torch.Tensor], comm: Collectives) -> None:
        """Replace every matrix in ``grads`` (n, m) by the rank-r average P^ Q^T, in place."""
        if not grads:
            return
        ms = [g.float() + e.to(g.device) if e is not None else g.float().clone()   # M_i (n, m), fp32
              for g, e in zip(grads, self.errors)]                    # (a resumed e is loaded on the CPU)
        qs = [q.to(g.device) for q, g in zip(self.qs, grads)]
        ps = [m @ q for m, q in zip(ms, qs)]                                   # (n, r) each
        ps = _all_reduce_mean(ps, comm)                                        # all-reduce #1
        ps = [torch.linalg.qr(p).Q for p in ps]                                # P^: orthonormal columns
        q_local = [m.T @ p for m, p in zip(ms, ps)]                            # (m, r) each
        qs = _all_reduce_mean(q_local, comm)                                   # all-reduce #2
        for i, (g, m, p, q, ql) in enumerate(zip(grads, ms, ps, qs, q_local)):
            self.errors[i] = m - p @ ql.T if self.error_feedback else None     # e_i = M_i - P^ Q_i^T
            g.copy_(p @ q.T)                                                   # G = P^ Q^T (n, m)
            self.qs[i] = q                                                     # warm start next step

    def state(self) -> tuple[list, list]:
        """(the warm-start Q's, the same on every rank; this rank's error memories, None before the first
        step or without error feedback): what a checkpoint keeps so that a resume is exact."""
        return list(self.qs), list(self.errors)

    def load_state(self, qs: list, errors: list) -> None:
        """Put back `state` (the layout, ``powersgd_rank`` included, matched: see the strategy)."""
        shapes = [tuple(q.shape) for q in qs] + [tuple(e.shape) for e in errors if e is not None]
        mine = [tuple(q.shape) for q in self.qs] + [s for s, e in zip(self.shapes, errors) if e is not None]
        if len(qs) != len(self.qs) or len(errors) != len(self.shapes) or shapes != mine:
            raise ValueError("the checkpoint's PowerSGD state does not fit these matrices: resume with the "
                             "model and powersgd_rank it was saved with")
        self.qs, self.errors = list(qs), list(errors)

    def elements(self) -> int:
        """Numbers all-reduced per step for the matrices: sum (n + m) r."""
        return sum((n + m) * r for (n, m), r in zip(self.shapes, self.ranks))


def _all_reduce_mean(parts: list[torch.Tensor], comm: Collectives) -> list[torch.Tensor]:
    """Average ``parts`` over the group in one all-reduce of their concatenation; returns new tensors."""
    flat = torch.cat([p.flatten() for p in parts])                            # (sum numel,)
    comm.all_reduce(flat, op="avg")
    return [piece.view_as(p) for piece, p in zip(flat.split([p.numel() for p in parts]), parts)]


class PowerSGDDDP(NaiveDDP):
    """Data parallelism with PowerSGD-compressed gradients (``rank``: r), over ``group``.

    After backward: one all-reduce of every vector gradient (biases, norms) whole, then PowerSGD's
    two all-reduces for all matrices together (their P's concatenated, then their Q's). Like
    `NaiveDDP` it communicates after backward, not overlapped. ``comm``: "torch" or "ring".
    """

    def __init__(self, module: nn.Module, rank: int = 4, error_feedback: bool = True, comm: str = "torch",
                 group=None, seed: int = 0):
        super().__init__(module, comm, group)          # NaiveDDP: broadcast, hooks, no_sync
        self.matrices = [p for p in self.params if p.dim() >= 2]
        self.vectors = [p for p in self.params if p.dim() < 2]
        self.compressor = PowerSGD([tuple(matrix_view(p).shape) for p in self.matrices], rank,
                                   error_feedback, seed)

    def all_reduce_grads(self) -> None:
        """Vectors averaged whole; matrices replaced by PowerSGD's rank-r average."""
        self._queued = False
        for p in self.params:                          # unused this step: contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.vectors:
            flat = _all_reduce_mean([p.grad for p in self.vectors], self.comm)
            for p, g in zip(self.vectors, flat):
                p.grad.copy_(g)
        self.compressor.reduce([matrix_view(p.grad) for p in self.matrices], self.comm)

    def elements_per_step(self) -> int:
        """Numbers all-reduced per optimizer step: sum (n + m) r over matrices + every vector's numel."""
        return self.compressor.elements() + sum(p.numel() for p in self.vectors)
