"""The site as a reader gets it: a full CPU build with no warnings, every tutorial page complete, every
notebook valid and runnable, a failing tutorial failing the build by name, every page self-contained
(nothing from another host), links to the GitHub repository from its one setting, and the results
each benchmarking lesson leaves for the performance page following perf_summary's contract."""

import ast
import copy
import html
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile
from html.parser import HTMLParser
from pathlib import Path

import install_line
import lesson_files
import perf_summary
import pytest
import yaml
from conftest import ROOT, TUTORIALS, copy_docs_for_other_lessons, sphinx
from lessons import stems

LESSONS = stems()
RESULTS = ROOT / "build" / "results"


class Links(HTMLParser):
    """Images (with the link each sits in), links, and every resource the page asks for."""

    def __init__(self):
        super().__init__()
        self.images, self.hrefs, self.resources, self.linked_images = [], [], [], {}
        self.open_link = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])
            self.linked_images[attrs["src"]] = self.open_link
        if tag == "a":
            self.open_link = attrs.get("href")
            if attrs.get("href"):
                self.hrefs.append(attrs["href"])
        if tag in ("script", "img", "iframe", "source", "audio", "video", "embed") and attrs.get("src"):
            self.resources.append(attrs["src"])
        if tag == "link" and attrs.get("href") and attrs.get("rel") not in ("canonical", "alternate"):
            self.resources.append(attrs["href"])

    def handle_endtag(self, tag):
        if tag == "a":
            self.open_link = None


def links_of(page):
    parser = Links()
    parser.feed(page.read_text())
    return parser


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_table_wherever_the_text_cites_one(site, lesson):
    """Prose that points at "the table" must have a rendered table on the page, not a repr in a code block."""
    text = (site / "tutorials" / f"{lesson}.html").read_text()
    prose = re.sub(r'<div class="highlight.*?</div>', "", text, flags=re.S)  # code and its output
    cites = re.findall(r"[^.<>]*\bthe (?:results )?table\b[^.<>]*", re.sub(r"<[^>]+>", " ", prose))
    if cites:
        assert re.search(r'<table[^>]*class="dataframe', text), f"{lesson} cites a table but renders none: {cites[0]}"


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
    for src in plots:
        assert links.linked_images[src] == src, f"{lesson}: a click on {src} must open it full size"
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


def test_execution_times_page_measures_memory(site):
    text = (ROOT / "docs" / "sg_execution_times.rst").read_text()
    memory = [float(m) for m in re.findall(r"\.py``\)\n\s*-\s*\d+:\d+\.\d+\n\s*-\s*([\d.]+)", text)]
    assert len(memory) == len(LESSONS), text
    assert any(memory), "every lesson reports 0.0 MB: the memory column measures nothing"


