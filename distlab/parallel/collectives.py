"""The one traced wrapper over torch.distributed (or distlab's own ring, `dl.comm`).

Every collective a parallelism issues goes through this file, and this file alone records it in
``dl.tracer()``: algorithms call ``all_reduce``/``all_gather``/``reduce_scatter`` and carry no
labels, byte counters or timers themselves.

Three surfaces:

* ``Collectives(comm, group)``, in `flat_collectives` beside this file: the flat-buffer collectives data
  parallelism needs (DDP, ZeRO, FSDP), asynchronous, through torch.distributed (``comm="torch"``) or
  distlab's ring (``comm="ring"``: the pipelined ring of `dl.comm`, built from send/recv, every step
  traced by dl.comm); each event is written by this file's `record`:

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

import torch
import torch.distributed as dist

from ..comm import ring_bytes
from ..comm.host import post
from ..runtime import current_run, group_name, group_rank, group_size, tracer
from ..runtime import name_group  # noqa: F401  (re-exported; the flight recorder reads the names too)


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
            self.work = post(send, tensor, peer, group, tag)       # via host memory: GPU tensors on gloo
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
