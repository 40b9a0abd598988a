"""Place a finished site build into a gh-pages working tree as one version among many.

    python tools/publish.py BUILD_DIR GH_PAGES_TREE VERSION [--base-url /repo/] [--force]

VERSION is a release tag ``vX.Y.Z`` or ``main``:

* a release goes to ``vX.Y.Z/`` and is never rewritten afterwards (unless ``--force``);
* ``main`` goes to ``dev/`` and replaces what was there;
* ``stable/`` is a full copy of the newest release. A copy rather than a set of redirect pages:
  every deep link into ``stable/`` is a real page (no redirect hop, works without JavaScript, and
  search engines index the stable text), and the site is small enough that the copy costs little;
* the root ``index.html`` redirects to ``stable/`` (to ``dev/`` until there is a release);
* ``switcher.json`` at the root lists every version for pydata-sphinx-theme's version switcher,
  newest first, ``dev`` on top, the newest release ``preferred``;
* ``.nojekyll`` keeps GitHub Pages from hiding folders that start with an underscore.

Everything is validated before anything is written, and the new state is assembled beside the tree
and moved into place at the end; if a step fails, the moves made so far are undone, so the tree is
left exactly as it was. Folders of other versions are never touched.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RELEASE = re.compile(r"v(\d+)\.(\d+)\.(\d+)")
SWITCHER = "switcher.json"


class PublishError(Exception):
    """A refusal with a message meant for the person publishing."""


def folder_for(version):
    if version == "main":
        return "dev"
    if RELEASE.fullmatch(version):
        return version
    raise PublishError(f"version must be 'main' or a release tag like v1.2.3, got {version!r}")


def release_key(name):
    return tuple(int(part) for part in RELEASE.fullmatch(name).groups())


def built_version(build):
    """The version the pages were built as (Sphinx writes it into documentation_options.js)."""
    options = build / "_static" / "documentation_options.js"
    match = re.search(r"VERSION:\s*'([^']*)'", options.read_text()) if options.exists() else None
    return match.group(1) if match else None


def validate(build, tree, version, force):
    folder = folder_for(version)
    if not (build / "index.html").is_file():
        raise PublishError(f"{build} is not a finished site build: it has no index.html")
    label = "dev" if folder == "dev" else version
    found = built_version(build)
    if found != label:
        raise PublishError(f"{build} was built as version {found!r}, not {label!r}: "
                           f"rebuild with DOCS_VERSION={label}")
    if not tree.is_dir():
        raise PublishError(f"{tree} is not a directory")
    branch = subprocess.run(["git", "-C", str(tree), "symbolic-ref", "--short", "HEAD"],
                            capture_output=True, text=True)
    if branch.returncode != 0 or branch.stdout.strip() != "gh-pages":
        raise PublishError(f"{tree} is not a working tree of the gh-pages branch")
    if folder != "dev" and (tree / folder).exists() and not force:
        raise PublishError(f"{folder} is already published and releases are immutable; use --force to replace it")
    return folder


def switcher_entries(releases, has_dev, base_url):
    entries = [{"name": "dev", "version": "dev", "url": f"{base_url}dev/"}] if has_dev else []
    for i, name in enumerate(releases):
        entry = {"name": f"{name} (stable)" if i == 0 else name, "version": name, "url": f"{base_url}{name}/"}
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


def publish(build, tree, version, base_url="/", force=False):
    """Publish build as version into tree; returns the folder written."""
    build, tree = Path(build).resolve(), Path(tree).resolve()
    if not base_url.endswith("/"):
        base_url += "/"
    folder = validate(build, tree, version, force)

    releases = sorted({p.name for p in tree.iterdir() if p.is_dir() and RELEASE.fullmatch(p.name)} |
                      ({folder} if folder != "dev" else set()), key=release_key, reverse=True)
    has_dev = folder == "dev" or (tree / "dev").is_dir()
    newest = releases[0] if releases else None

    staging = Path(tempfile.mkdtemp(prefix=".publish-", dir=tree))
    backup = staging / "previous"
    backup.mkdir()
    moved = []  # (name, had_previous) in the order they were put in place
    try:
        shutil.copytree(build, staging / folder)
        if newest is not None and newest == folder:
            shutil.copytree(build, staging / "stable")
        (staging / SWITCHER).write_text(json.dumps(switcher_entries(releases, has_dev, base_url), indent=2) + "\n")
        (staging / "index.html").write_text(redirect_page("stable/" if newest else "dev/"))
        (staging / ".nojekyll").write_text("")
        for name in (folder, "stable", SWITCHER, "index.html", ".nojekyll"):
            if not (staging / name).exists():
                continue
            had_previous = (tree / name).exists()
            if had_previous:
                (tree / name).rename(backup / name)
            moved.append((name, had_previous))
            (staging / name).rename(tree / name)
    except BaseException:
        for name, had_previous in reversed(moved):
            target = tree / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            if had_previous:
                (backup / name).rename(target)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path, help="the finished site, e.g. build/html")
    parser.add_argument("tree", type=Path, help="a working tree of the gh-pages branch")
    parser.add_argument("version", help="a release tag vX.Y.Z, or main")
    parser.add_argument("--base-url", default="/", help="where the site is served, e.g. /my-repo/ (default /)")
    parser.add_argument("--force", action="store_true", help="replace an already published release")
    args = parser.parse_args(argv)
    try:
        folder = publish(args.build, args.tree, args.version, args.base_url, args.force)
    except PublishError as error:
        print(f"publish: {error}", file=sys.stderr)
        return 2
    print(f"published {args.build} as {folder}/ in {args.tree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
