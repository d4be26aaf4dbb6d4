"""Public model shapes, GPUs and interconnects, for calculators and quizzes.

Models (shapes from the papers / released configs):
  GPT-3 175B    Brown et al. 2020, Table 2.1: L=96, h=12288, 96 heads, context 2048, vocab 50257.
  Llama-2       Touvron et al. 2023b and the released config.json: 7B (L=32, h=4096, f=11008),
                13B (L=40, h=5120, f=13824), 70B (L=80, h=8192, f=28672, 8 KV heads); vocab 32000.
  Llama-3/3.1   Dubey et al. 2024, Table 3: 8B (L=32, h=4096, f=14336), 70B (L=80, h=8192, f=28672),
                405B (L=126, h=16384, f=53248), 8 KV heads, vocab 128256.

GPUs (NVIDIA data sheets; bf16 dense tensor-core TFLOPS, no sparsity):
  A100 40/80 GB 312; H100 SXM 80 GB 989; H200 141 GB 989; RTX 4090 24 GB 165 (fp32 accumulate).

Links (one direction, per GPU):
  NVLink 3 (A100) 300 GB/s, NVLink 4 (H100/H200) 450 GB/s  -- NVIDIA data sheets (600 / 900 both ways)
  PCIe 4.0 x16 32 GB/s, PCIe 5.0 x16 64 GB/s                -- PCI-SIG, 16 / 32 GT/s per lane
  InfiniBand HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s -- IBTA / NVIDIA ConnectX-6/7
  Ethernet 400 GbE = 50 GB/s, 100 GbE = 12.5 GB/s, 10 GbE = 1.25 GB/s -- IEEE 802.3 (bs, ba, ae)
Latencies are order-of-magnitude teaching values (a few microseconds on NVLink/PCIe/IB,
tens over TCP Ethernet), not specifications.
"""
from __future__ import annotations

from dataclasses import dataclass

from distlab.theory.params import transformer_params
from distlab.theory.units import GiB


@dataclass(frozen=True)
class ModelPreset:
    """A transformer shape; ``.params`` counts it with :func:`transformer_params`."""

    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq_len: int
    ffn: int | None = None
    kv_heads: int | None = None
    llama: bool = False          # SwiGLU, RMSNorm, no biases, untied output layer
    positions: int = 0           # learned position embeddings (GPT-3)

    @property
    def params(self) -> int:
        return transformer_params(
            self.hidden, self.layers, self.vocab, heads=self.heads, kv_heads=self.kv_heads,
            ffn=self.ffn, swiglu=self.llama, bias=not self.llama,
            norm="rmsnorm" if self.llama else "layernorm", tied=not self.llama, positions=self.positions)


@dataclass(frozen=True)
class GPUPreset:
    name: str
    memory: float                # bytes
    bf16_flops: float            # dense FLOP/s
    link: str                    # intra-node link, a key of LINKS


@dataclass(frozen=True)
class LinkPreset:
    name: str
    bandwidth: float             # bytes/s, one direction
    latency: float               # seconds per message (rough)


MODELS = {m.name: m for m in [
    ModelPreset("gpt3-175b", 12288, 96, 96, 50257, 2048, positions=2048),
    ModelPreset("llama2-7b", 4096, 32, 32, 32000, 4096, ffn=11008, llama=True),
    ModelPreset("llama2-13b", 5120, 40, 40, 32000, 4096, ffn=13824, llama=True),
    ModelPreset("llama2-70b", 8192, 80, 64, 32000, 4096, ffn=28672, kv_heads=8, llama=True),
    ModelPreset("llama3-8b", 4096, 32, 32, 128256, 8192, ffn=14336, kv_heads=8, llama=True),
    ModelPreset("llama3-70b", 8192, 80, 64, 128256, 8192, ffn=28672, kv_heads=8, llama=True),
    ModelPreset("llama3-405b", 16384, 126, 128, 128256, 8192, ffn=53248, kv_heads=8, llama=True),
]}

GPUS = {g.name: g for g in [
    GPUPreset("rtx4090-24gb", 24 * GiB, 165e12, "pcie4"),
    GPUPreset("a100-40gb", 40 * GiB, 312e12, "nvlink3"),
    GPUPreset("a100-80gb", 80 * GiB, 312e12, "nvlink3"),
    GPUPreset("h100-80gb", 80 * GiB, 989e12, "nvlink4"),
    GPUPreset("h200-141gb", 141 * GiB, 989e12, "nvlink4"),
]}

LINKS = {k.name: k for k in [
    LinkPreset("nvlink3", 300e9, 2e-6),
    LinkPreset("nvlink4", 450e9, 2e-6),
    LinkPreset("pcie4", 32e9, 5e-6),
    LinkPreset("pcie5", 64e9, 5e-6),
    LinkPreset("ib-hdr", 25e9, 5e-6),
    LinkPreset("ib-ndr", 50e9, 5e-6),
    LinkPreset("ethernet-400g", 50e9, 20e-6),
    LinkPreset("ethernet-100g", 12.5e9, 20e-6),
    LinkPreset("ethernet-10g", 1.25e9, 50e-6),
]}


def _lookup(table: dict, name: str, what: str):
    key = name.lower().replace("_", "-").replace(" ", "")
    for candidate in (key, key.replace("-", "")):
        for known in table:
            if candidate in (known, known.replace("-", "")):
                return table[known]
    raise ValueError(f"unknown {what} {name!r}: choose one of {', '.join(table)}")


def model(name: str) -> ModelPreset:
    """A model preset by name, e.g. ``"llama2-7b"`` (case, ``_`` and ``-`` are forgiven)."""
    return _lookup(MODELS, name, "model preset")


def gpu(name: str) -> GPUPreset:
    """A GPU preset by name, e.g. ``"h100-80gb"``."""
    return _lookup(GPUS, name, "GPU preset")


def link(name: str) -> LinkPreset:
    """An interconnect preset by name, e.g. ``"nvlink4"`` or ``"ib-ndr"``."""
    return _lookup(LINKS, name, "link preset")
