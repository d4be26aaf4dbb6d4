"""README's first command, `make lab`, writes the learner's copy of the lessons (lab/student, lab/solved) and
starts JupyterLab there: as root too (Jupyter refuses root unless told), with the user's own arguments
(LAB_ARGS). The commands are run exactly as `make` would run them (read from `make -n`), the server seen to
serve the student versions, and stopped."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "distlab-test"


def _lab_commands(lab_args: str, lab_dir: Path, target: str = "lab") -> list[list[str]]:
    """The commands `make lab` runs (``make -n``: printed, not run), with this test's venv."""
    out = subprocess.run(["make", "-n", "-s", target, f"VENV={sys.prefix}", f"LAB_ARGS={lab_args}",
                          f"LAB_DIR={lab_dir}", f"STAMP={ROOT / 'pyproject.toml'}"],   # installed: as done
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listing(port: int, proc, deadline: float) -> str:
    """The server's listing of the student folder, asked until it answers (or it exits, or time is up)."""
    url = f"http://127.0.0.1:{port}/api/contents/student?token={TOKEN}"
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.read().decode()
        except OSError:
            time.sleep(0.5)                               # not listening yet
    return ""


@pytest.mark.skipif(not (Path(sys.prefix) / "bin" / "jupyter").exists() or not hasattr(os, "getuid"),
                    reason="needs JupyterLab in this environment (pip install -e '.[lab]')")
def test_make_lab_serves_the_lessons_as_this_user_with_lab_args(tmp_path):
    port = _free_port()
    lab_dir = tmp_path / "lab"
    write, cmd = _lab_commands(f"--no-browser --ip=127.0.0.1 --port={port} --ServerApp.port_retries=0 "
                               f"--ServerApp.token={TOKEN}", lab_dir)
    assert write[1:] == ["-m", "distlab.lessons", str(lab_dir)], write
    subprocess.run(write, cwd=ROOT, check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert ("--allow-root" in cmd) == (os.getuid() == 0), cmd
    assert "--no-browser" in cmd and f"--notebook-dir={lab_dir}" in cmd
    solved = _lab_commands("", lab_dir, "lab-solved")[-1]
    assert "--notebook-dir=notebooks" in solved                        # the teacher opens the tracked ones
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        listing = _listing(port, proc, time.monotonic() + 120)
        assert "00_launch_and_collectives.ipynb" in listing, "JupyterLab did not serve the lessons:\n" + \
            "".join(log.read_text().splitlines(keepends=True)[-20:])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _torch_line(*variables: str) -> str:
    out = subprocess.run(["make", "-n", "-s", f"{ROOT}/.probe-venv/.installed", f"VENV={ROOT}/.probe-venv",
                          *variables], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return next(ln for ln in out.splitlines() if "pip install" in ln and "torch==" in ln)


def test_make_picks_the_cpu_wheel_index_without_nvidia_gpus_when_it_answers(tmp_path, cpu_index):
    no_gpu = "NVIDIA_SMI=/nonexistent/nvidia-smi"
    assert f"torch==2.13.0 --index-url {cpu_index}" in _torch_line(no_gpu, f"CPU_INDEX={cpu_index}")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)                                      # a GPU machine: PyPI's default (CUDA) wheel
    assert _torch_line(f"NVIDIA_SMI={fake}", f"CPU_INDEX={cpu_index}").endswith("torch==2.13.0")
    closed = f"http://127.0.0.1:{_free_port()}/whl/cpu"    # unreachable: fall back to the default
    assert _torch_line("NVIDIA_SMI=/nonexistent/nvidia-smi", f"CPU_INDEX={closed}").endswith("torch==2.13.0")
    assert _torch_line("TORCH=torch==2.13.0 --index-url X").endswith("--index-url X")   # the user decides
