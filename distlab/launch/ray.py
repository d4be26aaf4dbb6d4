"""Ray Train's path: the same ranks, started and restarted by a Ray cluster (``pip install 'distlab[ray]'``).

    report = dl.train("ddp", world_size=4, steps=40, checkpoint_dir="/shared/ck", checkpoint_every=5,
                      max_restarts=2, engine="ray")             # dl.train's strategies, on Ray Train
    run = distlab.launch.ray.launch(fn, world_size=4, max_failures=2)   # any function, like dl.launch

What runs where::

    driver (this process)             Ray cluster
    launch(fn, 4) ── TorchTrainer ──> controller ── worker group: 4 actors (ScalingConfig(num_workers=4))
                                         │            each: RANK, WORLD_SIZE, LOCAL_RANK set by Ray; the
                                         │            process group joined on a store bound to loopback
                                         │            (`LoopbackTorchConfig`); then torchrun's path
                                         │            (`distlab.launch.torchrun.launch_here`) runs fn
                                         │            and all-gathers every rank's result and trace
                                         └─ a worker dies: the whole group is torn down and started
                                            again, up to FailureConfig(max_failures) times
    <── Run (rank 0's return value: every rank's result, the merged trace)

Inside a rank nothing changes: ``dl.rank()``, ``dl.device()`` (``cuda:LOCAL_RANK`` under NCCL: Ray shares
every GPU of a node with the node's workers, `_TorchBackend.share_cuda_visible_devices`), collectives,
the tracer. gloo on the CPU; NCCL when ``use_gpu=True`` (one GPU per worker), as Ray's TorchConfig picks.

Checkpoints stay distlab's (`distlab.checkpoint`: every rank writes its shard into ``checkpoint_dir``,
which several machines must share); each committed ``step_N`` folder is also reported to Ray
(`report_checkpoint`: ``ray.train.report`` with a ``Checkpoint``, a barrier of every worker), which
copies it into the run's storage. A restarted group copies Ray's newest back into ``checkpoint_dir`` if that
lost it (`restore_checkpoint`) and resumes from the newest checkpoint there, bit for bit (Ray registers a
report when its controller next polls the workers, so its newest can lag the directory's by one). `attempt`
counts the group's starts (0 first), so planted faults (``fail_at_step``) fire on the first only.

Ray's elasticity and distlab's own, side by side:

    engine                  what a failure costs                        who keeps running
    dl.train max_restarts   every rank stops; a fresh launch on this    nobody: all restart (shrink=: on
      (engine="local")      machine resumes from the checkpoint         fewer ranks)
    dl.train                every worker stops; Ray starts a new group  nobody: all restart, on any node
      (engine="ray")        (on healthy nodes) from the checkpoint      with room (ScalingConfig)
    dl.elastic.train        the dead replica leaves the quorum; it      the survivors, without waiting
      (elastic replicas)    rejoins healed from a live peer             (`distlab.parallel.elastic`)

Ray restarts a *group* from a checkpoint (the steps since it are computed again); elastic replicas keep
the survivors stepping on the same global batch and lose no step. Ray replaces machines; elastic replicas
keep the others from waiting for one.

Security of the local cluster `start_local` makes: every Ray process on 127.0.0.1 (the node address
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` gives, which also makes Ray's gRPC servers listen on loopback
only), no dashboard, no usage statistics; the training store is bound to 127.0.0.1 too. Nothing is
downloaded. A cluster of several machines is yours to start (``ray start``) and to secure; call
``ray.init(address=...)`` before `launch` and it is used as it is.

Ray Train V2 (Ray 2.60, pinned by the extra): ``TorchTrainer(train_loop, train_loop_config=config(fn))``
runs any function the same way with your own ``ScalingConfig``/``RunConfig``.
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import cloudpickle

from . import rank as rank_side
from . import torchrun

LOOPBACK = "127.0.0.1"
#: per worker process: the store socket rank 0 bound (kept open for the group's life) and the group's start
_worker: dict = {"sock": None, "attempt": None}


def _ray():
    """Ray, imported with its node address on loopback (the variable is read when Ray is imported)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in (("RAY_agent_register_timeout_ms", "120000"), ("RAY_raylet_start_wait_time_s", "120")):
        os.environ.setdefault(name, value)             # Ray's agents start slowly on a busy CPU
    try:
        import ray
        import ray.train  # noqa: F401
        import ray.train.torch  # noqa: F401
    except ImportError as err:
        raise ImportError("Ray Train is not installed: pip install 'distlab[ray]' (ray[train]), or use "
                          "engine='local' / dl.launch") from err
    return ray


