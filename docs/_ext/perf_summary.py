"""The ``perf-summary`` directive: the "Performance at a glance" table, computed from the numbers the
tutorials measured in this same build.

The results contract
--------------------
Each tutorial that benchmarks, when run by the build, calls ``save_results(tutorial, benchmarks)``
(``tutorials/stepkit.py``), which writes ``<TUTORIAL_RESULTS_DIR>/<tutorial>.json``; this is the one
description of that file, and ``validate_record`` checks it on every load::

    {"tutorial": str,          # the lesson's file name without .py, and the JSON's own file name
     "platform": str,          # what produced the numbers, as the lesson prints it
     "on_gpu": bool,           # False when the Triton interpreter ran on a CPU
     "date": "YYYY-MM-DD",     # the day of the measurements
     "benchmarks": [           # at least one
        {"name": str,          # the benchmark, as the page names it
         "unit": str,          # of every value and of the ceiling: a rate, higher is faster ("GB/s", ...)
         "ceiling_name": str,  # what the device ceiling is, e.g. "copy bandwidth"
         "ceiling": float,     # the ceiling measured in the same run: finite and > 0
         "ceiling_per_case": str,  # optional: a provider measured at every case (a copy of the same
                                   # bytes, say) whose rate there is that case's ceiling instead
         "ours": [str, ...],   # the providers that are this tutorial's kernels (at least one)
         "peers": [str, ...],  # the providers they are compared with (may be empty)
         "rows": [             # one per provider and case; other providers are allowed and ignored
            {"provider": str,
             "value": float > 0, or null or NaN (not measured),  # back to back (see below)
             "gpu_value": float > 0, or null or NaN,  # GPU time, as a rate in the same unit: on a GPU
                                                      # only, and there in every row of ours, of a peer
                                                      # and of ceiling_per_case
             "spread": float >= 0, or null or NaN,    # optional: how far the timings of value spread
             "gpu_spread": float >= 0, or null or NaN,  # optional, on a GPU only: the same for gpu_value
             "gpu_method": "CUDA graph" or "profiler",  # optional, on a GPU only: how GPU time was taken
             <case column>: str, int, float or bool, ...},   # the same columns, of the same types, in
            ...]}]}                                           # every row; one row per provider and case

``stepkit.Measured.row(work)`` gives a row's measured fields. The two rates come from the two timings
of the lessons' one method (the performance page's section "How we time", and stepkit's docstring):
``gpu_value`` from GPU time (the call replayed from a CUDA graph after an L2 flush, or the profiler's
kernel times where the call cannot be captured, which ``gpu_method`` names), ``value`` from calls
enqueued back to back (under the interpreter, the fastest of three wall-clock runs). A spread is the
slowest timing over the fastest, less 1; the rate is the fastest. None of these fields is a case column.

Every provider of ``ours`` and ``peers`` has rows, and none is in both lists; ``ceiling_per_case``, when
given, has rows too and is in neither.

For every kernel of ours, the page gives its best and worst ratio to the strongest peer measured at the
same case, by GPU time and back to back, and its best and worst fraction of the device ceiling measured
in the same run (or of the case's own ceiling, where the benchmark names one), by GPU time on a GPU,
with the range of each device ceiling that several benchmarks divide by; then, for every benchmark, its
ceiling, which providers' GPU time came from the profiler, and a table with the same quantities at each
case and kernel, and which limit binds there: the host where back to back takes longer than GPU time by
more than SPREAD_LIMIT and the timings' spread, else the GPU. A ratio whose timings spread past
``SPREAD_LIMIT`` shows as a range. Each quantity has one format wherever the page shows it: ``format_ratio`` (or
``format_ratio_range``), ``format_fraction`` and ``format_rate`` (the ceiling).
"""

import datetime
import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import NamedTuple

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.addnodes import pending_xref

FIELDS = {"tutorial": str, "platform": str, "on_gpu": bool, "date": str, "benchmarks": list}
BENCHMARK_FIELDS = {"name": str, "unit": str, "ceiling_name": str, "ceiling": float, "ours": list,
                    "peers": list, "rows": list}
