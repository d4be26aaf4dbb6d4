"""Every relative link to a file of distlab/ points at a file that exists: in the lesson sources
(notebooks/*.py, whose markdown lives in comments), the top README.md and every README.md under distlab/.
(The executed lessons' markdown cells are checked by `test_house.test_lessons_link_the_code_they_explain`.)
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "distlab"
SOURCES = sorted(ROOT.glob("notebooks/*.py")) + [ROOT / "README.md"] + sorted(PACKAGE.rglob("README.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")          # [text](target): the target, up to a space or ")"


def links_into_package(path: Path, package: Path = PACKAGE) -> list[str]:
    """The relative link targets in ``path`` that resolve to somewhere under ``package`` (anchors dropped;
    web and mail links, and links elsewhere in the repository, left out)."""
    found = []
    for target in LINK.findall(path.read_text()):
        target = target.split("#")[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):     # an anchor alone, http:, mailto:
            continue
        if (path.parent / target).resolve().is_relative_to(package.resolve()):
            found.append(target)
    return found


def broken(path: Path, package: Path = PACKAGE) -> list[str]:
    return [t for t in links_into_package(path, package) if not (path.parent / t).exists()]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_to_the_package_exist(path):
    assert not broken(path), f"{path.relative_to(ROOT)} links files that do not exist: {broken(path)}"


def test_the_lessons_and_readmes_link_the_package():
    """The check reads something: the lessons and the READMEs link distlab/ files."""
    assert sum(len(links_into_package(p)) for p in SOURCES) > 100


def test_a_planted_broken_link_is_found(tmp_path):
    package = tmp_path / "distlab"
    (package / "parallel").mkdir(parents=True)
    (package / "parallel" / "mesh.py").write_text("")
    lesson = tmp_path / "notebooks" / "99_planted.py"
    lesson.parent.mkdir()
    lesson.write_text("# %% [markdown]\n# Read [mesh.py](../distlab/parallel/mesh.py) and\n"
                      "# [gone.py](../distlab/parallel/gone.py#L3), not [torch](https://pytorch.org) or "
                      "[a test](../tests/x.py).\n")
    readme = package / "parallel" / "README.md"
    readme.write_text("[mesh](mesh.py), [old](schedule.py), [up](../parallel/mesh.py)\n")
    assert broken(lesson, package) == ["../distlab/parallel/gone.py"]
    assert broken(readme, package) == ["schedule.py"]
