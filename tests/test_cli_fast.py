"""The ``distlab`` command as a newcomer meets it: ``--help`` and typos answer without importing torch,
a misspelled flag, subcommand or choice gets a did-you-mean, ``distlab strategies`` says what each
option does (from the typed spec's field docstrings), the header prints before training starts, and the
mean step time leaves the warm-up step out and says so."""
import dataclasses
import subprocess
import sys

import pytest

from distlab.cli import main, mean_step_time
from distlab.strategies.spec import DataParallel, Layout


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
                       (["trian"], "invalid choice: 'trian'"),
                       (["trian"], "(did you mean 'train'?)"),
                       (["train", "--optimizer", "adamww"], "(did you mean 'adamw'?)")]:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and said in err, err
    with pytest.raises(SystemExit):
        main(["train", "--zzz"])                                # nothing close: no suggestion
    assert "did you mean" not in capsys.readouterr().err


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
