"""The lessons' sources: each ``notebooks/NN_name.ipynb`` has its jupytext percent-format ``NN_name.py``
(paired by ``notebooks/jupytext.toml``), and the two carry the same cells: types, sources, and the metadata
that matters (nbval's tags, nbgrader's markup). A .py edited without re-making its notebook, or a notebook
edited without re-writing its source, fails here with the command that brings them back together.

Also: pytest and ruff leave the .py sources alone (nbval collects the .ipynb only), and the exercise cells
the lessons carry literally still equal what ``distlab.exercises.student.exercise_cells`` makes from the
reference solutions, so a changed reference cannot leave a stale solution in a lesson.
"""
from __future__ import annotations

import difflib
import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

import distlab as dl
from distlab.exercises import student
from distlab.exercises.student import exercise_cells

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "notebooks"
NOTEBOOKS = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
SOURCES = sorted(LESSONS.glob("[0-9][0-9]_*.py"))
# cell metadata that is not part of a lesson: execution timestamps, UI state, jupytext's own layout hints
NOT_CONTENT = {"execution", "ExecuteTime", "collapsed", "scrolled", "trusted", "autoscroll",
               "lines_to_next_cell", "lines_to_end_of_cell_marker", "cell_marker"}


def _fix(stem: str) -> str:
    return (f"if you edited notebooks/{stem}.py, run `make notebooks LESSONS=notebooks/{stem}.py` (or "
            f"`jupytext --update --to ipynb notebooks/{stem}.py`, then execute it); if you edited the "
            f".ipynb, run `make sources NOTEBOOKS=notebooks/{stem}.ipynb`")


def _cells(nb) -> list[tuple]:
    """(cell type, source, metadata that matters) of each cell; empty tags count as none."""
    out = []
    for cell in nb.cells:
        meta = {k: v for k, v in cell.get("metadata", {}).items()
                if k not in NOT_CONTENT and not (k == "tags" and not v)}
        out.append((cell.cell_type, cell.source, meta))
    return out


def _describe(i: int, a: tuple | None, b: tuple | None, names=(".py", ".ipynb")) -> str:
    """How cell ``i`` differs: ``a`` as found in ``names[0]``, ``b`` in ``names[1]`` (None: no such cell)."""
    if a is None or b is None:
        where, extra = (names[1], b) if a is None else (names[0], a)
        return f"cell {i} is only in the {where} ({extra[0]}: {extra[1][:60]!r})"
    if a[0] != b[0]:
        return f"cell {i} is {a[0]} in the {names[0]}, {b[0]} in the {names[1]}"
    if a[1] != b[1]:
        diff = difflib.unified_diff(b[1].splitlines(), a[1].splitlines(), *names[::-1], lineterm="", n=0)
        diff = [line for line in diff if line[:1] in "+-"]
        return f"cell {i} ({a[0]}) has a different source:\n  " + "\n  ".join(diff[:8])
    return f"cell {i} ({a[0]}) has different metadata: {names[0]} {a[2]} vs {names[1]} {b[2]}"


def disagreement(py: Path, ipynb: Path) -> str | None:
    """None when the lesson's source and notebook carry the same cells, else the first difference and the
    command that fixes it."""
    if not py.exists():
        return f"{ipynb.name} has no source {py.name}: run `make sources NOTEBOOKS=notebooks/{ipynb.name}`"
    if not ipynb.exists():
        return f"{py.name} has no notebook {ipynb.name}: run `make notebooks LESSONS=notebooks/{py.name}`"
    ours = _cells(jupytext.read(py, fmt="py:percent"))
    theirs = _cells(nbformat.read(ipynb, as_version=4))
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            return f"{py.name} and {ipynb.name} disagree: {_describe(i, a, b)}\n{_fix(py.stem)}"
    return None


def test_lessons_are_paired_by_jupytext_config():
    config = (LESSONS / "jupytext.toml").read_text()
    assert re.search(r'^formats\s*=\s*"ipynb,py:percent"', config, re.M), config
    assert NOTEBOOKS and len(NOTEBOOKS) == len(SOURCES), (
        f"lessons without a source: {[p.name for p in NOTEBOOKS if not p.with_suffix('.py').exists()]}; "
        f"sources without a lesson: {[p.name for p in SOURCES if not p.with_suffix('.ipynb').exists()]}")
    assert not (LESSONS / "src").exists(), (
        "notebooks/src/ is back: a lesson's source is now notebooks/NN_name.py; write it from the executed "
        "lesson with `make sources NOTEBOOKS=notebooks/NN_name.ipynb`, then delete notebooks/src/")


