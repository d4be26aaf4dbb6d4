"""How an exercise is checked: the learner's function runs on real ranks, case by case, beside the
reference, and the first difference is said in words.

    check(name, fn)
      for each world size the exercise lists (some that do not divide the data):
        launch the ranks; on every rank, for every case (seeded random inputs, edge cases):
            output = exercise.run(fn, case)          # the learner's code, on this rank
        in the parent, for every rank and case:
            expected = exercise.expect(case, rank, world_size)   # the reference, computed alone
            the first mismatch -> "on 2 ranks, case '7 elements', rank 1, element 3 of 7: expected 4.0,
                                    got 2.0"
      a hang ends at the deadline with what each rank was waiting for (see `P2PLog`)

Exercises without communication (a schedule, a router) set ``world_sizes=()`` and run in this process.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

REGISTRY: dict[str, "Exercise"] = {}


@dataclass(frozen=True)
class Exercise:
    """One build-it-yourself exercise.

    ``cases(world_size)`` the inputs (a list of dicts, each with a "label"); ``run(fn, case)`` calls the
    learner's function on one rank (or in-process) and returns what to compare; ``expect(case, rank,
    world_size)`` what that should be, from the reference; ``compare(got, expected)`` None when right,
    else the difference in words (default: tensors equal within ``atol``).
    """

    name: str
    lesson: str
    task: str
    reference: Callable
    cases: Callable[[int], list[dict]]
    run: Callable[[Callable, dict], Any]
    expect: Callable[[dict, int, int], Any]
    hint: str
    world_sizes: tuple[int, ...] = (1, 2, 3, 4)
    compare: Callable[[Any, Any], str | None] | None = None
    atol: float = 1e-5


def register(exercise: Exercise) -> Exercise:
    REGISTRY[exercise.name] = exercise
    return exercise



@dataclass
class Result:
    """What ``check`` found: ``passed``, what was checked, the first problem and a hint."""

    name: str
    passed: bool
    checked: list[str] = field(default_factory=list)
    problem: str | None = None
    hint: str = ""
    shown: bool = False            # printed by `check` (then `require` does not repeat it in Jupyter)

    def __str__(self) -> str:
        if self.passed:
            return f"PASSED {self.name}: " + "; ".join(self.checked)
        done = f"\n  passed before that: {'; '.join(self.checked)}" if self.checked else ""
        return f"NOT YET {self.name}: {self.problem}{done}\n  hint: {self.hint}"

    __repr__ = __str__

    def require(self) -> None:
        """Raise unless passed: `NotImplementedError` for a stub not written yet ("not implemented yet"),
        `ExerciseNotPassed` with the first difference otherwise. For graded cells: it returns None, so a
        cell ending in it shows only what `check` printed (nbval runs cells without history, where a
        trailing ``;`` does not silence a value). In Jupyter either shows as one line, not a traceback
        through this file, and does not repeat a difference `check` has printed already."""
        if self.passed:
            return None
        if "NotImplementedError" in (self.problem or ""):
            raise one_line(NotImplementedError(f"{self.name}: not implemented yet; write it in the cell "
                                               "above, then run this cell again"))
        brief = f"{self.name}: not passed yet (what differs is printed above)" if self.shown else None
        raise one_line(ExerciseNotPassed(str(self)), brief)


def one_line(err: BaseException, brief: str | None = None) -> BaseException:
    """``err``, shown by IPython as one line (its `_render_traceback_` hook, read from the instance) rather
    than a traceback through the checker: ``brief`` if given, else the message."""
    text = f"\x1b[0;31m{type(err).__name__}\x1b[0m: {brief or err}"
    err._render_traceback_ = lambda: [text]
    return err


class ExerciseNotPassed(AssertionError):
    """A learner's solution that gives a different answer than the reference (the message says where)."""


