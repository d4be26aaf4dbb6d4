"""Dry runs: the same code at 1,024 and 16,384 ranks in this process, on torch's fake process group and
tensors without storage (`distlab.launch.fake`), the model-state bytes equal to `dl.theory.memory`."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from distlab.memory import storage_bytes


def _who():
    mesh = dl.Mesh(dp=dl.world_size() // 64, tp=8, pp=8)
    x = torch.ones(4, device=dl.device())
    dist.all_reduce(x, group=mesh.group("tp"))                 # completes at once, nothing sent
    print("rank", dl.rank())
    return dl.rank(), dl.world_size(), dl.device().type, tuple(x.shape), mesh.coords().pp


@pytest.mark.parametrize("world", [1024, 16384])
def test_fake_launch_runs_the_listed_ranks_here_in_their_order(world):
    start = time.perf_counter()
    run = dl.launch(_who, world_size=world, backend="fake", ranks=(world - 1, 0), output="quiet")
    assert time.perf_counter() - start < 5                    # thousands of groups: no rendezvous
    assert run.results == [(world - 1, world, "meta", (4,), 7), (0, world, "meta", (4,), 0)]
    assert run.outputs == [f"rank {world - 1}\n", "rank 0\n"]
    assert run.backend == "fake" and run.world_size == world
    assert not dist.is_initialized()                          # each rank's group torn down after it


@pytest.mark.parametrize("kwargs, error", [
    (dict(backend="fake"), "pass ranks="),
    (dict(backend="gloo", ranks=(0,)), "pass backend='fake'"),
    (dict(backend="fake", ranks=(0, 8)), "8 is not a rank of world_size=8"),
    (dict(backend="fake", ranks=(1, 1)), "twice"),
    (dict(backend="fake", ranks=()), "no rank"),
    (dict(backend="fake", ranks=(-1,)), "not a rank"),
])
def test_fake_launch_refuses_bad_input_before_running(kwargs, error):
    ran = []
    with pytest.raises(ValueError, match=error):
        dl.launch(lambda: ran.append(1), world_size=8, **kwargs)
    assert not ran


def test_a_failing_rank_is_a_launch_error_naming_it():
    def fn():
        if dl.rank() == 3:
            raise RuntimeError("boom")
        return dl.rank()
    with pytest.raises(dl.LaunchError, match="boom") as info:
        dl.launch(fn, world_size=4, backend="fake", ranks=(0, 3), output="quiet")
    assert info.value.rank == 3
    assert not dist.is_initialized()


def test_storage_bytes_counts_tensors_without_storage_once_per_storage():
    from torch._subclasses.fake_tensor import FakeTensorMode
    meta = torch.empty(10, 3, device="meta")
    assert storage_bytes([meta, meta[2:], meta.view(30)]) == 120        # views: one storage
    assert storage_bytes([meta, torch.empty(5, device="meta")]) == 140   # distinct: both
    with FakeTensorMode():
        fake = torch.empty(1000, dtype=torch.bfloat16)
        assert storage_bytes([fake, fake[10:]]) == 2000
