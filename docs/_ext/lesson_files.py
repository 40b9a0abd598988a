"""What a lesson needs beside it, and the downloads that bring it.

Every lesson imports the shared module ``tutorials/stepkit.py``, which reads
``tutorials/tuned_tables.json``, and some load earlier lessons with ``kit.load_lesson("NN-name")``
(found here by ``LOADS`` over the lesson's source, transitively). Sphinx-Gallery knows none of this,
so this extension adds three things:

* **Rerun rule.** Sphinx-Gallery reruns a lesson only when the lesson's own file changes (its ``.md5``
  beside the generated page). Before the gallery runs, ``rerun_when_needs_change`` keeps a record of
  the files each lesson needs, ``<gallery>/<lesson>.needs.json`` (their MD5 sums), and where they
  changed since the record, deletes the lesson's ``.md5``, so that the lesson runs again.
* **Zips.** The zip of all scripts and the zip of all notebooks get ``SHARED`` beside the lessons, so
  that either runs as it is, offline. The notebooks' zip holds notebooks only (a lesson loads its
  siblings from their notebooks), and ``SHARED`` as they are: no notebook of them. A lesson's own zip
  (its script and notebook) gets the files it needs too.
* **Download step.** The first cell of every notebook (``download_cell``, Sphinx-Gallery's
  ``first_notebook_cell``) fetches the files the lesson needs that are missing beside it, from
  ``https://raw.githubusercontent.com/<repository>/<ref>/tutorials/``, at the version of the page it
  came from (``download_ref`` in conf.py: the release tag, else the commit built) and no other. Sphinx-
  Gallery writes a notebook only when it runs the lesson, with one first cell for all; after it,
  ``refresh_downloads`` gives each notebook its own list of files and this build's version. The
  ``download-step`` directive shows the same step for scripts on the Getting started page.
"""

import hashlib
import io
import json
import os
import re
import zipfile
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from install_line import install_text

# Beside the lessons, needed by every lesson (stepkit.py reads the tables).
SHARED = ("stepkit.py", "tuned_tables.json")
LOADS = re.compile(r"""\bload_lesson\(\s*(?:stem\s*=\s*)?["']([\w.-]+)["']\s*\)""")
LESSON = re.compile(r"\d\d-[^/]*\.py")
CELL_START = "# This notebook comes from the tutorial site 'Triton kernels, step by step'."
RAW = "https://raw.githubusercontent.com"


def lessons(folder):
    """The lessons' stems in folder, in order."""
    return sorted(path.stem for path in Path(folder).glob("[0-9][0-9]-*.py") if LESSON.fullmatch(path.name))


def siblings(folder, stem):
    """The lessons that lesson `stem` loads, directly or through those it loads, in order; a name that
    has no file is kept (the lesson fails there, and its record notes the missing file)."""
    found, todo = set(), [stem]
    while todo:
        path = Path(folder) / f"{todo.pop()}.py"
        if not path.is_file():
            continue
        for name in LOADS.findall(path.read_text(encoding="utf-8")):
            if name not in found and name != stem:
                found.add(name)
                todo.append(name)
    return sorted(found)


def needs(folder, stem):
    """The files lesson `stem` needs beside it: SHARED, then the lessons it loads."""
    return [*SHARED, *(f"{name}.py" for name in siblings(folder, stem))]


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest() if path.is_file() else None


def rerun_when_needs_change(lessons_dir, gallery_dir):
    """Make Sphinx-Gallery run again each lesson whose needed files changed since the last build; return
    their stems.

    Each lesson's record, <gallery_dir>/<lesson>.needs.json, holds the MD5 of every file it needs (null
    for a missing one). Where the record is missing or differs, the lesson's .md5 goes, so that the
    gallery reruns it, and the record is written anew. Deleting the .md5 is what makes the rule hold: a
    build that stops before the lesson ran, or one that does not run lessons, still leaves the lesson
    to run in the next build (Sphinx-Gallery writes the .md5 only after a successful run)."""
    lessons_dir, gallery_dir = Path(lessons_dir), Path(gallery_dir)
    gallery_dir.mkdir(parents=True, exist_ok=True)
    rerun = []
    for stem in lessons(lessons_dir):
        record = gallery_dir / f"{stem}.needs.json"
        current = {name: _md5(lessons_dir / name) for name in needs(lessons_dir, stem)}
        try:
            known = json.loads(record.read_text())
        except (OSError, ValueError):
            known = None
        if known != current:
            (gallery_dir / f"{stem}.py.md5").unlink(missing_ok=True)
            record.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
            rerun.append(stem)
    return rerun


