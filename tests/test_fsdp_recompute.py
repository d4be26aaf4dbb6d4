"""Activation recomputation, and forwards without grad, under `dl.fully_shard` and `dl.ZeRO(stage=3)`.

``torch.utils.checkpoint`` re-runs a module's forward inside backward. Around a sharded unit
(``checkpoint(block, x)``, reentrant or not, with or without early stop) the unit's own hooks run again
there; inside one (``fully_shard(checkpoint_wrapper(block))``, torchtitan's order, and Hugging Face's
``gradient_checkpointing_enable()``) only its modules do. A forward under ``torch.no_grad()`` between a
forward and its backward (a metric on another batch) must leave what that backward saved alone. Each
setup trains AdamW for 4 steps equal to one process on the same global batch and to torch's own
``fully_shard`` (FSDP2, which runs on gloo and CPU), and leaves nothing gathered or in flight after
backward (a prefetch issued in a recomputation used to survive into the next step's forward, which then
computed with the pre-step weights).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import distlab as dl
from distlab.parallel.zero import fsdp

D, HIDDEN, B, STEPS = 10, 14, 12, 4     # 10 and 14 rows: uneven over 3 ranks
SETUPS = ("checkpoint", "reentrant", "no_early_stop", "checkpoint_wrapper", "no_grad")
# (wrapper, setup) run at each world size; keep: reshard_after_forward=False; torch's FSDP2 at 2 ranks
RUNS = {2: [(w, s) for w in ("fully_shard", "zero3", "torch") for s in SETUPS]
        + [("fully_shard_keep", s) for s in ("checkpoint", "reentrant", "no_grad")],
        3: [(w, s) for w in ("fully_shard", "zero3") for s in SETUPS]}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """Three blocks (the units) between an input layer and a head (the root's)."""

    def __init__(self, setup: str):
        super().__init__()
        self.setup = setup
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        if setup == "checkpoint_wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            self.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in self.blocks)

    def forward(self, x):                       # x: (b, D) -> (b, 1)
        x = self.inp(x)
        for block in self.blocks:
            if self.setup in ("checkpoint", "reentrant"):
                x = checkpoint(block, x, use_reentrant=self.setup == "reentrant")
            elif self.setup == "no_early_stop":             # the unit's post-forward hook runs again too
                with set_checkpoint_early_stop(False):
                    x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.out(x)


def _net(setup: str) -> Net:
    torch.manual_seed(0)
    return Net(setup)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, D, generator=g), torch.randn(B, 1, generator=g)


def _wrap(net: Net, wrapper: str):
    """(the model to call, its optimizer, a function returning the full state, what is left gathered)."""
    if wrapper == "zero3":
        model = dl.ZeRO(net, stage=3, optim=torch.optim.AdamW, lr=0.01, prefetch=True)
        left = lambda: sorted(model._live) + sorted(model._gathers)        # noqa: E731
        return model, model.optimizer, model.full_state_dict, left
    if wrapper == "torch":
        from torch.distributed.fsdp import fully_shard
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        return (net, torch.optim.AdamW(net.parameters(), lr=0.01),
                lambda: {k: v.full_tensor() for k, v in net.state_dict().items()}, lambda: [])
    keep = dict(reshard_after_forward=wrapper != "fully_shard_keep")
    for block in net.blocks:
        dl.fully_shard(block, **keep)
    dl.fully_shard(net, **keep)
    units = fsdp.units(net)
    return (net, torch.optim.AdamW(net.parameters(), lr=0.01), lambda: dl.full_state_dict(net),
            lambda: [(k, len(u.gathered()), u._pending is not None) for k, u in enumerate(units)
                     if u.gathered()])


