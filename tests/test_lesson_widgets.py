"""The lessons' widgets as a learner first meets them, checked on the stored notebooks (no kernel, no browser;
tests/browser/test_lab_first_open.py looks at the same in JupyterLab):

* every widget a lesson displays is stored whole in the notebook's widget state (its model and every model it
  refers to), so JupyterLab can draw it before any cell runs;
* it is stored as its own cell made it: no later cell moved it (the demonstrations drive a second, undisplayed
  instance), so the quiz starts unanswered, at 0/0, and the ZeRO slider where a fresh calculator puts it;
* `distlab lessons` / `make lab` write those lessons trusted (signed for this user, as `jupyter trust` does):
  JupyterLab draws a widget's view only in a trusted notebook, else its text, ``VBox(children=(HTML(...``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import distlab as dl
import distlab.lessons as lessons

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipywidgets")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
VIEW = "application/vnd.jupyter.widget-view+json"
STATE = "application/vnd.jupyter.widget-state+json"
REF = "IPY_MODEL_"


def _displayed(nb: dict) -> list[tuple[str, str]]:
    """(cell source, model id) of every widget view among the stored outputs."""
    return [("".join(cell["source"]), output["data"][VIEW]["model_id"])
            for cell in nb["cells"] for output in cell.get("outputs", ()) if VIEW in output.get("data", {})]


WITH_WIDGETS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")
                      if _displayed(json.loads(p.read_text())))


def _state(nb: dict) -> dict:
    return nb.get("metadata", {}).get("widgets", {}).get(STATE, {}).get("state", {})


def _refs(value) -> list[str]:
    """The model ids a widget's state refers to (children, layout, style: ``IPY_MODEL_<id>`` strings)."""
    if isinstance(value, str):
        return [value[len(REF):]] if value.startswith(REF) else []
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    return []


def test_the_lessons_with_widgets_are_found():
    assert {"07_interview_prep.ipynb", "13_laptop_to_16000_gpus.ipynb"} <= set(WITH_WIDGETS)


@pytest.mark.parametrize("name", WITH_WIDGETS)
def test_every_displayed_widget_is_stored_whole(name):
    nb = json.loads((NOTEBOOKS / name).read_text())
    state = _state(nb)
    for source, model_id in _displayed(nb):
        seen, todo = set(), [model_id]
        while todo:
            current = todo.pop()
            assert current in state, f"{name}: the widget of cell {source!r:.60} lacks model {current}"
            seen.add(current)
            todo += [r for r in _refs(state[current]["state"]) if r not in seen]
        assert len(seen) > 3


def _pairs(fresh, stored_id: str, state: dict):
    """(fresh widget, stored state) down both trees in step: a Box's children in order."""
    stored = state[stored_id]["state"]
    yield fresh, stored
    children = getattr(fresh, "children", ())
    if children:
        ids = [r[len(REF):] for r in stored["children"]]
        assert len(ids) == len(children)
        for child, child_id in zip(children, ids):
            yield from _pairs(child, child_id, state)


def _made_by_its_cell(source: str):
    """The explorer a widget cell displays, built afresh: the cell is ``name = dl.widgets.x(...)\\nname``."""
    assignment, shown = source.strip().splitlines()
    scope = {"dl": dl}
    exec(assignment, scope)
    return scope[shown.strip()]


@pytest.mark.parametrize("name", WITH_WIDGETS)
def test_every_displayed_widget_is_stored_as_its_cell_made_it(name):
    """No demonstration cell moved the learner's widget: each control's value, each HTML text (the quiz's
    question and score) as a fresh one has them. A lesson whose cell drove the displayed calculator stores
    ZeRO-3 where a fresh one says 0, and a quiz that a cell answered stores "score 1/1"."""
    nb = json.loads((NOTEBOOKS / name).read_text())
    state = _state(nb)
    for source, model_id in _displayed(nb):
        explorer = _made_by_its_cell(source)
        compared = 0
        for fresh, stored in _pairs(explorer.widget, model_id, state):
            for key in ("value", "index"):
                if key in stored and type(fresh).__name__ != "Output":
                    assert stored[key] == fresh.get_state(key)[key], (
                        f"{name}: {source.splitlines()[0]!r}: {type(fresh).__name__} "
                        f"{getattr(fresh, 'description', '')!r} stored {key}={stored[key]!r}, "
                        f"as made {fresh.get_state(key)[key]!r}: a later cell moved the displayed widget")
                    compared += 1
        assert compared >= len(explorer.controls)


def test_lesson07_quiz_is_stored_unanswered():
    nb = json.loads((NOTEBOOKS / "07_interview_prep.ipynb").read_text())
    state = _state(nb)
    (source, model_id), = [(s, m) for s, m in _displayed(nb) if "quiz(" in s]
    title, heading, controls, _output = (r[len(REF):] for r in state[model_id]["state"]["children"])
    assert "score 0/0" in state[heading]["state"]["value"]
    radio = state[state[controls]["state"]["children"][0][len(REF):]]["state"]
    assert radio["_model_name"] == "RadioButtonsModel" and radio["index"] is None


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    """A private Jupyter data dir: its notebook secret and signature database."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    return tmp_path / "jupyter-data"


def _trusted(path: Path) -> bool:
    from nbformat.sign import NotebookNotary
    return NotebookNotary().check_signature(nbformat.read(path, as_version=4))


def test_the_learners_copy_is_trusted_where_it_shows_widgets(tmp_path, data_dir):
    lab = tmp_path / "lab"
    lessons.copy(lab)
    assert (data_dir / "nbsignatures.db").is_file()
    for folder in (lessons.STUDENT, lessons.SOLVED):
        for name in WITH_WIDGETS:
            assert _trusted(lab / folder / name), f"{folder}/{name} is not trusted: its widgets show as text"
    assert not _trusted(lab / lessons.SOLVED / "00_launch_and_collectives.ipynb")   # no widgets: not signed

    mine = lab / lessons.STUDENT / WITH_WIDGETS[0]                  # edited outside Jupyter: untrusted,
    nb = nbformat.read(mine, as_version=4)                          # and `make lab` again leaves it so
    nb.cells[0].source += "\n\nmy notes"
    nbformat.write(nb, mine)
    assert not _trusted(mine)
    lessons.copy(lab)
    assert not _trusted(mine) and "my notes" in mine.read_text()


def test_needs_trust_names_what_jupyterlab_would_show_as_text():
    def nb(*data: dict) -> dict:
        return {"cells": [{"cell_type": "code", "outputs": [{"output_type": "display_data", "data": d}
                                                            for d in data]}]}
    assert lessons.needs_trust(nb({VIEW: {"model_id": "x"}, "text/plain": "VBox(...)"}))
    assert lessons.needs_trust(nb({"image/svg+xml": "<svg/>"}))
    assert not lessons.needs_trust(nb({"image/png": "iVBOR", "text/plain": "<Figure>"}, {"text/html": "<b>"}))
    assert not lessons.needs_trust({"cells": [{"cell_type": "markdown", "source": "x"}]})
