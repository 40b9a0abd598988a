"""tools/publish.py: versions land where they should, releases stay immutable, bad input changes nothing,
a publish that fails or dies at any step is rolled back, and publishes at the same time all land."""

import errno
import fcntl
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import publish
import pytest

# What a published tree may hold at its top (besides version folders), at any moment: nothing else
# may ever appear there, since the workflow commits the tree with `git add --all`.
TOP = {".git", ".nojekyll", "index.html", "switcher.json", "switcher.zh_CN.json", "stable", "dev"}

# A child process started by these tests: it imports the tool, says so, and publishes on "go".
CHILD = f"""
import sys
sys.path.insert(0, {str(Path(publish.__file__).parent)!r})
import publish
print("ready", flush=True)
sys.stdin.readline()
sys.exit(publish.main(sys.argv[1:]))
"""


def fake_build(root, label, marker, pages=0, switcher="/switcher.json", chinese=True):
    """A minimal finished build, labelled as Sphinx labels it, its pages reading the versions at switcher (as
    pydata-sphinx-theme writes it; None: no switcher), with pages more generated pages, and its Chinese
    edition in zh_CN/ (chinese: True, or a (label, switcher) of its own; False: none)."""
    build = root / f"build-{label}-{marker}"
    _fake_pages(build, label, marker, switcher)
    if chinese:
        zh_label, zh_switcher = (label, switcher and switcher.replace(".json", ".zh_CN.json")) if chinese is True \
            else chinese
        _fake_pages(build / "zh_CN", zh_label, "中文 " + marker, zh_switcher)
    for i in range(pages):
        page = build / "generated" / f"part{i % 10}" / f"page{i}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"{marker} {i} " * 40)
    return build


def _fake_pages(build, label, marker, switcher):
    (build / "_static").mkdir(parents=True)
    reads = f"<script>DOCUMENTATION_OPTIONS.theme_switcher_json_url = '{switcher}';</script>" if switcher else ""
    (build / "index.html").write_text(f"<html>{reads}{label} {marker}</html>")
    (build / "tutorials").mkdir()
    (build / "tutorials" / "page.html").write_text(marker)
    options = f"const DOCUMENTATION_OPTIONS = {{VERSION: '{label}'}};"
    (build / "_static" / "documentation_options.js").write_text(options)


REPO = "/repo/switcher.json"  # where builds published with --base-url /repo/ read the versions


def git_tree(path, branch="gh-pages"):
    # No template: the hooks' samples would only slow down the many copies of a tree below.
    subprocess.run(["git", "init", "-q", "--template=", "-b", branch, str(path)], check=True)
    return path


def snapshot(tree):
    """Every entry below tree but .git: a file's bytes, a link's target, or 'dir' (empty folders count)."""
    entries = {}
    for path in sorted(tree.rglob("*")):
        relative = path.relative_to(tree)
        if relative.parts[0] != ".git":
            entries[str(relative)] = (("link", os.readlink(path)) if path.is_symlink() else
                                      "dir" if path.is_dir() else path.read_bytes())
    return entries


def work_dir(tree):
    return tree / ".git" / publish.WORK


def top_level_is_clean(tree):
    return all(p.name in TOP or publish.RELEASE.fullmatch(p.name) for p in tree.iterdir())


def switcher(tree):
    return json.loads((tree / "switcher.json").read_text())


