"""Checkpoints of a user's own model (issue 21 item 4): ``dl.checkpoint.save(d, step, model=, optimizer=)``
under one layout, ``load`` under another at another world size (or in one process without a process
group), ``consolidate`` to the model's own state_dict, ``export`` to safetensors for ``from_pretrained``.

Each saving layout trains 2 AdamW steps, saves, gathers its full weights by its own means (dl.full_state_dict,
dl.tp.full_state_dict, ZeRO's full_state_dict, the stages' state dicts) and takes a third step. Then:

* the checkpoint consolidates to exactly those gathered weights (the save side is right);
* one process loads it (no process group) and its third step equals the layout's own (the optimizer
  state came along: a wrong moment or step count would change the update);
* another layout at another world size loads it: a save right after the load consolidates to exactly the
  saved parameters and optimizer state, and its third step equals the saver's.

Layouts: fully_shard (uneven rows), HSDP (2, 2), DDP, ZeRO-1 (fp32 and bf16 with fp32 masters) and ZeRO-3,
pipeline stages by name, a tensor-parallel Llama by plan, and DDP over it on a 2 x 2 mesh; an MLP and a tiny
random Llama (nothing downloaded). Five launches in all (world sizes 2 to 4), a few seconds of CPU each.
"""
from __future__ import annotations

import pytest
import safetensors
import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it on a first optimizer: here once, not in every rank)
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers.models.llama import modeling_llama  # noqa: F401  (imported lazily otherwise: in every rank)

import distlab as dl
from distlab.checkpoint import CheckpointError

B, LR = 12, 1e-2                       # global batch: divides over 2, 3 and 4 data-parallel ranks
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
LLAMA_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise"}


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)            # 10, 5 and 3 rows: uneven shards over 2, 3 and 4 ranks
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 5), nn.GELU(), nn.Linear(5, 3))


def llama(seed: int = 0, tied: bool = False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).eval()        # eval: no dropout (there is none anyway)


