"""Progress of a long launch, drawn as a bar in the notebook that started it.

Inside a rank, ``dl.progress(step, total)`` sends a small message up the rank's result pipe
(rank 0 only, at most ten times a second, always the last step). The parent's supervisor hands
it to a `ProgressBar`, which shows an ipywidgets bar in Jupyter, a one-line counter on a
terminal, and nothing otherwise. The bar is displayed with a fixed initial state, so the stored
notebook output does not depend on timing.
"""
from __future__ import annotations

import pickle
import sys
import time

_MIN_INTERVAL = 0.1
_channel = {"conn": None, "last": 0.0}


def _attach(conn) -> None:
    """Called in a rank started by `launch`: progress goes up this connection."""
    _channel.update(conn=conn, last=0.0)


def progress(step: int, total: int, label: str = "step") -> None:
    """Report that ``step`` of ``total`` units are done (call it on every rank; rank 0 reports)."""
    from .runtime import rank

    conn = _channel["conn"]
    if conn is None or rank() != 0:
        return
    now = time.monotonic()
    if step < total and now - _channel["last"] < _MIN_INTERVAL:
        return
    _channel["last"] = now
    conn.send_bytes(pickle.dumps(("progress", int(step), int(total), str(label))))


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return type(shell).__name__ == "ZMQInteractiveShell"


class ProgressBar:
    """Parent side: created lazily on the first progress message of a launch."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bar = None
        self._text = None
        self._terminal = False

    def update(self, step: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        if self._bar is None and self._text is None and not self._terminal:
            self._open(total, label)
        if self._bar is not None:
            self._bar.max = max(total, 1)
            self._bar.value = step
            self._text.value = f"{label} {step}/{total}"
        elif self._terminal:
            print(f"\r{label} {step}/{total}", end="", file=sys.stderr, flush=True)

    def _open(self, total: int, label: str) -> None:
        if _in_notebook():
            try:
                import ipywidgets as widgets
                from IPython.display import display
            except ImportError:
                return
            self._bar = widgets.IntProgress(value=0, min=0, max=max(total, 1))
            self._text = widgets.Label(value=f"{label} 0/{total}")
            display(widgets.HBox([self._bar, self._text]))
        elif sys.stderr.isatty():
            self._terminal = True

    def close(self) -> None:
        if self._terminal:
            print(file=sys.stderr)
