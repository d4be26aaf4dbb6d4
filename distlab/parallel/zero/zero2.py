"""ZeRO stage 2: gradients reduce-scattered bucket by bucket during backward (Rajbhandari et al. 2020,
Sec. 5.2).

Per rank, for Psi parameters over N ranks with K bytes of optimizer state per parameter
(fp32 Adam: 4 + 4 + K=8; bf16 mixed with fp32 master weights: 2 + 2 + K=12):

    stage  params    grads     optimizer   sent per step        what happens
    0/DDP  4 Psi     4 Psi     K Psi       2 (N-1)/N Psi        all-reduce grads
    1      4 Psi     4 Psi     K Psi / N   2 (N-1)/N Psi        reduce-scatter grads at step, gather params
    2      4 Psi     4 Psi / N K Psi / N   2 (N-1)/N Psi        reduce-scatter each bucket *during* backward
    3      4 Psi / N 4 Psi / N K Psi / N   3 (N-1)/N Psi        params gathered per unit, forward and backward

Transient ``buffers`` on top (the ledger's fifth category): a reduce-scatter needs its bucket's gradients
in one flat buffer until it completes. At most ``max_inflight`` of them live at once (`reducer`): each is
freed as soon as its shard has been taken, so ZeRO-1/2 hold about max_inflight x bucket_mb of them (ZeRO-1
in step(), ZeRO-2 during backward), never the whole 4 Psi gradient unless one bucket is the whole model;
ZeRO-3 holds about one unit: a gathered unit waits for room among them too (see `zero3`).

    model = dl.ZeRO(module, stage=2, optim=torch.optim.AdamW, lr=1e-3)
    loss = loss_fn(model(x), y); loss.backward()
    model.optimizer.step(); model.optimizer.zero_grad()

Gradient accumulation over k micro-steps, ``with model.no_sync():`` on the first k-1 (as DDP and
FSDP): those backward passes keep their gradients local, summed by autograd into the parameters'
own ``.grad`` (the local accumulation buffer), and the first backward outside reduce-scatters the sum.
Bytes sent per rank per optimizer step, and the gradient memory held while accumulating:

    stage  without no_sync        with no_sync           gradients held between micro-steps
    1      2 (N-1)/N Psi          2 (N-1)/N Psi          4 Psi either way (stage 1 communicates in step())
    2      (k+1) (N-1)/N Psi      2 (N-1)/N Psi          4 Psi with no_sync, 4 Psi / N without
    3      3k (N-1)/N Psi         (2k+1) (N-1)/N Psi     4 Psi with no_sync, 4 Psi / N without

no_sync trades ZeRO-2/3's gradient saving for bytes (FSDP allows it, DeepSpeed refuses it for stages 2
and 3): why distlab allows it, in `distlab/parallel/README.md` ("no_sync under ZeRO-2/3").
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..data.backward_hooks import BackwardWatcher
from .shards import ShardsFromBackward, flat_layout
from .zero1 import ZeRO1


class ZeRO2(ZeRO1):
    """``ZeRO2(module, torch.optim.AdamW, lr=1e-3)``: `ZeRO1` whose gradients leave during backward.

    As each bucket's gradients complete, they are packed into a flat buffer, ``p.grad`` is dropped,
    and the bucket is reduce-scattered into this rank's gradient shard (`GradReducer`): a rank never
    holds more than its 1/N of the gradients plus ``max_inflight`` flat buckets. ``overlap=True``
    launches each reduce-scatter asynchronously, under the rest of backward; ``overlap=False`` waits
    for each before backward goes on.
    """

    stage = 2

    def __init__(self, module: nn.Module, optim: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 overlap: bool = True, **kwargs):
        super().__init__(module, optim, **kwargs)
        self.overlap = overlap
        self.watcher = BackwardWatcher([b.params for b in self.optimizer.buckets],
                                       on_ready=self._bucket_ready, on_end=self._backward_done)

    def _optimizer(self, params, optim, bucket_mb: float, max_inflight: int, optim_kwargs: dict):
        """ZeRO-1's bucket layout; the gradient shards come during backward (`shards.ShardsFromBackward`)."""
        buckets, shards = flat_layout(params, bucket_mb, self.comm)
        return ShardsFromBackward(buckets, shards, optim, self.comm, max_inflight, **optim_kwargs)

    def _bucket_ready(self, b: int) -> None:
        if not self._sync:
            return                                          # no_sync: autograd keeps summing into p.grad
        # pack the bucket's (accumulated) gradients into a flat buffer, drop p.grad, launch the
        # reduce-scatter; older buckets beyond max_inflight are waited for and their buffers freed first
        self.optimizer.reducer.submit(b, self.optimizer.buckets[b], async_op=self.overlap)

    def _backward_done(self) -> None:
        self.optimizer.reducer.drain()
