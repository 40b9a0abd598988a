"""Place a finished site build into a gh-pages working tree as one version among many.

    python tools/publish.py BUILD_DIR GH_PAGES_TREE VERSION [--base-url /repo/] [--force]

VERSION is a release tag ``vX.Y.Z`` (ASCII digits, no leading zeros: ``v0.1.0``, not ``v01.1.0``)
or ``main``:

* a release goes to ``vX.Y.Z/`` and is never rewritten afterwards (unless ``--force``);
* ``main`` goes to ``dev/`` and replaces what was there;
* ``stable/`` is a full copy of the newest release. A copy rather than a set of redirect pages:
  every deep link into ``stable/`` is a real page (no redirect hop, works without JavaScript, and
  search engines index the stable text), and the site is small enough that the copy costs little;
* the root ``index.html`` redirects to ``stable/`` (to ``dev/`` until there is a release);
* ``switcher.json`` at the root lists every version for pydata-sphinx-theme's version switcher,
  newest first, ``dev`` on top, the newest release ``preferred``; ``switcher.zh_CN.json`` lists the
  same versions' Chinese editions (``<version>/zh_CN/``), so that the Chinese pages switch versions
  within Chinese;
* a version is published with its Chinese edition, ``<version>/zh_CN/`` (``make html`` builds it into
  the English build's folder), as one unit: a build without it, or with one of another version, or
  reading another list of versions, is refused;
* ``.nojekyll`` keeps GitHub Pages from hiding folders that start with an underscore.

Checks come first, before anything is written: the version; the build (a finished Sphinx build
labelled with that version, whose pages read ``switcher.json`` where this publish writes it, so built
with ``DOCS_SWITCHER_URL=<base-url>switcher.json``, and holding only regular files and folders, since a
symbolic link would publish whatever it points to); the target (the root of a git working tree on
branch gh-pages).

Publishes into one tree run one after another: each holds an exclusive lock (flock on
``gh-pages-publish.lock`` in the tree's git directory, released by the kernel if the process dies)
and reads the tree's state only once it holds it, so concurrent publishes all land.

The new top-level entries are assembled in ``gh-pages-publish/`` in the tree's git directory: on the
tree's filesystem, so every move into place is one atomic rename, and never part of what
``git add --all`` commits. Before the first move, a journal listing the moves is written there.
A publish that does not finish is rolled back, never completed: on an error it undoes its own moves
at once; if it dies (killed, out of memory, cancelled job), the next run finds the journal and undoes
them before doing its own work. Either way the tree returns exactly to its state before that
publish, so a publish that did not report success has had no effect and can simply be run again.
Folders of other versions are never touched.

Refusals exit with status 2, failures of the filesystem with status 1; both print one line that
starts with ``publish:`` on stderr.
"""

import argparse
import fcntl
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

# [0-9], not \d: \d also matches other scripts' digits, which would name a second folder for one release.
# At most 9 digits a part: a longer number names no real release, and thousands of digits overflow int().
RELEASE = re.compile(r"v(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})")
SWITCHER = "switcher.json"
# The Chinese edition's folder inside each version: docs/_ext/edition.py's CHINESE, written again because
# this tool runs with the standard library alone, and edition.py imports Sphinx (a test ties the two).
CHINESE = "zh_CN"
SWITCHER_CHINESE = f"switcher.{CHINESE}.json"
LOCK = "gh-pages-publish.lock"
WORK = "gh-pages-publish"
STAGING, PREVIOUS, JOURNAL = "staging", "previous", "journal.json"
MAX_DEPTH = 100  # far deeper than any site, far shallower than Python's recursion limit


class PublishError(Exception):
    """A refusal with a message meant for the person publishing."""


def folder_for(version):
    if version == "main":
        return "dev"
    if RELEASE.fullmatch(version):
        return version
    raise PublishError(f"version must be 'main' or a release tag like v1.2.3 (no leading zeros, at most 9 digits "
                       f"a part), got {version!r:.80}")


def check_base_url(base_url):
    """The site's address as a path from the host's root (/repo/) or an absolute URL: a relative one would
    make every switcher link relative to the page that shows it."""
    if not re.fullmatch(r"(/|https?://[^/\s]+/)[^\s\\\"'<>]*", base_url):
        raise PublishError(f"--base-url must start with / or http(s)://host/ and hold no spaces, quotes or "
                           f"brackets, got {base_url!r:.80}")


def release_key(name):
    return tuple(int(part) for part in RELEASE.fullmatch(name).groups())


def built_version(build):
    """The version the pages were built as (Sphinx writes it into documentation_options.js)."""
    options = build / "_static" / "documentation_options.js"
    text = options.read_text(errors="replace") if options.is_file() else ""
    match = re.search(r"VERSION:\s*'([^']*)'", text)
    return match.group(1) if match else None


def built_switcher(build):
    """Where the pages look for switcher.json (pydata-sphinx-theme writes it into every page), or None for a
    build without a version switcher: a local one, made without DOCS_SWITCHER_URL."""
    text = (build / "index.html").read_text(errors="replace")
    match = re.search(r"DOCUMENTATION_OPTIONS\.theme_switcher_json_url\s*=\s*'([^']*)'", text)
    return match.group(1) if match else None


