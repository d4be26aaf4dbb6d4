"""The pytest file `distlab grade --template` prints, for a course repository (GitHub Classroom and other
autograders run pytest; ``pytest --junitxml=grades.xml`` gives them JUnit XML)."""

TEMPLATE = '''\
"""distlab's build-it-yourself exercises, graded by pytest: a test per exercise of every student notebook.

Made by `distlab grade --template`. Put it in the course repository's tests/ folder; the notebooks are
searched below the repository's root (hidden folders and virtual environments left out), or below
DISTLAB_NOTEBOOKS.

    pytest tests/test_distlab_exercises.py -v --junitxml=grades.xml

Each notebook runs once, headless, in a fresh kernel (`distlab.exercises.grade`: its exercise section, the
check cells as the lesson wrote them); each exercise passes when its check did. Points: nbgrader's metadata,
in the JSON of `distlab grade PATH --json FILE`.
"""
import functools
import os
from pathlib import Path

import pytest

from distlab.exercises import grade

ROOT = Path(os.environ.get("DISTLAB_NOTEBOOKS", Path(__file__).resolve().parents[1]))
TIMEOUT = float(os.environ.get("DISTLAB_GRADE_TIMEOUT", "600"))   # seconds a cell may run


def _exercises():
    for path in grade.notebooks(ROOT):
        nb = grade.json.loads(path.read_text())
        for _, exercise, _ in grade.graded_cells(nb):
            yield pytest.param(path, exercise, id=f"{path.relative_to(ROOT)}::{exercise}")


@functools.cache
def _graded(path):
    return {o.exercise: o for o in grade.grade_notebook(path, TIMEOUT)}


@pytest.mark.parametrize("path, exercise", list(_exercises()))
def test_exercise(path, exercise):
    outcome = _graded(path)[exercise]
    assert outcome.passed, f"{exercise} {outcome.status}: {outcome.message}"
'''
