"""The fake backend: the same code at 1,024 or 16,384 ranks, run here, one listed rank after another.

    run = dl.launch(fn, world_size=1024, backend="fake", ranks=(0, 1023))
    run.results            # [what fn returned as rank 0, ... as rank 1023]: in the order of ``ranks``
    run.trace              # the events of ranks 0 and 1023

How: for each listed rank, in this process, ``init_process_group("fake", rank=r, world_size=N)`` (torch's
``FakeProcessGroup``, the one behind torchtitan's dry run and Megatron's ``--fake-process-group``),
run ``fn``, keep its result and trace, ``destroy_process_group``, next rank::

    rank 0:     init(fake, 0, N) -> fn() -> result, trace -> destroy
    rank 1023:  init(fake, 1023, N) -> fn() -> result, trace -> destroy

A fake group completes every collective at once and sends nothing: an all-reduce leaves its tensor as it
was, an all-gather fills the output with copies of this rank's input, a recv receives nothing. Shapes are
right, values are not: what one rank computes from its own shapes (its shards, its bytes, its peak) is
exact, what it learns from its peers is not. ``dist.new_group`` costs microseconds (no rendezvous), so a
mesh of thousands of groups builds at once. Inside, ``dl.device()`` is the ``meta`` device: tensors
have shapes and dtypes but no storage, so a 405B-parameter model "fits" on a laptop and its bytes are
counted from ``nbytes`` (`distlab.memory`). Nothing here gathers across ranks: each listed rank is a
world of its own, which is the point of a dry run (the other 1,022 ranks are never run).

One kernel choice is made here as the real device makes it: ``F.scaled_dot_product_attention`` on meta
tensors would take torch's math path (softmax(QK^T) materialised and saved: b a s^2 per call), where a
CPU or GPU run takes a fused kernel that saves only q, k, v, the output and the log-sum-exp (Dao et al.
2022, FlashAttention). `fused_attention_on_meta` routes it to that kernel's meta implementation, so a dry
run of Ulysses attention saves what a real run saves, to the byte (tests/test_dry_run.py).
"""
from __future__ import annotations

import contextlib
import io
import sys
import time
import traceback

from ..trace import Trace
from .supervisor import LaunchError


def check(world_size: int, ranks, backend: str) -> tuple[int, ...] | None:
    """The listed ranks as a tuple (None without ``ranks``), after refusing what a fake launch cannot do:
    ``ranks`` only with ``backend="fake"``, ``backend="fake"`` only with ``ranks``, every rank an int in
    ``0 .. world_size - 1``, none twice."""
    if ranks is None:
        if backend == "fake":
            raise ValueError("backend='fake' runs fn here as the ranks you list: pass ranks=(0,) (or e.g. "
                             f"ranks=(0, {world_size - 1}), the first and the last)")
        return None
    if backend != "fake":
        raise ValueError(f"ranks={ranks!r} lists the ranks a dry run runs here: pass backend='fake' too "
                         f"(backend={backend!r} runs every rank)")
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = (ranks,)
    try:
        listed = tuple(ranks)
    except TypeError:
        raise TypeError(f"ranks must be a list or tuple of rank numbers, e.g. (0,), got {ranks!r}") from None
    if not listed:
        raise ValueError("ranks=() lists no rank: pass at least one, e.g. ranks=(0,)")
    for r in listed:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ValueError(f"ranks={list(listed)}: {r!r} is not a rank of world_size={world_size} "
                             f"(ranks are 0 .. {world_size - 1})")
    if len(set(listed)) != len(listed):
        raise ValueError(f"ranks={list(listed)} lists a rank twice: list each once")
    return listed


def launch_fake(fn, world_size: int, ranks: tuple[int, ...], args: tuple, kwargs: dict,
                output: str) -> dict:
    """Run ``fn`` here as each of ``ranks`` of a ``world_size``-rank fake job; the fields of the `Run`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: a fake launch runs "
                           "its ranks here and needs it free (call dist.destroy_process_group() first)")
    started = time.perf_counter()
    results, traces, outputs, failures = [], {}, [], {}
    for r in ranks:
        ok, value, events, text = _one_rank(fn, r, world_size, args, kwargs)
        outputs.append(text)
        traces[r] = events
        if not ok:
            failures[r] = value
            break                                          # the same code would fail the same way again
        results.append(value)
    if output == "ordered":
        for r, text in zip(ranks, outputs):
            for line in text.splitlines():
                print(f"[rank {r}] {line}")
    if failures:
        (r, tb), = failures.items()
        raise LaunchError(f"rank {r} of the fake launch (world_size={world_size}) failed:\n{tb}", rank=r,
                          failures=failures, outputs=outputs)
    return dict(results=results, trace=Trace.merge(traces), outputs=outputs, world_size=world_size,
                backend="fake", start_method="in-process", seconds=time.perf_counter() - started)


def _one_rank(fn, r: int, world_size: int, args: tuple, kwargs: dict) -> tuple[bool, object, list, str]:
    """(ok, fn's value or the traceback, the trace events, the output) of ``fn`` run as rank ``r``."""
    import torch.distributed as dist

    from .. import runtime

    captured, hook = io.StringIO(), sys.excepthook     # init_process_group wraps the hook in "[rank r]: "
    # no store: torch then gives the fake group its FakeStore, which holds nothing (nobody rendezvous), and
    # registers the "fake" backend (torch.testing._internal.distributed.fake_pg) on first use
    dist.init_process_group("fake", rank=r, world_size=world_size)
    tracer = runtime._enter(r, world_size, 0, "fake")
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured), \
                fused_attention_on_meta():
            value, ok = fn(*args, **kwargs), True
    except Exception:
        value, ok = traceback.format_exc(), False
    finally:
        events = tracer.export()
        runtime._leave()
        dist.destroy_process_group()
        sys.excepthook = hook                            # this process is no rank once the rank is done
        sys.stdout.flush()
    return ok, value, events, captured.getvalue()


def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention on meta tensors by the fused CPU kernel (saves q, k, v, out, lse), or None where a real
    device would not take it either (a mask, dropout, grouped heads, other shapes): torch's choice then."""
    import torch
    if not all(isinstance(t, torch.Tensor) and t.is_meta and t.dim() == 4 for t in (q, k, v)):
        return None
    if attn_mask is not None or dropout_p or enable_gqa or q.shape[:2] != k.shape[:2]:
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                                       scale=scale)[0]


def fused_attention_on_meta():
    """A torch function mode for a fake launch's ranks: ``F.scaled_dot_product_attention`` on meta tensors
    runs the fused kernel a CPU or GPU run takes (`_fused_attention`), not the math path::

        real (CPU flash / GPU flash): saves q, k, v, out (b a s d each), lse (b a s fp32)
        meta without this:            saves the (b a s s) scores and probabilities besides
    """
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                out = _fused_attention(*args, **kwargs)
                if out is not None:
                    return out
            return func(*args, **kwargs)

    return Mode()
