"""Properties of the lessons as files: each runs alone after download, so each carries its own copy of a
few small helpers; those copies must stay identical, and importing a lesson must stay cheap."""

import inspect
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TUTORIALS
from lessons import load, stems

LESSONS = stems()
SHARED_HELPERS = ["describe_platform", "warm_up", "bench_ms", "save_results", "matmul_tflops", "check_input",
                  "copy_bandwidth_gbs", "load_sibling", "fastest_of_rounds", "retime_disagreeing"]


@pytest.mark.parametrize("helper", SHARED_HELPERS)
def test_copies_of_shared_helpers_are_identical(helper):
    sources = {stem: inspect.getsource(getattr(load(stem), helper))
               for stem in LESSONS if hasattr(load(stem), helper)}
    assert len(sources) >= 2, f"{helper} is no longer shared: remove it from this list"
    first = next(iter(sources.values()))
    assert all(src == first for src in sources.values()), f"the copies of {helper} differ: {sorted(sources)}"


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
