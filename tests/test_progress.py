"""The progress bar of `dl.train` and the CLI (`distlab.progress`): tqdm in the parent, fed by the ranks.

What is checked: rank 0 drives the count to the total; the loss shown is the loss-holding rank's (the
last pipeline stage); ``single`` feeds a bar in this process; the bar is off where nobody watches
(pytest's captured stderr, a kernel run by nbval or nbconvert) and on in a person's front end, where
it is a real ipywidgets widget; ``DISTLAB_PROGRESS`` and ``progress=`` override.
"""
from __future__ import annotations

import re
import sys

import pytest

import distlab as dl
from distlab import cli

progress_module = sys.modules["distlab.progress"]      # (dl.progress is the function)
FRAME = re.compile(r"(\d+)/(\d+) \[[^\]]*step/s, loss=([0-9.]+)\]")


def frames(text: str) -> list[tuple[int, int, float]]:
    return [(int(a), int(b), float(c)) for a, b, c in FRAME.findall(text)]


def test_pipeline_bar_counts_rank_zero_steps_and_shows_the_last_stage_loss(capsys):
    report = dl.train("pp-1f1b", world_size=2, model="gpt-tiny", steps=6, global_batch=8, progress=True)
    seen = frames(capsys.readouterr().err)
    assert seen, "no bar drawn"
    assert seen[-1][:2] == (6, 6)                                   # ends at the total
    assert seen[-1][2] == pytest.approx(report.losses[-1], abs=1e-4)   # the last stage's loss, shown 4 d.p.
    assert [f[0] for f in seen] == sorted(f[0] for f in seen)


def test_data_parallel_bar_shows_the_global_loss_the_table_shows(capsys, monkeypatch):
    sent = {}
    update = progress_module.ProgressBar.update

    def recording(self, rank, step, total, label, postfix, shares=()):
        sent[rank] = postfix
        update(self, rank, step, total, label, postfix, shares)

    monkeypatch.setattr(progress_module.ProgressBar, "update", recording)
    report = dl.train("ddp", world_size=2, model="gpt-tiny", steps=3, global_batch=8, progress=True)
    seen = frames(capsys.readouterr().err)
    assert seen[-1][:2] == (3, 3)
    assert seen[-1][2] == pytest.approx(report.losses[-1], abs=1e-4)     # the sum of the shares, as the table
    assert sent[0]["loss"] != pytest.approx(report.losses[-1], abs=1e-4)  # not rank 0's part of the batch


def test_the_bar_sums_a_step_once_every_member_has_sent_its_share():
    bar = progress_module.ProgressBar(enabled=True)
    bar.bar = type("Bar", (), {"n": 0, "set_postfix": lambda *a, **k: None,
                               "update": lambda self, k: setattr(self, "n", self.n + k)})()
    bar.update(0, 1, 4, "step", {"loss": 3.0}, [(1, "loss", 1.5, (0, 1))])
    assert bar.postfix == {"loss": 3.0}                           # rank 1's share not in: rank 0's own loss
    bar.update(1, 1, 4, "step", {"loss": 5.0}, [(1, "loss", 2.5, (0, 1))])
    assert bar.postfix["loss"] == 4.0                             # 1.5 + 2.5, the table's value
    bar.update(2, 1, 4, "step", {"loss": 9.0}, [(1, "loss", 9.0, (2, 3))])   # another group, not whole
    bar.update(0, 2, 4, "step", {"loss": 1.0}, [(2, "loss", 0.5, (0, 1))])
    assert bar.postfix["loss"] == 4.0                             # step 2 not whole yet: step 1's sum kept


def test_single_feeds_a_bar_in_this_process(capsys):
    report = dl.train("single", model="gpt-tiny", steps=3, global_batch=4, progress=True)
    seen = frames(capsys.readouterr().err)
    assert seen[-1][:2] == (3, 3) and seen[-1][2] == pytest.approx(report.losses[-1], abs=1e-4)
    assert progress_module._channel["sink"] is None                # the bar is gone with the run


def test_off_where_nobody_watches_and_forced_by_the_environment(capsys, monkeypatch):
    monkeypatch.delenv("DISTLAB_PROGRESS", raising=False)
    assert not progress_module.shown_by_default()                  # pytest's stderr is no terminal
    dl.train("ddp", world_size=2, model="gpt-tiny", steps=2, global_batch=8)
    assert "step/s" not in capsys.readouterr().err
    monkeypatch.setenv("DISTLAB_PROGRESS", "1")
    assert progress_module.shown_by_default()
    cli.main(["train", "--steps", "2", "--global-batch", "4"])
    assert frames(capsys.readouterr().err)[-1][:2] == (2, 2)
    cli.main(["train", "--steps", "2", "--global-batch", "4", "--no-progress"])
    assert "step/s" not in capsys.readouterr().err


def test_a_terminal_gets_the_bar_by_default():
    """The CLI with stderr on a terminal (a pseudo-terminal 100 columns wide) draws the bar unasked."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "DISTLAB_PROGRESS"}
    command = [sys.executable, "-m", "distlab.cli", "train", "--steps", "3", "--global-batch", "4"]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=slave, env=env, timeout=300)
    os.close(slave)
    err = b""
    while select.select([master], [], [], 0.5)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:                                  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    assert done.returncode == 0 and b"step    2" in done.stdout    # the report still goes to stdout
    assert frames(err.decode(errors="replace"))[-1][:2] == (3, 3)


def test_under_torchrun_rank_zero_alone_draws_the_bar():
    import os
    import subprocess

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTLAB_PROGRESS": "1"}
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "distlab.cli", "train",
                           "--strategy", "ddp", "--world-size", "2", "--steps", "3", "--global-batch", "8"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("| 0/3 [") == 1                     # one bar opened: rank 0's
    assert frames(done.stderr)[-1][:2] == (3, 3) and done.stdout.count("ddp on 2 rank(s)") == 1


def test_without_tqdm_the_run_goes_on_and_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)           # import fails
    report = dl.train("ddp", world_size=2, model="gpt-tiny", steps=2, global_batch=8, progress=True)
    assert len(report.losses) == 2 and "pip install tqdm" in capsys.readouterr().err


RUN_IN_KERNEL = """
import distlab as dl
report = dl.train("single", model="gpt-tiny", steps=2, global_batch=4)
"""


@pytest.mark.parametrize("person", [True, False], ids=["person", "nbval"])
def test_a_notebook_gets_a_widget_only_when_a_person_runs_the_cell(person):
    """A real kernel: JupyterLab sends allow_stdin=True and gets a tqdm widget; nbval and nbconvert
    send allow_stdin=False and get no output at all, so lessons' stored outputs do not change."""
    pytest.importorskip("ipywidgets")
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    outputs = []
    try:
        reply = kc.execute_interactive(RUN_IN_KERNEL, allow_stdin=person, timeout=120,
                                       output_hook=lambda msg: outputs.append(msg))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", reply["content"]
    shown = [m for m in outputs if m["msg_type"] in ("display_data", "stream", "execute_result", "error")]
    widgets = [m for m in shown if "application/vnd.jupyter.widget-view+json" in m["content"].get("data", {})]
    if person:
        assert widgets, f"no widget displayed: {shown}"
    else:
        assert shown == []
