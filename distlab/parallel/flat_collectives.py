"""``Collectives(comm, group)``: the flat-buffer collectives data parallelism needs (DDP, ZeRO, FSDP),
the asynchronous half of the one traced wrapper (`distlab.parallel.collectives`, whose `record` writes
every event, tagged by its open scopes)::

    comm = Collectives("torch")                  # or "ring": dl.comm's pipelined ring, from send/recv
    h = comm.all_reduce(flat, async_op=True)     # a Handle: the bucket is in flight
    ...                                          # backward goes on
    h.wait()                                     # averaged in place; the event spans launch -> wait

``comm="torch"``: torch.distributed with ``async_op=True``, recorded as one event with the bytes the
ring algorithm moves per rank (`dl.comm.ring_bytes`, ``bytes="ring-model"``). ``comm="ring"``: every
call on one background thread, in submission order (so every rank's rings match up), each step traced
by `dl.comm` itself.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.distributed as dist

from ..comm import ring_bytes
from ..runtime import group_rank, group_size, tracer
from .collectives import current_tags, record
from .mesh import as_group

COMMS = ("torch", "ring")


class Handle:
    """A launched collective: ``wait()`` blocks until it finished (idempotent)."""

    def __init__(self, waiter=None, on_done=None):
        self._waiter, self._on_done, self.done = waiter, on_done, False

    def wait(self) -> None:
        if self.done:
            return
        with torch.no_grad():             # backends may copy into views of the output as they finish
            if self._waiter is not None:
                self._waiter()
            self.done = True
            if self._on_done is not None:
                self._on_done()


class Collectives:
    """all_reduce, reduce_scatter, all_gather and broadcast over ``group`` (default: the world; a 1-D mesh:
    its group, `mesh.as_group`: so DDP, ZeRO and fully_shard take one)."""

    def __init__(self, comm: str = "torch", group=None):
        if comm not in COMMS:
            raise ValueError(f"comm={comm!r}: choose 'torch' (torch.distributed collectives) or "
                             f"'ring' (distlab's ring from send/recv)")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("data parallelism needs a process group: "
                               "run inside dl.launch(fn, world_size=N)")
        self.comm, self.group = comm, as_group(group)            # a 1-D DeviceMesh: its process group
        self.size, self.rank = group_size(self.group), group_rank(self.group)
        self._pool: ThreadPoolExecutor | None = None
        self._launch_hooks: list = []

    def register_launch_hook(self, hook) -> None:
        """Call ``hook()`` right after every collective this object launches (before any wait): how
        an observer outside the algorithm, such as `distlab.memory`, samples the buffers in flight."""
        self._launch_hooks.append(hook)

    # -- the three collectives ---------------------------------------------------------------
    @torch.no_grad()
    def all_reduce(self, t: torch.Tensor, op: str = "avg", async_op: bool = False) -> Handle:
        """Reduce ``t`` in place over the group (op "sum" or "avg"; an fp16 average divides first)."""
        op = self._divide_first(t, op)
        if self.comm == "ring":
            from .. import comm as ring
            return self._ring(partial(ring.pipelined_all_reduce, t, op=op, group=self.group), async_op)
        post = (lambda: t.div_(self.size)) if op == "avg" else None
        return self._torch(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
                           "all_reduce", t.numel(), t.element_size(), async_op, post)

    @torch.no_grad()
    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, op: str = "avg",
                       async_op: bool = False) -> Handle:
        """``out`` <- chunk ``rank`` of the reduced ``flat`` (``flat.numel() == size * out.numel()``)."""
        if flat.numel() != self.size * out.numel():
            raise ValueError(f"reduce_scatter needs a flat buffer padded to {self.size} x {out.numel()} "
                             f"elements, got {flat.numel()}")
        op = self._divide_first(flat, op)
        if self.comm == "ring":
            from .. import comm as ring
            scatter = partial(ring.pipelined_reduce_scatter, flat, op=op, group=self.group, out=out)
            return self._ring(scatter, async_op)
        post = (lambda: out.div_(self.size)) if op == "avg" else None
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)   # torch < 2.13
        return self._torch(lambda: reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=self.group,
                                                  async_op=True),
                           "reduce_scatter", flat.numel(), flat.element_size(), async_op, post)

    def _divide_first(self, t: torch.Tensor, op: str) -> str:
        """An fp16 average divides by N before summing, as torch's DDP ``allreduce_hook`` does for every
        dtype: the sum of N gradients can overflow fp16's 65504 where their mean would not (log2 N bits
        of headroom). fp32 and bf16 sum first and divide once (one rounding less)."""
        if op != "avg" or t.dtype != torch.float16 or self.size == 1:
            return op
        t.div_(self.size)
        return "sum"

    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Handle:
        """``out`` <- every rank's ``shard`` concatenated in rank order (equal shard sizes)."""
        if out.numel() != self.size * shard.numel():
            raise ValueError(f"all_gather needs out of {self.size} x {shard.numel()} elements, "
                             f"got {out.numel()}")
        if self.comm == "ring":
            from .. import comm as ring
            sizes = [shard.numel()] * self.size
            gather = partial(ring.pipelined_all_gather, shard, group=self.group, sizes=sizes, out=out)
            return self._ring(gather, async_op)
        if shard.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            shard = shard.clone()                     # not every backend gathers in place
        all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)   # torch < 2.13
        return self._torch(lambda: all_gather(out, shard, group=self.group, async_op=True),
                           "all_gather", out.numel(), out.element_size(), async_op)

    @torch.no_grad()
    def all_to_all(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """Row block k of ``t`` (dim 0 split in ``size`` equal blocks) goes to rank k; ``out``'s block k
        is what rank k sent here. Synchronous, torch.distributed; recorded with the exact bytes that leave
        and arrive (the block to itself stays in memory). Quantized reduce-scatters use it (qgZ)."""
        start, tags = tracer().now(), current_tags()
        dist.all_to_all_single(out, t, group=self.group)
        nbytes = t.numel() * t.element_size() // self.size * (self.size - 1)
        record("all_to_all", start=start, end=tracer().now(), sent=nbytes, received=nbytes, group=self.group,
               tags=tags, impl="torch", bytes="exact", size=t.numel() * t.element_size(), world=self.size)
        self._launched()

    @torch.no_grad()
    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Copy ``t`` from group rank ``src`` to every rank (used once, at construction)."""
        if self.comm == "ring":
            from .. import comm as ring
            self._ring(lambda: ring.broadcast(t, src=src, group=self.group), async_op=False)
            return
        start = tracer().now()
        dist.broadcast(t, group_src=src, group=self.group)
        nbytes = t.numel() * t.element_size()
        record("broadcast", start=start, end=tracer().now(), sent=nbytes if self.rank == src else 0,
               received=0 if self.rank == src else nbytes, group=self.group, impl="torch", bytes="logical")

    def close(self) -> None:
        """Stop the ring's worker thread (``comm="ring"``)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- plumbing ----------------------------------------------------------------------------
    def _ring(self, call, async_op: bool) -> Handle:
        # Every ring call runs on one worker thread, in submission order, even the blocking ones:
        # two threads exchanging with the same neighbours at once could receive each other's messages.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distlab-comm")
        handle = Handle(waiter=self._pool.submit(_without_grad, call).result)
        self._launched()
        if not async_op:
            handle.wait()
        return handle

    def _torch(self, launch, op: str, numel: int, element_size: int, async_op: bool, post=None) -> Handle:
        tr = tracer()
        start, work = tr.now(), launch()             # from before the launch call: gloo's may block in it
        sent, received = ring_bytes(numel, element_size, self.size, self.rank, op)
        tags = current_tags()                         # the scope at launch, not at wait
        finished: list[float] = []                    # when the backend completed, if it tells us
        try:
            work.get_future().add_done_callback(lambda _: finished.append(tr.now()))
        except (AttributeError, RuntimeError):
            pass

        def on_done():
            if post is not None:
                post()
            end = finished[0] if finished else tr.now()
            record(op, start=start, end=end, sent=sent, received=received, group=self.group, tags=tags,
                   impl="torch", bytes="ring-model", size=numel * element_size, world=self.size)
        handle = Handle(waiter=work.wait, on_done=on_done)
        self._launched()
        if not async_op:
            handle.wait()
        return handle

    def _launched(self) -> None:
        for hook in self._launch_hooks:                                 # e.g. a memory probe
            hook()


def _without_grad(call):
    with torch.no_grad():                 # grad mode is per thread: the worker's own is on by default
        return call()
