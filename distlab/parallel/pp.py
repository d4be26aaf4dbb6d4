"""``dl.pp``: pipeline parallelism -- schedules, stage splitting and the executor.

    actions = dl.pp.schedule("1f1b", stages=4, microbatches=8)     # pure: per-rank action lists
    dl.pp.simulate(actions).bubble                                   # replayed on a clock
    stage = dl.pp.stage_module(gpt, stage_id=r, num_stages=4)        # this rank's slice of the model
    pipe = dl.pp.Pipeline(stage, r, 4, schedule="1f1b", microbatches=8)
    loss = pipe.step(x=ids, target=targets)                          # loss on the last stage, else None

Schedules: `distlab.parallel.schedule`; splitting: `distlab.parallel.stage`; executor:
`distlab.parallel.pipeline`; point-to-point links: `distlab.parallel.pipeline_p2p`.
"""
from __future__ import annotations

from .pipeline import Pipeline, default_loss
from .schedule import SCHEDULES, Action, DeadlockError, Timeline, peak_activations, schedule, simulate
from .pipeline_trace import Bubble, executed, in_flight, measured_bubble, peak_in_flight
from .stage import (GPTStage, MLPStage, SequentialStage, TimedStage, boundaries, partition, split, stage_module,
                    stage_names)

__all__ = ["schedule", "simulate", "Action", "Timeline", "DeadlockError", "peak_activations", "SCHEDULES",
           "Pipeline", "default_loss", "split", "stage_module", "stage_names", "boundaries", "partition",
           "GPTStage", "MLPStage", "SequentialStage", "TimedStage",
           "measured_bubble", "Bubble", "executed", "in_flight", "peak_in_flight"]
