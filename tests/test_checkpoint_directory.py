"""The checkpoint directory is shared ground: a save removes only the temporary folders distlab made
there, and one training run at a time writes it, whether the second run is in another process or in
another thread of this one (issue 19)."""
from __future__ import annotations

import os
import pathlib
import threading
import time

import pytest
import torch

import distlab as dl
from distlab.checkpoint import CheckpointError, directory, store

KW = dict(steps=2, model="gpt-tiny", global_batch=8, checkpoint_every=1, progress=False)
BUSY = "another training run is writing checkpoints to"


def _interrupted_save(directory, step: int) -> None:
    """What a crash in the middle of saving ``step`` leaves: ``step_<step>.tmp`` with a shard, no commit."""
    def crash(stage):
        if stage == "written":
            raise KeyboardInterrupt("the process died here")
    with pytest.raises(KeyboardInterrupt):
        dl.checkpoint.save(directory, step, {"x": torch.ones(3)}, hook=crash)
    assert (directory / f"step_{step}.tmp" / "rank_0.pt").is_file()


# -- what a save may delete ------------------------------------------------------------------------
def test_a_save_removes_only_the_interrupted_saves_it_made(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.txt").write_text("a user's data")
    theirs = {"my results.tmp": "folder", "step_7.tmp": "folder", "step_x.tmp": "folder",
              "step_8.replaced.tmp": "folder", "notes.tmp": "file", "step_9.tmp": "file"}
    for name, kind in theirs.items():
        if kind == "folder":
            (ck / name).mkdir()
            (ck / name / "keep.txt").write_text("mine")
        else:
            (ck / name).write_text("mine")
    (ck / "step_6.tmp").symlink_to(outside, target_is_directory=True)   # a link to a user's folder
    _interrupted_save(ck, 2)
    dl.checkpoint.save(ck, 3, {"x": torch.zeros(3)}, keep_last=1)
    left = sorted(p.name for p in ck.iterdir())
    assert left == sorted([*theirs, "step_6.tmp", "step_3"])          # only distlab's step_2.tmp went
    assert all((ck / n / "keep.txt").is_file() for n, kind in theirs.items() if kind == "folder")
    assert (outside / "data.txt").read_text() == "a user's data"
    dl.checkpoint.save(ck, 3, {"x": torch.ones(3)}, keep_last=1)         # re-saving, rotating: the same
    assert sorted(p.name for p in ck.iterdir()) == left


def test_a_save_into_the_working_directory_leaves_the_projects_tmp_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache.tmp").mkdir()
    (tmp_path / "cache.tmp" / "big.bin").write_bytes(b"0" * 100)
    _interrupted_save(pathlib.Path(""), 1)
    dl.checkpoint.save("", 2, {"x": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.tmp", "step_2"]
    assert (tmp_path / "cache.tmp" / "big.bin").read_bytes() == b"0" * 100


def test_messages_name_only_distlabs_interrupted_saves(tmp_path):
    (tmp_path / "my results.tmp").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint") as err:
        dl.checkpoint.load(tmp_path)
    assert "my results.tmp" not in str(err.value)
    _interrupted_save(tmp_path, 4)
    with pytest.raises(CheckpointError, match=r"only interrupted saves.*\['step_4.tmp'\]"):
        dl.checkpoint.load(tmp_path)


def test_a_step_tmp_folder_that_is_not_distlabs_is_refused_not_overwritten(tmp_path):
    (tmp_path / "step_5.tmp").mkdir()
    (tmp_path / "step_5.tmp" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="step_5.tmp.*not one distlab made.*move it"):
        dl.checkpoint.save(tmp_path, 5, {"x": torch.ones(3)})
    assert (tmp_path / "step_5.tmp" / "keep.txt").read_text() == "mine"


# -- one run at a time -----------------------------------------------------------------------------
class Paused:
    """Holds the first checkpoint save of the run whose seed is ``seed`` until `go` (in this process, or
    in a rank forked from it: the two sides meet through files in ``where``)."""

    def __init__(self, monkeypatch, where, seed: int):
        self.where, self.seed, real = where, seed, store.save

        def save(directory, step, state, **kw):
            if kw["meta"]["spec"]["seed"] == self.seed and dl.rank() == 0 and not (where / "saving").exists():
                (where / "saving").touch()
                deadline = time.monotonic() + 120
                while not (where / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            return real(directory, step, state, **kw)
        monkeypatch.setattr(store, "save", save)

    def wait_saving(self) -> None:
        deadline = time.monotonic() + 120
        while not (self.where / "saving").exists():
            assert time.monotonic() < deadline, "the first run never reached its first save"
            time.sleep(0.02)

    def go(self) -> None:
        (self.where / "go").touch()


def _in_thread(fn, name=None, **kw):
    out = {}

    def body():
        try:
            out["report"] = fn(**kw)
        except BaseException as err:        # noqa: BLE001 -- handed to the test
            out["error"] = err
    thread = threading.Thread(target=body, name=name)
    thread.start()
    return thread, out


@pytest.mark.parametrize("first, second", [("single", "single"), ("single", "ddp"), ("ddp", "ddp")])
def test_a_second_live_run_in_another_thread_is_refused(tmp_path, monkeypatch, first, second):
    ck, sync = tmp_path / "ck", tmp_path / "sync"
    sync.mkdir()
    paused = Paused(monkeypatch, sync, seed=0)
    world = {"single": 1, "ddp": 2}
    thread, out = _in_thread(dl.train, strategy=first, world_size=world[first], seed=0,
                             checkpoint_dir=str(ck), **KW)
    try:
        paused.wait_saving()
        error = (dl.LaunchError, CheckpointError) if second != "single" else CheckpointError
        with pytest.raises(error, match=BUSY):
            dl.train(second, world_size=world[second], seed=1, checkpoint_dir=str(ck), **KW)
    finally:
        paused.go()
        thread.join()
    assert "error" not in out, out.get("error")
    assert dl.checkpoint.steps(ck) == [1, 2]
    assert {dl.checkpoint.manifest(ck, s)["meta"]["spec"]["seed"] for s in (1, 2)} == {0}
    dl.train(second, world_size=world[second], seed=1, checkpoint_dir=str(ck), **KW)   # free again
    assert dl.checkpoint.manifest(ck)["meta"]["spec"]["seed"] == 1


def test_a_run_that_failed_in_another_thread_leaves_the_directory_free(tmp_path, monkeypatch):
    real = store.save

    def failing(*args, **kw):
        if threading.current_thread().name == "doomed":
            raise OSError("disk full")
        return real(*args, **kw)
    monkeypatch.setattr(store, "save", failing)
    out = {}
    thread = threading.Thread(name="doomed", target=lambda: out.setdefault("error", _raises(
        lambda: dl.train("single", checkpoint_dir=str(tmp_path), **KW))))
    thread.start()
    thread.join()
    assert "disk full" in str(out["error"])
    dl.train("single", checkpoint_dir=str(tmp_path), **KW)                      # this thread
    dl.train("ddp", world_size=2, checkpoint_dir=str(tmp_path), **KW)          # launched ranks
    assert dl.checkpoint.steps(tmp_path) == [1, 2]


def _raises(fn):
    try:
        fn()
    except BaseException as err:            # noqa: BLE001
        return err
    return None


def test_the_write_test_of_two_threads_at_once_is_not_mistaken_for_an_unwritable_directory(
        tmp_path, monkeypatch):
    """Thread a writes its probe file, thread b checks the same directory meanwhile; then a removes its
    probe. A probe named by the process id alone is the same file for both: b removes it under a."""
    a_waiting, b_done = threading.Event(), threading.Event()
    real_unlink = pathlib.Path.unlink

    def unlink(self, *args, **kw):
        if self.name.startswith(".write-test") and threading.current_thread().name == "a":
            a_waiting.set()
            b_done.wait(30)
        return real_unlink(self, *args, **kw)
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    thread, out = _in_thread(directory.writable, name="a", directory=tmp_path)
    try:
        assert a_waiting.wait(30)
        directory.writable(tmp_path)
    finally:
        b_done.set()
        thread.join()
    assert "error" not in out, out.get("error")
    assert os.listdir(tmp_path) == []                                   # no probe left behind


def test_a_forked_rank_does_not_keep_its_parents_lock(tmp_path):
    """A rank forked while a run of this process holds a directory (a launch in another thread) gets a
    copy of the lock's descriptor; it closes it, so the directory is free once the run gives it back."""
    held = directory.lock(tmp_path)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:                                           # the child: say it runs, wait until told to go
        os.write(ready_w, b"1")
        os.read(go_r, 1)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        held.release()
        directory.lock(tmp_path).release()                   # free, though the child lives on
    finally:
        os.write(go_w, b"1")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
