"""Sphinx configuration: Sphinx-Gallery runs tutorials/*.py and MyST renders the hand-written pages."""

import os
import re
import subprocess
import sys
from pathlib import Path

from sphinx.errors import ExtensionError

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

from edition import CHINESE  # noqa: E402
from lesson_files import SHARED, download_cell, stale_lessons  # noqa: E402  (found through the path above)
from lesson_files import lessons as lesson_stems  # noqa: E402
from lesson_pages import PeakMemory  # noqa: E402

project = "Triton kernels, step by step"
author = "the Triton tutorials team"
copyright = "2026, " + author
# The version this build is published as (tools/publish.py and the docs workflow set it).
release = version = os.environ.get("DOCS_VERSION", "dev")

# The project's home on GitHub, for builds that cannot tell it otherwise: a local clone whose origin
# is not on GitHub, or a copy without git.
HOME_REPOSITORY = "triton-tutorials/triton-kernels-step-by-step"


def _github_repository():
    """owner/name of the repository this build comes from.

    GitHub Actions sets GITHUB_REPOSITORY in every job, so a fork's build links to the fork. Elsewhere
    the origin remote decides when it is on GitHub (https or ssh), and HOME_REPOSITORY otherwise."""
    if os.environ.get("GITHUB_REPOSITORY"):
        return os.environ["GITHUB_REPOSITORY"]
    try:
        origin = subprocess.run(["git", "remote", "get-url", "origin"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        origin = ""
    found = re.fullmatch(r"(?:https://|ssh://git@|git@)github\.com[:/]([\w.-]+/[\w.-]+?)(?:\.git)?/?", origin)
    return found.group(1) if found else HOME_REPOSITORY


# Every link to GitHub (the header icon, each page's source, the clone command on Getting started)
# derives from this one setting; docs/_ext/repository.py builds the URLs.
repository = _github_repository()
# The branch the source links point to: the one docs.yml publishes as dev.
repository_branch = "main"


def _download_ref():
    """The version whose files a downloaded lesson fetches (docs/_ext/lesson_files.py): the release tag
    when this build is one (DOCS_VERSION vX.Y.Z), else the commit it was built from (GITHUB_SHA in
    GitHub Actions, else git's HEAD); None without git, and then the pages offer the zips alone."""
    if re.fullmatch(r"v(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})", version, re.ASCII):
        return version
    if re.fullmatch(r"[0-9a-f]{40}", os.environ.get("GITHUB_SHA", "")):
        return os.environ["GITHUB_SHA"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        head = ""
    return head if re.fullmatch(r"[0-9a-f]{40}", head) else None


# A single downloaded notebook or script fetches what it needs at this version, and no other.
download_ref = _download_ref()

extensions = [
    "myst_parser",
    "sphinx.ext.mathjax",
    "sphinx_copybutton",
    "sphinx_gallery.gen_gallery",
    "perf_summary",
    "repository",
    "install_line",
    # After sphinx_gallery: it completes the gallery's downloads (and decides which lessons rerun).
    "lesson_files",
    "offline_math",
    # After sphinx_gallery: it replaces how that extension writes a plot into the page.
    "lesson_pages",
    "edition",
]
myst_enable_extensions = ["colon_fence", "dollarmath"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "tutorials/*.md5"]
templates_path = ["_templates"]

# The Chinese edition (docs/_ext/edition.py, tools/i18n.py): one gettext catalog per page in
# docs/locales/zh_CN/LC_MESSAGES. tools/shard_build.py builds it with DOCS_LANGUAGE=zh_CN into
# build/html/zh_CN, from the pages the English build executed. No line numbers in the catalogs, so
# that a catalog changes only when one of its messages does.
language = os.environ.get("DOCS_LANGUAGE", "en")  # CHINESE for the Chinese edition
locale_dirs = ["locales/"]
gettext_compact = False
gettext_location = False
gettext_uuid = False

# Where tutorials leave their measured numbers for the "Performance at a glance" page.
RESULTS_DIR = Path(os.environ.get("TUTORIAL_RESULTS_DIR", ROOT / "build" / "results")).resolve()
os.environ["TUTORIAL_RESULTS_DIR"] = str(RESULTS_DIR)


def forget_removed_lessons(lessons, gallery, results):
    """Remove what Sphinx-Gallery and the benchmarks generated for lessons that no longer exist.

    A lesson renamed or removed leaves its page, notebook, figures and results behind. The page alone
    fails the build (it is in no toctree), its script would ship in the zips of all lessons, and its
    results would stay on the performance page."""
    current = {path.stem for path in lessons.glob("[0-9][0-9]-*.py")}
    generated = [*gallery.glob("[0-9][0-9]-*"), *gallery.glob("images/**/sphx_glr_[0-9][0-9]-*"),
                 *results.glob("[0-9][0-9]-*.json")]
    for path in generated:
        stem = re.split(r"[._]", path.name.removeprefix("sphx_glr_"), maxsplit=1)[0]
        if stem not in current and path.is_file():
            path.unlink()


forget_removed_lessons(ROOT / "tutorials", DOCS / "tutorials", RESULTS_DIR)

sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "tutorials"),
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/\d\d-[^/]*\.py$",
    # The lessons' shared module is no lesson: no page of its own.
    "ignore_pattern": r"stepkit\.py$",
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": True,
    # Benchmarks share one GPU: run lessons one after another, never in parallel.
    "parallel": False,
    "reset_modules": ("matplotlib",),
    "capture_repr": ("_repr_html_", "__repr__"),
    # What to install, and the download step: the files every lesson needs, at this build's version
    # (docs/_ext/lesson_files.py then adds each notebook's own sibling lessons).
    "first_notebook_cell": download_cell(repository, download_ref, SHARED),
    "min_reported_time": 0,
    # The Computation times page's memory column; without this, Sphinx-Gallery needs memory_profiler
    # and writes 0.0 for every lesson.
    "show_memory": PeakMemory(),
}

html_theme = "pydata_sphinx_theme"
# The Chinese edition's header names the site in Chinese; the rest of its theme is translated by catalogs.
html_title = "Triton 内核，循序渐进" if language == CHINESE else project
html_static_path = ["_static"]
html_css_files = ["custom.css"]
# The published site's pages find every version in one switcher.json (tools/publish.py writes it), at
# DOCS_SWITCHER_URL, which the docs workflow sets. A local build has no such file: its pages show no
# version menu rather than an empty one.
SWITCHER_URL = os.environ.get("DOCS_SWITCHER_URL")
# The Chinese pages switch versions within Chinese: their list, beside the English one, holds each
# version's zh_CN/ folder (tools/publish.py writes both).
if SWITCHER_URL and language == CHINESE:
    SWITCHER_URL = re.sub(r"\.json$", f".{CHINESE}.json", SWITCHER_URL)

html_theme_options = {
    # Beside the title, where a phone keeps it in the header: the other header items fold into the
    # side drawer below the theme's large breakpoint.
    "navbar_start": ["navbar-logo", *(["version-switcher"] if SWITCHER_URL else [])],
    # The default lines the links up with the text by giving the title a fixed quarter of the width,
    # which the switcher beside the title would overrun.
    "navbar_align": "left",
    "navbar_end": ["theme-switcher", "navbar-icon-links"],
    # An icon, not a field: the field alone would push the header onto a second row.
    # The language link too: the same page in the other edition, in the header at every width.
    "navbar_persistent": ["search-button", "language-switch"],
    "github_url": f"https://github.com/{repository}",
    # The menu of the header's links that do not fit (an option of the theme, not a catalog message).
    "header_dropdown_text": "更多" if language == CHINESE else "More",
    "secondary_sidebar_items": ["page-toc", "source-links", "sg_download_links", "sg_launcher_links"],
}
if SWITCHER_URL:
    html_theme_options.update({
        "switcher": {"json_url": SWITCHER_URL, "version_match": version},
        # Builds happen offline; the switcher's JSON is checked by the publish tool instead.
        "check_switcher": False,
        # Pages of versions other than the preferred one link to it (the preferred one: switcher.json).
        "show_version_warning_banner": True,
    })
# Pages at the top level have no section to navigate: their text and tables take the width instead.
html_sidebars = {"*": []}
html_context = {"default_mode": "light"}
html_last_updated_fmt = "%Y-%m-%d"


def _add_zip_download(app, docname, source):
    """Give every tutorial page a link to the whole gallery as a zip, beside its own .py and .ipynb."""
    name = docname.split("/")[-1]
    if docname.startswith("tutorials/") and name[:2].isdigit():
        source[0] += (
            "\n\n.. rst-class:: sphx-glr-download\n\n"
            ":download:`Download all tutorials as Python files (zip) <tutorials_python.zip>`\n\n"
            ".. rst-class:: sphx-glr-download\n\n"
            ":download:`Download all tutorials as notebooks (zip) <tutorials_jupyter.zip>`\n"
        )


# The last build of a sharded one (tools/shard_build.py) merges lessons that ran elsewhere, on other
# GPUs or other CI runners, and runs none itself. SHARD_MERGE=1 makes that a rule: the build stops
# before Sphinx-Gallery starts if any lesson would run here (a checksum that did not match would
# otherwise run it quietly, on whatever machine merges). SHARD_REQUIRE_GPU=1 (CI's merge) also stops it
# unless every lesson page's platform line names a GPU. SHARD_GPU_DRIVER is the NVIDIA driver the
# shards ran on, for the performance page, when the merging machine has no GPU of its own.
SHARD_MERGE = os.environ.get("SHARD_MERGE") == "1"
SHARD_REQUIRE_GPU = os.environ.get("SHARD_REQUIRE_GPU") == "1"
# The first line of a lesson's output that is a platform line (stepkit.describe_platform), in
# Sphinx-Gallery's blocks of printed output.
OUTPUT_BLOCK = re.compile(r"^\.\. rst-class:: sphx-glr-script-out\n\n \.\. code-block:: none\n\n((?:(?: {4}.*)?\n)*)",
                          re.M)
PLATFORM_LINE = re.compile(r"^ {4}(GPU: .*|Triton interpreter on CPU .*)$", re.M)

if os.environ.get("SHARD_GPU_DRIVER"):
    import perf_summary  # noqa: E402  (the very module Sphinx loads as the extension)

    perf_summary.gpu_driver = lambda: os.environ["SHARD_GPU_DRIVER"]


def platform_line(page):
    """The platform line a lesson's generated page (<gallery>/<lesson>.rst) printed, or None."""
    blocks = OUTPUT_BLOCK.findall(page.read_text(encoding="utf-8")) if page.is_file() else []
    found = [line for block in blocks for line in PLATFORM_LINE.findall(block)]
    return found[0] if found else None


def _nothing_runs_here(app):
    """SHARD_MERGE=1, after lesson_files' rerun rule and before Sphinx-Gallery: every lesson is current."""
    if app.config.sphinx_gallery_conf.get("run_stale_examples"):
        raise ExtensionError("SHARD_MERGE=1 runs no lesson: run_stale_examples would run them all")
    stale = stale_lessons(ROOT / "tutorials", DOCS / "tutorials")
    if stale:
        raise ExtensionError(
            f"SHARD_MERGE=1: these lessons would run on the merge machine: {', '.join(stale)}. No shard left "
            "their files, or the files they need changed since the shards ran them (a .py.md5 that does not "
            "match the lesson, or a needs record that does not match: docs/_ext/lesson_files.py).")


def _every_lesson_ran_on_a_gpu(app):
    """SHARD_REQUIRE_GPU=1, after Sphinx-Gallery wrote the pages: each names a GPU as its platform."""
    off = []
    for stem in lesson_stems(ROOT / "tutorials"):
        line = platform_line(DOCS / "tutorials" / f"{stem}.rst")
        if line is None or not line.startswith("GPU: "):
            off.append(f"{stem} ({line or 'printed no platform line'})")
    if off:
        raise ExtensionError("SHARD_REQUIRE_GPU=1: these lesson pages did not run on a GPU: " + "; ".join(off))


def setup(app):
    app.connect("source-read", _add_zip_download)
    # lesson_files' rerun rule runs at priority 400, Sphinx-Gallery at 500.
    if SHARD_MERGE:
        app.connect("builder-inited", _nothing_runs_here, priority=450)
    if SHARD_REQUIRE_GPU:
        app.connect("builder-inited", _every_lesson_ran_on_a_gpu, priority=550)