def refuse_odd_entries(build):
    """Copying follows no link and reads no pipe or device: anything but files and folders is refused,
    and so is nesting deep enough to exhaust the recursion of shutil.copytree."""
    folders = [(build, 0)]
    while folders:
        folder, depth = folders.pop()
        if depth > MAX_DEPTH:
            raise PublishError(f"{folder} lies more than {MAX_DEPTH} folders deep in the build")
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_symlink():
                    raise PublishError(f"{entry.path} is a symbolic link; a build may hold only files and folders")
                if entry.is_dir(follow_symlinks=False):
                    folders.append((entry.path, depth + 1))
                elif not entry.is_file(follow_symlinks=False):
                    raise PublishError(f"{entry.path} is not a regular file or folder")


def check_build(build, label, base_url="/"):
    if not build.is_dir():
        raise PublishError(f"{build} is not a directory")
    refuse_odd_entries(build)
    if not (build / "index.html").is_file():
        raise PublishError(f"{build} is not a finished site build: it has no index.html")
    found = built_version(build)
    if found != label:
        raise PublishError(f"{build} was built as version {found!r}, not {label!r}: "
                           f"rebuild with DOCS_VERSION={label}")
    # The pages must read the list of versions where this publish writes it: a build without a switcher (a
    # local build) or pointed elsewhere would show no version menu, or an empty one, once published.
    check_switcher(build, f"{base_url}{SWITCHER}", f"{base_url}{SWITCHER}")
    chinese = build / CHINESE
    if not (chinese / "index.html").is_file():
        raise PublishError(f"{build} has no Chinese edition ({CHINESE}/index.html): a version is published with "
                           "both editions; build it with make html, which writes both")
    found = built_version(chinese)
    if found != label:
        raise PublishError(f"{chinese} was built as version {found!r}, not {label!r}: "
                           f"rebuild with DOCS_VERSION={label}")
    check_switcher(chinese, f"{base_url}{SWITCHER_CHINESE}", f"{base_url}{SWITCHER}")


def check_switcher(build, wanted, setting):
    switcher = built_switcher(build)
    if switcher != wanted:
        found = "has no version switcher" if switcher is None else f"reads its list of versions at {switcher!r}"
        raise PublishError(f"{build} {found}, but this publish writes the list at {wanted!r}: "
                           f"rebuild with DOCS_SWITCHER_URL={setting}")


def git(tree, *args):
    # surrogateescape: paths that are not UTF-8 come back as the same str that pathlib made of them.
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, errors="surrogateescape")


def check_target(tree):
    """The git directory of tree, once tree is known to be the root of a working tree on gh-pages."""
    where = git(tree, "rev-parse", "--show-toplevel", "--absolute-git-dir")
    branch = git(tree, "symbolic-ref", "--short", "HEAD")
    lines = where.stdout.splitlines()
    # A folder inside the worktree would pass the branch test, yet publish a site nobody serves.
    if (where.returncode or branch.returncode or len(lines) != 2 or Path(lines[0]).resolve() != tree
            or branch.stdout.strip() != "gh-pages"):
        raise PublishError(f"{tree} is not the root of a working tree of the gh-pages branch")
    gitdir = Path(lines[1])
    if gitdir.stat().st_dev != tree.stat().st_dev:
        raise PublishError(f"{gitdir} is on another filesystem than {tree}, so moves from it would not be atomic")
    return gitdir


def switcher_entries(releases, has_dev, base_url, edition=""):
    """The version switcher's list; edition "zh_CN/" lists each version's Chinese edition."""
    entries = [{"name": "dev", "version": "dev", "url": f"{base_url}dev/{edition}"}] if has_dev else []
    for i, name in enumerate(releases):
        entry = {"name": f"{name} (stable)" if i == 0 else name, "version": name,
                 "url": f"{base_url}{name}/{edition}"}
        if i == 0:
            entry["preferred"] = True
        entries.append(entry)
    return entries


def redirect_page(target):
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\n"
            f"<title>Redirecting to {target}</title>\n"
            f"<meta http-equiv=\"refresh\" content=\"0; url={target}\">\n"
            f"<link rel=\"canonical\" href=\"{target}\">\n"
            f"<script>location.replace(\"{target}\" + location.hash);</script>\n"
            f"</head><body><p>This site lives at <a href=\"{target}\">{target}</a>.</p></body></html>\n")


def copy_folder(source, target):
    try:
        # symlinks=True: should a link appear after the check, it is copied as a link, never followed.
        shutil.copytree(source, target, symlinks=True)
    except shutil.Error as error:
        # copytree carries on past a file it cannot copy and then lists them all; the first one says enough.
        raise OSError(f"could not copy {source}: {error.args[0][0][2]}") from None


