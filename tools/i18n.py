"""The Chinese edition's catalogs and notebooks.

    python tools/i18n.py update            # after an English change: refresh the catalogs, list what to translate
    python tools/i18n.py check [FILE.po]   # every message translated, keeping its code, math, numbers and links
    python tools/i18n.py notebooks         # the Chinese notebooks, from the English ones the build wrote

The catalogs (docs/locales/zh_CN/LC_MESSAGES/<page>.po, one per page) hold every paragraph, list item,
heading and table cell of the English pages, as Sphinx's gettext builder extracts them. ``update``
extracts them from a copy of docs/ and tutorials/ with the lessons not run (Sphinx-Gallery's
plot_gallery=0: the prose is the same), merges them into the catalogs with sphinx-intl, and lists the
messages that are new or changed (empty or fuzzy). An English edit and its Chinese update go in the same
change: ``make test`` fails on a catalog that is not complete.
"""

import argparse
import collections
import itertools
import json
import re
import shutil
import subprocess
import sys
import unicodedata
import zipfile
from pathlib import Path

from babel.messages.pofile import read_po

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIALS = ROOT / "tutorials"
GALLERY = DOCS / "tutorials"

sys.path.insert(0, str(DOCS / "_ext"))
from edition import CHINESE, ENGLISH_ONLY  # noqa: E402  (the build's own rule)
from lesson_files import lessons  # noqa: E402

CATALOGS = DOCS / "locales" / CHINESE / "LC_MESSAGES"
# The Chinese notebooks, where the Chinese build's download links find them (docs/_ext/edition.py).
NOTEBOOKS = GALLERY / CHINESE

# What a translation keeps exactly as its English message has it: code, math, link targets, URLs, in
# the syntax of the page's source: reST for the lessons and Sphinx-Gallery's pages, Markdown (MyST)
# for the hand-written pages. A role's text may be translated, its target not; math is kept whole.
ROLE = {"rst": re.compile(r":(\w+):`([^`]*)`"), "md": re.compile(r"\{(\w+)\}`([^`]*)`")}
URL = re.compile(r"https?://[^\s<>`)\]]+")
KEPT_WHOLE = {
    "rst": [re.compile(r"``.+?``")],
    "md": [re.compile(r"`[^`\n]+`"), re.compile(r"\$\$.+?\$\$|\$[^$\s][^$]*?\$")],
}
ADDRESS = {"rst": re.compile(r"`[^`<]*<([^<>`\s]+)>`_{1,2}"), "md": re.compile(r"\]\(([^)\s]+)\)")}
# Numbers in the prose: each digit sequence (1,024 / 2.5 / 90) must appear in the translation as written.
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?![\w])")
# reST inline markup, whose neighbours decide whether docutils reads it as markup.
REST_MARKUP = re.compile(r"``.+?``|:\w+:`[^`]*`|`[^`]+`_{1,2}|\*\*[^*]+\*\*|\*[^*\s][^*]*\*")


def catalogs():
    return sorted(CATALOGS.rglob("*.po"))


def page_of(path):
    return path.relative_to(CATALOGS).with_suffix("").as_posix()


def read_catalog(path):
    with path.open("rb") as handle:
        return read_po(handle)


def syntax(page):
    """The markup of a page's messages: Markdown for the hand-written pages, reST for the rest."""
    return "md" if (DOCS / f"{page}.md").is_file() else "rst"


def protected_parts(text, markup):
    """(the code, math, link targets and URLs of a message, each as written; the rest of its text)."""
    parts = []

    def role(m):
        if m.group(1) == "math":
            parts.append(m.group(0))
        else:
            target = re.search(r"<([^<>]+)>$", m.group(2))
            parts.append(target.group(1) if target else m.group(2))
        return " "

    def whole(m):
        parts.append(m.group(0))
        return " "

    text = ROLE[markup].sub(role, text)
    for pattern in KEPT_WHOLE[markup]:
        text = pattern.sub(whole, text)
    text = ADDRESS[markup].sub(lambda m: parts.append(m.group(1)) or " ", text)
    text = URL.sub(whole, text)
    return parts, text


def numbers(text, markup):
    """The numbers of a message's prose (those in code, math and links are compared with them)."""
    return NUMBER.findall(protected_parts(text, markup)[1])


# What docutils accepts around inline markup: before its start, a space, one of these ASCII characters or
# opening, quoting or other punctuation; after its end, a space, one of these or closing punctuation. A
# Chinese character is a letter, and "（" opens: `使用``tl.dot``计算` and ```x``（y）` print the markup raw.
BEFORE_MARKUP = set(" \n-:/'\"<([{") | {"Ps", "Pi", "Pf", "Pd", "Po", "Zs"}
AFTER_MARKUP = set(" \n-.,:;!?\\/'\")]}>") | {"Pe", "Pi", "Pf", "Pd", "Po", "Zs"}