OPTIONAL_BENCHMARK_FIELDS = {"ceiling_per_case": str}
KINDS = {str: "text", bool: "true or false", list: "a list", float: "a number"}
CASE_TYPES = (str, int, float, bool)
# A row's fields that are no case column: what was measured, and how.
RATES = ("value", "gpu_value")
SPREADS = ("spread", "gpu_spread")
GPU_FIELDS = ("gpu_value", "gpu_spread", "gpu_method")
MEASURED = ("provider", *RATES, *SPREADS, "gpu_method")
GPU_METHODS = ("CUDA graph", "profiler")
# Timings further apart than this are shown as a range: stepkit.SPREAD_LIMIT (a test keeps them alike).
SPREAD_LIMIT = 0.10


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_kind(value, kind):
    if kind is float:
        return _is_number(value)
    return isinstance(value, kind)


def _check_fields(record, fields, where, optional=None):
    if not isinstance(record, dict):
        raise ValueError(f"{where or 'record'}: expected an object, got {type(record).__name__}")
    optional = optional or {}
    prefix = f"{where}." if where else ""
    missing, unknown = sorted(set(fields) - set(record)), sorted(set(record) - set(fields) - set(optional))
    if missing:
        raise ValueError(f"{prefix}{missing[0]}: missing")
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: not a field of the results contract")
    for name, kind in {**fields, **{name: optional[name] for name in optional if name in record}}.items():
        value = record[name]
        if not _is_kind(value, kind):
            raise ValueError(f"{prefix}{name}: expected {KINDS[kind]}, got {value!r}")
        if kind is str and not value.strip():
            raise ValueError(f"{prefix}{name}: empty")


def _check_providers(values, where, at_least_one):
    if at_least_one and not values:
        raise ValueError(f"{where}: empty")
    for i, value in enumerate(values):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}[{i}]: expected a provider name, got {value!r}")
        if value in values[:i]:
            raise ValueError(f"{where}[{i}]: {value!r} is listed twice")


def _is_finite_positive(value):
    """Whether a number (int or float) is finite and > 0; a huge int that no float holds is not."""
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:
        return False


def _columns_text(columns):
    return "(" + ", ".join(f"{name}: {kind.__name__}" for name, kind in sorted(columns.items())) + ")"


def _check_measured(row, at, on_gpu, compared):
    """The measured fields of one row: rates, spreads and the GPU method. `compared`: the row is one of
    ours, a peer's or the per-case ceiling's, which on a GPU must carry GPU time."""
    if not on_gpu:
        for name in GPU_FIELDS:
            if name in row:
                raise ValueError(f"{at}.{name}: GPU time in a record made without a GPU (on_gpu is false)")
    elif compared and "gpu_value" not in row:
        raise ValueError(f"{at}.gpu_value: missing (on a GPU every row of ours, of a peer and of the "
                         "per-case ceiling carries GPU time)")
    for name in (*RATES, *SPREADS):
        if name not in row:
            continue
        value, rate = row[name], name in RATES
        if value is not None and not _is_number(value):
            raise ValueError(f"{at}.{name}: expected a number or null, got {value!r}")
        if value is None or value != value:  # null or NaN: not measured
            continue
        if rate and not _is_finite_positive(value):
            raise ValueError(f"{at}.{name}: expected a finite number > 0 (or null or NaN: not measured), "
                             f"got {value!r}")
        if not rate and not (_is_finite_positive(value) or value == 0):
            raise ValueError(f"{at}.{name}: expected a finite number >= 0 (or null or NaN: not measured), "
                             f"got {value!r}")
    if "gpu_method" in row and row["gpu_method"] not in GPU_METHODS:
        raise ValueError(f"{at}.gpu_method: expected one of {', '.join(map(repr, GPU_METHODS))}, "
                         f"got {row['gpu_method']!r}")


