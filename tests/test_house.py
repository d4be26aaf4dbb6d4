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
# Where tracing and measuring live, under distlab/ (a name ending in "/": the whole folder). Every other
# file is algorithm (or a pure formula, or a checker) and carries no instrumentation.
INSTRUMENTATION = {
    "trace.py": "the event recorder itself",
    "memory.py": "the memory ledger: measures saved activations and buffers from outside",
    "memory_budget.py": "the ledger's limit: raises, naming the phase, when the bytes it counts cross it",
    "comm/p2p.py": "dl.comm's one attachment point: its primitives record each step of the call they run in",
    "comm/replay.py": "a measuring tool, not an algorithm: re-runs recorded calls on the ring and reads back "
                      "the bytes its sends recorded",
    "parallel/collectives.py": "the one traced wrapper over torch.distributed: records every collective",
    "parallel/flat_collectives.py": "the flat-buffer half of the wrapper (DDP, ZeRO, FSDP)",
    "parallel/labels.py": "names modules from outside (forward hooks) for the wrapper's events",
    "parallel/pipeline/measure.py": "the pipeline's observers: a span per action, the step's mark",
    "strategies/": "where a run is assembled and measured: the step loop's marks and spans, the ledger",
    "viz/": "draws traces and memory records; runs no algorithm",
    "recomputation.py": "hands the ledger's counting context to torch's checkpoint (its context_fn): the "
                        "ledger measures what backward rebuilds from outside the recomputed module",
}


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


LABELS = ("where", "operator", "phase", "call_id", "send_chunk", "recv_chunk")   # keywords only a trace reads
RECORDERS = ("tracer", "SavedActivations", "record", "span", "mark", "comm_span")  # calls that write a trace


def _instrumentation(path: Path) -> list[str]:
    """Trace labels, tracer calls and memory probes inside an algorithm file."""
    tree = ast.parse(path.read_text())
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in LABELS:
            hits.append(f"{node.arg}= at line {node.value.lineno}")
        elif isinstance(node, ast.arg) and node.arg in LABELS:
            hits.append(f"parameter '{node.arg}' at line {node.lineno}")
        elif isinstance(node, ast.Call) and _called(node) in RECORDERS:
            hits.append(f"{_called(node)}() at line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("memory") and node.level:
            hits.append(f"imports memory at line {node.lineno}")
    return hits


def _called(call: ast.Call) -> str:
    return getattr(call.func, "id", getattr(call.func, "attr", ""))


def _instrumented(path: Path) -> bool:
    name = path.relative_to(PACKAGE).as_posix()
    return any(name == k or (k.endswith("/") and name.startswith(k)) for k in INSTRUMENTATION)


ALGORITHMS = [p for p in SOURCES if not _instrumented(p)]


@pytest.mark.parametrize("path", ALGORITHMS, ids=lambda p: str(p.relative_to(ROOT)))
def test_algorithms_carry_no_instrumentation(path):
    hits = _instrumentation(path)
    assert not hits, (f"{path.relative_to(ROOT)} instruments itself ({hits}): record in "
                      "parallel/collectives.py (dl.comm: in comm/p2p.py's primitives, inside the call "
                      "comm/traced.py opens), tag from outside with collectives.scope or module hooks, "
                      "measure memory in distlab/memory.py")


def test_the_instrumentation_list_is_short_and_true():
    """Every folder of distlab/ is checked (the listed folders aside), and each exception exists."""
    def listed(p: Path, name: str) -> bool:
        return p.relative_to(PACKAGE).as_posix().startswith(name)
    folders = [k for k in INSTRUMENTATION if k.endswith("/")]
    unlisted = {p.parent for p in SOURCES if not any(listed(p, k) for k in folders)}
    assert unlisted == {p.parent for p in ALGORITHMS}, "a folder of distlab/ goes unchecked"
    missing = [name for name in INSTRUMENTATION if not any(listed(p, name) for p in SOURCES)]
    assert not missing, f"INSTRUMENTATION lists {missing}, not in distlab/"


def test_the_probe_finds_instrumentation(tmp_path):
    planted = tmp_path / "algo.py"
    planted.write_text("from ..memory import SavedActivations\n"
                       "def f(x, where=None):\n    tracer().span('F')\n    return g(x, where='blocks.0')\n"
                       "def ring(t, step, c):\n    collectives.record('x', send_chunk=c)\n")
    assert len(_instrumentation(planted)) == 7


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
