"""A two-version site, built as the docs workflow builds it (told where switcher.json is), published with
tools/publish.py, served on 127.0.0.1 and driven in headless Chromium: the root redirects to stable, the
switcher lists both versions and lands on the same page of the other, plots load and open full size, download
links answer, and the dev page warns that it is not the stable version. Every lesson page, Getting started and
the performance page, at a desktop, a laptop and a phone width, with every request to another host blocked: the
page is no wider than the window, the header keeps the version switcher on one row, printed output wraps inside
its column, a lesson's code fits its column at 1400 and 1200 px (88 columns) and on a phone scrolls inside its
own block, plots are not shipped far larger than shown, everything comes from the site itself, and the math is
typeset."""

import functools
import os
import shutil
import subprocess
import threading
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import publish
import pytest
from conftest import ROOT, build_once
from lessons import stems

SCREENSHOTS = ROOT / "build" / "screenshots"
LESSON = stems()[0]
PAGE = f"tutorials/{LESSON}.html"
READER_PAGES = [f"tutorials/{lesson}.html" for lesson in stems()] + ["getting-started.html", "performance.html"]
# The Chinese edition's pages of each kind: a lesson, and the two hand-written pages.
READER_PAGES += [f"zh_CN/{page}" for page in (PAGE, "getting-started.html", "performance.html")]
WIDTHS = {"desktop": 1400, "laptop": 1200, "phone": 390}


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("no Chromium found: install Debian's 'chromium' package (.ci/run does)")


@pytest.fixture(scope="module")
def served_site(site, testrun_uid, tmp_path_factory):
    """Two builds as docs.yml makes them, with the switcher at the root: one labelled dev published as main,
    one labelled v1.0.0 published as that release. (The local build, `site`, has no version menu: it has no
    switcher.json. Built after it, these run no lesson again.)"""
    work = tmp_path_factory.mktemp("versions")
    published = dict(os.environ, DOCS_SWITCHER_URL="/switcher.json")
    dev = build_once(testrun_uid, ROOT / "build" / "published-dev", env=dict(published, DOCS_VERSION="dev"))
    release = build_once(testrun_uid, ROOT / "build" / "release", env=dict(published, DOCS_VERSION="v1.0.0"))
    tree = work / "gh-pages"
    tree.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "gh-pages", str(tree)], check=True)
    publish.publish(release, tree, "v1.0.0")
    publish.publish(dev, tree, "main")

    handler = functools.partial(QuietHandler, directory=str(tree))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=find_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
            "--disable-background-networking", "--disable-component-update"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    yield page
    page.close()


def test_root_redirects_to_stable(served_site, page):
    page.goto(served_site + "/")
    page.wait_for_url("**/stable/**")
    assert "/stable/" in page.url


def test_switcher_lists_both_versions_and_keeps_the_page(served_site, page):
    page.goto(f"{served_site}/v1.0.0/{PAGE}")
    button = page.locator("button.version-switcher__button").first
    button.wait_for()
    assert "v1.0.0" in button.inner_text()
    button.click()
    items = page.locator(".version-switcher__menu a")
    items.first.wait_for()
    names = [t.strip() for t in items.all_inner_texts()]
    assert any(n.startswith("dev") for n in names) and any(n.startswith("v1.0.0") for n in names), names
    items.filter(has_text="dev").first.click()
    page.wait_for_url(f"**/dev/{PAGE}")
    assert page.url.endswith(f"/dev/{PAGE}")


@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("path", [PAGE, "index.html"])
def test_the_language_switch_leads_to_the_same_page_both_ways(served_site, browser, path, width):
    page = browser.new_page(viewport={"width": width, "height": 900})
    try:
        for start, end, lang in ((f"dev/{path}", f"dev/zh_CN/{path}", "zh-CN"),
                                 (f"dev/zh_CN/{path}", f"dev/{path}", "en")):
            page.goto(f"{served_site}/{start}")
            # The theme writes persistent header items twice, one for each layout; one shows.
            switch = page.locator(".bd-header a.language-switch:visible")
            assert switch.count() == 1, f"{start}: {switch.count()} visible language switches in the header"
            box, brand = switch.bounding_box(), page.locator(".bd-header .navbar-brand").first.bounding_box()
            assert box["x"] + box["width"] <= width and box["y"] < brand["y"] + brand["height"], (start, box)
            switch.click()
            page.wait_for_url(f"{served_site}/{end}")
            assert page.locator("html").get_attribute("lang") == lang
    finally:
        page.close()


