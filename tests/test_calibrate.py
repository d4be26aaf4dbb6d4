"""`dl.theory.calibrate`: the simulator on a machine whose ranks share CPU cores.

Pure checks (no ranks): processor sharing worked by hand, the fit recovering constants it was given,
CPU time as the step without its bubble. One small real run: THE loop stamps CPU seconds on its step
marks, and they grow.
"""
from __future__ import annotations

import pytest

from distlab.theory import calibrate, sim
from distlab.theory.presets import LinkPreset, ModelPreset

SHAPE = ModelPreset("gpt-small", 128, 4, 8, 256, 64)
LINK = LinkPreset("loopback", 2e9, 50e-6)
RUNS = {"single": (1, dict(micro_batch=16)), "ddp": (2, dict(micro_batch=8)),
        "pp": (2, dict(pp=2, micro_batch=4)), "zero3": (2, dict(zero=3, micro_batch=8)),
        "tp": (2, dict(tp=2, micro_batch=16)), "3d": (4, dict(tp=2, pp=2, micro_batch=4))}


def _predict(name, eff):
    ranks, layout = RUNS[name]
    return calibrate.predict(SHAPE, ranks, LINK, eff, **layout)


def test_processor_sharing_by_hand():
    # 2 cores, work 6, 12, 18, 24: all four at 1/2 until t=12 (job 0 done), then three at 2/3 ...
    assert [round(t, 6) for t in calibrate.processor_sharing([6, 12, 18, 24], 2)] == [12, 21, 27, 33]
    assert calibrate.processor_sharing([6, 12, 18, 24], 4) == [6, 12, 18, 24]
    assert calibrate.core_share(4, 2) == 0.5 and calibrate.core_share(2, 2) == 1.0
    assert calibrate.core_share(2, 2, others=2) == 0.5
    with pytest.raises(ValueError, match="cores"):
        calibrate.processor_sharing([1.0], 0)
    with pytest.raises(ValueError, match="ranks >= 1"):
        calibrate.core_share(0, 2)


def test_busy_is_the_step_without_its_bubble_and_wall_stretches_only_the_work():
    eff = sim.Efficiency(compute=50.0, comm=1.0, overhead=0.01, per_action=0.001)
    pp = _predict("pp", eff)
    assert pp.breakdown["bubble"] > 0
    assert calibrate.busy(pp) == pytest.approx(pp.step_time - pp.breakdown["bubble"])
    assert calibrate.wall(pp, 0.5) == pytest.approx(2 * calibrate.busy(pp) + pp.breakdown["bubble"])
    ddp = _predict("ddp", eff)
    assert ddp.breakdown["bubble"] == pytest.approx(0.0, abs=1e-12)
    # the same FLOPs per rank in ddp and tp on 2 ranks, half that in 3d on 4 ranks
    assert _predict("3d", eff).breakdown["compute"] == pytest.approx(ddp.breakdown["compute"] / 2)
    assert _predict("tp", eff).breakdown["compute"] == pytest.approx(ddp.breakdown["compute"])


def test_fit_recovers_the_constants_it_was_given_and_predicts_the_rest():
    truth = sim.Efficiency(compute=70.0, comm=1.0, overhead=0.02, per_action=0.0015, per_collective=0.0004)
    unit = sim.Efficiency(compute=1.0, comm=1.0)
    for fitted in (("single", "ddp", "pp", "tp"), ("single", "zero3", "pp", "3d", "tp")):
        cpu = [calibrate.busy(_predict(n, truth)) for n in fitted]
        eff = calibrate.fit([_predict(n, unit) for n in fitted], cpu)
        assert eff.compute == pytest.approx(70.0) and eff.overhead == pytest.approx(0.02)
        assert eff.per_action == pytest.approx(0.0015) and eff.per_collective == pytest.approx(0.0004)
        for name in RUNS:
            assert calibrate.busy(_predict(name, eff)) == pytest.approx(calibrate.busy(_predict(name, truth)))


def test_tp_collectives_counts_what_sim_charges_per_collective():
    base = sim.Efficiency(compute=50.0, comm=1.0)
    for name in RUNS:
        with_cost = _predict(name, sim.Efficiency(compute=50.0, comm=1.0, per_collective=1.0))
        extra = calibrate.busy(with_cost) - calibrate.busy(_predict(name, base))
        assert extra == pytest.approx(calibrate.tp_collectives(with_cost))
    assert calibrate.tp_collectives(_predict("tp", base)) == 16        # 4 layers x (2 forward + 2 backward)
    assert calibrate.tp_collectives(_predict("3d", base)) == 32        # 4 microbatches x 2 layers x 4


def test_fit_drops_what_the_runs_cannot_see_or_what_comes_out_negative():
    truth = sim.Efficiency(compute=70.0, comm=1.0, overhead=0.02, per_action=0.0015)
    unit = sim.Efficiency(compute=1.0, comm=1.0)
    fitted = ("single", "ddp", "pp")                                 # no TP run: per_collective unseen
    cpu = [calibrate.busy(_predict(n, truth)) for n in fitted]
    eff = calibrate.fit([_predict(n, unit) for n in fitted], cpu)
    assert eff.per_collective == 0.0 and eff.per_action == pytest.approx(0.0015)
    cheap_pp = [0.0, 0.0, -0.012]               # pp's 6 extra actions cost 9 ms: 12 ms less is negative
    cpu = [calibrate.busy(_predict(n, truth)) + d for n, d in zip(fitted, cheap_pp)]
    eff = calibrate.fit([_predict(n, unit) for n in fitted], cpu)
    assert eff.per_action == 0.0 and eff.compute > 0


def test_fit_refuses_what_cannot_determine_it():
    unit = sim.Efficiency(compute=1.0, comm=1.0)
    with pytest.raises(ValueError, match=">= 3 runs"):
        calibrate.fit([_predict("ddp", unit)], [0.05])
    same = [_predict(n, unit) for n in ("ddp", "zero3", "tp", "pp")]       # the same FLOPs per rank
    with pytest.raises(ValueError, match="do not determine"):
        calibrate.fit(same, [0.05, 0.06, 0.07, 0.06])
    with pytest.raises(ValueError, match="cannot determine 4 constants"):
        calibrate.fit([_predict(n, unit) for n in ("single", "pp", "tp")], [0.09, 0.06, 0.07])


def test_the_loop_stamps_cpu_seconds_on_every_step():
    import distlab as dl
    report = dl.train("ddp", world_size=2, model="gpt-tiny", steps=3, seed=0, global_batch=4)
    for rank in range(2):
        marks = sorted(report.trace.select("mark", rank=rank, name="step"), key=lambda e: e.start)
        cpu = [m.args["cpu"] for m in marks]
        assert len(cpu) == 3 and all(b > a for a, b in zip(cpu, cpu[1:]))


def test_fit_link_inverts_the_ring_all_reduce_of_theory_comm():
    from distlab.theory.comm import comm_time
    n, alpha, beta = 2, 60e-6, 1.5e9
    small, large = 64, 4 << 20
    # the small message's bytes are not quite zero: alpha comes out a hair high, beta a hair low
    link = calibrate.fit_link(n, (small, comm_time("all_reduce", small, n, beta, alpha)),
                              (large, comm_time("all_reduce", large, n, beta, alpha)))
    assert link.latency == pytest.approx(alpha, rel=1e-3) and link.bandwidth == pytest.approx(beta, rel=1e-3)
    with pytest.raises(ValueError, match="larger message"):
        calibrate.fit_link(2, (64, 1e-3), (1 << 20, 1e-3))
