"""dl.launch: one test (at least) per requirement of the foundation issue, section 2."""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import distlab as dl
from _processes import child_pids

launch_module = importlib.import_module("distlab.launch.parent")   # the parent side (dl.launch: the function)

pytestmark = pytest.mark.usefixtures("no_leaks")


# -- functions the ranks run ------------------------------------------------------------------------
def rank_times(x):
    return dl.rank() * x


def all_reduce_ranks():
    t = torch.tensor([float(dl.rank())])
    dist.all_reduce(t)
    return t.item()


def chatty():
    print(f"print from {dl.rank()}")
    os.write(1, f"fd1 from {dl.rank()}\n".encode())
    os.write(2, f"fd2 from {dl.rank()}\n".encode())
    print(f"stderr from {dl.rank()}", file=sys.stderr)
    subprocess.run(["echo", f"subprocess from {dl.rank()}"], check=True)
    sys.stdout.write("no newline at the end")
    return dl.rank()


def traced():
    with dl.tracer().span("work", step=1):
        time.sleep(0.01)
    dl.tracer().comm("fake", start=0.0, end=0.001, sent=8 * (dl.rank() + 1))
    return None


def fails_on(bad_rank):
    if dl.rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} is broken")
    dist.barrier()


def fails_late(bad_rank):
    """Peers enter a collective first; the bad rank fails after them, so they die of it later."""
    if dl.rank() == bad_rank:
        time.sleep(0.3)
        raise ValueError("the real problem")
    dist.all_reduce(torch.ones(1))


def hard_exit(bad_rank, how):
    if dl.rank() == bad_rank:
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def hangs(sleeper):
    if dl.rank() == sleeper:
        time.sleep(60)
    dist.barrier()


