"""`dl.fully_shard` (FSDP2, HSDP): equal to single-process training on the same global batch, and its
invariants (shards 1/N, gathered parameters freed after each unit, replicated gradients equal).

One launch per world size runs every configuration of that size; the references run here."""
from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distlab as dl
from distlab.cli import main
from distlab.models import shard
from distlab.parallel.zero import fsdp

VOCAB, D, B, T, STEPS = 11, 6, 10, 4, 3      # 11, 7, 5 rows: never divisible by 2, 3 or 4; B uneven at 3, 4


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """Tied embedding and head, a frozen layer, a scalar gain (kept whole), two blocks (the units)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.blocks = nn.ModuleList([Block(7), Block(5)])
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, ids):                     # ids: (b, T) -> logits (b, T, VOCAB)
        x = self.frozen(self.emb(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.gain


class Momentum(torch.optim.Optimizer):
    """A user's own optimizer (heavy ball), built on the shards like any other."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    m = self.state[p].setdefault("m", torch.zeros_like(p))
                    p.add_(m.mul_(0.9).add_(p.grad), alpha=-group["lr"])


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.2),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
              "mine": lambda ps: Momentum(ps, lr=0.1)}


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, VOCAB, (B, T), generator=g)


def _loss(model, ids, targets, n: int) -> torch.Tensor:
    """This rank's share of the global mean loss (n rows_r / B: averaging over n ranks gives the mean)."""
    return F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten()) * n * ids.shape[0] / B


def _shard_model(cfg: dict) -> Net:
    model, kw = _net(), cfg.get("fsdp", {})
    for block in model.blocks:
        rep = [block.norm.weight, block.norm.bias] if cfg.get("replicate") else None
        dl.fully_shard(block, replicate=rep, **kw)
    return dl.fully_shard(model, **kw)


def _train(cfg: dict) -> dict:
    """On every rank: shard, build the optimizer after, train STEPS steps (``accum`` micro-steps each, all
    but the last under no_sync); returns the full state and what the invariants need."""
    n, r = dl.world_size(), dl.rank()
    model = _shard_model(cfg)
    opt = OPTIMIZERS[cfg.get("opt", "sgd")](model.parameters())
    accum, out = cfg.get("accum", 1), {"replicated_grads": []}
    up = model.blocks[0].up                     # what the block computes with, seen from outside
    up.register_forward_hook(lambda m, a, o: None if "dtypes" in out else out.update(dtypes=[m.weight.dtype,
                                                                                             o.dtype]))
    for step in range(STEPS):
        ids, targets = _batch(step)
        ids, targets = shard(ids, r, n), shard(targets, r, n)
        for micro, rows in enumerate(torch.tensor_split(torch.arange(ids.shape[0]), accum)):
            quiet = fsdp.no_sync(model) if micro < accum - 1 else contextlib.nullcontext()
            if cfg.get("switch"):                   # FSDP2's switch instead of the context
                fsdp.set_requires_gradient_sync(model, micro == accum - 1)
                quiet = contextlib.nullcontext()
            with quiet:
                _loss(model, ids[rows], targets[rows], n).backward()      # weighted by its rows: sums right
        if step == 0:
            out["dtypes"] += [up.weight.grad.dtype, model.blocks[0].norm.weight.grad.dtype]
        out["replicated_grads"].append([model.blocks[0].norm.weight.grad.clone(), model.gain.grad.clone()])
        opt.step()
        opt.zero_grad()
    out["state"] = dl.full_state_dict(model)
    return out


def _probe(cfg: dict) -> dict:
    """Shard sizes by name (storage bytes), and which units hold gathered parameters at each block's end."""
    model = _shard_model(cfg)
    shards = {k: (p.untyped_storage().nbytes(), p.numel() * p.element_size())
              for k, p in model.named_parameters()}
    units = [model.blocks[0]._fsdp, model.blocks[1]._fsdp, model._fsdp]
    assert sorted(map(id, fsdp.units(model))) == sorted(map(id, units))
    seen, used = [], []
    for block in model.blocks:                 # registered after fully_shard's hooks: runs after the free
        block.up.register_forward_pre_hook(lambda m, a: used.append(m.weight))   # the gathered tensor
        block.register_forward_hook(lambda m, a, o: seen.append([len(u.gathered()) for u in units]
                                                                + [used[-1].untyped_storage().nbytes()]))
    ids, targets = _batch(0)
    for _ in range(2):                         # the second step knows the order: prefetches
        loss = _loss(model, ids, targets, 1)
        after_forward = [len(u.gathered()) for u in units]
        loss.backward()
    after_backward = [len(u.gathered()) for u in units] + [len(model._fsdp.coordinator.reducer.in_flight())]
    return {"shards": shards, "seen": seen, "after_forward": after_forward, "after_backward": after_backward,
            "full_shape": tuple(used[0].shape)}


