"""Lesson 07 in a real browser: JupyterLab in headless Chromium runs every cell, then the memory
calculator is moved in the live DOM (the "dp" dropdown, a mouse drag and a key press on the "ZeRO
stage" slider) and each time the verdict it displays must match :func:`distlab.theory.memory` and
:func:`distlab.theory.fits` computed here, in the test process.

What this adds to the nbval run and tests/test_widgets.py: the widget front end really renders in
JupyterLab (jupyterlab_widgets is installed and matches ipywidgets), and a change made by a user in
the browser travels over the kernel's comm channel, is recomputed in the kernel and drawn back.

Runs in ~30-60 s on 2 cores. Skips without Chromium/chromedriver/selenium
(tests/browser/install_browser.sh installs them). Leaves a screenshot for the README in
docs/lesson07_memory_calculator.png.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from distlab import theory

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
LESSON = REPO / "notebooks" / "07_interview_prep.ipynb"
SCREENSHOT = REPO / "docs" / "lesson07_memory_calculator.png"

# The calculator's state after "Run All": the lesson displays memory_calculator("llama2-7b") and its
# next cell sets ZeRO to 3; every other control keeps its default (see distlab/widgets/memory_calculator.py).
LESSON_STATE = dict(model="llama2-7b", precision="bf16-mixed", optimizer="adam", master_weights=True,
                    dp=8, zero=3, tp=1, pp=1, seq_len=2048, micro_batch=1, sp=False, recompute="none",
                    schedule="1f1b")

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


def expected_verdict(**changes) -> str:
    """The total and the "fits" line the calculator shows, computed from dl.theory in this process."""
    state = {**LESSON_STATE, **changes}
    model = state.pop("model")
    breakdown = theory.memory(model, **state, stage=0)   # pp=1: the only stage is the fullest
    fits = ", ".join(f"{gpu} {'fits' if theory.fits(breakdown, gpu) else 'no'}" for gpu in theory.GPUS)
    return f"{breakdown.total / theory.GB:.1f} GB per GPU on the fullest stage\n{fits}"


def prepared_copy(root: Path) -> str:
    """Lesson 07 without stored outputs or widget state, so everything on screen comes from this run."""
    notebook = json.loads(LESSON.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    notebook["metadata"].pop("widgets", None)
    (root / LESSON.name).write_text(json.dumps(notebook))
    return LESSON.name


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


def test_lesson07_memory_calculator_in_chromium(lab, chrome):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    chrome.get(lab.open_url(prepared_copy(lab.root)))
    run_all_cells(chrome)
    calc = Calculator(chrome)
    wait(chrome, lambda d: calc.verdict() == expected_verdict(), 30, "the lesson's state to render")
    chrome.execute_script("arguments[0].scrollIntoView()", calc.root)

    # 1. a dropdown: dp 8 -> 64 (ZeRO-3 shards by 64: 44.1 -> 32.3 GB, now fits on an A100 40 GB)
    before = calc.state()
    Select(calc.control("dropdown", "dp").find_element(By.TAG_NAME, "select")).select_by_visible_text("64")
    calc.changed(before, "dp = 64")
    assert calc.verdict() == expected_verdict(dp=64)
    assert "a100-40gb fits" in calc.verdict()

    # 2. the slider, dragged with the mouse past its left end: ZeRO stage 3 -> 0 (replicated: fits nowhere)
    slider = calc.control("slider", "ZeRO stage")
    handle = slider.find_element(By.CSS_SELECTOR, ".noUi-handle")
    track = slider.find_element(By.CSS_SELECTOR, ".noUi-target")
    before = calc.state()
    ActionChains(chrome).click_and_hold(handle).move_by_offset(-track.size["width"] // 2, 0) \
        .move_by_offset(-track.size["width"], 0).release().perform()
    calc.changed(before, "dragging ZeRO stage to 0")
    assert slider.find_element(By.CSS_SELECTOR, ".widget-readout").text.strip() == "0"
    assert calc.verdict() == expected_verdict(dp=64, zero=0)
    assert "fits" not in calc.verdict()

    # 3. the slider again, from the keyboard: one step right, ZeRO stage 1 (optimizer states sharded)
    before = calc.state()
    handle.send_keys(Keys.ARROW_RIGHT)
    calc.changed(before, "ZeRO stage + 1 from the keyboard")
    assert slider.find_element(By.CSS_SELECTOR, ".widget-readout").text.strip() == "1"
    assert calc.verdict() == expected_verdict(dp=64, zero=1)

    SCREENSHOT.parent.mkdir(exist_ok=True)
    assert calc.root.screenshot(str(SCREENSHOT)), "Chromium could not take the screenshot"
