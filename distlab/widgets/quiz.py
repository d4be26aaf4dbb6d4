"""Interview quiz: conceptual questions plus numeric ones drawn from a seed and answered by
dl.theory; an explanation after each answer and a running score.

    q = dl.widgets.quiz(seed=0)
    q.controls["answer"].value = q.result.choices[0]
    q.controls["submit"].click()
    q.result.correct, q.result.score, q.result.explanation
    q.controls["next"].click()
"""
from __future__ import annotations

import html
import random
from dataclasses import dataclass

import ipywidgets as W

from distlab.widgets.base import Explorer
from distlab.widgets.quiz_bank import CONCEPTUAL, Question
from distlab.widgets.quiz_numeric import numeric_questions


def questions(seed: int = 0) -> list[Question]:
    """Every question, numeric ones drawn from ``seed``, conceptual choices shuffled, all in a
    seeded order: the same seed gives the same quiz."""
    rng = random.Random(seed)
    shuffled = []
    for q in CONCEPTUAL:
        order = list(range(len(q.choices)))
        rng.shuffle(order)
        shuffled.append(Question(q.topic, q.prompt, tuple(q.choices[i] for i in order), order.index(q.answer),
                                 q.explanation))
    every = shuffled + numeric_questions(rng)
    rng.shuffle(every)
    return every


@dataclass(frozen=True)
class QuizState:
    """Where the quiz stands: the current question, whether it was answered and right, the score."""

    index: int
    total: int
    question: Question
    answered: bool
    correct: bool | None
    score: int
    attempted: int

    @property
    def choices(self) -> tuple[str, ...]:
        return self.question.choices

    @property
    def explanation(self) -> str:
        return self.question.explanation if self.answered else ""


class Quiz(Explorer):
    title = "Distributed training interview quiz"

    def __init__(self, seed: int = 0):
        self.questions = questions(seed)
        self.index, self.score, self.attempted = 0, 0, 0
        self.verdict: bool | None = None
        self.nudged = False                     # Submit pressed with no choice made
        submit, following = W.Button(description="Submit"), W.Button(description="Next question")
        submit.on_click(lambda _button: self.submit())
        following.on_click(lambda _button: self.next())
        first = self.questions[0]
        self.heading = W.HTML()                 # the question, drawn above its choices and buttons
        super().__init__({
            "answer": W.RadioButtons(options=first.choices, value=None, layout={"width": "max-content"}),
            "submit": submit,
            "next": following,
        })
        self.widget.children = (self.widget.children[0], self.heading, *self.widget.children[1:])

    def submit(self) -> None:
        """Mark the selected answer (once per question) and show the explanation; with no choice made,
        ask for one."""
        chosen = self.value("answer")
        if self.verdict is None and chosen is None:
            self.nudged = True
            self.update()
        if self.verdict is not None or chosen is None:
            return
        question = self.questions[self.index]
        self.verdict = question.choices.index(chosen) == question.answer
        self.score += self.verdict
        self.attempted += 1
        self.update()

    def next(self) -> None:
        """Move to the next question (wrapping round at the end)."""
        with self.hold():
            self.index = (self.index + 1) % len(self.questions)
            self.verdict, self.nudged = None, False
            radio = self.controls["answer"]
            radio.options, radio.value = self.questions[self.index].choices, None

    def compute(self) -> QuizState:
        return QuizState(self.index, len(self.questions), self.questions[self.index],
                         self.verdict is not None, self.verdict, self.score, self.attempted)

    def render(self, result: QuizState):
        """The question goes in the heading above the choices; the verdict below the buttons."""
        q = result.question
        self.heading.value = (f"<p><b>Question {result.index + 1} of {result.total}</b> "
                              f"({html.escape(q.topic)}) score {result.score}/{result.attempted}</p>"
                              f"<p>{html.escape(q.prompt)}</p>")
        if not result.answered:
            waiting = self.nudged and self.value("answer") is None
            return None, "<p><i>Choose an answer above, then press Submit.</i></p>" if waiting else ""
        right = html.escape(q.choices[q.answer])
        verdict = "Right." if result.correct else f"Not quite: the answer is {right}."
        return None, f"<p><b>{verdict}</b> {html.escape(q.explanation)}</p>"


def quiz(seed: int = 0) -> Quiz:
    """An interactive quiz of at least 40 questions; see :class:`Quiz`."""
    return Quiz(seed)