def test_the_chinese_version_switcher_stays_in_chinese(served_site, page):
    page.goto(f"{served_site}/v1.0.0/zh_CN/{PAGE}")
    button = page.locator("button.version-switcher__button").first
    button.wait_for()
    button.click()
    page.locator(".version-switcher__menu a").filter(has_text="dev").first.click()
    page.wait_for_url(f"{served_site}/dev/zh_CN/{PAGE}")


def test_the_chinese_search_finds_a_chinese_word(served_site, page):
    page.goto(f"{served_site}/dev/zh_CN/search.html?q=共享内存")
    results = page.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=20000)
    hrefs = results.evaluate_all("links => links.map(a => a.getAttribute('href'))")
    assert any("tutorials/" in h for h in hrefs), hrefs


def test_dev_page_points_to_stable(served_site, page):
    page.goto(f"{served_site}/dev/{PAGE}")
    banner = page.locator("#bd-header-version-warning")
    banner.locator("a").first.wait_for()
    assert "/v1.0.0/" in banner.locator("a").first.get_attribute("href")


def test_tutorial_page_shows_its_plot_and_downloads(served_site, page):
    page.goto(f"{served_site}/dev/{PAGE}")
    plot = page.locator(f"img[src*='sphx_glr_{LESSON}_001']").first
    plot.scroll_into_view_if_needed()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=plot.element_handle())
    hrefs = page.eval_on_selector_all("a[href*='_downloads/']", "links => links.map(a => a.href)")
    assert {h.rsplit(".", 1)[-1] for h in hrefs} >= {"py", "ipynb", "zip"}, hrefs
    for href in set(hrefs):
        with urllib.request.urlopen(href) as response:
            assert response.status == 200, href
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "tutorial-page.png"), full_page=False)
    plot.screenshot(path=str(SCREENSHOTS / "tutorial-plot.png"))


def test_clicking_a_plot_opens_it_full_size(served_site, page):
    page.goto(f"{served_site}/dev/{PAGE}")
    plot = page.locator("img.sphx-glr-single-img, img.sphx-glr-multi-img").first
    plot.scroll_into_view_if_needed()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=plot.element_handle())
    natural_width = plot.evaluate("img => img.naturalWidth")
    source = plot.evaluate("img => img.src")
    plot.click()
    page.wait_for_url(source)
    assert page.evaluate("document.contentType") == "image/png"
    assert page.evaluate("document.images[0].naturalWidth") == natural_width


