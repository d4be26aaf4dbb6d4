"""Synthetic data sets, indexed by step: each ``batch(step, size)`` returns the *global* batch, a pure
function of (seed, step), so every rank and every world size sees the same one; `shard` gives a rank
its rows.

* `MarkovTokens`: token sequences from a seeded, low-entropy Markov chain: a model visibly learns it
  (loss falls from ln V towards the chain's entropy rate, `MarkovTokens.entropy`). For the GPTs.
* `TeacherRegression`: inputs and targets from a fixed random teacher MLP. For the MLP.
"""
from __future__ import annotations

import math

import torch

from .mlp import MLP


class MarkovTokens:
    """Sequences from a seeded Markov chain over ``vocab`` tokens with ``branching`` likely successors.

    Each token has ``branching`` successors drawn once from the seed, taken with equal probability,
    so the best achievable loss is ln(branching) nats (`entropy`), far below ln(vocab).
    ``batch(step, size)`` is a pure function of (seed, step): every rank and every world size sees
    the same global batch.
    """

    def __init__(self, vocab: int = 64, seq_len: int = 32, seed: int = 0, branching: int = 2):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq_len, self.seed, self.branching = vocab, seq_len, seed, branching
        self.successors = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])

    @property
    def entropy(self) -> float:
        return math.log(self.branching)

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        seq = torch.empty(size, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (size,), generator=g)
        choice = torch.randint(self.branching, (size, self.seq_len), generator=g)
        for t in range(self.seq_len):
            seq[:, t + 1] = self.successors[seq[:, t], choice[:, t]]
        return seq[:, :-1], seq[:, 1:]


class TeacherRegression:
    """x ~ N(0, I), y = teacher(x) for a fixed random MLP teacher: the MLP student can fit it exactly."""

    def __init__(self, sizes=(16, 64, 64, 1), seed: int = 0):
        torch.manual_seed(10_000 + seed)
        self.teacher = MLP(sizes)
        for p in self.teacher.parameters():
            p.data.mul_(10.0)   # larger than the student's init, so there is something to learn
            p.requires_grad_(False)
        self.in_features, self.seed = sizes[0], seed

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(size, self.in_features, generator=g)
        with torch.no_grad():
            return x, self.teacher(x)


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows of the global batch that ``rank`` owns: ``torch.tensor_split`` (uneven splits allowed)."""
    return torch.tensor_split(batch, world_size)[rank]