def pg_timeout_seconds():
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def store_address():
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    listening = False
    if dl.rank() == 0:   # the rank that serves the store: is its socket bound to loopback only?
        with open("/proc/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        listening = any(r[1] == f"0100007F:{store.port:04X}" and r[3] == "0A" for r in rows)
    return store.host, store.port, listening


def returns_unpicklable():
    return threading.Lock()


def num_threads():
    return torch.get_num_threads()


# -- 1. start methods ---------------------------------------------------------------------------
def test_fork_is_the_default_on_linux_and_fast():
    run = dl.launch(rank_times, 4, args=(10,), output="quiet")
    assert run.start_method == "fork" and run.backend == "gloo"
    assert run.results == [0, 10, 20, 30]
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver_ship_closures_with_cloudpickle(method):
    offset = 5
    closure = lambda: dl.rank() + offset          # noqa: E731  (a lambda cannot be pickled by reference)
    run = dl.launch(closure, 2, start_method=method, output="quiet")
    assert run.start_method == method and run.results == [5, 6]


def test_auto_uses_spawn_when_cuda_is_initialised(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert launch_module.resolve_start_method("auto") == "spawn"
    assert "spawn" in capsys.readouterr().err
    with pytest.raises(ValueError, match="start_method='spawn'"):
        launch_module.resolve_start_method("fork")


def test_unpicklable_function_under_spawn_is_a_clear_error():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send .* to spawned ranks"):
        dl.launch(lambda: lock.locked(), 2, start_method="spawn")
    assert child_pids() == []


# -- 2. output ------------------------------------------------------------------------------------
def test_output_at_python_and_fd_level_is_relayed_in_rank_order(capsys):
    run = dl.launch(chatty, 3, output="ordered")
    printed = capsys.readouterr().out.splitlines()
    for r in range(3):
        mine = [line for line in printed if line.startswith(f"[rank {r}] ")]
        assert mine == [f"[rank {r}] {line}" for line in run.outputs[r].splitlines()]
        for text in ("print", "fd1", "fd2", "stderr", "subprocess"):
            assert f"{text} from {r}" in run.outputs[r]
        assert run.outputs[r].rstrip().endswith("no newline at the end")
    ranks_in_order = [int(line.split("]")[0].split()[1]) for line in printed]
    assert ranks_in_order == sorted(ranks_in_order)


def test_live_prints_tagged_lines_and_quiet_prints_nothing(capsys):
    dl.launch(chatty, 2, output="live")
    live = capsys.readouterr().out
    assert "[rank 0] print from 0" in live and "[rank 1] fd1 from 1" in live
    run = dl.launch(chatty, 2, output="quiet")
    assert capsys.readouterr().out == ""
    assert "print from 1" in run.outputs[1]


# -- 3. results and trace -------------------------------------------------------------------------
def test_results_and_merged_trace_come_back():
    run = dl.launch(traced, 3, output="quiet")
    assert run.results == [None, None, None]
    assert run.trace.ranks == [0, 1, 2]
    spans = run.trace.spans(name="work")
    assert len(spans) == 3 and all(s.duration >= 0.009 and s.args["step"] == 1 for s in spans)
    assert [run.trace.bytes_sent(rank=r) for r in range(3)] == [8, 16, 24]
    chrome = run.trace.to_chrome()["traceEvents"]
    assert sum(1 for e in chrome if e.get("ph") == "X") == 6


def test_collectives_work_across_ranks():
    assert dl.launch(all_reduce_ranks, 4, output="quiet").results == [6.0] * 4


# -- 4. errors and the root cause -----------------------------------------------------------------
def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(dl.LaunchError) as info:
        dl.launch(fails_on, 3, args=(1,), output="quiet")
    err = info.value
    assert err.rank == 1
    assert "ValueError: rank 1 is broken" in err.failures[1]
    assert "rank 1 failed" in str(err) and "rank 1 is broken" in str(err)


def test_root_cause_is_the_rank_that_failed_not_the_peers_it_took_down():
    with pytest.raises(dl.LaunchError) as info:
        dl.launch(fails_late, 4, args=(2,), output="quiet")
    assert info.value.rank == 2
    assert "the real problem" in str(info.value)


@pytest.mark.parametrize("how, expected", [("exit", "exited with code 7"), ("kill", "SIGKILL")])
def test_hard_exit_counts_as_a_failure_of_that_rank(how, expected):
    with pytest.raises(dl.LaunchError) as info:
        dl.launch(hard_exit, 3, args=(2, how), output="quiet")
    assert info.value.rank == 2 and expected in info.value.failures[2]


# -- 5. deadline ----------------------------------------------------------------------------------
def test_deadline_names_the_ranks_that_never_finished():
    start = time.monotonic()
    with pytest.raises(dl.LaunchError) as info:
        dl.launch(hangs, 3, args=(1,), timeout=2.0, output="quiet")
    assert time.monotonic() - start < 8
    assert info.value.rank is None and info.value.unfinished == [0, 1, 2]
    assert "deadline of 2 s passed" in str(info.value)


def test_process_group_timeout_follows_the_launch_timeout():
    assert dl.launch(pg_timeout_seconds, 2, timeout=42.0, output="quiet").results == [42.0, 42.0]


# -- 6. cleanup, including the notebook's stop button ---------------------------------------------
def test_keyboard_interrupt_leaves_nothing_running_and_the_next_launch_works():
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        dl.launch(hangs, 3, args=(0,), timeout=30, output="quiet")
    timer.join()
    assert child_pids() == []
    assert dl.launch(rank_times, 2, args=(1,), output="quiet").results == [0, 1]


def test_repeated_failures_leave_nothing_behind():
    for _ in range(3):
        with pytest.raises(dl.LaunchError):
            dl.launch(fails_on, 2, args=(0,), output="quiet")
    assert child_pids() == []


# -- 7. rendezvous --------------------------------------------------------------------------------
def test_rendezvous_listens_on_loopback_on_a_fresh_port():
    run = dl.launch(store_address, 2, output="quiet")
    (host, port, listening), (host1, port1, _) = run.results
    assert host == host1 == "127.0.0.1" and port == port1 and port != 29500
    assert listening, "rank 0's store socket should be bound to 127.0.0.1 only"


def test_simultaneous_launches_do_not_collide():
    results = {}

    def go(i):
        results[i] = dl.launch(store_address, 2, output="quiet").results[0][1]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results.values())) == 3


