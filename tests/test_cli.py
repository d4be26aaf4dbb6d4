"""The `distlab` command and the strategy registry's options, as a newcomer meets them (issue 14, items 2, 3).

Bad input is refused in the parent, before any rank starts (`launch` is replaced by a tripwire), in one
line with what to do; every strategy's report carries real bytes and memory.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import distlab as dl
from distlab.cli import main
from distlab.strategies import CHECKPOINT_OPTIONS, MESH_FORM, REGISTRY, names, options

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything starts a rank."""
    def tripwire(*args, **kwargs):
        raise AssertionError("a rank was started: the error should have come before any launch")
    monkeypatch.setattr(sys.modules["distlab.launch"], "launch", tripwire)   # dl.launch is the function


# -- item 2: misspelled and misplaced options ---------------------------------------------------------
def test_misspelled_options_name_the_valid_ones_with_a_did_you_mean(no_launch):
    with pytest.raises(TypeError, match=r"'ddp' has no option 'buket_mb' \(did you mean 'bucket_mb'\?\)"):
        dl.train("ddp", world_size=2, buket_mb=0.01, overlapp=False)
    with pytest.raises(TypeError, match=r"'overlapp' \(did you mean 'overlap'\?\).*Its options: bucket_mb"):
        dl.train("ddp", world_size=2, bucket_mb=0.01, overlapp=False)
    with pytest.raises(TypeError, match=r"'zero3' has no option 'prefech' \(did you mean 'prefetch'\?\)"):
        dl.train("zero3", world_size=2, prefech=True)
    with pytest.raises(TypeError, match=r"no option 'foo'\. Its options"):
        dl.train("ddp", world_size=2, options={"foo": 1})
    # an option of another family: said whose it is
    with pytest.raises(TypeError, match=r"'pp-1f1b' has no option 'bucket_mb'; 'bucket_mb' is an option of "
                                        r"single, ddp.*Its options: microbatches, balance"):
        dl.train("pp-1f1b", world_size=2, bucket_mb=1.0)
    with pytest.raises(TypeError, match="'prefetch' is an option of zero3"):
        dl.train("ddp", world_size=2, prefetch=True)
    with pytest.raises(TypeError, match="'virtual' is an option of pp-interleaved"):
        dl.train("pp-1f1b", world_size=2, virtual=2)
    with pytest.raises(TypeError, match=r"'tp' has no option 'microbatches'"):
        dl.train("tp", world_size=2, microbatches=4)
    # the mesh: strict in options= and in its name
    with pytest.raises(TypeError, match=r"no option 'prefetch'"):
        dl.train("3d:dp=2,tp=1,pp=2", world_size=4, prefetch=True)
    with pytest.raises(TypeError, match=r"'microbatch' \(did you mean 'microbatches'\?\)"):
        dl.train("3d:dp=2,tp=1,pp=2", world_size=4, microbatch=4)
    with pytest.raises(ValueError, match=r"cannot read 'tq=2' \(did you mean 'tp'\?\)"):
        dl.train("3d:dp=2,tq=2", world_size=4)


def test_every_strategy_declares_its_options_and_takes_the_checkpoints():
    from distlab.strategies import parse
    assert MESH_FORM in names() and "3d" not in names() and len(names()) == len(REGISTRY)
    for name in names():
        opts = options(name)
        assert set(CHECKPOINT_OPTIONS) <= set(opts), name
    assert set(options("zero3")) - set(options("zero2")) == {"prefetch", "quantize"}
    assert "bucket_mb" not in options("pp-gpipe") and "virtual" in options("pp-interleaved")
    with pytest.raises(TypeError, match="no option 'prefetch'"):        # no longer silently ignored
        parse("3d:dp=2", prefetch=True)
    spec = parse("3d:dp=2", checkpoint_dir="x")                          # the checkpoint's: its own concern
    assert spec.layout.dp == 2 and spec.checkpoint.checkpoint_dir == "x"


