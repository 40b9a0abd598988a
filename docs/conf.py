"""Sphinx configuration: Sphinx-Gallery runs tutorials/*.py and MyST renders the hand-written pages."""

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

from lesson_pages import PeakMemory  # noqa: E402  (found through the path set just above)

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

extensions = [
    "myst_parser",
    "sphinx.ext.mathjax",
    "sphinx_copybutton",
    "sphinx_gallery.gen_gallery",
    "perf_summary",
    "repository",
    "offline_math",
    # After sphinx_gallery: it replaces how that extension writes a plot into the page.
    "lesson_pages",
]
myst_enable_extensions = ["colon_fence", "dollarmath"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "tutorials/*.md5"]
templates_path = ["_templates"]

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
    "first_notebook_cell": (
        "# This notebook comes from the tutorial site 'Triton kernels, step by step'.\n"
        "# It needs PyTorch, Triton, matplotlib and pandas. Without a CUDA GPU it runs\n"
        "# through the Triton interpreter at small sizes. To install, uncomment:\n"
        "# %pip install torch triton matplotlib pandas"
    ),
    "min_reported_time": 0,
    # The Computation times page's memory column; without this, Sphinx-Gallery needs memory_profiler
    # and writes 0.0 for every lesson.
    "show_memory": PeakMemory(),
}

html_theme = "pydata_sphinx_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    # Beside the title, where a phone keeps it in the header: the other header items fold into the
    # side drawer below the theme's large breakpoint.
    "navbar_start": ["navbar-logo", "version-switcher"],
    # The default lines the links up with the text by giving the title a fixed quarter of the width,
    # which the switcher beside the title would overrun.
    "navbar_align": "left",
    "navbar_end": ["theme-switcher", "navbar-icon-links"],
    # An icon, not a field: the field alone would push the header onto a second row.
    "navbar_persistent": ["search-button"],
    "github_url": f"https://github.com/{repository}",
    "switcher": {
        # One fixed place for every published version (tools/publish.py writes it).
        "json_url": os.environ.get("DOCS_SWITCHER_URL", "/switcher.json"),
        "version_match": version,
    },
    # Builds happen offline; the switcher's JSON is checked by the publish tool instead.
    "check_switcher": False,
    "show_version_warning_banner": True,
    "secondary_sidebar_items": ["page-toc", "source-links", "sg_download_links", "sg_launcher_links"],
}
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


def setup(app):
    app.connect("source-read", _add_zip_download)
