"""`dl.data` and `dl.train(..., data="text")`: the sampler's invariants (torch's DistributedSampler per
epoch, every sample once across ranks, deterministic by seed and epoch, uneven sizes), the loader's
position (read-ahead never moves it), exact resume of the data after a fault, on the same and on a
shrunk data-parallel size (the sample ids of every step compared with an uninterrupted run's), the
"data wait" spans of slow storage, and a text loss that falls."""
import math
import time

import pytest
import torch
from torch.utils.data import DistributedSampler as TorchSampler

import distlab as dl
from distlab.data import DistributedSampler, Loader, Position, TextCorpus
from distlab.strategies import feed as feeds


@pytest.mark.parametrize("size,n,drop_last", [(10, 3, False), (10, 3, True), (12, 4, False), (5, 8, False)])
def test_shard_is_torchs_distributed_sampler(size, n, drop_last):
    s = DistributedSampler(size, seed=7, drop_last=drop_last)
    for epoch in (0, 3):
        for r in range(n):
            theirs = TorchSampler(range(size), num_replicas=n, rank=r, shuffle=True, seed=7,
                                  drop_last=drop_last)
            theirs.set_epoch(epoch)
            assert s.shard(epoch, r, n) == list(theirs)


@pytest.mark.parametrize("size,n", [(10, 3), (16, 4), (7, 2)])
def test_every_sample_once_per_epoch_across_ranks(size, n):
    s = DistributedSampler(size, seed=1)
    shards = [s.shard(2, r, n) for r in range(n)]
    assert len({len(x) for x in shards}) == 1                     # equal counts (padded)
    seen = [i for x in shards for i in x]
    assert set(seen) == set(range(size)) and len(seen) - size == -size % n   # the padding, no more
    assert sorted(s.epoch_order(0).tolist()) == list(range(size))
    assert torch.equal(s.epoch_order(4), DistributedSampler(size, seed=1).epoch_order(4))    # by seed, epoch
    assert not torch.equal(s.epoch_order(0), s.epoch_order(1))
    assert DistributedSampler(size, shuffle=False).epoch_order(5).tolist() == list(range(size))


def test_the_stream_of_global_batches_and_its_positions():
    s = DistributedSampler(10, seed=0)
    ids, pos = s.batch_at(Position(), 4)
    assert torch.equal(ids, s.epoch_order(0)[:4]) and pos == Position(0, 4)
    ids, pos = s.batch_at(Position(0, 8), 4)                      # runs on into epoch 1
    assert ids.tolist() == s.epoch_order(0)[8:].tolist() + s.epoch_order(1)[:2].tolist()
    assert pos == Position(1, 2)
    dropping = DistributedSampler(10, seed=0, drop_last=True)
    ids, pos = dropping.batch_at(Position(0, 8), 4)               # the tail of 2 is skipped
    assert torch.equal(ids, dropping.epoch_order(1)[:4]) and pos == Position(1, 4)
    assert s.position_after(12, 4) == Position(1, 2)
    rows = [dl.data.rows(torch.arange(10), r, 3).tolist() for r in range(3)]    # uneven: 4, 3, 3
    assert rows == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_loader_reads_ahead_without_moving_its_position():
    corpus = TextCorpus(seq_len=8)
    s = DistributedSampler(len(corpus), seed=3)
    plain = [next(Loader(corpus, s, 5)).ids]
    ahead = Loader(corpus, s, 5, workers=2, prefetch=2)
    first = next(ahead)
    assert torch.equal(first.ids, plain[0]) and ahead.position == s.batch_at(Position(), 5)[1]
    state = ahead.state_dict()                                    # 4 batches in flight, 1 taken
    later = [next(ahead).ids for _ in range(3)]
    ahead.load_state_dict(state)
    assert all(torch.equal(a, next(ahead).ids) for a in later)    # the same batches again, in order
    x, y = corpus[first.ids]
    assert torch.equal(first.x, x) and torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (5, 8)
    ahead.close()


def test_slow_storage_is_hidden_by_workers():
    corpus = TextCorpus(seq_len=8)
    s = DistributedSampler(len(corpus))
    for workers in (0, 4):
        loader = Loader(corpus, s, 4, workers=workers, prefetch=2, latency=0.02)
        next(loader)                                              # the first read: nothing ahead yet
        for _ in range(6):
            time.sleep(0.02)                                      # a "training step" as long as a read
            next(loader)
        waited = sum(loader.wait_s[1:]) / 6
        loader.close()
        assert (waited > 0.015) if workers == 0 else (waited < 0.01), (workers, waited)
    assert feeds.predicted_idle_fraction(0.02, 0.02) == 0.5
    assert feeds.predicted_idle_fraction(0.02, 0.02, workers=4) == 0.0


KW = dict(model="gpt-tiny", steps=6, global_batch=6, seed=0, data="text", shuffle=True)


def _samples(report) -> dict:
    return report.results[0].info["data"]["samples"]


def test_text_resumes_exactly_on_the_same_and_a_shrunk_dp_size(tmp_path, no_leaks):
    """Killed at step 5 (checkpoints every 2), resumed from step 4 on 3 ranks, and on 2 after a shrink:
    the steps after the resume consume the uninterrupted run's sample ids, step by step, and each
    resumed run starts from the position its checkpoint holds."""
    plain = dl.train("ddp", world_size=3, **KW)
    whole = _samples(plain)
    assert sorted(whole) == list(range(6)) and all(len(v) == 6 for v in whole.values())
    for name, extra in (("same", {}), ("shrunk", {"shrink": True})):
        ck = tmp_path / name
        r = dl.train("ddp", world_size=3, **KW, checkpoint_dir=str(ck), checkpoint_every=2, fail_at_step=5,
                     max_restarts=1, **extra)
        [restart] = r.restarts
        assert restart.resumed_from == 4 and r.world_size == (2 if extra else 3)
        assert _samples(r) == {s: whole[s] for s in (4, 5)}
        assert r.results[0].info["data"]["resumed_position"] == (0, 24)
        assert r.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-6)


