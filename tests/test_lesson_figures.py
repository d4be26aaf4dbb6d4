"""Each figure a lesson stores is stored once.

A cell that ends with ``fig`` under matplotlib's inline backend shows its figure twice: once when the
backend flushes the open figure, once as the cell's value (lesson 13 showed five figures so). The stored
outputs are what a reader sees on GitHub and what nbval compares, so a duplicate is a defect in the
lesson, not only noise: this test reads every executed lesson and names the cell that repeats an image.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
IMAGES = ("image/png", "image/jpeg", "image/svg+xml")


def repeated_images(notebook: dict) -> list[str]:
    """'cell i repeats the image of cell j' for every stored image seen before in the same lesson."""
    seen: dict[str, int] = {}
    found = []
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code):
        for output in cell.get("outputs", []):
            for kind in IMAGES:
                data = output.get("data", {}).get(kind)
                if data is None:
                    continue
                key = hashlib.sha256("".join(data).encode()).hexdigest()
                if key in seen:
                    where = "the same cell" if seen[key] == i else f"code cell {seen[key]}"
                    found.append(f"code cell {i} stores an image ({kind}) already stored by {where}")
                seen.setdefault(key, i)
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_lesson_stores_a_figure_twice(path):
    repeats = repeated_images(json.loads(path.read_text()))
    assert not repeats, (f"{path.name}: " + "; ".join(repeats) + " (end the cell with plt.show(), not `fig`, "
                         "and re-execute the lesson)")


def test_the_check_finds_a_figure_shown_twice():
    png = {"output_type": "display_data", "data": {"image/png": "iVBORw0KGgo="}, "metadata": {}}
    other = {"output_type": "display_data", "data": {"image/png": "AAAA"}, "metadata": {}}
    twice = {"cells": [{"cell_type": "code", "outputs": [png, {**png, "output_type": "execute_result"}]}]}
    apart = {"cells": [{"cell_type": "code", "outputs": [png]}, {"cell_type": "markdown"},
                       {"cell_type": "code", "outputs": [other, png]}]}
    assert repeated_images(twice) == [
        "code cell 0 stores an image (image/png) already stored by the same cell"]
    assert repeated_images(apart) == ["code cell 1 stores an image (image/png) already stored by code cell 0"]
    assert repeated_images({"cells": [{"cell_type": "code", "outputs": [png, other]}]}) == []
