"""The ``distlab`` command as a newcomer meets it: ``--help`` and typos answer without importing torch,
a misspelled flag, subcommand or choice gets a did-you-mean, ``distlab strategies`` says what each
option does (from the typed spec's field docstrings), the header prints before training starts, and the
mean step time leaves the warm-up step out and says so."""
import argparse
import dataclasses
import re
import subprocess
import sys

import pytest

from distlab.cli import OPTIONS, WITHOUT_FLAG, _parser, main, mean_step_time, train_keywords
from distlab.rules import rule_of
from distlab.strategies.parse import TOP, names, options, parse
from distlab.strategies.spec import CONCERNS, WHERE, DataParallel, Layout

ROWS = [row for rows in OPTIONS.values() for row in rows]


def _imports(*argv: str) -> tuple[str, str]:
    """(the modules imported while ``distlab ARGV`` ran, its stderr), from ``python -X importtime``."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c",
                          "import sys; from distlab.cli import main; sys.exit(main(sys.argv[1:]))", *argv],
                         capture_output=True, text=True, timeout=120)
    modules = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()
               if line.startswith("import time:")]
    return " ".join(modules), run.stderr


@pytest.mark.parametrize("argv", [("--help",), ("train", "--help"), ("trian",),
                                  ("train", "--stratgy", "ddp")])
def test_help_and_typos_answer_without_importing_torch(argv):
    modules, stderr = _imports(*argv)
    assert "distlab.cli" in modules.split(), stderr[-2000:]
    assert "torch" not in modules.split() and "numpy" not in modules.split(), [
        m for m in modules.split() if m.startswith(("torch", "numpy"))][:5]


def test_a_misspelled_flag_subcommand_or_choice_gets_a_suggestion(capsys):
    for argv, said in [(["train", "--stratgy", "ddp"], "unrecognized arguments: --stratgy ddp (did you mean "
                                                        "--strategy?)"),
                       (["train", "--world-sise=2"], "(did you mean --world-size?)"),
                       (["train", "--sync-evry", "4"], "(did you mean --sync-every?)"),
                       (["train", "--quantise", "int8"], "(did you mean --quantize?)"),
                       (["train", "--quantize", "int4"], "invalid choice: 'int4'"),
                       (["trian"], "invalid choice: 'trian'"),
                       (["trian"], "(did you mean 'train'?)"),
                       (["train", "--optimizer", "adamww"], "(did you mean 'adamw'?)")]:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and said in err, err
    with pytest.raises(SystemExit):
        main(["train", "--qqqq"])                               # nothing close: no suggestion
    assert "did you mean" not in capsys.readouterr().err


def test_python_m_distlab_is_the_command_and_its_help_imports_no_torch():
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "distlab", "train", "--help"],
                         capture_output=True, text=True, timeout=120)
    modules = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()
               if line.startswith("import time:")]
    assert run.returncode == 0 and "--sync-every H" in run.stdout and "local-sgd, diloco:" in run.stdout
    assert "distlab.cli" in modules and "torch" not in modules, run.stderr[-2000:]


def _keywords(*argv: str) -> dict:
    parser, _ = _parser()
    return train_keywords(parser.parse_args(["train", *argv]))


def test_every_option_of_the_typed_spec_has_a_flag_or_says_why_not():
    flagged = [row.keyword for row in ROWS] + ["max_restarts", "shrink"]       # (those two: their own)
    assert len(flagged) == len(set(flagged)) and not set(flagged) & set(WITHOUT_FLAG)
    assert set(flagged) | set(WITHOUT_FLAG) == set(WHERE), set(WHERE) ^ (set(flagged) | set(WITHOUT_FLAG))
    parser, commands = _parser()
    own = {o for action in commands["train"]._actions for o in action.option_strings}
    assert {"--" + k.replace("_", "-") for k in TOP} <= own          # dl.train's own parameters: flags too
    assert {row.name for row in ROWS} <= own


def _example(row) -> tuple[list[str], object]:
    """A flag of ``row`` on a command line, and the value its keyword should get."""
    how = row.how
    if how.get("action") == "store_const":
        return [row.name], how["const"]
    if how.get("action") is argparse.BooleanOptionalAction:
        return [row.name.replace("--", "--no-")], False
    if "choices" in how:
        return [row.name, how["choices"][-1]], how["choices"][-1]       # the last: not the default
    example = rule_of(CONCERNS[WHERE[row.keyword]], row.keyword).example
    return [row.name, str(example)], example


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_each_flag_parses_into_its_field_of_the_typed_spec(row):
    argv, want = _example(row)
    concern = WHERE[row.keyword]
    text = ["--data", "text"] if concern == "data_loading" and row.keyword != "data" else []
    strategy = next((n for n in names() if row.keyword in options(n) and not n.startswith("3d")), "ddp")
    kw = _keywords(*argv, *text)
    assert kw[row.keyword] == want and type(kw[row.keyword]) is type(want), (kw, want)
    assert getattr(getattr(parse(strategy, **kw), concern), row.keyword) == want
    assert row.keyword not in _keywords(*text)                  # not given: no keyword, the spec's default


@pytest.mark.parametrize("row", [r for r in ROWS if re.search(r"\(default -?[\d.]+[);:]", r.help)],
                         ids=lambda row: row.name)
def test_a_default_the_help_says_is_the_specs(row):
    said = float(re.search(r"\(default (-?[\d.]+)[);:]", row.help).group(1))
    field = next(f for f in dataclasses.fields(CONCERNS[WHERE[row.keyword]]) if f.name == row.keyword)
    assert said == field.default, (row.help, field.default)


def test_the_new_flags_parse_into_the_typed_spec():
    spec = parse("diloco", **_keywords("--sync-every", "4", "--outer-lr", "0.5", "--outer-momentum", "0.8",
                                       "--engine", "ray"))
    assert (spec.data_parallel.sync_every, spec.data_parallel.outer_lr, spec.data_parallel.outer_momentum,
            spec.restart.engine) == (4, 0.5, 0.8, "ray")
    spec = parse("zero3", **_keywords("--quantize", "int8", "--offload", "disk", "--offload-dir", "off"))
    assert (spec.data_parallel.quantize, spec.memory.offload, str(spec.memory.offload_dir)) == (
        "int8", "disk", "off")
    assert parse("fsdp", **_keywords("--quantize", "fp8")).data_parallel.quantize == "fp8"
    assert parse("local-sgd", **_keywords("--sync-every", "2")).data_parallel.sync_every == 2
    spec = parse("ddp", **_keywords("--data", "text", "--workers", "2", "--profile", "prof"))
    assert (spec.data_loading.data, spec.data_loading.workers, str(spec.profiling.profile)) == (
        "text", 2, "prof")
    kw = _keywords("--backend", "fake", "--ranks", "0,1023")
    assert (kw["backend"], kw["ranks"]) == ("fake", [0, 1023])
    # --option still sets any keyword, and wins over a flag given beside it
    assert _keywords("--sync-every", "4", "--option", "sync_every=6")["sync_every"] == 6
    with pytest.raises(TypeError, match="strategy 'zero2' has no option 'sync_every'"):
        parse("zero2", **_keywords("--sync-every", "4"))         # a flag of another family: refused


def test_strategies_says_what_each_option_does_from_the_spec(capsys):
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    listing = out.split("what each option does:")[1]
    docs = {f.name: f.metadata["doc"] for cls in (DataParallel, Layout) for f in dataclasses.fields(cls)}
    for option in ("bucket_mb", "prefetch", "microbatches", "zero"):
        line = next(line for line in listing.splitlines() if line.split() and line.split()[0] == option)
        assert docs[option][:30] in " ".join(line.split()), (option, line)
    assert "sp" in listing and "the same as sequence_parallel" in listing


def test_the_header_prints_before_training_starts(capsys, monkeypatch):
    seen = {}

    def train(strategy, check_only=False, **kwargs):
        if not check_only:
            seen["out"] = capsys.readouterr().out
            raise ValueError("stopped here")
    monkeypatch.setattr(sys.modules["distlab.train"], "train", train)     # (dl.train is the function)
    assert main(["train", "--strategy", "ddp", "--world-size", "2", "--steps", "3"]) == 1
    assert seen["out"].startswith("ddp on 2 rank(s), gpt-tiny, global batch 16"), seen


def test_an_extra_not_installed_is_one_line_saying_what_to_install(capsys, monkeypatch):
    def train(strategy, check_only=False, **kwargs):            # what dl.train says without Ray installed
        raise ImportError("Ray Train is not installed: pip install 'distlab[ray]' (ray[train])")
    monkeypatch.setattr(sys.modules["distlab.train"], "train", train)
    assert main(["train", "--strategy", "ddp", "--world-size", "2", "--engine", "ray"]) == 2
    assert capsys.readouterr().err == ("distlab: error: Ray Train is not installed: pip install "
                                       "'distlab[ray]' (ray[train])\n")


def test_mean_step_time_leaves_the_warm_up_out_and_says_so():
    line = mean_step_time({0: 1.0, 1: 0.1, 2: 0.3})
    assert line.startswith("mean step time 200.0 ms (5.00 steps/s over 2 steps")
    assert "step 0, the warm-up, left out" in line
    assert "over 1 step; step 4, the warm-up" in mean_step_time({4: 1.0, 5: 0.2})
    assert "1 step, the warm-up" in mean_step_time({0: 1.0})


def test_runtime_asks_without_torch_and_places_with_it():
    code = ("import sys, distlab.runtime as r; assert r.rank() == 0 and r.world_size() == 1; "
            "assert 'torch' not in sys.modules; r.place_on('cpu'); print(r.device())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "cpu", run.stderr[-2000:]