def test_text_training_loss_falls():
    r = dl.train("single", world_size=1, model="gpt-tiny", steps=25, global_batch=16, lr=3e-3, data="text")
    assert r.losses[0] > 5.0 and sum(r.losses[-3:]) / 3 < r.losses[0] - 1.5       # ln 256 = 5.55
    before, after = dl.data.before_and_after(r, "It was the ", 20)
    assert before.startswith("It was the ") and after.startswith("It was the ") and before != after


def test_starved_ranks_wait_on_the_timeline(no_leaks):
    """Storage of 50 ms a batch and no workers: every step's "data wait" span takes the latency, and the
    measured idle fraction is the predicted latency / (latency + step) (step: the rest of the step)."""
    r = dl.train("ddp", world_size=2, model="gpt-tiny", steps=6, global_batch=8, data="text",
                 data_latency=0.05)
    for rank in (0, 1):
        spans = r.run.trace.spans(rank=rank)
        waits = [e for e in spans if e.name == "data wait"]
        assert len(waits) == 6 and min(e.duration for e in waits) >= 0.05
        measured = feeds.idle_fraction(r.run.trace, rank)
        wait = sum(e.duration for e in waits) / 6
        step = (max(e.end for e in spans) - min(e.start for e in spans)) / 6
        assert measured == pytest.approx(feeds.predicted_idle_fraction(0.05, step - wait), abs=0.1)
        assert measured > 0.2


def test_data_options_are_checked():
    with pytest.raises(ValueError, match="pass data='text' too"):
        dl.train("single", world_size=1, workers=2)
    with pytest.raises(ValueError, match="byte tokens for a GPT"):
        dl.train("single", world_size=1, model="mlp", data="text")
    with pytest.raises(ValueError):
        dl.train("single", world_size=1, data="images")


def test_every_layout_reads_the_same_global_batches():
    """A pipeline's middle stage asks for no batch, yet its position moves with the others' (`step_done`);
    with grad_accum, each step consumes its micro-batches in order: the same samples and losses as one
    process."""
    kw = dict(model="gpt-tiny", steps=3, global_batch=8, grad_accum=2, seed=1, data="text")
    ref = dl.train("single", world_size=1, **kw)
    pipe = dl.train("pp-1f1b", world_size=3, **kw)
    assert all(r.info["data"]["samples"] == _samples(ref) for r in pipe.results)
    assert all(r.info["data"]["position"] == ref.results[0].info["data"]["position"] for r in pipe.results)
    assert pipe.losses == pytest.approx(ref.losses, rel=1e-5)


def test_a_text_checkpoint_resumes_only_the_same_order(tmp_path):
    """The position counts samples of one order: a checkpoint of the text resumed with synthetic data, or
    with another shuffle, is refused (say what differs), not silently read from the wrong place."""
    kw = dict(model="gpt-tiny", steps=2, global_batch=4, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    dl.train("single", world_size=1, data="text", **kw)
    with pytest.raises(dl.checkpoint.CheckpointError, match="data: saved"):
        dl.train("single", world_size=1, **{**kw, "steps": 3}, resume=True)
    with pytest.raises(dl.checkpoint.CheckpointError, match="'shuffle': True"):
        dl.train("single", world_size=1, data="text", shuffle=False, **{**kw, "steps": 3}, resume=True)
    r = dl.train("single", world_size=1, data="text", **{**kw, "steps": 3}, resume=True)
    assert r.results[0].info["data"]["resumed_position"] == (0, 8) and list(_samples(r)) == [2]


def test_each_data_parallel_rank_reads_only_its_rows():
    """A loader with ``part=(r, n)`` reads rank r's rows of each global batch (the ids stay global); in
    `dl.train` a data-parallel rank reads only its shard (7 samples a step over 3 ranks: 3, 2, 2), a
    tensor-parallel rank the whole batch, and the losses are those of one process reading everything."""
    corpus = TextCorpus(seq_len=8)
    s = DistributedSampler(len(corpus), seed=1)
    whole = next(Loader(corpus, s, 7))
    for r in range(3):
        part = next(Loader(corpus, s, 7, part=(r, 3), workers=1))
        assert torch.equal(part.ids, whole.ids) and torch.equal(part.x, dl.data.rows(whole.x, r, 3))
    kw = dict(model="gpt-tiny", steps=2, global_batch=7, seed=0, data="text")
    ref = dl.train("single", world_size=1, **kw)
    ddp = dl.train("ddp", world_size=3, **kw)
    assert [r.info["data"]["rows_read"] for r in ddp.results] == [6, 4, 4]
    assert all(r.info["data"]["samples"] == _samples(ref) for r in ddp.results)
    assert ddp.losses == pytest.approx(ref.losses, rel=1e-5)
    tp = dl.train("tp", world_size=2, **kw)
    assert [r.info["data"]["rows_read"] for r in tp.results] == [14, 14]


def test_text_data_with_a_model_given_by_its_shape():
    """`model=` a `dl.theory.ModelPreset` reads the corpus in sequences of its own seq_len (it was looked up
    among the named presets: KeyError); an untrained byte-level model starts near ln 256."""
    shape = dl.theory.ModelPreset("mine", hidden=64, layers=2, heads=4, vocab=256, seq_len=24)
    report = dl.train("ddp", world_size=2, model=shape, data="text", steps=2, seed=0)
    assert len(report.losses) == 2 and abs(report.losses[0] - math.log(256)) < 0.3
