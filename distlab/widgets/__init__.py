"""Interactive calculators, explorers and a quiz for notebooks (ipywidgets + matplotlib).

Each returns an object that displays itself, exposes its inputs as ``.controls`` (name ->
widget) and its latest answer as ``.result``, recomputed whenever a control changes:

    w = dl.widgets.memory_calculator()
    w.controls["zero"].value = 3
    w.result.memory.total, w.result.fits["h100-80gb"], w.result.cheapest
"""
try:
    import ipywidgets  # noqa: F401
except ImportError as err:         # the widgets are an extra: say how to get them
    raise ImportError("dl.widgets needs ipywidgets, which distlab's 'lab' extra installs: "
                      "pip install distlab[lab]  (or: pip install ipywidgets)") from err

from distlab.widgets.advisor import advisor
from distlab.widgets.allreduce_explorer import allreduce_explorer
from distlab.widgets.bubble_explorer import bubble_explorer
from distlab.widgets.cluster_planner import cluster_planner
from distlab.widgets.memory_calculator import memory_calculator
from distlab.widgets.quiz import quiz

__all__ = ["advisor", "allreduce_explorer", "bubble_explorer", "memory_calculator", "quiz", "cluster_planner"]