def markup_broken_by_neighbours(text):
    """The reST inline markup of a translation that a neighbouring character keeps from being markup."""
    found = []
    for m in REST_MARKUP.finditer(text):
        before = text[m.start() - 1] if m.start() else " "
        after = text[m.end()] if m.end() < len(text) else " "
        if not ({before, unicodedata.category(before)} & BEFORE_MARKUP
                and {after, unicodedata.category(after)} & AFTER_MARKUP):
            found.append(m.group(0))
    return found


def problems(path):
    """(message, what is wrong) for every message of one catalog that is not ready to publish."""
    found = []
    markup = syntax(page_of(path))
    for message in read_catalog(path):
        if not message.id:
            continue
        if not message.string:
            found.append((message.id, "untranslated"))
            continue
        if message.fuzzy:
            found.append((message.id, "fuzzy: the English changed; check the translation, then remove the flag"))
            continue
        lost = [part for part in protected_parts(message.id, markup)[0] if part not in message.string]
        lost += [n for n in numbers(message.id, markup) if not re.search(rf"(?<![\d.,]){re.escape(n)}(?!\d)",
                                                                  message.string)]
        if lost:
            found.append((message.id, "the translation lacks " + ", ".join(repr(x) for x in lost)))
        if markup == "rst" and (touching := markup_broken_by_neighbours(message.string)):
            found.append((message.id, "put a space (or ASCII punctuation) between these and the Chinese next to "
                                      "them, or they print as raw markup: " + ", ".join(repr(x) for x in touching)))
    return found


def check(paths):
    every = not paths
    paths = [Path(p).resolve() for p in paths] or catalogs()
    count = 0
    for path in paths:
        for message, why in problems(path):
            count += 1
            print(f"{path.relative_to(ROOT)}: {why}\n    msgid {message[:160]!r}")
    if every:
        pages = {page_of(p) for p in paths}
        missing = [d for d in english_pages() if d not in pages and d not in ENGLISH_ONLY]
        for page in missing:
            count += 1
            print(f"no catalog for the page {page}: run `python tools/i18n.py update`")
    print(f"i18n: {count} problem(s) in {len(paths)} catalog(s)")
    return 1 if count else 0


def english_pages():
    """The hand-written pages and the lessons' pages: every page the Chinese edition translates."""
    pages = [p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.glob("*.md")]
    pages += [f"tutorials/{stem}" for stem in lessons(TUTORIALS)]
    return sorted(pages)


# -- update -------------------------------------------------------------------------------------------


def update():
    """Extract the English messages (lessons not run) and merge them into the catalogs."""
    work = ROOT / "build" / "gettext"
    if work.exists():
        shutil.rmtree(work)
    source = work / "src"
    # A copy: Sphinx-Gallery with plot_gallery=0 would write pages without output into docs/tutorials.
    shutil.copytree(DOCS, source / "docs", ignore=shutil.ignore_patterns("tutorials", "locales"))
    shutil.copytree(TUTORIALS, source / "tutorials", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "sphinx", "-b", "gettext", "-q", "-D", "sphinx_gallery_conf.plot_gallery=0",
         "-d", str(work / "doctrees"), str(source / "docs"), str(work / "pot")])
    for page in ENGLISH_ONLY:
        (work / "pot" / f"{page}.pot").unlink(missing_ok=True)
    run([sys.executable, "-m", "sphinx_intl", "update", "-p", str(work / "pot"), "-l", CHINESE,
         "-d", str(DOCS / "locales"), "-w", "0"])
    # Catalogs of pages that no longer exist.
    current = {p.relative_to(work / "pot").with_suffix("").as_posix() for p in (work / "pot").rglob("*.pot")}
    for path in catalogs():
        if page_of(path) not in current:
            print(f"removing the catalog of a page that is gone: {path.relative_to(ROOT)}")
            path.unlink()
    todo = [(path, m) for path in catalogs() for m in read_catalog(path)
            if m.id and (not m.string or m.fuzzy)]
    for path, message in todo:
        print(f"{path.relative_to(ROOT)}: {'fuzzy' if message.fuzzy else 'new'}: {message.id[:120]!r}")
    print(f"i18n: {len(todo)} message(s) to translate")
    return 0


def run(command):
    result = subprocess.run(command, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"i18n: {' '.join(command[:4])} ... failed with status {result.returncode}")


# -- notebooks ----------------------------------------------------------------------------------------


def translations(page):
    """{English message: Chinese} of one page's catalog, translated messages only."""
    path = CATALOGS / f"{page}.po"
    if not path.is_file():
        return {}
    return {m.id: m.string for m in read_catalog(path) if m.id and m.string and not m.fuzzy}


# Directives whose body is code, math or markup, never prose: a notebook keeps it as it is.
VERBATIM_DIRECTIVES = {"math", "code-block", "code", "sourcecode", "literalinclude", "raw", "image", "figure",
                       "list-table", "csv-table", "only", "highlight"}


def _indent(line):
    return len(line) - len(line.lstrip())