def test_layouts_that_cannot_run_fail_before_any_rank_starts(no_launch):
    with pytest.raises(ValueError, match="64 ranks a row"):                # not 64 forked processes
        dl.train("ddp", world_size=64)
    with pytest.raises(ValueError, match=r"heads=4 is not divisible by the tensor-parallel size 3"):
        dl.train("tp", world_size=3)
    with pytest.raises(ValueError, match=r"gpt-wide's heads=8 is not divisible by the tensor-parallel size"):
        dl.train("3d:dp=1,tp=3,pp=1", world_size=3, model="gpt-wide")
    with pytest.raises(ValueError, match=r"heads=4 is not divisible by the tensor-parallel size 8"):
        dl.train("3d:dp=1,tp=8,pp=1", world_size=8, sp=True)
    with pytest.raises(ValueError, match="choose a GPT preset"):
        dl.train("tp", world_size=2, model="mlp")
    with pytest.raises(ValueError, match=r"unknown model 'gpt-tiyn' \(did you mean 'gpt-tiny'\?\)"):
        dl.train("ddp", world_size=2, model="gpt-tiyn")
    with pytest.raises(ValueError, match="pipeline stages"):
        dl.train("pp-gpipe", world_size=8)
    with pytest.raises(ValueError, match="microbatches need at least"):
        dl.train("pp-1f1b", world_size=2, global_batch=2, microbatches=4)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        dl.train("ddp", world_size=0)
    with pytest.raises(ValueError, match="balance"):
        dl.train("pp-1f1b", world_size=2, balance="flops")