def one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.startswith("publish: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err


@pytest.fixture
def tree(tmp_path):
    return git_tree(tmp_path / "site")


def test_releases_main_and_stable_over_several_publishes(tmp_path, tree):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a", switcher=REPO), tree, "v1.0.0", base_url="/repo")
    assert "stable/" in (tree / "index.html").read_text()
    publish.publish(fake_build(tmp_path, "dev", "first", switcher=REPO), tree, "main", base_url="/repo")
    publish.publish(fake_build(tmp_path, "dev", "second", switcher=REPO), tree, "main", base_url="/repo")
    assert (tree / "dev" / "tutorials" / "page.html").read_text() == "second"  # main replaces dev/
    v100 = snapshot(tree / "v1.0.0")
    publish.publish(fake_build(tmp_path, "v1.1.0", "b", switcher=REPO), tree, "v1.1.0", base_url="/repo")
    # An older release, published later.
    publish.publish(fake_build(tmp_path, "v0.9.0", "c", switcher=REPO), tree, "v0.9.0", base_url="/repo")
    assert snapshot(tree / "v1.0.0") == v100  # other versions untouched
    assert snapshot(tree / "stable") == snapshot(tree / "v1.1.0")  # stable = the newest release
    entries = switcher(tree)
    assert [e["version"] for e in entries] == ["dev", "v1.1.0", "v1.0.0", "v0.9.0"]
    assert [e["version"] for e in entries if e.get("preferred")] == ["v1.1.0"]
    assert all(set(e) >= {"name", "version", "url"} for e in entries)
    assert entries[1]["url"] == "/repo/v1.1.0/" and entries[0]["url"] == "/repo/dev/"
    assert (tree / ".nojekyll").exists()
    assert 'url=stable/"' in (tree / "index.html").read_text()
    # The lock and the staging live in .git: what the workflow commits is the site and nothing else.
    assert not work_dir(tree).exists() and (tree / ".git" / publish.LOCK).exists()
    subprocess.run(["git", "-C", str(tree), "add", "--all"], check=True)
    committed = subprocess.run(["git", "-C", str(tree), "ls-files"], capture_output=True, text=True, check=True)
    assert {line.split("/")[0] for line in committed.stdout.splitlines()} == {
        "dev", "stable", "v0.9.0", "v1.0.0", "v1.1.0", "index.html", "switcher.json", "switcher.zh_CN.json",
        ".nojekyll"}


def test_each_version_lands_with_its_chinese_edition_and_a_chinese_switcher(tmp_path, tree):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a", switcher=REPO), tree, "v1.0.0", base_url="/repo")
    publish.publish(fake_build(tmp_path, "dev", "b", switcher=REPO), tree, "main", base_url="/repo")
    for folder, marker in (("v1.0.0", "a"), ("stable", "a"), ("dev", "b")):
        assert (tree / folder / "zh_CN" / "tutorials" / "page.html").read_text() == "中文 " + marker
    english, chinese = switcher(tree), json.loads((tree / "switcher.zh_CN.json").read_text())
    assert [e["version"] for e in chinese] == [e["version"] for e in english] == ["dev", "v1.0.0"]
    assert [e["url"] for e in chinese] == ["/repo/dev/zh_CN/", "/repo/v1.0.0/zh_CN/"]
    assert [e.get("preferred") for e in chinese] == [e.get("preferred") for e in english]


def test_a_build_without_its_chinese_edition_or_with_a_mismatched_one_is_refused(tmp_path, tree):
    with pytest.raises(publish.PublishError, match=r"has no Chinese edition \(zh_CN/index.html\)"):
        publish.publish(fake_build(tmp_path, "dev", "english-only", chinese=False), tree, "main")
    with pytest.raises(publish.PublishError, match=r"zh_CN was built as version 'v1.0.0', not 'dev'"):
        publish.publish(fake_build(tmp_path, "dev", "older", chinese=("v1.0.0", "/switcher.zh_CN.json")),
                        tree, "main")
    with pytest.raises(publish.PublishError, match=r"zh_CN reads its list of versions at '/switcher\.json', but "
                                                   r"this publish writes the list at '/switcher\.zh_CN\.json'"):
        publish.publish(fake_build(tmp_path, "dev", "english-list", chinese=("dev", "/switcher.json")), tree, "main")
    assert snapshot(tree) == {}


def test_root_points_to_dev_until_there_is_a_release(tmp_path, tree):
    publish.publish(fake_build(tmp_path, "dev", "x"), tree, "main")
    assert 'url=dev/"' in (tree / "index.html").read_text()
    assert not (tree / "stable").exists()
    assert [e.get("preferred") for e in switcher(tree)] == [None]


def test_a_release_is_never_rewritten_unless_forced(tmp_path, tree):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    before = snapshot(tree)
    with pytest.raises(publish.PublishError, match="immutable"):
        publish.publish(fake_build(tmp_path, "v1.0.0", "b"), tree, "v1.0.0")
    assert snapshot(tree) == before
    publish.publish(fake_build(tmp_path, "v1.0.0", "c"), tree, "v1.0.0", force=True)
    assert (tree / "v1.0.0" / "tutorials" / "page.html").read_text() == "c"
    assert (tree / "stable" / "tutorials" / "page.html").read_text() == "c"


@pytest.mark.parametrize("version", ["v0.0.0", "v0.1.0", "v10.20.30", "v1.0.100"])
def test_plain_release_numbers_are_accepted(tmp_path, tree, version):
    assert publish.publish(fake_build(tmp_path, version, "a"), tree, version) == version
    assert (tree / version / "index.html").is_file() and switcher(tree)[0]["version"] == version


# Leading zeros and other scripts' digits would each name a second folder for release v1.2.3.
HOSTILE_VERSIONS = [
    "../evil", "v1.2", "1.2.3", "v1.2.3/../x", "", "dev", "stable", "v1.2.3 ", " v1.2.3", "v1.2.3\n", "V1.2.3",
    "v01.2.3", "v1.02.3", "v1.2.03", "v00.0.0", "v1.2.3-rc1", "v1.2.3.4", "v+1.2.3", "v-1.2.3", "v1_0.2.3",
    "v\u0661.\u0662.\u0663", "v\uff11.2.3", "v1.2.\U0001d7d1", "v1\u0660.0.0", "v1.2.3\u0663", "v1.2\uff10.3",
    "v1.2.\u00b3", "main\n", "Main", " main", "v1.2.3\x00",
]


@pytest.mark.parametrize("version", HOSTILE_VERSIONS)
def test_hostile_versions_are_refused(tmp_path, tree, capsys, version):
    publish.publish(fake_build(tmp_path, "v1.2.3", "a"), tree, "v1.2.3")
    before = snapshot(tree)
    build = fake_build(tmp_path, version.replace("/", "_").replace("\x00", "_"), "x")
    with pytest.raises(publish.PublishError, match="version must be"):
        publish.publish(build, tree, version)
    assert publish.main([str(build), str(tree), version]) == 2
    assert "version must be" in one_line_error(capsys)
    assert snapshot(tree) == before


def outside_file(build):
    secret = build.parent / "secret.html"
    secret.write_text("<html>not part of the build</html>")
    return secret


# Each makes a finished build hostile, and returns the path the refusal must name.
def link_to_a_file_outside(build):
    (build / "tutorials" / "leak.html").symlink_to(outside_file(build))
    return build / "tutorials" / "leak.html"


def link_to_a_folder_outside(build):
    outside_file(build)
    (build / "tutorials" / "leak").symlink_to(build.parent)
    return build / "tutorials" / "leak"


def link_within_the_build(build):
    (build / "copy.html").symlink_to("index.html")
    return build / "copy.html"


def dangling_link(build):
    (build / "gone.html").symlink_to(build / "nowhere")
    return build / "gone.html"


def linked_index(build):
    (build / "index.html").unlink()
    (build / "index.html").symlink_to(outside_file(build))
    return build / "index.html"


def linked_static_folder(build):
    real = build.parent / "static-elsewhere"
    (build / "_static").rename(real)
    (build / "_static").symlink_to(real)
    return build / "_static"


def deep_link(build):
    (build / "a" / "b" / "c").mkdir(parents=True)
    (build / "a" / "b" / "c" / "etc").symlink_to("/etc")
    return build / "a" / "b" / "c" / "etc"


def fifo(build):
    os.mkfifo(build / "tutorials" / "pipe")
    return build / "tutorials" / "pipe"


def fifo_with_a_line_break_in_its_name(build):
    os.mkfifo(build / "two\nlines")
    return build / "two\nlines"


def unix_socket(build):
    # A relative name: the absolute one may be longer than a socket address allows.
    cwd = os.getcwd()
    os.chdir(build)
    try:
        socket.socket(socket.AF_UNIX).bind("sock")
    finally:
        os.chdir(cwd)
    return build / "sock"


def nested_too_deep(build):
    deep = build.joinpath(*["d"] * (publish.MAX_DEPTH + 1))
    (deep / "d").mkdir(parents=True)
    return deep


@pytest.mark.parametrize("make_hostile", [
    link_to_a_file_outside, link_to_a_folder_outside, link_within_the_build, dangling_link, linked_index,
    linked_static_folder, deep_link, fifo, fifo_with_a_line_break_in_its_name, unix_socket, nested_too_deep])
def test_builds_holding_anything_but_files_and_folders_are_refused(tmp_path, tree, capsys, make_hostile):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    before = snapshot(tree)
    build = fake_build(tmp_path, "dev", "hostile")
    culprit = make_hostile(build)
    with pytest.raises(publish.PublishError) as refusal:
        publish.publish(build, tree, "main")
    assert str(culprit) in str(refusal.value)
    assert publish.main([str(build), str(tree), "main"]) == 2
    assert str(culprit).replace("\n", "\\n") in one_line_error(capsys)
    assert snapshot(tree) == before and not work_dir(tree).exists()


def test_bad_builds_are_refused(tmp_path, tree):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(publish.PublishError, match="no index.html"):
        publish.publish(empty, tree, "main")
    with pytest.raises(publish.PublishError, match="built as version 'dev'"):
        publish.publish(fake_build(tmp_path, "dev", "x"), tree, "v2.0.0")
    with pytest.raises(publish.PublishError, match="not a directory"):
        publish.publish(tmp_path / "missing", tree, "main")
    assert snapshot(tree) == {}


def test_a_build_whose_pages_would_show_no_versions_is_refused(tmp_path, tree):
    """A local build has no version switcher; a build told another address than the publish's would look for
    the versions where nothing is: either would publish pages with no version menu, or an empty one."""
    with pytest.raises(publish.PublishError, match=r"has no version switcher.*DOCS_SWITCHER_URL=/switcher\.json"):
        publish.publish(fake_build(tmp_path, "dev", "local", switcher=None), tree, "main")
    with pytest.raises(publish.PublishError, match=r"reads its list of versions at '/switcher\.json'.*"
                                                   r"DOCS_SWITCHER_URL=/repo/switcher\.json"):
        publish.publish(fake_build(tmp_path, "dev", "elsewhere"), tree, "main", base_url="/repo/")
    assert snapshot(tree) == {}
    publish.publish(fake_build(tmp_path, "dev", "right", switcher=REPO), tree, "main", base_url="/repo/")


def test_targets_other_than_a_gh_pages_worktree_root_are_refused(tmp_path, tree):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    (tree / "sub").mkdir()
    before = snapshot(tree)
    plain = tmp_path / "plain"
    plain.mkdir()
    other = git_tree(tmp_path / "other", branch="main")
    file = tmp_path / "file"
    file.write_text("")
    build = fake_build(tmp_path, "dev", "y")
    for target in (tree / "sub", tree / "v1.0.0", tree / ".git", other, plain, tmp_path / "missing", file):
        with pytest.raises(publish.PublishError, match="not the root of a working tree of the gh-pages branch"):
            publish.publish(build, target, "main")
    assert snapshot(tree) == before and list(plain.iterdir()) == [] and snapshot(other) == {}


def test_a_link_to_the_root_and_a_linked_worktree_are_accepted(tmp_path, tree):
    (tmp_path / "link").symlink_to(tree)
    publish.publish(fake_build(tmp_path, "dev", "x"), tmp_path / "link", "main")
    assert (tree / "dev" / "index.html").is_file()
    # A linked worktree's .git is a file; its git directory lies elsewhere, on the same filesystem.
    repo = git_tree(tmp_path / "repo", branch="main")
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "start"], check=True)
    pages = tmp_path / "pages"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "-b", "gh-pages", str(pages)], check=True)
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), pages, "v1.0.0")
    assert {p.name for p in pages.iterdir()} == {".git", "v1.0.0", "stable", "index.html", "switcher.json",
                                                  "switcher.zh_CN.json", ".nojekyll"}


