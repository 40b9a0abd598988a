"""The site as a reader gets it: a full CPU build with no warnings, every tutorial page complete, every
notebook valid and runnable, a failing tutorial failing the build by name, every page self-contained
(nothing from another host), links to the GitHub repository from its one setting, and the results
each benchmarking lesson leaves for the performance page following perf_summary's contract."""

import ast
import copy
import html
import json
import re
import runpy
import shutil
import zipfile
from html.parser import HTMLParser

import perf_summary
import pytest
from conftest import ROOT, TUTORIALS, sphinx
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
    assert f"git clone https://github.com/{repository}.git &amp;&amp; cd {repository.split('/')[1]}" in text
    assert "&lt;this repository&gt;" not in text


def test_the_repository_setting_follows_github_actions(monkeypatch):
    monkeypatch.setenv("GITHUB_REPOSITORY", "someone/a-fork")
    # conf.py exports where the results go: keep this process's value as it was.
    monkeypatch.setenv("TUTORIAL_RESULTS_DIR", str(RESULTS))
    conf = runpy.run_path(str(ROOT / "docs" / "conf.py"))
    assert conf["repository"] == "someone/a-fork"
    assert conf["html_theme_options"]["github_url"] == "https://github.com/someone/a-fork"


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
     "peers": ["a"], "rows": [{"N": 1, "provider": "mine", "value": 50.0}, {"N": 1, "provider": "a", "value": None}]}]}


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
])
def test_validate_record_names_the_bad_field(field, change):
    perf_summary.validate_record(GOOD_RECORD)
    record = copy.deepcopy(GOOD_RECORD)
    change(record)
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}[:. ]"):
        perf_summary.validate_record(record)


def test_a_case_s_own_ceiling_divides_the_fractions_of_that_case():
    record = copy.deepcopy(GOOD_RECORD)
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


def test_performance_page_is_computed_from_this_build(site):
    results = perf_summary.load_results(RESULTS)
    page = (site / "performance.html").read_text()
    hrefs = links_of(site / "performance.html").hrefs
    for result in results:
        assert f"tutorials/{result['tutorial']}.html" in hrefs, f"{result['tutorial']} does not link to its page"
    if not all(r["on_gpu"] for r in results):
        assert "measure the interpreter, not a GPU" in page
    # Each quantity in one format: ratios 0.00x, fractions 0%, ceilings as format_rate writes them.
    ceilings = {f"\u201c{b['ceiling_per_case']}\u201d at each case" if "ceiling_per_case" in b else
                f"{b['ceiling_name']}: {perf_summary.format_rate(b['ceiling'])} {b['unit']}"
                for r in results for b in r["benchmarks"]}
    ratio = r"n/a|\d+\.\d\dx .+ \(.*\)"
    summary = page_tables(page)[0]
    assert [row for row in table_rows(summary, "th") if row] == [
        ["tutorial", "benchmark", "kernel", "best vs. peer", "worst vs. peer", "of ceiling", "ceiling"]]
    rows = [row for row in table_rows(summary) if row]
    assert rows
    for _, _, _, best, worst, fraction, ceiling in rows:
        assert re.fullmatch(ratio, best) and re.fullmatch(ratio, worst), (best, worst)
        assert re.fullmatch(r"best \d+% \(.*\), worst \d+% \(.*\)", fraction), fraction
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


def test_performance_page_shows_every_case(site):
    """Below the summary, each benchmark's heading names and links its lesson, a line under it gives the
    ceiling of its run, and its table shows every case as case_table computes it from this build's
    results, under headers that name the kernel but not the ceiling."""
    results = perf_summary.load_results(RESULTS)
    page = (site / "performance.html").read_text()
    sections = re.findall(r'<p class="rubric">(.*?)</p>\s*<p>(.*?)</p>\s*(?:<div[^>]*>\s*)?(<table.*?</table>)',
                          page, re.S)
    benches = [(r["tutorial"], b) for r in results for b in r["benchmarks"]]
    assert len(sections) == len(benches) == len(page_tables(page)) - 1
    for (heading, ceiling, table), (tutorial, bench) in zip(sections, benches):
        assert f'href="tutorials/{tutorial}.html"' in heading, heading
        assert text_of(heading) == f"{tutorial}: {bench['name']}"
        rate = f"{perf_summary.format_rate(bench['ceiling'])} {bench['unit']}"
        assert text_of(ceiling).replace("\u2019", "'") == (
            f"Ceiling: at each case, \u201c{bench['ceiling_per_case']}\u201d measured there in the same run (the "
            f"device's {bench['ceiling_name']}: {rate})." if "ceiling_per_case" in bench else
            f"Ceiling: {bench['ceiling_name']}, {rate}, measured in the same run.")
        assert 'class="perf-summary' in table, "the case tables share the summary's look on a phone"
        header, rows = perf_summary.case_table(bench)
        assert [row for row in table_rows(table, "th") if row] == [header]
        assert header[len(perf_summary.case_columns(bench)):] == [
            f"{ours}: {quantity}" for ours in bench["ours"] for quantity in ("vs. peer", "of ceiling")]
        assert [row for row in table_rows(table) if row] == rows
        for row in rows:
            kernels = row[len(perf_summary.case_columns(bench)):]
            for ratio, fraction in zip(kernels[::2], kernels[1::2], strict=True):
                assert re.fullmatch(r"n/a|\d+\.\d{2,6}x .+", ratio) and re.fullmatch(r"n/a|\d+%", fraction), row


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
    assert summary["best_ratio"][:2] == (1.25, (("N", "1"),)) and summary["best_ratio"][2] == "b"
    assert summary["worst_ratio"][:3] == (0.9, (("N", "2"),), "a")
    assert summary["best_fraction"][0] == 0.9 and summary["worst_fraction"][0] == 0.5


