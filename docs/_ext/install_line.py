"""The ``install-line`` directive: the ``pip install`` command of Getting started, with the
PyTorch and Triton versions that produced this build's pages, read from the platform line of
the lessons' results records (``GPU: <name> (torch X, Triton Y)``), never typed by hand.

A GPU record wins over an interpreter one (the pages' numbers are the GPU's). A build with no
records (``make html-noplot``) falls back to the versions pinned in requirements.txt, and says so.
Local version labels (``2.11.0+cu130``) are dropped: pip installs the public release, and
PyTorch's own selector picks the CUDA build.
"""

import json
import os
import re
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive

PLATFORM = re.compile(r"torch (?P<torch>[\w.+]+), Triton (?P<triton>[\w.+]+)")
EXTRAS = "matplotlib pandas"


def built_versions(results_dir):
    """(torch, triton, platform line) from the results records, a GPU's first; None without any."""
    found = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        match = PLATFORM.search(str(record.get("platform", "")))
        if match:
            found.append((not record.get("on_gpu"), match["torch"], match["triton"], record["platform"]))
    if not found:
        return None
    _, torch, triton, platform = min(found)
    return torch.split("+")[0], triton.split("+")[0], platform


def pinned_versions(requirements):
    """(torch, triton) pinned in requirements.txt; None where the file or a pin is missing (a copy of
    docs/ and tutorials/ alone, as a build worker has)."""
    try:
        pins = dict(re.findall(r"^(torch|triton)==([\w.]+)", Path(requirements).read_text(), re.M))
    except FileNotFoundError:
        return None
    return (pins["torch"], pins["triton"]) if {"torch", "triton"} <= set(pins) else None


# The sentence before the command, in each edition: a template, since it names this build's versions.
SENTENCES = {
    "en": {"line": "The install line below names {said}:",
           "built": "the versions that produced this site's pages ({platform})",
           "pinned": "the versions pinned in the repository's requirements.txt (this build ran no lesson)",
           "none": "no versions: this build ran no lesson and has no requirements.txt"},
    "zh_CN": {"line": "下面的安装命令写明了{said}：",
              "built": "生成本站页面的版本（{platform}）",
              "pinned": "仓库 requirements.txt 中固定的版本（本次构建没有运行课程）",
              "none": "空缺的版本：本次构建没有运行课程，也没有 requirements.txt"},
}


def install_text(results_dir, requirements, language="en"):
    """(command, sentence) for the page."""
    words = SENTENCES.get(language, SENTENCES["en"])
    built = built_versions(results_dir)
    if built:
        torch, triton, platform = built
        said = words["built"].format(platform=platform)
    elif pinned := pinned_versions(requirements):
        torch, triton = pinned
        said = words["pinned"]
    else:
        return f"pip install torch triton {EXTRAS}", words["line"].format(said=words["none"])
    return f"pip install torch=={torch} triton=={triton} {EXTRAS}", words["line"].format(said=said)


class InstallLine(Directive):
    has_content = False

    def run(self):
        env = self.state.document.settings.env
        env.note_reread()  # the versions are this build's: read the page again on every build
        results = Path(os.environ.get("TUTORIAL_RESULTS_DIR", Path(env.app.confdir).parent / "build" / "results"))
        command, sentence = install_text(results, Path(env.app.confdir).parent / "requirements.txt",
                                         env.config.language)
        # This build's versions: no message of the catalogs; the Chinese edition has its own template.
        paragraph = nodes.paragraph(text=sentence, translatable=False)
        block = nodes.literal_block(command, command, language="bash")
        return [paragraph, block]


def setup(app):
    app.add_directive("install-line", InstallLine)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
