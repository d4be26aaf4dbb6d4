"""Tensor x data parallelism on a user's model (issue 21 item 6): a tiny random Hugging Face Llama on a
2 x 2 mesh, ``dl.tp.parallelize(model, plan=LLAMA_PLAN, group=mesh["tp"])`` then ``dl.fully_shard`` over
``mesh["dp"]`` per decoder layer and the root (torchtitan's order: TP first), equal to one process on the
same global batch: losses, the global gradient norm `dl.clip_grad_norm_` reports (and clips by), and the
weights after AdamW steps. The mesh is torch's ``init_device_mesh`` or distlab's ``dl.Mesh``; data
parallelism is fully_shard or dl.DDP. Nothing is downloaded: the model is built from a config."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distlab as dl

pytest.importorskip("transformers")

STEPS, BATCH, SEQ, MAX_NORM = 3, 4, 8, 0.5
LLAMA_PLAN = {"model.embed_tokens": "embedding",
              "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather"}
# tolerances: fp32 sums in another order (row- and column-split matmuls, all-reduces) differ by ~1e-7
# relative; losses and norms agree within 1e-5. Adam divides each update by sqrt(v): on entries whose
# gradient is near zero that noise grows, so after 3 AdamW steps the weights agree within 1e-4 of their
# norm (2e-5 observed, the same for all three setups: TP's summation order, not the data parallelism)
REL, STATE_REL = 1e-5, 1e-4


def llama(num_key_value_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)                        # the same full weights on every rank
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=num_key_value_heads)
    return LlamaForCausalLM(cfg)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train(model, ids_of, clip) -> tuple[list, list]:
    """AdamW steps on ``ids_of(step)``; (losses, gradient norms before clipping)."""
    opt, losses, norms = torch.optim.AdamW(model.parameters(), lr=1e-2), [], []
    for step in range(STEPS):
        ids = ids_of(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(clip(model).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def reference() -> dict:
    """One process, the whole batch: the mean of the two data-parallel halves' losses (equal rows)."""
    model = llama()
    opt, losses, norms = torch.optim.AdamW(model.parameters(), lr=1e-2), [], []
    for step in range(STEPS):
        ids = batch(step)
        loss = sum(model(input_ids=ids[d::2], labels=ids[d::2]).loss for d in range(2)) / 2
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.detach() for k, v in model.named_parameters()}}


def _meshes(kind: str):
    """(mesh, this rank's dp coordinate) for torch's DeviceMesh or distlab's Mesh, both dp x tp = 2 x 2."""
    if kind == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return mesh, mesh.get_local_rank("dp")
    mesh = dl.Mesh(dp=2, tp=2)
    return mesh, mesh.dp_rank


def _run(kind: str, data: str) -> dict:
    mesh, d = _meshes(kind)
    model = dl.tp.parallelize(llama(), plan=LLAMA_PLAN, group=mesh["tp"])     # TP first (torchtitan's order)
    if data == "fsdp":
        for layer in model.model.layers:
            dl.fully_shard(layer, group=mesh["dp"])
        dl.fully_shard(model, group=mesh["dp"])
    else:
        model = dl.DDP(model, group=mesh["dp"])
    losses, norms = train(model, lambda step: batch(step)[d::2],
                          lambda m: dl.clip_grad_norm_(m, MAX_NORM))
    mean = torch.tensor(losses)
    dist.all_reduce(mean)                       # the mean over dp of the halves' losses (same on tp ranks)
    inner = model.module if data == "ddp" else model
    local = dl.full_state_dict(inner) if data == "fsdp" else None
    state = dl.tp.full_state_dict(inner, local=local)
    return {"losses": (mean / 4).tolist(), "norms": norms, "state": state}


GPT2_PLAN = {"transformer.wte": "embedding", "transformer.h.*.attn.c_attn": dl.tp.Colwise(packed=3),
             "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
             "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise_gather"}


