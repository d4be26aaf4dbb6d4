"""Checkpoints that went wrong: nothing is silently lost or overwritten, and the message says what to do.
(Mostly `single`, which trains in this process: the rules live in `distlab.checkpoint`, not in a strategy.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distlab as dl
from distlab.checkpoint import CheckpointError

KW = dict(steps=4, global_batch=8, checkpoint_every=2)


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def test_resume_refuses_to_train_over_step_folders_it_cannot_read(tmp_path):
    dl.train("single", **KW, checkpoint_dir=str(tmp_path))
    for step in (2, 4):
        (tmp_path / f"step_{step}" / "manifest.json").unlink()      # say, a copy that lost its manifests
    with pytest.raises(CheckpointError, match=r"found \['step_2', 'step_4'\].*no checkpoint that verifies.*"
                                              r"new checkpoint_dir"):
        dl.train("single", **KW, checkpoint_dir=str(tmp_path), resume=True)
    assert _names(tmp_path) == ["step_2", "step_4"]
    assert not (tmp_path / "step_2" / "manifest.json").exists()      # nothing was overwritten


def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_that_verifies(tmp_path, capfd):
    plain = dl.train("single", steps=6, global_batch=8)
    dl.train("single", **KW, checkpoint_dir=str(tmp_path))
    shard = tmp_path / "step_4" / "rank_0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                                      # one flipped byte
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    resumed = dl.train("single", **{**KW, "steps": 6}, checkpoint_dir=str(tmp_path), resume=True)
    err = capfd.readouterr().err
    assert "resuming from step 2" in err and "step_4" in err and "sha256" in err and "resume=2" in err
    assert {k: v for k, v in resumed.results[0].info["checkpoint"].items() if k != "note"} == {
        "resumed_from": 2, "saved": [4, 6]}
    assert resumed.losses == plain.losses


def test_a_truncated_manifest_is_a_clear_error_and_resume_skips_it(tmp_path, capfd):
    dl.train("single", **KW, checkpoint_dir=str(tmp_path))
    path = tmp_path / "step_4" / "manifest.json"
    path.write_text(path.read_text()[:40])
    with pytest.raises(CheckpointError, match="step_4/manifest.json cannot be read.*damaged"):
        dl.checkpoint.load(tmp_path, 4)
    resumed = dl.train("single", **KW, checkpoint_dir=str(tmp_path), resume="latest")
    assert resumed.results[0].info["checkpoint"]["resumed_from"] == 2
    assert "resuming from step 2" in capfd.readouterr().err


def test_shards_are_tied_to_their_run(tmp_path):
    for name, value in (("a", 1.0), ("b", 2.0)):
        dl.checkpoint.save(tmp_path / name, 1, {"x": torch.full((4,), value)})
    a, b = tmp_path / "a" / "step_1", tmp_path / "b" / "step_1"
    info = json.loads((a / "manifest.json").read_text())
    assert len(info["run_id"]) == 32 and info["run_id"] != dl.checkpoint.manifest(tmp_path / "b")["run_id"]
    # a shard of run b slipped into run a, with a manifest patched to match its bytes
    (a / "rank_0.pt").write_bytes((b / "rank_0.pt").read_bytes())
    info["shards"][0].update(json.loads((b / "manifest.json").read_text())["shards"][0])
    (a / "manifest.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="written by run .* belongs to run .*two runs were mixed"):
        dl.checkpoint.load(tmp_path / "a")


def test_two_runs_cannot_write_one_checkpoint_dir(tmp_path):
    holder = subprocess.Popen(                         # another process training into the same directory
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match="another training run is writing checkpoints to"):
            dl.train("single", **KW, checkpoint_dir=str(tmp_path))
    finally:
        holder.stdin.close()
        holder.wait()
        holder.stdout.close()
    assert list(tmp_path.iterdir()) == []
    dl.train("single", **KW, checkpoint_dir=str(tmp_path))           # free again: it trains
    dl.train("single", **KW, checkpoint_dir=str(tmp_path))           # and the lock went with the run
    assert _names(tmp_path) == ["step_2", "step_4"]


def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="not writable.*choose a directory"):
        dl.train("ddp", world_size=2, **KW, checkpoint_dir=str(tmp_path / "file" / "ck"))


@pytest.mark.parametrize("resume", ["last", -1, 2.5])
def test_bad_resume_values_are_clear_errors(tmp_path, resume):
    with pytest.raises(ValueError, match="resume must be True .*a step number, or False"):
        dl.train("ddp", world_size=2, **KW, checkpoint_dir=str(tmp_path), resume=resume)


def test_a_run_that_failed_in_this_process_does_not_keep_the_directory_locked(tmp_path):
    from distlab.checkpoint import directory
    directory.lock(tmp_path)              # what a failed run's frames, kept by a notebook's traceback, hold
    dl.train("single", **KW, checkpoint_dir=str(tmp_path))
    assert _names(tmp_path) == ["step_2", "step_4"]


def test_sharded_resume_skips_a_checkpoint_whose_other_rank_shard_is_corrupt(tmp_path, capfd):
    kw = dict(world_size=2, steps=4, global_batch=8)
    plain = dl.train("zero2", **kw)
    dl.train("zero2", **kw, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    (tmp_path / "step_4" / "rank_1.pt").write_bytes(b"truncated")
    capfd.readouterr()
    resumed = dl.train("zero2", **kw, checkpoint_dir=str(tmp_path), checkpoint_every=2, resume=True)
    assert "step_4/rank_1.pt does not match" in capfd.readouterr().err
    assert resumed.results[0].info["checkpoint"]["saved"] == [4]
    assert resumed.results[0].info["checkpoint"]["resumed_from"] == 2
    assert "step_4" in resumed.results[0].info["checkpoint"]["note"]
    assert resumed.losses == plain.losses


# -- a manifest is input from outside: it cannot make distlab read outside its step folder ----------
def _saved(tmp_path):
    """A one-rank checkpoint at ``tmp_path/ck/step_1``, a copy of its shard outside the step folder (same
    bytes, same run: only where it lies is wrong), and a function that edits the shard's manifest entry."""
    ck = tmp_path / "ck"
    dl.checkpoint.save(ck, 1, {"x": torch.arange(10.0)})
    (tmp_path / "outside.pt").write_bytes((ck / "step_1" / "rank_0.pt").read_bytes())

    def edit(**entry):
        path = ck / "step_1" / "manifest.json"
        info = json.loads(path.read_text())
        info["shards"][0].update(entry)
        path.write_text(json.dumps(info))
    return ck, edit


