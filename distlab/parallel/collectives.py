"""The one traced wrapper over torch.distributed (or distlab's own ring, `dl.comm`).

Every collective a parallelism issues goes through this file, and this file alone records it in
``dl.tracer()``: algorithms call ``all_reduce``/``all_gather``/``reduce_scatter`` and carry no
labels, byte counters or timers themselves.

Three surfaces:

* ``Collectives(comm, group)``: the flat-buffer collectives data parallelism needs (DDP, ZeRO),
  asynchronous, through torch.distributed (``comm="torch"``) or distlab's ring (``comm="ring"``: the
  pipelined ring of `dl.comm`, built from send/recv, every step traced by dl.comm):

      comm = Collectives("torch"); h = comm.all_reduce(flat, async_op=True); ...; h.wait()

* ``all_reduce_sum(t, group)`` (and ``all_reduce_max``), ``all_gather(shard, dim, group)``,
  ``reduce_scatter(t, dim, group)``, ``split``, ``all_to_all(t, send, recv, group)``: the shaped
  collectives (tensor and expert parallelism), synchronous, torch.distributed; each returns its result.

* ``Transfer(send, tensor, peer, group, tag, **address)``: a pipeline's isend or irecv, ``.wait()``.

Bytes: torch does not say what its backend put on the wire, so a ``comm="torch"`` call is recorded as
one event with the bytes the *ring algorithm* moves per rank (`dl.comm.ring_bytes`, marked
``bytes="ring-model"``); ``comm="ring"`` records the real send/recv sizes (in `dl.comm`); the tests
check that the two agree byte for byte. Asynchrony: torch collectives run with ``async_op=True``, ring
ones on one background thread in submission order (so every rank's rings match up); an event spans
from launch until `Handle.wait` returned.

Tensor-parallel collectives (called by `tensor/regions.py`) run the ``torch.distributed`` collective
and record the bytes a ring moves for it, as `dl.comm.ring_bytes` counts them: for a message of S
bytes over t ranks, all_reduce 2 (t-1)/t S, all_gather (S: the output) and reduce_scatter (S: the
input) (t-1)/t S each. The operators pass no labels: an event gets the open scopes' tags plus what
the call reveals (`derived_tags`), and `labels.label_modules(model)` names the modules from outside.
With a group of one rank (or no process group) every collective is the identity and records nothing.
"""
from __future__ import annotations

import contextlib
import sys
from functools import partial
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..comm import ring_bytes
from ..runtime import current_run, group_name, group_rank, group_size, tracer
from .mesh import as_group
from ..runtime import name_group  # noqa: F401  (re-exported; the flight recorder reads the names too)

COMMS = ("torch", "ring")


# -- what every recorded event is tagged with --------------------------------------------------
# Algorithms never label their own communication. The caller that knows the context says it once:
#   with collectives.scope(phase="backward", microbatch=3): ...      (a strategy, a hook, a lesson)
#   collectives.name_group(mesh.dp_group, "dp")                       (the mesh, once per group;
#                                                                       kept in `runtime`)
# and every event recorded meanwhile carries those tags, plus ``group=<name>`` for named groups. Both live
# with the rank's run (`runtime`), not in this module.
@contextlib.contextmanager
def scope(**tags):
    """Tag every comm event recorded inside the block with ``tags`` (inner scopes win on a clash)."""
    opened = current_run().comm_scopes     # this run's stack (a block that outlives a run closes its own)
    opened.append(tags)
    try:
        yield
    finally:
        opened.pop()


def current_tags() -> dict:
    """The tags of every open `scope`, merged outermost first."""
    merged: dict = {}
    for tags in current_run().comm_scopes:
        merged.update(tags)
    return merged


def record(op: str, *, start: float, end: float, sent: int, received: int, group=None,
           tags: dict | None = None, **args) -> None:
    """The one place an event is written into ``dl.tracer()``: the open scopes' tags (or ``tags``,
    captured when an asynchronous collective was launched), then ``args`` (what the collective itself
    knows: size, world, peer...), then the group's name."""
    merged = {**(current_tags() if tags is None else tags), **args}
    name = group_name(group)
    if name is not None:
        merged.setdefault("group", name)
    tracer().comm(op, start=start, end=end, sent=sent, received=received, **merged)


def now() -> float:
    """The clock `record` takes ``start`` and ``end`` on: seconds on this rank's trace axis."""
    return tracer().now()


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
        return self._torch(lambda: dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM,
                                                              group=self.group, async_op=True),
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
        return self._torch(lambda: dist.all_gather_single(out, shard, group=self.group, async_op=True),
                           "all_gather", out.numel(), out.element_size(), async_op)

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


# -- point-to-point (pipeline stages) ------------------------------------------------------------
class Transfer:
    """An ``isend`` (``send=True``) or ``irecv`` of ``tensor`` to or from global rank ``peer``, recorded here:
    a send as an instant when posted (a rank never waits for its sends mid-step), a receive from its post
    to the data's arrival (a long one is a rank waiting on its neighbour). ``address``: the message's
    own, what its ``tag`` is made of (a pipeline's what, stage, microbatch). ``grouped``: posted later,
    by `start_together` (NCCL matches point-to-point in issue order)."""

    def __init__(self, send: bool, tensor: torch.Tensor, peer: int, group=None, tag: int = 0,
                 grouped: bool = False, **address):
        self.send, self.tensor, self.peer, self.group, self.tag = send, tensor, peer, group, tag
        self.address, self.work, self.start = address, None, now()
        if not grouped:
            self.work = (dist.isend if send else dist.irecv)(tensor, peer, group=group, tag=tag)
        if send:
            self._record(end=self.start)

    def wait(self) -> torch.Tensor:
        """Block until the transfer is complete; returns the tensor (received into, for a receive)."""
        self.work.wait()
        if not self.send:
            self._record(end=now())
        return self.tensor

    def _record(self, end: float) -> None:
        nbytes = self.tensor.numel() * self.tensor.element_size()
        record("send" if self.send else "recv", start=self.start, end=end, sent=nbytes if self.send else 0,
               received=0 if self.send else nbytes, group=self.group, peer=self.peer, **self.address)


