"""Inside a rank: who am I, how many are we, which device do I compute on, where do I record, and what
the groups I am in are called.

`distlab.launch` (or torchrun) initialises the process group and calls `_enter`; everything
else asks these functions. Outside any launch they describe a world of one process on the CPU
(or the first GPU), which is what the single-process reference runs use.

Asking does not import torch (``import distlab`` stays light, and the ``distlab`` command answers
``--help`` at once): a process that has not loaded torch has no process group.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .trace import Tracer

if TYPE_CHECKING:
    import torch


@dataclass
class _RankState:
    """What one rank's run holds (a fresh one per run: `_enter`, `_leave`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    tracer: Tracer = field(default_factory=lambda: Tracer(0))
    group_names: dict = field(default_factory=dict)       # group -> what it is called (`name_group`)
    comm_scopes: list = field(default_factory=list)       # the tags of every open `collectives.scope`
    comm_buffers: dict = field(default_factory=dict)      # dl.comm's receive buffers, kept between calls
    saved_tensors: object = None                          # what the memory ledger counts recomputations into
    dry_autocast: object = None                           # a dry run's autocast in force (`strategies.dry`):
                                                          # what a recomputation must run under again
    placed: torch.device | None = None                    # where `place_on` put the rank, if anywhere
    feed: object = None                                   # dl.train's data loader (`strategies.feed`), if any


_state = _RankState()


def _enter(rank: int, world_size: int, local_rank: int, backend: str) -> Tracer:
    """Called once per rank after ``init_process_group``; returns the rank's fresh tracer."""
    global _state
    _state = _RankState(rank, world_size, local_rank, backend, Tracer(rank))
    return _state.tracer


def _leave() -> None:
    global _state
    _state = _RankState()


def current_run() -> _RankState:
    """What this rank's run in progress holds (its tracer, group names, comm scopes and buffers): one per
    run, made fresh at `_enter` and dropped at `_leave`, so nothing of one run leaks into the next."""
    return _state


def _started():
    """torch.distributed once a process group is up, else None (torch is not imported to find out)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    """This process's global rank (0 outside a launch)."""
    dist = _started()
    return dist.get_rank() if dist else _state.rank


def world_size() -> int:
    """Number of ranks in the default group (1 outside a launch)."""
    dist = _started()
    return dist.get_world_size() if dist else _state.world_size


def local_rank() -> int:
    """Rank among the processes on this machine (selects the GPU under NCCL)."""
    return _state.local_rank


def backend() -> str | None:
    """"gloo", "nccl", or None outside a process group."""
    dist = _started()
    return dist.get_backend() if dist else _state.backend


def device() -> torch.device:
    """Where this rank computes: its own GPU under NCCL, ``meta`` under the fake backend of a dry run
    (shapes without storage: nothing is computed), else the CPU (or where `place_on` put it).
    Strategies never assume CUDA."""
    import torch
    if backend() == "fake":
        return torch.device("meta")
    if _state.placed is not None:
        return _state.placed
    if backend() == "nccl":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def place_on(dev) -> None:
    """Compute on ``dev`` (e.g. ``"cuda:0"``) for the rest of this rank, whatever the backend: gloo ranks
    sharing one GPU (NCCL refuses two ranks on one GPU) use CUDA tensors through gloo where gloo takes
    them. Called inside a rank, after the launch made it (each launch starts from the backend's rule)."""
    import torch
    _state.placed = torch.device(dev)


def tracer() -> Tracer:
    """This rank's event recorder (see `distlab.trace`)."""
    return _state.tracer


# -- groups: the one place that asks torch.distributed who is in a group -------------------------
def group_size(group=None) -> int:
    """Ranks in ``group`` (default: the world; 1 outside a process group)."""
    dist = _started()
    return dist.get_world_size(group) if dist else 1


def group_rank(group=None) -> int:
    """This rank's index inside ``group`` (0 outside a process group); a clear error for a non-member."""
    dist = _started()
    if not dist:
        return 0
    r = dist.get_rank(group)
    if r < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of this group: call it only on the ranks "
                         "you passed to dist.new_group(...)")
    return r


def group_members(group=None) -> tuple[int, ...]:
    """The global rank of every member of ``group``, in group-rank order (send/recv address global ranks)."""
    n, dist = group_size(group), _started()
    if not dist or group is None or group is dist.group.WORLD:
        return tuple(range(n))
    return tuple(dist.get_global_rank(group, r) for r in range(n))


def barrier(group=None) -> None:
    """A barrier that is a no-op in a world of one process."""
    dist = _started()
    if dist:
        dist.barrier(group=group)


# -- group names: what a mesh calls its groups ("dp", "tp", ...), read by whoever records a collective --
def name_group(group, name: str) -> None:
    """Call ``group`` by ``name`` (e.g. a mesh axis) for the rest of this rank's run: the traced collectives
    on it (`parallel.collectives`) and the flight recorder's records (`launch.flight`) say so."""
    _state.group_names[group] = name


def group_name(group) -> str | None:
    """The name given to ``group`` by `name_group` in this run, if any."""
    try:
        return _state.group_names.get(group)
    except TypeError:                    # an unhashable stand-in for a group: never named
        return None
