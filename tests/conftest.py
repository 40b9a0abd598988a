"""Shared fixtures: the tutorials are imported as modules (not run as __main__), so tests exercise the
very kernels the pages teach."""

import re
import shutil
import subprocess
import sys

import pytest
from lessons import ROOT, TUTORIALS  # noqa: F401  (re-exported for the tests)


@pytest.fixture
def rng():
    """A fresh, unseeded generator per test: every run draws new inputs."""
    import torch

    generator = torch.Generator()
    generator.seed()
    return generator


def sphinx(src_root, out, *extra, env=None):
    """The command `make html` runs, with this interpreter; the site lands in out/html."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", *extra,
         "-d", str(out / "doctrees"), str(src_root / "docs"), str(out / "html")],
        cwd=src_root, capture_output=True, text=True, env=env)


def chinese(src_root, out, env=None):
    """What `make html` runs next: the Chinese edition into out/html/zh_CN, from the pages just built."""
    command = ("import sys, shard_build; "
               f"sys.exit(shard_build.chinese_build(['-W', '--keep-going'], out=shard_build.Path({str(out)!r})))")
    return subprocess.run([sys.executable, "-c", command], cwd=src_root / "tools", capture_output=True, text=True,
                          env=env)


def build_once(testrun_uid, out, env=None):
    """Build the repository's own docs into out/html, and their Chinese edition into out/html/zh_CN, once
    per test run; return out/html.

    make test runs several test processes (pytest-xdist), and any of them may need a build. Every
    build of docs/ writes the gallery's files under docs/tutorials, so two at once (even into
    different output folders) would race on those files: builds wait on one lock, and the first
    process to need a build makes it for all of them."""
    from filelock import FileLock

    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    stamp = out / ".built-by"
    with FileLock(build / ".sphinx.lock"):
        if not stamp.exists() or stamp.read_text() != testrun_uid:
            stamp.unlink(missing_ok=True)
            for build in (sphinx, chinese):
                result = build(ROOT, out, env=env)
                assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
                assert "warning" not in result.stderr.lower(), result.stderr
            stamp.write_text(testrun_uid)
    return out / "html"


@pytest.fixture(scope="session")
def site(testrun_uid):
    """The whole site, built once per test run into build/html, with no warnings."""
    return build_once(testrun_uid, ROOT / "build")


@pytest.fixture(scope="session")
def chinese_site(site):
    """The site's Chinese edition, which build_once builds with it: build/html/zh_CN."""
    return site / "zh_CN"


def copy_docs_for_other_lessons(dest):
    """docs/ without what the build generated, for a copy of the site with lessons of its own: the home
    page's links to the real lessons become plain text there (they would be unknown documents)."""
    shutil.copytree(ROOT / "docs", dest, ignore=shutil.ignore_patterns("tutorials", "sg_execution_times.rst",
                                                                        "__pycache__"))
    index = dest / "index.md"
    index.write_text(re.sub(r"\{doc\}`([^`<]*?) <tutorials/[^>]+>`", r"\1", index.read_text()))
