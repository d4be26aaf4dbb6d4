"""Shift round the ring: every rank sends a block to the next rank and gets the previous rank's.

    r0 --t0--> r1 --t1--> r2 --t2--> r0         rank r ends with t_(r-1)

One `p2p.exchange` per call. Ring attention moves its K/V blocks (and their gradients) round the ring
this way, N-1 shifts per layer; to hide a shift behind the attention of the block in hand it is
posted first and waited for later:

    shift = start_ring_shift(kv)     # isend to the next rank, irecv from the previous: posted now
    ... compute on kv ...            # the transfer proceeds meanwhile (gloo's and NCCL's own threads)
    kv = shift.wait()                # what the previous rank sent
"""
from __future__ import annotations

import torch

from .p2p import Ring, exchange, flat_view, post_exchanges


def ring_shift(t: torch.Tensor, group=None) -> torch.Tensor:
    """Send ``t`` to the next rank of the ring and return what the previous rank sent (same shape, dtype).

    Every rank passes the same shape; one comm event ``"ring_shift"``. One rank: returns ``t``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    ring = Ring.of(group)
    if ring.size == 1:
        return t
    send = flat_view(t)
    recv = torch.empty_like(send)
    exchange(ring, send=send, dst=ring.next, recv=recv, src=ring.prev)
    return recv.view(t.shape)


class PendingShift:
    """A `ring_shift` posted but not finished: the block travels while the caller computes.

    The send buffer must not be written until ``wait`` returns. Its one comm event spans the whole
    flight, from posting to completion.
    """

    def __init__(self, t: torch.Tensor, group=None):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        ring, self.shape = Ring.of(group), t.shape
        self.send = flat_view(t)
        self.recv = torch.empty_like(self.send)
        moving = ring.size > 1 and self.send.numel() > 0
        self.flights = post_exchanges(ring, [(self.send, ring.next, self.recv, ring.prev)]) if moving else []
        self.done = None if moving else self.send.view(self.shape)      # one rank, or nothing to move

    def wait(self) -> torch.Tensor:
        """Block until the block has arrived (and ours has left); returns it, shaped like the one sent.
        Waiting again returns the same block."""
        if self.done is None:
            for flight in self.flights:
                flight.wait_all()
            self.done = self.recv.view(self.shape)
        return self.done


def start_ring_shift(t: torch.Tensor, group=None) -> PendingShift:
    """`ring_shift` in two halves, to overlap it with compute: post now, ``.wait()`` for the result."""
    return PendingShift(t, group)
