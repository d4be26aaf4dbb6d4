"""Dry runs of expert parallelism: on tensors without values the router's choices have none, so a dry run
routes the capacity-bound step (`parallel.expert.dispatch.at_capacity`: every expert receives its whole
capacity C = ceil(capacity_factor k T / E)). Model states equal `dl.theory.ep_memory` to the byte, the
all-to-all bytes `dl.theory.moe_step_all_to_all_bytes` at capacity, and a real run whose router fills
every expert exactly to capacity saves the same activations."""
from __future__ import annotations

import pytest
import torch

import distlab as dl

CFG = dl.models.PRESETS["gpt-moe-tiny"]               # h 32, 2 layers, E 4, k 2, capacity factor 1.25


def _theory():
    return dl.theory.gpt_moe_params(CFG.vocab, CFG.seq_len, CFG.d_model, CFG.layers, CFG.experts, CFG.top_k,
                                    ffn=CFG.mlp_ratio * CFG.d_model, tied=CFG.tied)


@pytest.mark.parametrize("layout, world, ranks, ep, opts", [
    ("ep", 4, [0, 3], 4, {}), ("3d:dp=256,ep=4", 1024, [1023], 4, {}), ("3d:dp=2,ep=2", 4, [1], 2, {}),
    ("ep", 4, [2], 1, {"experts": "replicated"}),                  # every expert here: no all-to-all
])
def test_ep_dry_run_model_states_and_all_to_all_equal_the_theory(layout, world, ranks, ep, opts):
    """fp32 AdamW: 16 bytes per parameter a rank holds (dense + experts / ep), plus Adam's 4-byte step
    counter per parameter tensor; four all-to-alls per MoE layer and step, each sending the rank's share
    of every other rank's experts' capacity: k T h 4 (ep - 1) / ep bytes at T = capacity_factor x the
    rank's tokens (all of them kept, each expert full)."""
    report = dl.train(layout, model="gpt-moe-tiny", world_size=world, backend="fake", ranks=ranks,
                      options=opts)
    tensors = len(list(dl.models.build("gpt-moe-tiny").parameters()))
    held = dl.theory.ep_params_per_rank(_theory(), ep)
    tokens = CFG.seq_len                                           # a dry run: one row per rank
    cap = dl.theory.expert_capacity(tokens * world, CFG.experts, CFG.top_k, CFG.capacity_factor)
    assert cap * CFG.experts == CFG.capacity_factor * CFG.top_k * tokens * world     # no rounding here
    want_a2a = dl.theory.moe_step_all_to_all_bytes(CFG.capacity_factor * tokens, CFG.d_model, CFG.top_k,
                                                   ep, CFG.layers)
    for peak, comm in zip((m["peak"] for m in report.memory), report.comm):
        assert peak["params"] == peak["grads"] == 4 * held
        assert peak["params"] + peak["grads"] + peak["optimizer"] == dl.theory.ep_memory(_theory(), ep) \
            + 4 * tensors
        assert comm["sent_by_op"].get("all_to_all", 0) == want_a2a
        assert peak["activations"] > 0


class _Balanced(torch.nn.Module):
    """A router that sends token t to experts (t + c) mod E, c < k: every expert gets k T / E of every
    part's tokens, exactly its capacity at capacity factor 1. Scores still from the gate (for gradients)."""

    def __init__(self, router):
        super().__init__()
        self.gate, self.top_k = router.gate, router.top_k

    def forward(self, x):
        probs = self.gate(x).float().softmax(dim=-1)
        t = torch.arange(x.shape[0], device=x.device)[:, None]
        expert = (t + torch.arange(self.top_k, device=x.device)) % probs.shape[-1]
        weight = probs.gather(1, expert)
        return probs, expert, weight / weight.sum(dim=-1, keepdim=True)


def _moe_layer_bytes(capacity_factor: float) -> int:
    torch.manual_seed(0)
    with torch.device(dl.device()):
        layer = dl.ep.MoE(hidden=32, ffn=64, experts=4, top_k=2, capacity_factor=capacity_factor)
        layer.router = _Balanced(layer.router)
        x = torch.randn(16, 32)                                         # 16 tokens per rank
    return dl.memory.measure_layer(layer, x)


def test_ep_dry_run_activations_equal_a_real_run_routed_to_capacity():
    """At capacity factor 1 a balanced router fills every expert exactly: the real 2-rank gloo run saves
    what the dry run counts, to the byte. At 1.25 the real run is unchanged (the same rows, nothing
    dropped) and the dry run counts 25% more expert rows: the capacity bound, which no real step of
    k T pairs can fill (E C = 1.25 k T slots)."""
    real = {cf: dl.launch(_moe_layer_bytes, world_size=2, args=(cf,), output="quiet").results
            for cf in (1.0, 1.25)}
    dry = {cf: dl.launch(_moe_layer_bytes, world_size=2, args=(cf,), backend="fake", ranks=(0, 1),
                         output="quiet").results for cf in (1.0, 1.25)}
    assert dry[1.0] == real[1.0] == real[1.25]
    assert all(d > r for d, r in zip(dry[1.25], real[1.25]))