def validate_record(record):
    """Check one results record against the contract above; raise ValueError naming the bad field."""
    _check_fields(record, FIELDS, "")
    try:
        # fromisoformat alone also takes 20261122 and 2026-W47-7, which the page would print as they are.
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]):
            raise ValueError
        datetime.date.fromisoformat(record["date"])
    except ValueError:
        raise ValueError(f"date: expected YYYY-MM-DD, got {record['date']!r}") from None
    if not record["benchmarks"]:
        raise ValueError("benchmarks: empty")
    for b, bench in enumerate(record["benchmarks"]):
        where = f"benchmarks[{b}]"
        _check_fields(bench, BENCHMARK_FIELDS, where, OPTIONAL_BENCHMARK_FIELDS)
        if not _is_finite_positive(bench["ceiling"]):
            raise ValueError(f"{where}.ceiling: expected a finite number > 0, got {bench['ceiling']!r}")
        _check_providers(bench["ours"], f"{where}.ours", at_least_one=True)
        _check_providers(bench["peers"], f"{where}.peers", at_least_one=False)
        both = sorted(set(bench["ours"]) & set(bench["peers"]))
        if both:
            raise ValueError(f"{where}: {both[0]!r} is both one of ours and a peer")
        per_case = bench.get("ceiling_per_case")
        if per_case in bench["ours"] or per_case in bench["peers"]:
            raise ValueError(f"{where}.ceiling_per_case: {per_case!r} is also one of ours or a peer")
        if not bench["rows"]:
            raise ValueError(f"{where}.rows: empty")
        columns, seen = None, set()
        compared = {*bench["ours"], *bench["peers"], *([per_case] if per_case else [])}
        for r, row in enumerate(bench["rows"]):
            at = f"{where}.rows[{r}]"
            if not isinstance(row, dict):
                raise ValueError(f"{at}: expected an object, got {type(row).__name__}")
            for name in ("provider", "value"):
                if name not in row:
                    raise ValueError(f"{at}.{name}: missing")
            if not isinstance(row["provider"], str) or not row["provider"]:
                raise ValueError(f"{at}.provider: expected a provider name, got {row['provider']!r}")
            _check_measured(row, at, record["on_gpu"], row["provider"] in compared)
            case = {name: type(row[name]) for name in row if name not in MEASURED}
            for name in sorted(case):
                if not isinstance(row[name], CASE_TYPES):
                    raise ValueError(f"{at}.{name}: expected a case value (text, number or bool), got {row[name]!r}")
            if columns is not None and case != columns:
                raise ValueError(f"{at}: case columns {_columns_text(case)} differ from the first row's "
                                 f"{_columns_text(columns)}")
            columns = case
            key = (row["provider"], _case_key(row))
            if key in seen:
                raise ValueError(f"{at}: a second row for {row['provider']!r} at {_case_text(key[1])}")
            seen.add(key)
        named = {row["provider"] for row in bench["rows"]}
        listed = [("ours", name) for name in bench["ours"]] + [("peers", name) for name in bench["peers"]]
        for field, name in listed + ([("ceiling_per_case", per_case)] if per_case else []):
            if name not in named:
                raise ValueError(f"{where}.{field}: {name!r} has no row")


def format_ratio(ratio):
    """Two decimals, or as many more as it takes to show on which side of 1 the ratio lies (0.998x, not 1.00x)."""
    digits = 2
    while digits < 6 and (round(ratio, digits) < 1) != (ratio < 1):
        digits += 1
    return f"{ratio:.{digits}f}x"


def _two_figures(value):
    rounded = float(f"{value:.2g}")
    if rounded >= 10:
        return f"{value:.0f}"
    return f"{rounded:.{1 - math.floor(math.log10(rounded))}f}"


def format_ratio_range(low, high):
    """A ratio known only within a range, as where its timings spread past SPREAD_LIMIT: two significant
    figures at each end (0.91–1.3x), never a two-decimal figure that its timings do not support."""
    return f"{_two_figures(low)}\u2013{_two_figures(high)}x"


def format_fraction(fraction):
    return f"{fraction:.0%}"


def format_rate(value):
    """Three significant figures in plain notation, whole numbers from 100 up: 728, 42.5, 0.00210."""
    rounded = float(f"{value:.3g}")
    if abs(rounded) >= 100:
        return f"{value:.0f}"
    decimals = 2 - math.floor(math.log10(abs(rounded))) if rounded else 0
    return f"{rounded:.{decimals}f}"


def _case_key(row):
    return tuple(sorted((k, str(v)) for k, v in row.items() if k not in MEASURED))


def _case_text(key):
    return ", ".join(f"{k}={v}" for k, v in key)


def case_columns(bench):
    """The case columns of a benchmark's rows, in the order the rows carry them."""
    return [name for name in bench["rows"][0] if name not in MEASURED] if bench["rows"] else []


