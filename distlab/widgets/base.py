"""What every distlab widget shares: named controls, a result recomputed whenever one changes,
an output area that shows the latest figure or text, and notebook display.

    w = dl.widgets.memory_calculator()
    w.controls["zero"].value = 3      # any change recomputes...
    w.result                          # ...the latest answer, and redraws w.figure
"""
from __future__ import annotations

import base64
import io
from contextlib import contextmanager
from typing import Any, Iterator

import ipywidgets as W
from IPython.display import display
from matplotlib.figure import Figure


class Explorer:
    """Base class: subclasses build ``controls`` and implement ``compute`` and ``render``."""

    title = ""

    def __init__(self, controls: dict[str, W.Widget]):
        self.controls = controls
        self.output = W.Output()
        self.figure: Figure | None = None
        self.result: Any = None
        self._held = False
        for control in controls.values():
            if not isinstance(control, W.Button):
                control.observe(self._changed, names="value")
        self.widget = W.VBox([W.HTML(f"<b>{self.title}</b>"), W.VBox(list(controls.values())), self.output])
        self.update()

    def compute(self) -> Any:
        """The answer for the current control values (pure: no drawing)."""
        raise NotImplementedError

    def render(self, result: Any) -> tuple[Figure | None, str]:
        """A figure (or None) and an HTML text for ``result``."""
        raise NotImplementedError

    def value(self, name: str) -> Any:
        return self.controls[name].value

    def _changed(self, _change: dict) -> None:
        if not self._held:
            self.update()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Change several controls, then recompute once on leaving the block."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
        self.update()

    def update(self) -> None:
        """Recompute ``result`` and redraw the output area.

        The output area's contents are set directly on the widget model rather than captured
        with ``with output:``: capture needs a live front end, and without one (nbconvert, nbval,
        a test) the drawing would leak into whichever cell moved the control.
        """
        self.result = self.compute()
        self.figure, text = self.render(self.result)
        outputs = []
        if text:
            outputs.append(_display_data({"text/html": text, "text/plain": text}))
        if self.figure is not None:
            outputs.append(_display_data({"image/png": _png(self.figure), "text/plain": repr(self.figure)}))
        self.output.outputs = tuple(outputs)

    def _ipython_display_(self) -> None:
        display(self.widget)


def _display_data(data: dict[str, str]) -> dict:
    return {"output_type": "display_data", "data": data, "metadata": {}}


def _png(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def dropdown(name: str, options, value) -> W.Dropdown:
    return W.Dropdown(options=options, value=value, description=name, style={"description_width": "initial"})


def int_slider(name: str, value: int, low: int, high: int) -> W.IntSlider:
    return W.IntSlider(value=value, min=low, max=high, description=name, continuous_update=False,
                       style={"description_width": "initial"})


def float_slider(name: str, value: float, low: float, high: float, step: float = 0.1) -> W.FloatSlider:
    return W.FloatSlider(value=value, min=low, max=high, step=step, description=name, continuous_update=False,
                         style={"description_width": "initial"})


def new_figure(width: float = 7.0, height: float = 3.0) -> Figure:
    """A matplotlib Figure outside pyplot: nothing global, nothing shown unless displayed."""
    return Figure(figsize=(width, height), dpi=80, layout="constrained")