def test_a_copy_failure_is_a_one_line_error_and_changes_nothing(tmp_path, tree, capsys, monkeypatch):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    before = snapshot(tree)

    def no_space(source, target, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)", str(target))

    monkeypatch.setattr(shutil, "copyfile", no_space)
    assert publish.main([str(fake_build(tmp_path, "v1.1.0", "b")), str(tree), "v1.1.0"]) == 1
    assert "No space left on device (simulated)" in one_line_error(capsys)
    assert snapshot(tree) == before and not work_dir(tree).exists()


def test_a_write_beyond_the_file_size_limit_fails_cleanly_in_a_real_process(tmp_path, tree):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    before = snapshot(tree)
    build = fake_build(tmp_path, "v1.1.0", "b")
    (build / "big.bin").write_bytes(os.urandom(1 << 16))
    # The kernel refuses writes past RLIMIT_FSIZE with EFBIG once SIGXFSZ is ignored: a real I/O failure.
    limited = ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 14, 1 << 14))\n" + CHILD)
    result = subprocess.run([sys.executable, "-c", limited, str(build), str(tree), "v1.1.0"],
                            input="go\n", capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert re.fullmatch(r"publish: could not copy .*File too large.*\n", result.stderr), result.stderr
    assert snapshot(tree) == before and not work_dir(tree).exists()


def test_command_line_reports_refusals(tmp_path, tree, capsys):
    assert publish.main([str(fake_build(tmp_path, "dev", "x")), str(tree), "../up"]) == 2
    assert "version must be" in one_line_error(capsys)
    assert publish.main([str(fake_build(tmp_path, "dev", "y")), str(tree), "main"]) == 0


class Steps:
    """A profile hook: counts the filesystem calls made from Python code once the publish holds its lock
    (before that, it writes nothing but the lock file), and acts just before the n-th.

    It sees the tool's own calls and those inside shutil and pathlib, so a fault can be placed before
    each of them without the tool knowing. Metadata calls (chmod, utime) that follow each copy are left
    out: a fault there is no different from one before the next copy."""

    NAMES = {"open", "write", "rename", "replace", "unlink", "rmdir", "mkdir", "sendfile"}
    MODULES = {"posix", "_io"}

    def __init__(self, n=0, action=None):
        self.n, self.action, self.count, self.locked = n, action, 0, False

    def __call__(self, frame, event, arg):
        if event != "c_call":
            return
        if getattr(arg, "__name__", None) == "flock":
            self.locked = True
        # By module or by file object, so that str.replace, say, is not taken for os.replace.
        elif self.locked and getattr(arg, "__name__", None) in self.NAMES and (
                getattr(arg, "__module__", None) in self.MODULES
                or isinstance(getattr(arg, "__self__", None), io.IOBase)):
            self.count += 1
            if self.count == self.n:
                self.action()


def run_with(hook, *args, **kwargs):
    sys.setprofile(hook)
    try:
        return publish.publish(*args, **kwargs)
    finally:
        sys.setprofile(None)


KILLED = 70


def fail():
    raise OSError(errno.EIO, "input/output error (simulated)")


def die():
    os._exit(KILLED)


@pytest.fixture(params=["v1.1.0", "main"])
def interrupted(request, tmp_path):
    """A tree with v1.0.0 and dev, a publish to run on it, the state that publish should reach, and
    how many filesystem calls it makes."""
    version = request.param
    base = git_tree(tmp_path / "base")
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), base, "v1.0.0")
    publish.publish(fake_build(tmp_path, "dev", "d"), base, "main")
    build = fake_build(tmp_path, "dev" if version == "main" else version, "new")
    counts = []
    for attempt in ("warm-up", "reference"):  # the warm-up leaves no first-call work to the count
        shutil.copytree(base, tmp_path / attempt, symlinks=True)
        counter = Steps()
        run_with(counter, build, tmp_path / attempt, version)
        counts.append(counter.count)
    assert counts[0] == counts[1] > 30
    return base, build, version, snapshot(base), snapshot(tmp_path / "reference"), counts[1]


