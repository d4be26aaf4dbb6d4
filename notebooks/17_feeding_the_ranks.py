# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 17 · Feeding the ranks
#
# Every lesson so far trained on data computed inside each rank, a pure function of (seed, step). Real runs read
# it: from a corpus, through a sampler that gives each rank its part, a loader that reads ahead, and storage
# that can be slow. Two things go wrong there at scale, and this lesson causes both and fixes them:
#
# - **Starved ranks.** When a batch takes longer to read than a step takes to compute, the GPUs wait for data.
#   The timeline shows it; the idle fraction is predictable; worker threads that read ahead remove it.
# - **A resume that reads the wrong data.** A run killed at step k and resumed must consume exactly the samples
#   the uninterrupted run would have: not the start of the epoch again, and not a per-rank position that means
#   nothing once the data-parallel size has changed (a real bug class: a loader's state silently dropped when
#   the dp size shrank on resume).
#
# | § | what is predicted | what is measured and asserted |
# |---|---|---|
# | 1 | each rank's samples are torch's `DistributedSampler`'s; the stream of global batches does not depend on N | the ids |
# | 2 | slow storage: the ranks idle L / (L + t) of the time; with w workers, max(0, L/w - t) / (L/w) | "data wait" spans |
# | 3 | killed at step 5, resumed on 3 ranks and on 2: the uninterrupted run's samples, step by step | the sample ids |
# | 4 | a GPT trained on the shipped corpus: the loss falls from ln 256 | the loss; text before and after |
#
# **The code, in reading order**: [sampler.py](../distlab/data/sampler.py) (the global order, a rank's shard,
# the position), [loader.py](../distlab/data/loader.py) (workers, read-ahead, slow storage),
# [text.py](../distlab/data/text.py) (the corpus, byte-tokenised); how `dl.train(..., data="text")` uses them,
# with the position in every checkpoint: [feed.py](../distlab/strategies/feed.py). Notation:
# [docs/notation.md](../docs/notation.md).

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it with the first optimizer: here, once, not in each rank)
from torch.utils.data import DistributedSampler as TorchSampler

import distlab as dl
from distlab.data import DistributedSampler, Position, TextCorpus, rows
from distlab.strategies import feed as feeds

TMP = Path(tempfile.mkdtemp(prefix="distlab_17_"))

# %% [markdown]
# ## 1 · Who reads what
#
# An epoch's order is a permutation of the sample ids, seeded by seed + epoch (so every rank computes the same
# one without talking). torch's `DistributedSampler` gives rank r of N the ids `order[r::N]`, padding the order to
# a multiple of N. distlab's sampler gives the same shards, and adds what torch's lacks: a **position**, counted
# in *global samples consumed*. A global batch is the next B ids of the stream, and each rank takes its rows of
# it, so the stream, and the position, are the same whatever N is. From storage, a data-parallel rank of
# `dl.train(..., data="text")` reads only its rows (`Loader(part=(r, N))`): every rank knows the ids of the
# whole batch, none reads another's samples.

# %%
corpus = TextCorpus(seq_len=32)
sampler = DistributedSampler(len(corpus), seed=0)
print(f"the corpus: {len(corpus.tokens):,} bytes -> {len(corpus)} samples of 32 bytes")
print("epoch 0 order:", sampler.epoch_order(0)[:12].tolist(), "...")
for n in (2, 3):
    for r in range(n):
        ours = sampler.shard(0, r, n)
        theirs = TorchSampler(range(len(corpus)), num_replicas=n, rank=r, seed=0)
        theirs.set_epoch(0)
        assert ours == list(theirs)
    print(f"N = {n}: rank 0's shard starts {sampler.shard(0, 0, n)[:6]}: equal to torch's on every rank")

batch, after = sampler.batch_at(Position(), 6)
print(f"\nglobal batch 0: ids {batch.tolist()}; the position after it: {after}")
for n in (3, 2):
    print(f"  on {n} ranks:", " | ".join(f"rank {r}: {rows(batch, r, n).tolist()}" for r in range(n)))
assert torch.equal(torch.cat([rows(batch, r, 3) for r in range(3)]), batch)

# %% [markdown]
# ## 2 · Starved ranks, and the fix
#
# `data_latency=L` makes each batch's read take L seconds more (slow storage: a network file system, an object
# store). Without workers, every step first reads its batch, then computes for t seconds:
#
#     workers=0   |read L|step t|read L|step t|...      idle: L / (L + t)
#     workers=w   |step t|step t|step t|...             w reads in flight: a batch every L / w seconds;
#                  |read L   ||read L   |               idle: max(0, L/w - t) / (L/w)
#
# Three runs of 2-rank DDP on the corpus with L = 100 ms: no workers; one worker (it cannot keep up: L > t);
# eight workers (L/8 < t: nothing left to wait for). Measured on each rank's timeline from step 1 on (the very
# first batch always waits: nothing was read ahead yet, as with torch's `DataLoader`): the share of time in
# "data wait" spans, and the compute t between them, which the prediction uses.

# %%
L = 0.1
KW = dict(world_size=2, model="gpt-tiny", steps=8, global_batch=8, data="text", data_latency=L)