def _skip_body(lines, start, indent):
    """The index after the block that starts at `start` and is indented deeper than `indent`."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():  # the blank lines after it are not the block's
        end -= 1
    return end


def translate_text_block(text, table):
    """A lesson's text block (reST) with each paragraph, list item and heading that the catalog
    translates replaced by its translation; returns (text, English paragraphs left)."""
    lines = text.split("\n")
    out, left, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        # A heading: a line, then a line of one punctuation character repeated.
        if (i + 1 < len(lines) and line.strip() and re.fullmatch(r"([=\-~^\"'`#*+])\1{2,}", lines[i + 1].strip())):
            title = table.get(line.strip(), line.strip())
            out += [title, lines[i + 1][0] * max(len(lines[i + 1]), 2 * len(title))]
            i += 2
            continue
        directive = re.match(r" *\.\. (?:([\w-]+)::)?", line)
        if directive:  # a directive, or a link target or comment (no "::"), kept as it is
            verbatim = directive.group(1) in VERBATIM_DIRECTIVES | {None}
            end = _skip_body(lines, i + 1, _indent(line)) if verbatim else i + 1
            out += lines[i:end]
            i = end
            continue
        unit = re.match(r"( *)((?:[*\-+]|\d+\.|#\.) +)?(\S.*)$", line)
        if not unit:
            out.append(line)
            i += 1
            continue
        indent, bullet = unit.group(1), unit.group(2) or ""
        body_indent = len(indent) + len(bullet)
        words, j = [unit.group(3)], i + 1
        # The unit runs on while its lines are indented as its body; in reST a list or a block
        # inside it starts after a blank line.
        while j < len(lines) and lines[j].strip() and _indent(lines[j]) == body_indent:
            words.append(lines[j].strip())
            j += 1
        message = " ".join(words)
        if message in table:
            out.append(indent + bullet + table[message])
        else:
            out += lines[i:j]
            left.append(message)
        if message.endswith("::"):  # a literal block follows, indented
            end = _skip_body(lines, j, len(indent))
            out += lines[j:end]
            j = end
        i = j
    return "\n".join(out), left


def chinese_notebook(stem):
    """The English notebook of a lesson with its text cells in Chinese; returns (notebook, left)."""
    from sphinx_gallery.notebook import rst2md
    from sphinx_gallery.py_source_parser import split_code_and_text_blocks

    english = json.loads((GALLERY / f"{stem}.ipynb").read_text(encoding="utf-8"))
    _, blocks = split_code_and_text_blocks(str(TUTORIALS / f"{stem}.py"))
    texts = [block.content for block in blocks if block.type == "text"]
    markdown = [cell for cell in english["cells"] if cell["cell_type"] == "markdown"]
    if len(texts) != len(markdown):
        raise SystemExit(f"i18n: {stem}.ipynb has {len(markdown)} text cells, its lesson {len(texts)} text blocks: "
                         "the notebook was not written from this source")
    table = translations(f"tutorials/{stem}")
    # As Sphinx-Gallery's fill_notebook converts a lesson's blocks: one count of heading levels a notebook.
    counter = itertools.count(start=1)
    levels = collections.defaultdict(lambda: next(counter))
    left = []
    for cell, text in zip(markdown, texts):
        chinese, missed = translate_text_block(text, table)
        left += missed
        cell["source"] = rst2md(chinese + "\n", {}, str(GALLERY), levels)
    return english, left


def notebooks():
    """The Chinese notebooks beside the English ones (docs/tutorials/zh_CN), and the zips that hold
    notebooks with the Chinese ones in their place: what the Chinese pages offer for download."""
    NOTEBOOKS.mkdir(parents=True, exist_ok=True)
    stems = lessons(TUTORIALS)
    chinese = {}
    for stem in stems:
        notebook, left = chinese_notebook(stem)
        chinese[f"{stem}.ipynb"] = (json.dumps(notebook, ensure_ascii=False, indent=1) + "\n").encode()
        (NOTEBOOKS / f"{stem}.ipynb").write_bytes(chinese[f"{stem}.ipynb"])
        if left:
            print(f"i18n: {stem}: {len(left)} paragraph(s) of the notebook stay English, first {left[0][:100]!r}")
    for zipped in [*(f"{stem}.zip" for stem in stems), f"{GALLERY.name}_jupyter.zip"]:
        with zipfile.ZipFile(GALLERY / zipped) as english, \
                zipfile.ZipFile(NOTEBOOKS / zipped, "w", zipfile.ZIP_DEFLATED) as bundle:
            for info in english.infolist():
                bundle.writestr(info, chinese.get(info.filename) or english.read(info))
    print(f"i18n: {len(stems)} Chinese notebooks and their zips in {NOTEBOOKS.relative_to(ROOT)}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("update", help="refresh the catalogs from the English pages; list what to translate")
    checking = sub.add_parser("check", help="every message translated, keeping its code, math, numbers, links")
    checking.add_argument("files", nargs="*", type=Path)
    sub.add_parser("notebooks", help="write the Chinese notebooks from the English ones")
    args = parser.parse_args(argv)
    if args.command == "update":
        return update()
    if args.command == "check":
        return check(args.files)
    return notebooks()


if __name__ == "__main__":
    sys.exit(main())
