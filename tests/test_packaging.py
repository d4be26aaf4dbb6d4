"""What a pip user gets: the wheel and the sdist, built offline from a copy of this tree.

Checked: the license (Apache-2.0 as an SPDX expression, the LICENSE file in the wheel's
``.dist-info/licenses``), classifiers, ``py.typed`` (PEP 561) and tqdm in the wheel's metadata; the
sdist carries the changelog and the images the README links, at the paths it links them by, so the
README renders with its figure wherever the sdist is unpacked (PyPI's page needs an absolute URL,
which only a published repository can give).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                              ".ipynb_checkpoints")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel, sdist) built without network: no build isolation, the setuptools of this environment."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    out = tmp / "out"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(out), str(src)], check=True, timeout=300)
    sdist = f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"
    subprocess.run([sys.executable, "-c", sdist], cwd=src, check=True, timeout=300, capture_output=True)
    return next(out.glob("distlab-*.whl")), next(out.glob("distlab-*.tar.gz"))


def test_pyproject_declares_the_license_as_spdx_with_a_setuptools_that_reads_it():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])   # PEP 639: not both
    assert "Typing :: Typed" in project["classifiers"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in meta["build-system"]["requires"])
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS" in text


def test_wheel_carries_license_py_typed_and_metadata(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert z.read(license_file).decode() == (ROOT / "LICENSE").read_text()
    assert "distlab/py.typed" in names and "distlab/progress.py" in names
    assert "distlab/launch/parent.py" in names and "distlab/launch/rank.py" in names     # the launcher room
    assert "distlab/theory/data/published_runs.json" in names          # dl.theory.published reads it
    assert "distlab/data/corpus.txt" in names                          # dl.data's text (data="text")
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert "Classifier: Typing :: Typed" in meta and re.search(r"Requires-Dist: tqdm", meta)


def test_sdist_carries_changelog_and_the_readme_images_where_it_links_them(built):
    _, sdist = built
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "distlab/py.typed"} <= names
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert images, "the README shows no image"
    for link in images:
        assert "://" not in link, f"{link}: an absolute link; the README's images are relative paths"
        assert (ROOT / link).is_file() and link in names, f"{link} missing from the tree or the sdist"