# -- comparing ------------------------------------------------------------------------------------
def compare_tensors(got, expected, atol: float = 1e-5, rtol: float = 1e-6) -> str | None:
    """None when ``got`` equals ``expected`` (shape, then values within ``atol + rtol |expected|``),
    else the first difference: "element 3 of 7: expected 4.0, got 2.0"."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor of shape {tuple(expected.shape)}, got {type(got).__name__}"
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    got, expected = got.detach().double(), expected.double()
    wrong = ((got - expected).abs() > atol + rtol * expected.abs()).flatten()
    if not wrong.any():
        return None
    i = int(wrong.nonzero()[0])
    index = [int(j) for j in torch.unravel_index(torch.tensor(i), expected.shape)]
    at = f" (index {index})" if expected.dim() > 1 else ""
    return (f"element {i} of {expected.numel()}{at}: expected {expected.flatten()[i].item():.6g}, "
            f"got {got.detach().flatten()[i].item():.6g} ({int(wrong.sum())} elements differ)")


def compare_outputs(got, expected, names: tuple[str, ...], atol: float = 1e-5) -> str | None:
    """For a function returning several tensors: each compared on its own and named, "weight: element 3
    of 20 (index [1, 1]) ..." (never an index into the outputs joined together)."""
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        return f"expected {len(names)} outputs ({', '.join(names)}), got {_describe(got)}"
    for name, mine, right in zip(names, got, expected):
        problem = compare_tensors(mine, right, atol)
        if problem:
            return f"{name}: {problem}"
    return None


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def differs(exercise: Exercise, got, expected) -> str | None:
    if isinstance(got, _Raised):
        return f"raised {got.text}"
    if exercise.compare is not None:
        return exercise.compare(got, expected)
    return compare_tensors(got, expected, exercise.atol)


@dataclass(frozen=True)
class _Raised:
    text: str


# -- running --------------------------------------------------------------------------------------
def run_cases(exercise: Exercise, fn: Callable, world_size: int) -> list:
    """Every case of ``exercise`` through ``fn`` here; an exception becomes a `_Raised` (a learner's
    stub saying "not implemented yet" is reported as such, not as a traceback wall)."""
    outputs = []
    for case in exercise.cases(world_size):
        try:
            outputs.append(exercise.run(fn, case))
        except Exception as err:                          # noqa: BLE001 - reported in words below
            where = traceback.extract_tb(err.__traceback__)[-1]
            outputs.append(_Raised(f"{type(err).__name__}: {err} (line {where.lineno} of {where.name})"))
    return outputs


def sends_during(call: Callable[[], Any]) -> tuple[Any, list[int]]:
    """``call()`` and the peers of the sends it made on this rank (none outside a check's ranks)."""
    out, messages = p2p_during(call)
    return out, [peer for kind, peer, _ in messages if kind == "send"]


def p2p_during(call: Callable[[], Any]) -> tuple[Any, list[tuple[str, int, int]]]:
    """``call()`` and every send and receive it posted on this rank, as ("send" or "recv", peer, bytes)."""
    log = P2PLog.current
    before = len(log.messages) if log else 0
    out = call()
    return out, (log.messages[before:] if log else [])


def _on_rank(module: str, name: str, fn: Callable, log_dir: str) -> list:
    """What each rank runs: the exercise's cases, with every send and receive logged for hangs. The
    module that registers the exercise is imported first (a rank started by spawn has not yet)."""
    import importlib

    import distlab as dl
    importlib.import_module(module)
    with P2PLog(Path(log_dir) / f"rank{dl.rank()}.jsonl"):
        return run_cases(REGISTRY[name], fn, dl.world_size())


def check(name: str, fn: Callable, world_sizes: tuple[int, ...] | None = None, timeout: float = 30.0,
          quiet: bool = False) -> Result:
    """Run ``fn`` as the solution of exercise ``name``; print and return the `Result`."""
    exercise = REGISTRY.get(name)
    if exercise is None:
        raise KeyError(f"no exercise named {name!r}; dl.exercises.names() lists them")
    result = Result(name, passed=True, hint=exercise.hint)
    for n in (exercise.world_sizes if world_sizes is None else world_sizes) or (0,):
        cases = exercise.cases(max(n, 1))
        problem = _check_world(exercise, fn, n, timeout, cases)
        where = f"on {n} rank{'s' * (n != 1)}" if n else "in this process"
        if problem:
            result.passed, result.problem = False, f"{where}, {problem}"
            break
        result.checked.append(f"{len(cases)} cases {where}")
    if not quiet:
        print(result)
        result.shown = True
    return result


def _check_world(exercise: Exercise, fn: Callable, n: int, timeout: float, cases: list[dict]) -> str | None:
    if n == 0:
        per_rank = [run_cases(exercise, fn, 1)]
    else:
        per_rank = _launch(exercise, fn, n, timeout)
        if isinstance(per_rank, str):
            return per_rank
    for rank, outputs in enumerate(per_rank):
        for case, got in zip(cases, outputs):
            problem = differs(exercise, got, exercise.expect(case, rank, max(n, 1)))
            if problem:
                who = f"rank {rank}, " if n else ""
                return f"case '{case['label']}', {who}{problem}"
    return None


