"""A step-time simulator: how long one training step of a dense transformer takes on a cluster.

It composes the other `dl.theory` pieces (no second formula for anything they already say):
FLOPs per layer (Narayanan et al. 2021, Eq. 3), collective times in the alpha-beta model
(`theory.comm`), memory per GPU (`theory.memory`, Korthikanti et al. 2022), and pipeline bubbles
replayed from the very action lists `dl.pp` executes (`parallel/pipeline/schedule.py`, pure Python,
imported when first needed: importing its package also loads the torch executor).

One microbatch on one pipeline stage (``layers / pp`` layers on ``tp x cp`` GPUs)::

    t_f = F_fwd / (peak x eff(h))            + TP / CP collectives of the forward    (critical path)
    t_b = (2 F_fwd + F_recompute) / (...)    + TP / CP collectives of the backward
    pipeline = simulate(schedule(name, pp, m, v), t_f, t_b, t_comm=p2p)   -> makespan (bubble inside)
    step = makespan + DP/ZeRO collectives not hidden under the last backward + overhead

    F_fwd per layer = 2 s b (2h^2 + 2 h kv) + 4 b s^2 h + 2 s b h f (x3/2 for SwiGLU)     (GEMMs)
    logits          = 2 s b h V forward (x3 with backward), spread evenly over the stages

Kernel efficiency: the matmuls run at ``compute x peak``; the memory-bound work around them (norms,
softmax, GeLU, dropout) moves about what the layer stores for its backward, Korthikanti's
s b h (34 + 5 a s / h) bytes, while the matmuls grow as 24 s b h^2, so::

    speed = compute x peak / (1 + h_half / h x (34 + 5 a s / h) / 34)

(the 5as/h term is absent with flash attention, which never writes the scores). Wide layers with
few long heads get close to ``compute``; a 2304-wide GPT with 2048-token scores does not.

Where the GPUs of a group sit decides its bandwidth (rails: one NIC per GPU; NCCL runs a channel per
NIC, so a group with k members per node moves k NICs' worth across nodes)::

    group inside one node        NVLink
    k members per node, >1 node  min(NVLink, k x NIC)

Outputs: ``step_time`` with its ``breakdown`` (compute, recompute, tp, cp, bubble, dp, overhead;
they sum to the step), ``memory`` per GPU, tokens/s, MFU (model FLOPs, PaLM's definition: no
recomputation), HFU and ``tflops_per_gpu`` (hardware FLOPs, recomputation included: Narayanan's
"achieved teraFLOP/s per GPU"), and ``days(tokens)``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from distlab.theory.activations import activation_bytes_per_layer
from distlab.theory.comm import comm_time
from distlab.theory.memory import MemoryBreakdown, memory as memory_bytes
from distlab.theory.presets import (GPUPreset, LinkPreset, ModelPreset, gpu as gpu_preset,
                                    link as link_preset, model as model_preset)

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class Efficiency:
    """What a cluster achieves of its data sheet: one set per table, never per row.

    ``compute``   share of peak FLOP/s the matmuls reach on a wide layer
    ``h_half``    the width at which a flash-attention layer's memory-bound work takes as long as
                  its matmuls (0: no memory-bound work)
    ``comm``      share of a link's bandwidth a collective reaches (nccl-tests busbw / peak)
    ``overhead``  seconds per step outside the layers (optimizer, data loading, launch gaps)
    ``per_action`` seconds per pipeline action outside the layers (a framework's per-call cost)
    ``per_collective`` seconds per tensor-parallel collective beyond its alpha-beta time (the Python
                  and autograd around the call; 0 on a GPU cluster, where launches overlap)
    """

    compute: float = 0.6
    h_half: float = 0.0
    comm: float = 0.8
    overhead: float = 0.0
    per_action: float = 0.0
    per_collective: float = 0.0


@dataclass(frozen=True)
class Cluster:
    """GPUs, how many share a node, the link inside a node and each GPU's link across nodes."""

    gpu: GPUPreset
    gpus_per_node: int = 8
    intra: LinkPreset | None = None
    inter: LinkPreset = field(default_factory=lambda: link_preset("ib-hdr"))

    @property
    def nvlink(self) -> LinkPreset:
        return self.intra or link_preset(self.gpu.link)


@dataclass(frozen=True)
class StepResult:
    """One predicted step. Times in seconds, memory in bytes per GPU, FLOP/s per GPU."""

    step_time: float
    breakdown: dict[str, float]
    memory: MemoryBreakdown
    tokens_per_step: int
    model_flops: float             # per step, whole cluster, no recomputation
    hardware_flops: float          # per step, whole cluster, recomputation included
    gpus: int
    peak_flops: float
    layout: dict
    fits: bool

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.gpus * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.step_time * self.gpus * self.peak_flops)

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved hardware teraFLOP/s per GPU (recomputation counted), Narayanan et al.'s column."""
        return self.hardware_flops / (self.step_time * self.gpus) / 1e12

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / (self.step_time * self.gpus) / 1e12

    def days(self, tokens: float) -> float:
        """Days to train on ``tokens`` tokens at this step time."""
        return tokens / self.tokens_per_s / SECONDS_PER_DAY


