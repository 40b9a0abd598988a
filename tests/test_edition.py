"""The Chinese edition (docs/_ext/edition.py, tools/i18n.py): complete catalogs whose translations keep
their English messages' code, math, numbers and links; a build that mirrors the English pages from the
same execution, links each page to its twin, searches Chinese words, and offers Chinese notebooks whose
code is the English notebooks' code."""

import json
import re
import subprocess
import sys
from html.parser import HTMLParser

import i18n
import pytest
from conftest import ROOT
from lessons import stems

CATALOG = i18n.CATALOGS


# -- The catalogs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", i18n.catalogs(), ids=lambda p: i18n.page_of(p))
def test_every_message_is_translated_and_keeps_its_code_math_numbers_and_links(path):
    problems = i18n.problems(path)
    assert not problems, "\n".join(f"{why}: {message[:120]!r}" for message, why in problems[:20])


def test_every_page_but_the_engineering_notes_has_a_catalog():
    pages = {i18n.page_of(p) for p in i18n.catalogs()}
    assert set(i18n.english_pages()) - pages == {"engineering-notes"}


def test_publish_and_the_build_name_the_chinese_folder_alike():
    """tools/publish.py runs without Sphinx, so it writes the edition's folder name again."""
    import publish
    from edition import CHINESE

    assert publish.CHINESE == CHINESE and publish.SWITCHER_CHINESE == f"switcher.{CHINESE}.json"


def _problems_of(tmp_path, message, translation, page="tutorials/01-first-kernel", fuzzy=False):
    """What the checker says of one message and its translation, in a catalog of `page`."""
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import write_po

    catalog = Catalog(locale="zh_CN")
    catalog.add(message, translation, flags=["fuzzy"] if fuzzy else [])
    path = tmp_path / "locales" / f"{page}.po"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        write_po(handle, catalog)
    original = i18n.CATALOGS
    i18n.CATALOGS = tmp_path / "locales"
    try:
        return [why for _, why in i18n.problems(path)]
    finally:
        i18n.CATALOGS = original


@pytest.mark.parametrize("translation, fault", [
    ("", "untranslated"),
    ("在 98,765 个元素上用 ``tl.load`` 读取 :math:`2^{24}`，见 :doc:`下一课 <02-fused-softmax>`。", None),
    ("在 98765 个元素上用 ``tl.load`` 读取 :math:`2^{24}`，见 :doc:`下一课 <02-fused-softmax>`。", "'98,765'"),
    ("在 98,765 个元素上用 ``tl.store`` 读取 :math:`2^{24}`，见 :doc:`下一课 <02-fused-softmax>`。", "'``tl.load``'"),
    ("在 98,765 个元素上用 ``tl.load`` 读取 :math:`2^{23}`，见 :doc:`下一课 <02-fused-softmax>`。", "2^{24}"),
    ("在 98,765 个元素上用 ``tl.load`` 读取 :math:`2^{24}`，见 :doc:`下一课 <03-long-softmax>`。",
     "'02-fused-softmax'"),
    ("在 98,765 个元素上用``tl.load``读取 :math:`2^{24}`，见 :doc:`下一课 <02-fused-softmax>`。", "put a space"),
])
def test_the_checker_finds_what_a_translation_lost(tmp_path, translation, fault):
    message = "On 98,765 elements ``tl.load`` reads :math:`2^{24}`; next: :doc:`the next lesson <02-fused-softmax>`."
    found = _problems_of(tmp_path, message, translation)
    if fault is None:
        assert found == []
    else:
        assert len(found) == 1 and fault in found[0], found


def test_the_checker_finds_fuzzy_messages_and_markdown_losses(tmp_path):
    assert "fuzzy" in _problems_of(tmp_path, "Exercises", "练习", fuzzy=True)[0]
    found = _problems_of(tmp_path, "Run `make html`; see [the guide](https://example.org/guide) and $x^2$.",
                         "运行 `make test`；见[指南](https://example.org/other)和 $x^3$。", page="getting-started")
    assert len(found) == 1 and all(s in found[0] for s in ("`make html`", "$x^2$", "https://example.org/guide"))