def _is_measured(value):
    return value is not None and value == value  # neither null nor NaN


def _rate(row, name):
    return float(row[name]) if row is not None and _is_measured(row.get(name)) else None


def has_gpu_time(bench):
    """Whether the benchmark's rows carry GPU time (they do on a GPU, and only there)."""
    return any("gpu_value" in row for row in bench["rows"])


class Ratio(NamedTuple):
    """A kernel's rate over the strongest peer's at one case, by one of the two timings; low and high
    bound it where the timings of either spread past SPREAD_LIMIT (None otherwise)."""

    value: float
    peer: str
    low: float | None = None
    high: float | None = None


def ratio_text(ratio):
    """How a ratio reads on the page, the peer named: "1.20x SDPA cuDNN", "0.91–1.3x SDPA cuDNN", "n/a"."""
    if ratio is None:
        return "n/a"
    shown = format_ratio(ratio.value) if ratio.low is None else format_ratio_range(ratio.low, ratio.high)
    return f"{shown} {ratio.peer}"


def _vs_strongest_peer(rows, ours, peers, rate, spread):
    value = _rate(rows.get(ours), rate)
    measured = [(_rate(rows.get(peer), rate), peer) for peer in peers]
    measured = [(v, peer) for v, peer in measured if v is not None]
    if value is None or not measured:
        return None
    strongest, peer = max(measured)
    ratio = value / strongest
    ours_spread, peer_spread = (_rate(rows[name], spread) or 0.0 for name in (ours, peer))
    if max(ours_spread, peer_spread) > SPREAD_LIMIT:
        # Each rate comes from its fastest timing; its slowest gives value / (1 + spread).
        return Ratio(ratio, peer, ratio / (1 + ours_spread), ratio * (1 + peer_spread))
    return Ratio(ratio, peer)


def binding_limit(row):
    """Which limit sets the pace of one provider at one case: "host" where back to back took longer than
    GPU time by more than SPREAD_LIMIT (the lessons' measure of timings that differ) and by more than the
    larger spread of the two timings (the host could not enqueue the calls as fast as the GPU ran them),
    else "GPU"; None where the row cannot tell (no GPU time, no spreads)."""
    b2b, gpu = _rate(row, "value"), _rate(row, "gpu_value")
    spreads = [_rate(row, name) for name in SPREADS]
    if b2b is None or gpu is None or None in spreads:
        return None
    # Rates in one unit: back to back took gpu / b2b times as long as GPU time.
    return "host" if gpu / b2b - 1 > max(SPREAD_LIMIT, *spreads) else "GPU"


def per_case(bench):
    """One entry per case, in the order cases first appear in the rows: for each kernel of ours, its ratio
    to the strongest peer measured at that case by GPU time ("gpu_ratio") and back to back ("ratio"), as a
    Ratio, its fraction of the ceiling (the case's own, where the benchmark names one; by GPU time where
    the rows carry it, as the ceilings are measured), and the limit that binds there (binding_limit). None
    where the kernel, or for a ratio every peer, or for the fraction the case's ceiling, was not measured
    there, and where no limit can be told."""
    columns, cases = case_columns(bench), {}
    for row in bench["rows"]:
        _, rows = cases.setdefault(_case_key(row), ({name: row[name] for name in columns}, {}))
        rows[row["provider"]] = row
    measure = "gpu_value" if has_gpu_time(bench) else "value"
    out = []
    for key, (case, rows) in cases.items():
        if "ceiling_per_case" in bench:
            ceiling = _rate(rows.get(bench["ceiling_per_case"]), measure)
        else:
            ceiling = bench["ceiling"]
        kernels = {}
        for ours in bench["ours"]:
            value = _rate(rows.get(ours), measure)
            kernels[ours] = {
                "gpu_ratio": _vs_strongest_peer(rows, ours, bench["peers"], "gpu_value", "gpu_spread"),
                "ratio": _vs_strongest_peer(rows, ours, bench["peers"], "value", "spread"),
                "fraction": None if value is None or ceiling is None else value / ceiling,
                "limit": binding_limit(rows.get(ours)),
            }
        out.append({"key": key, "case": case, "kernels": kernels})
    return out


