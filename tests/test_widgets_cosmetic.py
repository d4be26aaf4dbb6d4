"""What a learner notices in the widgets: no legend lies on a bar (the planner's, the calculator's), and
the quiz's Submit with no choice made asks for one instead of doing nothing."""
import pytest

pytest.importorskip("ipywidgets")

from matplotlib.backends.backend_agg import FigureCanvasAgg   # noqa: E402
from matplotlib.patches import Rectangle                      # noqa: E402

from distlab import widgets                                   # noqa: E402


def _legend_overlaps_a_bar(figure) -> list:
    FigureCanvasAgg(figure).draw()
    renderer = figure.canvas.get_renderer()
    ax = figure.axes[0]
    legend = (ax.get_legend() or figure.legends[0]).get_window_extent(renderer)
    bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_width() and p.get_height()]
    assert bars
    return [b for b in bars if legend.overlaps(b.get_window_extent(renderer))]


@pytest.mark.parametrize("make", [widgets.cluster_planner, widgets.memory_calculator])
def test_no_legend_lies_on_a_bar(make):
    w = make()
    assert _legend_overlaps_a_bar(w.figure) == []


def test_the_planner_legend_stays_off_the_bars_for_other_layouts():
    w = widgets.cluster_planner(gpus=64, model="llama2-7b")
    assert _legend_overlaps_a_bar(w.figure) == []
    w = widgets.memory_calculator()
    with w.hold():
        w.controls["pp"].value = 4
    assert _legend_overlaps_a_bar(w.figure) == []


def _said(q) -> str:
    return "".join(o["data"]["text/html"] for o in q.output.outputs)


def test_submit_without_a_choice_asks_for_one():
    q = widgets.quiz(seed=0)
    assert _said(q) == ""                                           # nothing before anything is pressed
    q.controls["submit"].click()
    assert "Choose an answer" in _said(q) and q.result.attempted == 0
    q.controls["answer"].value = q.result.choices[0]
    assert "Choose an answer" not in _said(q)                       # a choice clears the nudge
    q.controls["submit"].click()
    assert q.result.attempted == 1 and "Choose an answer" not in _said(q)
    q.controls["next"].click()
    assert _said(q) == ""                                           # the next question starts clean