def test_build_figures_are_kept_out_of_the_catalogs_and_written_from_a_template():
    from edition import build_figure

    running = "Total running time of the script: (1 minutes 2.345 seconds)"
    assert build_figure(running) == "脚本总运行时间：1 分 2.345 秒"
    assert build_figure("Estimated memory usage:  12 MB") == "估计内存用量：12 MB"
    assert build_figure("Running the script took 2 minutes") is None
    for path in i18n.catalogs():
        assert not any(m.id and "Total running time" in m.id for m in i18n.read_catalog(path)), path


def test_jieba_imports_quietly_even_compiled_from_source(tmp_path):
    """jieba 0.42.1's plain-string regular expressions warn when compiled (3.11: DeprecationWarning; 3.12
    and 3.13: SyntaxWarning); the build imports it through edition.quiet_jieba, which silences them."""
    code = ("import sys; sys.path.insert(0, 'docs/_ext'); import edition; "
            "print(' '.join(edition.quiet_jieba().cut_for_search('共享内存')))")
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={"PYTHONPYCACHEPREFIX": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "共享内存" in result.stdout.split()


# -- The notebooks ---------------------------------------------------------------------------------------


def test_a_text_block_is_translated_by_paragraph_item_and_heading():
    block = ("Where it runs\n-------------\nA first line that goes\non.\n\n* an item that\n  goes on\n"
             "* 24. not a new item\n\n.. math::\n\n   x = 1\n\nLeft alone.")
    table = {"Where it runs": "在哪里运行", "A first line that goes on.": "第一行。",
             "an item that goes on": "一项", "24. not a new item": "不是新的一项"}
    text, left = i18n.translate_text_block(block, table)
    assert text.split("\n")[:2] == ["在哪里运行", "-" * 13]
    assert "第一行。" in text and "* 一项" in text and "* 不是新的一项" in text and "   x = 1" in text
    assert left == ["Left alone."]


@pytest.mark.parametrize("stem", stems())
def test_a_chinese_notebook_has_the_english_code_and_chinese_text(chinese_site, stem):
    english = json.loads((ROOT / "docs" / "tutorials" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    chinese = json.loads((i18n.NOTEBOOKS / f"{stem}.ipynb").read_text(encoding="utf-8"))

    def cells(notebook, kind):
        return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                for c in notebook["cells"] if c["cell_type"] == kind]

    assert cells(chinese, "code") == cells(english, "code")
    text = "".join(cells(chinese, "markdown"))
    assert chinese_share(text) > 0.4, f"{stem}: {chinese_share(text):.0%} of the text cells' letters are Chinese"


# -- The Chinese pages ------------------------------------------------------------------------------------


def chinese_share(text):
    """Chinese characters as a fraction of all letters (Chinese characters and Latin letters)."""
    han = len(re.findall(r"[\u4e00-\u9fff]", text))
    latin = len(re.findall(r"[A-Za-z]", text))
    return han / max(1, han + latin)


class ProseOf(HTMLParser):
    """The text of a page's paragraphs, list items and headings, without code, math, output or the page's
    frame (header, sidebars, footer)."""

    PROSE = {"p", "li", "h1", "h2", "h3", "h4", "h5", "h6"}
    SKIP = {"pre", "code", "script", "style", "nav", "header", "footer", "math", "kbd"}

    def __init__(self):
        super().__init__()
        self.stack, self.parts, self.in_article = [], [], 0

    def handle_starttag(self, tag, attrs):
        classes = dict(attrs).get("class") or ""
        if tag in {"br", "img", "hr", "input", "meta", "link"}:
            return
        skip = tag in self.SKIP or "math" in classes.split() or "sphx-glr-script-out" in classes
        self.stack.append((tag, skip, tag == "article"))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        tags = [t for t, _, _ in self.stack]
        if (any(a for _, _, a in self.stack) and not any(s for _, s, _ in self.stack)
                and any(t in self.PROSE for t in tags)):
            self.parts.append(re.sub(r"\\\(.*?\\\)", " ", data))


def prose(path):
    parser = ProseOf()
    parser.feed(path.read_text(encoding="utf-8"))
    return " ".join(parser.parts)


def search_index(root):
    text = (root / "searchindex.js").read_text(encoding="utf-8")
    return json.loads(text[text.index("(") + 1:text.rindex(")")])


def test_the_chinese_edition_mirrors_the_english_pages(site, chinese_site):
    """The same pages at the same paths (the pages each build wrote this time, by its search index: an
    English folder may keep pages of lessons renamed since)."""
    english, chinese = search_index(site)["docnames"], search_index(chinese_site)["docnames"]
    assert chinese == english and len(english) > 20
    for name in english:
        assert (chinese_site / f"{name}.html").is_file() and (site / f"{name}.html").is_file(), name
    assert (chinese_site / "_static" / "documentation_options.js").read_text().count("LANGUAGE: 'zh-CN'") == 1


@pytest.mark.parametrize("stem", stems())
def test_a_chinese_lesson_page_is_in_chinese_and_links_its_english_twin(site, chinese_site, stem):
    page = chinese_site / "tutorials" / f"{stem}.html"
    share = chinese_share(prose(page))
    assert share >= 0.4, f"{stem}: Chinese characters are {share:.0%} of the prose's letters"
    html = page.read_text(encoding="utf-8")
    assert f'href="../../tutorials/{stem}.html" hreflang="en"' in html
    english = (site / "tutorials" / f"{stem}.html").read_text(encoding="utf-8")
    assert f'href="../zh_CN/tutorials/{stem}.html" hreflang="zh-CN"' in english
    # The same outputs: every printed block of the English page, as the English page shows it.
    blocks = re.compile(r'<div class="sphx-glr-script-out highlight-none notranslate">.*?</pre>', re.S)
    assert blocks.findall(html) == blocks.findall(english) != []


def test_chinese_pages_show_the_english_builds_images_and_downloads(chinese_site):
    page = chinese_site / "tutorials" / f"{stems()[0]}.html"
    html = page.read_text(encoding="utf-8")
    links = re.findall(r'(?:src|href)="([^"]*_(?:images|downloads)/[^"#?]+)"', html)
    assert links, "the page has no image or download"
    for link in links:
        assert (page.parent / link).resolve().is_file(), link
    notebook = next(link for link in links if link.endswith(".ipynb"))
    assert "zh_CN/_downloads/" in (page.parent / notebook).resolve().as_posix()  # the Chinese notebook
    assert any("/zh_CN/" not in (page.parent / link).resolve().as_posix() for link in links if "_images" in link)


def test_the_chinese_search_index_holds_chinese_words(chinese_site):
    index = search_index(chinese_site)
    terms = index["terms"]
    # 线程束 is a word through the glossary's terms (edition.py); jieba alone would cut it in two.
    for word in ("共享内存", "线程束", "占用率"):
        assert word in terms, [t for t in terms if re.search(r"[\u4e00-\u9fff]", t)][:20]
        documents = terms[word] if isinstance(terms[word], list) else [terms[word]]
        assert any(index["docnames"][d].startswith("tutorials/") for d in documents), word


def test_the_chinese_search_page_loads_a_stemmer_it_defines(chinese_site):
    """Sphinx 9.0.4 named ChineseStemmer where only EnglishStemmer is defined (edition.chinese_search)."""
    page = (chinese_site / "search.html").read_text(encoding="utf-8")
    data = re.search(r'src="((?:\.\./)*_static/language_data\.js)', page).group(1)
    script = (chinese_site / data).resolve().read_text(encoding="utf-8")
    named = re.search(r"window\.Stemmer = (\w+);", script).group(1)
    assert f"var {named}=" in script.replace(" ", "") or f"{named}=function" in script.replace(" ", ""), named


def test_a_chinese_lesson_says_its_code_and_output_stay_as_built(chinese_site):
    html = (chinese_site / "tutorials" / f"{stems()[0]}.html").read_text(encoding="utf-8")
    assert "都保持本次构建运行时生成的英文原样" in html
    assert "保持英文原文" in (chinese_site / "engineering-notes.html").read_text(encoding="utf-8")


def test_the_chinese_build_runs_no_lesson_and_writes_its_notebooks_first(monkeypatch):
    """It is the English build's pages in Chinese: SHARD_MERGE=1 stops it before any lesson would run."""
    import types

    import shard_build

    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs.get("env") or {}))
        return types.SimpleNamespace(returncode=len(calls) - 1)  # the notebooks pass, the build "fails"

    monkeypatch.setattr(shard_build.subprocess, "run", run)
    assert shard_build.chinese_build(["-W"], env={"SHARD_GPU_DRIVER": "580.1"}) == 1
    (notebooks, _), (build, env) = calls
    assert notebooks[-1] == "notebooks" and build[-1].endswith("html/zh_CN")
    assert env["SHARD_MERGE"] == "1" and env["DOCS_LANGUAGE"] == "zh_CN" and env["SHARD_GPU_DRIVER"] == "580.1"
