"""Hugging Face decoders through the pipeline, cut between their blocks by name (issue 21 items 5, 7).

Tiny random-init models built from configs here (nothing downloaded): a Llama (rotary embeddings, the
family of Qwen2 and Mistral) and a GPT-2 (learned positions), untied and without dropout so one
process is an exact reference. ``dl.pp.chain`` lists their blocks, ``dl.pp.named_stage`` runs a cut of
them, each stage recomputing what its blocks take from their parent (rotary cos/sin, positions, mask).
GPipe, 1F1B and ZB-H1 at 2 stages, and 1F1B / ZB-H1 at 3 uneven stages, each equal one process on the
same global batch: losses within 1e-5 relative, the first step's gradients within 1e-5 of their norm,
the parameters after 3 AdamW steps within 1e-4 (AdamW's step g / (|g| + eps), eps = 1e-8, turns a ~1e-9
rounding difference of a gradient entry near 1e-8 into a visible one: under ``make test``'s pinned AVX2
kernels the layer-0 MLP weights of the Llama end 1.2e-5 of their norm apart); under ZB-H1 every I leaves
all of its stage's weight gradients
(embeddings, projections, norms) to W. torch's own ``torch.distributed.pipelining`` (ScheduleGPipe)
runs the same stages to the same numbers: with *manual* ``PipelineStage``s around our ``named_stage``
modules, because its ``pipeline()`` tracer cannot take this Llama (torch 2.13, transformers 5.x:
torch.export stops with "cannot capture your model as a full graph"). A stage module that returns a
``ModelOutput`` (the whole ``model.model``) flows its ``last_hidden_state``; a stage returning no tensor
is a clear error. The 4-rank pp=2 x tp=2 case splits each stage's projections by a plan.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import distlab as dl

pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, MICRO, STEPS, LR = 64, 8, 8, 4, 3, 1e-2
CUTS = {2: ["model.layers.2"], 3: ["model.layers.3", "model.norm"]}          # 3 stages: 4 + 1 + 2 modules
GPT2_CUTS = {2: ["transformer.h.2"], 3: ["transformer.h.1", "transformer.h.3"]}


def _model(family: str):
    """The tiny model from seed 0 on every rank and in the reference."""
    import transformers as tf
    torch.manual_seed(0)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=4, num_attention_heads=4,
                                                  num_key_value_heads=2))
    # untied (a tied wte/lm_head would live on two stages) and no dropout (one process must be exact)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=32,
                                            tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _data(step: int):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _snapshot(named) -> dict:
    return {n: p.detach().clone() for n, p in named}


def _grads(named) -> dict:
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def _reference(family: str) -> dict:
    """One process: the whole batch, cross-entropy on the logits, AdamW."""
    model = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = _data(step)
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        grads = grads or _grads(model.named_parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": _snapshot(model.named_parameters())}


def _train(stage, step_fn) -> dict:
    """AdamW on this rank's stage; ``step_fn(x, y)`` runs one pipeline step and returns the loss or None."""
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        loss = step_fn(*_data(step))
        grads = grads or _grads(stage.named_parameters())
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    return {"losses": losses, "grads": grads, "params": _snapshot(stage.named_parameters())}


class _LeftToW(dl.pp.Observer):
    """Zero bubble: the parameters whose weight gradient each I action leaves to its W."""

    def __init__(self):
        self.left = []

    @contextlib.contextmanager
    def around_action(self, pipe, action):
        yield
        if action.kind == "I":
            uses = pipe.stash[(action.stage, action.microbatch)].uses
            self.left.append({id(p) for _, aliases in uses.deferred for p, _ in aliases})


def _ours(family: str, schedule: str, cuts: list[str]) -> dict:
    model, r = _model(family), dl.rank()
    stages = dl.pp.cut(dl.pp.chain(model), at=cuts)
    dl.pp.check_stages(model, stages)
    stage = dl.pp.named_stage(model, stages[r])
    watch = _LeftToW()
    pipe = dl.pp.Pipeline(stage, r, len(stages), schedule=schedule, microbatches=MICRO, observers=[watch])
    out = _train(stage, lambda x, y: pipe.step(x if pipe.first else None, y if pipe.last else None))
    every = {id(p) for p in stage.parameters()}
    out["all_left_to_w"] = bool(watch.left) and all(left == every for left in watch.left)
    return out


