"""The import graph of distlab: every module imports, no import cycles, and dependencies point one way
(DESIGN.md, "Rules of the house"):

    theory imports no torch; parallel imports no matplotlib, ipywidgets, strategies or checkpoint;
    models imports nothing from parallel (nor strategies, checkpoint or the launcher);
    checkpoint knows no strategy names; parallel and memory.py do not import each other;
    the launcher (`distlab.launch`) reaches nothing of parallel, strategies, checkpoint or models;
    top-level distlab/ keeps the few modules a learner meets first (`TOP_LEVEL`).

The graph is read statically from the source (`ast`, relative imports resolved), with the imports
inside functions too: a lazy import is a dependency all the same, and a cycle hidden in a function
body is still a cycle. Importing a submodule runs its parent packages' ``__init__`` first; those
implicit edges are not counted (every module of a package would otherwise "import" the package).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "distlab"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


FILES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
MODULES = sorted(FILES)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of ``from <dots><node.module> import ...`` written inside ``module``."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if FILES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(distlab modules that ``module`` imports, top-level names of the other packages it imports)."""
    tree = ast.parse(FILES[module].read_text())
    inside, outside = set(), set()

    def add(name: str) -> None:
        if name == "distlab" or name.startswith("distlab."):
            while name not in FILES:                 # a name defined in a module: the module itself
                name = name.rsplit(".", 1)[0]
            inside.add(name)
        else:
            outside.add(name.split(".")[0])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:                 # `from pkg import sub` imports the module pkg.sub
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in FILES else base)
    inside.discard(module)
    return inside, outside


GRAPH = {m: _imports(m) for m in MODULES}


def _reachable(start: str) -> set[str]:
    """Every distlab module ``start`` imports, directly or through others (``start`` itself included)."""
    seen, todo = {start}, [start]
    while todo:
        for nxt in GRAPH[todo.pop()][0]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v][0]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in MODULES:
        if v not in index:
            visit(v)
    return found


def _edges_into(sources: str, targets) -> list[str]:
    """``a -> b`` for every module a under ``sources`` importing (directly) a module b for which
    ``targets(b)`` holds."""
    return sorted(f"{a} -> {b}" for a in MODULES if _under(a, sources) for b in GRAPH[a][0] if targets(b))


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports(module):
    importlib.import_module(module)


def test_the_graph_is_read_from_the_source():
    """Relative imports resolve to modules (a check of the reader itself, on edges known to exist)."""
    assert "distlab.parallel.mesh" in GRAPH["distlab.parallel.flat_collectives"][0]
    assert "distlab.strategies.loop" in GRAPH["distlab.strategies.data_parallel"][0]
    assert "torch" in GRAPH["distlab.parallel.collectives"][1]


def test_no_import_cycles():
    assert _cycles() == []


def test_theory_imports_no_torch():
    offenders = sorted(f"{m} (reached from {t})" for t in MODULES if _under(t, "distlab.theory")
                       for m in _reachable(t) if "torch" in GRAPH[m][1])
    assert offenders == []


def test_parallel_imports_no_plots_widgets_strategies_or_checkpoints():
    banned = ("distlab.strategies", "distlab.checkpoint", "distlab.viz", "distlab.widgets")
    assert _edges_into("distlab.parallel", lambda b: any(_under(b, p) for p in banned)) == []
    outside = sorted(f"{m} imports {pkg}" for t in MODULES if _under(t, "distlab.parallel")
                     for m in _reachable(t) for pkg in GRAPH[m][1] & {"matplotlib", "ipywidgets"})
    assert outside == []


def test_models_sit_below_the_parallelisms():
    """`distlab.models` (the GPT, the mixture of experts, the MLP, the data) reaches nothing of `parallel`,
    the strategies, the checkpoints or the launcher, directly or through another module: the parallel
    wrappers take models, never the reverse (`dl.ep` splits the experts of `models.moe.MoE`)."""
    banned = ("distlab.parallel", "distlab.strategies", "distlab.checkpoint", "distlab.launch",
              "distlab.train", "distlab.cli")
    models = [m for m in MODULES if _under(m, "distlab.models")]
    assert "distlab.models.moe" in GRAPH["distlab.models.gpt"][0]            # the reader sees inside models
    assert "distlab.models.moe" in GRAPH["distlab.parallel.expert.moe"][0]   # the arrow that points down
    reached = sorted(f"{m} (from {t})" for t in models for m in _reachable(t)
                     if any(_under(m, b) for b in banned))
    assert reached == []


