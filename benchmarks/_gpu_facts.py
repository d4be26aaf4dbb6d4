"""What `gpu_check.py` needs to know about the machine: the device and its versions, its peak bf16 FLOP/s,
MFU, and a world of one rank that every strategy of `dl.train` runs in, in this process.

    facts = device_facts(device)                    # name, torch, CUDA, cuDNN, NCCL, date
    peak = peak_flops(facts["name"])                # None for a device not in the table: MFU omitted
    with one_rank_world():                          # torchrun's variables: dl.train runs here, NCCL or gloo
        report = dl.train("zero3", world_size=1)

Peak dense bf16 tensor-core FLOP/s, from NVIDIA's data sheets (the sheets print the figure "with sparsity",
twice the dense one; the dense one is used here, as MFU is defined on dense FLOPs):

    A100 SXM4 / PCIe   312 TFLOP/s   NVIDIA A100 Tensor Core GPU data sheet (2021), "BFLOAT16 Tensor Core"
    H100 SXM5          989 TFLOP/s   NVIDIA H100 Tensor Core GPU data sheet (2023): 1,979 with sparsity
    H100 PCIe          756 TFLOP/s   same sheet: 1,513 with sparsity
    H100 NVL           835 TFLOP/s   same sheet: 1,671 with sparsity
    H200 SXM           989 TFLOP/s   NVIDIA H200 Tensor Core GPU data sheet (2024): 1,979 with sparsity
    H200 NVL           835 TFLOP/s   same sheet: 1,671 with sparsity

MFU (model FLOPs utilisation, Chowdhery et al. 2022, "PaLM", Appendix B) = model FLOPs per second / peak,
with the model FLOPs of a training step taken as 6 N T (N parameters, T tokens: 2 N T forward, 4 N T
backward; Kaplan et al. 2020, Sec. 2.1). Here N counts every parameter, embeddings included, and the
attention term (12 L H Q T in PaLM's formula) is left out: at the short sequences of distlab's presets it is
a few percent.
"""
from __future__ import annotations

import contextlib
import os
import platform
import socket
import time

import torch

# (what the device name contains, lower case; peak dense bf16 FLOP/s; the variant): first match wins, so
# the specific names (PCIe, NVL) come before the family's SXM default
PEAKS = (
    ("h100 pcie", 756e12, "H100 PCIe"),
    ("h100 nvl", 835e12, "H100 NVL"),
    ("h100", 989e12, "H100 SXM5"),
    ("h200 nvl", 835e12, "H200 NVL"),
    ("h200", 989e12, "H200 SXM"),
    ("a100", 312e12, "A100"),
)
PEAK_SOURCE = ("NVIDIA data sheets (A100 2021, H100 2023, H200 2024), dense bf16 tensor-core FLOP/s "
               "(half the 'with sparsity' figure)")


def peak_flops(device_name: str) -> tuple[float, str] | None:
    """(peak dense bf16 FLOP/s, variant) of a device by its name, or None where the table does not know it."""
    name = device_name.lower()
    for key, flops, variant in PEAKS:
        if key in name:
            return flops, variant
    return None


def mfu(params: int, tokens: int, seconds: float, peak: float | None) -> float | None:
    """6 N T / t / peak (see the module docstring); None without a peak."""
    return None if peak is None else 6 * params * tokens / seconds / peak


def device_facts(device: torch.device) -> dict:
    """The device's name and memory, and the versions a GPU number depends on."""
    facts = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cuda": torch.version.cuda,
             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(name=props.name, memory_bytes=props.total_memory,
                     capability=f"{props.major}.{props.minor}", gpus_visible=torch.cuda.device_count(),
                     nccl=_nccl_version())
    else:
        facts.update(name=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    return facts


def _nccl_version() -> str | None:
    """NCCL's version as "2.27.3", None where torch cannot say (a build without NCCL)."""
    try:
        found = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(map(str, found)) if isinstance(found, tuple) else str(found)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_world():
    """torchrun's environment for a world of one (RANK=0, WORLD_SIZE=1): `dl.launch`, and so `dl.train`,
    then runs in this process (`distlab.launch.torchrun`), on NCCL and ``cuda:0`` where there is a GPU,
    else gloo on the CPU; ``single`` too, once the group exists (`dl.device()` follows the backend).
    Leaving restores the environment and tears the group down, so that later code sees no world."""
    import torch.distributed as dist

    from distlab import runtime
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        runtime._leave()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def join_world(backend: str = "auto") -> None:
    """Inside `one_rank_world`: make the process group now (the first `dl.train` would), so that
    ``single`` and `dl.device()` already see it."""
    import distlab as dl
    dl.launch(_nothing, world_size=1, backend=backend, output="quiet")


def _nothing() -> None:
    return None