def _model_output_stages() -> dict:
    """The coarse cut ``model | lm_head`` with the modules themselves as stages: stage 0 returns a
    ``BaseModelOutputWithPast`` and the executor passes on its ``last_hidden_state``."""
    model, r = _model("llama"), dl.rank()
    stage = [model.model, model.lm_head][r]
    pipe = dl.pp.Pipeline(stage, r, 2, schedule="1f1b", microbatches=MICRO)
    out = _train(stage, lambda x, y: pipe.step(x if pipe.first else None, y if pipe.last else None))
    out["params"] = {(f"model.{n}" if r == 0 else f"lm_head.{n}"): p for n, p in out["params"].items()}
    out["grads"] = {(f"model.{n}" if r == 0 else f"lm_head.{n}"): g for n, g in out["grads"].items()}
    return out


def _torch_gpipe(family: str) -> dict:
    """The same stages under torch.distributed.pipelining: manual PipelineStage + ScheduleGPipe."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    model, r = _model(family), dl.rank()
    stages = dl.pp.cut(dl.pp.chain(model), at=(CUTS if family == "llama" else GPT2_CUTS)[2])
    stage = dl.pp.named_stage(model, stages[r])
    schedule = ScheduleGPipe(PipelineStage(stage, r, 2, torch.device("cpu")), MICRO,
                             loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))

    def step(x, y):
        if r == 0:
            schedule.step(x)
            return None
        losses = []
        schedule.step(target=y, losses=losses)
        return torch.stack(losses).mean()
    return _train(stage, step)


def _two_stages() -> dict:
    out = {}
    for family, cuts in (("llama", CUTS[2]), ("gpt2", GPT2_CUTS[2])):
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            out[(family, schedule)] = _ours(family, schedule, cuts)
    out[("llama", "model-output")] = _model_output_stages()
    out[("llama", "torch-gpipe")] = _torch_gpipe("llama")
    return out


def _three_stages() -> dict:
    return {("llama", "1f1b"): _ours("llama", "1f1b", CUTS[3]),
            ("gpt2", "zb-h1"): _ours("gpt2", "zb-h1", GPT2_CUTS[3])}


def _comparable(name: str, value: torch.Tensor) -> torch.Tensor:
    """GPT-2's key bias (the middle third of ``c_attn.bias``) has an exact gradient of zero (softmax
    ignores a shift shared by a query's scores): AdamW turns the rounding noise there into +-lr steps,
    so its parameters are left out of the comparison (its gradients are not)."""
    if name.endswith("c_attn.bias"):
        value = value.clone()
        value[value.numel() // 3: 2 * value.numel() // 3] = 0
    return value


def _close(got: dict, want: dict, what: str, rel: float = 1e-5) -> list[str]:
    errs = {n: ((v - want[n]).norm(), want[n].norm()) for n, v in got.items()}
    return [f"{what} {n}: {e:.2e} vs norm {w:.2e}" for n, (e, w) in errs.items() if e > rel * w + 1e-7]


def _check(results: list[dict], ref: dict, case, params_rel: float = 1e-4) -> list[str]:
    """Every parameter on exactly one stage, all of them covered; losses, first grads, final params."""
    wrong = []
    if results[-1]["losses"] != pytest.approx(ref["losses"], rel=1e-5):
        wrong.append(f"{case} losses {results[-1]['losses']} vs {ref['losses']}")
    names = [set(res["params"]) for res in results]
    if sum(map(len, names)) != len(ref["params"]) or set().union(*names) != set(ref["params"]):
        wrong.append(f"{case}: stages hold {sorted(map(len, names))} parameters: no partition")
    for res in results:
        if case[1] == "zb-h1" and not res.get("all_left_to_w"):      # each HF block's weights: dW in W, not I
            wrong.append(f"{case}: some I computed a weight gradient itself (or no I ran)")
        wrong += _close(res["grads"], ref["grads"], f"{case} grad")
        wrong += _close({n: _comparable(n, v) for n, v in res["params"].items()},
                        {n: _comparable(n, v) for n, v in ref["params"].items()}, f"{case} param", params_rel)
    return wrong


@pytest.mark.parametrize("world, fn", [(2, _two_stages), (3, _three_stages)])
def test_hf_decoders_pipelined_equal_one_process(world, fn):
    refs = {family: _reference(family) for family in ("llama", "gpt2")}
    run = dl.launch(fn, world_size=world, output="quiet", timeout=240)
    wrong = []
    for case in run.results[0]:
        wrong += _check([res[case] for res in run.results], refs[case[0]], case)
    assert not wrong, "\n".join(wrong[:10])


# -- tensor x pipeline parallel: pp=2 x tp=2 on the Llama -----------------------------------------------
LLAMA_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise"}


def _tp_pp(schedule: str) -> dict:
    """This rank's stage (its pp coordinate) split over its tp group by ``LLAMA_PLAN``, the pipeline over
    its pp group; full weights and first gradients gathered over tp. The heads split with the
    projections: 2 of 4 query heads and 1 of 2 key/value heads per tp rank (GQA groups stay whole)."""
    mesh, model = dl.Mesh(pp=2, tp=2), _model("llama")
    stages = dl.pp.cut(dl.pp.chain(model), at=CUTS[2])
    stage = dl.pp.named_stage(model, stages[mesh.pp_rank])
    dl.tp.parallelize(stage, plan=LLAMA_PLAN, group=mesh.group("tp"))
    shard = stage.get_submodule(stages[mesh.pp_rank][1] + ".self_attn.q_proj").weight.shape
    watch = _LeftToW()
    pipe = dl.pp.Pipeline(stage, mesh.pp_rank, 2, schedule=schedule, microbatches=MICRO,
                          group=mesh.group("pp"), observers=[watch])
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        x, y = _data(step)
        loss = pipe.step(x if pipe.first else None, y if pipe.last else None)
        grads = grads or dl.tp.full_grads(stage)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    every = {id(p) for p in stage.parameters()}
    return {"losses": losses, "grads": grads, "params": dl.tp.full_state_dict(stage), "shard": tuple(shard),
            "all_left_to_w": bool(watch.left) and all(left == every for left in watch.left)}


def _tp_pp_both() -> dict:
    return {("llama", s): _tp_pp(s) for s in ("1f1b", "zb-h1")}


def test_llama_tensor_and_pipeline_parallel_equals_one_process():
    """4 ranks, ``dl.Mesh(pp=2, tp=2)``: 1F1B and ZB-H1 equal one process: losses and first gradients within
    1e-5 as above, parameters after 3 AdamW steps within 1e-4 of their norm. Why looser: tensor parallelism
    rounds some gradient entries of ~1e-8 differently (by ~2e-9; the same without the pipeline), and
    AdamW's step g / (|g| + eps), eps = 1e-8, is steep there: the layer-0 MLP weights end ~5e-5 apart.
    Each tp rank holds half of every planned projection; both tp ranks of a stage agree to 1e-5."""
    ref = _reference("llama")
    results = dl.launch(_tp_pp_both, world_size=4, output="quiet", timeout=240).results
    wrong = []
    for case in results[0]:
        by_stage = [results[0][case], results[2][case]]            # pp=0, 1 at tp=0 (rank = pp * 2 + tp)
        wrong += _check(by_stage, ref, case, params_rel=1e-4)
        for twin, mine in ((results[1][case], results[0][case]), (results[3][case], results[2][case])):
            assert twin["losses"] == mine["losses"] and twin["shard"] == mine["shard"] == (16, 32)
            wrong += _close(twin["params"], mine["params"], f"{case} tp twin")
    assert not wrong, "\n".join(wrong[:10])


# -- in one process: the chains, the recomputed context, the errors ------------------------------------
def test_chains_and_stages_equal_the_full_forward():
    """The chain of each family; stages composed equal the model's logits under sdpa and eager attention
    (eager needs the recomputed 4-D causal mask, sdpa its is_causal path); Qwen2 and Mistral (a sliding
    window shorter than the sequence) by the same adapter."""
    import transformers as tf
    llama = _model("llama")
    assert dl.pp.chain(llama) == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)),
                                  "model.norm", "lm_head"]
    assert dl.pp.chain(llama.model)[:2] == ["embed_tokens", "layers.0"]
    assert dl.pp.chain(_model("gpt2")) == ["transformer.wte", "transformer.wpe",
                                           *(f"transformer.h.{i}" for i in range(4)), "transformer.ln_f",
                                           "lm_head"]
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2)
    models = [llama, _model("gpt2"), tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw)),
              tf.MistralForCausalLM(tf.MistralConfig(**kw, sliding_window=3))]
    x, _ = _data(0)
    for model in models:
        for attention in ("sdpa", "eager"):
            model.config._attn_implementation = attention
            want, out = model(input_ids=x).logits, x
            names = dl.pp.chain(model)
            for part in dl.pp.cut(names, at=[names[1], names[3], names[-1]]):   # GPT-2: wte | wpe, h.0 | ...
                out = dl.pp.named_stage(model, part)(out)
            assert (out - want).abs().max() < 1e-5, (type(model).__name__, attention)


def test_stage_outputs_name_their_tensor_or_say_how():
    llama = _model("llama")
    x, _ = _data(0)
    hidden = dl.pp.named_stage(llama, ["model"])(x)       # BaseModelOutputWithPast -> last_hidden_state
    assert hidden.shape == (BATCH, SEQ, 32)
    assert torch.equal(dl.pp.named_stage(llama, ["model", "lm_head"])(x), llama(input_ids=x).logits)
    tensor_of = dl.pp.tensor_of
    a, b = torch.zeros(1), torch.ones(1)
    assert tensor_of((None, a, b)) is a and tensor_of((a, b), 1) is b
    assert tensor_of({"loss": a, "logits": b}) is b and tensor_of({"aux": a, "h": b}, "h") is b
    with pytest.raises(ValueError, match=r"output='logits' is not one of its tensors \['last_hidden_state"):
        dl.pp.named_stage(llama, ["model"], output="logits")(x)
    with pytest.raises(ValueError, match="module 'x' returned a tuple holding no tensor .*return one"):
        tensor_of((None, "text"), what="module 'x'")
    with pytest.raises(ValueError, match="stage 0 returned a str, not a tensor"):
        tensor_of("text", what="stage 0")
    with pytest.raises(ValueError, match="not in this stage"):
        dl.pp.named_stage(llama, ["model.norm"], output={"lm_head": "logits"})


class _AuxFirst(torch.nn.Module):
    """Returns (an auxiliary scalar, the output) -- or nothing at all, when ``broken``."""

    def __init__(self, broken: bool = False):
        super().__init__()
        self.linear, self.broken = torch.nn.Linear(4, 3), broken

    def forward(self, x):
        return None if self.broken else (torch.zeros(()), self.linear(x))


def test_pipeline_output_names_the_tensor_a_stage_passes_on():
    """One stage in one process: ``Pipeline(output=1)`` trains on the tuple's second tensor, to the loss of
    the plain model; a stage returning None says so, with its stage id."""
    torch.manual_seed(0)
    stage, x, y = _AuxFirst(), torch.randn(4, 4), torch.randn(4, 3)
    loss = dl.pp.Pipeline(stage, 0, 1, microbatches=2, output=1).step(x, y)
    assert loss.item() == pytest.approx(F.mse_loss(stage.linear(x), y).item(), rel=1e-6)
    with pytest.raises(ValueError, match="stage 0 returned a NoneType, not a tensor"):
        dl.pp.Pipeline(_AuxFirst(broken=True), 0, 1, microbatches=2).step(x, y)


def test_a_tied_gpt2_cut_apart_says_untie():
    import transformers as tf
    tied = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                            bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match="'lm_head.weight' is on stages 0 and 1.*untie it"):
        dl.pp.check_stages(tied, dl.pp.cut(dl.pp.chain(tied), at=["transformer.h.1"]))