# --- FLOPs --------------------------------------------------------------------------------
def layer_flops(shape: ModelPreset, seq_len: int, micro_batch: int) -> tuple[float, float]:
    """(GEMM FLOPs of one layer's forward, of which attention scores: QK^T and AV) for one microbatch."""
    s, b, h = seq_len, micro_batch, shape.hidden
    kv = (shape.kv_heads or shape.heads) * (h // shape.heads)
    ffn = shape.ffn or 4 * h
    scores = 4 * b * s * s * h                                   # QK^T and AV, 2 b s^2 h each
    projections = 2 * s * b * (2 * h * h + 2 * h * kv)           # Q, O: h x h; K, V: h x kv
    mlp = 2 * s * b * h * ffn * (3 if shape.llama else 2)        # SwiGLU has three matrices
    return projections + scores + mlp, scores


def step_flops(shape: ModelPreset, seq_len: int, batch: int, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step on ``batch`` sequences: 3 passes, plus recomputation."""
    fwd, scores = layer_flops(shape, seq_len, batch)
    logits = 2 * seq_len * batch * shape.hidden * shape.vocab
    model = 3 * (shape.layers * fwd + logits)
    extra = {"none": 0.0, "selective": scores, "full": fwd}[recompute] * shape.layers
    return model, model + extra


# --- where a group sits ----------------------------------------------------------------------
def group_link(cluster: Cluster, size: int, stride: int, eff: Efficiency) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a collective over ``size`` ranks ``stride`` apart."""
    node = cluster.gpus_per_node
    if size * stride <= node:
        return cluster.nvlink.bandwidth * eff.comm, cluster.nvlink.latency
    per_node = max(1, node // stride)
    bandwidth = min(cluster.nvlink.bandwidth, per_node * cluster.inter.bandwidth)
    return bandwidth * eff.comm, cluster.inter.latency


# --- the step ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _actions(name: str, p: int, m: int, v: int):
    # the same lists dl.pp.Pipeline executes; schedule.py is pure Python (imported here, not at the
    # top, because importing the package distlab.parallel.pipeline also loads its torch executor)
    from distlab.parallel.pipeline.schedule import schedule
    return schedule(name, p, m, v)


def pipeline_time(name: str, p: int, m: int, v: int, t_f: float, t_b: float, t_comm: float) -> float:
    """Makespan of one step's pipeline, replayed by `dl.pp.simulate` on a clock (times per chunk)."""
    from distlab.parallel.pipeline.schedule import simulate
    return simulate(_actions(name, p, m, v), t_f=t_f, t_b=t_b, t_comm=t_comm).makespan


def _microbatch_times(shape, cluster, eff, layout) -> dict[str, float]:
    """Seconds one microbatch spends on one model chunk: compute, recompute, TP and CP comm."""
    tp, cp, pp, v = layout["tp"], layout["cp"], layout["pp"], layout["virtual"]
    s, b, h = layout["seq_len"], layout["micro_batch"], shape.hidden
    fwd, scores = layer_flops(shape, s, b)
    logits = 2 * s * b * h * shape.vocab
    chunks = pp * v
    scores_kept = "selective" if layout["flash"] else "none"
    stored = activation_bytes_per_layer(s, b, h, shape.heads, recompute=scores_kept)
    memory_bound = eff.h_half * stored / (34 * s * b * h) / h        # h_half / h for a flash-attention layer
    speed = cluster.gpu.bf16_flops * eff.compute / (1 + memory_bound)
    per_chunk = (shape.layers * fwd + logits) / chunks / (tp * cp)          # forward FLOPs per GPU
    extra = {"none": 0.0, "selective": scores, "full": fwd}[layout["recompute"]]
    recompute = shape.layers * extra / chunks / (tp * cp)
    layers = shape.layers / chunks
    e = layout["element"]                                                    # bytes per element
    message = e * (s // cp) * b * h                                         # one activation, bytes
    bw, lat = group_link(cluster, tp, 1, eff)
    tp_one = comm_time("all_reduce", message, tp, bw, lat)                   # = reduce-scatter + all-gather
    tp_one += eff.per_collective if tp > 1 else 0.0
    full = layout["recompute"] == "full"
    tp_f, tp_b = 2 * layers * tp_one, (2 + (2 if full else 0)) * layers * tp_one
    kv = 2 * (s // cp) * b * (shape.kv_heads or shape.heads) * (h // shape.heads) * e / tp   # K and V
    bw, lat = group_link(cluster, cp, tp, eff)
    cp_one = comm_time("all_gather", kv * cp, cp, bw, lat) if cp > 1 else 0.0
    cp_f, cp_b = layers * cp_one, (2 + (1 if full else 0)) * layers * cp_one
    return {"f": per_chunk / speed, "b": 2 * per_chunk / speed, "recompute": recompute / speed,
            "tp_f": tp_f, "tp_b": tp_b, "cp_f": cp_f, "cp_b": cp_b}


def _p2p_time(shape, cluster, eff, layout) -> float:
    """One activation (or its gradient) to the next stage; split over the TP ranks' own NICs
    (Narayanan et al. 2021, Sec. 4.1, scatter/gather)."""
    tp, cp, pp = layout["tp"], layout["cp"], layout["pp"]
    if pp == 1:
        return 0.0
    nbytes = layout["element"] * (layout["seq_len"] // cp) * layout["micro_batch"] * shape.hidden / tp
    inside = tp * cp * pp <= cluster.gpus_per_node
    link = cluster.nvlink if inside else cluster.inter
    return link.latency + nbytes / (link.bandwidth * eff.comm)


def _dp_time(shape, cluster, eff, layout, m: int) -> tuple[float, float]:
    """(DP / ZeRO communication per step, of which per microbatch for ZeRO-3), seconds.

    Context-parallel ranks hold the same weights as their data-parallel replicas, so gradients are
    reduced over dp x cp ranks (Megatron-LM's data-parallel-with-context-parallel group; distlab's
    ``cp-ring`` averages over the same ranks)."""
    dp, cp, zero = layout["dp"], layout["cp"], layout["zero"]
    n = dp * cp
    local = shape.params / (layout["tp"] * layout["pp"]) * layout["element"]   # bytes of this GPU's model
    stride = layout["tp"] if dp == 1 else layout["tp"] * layout["cp"] * layout["pp"]   # the widest hop
    bw, lat = group_link(cluster, n, stride, eff)
    if n == 1:
        return 0.0, 0.0
    grads = comm_time("reduce_scatter", local, n, bw, lat)
    gather = comm_time("all_gather", local, n, bw, lat)
    if zero == 3:                      # parameters gathered for every forward and backward
        return grads + 2 * m * gather, 2 * gather
    return grads + gather, 0.0         # ZeRO 0-2: reduce-scatter + all-gather = one all-reduce


def _layout(shape: ModelPreset, gpus, dp, tp, pp, virtual, cp, zero, global_batch, micro_batch, seq_len,
            recompute, schedule, sp, flash=False, precision="bf16-mixed") -> dict:
    """The layout as a dict, checked: every error says what to change."""
    degrees = (("tp", tp), ("pp", pp), ("cp", cp), ("virtual", virtual), ("micro_batch", micro_batch))
    for name, value in degrees:
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if dp is None:
        if gpus is None or gpus % (tp * pp * cp):
            raise ValueError(f"gpus={gpus} must be a multiple of tp x pp x cp = {tp * pp * cp} (or pass dp=)")
        dp = gpus // (tp * pp * cp)
    if gpus is not None and gpus != dp * tp * pp * cp:
        raise ValueError(f"gpus={gpus} != dp x tp x pp x cp = {dp * tp * pp * cp}")
    if global_batch % (dp * micro_batch):
        raise ValueError(f"global_batch={global_batch} must divide by dp x micro_batch = {dp * micro_batch}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    if seq_len % cp:
        raise ValueError(f"cp={cp} must divide seq_len={seq_len}")
    if shape.layers < pp:
        raise ValueError(f"{shape.layers} layers cannot fill pp={pp} pipeline stages: lower pp")
    schedule = schedule or ("interleaved" if virtual > 1 else "1f1b")
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "virtual": virtual, "zero": zero, "seq_len": seq_len,
            "global_batch": global_batch, "micro_batch": micro_batch, "recompute": recompute,
            "schedule": schedule, "sp": tp > 1 if sp is None else sp, "flash": flash, "precision": precision,
            "element": 4 if precision == "fp32" else 2, "layers": shape.layers,
            "microbatches": global_batch // (dp * micro_batch)}


def cluster(gpu: str | GPUPreset = "a100-80gb", gpus_per_node: int = 8, inter: str | LinkPreset = "ib-hdr",
            intra: str | LinkPreset | None = None) -> Cluster:
    """A `Cluster` from preset names (`theory.presets`): the GPU, GPUs per node, the per-GPU NIC."""
    card = gpu_preset(gpu) if isinstance(gpu, str) else gpu
    nic = link_preset(inter) if isinstance(inter, str) else inter
    inside = link_preset(intra) if isinstance(intra, str) else intra
    return Cluster(card, gpus_per_node, inside, nic)


def step(model: str | ModelPreset, gpu: str | GPUPreset | Cluster = "a100-80gb", gpus: int | None = None, *,
         dp: int | None = None, tp: int = 1, pp: int = 1, virtual: int = 1, cp: int = 1, zero: int = 0,
         global_batch: int = 1536, micro_batch: int = 1, seq_len: int | None = None,
         recompute: str = "selective", schedule: str | None = None, sp: bool | None = None,
         flash_attention: bool = False, precision: str = "bf16-mixed", overlap_dp: bool = True,
         efficiency: Efficiency | None = None,
         gpus_per_node: int = 8, inter: str = "ib-hdr", headroom: float = 0.9) -> StepResult:
    """Predict one training step of ``model`` (a preset name or a `ModelPreset`) on ``gpus`` GPUs.

    ``gpu`` is a preset name (then ``gpus_per_node`` and ``inter``, the per-GPU NIC, describe the
    cluster) or a `Cluster`. ``global_batch`` and ``micro_batch`` count sequences; the pipeline runs
    ``global_batch / (dp x micro_batch)`` microbatches under ``schedule`` (default 1F1B, interleaved
    when ``virtual > 1``). ``overlap_dp``: the DP/ZeRO collectives hide under the last backward.
    ``precision``: "bf16-mixed" (2-byte activations and gradients on the wire) or "fp32" (4 bytes);
    it changes the bytes only: compute is priced at the GPU's bf16 peak either way (the presets carry
    no fp32/tf32 peak), so an fp32 step comes out too fast.
    ``flash_attention``: the scores are never stored (memory as with selective recomputation, and
    no memory-bound softmax traffic).
    """
    shape = model_preset(model) if isinstance(model, str) else model
    where = gpu if isinstance(gpu, Cluster) else cluster(gpu, gpus_per_node, inter)
    eff = efficiency or Efficiency()
    lay = _layout(shape, gpus, dp, tp, pp, virtual, cp, zero, global_batch, micro_batch,
                  seq_len or shape.seq_len, recompute, schedule, sp, flash_attention, precision)
    m, v = lay["microbatches"], lay["virtual"]
    t = _microbatch_times(shape, where, eff, lay)
    t_f = t["f"] + t["tp_f"] + t["cp_f"] + eff.per_action
    t_b = t["b"] + t["recompute"] + t["tp_b"] + t["cp_b"] + eff.per_action
    makespan = pipeline_time(lay["schedule"], pp, m, v, t_f, t_b, _p2p_time(shape, where, eff, lay))
    dp_step, dp_micro = _dp_time(shape, where, eff, lay, m)
    if overlap_dp and lay["zero"] == 3:
        # each chunk's parameter all-gathers (dp_micro / v) hide under that chunk's forward and backward;
        # the gradients' reduce-scatter (dp_step - m x dp_micro) is counted exposed (conservative)
        exposed = m * v * max(0.0, dp_micro / v - (t["f"] + t["b"])) + (dp_step - m * dp_micro)
    elif overlap_dp:
        exposed = max(0.0, dp_step - t["b"] - t["recompute"])              # hides under the last backward
    else:
        exposed = dp_step
    busy = m * v * (t_f + t_b)
    breakdown = {"compute": m * v * (t["f"] + t["b"]), "recompute": m * v * t["recompute"],
                 "tp": m * v * (t["tp_f"] + t["tp_b"]), "cp": m * v * (t["cp_f"] + t["cp_b"]),
                 "bubble": makespan - busy, "dp": exposed,
                 "overhead": eff.overhead + 2 * m * v * eff.per_action}
    memory = _memory(shape, lay)
    model_flops, hardware_flops = step_flops(shape, lay["seq_len"], global_batch, lay["recompute"])
    return StepResult(step_time=sum(breakdown.values()), breakdown=breakdown, memory=memory,
                      tokens_per_step=global_batch * lay["seq_len"], model_flops=model_flops,
                      hardware_flops=hardware_flops, gpus=lay["dp"] * tp * pp * cp,
                      peak_flops=where.gpu.bf16_flops, layout=lay,
                      fits=memory.total <= headroom * where.gpu.memory)


def _memory(shape: ModelPreset, lay: dict) -> MemoryBreakdown:
    """`theory.memory` for the first pipeline stage (the fullest); context parallelism splits the
    activations by cp (Megatron's CP; `theory.context`)."""
    schedule = lay["schedule"] if lay["schedule"] in ("gpipe", "1f1b", "interleaved", "zb-h1") else "1f1b"
    recompute = "selective" if lay["flash"] and lay["recompute"] == "none" else lay["recompute"]
    mem = memory_bytes(shape, dp=lay["dp"], zero=lay["zero"], tp=lay["tp"], pp=lay["pp"],
                       precision=lay["precision"], seq_len=lay["seq_len"], micro_batch=lay["micro_batch"],
                       sp=lay["sp"], recompute=recompute, schedule=schedule,
                       microbatches=lay["microbatches"], virtual=lay["virtual"])
    return replace(mem, activations=mem.activations / lay["cp"])
