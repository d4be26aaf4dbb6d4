"""``cp=`` and ``ep=`` as mesh axes: ``3d:dp=2,cp=2``, ``3d:cp=2,tp=2``, ``3d:dp=2,cp=2,tp=2``,
``3d:dp=2,ep=2``.

What composes (each equal to ``single`` on the same global batch; tested in ``tests/test_mesh_axes.py``)::

    dp x cp x tp   grid arange(world).view(dp, cp, tp), tp fastest (Megatron-LM's order)
                   tp splits heads, MLP and vocabulary; cp splits every sequence, attention on this
                   rank's a/tp heads by ring attention (``attention=ring``, zig-zag) or Ulysses
                   (``attention=ulysses``, needs cp | heads/tp); gradients averaged over the dp x cp
                   ranks that hold the same shards           -> `distlab.strategies.context`
    dp x ep        grid arange(world).view(dp, ep): experts split over each row (tokens travel by
                   all-to-all inside it), everything else replicated over dp x ep; dense gradients
                   summed over the world, expert gradients over the dp column only; router counts over
                   the whole batch, so capacity and dropped tokens are single's
                                                             -> `distlab.strategies.expert`

What is refused, and why (before any rank starts):

    cp or ep with pp > 1      the pipeline strategy cuts a dense GPT into stages and runs its schedule;
                              context-parallel or MoE stages are not built here: use pp=1
    cp with ep                a mesh with both is not built here: one of them
    ep with tp > 1            experts are whole matrices per rank here (no tp split of an expert)
    cp or ep with zero=1      their gradients are averaged by DDP / explicit all-reduces: zero=0
    cp with sequence_parallel SP splits the sequence over tp, cp over cp: one of them
"""
from __future__ import annotations

from dataclasses import replace

from .base import RankResult, TrainSpec
from .spec import Layout, changed


def refuse(layout: Layout) -> None:
    """The combinations this mesh does not build, each with what to change instead."""
    cp, ep = layout.cp, layout.ep
    axis = "cp" if cp > 1 else "ep"
    if cp > 1 and ep > 1:
        raise ValueError(f"cp={cp} with ep={ep}: a mesh with both context and expert parallelism is not "
                         "built here; keep one of them (e.g. '3d:dp=2,cp=2' or '3d:dp=2,ep=2')")
    if layout.pp > 1:
        kind = "context-parallel" if cp > 1 else "mixture-of-experts"
        raise ValueError(f"{axis}={getattr(layout, axis)} with pp={layout.pp}: pipeline stages are cut from "
                         f"a dense GPT and {kind} stages are not built here; use pp=1 (compose {axis} with "
                         f"dp{' and tp' if cp > 1 else ''})")
    if ep > 1 and layout.tp > 1:
        raise ValueError(f"ep={ep} with tp={layout.tp}: each rank holds whole experts here (no tensor-"
                         "parallel split of an expert); use tp=1 and compose ep with dp")
    if layout.zero:
        raise ValueError(f"{axis}={getattr(layout, axis)} with zero={layout.zero}: gradients of this mesh "
                         "are averaged by DDP / all-reduce (zero=0); ZeRO-1 is offered on the dp x tp x pp "
                         "mesh")
    if cp > 1 and layout.sequence_parallel:
        raise ValueError("sequence_parallel splits the sequence over tp and cp splits it over cp: use one "
                         "of them (drop sp=1, or cp=)")


#: layout fields that only the dp x tp x pp mesh (pipeline) or only the cp axis reads
PIPELINE_ONLY = ("schedule", "microbatches", "virtual", "balance")
CP_ONLY = ("attention", "zigzag")


def refuse_unused(layout: Layout, cp: bool) -> None:
    """An option this mesh would silently drop (a pipeline option with cp= or ep=, an attention option
    with ep=), set to other than its default, is refused, naming it: the strict-options rule holds for
    meshes too."""
    unused = sorted(set(changed(layout)) & set(PIPELINE_ONLY + (() if cp else CP_ONLY)))
    if unused:
        axis = "cp" if cp else "ep"
        raise TypeError(f"{unused} have no effect on a mesh with {axis}= (no pipeline stages"
                        f"{'' if cp else ', no context-parallel attention'} here): drop them")


def sub_spec(spec: TrainSpec) -> TrainSpec:
    """The spec of the strategy family that trains this mesh: ``cp-ring`` / ``cp-ulysses`` (dp, cp and tp
    from the layout) or ``ep`` (dp and ep); every other concern (checkpoints...) as it is."""
    if spec.layout.cp > 1:
        return replace(spec, strategy=f"cp-{spec.layout.attention}")
    return replace(spec, strategy="ep")


def check(spec: TrainSpec, world: int) -> None:
    """Before any rank starts: a refused combination, degrees that do not fill the world, and what the
    family itself refuses (sequence or heads that do not split, experts that do not divide)."""
    layout = spec.layout
    refuse(layout)
    refuse_unused(layout, cp=layout.cp > 1)
    degrees = {a: getattr(layout, a) for a in ("dp", "cp", "ep", "tp") if getattr(layout, a) > 1 or a == "dp"}
    product = 1
    for n in degrees.values():
        product *= n
    if product != world:
        shown = " x ".join(f"{a}={n}" for a, n in degrees.items())
        raise ValueError(f"mesh {shown} = {product} ranks, but the world has {world}: choose degrees whose "
                         f"product is {world}, or launch with world_size={product}")
    sub = sub_spec(spec)
    if layout.cp > 1:
        from .context import check as check_cp
        check_cp(sub, world)
    else:
        from .expert import check as check_ep
        check_ep(sub, world)


def train_rank(spec: TrainSpec) -> RankResult:
    from ..runtime import world_size
    check(spec, world_size())
    sub = sub_spec(spec)
    if spec.layout.cp > 1:
        from .context import train_rank as train_cp
        return train_cp(sub)
    from .expert import train_rank as train_ep
    return train_ep(sub)
