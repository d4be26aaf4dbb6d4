"""Inside a launch every rank has torchrun's environment, so torchrun-style code runs unchanged, and a
launch from inside a rank says it is already inside one instead of nesting."""
from __future__ import annotations

import os

import pytest

import distlab as dl

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _environment():
    return {name: os.environ.get(name) for name in NAMES}


def test_every_rank_has_torchrun_environment():
    run = dl.launch(_environment, world_size=3, output="quiet")
    ports = {env["MASTER_PORT"] for env in run.results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, env in enumerate(run.results):
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
    assert "RANK" not in os.environ               # the parent's own environment is untouched


def _nested():
    return dl.launch(_environment, world_size=2, output="quiet").results


def test_a_launch_inside_a_rank_says_so():
    with pytest.raises(dl.LaunchError) as err:
        dl.launch(_nested, world_size=2, output="quiet")
    assert "already inside a launch" in str(err.value)