def _launch(exercise: Exercise, fn: Callable, n: int, timeout: float) -> list | str:
    import distlab as dl
    with tempfile.TemporaryDirectory(prefix="distlab-exercise-") as logs:
        try:
            where = exercise.reference.__module__           # the module that registers it
            return dl.launch(_on_rank, world_size=n, args=(where, exercise.name, fn, logs), timeout=timeout,
                             output="quiet").results
        except dl.LaunchError as err:
            last_line = err.failures[err.rank].strip().splitlines()[-1] if err.rank is not None else ""
            if err.rank is None or "timed out" in last_line.lower() or "timeout" in last_line.lower():
                returned = set(range(n)) - set(err.unfinished) - set(err.failures)
                why = explain_hang(Path(logs), n, err.flight, returned)
                return f"the ranks hung for {timeout:g} s: {why}"
            return f"rank {err.rank} failed: {last_line}"


# -- hangs: who waited for whom -------------------------------------------------------------------
class P2PLog(contextlib.ContextDecorator):
    """Inside a rank, log every send/recv/isend/irecv as posted and finished, one JSON line each, to
    a file the parent reads if the ranks hang (a killed rank's file survives it). It listens to the
    flight recorder's tap on torch.distributed (`distlab.launch.flight.listening`), which every launch
    installs; this log adds the per-check file and the peers of the sends."""

    current: "P2PLog | None" = None        # the log of this rank, for exercises that judge the messages

    def __init__(self, path: Path):
        self.path, self._listening = path, None
        self.messages: list[tuple[str, int, int]] = []    # ("send" or "recv", peer, bytes), in order

    def __enter__(self):
        from ..launch import flight
        P2PLog.current = self
        self.file = open(self.path, "w", buffering=1)
        self._listening = flight.listening(self)
        self._listening.__enter__()
        return self

    def __exit__(self, *exc):
        self._listening.__exit__(*exc)
        P2PLog.current = None
        self.file.close()
        return False

    def entered(self, op: str, group: str, ranks, peer: int | None, nbytes: int):
        """Called by the tap as an operation starts; returns the token `finished` gets back."""
        from ..launch.flight import P2P
        if op not in P2P:
            return None
        self.messages.append(("send" if op in ("send", "isend") else "recv", peer, nbytes))
        self._write("posted", op, peer)
        return op, peer

    def finished(self, token) -> None:
        if token is not None:
            self._write("finished", *token)

    def _write(self, event: str, op: str, peer: int | None) -> None:
        self.file.write(json.dumps({"event": event, "op": op, "peer": peer}) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def explain_hang(logs: Path, n: int, flight: dict | None = None, returned=()) -> str:
    """Each rank's unfinished operations, matched against its peers' sends: "rank 2 never received
    from rank 1 (rank 1 posted no send to rank 2)"; when no rank waits in a send or receive, the flight
    recorder's account of the collectives (`distlab.launch.flight.diagnose`), if ``flight`` is given."""
    events = {r: _read(logs / f"rank{r}.jsonl") for r in range(n)}
    if flight and not any(_unfinished(events[r]) for r in range(n)):
        from ..launch.flight import diagnose
        return diagnose(flight, returned=returned).replace("\n", "; ")
    sent: dict[tuple[int, int], int] = {}
    for r in range(n):
        for e in events[r]:
            if e["event"] == "posted" and e["op"] in ("send", "isend"):
                sent[(r, e["peer"])] = sent.get((r, e["peer"]), 0) + 1
    lines = []
    for r in range(n):
        pending = _unfinished(events[r])
        for op, peer in pending:
            if op in ("recv", "irecv"):
                posted = sent.get((peer, r), 0)
                lines.append(f"rank {r} never received from rank {peer} "
                             f"(rank {peer} posted {posted} send{'s' * (posted != 1)} to rank {r})")
            else:
                lines.append(f"rank {r} waits in {op} to rank {peer}")
        if not pending:
            lines.append(f"rank {r} was not inside a send or receive")
    return "; ".join(lines) or "no rank was inside a send or receive (a collective, a loop?)"


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _unfinished(events: list[dict]) -> list[tuple[str, int]]:
    """Operations posted and never finished (matched in order per (op, peer))."""
    open_ops: list[tuple[str, int]] = []
    for e in events:
        key = (e["op"], e["peer"])
        if e["event"] == "posted":
            open_ops.append(key)
        elif key in open_ops:
            open_ops.remove(key)
    return open_ops
