"""The Chinese edition: what the English build keeps out of the catalogs, and what the Chinese build
adds to its pages.

The Chinese pages are the English pages, executed once, with their prose replaced from the gettext
catalogs in docs/locales/zh_CN/LC_MESSAGES (Sphinx's Locale transform). This extension:

* keeps the figures of one build out of the catalogs (the running time and memory lines, the
  Computation times tables) and the engineering notes, which stay English: a new build never makes
  a message that needs a translation. The Chinese build writes those lines from a template;
* fails the Chinese build, naming page and message, on a message with no translation or a fuzzy one;
* says near the top of each Chinese lesson that code, output and plots are as the build produced
  them, and on the engineering notes that they stay English;
* gives every page the address of the same page in the other language (``language_switch``), for
  the header's link (docs/_templates/language-switch.html).
"""

import logging as logging_module
import re
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms import SphinxTransform
from sphinx.util import logging

logger = logging.getLogger(__name__)

CHINESE = "zh_CN"
# Pages that stay English in the Chinese edition: lab notes, dated, for the team.
ENGLISH_ONLY = {"engineering-notes"}
# Sphinx-Gallery's pages of run times: their tables are this build's figures.
TIMES_PAGE = re.compile(r"(^|/)sg_execution_times$")

# A paragraph that states a figure of this build, with its Chinese template. Each English pattern
# matches the paragraph's text; the template fills in the figures it captured.
BUILD_FIGURES = [
    (re.compile(r"^Total running time of the script: \((?P<m>\d+) minutes (?P<s>[\d.]+) seconds\)$"),
     "脚本总运行时间：{m} 分 {s} 秒"),
    (re.compile(r"^Estimated memory usage: +(?P<mb>[\d.]+) MB$"), "估计内存用量：{mb} MB"),
    (re.compile(r"^(?P<t>[\d:.]+) total execution time for (?P<n>\d+) files from (?P<where>all galleries|\S+):$"),
     "{n} 个文件的总执行时间：{t}"),
]


def build_figure(text):
    """The Chinese line for a paragraph that states this build's figures, or None for any other."""
    for pattern, template in BUILD_FIGURES:
        found = pattern.match(" ".join(text.split()))
        if found:
            return template.format(**found.groupdict())
    return None


def is_build_figure(text):
    return build_figure(text) is not None


class KeepBuildFiguresOut(SphinxTransform):
    """Before the Locale transform (priority 20), in every language: this build's figures and the
    English-only pages are not messages, so the gettext builder leaves them out of the catalogs and
    the Chinese build does not look them up."""

    default_priority = 15

    def apply(self, **kwargs):
        docname = self.env.docname
        whole_page = docname in ENGLISH_ONLY
        times_page = bool(TIMES_PAGE.search(docname))
        for node in self.document.findall(nodes.TextElement):
            if (whole_page or (times_page and _inside(node, nodes.table))
                    or (isinstance(node, nodes.paragraph) and is_build_figure(node.astext()))):
                node["translatable"] = False


def _inside(node, kind):
    while node is not None:
        if isinstance(node, kind):
            return True
        node = node.parent
    return False


class ChinesePage(SphinxTransform):
    """After the Locale transform, in the Chinese build: the figures' lines from their templates,
    the notes at the top of a lesson and of an English-only page, and no untranslated message."""

    default_priority = 21

    def apply(self, **kwargs):
        if self.config.language != CHINESE:
            return
        docname = self.env.docname
        for node in list(self.document.findall(nodes.paragraph)):
            line = build_figure(node.astext())
            if line is not None:
                node.replace_self(nodes.paragraph(line, line, classes=node["classes"]))
        if docname in ENGLISH_ONLY:
            _note_after_title(self.document, "本页是团队的工程记录，保持英文原文，不作翻译。")
            return
        self._chinese_downloads()
        if docname == "performance":
            _note_after_title(self.document, "本页由本次构建的测量结果生成的部分（图、表格以及其中和周围的说明文字）"
                                             "保持英文原样；测量方法的说明已译成中文。")
        if re.fullmatch(r"tutorials/\d\d-[^/]*", docname):
            _note_after_title(self.document, "本页的代码、打印输出（包括课程据测量结果算出的结论）和图中的文字，"
                                             "都保持本次构建运行时生成的英文原样；只有讲解文字译成了中文。")
        self._fail_on_untranslated(docname)

    def _chinese_downloads(self):
        """Notebooks, and zips that hold notebooks, from the Chinese ones that tools/i18n.py wrote
        beside the English ones (docs/tutorials/zh_CN); scripts stay as they are."""
        folder = Path(self.env.srcdir) / "tutorials" / CHINESE
        for node in self.document.findall(addnodes.download_reference):
            name = node["reftarget"].rsplit("/", 1)[-1]
            if (folder / name).is_file():
                node["reftarget"] = f"/tutorials/{CHINESE}/{name}"

    def _fail_on_untranslated(self, docname):
        catalog = _catalog(Path(self.env.srcdir), docname)
        # An image's alt text is translated only where gettext_additional_targets names images.
        images = "image" in self.config.gettext_additional_targets
        for node in self.document.findall(nodes.Element):
            if node.get("translated") is False and (images or not isinstance(node, nodes.image)):
                message = " ".join(node.rawsource.split())
                entry = catalog.get(message)
                state = "fuzzy" if entry is not None and entry.fuzzy else "untranslated"
                logger.warning(f"{state} message in docs/locales/{CHINESE}/LC_MESSAGES/{docname}.po: "
                               f"{message[:120]!r}", location=node, type="i18n", subtype="untranslated")


