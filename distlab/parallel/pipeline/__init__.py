"""``dl.pp``: pipeline parallelism -- schedules, stage splitting and the executor.

    loss = dl.pp.one_f_one_b(stage, x, target, microbatches=8)       # 1F1B by hand: three plain loops
    actions = dl.pp.schedule("1f1b", stages=4, microbatches=8)     # pure: per-rank action lists
    dl.pp.simulate(actions).bubble                                   # replayed on a clock
    stage = dl.pp.stage_module(gpt, stage_id=r, num_stages=4)        # this rank's slice of the model
    stage = dl.pp.named_stage(my_model, ["blocks.2", "norm", "head"])  # your model's, by module names
    stage = dl.pp.named_stage(llama, dl.pp.chain(llama)[3:])         # a Hugging Face decoder's blocks
    pipe = dl.pp.Pipeline(stage, r, 4, schedule="1f1b", microbatches=8,       # measured from outside:
                          observers=[dl.pp.ActionTrace(), dl.memory.PipelineStash()])
    loss = pipe.step(x=ids, target=targets)                          # loss on the last stage, else None
    dl.pp.measured_bubble(run.trace, step=1)                         # read back from the trace

Reading order:

    one_f_one_b.py   1F1B for one stage per rank as three loops (warm-up, steady, cool-down), sends and
                     receives inline: the textbook version of what the executor runs from a list
    schedule.py      the schedules as pure lists of actions, and a simulator that raises on deadlock
    split.py         cutting a model into contiguous stages
    named.py         stages of your own model by module names (chain, cut, named_stage), and the one
                     tensor a ModelOutput / tuple / dict passes on (tensor_of)
    decoders.py      Hugging Face decoders (Llama, Qwen2, Mistral, GPT-2) as chains: what a block takes
                     from its parent (rotary, positions, causal mask) recomputed on each stage
    p2p.py           activations forward, gradients backward between neighbouring stages
    executor.py      Pipeline: runs one rank's list of actions (receive, compute, send)
    zero_bubble.py   the split backward (I and W) of zero-bubble schedules
    grad_sync.py     ReplicaGradSync: data-parallel replicas of a stage all-reduce during the last backward
    aux_loss.py      ride_balance_losses: a stage's MoE layers carry their balance losses into backward
    measure.py       ActionTrace (a span per action) and reading a run back from its trace

``dl.pp.schedule`` and ``dl.pp.split`` are the functions; import from their modules by name
(``from distlab.parallel.pipeline.split import partition``), not as ``dl.pp.split.<name>``.
"""
from __future__ import annotations

from .executor import Observer, Pipeline, Stash, default_loss
from .aux_loss import AuxLoss, ride_balance_losses
from .grad_sync import ReplicaGradSync
from .schedule import SCHEDULES, Action, DeadlockError, Timeline, peak_activations, schedule, simulate
from .named import NamedStage, chain, check_stages, cut, named_stage, tensor_of
from .one_f_one_b import one_f_one_b
from .measure import ActionTrace, Bubble, executed, in_flight, measured_bubble, peak_in_flight
from .split import (GPTStage, MLPStage, SequentialStage, TimedStage, boundaries, partition, split,
                    stage_module, stage_names)

__all__ = ["one_f_one_b", "schedule", "simulate", "Action", "Timeline", "DeadlockError", "peak_activations",
           "SCHEDULES", "Pipeline", "Observer", "Stash", "default_loss", "split", "stage_module",
           "stage_names", "boundaries", "partition", "GPTStage", "MLPStage", "SequentialStage", "TimedStage",
           "ActionTrace", "measured_bubble", "Bubble", "executed", "in_flight", "peak_in_flight",
           "NamedStage", "named_stage", "chain", "cut", "check_stages", "tensor_of", "ReplicaGradSync",
           "AuxLoss", "ride_balance_losses"]
