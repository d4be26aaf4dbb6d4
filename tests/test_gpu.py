"""distlab on one GPU: every strategy of `dl.train` on CUDA tensors equals one process on the same global
batch, bf16 trains, and gloo carries CUDA tensors through torch's collectives. Skipped without CUDA.

One GPU only (the machine these run on is lent one): NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"), so the strategies run as a world of one rank on NCCL (`_gpu_facts.one_rank_world`: torchrun's
variables, `dl.train` runs in this process on ``cuda:0``), which runs every wrapper, hook, schedule and
shard on CUDA tensors with group-of-one collectives; the two-rank tests run gloo ranks sharing the GPU
(`dl.runtime.place_on`): torch's collectives, and DDP, whose all-reduce and broadcast gloo runs on CUDA.
`benchmarks/gpu_check.py` runs these (``pytest -m gpu``) first, and every other strategy on two ranks.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

import distlab as dl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from _gpu_facts import join_world, one_rank_world  # noqa: E402

# device_count(), not is_available(): it asks NVML and leaves CUDA uninitialised in this process, so that
# ranks forked later (tests/test_launch.py's NCCL launch, in the same session) can still use it
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.device_count(), reason="needs a CUDA GPU (none visible)")]

SGD = dict(steps=3, seed=0, optimizer="sgd", lr=0.1, global_batch=8, grad_accum=2)
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "tp-sp", "pp-gpipe", "pp-1f1b", "pp-zb-h1",
              "cp-ring", "cp-ulysses", "ep", "3d:dp=1,tp=1,pp=1",
              pytest.param("pp-interleaved", marks=pytest.mark.xfail(
                  reason="at pp=1 the interleaved schedule sends between its two local stages through "
                         "the process group; gloo refuses a send to itself (seen on CPU), NCCL may not",
                  strict=False))]


def _model(strategy: str) -> str:
    return "gpt-moe-tiny" if strategy == "ep" else "gpt-tiny"


@pytest.fixture(scope="module")
def on_cpu():
    """``single`` on the CPU, before any process group exists: {model: Report}."""
    return {m: dl.train("single", model=m, **SGD) for m in ("gpt-tiny", "gpt-moe-tiny")}


@pytest.fixture(scope="class")
def gpu_world(on_cpu):
    """A world of one rank on NCCL and cuda:0, for the class (gone before the two-rank launch);
    ``single`` on the GPU, {model: Report}."""
    with one_rank_world():
        join_world("nccl")
        assert dl.device().type == "cuda" and dl.backend() == "nccl"
        yield {m: dl.train("single", model=m, **SGD) for m in on_cpu}


def _assert_close(losses, params, ref, rel):
    """Losses and final parameters equal ``ref``'s (a Report) within ``rel`` (test_train's rule)."""
    assert losses == pytest.approx(ref.losses, rel=rel)
    assert sorted(params) == sorted(ref.params)
    for name, want in ref.params.items():
        err = (params[name].cpu() - want.cpu()).norm().item()
        assert err <= rel * want.norm().item() + 1e-7, (name, err / want.norm().item())


class TestOneRankOnNCCL:
    """Every test here runs inside one world of one rank on NCCL and cuda:0 (`gpu_world`)."""

    def test_single_on_the_gpu_equals_single_on_the_cpu(self, gpu_world, on_cpu):
        """The same fp32 arithmetic on two devices: equal up to the kernels' rounding."""
        for m, report in gpu_world.items():
            _assert_close(report.losses, report.params, on_cpu[m], rel=1e-4)

    @pytest.mark.parametrize("strategy", STRATEGIES)
    def test_every_strategy_on_one_gpu_equals_single(self, strategy, gpu_world):
        """Losses and final parameters of every strategy, on CUDA tensors under NCCL, equal ``single``'s on
        the same GPU and global batch (two accumulated micro-steps per step)."""
        report = dl.train(strategy, world_size=1, model=_model(strategy), **SGD)
        assert report.run.backend == "nccl"
        _assert_close(report.losses, report.params, gpu_world[_model(strategy)], rel=1e-5)
        assert report.memory[0]["peak_total"] > 0

    def test_bf16_mixed_on_the_gpu_stays_near_fp32(self, gpu_world):
        """bf16 autocast on CUDA (weights fp32): finite losses within bf16's rounding of the fp32 run's."""
        report = dl.train("single", model="gpt-tiny", **dict(SGD, precision="bf16-mixed"))
        assert all(torch.isfinite(torch.tensor(report.losses)))
        assert report.losses == pytest.approx(gpu_world["gpt-tiny"].losses, rel=2e-2)


def _gloo_on_cuda():
    """Inside a rank: torch's all_reduce and all_to_all_single on cuda:0 tensors through gloo."""
    cuda = torch.device("cuda", 0)
    r, n = dl.rank(), dl.world_size()
    t = torch.full((4,), float(r + 1), device=cuda)
    dist.all_reduce(t)
    sent = torch.arange(n * 2, dtype=torch.float32, device=cuda) + 100 * r      # block i goes to rank i
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent)
    return t.device.type, t.cpu().tolist(), got.cpu().tolist()


def test_gloo_carries_cuda_tensors_through_torch_collectives():
    """Two ranks on one GPU: gloo (NCCL would refuse) all-reduces and all-to-alls CUDA tensors."""
    run = dl.launch(_gloo_on_cuda, world_size=2, backend="gloo", start_method="spawn", output="quiet",
                    timeout=60)                  # spawn: this process has used CUDA, a forked child could not
    for r, (kind, reduced, got) in enumerate(run.results):
        assert kind == "cuda" and reduced == [3.0] * 4
        assert got == [2 * r + 100 * s + j for s in range(2) for j in range(2)]


def _strategy_on_cuda(spec):
    """Inside a gloo rank: compute on cuda:0 (`dl.runtime.place_on`), train, hand back CPU numbers."""
    from distlab import runtime
    from distlab.strategies import load
    runtime.place_on("cuda:0")
    result = load(spec.strategy)(spec)
    params = {k: v.cpu() for k, v in result.params.items()} if result.params else None
    return str(dl.device()), result.losses, params


def test_ddp_on_two_gloo_ranks_sharing_the_gpu_equals_single(on_cpu):
    """DDP needs only all-reduce and broadcast, which gloo runs on CUDA tensors: two ranks on one GPU equal
    one process (the CPU's single, within the two devices' rounding). The other strategies on two ranks are
    `gpu_check.py`'s multirank stage: a finding per strategy, as gloo has no CUDA send/recv."""
    from distlab.strategies import parse
    spec = parse("ddp", model="gpt-tiny", **SGD)
    run = dl.launch(_strategy_on_cuda, world_size=2, args=(spec,), backend="gloo", start_method="spawn",
                    output="quiet", timeout=60)
    assert [r[0] for r in run.results] == ["cuda:0", "cuda:0"]
    losses = next(r[1] for r in run.results if r[1] is not None)
    params = next(r[2] for r in run.results if r[2] is not None)
    _assert_close(losses, params, on_cpu["gpt-tiny"], rel=1e-4)