@pytest.mark.parametrize("interrupted", ["v1.1.0"], indirect=True)
def test_a_publish_that_fails_at_any_step_is_undone_at_once(tmp_path, interrupted):
    base, build, version, before, after, steps = interrupted
    outcomes = []
    for n in range(1, steps + 1):
        tree = shutil.copytree(base, tmp_path / f"failed-{n}", symlinks=True)
        try:
            run_with(Steps(n, fail), build, tree, version)
        except OSError as error:
            assert "simulated" in str(error)
            assert snapshot(tree) == before and not work_dir(tree).exists(), f"step {n}"
            outcomes.append("undone")
        else:  # failed after the journal was gone, or shutil recovered (a sendfile failure falls back to read/write)
            assert snapshot(tree) == after, f"step {n}"
            outcomes.append("published")
        # Failures once the journal is gone only leave litter in .git, which the next run clears.
        publish.publish(build, tree, version, force=True)
        assert snapshot(tree) == after and not work_dir(tree).exists(), f"step {n}"
        shutil.rmtree(tree)
    assert outcomes[0] == "undone" and outcomes[-1] == "published" and outcomes.count("undone") > steps // 2


def test_a_publish_killed_at_any_step_is_rolled_back_by_the_next_run(tmp_path, interrupted):
    base, build, version, before, after, steps = interrupted
    outcomes = []
    for n in range(1, steps + 1):
        tree = shutil.copytree(base, tmp_path / f"killed-{n}", symlinks=True)
        pid = os.fork()
        if pid == 0:  # the child dies just before its n-th filesystem call, leaving everything as it is
            try:
                run_with(Steps(n, die), build, tree, version)
            finally:
                os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == KILLED, f"step {n} was never reached"
        assert top_level_is_clean(tree), f"step {n}: {sorted(p.name for p in tree.iterdir())}"
        # A run that recovers and is then refused shows what recovery made of the tree: the state
        # before, or, once the journal was gone, the state after; never a mix.
        with pytest.raises(publish.PublishError, match="immutable"):
            publish.publish(fake_build(tmp_path / f"killed-{n}.builds", "v1.0.0", "z"), tree, "v1.0.0")
        state = snapshot(tree)
        assert state in (before, after), f"step {n}"
        assert not work_dir(tree).exists(), f"step {n}"
        outcomes.append("published" if state == after else "rolled back")
        publish.publish(build, tree, version, force=True)
        assert snapshot(tree) == after and not work_dir(tree).exists(), f"step {n}"
        shutil.rmtree(tree)
    assert outcomes == sorted(outcomes, reverse=True) and outcomes[0] == "rolled back" and outcomes[-1] == "published"


