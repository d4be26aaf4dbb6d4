"""`distlab lessons DIR` and `make lab`: a working copy of the lessons made for learners.

    distlab lessons ~/distlab-lessons      # DIR/student/  every lesson, exercises stubbed: work here
                                           # DIR/solved/   the teacher's versions, solutions shown
                                           # DIR/distlab   a link to the package: the code they link
                                           # DIR/docs      the pages they link (the notation table)
    jupyter lab ~/distlab-lessons
    python -m distlab.lessons lab          # what `make lab` runs first: lab/ in a checkout (ignored by git)

Nothing a learner edits is overwritten: a file is written when it is missing, or refreshed when the lesson
changed and the copy is still as it was written (its hash is in ``DIR/.distlab-lessons.json``); a copy the
learner changed (an exercise answered, outputs saved) is kept and named; ``force`` (``--force``) replaces
it.

Where the lessons are: in a source checkout, ``notebooks/`` beside the package; in an installed wheel, the
data files ``share/distlab/lessons`` under the environment's prefix (pyproject's
``[tool.setuptools.data-files]``: the notebooks live outside the package folder, where setuptools'
package data cannot reach), found through the installed distribution's list of files.

The lessons link the files they explain as ``../distlab/...``; so that those links open, ``DIR/distlab``
is made a link to the installed package (a copy where links are not allowed): the code that runs.

Every copy written here is trusted, as `jupyter trust` would: signed with this user's notebook secret into
their signature database (nbformat's ``NotebookNotary``, in the Jupyter data dir). JupyterLab shows the
outputs of an untrusted notebook only in their safe forms, and a widget's view is not one: lesson 07
opened fresh would show ``VBox(children=(HTML(...`` text where its calculator is, although the notebook
stores every widget's state (``metadata.widgets``, ``application/vnd.jupyter.widget-state+json``, written
by the execution). Trusted, the widget manager draws them from that state before any cell runs (not yet
live: the cell's run connects them to the kernel). A copy the learner changed is left unsigned by this
(JupyterLab signs what it saves from a trusted notebook itself). Only lessons that need it are signed: those
with an output JupyterLab would not show untrusted (`needs_trust`); the rest look the same either way.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
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


STUDENT, SOLVED = "student", "solved"
MANIFEST = ".distlab-lessons.json"                 # what was written: {relative path: sha256}


def student_version(path: Path) -> bytes:
    """Lesson ``path`` as a student gets it: exercise solutions stubbed (`exercises.student`), else as is."""
    from .exercises.student import has_exercises, student_notebook
    raw = path.read_bytes()
    nb = json.loads(raw)
    if not has_exercises(nb):
        return raw
    return (json.dumps(student_notebook(nb), indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def copy(directory, force: bool = False) -> dict[str, list[Path]]:
    """Write the student and solved versions of every lesson into ``directory`` (see the module's
    docstring) and link ``directory/distlab`` to the package. Returns {"written": [...], "kept": [...]}:
    the files written or refreshed, and the learner's changed copies of lessons that changed since, left
    alone (unless ``force``)."""
    root = Path(directory).expanduser()
    manifest_path = root / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    done: dict[str, list[Path]] = {"written": [], "kept": []}
    ours: list[bytes] = []                         # what stands in the folder as written here: to be trusted
    for lesson in sorted(source().glob(PATTERN)):
        for folder, data in ((STUDENT, student_version(lesson)), (SOLVED, lesson.read_bytes())):
            target, key = root / folder / lesson.name, f"{folder}/{lesson.name}"
            now = _sha(target.read_bytes()) if target.is_file() else None
            if now == _sha(data):
                manifest[key] = now                                    # up to date
                ours.append(data)                                      # (signed again: a wiped database)
                continue
            if now is not None and now != manifest.get(key) and not force:    # the learner's: left alone,
                if manifest.get(key) != _sha(data):                           # named if the lesson changed
                    done["kept"].append(target)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            manifest[key] = _sha(data)
            done["written"].append(target)
            ours.append(data)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _link_code(root)
    _copy_docs(root)
    trust([data for data in ours if needs_trust(json.loads(data))])
    return done


# What JupyterLab renders in an untrusted notebook (its rendermime factories marked safe; HTML sanitised);
# anything else (a widget's view, SVG, JavaScript) it replaces by the output's text/plain form.
SAFE_OUTPUTS = frozenset({"text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg",
                          "image/gif", "image/bmp", "image/webp", "application/vnd.jupyter.stdout",
                          "application/vnd.jupyter.stderr"})


def needs_trust(nb: dict) -> bool:
    """Whether notebook ``nb`` (its parsed JSON) holds an output JupyterLab shows only when trusted."""
    return any(set(output.get("data", {})) - SAFE_OUTPUTS
               for cell in nb["cells"] for output in cell.get("outputs", ()))


def trust(notebooks: list[bytes]) -> bool:
    """Sign each notebook (its JSON text) as trusted for this user: what `jupyter trust FILE` does, into
    the signature database of the Jupyter data dir (``$JUPYTER_DATA_DIR``, else ``~/.local/share/jupyter``)
    that JupyterLab's server checks when it opens a notebook. The signature is an HMAC of the notebook's
    content, so an edit made outside Jupyter makes it untrusted again. False where nbformat is missing
    (distlab installed without its lab extras: no JupyterLab to show widgets either)."""
    try:
        import nbformat
        from nbformat.sign import NotebookNotary
    except ImportError:
        return False
    notary = NotebookNotary()
    for data in notebooks:
        notary.sign(nbformat.reads(data.decode(), as_version=4))
    return True


def _link_code(root: Path) -> None:
    """``root/distlab``: a link to the package, so that the lessons' ``../distlab/...`` links open."""
    code, package = root / "distlab", Path(__file__).resolve().parent
    if not code.exists() and not code.is_symlink():
        try:
            code.symlink_to(package, target_is_directory=True)
        except OSError:                          # no links here (some file systems): a copy
            shutil.copytree(package, code, ignore=shutil.ignore_patterns("__pycache__"))


def _copy_docs(root: Path) -> None:
    """``root/docs``: the pages the lessons link as ``../docs/...`` (the notation table), kept current."""
    docs = source().parent / "docs"                 # the checkout's docs/, or the wheel's share/distlab/docs
    for page in sorted(docs.glob("*.md")) if docs.is_dir() else ():
        target = root / "docs" / page.name
        if not target.is_file() or target.read_bytes() != page.read_bytes():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(page, target)


def report(directory, done: dict[str, list[Path]]) -> str:
    """What `copy` did, in words, with how to open the lessons."""
    root = Path(directory).expanduser()
    lines = [f"{root}: wrote {len(done['written'])} notebooks; {STUDENT}/ holds every lesson with its "
             f"exercises to write, {SOLVED}/ the teacher's versions to compare with"]
    if done["kept"]:
        names = ", ".join(str(p.relative_to(root)) for p in done["kept"])
        lines.append(f"kept your changed {names} (the lesson changed since: --force replaces them; "
                     "copy your work elsewhere first)")
    lines.append(f"start with {STUDENT}/00_launch_and_collectives.ipynb")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python -m distlab.lessons DIR [--force]``: what `make lab` runs before starting JupyterLab."""
    force = "--force" in argv
    args = [a for a in argv if a != "--force"]
    if len(args) != 1:
        print("usage: python -m distlab.lessons DIR [--force]", file=sys.stderr)
        return 2
    print(report(args[0], copy(args[0], force=force)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
