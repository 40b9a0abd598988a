"""The ``perf-summary`` directive: the "Performance at a glance" table, computed from the numbers the
tutorials measured in this same build.

Each tutorial, when run by the build, writes ``<TUTORIAL_RESULTS_DIR>/<tutorial>.json``::

    {"tutorial": ..., "platform": ..., "on_gpu": bool, "date": ...,
     "benchmarks": [{"name": ..., "unit": "GB/s", "ceiling_name": ..., "ceiling": float,
                     "ours": [provider, ...], "peers": [provider, ...],
                     "rows": [{"provider": ..., "value": float, <case columns>...}, ...]}]}

For every kernel of ours, the page gives its best and worst ratio to the strongest peer measured at
the same case, and its best and worst fraction of the device ceiling measured in the same run.
"""

import json
import os
import subprocess
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive


def _case_key(row):
    return tuple(sorted((k, str(v)) for k, v in row.items() if k not in ("provider", "value")))


def _case_text(key):
    return ", ".join(f"{k}={v}" for k, v in key)


def summarize(bench):
    """One summary row per kernel of ours: ratios to the best peer, fractions of the ceiling."""
    cases = {}
    for row in bench["rows"]:
        if row["value"] is not None and row["value"] == row["value"]:  # skip None and NaN
            cases.setdefault(_case_key(row), {})[row["provider"]] = float(row["value"])
    out = []
    for ours in bench["ours"]:
        ratios, fractions = [], []
        for key, values in cases.items():
            if ours not in values:
                continue
            fractions.append((values[ours] / bench["ceiling"], key))
            peers = [(values[p], p) for p in bench["peers"] if p in values]
            if peers:
                best_value, best_peer = max(peers)
                ratios.append((values[ours] / best_value, key, best_peer))
        if not fractions:
            continue
        out.append({
            "kernel": ours,
            "best_ratio": max(ratios) if ratios else None,
            "worst_ratio": min(ratios) if ratios else None,
            "best_fraction": max(fractions),
            "worst_fraction": min(fractions),
        })
    return out


def gpu_driver():
    """The NVIDIA driver of the machine running this build (the one the tutorials just ran on)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def load_results(results_dir):
    results = []
    for path in sorted(Path(results_dir).glob("*.json")):
        with open(path) as f:
            results.append(json.load(f))
    return results


def _table(header, rows):
    table = nodes.table(classes=["perf-summary"])
    group = nodes.tgroup(cols=len(header))
    table += group
    group.extend(nodes.colspec(colwidth=1) for _ in header)
    thead, tbody = nodes.thead(), nodes.tbody()
    group += thead
    group += tbody
    for cells, parent in [(header, thead)] + [(r, tbody) for r in rows]:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text=str(cell))
            row += entry
        parent += row
    return table


class PerfSummary(Directive):
    has_content = False

    def run(self):
        env = self.state.document.settings.env
        results_dir = Path(os.environ["TUTORIAL_RESULTS_DIR"])
        results = load_results(results_dir)
        for path in results_dir.glob("*.json"):
            env.note_dependency(str(path))
        if not results:
            return [nodes.paragraph(text=(
                "No tutorial has recorded results in this build (the pages were built without "
                "running the tutorials)."))]
        out = []
        platforms = sorted({r["platform"] for r in results})
        if not all(r["on_gpu"] for r in results):
            out.append(nodes.warning("", nodes.paragraph(text=(
                "Some or all numbers below come from the Triton interpreter on a CPU: they measure "
                "the interpreter, not a GPU, and say nothing about how fast these kernels are."))))
        for platform in platforms:
            out.append(nodes.paragraph(text="Measured on: " + platform))
        if any(r["on_gpu"] for r in results):
            out.append(nodes.paragraph(text="NVIDIA driver: " + gpu_driver()))
        dates = sorted({r["date"] for r in results})
        out.append(nodes.paragraph(text="Date of the measurements: " + ", ".join(dates)))
        header = ["tutorial", "benchmark", "kernel", "best vs. strongest peer",
                  "worst vs. strongest peer", "fraction of the ceiling", "ceiling"]
        rows = []
        for result in results:
            for bench in result["benchmarks"]:
                for s in summarize(bench):
                    def ratio(r):
                        return "n/a" if r is None else f"{r[0]:.2f}x {r[2]} ({_case_text(r[1])})"
                    rows.append([
                        result["tutorial"], bench["name"], s["kernel"],
                        ratio(s["best_ratio"]), ratio(s["worst_ratio"]),
                        f"best {s['best_fraction'][0]:.0%} ({_case_text(s['best_fraction'][1])}), "
                        f"worst {s['worst_fraction'][0]:.0%} ({_case_text(s['worst_fraction'][1])})",
                        f"{bench['ceiling_name']}: {bench['ceiling']:.4g} {bench['unit']}",
                    ])
        out.append(_table(header, rows))
        return out


def _always_reread(app, env, added, changed, removed):
    # The numbers change whenever a tutorial runs, so this page is read again on every build.
    return [doc for doc in env.found_docs if doc == "performance"]


def setup(app):
    app.add_directive("perf-summary", PerfSummary)
    app.connect("env-get-outdated", _always_reread)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
