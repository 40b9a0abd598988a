"""Load a lesson from tutorials/ as a Python module, for the tests and the tools.

A lesson is a script that Sphinx-Gallery runs as ``__main__``; imported under another name it
defines its kernels and launchers and runs no benchmark, so importing is cheap. Each lesson is
loaded once per process and kept in ``sys.modules``.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"


def stems():
    """The lessons' file names without ``.py``, in reading order."""
    return sorted(p.stem for p in TUTORIALS.glob("[0-9][0-9]-*.py"))


def load(stem):
    """Import tutorials/<stem>.py once and return the module."""
    name = "lesson_" + stem.replace("-", "_")
    if name not in sys.modules:
        path = TUTORIALS / f"{stem}.py"
        if not path.is_file():
            raise FileNotFoundError(f"no lesson {path}: the lessons are {', '.join(stems())}")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
