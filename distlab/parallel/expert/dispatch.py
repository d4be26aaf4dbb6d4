"""Dispatch and combine: tokens travel to their experts' ranks by all-to-all, and back by another.

Experts are split over the group in contiguous blocks: rank r owns experts r*E/n .. (r+1)*E/n - 1.
Each rank holds a contiguous part of the batch (rows of the global batch in rank order)::

    rank 0: tokens t0 t1 t2 t3        routed   t0->e2  t1->e0  t2->e3  t3->e0     (E = 4, n = 2)
                 sorted by expert: [t1 t3 | t0 t2]   send = [2, 2]
    all-to-all: rank r receives, from every rank in rank order, the tokens routed to its experts
    rank 0 (e0, e1): [t1 t3 from rank 0 | ... from rank 1]   -> experts -> outputs, same order
    all-to-all back (send and receive sizes swapped) -> y(t) = sum_c weight(t, c) * expert_c(t)

1. `plan`: the single-process `models.moe.plan` over a group. Every rank counts its tokens per
   (choice, expert) and all-gathers the counts, (n, k, E): from them alone every rank knows the
   capacity C (from the *global* token count), which of its own tokens fit (`moe.slots` with its
   part's `moe.offsets`), and how many rows it sends to and receives from each rank (`moe.kept`).
   Dropping at the sender, with global slot numbers, drops exactly what one process would.
2. `dispatch`: rows of x sorted by expert (stable: token order within an expert) -> all-to-all.
3. `combine`: the expert outputs come back in the order they left (all-to-all), then `moe.combine`
   weights and sums them per token, as in one process.

The all-to-all is an autograd function (`RowExchange`): its backward is the reverse all-to-all of the
gradients. With a group of one rank (or ``group=LOCAL``) nothing is sent and the plan is
`models.moe.plan`'s: the single-process layer every expert-parallel run is tested against.

In a dry run (`distlab.strategies.dry`: the router's choices on the meta device, without values) the
plan is `at_capacity`: every expert receives its capacity C, the sizes of the capacity-bound step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models import moe
from .. import collectives as C


class _Local:
    def __repr__(self) -> str:
        return "LOCAL"


#: ``group=LOCAL``: every expert in this process, no communication, even inside a launched rank.
LOCAL = _Local()


def group_size(group) -> int:
    """Ranks in ``group`` (`runtime.group_size`), where ``LOCAL`` is a group of one."""
    return 1 if group is LOCAL else C.group_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (`runtime.group_rank`), 0 in ``LOCAL``."""
    return 0 if group is LOCAL else C.group_rank(group)


