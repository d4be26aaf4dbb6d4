"""The landscape: why tensor parallelism stays inside a node, and what real training runs cost.

1. A tensor-parallel layer on a link (Shoeybi et al. 2019, Megatron-LM, Sec. 3). Each transformer
   layer all-reduces its b s h activation twice forward (after attention and after the MLP: the
   operator g) and twice backward (operator f); nothing else runs meanwhile, so the time sits on the
   critical path. The layer's matmuls, split over t GPUs, take forward + backward = 3 F_fwd::

       t_comm    = 4 x all_reduce(b s h x bytes, t ranks, link)      ring: 2 (t-1)/t S / B + 2 (t-1) alpha
       t_compute = 3 F_fwd / t / (peak x mfu)                    F_fwd: sim.layer_flops (Narayanan Eq. 3)

       ratio t_comm / t_compute     NVLink: 0.1-0.3     PCIe, InfiniBand, Ethernet: about 1 or more

   Both scale as 1/t in the matmul-sized terms, but the all-reduce carries b s h per layer while the
   matmuls carry ~24 b s h^2 FLOPs: the ratio goes as (1/h) x (peak / bandwidth), which only an
   NVLink-class link (hundreds of GB/s) keeps well below 1 on a ~1 PFLOP/s GPU. The all-reduces sit
   on the critical path, so a ratio near 1 doubles the layer's time.

2. A training run's cost from published figures (6 N D: Kaplan et al. 2020; MFU: Chowdhery et al.
   2022, App. B)::

       accelerator-hours = FLOPs / (peak x MFU) / 3600           (when the hours are not published)
       implied MFU       = FLOPs / (hours x 3600 x peak)           (when they are)
       wall days on G    = hours / G / 24
       cost              = hours x price per hour                  (a model's figure: the price is assumed)

   ``data/landscape_runs.json`` holds each run's published numbers with where each was read;
   anything not in it is computed here and labelled modelled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from distlab.theory.comm import comm_time
from distlab.theory.presets import ModelPreset, gpu as gpu_preset, link as link_preset, model as model_preset
from distlab.theory.sim import layer_flops

RUNS = Path(__file__).resolve().parent / "data" / "landscape_runs.json"
SECONDS_PER_HOUR = 3600.0
PF_DAY = 1e15 * 86400.0                    # one petaFLOP/s for a day, in FLOPs (Brown et al. 2020, App. D)


@dataclass(frozen=True)
class TPLayer:
    """One transformer layer's forward + backward under tensor parallelism on one link, seconds."""

    link: str
    bandwidth: float               # bytes/s, one direction
    message: float                 # bytes of one all-reduced activation, b s h x element
    comm: float                    # the four all-reduces
    compute: float                 # the layer's matmuls on one GPU

    @property
    def ratio(self) -> float:
        """t_comm / t_compute: above 1, the GPUs wait on the link longer than they compute."""
        return self.comm / self.compute


def tp_layer_time(model: str | ModelPreset, link: str, tp: int = 8, gpu: str = "h100-80gb",
                  seq_len: int | None = None, micro_batch: int = 1, mfu: float = 0.5,
                  bus_efficiency: float = 1.0, bytes_per_element: int = 2) -> TPLayer:
    """Seconds of TP all-reduces vs matmuls for one layer of ``model`` split ``tp`` ways over ``link``.

    ``mfu``: share of ``gpu``'s peak the matmuls reach; ``bus_efficiency``: share of the link's
    bandwidth a collective reaches (nccl-tests busbw / peak). Every rank's traffic is assumed to
    cross ``link`` (a TP group inside a node on NVLink or PCIe, or one spread over nodes' NICs)."""
    if tp < 2:
        raise ValueError(f"tensor parallelism needs tp >= 2 ranks, got tp={tp}")
    if not (0 < mfu <= 1 and 0 < bus_efficiency <= 1):
        raise ValueError(f"mfu and bus_efficiency are fractions in (0, 1], got {mfu} and {bus_efficiency}")
    shape = model_preset(model) if isinstance(model, str) else model
    chip, wire = gpu_preset(gpu), link_preset(link)
    s, b = seq_len or shape.seq_len, micro_batch
    fwd, _ = layer_flops(shape, s, b)                                   # GEMM FLOPs of one forward
    message = s * b * shape.hidden * bytes_per_element                  # (s, b, h) activation
    bandwidth = wire.bandwidth * bus_efficiency
    comm = 4 * comm_time("all_reduce", message, tp, bandwidth, wire.latency)
    compute = 3 * fwd / tp / (chip.bf16_flops * mfu)
    return TPLayer(wire.name, wire.bandwidth, message, comm, compute)


