"""The device mesh: every rank at one coordinate of a grid of named axes, one process group per axis.

The whole mesh is one expression (Megatron-LM's rank order: tensor-parallel fastest, so a TP
group is a run of consecutive ranks -- one node's fast links -- and data-parallel slowest)::

    grid = torch.arange(world).view(dp, pp, tp)        # grid[d, p, t] = global rank

    world = 8, dp = pp = tp = 2:            tp=0  tp=1
                              dp=0  pp=0 [   0     1  ]     TP groups: a row          {0,1} {2,3} {4,5} {6,7}
                                    pp=1 [   2     3  ]     PP groups: down a block   {0,2} {1,3} {4,6} {5,7}
                              dp=1  pp=0 [   4     5  ]     DP groups: across blocks  {0,4} {1,5} {2,6} {3,7}
                                    pp=1 [   6     7  ]

A rank finds its coordinates by lookup (``(grid == rank).nonzero()``), and the members of its group
along an axis by fixing the other coordinates: ``grid[d, p, :]`` is its TP group,
``grid[d, :, t]`` its pipeline, ``grid[:, p, t]`` its data-parallel replicas. Every group along an
axis partitions the world: each rank is in exactly one TP, one PP and one DP group.

Context and expert parallelism are two more axes, ``Mesh(dp=2, cp=2, tp=2)``, ``Mesh(dp=2, ep=2)``,
placed in `ORDER` (cp and ep between pp and tp: they talk every layer, so they get the next-fastest
links); a group over several axes, such as the ``dp x cp`` ranks that hold the same weights, is
``mesh.group("dp", "cp")``.

What travels on each kind of link in 3D training (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", Sec. 3):

    TP   all-reduces of activations, twice per layer forward and backward: the most, most often
    PP   one activation forward and one gradient backward per microbatch and stage boundary
    DP   one all-reduce of this rank's gradient shard per step (Psi / (tp pp) parameters)

ONE grid builder: `grid_rows` reads the groups off ``torch.arange(world).view(...)`` for any named
axes, `grid_groups` makes them process groups, and `Mesh` names them. ``Mesh(...)`` inside a launched
rank creates every group on every rank in the same order (``torch.distributed.new_group`` is
collective over the world) and names each by its axis, so every traced collective on it says which
link it used (``event.args["group"]``); outside one (or with ``groups=False``) it is the pure layout,
for drawing and checking.

A mesh wherever a group is taken: `as_group` turns a 1-D torch ``DeviceMesh`` (``mesh["tp"]`` of
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``) or a dl.Mesh axis into its process
group; every ``group=`` of distlab passes through it once, where the parallelism receives it, so
torchtitan-style code (``parallelize(model, group=mesh["tp"])``) runs unchanged on distlab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh

from ..runtime import group_name, name_group

ORDER = ("dp", "pp", "cp", "ep", "tp")   # every axis a mesh may have, slowest to fastest
AXES = ("dp", "pp", "tp")                # the 3D mesh's: always there (cp and ep when asked for)
SHOWN = ("dp", "tp", "pp", "cp", "ep")   # the order they are written in (Mesh(dp, tp, pp))


@dataclass(frozen=True)
class Coord:
    """Where a rank sits in the mesh (cp and ep: None on a mesh without that axis)."""

    dp: int
    pp: int
    tp: int
    cp: int | None = None
    ep: int | None = None

    def __str__(self) -> str:
        shown = [f"{a}={getattr(self, a)}" for a in ORDER if getattr(self, a) is not None]
        return f"({', '.join(shown)})"


class Mesh:
    """A grid of ranks, ``dp x pp [x cp] [x ep] x tp``, and one family of process groups per axis.

    ``mesh.coords(r)`` -> `Coord`; ``mesh.rank_at(dp=, pp=, tp=)``; ``mesh.ranks("tp", r)``: the
    ranks in r's TP group (in group-rank order); ``mesh.all_groups("pp")``: every PP group;
    ``mesh.group("dp")`` / ``mesh.dp_group``: this rank's process group; ``mesh.group("dp", "cp")``:
    over several axes (made on first use: every rank must ask for it, in the same order);
    ``mesh.dp_rank`` etc.: this rank's coordinates; ``mesh.dp`` etc.: the degrees (1 for an axis the
    mesh does not have).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, *, cp: int | None = None,
                 ep: int | None = None, world_size: int | None = None, groups: bool = True):
        given = {"dp": dp, "pp": pp, "cp": cp, "ep": ep, "tp": tp}
        for axis, n in given.items():
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ValueError(f"{axis}={n!r}: every mesh degree must be a positive integer")
        self.sizes = {a: given[a] for a in ORDER if given[a] is not None}
        self.dp, self.pp, self.tp, self.cp, self.ep = dp, pp, tp, cp or 1, ep or 1
        distributed = dist.is_available() and dist.is_initialized()
        product = math.prod(self.sizes.values())
        if world_size is None:
            world_size = dist.get_world_size() if distributed else product
        if product != world_size:
            shown = " x ".join(f"{a}={self.sizes[a]}" for a in SHOWN if a in self.sizes)
            raise ValueError(f"mesh {shown} = {product} ranks, but the world has {world_size}: choose "
                             f"degrees whose product is {world_size} (e.g. {_suggest(world_size)}) or "
                             f"launch with world_size={product}")
        self.world_size = world_size
        self.grid = torch.arange(world_size).view(*self.sizes.values())
        self.rank = dist.get_rank() if distributed else None
        self._groups: dict[tuple, object] = {}
        self._distributed = distributed and groups
        if self._distributed:
            made = grid_groups(self.sizes, {axis: (axis,) for axis in self.sizes})
            self._groups = {(axis,): g for axis, g in made.items()}

    # -- the layout (pure) -------------------------------------------------------------------
    def coords(self, rank: int | None = None) -> Coord:
        """The coordinates of ``rank`` (default: this rank), found by lookup in the grid."""
        rank = self._me(rank)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        at = (self.grid == rank).nonzero()[0].tolist()
        return Coord(**dict(zip(self.sizes, at)))

    def rank_at(self, **coords: int) -> int:
        """The global rank at a coordinate (axes not named: 0)."""
        return int(self.grid[tuple(coords.get(a, 0) for a in self.sizes)])

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, each a list of global ranks in group-rank order (`grid_rows`)."""
        self._axis(axis)
        return grid_rows(self.sizes, (axis,))

    def ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """The members of ``rank``'s group along ``axis`` (``rank`` included), in group-rank order."""
        self._axis(axis)
        c = self.coords(rank)
        index = [slice(None) if a == axis else getattr(c, a) for a in self.sizes]
        return self.grid[tuple(index)].tolist()

    def links(self, rank: int | None = None) -> dict[str, list[int]]:
        """The ranks ``rank`` talks to on each axis (its group members other than itself)."""
        me = self._me(rank)
        return {axis: [r for r in self.ranks(axis, me) if r != me] for axis in self.sizes}

    # -- this rank's groups ------------------------------------------------------------------
    def group(self, *axes: str):
        """This rank's process group along ``axes`` (only inside a launched rank). One axis: made with the
        mesh; several (``"dp", "cp"``): made on first use, named by the axes joined (``"dp_cp"``)."""
        for axis in axes:
            self._axis(axis)
        if not self._distributed:
            raise RuntimeError("this Mesh has no process groups: build it inside a launched rank "
                               "(dl.launch) with groups=True")
        span = tuple(a for a in self.sizes if a in axes)          # in the grid's order
        if span not in self._groups:                              # collective: every rank asks
            self._groups[span] = grid_groups(self.sizes, {"_".join(span): span})["_".join(span)]
        return self._groups[span]

    def __getitem__(self, axis: str):
        """``mesh["tp"]``: this rank's group along one axis, spelled as for torch's ``DeviceMesh``."""
        if not isinstance(axis, str):
            raise TypeError(f"mesh[{axis!r}]: name one axis (mesh['tp']); for one group over several axes "
                            "call mesh.group('dp', 'cp')")
        return self.group(axis)

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def dp_rank(self) -> int:
        return self.coords().dp

    @property
    def pp_rank(self) -> int:
        return self.coords().pp

    @property
    def tp_rank(self) -> int:
        return self.coords().tp

    # -- helpers -------------------------------------------------------------------------------
    def _me(self, rank: int | None) -> int:
        if rank is not None:
            return int(rank)
        if self.rank is None:
            raise ValueError("outside a launched rank pass rank= explicitly")
        return self.rank

    def _axis(self, axis: str) -> None:
        if axis not in self.sizes:
            raise ValueError(f"unknown mesh axis {axis!r}: this mesh's axes are {tuple(self.sizes)}")

    def table(self) -> str:
        """The grid as text: one line per coordinate of the slower axes, the ranks along tp."""
        slow = [a for a in self.sizes if a != "tp"]
        rows = self.grid.reshape(-1, self.tp)
        labels = [" ".join(f"{a}={i}" for a, i in zip(slow, idx))
                  for idx in torch.cartesian_prod(*[torch.arange(self.sizes[a]) for a in slow]).view(
                      -1, len(slow)).tolist()]
        width = max(len(label) for label in labels) + 2
        lines = [" " * (width + 1) + "".join(f"tp={t:<4d}" for t in range(self.tp))]
        for label, row in zip(labels, rows):
            lines.append(label.ljust(width) + "".join(f"{int(r):<7d}" for r in row))
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        where = "" if self.rank is None else f", rank {self.rank} at {self.coords()}"
        degrees = ", ".join(f"{a}={self.sizes[a]}" for a in SHOWN if a in self.sizes)
        return f"Mesh({degrees}{where})"


