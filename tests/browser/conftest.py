"""Fixtures for the real-browser checks: a private JupyterLab server and headless Debian Chromium.

Nothing here downloads a browser. selenium is pointed at Debian's /usr/bin/chromium and
/usr/bin/chromedriver (install both, and selenium into the venv, with tests/browser/install_browser.sh);
selenium-manager is kept offline. Every process started here carries the test's temporary
directory on its command line (JupyterLab's runtime dir, the kernel's connection file under it,
Chromium's --user-data-dir, chromedriver's --log-path), so teardown can find any survivor by that
marker, end it by pid, and fail the test if one had to be killed.

    lab (JupyterLab on 127.0.0.1:<free port>, token, private settings/runtime dirs, --no-browser)
      ^  http + websocket
    chrome (headless Chromium <- chromedriver <- selenium in this process)
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

# Debian's packages by default; elsewhere (an Ubuntu CI runner, where apt's chromium is a snap shim)
# point these at an installed Chrome/Chromium and its matching chromedriver.
CHROMIUM = Path(os.environ.get("DISTLAB_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("DISTLAB_CHROMEDRIVER", "/usr/bin/chromedriver"))
INSTALL_HINT = "run tests/browser/install_browser.sh (apt chromium + chromium-driver, pip selenium)"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1600",
                  "--force-device-scale-factor=1")

# JupyterLab user settings for a quiet, fully rendered notebook: every cell in the DOM (no windowing),
# no news or update pop-ups, no autosave over the copied lesson.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
}


@dataclass
class Lab:
    url: str         # http://127.0.0.1:<port>
    token: str
    root: Path       # the server's root directory (where the lesson copy lives)
    data: Path       # its JUPYTER_DATA_DIR: the notebook secret and the signatures that say what is trusted

    def open_url(self, path: str) -> str:
        return f"{self.url}/lab/tree/{path}?token={self.token}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_mentioning(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (this test's temp dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = (Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                       .decode(errors="replace"))
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry))
    return found


def kill_survivors(marker: str, grace: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process still mentioning ``marker``; returns those found."""
    survivors = processes_mentioning(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_mentioning(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while processes_mentioning(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
    return survivors


def _require_browser() -> None:
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not os.access(binary, os.X_OK):
            pytest.skip(f"{binary} not found: {INSTALL_HINT}")
    pytest.importorskip("selenium", reason=f"selenium not installed: {INSTALL_HINT}")
    try:
        import jupyterlab  # noqa: F401
        import jupyterlab_widgets  # noqa: F401
    except ImportError:
        pytest.skip("jupyterlab / jupyterlab_widgets not installed: pip install -e '.[lab]'")


@pytest.fixture
def browser_tmp(tmp_path_factory) -> Path:
    _require_browser()
    return tmp_path_factory.mktemp("browser")


@pytest.fixture
def lab(browser_tmp: Path):
    """A JupyterLab server of this venv, private to the test, shut down (kernels included) afterwards."""
    root, runtime, settings, data = (browser_tmp / name for name in ("root", "runtime", "settings", "data"))
    for folder in (root, runtime, settings, data, browser_tmp / "workspaces", browser_tmp / "config"):
        folder.mkdir()
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    token = secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(browser_tmp / "workspaces"),
               JUPYTER_CONFIG_DIR=str(browser_tmp / "config"), JUPYTER_DATA_DIR=str(data),
               OMP_NUM_THREADS="1", MPLBACKEND="agg")
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={_free_port()}",
               "--ServerApp.port_retries=20", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={root}",
               "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--ServerApp.jpserver_extensions={'jupyter_lsp': False}"]
    if os.geteuid() == 0:
        command.append("--allow-root")   # CI containers run as root; the server only listens on 127.0.0.1
    log = open(browser_tmp / "jupyterlab.log", "wb")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield Lab(_wait_for_server(server, runtime, token, browser_tmp / "jupyterlab.log"), token, root, data)
    finally:
        _stop_server(server, token, runtime)
        log.close()
        left = kill_survivors(str(browser_tmp))
        assert not left, f"JupyterLab left processes behind (killed): {left}"


def _wait_for_server(server: subprocess.Popen, runtime: Path, token: str, log: Path,
                     timeout: float = 60.0) -> str:
    """The server's URL once it answers /api/status (it writes jpserver-<pid>.json when listening)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        for info in runtime.glob(f"jpserver-{server.pid}.json"):
            try:
                url = json.loads(info.read_text())["url"].rstrip("/")
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                    return url
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.3)
    raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop_server(server: subprocess.Popen, token: str, runtime: Path) -> None:
    """Ask the server to shut down (it stops its kernels), then SIGTERM/SIGKILL its process group."""
    if server.poll() is None:
        info = runtime / f"jpserver-{server.pid}.json"
        try:
            url = json.loads(info.read_text())["url"].rstrip("/")
            request = urllib.request.Request(f"{url}/api/shutdown", method="POST",
                                             headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(request, timeout=10).close()
            server.wait(timeout=20)
        except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if server.poll() is not None:
            break
        os.killpg(server.pid, sig)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def chrome(browser_tmp: Path, monkeypatch):
    """A headless Debian Chromium driven by Debian's chromedriver; quit (and checked gone) afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")   # selenium-manager must never fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={browser_tmp / 'chromium-profile'}")
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(browser_tmp / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            service.stop()
        time.sleep(0.2)
        left = (kill_survivors(str(browser_tmp / "chromium-profile"))
                + kill_survivors(str(browser_tmp / "chromedriver.log")))
        assert not left, f"Chromium/chromedriver left processes behind (killed): {left}"
