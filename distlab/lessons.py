"""`distlab lessons DIR`: the lessons (Jupyter notebooks) out of an installed distlab, ready to open.

    distlab lessons ~/distlab-lessons      # DIR/notebooks/00_*.ipynb ... and DIR/distlab, the code they link
    jupyter lab ~/distlab-lessons

Where the lessons are: in a source checkout, ``notebooks/`` beside the package; in an installed wheel, the
data files ``share/distlab/lessons`` under the environment's prefix (pyproject's
``[tool.setuptools.data-files]``: the notebooks live outside the package folder, where setuptools'
package data cannot reach), found through the installed distribution's list of files.

The lessons link the files they explain as ``../distlab/...``; so that those links open, ``DIR/distlab``
is made a link to the installed package (a copy where links are not allowed): the code that runs.
"""
from __future__ import annotations

import importlib.metadata
import shutil
import site
import sys
from pathlib import Path

DATA = ("share", "distlab", "lessons")            # where a wheel installs them, under the prefix
PATTERN = "[0-9][0-9]_*.ipynb"


def source() -> Path:
    """The folder holding the lessons: the checkout's ``notebooks/``, else the installed data files."""
    checkout = Path(__file__).resolve().parents[1] / "notebooks"
    if any(checkout.glob(PATTERN)):
        return checkout
    try:
        files = importlib.metadata.distribution("distlab").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name.endswith(".ipynb") and tuple(f.parts[-4:-1]) == DATA:
            return Path(f.locate()).resolve().parent
    for base in (sys.prefix, site.USER_BASE or ""):
        folder = Path(base, *DATA)
        if any(folder.glob(PATTERN)):
            return folder
    raise FileNotFoundError("the lessons are not installed with this distlab: install it from a wheel "
                            "(pip install distlab) or use a clone of the repository, whose notebooks/ "
                            "folder they are")


def copy(directory, force: bool = False) -> list[Path]:
    """Copy every lesson into ``directory/notebooks`` and link ``directory/distlab`` to the package;
    returns the copied notebooks. Refuses to overwrite a lesson already there unless ``force``."""
    lessons = sorted(source().glob(PATTERN))
    out = Path(directory).expanduser() / "notebooks"
    there = [p.name for p in lessons if (out / p.name).exists()]
    if there and not force:
        raise FileExistsError(f"{out} already holds {', '.join(there)}: pass --force to overwrite them, "
                              "or choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    copied = [Path(shutil.copyfile(p, out / p.name)) for p in lessons]
    code, package = out.parent / "distlab", Path(__file__).resolve().parent
    if not code.exists() and not code.is_symlink():
        try:
            code.symlink_to(package, target_is_directory=True)
        except OSError:                          # no links here (some file systems): a copy
            shutil.copytree(package, code, ignore=shutil.ignore_patterns("__pycache__"))
    return copied
