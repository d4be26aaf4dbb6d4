"""Offload: where the optimizer state of this rank's shards lives, and how the step reaches it.

ZeRO-Offload (Ren et al. 2021) keeps the fp32 master weights and the optimizer state of each rank's
shard in host memory and runs the optimizer step there, on the CPU; ZeRO-Infinity (Rajbhandari et al.
2021) adds the tier below, NVMe, streamed shard by shard. `OffloadedOptimizer` is both, around any torch
optimizer, for any list of tensors: ZeRO's shards (``dl.ZeRO(..., offload="cpu")``) or a
``fully_shard``-ed model's parameters (``OffloadedOptimizer(model.parameters(), torch.optim.AdamW)``):

    device                        host (CPU RAM; pinned on CUDA)           disk (offload_dir)
    shard p, its gradient g  -g->  g (fp32), master m (fp32)       <-read-  shard-i.pt: m, Adam's m1, m2
                                   optimizer.step() on m            -write->  (one shard at a time; the
                             <-m-  p.copy_(m)  (cast back to p's dtype)        next one read ahead)

    offload="cpu":   every shard's m and state live in host memory for the whole run
    offload="disk":  they live in files, one per shard (per flat bucket / parameter); host memory holds
                     about three shards' worth at once (stepping, read ahead, being written)

Bytes moved per rank per step, for Psi/N parameters in this rank's shards, K bytes of optimizer state
per parameter (Adam: 8) and 4 of fp32 master (the transfer formula `dl.theory.offload.step_time` uses):

    device <-> host:  g down, p up            2 x 4 Psi/N        (bf16 gradients/params: 2 x 2 Psi/N)
    host <-> disk:    m and state read, written  2 x (K + 4) Psi/N  (offload="disk" only)
    t_offload  ~  8 Psi/N / B_host  +  2 (K + 4) Psi/N / B_disk  +  t_step on the CPU

On CUDA the gradients go down into pinned buffers on a side stream, all launched before the first
shard steps, so shard i+1's copy overlaps shard i's step; the updated parameters go up on the same
stream. (Written for CUDA, exercised on CPU.) On a CPU "device" and "host" are one memory: the copies
still happen, and the memory ledger counts the offloaded bytes as ``host``/``disk``, not ``optimizer``
(`distlab.memory.offload_bytes`). Each shard is stepped by its own instance of the optimizer class:
elementwise optimizers (Adam, AdamW, SGD) give the same numbers, to the bit, as one instance over all.

Checkpoints: `state_dict` is torch's format with one index per shard, each holding its optimizer state and
its fp32 ``master`` (the only fp32 copy under mixed precision), read from the files for ``"disk"``; being
per-element, the master is resharded with Adam's moments when a run resumes on another world size.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

KINDS = ("cpu", "disk")


class OffloadedOptimizer:
    """``OffloadedOptimizer(params, torch.optim.AdamW, offload="cpu", lr=1e-3)``: the optimizer state
    and fp32 masters of ``params`` in host memory (``"cpu"``) or in files under ``offload_dir``
    (``"disk"``; default: a fresh temporary directory, removed with the optimizer); ``step()`` reads
    each parameter's ``.grad``, steps on the host and copies the result back into the parameter."""

    def __init__(self, params, optim: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 offload: str = "cpu", offload_dir=None, **optim_kwargs):
        if offload not in KINDS:
            raise ValueError(f"offload={offload!r}: choose 'cpu' (host memory) or 'disk' (files under "
                             "offload_dir)")
        if offload_dir is not None and offload != "disk":
            raise ValueError("offload_dir= is where offload='disk' keeps its files: pass offload='disk'")
        self.params = [p for p in params]
        if not self.params or not all(isinstance(p, torch.Tensor) for p in self.params):
            raise ValueError("OffloadedOptimizer takes a non-empty list of tensors (no parameter groups)")
        self.kind = offload
        cuda = self.params[0].is_cuda
        self.stream = torch.cuda.Stream(self.params[0].device) if cuda else None
        self.grads = [host_copy(p, pinned=True) for p in self.params] if cuda else None   # pinned, reused
        self.files = ShardFiles(offload_dir) if offload == "disk" else None
        self.masters = []
        for i, p in enumerate(self.params):
            m = host_copy(p, pinned=cuda).requires_grad_(True)
            if self.files is not None:                   # the master lives in its file between steps
                self.files.write(i, m.detach(), {})
                m.data = torch.empty(0)
            self.masters.append(m)
        self.optimizers = [optim([m], **optim_kwargs) for m in self.masters]

    # -- the torch.optim surface ---------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """One group per shard (the real dicts: changing ``lr`` in them changes the step)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        """The state held in memory now (``"disk"``: none between steps)."""
        return {m: s for o in self.optimizers for m, s in o.state.items()}

    def held(self) -> list[torch.Tensor]:
        """The host tensors alive now: masters, optimizer state, gradient buffers (the ledger's ``host``)."""
        state = [t for o in self.optimizers for st in o.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor)]
        return [*self.masters, *(self.grads or ()), *state]

    def disk_bytes(self) -> int:
        """Bytes of the offload files now (the ledger's ``disk``; 0 for ``"cpu"``)."""
        return self.files.nbytes() if self.files is not None else 0

    def close(self) -> None:
        """Remove the offload files (``"disk"``; also done when the optimizer is collected or the process
        exits normally: a forked rank that ends with ``os._exit`` needs this call)."""
        if self.files is not None:
            self.files.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None, grads=None):
        """Gradients down, every shard stepped on the host (``"disk"``: read, step, write back, one at
        a time, the next read ahead in a thread), parameters up. ``grads``: one gradient per parameter
        (of any float dtype: ZeRO's fp32 gradient shards) instead of their ``.grad``."""
        if closure is not None:
            raise ValueError("OffloadedOptimizer.step does not take a closure")
        grads = list(grads) if grads is not None else [p.grad for p in self.params]
        ready = self._download(grads)
        with self._tier() as tier:
            for i, (p, m) in enumerate(zip(self.params, self.masters)):
                if grads[i] is None:
                    continue
                tier.fetch(i)
                m.grad = self._host_grad(i, grads[i], ready)
                self.optimizers[i].step()
                m.grad = None
                self._upload(p, m)
                tier.release(i)
        if self.stream is not None:
            torch.cuda.current_stream(self.params[0].device).wait_stream(self.stream)

    # -- device <-> host -----------------------------------------------------------------------
    def _download(self, grads: list):
        """CUDA: launch every gradient's copy into its pinned buffer on the side stream (after the
        compute stream has produced it); returns one event per shard. CPU: nothing to launch."""
        if self.stream is None:
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.params[0].device))
        events = []
        with torch.cuda.stream(self.stream):
            for g, buf in zip(grads, self.grads):
                if g is not None:
                    g.record_stream(self.stream)
                    buf.copy_(g, non_blocking=True)
                events.append(self.stream.record_event() if g is not None else None)
        return events

    def _host_grad(self, i: int, grad: torch.Tensor, ready) -> torch.Tensor:
        if ready is not None:
            ready[i].synchronize()                          # shard i's gradient is in its pinned buffer
            return self.grads[i]
        return grad.to(torch.float32, copy=True)            # CPU: the host copy, fp32

    def _upload(self, p: torch.Tensor, m: torch.Tensor) -> None:
        if self.stream is None:
            p.copy_(m)
            return
        with torch.cuda.stream(self.stream):
            p.copy_(m, non_blocking=True)

    def _tier(self):
        return self.files.streaming(self) if self.files is not None else contextlib.nullcontext(_InMemory())

    # -- saving, and what a learner prints -----------------------------------------------------
    def state_dict(self) -> dict:
        """torch's optimizer format, one index per shard: ``{"state": {i: {**shard i's optimizer state,
        "master": its fp32 master}}, "param_groups": [one group per shard, "params": [i]]}`` (``"disk"``:
        read from the files). The master is saved because under mixed precision it is the only fp32 copy;
        as a per-element tensor it is resharded with Adam's moments when the world size changes."""
        state = {}
        for i, (o, m) in enumerate(zip(self.optimizers, self.masters)):
            if self.files is not None:
                saved = self.files.read(i)
                master, held = saved["master"], saved["state"]
            else:
                master, held = m.detach(), o.state.get(m, {})
            state[i] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in held.items()},
                        "master": master.clone()}
        groups = [{**{k: v for k, v in o.param_groups[0].items() if k != "params"}, "params": [i]}
                  for i, o in enumerate(self.optimizers)]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Put a `state_dict` back (``"disk"``: into the files). A shard without a saved ``"master"`` takes
        its parameter's current value (a checkpoint of another optimizer, restored into the parameters
        first); one without optimizer state starts it afresh, as a new optimizer would."""
        groups = state["param_groups"]
        if len(groups) != len(self.optimizers):
            raise ValueError(f"the state has {len(groups)} parameter groups; this offloaded optimizer has "
                             f"{len(self.optimizers)} shards (one group each)")
        for i, (o, m, p) in enumerate(zip(self.optimizers, self.masters, self.params)):
            saved = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                     for k, v in state["state"].get(i, state["state"].get(str(i), {})).items()}
            master = saved.pop("master", None)
            master = (master if master is not None else p.detach()).to(torch.float32, copy=True).cpu()
            group = {k: v for k, v in groups[i].items() if k != "params"}
            o.param_groups[0].update(group)
            if self.files is not None:
                self.files.write(i, master.reshape(p.shape), saved)
                continue
            m.copy_(master.reshape(p.shape))
            o.state.pop(m, None)
            if saved:
                o.state[m] = saved

    def __repr__(self) -> str:
        where = f"files under {self.files.path}" if self.files is not None else "host memory"
        return (f"OffloadedOptimizer({type(self.optimizers[0]).__name__}, {len(self.params)} shards, "
                f"state in {where})")


class _InMemory:
    """offload="cpu": every shard's master and state are in host memory already."""

    def fetch(self, i: int) -> None:
        pass

    def release(self, i: int) -> None:
        pass


