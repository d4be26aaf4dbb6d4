"""torch.profiler around a launch (`distlab.launch.profiler`) and what is measured from it
(`distlab.viz.profile`): one profiled 2-rank DDP run of `dl.train`, shared by the tests that read it.

The comm fraction, the profiler's beside distlab's own (same steps, same clock): they are not equal, and
the relation that must hold is tested instead. distlab's event of a collective runs from before its launch
call to its completion as distlab learns it: the future's done callback, which needs the GIL (while the
main thread runs Python between ops it holds it, and the end is stamped late), or the wait. The profiler
sees the launch call (``c10d::allreduce_``) and the backend's run (``gloo:all_reduce``), both inside that
interval. So every such profiler range lies inside a distlab event, and the profiler's fraction is at most
distlab's (0.02 of slack for the clocks); on a quiet machine they agree to a few hundredths, on a busy one
distlab's has been seen at twice the profiler's.
"""
from __future__ import annotations

import json

import pytest

import distlab as dl
from distlab.launch import profiler
from distlab.viz import profile as measure


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prof")
    report = dl.train("ddp", world_size=2, steps=3, model="gpt-tiny", profile=str(directory))
    return directory, report


def test_the_merged_trace_is_chrome_json_with_both_ranks_and_distlabs_ranges(profiled):
    directory, report = profiled
    assert sorted(p.name for p in directory.iterdir()) == ["rank0.json", "rank1.json", "trace.json"]
    with open(directory / "trace.json") as f:
        data = json.load(f)                                   # valid JSON
    events = data["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}               # a process per rank (CPU: no GPU processes)
    assert all(isinstance(e.get("ts", 0.0), (int, float)) for e in events)
    for rank in (0, 1):
        names = {e["name"] for e in events if e["pid"] == rank and e.get("ph") == "X"}
        assert {"distlab:forward", "distlab:backward", "distlab:optimizer"} <= names   # live ranges
        assert "distlab:all_reduce" in names                  # the collective, written in at its times
        assert {"distlab:module:DDP", "distlab:module:module.blocks.0.attn"} <= names   # modules' forwards
        assert "c10d::allreduce_" in names and "gloo:all_reduce" in names      # torch's own ops
        assert any(n.startswith("aten::") for n in names)
    forward = [e for e in events if e["name"] == "distlab:forward" and e["pid"] == 0]
    assert [e["args"]["step"] for e in forward] == list(range(3))       # each range carries its span's args
    # the common time base: a range sits where distlab's own trace has its span (the median of the gaps:
    # a rank preempted, or collecting garbage, between a span's start and its range's is off by as long)
    spans = report.trace.spans(rank=0, name="forward")
    assert _median_gap(sorted(e["ts"] * 1e-6 for e in forward), spans) < 2e-3


def _median_gap(starts: list[float], spans: list) -> float:
    assert len(starts) == len(spans)
    gaps = sorted(abs(t - s.start) for t, s in zip(starts, spans))
    return gaps[len(gaps) // 2]


def test_each_rank_file_is_the_profilers_own_with_its_rank(profiled):
    directory, _ = profiled
    for rank in (0, 1):
        with open(directory / f"rank{rank}.json") as f:
            data = json.load(f)
        assert data["distributedInfo"]["rank"] == rank        # what Holistic Trace Analysis reads
        assert data["distlab"]["rank"] == rank and data["distlab"]["peak_flops"] > 0
        assert len(data["distlab"]["steps"]) == 3
        steps = [e["name"] for e in data["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
        assert steps == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]


def test_comm_fraction_from_the_profiler_beside_distlabs(profiled):
    directory, report = profiled
    figures = measure.measured(str(directory), report.trace)
    for rank, f in figures.items():
        own = f["distlab"]
        assert 0 < f["comm"] < 1 and 0 < own["comm"] < 1
        assert f["comm"] <= own["comm"] + 0.02, (rank, f)
        assert 0 <= f["hidden"] <= own["hidden"] + 0.05       # distlab's compute spans hold the ops
        assert f["flops"] > 0 and 0 < f["mfu"] < 1.5


def test_the_profilers_collective_ranges_lie_inside_distlabs_events(profiled):
    directory, _ = profiled
    with open(directory / "trace.json") as f:
        data = json.load(f)
    for rank, info in data["distlab"]["ranks"].items():
        (start, _), (_, end) = info["steps"][0], info["steps"][-1]
        ranges = [e for e in data["traceEvents"] if e["pid"] == int(rank) and e.get("ph") == "X"
                  and start <= e["ts"] <= end]
        ours = [(e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"].startswith("distlab:all_reduce")]
        theirs = [e for e in ranges if e["name"] in ("c10d::allreduce_", "gloo:all_reduce")]
        assert ours and theirs
        for e in theirs:                       # 0.2 ms: where each clock reads the moment
            assert any(a - 200 <= e["ts"] and e["ts"] + e["dur"] <= b + 200 for a, b in ours), e


def test_no_profile_means_no_files_and_no_ranges(tmp_path):
    def ranges_set():
        from distlab.runtime import tracer
        return tracer().ranges is not None

    run = dl.launch(ranges_set, world_size=1, output="quiet")
    assert run.results == [False]
    assert list(tmp_path.iterdir()) == []


def test_bad_profile_directories_are_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match="profile"):
        dl.launch(print, world_size=1, profile="  ")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="profile"):
        profiler.prepare(tmp_path / "file" / "below")
    with pytest.raises(ValueError, match="profile"):
        dl.train("ddp", world_size=2, profile=3, check_only=True)


def test_old_rank_files_are_removed(tmp_path):
    (tmp_path / "rank7.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    assert profiler.prepare(tmp_path) == str(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_interval_arithmetic():
    a = measure._union([(0, 2), (1, 3), (5, 6)])
    assert a == [(0, 3), (5, 6)]
    assert measure._intersect(a, [(2, 5.5)]) == [(2, 3), (5, 5.5)]
    assert measure._subtract(a, [(1, 2), (5.5, 7)]) == [(0, 1), (2, 3), (5, 5.5)]
    assert measure._flops({"args": {"Input Dims": [[4], [2, 3], [3, 4], [], []]}}) == 2 * 2 * 3 * 4


def test_the_command_takes_profile_and_prints_the_figures(profiled):
    import argparse

    from distlab import cli
    from distlab.viz.profile import summary

    parser = argparse.ArgumentParser()
    cli._train_parser(parser.add_subparsers(dest="command"))
    assert cli.train_keywords(parser.parse_args(["train", "--profile", "prof"]))["profile"] == "prof"
    directory, report = profiled
    lines = summary(str(directory), report.trace).splitlines()
    assert lines[0].startswith("profile: ") and lines[1].startswith("rank 0: comm ") and "MFU" in lines[2]


def test_single_profiles_in_this_process_on_the_reports_axis(tmp_path):
    report = dl.train("single", steps=3, profile=tmp_path)
    with open(tmp_path / "trace.json") as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events} == {0}
    ranges = sorted(e["ts"] * 1e-6 for e in events if e.get("name") == "distlab:forward")
    assert len(ranges) == 3
    assert _median_gap(ranges, report.trace.spans(name="forward")) < 2e-3


def test_a_dry_run_refuses_a_profile(tmp_path):
    with pytest.raises(ValueError, match="dry run"):
        dl.train("ddp", world_size=4, steps=1, backend="fake", ranks=[0], profile=tmp_path / "p")
    with pytest.raises(ValueError, match="dry run"):
        dl.launch(len, 4, args=((),), backend="fake", ranks=(0,), profile=tmp_path / "q")
    assert not (tmp_path / "p").exists() and not (tmp_path / "q").exists()


def test_the_merge_names_each_ranks_gpu_process(tmp_path):
    """The profiler names a GPU's stream process after the program ("python3" on the H100 run), the
    same for every rank: the merged file calls it "rank r GPU d", beside "rank r" for the host."""
    import json

    from distlab.launch import profiler
    for r in range(2):
        host = 4000 + r
        events = [{"ph": "M", "name": "process_name", "pid": host, "tid": 0, "args": {"name": "python3"}},
                  {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python3"}},
                  {"ph": "X", "name": "kernel", "pid": 0, "tid": 7, "ts": 5.0, "dur": 1.0}]
        with open(profiler.rank_path(str(tmp_path), r), "w") as f:
            json.dump({"traceEvents": events, "distlab": {"rank": r, "pid": host, "epoch_us": 0.0}}, f)
    with open(profiler.merge(str(tmp_path), 2)) as f:
        merged = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 1000: "rank 0 GPU 0", 2000: "rank 1 GPU 0"}
    assert sorted(e["pid"] for e in merged if e.get("name") == "kernel") == [1000, 2000]
