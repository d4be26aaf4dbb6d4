"""README's first command, `make lab`, starts JupyterLab on the lessons: as root too (Jupyter refuses root
unless told), with the user's own arguments (LAB_ARGS). The server is started exactly as `make` would start it
(the command is read from `make -n`), seen to serve, and stopped."""
from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
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


@pytest.mark.skipif(not (Path(sys.prefix) / "bin" / "jupyter").exists() or not hasattr(os, "getuid"),
                    reason="needs JupyterLab in this environment (pip install -e '.[lab]')")
def test_make_lab_serves_the_lessons_as_this_user_with_lab_args():
    cmd = _lab_command(f"--no-browser --port=0 --ServerApp.token={TOKEN}")
    assert ("--allow-root" in cmd) == (os.getuid() == 0), cmd
    assert "--no-browser" in cmd and "--notebook-dir=notebooks" in cmd
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    seen, port = [], None
    try:
        deadline = time.monotonic() + 90
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            match = re.search(r"http://127\.0\.0\.1:(\d+)/lab", seen[-1])
            port = match and match.group(1)
        assert port, "JupyterLab did not start:\n" + "".join(seen[-20:])
        url = f"http://127.0.0.1:{port}/api/contents?token={TOKEN}"
        with urllib.request.urlopen(url, timeout=30) as reply:
            listing = reply.read().decode()
        assert "00_launch_and_collectives.ipynb" in listing        # it serves the lessons
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
