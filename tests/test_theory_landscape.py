"""dl.theory.landscape held to its sources: Megatron's per-layer FLOPs and all-reduces, and the published
figures of GPT-3 (Brown et al. 2020), Llama 2 (Touvron et al. 2023) and PaLM (Chowdhery et al. 2022)."""
import pytest

from distlab import theory
from distlab.theory import landscape
from distlab.theory.sim import layer_flops

INSIDE = ("nvlink3", "nvlink4")
ACROSS = ("ib-hdr", "ib-ndr", "ethernet-100g", "ethernet-400g")


def test_layer_flops_is_narayanan_eq3_for_gpt3():
    # Narayanan et al. 2021, Eq. 3: one GPT layer's forward is 24 B s h^2 + 4 B s^2 h FLOPs
    shape = theory.model("gpt3-175b")
    s, b, h = 2048, 3, shape.hidden
    assert layer_flops(shape, s, b)[0] == 24 * b * s * h * h + 4 * b * s * s * h


def test_tp_layer_time_is_four_all_reduces_against_three_forwards():
    shape = theory.model("llama2-70b")
    r = theory.tp_layer_time("llama2-70b", "nvlink4", tp=8, seq_len=4096, mfu=0.5)
    message = 4096 * 8192 * 2                                  # (s, b, h) in bf16: 64 MiB
    assert r.message == message == 64 * 2 ** 20
    ring = 2 * 7 / 8 * message / 450e9 + 2 * 7 * 2e-6          # Thakur et al.: 2(n-1)/n S/B + 2(n-1) alpha
    assert r.comm == pytest.approx(4 * ring, rel=1e-12)
    assert r.compute == pytest.approx(3 * layer_flops(shape, 4096, 1)[0] / 8 / (989e12 * 0.5), rel=1e-12)
    assert r.ratio == pytest.approx(r.comm / r.compute)


def test_tp_stays_inside_the_node():
    for model in ("llama2-70b", "gpt3-175b", "llama3-405b"):
        ratios = {name: theory.tp_layer_time(model, name, tp=8).ratio for name in INSIDE + ACROSS}
        assert all(ratios[name] < 0.35 for name in INSIDE), ratios
        # across nodes the exposed all-reduces take about as long as the matmuls or longer: the layer's
        # time nearly doubles (GPT-3's h = 12288 gives the most FLOPs per byte: 0.88 on NDR)
        assert all(ratios[name] > 0.8 for name in ACROSS), ratios
        assert min(ratios[n] for n in ACROSS) > 5 * ratios["nvlink4"]
        if model == "llama2-70b":
            assert all(ratios[name] > 1.0 for name in ACROSS), ratios
        # the same layer: slower link, longer wait, in the order of the bandwidths
        by_bandwidth = sorted(INSIDE + ACROSS, key=lambda n: -theory.link(n).bandwidth)
        assert [ratios[n] for n in by_bandwidth[:3]] == sorted(ratios[n] for n in by_bandwidth[:3])


def test_tp_layer_time_refuses_bad_input():
    with pytest.raises(ValueError, match="tp >= 2"):
        theory.tp_layer_time("llama2-70b", "nvlink4", tp=1)
    with pytest.raises(ValueError, match="fractions"):
        theory.tp_layer_time("llama2-70b", "nvlink4", mfu=1.5)
    with pytest.raises(ValueError, match="unknown link preset"):
        theory.tp_layer_time("llama2-70b", "carrier-pigeon")


def test_ethernet_400g_preset():
    assert theory.link("ethernet-400g").bandwidth == 400e9 / 8


def test_gpt3_published_compute():
    run = theory.run_cost("GPT-3 175B", price_per_hour=2.0, gpu="a100-80gb", mfu=0.4)
    assert run.flops == 3.14e23                                          # Table D.1
    six_nd = 6 * theory.model("gpt3-175b").params * 300e9
    assert six_nd == pytest.approx(3.14e23, rel=2e-3)                    # 6 N D reproduces the table
    assert 3640 * landscape.PF_DAY == pytest.approx(3.14e23, rel=2e-3)   # and so do its 3,640 PF-days
    assert run.accelerator_hours == pytest.approx(3.14e23 / (312e12 * 0.4) / 3600)
    assert set(run.modelled) == {"cost", "accelerator_hours", "mfu"}     # no hours were published


def test_llama2_70b_published_hours():
    run = theory.run_cost("Llama 2 70B", price_per_hour=2.0)
    assert run.accelerator_hours == 1_720_320 and run.accelerator_days == 71_680     # Table 2
    assert run.cost == 2.0 * 1_720_320
    implied = 6 * theory.model("llama2-70b").params * 2e12 / (1_720_320 * 3600 * 312e12)
    assert run.mfu == pytest.approx(implied) and 0.40 < run.mfu < 0.45
    assert run.wall_days(2000) == pytest.approx(1_720_320 / 2000 / 24)
    assert set(run.modelled) == {"cost", "flops", "mfu"}


def test_palm_540b_published_figures():
    run = theory.run_cost("PaLM 540B")
    assert 6 * 540e9 * 780e9 == pytest.approx(2527.2e21, rel=1e-4)       # 6 N D: 540B params x 780B tokens
    assert run.flops == 2527.2e21 and run.mfu == 0.462 and run.peak_flops == 275e12
    assert run.accelerator_hours == 6144 * 1200 + 3072 * 336
    # measured over steps vs over the wall clock: downtime and repeated steps cost a third
    assert 0.29 < run.utilisation < 0.32 < run.mfu
    at_mfu = landscape.accelerator_hours(run.flops, run.peak_flops, run.mfu) / 6144
    assert 850 < at_mfu < 950 < 1200
    assert run.modelled == ("cost",)


def test_every_published_figure_names_its_source():
    fields = ("tokens", "train_flops", "pf_days", "accelerator_hours", "mfu", "chips", "params",
              "peak_flops", "scaled_to")
    for name, run in landscape.published_runs().items():
        missing = [f for f in fields if run.get(f) is not None and f not in run["sources"]]
        assert not missing, f"{name}: no source for {missing}"


def test_run_cost_refuses_bad_input():
    with pytest.raises(ValueError, match="unknown run"):
        theory.run_cost("GPT-5")
    with pytest.raises(ValueError, match="price_per_hour"):
        theory.run_cost("PaLM 540B", price_per_hour=0)
    with pytest.raises(ValueError, match="mfu"):
        landscape.accelerator_hours(1e20, 1e15, 0.0)
