"""Widgets without a browser: set controls, click buttons, read .result and the figures."""
import ipywidgets as W
import pytest

from distlab import theory, widgets


def test_memory_calculator_follows_its_controls():
    w = widgets.memory_calculator()
    assert isinstance(w.widget, W.VBox) and set(w.controls) >= {"model", "zero", "dp", "tp", "pp", "seq_len"}
    before = w.result.memory.total
    w.controls["zero"].value = 3
    expected = theory.memory("llama2-7b", dp=8, zero=3, seq_len=2048)
    assert w.result.memory == expected and w.result.memory.total < before
    assert set(w.result.fits) == set(theory.GPUS)
    assert w.result.fits["h100-80gb"] == theory.fits(expected, "h100-80gb")
    assert w.result.cheapest is not None and theory.fits(w.result.cheapest.memory, w.result.cheapest.gpu)
    bars = w.figure.axes[0].patches
    assert len(bars) == 4                               # one stage, four categories stacked
    assert bars[3].get_height() == pytest.approx(expected.activations / theory.GB)


def test_memory_calculator_pipeline_stages_and_custom_model():
    w = widgets.memory_calculator()
    w.controls["pp"].value = 4
    stages = w.result.stages
    assert len(stages) == 4 and stages[0].activations > stages[3].activations > 0
    assert len(w.figure.axes[0].patches) == 16
    with w.hold():
        w.controls["model"].value = "custom"
        w.controls["params_b"].value = 7.0
        w.controls["master_weights"].value = False
        w.controls["dp"].value = 1
        w.controls["pp"].value = 1
    assert w.result.total_gb == pytest.approx(84.0)     # 12 bytes per parameter
    assert w.result.cheapest is None                    # no shape, no search


def test_bubble_explorer_matches_theory_and_draws_every_action():
    w = widgets.bubble_explorer("1f1b", p=4, m=8)
    assert w.result.simulated == pytest.approx(3 / 11) == pytest.approx(w.result.predicted)
    assert len(w.figure.axes[0].patches) == 4 * 8 * 2
    w.controls["schedule"].value = "zb-h1"
    assert w.result.simulated == pytest.approx(w.result.predicted)
    assert w.result.simulated < 3 / 11
    assert len(w.figure.axes[0].patches) == 4 * 8 * 3
    w.controls["schedule"].value = "interleaved"
    w.controls["m"].value = 6
    assert w.result.timeline is None and "multiple of stages" in w.result.error and w.figure is None
    w.controls["m"].value = 8
    assert w.result.simulated == pytest.approx(theory.bubble("interleaved", 4, 8, v=2))
    w.controls["t_comm"].value = 0.5
    assert w.result.predicted is None and w.result.simulated > theory.bubble("interleaved", 4, 8, v=2)


def test_allreduce_explorer_picks_ring_for_big_and_tree_for_small_messages():
    w = widgets.allreduce_explorer(n=8, size_mb=100.0, link="nvlink4")
    assert w.result.fastest == "ring"
    card = theory.link("nvlink4")
    assert w.result.seconds["ring"] == pytest.approx(
        theory.comm_time("all_reduce", 100e6, 8, card.bandwidth, card.latency))
    with w.hold():
        w.controls["n"].value = 1024
        w.controls["size_mb"].value = 0.001
        w.controls["link"].value = "ethernet-100g"
    assert w.result.fastest == "tree"
    assert len(w.figure.axes[0].get_lines()) == 6       # three curves, three markers


def test_advisor_walks_the_guide():
    w = widgets.advisor("llama2-7b", "h100-80gb", 8)
    assert w.result.plan is not None and w.result.steps[0][1].startswith("no")
    w.controls["model"].value = "llama3-405b"
    assert w.result.plan is None and "no layout" in w.result.steps[-1][1]
    w.controls["gpus"].value = 1024
    assert (w.result.plan.zero, w.result.plan.recompute, w.result.plan.tp) == (3, "full", 1)
    w.controls["full_recompute"].value = False
    assert w.result.plan is not None and w.result.plan.pp > 1 and w.result.plan.tp == 8


