"""`distlab grade PATH`: every exercise check of a student notebook (or of a folder of them), headless.

    distlab grade lab/student                                   # a score per exercise, then the total
    distlab grade submissions/ --junit grades.xml --json grades.json
    distlab grade --template > tests/test_exercises.py          # the same under pytest, for a course's repo

What runs, per notebook, in a fresh Jupyter kernel (nbclient) started in the notebook's folder:

    the cells from "## Build it yourself" on (the exercises' imports, the learner's solutions, the checks);
        the whole notebook with --all-cells, or where a notebook has no such heading (as nbgrader does)
    each graded check cell as the lesson wrote it (`student.check_source`): a student's edit to a check
        cell is not what is graded, as nbgrader restores its locked cells
    a cell that errors does not stop the next; a cell running past --timeout is interrupted

An exercise is a graded cell (nbgrader metadata ``grade: true``, grade_id ``check_<name>``): passed when its
check cell ran without an error; otherwise "not implemented yet" (the stub), "failed" (the check's first
difference, in its words) or "error" (anything else: the solution cell's own error is named). Works on the
student versions `make student` / `distlab lessons` write and on nbgrader's (both keep the metadata).
Exit status: 0 when every exercise passed, 1 when one did not, 2 for bad input.
"""
from __future__ import annotations

import json
import re
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from .student import check_source, text

SECTION = "## Build it yourself"


@dataclass
class Outcome:
    """One exercise of one notebook, as graded."""

    notebook: str
    exercise: str
    status: str             # "passed" | "not implemented" | "failed" | "error"
    points: float
    max_points: float
    message: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# -- which cells ----------------------------------------------------------------------------------
def graded_cells(nb: dict) -> list[tuple[int, str, float]]:
    """(index, exercise name, points) of every graded cell: nbgrader's ``grade: true`` cells, named by
    their grade_id without its ``check_`` prefix."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell["cell_type"] == "code" and meta.get("grade"):
            grade_id = meta.get("grade_id", f"cell_{i}")
            found.append((i, grade_id.removeprefix("check_"), float(meta.get("points", 1))))
    return found


def cells_to_run(nb: dict, all_cells: bool = False) -> list[int]:
    """The code cells to execute: from the exercise section's heading on, or every one."""
    cells = nb["cells"]
    start = 0
    if not all_cells:
        start = next((i for i, c in enumerate(cells)
                      if c["cell_type"] == "markdown" and text(c["source"]).lstrip().startswith(SECTION)), 0)
    return [i for i in range(start, len(cells)) if cells[i]["cell_type"] == "code"]


def _runnable(nb: dict, indices: list[int]) -> dict:
    """A notebook of the cells ``indices`` (their outputs cleared), each distlab check cell restored."""
    from distlab.exercises import names
    known = set(names())
    cells = []
    for i in indices:
        cell = json.loads(json.dumps(nb["cells"][i]))
        cell.update(outputs=[], execution_count=None, source=text(cell["source"]))
        meta = cell.get("metadata", {}).get("nbgrader", {})
        name = meta.get("grade_id", "").removeprefix("check_")
        if meta.get("grade") and name in known:
            cell["source"] = "import distlab as dl\n" + check_source(name)
        cells.append(cell)
    return {**nb, "cells": cells}


# -- running --------------------------------------------------------------------------------------
def execute(nb: dict, folder: Path, timeout: float) -> tuple[dict, str | None]:
    """Run ``nb`` in a fresh kernel started in ``folder``; returns it with its outputs, and why it stopped
    early (a kernel that died), if it did."""
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as err:
        raise ImportError("distlab grade runs notebooks with nbclient: pip install 'distlab[lab]' "
                          f"(or nbclient and ipykernel) ({err})") from err
    node = nbformat.from_dict(nb)
    client = NotebookClient(node, timeout=timeout, kernel_name="python3", allow_errors=True,
                            interrupt_on_timeout=True, resources={"metadata": {"path": str(folder)}},
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])   # no warning per kernel
    try:
        client.execute()
    except Exception as err:                               # noqa: BLE001 - a dead kernel, reported per exercise
        first = (_clean(str(err)).strip().splitlines() or [""])[0]
        return node, f"the notebook stopped before this cell ran: {type(err).__name__}: {first}"
    return node, None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _clean(s: str) -> str:
    """Without terminal colours and characters XML cannot hold."""
    return _CONTROL.sub("", _ANSI.sub("", s))