def grid_rows(sizes: dict[str, int], along: tuple[str, ...]) -> list[list[int]]:
    """Every group of ranks that differ only along the axes ``along`` of
    ``grid = torch.arange(world).view(*sizes.values())`` (axes named by ``sizes``' keys, slowest first),
    each in group-rank order: move ``along`` last and read the grid row by row.

        sizes = {"dp": 2, "cp": 2}:   along ("cp",) -> [[0, 1], [2, 3]]     along ("dp",) -> [[0, 2], [1, 3]]
                                      along ("dp", "cp") -> [[0, 1, 2, 3]]
    """
    names = list(sizes)
    unknown = [a for a in along if a not in names]
    if unknown:
        raise ValueError(f"unknown axes {unknown}: the grid's axes are {names}")
    grid = torch.arange(math.prod(sizes.values())).view(*sizes.values())
    kept = [names.index(a) for a in names if a not in along]
    moved = [names.index(a) for a in along]
    width = math.prod(sizes[a] for a in along)
    return grid.permute(*kept, *moved).reshape(-1, width).tolist()


def grid_groups(sizes: dict[str, int], spans: dict[str, tuple[str, ...]]) -> dict[str, object]:
    """This rank's process group for each name in ``spans``: the ranks that differ from it only along
    ``spans[name]`` (`grid_rows`). Every rank creates every group, name by name and row by row in the
    same order (``new_group`` is collective over the world), and keeps its own, named by ``name``
    (`runtime.name_group`), so each traced collective on it says which link it used.

        grid_groups({"dp": D, "ep": E}, {"ep": ("ep",), "dp": ("dp",)})     expert x data parallelism
        grid_groups({"dp": D, "cp": C, "tp": T}, {"tp": ("tp",), "cp": ("cp",), "dp": ("dp", "cp")})
    """
    me, mine = dist.get_rank(), {}
    for name, along in spans.items():
        for members in grid_rows(sizes, along):
            group = dist.new_group(members)
            if me in members:
                mine[name] = group
                name_group(group, name)
    return mine


