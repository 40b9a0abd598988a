"""Properties of the lessons as files: importing one stays cheap and prints nothing, and each opens
with a title and what the reader will learn."""

import subprocess
import sys
import time

import pytest
from conftest import ROOT, TUTORIALS
from lessons import load, stems

LESSONS = stems()


@pytest.mark.parametrize("lesson", LESSONS)
def test_importing_a_lesson_runs_nothing_heavy(lesson):
    code = (f"import importlib.util, sys, time; sys.path.insert(0, r'{TUTORIALS}'); t = time.perf_counter(); "
            f"spec = importlib.util.spec_from_file_location('m', r'{TUTORIALS / (lesson + '.py')}'); "
            f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            f"print(time.perf_counter() - t)")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and not result.stderr.strip(), result.stdout + result.stderr  # prints nothing
    assert float(result.stdout) < 10, f"importing {lesson} took {float(result.stdout):.1f} s"
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_opens_with_a_title_and_what_you_will_learn(lesson):
    doc = load(lesson).__doc__
    lines = doc.strip().splitlines()
    assert set(lines[1]) == {"="} and len(lines[1]) >= len(lines[0]), "title underlined with ="
    assert "You will learn" in doc
