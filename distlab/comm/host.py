"""Point-to-point of GPU tensors over gloo, through host memory.

gloo implements ``all_reduce``, ``broadcast`` and ``all_gather`` for CUDA tensors but no ``send`` or
``recv``: ``dist.isend(cuda_tensor, ...)`` on a gloo group raises. On a one-GPU machine the ranks that
share the GPU must use gloo (NCCL refuses two ranks on one device), so every pipeline stage boundary, every
context-parallel ring step and every ring of `dl.comm` would fail there. This module posts such a transfer
on a CPU copy and moves the bytes across the PCIe bus around it::

    send:  cuda tensor --copy to host--> cpu copy --gloo isend-->            (wait: done)
    recv:                                cpu buffer <--gloo irecv--  (wait: then copy to the cuda tensor)

`post` is what `comm.p2p` and `parallel.collectives` call instead of ``dist.isend``/``dist.irecv``: it
returns the Work itself where no staging is needed (CPU tensors, or NCCL), else a `HostStaged` that
behaves like one (``wait()``). The bytes recorded are the tensor's: the copies are the host's cost, not
the link's. Found on an H100 (issue 22): with 2 gloo ranks on one GPU, pp-*, cp-* and dl.comm failed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def needs_host(tensor: torch.Tensor, group=None) -> bool:
    """Whether a send/recv of ``tensor`` over ``group`` must go through host memory: a GPU tensor on gloo."""
    return tensor.device.type not in ("cpu", "meta") and dist.get_backend(group) == "gloo"


class HostStaged:
    """An ``isend`` (``send=True``) or ``irecv`` of ``tensor`` posted on a CPU copy of it; ``wait()``
    completes it (a receive then copies the bytes into ``tensor``), as a ``dist.Work`` would."""

    def __init__(self, send: bool, tensor: torch.Tensor, peer: int, group=None, tag: int = 0):
        self.send, self.tensor = send, tensor
        self.host = tensor.detach().to("cpu") if send else torch.empty(tensor.shape, dtype=tensor.dtype)
        self.work = (dist.isend if send else dist.irecv)(self.host, peer, group=group, tag=tag)

    def wait(self) -> bool:
        self.work.wait()
        if not self.send:
            self.tensor.copy_(self.host)
        return True


def post(send: bool, tensor: torch.Tensor, peer: int, group=None, tag: int = 0):
    """``dist.isend``/``dist.irecv`` of ``tensor`` to/from global rank ``peer``, through host memory
    where the backend cannot move it (`needs_host`). Returns something to ``wait()`` on."""
    if needs_host(tensor, group):
        return HostStaged(send, tensor, peer, group, tag)
    return (dist.isend if send else dist.irecv)(tensor, peer, group=group, tag=tag)