def _suggest(world: int) -> str:
    for tp in (2, 1):
        for pp in (2, 1):
            if world % (tp * pp) == 0:
                return f"dp={world // (tp * pp)}, tp={tp}, pp={pp}"
    return f"dp={world}, tp=1, pp=1"


# -- a mesh wherever a group is taken -----------------------------------------------------------------
def as_group(group_or_mesh):
    """The process group ``group_or_mesh`` stands for: how every ``group=`` of distlab also takes a mesh
    (called once, where a parallelism receives its group)::

        None or a ProcessGroup               itself (None: the world)
        a 1-D torch DeviceMesh               its group: ``init_device_mesh("cpu", (2, 2),
                                             mesh_dim_names=("dp", "tp"))["tp"]`` (named "tp" in traces)
        a dl.Mesh with one axis over 1 rank  that axis's group (``mesh["tp"]``: the group of a named axis)
        anything else                        unchanged (e.g. ``dl.ep.LOCAL``)

    A mesh of several dimensions is refused, saying which one to pass (``mesh["tp"]``).
    """
    names = dim_names(group_or_mesh)
    if names is None:
        if isinstance(group_or_mesh, (list, tuple, str, int)):
            raise TypeError(f"group={group_or_mesh!r}: pass a process group (torch.distributed.new_group("
                            "ranks)), a 1-D DeviceMesh (mesh['tp']), a dl.Mesh axis (mesh['tp']) or None "
                            "(the world)")
        return group_or_mesh
    if len(names) != 1:
        shown = ", ".join(f"mesh[{name!r}]" for name in names)
        raise ValueError(f"group= got a {len(names)}-D mesh {describe(group_or_mesh)}, where one process "
                         f"group is needed: pass one of its dimensions, {shown}")
    return mesh_dims(group_or_mesh)[0][1]