def test_no_page_loads_anything_from_another_host(site):
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)
    assert len(pages) > len(LESSONS)
    for page in pages:
        remote = [r for r in links_of(page).resources if re.match(r"(https?:)?//", r)]
        assert not remote, f"{page.relative_to(site)} loads {remote}"
    mathjax = site / "_static" / "mathjax"
    assert (mathjax / "tex-chtml.js").is_file(), "MathJax must come with the site"
    assert list((mathjax / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff")), "and its fonts"


def github_repository(site):
    """owner/name, as the header's GitHub icon gives it."""
    found = set(re.findall(r'href="https://github\.com/([\w.-]+/[\w.-]+)"', (site / "index.html").read_text()))
    assert len(found) == 1, f"the header must link to exactly one repository: {found}"
    return found.pop()


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_links_to_its_script_on_github(site, lesson):
    base = f"https://github.com/{github_repository(site)}"
    hrefs = links_of(site / "tutorials" / f"{lesson}.html").hrefs
    assert f"{base}/blob/main/tutorials/{lesson}.py" in hrefs, [h for h in hrefs if "github" in h]
    assert f"{base}/edit/main/tutorials/{lesson}.py" in hrefs
    assert not [h for h in hrefs if "github.com" in h and "docs/tutorials/" in h], "links to a generated page"


def test_getting_started_gives_the_real_clone_command(site):
    repository = github_repository(site)
    text = re.sub(r"<[^>]+>", "", (site / "getting-started.html").read_text())
    assert f"git clone https://github.com/{repository}.git\ncd {repository.split('/')[1]}\n" in text
    assert "&lt;this repository&gt;" not in text


def test_the_repository_setting_follows_github_actions(monkeypatch):
    monkeypatch.setenv("GITHUB_REPOSITORY", "someone/a-fork")
    # conf.py exports where the results go: keep this process's value as it was.
    monkeypatch.setenv("TUTORIAL_RESULTS_DIR", str(RESULTS))
    conf = runpy.run_path(str(ROOT / "docs" / "conf.py"))
    assert conf["repository"] == "someone/a-fork"
    assert conf["html_theme_options"]["github_url"] == "https://github.com/someone/a-fork"


def run_conf(monkeypatch, **env):
    """conf.py's settings under the environment variables given (None: unset)."""
    monkeypatch.setenv("TUTORIAL_RESULTS_DIR", str(RESULTS))  # conf.py exports it: keep this process's value
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return runpy.run_path(str(ROOT / "docs" / "conf.py"))


def test_the_version_menu_only_where_a_switcher_file_is_published(monkeypatch):
    """A local build has no switcher.json to read: no version menu (an empty one was the bug), no banner that
    needs it. The published build, told where the file is (docs.yml), keeps both."""
    options = run_conf(monkeypatch, DOCS_SWITCHER_URL=None)["html_theme_options"]
    assert "version-switcher" not in options["navbar_start"] and "switcher" not in options
    assert not options.get("show_version_warning_banner")
    conf = run_conf(monkeypatch, DOCS_SWITCHER_URL="/a-repo/switcher.json", DOCS_VERSION="v1.2.0")
    options = conf["html_theme_options"]
    assert options["navbar_start"] == ["navbar-logo", "version-switcher"]
    assert options["switcher"] == {"json_url": "/a-repo/switcher.json", "version_match": "v1.2.0"}
    assert options["show_version_warning_banner"] and options["check_switcher"] is False
    build = yaml.safe_load((ROOT / ".github" / "workflows" / "docs.yml").read_text())["jobs"]["build"]
    assert build["env"]["DOCS_SWITCHER_URL"] == "/${{ github.event.repository.name }}/switcher.json"


def test_a_local_build_shows_no_version_menu(site):
    if os.environ.get("DOCS_SWITCHER_URL"):
        pytest.skip("this build was told where a switcher file is")
    for page in ("index.html", f"tutorials/{LESSONS[0]}.html"):
        assert "version-switcher" not in (site / page).read_text(), page


def head_commit():
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def test_downloads_fetch_at_the_release_or_the_commit_built(monkeypatch):
    """The version a downloaded lesson fetches its files at: a release's tag, else the commit built (GitHub's
    GITHUB_SHA, else git's HEAD); never a branch, which moves."""
    conf = run_conf(monkeypatch, DOCS_VERSION="v1.2.0", GITHUB_SHA="a" * 40)
    assert conf["download_ref"] == "v1.2.0"
    assert 'ref = "v1.2.0"' in conf["sphinx_gallery_conf"]["first_notebook_cell"]
    assert run_conf(monkeypatch, DOCS_VERSION="dev", GITHUB_SHA="a" * 40)["download_ref"] == "a" * 40
    assert run_conf(monkeypatch, DOCS_VERSION="v01.2.0", GITHUB_SHA=None)["download_ref"] == head_commit()
    assert run_conf(monkeypatch, DOCS_VERSION=None, GITHUB_SHA="main")["download_ref"] == head_commit()


def fetched_by(cell, folder, monkeypatch, name="__main__"):
    """The URLs cell downloads from, and to where, run in folder as a module called name (no network: the
    download is recorded, and writes the URL into the file)."""
    import urllib.request

    fetched = []

    def retrieve(url, path):
        fetched.append((url, str(path)))
        Path(path).write_text(url)

    monkeypatch.setattr(urllib.request, "urlretrieve", retrieve)
    monkeypatch.chdir(folder)
    exec(compile(cell, "<first cell>", "exec"), {"__name__": name})
    return fetched


def test_the_first_cell_fetches_what_is_missing_at_one_version(tmp_path, monkeypatch):
    files = ["stepkit.py", "tuned_tables.json", "02-a.py", "03-b.py"]
    cell = lesson_files.download_cell("someone/a-fork", "v1.2.0", files)
    assert "# %pip install torch triton matplotlib pandas" in cell
    (tmp_path / "stepkit.py").write_text("")  # there already
    (tmp_path / "03-b.ipynb").write_text("{}")  # a sibling lesson as a notebook serves as well as its script
    base = "https://raw.githubusercontent.com/someone/a-fork/v1.2.0/tutorials/"
    assert fetched_by(cell, tmp_path, monkeypatch) == [(base + "tuned_tables.json", "tuned_tables.json"),
                                                       (base + "02-a.py", "02-a.py")]
    assert fetched_by(cell, tmp_path, monkeypatch) == [], "a second run fetches nothing"
    (tmp_path / "tuned_tables.json").unlink()
    # Another lesson loading this notebook as a module: the cell must do nothing there.
    assert fetched_by(cell, tmp_path, monkeypatch, name="lesson_04_c") == []
    # A build that cannot name its version fetches nothing, and says to take the zip.
    unknown = lesson_files.download_cell("someone/a-fork", None, files)
    assert "urlretrieve" not in unknown and "zip of all notebooks" in unknown and "pip install" in unknown
    assert fetched_by(unknown, tmp_path, monkeypatch) == []


def fake_lessons(folder, loads):
    """Lessons in folder, {stem: [stems it loads]}, with the shared files beside them."""
    folder.mkdir(parents=True, exist_ok=True)
    for stem, loaded in loads.items():
        lines = [f'"""\n{stem}\n{"=" * len(stem)}\n"""', "import stepkit as kit"]
        lines += [f'{name.split("-")[1].upper()} = kit.load_lesson("{name}")' for name in loaded]
        (folder / f"{stem}.py").write_text("\n".join(lines) + "\n")
    (folder / "stepkit.py").write_text("def load_lesson(stem):\n    pass\n")
    (folder / "tuned_tables.json").write_text("{}\n")
    return folder


LOADS = {"01-a": [], "02-b": ["01-a"], "03-c": ["02-b"], "04-d": ["01-a", "03-c"], "05-e": ["05-e"]}


def test_a_lesson_needs_the_shared_files_and_what_it_loads_transitively(tmp_path):
    lessons = fake_lessons(tmp_path, LOADS)
    assert lesson_files.lessons(lessons) == list(LOADS)
    assert {stem: lesson_files.needs(lessons, stem) for stem in LOADS} == {
        "01-a": ["stepkit.py", "tuned_tables.json"],
        "02-b": ["stepkit.py", "tuned_tables.json", "01-a.py"],
        "03-c": ["stepkit.py", "tuned_tables.json", "01-a.py", "02-b.py"],
        "04-d": ["stepkit.py", "tuned_tables.json", "01-a.py", "02-b.py", "03-c.py"],
        "05-e": ["stepkit.py", "tuned_tables.json"]}


def test_a_lesson_reruns_when_a_file_it_needs_changes(tmp_path):
    """Sphinx-Gallery reruns a lesson whose .md5 is gone: the rule removes it where a needed file changed."""
    lessons, gallery = fake_lessons(tmp_path / "tutorials", LOADS), tmp_path / "gallery"

    def built():  # what Sphinx-Gallery leaves after running every lesson
        for stem in LOADS:
            (gallery / f"{stem}.py.md5").write_text("x")

    def rerun():
        kept = [stem for stem in LOADS if (gallery / f"{stem}.py.md5").exists()]
        found = lesson_files.rerun_when_needs_change(lessons, gallery)
        assert [stem for stem in kept if not (gallery / f"{stem}.py.md5").exists()] == [s for s in found if s in kept]
        return found

    assert rerun() == list(LOADS), "no record yet: every lesson runs"
    built()
    assert rerun() == []
    (lessons / "tuned_tables.json").write_text('{"x": 1}\n')
    assert rerun() == list(LOADS)
    built()
    (lessons / "01-a.py").write_text((lessons / "01-a.py").read_text() + "# changed\n")
    assert rerun() == ["02-b", "03-c", "04-d"], "the lessons that load 01-a, directly or not (01-a: its own md5)"
    assert rerun() == [], "the rule removed the .md5s: it has nothing more to say until the files change"
    built()
    (lessons / "03-c.py").write_text((lessons / "03-c.py").read_text().replace('kit.load_lesson("02-b")', ""))
    assert rerun() == ["03-c", "04-d"], "a lesson that stops loading one changes what it needs"
    built()
    (gallery / "04-d.needs.json").write_text("not json")
    assert rerun() == ["04-d"]


def test_the_build_reruns_a_lesson_when_a_file_it_needs_changes(tmp_path):
    """The rule in a real build, on a copy of the site with three small lessons (02-b loads 01-a): each run
    leaves a line in ran.txt. Sphinx-Gallery alone would rerun only a lesson whose own file changed."""
    copy_docs_for_other_lessons(tmp_path / "docs")
    lessons = fake_lessons(tmp_path / "tutorials", {"01-a": [], "02-b": ["01-a"], "03-c": []})
    shutil.copy(TUTORIALS / "GALLERY_HEADER.rst", lessons)
    for lesson in lessons.glob("0*.py"):
        lesson.write_text(lesson.read_text() + f"with open({str(tmp_path / 'ran.txt')!r}, 'a') as ran:\n"
                          f"    print('{lesson.stem}', file=ran)\n")
    env = dict(os.environ, TUTORIAL_RESULTS_DIR=str(tmp_path / "results"))

    def ran():
        (tmp_path / "ran.txt").write_text("")
        result = sphinx(tmp_path, tmp_path / "build", env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return sorted((tmp_path / "ran.txt").read_text().split())

    assert ran() == ["01-a", "02-b", "03-c"]
    assert ran() == [], "nothing changed: nothing runs"
    (lessons / "stepkit.py").write_text((lessons / "stepkit.py").read_text() + "# changed\n")
    assert ran() == ["01-a", "02-b", "03-c"]
    (lessons / "01-a.py").write_text((lessons / "01-a.py").read_text() + "# changed\n")
    assert ran() == ["01-a", "02-b"]


def test_a_lesson_s_downloads_carry_what_it_needs(tmp_path):
    """refresh_downloads on a gallery as Sphinx-Gallery leaves it: each notebook's first cell names its own
    needs at the build's version, its own zip follows and holds those needs, and the zips of all lessons hold
    the shared files (the notebooks' zip no notebook of them)."""
    lessons, gallery = fake_lessons(tmp_path / "tutorials", LOADS), tmp_path / "tutorials-out"
    gallery.mkdir()
    shared_cell = lesson_files.download_cell("o/r", "v1.0.0", lesson_files.SHARED)
    for stem in LOADS:
        shutil.copy(lessons / f"{stem}.py", gallery)
        notebook = {"cells": [{"cell_type": "code", "source": [shared_cell]}, {"cell_type": "code", "source": ["1"]}],
                    "metadata": {}, "nbformat": 4, "nbformat_minor": 0}
        (gallery / f"{stem}.ipynb").write_text(json.dumps(notebook, indent=2))
    for kind, suffix in (("python", ".py"), ("jupyter", ".ipynb")):
        with zipfile.ZipFile(gallery / f"{gallery.name}_{kind}.zip", "w") as bundle:
            for stem in LOADS:
                bundle.write(gallery / f"{stem}{suffix}", f"{stem}{suffix}")
    lesson_files.refresh_downloads(lessons, gallery, "o/r", "v1.0.0")
    for stem in LOADS:
        notebook = json.loads((gallery / f"{stem}.ipynb").read_text())
        assert "".join(notebook["cells"][0]["source"]) == lesson_files.download_cell(
            "o/r", "v1.0.0", lesson_files.needs(lessons, stem))
        with zipfile.ZipFile(gallery / f"{stem}.zip") as bundle:
            assert json.loads(bundle.read(f"{stem}.ipynb")) == notebook
            assert sorted(bundle.namelist()) == sorted([f"{stem}.py", f"{stem}.ipynb",
                                                        *lesson_files.needs(lessons, stem)])
    with zipfile.ZipFile(gallery / f"{gallery.name}_python.zip") as bundle:
        assert sorted(bundle.namelist()) == sorted([f"{stem}.py" for stem in LOADS] + list(lesson_files.SHARED))
        assert bundle.read("stepkit.py") == (lessons / "stepkit.py").read_bytes()
    with zipfile.ZipFile(gallery / f"{gallery.name}_jupyter.zip") as bundle:
        assert sorted(bundle.namelist()) == sorted([f"{stem}.ipynb" for stem in LOADS] + list(lesson_files.SHARED))
        assert bundle.read("04-d.ipynb") == (gallery / "04-d.ipynb").read_bytes(), "the refreshed notebook"
    before = {path.name: path.read_bytes() for path in gallery.iterdir()}
    lesson_files.refresh_downloads(lessons, gallery, "o/r", "v1.0.0")
    assert {path.name: path.read_bytes() for path in gallery.iterdir()} == before, "a second pass changes nothing"


def test_a_renamed_lesson_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("TUTORIAL_RESULTS_DIR", str(RESULTS))
    forget = runpy.run_path(str(ROOT / "docs" / "conf.py"))["forget_removed_lessons"]
    lessons, gallery, results = tmp_path / "tutorials", tmp_path / "gallery", tmp_path / "results"
    for folder in (lessons, gallery / "images" / "thumb", results):
        folder.mkdir(parents=True)
    (lessons / "01-kept.py").touch()
    kept = [gallery / "01-kept.rst", gallery / "01-kept.py.md5", gallery / "images" / "sphx_glr_01-kept_001.png",
            gallery / "index.rst", gallery / "tutorials_python.zip", results / "01-kept.json"]
    gone = [gallery / "02-renamed.rst", gallery / "02-renamed.py", gallery / "02-renamed.codeobj.json",
            gallery / "images" / "sphx_glr_02-renamed_001.png",
            gallery / "images" / "thumb" / "sphx_glr_02-renamed_thumb.png", results / "02-renamed.json"]
    for path in kept + gone:
        path.touch()
    forget(lessons, gallery, results)
    assert all(path.exists() for path in kept), [path for path in kept if not path.exists()]
    assert not [path for path in gone if path.exists()]


def calls_save_results(lesson):
    """Whether the lesson calls save_results, its own or another lesson's (module.save_results)."""
    tree = ast.parse((TUTORIALS / f"{lesson}.py").read_text())
    return any(isinstance(node, ast.Call) and "save_results" in (getattr(node.func, "id", None),
                                                                 getattr(node.func, "attr", None))
               for node in ast.walk(tree))


def test_results_follow_the_contract_and_every_benchmark_left_them(site):
    written = {path.stem for path in RESULTS.glob("*.json")}
    perf_summary.load_results(RESULTS)  # checks every record against the contract
    benchmarking = {lesson for lesson in LESSONS if calls_save_results(lesson)}
    assert benchmarking, "no lesson calls save_results"
    assert not benchmarking - written, f"lessons that benchmark but left no results: {benchmarking - written}"
    assert not written - set(LESSONS), f"results of no current lesson (make clean): {written - set(LESSONS)}"


GOOD_RECORD = {"tutorial": "01-x", "platform": "GPU: test", "on_gpu": True, "date": "2026-11-22", "benchmarks": [
    {"name": "b", "unit": "GB/s", "ceiling_name": "copy bandwidth", "ceiling": 100.0, "ours": ["mine"],
     "peers": ["a"], "rows": [
        {"N": 1, "provider": "mine", "value": 50.0, "gpu_value": 60.0, "spread": 0.02, "gpu_spread": 0.0,
         "gpu_method": "CUDA graph"},
        {"N": 1, "provider": "a", "value": None, "gpu_value": float("nan")}]}]}
CPU_RECORD = {**GOOD_RECORD, "on_gpu": False, "platform": "Triton interpreter on CPU", "benchmarks": [
    {**GOOD_RECORD["benchmarks"][0], "rows": [{"N": 1, "provider": "mine", "value": 50.0, "spread": 0.3},
                                              {"N": 1, "provider": "a", "value": 40.0}]}]}


def row_of(record, r):
    return record["benchmarks"][0]["rows"][r]


@pytest.mark.parametrize("field, change", [
    ("tutorial", lambda r: r.pop("tutorial")),
    ("on_gpu", lambda r: r.update(on_gpu="yes")),
    ("date", lambda r: r.update(date="22/11/2026")),
    ("extra", lambda r: r.update(extra=1)),
    ("benchmarks", lambda r: r.update(benchmarks=[])),
    ("benchmarks[0].ceiling", lambda r: r["benchmarks"][0].update(ceiling=0)),
    ("benchmarks[0].ceiling", lambda r: r["benchmarks"][0].update(ceiling="100")),
    ("benchmarks[0].ours", lambda r: r["benchmarks"][0].update(ours=[])),
    ("benchmarks[0].peers[0]", lambda r: r["benchmarks"][0].update(peers=[3])),
    ("benchmarks[0].rows[1].value", lambda r: r["benchmarks"][0]["rows"][1].update(value="fast")),
    ("benchmarks[0].rows[0].provider", lambda r: r["benchmarks"][0]["rows"][0].pop("provider")),
    ("benchmarks[0].rows[1]", lambda r: r["benchmarks"][0]["rows"][1].pop("N")),
    # Found by a hostile test: each was accepted, and rendered as a wrong number or crashed the build.
    ("date", lambda r: r.update(date="20261122")),
    ("date", lambda r: r.update(date="2026-W47-7")),
    ("benchmarks[0].ceiling", lambda r: r["benchmarks"][0].update(ceiling=10**400)),
    ("benchmarks[0].rows[1].value", lambda r: r["benchmarks"][0]["rows"][1].update(value=0.0)),
    ("benchmarks[0].rows[1].value", lambda r: r["benchmarks"][0]["rows"][1].update(value=-50.0)),
    ("benchmarks[0].rows[1].value", lambda r: r["benchmarks"][0]["rows"][1].update(value=float("inf"))),
    ("benchmarks[0].rows[1].value", lambda r: r["benchmarks"][0]["rows"][1].update(value=10**400)),
    ("benchmarks[0].rows[1]", lambda r: r["benchmarks"][0]["rows"][1].update(N="1")),
    ("benchmarks[0].rows[2]", lambda r: r["benchmarks"][0]["rows"].append({"N": 1, "provider": "mine", "value": 9.0})),
    ("benchmarks[0].rows", lambda r: r["benchmarks"][0].update(rows=[])),
    ("benchmarks[0].ours[1]", lambda r: r["benchmarks"][0].update(ours=["mine", "mine"])),
    ("benchmarks[0].ours", lambda r: r["benchmarks"][0].update(ours=["mine "])),
    ("benchmarks[0].peers", lambda r: r["benchmarks"][0].update(peers=["b"])),
    ("benchmarks[0]", lambda r: r["benchmarks"][0].update(peers=["mine"])),
    ("benchmarks[0].ceiling_per_case", lambda r: r["benchmarks"][0].update(ceiling_per_case=3)),
    ("benchmarks[0].ceiling_per_case", lambda r: r["benchmarks"][0].update(ceiling_per_case="copy")),
    ("benchmarks[0].ceiling_per_case", lambda r: r["benchmarks"][0].update(ceiling_per_case="a")),
    # GPU time: on a GPU in every row of ours and of a peer, a rate like value; spreads >= 0; a known method.
    ("benchmarks[0].rows[0].gpu_value", lambda r: row_of(r, 0).pop("gpu_value")),
    ("benchmarks[0].rows[1].gpu_value", lambda r: row_of(r, 1).pop("gpu_value")),
    ("benchmarks[0].rows[0].gpu_value", lambda r: row_of(r, 0).update(gpu_value=0.0)),
    ("benchmarks[0].rows[0].gpu_value", lambda r: row_of(r, 0).update(gpu_value="60")),
    ("benchmarks[0].rows[0].gpu_value", lambda r: row_of(r, 0).update(gpu_value=float("inf"))),
    ("benchmarks[0].rows[0].spread", lambda r: row_of(r, 0).update(spread=-0.01)),
    ("benchmarks[0].rows[0].spread", lambda r: row_of(r, 0).update(spread=float("inf"))),
    ("benchmarks[0].rows[0].spread", lambda r: row_of(r, 0).update(spread=True)),
    ("benchmarks[0].rows[0].gpu_spread", lambda r: row_of(r, 0).update(gpu_spread="0.1")),
    ("benchmarks[0].rows[0].gpu_method", lambda r: row_of(r, 0).update(gpu_method="events")),
    ("benchmarks[0].rows[0].gpu_method", lambda r: row_of(r, 0).update(gpu_method=None)),
    # A copy that is each case's ceiling carries GPU time as ours do.
    ("benchmarks[0].rows[2].gpu_value", lambda r: (r["benchmarks"][0].update(ceiling_per_case="copy"),
                                                   r["benchmarks"][0]["rows"].append(
                                                       {"N": 1, "provider": "copy", "value": 80.0}))),
    # Without a GPU there is no GPU time to give.
    ("benchmarks[0].rows[0].gpu_value", lambda r: r.update(on_gpu=False)),
    ("benchmarks[0].rows[0].gpu_method", lambda r: (r.update(on_gpu=False), row_of(r, 0).pop("gpu_value"),
                                                    row_of(r, 0).pop("gpu_spread"), row_of(r, 1).pop("gpu_value"))),
])
def test_validate_record_names_the_bad_field(field, change):
    perf_summary.validate_record(GOOD_RECORD)
    record = copy.deepcopy(GOOD_RECORD)
    change(record)
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}[:. ]"):
        perf_summary.validate_record(record)


def test_what_a_row_measured_is_no_case_column():
    """Rows may differ in their measured fields (a provider that is neither ours nor a peer needs no GPU time,
    a spread is optional); the case columns must still agree."""
    perf_summary.validate_record(CPU_RECORD)
    record = copy.deepcopy(GOOD_RECORD)
    record["benchmarks"][0]["rows"].append({"N": 1, "provider": "other", "value": 5.0})
    perf_summary.validate_record(record)
    assert perf_summary.case_columns(record["benchmarks"][0]) == ["N"]
    assert [case["case"] for case in perf_summary.per_case(record["benchmarks"][0])] == [{"N": 1}]


def test_the_page_and_the_lessons_share_the_spread_limit_and_the_method():
    """perf_summary's SPREAD_LIMIT is stepkit's, and the page's "How we time" states stepkit's constants."""
    constants = {node.targets[0].id: node.value for node in ast.parse((TUTORIALS / "stepkit.py").read_text()).body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
    value = {name: ast.literal_eval(constants[name]) for name in ("SPREAD_LIMIT", "MAX_PASSES", "WARM_UP_S")}
    assert perf_summary.SPREAD_LIMIT == value["SPREAD_LIMIT"]
    assert ast.unparse(constants["FLUSH_BYTES"]) == "256 << 20"
    assert ast.unparse(constants["PASSES"]) == "2 if ON_GPU else 1"
    page = (ROOT / "docs" / "performance.md").read_text()
    method = page.split("(how-we-time)=\n## How we time\n", 1)[1]
    for said in (f"more than {value['SPREAD_LIMIT']:.0%}", f"up to {value['MAX_PASSES']} passes",
                 f"same {value['WARM_UP_S'] * 1000:.0f} ms", "256 MiB", "two on a GPU", "CUDA graph",
                 "profiler", "torch.autograd.grad(out, inputs, dout)", "fastest of three"):
        assert said in method, said


def test_a_case_s_own_ceiling_divides_the_fractions_of_that_case():
    record = copy.deepcopy(CPU_RECORD)
    bench = record["benchmarks"][0]
    bench["rows"] += [{"N": 1, "provider": "copy", "value": 80.0}, {"N": 2, "provider": "mine", "value": 30.0},
                      {"N": 2, "provider": "copy", "value": None}]
    bench["ceiling_per_case"] = "copy"
    perf_summary.validate_record(record)
    cases = perf_summary.per_case(bench)
    assert [case["kernels"]["mine"]["fraction"] for case in cases] == [50.0 / 80.0, None]  # no copy at N=2
    assert perf_summary.ceiling_ranges([record]) == []  # no fraction divides by the device's figure
    del bench["ceiling_per_case"]
    assert [case["kernels"]["mine"]["fraction"] for case in perf_summary.per_case(bench)] == [0.5, 0.3]


def test_on_a_gpu_fractions_are_of_gpu_time_as_the_ceilings_are():
    record = copy.deepcopy(GOOD_RECORD)
    bench = record["benchmarks"][0]
    bench["rows"].append({"N": 1, "provider": "copy", "value": 50.0, "gpu_value": 80.0})
    perf_summary.validate_record(record)
    assert perf_summary.per_case(bench)[0]["kernels"]["mine"]["fraction"] == 0.6  # 60 of 100, by GPU time
    bench["ceiling_per_case"] = "copy"
    perf_summary.validate_record(record)
    assert perf_summary.per_case(bench)[0]["kernels"]["mine"]["fraction"] == 60.0 / 80.0


def test_the_phone_cards_name_the_summary_columns_as_its_header_does():
    css = (ROOT / "docs" / "_static" / "custom.css").read_text()
    labels = dict(re.findall(r'perf-summary-cards td:nth-child\((\d+)\)::before \{ content: "(.*?): "; \}', css))
    header = perf_summary.SUMMARY_HEADER
    assert [labels.get(str(column)) for column in range(2, len(header) + 1)] == header[1:]


def test_a_results_file_carries_its_own_name(tmp_path):
    (tmp_path / "02-other.json").write_text(json.dumps(GOOD_RECORD))
    with pytest.raises(ValueError, match=r"02-other\.json: tutorial:"):
        perf_summary.load_results(tmp_path)


def text_of(markup):
    return html.unescape(re.sub(r"<[^>]+>", "", markup)).strip()


def table_rows(markup, cell="td"):
    return [[text_of(c) for c in re.findall(rf"<{cell}[^>]*>(.*?)</{cell}>", row, re.S)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", markup, re.S)]


def page_tables(page):
    return re.findall(r"<table.*?</table>", page, re.S)


# A ratio as the page writes it: two decimals or more, or a range where the timings spread; then the peer.
RATIO = r"(\d+\.\d{2,6}x|\d+(\.\d+)?\u2013\d+(\.\d+)?x) .+"


def test_performance_page_is_computed_from_this_build(site):
    results = perf_summary.load_results(RESULTS)
    page = (site / "performance.html").read_text()
    hrefs = links_of(site / "performance.html").hrefs
    for result in results:
        assert f"tutorials/{result['tutorial']}.html" in hrefs, f"{result['tutorial']} does not link to its page"
    if not all(r["on_gpu"] for r in results):
        assert "measure the interpreter, not a GPU" in page
    # Each quantity in one format: ratios 0.00x (or a range), fractions 0%, ceilings as format_rate writes them.
    ceilings = {f"\u201c{b['ceiling_per_case']}\u201d at each case" if "ceiling_per_case" in b else
                f"{b['ceiling_name']}: {perf_summary.format_rate(b['ceiling'])} {b['unit']}"
                for r in results for b in r["benchmarks"]}
    ratios = rf"n/a|best {RATIO} \(.*\), worst {RATIO} \(.*\)"
    summary = page_tables(page)[0]
    assert [row for row in table_rows(summary, "th") if row] == [perf_summary.SUMMARY_HEADER] == [
        ["tutorial", "benchmark", "kernel", "vs. peer, GPU time", "vs. peer, back to back", "of ceiling", "ceiling"]]
    rows = [row for row in table_rows(summary) if row]
    assert rows == [[r["tutorial"], *perf_summary.summary_row(b, s)]
                    for r in results for b in r["benchmarks"] for s in perf_summary.summarize(b)]
    on_gpu = [r["on_gpu"] for r in results for b in r["benchmarks"] for s in perf_summary.summarize(b)]
    for (_, _, _, gpu, back_to_back, fraction, ceiling), gpu_record in zip(rows, on_gpu, strict=True):
        assert re.fullmatch(ratios, gpu) and re.fullmatch(ratios, back_to_back), (gpu, back_to_back)
        assert gpu_record or gpu == "n/a", "GPU time on the interpreter's row"
        assert re.fullmatch(r"n/a|best \d+% \(.*\), worst \d+% \(.*\)", fraction), fraction
        assert ceiling in ceilings, (ceiling, ceilings)
    # Between the summary and the first benchmark's heading: the range of every ceiling measured more than once.
    between = page.split("</table>", 1)[1].split('<p class="rubric">', 1)[0]
    # Sphinx sets apostrophes as typographic ones on the page.
    sentences = [text_of(p).replace("\u2019", "'") for p in re.findall(r"<p>(.*?)</p>", between, re.S)]
    assert sentences == perf_summary.ceiling_ranges(results)
    measurements = {}  # (ceiling, unit) -> {(lesson, figure)}: benchmarks of one lesson share its run's figure
    for r in results:
        for b in r["benchmarks"]:
            if "ceiling_per_case" in b:  # its fractions divide by each case's own ceiling
                continue
            measurements.setdefault((b["ceiling_name"], b["unit"]), set()).add((r["tutorial"], b["ceiling"]))
    for (name, unit), runs in measurements.items():
        said = [s for s in sentences if s.startswith(f"The {name} was measured {len(runs)} times in this build")]
        assert len(said) == (len(runs) > 1), (name, runs, sentences)
    # Where the numbers' method is defined, for the lessons to link to.
    assert '<section id="how-we-time">' in page and "<h2>How we time" in page


def test_performance_page_shows_every_case(site):
    """Below the summary, each benchmark's heading names and links its lesson, a line under it gives the
    ceiling of its run (and names the providers whose GPU time came from the profiler), and its table shows
    every case and kernel as case_table computes them from this build's results: on a GPU both ratios and
    the limit that binds."""
    results = perf_summary.load_results(RESULTS)
    page = (site / "performance.html").read_text()
    sections = re.findall(r'<p class="rubric">(.*?)</p>\s*<p>(.*?)</p>\s*(?:<div[^>]*>\s*)?(<table.*?</table>)',
                          page, re.S)
    benches = [(r, b) for r in results for b in r["benchmarks"]]
    assert len(sections) == len(benches) == len(page_tables(page)) - 1
    for (heading, ceiling, table), (result, bench) in zip(sections, benches):
        tutorial = result["tutorial"]
        assert f'href="tutorials/{tutorial}.html"' in heading, heading
        assert text_of(heading) == f"{tutorial}: {bench['name']}"
        rate = f"{perf_summary.format_rate(bench['ceiling'])} {bench['unit']}"
        line = (f"Ceiling: at each case, \u201c{bench['ceiling_per_case']}\u201d measured there in the same run (the "
                f"device's {bench['ceiling_name']}: {rate})." if "ceiling_per_case" in bench else
                f"Ceiling: {bench['ceiling_name']}, {rate}, measured in the same run.")
        profiled = perf_summary.profiler_text(bench)
        assert bool(profiled) == any(row.get("gpu_method") == "profiler" for row in bench["rows"]
                                     if row["provider"] in bench["ours"] + bench["peers"] +
                                     [bench.get("ceiling_per_case")])
        assert text_of(ceiling).replace("\u2019", "'") == (f"{line} {profiled}" if profiled else line)
        assert 'class="perf-summary' in table, "the case tables share the summary's look on a phone"
        header, rows = perf_summary.case_table(bench)
        columns = len(perf_summary.case_columns(bench))
        assert [row for row in table_rows(table, "th") if row] == [header]
        quantities = (["kernel", "vs. peer, GPU time", "vs. peer, back to back", "of ceiling", "limit"]
                      if result["on_gpu"] else ["kernel", "vs. peer, back to back", "of ceiling"])
        assert header[columns:] == quantities
        assert [row for row in table_rows(table) if row] == rows
        assert len(rows) == len(perf_summary.per_case(bench)) * len(bench["ours"])
        for row in rows:
            cells = dict(zip(quantities, row[columns:], strict=True))
            assert cells["kernel"] in bench["ours"]
            for name in ("vs. peer, GPU time", "vs. peer, back to back"):
                assert re.fullmatch(rf"n/a|{RATIO}", cells.get(name, "n/a")), row
            assert re.fullmatch(r"n/a|\d+%", cells["of ceiling"]) and cells.get("limit", "n/a") in (
                "host", "GPU", "n/a"), row


@pytest.mark.parametrize("value, text", [(727.7, "728"), (3352.1, "3352"), (99.96, "100"), (42.45, "42.5"),
                                         (2.0922, "2.09"), (0.0021003, "0.00210")])
def test_a_rate_has_one_format(value, text):
    assert perf_summary.format_rate(value) == text


@pytest.mark.parametrize("ratio, text", [(0.5, "0.50x"), (0.994, "0.99x"), (0.998, "0.998x"), (0.99997, "0.99997x"),
                                         (1.0, "1.00x"), (1.0005, "1.00x"), (1.25, "1.25x")])
def test_a_ratio_just_under_one_does_not_print_as_one(ratio, text):
    assert perf_summary.format_ratio(ratio) == text


def test_perf_summary_ratios():
    bench = {"ceiling": 100.0, "ours": ["mine"], "peers": ["a", "b"], "rows": [
        {"N": 1, "provider": "mine", "value": 50.0}, {"N": 1, "provider": "a", "value": 25.0},
        {"N": 1, "provider": "b", "value": 40.0}, {"N": 2, "provider": "mine", "value": 90.0},
        {"N": 2, "provider": "a", "value": 100.0}, {"N": 2, "provider": "b", "value": float("nan")}]}
    (summary,) = perf_summary.summarize(bench)
    (best, best_case), (worst, worst_case) = summary["ratio"]
    assert (best.value, best.peer, best_case) == (1.25, "b", (("N", "1"),))
    assert (worst.value, worst.peer, worst_case) == (0.9, "a", (("N", "2"),))
    assert summary["fraction"][0][0] == 0.9 and summary["fraction"][1][0] == 0.5
    assert summary["gpu_ratio"] is None, "no GPU time, no ratio by it"


# Two kernels, two peers, a ceiling of 200: a case with everything measured, one where our first kernel's
# value is NaN, one where no peer was measured (None and NaN), and one where our second kernel and one
# peer have no row at all, beside a faster provider that is neither ours nor a peer. As the interpreter
# measures: no GPU time.
PER_CASE_BENCH = {"name": "b", "unit": "GB/s", "ceiling_name": "copy bandwidth", "ceiling": 200.0,
                  "ours": ["mine", "other"], "peers": ["a", "b"], "rows": [
    {"dtype": "fp16", "N": 1, "provider": "mine", "value": 90.0},
    {"dtype": "fp16", "N": 1, "provider": "a", "value": 100.0},
    {"dtype": "fp16", "N": 1, "provider": "b", "value": 80.0},
    {"dtype": "fp16", "N": 1, "provider": "other", "value": 120.0},
    {"dtype": "fp16", "N": 2, "provider": "mine", "value": float("nan")},
    {"dtype": "fp16", "N": 2, "provider": "a", "value": 50.0},
    {"dtype": "fp16", "N": 2, "provider": "b", "value": 60.0},
    {"dtype": "fp16", "N": 2, "provider": "other", "value": 30.0},
    {"dtype": "fp32", "N": 1, "provider": "mine", "value": 20.0},
    {"dtype": "fp32", "N": 1, "provider": "a", "value": None},
    {"dtype": "fp32", "N": 1, "provider": "b", "value": float("nan")},
    {"dtype": "fp32", "N": 1, "provider": "other", "value": 10.0},
    {"dtype": "fp32", "N": 2, "provider": "mine", "value": 40.0},
    {"dtype": "fp32", "N": 2, "provider": "b", "value": 32.0},
    {"dtype": "fp32", "N": 2, "provider": "ignored", "value": 1000.0}]}
CPU = {"tutorial": "01-x", "platform": "Triton interpreter on CPU", "on_gpu": False, "date": "2026-11-22"}


def test_perf_per_case_ratios_and_fractions():
    perf_summary.validate_record({**CPU, "benchmarks": [PER_CASE_BENCH]})
    cases = perf_summary.per_case(PER_CASE_BENCH)
    assert [c["case"] for c in cases] == [{"dtype": "fp16", "N": 1}, {"dtype": "fp16", "N": 2},
                                          {"dtype": "fp32", "N": 1}, {"dtype": "fp32", "N": 2}]
    got = [{k: (v["ratio"] and v["ratio"][:2], v["fraction"]) for k, v in c["kernels"].items()} for c in cases]
    assert got == [
        {"mine": ((pytest.approx(0.9), "a"), pytest.approx(0.45)),
         "other": ((pytest.approx(1.2), "a"), pytest.approx(0.6))},
        {"mine": (None, None), "other": ((pytest.approx(0.5), "b"), pytest.approx(0.15))},
        {"mine": (None, pytest.approx(0.1)), "other": (None, pytest.approx(0.05))},
        {"mine": ((pytest.approx(1.25), "b"), pytest.approx(0.2)), "other": (None, None)}]
    assert all(k["gpu_ratio"] is None and k["limit"] is None for c in cases for k in c["kernels"].values())


def test_perf_case_table_text():
    header, rows = perf_summary.case_table(PER_CASE_BENCH)
    assert header == ["dtype", "N", "kernel", "vs. peer, back to back", "of ceiling"]
    assert rows == [["fp16", "1", "mine", "0.90x a", "45%"], ["fp16", "1", "other", "1.20x a", "60%"],
                    ["fp16", "2", "mine", "n/a", "n/a"], ["fp16", "2", "other", "0.50x b", "15%"],
                    ["fp32", "1", "mine", "n/a", "10%"], ["fp32", "1", "other", "n/a", "5%"],
                    ["fp32", "2", "mine", "1.25x b", "20%"], ["fp32", "2", "other", "n/a", "n/a"]]


def gpu_row(n, provider, value, gpu_value, spread=0.01, gpu_spread=0.01, method="CUDA graph"):
    return {"N": n, "provider": provider, "value": value, "gpu_value": gpu_value, "spread": spread,
            "gpu_spread": gpu_spread, "gpu_method": method}


# On a GPU: at N=1 the host binds our kernel (back to back 100 against GPU time 150: 50% longer, spreads of
# 1%) and the peers swap places between the two timings; at N=2 back to back is within the spread of GPU
# time; at N=3 our timings spread by 30%, so the ratio is a range and no ratio is given to two decimals;
# at N=4 the peer's GPU time comes from the profiler and back to back is even faster than GPU time.
GPU_BENCH = {"name": "g", "unit": "TFLOP/s", "ceiling_name": "fp16 matmul rate", "ceiling": 300.0,
             "ours": ["mine"], "peers": ["a", "b"], "rows": [
    gpu_row(1, "mine", 100.0, 150.0), gpu_row(1, "a", 50.0, 200.0), gpu_row(1, "b", 80.0, 100.0),
    gpu_row(2, "mine", 145.0, 150.0, spread=0.05), gpu_row(2, "a", 100.0, 100.0), gpu_row(2, "b", 50.0, 50.0),
    gpu_row(3, "mine", 120.0, 120.0, spread=0.3, gpu_spread=0.3), gpu_row(3, "a", 100.0, 100.0),
    gpu_row(3, "b", None, float("nan")),
    gpu_row(4, "mine", 90.0, 60.0), gpu_row(4, "a", 60.0, 40.0, method="profiler"),
    gpu_row(4, "b", 30.0, 20.0)]}


def test_perf_on_a_gpu_both_ratios_and_the_limit_that_binds():
    perf_summary.validate_record({**GOOD_RECORD, "benchmarks": [GPU_BENCH]})
    kernels = [case["kernels"]["mine"] for case in perf_summary.per_case(GPU_BENCH)]
    assert [(k["gpu_ratio"][:2], k["ratio"][:2]) for k in kernels] == [
        ((0.75, "a"), (1.25, "b")), ((1.5, "a"), (1.45, "a")), ((1.2, "a"), (1.2, "a")), ((1.5, "a"), (1.5, "a"))]
    assert [k["limit"] for k in kernels] == ["host", "GPU", "GPU", "GPU"]
    assert [k["fraction"] for k in kernels] == [0.5, 0.5, 0.4, 0.2]  # by GPU time, as the ceiling is measured
    # Ours spread by 30%, the peer by 1%: from our slowest against its fastest to our fastest against its slowest.
    assert kernels[2]["ratio"] == kernels[2]["gpu_ratio"] == (pytest.approx(1.2), "a", pytest.approx(1.2 / 1.3),
                                                             pytest.approx(1.2 * 1.01))
    assert all(k["ratio"].low is None for i, k in enumerate(kernels) if i != 2)
    header, rows = perf_summary.case_table(GPU_BENCH)
    assert header == ["N", "kernel", "vs. peer, GPU time", "vs. peer, back to back", "of ceiling", "limit"]
    assert rows == [["1", "mine", "0.75x a", "1.25x b", "50%", "host"],
                    ["2", "mine", "1.50x a", "1.45x a", "50%", "GPU"],
                    ["3", "mine", "0.92\u20131.2x a", "0.92\u20131.2x a", "40%", "GPU"],
                    ["4", "mine", "1.50x a", "1.50x a", "20%", "GPU"]]
    (summary,) = perf_summary.summarize(GPU_BENCH)
    assert perf_summary.summary_row(GPU_BENCH, summary) == [
        "g", "mine", "best 1.50x a (N=4), worst 0.75x a (N=1)", "best 1.50x a (N=4), worst 0.92\u20131.2x a (N=3)",
        "best 50% (N=2), worst 20% (N=4)", "fp16 matmul rate: 300 TFLOP/s"]
    assert perf_summary.profiler_text(GPU_BENCH) == (
        "GPU time by the profiler's kernel times, as the calls could not be captured in a CUDA graph: "
        "\u201ca\u201d (1 of 4 cases).")


def test_a_limit_needs_both_times_and_their_spreads():
    assert perf_summary.binding_limit(gpu_row(1, "mine", 100.0, 150.0)) == "host"
    assert perf_summary.binding_limit(gpu_row(1, "mine", 100.0, 150.0, spread=0.6)) == "GPU"
    assert perf_summary.binding_limit(gpu_row(1, "mine", 100.0, 150.0, gpu_spread=0.6)) == "GPU"
    assert perf_summary.binding_limit(gpu_row(1, "mine", 100.0, 150.0, spread=None)) is None
    assert perf_summary.binding_limit(gpu_row(1, "mine", None, 150.0)) is None
    assert perf_summary.binding_limit({"N": 1, "provider": "mine", "value": 100.0}) is None
    assert perf_summary.binding_limit(None) is None
    # Back to back 5% slower than GPU time, with settled timings: under the 10% the lessons call a difference.
    assert perf_summary.binding_limit(gpu_row(1, "mine", 100.0, 105.0, spread=0.01, gpu_spread=0.01)) == "GPU"
    assert perf_summary.binding_limit(gpu_row(1, "mine", 100.0, 111.0, spread=0.01, gpu_spread=0.01)) == "host"


@pytest.mark.parametrize("low, high, text", [(0.9231, 1.2, "0.92\u20131.2x"), (0.5, 0.61, "0.50\u20130.61x"),
                                             (8.04, 12.6, "8.0\u201313x"), (0.012, 0.0151, "0.012\u20130.015x")])
def test_a_ratio_whose_timings_spread_shows_as_a_range(low, high, text):
    assert perf_summary.format_ratio_range(low, high) == text


def test_perf_ceiling_text():
    assert perf_summary.ceiling_text(PER_CASE_BENCH) == "Ceiling: copy bandwidth, 200 GB/s, measured in the same run."
    bench = dict(PER_CASE_BENCH, ceiling_name="fp16 matmul rate", ceiling=670.6, unit="TFLOP/s")
    assert perf_summary.ceiling_text(bench) == "Ceiling: fp16 matmul rate, 671 TFLOP/s, measured in the same run."


def ceiling_record(tutorial, *ceilings):
    """A valid record with one benchmark per (ceiling_name, ceiling, unit)."""
    record = {"tutorial": tutorial, "platform": "GPU: test", "on_gpu": True, "date": "2026-11-22", "benchmarks": [
        {"name": f"b{i}", "unit": unit, "ceiling_name": name, "ceiling": ceiling, "ours": ["mine"], "peers": [],
         "rows": [{"N": 1, "provider": "mine", "value": 1.0, "gpu_value": 1.0}]}
        for i, (name, ceiling, unit) in enumerate(ceilings)]}
    perf_summary.validate_record(record)
    return record


MATMUL = "fp16 matmul rate"


def test_perf_ceiling_ranges():
    """One sentence per ceiling measured in several benchmarks, over records and over the benchmarks of
    one record; none for a ceiling measured once."""
    results = [ceiling_record("04-a", (MATMUL, 653.2, "TFLOP/s"), ("copy bandwidth", 3352.1, "GB/s")),
               ceiling_record("05-b", (MATMUL, 742.4, "TFLOP/s")),
               ceiling_record("06-c", (MATMUL, 716.0, "TFLOP/s"), (MATMUL, 670.6, "TFLOP/s"))]
    assert perf_summary.ceiling_ranges(results) == [
        "The fp16 matmul rate was measured 4 times in this build: from 653 to 742 TFLOP/s "
        "(each benchmark's fractions use its own run's figure)."]
    results.append(ceiling_record("07-d", ("copy bandwidth", 2.0922, "GB/s")))
    assert perf_summary.ceiling_ranges(results)[1] == (
        "The copy bandwidth was measured 2 times in this build: from 2.09 to 3352 GB/s "
        "(each benchmark's fractions use its own run's figure).")
    # Two benchmarks of one lesson sharing its run's figure are one measurement, used twice.
    results.append(ceiling_record("08-e", (MATMUL, 700.0, "TFLOP/s"), (MATMUL, 700.0, "TFLOP/s")))
    assert perf_summary.ceiling_ranges(results)[0] == (
        "The fp16 matmul rate was measured 5 times in this build (for 6 benchmarks): from 653 to 742 TFLOP/s "
        "(each benchmark's fractions use its own run's figure).")


def test_perf_ceiling_ranges_need_two_measurements_of_one_quantity():
    once = [ceiling_record("04-a", (MATMUL, 653.2, "TFLOP/s"), ("copy bandwidth", 3352.1, "GB/s")),
            ceiling_record("05-b", ("torch.matmul", 0.19, "TFLOP/s"))]
    assert perf_summary.ceiling_ranges(once) == []
    assert perf_summary.ceiling_ranges([ceiling_record("04-a", (MATMUL, 653.2, "TFLOP/s"))]) == []
    # The same name in another unit is another quantity: no range across units.
    assert perf_summary.ceiling_ranges(once + [ceiling_record("06-c", (MATMUL, 90.0, "GB/s"))]) == []
    # One run's figure shared by two benchmarks is one measurement: nothing to compare it with.
    shared = [ceiling_record("05-b", (MATMUL, 0.19636, "TFLOP/s"), (MATMUL, 0.19636, "TFLOP/s"))]
    assert perf_summary.ceiling_ranges(shared) == []
    # Two lessons that measured the same figure: a range from it to itself is one value.
    twice = shared + [ceiling_record("06-c", (MATMUL, 0.19636, "TFLOP/s"))]
    assert perf_summary.ceiling_ranges(twice) == [
        "The fp16 matmul rate was measured 2 times in this build (for 3 benchmarks): 0.196 TFLOP/s each time "
        "(each benchmark's fractions use its own run's figure)."]


def figure_series(fig):
    """What the ratio figure draws: its row labels, its legend, and per series colour the bars' ends."""
    (ax,) = fig.axes
    labels = [label.get_text() for label in ax.get_yticklabels()]
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    bars = {}
    for line in ax.get_lines():
        if line.get_linestyle() == "-":
            bars.setdefault(line.get_color(), []).append(tuple(line.get_xdata()))
    return labels, legend, bars


ONE = "1.0: as fast as the strongest peer"
GPU_TIME, BACK_TO_BACK = (colour for _, colour, _ in perf_summary.RATIO_SERIES)


def test_the_ratio_figure_draws_both_timings_of_a_gpu_in_path_order(tmp_path):
    """A bar per lesson, benchmark and kernel from its worst to its best ratio over the cases, the ratios
    summarize computes: by GPU time and back to back on a GPU, lessons in path order."""
    later = {**GOOD_RECORD, "tutorial": "03-later", "benchmarks": [GPU_BENCH]}
    first = {**GOOD_RECORD, "benchmarks": [{**GPU_BENCH, "name": "h", "ours": ["mine", "a"], "peers": ["b"]}]}
    for record in (later, first):
        perf_summary.validate_record(record)
    fig, rows = perf_summary.ratio_figure([later, first])
    assert [row[:3] for row in rows] == [("01-x", "h", "mine"), ("01-x", "h", "a"), ("03-later", "g", "mine")]
    # GPU_BENCH by GPU time: 0.75, 1.5, 1.2, 1.5 over the cases; back to back 1.25, 1.45, 1.2, 1.5.
    assert rows[2].gpu == (0.75, 1.5) and rows[2].back_to_back == pytest.approx((1.2, 1.5))
    labels, legend, bars = figure_series(fig)
    assert labels == ["mine", "a", "mine"]
    assert legend == ["GPU time", "back to back", ONE]
    assert bars[GPU_TIME] == [row.gpu for row in rows] and bars[BACK_TO_BACK] == [row.back_to_back for row in rows]
    assert [tuple(line.get_xdata()) for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"] == [(1, 1)]
    assert "GPU time (dark) and back to back (light)" in perf_summary.ratio_caption([later, first])
    assert "illustrative" not in perf_summary.ratio_caption([later, first])
    assert "3 kernels" in perf_summary.ratio_alt(rows) and "GPU time and back to back" in perf_summary.ratio_alt(rows)
    # The PNG: as wide as the page shows it (850 px, in an 896 px column), taller with more rows.
    png, shorter = tmp_path / "ratios.png", tmp_path / "one.png"
    assert perf_summary.draw_ratios([later, first], png) == rows
    assert perf_summary.draw_ratios([later], shorter) == rows[2:]
    from matplotlib.image import imread

    (height, width, _), (one_row, _, _) = imread(png).shape, imread(shorter).shape
    assert width == perf_summary.RATIO_FIGURE_WIDTH_IN * perf_summary.RATIO_FIGURE_DPI == 850
    assert height > one_row


def test_the_ratio_figure_draws_back_to_back_only_from_the_interpreter():
    cpu = {**CPU, "benchmarks": [PER_CASE_BENCH]}
    gpu = {**GOOD_RECORD, "tutorial": "02-gpu", "benchmarks": [GPU_BENCH]}
    fig, rows = perf_summary.ratio_figure([cpu])
    # PER_CASE_BENCH: "mine" 0.9 and 1.25 beside a peer, "other" 1.2 and 0.5.
    assert [(row.kernel, row.gpu) for row in rows] == [("mine", None), ("other", None)]
    assert [row.back_to_back for row in rows] == [pytest.approx((0.9, 1.25)), pytest.approx((0.5, 1.2))]
    labels, legend, bars = figure_series(fig)
    assert labels == ["mine", "other"] and legend == ["back to back", ONE] and set(bars) == {BACK_TO_BACK}
    assert "interpreter's ratios are illustrative" in perf_summary.ratio_caption([cpu])
    assert "GPU time" not in perf_summary.ratio_caption([cpu]) and "GPU time" not in perf_summary.ratio_alt(rows)
    # Beside a GPU's record, the interpreter's still gives back to back only, and the caption says why.
    fig, rows = perf_summary.ratio_figure([gpu, cpu])
    assert [(row.tutorial, row.gpu is not None) for row in rows] == [("01-x", False), ("01-x", False),
                                                                     ("02-gpu", True)]
    assert len(figure_series(fig)[2][GPU_TIME]) == 1
    assert "illustrative" in perf_summary.ratio_caption([gpu, cpu])


def test_no_ratio_figure_where_no_kernel_was_measured_beside_a_peer(tmp_path):
    alone = {**CPU, "benchmarks": [{**PER_CASE_BENCH, "peers": []}]}
    unmeasured = copy.deepcopy({**GOOD_RECORD, "benchmarks": [GPU_BENCH]})
    for row in unmeasured["benchmarks"][0]["rows"]:
        if row["provider"] != "mine":
            row.update(value=None, gpu_value=float("nan"))
    for record in (alone, unmeasured):
        perf_summary.validate_record(record)
    assert perf_summary.ratio_rows([alone, unmeasured]) == []
    assert perf_summary.ratio_figure([alone, unmeasured]) is None
    assert perf_summary.draw_ratios([alone, unmeasured], tmp_path / "ratios.png") == []
    assert not (tmp_path / "ratios.png").exists()


@pytest.mark.parametrize("lesson", LESSONS)
def test_notebook_is_valid_and_runs_on_cpu(site, lesson, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    # A reader's folder: the site's zip of all notebooks, unpacked (no scripts: the lessons that build on
    # earlier ones load them from their notebooks), and no build environment variables.
    (archive,) = site.glob("_downloads/*/tutorials_jupyter.zip")
    with zipfile.ZipFile(archive) as bundle:
        bundle.extractall(tmp_path)
    # Its first cell fetches what is missing: nothing is, so it runs with no network.
    assert [p.name for p in tmp_path.rglob("*.py")] == ["stepkit.py"], "lessons as notebooks only, beside stepkit"
    path = tmp_path / f"{lesson}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert "pip install" in notebook.cells[0].source, "the first cell must tell a reader what to install"
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]


def zip_of_all(site, kind):
    (archive,) = site.glob(f"_downloads/*/tutorials_{kind}.zip")
    return archive


@pytest.mark.parametrize("kind, suffix", [("python", ".py"), ("jupyter", ".ipynb")])
def test_a_zip_of_all_lessons_holds_what_they_need_and_runs_as_it_is(site, tmp_path, kind, suffix):
    """Each zip holds every lesson (scripts or notebooks) and the shared files as they are, and in a folder of
    its own, with no build around it, every lesson imports: the ones that load earlier lessons find them
    beside them, as scripts or as notebooks."""
    with zipfile.ZipFile(zip_of_all(site, kind)) as bundle:
        assert sorted(bundle.namelist()) == sorted([f"{lesson}{suffix}" for lesson in LESSONS] +
                                                   list(lesson_files.SHARED))
        for name in lesson_files.SHARED:
            assert bundle.read(name) == (TUTORIALS / name).read_bytes(), f"{name} differs from tutorials/"
        bundle.extractall(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUTORIAL_", "DOCS_"))}
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, stepkit as kit\n"
                               "for stem in sys.argv[1:]:\n    kit.load_lesson(stem)\nprint('loaded')", *LESSONS],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert loaded.returncode == 0 and loaded.stdout.strip().endswith("loaded"), loaded.stderr[-3000:]


def test_each_notebook_fetches_its_own_needs_at_this_build_s_version(site, monkeypatch):
    """A single notebook, downloaded alone, fetches stepkit.py, the tables and the lessons it loads, from the
    repository the site links to, at the version this build was made from; the same in the zip."""
    ref = run_conf(monkeypatch)["download_ref"]
    assert ref, "the build knows its version"
    repository = github_repository(site)
    # The install line pins what Getting started's does: the versions that produced the pages.
    install, _ = install_line.install_text(ROOT / "build" / "results", ROOT / "requirements.txt")
    assert "torch==" in install and "triton==" in install
    with zipfile.ZipFile(zip_of_all(site, "jupyter")) as bundle:
        for lesson in LESSONS:
            cell = lesson_files.download_cell(repository, ref, lesson_files.needs(TUTORIALS, lesson), install)
            (alone,) = site.glob(f"_downloads/*/{lesson}.ipynb")
            for notebook in (json.loads(alone.read_text()), json.loads(bundle.read(f"{lesson}.ipynb"))):
                assert "".join(notebook["cells"][0]["source"]) == cell, lesson
            assert f'ref = "{ref}"' in cell and f'repository = "{repository}"' in cell


def test_getting_started_gives_the_download_step_for_a_script(site, monkeypatch):
    ref = run_conf(monkeypatch)["download_ref"]
    text = html.unescape(re.sub(r"<[^>]+>", "", (site / "getting-started.html").read_text()))
    assert f'repository = "{github_repository(site)}"' in text and f'ref = "{ref}"' in text
    loaded = {name for lesson in LESSONS for name in lesson_files.siblings(TUTORIALS, lesson)}
    # The names, a few to a line so that the step fits 80 columns.
    listed = re.search(r"for name in \[(.*?)\]:", text, re.DOTALL).group(1)
    assert re.findall(r'"([^"]+)"', listed) == [*lesson_files.SHARED, *(f"{n}.py" for n in sorted(loaded))]
    step = text[text.index("python - <<'EOF'"):text.index("EOF", text.index("python - <<'EOF'") + 16) + 3]
    assert max(map(len, step.splitlines())) <= 80, "the download step scrolls sideways"


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


def test_the_install_line_names_the_versions_that_built_the_pages(tmp_path):
    import install_line

    record = {"platform": "GPU: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, Triton 3.6.0)", "on_gpu": True}
    cpu = {"platform": "Triton interpreter on CPU (x86_64; torch 2.13.0+cpu, Triton 3.9.0): ...", "on_gpu": False}
    (tmp_path / "02-a.json").write_text(json.dumps(cpu))
    (tmp_path / "03-b.json").write_text(json.dumps(record))
    command, said = install_line.install_text(tmp_path, ROOT / "requirements.txt")
    assert command == "pip install torch==2.11.0 triton==3.6.0 matplotlib pandas"  # the GPU's, no +cu130
    assert "NVIDIA H100" in said
    (tmp_path / "03-b.json").unlink()
    assert install_line.install_text(tmp_path, ROOT / "requirements.txt")[0].startswith("pip install torch==2.13.0 ")
    (tmp_path / "02-a.json").unlink()
    command, said = install_line.install_text(tmp_path, ROOT / "requirements.txt")
    pins = dict(re.findall(r"^(torch|triton)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    assert command == f"pip install torch=={pins['torch']} triton=={pins['triton']} matplotlib pandas"
    assert "requirements.txt" in said
    assert install_line.install_text(tmp_path, tmp_path / "requirements.txt")[0] == (
        "pip install torch triton matplotlib pandas")  # a build worker's copy has no requirements.txt


def test_getting_started_shows_the_install_line_and_where_mac_and_windows_readers_go(site):
    text = re.sub(r"<[^>]+>", "", (site / "getting-started.html").read_text())
    assert re.search(r"pip install torch==[\d.]+ triton==[\d.]+ matplotlib pandas", text)
    assert "WSL2" in text and "Linux only" in text