def batch(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "llama":
        ids = torch.randint(0, 64, (4, 8), generator=g)
        return ids, ids
    x = torch.randn(B, 6, generator=g)
    return x, torch.sin(x[:, :3] * 2)


def loss_of(kind: str, model, x, y):
    return model(input_ids=x, labels=y).loss if kind == "llama" else F.mse_loss(model(x), y)


class Setup:
    """One layout on one rank: the model as the user wraps it, its optimizer, a training step on the
    global batch of ``step``, and the full weights gathered by the layout's own means."""

    def __init__(self, layout: str, seed: int):
        llamas = ("tp", "fsdp-llama", "tp-ddp", "tp-fsdp")
        self.layout, self.kind = layout, "llama" if layout in llamas else "mlp"
        self.dp = layout in ("fsdp", "hsdp", "ddp", "zero1", "zero3", "fsdp-llama", "zero1-bf16")
        self.dp_rank, self.dp_size = dl.rank(), dl.world_size()
        if layout == "tp":
            self.model = dl.tp.parallelize(llama(seed), plan=LLAMA_PLAN)
        elif layout == "tp-ddp":                       # 2 x 2: tp blocks in each row, DDP down each column
            mesh = dl.Mesh(dp=2, tp=2)
            self.dp, self.dp_rank, self.dp_size = True, mesh.dp_rank, 2
            tp = dl.tp.parallelize(llama(seed), plan=LLAMA_PLAN, group=mesh.tp_group)
            self.model = dl.DDP(tp, group=mesh.dp_group)
        elif layout == "tp-fsdp":                      # torchtitan's order: tp blocks, then fully_shard rows
            mesh = dl.Mesh(dp=2, tp=2)
            self.dp, self.dp_rank, self.dp_size = True, mesh.dp_rank, 2
            self.model = dl.tp.parallelize(llama(seed), plan=LLAMA_PLAN, group=mesh.tp_group)
            for layer in self.model.model.layers:
                dl.fully_shard(layer, group=mesh.dp_group)
            dl.fully_shard(self.model, group=mesh.dp_group)
        elif layout == "fsdp-llama":
            self.model = llama(seed)
            for layer in self.model.model.layers:
                dl.fully_shard(layer)
            dl.fully_shard(self.model)
        elif layout in ("fsdp", "hsdp"):
            self.model = mlp(seed)
            mesh = (2, 2) if layout == "hsdp" else None
            for layer in self.model[::2]:
                dl.fully_shard(layer, mesh=mesh)
            dl.fully_shard(self.model, mesh=mesh)
        elif layout == "ddp":
            self.model = dl.DDP(mlp(seed))
        elif layout in ("zero1", "zero3", "zero1-bf16"):
            m = mlp(seed).to(torch.bfloat16 if layout.endswith("bf16") else torch.float32)
            self.model = dl.ZeRO(m, stage=int(layout[4]), lr=LR, bucket_mb=1e-4,   # buckets: one per unit
                                 units=list(m[::2]))                                # (3), ~per parameter (1)
        elif layout == "stage":
            full = mlp(seed)
            names = dl.pp.cut(dl.pp.chain(full), at=["2"])[dl.rank()]
            self.model = dl.pp.named_stage(full, names)
            self.pipe = dl.pp.Pipeline(self.model, dl.rank(), 2, schedule="1f1b", microbatches=2)
        elif layout == "interleaved":                  # stages r and r + 2 on rank r: the list is the model
            full, ids = mlp(seed), [dl.rank(), dl.rank() + 2]
            stages = dl.pp.cut(dl.pp.chain(full), at=["1", "3", "4"])
            self.model = [dl.pp.named_stage(full, stages[i]) for i in ids]
            self.pipe = dl.pp.Pipeline(self.model, ids, 4, schedule="interleaved", microbatches=2)
        else:
            self.model = mlp(seed)
        params = [p for m in self.model for p in m.parameters()] if layout == "interleaved" else None
        self.opt = (self.model.optimizer if layout.startswith("zero")
                    else torch.optim.AdamW(params or self.model.parameters(), lr=LR))

    def step(self, step: int) -> None:
        x, y = batch(self.kind, step)
        if self.layout in ("stage", "interleaved"):
            self.pipe.step(x if self.pipe.first else None, y if self.pipe.last else None)
        else:
            if self.dp:
                x, y = x.tensor_split(self.dp_size)[self.dp_rank], y.tensor_split(self.dp_size)[self.dp_rank]
            if self.layout.endswith("bf16"):
                x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
            loss_of(self.kind, self.model, x, y).backward()
        self.opt.step()
        self.opt.zero_grad()

    def full(self) -> dict:
        if self.layout in ("fsdp", "hsdp", "fsdp-llama"):
            return dl.full_state_dict(self.model)
        if self.layout == "tp-fsdp":
            return dl.tp.full_state_dict(self.model, local=dl.full_state_dict(self.model))
        if self.layout in ("tp", "tp-ddp"):
            return dl.tp.full_state_dict(getattr(self.model, "module", self.model))
        if self.layout == "zero3":
            return self.model.full_state_dict()
        inner = self.model.module if self.layout == "ddp" else self.model
        parts = inner if self.layout == "interleaved" else [inner]
        return {k: v.detach().clone() for m in parts for k, v in m.state_dict().items()}


def _save(root: str, layouts: list[str]) -> dict:
    """Each layout from seed 0: 2 steps, save, its own full weights; a third step, its weights again."""
    out = {}
    for layout in layouts:
        s = Setup(layout, seed=0)
        s.step(0), s.step(1)
        for group in s.opt.param_groups:                # as a learning-rate schedule would: saved, restored
            group["lr"] = LR / 2
        dl.checkpoint.save(f"{root}/{layout}", 2, model=s.model, optimizer=s.opt)
        at_2 = s.full()
        s.step(2)
        out[layout] = (at_2, s.full())
    return out


def _load(root: str, jobs: list[tuple[str, str]]) -> None:
    """Each (saved, layout) from another seed: load, save as it is, one more step, save again."""
    for saved, layout in jobs:
        s = Setup(layout, seed=1)
        assert dl.checkpoint.load(f"{root}/{saved}", model=s.model, optimizer=s.opt) == 2
        dl.checkpoint.save(f"{root}/{saved}-{layout}-loaded", 2, model=s.model, optimizer=s.opt)
        s.step(2)
        dl.checkpoint.save(f"{root}/{saved}-{layout}-stepped", 3, model=s.model)


def _save_and_load(root: str, layouts: list[str], jobs: list[tuple[str, str]]) -> dict:
    out = _save(root, layouts)
    _load(root, jobs)
    return out


def _refusals(root: str) -> list[str]:
    """DDP replicas that differ (rank 1 alone changed a weight): the save refuses; a checkpoint of one's
    own state dicts saved by one process: loading it on two says how to read it."""
    s = Setup("ddp", seed=0)
    with torch.no_grad():
        if dl.rank() == 1:
            s.model.module[0].weight[0, 0] += 1
    said = []
    for attempt in (lambda: dl.checkpoint.save(f"{root}/diverged", 0, model=s.model),
                    lambda: dl.checkpoint.load(f"{root}/own")):
        try:
            attempt()
            said.append("done")
        except CheckpointError as err:
            said.append(str(err))
    return said


def _saves_and_loads(root: str) -> dict:
    """The whole matrix in five launches (world sizes 2, 4, 2, 3, 2)."""
    run = dl.launch(_save, world_size=2, args=(root, ["fsdp", "ddp", "tp", "stage", "interleaved",
                                                       "zero1-bf16"]), output="quiet")
    out = {layout: run.results[0][layout] for layout in ("fsdp", "ddp", "tp")}
    for layout in ("stage", "interleaved"):                 # each rank its own stages: the union
        out[layout] = tuple({**run.results[0][layout][i], **run.results[1][layout][i]} for i in (0, 1))
    on_four = ["hsdp", "tp-ddp", "tp-fsdp"]
    run = dl.launch(_save_and_load, world_size=4, args=(root, on_four, [("tp", "tp-fsdp")]), output="quiet")
    out.update({layout: run.results[0][layout] for layout in on_four})
    dl.checkpoint.save(f"{root}/own", 0, {"x": torch.ones(2)})
    out["refusals"] = dl.launch(_refusals, world_size=2, args=(root,), output="quiet").results[0]
    on_three = [("fsdp", "ddp"), ("hsdp", "fsdp"), ("fsdp", "zero3"), ("hsdp", "zero1"),
                ("zero1-bf16", "zero1-bf16")]
    run = dl.launch(_save_and_load, world_size=3, args=(root, ["zero3"], on_three), output="quiet")
    out["zero3"] = run.results[0]["zero3"]
    dl.launch(_load, world_size=2, args=(root, [("zero3", "fsdp"), ("ddp", "stage"), ("ddp", "interleaved"),
                                                ("tp", "fsdp-llama"),
                                                ("tp-fsdp-llama-loaded", "tp")]), output="quiet")
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    return root, _saves_and_loads(str(root))


def assert_equal(a: dict, b: dict):
    assert list(a) == list(b)
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def assert_close(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert (v - b[k]).abs().max() <= 1e-6 + 1e-5 * b[k].abs().max(), k


def one_process(directory, kind: str):
    """The checkpoint loaded into the plain model and AdamW here, no process group; one step after."""
    s = Setup("single" if kind == "mlp" else "llama", seed=1)
    if kind == "llama":
        s.model, s.kind = llama(seed=1), "llama"
        s.opt = torch.optim.AdamW(s.model.parameters(), lr=LR)
    assert dl.checkpoint.load(directory, model=s.model, optimizer=s.opt) == 2
    return s


@pytest.mark.parametrize("layout", ["fsdp", "ddp", "tp", "stage", "interleaved", "hsdp", "zero3", "tp-ddp",
                                    "tp-fsdp"])
def test_checkpoint_is_the_model_and_one_process_continues_it(saved, layout):
    """Consolidated: the layout's own full weights, the model's own names and shapes, bit for bit. Loaded
    in one process: the same parameters, and one more AdamW step equals the layout's third step."""
    root, out = saved
    at_2, at_3 = out[layout]
    kind = "llama" if layout.startswith("tp") else "mlp"
    full = dl.checkpoint.consolidate(root / layout)
    assert_equal({k: full[k] for k in at_2}, at_2)
    s = one_process(root / layout, kind)
    assert sorted(full) == sorted(s.model.state_dict())        # (interleaved stages: rank by rank)
    if layout != "interleaved":
        assert list(full) == list(s.model.state_dict())
    assert_equal(s.model.state_dict(), full)
    s.step(2)
    assert_close({k: v for k, v in s.model.state_dict().items() if k in at_3}, at_3)


@pytest.mark.parametrize("saved_as, loaded_as", [("fsdp", "ddp"), ("hsdp", "fsdp"), ("zero3", "fsdp"),
                                                 ("fsdp", "zero3"), ("hsdp", "zero1"), ("ddp", "stage"),
                                                 ("ddp", "interleaved"),
                                                 ("tp", "fsdp-llama"), ("tp-fsdp-llama-loaded", "tp"),
                                                 ("tp", "tp-fsdp")])
def test_another_layout_at_another_world_size_continues_it(saved, saved_as, loaded_as):
    """fully_shard on 2 -> DDP on 3, HSDP (2, 2) -> fully_shard on 3, ZeRO-3 on 3 -> fully_shard on 2, and
    into ZeRO's flat buckets (stages 3 and 1, on 3 ranks), into pipeline stages, and the tensor-parallel
    Llama's blocks into fully_shard's rows (2 ranks), back into blocks, and into rows of blocks: right
    after loading, parameters and optimizer state (every moment, every step count) are exactly the saved
    ones; one more step equals the saving layout's own third step."""
    root, out = saved
    before = dl.checkpoint.consolidate(root / saved_as, optimizer=True)
    after = dl.checkpoint.consolidate(root / f"{saved_as}-{loaded_as}-loaded", optimizer=True)
    assert_equal(after["model"], before["model"])
    assert list(after["optimizer"]) == list(before["optimizer"]) == [k for k in before["model"]]
    for name, state in before["optimizer"].items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        assert_equal(after["optimizer"][name], state)
    first = next(iter(before["model"]))
    assert before["optimizer"][first]["step"] == 2 and before["settings"][first]["lr"] == LR / 2
    assert after["settings"] == before["settings"]
    stepped = dl.checkpoint.consolidate(root / f"{saved_as}-{loaded_as}-stepped")
    assert_close(stepped, out[saved_as.split("-")[0]][1])


def test_low_precision_zero_keeps_its_fp32_masters(saved):
    """ZeRO-1 with bf16 parameters on 2 ranks -> on 3: the fp32 masters come along exactly (not the bf16
    parameters upcast), beside the moments."""
    root, _ = saved
    before = dl.checkpoint.consolidate(root / "zero1-bf16", optimizer=True)
    after = dl.checkpoint.consolidate(root / "zero1-bf16-zero1-bf16-loaded", optimizer=True)
    assert_equal(after["model"], before["model"])
    for name, state in before["optimizer"].items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "master", "step"]
        assert_equal(after["optimizer"][name], state)
    weight, master = before["model"]["0.weight"], before["optimizer"]["0.weight"]["master"]
    assert weight.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert torch.equal(master.bfloat16(), weight) and not torch.equal(master, weight.float())


def test_replicas_and_shards_are_written_once(saved):
    """DDP: rank 0 writes everything, rank 1 nothing; fully_shard: each rank its rows, the uneven last
    shard shorter; HSDP (2, 2): only the first replica group writes; tp: blocks per rank, the rest once;
    DDP over tp: the first replica of each block; fully_shard over tp: rows of each block."""
    root, _ = saved
    pieces = lambda name: dl.checkpoint.manifest(root / name)["meta"]["pieces"]   # noqa: E731
    ddp = pieces("ddp")
    assert ddp[1] == [] and all(p["held_by"] == [0, 1] for p in ddp[0])
    rows = [(p["cut"], p["held_by"]) for r in pieces("fsdp") for p in r if p["name"] == "2.weight"
            and p["key"] is None]
    assert rows == [({"kind": "rows", "start": 0, "stop": 3}, [0]),
                    ({"kind": "rows", "start": 3, "stop": 5}, [1])]
    hsdp = pieces("hsdp")
    assert hsdp[2] == hsdp[3] == [] and hsdp[0] and hsdp[1]
    assert {p["held_by"][0] + 2 in p["held_by"] for r in hsdp for p in r
            if p["cut"]["kind"] == "rows"} == {True}
    tp = pieces("tp")
    q = [p["cut"] for r in tp for p in r
         if p["name"] == "model.layers.0.self_attn.q_proj.weight" and not p["key"]]
    assert q == [{"kind": "block", "dim": 0, "index": i, "parts": 2, "packed": 1} for i in (0, 1)]
    assert all(p["held_by"] == [0, 1] for p in tp[0] if p["name"] == "model.norm.weight")
    mixed = pieces("tp-ddp")                # tp blocks over ranks (0, 1), DDP replicas (2, 3) of them
    assert mixed[2] == mixed[3] == [] and {p["cut"]["kind"] for p in mixed[1]} == {"block"}
    assert {tuple(p["held_by"]) for p in mixed[1]} == {(1, 3)}
    nested = [p["cut"] for r in pieces("tp-fsdp") for p in r       # rows (dp) of each block (tp)
              if p["name"] == "model.layers.0.mlp.down_proj.weight" and not p["key"]]
    assert nested == [{"kind": "block", "dim": 1, "index": i, "parts": 2, "packed": 1,
                       "then": {"kind": "rows", "start": lo, "stop": lo + 16}}
                      for lo in (0, 16) for i in (0, 1)]


def test_export_loads_with_from_pretrained(saved, tmp_path, monkeypatch):
    """The tensor-parallel Llama's checkpoint -> model.safetensors beside its config.json -> from_pretrained:
    the weights the layout held; and a tied Llama saved in one process comes back tied, logits equal."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, out = saved
    transformers.LlamaConfig(**LLAMA).save_pretrained(tmp_path / "tp")
    dl.checkpoint.export(root / "tp", tmp_path / "tp")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tp")
    assert_equal({k: v for k, v in back.state_dict().items() if k in out["tp"][0]}, out["tp"][0])

    tied = llama(seed=3, tied=True)
    dl.checkpoint.save(tmp_path / "ck", 0, model=tied)
    aliases = dl.checkpoint.manifest(tmp_path / "ck")["meta"]["aliases"]
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    tied.config.save_pretrained(tmp_path / "tied")
    dl.checkpoint.export(tmp_path / "ck", tmp_path / "tied" / "model.safetensors")
    with safetensors.safe_open(tmp_path / "tied" / "model.safetensors", "pt") as f:   # as save_pretrained
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tied").eval()
    assert again.lm_head.weight is again.model.embed_tokens.weight
    ids = batch("llama", 0)[0]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, tied(ids).logits)
    plain = llama(seed=4, tied=True)
    full = dl.checkpoint.consolidate(tmp_path / "ck")
    assert list(full) == list(tied.state_dict())
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    plain.load_state_dict(full)                                             # the one-line way back
    assert torch.equal(plain.lm_head.weight, tied.lm_head.weight)


def test_errors_say_what_to_do(saved, tmp_path):
    root, out = saved
    diverged, elsewhere = out["refusals"]
    assert "copies differ" in diverged and "shard_dims" in diverged and not (root / "diverged").exists()
    assert "saved by 1 ranks, this run has 2" in elsewhere and "dl.checkpoint.load_all" in elsewhere
    small = mlp()
    dl.checkpoint.save(tmp_path / "m", 0, model=small)
    other = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 4), nn.GELU(), nn.Linear(4, 3))
    with pytest.raises(CheckpointError, match=r"shapes differ: 2.weight: checkpoint \(5, 10\), model "
                                              r"\(4, 10\).*same class and config"):
        dl.checkpoint.load(tmp_path / "m", model=other)
    longer = nn.Sequential(*mlp(), nn.GELU(), nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"not in the checkpoint: \['6.weight', '6.bias'\].*"
                                              r"strict=False"):
        dl.checkpoint.load(tmp_path / "m", model=longer)
    with pytest.raises(CheckpointError, match=r"not in the model: \['4.bias', '4.weight'\]"):
        dl.checkpoint.load(tmp_path / "m", model=nn.Sequential(*mlp()[:3]))
    dl.checkpoint.load(tmp_path / "m", model=longer, strict=False)
    assert torch.equal(longer[4].weight, small[4].weight)
    with pytest.raises(CheckpointError, match="no optimizer state.*without optimizer="):
        dl.checkpoint.load(tmp_path / "m", model=small, optimizer=torch.optim.AdamW(small.parameters()))
    with pytest.raises(CheckpointError, match="holds AdamW state, this optimizer is SGD: build a "
                                              "torch.optim.AdamW"):
        dl.checkpoint.load(root / "ddp", model=small, optimizer=torch.optim.SGD(small.parameters(), lr=1))
    with pytest.raises(CheckpointError, match=r"holds a model's pieces: load it with "
                                              r"dl.checkpoint.load\(directory, model=model"):
        dl.checkpoint.load(tmp_path / "m")


def test_other_kinds_of_checkpoint_point_forward(tmp_path):
    """A dl.train checkpoint loaded with model= says how to resume it or take its weights (and that way
    works); a checkpoint of one's own state dicts says what consolidate and load(model=) need."""
    dl.train("single", steps=1, checkpoint_dir=str(tmp_path / "train"), checkpoint_every=1)
    gpt = dl.models.build("gpt-tiny", seed=5)
    with pytest.raises(CheckpointError, match=r"written by dl.train \(strategy 'single'.*resume=True.*"
                                              r"model.load_state_dict\(\{\*\*full\['params'\], "
                                              r"\*\*full\['buffers'\]\}\)"):
        dl.checkpoint.load(tmp_path / "train", model=gpt)
    full = dl.checkpoint.consolidate(tmp_path / "train")
    gpt.load_state_dict({**full["params"], **full["buffers"]})            # what the message says works
    dl.checkpoint.save(tmp_path / "own", 0, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"nothing to consolidate.*load_all\(directory\).*model=model"):
        dl.checkpoint.consolidate(tmp_path / "own")
    with pytest.raises(CheckpointError, match=r"records no model layout.*save\(directory, step, model=model"):
        dl.checkpoint.load(tmp_path / "own", model=mlp())
    assert torch.equal(dl.checkpoint.load(tmp_path / "own")["x"], torch.ones(2))
