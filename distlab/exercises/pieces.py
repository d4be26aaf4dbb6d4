"""Exercises without communication, checked in this process: the pieces of a strategy that are pure
logic (which buckets, which schedule, which groups, which expert) or local arithmetic (merging two
partial softmaxes) or file handling (a write that a crash cannot tear).
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import torch

from distlab.exercises.harness import Exercise, compare_outputs, register


def _same(got: Any, expected: Any, what: str) -> str | None:
    return None if got == expected else f"{what}: expected {expected}, got {got}"


# -- lesson 02: buckets ---------------------------------------------------------------------------
def buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Indices of the parameters in each DDP bucket: walk the parameters in *reverse* order (the order
    backward produces gradients) and start a new bucket when the next one would pass ``cap`` bytes;
    a parameter larger than ``cap`` gets a bucket of its own. (`distlab/parallel/data/buckets.py`)"""
    out: list[list[int]] = []
    size = 0
    for i in reversed(range(len(sizes))):
        if not out or size + sizes[i] > cap:
            out.append([])
            size = 0
        out[-1].append(i)
        size += sizes[i]
    return out


_BUCKET_CASES = [([4, 4, 4, 4], 8, "four equal, two per bucket"), ([10, 1, 1], 4, "one larger than the cap"),
                 ([3, 3, 3], 100, "all in one"), ([5, 5, 5], 0, "cap 0: one each"),
                 ([1, 7, 1, 7], 8, "exactly full")]

register(Exercise(
    name="buckets", lesson="02",
    task="buckets(sizes, cap) -> lists of parameter indices, in reverse order, no bucket over cap bytes "
         "unless one parameter alone is larger",
    reference=buckets, world_sizes=(),
    cases=lambda n: [{"label": label, "sizes": s, "cap": c} for s, c, label in _BUCKET_CASES],
    run=lambda fn, case: fn(case["sizes"], case["cap"]),
    expect=lambda case, r, n: buckets(case["sizes"], case["cap"]),
    compare=lambda got, expected: _same(got, expected, "buckets"),
    hint="go through range(len(sizes)) reversed; keep the running size of the open bucket; open a new one "
         "when size + sizes[i] > cap (and for the very first parameter)"))


# -- lesson 05: the 1F1B action list --------------------------------------------------------------
def one_f_one_b(stages: int, microbatches: int) -> list[list[str]]:
    """Per rank, the 1F1B order of "F<i>" and "B<i>": rank r runs min(p - r - 1, m) warm-up forwards,
    then alternates one forward and one backward, then drains the remaining backwards (PipeDream-Flush,
    Narayanan et al. 2021)."""
    plan = []
    for r in range(stages):
        warmup = min(stages - r - 1, microbatches)
        actions = [f"F{i}" for i in range(warmup)]
        for i in range(warmup, microbatches):
            actions += [f"F{i}", f"B{i - warmup}"]
        actions += [f"B{i}" for i in range(microbatches - warmup, microbatches)]
        plan.append(actions)
    return plan


def _schedule_compare(got, expected) -> str | None:
    if not isinstance(got, list) or len(got) != len(expected):
        return f"expected one list per rank ({len(expected)} lists), got {got!r:.80}"
    for r, (mine, right) in enumerate(zip(got, expected)):
        for k, (a, b) in enumerate(zip(mine, right)):
            if a != b:
                return f"rank {r}, action {k}: expected {b}, got {a} (rank {r} should run {right})"
        if len(mine) != len(right):
            return f"rank {r}: expected {len(right)} actions, got {len(mine)}"
    return None


register(Exercise(
    name="one_f_one_b", lesson="05",
    task="one_f_one_b(stages, microbatches) -> for each rank the list of 'F<i>' / 'B<i>' actions of 1F1B",
    reference=one_f_one_b, world_sizes=(),
    cases=lambda n: [{"label": f"p={p}, m={m}", "p": p, "m": m}
                     for p, m in ((1, 3), (2, 4), (4, 8), (4, 2), (3, 5))],
    run=lambda fn, case: fn(case["p"], case["m"]),
    expect=lambda case, r, n: one_f_one_b(case["p"], case["m"]),
    compare=_schedule_compare,
    hint="rank r warms up with min(p - r - 1, m) forwards; then each forward is followed by the backward of "
         "the oldest microbatch still in flight; the last rank has no warm-up; m < p caps the warm-up"))


# -- lesson 06: mesh groups -----------------------------------------------------------------------
def mesh_groups(dp: int, pp: int, tp: int, axis: str) -> list[list[int]]:
    """The groups along ``axis`` of the grid ``torch.arange(dp * pp * tp).view(dp, pp, tp)``: fix the two
    other coordinates, the ranks on the line that remains form a group."""
    grid = torch.arange(dp * pp * tp).view(dp, pp, tp)
    dim = ("dp", "pp", "tp").index(axis)
    return grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()


register(Exercise(
    name="mesh_groups", lesson="06",
    task="mesh_groups(dp, pp, tp, axis) -> the process groups along axis ('dp', 'pp' or 'tp') of the "
         "grid arange(dp*pp*tp).view(dp, pp, tp)",
    reference=mesh_groups, world_sizes=(),
    cases=lambda n: [{"label": f"{d}x{p}x{t}, {a}", "shape": (d, p, t), "axis": a}
                     for d, p, t in ((2, 2, 2), (1, 2, 4), (3, 1, 2)) for a in ("dp", "pp", "tp")],
    run=lambda fn, case: sorted(sorted(g) for g in fn(*case["shape"], case["axis"])),
    expect=lambda case, r, n: sorted(sorted(g) for g in mesh_groups(*case["shape"], case["axis"])),
    compare=lambda got, expected: _same(got, expected, "groups"),
    hint="build the grid with torch.arange(world).view(dp, pp, tp); the tp groups are the last dimension's "
         "rows; for another axis move it last (movedim) and reshape to (-1, size of that axis)"))


