"""The collective stages of `gpu_check.py`: benchmarks/allreduce.py's and all_to_all.py's measurements on
the device's tensors, two gloo ranks sharing the one GPU.

Why gloo and which implementations. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the
two ranks use gloo, which runs all_reduce and all_to_all_single on CUDA tensors (ProcessGroupGloo's CUDA
work classes stage them through host memory). distlab's own collectives (`dl.comm`) are built from
send/recv, and gloo's send/recv hand the tensor's pointer to its TCP transport as a host address
(ProcessGroupGloo.cpp, ``send``: ``createUnboundBuffer(tensor.const_data_ptr(), ...)``): on a CUDA tensor
they are expected to fail. So each stage first *probes* distlab's implementation on the device in a short
launch of its own, and times it beside torch only if the probe passed; the probe's outcome is written
either way. On a CPU (``--dry``) the probe passes and every implementation is timed.

    busbw = S / t x 2 (N-1)/N (all-reduce) or (N-1)/N (all-to-all), nccl-tests' definitions
"""
from __future__ import annotations

import torch

import all_to_all as a2a
import allreduce as ar
import distlab as dl
from _gpu_stages import Config, device
from _results import slowest_rank_rows

RANKS = 2
PROBE_TIMEOUT = 20.0        # a send that fails on one rank leaves its peer waiting in recv until this


def _probe_rank(op: str, where: str) -> bool:
    """Inside a rank: distlab's ``op`` on a small tensor on ``where``, checked against the known answer."""
    x = torch.full((RANKS * 256,), float(dl.rank() + 1), device=torch.device(where))
    if op == "all_reduce":
        return bool((dl.comm.ring_all_reduce(x) == sum(range(1, RANKS + 1))).all())
    got = dl.comm.all_to_all(x.view(RANKS, -1))                     # block i from rank i: i + 1 everywhere
    return bool((got.cpu() == torch.arange(1, RANKS + 1).view(-1, 1).float()).all())


def probe(op: str, where: torch.device) -> str | None:
    """None if distlab's ``op`` runs right on ``where`` under gloo, else the reason (first line)."""
    try:
        run = dl.launch(_probe_rank, RANKS, args=(op, str(where)), backend="gloo", output="quiet",
                        timeout=PROBE_TIMEOUT)
    except Exception as exc:                                   # dl.LaunchError: a rank failed or hung
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    return None if all(run.results) else "wrong result"


def _meta(where: torch.device, op: str, error: str | None, impls: list[str]) -> dict:
    return {"backend": "gloo", "world_size": RANKS, "device": str(where), "dtype": "float32", "impls": impls,
            "why_gloo": "one GPU: NCCL refuses two ranks on one GPU",
            "dl_on_device": f"dl {op} ran and matched" if error is None else f"dl {op} not timed: {error}",
            "statistic": "median over repeats of the slowest rank's time (benchmarks/_results.py)",
            "labels": {"median_s": "measured", "busbw_GBps": "from measured time, nccl-tests formula"}}


def allreduce(cfg: Config) -> dict:
    where = device()
    error = probe("all_reduce", where)
    impls = ["torch"] + ([] if error else ["ring", "textbook"])
    run = dl.launch(ar.measure, RANKS, args=(list(cfg.sizes), impls, cfg.budget, 3, 20, str(where)),
                    backend="gloo", output="quiet", timeout=600)
    rows = slowest_rank_rows(run.results, RANKS, traffic=2 * (RANKS - 1) / RANKS)
    return {"meta": _meta(where, "all_reduce", error, impls), "results": rows}


def all_to_all(cfg: Config) -> dict:
    where = device()
    error = probe("all_to_all", where)
    impls = ["torch"] + ([] if error else ["dl", "p2p"])
    run = dl.launch(a2a.measure, RANKS, args=(list(cfg.sizes), cfg.budget, 3, 20, 3, str(where), impls),
                    backend="gloo", output="quiet", timeout=600)
    rows = slowest_rank_rows(run.results, RANKS, traffic=(RANKS - 1) / RANKS)
    return {"meta": _meta(where, "all_to_all", error, impls), "results": rows}
