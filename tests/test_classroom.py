"""The classroom as a student and a teacher meet it: `make lab` writes the learner's copy into an ignored
folder (the student version to work in, its exercise a stub; the solved one to compare with), so running and
editing an exercise there leaves `git status` clean; `distlab grade` scores a folder of student notebooks and
writes JUnit XML and JSON. Lesson 02: its one exercise (buckets) needs no ranks, so a notebook grades fast."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from distlab.cli import main
from distlab.exercises.student import BEGIN, solution_source
from distlab.lessons import student_version

ROOT = Path(__file__).resolve().parents[1]
LESSON = "02_data_parallel.ipynb"
WRONG = "def buckets(sizes, cap):\n    return [[i] for i in range(len(sizes))]   # forward order, one each\n"
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def _fresh_clone(tmp_path: Path) -> Path:
    """A new repository holding this checkout's tracked files as they are now (uncommitted edits too)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    clone = tmp_path / "clone"
    for name in _git(ROOT, "ls-files", "-z").split("\0"):
        if name and (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    _git(clone, "init", "-q")
    _git(clone, "add", "-A")
    _git(clone, "commit", "-q", "-m", "fresh")
    return clone


def _make_lab_writes(clone: Path) -> str:
    """Run the first command of `make lab` (writing lab/), as make would, in ``clone``."""
    out = subprocess.run(["make", "-n", "-s", "lab", f"VENV={sys.prefix}",
                          f"STAMP={clone / 'pyproject.toml'}"],
                         cwd=clone, capture_output=True, text=True, check=True).stdout
    write = shlex.split(out.splitlines()[0])
    assert write[1:] == ["-m", "distlab.lessons", "lab"], write
    return subprocess.run(write, cwd=clone, capture_output=True, text=True, check=True, env=ENV).stdout


def _cell(nb, **nbgrader) -> dict:
    return next(c for c in nb.cells if all(c.get("metadata", {}).get("nbgrader", {}).get(k) == v
                                          for k, v in nbgrader.items()))


def _run_exercise_section(path: Path) -> None:
    """Run a lesson's exercise section in a kernel in its folder and save it, as JupyterLab's autosave
    would."""
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Build it yourself"))
    part = nbformat.v4.new_notebook(cells=nb.cells[first:], metadata=nb.metadata)
    NotebookClient(part, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.cells[first:] = part.cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (edited)", "language": "python"}
    nbformat.write(nb, path)


def test_a_student_works_in_lab_and_the_checkout_stays_clean(tmp_path):
    clone = _fresh_clone(tmp_path)
    said = _make_lab_writes(clone)
    lab = clone / "lab"
    assert "student/" in said and (lab / "distlab" / "parallel").is_dir()
    assert (lab / "solved" / LESSON).read_bytes() == (ROOT / "notebooks" / LESSON).read_bytes()
    mine = lab / "student" / LESSON
    solution = _cell(nbformat.read(mine, as_version=4), solution=True, grade_id="buckets")
    assert "not implemented yet" in solution.source and BEGIN not in solution.source     # a stub
    assert "reversed" not in solution.source

    nb = nbformat.read(mine, as_version=4)                   # the student answers, wrongly, and runs it
    _cell(nb, solution=True, grade_id="buckets").source = WRONG
    nbformat.write(nb, mine)
    _run_exercise_section(mine)
    check = _cell(nbformat.read(mine, as_version=4), grade=True, grade_id="check_buckets")
    assert [o.get("ename") for o in check.outputs if o.output_type == "error"] == ["ExerciseNotPassed"]
    edited = mine.read_bytes()

    _make_lab_writes(clone)                                  # `make lab` again: the learner's work is kept
    assert mine.read_bytes() == edited
    assert _git(clone, "status", "--porcelain", "--untracked-files=all") == ""


def test_lab_refreshes_what_the_learner_left_alone_and_keeps_the_rest(tmp_path, monkeypatch):
    import distlab.lessons as lessons
    src = tmp_path / "src"
    src.mkdir()
    lesson = src / "00_a.ipynb"
    monkeypatch.setattr(lessons, "source", lambda: src)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("one")])
    nbformat.write(nb, lesson)
    done = lessons.copy(tmp_path / "lab")
    assert len(done["written"]) == 2 and not done["kept"]
    nb.cells[0].source = "two"                                   # the lesson changes: untouched copies follow
    nbformat.write(nb, lesson)
    assert len(lessons.copy(tmp_path / "lab")["written"]) == 2
    mine = tmp_path / "lab" / "student" / "00_a.ipynb"
    mine.write_text(mine.read_text().replace("two", "my notes"))
    assert lessons.copy(tmp_path / "lab") == {"written": [], "kept": []}    # the learner's edit: kept
    nb.cells[0].source = "three"
    nbformat.write(nb, lesson)
    done = lessons.copy(tmp_path / "lab")                         # the lesson changed under it: kept, named
    assert done["kept"] == [mine] and "my notes" in mine.read_text()
    assert "student/00_a.ipynb" in lessons.report(tmp_path / "lab", done)
    assert lessons.copy(tmp_path / "lab", force=True)["written"] == [mine] and "three" in mine.read_text()