def _every_reader_refuses(ck, match: str) -> None:
    from distlab.checkpoint import store
    for read in (dl.checkpoint.load, dl.checkpoint.load_all, lambda d: store.verify(d, 1)):
        with pytest.raises(CheckpointError, match=match):
            read(ck)


@pytest.mark.parametrize("name", ["ABSOLUTE", "../outside.pt", "../ck/step_1/rank_0.pt", "sub/rank_0.pt",
                                  ".", "", "rank_0.pt\0"])
def test_a_manifest_cannot_name_a_file_outside_its_step_folder(tmp_path, name):
    ck, edit = _saved(tmp_path)
    edit(file=str(tmp_path / "outside.pt") if name == "ABSOLUTE" else name)
    _every_reader_refuses(ck, "manifest.json names .* for rank 0: not a plain file name .*refused")


def test_a_shard_that_is_a_link_out_of_its_step_folder_is_refused(tmp_path):
    ck, _ = _saved(tmp_path)
    shard = ck / "step_1" / "rank_0.pt"
    shard.unlink()
    shard.symlink_to(tmp_path / "outside.pt")                          # the same bytes, elsewhere
    _every_reader_refuses(ck, "rank_0.pt leads outside its step folder .*outside.pt.*refused")
    shard.unlink()
    shard.symlink_to("/dev/zero")
    _every_reader_refuses(ck, "rank_0.pt leads outside its step folder .*/dev/zero")


def test_a_shard_that_is_not_a_regular_file_is_refused(tmp_path):
    ck, _ = _saved(tmp_path)
    shard = ck / "step_1" / "rank_0.pt"
    shard.unlink()
    shard.mkdir()
    _every_reader_refuses(ck, "rank_0.pt is not a regular file")


def test_a_manifest_with_a_bad_shape_is_refused(tmp_path):
    ck, edit = _saved(tmp_path)
    edit(replicated_from=3)                                             # no such rank in a world of 1
    with pytest.raises(CheckpointError, match="manifest.json.*replicated_from=3.*not a rank"):
        dl.checkpoint.load(ck)
    edit(replicated_from=None, bytes="10")
    with pytest.raises(CheckpointError, match="manifest.json.*bytes='10'"):
        dl.checkpoint.load(ck)


def _load_in_a_child(ck) -> subprocess.CompletedProcess:
    """Load ``ck`` in a child allowed 2 GiB more memory than it holds after importing distlab: a read of
    /dev/zero, or of a file far larger than its manifest says, fails there, not in this process."""
    script = ("import resource, sys, os, distlab as dl\n"
              "held = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')\n"
              "resource.setrlimit(resource.RLIMIT_AS, (held + (2 << 30), held + (2 << 30)))\n"
              "try:\n    dl.checkpoint.load(sys.argv[1])\n"
              "except dl.checkpoint.CheckpointError as err:\n    print('refused:', err)\n")
    root = str(Path(__file__).resolve().parents[1])
    return subprocess.run([sys.executable, "-c", script, str(ck)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})


def test_a_manifest_pointing_at_dev_zero_is_refused_without_reading_it(tmp_path):
    ck, edit = _saved(tmp_path)
    edit(file="/dev/zero")
    done = _load_in_a_child(ck)
    assert "refused:" in done.stdout and "not a plain file name" in done.stdout, done.stderr[-2000:]


def test_a_shard_larger_than_its_manifest_says_is_refused_before_it_is_read(tmp_path):
    ck, _ = _saved(tmp_path)
    shard = ck / "step_1" / "rank_0.pt"
    os.truncate(shard, 64 << 30)                 # 64 GiB on paper (sparse: no disk used)
    done = _load_in_a_child(ck)
    assert "refused:" in done.stdout and "68719476736 bytes on disk" in done.stdout, done.stderr[-2000:]
    os.truncate(shard, 3)                         # and smaller: also before reading
    _every_reader_refuses(ck, r"rank_0.pt does not match its manifest: 3 bytes on disk, \d+ in the manifest")


def test_resume_and_consolidate_refuse_a_manifest_that_points_outside(tmp_path):
    dl.train("single", **KW, checkpoint_dir=str(tmp_path / "ck"))
    for step in (2, 4):
        path = tmp_path / "ck" / f"step_{step}" / "manifest.json"
        info = json.loads(path.read_text())
        info["shards"][0]["file"] = "/etc/passwd"
        path.write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="no checkpoint that verifies.*not a plain file name"):
        dl.train("single", **KW, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    with pytest.raises(CheckpointError, match="not a plain file name"):
        dl.checkpoint.consolidate(tmp_path / "ck")
