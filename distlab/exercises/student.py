"""The student version of the lessons: solutions stripped, checks kept.

The lessons carry their exercises in nbgrader's markup, so ``nbgrader generate_assignment`` makes the
same student version; this module does it without nbgrader:

    python -m distlab.exercises.student notebooks student      # what `make student` runs

* in a code cell, the lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` become
  ``# YOUR CODE HERE`` and ``raise NotImplementedError("not implemented yet")`` at the same indent;
* in a markdown cell, they become ``YOUR ANSWER HERE``;
* lines between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` are removed;
* the outputs of every cell that held a solution or a check are cleared (a student sees no answer).
"""
from __future__ import annotations

import ast
import copy
import inspect
import re
import sys
import textwrap
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
STUB = 'raise NotImplementedError("not implemented yet")'


PRELUDE = """\
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distlab as dl"""


def solution_source(name: str) -> str:
    """The reference of exercise ``name`` as a notebook cell: its signature and docstring, then its
    body between the solution markers (what a student version replaces by a stub)."""
    from distlab.exercises import reference
    source = textwrap.dedent(inspect.getsource(reference(name)))
    fn = ast.parse(source).body[0]
    has_doc = isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
    first = fn.body[1 if has_doc else 0].lineno - 1                 # the body's first line, 0-based
    lines = source.splitlines()
    return "\n".join(lines[:first] + [f"    {BEGIN}"] + lines[first:] + [f"    {END}"])


def exercise_cells(names: list[str]) -> list:
    """The "Build it yourself" section of a lesson: the task, a solution cell and a graded check per
    exercise, in nbgrader's markup (``nbgrader generate_assignment`` or `student_notebook` strip it).

    The lessons carry these cells literally in their jupytext sources (``notebooks/NN_name.py``);
    ``tests/test_lesson_sources.py`` checks that each exercise's task, solution and check there still equal
    what this function makes from the reference, so a changed reference cannot leave a stale lesson. To
    write them into a new lesson (or refresh them), print them in the sources' format and paste them:

        python -m distlab.exercises.student --cells buckets ring_all_reduce      # needs jupytext
    """
    import nbformat

    from distlab.exercises import task
    intro = ("## Build it yourself\n\nWrite each function below, then run the check under it: "
             "`dl.exercises.check` runs your code on real ranks (several world sizes, sizes that do not "
             "divide) beside the reference and says the first difference in words. The teacher's version "
             "of this notebook shows a solution; the student version has a stub instead: `make lab` opens "
             "it (`lab/student/`), and `distlab lessons DIR` writes it to `DIR/student/`.")
    cells = [nbformat.v4.new_markdown_cell(intro), nbformat.v4.new_code_cell(PRELUDE)]
    for name in names:
        meta = {"schema_version": 3, "locked": False, "points": 0}
        cells += [nbformat.v4.new_markdown_cell(f"**{name}**: {task(name)}"),
                  nbformat.v4.new_code_cell(solution_source(name), metadata={"nbgrader": {
                      **meta, "solution": True, "grade": False, "grade_id": name}}),
                  nbformat.v4.new_code_cell(check_source(name), metadata={
                      "nbgrader": {**meta, "solution": False, "grade": True, "locked": True, "points": 1,
                                   "grade_id": f"check_{name}"}})]
    return cells


def check_source(name: str) -> str:
    """The graded check cell of exercise ``name`` (what `distlab grade` runs, whatever a student made of
    it)."""
    return f'dl.exercises.check("{name}", {name}).require();'


def text(source) -> str:
    """A cell's source as one string (a notebook file may store it as a list of lines)."""
    return source if isinstance(source, str) else "".join(source)


def strip_source(source: str, markdown: bool = False) -> str:
    """``source`` with each solution replaced by a stub and hidden tests removed."""
    out, skipping = [], None
    for line in source.splitlines():
        marker = line.strip()
        if marker == BEGIN:
            indent = line[: len(line) - len(line.lstrip())]
            stub = ["YOUR ANSWER HERE"] if markdown else ["# YOUR CODE HERE", STUB]
            stub = [indent + line for line in stub]
            out += stub
            skipping = END
        elif marker == HIDDEN_BEGIN:
            skipping = HIDDEN_END
        elif skipping and marker == skipping:
            skipping = None
        elif not skipping:
            out.append(line)
    if skipping:
        raise ValueError(f"a cell opens a block and never writes {skipping!r}")
    return "\n".join(out)


def student_notebook(nb):
    """A copy of notebook ``nb`` for students (see the module's docstring): an nbformat notebook or the
    plain dict of its JSON file (no nbformat needed then)."""
    nb = copy.deepcopy(nb)
    for cell in nb["cells"]:
        source = text(cell["source"])
        graded = cell.get("metadata", {}).get("nbgrader", {})
        had_solution = BEGIN in source or HIDDEN_BEGIN in source
        cell["source"] = strip_source(source, markdown=cell["cell_type"] == "markdown")
        if cell["cell_type"] == "code" and (had_solution or graded.get("grade")):
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def has_exercises(nb) -> bool:
    return any(BEGIN in text(cell["source"]) for cell in nb["cells"])


def write_student_versions(source: Path, destination: Path) -> list[Path]:
    """Every lesson of ``source`` that has exercises, as a student version in ``destination``."""
    import nbformat
    destination.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(source.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if has_exercises(nb):
            target = destination / path.name
            nbformat.write(student_notebook(nb), target)
            written.append(target)
    return written


def percent_cells(names: list[str]) -> str:
    """`exercise_cells` as jupytext percent-format text, the format of the lessons' sources, no header."""
    import jupytext
    import nbformat
    out = jupytext.writes(nbformat.v4.new_notebook(cells=exercise_cells(names)), "py:percent")
    return out[out.index("# %%"):]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cells"] and argv[1:]:
        print(percent_cells(argv[1:]), end="")
        return 0
    if len(argv) != 2:
        print("usage: python -m distlab.exercises.student LESSONS_DIR OUTPUT_DIR\n"
              "       python -m distlab.exercises.student --cells EXERCISE...   (a lesson's exercise cells, "
              "in the .py sources' format)", file=sys.stderr)
        return 2
    written = write_student_versions(Path(argv[0]), Path(argv[1]))
    for path in written:
        print(f"wrote {path} ({len(re.findall('not implemented yet', path.read_text()))} exercises to write)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
