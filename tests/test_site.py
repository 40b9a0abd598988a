"""The site as a reader gets it: a full CPU build with no warnings, every tutorial page complete, every
notebook valid and runnable, and a failing tutorial failing the build by name."""

import re
import shutil
from html.parser import HTMLParser

import perf_summary
import pytest
from conftest import ROOT, TUTORIALS, sphinx
from lessons import stems

LESSONS = stems()

class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.hrefs = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def links_of(page):
    parser = Links()
    parser.feed(page.read_text())
    return parser


@pytest.mark.parametrize("lesson", LESSONS)
def test_tutorial_page_is_complete(site, lesson):
    page = site / "tutorials" / f"{lesson}.html"
    assert page.exists(), f"no page for {lesson}"
    text = page.read_text()
    assert "Triton interpreter on CPU" in text or "GPU: " in text, "the page must say what produced its numbers"
    links = links_of(page)
    plots = [src for src in links.images if "sphx_glr_" in src and "thumb" not in src]
    assert plots, f"{lesson} shows no plot"
    for src in plots:
        assert (page.parent / src).is_file(), f"missing image {src}"
    downloads = [h for h in links.hrefs if "_downloads/" in h]
    for suffix in (f"{lesson}.py", f"{lesson}.ipynb", "tutorials_python.zip", "tutorials_jupyter.zip"):
        matches = [h for h in downloads if h.endswith(suffix)]
        assert matches, f"{lesson} page has no download link to {suffix}"
        assert (page.parent / matches[0]).is_file(), f"download target missing: {matches[0]}"


def test_every_tutorial_has_a_nonzero_run_time(site):
    text = (ROOT / "docs" / "sg_execution_times.rst").read_text()
    for lesson in LESSONS:
        row = re.search(rf"{re.escape(lesson)}\.py.*?\n\s*-\s*(\d+:\d+\.\d+)", text, re.S)
        assert row, f"{lesson} missing from the execution-times page"
        assert row.group(1) != "00:00.000", f"{lesson} reports a zero run time"
    assert (site / "sg_execution_times.html").exists()


def test_performance_page_is_computed_from_this_build(site):
    results = perf_summary.load_results(ROOT / "build" / "results")
    assert sorted(r["tutorial"] for r in results) == LESSONS
    text = (site / "performance.html").read_text()
    for lesson in LESSONS:
        assert lesson in text
    if not all(r["on_gpu"] for r in results):
        assert "measure the interpreter, not a GPU" in text


def test_perf_summary_ratios():
    bench = {"ceiling": 100.0, "ours": ["mine"], "peers": ["a", "b"], "rows": [
        {"N": 1, "provider": "mine", "value": 50.0}, {"N": 1, "provider": "a", "value": 25.0},
        {"N": 1, "provider": "b", "value": 40.0}, {"N": 2, "provider": "mine", "value": 90.0},
        {"N": 2, "provider": "a", "value": 100.0}, {"N": 2, "provider": "b", "value": float("nan")}]}
    (summary,) = perf_summary.summarize(bench)
    assert summary["best_ratio"][:2] == (1.25, (("N", "1"),)) and summary["best_ratio"][2] == "b"
    assert summary["worst_ratio"][:3] == (0.9, (("N", "2"),), "a")
    assert summary["best_fraction"][0] == 0.9 and summary["worst_fraction"][0] == 0.5


@pytest.mark.parametrize("lesson", LESSONS)
def test_notebook_is_valid_and_runs_on_cpu(site, lesson, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    path = ROOT / "docs" / "tutorials" / f"{lesson}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert "pip install" in notebook.cells[0].source, "the first cell must tell a reader what to install"
    # A reader's folder: the notebook and its sibling lessons, no build environment variables.
    for other in TUTORIALS.glob("[0-9][0-9]-*.py"):
        shutil.copy(other, tmp_path)
    NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]


def test_a_failing_tutorial_fails_the_build_by_name(site, tmp_path):
    # A copy of the sources, with the generated gallery, so only the broken lesson runs again.
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(TUTORIALS, tmp_path / "tutorials")
    (tmp_path / "tutorials" / "99-broken-lesson.py").write_text(
        '"""\nBroken lesson\n=============\n"""\n\n# %%\nraise RuntimeError("this lesson is broken on purpose")\n')
    result = sphinx(tmp_path, tmp_path / "build")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "99-broken-lesson.py" in output
    assert "this lesson is broken on purpose" in output
