"""GPU tensors over gloo go through host memory for send/recv (`distlab.comm.host`): gloo has no CUDA
send/recv (found on an H100 with 2 gloo ranks sharing the GPU). The staging itself is checked here on
CPU tensors; which transfers take it (`needs_host`) is checked on the device names."""
from __future__ import annotations

import torch
import torch.distributed as dist

import distlab as dl
from distlab.comm import host


def _staged_round_trip():
    me, peer = dl.rank(), 1 - dl.rank()
    out = torch.arange(6, dtype=torch.float64) + 10 * me
    into = torch.zeros(2, 6, dtype=torch.float64)
    works = [host.HostStaged(True, out, peer), host.HostStaged(False, into[1], peer)]   # a view to land in
    done = [w.wait() for w in works]
    plain = host.post(True, out, peer), host.post(False, into[0], peer)               # CPU: gloo's own Work
    for w in plain:
        w.wait()
    return done, into.tolist(), [isinstance(w, host.HostStaged) for w in plain]


def test_host_staged_send_and_receive_land_in_the_tensor_and_its_views():
    run = dl.launch(_staged_round_trip, world_size=2, backend="gloo", output="quiet")
    for r, (done, into, staged) in enumerate(run.results):
        theirs = [float(i + 10 * (1 - r)) for i in range(6)]
        assert done == [True, True] and into == [theirs, theirs] and staged == [False, False]


def _needs(device):
    return host.needs_host(torch.empty(1, device=device))


def test_only_gpu_tensors_on_gloo_are_staged(monkeypatch):
    assert dl.launch(_needs, world_size=2, args=("cpu",), output="quiet").results == [False, False]

    class FakeCuda:
        device = torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert host.needs_host(FakeCuda()) is True
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert host.needs_host(FakeCuda()) is False
