"""The student version of the lessons: `make student` strips the solutions and keeps the checks; run as a
student would, each stub says "not implemented yet" in its check cell, and nothing else fails."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import distlab as dl
from distlab.exercises.student import (BEGIN, END, exercise_cells, strip_source, student_notebook,
                                       write_student_versions)

LESSONS = Path(__file__).resolve().parents[1] / "notebooks"


def test_strip_source_replaces_solutions_and_drops_hidden_tests():
    code = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
    assert strip_source(code) == ("def f(x):\n    '''doc'''\n    # YOUR CODE HERE\n"
                                  '    raise NotImplementedError("not implemented yet")')
    check = "assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(2) == 3\n### END HIDDEN TESTS"
    assert strip_source(check) == "assert f(1) == 2"
    assert strip_source("Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION", markdown=True) == \
        "Why?\nYOUR ANSWER HERE"
    with pytest.raises(ValueError, match="never writes"):
        strip_source("### BEGIN SOLUTION\nx = 1")


def test_every_exercise_is_in_a_lesson_in_nbgrader_markup():
    in_lessons = set()
    for path in sorted(LESSONS.glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            grade = cell.get("metadata", {}).get("nbgrader", {})
            if grade.get("solution"):
                assert BEGIN in cell.source and END in cell.source, path.name
                in_lessons.add(grade["grade_id"])
            if grade.get("grade"):
                assert ".require()" in cell.source and grade["points"] == 1 and grade["locked"]
    assert in_lessons == set(dl.exercises.names())


def test_student_versions_have_no_solutions_and_their_stubs_say_not_implemented(tmp_path):
    written = write_student_versions(LESSONS, tmp_path)
    assert len(written) >= 8
    for path in written:
        nb = nbformat.read(path, as_version=4)
        assert not any(BEGIN in c.source or END in c.source for c in nb.cells), path.name
        first = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Build it yourself"))
        part = nbformat.v4.new_notebook(cells=nb.cells[first:], metadata=nb.metadata)
        NotebookClient(part, timeout=300, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(LESSONS)}}).execute()
        graded = [c for c in part.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
        assert graded, path.name
        for cell in part.cells:
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            if cell in graded:                              # the check: a friendly "not implemented yet"
                assert [(e["ename"], "not implemented yet" in e["evalue"]) for e in errors] == \
                    [("NotImplementedError", True)], (path.name, cell.source, errors)
            else:                                           # the stubs themselves define cleanly
                assert not errors, (path.name, cell.source, errors)


def test_a_teacher_cell_round_trips_to_a_student_cell():
    cells = exercise_cells(["buckets"])
    nb = nbformat.v4.new_notebook(cells=cells)
    student = student_notebook(nb)
    solution = next(c for c in student.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution"))
    assert solution.source.startswith("def buckets(sizes") and "not implemented yet" in solution.source
    assert "reversed" not in solution.source                 # the answer is gone, the docstring stays
    assert "reverse* order" in solution.source