def _train(wrapper: str, setup: str) -> dict:
    n, r = dl.world_size(), dl.rank()
    model, opt, state, leftovers = _wrap(_net(setup), wrapper)
    losses, left = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        rows = torch.tensor_split(torch.arange(B), n)[r]
        loss = F.mse_loss(model(x[rows]), y[rows]) * len(rows) * n / B     # mean over ranks: the global mean
        if setup == "no_grad":                                             # a metric on another batch
            with torch.no_grad():
                model(_batch(100 + step)[0][: 5 - r])
        loss.backward()
        left.append(leftovers())
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / n)
    return {"losses": losses, "state": state(), "left": left}


def _rank(runs: list) -> dict:
    return {run: _train(*run) for run in runs}


def _reference(setup: str) -> dict:
    model = _net(setup)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def _rel(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max(((got[k] - v).norm() / v.norm()).item() for k, v in want.items())


@pytest.mark.parametrize("world", [2, 3])
def test_recomputation_and_no_grad_forwards_train_like_one_process_and_torch_fsdp2(world):
    run, wrong = dl.launch(_rank, world_size=world, args=(RUNS[world],), output="quiet"), []
    want = {setup: _reference(setup) for setup in SETUPS}
    for wrapper, setup in RUNS[world]:
        got = run.results[0][(wrapper, setup)]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want[setup]["losses"]))
        param_err = _rel(got["state"], want[setup]["state"])
        torch_fsdp2 = run.results[0].get(("torch", setup), got)["state"]
        if max(loss_err, param_err, _rel(got["state"], torch_fsdp2)) > 1e-5:
            wrong.append(f"{wrapper} {setup}: loss {loss_err:.1e}, params {param_err:.1e}, "
                         f"vs torch {_rel(got['state'], torch_fsdp2):.1e}")
        for r in range(world):                       # nothing gathered or in flight once backward returns
            if any(run.results[r][(wrapper, setup)]["left"]):
                wrong.append(f"{wrapper} {setup} rank {r}: left after backward "
                             f"{run.results[r][(wrapper, setup)]['left']}")
    assert not wrong, "\n".join(wrong)


# -- Hugging Face: gradient_checkpointing_enable() on a tiny random Llama, nothing downloaded ----------------
SEQ, HF_STEPS = 8, 3


def _llama(reentrant: bool | None):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         max_position_embeddings=SEQ))
    with warnings.catch_warnings():             # (newer transformers: a deprecated alias of
        warnings.simplefilter("ignore")          # activation_checkpointing_enable)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(step))


def _hf_train(reentrant: bool, torch_fsdp: bool) -> dict:
    model, n, r = _llama(reentrant), dl.world_size(), dl.rank()
    shard = dl.fully_shard
    if torch_fsdp:
        from torch.distributed.fsdp import fully_shard as shard
    for layer in model.model.layers:              # each decoder layer, then the root
        shard(layer)
    shard(model)
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for step in range(HF_STEPS):
        ids = _ids(step)[r::n]                     # equal rows per rank: the mean of means is the mean
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / n)
    state = ({k: v.full_tensor() for k, v in model.state_dict().items()} if torch_fsdp
             else dl.full_state_dict(model))
    return {"losses": losses, "state": state}


def _hf_rank() -> dict:
    return {(re, t): _hf_train(re, t) for re in (False, True) for t in (False, True)}


def _hf_reference(reentrant: bool) -> dict:
    model = _llama(reentrant)
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    for step in range(HF_STEPS):
        ids = _ids(step)
        loss = sum(model(input_ids=ids[r::2], labels=ids[r::2]).loss for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def test_hugging_face_gradient_checkpointing_under_fully_shard():
    pytest.importorskip("transformers")
    run = dl.launch(_hf_rank, world_size=2, output="quiet")
    for reentrant in (False, True):
        want = _hf_reference(reentrant)
        mine, theirs = run.results[0][(reentrant, False)], run.results[0][(reentrant, True)]
        assert mine["losses"] == pytest.approx(want["losses"], rel=1e-5), reentrant
        assert _rel(mine["state"], want["state"]) <= 1e-5, reentrant
        assert _rel(mine["state"], theirs["state"]) <= 1e-5, reentrant