def _error(cell: dict) -> dict | None:
    return next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)


def judge(cell: dict, solution: dict | None, stopped: str | None) -> tuple[str, str]:
    """(status, message) of one executed check cell."""
    error = _error(cell)
    if error is None:
        if cell.get("execution_count") is None and stopped:
            return "error", stopped
        return "passed", _stdout(cell)
    ename, evalue = error.get("ename", ""), _clean(error.get("evalue", ""))
    if ename == "NotImplementedError" or "not implemented yet" in evalue:
        return "not implemented", evalue or "not implemented yet"
    if ename == "ExerciseNotPassed":
        return "failed", evalue
    message = f"{ename}: {evalue}"
    own = _error(solution) if solution is not None else None
    if own is not None:
        message += f" (its solution cell raised {own.get('ename')}: {_clean(own.get('evalue', ''))})"
    return "error", message


def _stdout(cell: dict) -> str:
    return _clean("".join(text(o.get("text", "")) for o in cell.get("outputs", [])
                          if o.get("output_type") == "stream")).strip()


def grade_notebook(path, timeout: float = 600.0, all_cells: bool = False, name: str | None = None
                   ) -> list[Outcome]:
    """Every exercise of notebook ``path``, run and judged (see the module's docstring)."""
    path = Path(path)
    nb = json.loads(path.read_text())
    graded = graded_cells(nb)
    if not graded:
        return []
    indices = cells_to_run(nb, all_cells)
    indices = sorted(set(indices) | {i for i, _, _ in graded})
    start = time.monotonic()
    ran, stopped = execute(_runnable(nb, indices), path.parent.resolve(), timeout)
    seconds = time.monotonic() - start
    by_index = dict(zip(indices, ran["cells"]))
    meta = [c.get("metadata", {}).get("nbgrader", {}) for c in nb["cells"]]
    solutions = {m.get("grade_id"): by_index.get(i) for i, m in enumerate(meta) if m.get("solution")}
    outcomes = []
    for i, exercise, points in graded:
        status, message = judge(by_index[i], solutions.get(exercise), stopped)
        outcomes.append(Outcome(name or path.name, exercise, status, points if status == "passed" else 0.0,
                                points, message, round(seconds / len(graded), 3)))
    return outcomes


def notebooks(path) -> list[Path]:
    """``path`` itself, or every notebook under the folder ``path`` (hidden folders, checkpoints and
    virtual environments left out), sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no notebook or folder at {path}")
    skip = {"site-packages", "node_modules"}
    return sorted(p for p in path.rglob("*.ipynb")
                  if not any(part.startswith(".") or part in skip for part in p.relative_to(path).parts))


def grade(path, timeout: float = 600.0, all_cells: bool = False, echo=None, jobs: int = 1) -> list[Outcome]:
    """Every exercise of every notebook at ``path``, ``jobs`` notebooks at a time (a kernel each);
    ``echo(outcomes)`` as each notebook finishes. Returned in the notebooks' order."""
    from concurrent.futures import ThreadPoolExecutor
    root = Path(path)

    def one(nb: Path) -> list[Outcome]:
        name = str(nb.relative_to(root)) if root.is_dir() else nb.name
        try:
            found = grade_notebook(nb, timeout, all_cells, name=name)
        except (ValueError, KeyError, UnicodeDecodeError) as err:   # not a notebook: said, the rest goes on
            found = [Outcome(name, "(notebook)", "error", 0.0, 0.0,
                             f"could not read it: {type(err).__name__}: {err}")]
        if echo and found:
            echo(found)
        return found

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return [o for found in pool.map(one, notebooks(root)) for o in found]


# -- reporting ------------------------------------------------------------------------------------
def score_lines(outcomes: list[Outcome]) -> str:
    """One notebook's scores as text: a line per exercise, its message's first line under a miss."""
    lines = [outcomes[0].notebook]
    for o in outcomes:
        lines.append(f"  {o.exercise:<30} {o.points:g}/{o.max_points:g}  {o.status}")
        if not o.passed and o.message:
            lines.append(f"      {o.message.strip().splitlines()[0][:200]}")
    got, of = sum(o.points for o in outcomes), sum(o.max_points for o in outcomes)
    lines.append(f"  score {got:g}/{of:g}")
    return "\n".join(lines)


