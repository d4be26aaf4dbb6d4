"""Pure formulas for distributed training: memory, communication, bubbles, throughput.

No torch here: plain Python arithmetic, each function citing the paper it realises, so a lesson
can put a prediction beside a measurement. One idea per module:

  params       parameter count of a transformer (GPT closed form, GQA, SwiGLU, tied)
  memory       bytes per GPU by category under ZeRO 0-3, TP, PP; shard_numel padding
  activations  Korthikanti et al. 2022 activation memory; pipeline in-flight microbatches
  offload      DeepSpeed's CPU-offload estimators; step_time, what offload adds to a step
  comm         alpha-beta collective times, nccl-tests algbw/busbw, per-step volumes
  compression  PowerSGD's elements per step; local SGD / DiLoCo bytes per step; quantized bytes and error
  batch        the linear LR scaling rule, warmup, the gradient noise scale and the critical batch size
  context      context parallelism: activation memory per rank, ring attention vs Ulysses bytes
  moe          mixture of experts: total vs active parameters, expert-parallel memory, all-to-all bytes
  pipeline     bubble fractions of GPipe, 1F1B, interleaved, ZB-H1/H2, DualPipe
  throughput   6 N D FLOPs, MFU, training time, scaling efficiency
  presets      GPT-3 / Llama models, GPUs, interconnects
  planner      "fits on" verdicts, the cheapest configuration, the decision guide
  checkpoint   Young's and Daly's optimal checkpoint interval, the wall time it buys
  sim          step time of a training step on a cluster: compute, exposed communication, bubble
  published    published training runs (Narayanan 2021, Korthikanti 2022, Llama 3) beside sim's predictions
  landscape    TP all-reduces vs matmuls on each interconnect; GPT-3, Llama 2, PaLM costed from their papers
  scaling      Kaplan and Chinchilla: compute-optimal N and D from C = 6 N D, GPU-seconds, power-law fits
  precision    float formats (fp32, bf16, fp16, fp8 e4m3/e5m2): range, unit roundoff, sums, scaled casts
  calibrate    sim on this machine: CPU time as work, processor sharing, constants fitted from distlab's runs
"""
from distlab.theory.activations import activation_bytes_per_layer, pipeline_in_flight
from distlab.theory.checkpoint import (checkpointed_wall_time, daly_interval, interval_steps, waste_fraction,
                                       young_interval)
from distlab.theory.comm import (algbw, busbw, comm_time, dp_volume, fit_alpha_beta, fsdp_volume, pp_volume,
                                 tp_volume, zero_volume)
from distlab.theory.batch import (examples_factor, linear_scaling_lr, noise_scale, steps_factor,
                                  warmup_lr)
from distlab.theory.compression import (int8_error, local_sgd_volume, powersgd_elements, powersgd_ratio,
                                        quantized_bytes, quantized_ratio, quantized_volume, step_time_on_link)
from distlab.theory.context import (cp_activation_bytes_per_layer, cp_bytes_per_layer,
                                    cp_saved_bytes_per_layer, ring_attention_flops)
from distlab.theory.memory import MemoryBreakdown, bytes_per_param, fsdp_padding, memory, shard_numel
from distlab.theory.moe import (MoEParams, ep_memory, ep_params_per_rank, expert_capacity, gpt_moe_params,
                                moe_all_to_all_bytes, moe_layer_params, moe_step_all_to_all_bytes)
from distlab.theory.moe import expected_drop_fraction
from distlab.theory.offload import OffloadEstimate, OffloadTime, zero2_offload, zero3_offload
from distlab.theory.params import gpt_params, transformer_params
from distlab.theory.pipeline import bubble, bubble_time
from distlab.theory.planner import Advice, Plan, advise, cheapest_plan, fits
from distlab.theory.presets import GPUS, LINKS, MODELS, ModelPreset, gpu, link, model
from distlab.theory.throughput import (chinchilla_tokens, mfu, scaling_efficiency, throughput,
                                       training_flops, training_time)
from distlab.theory.units import GB, GiB, MB, MiB
from distlab.theory import calibrate, precision, published, scaling, sim  # noqa: E402  (modules: dl.theory.sim.step(...))
from distlab.theory.scaling import chinchilla_optimal, fit_power_law, gpu_seconds  # noqa: E402
from distlab.theory.landscape import accelerator_hours, implied_mfu, run_cost, tp_layer_time  # noqa: E402

__all__ = [
    "activation_bytes_per_layer", "pipeline_in_flight", "algbw", "busbw", "comm_time", "dp_volume",
    "fit_alpha_beta",
    "pp_volume", "tp_volume", "zero_volume", "cp_activation_bytes_per_layer", "cp_bytes_per_layer",
    "cp_saved_bytes_per_layer", "ring_attention_flops",
    "powersgd_elements", "powersgd_ratio", "local_sgd_volume", "quantized_bytes", "quantized_ratio",
    "quantized_volume", "int8_error", "step_time_on_link", "examples_factor", "linear_scaling_lr",
    "noise_scale",
    "steps_factor", "warmup_lr",
    "MemoryBreakdown", "bytes_per_param", "memory",
    "shard_numel", "OffloadEstimate", "OffloadTime", "zero2_offload", "zero3_offload", "gpt_params",
    "transformer_params", "bubble", "bubble_time", "Advice", "Plan", "advise", "cheapest_plan", "fits",
    "GPUS", "LINKS", "MODELS", "ModelPreset", "gpu", "link", "model", "chinchilla_tokens", "mfu",
    "scaling_efficiency",
    "throughput", "training_flops", "training_time", "GB", "GiB", "MB", "MiB",
    "MoEParams", "ep_memory", "ep_params_per_rank", "expert_capacity", "gpt_moe_params",
    "moe_all_to_all_bytes", "moe_layer_params", "moe_step_all_to_all_bytes", "expected_drop_fraction",
    "fsdp_volume", "fsdp_padding",
    "young_interval", "daly_interval", "waste_fraction", "checkpointed_wall_time", "interval_steps",
    "sim", "published", "calibrate", "precision", "scaling", "chinchilla_optimal",
    "fit_power_law", "gpu_seconds",
    "accelerator_hours", "implied_mfu", "run_cost", "tp_layer_time",
]
