"""CPU offload memory, as DeepSpeed's estimators define it (deepspeed.runtime.zero.stage_1_and_2.
estimate_zero2_model_states_mem_needs and stage3.estimate_zero3_model_states_mem_needs).

ZeRO-2 (Offload, Ren et al. 2021), P params, G GPUs in all, g per node, buffer factor 1.5:
    offload      GPU 2 P            CPU P max(4 G, 16) x 1.5
    no offload   GPU 4 P + 16 P / G CPU 4 P g x 1.5
ZeRO-3 (Infinity, Rajbhandari et al. 2021), largest layer ``l`` params (4 l bytes gathered), nodes k:
    params + optimizer offloaded   GPU 4 l              CPU 18 P / k x 1.5   (zero.Init)
    optimizer offloaded            GPU 4 l + 2 P / G    CPU 16 P / k x 1.5
    no offload                     GPU 4 l + 18 P / G   CPU 4 l g x 1.5

Step time (`step_time`): what offloading adds to a rank's step, for the Psi/N parameters of its shards,
K bytes of optimizer state per parameter (Adam: 8), 4 of fp32 master, g and p bytes per gradient and
parameter element (fp32: 4, bf16: 2), B_host the device<->host copy bandwidth, B_disk the file bandwidth:

    t_offload = (g + p) Psi/N / B_host  +  [disk]  2 (K + 4) Psi/N / B_disk  +  t_step(host)

(gradients down and parameters up; the masters and state read and written once per step). ZeRO-Offload
(Ren et al. 2021) overlaps the copies with backward and the CPU step; ZeRO-Infinity (Rajbhandari et al.
2021) overlaps the NVMe reads with the step (`distlab.parallel.zero.offload` reads the next shard ahead).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadEstimate:
    gpu: float                   # bytes per GPU
    cpu: float                   # bytes per node


def zero2_offload(params: float, gpus_per_node: int = 1, nodes: int = 1, offload: bool = True,
                  buffer_factor: float = 1.5) -> OffloadEstimate:
    """DeepSpeed's ZeRO-2 model-state estimate with or without CPU offload of the optimizer."""
    gpus = gpus_per_node * nodes
    if offload:
        return OffloadEstimate(gpu=2 * params, cpu=params * max(4 * gpus, 16) * buffer_factor)
    return OffloadEstimate(gpu=4 * params + int(16 * params / gpus),
                           cpu=params * 4 * gpus_per_node * buffer_factor)


def zero3_offload(params: float, largest_layer: float, gpus_per_node: int = 1, nodes: int = 1,
                  offload_optimizer: bool = True, offload_params: bool = True,
                  buffer_factor: float = 1.5) -> OffloadEstimate:
    """DeepSpeed's ZeRO-3 model-state estimate (with ``zero.Init``)."""
    gpus = gpus_per_node * nodes
    layer = 4 * largest_layer
    if offload_optimizer and offload_params:
        return OffloadEstimate(gpu=layer, cpu=params * 18 / nodes * buffer_factor)
    if offload_optimizer:
        return OffloadEstimate(gpu=layer + int(2 * params / gpus), cpu=params * 16 / nodes * buffer_factor)
    return OffloadEstimate(gpu=layer + int(18 * params / gpus),
                           cpu=largest_layer * 4 * gpus_per_node * buffer_factor)


@dataclass(frozen=True)
class OffloadTime:
    host: float                  # seconds copying gradients down and parameters up
    disk: float                  # seconds reading and writing the masters and optimizer state
    step: float                  # seconds of the optimizer step itself, on the host

    @property
    def total(self) -> float:
        """The transfers and the host step, none overlapped: an upper bound on what offload adds."""
        return self.host + self.disk + self.step


def step_time(params: float, dp: int = 1, tier: str = "cpu", host_bandwidth: float = 25e9,
              disk_bandwidth: float = 3e9, state_bytes: int = 8, grad_bytes: int = 4, param_bytes: int = 4,
              step_seconds: float = 0.0, shards: int = 1, disk_latency: float = 0.0) -> OffloadTime:
    """What offloading the optimizer of ``params`` parameters sharded over ``dp`` ranks adds per step
    (bandwidths in bytes/s: PCIe 4 x16 ~25 GB/s, an NVMe drive ~3 GB/s; ``step_seconds``: the host
    step's own time, measured or estimated). ``tier``: "cpu" (ZeRO-Offload) or "disk" (ZeRO-Infinity),
    whose ``shards`` files are each read and written once a step at ``disk_latency`` seconds apiece."""
    if tier not in ("cpu", "disk"):
        raise ValueError(f"tier={tier!r}: 'cpu' or 'disk'")
    shard = params / dp
    disk = 0.0
    if tier == "disk":                        # masters and state read and written, each file opened twice
        disk = 2 * (state_bytes + 4) * shard / disk_bandwidth + 2 * shards * disk_latency
    return OffloadTime(host=(grad_bytes + param_bytes) * shard / host_bandwidth, disk=disk, step=step_seconds)