def steady(trace, rank):
    """(idle fraction, compute seconds a step) on ``rank`` from step 1's data wait to the last span."""
    spans = trace.spans(rank=rank)
    waits = [s for s in spans if s.name == "data wait" and s.args["step"] >= 1]
    begin, end = min(s.start for s in waits), max(s.end for s in spans)
    waited = sum(s.duration for s in waits)
    return waited / (end - begin), (end - begin - waited) / len(waits)


starved = {w: dl.train("ddp", **KW, workers=w, read_ahead=2) for w in (0, 1, 8)}

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(2, 1, figsize=(10, 3.6))
for ax, w in zip(axes, (0, 8)):
    dl.viz.timeline(starved[w].run.trace, ax=ax, title=f"workers={w}: 'data wait' spans (L = {L * 1e3:.0f} ms)")
fig.tight_layout()

# %% tags=["nbval-ignore-output"]
for w, r in starved.items():
    for rank in (0, 1):
        idle, t = steady(r.run.trace, rank)
        predicted = feeds.predicted_idle_fraction(L, t, workers=w)
        print(f"workers={w} rank {rank}: step compute t = {t * 1e3:5.1f} ms, idle {idle:5.1%}, predicted "
              f"{predicted:5.1%}")
        assert abs(idle - predicted) < 0.1 + 0.2 * predicted, (w, rank, idle, predicted)
        assert idle > 0.3 if w == 0 else idle < 0.15 if w == 8 else True     # starved; fed

# %%
print("asserted: every run's measured idle fraction within 0.1 + 20% of the prediction; eight workers hide it")

# %% [markdown]
# ## 3 · Killed at step 5, resumed exactly: on the same and on a smaller data-parallel size
#
# 3-rank DDP, a checkpoint every 2 steps; a rank dies at step 5, and the run restarts from the checkpoint of
# step 4, once on 3 ranks and once, with `shrink=True`, on 2 (the failed node gone). The checkpoint holds the
# loader's position, (epoch, samples consumed), the same on every rank. Prediction: steps 4 and 5 of both
# resumed runs consume exactly the sample ids of the uninterrupted run's steps 4 and 5.
#
# What a per-rank position would have done instead: torch's `DistributedSampler` restarted on the new world reads
# its epoch from the start (steps 4 and 5 would repeat steps 0 and 1's samples); carried over per rank, "rank r
# has read k of its shard" points into a shard that no longer exists once N changed.

# %% tags=["nbval-ignore-output"]
RESUME = dict(model="gpt-tiny", steps=6, global_batch=6, seed=0, data="text")


def samples(report):
    return report.results[0].info["data"]["samples"]


whole = dl.train("ddp", world_size=3, **RESUME)
resumed = {}
for name, extra in (("3 ranks", {}), ("shrunk to 2", {"shrink": True})):
    resumed[name] = dl.train("ddp", world_size=3, **RESUME, checkpoint_dir=str(TMP / name), checkpoint_every=2,
                             fail_at_step=5, max_restarts=1, **extra)

# %%
print(f"{'step':>4}  {'uninterrupted (3 ranks)':34} {'resumed on 3 ranks':34} resumed on 2 ranks (shrink)")
for step in range(6):
    cells = [samples(whole)[step]] + [samples(r).get(step, "(before the checkpoint)") for r in resumed.values()]
    print(f"{step:4}  " + " ".join(f"{str(c):34}" for c in cells))
for name, r in resumed.items():
    [restart] = r.restarts
    print(f"{name}: resumed from step {restart.resumed_from} on {r.world_size} ranks at position "
          f"{r.results[0].info['data']['resumed_position']}")
    assert restart.resumed_from == 4 and samples(r) == {s: samples(whole)[s] for s in (4, 5)}
    assert r.results[0].info["data"]["resumed_position"] == (0, 4 * 6)
assert resumed["shrunk to 2"].world_size == 2
read = [r.info["data"]["rows_read"] for r in whole.results]
print(f"samples each rank of the uninterrupted run read from storage in 6 steps: {read} (its 2 rows of each 6)")
assert read == [12, 12, 12]

restarted = sorted(i for r in range(2) for i in sampler.shard(0, r, 2)[:3])    # its first 3 ids on each rank
print(f"\ntorch's sampler restarted on 2 ranks: step 4 reads {restarted}, step 0's samples again")
assert restarted == sorted(samples(whole)[0])

# %% [markdown]
# ## 4 · It learns the corpus
#
# The corpus is about 4 KB of public-domain prose (Dickens, Lincoln, Melville, Austen) that ships with distlab;
# tokens are its bytes (vocabulary 256). Before training, each of the 256 bytes is as likely as any other: the
# loss starts at ln 256 ≈ 5.55. Sixty steps of 2-rank DDP on the tiny GPT learn the bytes' frequencies and the
# first patterns of English (spaces, common letters); greedy text from the prompt, before and after.

# %%
text = dl.train("ddp", world_size=2, model="gpt-tiny", steps=60, global_batch=16, lr=1e-2, data="text")
before, after = dl.data.before_and_after(text, "It was the ", 40)
print("loss:", " ".join(f"{x:.2f}" for x in text.losses[::10]), f"... {text.losses[-1]:.2f}")
def shown(s):
    return "".join(c if c.isprintable() else "·" for c in s)     # untrained bytes are rarely printable


print("before:", shown(before))
print("after: ", shown(after))
assert abs(text.losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.1
assert max(text.losses[-5:]) < text.losses[0] - 2.0 and before != after