def open_offline(browser, url, width):
    """The page at url in a window `width` pixels wide, every request to another host refused; with the
    URLs it asked for and those that failed. Returns once the page and its math are finished."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    origin = "/".join(url.split("/", 3)[:3]) + "/"
    requested, failed = [], []

    def only_this_site(route):
        requested.append(route.request.url)
        if route.request.url.startswith(origin):
            route.continue_()
        else:
            route.abort()

    def note_error(response):
        if response.status >= 400:
            failed.append(f"{response.status} {response.url}")

    page.route("**/*", only_this_site)
    page.on("response", note_error)
    page.on("requestfailed", lambda request: failed.append(f"{request.failure} {request.url}"))
    page.goto(url)
    page.wait_for_load_state("networkidle")
    page.evaluate("async () => { if (window.MathJax?.startup?.promise) await MathJax.startup.promise; "
                  "await document.fonts.ready; }")
    page.wait_for_load_state("networkidle")
    return page, origin, requested, failed


# Text that MathJax would have replaced: TeX left outside code means the math did not render.
RAW_TEX = r"""() => {
  const walker = document.createTreeWalker(document.querySelector('main') || document.body, NodeFilter.SHOW_TEXT);
  const raw = [];
  while (walker.nextNode()) {
    const text = walker.currentNode;
    if (text.parentElement.closest('pre, code, script, style, mjx-container')) continue;
    if (/\\\(|\\\[/.test(text.data)) raw.push(text.data.trim().slice(0, 80));
  }
  return raw;
}"""
# Whether each formula became MathJax output.
TYPESET = "() => [...document.querySelectorAll('span.math, div.math')].map(e => !!e.querySelector('mjx-container'))"
# The header's visible items, each as [class, top, bottom].
HEADER_ITEMS = """() => [...document.querySelectorAll([
    '.bd-header__inner > button', '.bd-header .navbar-brand', '.bd-header .version-switcher__button',
    '.bd-header .search-button', '.bd-header .language-switch', '.bd-header .navbar-nav',
    '.bd-header .theme-switch-button',
    '.bd-header .navbar-icon-links'].join(', '))]
  .filter(e => e.offsetParent !== null && e.getBoundingClientRect().width > 0)
  .map(e => { const r = e.getBoundingClientRect(); return [e.className, r.top, r.bottom]; })"""
# The start of each block of printed output that scrolls sideways instead of wrapping.
WIDE_OUTPUT = """() => [...document.querySelectorAll('div.sphx-glr-script-out pre')]
  .filter(pre => pre.scrollWidth > pre.clientWidth + 1).map(pre => pre.innerText.slice(0, 80))"""
# Printed output in a box shorter than its text hides the lines below the fold in a scroll area.
TALL_OUTPUT = """() => [...document.querySelectorAll('div.sphx-glr-script-out pre')]
  .filter(pre => pre.scrollHeight > pre.clientHeight + 1).map(pre => pre.innerText.slice(0, 80))"""
# The parts of the links to the previous and next page that reach past the window's right edge.
PAST_THE_EDGE = """() => [...document.querySelectorAll('.prev-next-area *')]
  .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1).map(e => e.className)"""
# The start of each code block (code cells and printed output) that scrolls sideways, with its longest line.
WIDE_CODE = """() => [...document.querySelectorAll('div.highlight pre')]
  .filter(pre => pre.scrollWidth > pre.clientWidth + 1)
  .map(pre => [pre.innerText.slice(0, 60), Math.max(...pre.innerText.split('\\n').map(line => line.length))])"""
# Each code cell of a lesson as [scrolls sideways inside its block, its overflow-x, its white-space].
CODE_CELLS = """() => [...document.querySelectorAll('div.highlight-Python pre')]
  .map(pre => [pre.scrollWidth > pre.clientWidth + 1, getComputedStyle(pre).overflowX,
               getComputedStyle(pre).whiteSpace])"""
# How far the article column scrolls sideways: code cells and tables scroll inside their own boxes.
WIDE_ARTICLE = """() => { const a = document.querySelector('.bd-article-container');
  return a ? a.scrollWidth - a.clientWidth : 0; }"""
# Whether the performance summary fits its column: at a phone's width each of its rows is a card.
SUMMARY_FITS = """() => { const t = document.querySelector('table.perf-summary-cards');
  const box = t && t.closest('.pst-scrollable-table-container') || t;
  return !!t && t.scrollWidth <= t.clientWidth + 1 && box.scrollWidth <= box.clientWidth + 1; }"""
# Each plot as [src, loaded, natural width, shown width].
PLOTS = """() => [...document.querySelectorAll(
    'img.sphx-glr-single-img, img.sphx-glr-multi-img, figure.perf-ratios img')]
  .map(img => [img.getAttribute('src'), img.complete, img.naturalWidth, img.getBoundingClientRect().width])"""
# The hint under each plot link: what a reader sees below a plot, "none" where nothing is shown.
PLOT_HINTS = """() => [...document.querySelectorAll('a.plot-full-size')]
  .map(a => getComputedStyle(a, '::after').content)"""


@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("path", READER_PAGES)
def test_page_reads_well_offline(served_site, browser, path, width):
    page, origin, requested, failed = open_offline(browser, f"{served_site}/dev/{path}", width)
    try:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{path.rsplit('/', 1)[-1].removesuffix('.html')}-{width}.png"))

        assert not [u for u in requested if not u.startswith(origin)], "requests to another host"
        assert not failed, failed

        page_width, window = page.evaluate("[document.scrollingElement.scrollWidth, window.innerWidth]")
        assert page_width <= window, f"the page is {page_width} px wide in a {window} px window"

        items = page.evaluate(HEADER_ITEMS)
        switcher = [item for item in items if "version-switcher" in item[0]]
        assert switcher, f"no version switcher in the header at {width} px"
        middle = (switcher[0][1] + switcher[0][2]) / 2
        assert all(top <= middle <= bottom for _, top, bottom in items), f"header items on several rows: {items}"

        assert not page.evaluate(WIDE_OUTPUT), "printed output scrolls sideways"
        assert not page.evaluate(TALL_OUTPUT), "printed output is cut off inside a scroll box"
        assert page.evaluate(WIDE_ARTICLE) <= 1, "the article column scrolls sideways"
        assert not page.evaluate(PAST_THE_EDGE), "the links to the previous and next page run off the screen"

        typeset = page.evaluate(TYPESET)
        assert all(typeset), f"{typeset.count(False)} of {len(typeset)} formulas were not typeset"
        assert not page.evaluate(RAW_TEX), "raw TeX on the page"

        if path == "performance.html":
            assert page.evaluate(SUMMARY_FITS), f"the summary table scrolls sideways at {width} px"
        if path.startswith("tutorials/") and width in (WIDTHS["desktop"], WIDTHS["laptop"]):
            # The lessons hold code to 88 columns (ruff, tutorials/ruff.toml), and the page's code font fits them.
            assert not page.evaluate(WIDE_CODE), "code blocks that scroll sideways (start, longest line)"
        if path.startswith("tutorials/") and width == WIDTHS["phone"]:
            cells = page.evaluate(CODE_CELLS)
            assert any(scrolls for scrolls, _, _ in cells), "no code cell wider than a phone: the test sees nothing"
            assert all(overflow == "auto" and space == "pre" for _, overflow, space in cells), (
                "code keeps its lines and scrolls inside its own block")

        hints = page.evaluate(PLOT_HINTS)
        if width == WIDTHS["phone"]:
            assert all("full size" in hint for hint in hints), f"plots without the hint to open them: {hints}"
        else:
            assert all(hint in ("none", "normal") for hint in hints), f"a hint under desktop plots: {hints}"
        if width == WIDTHS["desktop"]:
            for src, loaded, natural, shown in page.evaluate(PLOTS):
                assert loaded and natural > 0, f"{src} did not load"
                assert natural <= 2 * shown, f"{src} is {natural} px wide, shown at {shown:.0f} px"
    finally:
        page.close()


# The header at a desktop width: [page width, window width, title height over its line height, right edge of
# the rightmost icon]. A reader at 1280 px found the title on four lines and the icons past the window's edge.
HEADER_FIT = """() => {
  const title = document.querySelector('.bd-header .navbar-brand p.title');
  const icons = [...document.querySelectorAll(['.bd-header .navbar-icon-links a', '.bd-header .theme-switch-button',
    '.bd-header .search-button'].join(', '))]
    .filter(e => e.offsetParent !== null).map(e => e.getBoundingClientRect().right);
  return [document.scrollingElement.scrollWidth, window.innerWidth,
          title.getBoundingClientRect().height / parseFloat(getComputedStyle(title).lineHeight), Math.max(...icons)];
}"""


@pytest.mark.parametrize("width", [960, 1100, 1200, 1280, 1366])
def test_the_header_fits_every_desktop_width(served_site, browser, width):
    page, *_ = open_offline(browser, f"{served_site}/dev/{PAGE}", width)
    try:
        page_width, window, title_lines, icons_end = page.evaluate(HEADER_FIT)
        assert page_width <= window, f"the page is {page_width} px wide in a {window} px window"
        assert title_lines < 2.5, f"the title takes {title_lines:.1f} lines"
        assert icons_end <= window, f"the icons end at {icons_end:.0f} px in a {window} px window"
    finally:
        page.close()