def dim_names(mesh) -> tuple[str, ...] | None:
    """The names of a mesh's dimensions, slowest first (a dl.Mesh: its axes over more than one rank, or
    its first axis when none is); None when ``mesh`` is not a mesh."""
    if isinstance(mesh, DeviceMesh):
        return mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    if isinstance(mesh, Mesh):
        return tuple(a for a, n in mesh.sizes.items() if n > 1) or tuple(mesh.sizes)[:1]
    return None


def mesh_dims(mesh) -> list[tuple[str, object]] | None:
    """[(name, this rank's group)] for each dimension of a mesh (`dim_names`); None for a non-mesh."""
    names = dim_names(mesh)
    if names is None:
        return None
    if isinstance(mesh, Mesh):
        return [(a, mesh.group(a)) for a in names]
    dims = [(name, mesh.get_group(i)) for i, name in enumerate(names)]
    for name, group in dims:
        if mesh.mesh_dim_names and group_name(group) is None:
            name_group(group, name)                      # traced collectives on it say "tp", as dl.Mesh's do
    return dims


def span_group(mesh):
    """The group of every rank in ``mesh`` (None: the world); under HSDP the ranks holding one model.
    A sub-mesh of torch's is flattened by ``DeviceMesh._flatten`` (every rank makes every group, as
    `grid_groups` does)."""
    if isinstance(mesh, Mesh) or mesh.size() == dist.get_world_size():
        return None
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()


def describe(mesh) -> str:
    """A mesh in a few words: ``DeviceMesh (dp=2, tp=2)`` or ``Mesh(dp=2, tp=2)``."""
    if isinstance(mesh, DeviceMesh):
        names = dim_names(mesh)
        return "DeviceMesh (" + ", ".join(f"{n}={d}" for n, d in zip(names, mesh.shape)) + ")"
    return repr(mesh)