def _best_and_worst(found):
    """(best, worst) of [(quantity, case key)], by the quantity (a Ratio's own value); None if empty."""
    if not found:
        return None
    rank = lambda item: (item[0].value if isinstance(item[0], Ratio) else item[0], item[1])  # noqa: E731
    return max(found, key=rank), min(found, key=rank)


def summarize(bench):
    """One summary row per kernel of ours measured at some case: best and worst ratio to the strongest
    peer by GPU time ("gpu_ratio") and back to back ("ratio"), best and worst fraction of the ceiling
    ("fraction"); each (best, worst) of (quantity, case key), or None where nothing was measured."""
    cases = per_case(bench)
    out = []
    for ours in bench["ours"]:
        found = {name: [(case["kernels"][ours][name], case["key"]) for case in cases
                        if case["kernels"][ours][name] is not None]
                 for name in ("gpu_ratio", "ratio", "fraction")}
        if not any(found.values()):
            continue
        out.append({"kernel": ours, **{name: _best_and_worst(items) for name, items in found.items()}})
    return out


SUMMARY_HEADER = ["tutorial", "benchmark", "kernel", "vs. peer, GPU time", "vs. peer, back to back",
                  "of ceiling", "ceiling"]


def summary_cell(best_and_worst, text):
    """A summary cell: "best <quantity> (<case>), worst <quantity> (<case>)", or "n/a"."""
    if best_and_worst is None:
        return "n/a"
    (best, best_case), (worst, worst_case) = best_and_worst
    return f"best {text(best)} ({_case_text(best_case)}), worst {text(worst)} ({_case_text(worst_case)})"


def summary_row(bench, summary):
    """The summary table's cells after the tutorial's: benchmark, kernel, the two ratios, the fraction and
    the ceiling."""
    return [bench["name"], summary["kernel"], summary_cell(summary["gpu_ratio"], ratio_text),
            summary_cell(summary["ratio"], ratio_text), summary_cell(summary["fraction"], format_fraction),
            ceiling_cell(bench)]


def ceiling_text(bench):
    """The line under a benchmark's heading that gives the ceiling its "of ceiling" columns divide by."""
    rate = f"{format_rate(bench['ceiling'])} {bench['unit']}"
    if "ceiling_per_case" in bench:
        return (f"Ceiling: at each case, \u201c{bench['ceiling_per_case']}\u201d measured there in the same run "
                f"(the device's {bench['ceiling_name']}: {rate}).")
    return f"Ceiling: {bench['ceiling_name']}, {rate}, measured in the same run."


def profiler_text(bench):
    """The sentence that names the providers whose GPU time is the profiler's kernel time (they could not
    be captured in a CUDA graph), with at how many of their cases; "" where every GPU time came from
    CUDA-graph replays."""
    compared = [*bench["ours"], *bench["peers"], *([bench["ceiling_per_case"]] if "ceiling_per_case" in bench
                                                   else [])]
    named = []
    for provider in compared:
        rows = [row for row in bench["rows"] if row["provider"] == provider]
        profiled = sum(row.get("gpu_method") == "profiler" for row in rows)
        if profiled:
            where = "every case" if profiled == len(rows) else f"{profiled} of {len(rows)} cases"
            named.append(f"\u201c{provider}\u201d ({where})")
    if not named:
        return ""
    return (f"GPU time by the profiler's kernel times, as the calls could not be captured in a CUDA graph: "
            f"{', '.join(named)}.")


def ceiling_cell(bench):
    """The summary table's "ceiling" cell of a benchmark."""
    if "ceiling_per_case" in bench:
        return f"\u201c{bench['ceiling_per_case']}\u201d at each case"
    return f"{bench['ceiling_name']}: {format_rate(bench['ceiling'])} {bench['unit']}"



