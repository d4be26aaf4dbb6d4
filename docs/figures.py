"""Regenerates the pictures in README.md from real runs: python docs/figures.py"""
from pathlib import Path

import matplotlib
matplotlib.use("Agg")

import torch
import torch.distributed as dist

import distlab as dl

HERE = Path(__file__).resolve().parent


def uneven_work():
    """Lesson 00's straggler: rank r does 6(r+1) matmuls per step before an all-reduce."""
    tr = dl.tracer()
    x = torch.randn(400, 400) / 20
    t = torch.ones(1000)
    dist.all_reduce(t)                                # warm-up, untraced
    for step in range(3):
        with tr.span("compute", step=step):
            for _ in range(6 * (dl.rank() + 1)):
                x = torch.tanh(x @ x)
        with tr.comm_span("all_reduce", sent=t.numel() * 4, received=t.numel() * 4):
            dist.all_reduce(t)


if __name__ == "__main__":
    run = dl.launch(uneven_work, world_size=4, output="quiet")
    fig = dl.viz.timeline(run.trace, title="lesson 00: rank 3 is the straggler, "
                                           "the others wait in all_reduce")
    fig.savefig(HERE / "timeline.png", dpi=100)
    print("wrote", HERE / "timeline.png")