@dataclass(frozen=True)
class RunCost:
    """A training run: what was published and what follows from it (see ``modelled``)."""

    name: str
    params: float
    tokens: float
    flops: float                   # published, or 6 N D
    accelerator_hours: float       # published, or FLOPs / (peak x MFU)
    peak_flops: float              # per accelerator
    mfu: float                     # published, or implied by published FLOPs and hours, or assumed
    price_per_hour: float          # assumed, dollars per accelerator-hour
    modelled: tuple[str, ...]      # the fields above that are a model's figure, not a published one

    @property
    def accelerator_days(self) -> float:
        return self.accelerator_hours / 24.0

    @property
    def cost(self) -> float:
        """Dollars at ``price_per_hour``: always a model's figure."""
        return self.accelerator_hours * self.price_per_hour

    @property
    def utilisation(self) -> float:
        """FLOPs over everything the accelerator-hours could have done: the MFU of the whole run,
        downtime and repeated steps included (PaLM: about 30% against 46.2% measured over steps)."""
        return implied_mfu(self.flops, self.accelerator_hours, self.peak_flops)

    def wall_days(self, accelerators: int) -> float:
        """Days on ``accelerators`` working at once (no downtime)."""
        return self.accelerator_hours / accelerators / 24.0


def accelerator_hours(flops: float, peak_flops: float, mfu: float) -> float:
    """Hours of one accelerator to do ``flops`` at ``mfu`` of ``peak_flops``: F / (peak x MFU) / 3600."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction in (0, 1], got {mfu}")
    return flops / (peak_flops * mfu) / SECONDS_PER_HOUR


def implied_mfu(flops: float, hours: float, peak_flops: float) -> float:
    """The utilisation that ``hours`` accelerator-hours imply for ``flops``: F / (hours x 3600 x peak)."""
    return flops / (hours * SECONDS_PER_HOUR * peak_flops)


def published_runs() -> dict[str, dict]:
    """The fixture's runs by name, each with its ``sources``."""
    return {run["name"]: run for run in json.loads(RUNS.read_text())["runs"]}


def run_cost(name: str, price_per_hour: float = 2.0, gpu: str = "a100-80gb", mfu: float = 0.4) -> RunCost:
    """Run ``name`` of the fixture, costed. Published numbers are used where they exist; a missing
    FLOP count is 6 N D, missing hours are FLOPs / (peak x ``mfu``) on ``gpu`` (both modelled), and
    a missing MFU is implied by the published FLOPs (or 6 N D) and hours."""
    runs = published_runs()
    if name not in runs:
        raise ValueError(f"unknown run {name!r}: choose one of {', '.join(runs)}")
    if price_per_hour <= 0:
        raise ValueError(f"price_per_hour is dollars per accelerator-hour, > 0; got {price_per_hour}")
    run, modelled = runs[name], ["cost"]
    params = run.get("params") or model_preset(run["model"]).params
    flops = run["train_flops"]
    if flops is None:
        flops, modelled = 6.0 * params * run["tokens"], modelled + ["flops"]
    chip = run["accelerator"] or gpu
    peak = run.get("peak_flops") or gpu_preset(chip).bf16_flops
    hours = run["accelerator_hours"]
    if hours is None:
        hours, modelled = accelerator_hours(flops, peak, mfu), modelled + ["accelerator_hours", "mfu"]
        run_mfu = mfu
    else:
        run_mfu = run["mfu"] or implied_mfu(flops, hours, peak)
        if run["mfu"] is None:
            modelled.append("mfu")
    return RunCost(name, params, run["tokens"], flops, hours, peak, run_mfu, price_per_hour, tuple(modelled))