def ceiling_ranges(results):
    """One sentence per device ceiling that fractions divide by in more than one run, with the lowest and
    highest value.

    Each lesson measures its ceiling in its own run, and the runs differ; the sentence shows by how much,
    so that fractions from different lessons are not read as if they shared one denominator. Benchmarks
    of one lesson that share its run's figure count as one measurement; those whose fractions divide by
    each case's own ceiling do not count."""
    measured, benchmarks = {}, {}
    for result in results:
        for bench in result["benchmarks"]:
            if "ceiling_per_case" in bench:
                continue
            key = (bench["ceiling_name"], bench["unit"])
            measured.setdefault(key, set()).add((result["tutorial"], bench["ceiling"]))
            benchmarks[key] = benchmarks.get(key, 0) + 1
    sentences = []
    for (name, unit), runs in measured.items():
        if len(runs) < 2:
            continue
        values = [value for _, value in runs]
        low, high = format_rate(min(values)), format_rate(max(values))
        spread = f"{low} {unit} each time" if low == high else f"from {low} to {high} {unit}"
        count = benchmarks[(name, unit)]
        used_by = f" (for {count} benchmarks)" if count != len(runs) else ""
        sentences.append(f"The {name} was measured {len(runs)} times in this build{used_by}: {spread} "
                         "(each benchmark's fractions use its own run's figure).")
    return sentences


class RatioRow(NamedTuple):
    """A row of the ratio figure: one kernel of one benchmark, with its (worst, best) ratio to the strongest
    peer over the cases, by GPU time and back to back (a Ratio's own value; None where not measured)."""

    tutorial: str
    benchmark: str
    kernel: str
    gpu: tuple[float, float] | None
    back_to_back: tuple[float, float] | None


def _worst_and_best(best_and_worst):
    if best_and_worst is None:
        return None
    (best, _), (worst, _) = best_and_worst
    return worst.value, best.value


def ratio_rows(results):
    """The ratio figure's rows, lessons in path order: summarize's best and worst ratios of every kernel of
    ours that was measured beside a peer; by GPU time only from records made on a GPU."""
    rows = []
    for result in sorted(results, key=lambda r: r["tutorial"]):
        for bench in result["benchmarks"]:
            for summary in summarize(bench):
                gpu = _worst_and_best(summary["gpu_ratio"]) if result["on_gpu"] else None
                back_to_back = _worst_and_best(summary["ratio"])
                if gpu or back_to_back:
                    rows.append(RatioRow(result["tutorial"], bench["name"], summary["kernel"], gpu, back_to_back))
    return rows


# The figure's two series, in neutral colours apart from the providers' (stepkit.STYLE), told apart by
# lightness too: (label, colour, RatioRow field).
RATIO_SERIES = (("GPU time", "#34495e", "gpu"), ("back to back", "#c4a46b", "back_to_back"))
RATIO_FIGURE_WIDTH_IN, RATIO_FIGURE_DPI = 8.5, 100  # 850 px, shown at that width in the 896 px text column


def _ratio_ticks(low, high):
    """Tick positions on the log axis from low to high, finer the narrower the span, 1 always among them."""
    span = math.log10(high / low)
    if span < 0.3:
        ladder = [0.7, 0.8, 0.85, 0.9, 0.95, 1, 1.05, 1.1, 1.2, 1.3, 1.5]
    elif span < 1.6:
        ladder = [0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 7, 10]
    else:
        ladder = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000]
    return [tick for tick in ladder if low <= tick <= high]