# -- 8. threads per rank --------------------------------------------------------------------------
def test_threads_per_rank_divide_the_cores():
    cores = len(os.sched_getaffinity(0))
    for n in (1, 2, 4):
        assert dl.launch(num_threads, n, output="quiet").results == [max(1, cores // n)] * n


# -- 9. backends ----------------------------------------------------------------------------------
def test_auto_backend_is_gloo_without_gpus_and_nccl_without_gpus_is_a_clear_error():
    if torch.cuda.device_count():        # (not is_available(): it would cuInit, and forked ranks fail)
        pytest.skip("this machine has GPUs")
    assert launch_module.resolve_backend("auto", 4) == "gloo"
    with pytest.raises(ValueError, match="needs one GPU per rank.*backend='gloo'"):
        dl.launch(rank_times, 2, args=(1,), backend="nccl")


# -- 10. torchrun ---------------------------------------------------------------------------------
def test_under_torchrun_launch_runs_in_place_and_gathers_results(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os\n"
        "import distlab as dl\n"
        "def f(x):\n"
        "    return dl.rank() * x\n"
        "run = dl.launch(f, world_size=2, args=(3,))\n"
        "line = f'RESULTS {dl.rank()} {run.results} {run.start_method}\\n'\n"
        "os.write(1, line.encode())   # one write: the two ranks share this pipe\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1",          # the script in tmp_path imports this checkout
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(dl.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RESULTS"))
    assert lines == ["RESULTS 0 [0, 3] torchrun", "RESULTS 1 [0, 3] torchrun"]


# -- 11. bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(world_size=0), ValueError, "world_size must be an integer >= 1"),
    (dict(world_size="2"), ValueError, "world_size must be an integer >= 1"),
    (dict(world_size=2, backend="mpi"), ValueError, "unknown backend 'mpi'"),
    (dict(world_size=2, start_method="thread"), ValueError, "unknown start_method"),
    (dict(world_size=2, output="loud"), ValueError, "unknown output mode"),
    (dict(world_size=2, timeout=0), ValueError, "timeout must be a positive"),
])
def test_bad_arguments_are_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        dl.launch(rank_times, args=(1,), **kwargs)
    assert child_pids() == []


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        dl.launch(42, 2)


def test_unpicklable_return_value_names_the_rank_and_says_what_to_do():
    with pytest.raises(dl.LaunchError) as info:
        dl.launch(returns_unpicklable, 2, output="quiet")
    assert "cannot be pickled" in str(info.value) and "return plain data" in str(info.value)


# -- progress of long runs --------------------------------------------------------------------------
def reports_progress(steps):
    for step in range(1, steps + 1):
        time.sleep(0.02)
        dl.progress(step, steps)
    return steps


def test_rank_zero_progress_reaches_the_parent_and_ends_at_the_total(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, enabled):
            self.enabled = enabled

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen.append("closed")

        def update(self, rank, step, total, label, postfix, shares=()):      # shares: the loss group's
            seen.append((rank, step, total, label, postfix))

    monkeypatch.setattr(launch_module, "ProgressBar", Recorder)
    assert dl.launch(reports_progress, 2, args=(30,), output="ordered").results == [30, 30]
    assert seen[-1] == "closed" and seen[-2] == (0, 30, 30, "step", {})
    steps = [s[1] for s in seen[:-1]]
    assert steps == sorted(steps) and 1 <= len(steps) < 30   # throttled, rank 0 only


def hangs_after_returning():
    if dl.rank() == 1:
        dist.destroy_process_group = lambda *a, **k: time.sleep(60)   # this rank's teardown never ends
    return dl.rank()


def test_a_rank_that_returned_but_hangs_at_exit_is_stopped_and_the_results_kept(capsys):
    start = time.monotonic()
    run = dl.launch(hangs_after_returning, 2, output="quiet")
    assert run.results == [0, 1]
    assert time.monotonic() - start < 20
    assert "rank(s) [1] returned but did not exit" in capsys.readouterr().err


# -- GPUs (skipped where there are none) ------------------------------------------------------------
def cuda_collectives():
    t = torch.full((5,), float(dl.rank() + 1), device=dl.device())
    dist.all_reduce(t)
    ours = dl.comm.ring_all_reduce(torch.full((5,), float(dl.rank() + 1), device=dl.device()))
    return str(dl.device()), t.cpu().tolist(), ours.cpu().tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.device_count(), reason="needs CUDA GPUs")   # NVML: CUDA left for the ranks
def test_auto_backend_uses_nccl_with_one_gpu_per_rank():
    n = torch.cuda.device_count()
    run = dl.launch(cuda_collectives, n, output="quiet")
    total = float(sum(range(1, n + 1)))
    assert run.backend == "nccl"
    assert [r[0] for r in run.results] == [f"cuda:{i}" for i in range(n)]
    assert all(r[1] == [total] * 5 and r[2] == [total] * 5 for r in run.results)