# -- item 3: the command's errors, flags and reports ---------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--strategy", "ddp", "--world-size", "64"], "64 ranks a row"),
    (["--strategy", "tp", "--world-size", "3"], "heads=4 is not divisible"),
    (["--strategy", "ddp", "--world-size", "2", "--option", "foo=1"], "no option 'foo'"),
    (["--strategy", "ddp", "--world-size", "2", "--option", "buket_mb=1"], "did you mean 'bucket_mb'"),
    (["--strategy", "pp-1f1b", "--world-size", "2", "--bucket-mb", "1"], "'bucket_mb' is an option of"),
    (["--strategy", "ddp", "--option", "nonsense"], "--option expects KEY=VALUE"),
    (["--strategy", "ddp", "--model", "gpt-huge"], "unknown model 'gpt-huge'"),
    (["--strategy", "zero9"], "did you mean 'zero3'"),
    (["--strategy", "single", "--checkpoint-dir", "{tmp}", "--checkpoint-every", "0"], "positive integer"),
    (["--strategy", "single", "--checkpoint-dir", "{tmp}", "--option", "fail_at_step=1"], "runs in this"),
])
def test_cli_errors_are_one_line_with_exit_status_2(argv, says, capsys, no_launch, tmp_path):
    assert main(["train", *[a.format(tmp=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distlab: error: ") and says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_an_error_inside_a_single_run_is_a_failed_run_not_bad_input(monkeypatch, capsys):
    """``single`` trains in this process: a ValueError raised by the run itself, after every check of
    the input passed, is exit 1 with the --traceback hint (and the original error behind it)."""
    def broken(spec):
        raise ValueError("an internal bug")
    monkeypatch.setattr(importlib.import_module("distlab.strategies.runner"), "load", lambda strategy: broken)
    assert main(["train", "--strategy", "single", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distlab: error: the run failed: ValueError: an internal bug")
    assert "--traceback" in err and "Traceback" not in err
    with pytest.raises(Exception, match="an internal bug") as caught:
        main(["train", "--strategy", "single", "--steps", "1", "--traceback"])
    assert isinstance(caught.value.__cause__, ValueError)


def test_cli_as_a_process_bad_input_is_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "distlab.cli", *argv], capture_output=True, text=True,
                              env=env, timeout=120)
    bad = cli("train", "--strategy", "ddp", "--world-size", "2", "--option", "buket_mb=1")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("distlab: error: strategy 'ddp' has no option 'buket_mb' (did you mean")
    assert "Traceback" not in bad.stderr


def test_a_rank_that_fails_is_one_line_naming_it_with_exit_status_1(tmp_path, capsys):
    argv = ["train", "--strategy", "ddp", "--world-size", "2", "--steps", "2", "--checkpoint-dir",
            str(tmp_path), "--option", "fail_at_step=1", "--option", "fail_rank=1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("distlab: error: rank 1 failed") and "Traceback" not in err, err
    with pytest.raises(TypeError, match="buket_mb"):             # --traceback: the whole story
        main(["train", "--strategy", "ddp", "--option", "buket_mb=1", "--traceback"])


def test_cli_version_help_and_strategies(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"distlab {dl.__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "(default: 20)" in helptext and "(default: 0)" in helptext and "'-': stdout" in helptext
    assert "(default: None)" not in helptext and "(default: False)" not in helptext
    assert main(["strategies"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert any(line.startswith("3d:dp=D,tp=T,pp=P ") and "schedule" in line for line in listing)
    assert not any(line.split()[0] == "3d" for line in listing if line.strip())
    assert any(line.split()[0] == "zero3" and "prefetch" in line for line in listing if line.strip())


def check_report(report) -> None:
    """Every rank of ``report`` sent real bytes (more than one rank) and measured its memory: params,
    grads and activations > 0, optimizer state > 0 unless plain SGD, and the parameters' peak equal to
    the bytes the rank holds where the strategy says (``param_bytes``). Also run by test_train's
    every-strategy test, so each strategy name is checked without a second launch."""
    for r, (comm, memory) in enumerate(zip(report.comm, report.memory)):
        peak = memory["peak"]
        assert (comm["sent_per_step"] > 0) == (report.world_size > 1), (r, comm)
        assert comm["sent"] == sum(comm["sent_by_op"].values())
        for category in ("params", "grads", "activations") + (("optimizer",) if report.spec.optimizer != "sgd"
                                                              else ()):
            assert peak[category] > 0, (r, category, peak)
        held = report.results[r].info.get("param_bytes")
        if held is not None:                                   # measured == what the rank holds
            assert peak["params"] == held, (r, peak["params"], held)


# the strategies test_train's every-strategy test does not run, and three that it does, through the CLI
CLI_RUNS = [("single", 1), ("ddp", 2), ("tp", 2), ("pp-1f1b", 2), ("ep", 2), ("cp-ring", 2),
            ("cp-ulysses", 2), ("3d:dp=1,tp=2,pp=2", 4), ("local-sgd", 2), ("diloco", 2)]


def test_every_strategy_name_is_checked_for_bytes_and_memory():
    from test_train import EVERY as IN_TEST_TRAIN
    checked = {s for s, _ in IN_TEST_TRAIN + CLI_RUNS}
    assert set(names()) - {MESH_FORM} <= checked and any(s.startswith("3d:") for s in checked)


@pytest.mark.parametrize("strategy, world", CLI_RUNS, ids=[s for s, _ in CLI_RUNS])
def test_the_cli_reports_real_bytes_and_memory(strategy, world, capsys, monkeypatch):
    """`--json -`: the settings, a step time per step, and for every rank the bytes it sent (> 0 on more
    than one rank) and its peak memory by category, as the report has them; the table on stderr."""
    train_module = sys.modules["distlab.train"]                 # dl.train is the function
    reports = []
    real = train_module.train
    monkeypatch.setattr(train_module, "train", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    model = "gpt-moe-tiny" if strategy == "ep" else "gpt-tiny"
    argv = ["train", "--strategy", strategy, "--world-size", str(world), "--steps", "2",
            "--global-batch", "8", "--model", model, "--seed", "3", "--json", "-"]
    argv += ["--sync-every", "2"] if strategy in ("local-sgd", "diloco") else []    # the replicas meet once
    assert main(argv) == 0
    out, err = capsys.readouterr()
    data, [report] = json.loads(out), [r for r in reports if r is not None]   # (the check_only call: None)
    check_report(report)
    assert (data["strategy"], data["model"], data["steps"], data["seed"]) == (strategy, model, 2, 3)
    assert len(data["step_seconds"]) == 2 and all(t > 0 for t in data["step_seconds"])
    assert data["losses"] == report.losses and data["comm"] == report.comm
    assert [m["peak"] for m in data["memory"]] == [m["peak"] for m in report.memory]
    assert "step    1  loss" in err and ("sent 0.000" not in err or world == 1)
    for r in range(world):
        assert f"rank {r}: sent" in err and "peak MiB: params" in err


# -- item 7: the lessons and the widgets for a pip user ------------------------------------------------
LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _links_resolve(folder: Path) -> None:
    """Every ``](../distlab/...)`` link of every lesson in ``folder`` opens a file."""
    import re
    for nb in folder.glob("*.ipynb"):
        for target in re.findall(r"\]\((\.\./distlab/[^)#\s]+)", nb.read_text()):
            assert (folder / target).is_file(), (nb.name, target)


def test_distlab_lessons_copies_them_out_with_the_code_they_link(tmp_path, capsys):
    assert len(LESSONS) >= 9
    assert main(["lessons", str(tmp_path / "mine")]) == 0
    solved, student = tmp_path / "mine" / "solved", tmp_path / "mine" / "student"
    assert sorted(p.name for p in solved.iterdir()) == sorted(p.name for p in student.iterdir()) == LESSONS
    assert all((solved / n).read_bytes() == (ROOT / "notebooks" / n).read_bytes() for n in LESSONS)
    assert "### BEGIN SOLUTION" not in (student / "01_ring_allreduce.ipynb").read_text()
    _links_resolve(solved)
    _links_resolve(student)
    assert "jupyter lab" in capsys.readouterr().out
    (student / LESSONS[0]).write_text((student / LESSONS[0]).read_text() + " ")    # the learner's edit
    assert main(["lessons", str(tmp_path / "mine")]) == 0              # never overwrites it silently
    assert (student / LESSONS[0]).read_text().endswith(" ")
    assert main(["lessons", str(tmp_path / "mine"), "--force"]) == 0
    assert (student / LESSONS[0]).read_text().endswith("}\n")


def test_a_built_wheel_carries_the_lessons_and_finds_them_installed(tmp_path):
    """Build the wheel from a copy of the project (pip wheel --no-deps), list it, install it into a fresh
    prefix and run `distlab lessons` from there, away from any checkout."""
    import shutil
    import zipfile
    src = tmp_path / "src"
    shutil.copytree(ROOT / "distlab", src / "distlab", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "notebooks").mkdir()
    for name in LESSONS:
        shutil.copy(ROOT / "notebooks" / name, src / "notebooks" / name)
    for path in ROOT.iterdir():                       # pyproject.toml, README.md, LICENSE, ...
        if path.is_file():
            shutil.copy(path, src / path.name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # a checkout on the path fools pip
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), str(src)],
                   check=True, capture_output=True, timeout=300, env=clean)
    wheel = next((tmp_path / "w").glob("distlab-*.whl"))
    listed = zipfile.ZipFile(wheel).namelist()
    data = sorted(n.rsplit("/", 1)[1] for n in listed if "/data/share/distlab/lessons/" in n)
    assert data == LESSONS, listed
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--ignore-installed",   # never uninstall
                    "--prefix", str(tmp_path / "env"), str(wheel)],                   # the dev install
                   check=True, capture_output=True, timeout=300, env=clean)
    site = next((tmp_path / "env").glob("lib/python*/site-packages"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import distlab.lessons as L; "
            "assert L.__file__.startswith(sys.argv[1]), L.__file__; print(L.source()); "
            "from distlab.cli import main; sys.exit(main(['lessons', sys.argv[2]]))")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-c", code, str(site), str(tmp_path / "out")], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == str((tmp_path / "env" / "share" / "distlab" / "lessons").resolve())
    assert sorted(p.name for p in (tmp_path / "out" / "student").iterdir()) == LESSONS
    _links_resolve(tmp_path / "out" / "student")


def test_widgets_without_ipywidgets_say_how_to_get_them(monkeypatch):
    """Simulate an environment without ipywidgets: importing it fails; dl.widgets names the extra."""
    for name in [n for n in sys.modules if n == "distlab.widgets" or n.startswith("distlab.widgets.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)          # `import ipywidgets` raises ImportError
    monkeypatch.delitem(vars(dl), "widgets", raising=False)       # the lazy attribute, if already loaded
    with pytest.raises(ImportError, match=r"pip install distlab\[lab\]"):
        assert dl.widgets is None                                  # never reached


def test_step_times_of_a_resumed_run_sit_beside_its_own_steps(tmp_path, capsys):
    """After a resume the report holds every step's loss but only this run's step times: the times are
    matched by step number (None for the steps of the run before), not by position."""
    ck = str(tmp_path / "ck")
    common = ["train", "--strategy", "ddp", "--world-size", "2", "--global-batch", "4",
              "--checkpoint-dir", ck, "--checkpoint-every", "2"]
    assert main([*common, "--steps", "2"]) == 0
    capsys.readouterr()
    assert main([*common, "--steps", "4", "--resume", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    times = json.loads(out)["step_seconds"]
    assert len(times) == 4 and times[:2] == [None, None] and all(t > 0 for t in times[2:])
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.endswith(" ms") for line in lines] == [False, False, True, True]
    assert "mean step time" in err and "over 1 step; step 2, the warm-up, left out" in err
