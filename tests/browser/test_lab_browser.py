"""The lessons with widgets in a real browser, as `make lab` serves them: JupyterLab in headless
Chromium opens the learner's copy that `python -m distlab.lessons` writes (student/ and solved/).

1. Before any cell runs, every widget of the lesson is drawn from the state stored in the notebook
   (the copy is trusted; an untrusted notebook shows ``VBox(children=(HTML(...`` text instead), the
   calculator with the verdict of a fresh one, the quiz unanswered at 0/0.
2. Lesson 07 runs every cell; the quiz is still at 0/0 and the calculator as a fresh one stands (the
   demonstration cells drive second, undisplayed instances). Then the calculator is moved in the
   live DOM (a mouse drag and a key press on the "ZeRO stage" slider, the "dp" dropdown) and each
   time the verdict it displays must match :func:`distlab.theory.memory` and
   :func:`distlab.theory.fits` computed here, in the test process.

What this adds to the nbval run and tests/test_widgets.py, tests/test_lesson_widgets.py: the widget
front end really renders in JupyterLab (jupyterlab_widgets is installed and matches ipywidgets, the
stored state is complete and picked up), and a change made by a user in the browser travels over the
kernel's comm channel, is recomputed in the kernel and drawn back.

Runs in ~60-90 s on 2 cores. Skips without Chromium/chromedriver/selenium
(tests/browser/install_browser.sh installs them). Leaves a screenshot for the README in
docs/lesson07_memory_calculator.png.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import distlab.lessons as lessons
from distlab import theory

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
LESSON = REPO / "notebooks" / "07_interview_prep.ipynb"
SCREENSHOT = REPO / "docs" / "lesson07_memory_calculator.png"

# The calculator as the lesson displays it, memory_calculator("llama2-7b"), before and after "Run All":
# every other control at its default (see distlab/widgets/memory_calculator.py).
LESSON_STATE = dict(model="llama2-7b", precision="bf16-mixed", optimizer="adam", master_weights=True,
                    dp=8, zero=0, tp=1, pp=1, seq_len=2048, micro_batch=1, sp=False, recompute="none",
                    schedule="1f1b")
VIEW = "application/vnd.jupyter.widget-view+json"
UNANSWERED = "score 0/0"

# JavaScript run in the page (JupyterLab started with expose_app_in_browser).
NOTEBOOK_JS = "const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
READY_JS = NOTEBOOK_JS + """
return !!(nb && nb.content && nb.sessionContext && nb.sessionContext.session
          && nb.sessionContext.session.kernel
          && nb.sessionContext.session.kernel.connectionStatus === 'connected'
          && nb.sessionContext.session.kernel.status === 'idle');"""
PROGRESS_JS = NOTEBOOK_JS + """
const cells = nb.content.widgets.filter(c => c.model.type === 'code');
const errors = [];
for (const c of cells) for (const o of c.model.outputs.toJSON())
  if (o.output_type === 'error') errors.push(o.ename + ': ' + o.evalue);