def current(lessons_dir, gallery_dir, stem):
    """Whether Sphinx-Gallery would skip lesson `stem`: the checksum it keeps beside its copy of the lesson
    (<gallery_dir>/<stem>.py.md5, written after a successful run) is that of the lesson's source."""
    from sphinx_gallery.utils import get_md5sum

    md5 = Path(gallery_dir) / f"{stem}.py.md5"
    return md5.is_file() and md5.read_text() == get_md5sum(Path(lessons_dir) / f"{stem}.py", mode="t")


def stale_lessons(lessons_dir, gallery_dir):
    """The lessons a build would run now, in order: the rerun rule first (rerun_when_needs_change, which
    removes the .md5 of a lesson whose needed files changed), then every lesson that is not current.
    tools/shard_build.py plans with it, and docs/conf.py's guard of a merging build checks it."""
    rerun_when_needs_change(lessons_dir, gallery_dir)
    return [stem for stem in lessons(lessons_dir) if not current(lessons_dir, gallery_dir, stem)]


def download_code(repository, ref, files):
    """The lines of standard-library Python that fetch the files missing in the current folder (a
    lesson may stand in as its script or its notebook) from the repository at ref."""
    # The names a few to a line, so that the step fits 80 columns (88 in a notebook's cell).
    rows, row = [], ""
    for name in (f'"{name}",' for name in files):
        if row and len(row) + 1 + len(name) > 72:
            rows.append(row)
            row = ""
        row = f"{row} {name}" if row else name
    listed = [f"    {row}" for row in [*rows, row] if row]
    return [
        "import pathlib",
        "import urllib.request",
        "",
        f'repository = "{repository}"',
        f'ref = "{ref}"  # the version of this page',
        'base = f"https://raw.githubusercontent.com/{repository}/{ref}/tutorials/"',
        "for name in [",
        *listed,
        "]:",
        "    path = pathlib.Path(name)",
        '    if not (path.exists() or path.with_suffix(".ipynb").exists()):',
        "        urllib.request.urlretrieve(base + name, path)",
        '        print("downloaded", name)',
    ]


UNPINNED = "pip install torch triton matplotlib pandas"


def download_cell(repository, ref, files, install=UNPINNED):
    """A notebook's first cell: what to install (`install`, the build's pinned pip line where it
    knows one), then the download step for `files` at `ref` (the release tag or the commit of the
    page), or where no ref is known, the zip to download instead. It runs only as the notebook
    itself, not when another lesson loads the notebook as a module."""
    lines = [
        CELL_START,
        "# It needs PyTorch, Triton, matplotlib and pandas. Without a CUDA GPU it runs",
        "# through the Triton interpreter at small sizes. To install, uncomment:",
        f"# %{install}",
        "#",
    ]
    if ref is None:
        return "\n".join(lines + [
            "# It also needs files beside it: " + ", ".join(files) + ".",
            "# This copy of the site cannot name the version they come from: download this",
            "# lesson's zip (linked at the end of its page), which holds them, or the site's",
            "# zip of all notebooks, and run this notebook there.",
        ])
    lines += [
        "# It also needs files beside it: the lessons' shared module, the tuned tables",
        "# and the lessons it builds on. This cell downloads those missing, at the",
        "# version of the page it comes from. Offline: the site's zip of all notebooks",
        "# holds them; unpack it and run this notebook there.",
        'if __name__ == "__main__":  # not when another lesson loads this notebook',
    ]
    return "\n".join(lines + ["    " + line if line else "" for line in download_code(repository, ref, files)])


def _gallery_paths(app):
    gallery = app.config.sphinx_gallery_conf
    examples, galleries = gallery["examples_dirs"], gallery["gallery_dirs"]
    examples = examples if isinstance(examples, str) else examples[0]
    galleries = galleries if isinstance(galleries, str) else galleries[0]
    return Path(app.confdir, examples).resolve(), Path(app.srcdir, galleries)


def _rerun(app):
    lessons_dir, gallery_dir = _gallery_paths(app)
    rerun_when_needs_change(lessons_dir, gallery_dir)