class RowExchange(torch.autograd.Function):
    """Uneven all-to-all of rows (tokens to their experts' ranks, and back). Forward: rows ``send[i]`` to
    rank i, ``recv[i]`` from rank i. Backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return C.all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_to_all(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


@dataclass
class Dispatch(moe.Routing):
    """`models.moe.Routing` over a group: where this rank's (token, choice) pairs go, what it receives.

    kept:   (T, k) bool, whether each of this rank's choices fit in its expert's capacity
    order:  (R_send,) flat indices t*k + c of the kept pairs, sorted by expert: the rows sent
    local_expert: (R_recv,) the local expert of each received row
    first_counts: (E,) first choices per expert over the whole batch; tokens: the batch's token count
    capacity: C, the slots of each expert (from the whole batch's token count)
    send:   rows to each rank; recv: rows from each rank (``len == n``)
    """

    send: list[int]
    recv: list[int]


def plan(expert: torch.Tensor, experts: int, capacity_factor: float, group=None,
         replicated: bool = False, batch_group=None) -> Dispatch:
    """The `Dispatch` of this rank's choices ``expert`` (T, k) over ``group``: one all-gather of counts.

    ``replicated``: every expert is on every rank; the capacity and the dropped tokens are still those
    of the group's whole batch, but each rank computes its own kept rows and sends nothing.
    ``batch_group``: the ranks the batch is split over, when larger than ``group`` (expert x data
    parallelism, ``3d:dp=D,ep=E``; ``group`` must be a run of consecutive ranks of it). The counts are
    all-gathered over it, so the capacity, the dropped tokens and the balance statistics are those of
    the whole batch, as in one process, while tokens still travel inside ``group`` only."""
    n, me = group_size(group), group_rank(group)
    parts = group if batch_group is None else batch_group
    mine_at = group_rank(parts)                                             # my part of the batch
    first = mine_at - me                                                    # the part of group rank 0
    top_k, per_rank = expert.shape[1], experts // (1 if replicated else n)
    mine = moe.counts(expert, experts)                                      # (k, E)
    every = mine[None] if group_size(parts) == 1 else C.all_gather(mine[None].contiguous(), 0, parts)
    # every: (P, k, E), the counts of every part of the batch
    if expert.is_meta:                                                      # a dry run: no values
        return at_capacity(expert, every, experts, capacity_factor, n, me, mine_at, replicated)
    tokens = int(every[:, 0].sum())
    cap = moe.capacity(tokens, experts, top_k, capacity_factor)
    kept_pairs = moe.slots(expert, experts, moe.offsets(every)[mine_at]) < cap      # (T, k)
    order = moe.by_expert(kept_pairs, expert)                                         # sent, by expert
    fits = moe.kept(every, cap).sum(dim=1)                                            # (P, E)
    if replicated:                                                    # our own kept rows, all experts
        ours = fits[mine_at:mine_at + 1]                                              # (1, E)
        send = [int(ours.sum())]
    else:
        send = fits[mine_at].view(n, per_rank).sum(dim=1).tolist()
        ours = fits[first:first + n, me * per_rank:(me + 1) * per_rank]               # (n, E/n)
    local_ids = torch.arange(per_rank, device=expert.device).repeat(ours.shape[0])
    local_expert = local_ids.repeat_interleave(ours.flatten())
    return Dispatch(kept=kept_pairs, order=order, local_expert=local_expert,
                    first_counts=every[:, 0].sum(dim=0), tokens=tokens, capacity=cap,
                    send=send, recv=ours.sum(dim=1).tolist())


def at_capacity(expert: torch.Tensor, every: torch.Tensor, experts: int, capacity_factor: float, n: int,
                me: int, mine_at: int, replicated: bool) -> Dispatch:
    """The `Dispatch` a dry run routes by (``expert`` on the meta device: choices without values): every
    expert receives its whole capacity C, the most a step can send it, so the all-to-all sizes and the
    activations are those of the capacity-bound step (a memory planner's upper bound, as GShard's
    fixed (E, C, h) dispatch buffer)::

        C = ceil(capacity_factor * k * T / E),  T the tokens of all P parts (every part holds T / P)
        part p fills  C // P + (p < C % P)  slots of every expert      (the P shares sum to C)
        sends to group rank j: its share of each of j's E / n experts;  receives: n shares of its own

    With ``capacity_factor > 1`` that is more rows than the k T / P (token, choice) pairs a part has: the
    bound counts every slot as filled, as a padded dispatch buffer holds them. The rows are meta tensors
    of those sizes; only ``local_expert`` holds values (on the CPU, for `models.moe.Experts`' split)."""
    parts, (tokens_here, top_k) = every.shape[0], expert.shape
    tokens = tokens_here * parts
    cap = moe.capacity(tokens, experts, top_k, capacity_factor)

    def share(p: int) -> int:                                    # slots of one expert part p fills
        return cap // parts + (p < cap % parts)

    per_rank = experts // (1 if replicated else n)
    if replicated:
        send, sources = [experts * share(mine_at)], [mine_at]
    else:
        send, sources = [per_rank * share(mine_at)] * n, [mine_at - me + j for j in range(n)]
    recv = [per_rank * share(p) for p in sources]
    local_expert = torch.cat([torch.arange(per_rank).repeat_interleave(share(p)) for p in sources])
    meta = dict(device=expert.device, dtype=torch.long)
    return Dispatch(kept=torch.ones(expert.shape, dtype=torch.bool, device=expert.device),
                    order=torch.empty(sum(send), **meta), local_expert=local_expert,
                    first_counts=every[:, 0].sum(dim=0), tokens=tokens, capacity=cap,
                    send=send, recv=recv)


def dispatch(x: torch.Tensor, d: Dispatch, group=None) -> torch.Tensor:
    """x (T, h) -> the rows this rank's experts compute (R_recv, h), received in rank order."""
    top_k = d.kept.shape[1]
    rows = x[d.order // top_k]                                       # (R_send, h) sorted by expert
    return rows if len(d.send) == 1 else RowExchange.apply(rows, d.send, d.recv, group)


def combine(y: torch.Tensor, d: Dispatch, weight: torch.Tensor, group=None) -> torch.Tensor:
    """Expert outputs y (R_recv, h) -> (T, h): sent back (the reverse all-to-all), then weighted by the
    gate and summed per token (`models.moe.combine`)."""
    back = y if len(d.send) == 1 else RowExchange.apply(y, d.recv, d.send, group)   # (R_send, h)
    return moe.combine(back, d, weight)
