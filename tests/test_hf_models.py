"""Hugging Face models under every distlab wrapper, beside torch's own (issue 21 item 8).

A tiny random-init ``transformers`` Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head)
and GPT-2 (LayerNorm, learned positions, fused ``Conv1D`` qkv, tied head), built from configs here (nothing
downloaded), train 4 AdamW steps on a fixed global batch under each layout:

    distlab                                   torch
    dl.DDP                                    DistributedDataParallel
    dl.ZeRO(stage=1, 2, 3)                    -
    dl.ShardedOptimizer (ZeRO-1 on its own)   DistributedDataParallel + ZeroRedundancyOptimizer
    dl.fully_shard, fp32                      FSDP2 fully_shard
    dl.fully_shard, bf16 params, fp32 reduce  FSDP2 fully_shard, MixedPrecisionPolicy(bf16, fp32)
    dl.fully_shard + dl.recompute per layer   FSDP2 fully_shard(checkpoint_wrapper(layer))
    dl.fully_shard HSDP, mesh=(2, 2)          FSDP2 fully_shard on a 2-D DeviceMesh (4 ranks)
    dl.tp.parallelize(plan=...) (Llama)       DTensor parallelize_module, Colwise/RowwiseParallel

Each is checked against one process on the same global batch (the loss of every step, and every parameter
after the last step) and against torch's implementation where one exists. fp32: 1e-5 relative (rounding
only: the ranks add the same numbers in another order). bf16 params with fp32 reduction: `BF16_TOL`;
against torch: 1e-5 (observed: equal to the bit).

One ``dl.launch`` per world size runs every case one after another (each model rebuilt from seed 0), so
the file costs two launches.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

import distlab as dl

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402  (here,
#                                                      not in each rank: forked ranks inherit the import)

B, S, STEPS, LR = 8, 16, 4, 1e-2
MODELS = ("llama", "gpt2")
#: fp32: the distributed ranks add the same terms as one process in another order (~1e-7 relative); AdamW's
#: division by sqrt(v) amplifies that in near-zero gradients, hence 1e-5 (the norm of each whole tensor).
FP32_TOL = 1e-5
#: bf16 compute, fp32 reduction: the reference (`_reference`) casts as fully_shard does and runs each rank's
#: slice through the same bf16 forward and backward, summing the slices' gradients in fp32, so again only the
#: order of fp32 additions differs (observed: 0). But one fp32 master weight a rounding apart can land on the
#: other side of a bf16 rounding boundary, a 2^-8 relative change of that weight in every later forward:
#: 1e-3. It still catches a bf16 reduce-scatter (reduce_dtype ignored: 3e-3 here). One process running the
#: whole batch in one bf16 pass lands 3.5e-2 away (Llama): bf16 sums of another shape, AdamW amplifying them.
BF16_TOL = 1e-3


def _build(kind: str):
    """The model from seed 0 (the same full weights on every rank and in the reference); no dropout."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S)
        return LlamaForCausalLM(cfg).train()
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def _layers(model) -> torch.nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1000 + step))


def _params(model, state: dict) -> dict:
    """The parameters of ``state`` under the names the plain model gives them (tied ones once; torch's
    checkpoint_wrapper prefix removed; DTensors made whole)."""
    state = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in state.items()}
    out = {}
    for name, _ in model.named_parameters():
        v = state[name]
        out[name] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().float()
    return out


# -- each layout: (module to call, optimizer, () -> full parameters, this rank's rows of the batch) ------
def _ddp(model, torch_side: bool):
    if torch_side:
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
    else:
        wrapped = dl.DDP(model)
    return wrapped, torch.optim.AdamW(model.parameters(), lr=LR), model.state_dict, _dp_rows()


def _zero(model, stage: int):
    z = dl.ZeRO(model, stage=stage, optim=torch.optim.AdamW, lr=LR)
    return z, z.optimizer, z.full_state_dict, _dp_rows()


def _sharded_optimizer(model, torch_side: bool):
    if torch_side:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        return wrapped, opt, model.state_dict, _dp_rows()
    return model, dl.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR), model.state_dict, \
        _dp_rows()


