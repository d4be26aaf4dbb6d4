"""Point-to-point links between pipeline stages: activations forward, gradients backward.

Stage ``s`` lives on pipeline rank ``s % p``. Two kinds of message cross a stage boundary::

    stage s --- activation (s, j) ---> stage s+1        forward of microbatch j
    stage s <----- grad (s+1, j) ----- stage s+1        d loss / d (input of stage s+1)

Every message carries a tag made of (stage, microbatch, what), so gloo matches each receive with
its send whatever order the two ranks post them in (with p = 2 and interleaving, activations and
gradients flow both ways between the same pair of ranks). NCCL ignores tags and matches in issue
order; there the executor groups each action's sends with the next action's receives into one
``batch_isend_irecv`` (Megatron's ``send_forward_recv_backward``), which is what keeps two
neighbours' blocking sends from waiting on each other.

Shapes: a gradient has the shape of the activation it belongs to, which both sides know. An
activation's shape is only known to its sender, so the first time (stage, microbatch) crosses, a
small header (dtype, ndim, sizes) goes first; both sides cache it (torch.distributed.pipelining
infers shapes once in the same way). ``static_shapes=False`` sends the header every step.

Sends are never waited for in the middle of a step (``isend`` then carry on): a rank only ever
blocks on a receive it needs, exactly the rule `distlab.parallel.pipeline.schedule.simulate` replays, so a
schedule that simulates without deadlock also runs without one.

Every transfer goes through `distlab.parallel.collectives.Transfer`, the traced wrapper's point-to-point,
addressed by what its tag is made of (``what``: "activation", "grad" or "shape"; ``stage``: the sending
stage; ``microbatch``); the wrapper records it (bytes, ``peer`` and that address; anything else, such
as the ``step``, from the caller's `collectives.scope`). This file records nothing itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.p2p import Ring
from ..collectives import Transfer, start_together

ACT_HEADER, ACT, GRAD = 0, 1, 2
WHAT = {ACT_HEADER: "shape", ACT: "activation", GRAD: "grad"}
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.bool, torch.int16, torch.int8]
_HEADER_LEN = 10


class Links:
    """The transfers of one pipeline rank, with shape caching."""

    def __init__(self, group, num_stages: int, device: torch.device, static_shapes: bool = True):
        self.group, self.num_stages, self.device = group, num_stages, device
        self.static_shapes = static_shapes
        self.members = Ring.of(group).members              # global rank of each pipeline rank
        self.grouped = dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl"
        self.shapes: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        self._queue: list[Transfer] = []
        self._sends: list[Transfer] = []

    def owner(self, stage: int) -> int:
        """Global rank holding ``stage``."""
        return self.members[stage % len(self.members)]

    def tag(self, what: int, stage: int, microbatch: int) -> int:
        return (microbatch * self.num_stages + stage) * 3 + what

    # -- posting ---------------------------------------------------------------------------
    def _post(self, send: bool, tensor: torch.Tensor, peer: int, what: int, stage: int, mb: int) -> Transfer:
        """Post (under NCCL: queue until `flush`) message (what, stage, mb) to or from ``peer``; a send is
        never waited for mid-step."""
        t = Transfer(send, tensor, peer, self.group, self.tag(what, stage, mb), grouped=self.grouped,
                     what=WHAT[what], stage=stage, microbatch=mb)
        if self.grouped:
            self._queue.append(t)
        if send:
            self._sends.append(t)
        return t

    def flush(self) -> None:
        """Issue queued transfers as one group (NCCL); a no-op under gloo, where posts are immediate."""
        if self._queue:
            start_together(self._queue)
            self._queue = []

    def _wait(self, t: Transfer) -> torch.Tensor:
        if t.work is None:
            self.flush()
        return t.wait()

    # -- activations -----------------------------------------------------------------------
    def send_activation(self, stage: int, mb: int, act: torch.Tensor) -> None:
        """Send stage ``stage``'s output for microbatch ``mb`` to stage ``stage + 1``."""
        peer, key = self.owner(stage + 1), (stage, mb)
        known = self.shapes.get(key)
        if known is None or not self.static_shapes:
            self._post(True, _header(act, self.device), peer, ACT_HEADER, stage, mb)
        elif known != (act.shape, act.dtype):
            raise RuntimeError(f"stage {stage} output for microbatch {mb} changed shape from "
                               f"{tuple(known[0])} to {tuple(act.shape)} between steps: build the Pipeline "
                               "with static_shapes=False to send shapes every step")
        self.shapes[key] = (act.shape, act.dtype)
        self._post(True, act.contiguous(), peer, ACT, stage, mb)

    def recv_activation(self, stage: int, mb: int) -> "Incoming":
        """Post the receive of stage ``stage - 1``'s output for microbatch ``mb``."""
        src, key = self.owner(stage - 1), (stage - 1, mb)
        if key in self.shapes and self.static_shapes:
            shape, dtype = self.shapes[key]
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            return Incoming(self, self._post(False, buf, src, ACT, *key))
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        return Incoming(self, self._post(False, header, src, ACT_HEADER, *key), key=key)

    # -- gradients -------------------------------------------------------------------------
    def send_grad(self, stage: int, mb: int, grad: torch.Tensor) -> None:
        """Send d loss / d (input of ``stage``) for microbatch ``mb`` to stage ``stage - 1``."""
        self._post(True, grad.contiguous(), self.owner(stage - 1), GRAD, stage, mb)

    def recv_grad(self, stage: int, mb: int) -> "Incoming":
        """Post the receive of the gradient of stage ``stage``'s output (sent by stage ``stage + 1``)."""
        shape, dtype = self.shapes[(stage, mb)]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return Incoming(self, self._post(False, buf, self.owner(stage + 1), GRAD, stage + 1, mb))

    # -- completion ------------------------------------------------------------------------
    def wait_sends(self) -> None:
        """Wait for every send of the step (end of ``Pipeline.step``): their buffers can then be reused."""
        self.flush()
        for t in self._sends:
            self._wait(t)
        self._sends = []


class Incoming:
    """A receive in flight; ``take()`` waits and returns the tensor (after a shape header, if needed)."""

    def __init__(self, links: Links, transfer: Transfer, key: tuple[int, int] | None = None):
        self.links, self.transfer, self.key = links, transfer, key

    def take(self) -> torch.Tensor:
        links, t = self.links, self.transfer
        data = links._wait(t)
        if self.key is None:
            return data
        shape, dtype = _parse_header(data)
        links.shapes[self.key] = (shape, dtype)
        buf = torch.empty(shape, dtype=dtype, device=links.device)
        return links._wait(links._post(False, buf, t.peer, ACT, *self.key))


def _header(t: torch.Tensor, device) -> torch.Tensor:
    if t.dim() > _HEADER_LEN - 2:
        raise ValueError(f"pipeline activations may have at most {_HEADER_LEN - 2} dimensions, got {t.dim()}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"cannot send a {t.dtype} activation between stages; use one of {_DTYPES}")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER_LEN - 2 - t.dim())
    return torch.tensor(values, dtype=torch.int64, device=device)


def _parse_header(h: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    values = h.tolist()
    dtype, ndim = _DTYPES[values[0]], values[1]
    return torch.Size(values[2:2 + ndim]), dtype