class ShardFiles:
    """offload="disk": shard i's fp32 master and optimizer state in ``shard-i.pt`` under a fresh
    directory inside ``directory`` (or the system's temporary one), removed with its owner."""

    def __init__(self, directory=None):
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix="distlab-offload-", dir=directory)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.path, True)

    def close(self) -> None:
        self._cleanup()

    def file(self, i: int) -> str:
        return os.path.join(self.path, f"shard-{i}.pt")

    def write(self, i: int, master: torch.Tensor, state: dict) -> None:
        torch.save({"master": master, "state": state}, self.file(i))

    def read(self, i: int) -> dict:
        return torch.load(self.file(i), weights_only=True)

    def nbytes(self) -> int:
        """Bytes on disk now (the ledger's ``disk``)."""
        return sum(e.stat().st_size for e in os.scandir(self.path) if e.is_file())

    @contextlib.contextmanager
    def streaming(self, opt: OffloadedOptimizer):
        """One step's pass over the shards: a single worker thread reads shard i+1 while shard i steps
        and writes each stepped shard back (in order: a shard is written before it is read again)."""
        with ThreadPoolExecutor(1, thread_name_prefix="distlab-offload") as pool:
            stream = _Streaming(self, opt, pool)
            yield stream
            stream.finish()


class _Streaming:
    """The read-ahead and write-back of one step over ``opt``'s shards (`ShardFiles.streaming`)."""

    def __init__(self, files: ShardFiles, opt: OffloadedOptimizer, pool: ThreadPoolExecutor):
        self.files, self.opt, self.pool = files, opt, pool
        self.reads: dict[int, object] = {}
        self.writes: list = []

    def fetch(self, i: int) -> None:
        """Shard i's master and state into memory (waiting for its read); shard i+1's read started."""
        if i not in self.reads:
            self.reads[i] = self.pool.submit(self.files.read, i)
        loaded = self.reads.pop(i).result()
        following = i + 1
        if following < len(self.opt.params):
            self.reads[following] = self.pool.submit(self.files.read, following)
        master = self.opt.masters[i]
        master.data = loaded["master"].pin_memory() if self.opt.stream is not None else loaded["master"]
        if loaded["state"]:
            self.opt.optimizers[i].state[master] = loaded["state"]

    def release(self, i: int) -> None:
        """Shard i stepped: write its master and state back (in the thread), and drop them here."""
        master = self.opt.masters[i]
        state = self.opt.optimizers[i].state.pop(master, {})
        self.writes.append(self.pool.submit(self.files.write, i, master.detach(), state))
        master.data = torch.empty(0)

    def finish(self) -> None:
        for r in self.reads.values():           # a read ahead of a shard without a gradient
            r.result()
        for w in self.writes:
            w.result()                          # a failed write raises here


def host_copy(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """An fp32 copy of ``t`` in host memory (pinned, for asynchronous copies, when ``pinned``)."""
    out = torch.empty(t.shape, dtype=torch.float32, device="cpu", pin_memory=pinned)
    return out.copy_(t.detach())


def offloaded(optimizer) -> OffloadedOptimizer | None:
    """The `OffloadedOptimizer` behind ``optimizer`` (itself, or a ZeRO optimizer's inner one), or None."""
    for o in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(o, OffloadedOptimizer):
            return o
    return None