# -- lesson 10: merging two partial attentions (online softmax) ----------------------------------
def merge_attention(out1, lse1, out2, lse2):
    """The attention over keys K1 + K2 from the attentions over each: lse = log(e^lse1 + e^lse2) and
    out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2 (Milakov & Gimelshein 2018; ring attention's step)."""
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2, lse


def _partial(q, k, v):
    scores = q @ k.T / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def _attention_case(seed: int, scale: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(5, 8, generator=g) * s for s in (scale, scale, 1.0))
    return {"label": f"scores scaled by {scale:g}", "q": q, "k": k, "v": v}


def _merge_run(fn, case):
    (o1, l1), (o2, l2) = _partial(case["q"], case["k"][:3], case["v"][:3]), _partial(case["q"], case["k"][3:],
                                                                                      case["v"][3:])
    return fn(o1, l1, o2, l2)


register(Exercise(
    name="merge_attention", lesson="10",
    task="merge_attention(out1, lse1, out2, lse2) -> (out, lse): attention over two key blocks from each "
         "block's output and log-sum-exp of its scores",
    reference=merge_attention, world_sizes=(), atol=1e-4,
    cases=lambda n: [_attention_case(0, 1.0), _attention_case(1, 10.0), _attention_case(2, 40.0)],
    run=_merge_run,
    expect=lambda case, r, n: _partial(case["q"], case["k"], case["v"]),
    compare=lambda got, expected: compare_outputs(got, expected, ("out", "lse"), atol=1e-4),
    hint="lse = torch.logaddexp(lse1, lse2); weigh each output by exp(lse_i - lse) (a column per query: "
         "unsqueeze(-1)); never exponentiate raw scores: large ones overflow"))


# -- lesson 11: the top-k router ------------------------------------------------------------------
def top_k_router(logits: torch.Tensor, k: int):
    """(expert (T, k), weight (T, k)): softmax over all experts, the k largest, renormalised to sum to 1
    when k > 1 (GShard; Switch keeps k = 1 unnormalised). As `distlab/models/moe.py`'s `Router`."""
    weight, expert = logits.float().softmax(dim=-1).topk(k, dim=-1)
    if k > 1:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    return expert, weight


def _router_case(seed: int, k: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"label": f"top-{k} of 6 experts", "logits": torch.randn(10, 6, generator=g) * 3, "k": k}


register(Exercise(
    name="top_k_router", lesson="11",
    task="top_k_router(logits (T, E), k) -> (expert (T, k), weight (T, k)): softmax over experts, top k, "
         "weights renormalised when k > 1",
    reference=top_k_router, world_sizes=(),
    cases=lambda n: [_router_case(0, 1), _router_case(1, 2), _router_case(2, 3)],
    run=lambda fn, case: fn(case["logits"], case["k"]),
    expect=lambda case, r, n: top_k_router(case["logits"], case["k"]),
    compare=lambda got, expected: compare_outputs(got, expected, ("expert", "weight")),
    hint="softmax first (over dim -1, all experts), then .topk(k); for k > 1 divide the k weights by their "
         "sum"))


# -- lesson 08: a write a crash cannot tear -------------------------------------------------------
def atomic_save(obj, path) -> None:
    """``torch.save`` to a temporary name in the same folder, flush and fsync, then ``os.replace`` onto
    ``path``: a reader sees the old file or the new one, never half of one."""
    import os
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _DiskFull(OSError):
    pass


def _save_then_crash(obj, f, *args, **kwargs):
    """torch.save that writes half the bytes and then fails, as a killed process or a full disk would."""
    data = io.BytesIO()
    _REAL_SAVE(obj, data)
    half = data.getvalue()[: len(data.getvalue()) // 2]
    if isinstance(f, (str, Path)):
        Path(f).write_bytes(half)
    else:
        f.write(half)
    raise _DiskFull("simulated crash in the middle of torch.save")


_REAL_SAVE = torch.save


def _atomic_run(fn, case) -> str:
    import tempfile
    from unittest import mock
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt.pt"
        fn({"step": 1, "w": torch.arange(4.0)}, path)
        if not case["crash"]:
            back = torch.load(path, weights_only=True)
            right = back["step"] == 1 and torch.equal(back["w"], torch.arange(4.0))
            return "saved" if right else "wrong content"
        with mock.patch.object(torch, "save", _save_then_crash):
            try:
                fn({"step": 2, "w": torch.zeros(1000)}, path)
            except _DiskFull:
                pass
        try:
            back = torch.load(path, weights_only=True)
        except Exception:                                  # noqa: BLE001 - a torn file is the finding
            return "torn: the file at path no longer loads"
        return "old checkpoint intact" if back["step"] == 1 else f"step {back['step']} after a failed save"


register(Exercise(
    name="atomic_save", lesson="08",
    task="atomic_save(obj, path): save so that a crash in the middle of the write leaves the previous file "
         "at path complete",
    reference=atomic_save, world_sizes=(),
    cases=lambda n: [{"label": "a normal save", "crash": False},
                     {"label": "a crash mid-write", "crash": True}],
    run=_atomic_run,
    expect=lambda case, r, n: "old checkpoint intact" if case["crash"] else "saved",
    compare=lambda got, expected: _same(got, expected, "after the save"),
    hint="torch.save into path + '.tmp' (an open file you flush and os.fsync), then os.replace(tmp, path): "
         "the rename is atomic, the write is not"))
