"""A user's own model (issue 14 item 8): ``dl.tp.parallelize(model, plan={...})`` on a plain nn.Module
written here (an MLP, and a small transformer with a fused qkv and tied embeddings), and pipeline
stages cut by module names (``dl.pp.chain`` / ``cut`` / ``named_stage``), each equal to training the
same model in one process on the same global batch; shards really 1/t; clear errors for a plan
naming no module, a style that does not exist, a dimension tp does not divide."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import distlab as dl

V, S, D, HEADS, B = 32, 8, 16, 4, 8


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(S, D)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.head_dim = nn.Linear(D, 3 * D), nn.Linear(D, D), D // HEADS

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)          # heads read from the tensor
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc", nn.Linear(D, 4 * D))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("proj", nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, layers=2, tied=True):
        super().__init__()
        self.embed, self.blocks = Embed(), nn.ModuleList(Block() for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.tok.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class UserMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(12, 32), nn.Linear(32, 12), nn.Linear(12, 1)

    def forward(self, x):
        return self.out(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


LM_PLAN = {"embed.tok": "embedding", "blocks.*.attn.qkv": dl.tp.Colwise(packed=3),
           "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise",
           "head": "colwise_gather"}
MLP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}


def _data(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "lm":
        ids = torch.randint(0, V, (B, S + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]
    x = torch.randn(B, 12, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _loss(kind: str, out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten()) if kind == "lm" else F.mse_loss(out, y)


def _train(kind: str, plan=None, steps: int = 3):
    """Every rank (or one process): the model from seed 0, tensor-parallel by ``plan``, SGD on the
    whole batch; returns the losses, the full weights and this rank's shard shapes."""
    torch.manual_seed(0)
    model = TinyLM() if kind == "lm" else UserMLP()
    if plan is not None:
        model = dl.tp.parallelize(model, plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for step in range(steps):
        x, y = _data(kind, step)
        loss = _loss(kind, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = dl.tp.full_state_dict(model) if plan is not None else model.state_dict()   # tied: both names
    return losses, {k: v.detach().clone() for k, v in full.items()}, \
        {k: tuple(v.shape) for k, v in model.named_parameters()}


@pytest.mark.parametrize("kind, plan", [("lm", LM_PLAN), ("mlp", MLP_PLAN)])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_plan_on_a_user_model_matches_one_process(kind, plan, world):
    """Losses within 1e-5 relative and every weight within 1e-5 of its norm after 3 SGD steps; every
    planned matrix holds 1/t on each rank; the tied embedding and head stay one parameter."""
    ref_losses, ref_full, ref_shapes = _train(kind)
    run = dl.launch(_train, world_size=world, args=(kind, plan), output="quiet")
    for losses, full, shapes in run.results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert sorted(full) == sorted(ref_full)
        for name, want in ref_full.items():
            assert (full[name] - want).norm() <= 1e-5 * want.norm() + 1e-7, name
        for name, shape in shapes.items():
            n, whole = torch.Size(shape).numel(), torch.Size(ref_shapes[name]).numel()
            split = name.endswith(("tok.weight", "qkv.weight", "qkv.bias", "attn.proj.weight", "fc.weight",
                                   "fc.bias", "mlp.proj.weight", "fc1.weight", "fc1.bias", "fc2.weight"))
            assert n == (whole // world if split else whole), (name, shape)
    if kind == "lm":
        assert "head.weight" not in run.results[0][2]            # tied: one parameter, named once


def _plain_colwise_on_fused_qkv():
    """The trap a packed style avoids: plain 'colwise' on a fused qkv gives rank 0 all of q."""
    plan = {**LM_PLAN, "blocks.*.attn.qkv": "colwise"}
    return _train("lm", plan, steps=1)[0]


def test_plain_colwise_on_a_fused_qkv_is_wrong_and_packed_is_right():
    wrong = dl.launch(_plain_colwise_on_fused_qkv, world_size=2, output="quiet").results[0]
    assert wrong != pytest.approx(_train("lm", steps=1)[0], rel=1e-3)


def _divisibility_error():
    try:
        dl.tp.parallelize(UserMLP(), plan={"fc1": "colwise", "out": "colwise"})
    except ValueError as err:
        return str(err)


def test_plan_errors_say_what_to_change():
    with pytest.raises(ValueError, match="names no module.*closest.*blocks.0.mlp.fc"):
        dl.tp.parallelize(TinyLM(), plan={"blocks.*.mlp.fcc": "colwise"})
    with pytest.raises(ValueError, match="not a tensor-parallel style.*did you mean 'colwise'"):
        dl.tp.parallelize(TinyLM(), plan={"blocks.*.mlp.fc": "colwize"})
    with pytest.raises(TypeError, match="is a Sequential.*splits an Linear"):
        dl.tp.parallelize(TinyLM(), plan={"blocks.*.mlp": "colwise"})
    with pytest.raises(ValueError, match="'head.weight' is tied"):
        dl.tp.parallelize(TinyLM(), plan={"embed.tok": "embedding"})
    with pytest.raises(ValueError, match="split it differently"):
        dl.tp.parallelize(TinyLM(), plan={"embed.tok": "embedding", "head": "rowwise"})
    with pytest.raises(TypeError, match="plan="):
        dl.tp.parallelize(UserMLP())
    msg = dl.launch(_divisibility_error, world_size=2, output="quiet").results[0]
    assert "out: out_features=1 is not divisible by the tensor-parallel size 2" in msg


# -- pipeline stages by module names -----------------------------------------------------------------
def _pipeline(cuts: list[str], steps: int = 2):
    """This rank's stage of an untied TinyLM(3) cut before ``cuts``; 1F1B, 4 microbatches, SGD."""
    torch.manual_seed(0)
    model = TinyLM(layers=3, tied=False)
    stages = dl.pp.cut(dl.pp.chain(model), at=cuts)
    dl.pp.check_stages(model, stages)
    r = dl.rank()
    stage = dl.pp.named_stage(model, stages[r])
    pipe = dl.pp.Pipeline(stage, r, len(stages), schedule="1f1b", microbatches=4)
    opt = torch.optim.SGD(stage.parameters(), lr=0.2)
    losses = []
    for step in range(steps):
        x, y = _data("lm", step)
        loss = pipe.step(x if pipe.first else None, y if pipe.last else None)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    return losses, {k: v.detach().clone() for k, v in stage.named_parameters()}


def _single_pipeline_reference(steps: int = 2):
    torch.manual_seed(0)
    model = TinyLM(layers=3, tied=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for step in range(steps):
        x, y = _data("lm", step)
        loss = _loss("lm", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("cuts", [["blocks.1"], ["blocks.1", "norm"]])
def test_stages_by_module_names_match_one_process(cuts):
    """2 and 3 stages: the last stage's losses within 1e-5, every parameter (named as in the model)
    within 1e-5 of its norm; the stages hold disjoint parameters covering the model."""
    ref_losses, ref = _single_pipeline_reference()
    results = dl.launch(_pipeline, world_size=len(cuts) + 1, args=(cuts,), output="quiet").results
    assert results[-1][0] == pytest.approx(ref_losses, rel=1e-5)
    names = [set(params) for _, params in results]
    assert sum(map(len, names)) == len(set().union(*names)) == len(ref)
    for _, params in results:
        for name, value in params.items():
            assert (value - ref[name].detach()).norm() <= 1e-5 * ref[name].norm() + 1e-7, name


def test_chain_cut_and_stage_errors():
    model = TinyLM(layers=3, tied=False)
    assert dl.pp.chain(model) == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert dl.pp.cut(dl.pp.chain(model), at=["blocks.2"]) == [["embed", "blocks.0", "blocks.1"],
                                                             ["blocks.2", "norm", "head"]]
    stage = dl.pp.named_stage(model, ["blocks.2", "norm", "head"])
    assert "blocks.2.attn.qkv.weight" in dict(stage.named_parameters())
    with pytest.raises(ValueError, match="not in the chain"):
        dl.pp.cut(dl.pp.chain(model), at=["blocks.7"])
    with pytest.raises(ValueError, match="every stage needs at least one module"):
        dl.pp.cut(dl.pp.chain(model), at=["embed"])
    with pytest.raises(ValueError, match="no module 'blocks.9'"):
        dl.pp.named_stage(model, ["blocks.9"])
    with pytest.raises(ValueError, match="parameters on no stage"):
        dl.pp.check_stages(model, [["embed", "blocks.0"], ["blocks.1", "head"]])
    with pytest.raises(ValueError, match="stages 0 and 1"):
        dl.pp.check_stages(model, [["embed", "blocks.0", "blocks.1"],
                                   ["blocks.1", "blocks.2", "norm", "head"]])


def _gpt_by_plan_and_by_hand():
    """distlab's GPT split by `dl.tp.GPT_PLAN` and by `parallelize(gpt)`: the same loss and gradients as
    the full model; the plan's extra backward all-reduces (q, k, v each their own f) counted."""
    from distlab.models import GPT, GPTConfig, MarkovTokens
    cfg = GPTConfig(vocab=32, seq_len=8, d_model=16, heads=4, layers=2)
    ids, targets = MarkovTokens(cfg.vocab, cfg.seq_len).batch(0, 4)
    torch.manual_seed(0)
    full = GPT(cfg)
    full.loss(ids, targets).backward()
    out = {}
    for kind in ("plan", "hand"):
        torch.manual_seed(0)
        plan = dl.tp.GPT_PLAN if kind == "plan" else None
        model = dl.tp.parallelize(GPT(cfg), plan=plan)
        mark = len(dl.tracer().events())
        loss = model.loss(ids, targets)
        loss.backward()
        grads = dl.tp.full_grads(model)
        worst = max(((grads[n] - p.grad).norm() / p.grad.norm()).item()
                    for n, p in full.named_parameters() if not n.endswith("k.bias"))
        bsh = 4 * 8 * 16 * 4                                   # b s h fp32 bytes
        backward = [e for e in dl.tracer().events()[mark:] if e.kind == "comm" and e.name == "all_reduce"
                    and e.args.get("phase") == "backward" and e.args.get("size") == bsh]
        out[kind] = (abs(loss.item() - full.loss(ids, targets).item()), worst, len(backward))
    return out


def test_gpt_as_a_plan_equals_the_full_model():
    for res in dl.launch(_gpt_by_plan_and_by_hand, world_size=2, output="quiet").results:
        for kind in ("plan", "hand"):
            assert res[kind][0] < 1e-5 and res[kind][1] < 1e-5, (kind, res)
        # backward b s h all-reduces: per layer the plan's f for q, k, v and fc (4), by hand one shared f and
        # fc's (2); plus the head's f once in both
        assert (res["plan"][2], res["hand"][2]) == (4 * 2 + 1, 2 * 2 + 1), res