def start(build, tree, *args):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(build), str(tree), *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    return child


def go(children):
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()


def test_killed_at_random_moments_a_publish_never_leaves_a_mix(tmp_path):
    tree = git_tree(tmp_path / "site")
    publish.publish(fake_build(tmp_path, "v1.0.0", "a", pages=80), tree, "v1.0.0")
    publish.publish(fake_build(tmp_path, "dev", "d", pages=80), tree, "main")
    # The newest release, replaced by one build and then the other: each publish rewrites v1.1.0/,
    # stable/ and the root files, and the tree goes back and forth between two known states.
    builds = [fake_build(tmp_path, "v1.1.0", marker, pages=80) for marker in "xy"]
    publish.publish(builds[0], tree, "v1.1.0")
    states = [snapshot(tree)]
    began = time.perf_counter()
    publish.publish(builds[1], tree, "v1.1.0", force=True)
    duration = time.perf_counter() - began
    states.append(snapshot(tree))
    refused = fake_build(tmp_path, "v1.0.0", "z")
    delays = random.Random(20240611)
    current, killed = 1, 0
    for _ in range(30):
        new = 1 - current
        child = start(builds[new], tree, "v1.1.0", "--force")
        go([child])
        time.sleep(delays.uniform(0, 1.2 * duration))
        child.kill()
        _, err = child.communicate(timeout=60)
        assert child.returncode in (0, -signal.SIGKILL), err
        killed += child.returncode == -signal.SIGKILL
        assert top_level_is_clean(tree)
        # A run that recovers and is then refused shows what recovery made of the tree.
        with pytest.raises(publish.PublishError, match="immutable"):
            publish.publish(refused, tree, "v1.0.0")
        state = snapshot(tree)
        assert state in (states[current], states[new]) and not work_dir(tree).exists()
        if state == states[current]:  # rolled back: the next publish lands
            publish.publish(builds[new], tree, "v1.1.0", force=True)
            assert snapshot(tree) == states[new] and not work_dir(tree).exists()
        current = new
    assert killed >= 10  # most kills land while the child publishes, or the loop tests little


