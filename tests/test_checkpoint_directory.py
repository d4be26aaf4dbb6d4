"""The checkpoint directory is shared ground: a save removes only the temporary folders distlab made
there (issue 19)."""
from __future__ import annotations

import pathlib

import pytest
import torch

import distlab as dl
from distlab.checkpoint import CheckpointError

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
