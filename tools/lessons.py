"""Load a lesson from tutorials/ as a Python module, for the tests and the tools.

A lesson is a script that Sphinx-Gallery runs as ``__main__``; imported under another name it
defines its kernels and launchers and runs no benchmark, so importing is cheap. Each lesson is
loaded once per process and kept in ``sys.modules``.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"


# The lessons import their shared module, stepkit, from the folder they sit in.
if str(TUTORIALS) not in sys.path:
    sys.path.insert(0, str(TUTORIALS))


def stems():
    """The lessons' file names without ``.py``, in reading order."""
    return sorted(p.stem for p in TUTORIALS.glob("[0-9][0-9]-*.py"))


def load(stem):
    """Import tutorials/<stem>.py once and return the module: the same module
    that a lesson loading it as a sibling (stepkit.load_lesson) gets."""
    import stepkit

    if not (TUTORIALS / f"{stem}.py").is_file():
        raise FileNotFoundError(f"no lesson {stem}.py in {TUTORIALS}: the lessons are {', '.join(stems())}")
    return stepkit.load_lesson(stem)