# Two kernels, two peers, a ceiling of 200: a case with everything measured, one where our first kernel's
# value is NaN, one where no peer was measured (None and NaN), and one where our second kernel and one
# peer have no row at all, beside a faster provider that is neither ours nor a peer.
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


def test_perf_per_case_ratios_and_fractions():
    perf_summary.validate_record({"tutorial": "01-x", "platform": "GPU: test", "on_gpu": True,
                                  "date": "2026-11-22", "benchmarks": [PER_CASE_BENCH]})
    cases = perf_summary.per_case(PER_CASE_BENCH)
    assert [c["case"] for c in cases] == [{"dtype": "fp16", "N": 1}, {"dtype": "fp16", "N": 2},
                                          {"dtype": "fp32", "N": 1}, {"dtype": "fp32", "N": 2}]
    got = [{k: (v["ratio"], v["fraction"]) for k, v in c["kernels"].items()} for c in cases]
    assert got == [
        {"mine": ((pytest.approx(0.9), "a"), pytest.approx(0.45)),
         "other": ((pytest.approx(1.2), "a"), pytest.approx(0.6))},
        {"mine": (None, None), "other": ((pytest.approx(0.5), "b"), pytest.approx(0.15))},
        {"mine": (None, pytest.approx(0.1)), "other": (None, pytest.approx(0.05))},
        {"mine": ((pytest.approx(1.25), "b"), pytest.approx(0.2)), "other": (None, None)}]


def test_perf_case_table_text():
    header, rows = perf_summary.case_table(PER_CASE_BENCH)
    assert header == ["dtype", "N", "mine: vs. peer", "mine: of ceiling", "other: vs. peer", "other: of ceiling"]
    assert rows == [["fp16", "1", "0.90x a", "45%", "1.20x a", "60%"],
                    ["fp16", "2", "n/a", "n/a", "0.50x b", "15%"],
                    ["fp32", "1", "n/a", "10%", "n/a", "5%"],
                    ["fp32", "2", "1.25x b", "20%", "n/a", "n/a"]]


def test_perf_ceiling_text():
    assert perf_summary.ceiling_text(PER_CASE_BENCH) == "Ceiling: copy bandwidth, 200 GB/s, measured in the same run."
    bench = dict(PER_CASE_BENCH, ceiling_name="fp16 matmul rate", ceiling=670.6, unit="TFLOP/s")
    assert perf_summary.ceiling_text(bench) == "Ceiling: fp16 matmul rate, 671 TFLOP/s, measured in the same run."


def ceiling_record(tutorial, *ceilings):
    """A valid record with one benchmark per (ceiling_name, ceiling, unit)."""
    record = {"tutorial": tutorial, "platform": "GPU: test", "on_gpu": True, "date": "2026-11-22", "benchmarks": [
        {"name": f"b{i}", "unit": unit, "ceiling_name": name, "ceiling": ceiling, "ours": ["mine"], "peers": [],
         "rows": [{"N": 1, "provider": "mine", "value": 1.0}]} for i, (name, ceiling, unit) in enumerate(ceilings)]}
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


@pytest.mark.parametrize("lesson", LESSONS)
def test_notebook_is_valid_and_runs_on_cpu(site, lesson, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    # A reader's folder: the site's zip of all notebooks, unpacked (no scripts: the lessons that build on
    # earlier ones load them from their notebooks), and no build environment variables.
    (archive,) = site.glob("_downloads/*/tutorials_jupyter.zip")
    with zipfile.ZipFile(archive) as bundle:
        bundle.extractall(tmp_path)
    assert not list(tmp_path.rglob("*.py")), "the notebooks' zip is meant to hold notebooks only"
    path = tmp_path / f"{lesson}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert "pip install" in notebook.cells[0].source, "the first cell must tell a reader what to install"
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
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