def stage(build, tree, staging, folder, base_url):
    """Assemble the tree's new top-level entries in staging; returns their names, in the order they move."""
    releases = sorted({p.name for p in tree.iterdir() if p.is_dir() and RELEASE.fullmatch(p.name)} |
                      ({folder} - {"dev"}), key=release_key, reverse=True)
    has_dev = folder == "dev" or (tree / "dev").is_dir()
    newest = releases[0] if releases else None
    staging.mkdir(parents=True)
    copy_folder(build, staging / folder)
    if newest == folder:
        copy_folder(staging / folder, staging / "stable")
    elif newest and not (tree / "stable").is_dir():
        # The root redirects to stable/: a tree without it (made by hand, or by an older tool) gets it back.
        copy_folder(tree / newest, staging / "stable")
    (staging / SWITCHER).write_text(json.dumps(switcher_entries(releases, has_dev, base_url), indent=2) + "\n")
    (staging / SWITCHER_CHINESE).write_text(
        json.dumps(switcher_entries(releases, has_dev, base_url, f"{CHINESE}/"), indent=2, ensure_ascii=False) + "\n")
    (staging / "index.html").write_text(redirect_page("stable/" if newest else "dev/"))
    (staging / ".nojekyll").write_text("")
    return [name for name in (folder, "stable", SWITCHER, SWITCHER_CHINESE, "index.html", ".nojekyll")
            if (staging / name).exists()]


def remove_tree(path):
    """shutil.rmtree, after making every folder below path writable: copytree copies a build's folder
    modes, and a read-only folder left in the work area would make every later publish fail."""
    for folder, _, _ in os.walk(path):
        os.chmod(folder, os.stat(folder).st_mode | stat.S_IRWXU)
    shutil.rmtree(path)


def roll_back(tree, work):
    """Undo the moves of a publish that stopped after writing its journal, then clear what it left.

    Each step is a rename that is skipped once done, so an interrupted roll-back is finished by the next.
    Per entry, the publish moved the tree's entry to previous/, then the staged one into the tree; so
    a staged entry that is gone is in the tree, and whatever is in previous/ belongs back in the tree."""
    journal = work / JOURNAL
    if journal.exists():
        try:
            names = json.loads(journal.read_text())
        except ValueError:
            raise PublishError(f"{journal} is damaged: put {tree} right by hand, then remove {work}") from None
        for name in reversed(names):
            staged, current, previous = work / STAGING / name, tree / name, work / PREVIOUS / name
            if not os.path.lexists(staged) and os.path.lexists(current):
                current.rename(staged)
            if os.path.lexists(previous):
                previous.rename(current)
        journal.unlink()
    if os.path.lexists(work):
        remove_tree(work)


def publish(build, tree, version, base_url="/", force=False):
    """Publish build as version into tree; returns the folder written."""
    build, tree = Path(build).resolve(), Path(tree).resolve()
    if not base_url.endswith("/"):
        base_url += "/"
    check_base_url(base_url)
    folder = folder_for(version)
    check_build(build, "dev" if folder == "dev" else version, base_url)
    gitdir = check_target(tree)
    work = gitdir / WORK
    with open(gitdir / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        roll_back(tree, work)
        if folder != "dev" and os.path.lexists(tree / folder) and not force:
            raise PublishError(f"{folder} is already published and releases are immutable; use --force to replace it")
        try:
            names = stage(build, tree, work / STAGING, folder, base_url)
            (work / PREVIOUS).mkdir()
            # Written whole and renamed into place: a journal is either absent or complete.
            (work / f"{JOURNAL}.partial").write_text(json.dumps(names))
            (work / f"{JOURNAL}.partial").rename(work / JOURNAL)
            for name in names:
                if os.path.lexists(tree / name):
                    (tree / name).rename(work / PREVIOUS / name)
                (work / STAGING / name).rename(tree / name)
            (work / JOURNAL).unlink()
        except BaseException:
            roll_back(tree, work)
            raise
        # With the journal gone the publish stands, and what is left in work is litter the next run clears.
        try:
            remove_tree(work)
        except OSError:
            pass
    return folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path, help="the finished site, e.g. build/html")
    parser.add_argument("tree", type=Path, help="the root of a working tree of the gh-pages branch")
    parser.add_argument("version", help="a release tag vX.Y.Z, or main")
    parser.add_argument("--base-url", default="/", help="where the site is served, e.g. /my-repo/ (default /)")
    parser.add_argument("--force", action="store_true", help="replace an already published release")
    args = parser.parse_args(argv)
    try:
        folder = publish(args.build, args.tree, args.version, args.base_url, args.force)
    except (PublishError, OSError) as error:
        # One line even when a file name holds a line break, so logs keep one error per line.
        message = str(error).replace("\r", "\\r").replace("\n", "\\n")
        print(f"publish: {message}", file=sys.stderr)
        return 2 if isinstance(error, PublishError) else 1
    # A path that is not UTF-8 holds surrogates that no stdout can encode: show them escaped.
    shown = [str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
             for path in (args.build, args.tree)]
    print(f"published {shown[0]} as {folder}/ in {shown[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