def _bad_inputs() -> list[str]:
    """Each bad input raises ValueError on every rank before any collective (so nothing hangs, nothing
    reads freed memory)."""
    errors = []
    cases = [lambda: dl.fully_shard(dl.fully_shard(_net())),                     # sharded twice
             lambda: dl.fully_shard(_net(), mesh=(3, 1)),                         # 3 x 1 != 2 ranks
             lambda: dl.fully_shard(_net(), replicate=[nn.Parameter(torch.ones(2))]),   # not in the module
             _optimizer_first,
             lambda: dl.fully_shard(dl.fully_shard(_net()).blocks[0]),           # top-down: already sharded
             lambda: dl.fully_shard(_torch_sharded()),                            # torch's FSDP2 (DTensors)
             lambda: dl.fully_shard(dl.ZeRO(_net(), stage=3).module),             # ZeRO-3: storage freed
             lambda: dl.fully_shard(_net(), mesh=(1, 2), group=dist.group.WORLD)]  # both
    for case in cases:
        try:
            case()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def _torch_sharded() -> nn.Module:
    from torch.distributed.fsdp import fully_shard            # (it refuses Net's scalar gain)
    return fully_shard(nn.Sequential(nn.Linear(D, 5)))


def _optimizer_first():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)       # built before sharding: would update nothing
    dl.fully_shard(model)
    opt.step()                                               # refused at its first step
    return opt


def _rank(configs: list[dict], bad: bool) -> dict:
    out = {"runs": [_train(c) for c in configs], "probe": _probe({})}
    if bad:
        out["bad"] = _bad_inputs()
    return out


