"""`make lab` / `make test` say which PyTorch build they install, and why, before installing (a CUDA build is
several GB and minutes of download), and let pip show its progress (read from `make -n`: printed, not run)."""
from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _install(*variables: str) -> list[str]:
    """The lines of the install step `make` would run, for a venv that does not exist."""
    out = subprocess.run(["make", "-n", "-s", f"{ROOT}/.probe-venv/.installed", f"VENV={ROOT}/.probe-venv",
                          *variables], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def _said_then_installed(lines: list[str]) -> tuple[str, str]:
    said = next(i for i, ln in enumerate(lines) if "distlab: installing PyTorch:" in ln)
    torch = next(i for i, ln in enumerate(lines) if "pip install" in ln and "torch==" in ln)
    assert said < torch and "--quiet" not in lines[torch] and "--progress-bar on" in lines[torch]
    return lines[said], lines[torch]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_install_says_which_torch_build_and_why_before_it_starts(tmp_path):
    closed = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    said, torch = _said_then_installed(_install("NVIDIA_SMI=/nonexistent/nvidia-smi", f"CPU_INDEX={closed}"))
    assert f"{closed} did not answer within 3 s" in said and "CUDA build, several GB" in said
    assert "Ctrl-C" in said and f"--index-url {closed}" in said and torch.endswith("torch==2.13.0")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    said, _ = _said_then_installed(_install(f"NVIDIA_SMI={fake}"))
    assert "the CUDA build (nvidia-smi found" in said
    said, torch = _said_then_installed(_install("TORCH=torch==2.13.0 --index-url X"))
    assert "as given" in said and torch.endswith("--index-url X")


def test_the_cpu_build_is_said_when_the_cpu_index_answers(cpu_index):
    no_gpu = "NVIDIA_SMI=/nonexistent/nvidia-smi"
    said, torch = _said_then_installed(_install(no_gpu, f"CPU_INDEX={cpu_index}"))
    assert f"the CPU build from {cpu_index} (no nvidia-smi" in said and f"--index-url {cpu_index}" in torch
