"""Shared, cached `dl.train` runs for the data-parallel tests (each launch once per session)."""
from __future__ import annotations

import functools

import torch

import distlab as dl

STEPS = 3
# (strategy, world size, optimizer, options): every stage at 2, 3 and 4 ranks, SGD and AdamW with
# weight decay, even and uneven batch splits (global batch 10 over 3 or 4 ranks), several bucket
# sizes, both comm back-ends, naive and non-overlapped DDP, ZeRO-3 prefetch.
CASES = [
    ("ddp", 2, "adamw", dict(bucket_mb=0.05)),
    ("ddp", 3, "sgd", dict(bucket_mb=25.0)),
    ("ddp", 4, "adamw", dict(naive=True)),
    ("ddp", 2, "sgd", dict(overlap=False, comm="ring", bucket_mb=0.1)),
    ("zero1", 2, "adamw", dict()),
    ("zero1", 3, "sgd", dict(bucket_mb=0.05)),
    ("zero1", 4, "adamw", dict(comm="ring")),
    ("zero2", 2, "sgd", dict(bucket_mb=0.05)),
    ("zero2", 3, "adamw", dict(bucket_mb=0.1)),
    ("zero2", 4, "sgd", dict(overlap=False)),
    ("zero3", 2, "adamw", dict(prefetch=True)),
    ("zero3", 3, "sgd", dict(comm="ring")),
    ("zero3", 4, "adamw", dict()),
]
GLOBAL_BATCH = 10          # uneven over 3 and 4 ranks: rows (4,3,3) and (3,3,2,2)


def kwargs(optimizer: str) -> dict:
    return dict(steps=STEPS, seed=0, global_batch=GLOBAL_BATCH, optimizer=optimizer, weight_decay=0.1,
                lr=1e-3 if optimizer.startswith("adam") else 0.1)


@functools.lru_cache(maxsize=None)
def single(optimizer: str, **more) -> dl.Report:
    return dl.train("single", **kwargs(optimizer), **more)


@functools.lru_cache(maxsize=None)
def run(index: int) -> dl.Report:
    strategy, n, optimizer, options = CASES[index]
    return dl.train(strategy, world_size=n, **kwargs(optimizer), **options)


# The attention key bias has an exactly zero gradient (softmax(q.k + q.b) is shift-invariant for
# each query), so its computed gradient is pure rounding noise (~1e-9) that depends on the order of
# the sums; SGD moves it by noise, and Adam, normalising each coordinate, turns the noise into +-lr
# steps. No layout can reproduce noise, so it is left out of the per-tensor comparison (the losses,
# and every other tensor, are still compared).
NOISE_ONLY = ("attn.k.bias",)


def max_relative_error(params: dict, reference: dict) -> tuple[float, str]:
    """Largest per-tensor max|p - ref| / max|ref| (and which tensor)."""
    worst, name = 0.0, ""
    for k, ref in reference.items():
        if k.endswith(NOISE_ONLY):
            continue
        err = ((params[k] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        if err > worst:
            worst, name = err, k
    return worst, name


def global_relative_error(params: dict, reference: dict) -> float:
    """||theta - theta_ref|| / ||theta_ref|| over all parameters together."""
    num = sum(((params[k] - v) ** 2).sum() for k, v in reference.items())
    return (num / sum((v ** 2).sum() for v in reference.values())).sqrt().item()


def param_numel(report: dl.Report) -> int:
    """Distinct trainable parameters (a tied weight counts once)."""
    model = dl.models.build(report.spec.model, report.spec.seed)
    return sum(p.numel() for p in model.parameters())


def same_losses(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def assert_matches_single(report: dl.Report, optimizer: str) -> None:
    """Losses within 1e-5 relative per step; final parameters within 1e-5 relative.

    SGD: every tensor, element-wise (max|diff| / max|ref|). Adam divides each coordinate by its own
    gradient scale, so a coordinate whose gradient is ~eps (1e-8) turns fp32 summation-order noise
    (different on every world size) into a visible step; for Adam the 1e-5 bound is on the whole
    parameter vector (L2), and each tensor must still agree to 1e-3 in L2 (a tensor left un-updated,
    or updated twice, is off by ~1e-1).
    """
    ref = single(optimizer)
    assert same_losses(report.losses, ref.losses), (report.losses, ref.losses)
    tag = f"{report.strategy} x{report.world_size} {optimizer}"
    if optimizer == "sgd":
        err, name = max_relative_error(report.params, ref.params)
        assert err <= 1e-5, f"{tag}: {name} differs by {err:.2e} (relative)"
    else:
        assert global_relative_error(report.params, ref.params) <= 1e-5, tag
        for k, v in ref.params.items():
            if not k.endswith(NOISE_ONLY):
                assert ((report.params[k] - v).norm() / v.norm()).item() <= 1e-3, f"{tag}: {k}"


torch.set_num_threads(1)