def start_local(num_cpus: int | None = None) -> None:
    """A one-machine Ray cluster on loopback (nothing listens beyond 127.0.0.1), unless Ray is already
    started or connected here (your cluster: used as it is)."""
    ray = _ray()
    if ray.is_initialized():
        return
    from ray._private import ray_constants
    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError("Ray was imported before distlab could keep its local cluster on loopback: set "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported, or start Ray "
                           "yourself (ray.init(...)) and distlab uses it as it is")
    for tries_left in (2, 1, 0):             # Ray gives its raylet 30 s to start, too few on a busy machine
        try:
            ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
                     log_to_driver=os.environ.get("DISTLAB_RAY_LOGS", "0") == "1", configure_logging=False)
            return
        except Exception as err:
            ray.shutdown()
            if not tries_left or "timed out during startup" not in str(err):
                raise


def launch(fn, world_size: int = 2, args: tuple = (), kwargs: dict | None = None, *,
           use_gpu: bool | None = None, max_failures: int = 0, storage_path=None, name: str | None = None,
           keep: int | None = None, timeout: float = 300.0, backend: str | None = None):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` Ray Train workers and return a `Run`, like `dl.launch`.

    ``max_failures``: Ray restarts the whole worker group up to that many times after a worker dies
    (``FailureConfig``); ``fn`` resumes from what it saved (`restore_checkpoint`). ``storage_path``: where
    Ray keeps its copies of reported checkpoints (default: Ray's); ``keep``: how many it keeps.
    ``use_gpu``: one GPU per worker (None: when the cluster has a GPU for each). ``backend``: "gloo" or
    "nccl" (default: NCCL when ``use_gpu``). A failed run raises `LaunchError`."""
    from .parent import Run
    from .supervisor import LaunchError
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    ray = _ray()
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    start_local()
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= world_size
    name = name or f"distlab-{uuid.uuid4().hex[:8]}"
    trainer = TorchTrainer(
        train_loop, train_loop_config=config(fn, args, kwargs),
        torch_config=LoopbackTorchConfig(backend=backend, timeout_s=int(timeout)),
        scaling_config=ScalingConfig(num_workers=world_size, use_gpu=use_gpu),
        run_config=RunConfig(name=name, storage_path=None if storage_path is None else str(storage_path),
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=keep)))
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as err:
        raise LaunchError(f"the Ray Train run failed after {max_failures} restart(s): {err}",
                          failures={0: str(err)}) from err
    return Run(**result.return_value)


def config(fn, args: tuple = (), kwargs: dict | None = None) -> dict:
    """``train_loop_config`` for `train_loop`: the function and its arguments, pickled by value (cells'
    functions travel too; so does the module of a function defined in a script or a test file, which
    Ray's workers could not import: they do not start in this directory)."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None) or ""
    by_value = (module is not None and path and "site-packages" not in path
                and module.__name__.split(".")[0] not in ("distlab", "__main__"))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return {"distlab_payload": cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))}
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def train_loop(cfg: dict) -> dict:
    """Ray Train's ``train_loop_per_worker``: count this start of the group, then torchrun's path runs
    the function on the group Ray formed; returns the fields of a `Run` (Ray keeps rank 0's)."""
    import torch.distributed as dist
    fn, args, kwargs = cloudpickle.loads(cfg["distlab_payload"])
    _worker["attempt"] = _count_start(dist)
    return torchrun.launch_here(fn, args, kwargs, "auto", 300.0, progress=False)


def attempt() -> int | None:
    """Which start of the worker group this is (0: the first; 1: after Ray's first restart); None outside
    a Ray Train worker of `train_loop`."""
    return _worker["attempt"]


def _count_start(dist) -> int:
    """Rank 0 counts the group's starts in a file of the run's storage (shared by its restarts) and tells
    every rank."""
    import pyarrow.fs
    import ray.train
    box = [None]
    if dist.get_rank() == 0:
        storage = ray.train.get_context().get_storage()
        fs, path = storage.storage_filesystem, f"{storage.experiment_fs_path}/distlab_starts"
        found = fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound
        if found:
            with fs.open_input_stream(path) as f:
                box[0] = int(f.read().decode())
        else:
            box[0] = 0
        with fs.open_output_stream(path) as f:
            f.write(str(box[0] + 1).encode())
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -- checkpoints: distlab's folders, reported to Ray ----------------------------------------------
def report_checkpoint(directory, step: int, metrics: dict | None = None) -> None:
    """Every rank, after checkpoint ``step`` committed in ``directory``: report it to Ray, which copies
    ``directory/step_{step}`` into its storage as checkpoint "step_{step}" (rank 0 hands it over; Ray
    waits for every worker's call)."""
    import ray.train
    import torch.distributed as dist
    folder = Path(directory) / f"step_{step}"
    mine = ray.train.Checkpoint.from_directory(str(folder)) if dist.get_rank() == 0 else None
    ray.train.report({"step": step, **(metrics or {})}, checkpoint=mine, checkpoint_dir_name=f"step_{step}")


def restore_checkpoint(directory) -> int | None:
    """Every rank, before training: the step of the newest checkpoint reported to Ray (None: none yet),
    copied back into ``directory/step_N`` by rank 0 where that folder is missing (a lost disk, a new
    node). Ray's copy is verified like any other when it is loaded (`distlab.checkpoint`)."""
    import ray.train
    import torch.distributed as dist
    box = [None]
    if dist.get_rank() == 0:
        reported = ray.train.get_checkpoint()
        if reported is not None:
            folder = Path(reported.path).name                       # "step_N", as reported
            box[0] = int(folder.split("_", 1)[1])
            target = Path(directory) / folder
            if not target.exists():
                with reported.as_directory() as here:
                    shutil.copytree(here, str(target) + ".from_ray")
                os.replace(str(target) + ".from_ray", target)
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -- the process group, its store on loopback --------------------------------------------------------
def _torch_config_class():
    """`LoopbackTorchConfig`, made when Ray is there (its base classes are Ray's)."""
    from ray.train.torch.config import TorchConfig, _set_torch_distributed_env_vars, _TorchBackend

    class _LoopbackBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config) -> None:
            """Ray's TorchConfig lets ``init_process_group("env://")`` serve the store on every interface;
            here rank 0 binds it to its node's address (loopback on a local cluster) first."""
            import ray
            n = len(worker_group)
            host = worker_group.execute_single(0, _node_address)
            port = worker_group.execute_single(0, _bind_store, host)
            worker_group.execute(_set_torch_distributed_env_vars)
            backend = backend_config.backend or ("nccl" if worker_group.get_resources_per_worker().get(
                "GPU", 0) > 0 else "gloo")
            ray.get([worker_group.execute_single_async(i, _join, host, port, i, n, backend,
                                                       backend_config.timeout_s) for i in range(n)])

    class LoopbackTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return _LoopbackBackend
    return LoopbackTorchConfig


def LoopbackTorchConfig(**kw):   # noqa: N802 (a class, made on first use: Ray is optional)
    """Ray's ``TorchConfig`` whose process group's store listens on the node's address only."""
    return _torch_config_class()(**kw)


def _node_address() -> str:
    import ray
    return ray.util.get_node_ip_address()


def _bind_store(host: str) -> int:
    """In rank 0: a listening socket for the store, bound before anyone connects (kept for the group)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen(128)
    _worker["sock"] = sock
    return sock.getsockname()[1]


def _join(host: str, port: int, rank: int, world: int, backend: str, timeout: float) -> None:
    """Each worker: MASTER_ADDR/PORT as torchrun's, gloo on loopback with a loopback store, then the group."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    rank_side._pin_gloo_to_loopback(host)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    wait = timedelta(seconds=timeout)
    sock = _worker["sock"] if rank == 0 else None
    store = (dist.TCPStore(host, port, world, is_master=True, master_listen_fd=sock.fileno(),
                           wait_for_workers=False, timeout=wait) if sock is not None
             else dist.TCPStore(host, port, world, is_master=False, timeout=wait))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
    dist.barrier()