def _submission(folder: Path, solution: str, check: str | None = None) -> Path:
    nb = nbformat.reads(student_version(ROOT / "notebooks" / LESSON).decode(), as_version=4)
    _cell(nb, solution=True, grade_id="buckets").source = solution
    if check is not None:
        _cell(nb, grade=True, grade_id="check_buckets").source = check
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / LESSON)
    return folder / LESSON


def test_distlab_grade_scores_a_folder_and_writes_junit_and_json(tmp_path, capsys):
    subs = tmp_path / "submissions"
    _submission(subs / "alice", solution_source("buckets"))
    _submission(subs / "bob", WRONG, check="print('PASSED buckets')")     # a check edited to pass: restored
    junit, summary = tmp_path / "grades.xml", tmp_path / "grades.json"
    assert main(["grade", str(subs), "--junit", str(junit), "--json", str(summary), "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert "buckets" in out and "total 1/2" in out and "expected" in out      # bob's first difference

    suites = ET.parse(junit).getroot()
    assert suites.tag == "testsuites" and (suites.get("tests"), suites.get("failures")) == ("2", "1")
    cases = {s.get("name"): s.find("testcase") for s in suites}
    assert set(cases) == {f"alice/{LESSON}", f"bob/{LESSON}"}
    alice = cases[f"alice/{LESSON}"]
    assert alice.find("failure") is None and alice.get("name") == "buckets"
    failure = cases[f"bob/{LESSON}"].find("failure")
    assert failure.get("type") == "ExerciseNotPassed" and "NOT YET buckets" in failure.text

    scores = json.loads(summary.read_text())
    assert (scores["score"], scores["max_score"]) == (1, 2)
    by_notebook = {nb["notebook"]: nb["score"] for nb in scores["notebooks"]}
    assert by_notebook == {f"alice/{LESSON}": 1, f"bob/{LESSON}": 0}


def test_grade_says_what_it_needs():
    assert main(["grade"]) == 2
    assert main(["grade", "/nonexistent/notebooks"]) == 2


@pytest.mark.slow
def test_the_pytest_template_grades_a_course_repository(tmp_path, capsys):
    assert main(["grade", "--template"]) == 0
    course = tmp_path / "course"
    (course / "tests").mkdir(parents=True)
    (course / "tests" / "test_distlab_exercises.py").write_text(capsys.readouterr().out)
    _submission(course / "alice", solution_source("buckets"))
    _submission(course / "bob", "def buckets(sizes, cap):\n    raise NotImplementedError\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests",
                          f"--junitxml={tmp_path / 'j.xml'}"], cwd=course, capture_output=True, text=True,
                         env=ENV, timeout=600)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    assert len(ET.parse(tmp_path / "j.xml").getroot().iter("testcase").__next__().attrib) >= 2


def test_every_relative_link_of_the_learners_copy_opens(tmp_path):
    """The lessons link the code (``../distlab/...``) and the notation table (``../docs/notation.md``): in the
    learner's copy, from student/ and solved/, each link must open (``DIR/distlab`` and ``DIR/docs``)."""
    import re

    import distlab.lessons as lessons
    lessons.copy(tmp_path / "lab")
    broken = set()
    for nb_path in sorted((tmp_path / "lab").glob("*/[0-9][0-9]_*.ipynb")):
        for cell in (c for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "markdown"):
            for target in re.findall(r"\]\(([^)\s#]+)", "".join(cell["source"])):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not (nb_path.parent / target).exists():
                    broken.add(f"{nb_path.parent.name}/{nb_path.name}: {target}")
    assert not broken, sorted(broken)