def _note_after_title(document, text):
    section = next(document.findall(nodes.section), None)
    note = nodes.note("", nodes.paragraph(text, text))
    if section is None:
        document.insert(0, note)
        return
    titles = [i for i, child in enumerate(section.children) if isinstance(child, nodes.title)]
    section.insert(titles[0] + 1 if titles else 0, note)


_catalogs = {}


def _catalog(srcdir, docname):
    """{msgid: babel Message} of a page's Chinese catalog (empty where the page has none)."""
    if docname not in _catalogs:
        from babel.messages.pofile import read_po

        path = srcdir / "locales" / CHINESE / "LC_MESSAGES" / f"{docname}.po"
        entries = {}
        if path.is_file():
            with path.open("rb") as handle:
                entries = {m.id: m for m in read_po(handle) if m.id}
        _catalogs[docname] = entries
    return _catalogs[docname]


def language_switch(language, pagename):
    """The link to the same page in the other edition, from page `pagename` of the edition in
    `language`: its label, relative address and language tag. Each edition's pages sit at the same
    paths below its folder: English at a version's root, Chinese in zh_CN/."""
    depth = pagename.count("/")
    if language == CHINESE:
        return {"label": "English", "href": "../" * (depth + 1) + pagename + ".html", "lang": "en"}
    return {"label": "中文", "href": "../" * depth + f"{CHINESE}/{pagename}.html", "lang": "zh-CN"}


def _page_context(app, pagename, templatename, context, doctree):
    context["language_switch"] = language_switch(app.config.language, pagename)


def quiet_jieba():
    """Import jieba, which Sphinx's Chinese search uses to cut text into words, without its noise.

    jieba 0.42.1 has regular expressions in plain strings ("\\."): compiled from source, Python 3.11
    warns of them (DeprecationWarning) and 3.12 and later print a SyntaxWarning. Its logger prints
    "Building prefix dict ..." on the first cut. Imported here first, Sphinx's own import finds it
    loaded."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import jieba
        except ImportError:
            return None
    jieba.setLogLevel(logging_module.WARNING)
    return jieba


def chinese_search():
    """Sphinx's Chinese search, with the stemmer its page can find.

    Sphinx 9.0.4 writes ``window.Stemmer = ChineseStemmer`` (its language's name) into the Chinese
    edition's language_data.js, but ships the English stemmer for the Chinese search's Latin words,
    which defines EnglishStemmer: the search page stops with "ChineseStemmer is not defined" and finds
    nothing. Named for the stemmer it ships, it finds it."""
    from sphinx.search.zh import SearchChinese

    class ChineseSearch(SearchChinese):
        language_name = "English"

    return ChineseSearch


def _builder_inited(app):
    if app.config.language != CHINESE:
        return
    if quiet_jieba() is None:
        # Sphinx would index Chinese pages without it, and leave every Chinese word out of the search.
        logger.warning("the Chinese search needs jieba (pinned in requirements.txt): pip install jieba",
                       type="i18n", subtype="search")
    app.add_search_language(chinese_search())
    # The glossary's Chinese terms as words of their own: jieba alone cuts 线程束 into 线程 and 束, and
    # a search for 线程束 would find nothing.
    terms = Path(app.doctreedir) / "search-terms.txt"
    terms.parent.mkdir(parents=True, exist_ok=True)
    terms.write_text("".join(f"{term} 100000\n" for term in glossary_terms(Path(app.srcdir) / "glossary.md")),
                     encoding="utf-8")
    app.config.html_search_options = {**app.config.html_search_options, "dict": str(terms)}


def glossary_terms(glossary):
    """The Chinese terms of the glossary's table (its second column), each run of Chinese characters."""
    found = []
    for line in glossary.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2:
            found += [t for t in re.findall(r"[\u4e00-\u9fff]{2,}", cells[1]) if t not in found]
    return found


def setup(app):
    app.connect("builder-inited", _builder_inited)
    app.add_transform(KeepBuildFiguresOut)
    app.add_transform(ChinesePage)
    app.connect("html-page-context", _page_context)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
