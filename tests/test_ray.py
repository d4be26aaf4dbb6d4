"""Ray Train's path (`distlab.launch.ray`, ``dl.train(..., engine="ray")``) on a one-machine Ray cluster on
loopback: the same losses as `dl.launch`, a worker killed mid-run and the group restarted by Ray from the
checkpoint to the same losses, and nothing listening beyond 127.0.0.1. Skipped without Ray
(``pip install 'distlab[ray]'``); slow (Ray takes tens of seconds to start), so `make test-slow` runs it."""
from __future__ import annotations

import ipaddress
import os

import pytest

# Ray reads it when imported: its node address (and so every gRPC server) on loopback, as distlab sets it
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray.train", reason="Ray Train is not installed: pip install 'distlab[ray]'")

import distlab as dl  # noqa: E402
from distlab.launch import ray as ray_train  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local cluster for the module (starting one takes ~30-50 s on 2 cores), shut down after it."""
    import ray as ray_core
    started = not ray_core.is_initialized()
    ray_train.start_local(num_cpus=2)
    yield
    if started:
        ray_core.shutdown()


def _listening(process) -> list[str]:
    """The addresses ``process`` listens on (TCP)."""
    return [c.laddr.ip for c in process.net_connections(kind="tcp") if c.status == "LISTEN"]


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _rank_facts(x):
    """On each worker: its rank, the world, the device, a sum over every rank, and what it listens on."""
    import psutil
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dl.rank() + 1)], device=dl.device())
    dist.all_reduce(t)
    return dl.rank(), dl.world_size(), str(dl.device()), t.item() * x, _listening(psutil.Process())


def test_launch_runs_any_function_on_loopback_only():
    """`launch` gives back a `Run` like `dl.launch`; every socket of the workers (the process group's
    store, gloo) and of Ray's own processes here listens on loopback."""
    import psutil
    run = ray_train.launch(_rank_facts, world_size=2, args=(10.0,))
    assert [r[:4] for r in run.results] == [(0, 2, "cpu", 30.0), (1, 2, "cpu", 30.0)]
    workers = [ip for r in run.results for ip in r[4]]
    assert workers and all(_loopback(ip) for ip in workers), workers
    ours = [ip for p in psutil.Process().children(recursive=True) for ip in _listening(p)]
    assert ours and all(_loopback(ip) for ip in ours), ours


def test_two_workers_equal_dl_launch():
    """DDP on 2 Ray workers: the losses and final parameters of the same training under `dl.launch`."""
    import torch
    kw = dict(world_size=2, steps=5, seed=3, global_batch=6)
    on_ray = dl.train("ddp", engine="ray", **kw)
    local = dl.train("ddp", **kw)
    assert on_ray.losses == pytest.approx(local.losses, rel=1e-6)
    for name, p in local.params.items():
        torch.testing.assert_close(on_ray.params[name], p, rtol=1e-5, atol=1e-7)
    assert on_ray.results[0].info["ray"] == {"attempt": 0, "reported": None}


def test_killed_worker_is_restarted_by_ray_from_the_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed at the start of step 5; Ray (FailureConfig(max_failures=1)) starts a new group,
    which resumes from checkpoint 3 and ends with the losses of the run without a fault."""
    kw = dict(world_size=2, steps=8, seed=1, global_batch=6)
    faulty = dl.train("ddp", engine="ray", checkpoint_dir=tmp_path / "ck", checkpoint_every=3,
                      max_restarts=1, fail_at_step=5, fail_rank=1, **kw)
    clean = dl.train("ddp", **kw)
    assert faulty.losses == pytest.approx(clean.losses, rel=1e-6)
    info = faulty.results[0].info
    assert info["ray"]["attempt"] == 1                     # the second start of the group
    assert info["checkpoint"]["resumed_from"] == 3         # steps 3 and 4 computed twice
    assert info["ray"]["reported"] in (None, 3)            # Ray may not have polled step 3's report yet
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == ["step_3", "step_6", "step_8"]


def test_without_restarts_the_failure_is_a_launch_error(tmp_path):
    """max_restarts=0 (FailureConfig(max_failures=0)): the killed worker ends the run with `LaunchError`."""
    with pytest.raises(dl.LaunchError, match="Ray Train run failed"):
        dl.train("ddp", engine="ray", world_size=2, steps=4, checkpoint_dir=tmp_path / "ck",
                 checkpoint_every=2, fail_at_step=1)


def test_what_ray_cannot_do_is_refused_before_it_starts(tmp_path):
    with pytest.raises(ValueError, match="not 'single'"):
        dl.train("single", engine="ray", steps=2)
    with pytest.raises(ValueError, match="drop shrink"):
        dl.train("ddp", engine="ray", world_size=2, steps=4, checkpoint_dir=tmp_path / "ck",
                 checkpoint_every=2, max_restarts=1, shrink=True, check_only=True)
