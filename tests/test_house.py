"""The rules of the house (DESIGN.md), checked on the source: short functions and files, no class
swapping, algorithms free of instrumentation, and lessons whose links to the code stay true.

Import cycles and the direction of dependencies are checked in `test_imports.py`.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "distlab"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_FUNCTION_LINES = 60          # statements of a function, its docstring not counted
MAX_FILE_LINES = 400
# where tracing and measuring attach (everything else in parallel/ is algorithm)
INSTRUMENTATION_FILES = {"collectives.py", "labels.py", "measure.py"}   # the tracing itself


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _code_lines(fn: ast.FunctionDef) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]                              # the docstring
    if not body:
        return 0
    return body[-1].end_lineno - body[0].lineno + 1


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_and_files_are_short(path):
    source = path.read_text()
    lines = source.count("\n")
    name = path.relative_to(ROOT)
    assert lines <= MAX_FILE_LINES, f"{name} has {lines} lines (> {MAX_FILE_LINES}): split it"
    long = [(fn.name, n) for fn in _functions(ast.parse(source))
            if (n := _code_lines(fn)) > MAX_FUNCTION_LINES]
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_class_swapping():
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr == "__class__"]
    assert not found, f"__class__ assigned at {found}: build a new object instead"


def _instrumentation(path: Path) -> list[str]:
    """Trace labels, tracer calls and memory probes inside an algorithm file."""
    tree = ast.parse(path.read_text())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("where", "operator", "phase"):
            hits.append(f"{node.arg}= at line {node.value.lineno}")
        elif isinstance(node, ast.arg) and node.arg == "where":
            hits.append(f"parameter 'where' at line {node.lineno}")
        elif isinstance(node, ast.Call) and _called(node) in ("tracer", "SavedActivations"):
            hits.append(f"{_called(node)}() at line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("memory") and node.level:
            hits.append(f"imports memory at line {node.lineno}")
    return hits


def _called(call: ast.Call) -> str:
    return getattr(call.func, "id", getattr(call.func, "attr", ""))


ALGORITHMS = [p for p in sorted((PACKAGE / "parallel").rglob("*.py")) if p.name not in INSTRUMENTATION_FILES]


@pytest.mark.parametrize("path", ALGORITHMS, ids=lambda p: str(p.relative_to(ROOT)))
def test_algorithms_carry_no_instrumentation(path):
    hits = _instrumentation(path)
    assert not hits, (f"{path.relative_to(ROOT)} instruments itself ({hits}): record in "
                      "parallel/collectives.py, tag from outside with collectives.scope or module hooks, "
                      "measure memory in distlab/memory.py")


def test_the_probe_finds_instrumentation(tmp_path):
    planted = tmp_path / "algo.py"
    planted.write_text("from ..memory import SavedActivations\n"
                       "def f(x, where=None):\n    tracer().span('F')\n    return g(x, where='blocks.0')\n")
    assert len(_instrumentation(planted)) == 4


LESSONS = sorted(ROOT.glob("notebooks/[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\]\((\.\./distlab/[^)#\s]+)\)")


def _markdown(nb_path: Path) -> str:
    cells = json.loads(nb_path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lessons_link_the_code_they_explain(lesson):
    links = LINK.findall(_markdown(lesson))
    assert links, f"{lesson.name} links no file of distlab/ (e.g. [ddp.py](../distlab/parallel/data/ddp.py))"
    broken = [link for link in links if not (lesson.parent / link).exists()]
    assert not broken, f"{lesson.name} links files that do not exist: {broken}"
