"""CPU offload memory, as DeepSpeed's estimators define it (deepspeed.runtime.zero.stage_1_and_2.
estimate_zero2_model_states_mem_needs and stage3.estimate_zero3_model_states_mem_needs).

ZeRO-2 (Offload, Ren et al. 2021), P params, G GPUs in all, g per node, buffer factor 1.5:
    offload      GPU 2 P            CPU P max(4 G, 16) x 1.5
    no offload   GPU 4 P + 16 P / G CPU 4 P g x 1.5
ZeRO-3 (Infinity, Rajbhandari et al. 2021), largest layer ``l`` params (4 l bytes gathered), nodes k:
    params + optimizer offloaded   GPU 4 l              CPU 18 P / k x 1.5   (zero.Init)
    optimizer offloaded            GPU 4 l + 2 P / G    CPU 16 P / k x 1.5
    no offload                     GPU 4 l + 18 P / G   CPU 4 l g x 1.5
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
