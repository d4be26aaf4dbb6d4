"""The lessons' kernels start without ipykernel's "running over TCP without encryption" warning: `make lab`
writes a Jupyter server setting into the venv (jupyter-config/jupyter_server_config.json) by which the
kernel manager provisions CurveZMQ keys, so the kernel's traffic is encrypted and it has nothing to warn of;
the other warnings are left alone (no log level lowered)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
zmq = pytest.importorskip("zmq")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "jupyter-config" / "jupyter_server_config.json"
pytestmark = pytest.mark.skipif(
    not zmq.has("curve") or "transport_encryption" not in jupyter_client.KernelManager.class_traits(),
    reason="needs pyzmq with CurveZMQ and jupyter_client's transport_encryption")


def _kernel_stderr(config) -> str:
    """What a python3 kernel started under ``config`` writes to stderr while it runs one cell."""
    with tempfile.TemporaryFile() as err:
        km = jupyter_client.KernelManager(kernel_name="python3", config=config)
        km.start_kernel(stderr=err, stdout=subprocess.DEVNULL)
        try:
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(timeout=60)
            reply = kc.execute_interactive("print(6 * 7)", timeout=60)
            kc.stop_channels()
            assert reply["content"]["status"] == "ok"
        finally:
            km.shutdown_kernel(now=False)
        err.seek(0)
        return err.read().decode()


def test_a_kernel_under_the_lab_setting_starts_encrypted_and_quiet():
    from traitlets.config import Config
    assert "without encryption" in _kernel_stderr(Config())                  # the warning, as it was
    said = _kernel_stderr(Config(json.loads(CONFIG.read_text())))
    assert "without encryption" not in said, said


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_install_writes_the_setting_into_the_venvs_jupyter_config(tmp_path):
    out = subprocess.run(["make", "-n", "-s", f"{tmp_path}/.installed", f"VENV={tmp_path}", "TORCH=torch",
                          f"BIN={Path(sys.executable).parent}"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines[:-1])
                 if ln.startswith("if ") and "transport_encryption" in lines[i + 1])
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith("fi"))
    subprocess.run(["sh", "-c", "\n".join(lines[start:end + 1])], cwd=ROOT, check=True)
    written = tmp_path / "etc" / "jupyter" / "jupyter_server_config.json"
    assert json.loads(written.read_text()) == {"KernelManager": {"transport_encryption": "auto"}}