def test_the_launcher_runs_any_function():
    """`distlab.launch` (parent side, rank side, supervisor, lifeline, torchrun, flight recorder) reaches
    nothing of the parallelisms, the strategies, the checkpoints or the models, directly or through another
    module: it runs whatever function it is given. The flight recorder takes group names from `runtime`."""
    banned = ("distlab.parallel", "distlab.strategies", "distlab.checkpoint", "distlab.models")
    room = [m for m in MODULES if _under(m, "distlab.launch")]
    assert {"distlab.launch.parent", "distlab.launch.rank", "distlab.launch.flight"} <= set(room)
    assert "distlab.runtime" in GRAPH["distlab.launch.flight"][0]            # the reader sees the lazy import
    reached = sorted(f"{m} (from {t})" for t in room for m in _reachable(t)
                     if any(_under(m, b) for b in banned))
    assert reached == []


#: The modules directly in distlab/ (packages aside): the few a learner meets first. Everything else lives in
#: a room of its own (launch/, parallel/, strategies/, checkpoint/, ...). Adding one here is a decision.
TOP_LEVEL = {"__init__", "__main__",                                       # (`python -m distlab`: cli/)
             "runtime", "trace", "memory", "memory_budget", "recomputation",    # inside a rank, measured
             "train", "rules", "progress", "stragglers",                       # dl.train and its report
             "lessons"}                                                        # `distlab lessons DIR`


def test_top_level_holds_the_few_modules_a_learner_meets_first():
    found = {p.stem for p in ROOT.glob("*.py")}
    assert found <= TOP_LEVEL, f"new modules in distlab/: {sorted(found - TOP_LEVEL)} (give them a room)"
    assert len(found - {"__init__", "__main__"}) <= 11, sorted(found)


def test_parallel_and_memory_do_not_import_each_other():
    assert _edges_into("distlab.parallel", lambda b: b == "distlab.memory") == []
    assert sorted(m for m in _reachable("distlab.memory") if _under(m, "distlab.parallel")) == []


def _strategy_names() -> set[str]:
    from distlab.strategies import REGISTRY
    return set(REGISTRY) - {"3d"}


def _code_strings(path: Path) -> list[str]:
    """String constants of a file's code, docstrings left out (they may name strategies to explain)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


def test_checkpoint_knows_no_strategy_names():
    """The checkpoint layer neither imports strategies nor compares with a strategy's name: a strategy
    hands it a `RankState` (`distlab.checkpoint.state`)."""
    reached = sorted(f"{m} (from {t})" for t in MODULES if _under(t, "distlab.checkpoint")
                     for m in _reachable(t) if _under(m, "distlab.strategies"))
    assert reached == []
    names = _strategy_names() | {"3d", "3d:", "pp-"}
    found = sorted(f"{m}: {s!r}" for m in MODULES if _under(m, "distlab.checkpoint")
                   for s in _code_strings(FILES[m]) if s in names)
    assert found == []


def test_dl_train_stays_the_function_after_its_module_is_imported():
    # importing a submodule sets it as an attribute of its package: a lazily resolved `dl.train` would
    # then be the module distlab.train, not the function (found when this file ran before a train test)
    import subprocess
    import sys
    code = "import distlab.train, distlab as dl, sys; sys.exit(0 if callable(dl.train) else 1)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_dl_launch_stays_the_function_beside_its_package():
    # distlab.launch is a package (the launcher room) and dl.launch its function: importing the package
    # or any of its modules, before or after distlab, leaves dl.launch the function
    import subprocess
    import sys
    for first in ("distlab.launch", "distlab.launch.flight", "distlab.launch.rank", "distlab"):
        code = (f"import {first}; import distlab.launch.parent, distlab as dl, sys, inspect; "
                "sys.exit(0 if inspect.isfunction(dl.launch) and dl.launch.__module__.endswith('.parent')"
                " and sys.modules['distlab.launch'].launch is dl.launch else 1)")
        assert subprocess.run([sys.executable, "-c", code]).returncode == 0, first