def _write_zip(path, entries):
    """Write {name: bytes} into the zip at path, replacing it only where its content differs."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data in entries.items():
            bundle.writestr(zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0)), data)
    if not path.exists() or path.read_bytes() != buffer.getvalue():
        path.write_bytes(buffer.getvalue())


def refresh_downloads(lessons_dir, gallery_dir, repository, ref, install=UNPINNED):
    """After Sphinx-Gallery wrote the gallery: each notebook's first cell installs with `install` and
    fetches that lesson's own needs at `ref` (its zip of script and notebook follows), and the zips of
    all lessons carry SHARED."""
    lessons_dir, gallery_dir = Path(lessons_dir), Path(gallery_dir)
    for stem in lessons(lessons_dir):
        notebook = gallery_dir / f"{stem}.ipynb"
        if not notebook.is_file():
            continue
        content = json.loads(notebook.read_text(encoding="utf-8"))
        first = content["cells"][0] if content["cells"] else {}
        cell = download_cell(repository, ref, needs(lessons_dir, stem), install)
        if first.get("cell_type") != "code" or not "".join(first["source"]).startswith(CELL_START):
            raise ValueError(f"{notebook}: its first cell is not the download step of first_notebook_cell")
        if "".join(first["source"]) != cell:
            first["source"] = [cell]
            notebook.write_text(json.dumps(content, indent=2), encoding="utf-8")
        script = gallery_dir / f"{stem}.py"
        if script.is_file():
            # The lesson's own zip: its script and notebook, and what they need, so that it runs as it is.
            needed = {name: (lessons_dir / name).read_bytes() for name in needs(lessons_dir, stem)
                      if (lessons_dir / name).is_file()}
            _write_zip(gallery_dir / f"{stem}.zip", {script.name: script.read_bytes(),
                                                     notebook.name: notebook.read_bytes(), **needed})
    shared = {name: (lessons_dir / name).read_bytes() for name in SHARED}
    for kind in ("python", "jupyter"):
        path = gallery_dir / f"{gallery_dir.name}_{kind}.zip"
        if not path.is_file():
            continue
        with zipfile.ZipFile(path) as bundle:
            entries = {name: bundle.read(name) for name in bundle.namelist() if name not in shared}
            entries = {name: entries[name] for name in sorted(entries)}
        if kind == "jupyter":
            # The notebooks as refreshed above, not as the zip had them.
            entries = {name: (gallery_dir / name).read_bytes() if (gallery_dir / name).is_file() else data
                       for name, data in entries.items()}
        _write_zip(path, {**entries, **shared})


def _refresh(app):
    """The notebooks' first cells pin what Getting started's install line pins: the versions that
    produced the pages (the lessons have run by now), else requirements.txt's."""
    lessons_dir, gallery_dir = _gallery_paths(app)
    root = Path(app.confdir).parent
    results = Path(os.environ.get("TUTORIAL_RESULTS_DIR", root / "build" / "results"))
    install, _ = install_text(results, root / "requirements.txt")
    refresh_downloads(lessons_dir, gallery_dir, app.config.repository, app.config.download_ref, install)


NO_REF_SENTENCE = {
    "en": ("This copy of the site cannot name the version its lessons come from: download the lesson's own "
           "zip instead (linked at the end of its page), which holds the files it needs, or the zip of all "
           "lessons."),
    "zh_CN": "这份网站副本无法说明其课程来自哪个版本：请改为下载该课自己的 zip 包（链接在其页面末尾），"
             "其中包含它所需的文件；也可以下载全部课程的 zip 包。",
}


class DownloadStep(Directive):
    """The download step for a script, as a shell command run in the script's folder: every file that
    some lesson needs beside it (SHARED, and each lesson another loads), at this build's version."""

    has_content = False

    def run(self):
        env = self.state.document.settings.env
        # What the step shows follows the lessons and the version built: read its page on every build.
        env.note_reread()
        app = env.app
        lessons_dir, _ = _gallery_paths(app)
        ref = app.config.download_ref
        if ref is None:
            # Only a build without git says this (no message of the catalogs: a catalog is extracted in a
            # clone), so each edition has its sentence here.
            return [nodes.paragraph(text=NO_REF_SENTENCE.get(env.config.language, NO_REF_SENTENCE["en"]),
                                    translatable=False)]
        loaded = sorted({name for stem in lessons(lessons_dir) for name in siblings(lessons_dir, stem)})
        code = download_code(app.config.repository, ref, [*SHARED, *(f"{name}.py" for name in loaded)])
        text = "\n".join(["python - <<'EOF'", *code, "EOF"])
        block = nodes.literal_block(text, text, language="bash")
        return [block]


def setup(app):
    app.add_config_value("download_ref", None, "html", types=[str, type(None)])
    # Sphinx-Gallery runs the lessons at builder-inited, priority 500: the rule before, the files after.
    app.connect("builder-inited", _rerun, priority=400)
    app.connect("builder-inited", _refresh, priority=600)
    app.add_directive("download-step", DownloadStep)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