def ratio_figure(results):
    """The performance page's figure: for every kernel of ours (a row per lesson, benchmark and kernel,
    grouped under a heading per lesson and benchmark, lessons in path order), a bar from its worst to its
    best ratio to the strongest peer over the cases, by GPU time and back to back (back to back only from
    the interpreter's records), and a line at 1.0. Returns (matplotlib Figure, ratio_rows), or None where
    no kernel was measured beside a peer. Drawn without pyplot: no backend or global state is touched."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator

    rows = ratio_rows(results)
    if not rows:
        return None
    # y positions from the top: a heading row per (lesson, benchmark), then a row per kernel.
    headings, places, y = [], [], 0.0
    for row in rows:
        if not headings or headings[-1][0] != (row.tutorial, row.benchmark):
            headings.append(((row.tutorial, row.benchmark), y))
            y += 0.8
        places.append(y)
        y += 1.0
    drawn = [series for series in RATIO_SERIES if any(getattr(row, series[2]) for row in rows)]
    values = [v for row in rows for series in drawn for v in (getattr(row, series[2]) or ())] + [1.0]
    low, high = min(values) / 1.25, max(values) * 1.25
    with matplotlib.rc_context({"font.size": 10, "xtick.labelsize": 10, "ytick.labelsize": 9,
                                "legend.fontsize": 9.5, "axes.labelsize": 10}):
        fig = Figure(figsize=(RATIO_FIGURE_WIDTH_IN, 0.3 * y + 1.5), dpi=RATIO_FIGURE_DPI, layout="constrained")
        ax = fig.add_subplot()
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1, zorder=1)
        offsets = [-0.18, 0.18] if len(drawn) == 2 else [0.0]
        for (label, colour, field), offset in zip(drawn, offsets, strict=True):
            for row, place in zip(rows, places, strict=True):
                span = getattr(row, field)
                if span is None:
                    continue
                worst, best = span
                ax.plot([worst, best], [place + offset] * 2, color=colour, linewidth=4, solid_capstyle="butt",
                        marker="o", markersize=5, zorder=2)
        for (tutorial, benchmark), place in headings:
            ax.text(0.005, place, f"{tutorial}: {benchmark}", transform=ax.get_yaxis_transform(), ha="left",
                    va="center", fontsize=9, fontweight="bold", zorder=3,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        ax.set_xscale("log")
        ax.set_xlim(low, high)
        ticks = _ratio_ticks(low, high)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{tick:g}x" for tick in ticks])
        ax.set_yticks(places, [row.kernel for row in rows])
        ax.set_ylim(y - 0.4, -0.6)  # the first row on top
        ax.tick_params(axis="y", length=0)
        ax.grid(axis="x", color="#e0e0e0", linewidth=0.8, zorder=0)
        ax.set_axisbelow(True)
        ax.set_xlabel("ratio to the strongest peer at the same case, worst case to best (right of 1: faster)")
        handles = [Line2D([], [], color=colour, linewidth=4, marker="o", markersize=5, label=label)
                   for label, colour, _ in drawn]
        handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1,
                              label="1.0: as fast as the strongest peer"))
        fig.legend(handles=handles, loc="outside upper center", ncols=len(handles), frameon=False)
    return fig, rows


def ratio_caption(results):
    """The figure's caption: what a bar shows, and where the interpreter drew it, that it only illustrates."""
    text = ("Each kernel's ratio to the strongest peer measured at the same case: a bar runs from its worst "
            "case to its best (a dot alone: one case, or the same ratio at each)")
    if any(r["on_gpu"] for r in results):
        text += ", by GPU time (dark) and back to back (light)"
    text += ". Right of the dashed line at 1.0 a kernel is faster than the strongest peer. The table below " \
            "gives the numbers and names the peer and the case."
    if not all(r["on_gpu"] for r in results):
        text += (" The Triton interpreter on a CPU made some or all of these records, and they show back to "
                 "back only: the interpreter's ratios are illustrative, and say nothing about a GPU.")
    return text


def ratio_alt(rows):
    """The figure's alt text: what it shows, and how many kernels."""
    series = " and ".join(label for label, _, field in RATIO_SERIES if any(getattr(row, field) for row in rows))
    return (f"Horizontal bars for {len(rows)} kernels, one per lesson, benchmark and kernel, each from its "
            f"worst to its best ratio to the strongest peer at the same case, by {series}, beside a dashed "
            "line at 1.0, as fast as the strongest peer.")


def draw_ratios(results, path):
    """Draw ratio_figure into the PNG at path; return its rows ([] and no file where it draws nothing)."""
    drawn = ratio_figure(results)
    if drawn is None:
        return []
    fig, rows = drawn
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=RATIO_FIGURE_DPI)  # no bbox_inches="tight": the width stays what the page shows
    return rows


def case_table(bench):
    """The header and text rows of a benchmark's table of cases: a row per case and kernel of ours, with the
    case columns, the kernel, its ratio to the strongest peer there by GPU time (on a GPU) and back to
    back (each naming that peer), its fraction of the ceiling, and (on a GPU) the limit that binds. The
    headers stay short: the ceiling goes in ceiling_text, once."""
    gpu = has_gpu_time(bench)
    header = [*case_columns(bench), "kernel", *(["vs. peer, GPU time"] if gpu else []), "vs. peer, back to back",
              "of ceiling", *(["limit"] if gpu else [])]
    rows = []
    for case in per_case(bench):
        for ours, kernel in case["kernels"].items():
            cells = [str(value) for value in case["case"].values()] + [ours]
            if gpu:
                cells.append(ratio_text(kernel["gpu_ratio"]))
            cells.append(ratio_text(kernel["ratio"]))
            cells.append("n/a" if kernel["fraction"] is None else format_fraction(kernel["fraction"]))
            if gpu:
                cells.append(kernel["limit"] or "n/a")
            rows.append(cells)
    return header, rows


