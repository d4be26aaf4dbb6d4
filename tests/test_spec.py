"""The typed spec (issue 20, item 3): one dataclass per concern, a docstring and a rule per field; a strategy
name, a mesh string, `dl.train`'s keywords and the ``distlab train`` command all parse into the same spec;
it pickles to the ranks; and THE composition function, `strategies.compose.parallelize`, lays out a user's
own model (TP -> CP -> PP -> DP) so that it trains exactly as one process does."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import distlab as dl
from distlab.strategies import Layout, TrainSpec, names, options, parse, validate
from distlab.strategies.parse import ALIASES, TOP, keywords_of
from distlab.strategies.spec import CONCERNS, WHERE


# -- one spec, however it is written -------------------------------------------------------------
def test_every_field_has_a_docstring_and_a_rule_and_every_keyword_a_field():
    for cls in (TrainSpec, *CONCERNS.values()):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name}: no docstring"
            assert f.name in CONCERNS or f.metadata.get("rule"), f"{cls.__name__}.{f.name}: no rule"
    for name in names():
        assert set(options(name)) <= set(WHERE) | set(ALIASES), name
    assert not set(TOP) & set(WHERE)                   # a keyword names one field of one concern


@pytest.mark.parametrize("name, layout", [
    ("single", Layout()),
    ("ddp", Layout(dp=None)),
    ("zero2", Layout(dp=None, zero=2)),
    ("tp-sp", Layout(tp=None, sequence_parallel=True)),
    ("pp-interleaved", Layout(pp=None, schedule="interleaved")),
    ("cp-ulysses", Layout(cp=None, attention="ulysses")),
    ("3d:dp=2,tp=2,pp=2,schedule=gpipe", Layout(dp=2, tp=2, pp=2, schedule="gpipe")),
    ("3d:dp=2,cp=2,attention=ulysses,zigzag=1", Layout(dp=2, cp=2, attention="ulysses", zigzag=True)),
])
def test_a_name_is_a_preset_of_the_layout(name, layout):
    assert parse(name).layout == layout


def test_the_name_and_keywords_are_one_layout():
    written = parse("3d:dp=2,tp=2,pp=2,sp=1,schedule=gpipe,microbatches=4,bucket_mb=0.5")
    said = parse("3d:dp=2", tp=2, pp=2, sp=True, schedule="gpipe", microbatches=4, bucket_mb=0.5)
    assert dataclasses.replace(written, strategy="x") == dataclasses.replace(said, strategy="x")
    assert parse("3d:dp=2,tp=2", tp=1).layout.tp == 1               # keywords win over the name
    assert parse("cp-ring", dp=2, tp=2).layout == Layout(dp=2, tp=2, cp=None)
    assert Layout(dp=None, tp=2).degrees(8) == {"dp": 4, "pp": 1, "cp": 1, "ep": 1, "tp": 2}


@pytest.mark.parametrize("strategy, kw", [
    ("zero3", dict(steps=3, prefetch=True, bucket_mb=1.0, checkpoint_dir="ck", checkpoint_every=2)),
    ("3d:dp=2,tp=2", dict(pp=2, sp=True, clip=0.5, recompute="selective", max_restarts=1)),
    ("ddp", dict(precision="fp16-mixed", loss_scale=1024.0, compression="powersgd", powersgd_rank=2)),
    ("ep", dict(model="gpt-moe-tiny", dp=2, experts="replicated", memory_limit="64MB")),
])
def test_a_spec_is_its_keywords(strategy, kw):
    """``keywords_of(spec)`` gives back what was asked beside the name; parsed again, the same spec."""
    spec = parse(strategy, **kw)
    assert parse(strategy, **keywords_of(spec)) == spec
    assert keywords_of(spec) == {ALIASES.get(k, k): v for k, v in kw.items()}
    assert pickle.loads(pickle.dumps(spec)) == spec                # it travels to every rank
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.layout.dp = 3


def test_the_command_and_the_keywords_are_one_spec(monkeypatch):
    """``distlab train`` flags and `dl.train` keywords parse into equal specs."""
    import sys

    from distlab.cli import main
    seen = {}

    def capture(strategy, **kw):
        seen.update(kw, strategy=strategy)
        raise SystemExit(0)

    monkeypatch.setattr(sys.modules["distlab.train"], "train", capture)
    with pytest.raises(SystemExit):
        main(["train", "--strategy", "3d:dp=2,tp=2,pp=2", "--world-size", "8", "--steps", "3",
              "--bucket-mb", "0.5", "--option", "schedule=gpipe", "--option", "microbatches=4",
              "--checkpoint-dir", "ck", "--resume", "--max-restarts", "2", "--shrink", "6"])
    kw = {k: v for k, v in seen.items() if k not in ("strategy", "world_size", "progress", "check_only")}
    from_cli = parse(seen["strategy"], **kw)
    from_python = parse("3d:dp=2,tp=2,pp=2", steps=3, bucket_mb=0.5, schedule="gpipe", microbatches=4,
                        checkpoint_dir="ck", resume=True, max_restarts=2, shrink=[6])
    assert from_cli == from_python


def test_validation_is_one_call_before_any_rank(tmp_path):
    assert validate(parse("zero2"), 4) == [4]
    spec = parse("ddp", checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, max_restarts=2, shrink=True)
    assert validate(spec, 3) == [3, 2, 1]
    with pytest.raises(ValueError, match="multiple of 2 x cp = 6"):
        validate(parse("cp-ring"), 3)
    with pytest.raises(TypeError, match=r"'tp' has no option 'microbatches'"):
        parse("tp", microbatches=4)
    with pytest.raises(ValueError, match=r"unknown strategy 'zero9' \(did you mean 'zero3'\?\)"):
        parse("zero9")


# -- the composition function on a user's own model -----------------------------------------------------
CFG = dict(vocab=32, seq_len=8, d_model=32, heads=4, layers=2)


def _data(steps: int = 2, rows: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CFG["vocab"], (rows, CFG["seq_len"]), generator=g),
             torch.randint(0, CFG["vocab"], (rows, CFG["seq_len"]), generator=g)) for _ in range(steps)]


def _one_process() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    gpt = dl.models.GPT(dl.models.GPTConfig(**CFG))
    opt = torch.optim.SGD(gpt.parameters(), lr=0.5)
    for ids, targets in _data():
        gpt.loss(ids, targets).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in gpt.state_dict().items()}


def _composed(degrees: dict) -> dict[str, torch.Tensor]:
    """On each rank: a user's GPT (same seed everywhere) laid out by `parallelize` on a mesh, trained on
    this replica's rows (and, with cp, this rank's part of each sequence)."""
    from distlab.parallel import context as cp_lib
    from distlab.parallel import tensor as tp_lib
    from distlab.parallel.mesh import Mesh
    from distlab.strategies.compose import parallelize
    torch.manual_seed(0)
    gpt = dl.models.GPT(dl.models.GPTConfig(**CFG))
    mesh = Mesh(**degrees)
    par = parallelize(gpt, Layout(**degrees, zigzag=True), mesh)
    opt = par.optimizer(torch.optim.SGD, lr=0.5)
    mine = torch.tensor_split(torch.arange(4), mesh.dp)[mesh.coords().dp]        # this replica's rows
    for ids, targets in _data():
        ids, targets = ids[mine], targets[mine]
        if mesh.cp > 1:
            cp = mesh.group("cp")
            ids, targets = (cp_lib.split(t, dim=1, group=cp, zigzag=True) for t in (ids, targets))
        par.model.loss(ids, targets).backward()           # dp's all-reduce runs as backward ends
        opt.step()
        opt.zero_grad()
    full = tp_lib.full_state_dict(par.model) if mesh.tp > 1 else par.model.state_dict()
    return {k: v.detach().clone() for k, v in full.items()}


@pytest.mark.parametrize("degrees", [dict(dp=2, tp=2), dict(dp=2, cp=2)])
def test_parallelize_a_users_model_equals_one_process(degrees):
    want = _one_process()
    run = dl.launch(_composed, world_size=4, args=(degrees,), output="quiet")
    for r, got in enumerate(run.results):
        assert sorted(got) == sorted(want), r
        for name, w in want.items():
            err = (got[name] - w).norm().item()
            assert err <= 1e-5 * w.norm().item() + 1e-6, (r, name, err)


def test_dl_mesh_is_the_public_lesson_object():
    """DESIGN's `dl.Mesh(dp=2, tp=2)`: the mesh `parallel.mesh` builds, reachable from the package."""
    from distlab.parallel.mesh import Mesh
    assert dl.Mesh is Mesh and "Mesh" in dl.__all__
    assert dl.Mesh(dp=2, tp=2).coords(3) == Mesh(dp=2, tp=2).coords(3)
