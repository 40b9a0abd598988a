"""MathJax comes with the site, so that math renders with no network.

The pinned ``django-static-mathjax`` package (MathJax itself, packaged for PyPI; it does not need
Django) supplies it. Each build copies into ``_static/mathjax`` the part a page can ask for: the
TeX-to-HTML component, its fonts, the TeX extensions it loads on demand, and the accessibility tools
of its menu; and points ``mathjax_path`` at that copy.
"""

from pathlib import Path

from sphinx.errors import ExtensionError
from sphinx.util.fileutil import copy_asset

# What tex-chtml.js loads at run time, relative to MathJax's es5 folder.
MATHJAX_PARTS = ["tex-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions", "ui", "a11y", "sre"]


def mathjax_source():
    try:
        import mathjax
    except ImportError as error:
        raise ExtensionError("MathJax is missing: install django-static-mathjax at the version pinned in "
                             "requirements.txt") from error
    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def _copy_mathjax(app):
    if app.builder.format != "html":
        return
    source, target = mathjax_source(), Path(app.outdir) / "_static" / "mathjax"
    for part in MATHJAX_PARTS:
        copy_asset(source / part, target / part if (source / part).is_dir() else target, force=True)


def _use_copy(app, config):
    config.mathjax_path = "mathjax/tex-chtml.js"


def setup(app):
    app.connect("config-inited", _use_copy)
    app.connect("builder-inited", _copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
