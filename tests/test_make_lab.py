"""README's first command, `make lab`, starts JupyterLab on the lessons: as root too (Jupyter refuses root
unless told), with the user's own arguments (LAB_ARGS). The server is started exactly as `make` would start it
(the command is read from `make -n`), seen to serve, and stopped."""
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


def _lab_command(lab_args: str) -> list[str]:
    """The jupyter command `make lab` runs (``make -n``: printed, not run), with this test's venv."""
    out = subprocess.run(["make", "-n", "-s", "lab", f"VENV={sys.prefix}", f"LAB_ARGS={lab_args}",
                          f"STAMP={ROOT / 'pyproject.toml'}"],            # the install step counts as done
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = [ln for ln in out.splitlines() if "jupyter lab" in ln][-1]
    return shlex.split(line)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listing(port: int, proc, deadline: float) -> str:
    """The server's listing of the lesson folder, asked until it answers (or it exits, or time is up)."""
    url = f"http://127.0.0.1:{port}/api/contents?token={TOKEN}"
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
    cmd = _lab_command(f"--no-browser --ip=127.0.0.1 --port={port} --ServerApp.port_retries=0 "
                       f"--ServerApp.token={TOKEN}")
    assert ("--allow-root" in cmd) == (os.getuid() == 0), cmd
    assert "--no-browser" in cmd and "--notebook-dir=notebooks" in cmd
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


def test_make_picks_the_cpu_wheel_index_without_nvidia_gpus_when_it_answers(tmp_path):
    import http.server
    import threading

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):                                  # an index that answers for torch
            self.send_response(200 if self.path.rstrip("/").endswith("/torch") else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_port}/whl/cpu"
        no_gpu = "NVIDIA_SMI=/nonexistent/nvidia-smi"
        assert f"torch==2.13.0 --index-url {index}" in _torch_line(no_gpu, f"CPU_INDEX={index}")
        fake = tmp_path / "nvidia-smi"
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)                                  # a GPU machine: PyPI's default (CUDA) wheel
        assert _torch_line(f"NVIDIA_SMI={fake}", f"CPU_INDEX={index}").endswith("torch==2.13.0")
    finally:
        server.shutdown()
    closed = f"http://127.0.0.1:{_free_port()}/whl/cpu"    # unreachable: fall back to the default
    assert _torch_line("NVIDIA_SMI=/nonexistent/nvidia-smi", f"CPU_INDEX={closed}").endswith("torch==2.13.0")
    assert _torch_line("TORCH=torch==2.13.0 --index-url X").endswith("--index-url X")   # the user decides