def summary(outcomes: list[Outcome]) -> dict:
    """The JSON summary: the total, then per notebook its score and every exercise's outcome."""
    by_notebook: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_notebook.setdefault(o.notebook, []).append(o)
    return {"score": sum(o.points for o in outcomes), "max_score": sum(o.max_points for o in outcomes),
            "passed": sum(o.passed for o in outcomes), "exercises": len(outcomes),
            "notebooks": [{"notebook": nb, "score": sum(o.points for o in found),
                           "max_score": sum(o.max_points for o in found),
                           "exercises": [{k: v for k, v in asdict(o).items() if k != "notebook"}
                                         for o in found]}
                          for nb, found in by_notebook.items()]}


def junit_xml(outcomes: list[Outcome]) -> str:
    """JUnit XML: a testsuite per notebook, a testcase per exercise; a wrong answer is a <failure>, a stub
    not written yet a <failure type="NotImplemented">, anything else an <error>."""
    suites = ET.Element("testsuites", name="distlab grade")
    for nb in dict.fromkeys(o.notebook for o in outcomes):
        found = [o for o in outcomes if o.notebook == nb]
        suite = ET.SubElement(suites, "testsuite", name=nb, tests=str(len(found)),
                              failures=str(sum(o.status in ("failed", "not implemented") for o in found)),
                              errors=str(sum(o.status == "error" for o in found)), skipped="0",
                              time=f"{sum(o.seconds for o in found):.3f}")
        for o in found:
            case = ET.SubElement(suite, "testcase", classname=nb.removesuffix(".ipynb").replace("/", "."),
                                 name=o.exercise, time=f"{o.seconds:.3f}")
            if not o.passed:
                tag = "error" if o.status == "error" else "failure"
                kind = {"failed": "ExerciseNotPassed", "not implemented": "NotImplemented"}.get(o.status,
                                                                                                "Error")
                first = o.message.strip().splitlines()[0] if o.message.strip() else o.status
                ET.SubElement(case, tag, message=first[:500], type=kind).text = o.message
    for key in ("tests", "failures", "errors"):
        suites.set(key, str(sum(int(s.get(key)) for s in suites)))
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


# -- the command ----------------------------------------------------------------------------------
def add_parser(sub) -> None:
    """Register ``distlab grade`` on the CLI's subparsers (`distlab.cli`)."""
    p = sub.add_parser("grade", help="run every exercise check of student notebooks headless and score them",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("path", metavar="PATH", nargs="?", help="a notebook, or a folder of them (searched below)")
    p.add_argument("--junit", metavar="FILE", help="write JUnit XML (a testcase per exercise)")
    p.add_argument("--json", metavar="FILE", help="write the scores as JSON ('-': stdout)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a cell may run before it is interrupted")
    p.add_argument("--jobs", "-j", type=int, default=1, help="notebooks graded at once (a kernel each)")
    p.add_argument("--all-cells", action="store_true",
                   help="run every cell of each notebook, not only its exercise section")
    p.add_argument("--template", action="store_true",
                   help="print a pytest file that grades a course repository's notebooks, and exit")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.template:
        from .pytest_template import TEMPLATE
        print(TEMPLATE, end="")
        return 0
    if not args.path:
        print("distlab: error: grade needs a PATH (a notebook or a folder), or --template", file=sys.stderr)
        return 2
    out = sys.stderr if args.json == "-" else sys.stdout
    outcomes = grade(args.path, args.timeout, args.all_cells, jobs=args.jobs,
                     echo=lambda found: print(score_lines(found), file=out, flush=True))
    if not outcomes:
        print(f"distlab: error: no graded exercise cells in {args.path}", file=sys.stderr)
        return 2
    total = summary(outcomes)
    print(f"total {total['score']:g}/{total['max_score']:g} ({total['passed']} of {total['exercises']} "
          "exercises passed)", file=out)
    if args.junit:
        Path(args.junit).write_text(junit_xml(outcomes))
    if args.json:
        text_ = json.dumps(total, indent=1) + "\n"
        sys.stdout.write(text_) if args.json == "-" else Path(args.json).write_text(text_)
    return 0 if all(o.passed for o in outcomes) else 1
