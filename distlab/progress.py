"""Progress of a training run: a tqdm bar (step, loss, it/s) where the person who started it looks.

    report = dl.train("zero2", world_size=4, steps=200)        # a bar in the cell, or on the terminal
    report = dl.train("zero2", world_size=4, progress=False)   # none

How a step reaches the bar::

    rank 0 ──("progress", 0, step, total, label, {})────────┐   result pipe, at most 10 a second
    rank p-1 ─("progress", p-1, step, total, label, {loss})─┤   (and always the last step)
                                                            v
    parent: Supervisor ── on_progress ──> ProgressBar ──> tqdm.auto: a widget in Jupyter, text on a terminal

The bar lives in the parent, the process that owns the notebook cell or the terminal, so it renders
as a real widget; ranks only send small messages. Rank 0 drives the step count. The loss shown is
the one the report's table shows: each rank that holds a share of it (a data-parallel replica: its
part of the batch) sends its share with `share` and the ranks whose shares add up to it; the parent
shows the sum once every one of them has sent the step's (no communication between ranks). Until then,
and for values sent with `progress` alone, the lowest rank's value is shown. A run in this very
process (``single``, or rank 0 under torchrun, which then shows only its own loss) feeds a bar here
directly.

When a bar is shown (``progress=None``, the default): when a person is watching. That is a notebook
cell run from a front end that can answer ``input()`` (JupyterLab, Notebook, VS Code), or a
terminal (stderr a TTY). Notebooks executed by machines (nbval, nbconvert, papermill) run their
cells with ``allow_stdin=False`` and get no bar, so stored lesson outputs stay deterministic;
neither do pipes, files or pytest's captured output. ``DISTLAB_PROGRESS=1`` (or ``0``) forces it.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time

_MIN_INTERVAL = 0.1
# conn: a rank's result pipe (set by `_attach` in a launched rank); sink: a bar in this process
# shares: (step, name, value, members) not sent yet
_channel = {"conn": None, "sink": None, "last": 0.0, "shares": []}


def _attach(conn) -> None:
    """Called in a rank started by `launch`: progress goes up this connection."""
    _channel.update(conn=conn, sink=None, last=0.0, shares=[])


def share(step: int, name: str, value: float, members: tuple[int, ...]) -> None:
    """This rank's share of the value ``name`` at ``step``, summed with those of the global ranks
    ``members`` (this one among them) into what the bar shows; it travels with the next `progress`."""
    if _channel["conn"] is not None or _channel["sink"] is not None:
        _channel["shares"].append((int(step), str(name), float(value), tuple(members)))


def progress(step: int, total: int, label: str = "step", **postfix: float) -> None:
    """Report that ``step`` of ``total`` units are done, with values to show beside the count
    (``loss=2.31``). Call it on every rank: rank 0 reports the count; any other rank reports only when
    it has ``postfix`` values (the pipeline's last stage holds the loss)."""
    from .runtime import rank

    conn, sink, me = _channel["conn"], _channel["sink"], rank()
    if (conn is None and sink is None) or (me != 0 and not postfix and not _channel["shares"]):
        return
    now = time.monotonic()
    if step < total and now - _channel["last"] < _MIN_INTERVAL:
        return
    _channel["last"] = now
    shares, _channel["shares"] = _channel["shares"], []
    message = (int(step), int(total), str(label), {k: float(v) for k, v in postfix.items()}, shares)
    if sink is not None:
        sink(me, *message)
    else:
        conn.send_bytes(pickle.dumps(("progress", me, *message)))


def shown_by_default() -> bool:
    """Whether a person is watching: see the module docstring (``DISTLAB_PROGRESS`` overrides)."""
    forced = os.environ.get("DISTLAB_PROGRESS", "").strip().lower()
    if forced in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        return forced in ("1", "true", "yes", "on")
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if type(shell).__name__ == "ZMQInteractiveShell":
        # ipykernel records the running request's allow_stdin: True from a person's front end
        return bool(getattr(getattr(shell, "kernel", None), "_allow_stdin", False))
    return sys.stderr is not None and sys.stderr.isatty()


class ProgressBar:
    """Parent side: a tqdm bar opened on rank 0's first message, closed at the end of the launch."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        self.postfix: dict[str, float] = {}
        self._from: int | None = None                  # the rank whose values are shown
        self._parts: dict[tuple, dict[int, float]] = {}     # (name, step, members) -> {rank: share}
        self._summed: dict[str, tuple[int, float]] = {}     # name -> (step, sum) of the newest whole sum

    def update(self, rank: int, step: int, total: int, label: str, postfix: dict, shares=()) -> None:
        if not self.enabled:
            return
        if postfix and (self._from is None or rank <= self._from):
            self._from, self.postfix = rank, dict(postfix)
        self._add(rank, shares)
        self.postfix.update({name: value for name, (_, value) in self._summed.items()})
        if rank != 0:
            return
        if self.bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:                            # a declared dependency, but never cost a run
                print("distlab: no progress bar without tqdm: pip install tqdm", file=sys.stderr)
                self.enabled = False
                return
            self.bar = tqdm(total=total, initial=max(step - 1, 0), unit=label, dynamic_ncols=True)
        self.bar.set_postfix(self._shown(), refresh=False)
        self.bar.update(step - self.bar.n)

    def _add(self, rank: int, shares) -> None:
        """Collect ``rank``'s shares; a step's sum is whole once every member's share is in."""
        for step, name, value, members in shares:
            parts = self._parts.setdefault((name, step, members), {})
            parts[rank] = value
            if len(parts) == len(members) and step >= self._summed.get(name, (-1, 0.0))[0]:
                self._summed[name] = (step, sum(parts[r] for r in sorted(parts)))
                self._parts = {k: v for k, v in self._parts.items() if k[0] != name or k[1] > step}

    def _shown(self) -> dict[str, str]:
        return {k: f"{v:.4f}" for k, v in self.postfix.items()}

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(self._shown(), refresh=False)   # the last step's loss may come last
            self.bar.close()
            self.bar = None


@contextlib.contextmanager
def bar_here(enabled: bool):
    """A bar in this process fed directly by `progress` (``single``; rank 0 under torchrun)."""
    previous = _channel["sink"]
    with ProgressBar(enabled) as bar:
        _channel.update(sink=bar.update if enabled else None, last=0.0)
        try:
            yield bar
        finally:
            _channel["sink"] = previous
