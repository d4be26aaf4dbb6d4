"""dl.theory held to published figures (ZeRO paper, Korthikanti et al., nccl-tests, model cards)."""
import pytest

from distlab import theory
from distlab.theory import GB


def test_no_torch_in_theory():
    import pathlib
    for path in pathlib.Path(theory.__file__).parent.glob("*.py"):
        assert "import torch" not in path.read_text(), path


@pytest.mark.parametrize("params, kwargs, expected_gb", [
    (7e9, dict(precision="bf16-mixed", master_weights=False), 84),     # 12 bytes/param
    (7e9, dict(precision="fp32"), 112),                                # 4 + 4 + 8
    (70e9, dict(precision="bf16-mixed", master_weights=False), 840),
    (7e9, dict(precision="bf16-mixed"), 112),                          # 2 + 2 + 12
    (7e9, dict(optimizer="sgd", precision="fp32"), 56),
    (7e9, dict(optimizer="sgd-momentum", precision="fp32"), 84),
])
def test_model_state_bytes_match_published_figures(params, kwargs, expected_gb):
    assert theory.memory(params, **kwargs).total / GB == pytest.approx(expected_gb)


@pytest.mark.parametrize("stage, expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_on_64_gpus(stage, expected_gb):
    b = theory.memory(7.5e9, dp=64, zero=stage)        # ZeRO paper Fig. 1: K = 12, 2 + 2 + K
    assert round(b.total / GB, 1) == expected_gb


def test_zero_shards_each_category_in_turn():
    full = theory.memory(1_000_003, dp=4)
    z1, z2, z3 = (theory.memory(1_000_003, dp=4, zero=s) for s in (1, 2, 3))
    shard = theory.shard_numel(1_000_003, 4)
    assert shard == 250_001
    assert (z1.params, z1.grads, z1.optimizer) == (full.params, full.grads, 12 * shard)
    assert (z2.params, z2.grads) == (full.params, 2 * shard)
    assert (z3.params, z3.grads, z3.optimizer) == (2 * shard, 2 * shard, 12 * shard)


def test_shard_numel_pads_the_last_rank():
    assert [theory.shard_numel(n, 4) for n in (8, 9, 11, 12)] == [2, 3, 3, 3]
    with pytest.raises(ValueError, match=">= 1"):
        theory.shard_numel(10, 0)


def test_tensor_and_pipeline_degrees_split_weights():
    assert theory.memory(8e9, tp=2, pp=4).params == 2 * 1e9


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        theory.memory(1e9, precision="int3")
    with pytest.raises(ValueError, match="choose one of"):
        theory.memory(1e9, optimizer="lion9")
    with pytest.raises(ValueError, match="zero must be"):
        theory.memory(1e9, zero=4)
    with pytest.raises(ValueError, match="hidden, heads and layers"):
        theory.memory(1e9, seq_len=128)
    with pytest.raises(ValueError, match="unknown model preset"):
        theory.memory("gpt-5")


def test_gpt_closed_form_and_presets_match_model_cards():
    h, L, v = 768, 12, 50257
    assert theory.transformer_params(h, L, v, heads=12) == theory.gpt_params(h, L, v)
    assert theory.transformer_params(h, L, v, heads=12, positions=1024) == 124_439_808   # GPT-2 small
    # released checkpoints: parameter counts printed by the HF model cards / config sums
    assert theory.model("llama2-7b").params == 6_738_415_616
    assert theory.model("llama2-70b").params == 68_976_648_192
    assert theory.model("llama3-8b").params == 8_030_261_248
    assert theory.model("llama3-405b").params == pytest.approx(405.85e9, rel=1e-3)
    assert theory.model("gpt3-175b").params == pytest.approx(175e9, rel=0.01)


def test_activation_memory_forms_of_korthikanti():
    s, b, h, a, t = 2048, 1, 12288, 96, 8          # GPT-3 175B layer
    sbh = s * b * h
    assert theory.activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert theory.activation_bytes_per_layer(s, b, h, a, tp=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert (theory.activation_bytes_per_layer(s, b, h, a, tp=t, sp=True)
            == pytest.approx(sbh * (34 + 5 * a * s / h) / t))
    assert (theory.activation_bytes_per_layer(s, b, h, a, tp=t, sp=True, recompute="selective")
            == pytest.approx(34 * sbh / t))
    assert theory.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * sbh


def test_pipeline_in_flight_and_activation_total():
    assert theory.pipeline_in_flight("gpipe", 4, 16) == 16
    assert theory.pipeline_in_flight("1f1b", 4, 16) == 4
    assert theory.pipeline_in_flight("1f1b", 4, 2) == 2
    assert theory.pipeline_in_flight("interleaved", 4, 8, v=2) == pytest.approx(4 * (1 + 3 / 8))
    one = theory.memory("llama2-7b", seq_len=4096, recompute="selective").activations
    staged = theory.memory("llama2-7b", seq_len=4096, recompute="selective", pp=4, microbatches=8).activations
    assert staged == pytest.approx(one)             # 1F1B: p microbatches x L/p layers = L layers


def test_ring_all_reduce_time_is_2_n_minus_1_over_n_s_over_b():
    s, bw = 1e9, 100e9
    for n in (2, 4, 8, 64):
        assert theory.comm_time("all_reduce", s, n, bw) == pytest.approx(2 * (n - 1) / n * s / bw)
    assert theory.comm_time("all_reduce", s, 8, bw, latency=1e-5) == pytest.approx(14 * 1e-5 + 1.75 * s / bw)
    assert theory.comm_time("all_gather", s, 4, bw) == pytest.approx(0.75 * s / bw)
    assert theory.comm_time("all_reduce", s, 1, bw) == 0.0


def test_algorithms_trade_latency_for_bandwidth():
    small, big, n, bw, lat = 1e3, 1e9, 64, 50e9, 5e-6

    def ring(s):
        return theory.comm_time("all_reduce", s, n, bw, lat, "ring")

    def tree(s):
        return theory.comm_time("all_reduce", s, n, bw, lat, "tree")

    def naive(s):
        return theory.comm_time("all_reduce", s, n, bw, lat, "naive")

    assert tree(small) < ring(small)                # log n latency wins for small messages
    assert ring(big) < tree(big) < naive(big)       # bandwidth-optimal ring wins for large ones
    assert theory.comm_time("broadcast", big, n, bw, algorithm="tree") == pytest.approx(6 * big / bw)
    with pytest.raises(ValueError, match="choose one of"):
        theory.comm_time("allreduce", big, n, bw)


def test_busbw_matches_nccl_tests_definition():
    assert theory.busbw("all_reduce", 1e9, 0.1, 8) == pytest.approx(1e10 * 2 * 7 / 8)
    assert theory.busbw("all_gather", 1e9, 0.1, 8) == pytest.approx(1e10 * 7 / 8)
    assert theory.busbw("broadcast", 1e9, 0.1, 8) == theory.algbw(1e9, 0.1)
    t = theory.comm_time("all_reduce", 1e9, 16, 25e9)
    assert theory.busbw("all_reduce", 1e9, t, 16) == pytest.approx(25e9)   # ring saturates the link


def test_step_volumes():
    psi = 2 * 7e9
    assert theory.dp_volume(psi, 8) == pytest.approx(2 * 7 / 8 * psi)
    assert theory.zero_volume(3, psi, 8) / theory.dp_volume(psi, 8) == pytest.approx(1.5)
    assert theory.tp_volume(2048, 1, 4096, tp=2) == pytest.approx(4 * 2048 * 4096 * 2)
    assert theory.pp_volume(2048, 1, 4096, microbatches=8) == 2 * 8 * 2048 * 4096 * 2


def test_fsdp_volume_by_link_and_padding():
    psi = 4 * 1e6
    v = theory.fsdp_volume(psi, shards=8)                                   # plain FSDP: ZeRO-3
    assert v["shard"] == pytest.approx(theory.zero_volume(3, psi, 8)) and v["replicate"] == 0
    assert theory.fsdp_volume(psi, 8, reshard_after_forward=False)["shard"] == pytest.approx(2 * 7 / 8 * psi)
    mixed = theory.fsdp_volume(psi / 2, 8, grad_bytes=psi)                  # bf16 gathers, fp32 reduce
    assert mixed["shard"] == pytest.approx((psi + psi) * 7 / 8)
    h = theory.fsdp_volume(psi, shards=4, replicas=2)                       # HSDP 2 x 4
    assert h["shard"] == pytest.approx(3 * 3 / 4 * psi)
    assert h["replicate"] == pytest.approx(2 * 1 / 2 * psi / 4)            # only 1/S crosses replicas
    with pytest.raises(ValueError, match="shards >= 1"):
        theory.fsdp_volume(psi, 0)
    shapes = [(5, 3), (5,), (7, 2)]                                          # 15 + 5 + 14 = 34 elements
    assert theory.fsdp_padding(shapes, 4, "flat") == 2                      # 36 - 34
    assert theory.fsdp_padding(shapes, 4) == 3 * 3 + 3 + 1 * 2              # rows 8, 8, 8 vs 5, 5, 7
    assert theory.fsdp_padding(shapes, 1) == theory.fsdp_padding(shapes, 1, "flat") == 0
    with pytest.raises(ValueError, match="per-param"):
        theory.fsdp_padding(shapes, 2, "rows")


@pytest.mark.parametrize("p, m", [(2, 1), (4, 8), (8, 32)])
def test_bubble_gpipe_and_1f1b(p, m):
    for name in ("gpipe", "1f1b"):
        assert theory.bubble(name, p, m) == pytest.approx((p - 1) / (m + p - 1))
        assert theory.bubble(name, p, m, convention="ideal") == pytest.approx((p - 1) / m)
        assert theory.bubble(name, p, m, t_b=2.0) == pytest.approx((p - 1) / (m + p - 1))


def test_bubble_interleaved_zero_bubble_dualpipe():
    assert theory.bubble("interleaved", 4, 8, v=2) == pytest.approx(3 / 19)
    assert theory.bubble("interleaved", 4, 8, v=2, convention="ideal") == pytest.approx(3 / 16)
    # Qi et al. 2023 Table 2 with T_F = T_I = T_W = 1: 1F1B 3(p-1), ZB-H1 (p-1), ZB-H2 0
    assert theory.bubble_time("1f1b", 4, 8, t_f=1, t_b=2) == 9
    assert theory.bubble_time("zb-h1", 4, 8, t_f=1, t_b=2, t_w=1) == 3
    assert theory.bubble_time("zb-h2", 4, 8, t_f=1, t_b=2, t_w=1) == 0
    assert theory.bubble_time("dualpipe", 8, 16, t_f=1, t_b=2, t_w=1, t_fb=3) == 3 * (3 + 2 - 3)
    with pytest.raises(ValueError, match="even"):
        theory.bubble("dualpipe", 3, 8)
    with pytest.raises(ValueError, match="choose one of"):
        theory.bubble("pipedream-2bw", 4, 8)
    with pytest.raises(ValueError, match="interleaved"):
        theory.bubble("1f1b", 4, 8, v=2)


def test_throughput_and_flops():
    assert theory.training_flops(7e9, 1e12) == 4.2e22
    days = theory.training_time(7e9, 2e12, gpus=1024, peak_flops=989e12, mfu=0.4) / 86400
    assert days == pytest.approx(6 * 7e9 * 2e12 / (1024 * 989e12 * 0.4) / 86400)
    assert 2 < days < 3
    assert theory.mfu(7e9, 3000, 1, 312e12) == pytest.approx(6 * 7e9 * 3000 / 312e12)
    assert theory.throughput(8, 100.0, 0.9) == 720.0
    assert theory.scaling_efficiency(720.0, 8, 100.0) == pytest.approx(0.9)
    assert theory.chinchilla_tokens(70e9) == 1.4e12


def test_offload_estimators_match_deepspeed():
    p = 6.7e9
    z2 = theory.zero2_offload(p, gpus_per_node=8, nodes=1)
    assert (z2.gpu, z2.cpu) == (2 * p, p * 32 * 1.5)
    z3 = theory.zero3_offload(p, largest_layer=2e8, gpus_per_node=8)
    assert (z3.gpu, z3.cpu) == (8e8, p * 18 * 1.5)


def test_presets_and_planner():
    assert theory.gpu("H100-80GB").bf16_flops == 989e12
    assert theory.link("ib_ndr").bandwidth == 50e9
    with pytest.raises(ValueError, match="choose one of"):
        theory.gpu("tpu-v5")
    small = theory.cheapest_plan("llama2-7b", seq_len=1024)
    assert small is not None and small.gpus == 1 and small.gpu == "h200-141gb"
    assert theory.fits(small.memory, "h200-141gb") and not theory.fits(small.memory, "a100-80gb")
    advice = theory.advise("llama3-70b", gpu="h100-80gb", gpus=64)
    assert any("ZeRO-3" in q and "selective" in q and a.startswith("no") for q, a in advice.steps)
    # ZeRO-3 with full recomputation is tried before tensor parallelism: 70B fits on 64 H100s at ~23 GB
    plan = advice.plan
    assert (plan.zero, plan.recompute, plan.tp, plan.pp) == (3, "full", 1, 1)
    assert plan.memory == theory.memory("llama3-70b", dp=64, zero=3, seq_len=4096, recompute="full")
    assert 22 * theory.GB < plan.memory.total < 24 * theory.GB
    refusing = theory.advise("llama3-70b", gpu="h100-80gb", gpus=64, full_recompute=False).plan
    assert (refusing.tp, refusing.pp, refusing.recompute) == (8, 1, "selective")
    assert refusing.memory.total > plan.memory.total       # TP costs more memory; it buys throughput
