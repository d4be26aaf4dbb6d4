"""The multirank stage of `gpu_check.py`: every strategy of `dl.train` on two ranks that share the one GPU,
gloo carrying CUDA tensors, compared with ``single`` on the same GPU and global batch. A finding, not a test:
each strategy's row says "equal", "differs" (with the gap) or "failed" (with the first line of the error).

Why it may fail, and why it is still run: NCCL refuses two ranks on one GPU, so the ranks use gloo, whose
CUDA support covers some collectives (all_reduce, broadcast, allgather, all_to_all_single stage CUDA
tensors through host memory: ProcessGroupGloo's CUDA work classes) and not send/recv, which hand the
tensor's pointer to gloo's TCP transport as a host address (ProcessGroupGloo.cpp, ``send``). Strategies built
on point-to-point (pipelines, ring attention, `dl.comm`'s rings) are expected to fail here; which ones do is
what this stage records. The ranks compute on ``cuda:0`` through `dl.runtime.place_on`.

Every launch is forked from this stage's process, which therefore touches CUDA only after the last one (a
forked child cannot use CUDA its parent initialised): ranks return their numbers on the CPU, and the
``single`` references run here at the end.
"""
from __future__ import annotations

import time

import torch

import distlab as dl
from _gpu_stages import Config, device
from distlab import runtime
from distlab.strategies import load, parse, validate

RUN = dict(steps=3, seed=0, optimizer="sgd", lr=0.1, global_batch=8, grad_accum=2)
PER_LAUNCH = 25.0            # seconds: a rank stuck in a receive its peer's failed send never fills
# collectives first (gloo runs some on CUDA), point-to-point last (gloo has no CUDA send/recv): if time runs
# out, it runs out on the expected failures
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "tp-sp", "cp-ulysses", "ep", "cp-ring",
              "pp-gpipe", "pp-1f1b", "pp-interleaved", "pp-zb-h1")
DRY_STRATEGIES = ("pp-1f1b",)     # a CPU proves the stage, not the strategies (tests/test_train.py does)


def _model(strategy: str) -> str:
    return "gpt-moe-tiny" if strategy == "ep" else "gpt-tiny"


def _train_here(spec, where: str) -> dict:
    """Inside a rank: place it on ``where``, run the strategy's rank function, return CPU numbers only."""
    runtime.place_on(where)
    result = load(spec.strategy)(spec)
    params = {k: v.detach().cpu() for k, v in result.params.items()} if result.params else None
    return {"losses": result.losses, "params": params, "device": str(dl.device())}


def _launch(strategy: str, world: int, where: torch.device, timeout: float) -> dict:
    spec = parse(strategy, model=_model(strategy), **RUN)
    validate(spec, world)
    run = dl.launch(_train_here, world, args=(spec, str(where)), backend="gloo", output="quiet",
                    timeout=timeout)
    losses = next(r["losses"] for r in run.results if r["losses"] is not None)
    params = next(r["params"] for r in run.results if r["params"] is not None)
    return {"losses": losses, "params": params, "devices": sorted({r["device"] for r in run.results})}


def _gap(got: dict, want: dict) -> float:
    """The largest relative difference of the losses and of the parameters, |got - want| / (|want| + 0.01):
    the 0.01 for parameters that stay near zero (a key's bias has no gradient in exact arithmetic, only
    rounding noise, whose relative difference means nothing)."""
    losses = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
    params = max((got["params"][k] - w).norm().item() / (w.norm().item() + 0.01)
                 for k, w in want["params"].items())
    return max(losses, params)


def multirank(cfg: Config, budget: float) -> dict:
    """Every strategy in turn, until ``budget`` seconds less one launch's time are spent; then the
    references, here (`_single_here`), so that no launch follows this process's first use of CUDA."""
    where, world, t0 = device(), 2, time.monotonic()
    rows, runs = [], {}
    for strategy in DRY_STRATEGIES if cfg.dry else STRATEGIES:
        left = budget - (time.monotonic() - t0) - 10           # the references' time kept
        if left < 10:
            rows.append({"strategy": strategy, "status": "not run", "detail": "the stage's time was up"})
            continue
        start, row = time.monotonic(), {"strategy": strategy}
        try:
            runs[strategy] = _launch(strategy, world, where, min(PER_LAUNCH, left))
        except Exception as exc:                               # dl.LaunchError: a rank failed or hung
            row.update(status="failed", detail=f"{type(exc).__name__}: "
                                               f"{str(exc).strip().splitlines()[0][:300]}")
        rows.append({**row, "seconds": round(time.monotonic() - start, 1)})
    refs = {m: _single_here(m, where) for m in sorted({_model(s) for s in runs})}
    for row in rows:
        if row["strategy"] in runs:
            got = runs[row["strategy"]]
            gap = _gap(got, refs[_model(row["strategy"])])
            row.update(status="equal" if gap <= 1e-5 else "differs", gap=gap, devices=got["devices"])
    return {"world_size": world, "backend": "gloo", "device": str(where), "run": RUN, "rows": rows,
            "reference": "single on the same device and global batch, in this process after the launches",
            "equal_means": "losses and final parameters within 1e-5 relative (`_gap`)"}


def _single_here(model: str, where: torch.device) -> dict:
    """``single`` in this process on ``where`` (`place_on` outside a launch: this process's last act)."""
    runtime.place_on(where)
    r = dl.train("single", model=model, **RUN)
    return {"losses": r.losses, "params": {k: v.detach().cpu() for k, v in r.params.items()}}