return {code: cells.length, done: cells.filter(c => c.model.executionCount !== null).length,
        busy: nb.sessionContext.session.kernel.status, errors: errors};"""

CALCULATOR = ("//div[contains(@class,'widget-html')][.//b[normalize-space()='Memory per GPU']]"
              "/parent::div[contains(@class,'widget-vbox')]")
QUIZ_HEADING = ("//div[contains(@class,'widget-html')]"
                "[.//b[normalize-space()='Distributed training interview quiz']]"
                "/following-sibling::div[contains(@class,'widget-html')][1]")
# Each widget output of the notebook on screen: how it is drawn (a widget, or its text/plain fallback).
WIDGET_OUTPUTS_JS = NOTEBOOK_JS + """
const outs = [];
for (const c of nb.content.widgets) {
  if (c.model.type !== 'code') continue;
  const stored = c.model.outputs.toJSON();
  c.outputArea.widgets.forEach((w, i) => {
    const o = stored[i];
    if (!o || !o.data || !o.data['""" + VIEW + """']) return;
    const node = w.node.querySelector('.jp-OutputArea-output');
    outs.push({mime: node && node.getAttribute('data-mime-type'),
               drawn: !!(node && node.querySelector('.widget-vbox .widget-html')),
               text: node ? node.innerText.slice(0, 80) : ''});
  });
}
return outs;"""


def expected_verdict(**changes) -> str:
    """The total and the "fits" line the calculator shows, computed from dl.theory in this process."""
    state = {**LESSON_STATE, **changes}
    model = state.pop("model")
    breakdown = theory.memory(model, **state, stage=0)   # pp=1: the only stage is the fullest
    fits = ", ".join(f"{gpu} {'fits' if theory.fits(breakdown, gpu) else 'no'}" for gpu in theory.GPUS)
    return f"{breakdown.total / theory.GB:.1f} GB per GPU on the fullest stage\n{fits}"


def learners_copy(lab, monkeypatch) -> None:
    """What `make lab` writes before it starts JupyterLab (`python -m distlab.lessons lab`), into the
    server's root, trusted in the server's own Jupyter data dir."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(lab.data))
    lessons.copy(lab.root)


def with_widgets() -> list[str]:
    return [p.name for p in sorted(LESSON.parent.glob("[0-9][0-9]_*.ipynb"))
            if VIEW in p.read_text()]


def shows_every_widget(driver, lesson: Path) -> None:
    """The notebook on screen draws each of its stored widget views as a widget (no cell run)."""
    expected = sum(1 for cell in json.loads(lesson.read_text())["cells"]
                   for output in cell.get("outputs", ()) if VIEW in output.get("data", {}))
    wait(driver, lambda d: d.execute_script(READY_JS), 60, f"{lesson.name} and an idle kernel")
    try:
        wait(driver, lambda d: [o["drawn"] for o in d.execute_script(WIDGET_OUTPUTS_JS)] == [True] * expected,
             60, f"the {expected} widgets of {lesson.name} to be drawn from the stored state")
    except AssertionError as failure:
        raise AssertionError(f"{failure}: {driver.execute_script(WIDGET_OUTPUTS_JS)}") from None
    counts = driver.execute_script(PROGRESS_JS)
    assert counts["busy"] == "idle" and not counts["errors"]


def wait(driver, condition, timeout: float, what: str):
    """Poll ``condition`` (a redraw may swap elements under it: missing or stale ones mean "not yet")."""
    from selenium.common.exceptions import (NoSuchElementException, StaleElementReferenceException,
                                            TimeoutException)
    from selenium.webdriver.support.ui import WebDriverWait
    patient = WebDriverWait(driver, timeout, poll_frequency=0.25,
                            ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    try:
        return patient.until(condition)
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}") from None


def run_all_cells(driver, timeout: float = 120.0) -> None:
    wait(driver, lambda d: d.execute_script(READY_JS), 60, "the notebook and an idle kernel")
    # fire and forget: returning the command's promise would make selenium wait on it under its script timeout
    driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
    deadline = time.monotonic() + timeout
    while True:
        progress = driver.execute_script(PROGRESS_JS)
        assert not progress["errors"], f"lesson 07 raised in the browser: {progress['errors']}"
        if progress["done"] == progress["code"] and progress["busy"] == "idle":
            return
        assert time.monotonic() < deadline, f"Run All unfinished after {timeout:.0f} s: {progress}"
        time.sleep(0.5)


class Calculator:
    """The memory calculator as rendered in the DOM: its controls found by their ipywidgets labels."""

    def __init__(self, driver):
        from selenium.webdriver.common.by import By
        self.driver, self.by = driver, By
        self.root = wait(driver, lambda d: d.find_element(By.XPATH, CALCULATOR), 30, "the memory calculator")

    def control(self, kind: str, label: str):
        return self.root.find_element(
            self.by.XPATH, f".//div[contains(@class,'widget-{kind}')][label[normalize-space()='{label}']]")

    def verdict(self) -> str:
        html = self.root.find_element(self.by.CSS_SELECTOR, ".widget-output .jp-RenderedHTMLCommon")
        return "\n".join(line.strip() for line in html.text.splitlines()[:2])

    def figure(self) -> str:
        return self.root.find_element(self.by.CSS_SELECTOR, ".widget-output img").get_attribute("src")

    def changed(self, before: tuple[str, str], what: str) -> None:
        """Wait for the kernel to recompute and the browser to redraw both verdict and figure."""
        wait(self.driver, lambda d: self.state()[0] != before[0] and self.state()[1] != before[1],
             30, f"the calculator to redraw after {what}")

    def state(self) -> tuple[str, str]:
        return self.verdict(), self.figure()