def test_quiz_has_40_questions_with_right_answers_checked_by_theory():
    q = widgets.quiz(seed=3)
    assert len(q.questions) >= 40
    topics = {x.topic for x in q.questions}
    assert {"DP vs TP", "ZeRO", "Bubbles", "Collectives", "Memory math", "Failure modes", "Scaling"} <= topics
    for question in q.questions:
        assert len(set(question.choices)) == len(question.choices) >= 3
        assert 0 <= question.answer < len(question.choices)
    one_f_one_b = next(x for x in q.questions if x.prompt.startswith("1F1B pipeline"))
    p, m = (int(one_f_one_b.prompt.split(s)[1].split()[0].rstrip(",")) for s in ("p = ", "m = "))
    assert float(one_f_one_b.choices[one_f_one_b.answer]) == pytest.approx(theory.bubble("1f1b", p, m),
                                                                            rel=1e-3)
    assert [x.prompt for x in widgets.quiz(seed=3).questions] == [x.prompt for x in q.questions]
    assert [x.prompt for x in widgets.quiz(seed=4).questions] != [x.prompt for x in q.questions]


def test_quiz_scores_and_explains():
    q = widgets.quiz(seed=0)
    first = q.result
    assert not first.answered and first.explanation == ""
    q.controls["answer"].value = first.choices[(first.question.answer + 1) % len(first.choices)]
    q.controls["submit"].click()
    q.controls["submit"].click()                        # a second submit does not count twice
    assert (q.result.correct, q.result.score, q.result.attempted) == (False, 0, 1)
    assert q.result.explanation == first.question.explanation
    for _ in range(3):
        q.controls["next"].click()
        state = q.result
        assert q.controls["answer"].options == state.choices and not state.answered
        q.controls["answer"].value = state.choices[state.question.answer]
        q.controls["submit"].click()
        assert q.result.correct
    assert (q.result.score, q.result.attempted, q.result.index) == (3, 4, 3)


def test_quiz_right_answer_is_not_given_away_by_its_length():
    """A review found the right choice was the longest in 28 of 34 questions: a test-taker could
    score without reading. Now neither the longest nor the shortest choice is a tell."""
    from distlab.widgets.quiz_bank import CONCEPTUAL
    lengths = [[len(c) for c in q.choices] for q in CONCEPTUAL]
    right = [ls[q.answer] for ls, q in zip(lengths, CONCEPTUAL)]
    longest = sum(r == max(ls) for r, ls in zip(right, lengths))
    shortest = sum(r == min(ls) for r, ls in zip(right, lengths))
    assert longest <= len(CONCEPTUAL) / 3 and shortest <= len(CONCEPTUAL) / 3, (longest, shortest)


def test_quiz_question_sits_above_its_choices_and_buttons():
    q = widgets.quiz(seed=0)
    children = list(q.widget.children)
    holding_choices = next(i for i, c in enumerate(children)
                           if q.controls["answer"] in getattr(c, "children", ()))
    assert children.index(q.heading) < holding_choices < children.index(q.output)
    assert q.result.question.prompt in q.heading.value
    q.controls["next"].click()
    assert q.result.question.prompt in q.heading.value


def test_memory_plot_speaks_one_unit_and_labels_each_memory_size_once():
    w = widgets.memory_calculator()
    ax = w.figure.axes[0]
    title = ax.get_title()
    assert "GiB" not in title and ax.get_ylabel() == "GB per GPU"
    said = w.output.outputs[0]["data"]["text/html"]
    assert f"{w.result.total_gb:.1f} GB on the fullest GPU" in title
    assert f"{w.result.total_gb:.1f} GB</b>" in said    # the text: the same figure and unit
    labels = [t.get_text() for t in ax.texts]
    assert len(labels) == len({card.memory for card in theory.GPUS.values()})   # 80 GB cards share one
    assert any("a100-80gb" in t and "h100-80gb" in t for t in labels)
