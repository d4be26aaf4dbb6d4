"""The lessons' nbgrader markup under nbgrader itself: a course that grades with nbgrader takes the lessons
(notebooks/, the teacher's versions) as its source, and `make student` / `distlab lessons` hand out the same
exercises without nbgrader. Skips without nbgrader (``pip install nbgrader``).

1. ``nbgrader generate_assignment`` accepts every lesson with exercises (locked cells, grade ids, points,
   solution and hidden-test markers) and its release holds no solution line of the teacher's version.
2. ``nbgrader autograde`` of lesson 02's exercise section (its one exercise, `buckets`, needs no ranks, so a
   notebook grades in seconds) gives full points to a student who answered right in the version
   `make student` wrote, and none to one who answered wrong in nbgrader's own release.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.exercises.student import BEGIN, END, has_exercises, student_notebook

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbgrader", reason="nbgrader not installed: pip install nbgrader")

pytestmark = pytest.mark.slow          # a gradebook, a kernel per submission: ~30 s on 2 cores

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
WITH_EXERCISES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")
                        if has_exercises(nbformat.read(p, as_version=4)))
LESSON = "02_data_parallel.ipynb"
RIGHT = "def buckets(sizes, cap):\n    out, size = [], 0\n    for i in reversed(range(len(sizes))):\n" \
        "        if not out or size + sizes[i] > cap:\n            out.append([])\n            size = 0\n" \
        "        out[-1].append(i)\n        size += sizes[i]\n    return out\n"
WRONG = "def buckets(sizes, cap):\n    return [[i] for i in range(len(sizes))]   # forward order, one each\n"


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``nbgrader`` of this Python in the course directory (its nbgrader_config.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", JUPYTER_DATA_DIR=str(course / ".jupyter-data"),
               JUPYTER_CONFIG_DIR=str(course / ".jupyter-config"),     # nbgrader runs `alembic` from PATH:
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # the venv's
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                          capture_output=True, text=True, timeout=600)
    said = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{said}"
    return done


def course_with(tmp_path: Path, assignment: str, notebooks: dict[str, object]) -> Path:
    course = tmp_path / "course"
    (course / "source" / assignment).mkdir(parents=True)
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        "c.CourseDirectory.course_id = 'distlab'\n"
        "c.CourseDirectory.db_assignments = [dict(name=%r)]\n"
        "c.CourseDirectory.db_students = [dict(id='right'), dict(id='wrong')]\n"
        "c.ExecutePreprocessor.timeout = 300\n" % assignment)
    for name, nb in notebooks.items():
        nbformat.write(nb, course / "source" / assignment / name)
    return course


def exercise_section(nb):
    """The cells from "## Build it yourself" on: the imports, the tasks, the solutions and the checks."""
    first = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Build it yourself"))
    return nbformat.v4.new_notebook(cells=nb.cells[first:], metadata=nb.metadata)


def solution_cell(nb, grade_id: str):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def test_nbgrader_releases_every_lesson_with_exercises_without_its_solutions(tmp_path):
    assert len(WITH_EXERCISES) >= 5
    course = course_with(tmp_path, "lessons", {n: nbformat.read(NOTEBOOKS / n, as_version=4)
                                               for n in WITH_EXERCISES})
    nbgrader(course, "generate_assignment", "lessons", "--force")
    for name in WITH_EXERCISES:
        teacher = nbformat.read(NOTEBOOKS / name, as_version=4)
        release = nbformat.read(course / "release" / "lessons" / name, as_version=4)
        assert len(release.cells) == len(teacher.cells)
        for mine, theirs in zip(teacher.cells, release.cells):
            if BEGIN not in mine.source:
                continue
            before, rest = mine.source.split(BEGIN, 1)
            body, after = rest.split(END, 1)
            given = set((before + after).splitlines())                  # what the student is given anyway
            solution = {line for line in body.splitlines() if line.strip()} - given
            assert not solution & set(theirs.source.splitlines()), \
                f"{name}: nbgrader's release keeps a solution line of {mine.metadata['nbgrader']['grade_id']}"
            assert "YOUR CODE HERE" in theirs.source or "YOUR ANSWER HERE" in theirs.source


def test_nbgrader_autogrades_a_right_and_a_wrong_student(tmp_path):
    teacher = exercise_section(nbformat.read(NOTEBOOKS / LESSON, as_version=4))
    course = course_with(tmp_path, "ddp", {LESSON: teacher})
    nbgrader(course, "generate_assignment", "ddp", "--force")

    ours = nbformat.from_dict(student_notebook(teacher))              # `make student`'s version, answered
    solution_cell(ours, "buckets").source = RIGHT
    theirs = nbformat.read(course / "release" / "ddp" / LESSON, as_version=4)    # nbgrader's, answered wrong
    solution_cell(theirs, "buckets").source = WRONG
    for student, nb in (("right", ours), ("wrong", theirs)):
        (course / "submitted" / student / "ddp").mkdir(parents=True)
        nbformat.write(nb, course / "submitted" / student / "ddp" / LESSON)
    nbgrader(course, "autograde", "ddp", "--force")

    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        scores = {s: gradebook.find_submission("ddp", s).score for s in ("right", "wrong")}
        assert gradebook.find_assignment("ddp").max_score == 1
    assert scores == {"right": 1, "wrong": 0}
    graded = nbformat.read(course / "autograded" / "wrong" / "ddp" / LESSON, as_version=4)
    check = solution_cell(graded, "check_buckets")
    assert [o.get("ename") for o in check.outputs if o.output_type == "error"] == ["ExerciseNotPassed"]