def quiz_heading(driver) -> str:
    return driver.find_element("xpath", QUIZ_HEADING).text


def test_widgets_show_before_running_and_lesson07s_calculator_lives_in_chromium(lab, chrome, monkeypatch):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    learners_copy(lab, monkeypatch)
    chrome.get(lab.open_url(f"{lessons.STUDENT}/{LESSON.name}"))
    shows_every_widget(chrome, LESSON)                      # 1. before any cell runs: drawn, as made
    assert Calculator(chrome).verdict() == expected_verdict()
    assert UNANSWERED in quiz_heading(chrome)

    run_all_cells(chrome)                                   # 2. Run All leaves the learner's widgets alone
    calc = Calculator(chrome)
    wait(chrome, lambda d: calc.verdict() == expected_verdict(), 30, "the lesson's state to render")
    assert UNANSWERED in quiz_heading(chrome)
    chrome.execute_script("arguments[0].scrollIntoView()", calc.root)

    # the slider, dragged with the mouse past its right end: ZeRO stage 0 -> 3 (everything sharded by dp=8)
    slider = calc.control("slider", "ZeRO stage")
    handle = slider.find_element(By.CSS_SELECTOR, ".noUi-handle")
    track = slider.find_element(By.CSS_SELECTOR, ".noUi-target")
    before = calc.state()
    ActionChains(chrome).click_and_hold(handle).move_by_offset(track.size["width"] // 2, 0) \
        .move_by_offset(track.size["width"], 0).release().perform()
    calc.changed(before, "dragging ZeRO stage to 3")
    assert slider.find_element(By.CSS_SELECTOR, ".widget-readout").text.strip() == "3"
    assert calc.verdict() == expected_verdict(zero=3)

    # a dropdown: dp 8 -> 64 (ZeRO-3 shards by 64: 44.1 -> 32.3 GB, now fits on an A100 40 GB)
    before = calc.state()
    Select(calc.control("dropdown", "dp").find_element(By.TAG_NAME, "select")).select_by_visible_text("64")
    calc.changed(before, "dp = 64")
    assert calc.verdict() == expected_verdict(zero=3, dp=64)
    assert "a100-40gb fits" in calc.verdict()

    # the slider again, from the keyboard: one step left, ZeRO stage 2 (parameters replicated again)
    before = calc.state()
    handle.send_keys(Keys.ARROW_LEFT)
    calc.changed(before, "ZeRO stage - 1 from the keyboard")
    assert slider.find_element(By.CSS_SELECTOR, ".widget-readout").text.strip() == "2"
    assert calc.verdict() == expected_verdict(dp=64, zero=2)

    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert calc.root.screenshot(str(SCREENSHOT)), "Chromium could not take the screenshot"

    # 3. every other lesson with widgets (the planner), student's and solved copy where they differ
    names = with_widgets()
    assert len(names) >= 2, f"only {names} display widgets: lesson 13's planner shows none"
    for folder, name in [(lessons.STUDENT, n) for n in names if n != LESSON.name] + \
                        [(lessons.SOLVED, n) for n in names]:
        path = lab.root / folder / name
        if folder == lessons.SOLVED and path.read_bytes() == (lab.root / lessons.STUDENT / name).read_bytes():
            continue                                             # the same notebook: seen already
        chrome.get(lab.open_url(f"{folder}/{name}") + "&reset")    # a fresh workspace: this tab only
        shows_every_widget(chrome, path)