def _fully_shard(model, torch_side: bool, bf16: bool = False, recompute: bool = False, hsdp: bool = False):
    layers = _layers(model)
    if torch_side:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
            if bf16 else {}
        if hsdp:
            kw["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for i, layer in enumerate(layers):
            if recompute:                            # torchtitan's way: wrap, then shard the wrapper
                layer = layers[i] = checkpoint_wrapper(layer)
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model, torch.optim.AdamW(model.parameters(), lr=LR), model.state_dict, _dp_rows()
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    if hsdp:
        kw["mesh"] = (2, 2)
    for layer in layers:
        if recompute:
            dl.recompute(layer)
        dl.fully_shard(layer, **kw)
    dl.fully_shard(model, **kw)
    state = functools.partial(dl.full_state_dict, model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR), state, _dp_rows()


LLAMA_TP = {"model.embed_tokens": "embedding", "lm_head": "colwise_gather",
            **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
            "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}


def _tp(model, torch_side: bool):
    """Llama's attention reads its head count from the tensor (``view(*shape, -1, head_dim)``), so each rank
    runs its heads/t query and kv_heads/t key-value heads with no change; every rank sees the whole batch."""
    if torch_side:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        styles = {"embedding": RowwiseParallel(input_layouts=Replicate()), "colwise": ColwiseParallel(),
                  "colwise_gather": ColwiseParallel(output_layouts=Replicate()), "rowwise": RowwiseParallel()}
        mesh = init_device_mesh("cpu", (dl.world_size(),))
        parallelize_module(model, mesh, {k: styles[v] for k, v in LLAMA_TP.items()})
        state = model.state_dict
    else:
        dl.tp.parallelize(model, plan=LLAMA_TP)
        state = functools.partial(dl.tp.full_state_dict, model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR), state, slice(None)


def _dp_rows():
    return slice(dl.rank(), None, dl.world_size())       # equal rows per rank: the mean of means is the mean


P = functools.partial
CASES = {
    2: {"dl.DDP": P(_ddp, torch_side=False), "torch DDP": P(_ddp, torch_side=True),
        "dl.ZeRO-1": P(_zero, stage=1), "dl.ZeRO-2": P(_zero, stage=2), "dl.ZeRO-3": P(_zero, stage=3),
        "dl.ShardedOptimizer": P(_sharded_optimizer, torch_side=False),
        "torch ZeroRedundancyOptimizer": P(_sharded_optimizer, torch_side=True),
        "dl.fully_shard": P(_fully_shard, torch_side=False),
        "torch fully_shard": P(_fully_shard, torch_side=True),
        "dl.fully_shard bf16": P(_fully_shard, torch_side=False, bf16=True),
        "torch fully_shard bf16": P(_fully_shard, torch_side=True, bf16=True),
        "dl.fully_shard recompute": P(_fully_shard, torch_side=False, recompute=True),
        "torch fully_shard checkpoint": P(_fully_shard, torch_side=True, recompute=True),
        "dl.tp": P(_tp, torch_side=False), "torch tp": P(_tp, torch_side=True)},
    4: {"dl.fully_shard hsdp": P(_fully_shard, torch_side=False, hsdp=True),
        "torch fully_shard hsdp": P(_fully_shard, torch_side=True, hsdp=True)},
}
#: the torch case each distlab case is compared with (None: torch has no such wrapper)
PAIRS = {"dl.DDP": "torch DDP", "dl.ZeRO-1": "torch ZeroRedundancyOptimizer", "dl.ZeRO-2": None,
         "dl.ZeRO-3": "torch fully_shard", "dl.ShardedOptimizer": "torch ZeroRedundancyOptimizer",
         "dl.fully_shard": "torch fully_shard", "dl.fully_shard bf16": "torch fully_shard bf16",
         "dl.fully_shard recompute": "torch fully_shard checkpoint", "dl.tp": "torch tp",
         "dl.fully_shard hsdp": "torch fully_shard hsdp"}
#: GPT-2's Conv1D (weight stored (in, out)) is not an nn.Linear a plan splits. Llama's attention reads its
#: head count from the tensor since transformers 4.48 (before: ``view(b, s, self.num_heads, d)``, which a
#: plan cannot split without rewriting the module's head counts, as torchtitan does).
TP_CASES = ("dl.tp", "torch tp")
TP_MODELS = ("llama",) if tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (4, 48) else ()


def _train(kind: str, case: str, world: int) -> dict:
    model = _build(kind)
    names = _build(kind)                               # a plain twin, for the parameter names
    wrapped, opt, state, rows = CASES[world][case](model)
    losses = []
    for step in range(STEPS):
        ids = _ids(step)[rows]
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone().float()
        if rows != slice(None):                         # data parallel: the mean over ranks
            dist.all_reduce(total)
            total /= dl.world_size()
        losses.append(total.item())
    return {"losses": losses, "params": _params(names, state())}


def _rank(world: int) -> dict:
    return {(kind, case): _train(kind, case, world) for kind in MODELS for case in CASES[world]
            if case not in TP_CASES or kind in TP_MODELS}


@functools.cache
def _reference(kind: str, bf16: bool, chunks: int) -> dict:
    """One process, the whole batch, as ``chunks`` equal row slices (those the data-parallel ranks take;
    1 for tensor parallelism), each slice's mean loss / chunks: the mean over the batch, each slice's
    forward the very one its rank runs. bf16 as fully_shard computes it: a copy with bf16 parameters
    (buffers such as RoPE's frequencies stay fp32) runs forward and backward slice by slice, each slice's
    gradient cast to fp32 and summed there (reduce_dtype=fp32), AdamW updating the fp32 parameters."""
    model = _build(kind)
    opt, losses = torch.optim.AdamW(model.parameters(), lr=LR), []
    for step in range(STEPS):
        ids, total = _ids(step), 0.0
        if not bf16:
            loss = sum(model(input_ids=ids[r::chunks], labels=ids[r::chunks]).loss for r in range(chunks))
            (loss / chunks).backward()
            total = loss.item() / chunks
        for r in range(chunks if bf16 else 0):
            work = copy.deepcopy(model)
            for p in work.parameters():
                p.data = p.data.to(torch.bfloat16)
            loss = work(input_ids=ids[r::chunks], labels=ids[r::chunks]).loss / chunks
            loss.backward()
            total += loss.item()
            for p, w in zip(model.parameters(), work.parameters()):
                p.grad = w.grad.float() if p.grad is None else p.grad + w.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def _no_key_bias(params: dict) -> dict:
    """GPT-2's key bias (the middle third of ``c_attn.bias``) left out: its exact gradient is zero (adding
    b_k to every key adds q.b_k to every score of a row, which softmax ignores), so what it receives is
    rounding noise, which AdamW's m / sqrt(v) turns into steps of about lr in either direction. Any
    other order of the same additions moves it by ~1e-5 (fp32), ~1e-2 (bf16); torch's wrappers, which add
    in the same order as distlab's, are compared on it too (`_compare`)."""
    out = dict(params)
    for name, v in params.items():
        if name.endswith("attn.c_attn.bias"):
            d = v.numel() // 3
            out[name] = torch.cat([v[:d], v[2 * d:]])          # q and v biases only
    return out


def _rel(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want)
    return max(((got[k] - v).norm() / v.norm()).item() for k, v in want.items())


def _loss_rel(got: list, want: list) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def _compare(world: int) -> list[str]:
    results = dl.launch(_rank, world_size=world, args=(world,), output="quiet").results
    wrong, report = [], []
    for (kind, case), got in results[0].items():
        if not case.startswith("dl."):
            continue
        bf16 = "bf16" in case
        tol = BF16_TOL if bf16 else FP32_TOL
        want = _reference(kind, bf16, 1 if case in TP_CASES else world)
        errs = {"loss": _loss_rel(got["losses"], want["losses"]), "params": _rel(_no_key_bias(got["params"]),
                                                                         _no_key_bias(want["params"]))}
        theirs = results[0].get((kind, PAIRS[case]))
        if theirs is not None:
            errs["loss vs torch"] = _loss_rel(got["losses"], theirs["losses"])
            errs["params vs torch"] = _rel(got["params"], theirs["params"])
        report.append(f"{kind} {case}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        limits = {k: (FP32_TOL if "torch" in k else tol) for k in errs}
        if any(errs[k] > limits[k] for k in errs):
            wrong.append(report[-1])
        for r in range(1, world):                    # every rank holds the same full model
            if _rel(results[r][(kind, case)]["params"], got["params"]) > 0:
                wrong.append(f"{kind} {case}: rank {r}'s parameters differ from rank 0's")
    print("\n".join(report))
    return wrong


@pytest.mark.parametrize("world", [2, 4])
def test_hugging_face_models_train_like_one_process_and_torch(world):
    wrong = _compare(world)
    assert not wrong, "\n".join(wrong)