@pytest.mark.parametrize("lesson", NOTEBOOKS, ids=lambda p: p.stem)
def test_source_and_notebook_carry_the_same_cells(lesson):
    problem = disagreement(lesson.with_suffix(".py"), lesson)
    assert problem is None, problem


def test_a_drifted_pair_is_caught_with_the_command_to_run(tmp_path):
    """Planted drift in a copy of lesson 07: each edit is caught and named; the untouched copy passes."""
    stem = "07_interview_prep"
    py, ipynb = tmp_path / f"{stem}.py", tmp_path / f"{stem}.ipynb"

    def fresh():
        shutil.copy(LESSONS / f"{stem}.py", py)
        shutil.copy(LESSONS / f"{stem}.ipynb", ipynb)
    fresh()
    assert disagreement(py, ipynb) is None
    text = py.read_text()
    code = next(line for line in text.splitlines() if line.startswith("import distlab"))
    py.write_text(text.replace(code, code + "  # edited", 1))              # a code line edited in the .py
    problem = disagreement(py, ipynb)
    assert "different source" in problem and "make notebooks LESSONS=" in problem, problem
    py.write_text(text.replace('# %% tags=["nbval-ignore-output"]', "# %%", 1))       # a tag dropped
    assert "different metadata" in disagreement(py, ipynb)
    nb = nbformat.read(ipynb, as_version=4)
    nb.cells.pop(3)                                                          # a cell deleted in the .ipynb
    py.write_text(text)
    nbformat.write(nb, ipynb)
    assert "disagree: cell 3" in disagreement(py, ipynb) and "make sources" in disagreement(py, ipynb)
    py.unlink()
    assert "has no source" in disagreement(py, ipynb)


def test_pytest_collects_only_the_notebooks_and_ruff_passes_the_sources():
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--nbval",
                                "-p", "no:cacheprovider", "notebooks"], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
    items = [line for line in collected.stdout.splitlines() if "::" in line]
    assert collected.returncode == 0 and items, collected.stdout[-2000:] + collected.stderr[-2000:]
    files = {line.split("::")[0] for line in items}
    assert files == {f"notebooks/{p.name}" for p in NOTEBOOKS}, files
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "notebooks"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert ruff.returncode == 0, ruff.stdout[-3000:]


@functools.cache
def _lesson_cells() -> dict[str, list[tuple]]:
    return {p.name: _cells(jupytext.read(p, fmt="py:percent")) for p in SOURCES}


@pytest.mark.parametrize("name", dl.exercises.names())
def test_each_exercise_in_the_lessons_is_its_reference(name):
    """Task, solution and graded check of exercise ``name`` appear in a lesson as `exercise_cells` makes
    them from the reference solution (so a changed reference or task cannot leave a stale lesson)."""
    expected = _cells(nbformat.v4.new_notebook(cells=exercise_cells([name])[2:]))   # task, solution, check
    found = {}
    for lesson, cells in _lesson_cells().items():
        for i, cell in enumerate(cells):
            if cell[2].get("nbgrader", {}).get("grade_id") == name:
                found[lesson] = i - 1                                       # where its task cell is
    assert found, f"exercise {name} is in no lesson"
    for lesson, first in found.items():
        cells = _lesson_cells()[lesson][first:first + 3]
        for i, (got, want, what) in enumerate(zip(cells, expected, ("task", "solution", "check"))):
            assert got == want, (
                f"the {what} cell of exercise {name} in notebooks/{lesson} is not what the reference makes: "
                f"{_describe(first + i, got, want, ('lesson', 'reference'))}\n{_refresh(name, lesson)}")


def _refresh(name: str, lesson: str) -> str:
    return (f"replace the task, solution and check cells of {name} in notebooks/{lesson} by the ones "
            f"`python -m distlab.exercises.student --cells {name}` prints "
            f"(after its introduction and imports), "
            f"then run `make notebooks LESSONS=notebooks/{lesson}`")


def test_cells_printed_for_a_lesson_read_back_as_the_exercise_cells(capsys):
    assert student.main(["--cells", "buckets", "ring_all_reduce"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# %% [markdown]\n# ## Build it yourself")
    expected = _cells(nbformat.v4.new_notebook(cells=exercise_cells(["buckets", "ring_all_reduce"])))
    assert _cells(jupytext.reads(text, fmt="py:percent")) == expected