def gpu_driver():
    """The NVIDIA driver of the machine running this build (the one the tutorials just ran on)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def load_results(results_dir):
    """Every record in results_dir, checked against the contract; ValueError names the file and field."""
    results = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            validate_record(record)
            if record["tutorial"] != path.stem:
                raise ValueError(f"tutorial: {record['tutorial']!r} written to the file of {path.stem!r}")
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
        results.append(record)
    return results


def _table(header, rows, classes=("perf-summary",)):
    table = nodes.table(classes=list(classes))
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
            entry += nodes.paragraph("", "", cell) if isinstance(cell, nodes.Node) else nodes.paragraph(text=str(cell))
            row += entry
        parent += row
    return table


class PerfSummary(Directive):
    has_content = False

    def _lesson_link(self, tutorial):
        env = self.state.document.settings.env
        gallery = env.config.sphinx_gallery_conf["gallery_dirs"]
        gallery = gallery if isinstance(gallery, str) else gallery[0]
        link = pending_xref("", nodes.inline(text=tutorial), refdomain="std", reftype="doc",
                            reftarget=f"/{gallery}/{tutorial}", refexplicit=True, refwarn=True,
                            refdoc=env.docname)
        return link

    def _ratio_figure(self, results):
        """The ratio figure, drawn into the build's doctree folder; Sphinx copies it to _images, as any
        image of the source, and links it to itself (a width is given), so a phone can open it full size."""
        env = self.state.document.settings.env
        png = Path(env.doctreedir) / "perf_summary" / "performance-ratios.png"
        rows = draw_ratios(results, png)
        if not rows:
            return []
        uri = "/" + Path(os.path.relpath(png, env.srcdir)).as_posix()  # "/" starts at the source folder
        width = f"{round(RATIO_FIGURE_WIDTH_IN * RATIO_FIGURE_DPI)}px"
        figure = nodes.figure(ids=["ratios-to-the-strongest-peer"], classes=["perf-ratios"])
        figure += nodes.image(uri=uri, alt=ratio_alt(rows), width=width)
        figure += nodes.caption(text=ratio_caption(results))
        return [figure]

    def run(self):
        env = self.state.document.settings.env
        env.note_reread()  # the numbers change whenever a lesson runs: read the page on every build
        results_dir = Path(os.environ["TUTORIAL_RESULTS_DIR"])
        for path in results_dir.glob("*.json"):
            env.note_dependency(str(path))
        try:
            results = load_results(results_dir)
        except ValueError as error:
            raise self.error(f"a tutorial's results break the contract of perf_summary.py: {error}") from error
        if not results:  # a sentence of the page, translated
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
        out.extend(self._ratio_figure(results))
        rows = []
        for result in results:
            for bench in result["benchmarks"]:
                for summary in summarize(bench):
                    rows.append([self._lesson_link(result["tutorial"]), *summary_row(bench, summary)])
        # On a phone each row of the summary shows as a card, a line per column (custom.css).
        out.append(_table(SUMMARY_HEADER, rows, ("perf-summary", "perf-summary-cards")))
        out.extend(nodes.paragraph(text=sentence) for sentence in ceiling_ranges(results))
        for result in results:
            for bench in result["benchmarks"]:
                # A rubric, not a section: a directive's output sits inside the page's own section. One
                # inline holds the heading, as the theme stacks a rubric's children one below another.
                out.append(nodes.rubric("", "", nodes.inline("", "", self._lesson_link(result["tutorial"]),
                                                             nodes.Text(f": {bench['name']}"))))
                out.append(nodes.paragraph(text=" ".join(filter(None, [ceiling_text(bench), profiler_text(bench)]))))
                out.append(_table(*case_table(bench)))
        # This build's figures: no message of the Chinese catalogs (docs/_ext/edition.py), which says so.
        for node in out:
            for text in node.findall(nodes.TextElement):
                text["translatable"] = False
        return out


def setup(app):
    app.add_directive("perf-summary", PerfSummary)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
