"""tools/publish.py: versions land where they should, releases stay immutable, bad input changes nothing."""

import json
import subprocess
from pathlib import Path

import publish
import pytest


def fake_build(root, label, marker):
    """A minimal finished build, labelled as Sphinx labels it."""
    build = root / f"build-{label}-{marker}"
    (build / "_static").mkdir(parents=True)
    (build / "index.html").write_text(f"<html>{label} {marker}</html>")
    (build / "tutorials").mkdir()
    (build / "tutorials" / "page.html").write_text(marker)
    (build / "_static" / "documentation_options.js").write_text(f"const DOCUMENTATION_OPTIONS = {{VERSION: '{label}'}};")
    return build


def git_tree(path, branch="gh-pages"):
    path.mkdir()
    subprocess.run(["git", "init", "-q", "-b", branch, str(path)], check=True)
    return path


def snapshot(tree):
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(tree).parts}


@pytest.fixture
def tree(tmp_path):
    return git_tree(tmp_path / "site")


def switcher(tree):
    return json.loads((tree / "switcher.json").read_text())


def test_releases_main_and_stable_over_several_publishes(tmp_path, tree):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0", base_url="/repo")
    assert "stable/" in (tree / "index.html").read_text()
    publish.publish(fake_build(tmp_path, "dev", "first"), tree, "main", base_url="/repo")
    publish.publish(fake_build(tmp_path, "dev", "second"), tree, "main", base_url="/repo")
    assert (tree / "dev" / "tutorials" / "page.html").read_text() == "second"  # main replaces dev/
    v100 = snapshot(tree / "v1.0.0")
    publish.publish(fake_build(tmp_path, "v1.1.0", "b"), tree, "v1.1.0", base_url="/repo")
    publish.publish(fake_build(tmp_path, "v0.9.0", "c"), tree, "v0.9.0", base_url="/repo")  # older, later
    assert snapshot(tree / "v1.0.0") == v100  # other versions untouched
    assert snapshot(tree / "stable") == snapshot(tree / "v1.1.0")  # stable = the newest release
    entries = switcher(tree)
    assert [e["version"] for e in entries] == ["dev", "v1.1.0", "v1.0.0", "v0.9.0"]
    assert [e["version"] for e in entries if e.get("preferred")] == ["v1.1.0"]
    assert all(set(e) >= {"name", "version", "url"} for e in entries)
    assert entries[1]["url"] == "/repo/v1.1.0/" and entries[0]["url"] == "/repo/dev/"
    assert (tree / ".nojekyll").exists()
    assert 'url=stable/"' in (tree / "index.html").read_text()
    assert not [p for p in tree.iterdir() if p.name.startswith(".publish-")]


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


@pytest.mark.parametrize("version", ["../evil", "v1.2", "1.2.3", "v1.2.3/../x", "", "dev", "stable", "v1.2.3 "])
def test_bad_versions_are_refused(tmp_path, tree, version):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    before = snapshot(tree)
    with pytest.raises(publish.PublishError, match="version must be"):
        publish.publish(fake_build(tmp_path, "dev", "x"), tree, version)
    assert snapshot(tree) == before


def test_bad_builds_and_targets_are_refused(tmp_path, tree):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(publish.PublishError, match="no index.html"):
        publish.publish(empty, tree, "main")
    with pytest.raises(publish.PublishError, match="built as version 'dev'"):
        publish.publish(fake_build(tmp_path, "dev", "x"), tree, "v2.0.0")
    with pytest.raises(publish.PublishError, match="gh-pages"):
        publish.publish(fake_build(tmp_path, "dev", "y"), git_tree(tmp_path / "other", branch="main"), "main")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(publish.PublishError, match="gh-pages"):
        publish.publish(fake_build(tmp_path, "dev", "z"), plain, "main")
    assert snapshot(tree) == {} and list(plain.iterdir()) == []


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_a_failure_halfway_leaves_the_tree_as_it_was(tmp_path, tree, monkeypatch, failing_call):
    publish.publish(fake_build(tmp_path, "v1.0.0", "a"), tree, "v1.0.0")
    publish.publish(fake_build(tmp_path, "dev", "d"), tree, "main")
    before = snapshot(tree)
    calls = {"n": 0}
    rename = Path.rename

    def failing_rename(self, target):
        if Path(target).parent == tree:  # a move into place
            calls["n"] += 1
            if calls["n"] == failing_call:
                raise OSError("disk full (simulated)")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        publish.publish(fake_build(tmp_path, "v1.1.0", "b"), tree, "v1.1.0")
    monkeypatch.undo()
    assert snapshot(tree) == before
    assert not [p for p in tree.iterdir() if p.name.startswith(".publish-")]


def test_command_line_reports_refusals(tmp_path, tree, capsys):
    assert publish.main([str(fake_build(tmp_path, "dev", "x")), str(tree), "../up"]) == 2
    assert "version must be" in capsys.readouterr().err
    assert publish.main([str(fake_build(tmp_path, "dev", "y")), str(tree), "main"]) == 0
