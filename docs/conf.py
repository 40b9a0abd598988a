"""Sphinx configuration: Sphinx-Gallery runs tutorials/*.py and MyST renders the hand-written pages."""

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "Triton kernels, step by step"
author = "the Triton tutorials team"
copyright = "2026, " + author
# The version this build is published as (tools/publish.py and the docs workflow set it).
release = version = os.environ.get("DOCS_VERSION", "dev")

extensions = [
    "myst_parser",
    "sphinx.ext.mathjax",
    "sphinx_copybutton",
    "sphinx_gallery.gen_gallery",
    "perf_summary",
]
myst_enable_extensions = ["colon_fence", "dollarmath"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "tutorials/*.md5"]

# Where tutorials leave their measured numbers for the "Performance at a glance" page.
RESULTS_DIR = Path(os.environ.get("TUTORIAL_RESULTS_DIR", ROOT / "build" / "results")).resolve()
os.environ["TUTORIAL_RESULTS_DIR"] = str(RESULTS_DIR)

sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "tutorials"),
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/\d\d-[^/]*\.py$",
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
}

html_theme = "pydata_sphinx_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "navbar_end": ["version-switcher", "theme-switcher", "navbar-icon-links"],
    "switcher": {
        # One fixed place for every published version (tools/publish.py writes it).
        "json_url": os.environ.get("DOCS_SWITCHER_URL", "/switcher.json"),
        "version_match": version,
    },
    # Builds happen offline; the switcher's JSON is checked by the publish tool instead.
    "check_switcher": False,
    "show_version_warning_banner": True,
    "secondary_sidebar_items": ["page-toc", "sg_download_links", "sg_launcher_links"],
}
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