# -- the single-process reference ---------------------------------------------------------------------
def _reference(cfg: dict) -> dict:
    """The same steps on one process over the whole global batch; with ``param_dtype`` it casts the same
    way: compute on a copy in that dtype, gradients back to the fp32 master parameters."""
    model = _net()
    opt = OPTIMIZERS[cfg.get("opt", "sgd")](model.parameters())
    dtype = cfg.get("fsdp", {}).get("param_dtype")
    for step in range(STEPS):
        ids, targets = _batch(step)
        work = model if dtype is None else copy.deepcopy(model).to(dtype)
        _loss(work, ids, targets, 1).backward()
        if dtype is not None:
            for p, w in zip(model.parameters(), work.parameters()):
                p.grad = None if w.grad is None else w.grad.float()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _max_rel_err(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max(((got[k] - v).norm() / v.norm()).item() for k, v in want.items())


RUNS = {
    2: [dict(), dict(opt="adamw"), dict(opt="mine"), dict(opt="sgd", fsdp=dict(reshard_after_forward=False),
                                                          accum=2),
        dict(fsdp=dict(param_dtype=torch.bfloat16)), dict(fsdp=dict(param_dtype=torch.float16))],
    3: [dict(replicate=True, accum=2), dict(opt="adamw"), dict(opt="mine", accum=3, switch=True)],
    4: [dict(), dict(fsdp=dict(mesh=(2, 2))), dict(opt="adamw", fsdp=dict(mesh=(2, 2)), replicate=True)],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fully_shard_equals_single_and_keeps_its_invariants(world):
    run = dl.launch(_rank, world_size=world, args=(RUNS[world], world == 2), output="quiet")
    for i, cfg in enumerate(RUNS[world]):
        want = _reference(cfg)
        for r in range(world):                                  # every rank gathers the same full state
            got = run.results[r]["runs"][i]["state"]
            tol = 1e-6 if "param_dtype" not in cfg.get("fsdp", {}) else 1e-2
            assert _max_rel_err(got, want) <= tol, (cfg, r, _max_rel_err(got, want))
        dtype = cfg.get("fsdp", {}).get("param_dtype", torch.float32)   # computed in it, fp32 .grad
        assert run.results[0]["runs"][i]["dtypes"] == [dtype, dtype, torch.float32, torch.float32], cfg
        if cfg.get("replicate"):                                # replicated gradients equal on every rank
            for r in range(1, world):
                for mine, first in zip(run.results[r]["runs"][i]["replicated_grads"],
                                       run.results[0]["runs"][i]["replicated_grads"]):
                    assert all(torch.equal(a, b) for a, b in zip(mine, first))
        assert torch.equal(run.results[0]["runs"][i]["state"]["frozen.weight"], _net().frozen.weight)
    _check_probe([run.results[r]["probe"] for r in range(world)], world)
    if world == 4:                             # HSDP: gathers and reduce-scatters inside a replica (a row
        ops = {(e.name, e.args.get("group")) for e in run.trace.comms(rank=3)}   # of 2), all-reduce across
        assert {("all_gather", "shard"), ("reduce_scatter", "shard"), ("all_reduce", "replicate")} <= ops, ops
    if world == 2:
        _check_bad(run.results[0]["bad"])


def _check_probe(probes: list[dict], n: int) -> None:
    full = {k: v for k, v in _net().named_parameters()}
    for name, p in full.items():
        held = [probe["shards"][name] for probe in probes]
        assert all(storage == used for storage, used in held)          # no hidden padding, no full copy
        if p.dim() == 0:
            assert all(used == 4 for _, used in held)                   # a scalar stays whole
            continue
        assert sum(used for _, used in held) == 4 * p.numel(), name    # the shards tile the parameter
        assert max(used for _, used in held) == 4 * math.ceil(p.shape[0] / n) * p[0].numel()   # 1/N each
    for probe in probes:
        # at the end of block i's forward its own parameters are freed (the tensor it computed with too);
        # the root is gathered throughout
        # held: gathered parameters of (block 0, block 1, root), and the bytes left of the block's weight
        for k, held in enumerate(probe["seen"]):
            i = k % 2                                                  # block i, step k // 2
            assert held[i] == 0 and held[3] == 0 and held[2] > 0, probe["seen"]
        assert probe["seen"][2][1] > 0                                 # step 2: block 1 prefetched
        assert probe["full_shape"] == (7, D)                           # what the block computed with: whole
        assert probe["after_forward"] == [0, 0, 0]                     # reshard_after_forward
        assert probe["after_backward"] == [0, 0, 0, 0]                 # freed, reduce-scatters retired


def _check_bad(errors: list[str]) -> None:
    assert "already fully_shard-ed" in errors[0], errors[0]
    assert "mesh=(3, 1)" in errors[1] and "world size 2" in errors[1], errors[1]
    assert "replicate=" in errors[2] and "not parameters of this" in errors[2], errors[2]
    assert "build it *after* fully_shard" in errors[3], errors[3]
    assert "outer fully_shard" in errors[4] and "bottom-up" in errors[4], errors[4]
    assert "DTensor" in errors[5], errors[5]
    assert "dl.ZeRO(stage=3) already shards" in errors[6], errors[6]
    assert "not both" in errors[7], errors[7]


def test_train_fsdp_hsdp_checks_before_launch_and_matches_single(capsys):
    with pytest.raises(ValueError, match="hsdp=2"):
        dl.train("fsdp", world_size=3, steps=1, hsdp=2)
    argv = ["train", "--strategy", "fsdp", "--world-size", "2", "--model", "mlp", "--steps", "1",
            "--hsdp", "2", "--param-dtype", "bf16", "--no-reshard-after-forward"]
    assert main(argv) == 0 and "fsdp on 2 rank(s)" in capsys.readouterr().out
    kw = dict(model="mlp", steps=2, optimizer="sgd", lr=0.1, global_batch=8)
    ref = dl.train("single", **kw)
    report = dl.train("fsdp", world_size=4, hsdp=2, **kw)
    assert report.losses == pytest.approx(ref.losses, rel=1e-6)
    assert _max_rel_err(report.params, ref.params) <= 1e-6
    for r, result in enumerate(report.results):                 # the ledger measures the shards: 1/S each
        assert report.memory[r]["peak"]["params"] == result.info["param_bytes"] > 0
        assert report.memory[r]["peak"]["buffers"] > 0          # gathered units, gradients in flight


def test_fsdp_checkpoint_resumes_exactly_and_reshards_to_and_from_other_strategies(tmp_path):
    """Save at steps 2 and 4 under fsdp on 3 ranks; resumed from 2 the run is bit-identical. Resharding:
    the fsdp checkpoint resumed by ddp on 2 ranks, and a zero3 one by HSDP (2 x 2), both continue like
    the uninterrupted single-process run."""
    kw = dict(model="mlp", steps=5, global_batch=12)
    full = dl.train("fsdp", world_size=3, **kw, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2)
    resumed = dl.train("fsdp", world_size=3, **kw, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2,
                       resume=2)
    assert resumed.results[0].info["checkpoint"]["resumed_from"] == 2
    assert resumed.losses == full.losses
    assert all(torch.equal(v, resumed.params[k]) for k, v in full.params.items())
    reference = dl.train("single", **kw)
    dl.train("zero3", world_size=2, **kw, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=2)
    for directory, strategy, world, more in [("a", "ddp", 2, {}), ("b", "fsdp", 4, {"hsdp": 2})]:
        report = dl.train(strategy, world_size=world, **kw, **more, checkpoint_dir=str(tmp_path / directory),
                          resume=2)
        assert report.results[0].info["checkpoint"]["resumed_from"] == 2
        assert report.losses == pytest.approx(reference.losses, rel=1e-5)
        assert _max_rel_err(report.params, reference.params) < 1e-5
