"""The launcher room: `launch(fn, world_size)` runs a function on N ranks from a notebook cell and gives
everything back as a `Run`, or raises a `LaunchError` naming the rank that failed first and saying what
every rank was doing.

    run = dl.launch(train_step, world_size=4)
    run.results[2]; run.outputs[2]; run.trace      # rank 2's return value and output; every rank's trace

Read it in this order:

    parent.py      the parent side: checks, backend and start method, the rendezvous socket, the ranks
                   started from a fresh thread, the `Run` collected
    rank.py        the rank side: what each started process does, step by step, and why in that order
    supervisor.py  the parent's loop while ranks run (output, results, the root cause), `LaunchError`,
                   and the shutdown that leaves no process behind
    lifeline.py    the pipe and the subreaper that end a rank's whole process tree when the parent goes
    torchrun.py    torchrun's path: under RANK/WORLD_SIZE, ``fn`` runs in this process; a store prefix
                   per restart attempt
    ray.py         Ray Train's path (``pip install 'distlab[ray]'``): the ranks as Ray Train workers,
                   the group restarted by Ray from the newest checkpoint; ``dl.train(engine="ray")``
    flight.py      the flight recorder: each rank's last collectives in a ring buffer that outlives it
    diagnosis.py   the rings read after a hang, in words: who waits where, who never came
    fake.py        dry runs: ``backend="fake", ranks=(0, ...)`` runs ``fn`` here as each listed rank of a
                   job of any size, on torch's fake process group and the meta device
    replicas.py    elastic training's processes: a store of its own, a dead replica restarted alone while
                   the others keep their processes (`distlab.parallel.elastic`)
    profiler.py    ``profile=DIR``: every rank under torch.profiler, distlab's spans and collectives as its
                   ranges, one merged trace on the launch's time base

Nothing here imports `parallel`, the strategies, the checkpoints or the models: the launcher runs any
function, and the names of groups come from `distlab.runtime`.
"""
from .parent import Run, launch, resolve_backend, resolve_start_method, threads_per_rank
from .supervisor import LaunchError

__all__ = ["launch", "Run", "LaunchError", "resolve_backend", "resolve_start_method", "threads_per_rank"]
