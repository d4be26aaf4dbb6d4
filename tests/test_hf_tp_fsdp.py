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


def _rank() -> dict:
    return {(kind, data): _run(kind, data) for kind, data in
            (("torch", "fsdp"), ("dl", "fsdp"), ("torch", "ddp"))}


def _rel(mine: dict, want: dict) -> float:
    """The largest ||mine - want|| / ||want|| over the parameters (the same names on both sides)."""
    assert sorted(mine) == sorted(want), sorted(set(want) ^ set(mine))
    return max(((mine[k] - want[k]).norm() / want[k].norm().clamp(min=1e-6)).item() for k in mine)


def test_llama_tp_times_fsdp_on_a_2x2_mesh_equals_one_process():
    want = reference()
    assert min(want["norms"]) > MAX_NORM                 # clipping really acts in every step
    run = dl.launch(_rank, world_size=4, output="quiet")
    for r, res in enumerate(run.results):
        for setup, got in res.items():
            assert got["losses"] == pytest.approx(want["losses"], rel=REL), (r, setup)
            assert got["norms"] == pytest.approx(want["norms"], rel=REL), (r, setup)
            assert _rel(got["state"], want["state"]) <= STATE_REL, (r, setup)