def gpt2(convert: bool = True):
    """A tiny random GPT-2 (Conv1D linears, lm_head tied to wte), dropout off; converted to nn.Linear."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    return dl.tp.conv1d_to_linear(model) if convert else model


def _gpt2_tp() -> dict:
    """GPT-2 tensor-parallel over every rank (group: a dl.Mesh with one axis), the same batch everywhere."""
    model = dl.tp.parallelize(gpt2(), plan=GPT2_PLAN, group=dl.Mesh(tp=dl.world_size()))
    losses, _ = train(model, batch, lambda m: torch.zeros(()))
    return {"losses": losses, "state": dl.tp.full_state_dict(model),
            "split_size": model.transformer.h[0].attn.split_size}


def _errors() -> dict:
    """The messages of what must be refused: heads that do not split, TP after fully_shard."""
    said = {}
    try:
        dl.tp.parallelize(llama(num_key_value_heads=2), plan=LLAMA_PLAN)            # tp = 4 > 2 kv heads
    except ValueError as e:
        said["kv_heads"] = str(e)
    model = llama()
    dl.fully_shard(model)
    try:
        dl.tp.parallelize(model, plan=LLAMA_PLAN, group=None)
    except ValueError as e:
        said["after_fsdp"] = str(e)
    return said


def _rank() -> dict:
    out = {(kind, data): _run(kind, data) for kind, data in
           (("torch", "fsdp"), ("dl", "fsdp"), ("torch", "ddp"))}
    return {**out, "gpt2": _gpt2_tp(), "errors": _errors()}


@pytest.fixture(scope="module")
def results() -> list:
    return dl.launch(_rank, world_size=4, output="quiet").results


def _rel(mine: dict, want: dict) -> float:
    """The largest ||mine - want|| / ||want|| over ``want``'s parameters (each also in ``mine``)."""
    assert set(want) <= set(mine), sorted(set(want) - set(mine))
    return max(((mine[k] - want[k]).norm() / want[k].norm().clamp(min=1e-6)).item() for k in want)


def test_llama_tp_times_fsdp_on_a_2x2_mesh_equals_one_process(results):
    want = reference()
    assert min(want["norms"]) > MAX_NORM                 # clipping really acts in every step
    for r, res in enumerate(results):
        for setup in (("torch", "fsdp"), ("dl", "fsdp"), ("torch", "ddp")):
            got = res[setup]
            assert sorted(got["state"]) == sorted(want["state"])
            assert got["losses"] == pytest.approx(want["losses"], rel=REL), (r, setup)
            assert got["norms"] == pytest.approx(want["norms"], rel=REL), (r, setup)
            assert _rel(got["state"], want["state"]) <= STATE_REL, (r, setup)


def test_gpt2_conv1d_converted_then_tensor_parallel_equals_one_process(results):
    ids = batch(0)
    with torch.no_grad():                                # the conversion computes what Conv1D did
        assert torch.allclose(gpt2(convert=False)(ids).logits, gpt2()(ids).logits, atol=1e-6)
    model = gpt2()
    losses, _ = train(model, batch, lambda m: torch.zeros(()))
    want = _without_key_bias({k: v.detach() for k, v in model.named_parameters()})
    for r, res in enumerate(results):
        got = res["gpt2"]
        assert got["split_size"] == 32 // 4                  # GPT2Attention's split width, per rank
        assert got["losses"] == pytest.approx(losses, rel=REL), r
        assert _rel(_without_key_bias(got["state"]), want) <= STATE_REL, r


def _without_key_bias(state: dict) -> dict:
    """c_attn's bias without its key third: softmax ignores a shift of every score by q.b_k, so that
    gradient is zero up to rounding, and Adam turns the rounding into lr-sized steps of either sign."""
    return {k: torch.cat([v[:32], v[64:]]) if k.endswith("c_attn.bias") else v for k, v in state.items()}


def test_a_plan_naming_a_conv1d_says_so():
    with pytest.raises(TypeError, match=r"Conv1D .*transposed, \(in, out\) = \(32, 96\).*conv1d_to_linear"):
        dl.tp.parallelize(gpt2(convert=False), plan=GPT2_PLAN)


def test_heads_that_do_not_split_and_tp_after_fully_shard_are_refused_clearly(results):
    said = results[0]["errors"]
    kv = said["kv_heads"]
    assert "'model.layers.0.self_attn.k_proj' holds 2 heads (LlamaConfig.num_key_value_heads=2)" in kv
    assert "do not split over tp=4" in kv and "Valid tp degrees for this attention: [1, 2]" in kv
    assert "already fully_shard-ed" in said["after_fsdp"]
    assert "apply tensor parallelism first, then fully_shard" in said["after_fsdp"]
