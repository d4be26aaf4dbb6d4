"""`DistributedSampler`: which samples each rank reads, and *where the run is* in the data, as state.

torch's ``torch.utils.data.DistributedSampler`` gives rank r of n the samples ``order[r::n]`` of one epoch,
where ``order`` is ``torch.randperm(size)`` under a generator seeded with ``seed + epoch`` (``arange``
without shuffling), first padded by repeating its head up to a multiple of n (or, ``drop_last``, cut
down to one). `shard` is exactly that (and is tested equal to torch's). What torch's sampler does not
hold is a *position*: a run resumed from a checkpoint starts its epoch again unless the training script
remembers, per rank, how far each iterator got, and that per-rank count means nothing once the
data-parallel size changes (the bug class: a data loader's state silently dropped when the dp size
shrank on resume).

Here the position is counted in *global samples consumed*, the same number on every rank::

    epoch 0 order:  [ 7  2  9  0 | 4  8  1  5 | 3  6 ] [ 5  0  ...      the stream: epoch after epoch
                      step 0        step 1        step 2 ...           each global batch the next B samples
    consumed = 8  ->  the next batch starts at order[8]                 (epoch 0, offset 8)

A global batch is the next B samples of the stream, and a rank takes its rows of it (``tensor_split``,
uneven allowed: `rows`). The stream does not depend on the number of ranks, so a checkpoint's position
resumes the same global order on any dp size: 4 ranks killed after 10 steps, resumed on 3, read from
sample ``10 B`` on, exactly as the uninterrupted run would have.

``drop_last`` for the stream: a batch never straddles two epochs (the tail of an epoch shorter than a
batch is skipped, as a ``DataLoader(drop_last=True)`` skips it); without it, a batch runs on into the
next epoch's order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Position:
    """Where a run is in the data: ``epoch`` and ``offset`` (samples of that epoch's order consumed)."""

    epoch: int = 0
    offset: int = 0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.epoch, self.offset], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Position:
        epoch, offset = (int(v) for v in t.tolist())
        return cls(epoch, offset)


class DistributedSampler:
    """The global order of a data set of ``size`` samples, epoch by epoch, and a rank's part of it.

    ``epoch_order(e)``: every sample once, shuffled by (seed, e) like torch's sampler.
    ``shard(e, rank, n)``: torch's ``DistributedSampler(...).set_epoch(e)`` indices for ``rank`` of ``n``.
    ``batch_at(position, B)``: the global batch of B sample ids starting at ``position`` and the position
    after it: a pure function, so a loader may read ahead without moving the run's position.
    """

    def __init__(self, size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if size < 1:
            raise ValueError(f"a data set of {size} samples has nothing to sample")
        self.size, self.shuffle, self.seed, self.drop_last = size, shuffle, seed, drop_last

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Every sample id once, in epoch ``epoch``'s order (torch's: randperm seeded by seed + epoch)."""
        if not self.shuffle:
            return torch.arange(self.size)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=g)

    def shard(self, epoch: int, rank: int, num_replicas: int) -> list[int]:
        """``rank``'s samples of epoch ``epoch`` among ``num_replicas``, as torch's DistributedSampler
        gives them: padded by repeating the order's head to a multiple of the ranks (every rank the same
        count; a few samples twice) or, ``drop_last``, cut to one (a few samples not at all)."""
        order = self.epoch_order(epoch).tolist()
        if self.drop_last:
            total = (self.size // num_replicas) * num_replicas
            order = order[:total]
        else:
            total = -(-self.size // num_replicas) * num_replicas
            pad = total - self.size
            order = order + (order * (pad // self.size + 1))[:pad]
        return order[rank:total:num_replicas]

    def batch_at(self, position: Position, batch: int) -> tuple[torch.Tensor, Position]:
        """(the next ``batch`` sample ids of the stream from ``position``, the position after them)."""
        if self.drop_last and batch > self.size:
            raise ValueError(f"drop_last with a batch of {batch} from {self.size} samples drops every batch")
        epoch, offset, parts, need = position.epoch, position.offset, [], batch
        while need:
            if offset >= self.size or (self.drop_last and offset + need > self.size):
                epoch, offset = epoch + 1, 0                  # the epoch is over (or its tail dropped)
                continue
            take = min(need, self.size - offset)
            parts.append(self.epoch_order(epoch)[offset:offset + take])
            offset, need = offset + take, need - take
        return torch.cat(parts), Position(epoch, offset)

    def position_after(self, consumed: int, batch: int) -> Position:
        """The position after ``consumed`` global samples taken ``batch`` at a time from the start."""
        if consumed % batch:
            raise ValueError(f"{consumed} samples is not a whole number of batches of {batch}")
        pos = Position()
        for _ in range(consumed // batch):
            pos = self.batch_at(pos, batch)[1]
        return pos


def rows(batch: torch.Tensor, rank: int, num_replicas: int) -> torch.Tensor:
    """``rank``'s rows of a global batch: ``torch.tensor_split`` into ``num_replicas`` contiguous parts
    (uneven sizes allowed: the first ``B % n`` ranks take one row more), as `dl.models.shard` cuts."""
    return torch.tensor_split(batch, num_replicas)[rank]
