"""A two-version site, published with tools/publish.py, served on 127.0.0.1 and driven in headless Chromium:
the root redirects to stable, the switcher lists both versions and lands on the same page of the other,
plots load, download links answer, and the dev page warns that it is not the stable version."""

import functools
import os
import shutil
import subprocess
import threading
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import publish
import pytest
from conftest import ROOT, sphinx

SCREENSHOTS = ROOT / "build" / "screenshots"
PAGE = "tutorials/01-fused-softmax.html"


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("no Chromium found: install Debian's 'chromium' package (.ci/run does)")


@pytest.fixture(scope="module")
def served_site(site, tmp_path_factory):
    """build/html published as dev, a second build labelled v1.0.0 published as that release."""
    work = tmp_path_factory.mktemp("versions")
    release = sphinx(ROOT, work / "release", env=dict(os.environ, DOCS_VERSION="v1.0.0"))
    assert release.returncode == 0, release.stderr
    tree = work / "gh-pages"
    tree.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "gh-pages", str(tree)], check=True)
    publish.publish(work / "release" / "html", tree, "v1.0.0")
    publish.publish(site, tree, "main")

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


def test_dev_page_points_to_stable(served_site, page):
    page.goto(f"{served_site}/dev/{PAGE}")
    banner = page.locator("#bd-header-version-warning")
    banner.locator("a").first.wait_for()
    assert "/v1.0.0/" in banner.locator("a").first.get_attribute("href")


def test_tutorial_page_shows_its_plot_and_downloads(served_site, page):
    page.goto(f"{served_site}/dev/{PAGE}")
    plot = page.locator("img[src*='sphx_glr_01-fused-softmax_001']").first
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