def waiting_on(lock_file, pids):
    """Whether every process in pids is blocked on the flock of lock_file (Linux lists waiters in /proc/locks)."""
    inode = lock_file.stat().st_ino
    waiters = re.findall(r"-> FLOCK\s+ADVISORY\s+WRITE\s+(\d+)\s+\S+:(\d+)\s", Path("/proc/locks").read_text())
    return {pid for pid, ino in waiters if int(ino) == inode} >= {str(pid) for pid in pids}


def check_all_landed(tree, builds):
    for version, build in builds.items():
        assert snapshot(tree / ("dev" if version == "main" else version)) == snapshot(build), version
    releases = sorted((v for v in builds if v != "main"), key=publish.release_key, reverse=True)
    assert snapshot(tree / "stable") == snapshot(builds[releases[0]])
    assert [e["version"] for e in switcher(tree)] == ["dev"] * ("main" in builds) + releases
    assert [e["version"] for e in switcher(tree) if e.get("preferred")] == releases[:1]
    assert 'url=stable/"' in (tree / "index.html").read_text()
    assert top_level_is_clean(tree) and not work_dir(tree).exists()


@pytest.mark.parametrize("versions", [("v1.0.0", "v1.1.0"), ("v2.0.0", "main", "v1.0.0")])
def test_publishes_waiting_on_the_lock_all_land(tmp_path, tree, versions):
    builds = {v: fake_build(tmp_path, "dev" if v == "main" else v, v, pages=60) for v in versions}
    lock_file = tree / ".git" / publish.LOCK
    with open(lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        children = [start(builds[v], tree, v) for v in versions]
        go(children)
        deadline = time.monotonic() + 30
        while not waiting_on(lock_file, [child.pid for child in children]):
            assert time.monotonic() < deadline, "the publishes never waited for the lock"
            assert all(child.poll() is None for child in children), "a publish ran without the lock"
            time.sleep(0.01)
        assert snapshot(tree) == {}
    # Released: they all wake up at once, and each must see what the others did before it.
    for child in children:
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
    check_all_landed(tree, builds)


@pytest.mark.parametrize("versions", [("v1.0.0", "v1.1.0"), ("v2.0.0", "main", "v1.0.0")])
def test_publishes_started_at_the_same_moment_all_land(tmp_path, versions):
    for round in range(2):
        tree = git_tree(tmp_path / f"site-{round}")
        builds = {v: fake_build(tmp_path / f"round-{round}", "dev" if v == "main" else v, v, pages=60)
                  for v in versions}
        children = [start(builds[v], tree, v) for v in versions]
        go(children)
        for child in children:
            _, err = child.communicate(timeout=60)
            assert child.returncode == 0, err
        check_all_landed(tree, builds)


def test_of_two_publishes_of_one_release_exactly_one_lands(tmp_path, tree):
    builds = [fake_build(tmp_path, "v1.0.0", marker, pages=60) for marker in ("first", "second")]
    children = [start(build, tree, "v1.0.0") for build in builds]
    go(children)
    results = [(child.communicate(timeout=60)[1], child.returncode) for child in children]
    assert sorted(code for _, code in results) == [0, 2], results
    assert "immutable" in next(err for err, code in results if code == 2)
    winner = builds[[code for _, code in results].index(0)]
    assert snapshot(tree / "v1.0.0") == snapshot(tree / "stable") == snapshot(winner)


# Found by a hostile test of the tool.


def test_a_build_with_a_read_only_folder_does_not_block_later_publishes():
    """copytree copies folder modes: the replaced dev/ lands in the work area with its read-only folder, and
    removing it failed, and with it every later publish. Run as an unprivileged user (root ignores modes)."""
    import pwd
    import tempfile

    user = "nobody" if os.geteuid() == 0 else None
    # Under a folder that user can enter (pytest's own is private to root), with a copy of the tool and an
    # interpreter that user can reach (the checkout's .venv may be private).
    root = Path(tempfile.mkdtemp(prefix="publish-modes-"))
    try:
        os.chmod(root, 0o755)
        build, tree = fake_build(root, "dev", "x"), git_tree(root / "site")
        (build / "tutorials").chmod(0o555)
        tool = shutil.copy(publish.__file__, root / "publish.py")
        if user:
            ids = pwd.getpwnam(user)
            for path in [root, *root.rglob("*")]:
                os.chown(path, ids.pw_uid, ids.pw_gid, follow_symlinks=False)
        command = [shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"), tool, str(build), str(tree), "main"]
        for attempt in range(3):
            result = subprocess.run(command, capture_output=True, text=True, user=user)
            assert result.returncode == 0, f"publish {attempt + 1}: {result.stderr}"
        assert not work_dir(tree).exists()
    finally:
        for folder, _, _ in os.walk(root):
            os.chmod(folder, 0o755)
        shutil.rmtree(root)


def test_a_tree_without_stable_gets_it_back(tmp_path, tree):
    (tree / "v2.0.0").mkdir()
    (tree / "v2.0.0" / "index.html").write_text("two")
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    assert (tree / "stable" / "index.html").read_text() == "two"  # the root redirects there
    assert 'url=stable/"' in (tree / "index.html").read_text()


@pytest.mark.parametrize("version", ["v1234567890.0.0", "v" + "9" * 5000 + ".0.0"], ids=["10 digits", "5000 digits"])
def test_release_numbers_past_nine_digits_are_refused(tmp_path, tree, version):
    with pytest.raises(publish.PublishError, match="version must be"):
        publish.publish(fake_build(tmp_path, "x", "a"), tree, version)


@pytest.mark.parametrize("base_url", ["repo", "repo/", "/a b/", "/x\n/", "https:/x/", '/"x/', "ftp://host/"])
def test_base_urls_that_would_break_the_switcher_are_refused(tmp_path, tree, base_url):
    with pytest.raises(publish.PublishError, match="base-url"):
        publish.publish(fake_build(tmp_path, "dev", "a"), tree, "main", base_url=base_url)
    assert {p.name for p in tree.iterdir()} == {".git"}


@pytest.mark.parametrize("base_url", ["/", "/repo", "/repo/", "https://example.org/repo/"])
def test_base_urls_from_the_root_or_absolute_are_accepted(tmp_path, tree, base_url):
    build = fake_build(tmp_path, "dev", "a", switcher=base_url.rstrip("/") + "/switcher.json")
    publish.publish(build, tree, "main", base_url=base_url)
    assert switcher(tree)[0]["url"] == base_url.rstrip("/") + "/dev/"


def test_a_build_path_that_is_not_utf8_is_reported_as_published(tmp_path, tree, capsys):
    build = fake_build(tmp_path, "dev", "a").rename(Path(os.fsdecode(bytes(tmp_path) + b"/b\xff")))
    assert publish.main([str(build), str(tree), "main"]) == 0
    assert "published" in capsys.readouterr().out and (tree / "dev" / "index.html").is_file()