def start_together(transfers: list[Transfer]) -> None:
    """Issue grouped transfers as one ``batch_isend_irecv`` (one NCCL group)."""
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, t.peer,
                                               t.group, t.tag) for t in transfers])
    for i, t in enumerate(transfers):
        t.work = works[i] if len(works) == len(transfers) else works[-1]


# -- tensor-parallel collectives ----------------------------------------------------------------
def _record(op: str, start: float, t: torch.Tensor, numel: int, group, tags: dict) -> None:
    n = group_size(group)
    sent, received = ring_bytes(numel, t.element_size(), n, group_rank(group), op)
    record(op, start=start, end=tracer().now(), sent=sent, received=received, group=group,
           tags={**derived_tags(), **tags}, size=numel * t.element_size(), world=n)


def all_reduce_sum(t: torch.Tensor, group=None, **tags) -> torch.Tensor:
    """Sum ``t`` over the group, in place, and return it (``tags``: callers outside algorithms). Not to
    be confused with `Collectives.all_reduce`: a data-parallel flat buffer, averaged, a `Handle` back."""
    return _all_reduce(t, group, dist.ReduceOp.SUM, tags)


def all_reduce_max(t: torch.Tensor, group=None, **tags) -> torch.Tensor:
    """The elementwise maximum of ``t`` over the group, in place; returns ``t``."""
    return _all_reduce(t, group, dist.ReduceOp.MAX, tags)


def _all_reduce(t: torch.Tensor, group, op, tags: dict) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    start = tracer().now()
    dist.all_reduce(t, op=op, group=group)
    _record("all_reduce", start, t, t.numel(), group, tags)
    return t


def all_gather(shard: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's equal-sized ``shard`` along ``dim``, in rank order."""
    n = group_size(group)
    if n == 1:
        return shard
    dim = dim % shard.dim()
    shard = shard.contiguous()
    start = tracer().now()
    out = torch.empty((n * shard.shape[0],) + tuple(shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, shard, group=group)  # looked up
    _record("all_gather", start, shard, out.numel(), group, {})
    if dim == 0:
        return out
    # (n, ..., k, ...) -> (..., n*k, ...): move the rank axis next to ``dim`` and merge them
    out = out.view((n,) + tuple(shard.shape))
    return out.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Sum ``t`` over the group and keep this rank's ``1/n`` slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return t
    dim = dim % t.dim()
    if t.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter size {t.shape[dim]} over {n} ranks: it must divide evenly")
    # lay the n slices out one after another so slice r is a contiguous block
    blocks = t.unflatten(dim, (n, t.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = torch.empty(blocks.shape[1:], dtype=t.dtype, device=t.device)
    blocks = blocks.flatten(0, 1) if blocks.dim() > 2 else blocks.flatten()
    start = tracer().now()
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, blocks, group=group)  # per call
    _record("reduce_scatter", start, t, t.numel(), group, {})
    return out


def all_to_all(t: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Rows of ``t``: the first ``send[0]`` go to rank 0, the next ``send[1]`` to rank 1, ...; returns the
    rows every rank sent here in rank order (``recv[i]`` from rank i). Recorded with the exact bytes
    that leave and arrive (a rank's block to itself stays in memory and is not counted)."""
    n, me = group_size(group), group_rank(group)
    if n == 1:
        return t
    row = torch.Size(t.shape[1:]).numel() * t.element_size()          # bytes per row
    out = t.new_empty((sum(recv),) + tuple(t.shape[1:]))
    start = tracer().now()
    dist.all_to_all_single(out, t.contiguous(), recv, send, group=group)
    record("all_to_all", start=start, end=tracer().now(), sent=(sum(send) - send[me]) * row,
           received=(sum(recv) - recv[me]) * row, group=group, tags=derived_tags(), bytes="exact", world=n)
    return out


def split(t: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's ``1/n`` slice of ``t`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"cannot split size {t.shape[dim]} over {n} ranks: it must divide evenly")
    return t.chunk(n, dim)[group_rank(group)].contiguous()


# -- tags the wrapper derives (module names are attached from outside: `labels.label_modules`) ------
def derived_tags() -> dict:
    """The open scopes' tags, plus what a collective sees for itself: ``operator``, the function that
    called it (``CopyToRegion.backward``); inside autograd's backward ``phase="backward"`` and ``where``,
    the module whose forward made the node being run (`labels.label_modules` wrote it; a scope's
    ``where`` wins)."""
    tags = {"operator": _caller(), **current_tags()}
    if torch._C._current_graph_task_id() != -1:
        tags["phase"] = "backward"
        node = torch._C._current_autograd_node()
        if node is not None and "where" in node.metadata:
            tags.setdefault("where", node.metadata["where"])
    return tags


def _caller() -> str:
    """Qualified name of the innermost function on the stack outside this file."""
    frame = sys._getframe(1)
    while frame.f_globals.get("__name__") == __name__:          # the caller is never this file
        frame = frame.f_back
    return frame.f_code.co_qualname.replace("<locals>.", "")
