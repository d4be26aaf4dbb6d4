"""Shared fixtures: every launcher test must leave no rank process and no file descriptor behind."""
from __future__ import annotations

import signal

import pytest

from _processes import child_pids, describe, is_library_singleton, open_fds

_warmed: list[bool] = []


def _warm_singletons() -> None:
    """TCPStore keeps one wake-up pipe per process and forkserver one connection:
    start them before counting."""
    if not _warmed:
        from multiprocessing import forkserver, resource_tracker

        import torch.distributed as dist
        resource_tracker.ensure_running()
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        del store
        forkserver.ensure_running()
        _warmed.append(True)


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves rank processes or file descriptors behind."""
    _warm_singletons()
    before_fds = open_fds()
    yield
    left = child_pids()
    assert left == [], f"orphan or zombie rank processes left: {describe(left)}"
    leaked = {fd for fd in open_fds() - before_fds if not is_library_singleton(fd)}
    assert not leaked, f"file descriptors leaked: {sorted(leaked)}"


def pytest_configure(config):
    """Ctrl-C as a notebook's kernel has it. A runner started in the background of a non-interactive shell
    (`make test &`) inherits SIGINT ignored, Python then keeps it ignored, and so would every process it
    starts (an ignored signal stays ignored across exec): the tests of Ctrl-C would see nothing arrive."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def cpu_index():
    """The URL of a PyTorch CPU wheel index on loopback that answers for torch (404 for anything else), as the
    Makefile's 3-second probe of the real one would find it (tests/test_make_lab.py, test_make_torch.py)."""
    import http.server
    import threading

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path.rstrip("/").endswith("/torch") else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    finally:
        server.shutdown()


@pytest.fixture(scope="session")
def _jupyter_data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jupyter-data")


@pytest.fixture(autouse=True)
def _own_jupyter_data(_jupyter_data_dir, monkeypatch):
    """`distlab.lessons.copy` signs the lessons it writes into Jupyter's data directory (what `jupyter trust`
    does): the tests' copies are signed into a directory of their own, never the user's."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(_jupyter_data_dir))
