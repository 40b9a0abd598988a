"""What the lessons share and none of them teaches: the device, loading a sibling
lesson, timing, ceilings, the results file, plot style, input handling, exercise
checks and the attention benchmark.

Every lesson imports it in one line, before Triton::

    import stepkit as kit  # picks the device; no GPU: the Triton interpreter

It keeps no state between lessons: Sphinx-Gallery runs them all in one process.

How the lessons time a call (the performance page gives the same definition):

* **GPU time**: the call's launches captured once in a CUDA graph and replayed,
  with the L2 cache flushed before each replay; CUDA events around each replay.
  A call that cannot be captured is timed by the CUDA profiler's kernel times.
* **Back to back**: many calls enqueued in a row from Python, with no flush and
  no synchronization between them, wall time over their number: what a training
  or inference loop sees, the slower of the host and the GPU.
* Every call is warmed up the same way first; a backward is
  ``torch.autograd.grad(out, inputs, dout)``, so nothing accumulates in ``.grad``;
  a peer's backend is selected outside the timed region.
* Each provider is timed in passes over all the cases and keeps its fastest
  timing. Where its two fastest timings of one case differ by more than
  ``SPREAD_LIMIT``, it is timed again, up to ``MAX_PASSES`` times in all, and
  then shown as a range.
* Under the interpreter the time is the fastest of three wall-clock runs: it
  measures NumPy on the CPU, and only illustrates.
"""

import contextlib
import functools
import itertools
import json
import math
import numbers
import os
import platform
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Triton reads this when @triton.jit runs: it must be set before any kernel.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (after the interpreter switch, on purpose)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
HERE = Path(__file__).resolve().parent


# -- Sibling lessons -------------------------------------------------------


def load_lesson(stem):
    """Another lesson, imported once from the file next to this module: its
    script, or else its notebook (the site's zips hold one or the other).

    It is imported under a name that is not ``__main__``, so it defines its
    kernels and runs nothing heavy. ImportError, saying what to download, when
    neither file is there."""
    import linecache

    name = "lesson_" + stem.replace("-", "_")
    if name in sys.modules:
        return sys.modules[name]
    path = HERE / f"{stem}.py"
    if path.exists():
        source = path.read_text(encoding="utf-8")
    elif path.with_suffix(".ipynb").exists():
        path = path.with_suffix(".ipynb")
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        source = "\n".join(
            "".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"
        )
        # Triton reads a kernel's source back through linecache: give it code.
        linecache.cache[str(path)] = (
            len(source),
            None,
            source.splitlines(keepends=True),
            str(path),
        )
    else:
        raise ImportError(
            f"this lesson needs {stem}.py or {stem}.ipynb next to stepkit.py in "
            f"{HERE}: download all lessons as a zip from the site, or run the "
            "download step at the top of the notebook"
        )
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]  # a half-run lesson must not be found next time
        raise
    return module


def tuned_table(name):
    """One table that ``tools/tune.py`` measured on a GPU and wrote into
    ``tuned_tables.json`` beside the lessons: {"measured_on": ..., "rows": ...}."""
    path = HERE / "tuned_tables.json"
    try:
        tables = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ImportError(
            f"{path.name} is missing next to stepkit.py: download all "
            "lessons as a zip from the site"
        ) from None
    if name not in tables:
        raise KeyError(f"{path.name} has no table {name!r}; it has {sorted(tables)}")
    return tables[name]


# -- What produced the numbers ----------------------------------------------


def describe_platform():
    """What produced the numbers on this page."""
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name()} ({versions})"
    cpu = platform.processor() or platform.machine()
    return (
        f"Triton interpreter on CPU ({cpu}; {versions}): these timings "
        "measure the interpreter, not a GPU"
    )


def save_results(tutorial, benchmarks):
    """Leave the measured numbers for the "Performance at a glance" page, when
    the site's build asks for them (docs/_ext/perf_summary.py: the contract)."""
    out = os.environ.get("TUTORIAL_RESULTS_DIR")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    record = {
        "tutorial": tutorial,
        "platform": describe_platform(),
        "on_gpu": ON_GPU,
        "date": time.strftime("%Y-%m-%d"),
        "benchmarks": benchmarks,
    }
    with open(os.path.join(out, tutorial + ".json"), "w") as f:
        json.dump(record, f, indent=1)


def c_printed(run):
    """Call run() and return, as text, what it wrote to file descriptor 1, C's
    standard output: where the GPU's printing lands, which notebooks and this page
    never see, since they replace only Python's sys.stdout."""
    import ctypes
    import tempfile

    sys.stdout.flush()  # what Python printed before stays out of the capture
    saved = os.dup(1)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            run()
        finally:
            ctypes.CDLL(None).fflush(None)  # C buffers its output when not a terminal
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        return captured.read().decode(errors="replace")


# -- Timing -----------------------------------------------------------------

SPREAD_LIMIT = 0.10  # timings of one case further apart than this are retimed
PASSES = 2 if ON_GPU else 1
MAX_PASSES = 4
WARM_UP_S = 0.05  # every call, every provider: the clocks settle while it runs
TIMED_S = 0.03  # about this long of calls per timing
FLUSH_BYTES = 256 << 20  # more than any GPU's L2 cache


def warm_up(fn, seconds=WARM_UP_S):
    """Run fn on the GPU for `seconds`, waiting for each call; return the count.

    While the host compiles, the GPU idles and its clocks drop: a kernel timed
    right after it compiled would be timed on a cold GPU."""
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        torch.cuda.synchronize()
        calls += 1
    return calls


class Timer:
    """How to time one call: ``make()`` prepares it (a backward runs its forward
    there) and returns the function to repeat; ``context`` is entered around
    both, outside the timed region (a peer's backend choice, say)."""

    def __init__(self, make, context=contextlib.nullcontext):
        self.make, self.context = make, context


def call_timer(fn, *args, **kwargs):
    """A Timer for fn(*args, **kwargs); fn.context, if set, is its context."""
    call = functools.partial(fn, *args, **kwargs)
    return Timer(lambda: call, getattr(fn, "context", contextlib.nullcontext))


def backward_timer(fn, *inputs, **kwargs):
    """A Timer for the backward pass of fn(*inputs, **kwargs) alone:
    torch.autograd.grad of its output with a fresh random dout; the forward runs
    once, in make(), outside the timing."""

    def make():
        out = fn(*inputs, **kwargs)
        dout = torch.randn_like(out)
        return functools.partial(
            torch.autograd.grad, out, inputs, dout, retain_graph=True
        )

    return Timer(make, getattr(fn, "context", contextlib.nullcontext))


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return (
        ordered[middle]
        if len(ordered) % 2
        else (ordered[middle - 1] + ordered[middle]) / 2
    )


def _kernel_times(fn, calls, before_each=None):
    """{kernel name: GPU milliseconds per call} of calls calls of fn under the
    CUDA profiler, before_each() (if given) launched before each call."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the profiler's own set-up
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(calls):
                if before_each is not None:
                    before_each()
                fn()
            torch.cuda.synchronize()
    return {
        e.key: e.self_device_time_total / calls / 1e3
        for e in profile.key_averages()
        if e.self_device_time_total > 0
    }


def _profiled_ms(fn, flush, calls):
    """GPU milliseconds per call of fn from the CUDA profiler's kernel times.
    The L2 flush before each call is a bitwise NOT, a kernel no provider runs,
    so that its time can be left out by name."""
    times = _kernel_times(fn, calls, before_each=flush.bitwise_not_)
    return sum(ms for name, ms in times.items() if "bitwise_not" not in name)


def kernel_ms(fn, calls=20):
    """{kernel name: GPU milliseconds per call of fn}, from the CUDA profiler,
    after one call outside it: where a call's time goes, kernel by kernel."""
    fn()
    torch.cuda.synchronize()
    return _kernel_times(fn, calls)


def gpu_ms(fn, flush, replays):
    """(median GPU milliseconds of fn over replays, method): the call captured
    in a CUDA graph and replayed after an L2 flush, events around each replay;
    the profiler's kernel times where fn cannot be captured. Runs on the
    current stream, which must not be the default one (time_once sees to it)."""
    stream = torch.cuda.current_stream()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            fn()
    except RuntimeError:  # a call that synchronizes, say, cannot be captured
        torch.cuda.synchronize()
        return _profiled_ms(fn, flush, replays), "profiler"
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(replays)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return _median([start.elapsed_time(end) for start, end in events]), "CUDA graph"


def captured(fn, *inputs):
    """fn(*inputs) recorded in a CUDA graph: (replay, its output). A replay reads
    whatever the recorded inputs hold then, and overwrites the output."""
    fn(*inputs)  # compiled before the recording
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    return graph.replay, out


def back_to_back_ms(fn, calls):
    """Wall milliseconds per call of fn, calls enqueued in a row, no sync."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def wall_ms(fn):
    """Under the interpreter: the fastest of three wall-clock runs (other
    processes on a shared CPU only ever add time)."""
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def time_once(timer, flush=None):
    """{"b2b": ms, "gpu": ms or None, "gpu_method": ...} for one Timer, once.

    On a GPU everything runs on a stream of its own: a CUDA graph cannot be
    captured on the default stream, and autograd runs a backward on the
    stream that ran its forward, so make() must run there too."""
    if not ON_GPU:
        with timer.context():
            return {"b2b": wall_ms(timer.make()), "gpu": None, "gpu_method": None}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), timer.context():
        fn = timer.make()
        calls = warm_up(fn)
        per_call_s = WARM_UP_S / max(1, calls)
        repeats = max(5, min(1000, int(TIMED_S / per_call_s)))
        gpu, method = gpu_ms(fn, flush, min(repeats, 100))
        b2b = back_to_back_ms(fn, repeats)
    torch.cuda.current_stream().wait_stream(stream)
    return {"b2b": b2b, "gpu": gpu, "gpu_method": method}


class Measured:
    """The timings of one provider in one case, over the passes."""

    def __init__(self):
        self.b2b, self.gpu, self.gpu_method = [], [], None

    def add(self, timing):
        for name in ("b2b", "gpu"):
            ms = timing[name]
            if ms is not None and not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"a {name} timing of {ms} ms: not a positive number")
        self.b2b.append(timing["b2b"])
        if timing["gpu"] is not None:
            self.gpu.append(timing["gpu"])
            self.gpu_method = timing["gpu_method"]

    @staticmethod
    def _spread(ms):
        """How far the two fastest timings differ, as a fraction of the fastest:
        one disturbed timing among settled ones does not count."""
        fastest = sorted(ms)[:2]
        return fastest[1] / fastest[0] - 1 if len(fastest) == 2 else 0.0

    def spread(self):
        """The larger spread of the two times (back to back, GPU)."""
        return max(self._spread(self.b2b), self._spread(self.gpu))

    def unsettled(self):
        return len(self.b2b) < MAX_PASSES and self.spread() > SPREAD_LIMIT

    def row(self, work):
        """Row fields for a rate of `work` per millisecond: value (back to
        back, from the fastest timing) and, on a GPU, gpu_value (GPU time),
        each with its spread (a range where it passed SPREAD_LIMIT)."""
        fields = {"value": work / min(self.b2b), "spread": self._spread(self.b2b)}
        if self.gpu:
            fields.update(
                gpu_value=work / min(self.gpu),
                gpu_spread=self._spread(self.gpu),
                gpu_method=self.gpu_method,
            )
        return fields


def error_summary(error, width=160):
    """One line saying why a call failed: the last line of the message that names an
    exception (a compiler's message wraps the real one, at its end), else the first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    line = (named or lines or [type(error).__name__])[-1 if named else 0]
    return line if len(line) <= width else line[: width - 1] + "…"


def measure(timing_cases):
    """{(case, key): Measured} over what timing_cases() yields, each
    (case, label, {key: Timer}), in passes over all cases (alternating order).

    A key whose timings spread past SPREAD_LIMIT is timed again in further
    passes, up to MAX_PASSES; a key failing with RuntimeError in a case is
    reported and left out of that case. timing_cases() is called once per pass,
    so a case's inputs live only while it is timed."""
    measured, failed = {}, set()
    flush = (
        torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=DEVICE)
        if ON_GPU
        else None
    )

    def one_pass(reverse, wanted):
        for case, label, timers in timing_cases():
            keys = list(timers)[::-1] if reverse else list(timers)
            for key in keys:
                if (case, key) in failed or not wanted(measured.get((case, key))):
                    continue
                try:
                    timing = time_once(timers[key], flush)
                except RuntimeError as error:  # a backend that cannot run this case
                    print(f"{key} skipped at {label}: {error_summary(error)}")
                    failed.add((case, key))
                    measured.pop((case, key), None)
                    continue
                measured.setdefault((case, key), Measured()).add(timing)

    for p in range(PASSES):
        one_pass(p % 2 == 1, lambda m: True)
    while any(m.unsettled() for m in measured.values()):
        one_pass(False, lambda m: m is not None and m.unsettled())
    return measured


def time_calls(calls, label="this case"):
    """{name: Measured} for {name: Timer} of one case (named label where a call
    fails), timed as measure() does."""
    found = measure(lambda: iter([(None, label, calls)]))
    return {key: m for (_, key), m in found.items()}


def case_benchmark(cases, timers, work):
    """Rates of every provider in each case of cases (dicts of case columns, all
    with the same keys): timers(case) gives {provider: Timer}, timed as
    time_calls does (a case's inputs live only while it is timed), and work(case)
    is one call's work per millisecond of the rate's unit. Returns (results, by
    GPU time, back to back): the rows as a DataFrame and their rate_tables, a
    column per provider, indexed by the case columns."""
    import pandas as pd

    rows = [
        dict(case, provider=name, **m.row(work(case)))
        for case in cases
        for name, m in time_calls(
            timers(case), ", ".join(f"{k} = {v}" for k, v in case.items())
        ).items()
    ]
    results = pd.DataFrame(rows)
    return (results, *rate_tables(results, list(cases[0])))


def cases_that_fit(cases, bytes_of, share=0.8):
    """The cases whose bytes_of(case) fit in share of the GPU's free memory (all
    without a GPU), printing those left out: a smaller GPU runs a smaller grid."""
    budget = share * torch.cuda.mem_get_info()[0] if ON_GPU else math.inf
    fits = [case for case in cases if bytes_of(case) < budget]
    if len(fits) < len(cases):
        left_out = [", ".join(f"{k} = {v}" for k, v in c.items()) for c in cases
                    if c not in fits]  # fmt: skip
        print(f"Left out, past {budget / 2**30:.0f} GiB of free memory: "
              + "; ".join(left_out))  # fmt: skip
    return fits


def size_benchmark(sizes, timers, work):
    """case_benchmark over the sizes N of sizes: timers(N) and work(N)."""
    return case_benchmark(
        [{"N": n} for n in sizes], lambda c: timers(c["N"]), lambda c: work(c["N"])
    )


def shown_rate(value, slowest=None):
    """A rate as a page shows it: three significant digits under the
    interpreter, whole numbers on a GPU, a range where timings spread."""

    def fmt(v):
        return f"{v:.3g}" if not ON_GPU or v < 100 else f"{v:.0f}"

    if slowest is not None and value > (1 + SPREAD_LIMIT) * slowest:
        return f"{fmt(slowest)}–{fmt(value)}"
    return fmt(value)


# -- Ceilings ----------------------------------------------------------------


def same_bytes_copy(like):
    """fn(src): src, a tensor like `like`, copied into a buffer of its own by an SM
    kernel (PyTorch's elementwise multiply by one), the copy that SAME_BYTES and the
    copy ceilings time. Not copy_: that is a cudaMemcpy, which a CUDA graph replays as
    a memcpy node, timed on an H200 at 2.7 TB/s from 512 MB against 4.2 TB/s for the
    multiply (engineering notes, 2026-11-27)."""
    return functools.partial(torch.mul, other=1, out=torch.empty_like(like))


def copy_gbs(src):
    """GB/s (bytes read + written) of copying src into a tensor like it,
    by GPU time (back to back under the interpreter)."""
    m = time_calls({"copy": call_timer(same_bytes_copy(src), src)})["copy"]
    ms = min(m.gpu) if m.gpu else min(m.b2b)
    return 2 * src.numel() * src.element_size() / ms * 1e-6


def copy_bandwidth_gbs():
    """Device copy bandwidth on a buffer far larger than the caches."""
    n = (256 << 20) if ON_GPU else (8 << 20)
    return copy_gbs(torch.randn(n // 4, device=DEVICE))


MATMUL_CEILING = (
    "torch.matmul, 8192 x 8192 fp16"
    if ON_GPU
    else "torch.matmul, 256 x 256 fp32 on the CPU"
)


def matmul_tflops():
    """The device's fp16 matrix-multiply rate, by GPU time, after a second of
    multiplies: the clocks that a GPU keeps under load, which the benchmarks'
    kernels, run one after another, meet too."""
    n = 8192 if ON_GPU else 256
    dtype = torch.float16 if ON_GPU else torch.float32
    a, b = (torch.randn(n, n, device=DEVICE, dtype=dtype) for _ in range(2))
    if ON_GPU:
        warm_up(lambda: a @ b, seconds=1.0)
    m = time_calls({"matmul": call_timer(torch.matmul, a, b)})["matmul"]
    ms = min(m.gpu) if m.gpu else min(m.b2b)
    return 2 * n**3 / ms * 1e-9


def ceiling_line(peak):
    """The line a page prints under its matmul ceiling peak (TFLOP/s, from
    matmul_tflops): what it is, and why pages differ in it."""
    line = f"Ceiling, {MATMUL_CEILING}, measured now: {peak:.3g} TFLOP/s"
    if not ON_GPU:
        return line
    return (
        line + ". It is measured once per page, after a second of multiplies; the "
        "clocks move it by several percent from page to page, so compare fractions "
        "of it within a page."
    )


# -- Plot style ----------------------------------------------------------------

# One colour and marker per provider on every page.
STYLE = {
    "copy of the same bytes": ("#7f7f7f", "."),
    "torch.softmax": ("#1f77b4", "s"),
    "torch.add": ("#1f77b4", "s"),
    "torch.compile": ("#2ca02c", "^"),
    "naive PyTorch": ("#bcbd22", "v"),
    "cuBLAS (torch.matmul)": ("#1f77b4", "s"),
    "SDPA cuDNN": ("#1f77b4", "s"),
    "SDPA flash": ("#2ca02c", "^"),
    "SDPA mem-efficient": ("#bcbd22", "v"),
    "SDPA math": ("#7f7f7f", "v"),
    "FlexAttention": ("#17becf", "h"),
}
OURS_COLORS = ["#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def style(name, ours=()):
    """(colour, marker) of a provider: a peer's from STYLE, ours (Triton's and
    Gluon's) in the order the lesson lists them."""
    if name in STYLE:
        return STYLE[name]
    if name in ours:
        return OURS_COLORS[list(ours).index(name) % len(OURS_COLORS)], "o"
    return "#17becf", "."


def plot_style():
    """Figure text sized for a page column about 710 px wide (8 in at 100 dpi)."""
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.titlesize": 11,
            "legend.fontsize": 10,
            "xtick.labelsize": 10,
            "ytick.labelsize": 10,
        }
    )


def line_style(name, ours=()):
    """matplotlib keywords for a provider's curve: its colour and marker (style),
    the copy of the same bytes dotted, ours drawn above the peers with hollow
    markers, each of ours narrower than the one before it and above it: curves
    that meet (ours on a peer's, or two of ours running one kernel) all show."""
    color, marker = style(name, ours)
    if name not in ours:
        dotted = ":" if name == "copy of the same bytes" else "-"  # a reference
        return dict(color=color, marker=marker, markersize=6, linestyle=dotted,
                    linewidth=1.5, zorder=2)  # fmt: skip
    rank = list(ours).index(name)
    return dict(
        color=color,
        linestyle="-",
        marker=marker,
        markersize=max(5, 12 - 4 * rank),
        markerfacecolor="none",
        markeredgewidth=1.5,
        linewidth=max(1.0, 2.5 - rank),
        zorder=3 + rank,
    )


def label_sizes(ax, sizes, rotation=0, closest=0.75):
    """Ticks at every size of a log2 x axis, labelled where a label fits: powers of
    two first, then other sizes at least `closest` octaves from every label (12288
    between 8192 and 16384 keeps its tick, not its label)."""
    sizes = sorted(set(sizes))
    octaves = {n: math.log2(n) for n in sizes}
    shown = [n for n in sizes if octaves[n].is_integer()]
    for n in sizes:
        if all(abs(octaves[n] - octaves[m]) >= closest for m in shown):
            shown.append(n)
    ax.set_xticks(sizes, [str(n) if n in shown else "" for n in sizes])
    ax.tick_params(axis="x", labelrotation=rotation)
    ax.minorticks_off()


def plot_rates(table, ceiling, ceiling_label, ylabel, title, ours=(), log_y=False):
    """One figure: each provider (a column of table) against the table's index
    on a log2 axis, ours drawn above the peers (line_style), the ceiling dashed,
    the legend below the axes (inside, it would hide the ceiling or the curves
    near it). log_y: a log rate axis, for rates that span decades."""
    import matplotlib.pyplot as plt

    plot_style()
    fig, ax = plt.subplots(figsize=(8, 4.4))
    for name in table.columns:
        ax.plot(table.index, table[name], label=name, **line_style(name, ours))
    ax.axhline(ceiling, color="black", linestyle="--", label=ceiling_label, zorder=1)
    ax.set_xscale("log", base=2)
    label_sizes(ax, table.index)
    ax.set(title=title, xlabel=table.index.name, ylabel=ylabel)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, None)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def back_to_back_gaps(results, limit=SPREAD_LIMIT):
    """The rows of a benchmark whose back-to-back rate differs from their rate
    by GPU time by more than limit, with that ratio as "b2b_ratio" (none under
    the interpreter, which has no GPU time): where calls made in a row go at
    another pace than the GPU's, the host's launches, say."""
    if "gpu_value" not in results:
        return results.iloc[:0].assign(b2b_ratio=[])
    ratio = results["value"] / results["gpu_value"]
    return results.assign(b2b_ratio=ratio)[(ratio - 1).abs() > limit]


# -- Input handling ----------------------------------------------------------


def int32_columns(t):
    """t, or a contiguous copy where a column offset (index times column
    stride) would pass 2**31: kernels add 32-bit column offsets."""
    return t.contiguous() if (t.shape[1] - 1) * t.stride(1) >= 2**31 else t


def resolved(*tensors):
    """The tensors with lazy negation or conjugation applied: a kernel reads
    memory, not those flags."""
    return tuple(t.resolve_neg().resolve_conj() for t in tensors)


def check_device(name, t):
    if t.device.type != DEVICE.type:
        raise ValueError(
            f"{name} is on device '{t.device}', but Triton runs these "
            f"kernels on '{DEVICE.type}' here"
        )


def check_tensor(name, t, dims, like, like_name="q"):
    """A tensor of dims dimensions on the device of like (called like_name)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got {tuple(t.shape)}")
    check_device(name, t)
    if t.device != like.device:
        raise ValueError(
            f"{name} must be on {like_name}'s device {like.device}, not {t.device}"
        )


def check_index(name, t, like, shape, like_name="q"):
    """An int32 or int64 tensor of shape (None: any size but 0) on like's device."""
    check_tensor(name, t, len(shape), like, like_name)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if 0 in t.shape or any(n not in (None, m) for n, m in zip(shape, t.shape)):
        shown = ", ".join("any" if n is None else str(n) for n in shape)
        raise ValueError(f"{name} must have shape ({shown}), got {tuple(t.shape)}")


MAX_BLOCK = 2**20  # the most elements Triton allows in one block


def check_block(name, value, largest=MAX_BLOCK):
    """Refuse, by name, a block size that is not a power of two from 1 to largest."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (a power of two), got {value!r}")
    if not 1 <= value <= largest or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, 1 to {largest}, got {value}")


def check_warps(value):
    """Refuse a warp count Triton cannot launch (a power of two up to 32)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_warps must be an int, got {value!r}")
    if value not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two, 1 to 32, got {value}")


# -- Exercise checks -----------------------------------------------------------

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def fresh_generator():
    """A CPU generator seeded afresh: every check draws new inputs."""
    generator = torch.Generator()
    generator.seed()
    return generator


def expect_close(exercise, case, what, got, expected, dtype, rtol, atol):
    """AssertionError naming the exercise, the case and what differs, where got
    is not a tensor of expected's shape and dtype, or where an element is not within
    atol + rtol * |expected| of expected: it names the first such element, its value,
    the float64 reference's and how far off it is (NaN is wrong)."""
    if (
        not isinstance(got, torch.Tensor)
        or got.shape != expected.shape
        or got.dtype != dtype
    ):
        shown = (
            f"{tuple(got.shape)} {got.dtype}"
            if isinstance(got, torch.Tensor)
            else type(got).__name__
        )
        raise AssertionError(
            f"{exercise} on {case}: {what} should be a "
            f"{tuple(expected.shape)} {dtype} tensor, got {shown}"
        )
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    wrong = ~torch.isclose(got, expected, rtol=rtol, atol=atol)
    if wrong.any():
        index = tuple(wrong.nonzero()[0].tolist())
        g, e = got[index].item(), expected[index].item()
        at = index[0] if len(index) == 1 else index
        raise AssertionError(
            f"{exercise} on {case}: {what}: element {at} is {g:.6g}, the float64 "
            f"reference {e:.6g}: off by {abs(g - e):.3g} (allowed {atol:.3g} + "
            f"{rtol:.3g} x |reference|); {int(wrong.sum())} of {wrong.numel()} "
            "elements are wrong"
        )


def expect_elementwise(exercise, case, got, expected, dtype):
    """expect_close with TOLERANCE[dtype] relative and a hundredth of it absolute."""
    tol = TOLERANCE[dtype]
    expect_close(exercise, case, "the output", got, expected, dtype, tol, tol / 100)


def expect_unchanged(exercise, case, name, before, after):
    if not torch.equal(before, after):
        raise AssertionError(
            f"{exercise} on {case}: the function changed its input "
            f"{name}; it must leave it as it was"
        )


def check_deepest_rings(exercise, depths, name, keys, shared_of, limit):
    """An exercise's check that depths, {key: stages} for exactly keys (values of
    name), are the deepest rings that fit limit bytes of shared memory, an H100
    program's: shared_of([(key, stages), ...]) gives each compiled ring's bytes.
    TypeError or ValueError for what is no answer; AssertionError, saying which, for
    a ring that does not fit, or one that leaves room for a deeper one."""
    if not isinstance(depths, dict) or sorted(depths) != sorted(keys):
        shape = ", ".join(f"{key}: stages" for key in keys)
        raise TypeError(f"depths must be a dict {{{shape}}}, got {depths!r}")
    for key, stages in depths.items():
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(
                f"depths[{key}] must be a whole number of stages, 1 or more, got "
                f"{stages!r}"
            )
    shared = iter(shared_of([
        (key, stages + deeper) for key, stages in depths.items() for deeper in (0, 1)
    ]))
    for (key, stages), fits, deeper in zip(depths.items(), shared, shared):
        if fits > limit:
            raise AssertionError(
                f"{exercise}: {name} = {key}, STAGES = {stages} needs {fits:,} bytes "
                f"of shared memory, more than an H100 gives a program ({limit:,})"
            )
        if deeper <= limit:
            raise AssertionError(
                f"{exercise}: {name} = {key}: STAGES = {stages} fits, and so does a "
                "deeper ring"
            )


def check_elementwise(exercise, fn, reference, strides=(1,)):
    """Check fn(*inputs) against reference(*inputs in float64), element by element
    (expect_elementwise), on fresh random 1-D inputs, one per entry of strides (a
    view of that stride, at an offset), at irregular lengths in every dtype of
    TOLERANCE; fn must leave its inputs as they were. Prints a line if it passes."""
    generator, count = fresh_generator(), 0
    for dtype, n in itertools.product(TOLERANCE, (1, 17, 1000, 4099)):
        case, inputs = f"n = {n}, {str(dtype)[6:]}", []
        for step in strides:
            base = torch.randn(3 + n * step, generator=generator).to(DEVICE, dtype)
            inputs.append(base[3::step])
        before = [t.clone() for t in inputs]
        got = fn(*inputs)
        for name, old, new in zip("xyzuvw", before, inputs):  # fn(x, y, ...)
            expect_unchanged(exercise, case, name, old, new)
        expected = reference(*(t.double() for t in inputs))
        expect_elementwise(exercise, case, got, expected, dtype)
        count += 1
    print(
        f"{exercise} passed on {count} fresh inputs (lengths 1 to 4099, strides "
        f"{', '.join(map(str, strides))}; fp32, fp16, bf16)."
    )


def copy_fraction(fn, x):
    """fn(x)'s speed by GPU time as a fraction of copying x, for an fn that reads x
    once and writes as many bytes; None without a GPU."""
    if not ON_GPU:
        return None
    calls = {"fn": call_timer(fn, x), "copy": call_timer(torch.empty_like(x).copy_, x)}
    ms = {name: min(m.gpu) for name, m in time_calls(calls).items()}
    return ms["copy"] / ms["fn"]


# -- Row-wise kernels (the softmax lessons): benchmark, plot, inputs -----------

SAME_BYTES = "copy of the same bytes"  # a provider: x copied into a tensor like it


def compiled_for(fn, x):
    """torch.compile(fn), compiled now for x's shape alone, outside any timing.
    Dynamo's caches are reset first: a benchmark over many shapes would
    otherwise reach its recompile limit and fall back to eager PyTorch."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=False)
    compiled(x)
    return compiled


def bandwidth_benchmark(M, sizes, dtypes, providers):
    """GB/s of each provider of providers(x), {name: fn}, timing fn(x) on x of
    M x N random values, at every dtype and row length N in sizes; GB/s counts
    x's bytes twice, read once and written once. Each case is timed on its own
    (time_calls): a peer compiled for its shape lives only while it is timed.

    Returns (results, gpu, b2b): the rows as a DataFrame, and two tables of
    rates, index (dtype, N) and a column per provider, by GPU time and back to
    back (under the interpreter, both back to back)."""
    dtype_of = {str(dtype)[6:]: dtype for dtype in dtypes}

    def timers(case):
        x = torch.randn(M, case["N"], device=DEVICE, dtype=dtype_of[case["dtype"]])
        return {name: call_timer(fn, x) for name, fn in providers(x).items()}

    def work(case):  # GB per ms: GB/s
        return 2 * M * case["N"] * dtype_of[case["dtype"]].itemsize * 1e-6

    cases = [{"dtype": name, "N": N} for name in dtype_of for N in sizes]
    return case_benchmark(cases, timers, work)


def reference_dips(table, copy_gbs, ours, name, limit=SPREAD_LIMIT):
    """A sentence: the cases (dtype, N; N ascending) of table (GB/s) where the copy of
    the same tensor runs more than limit below copy_gbs, the large-buffer copy, with
    ours' (called name) fraction of copy_gbs; apart, its dips: more than limit slower
    than at a shorter row."""
    copy, share = table[SAME_BYTES], table[ours] / copy_gbs
    low = copy < (1 - limit) * copy_gbs
    if not low.any():
        return f"That copy is nowhere more than {limit:.0%} below the large-buffer one."
    fastest = copy.groupby(level="dtype", sort=False).cummax()
    shorter = fastest.groupby(level="dtype", sort=False).shift()  # at shorter rows
    dip = low & (copy < (1 - limit) * shorter)
    line = (
        f"That copy runs more than {limit:.0%} below the large-buffer one at "
        f"{name_cases(copy[low].index)}"
    )
    if (low & ~dip).any():
        there = share[low & ~dip]
        line += (
            f"; {name} reaches {there.min():.0%} to {there.max():.0%} of the "
            "large-buffer copy there" + (" (the dips apart)" if dip.any() else "")
        )
    for key in dip[dip].index:
        line += (
            f". At {key[0]}, N = {key[1]} it ran at {copy[key] / shorter[key]:.0%} "
            f"of its speed at a shorter row: the reference itself dipped, so {name}'s "
            f"{table[ours][key] / copy[key]:.0%} of it is {share[key]:.0%} of "
            "the large-buffer copy"
        )
    return line + "."


def plot_bandwidth(table, ceiling, title, ours=()):
    """One panel per dtype of a table of GB/s (index (dtype, N), a column per
    provider): each provider against N in its colour, the copy of the same
    bytes dotted, the device's copy bandwidth (ceiling) dashed behind them."""
    import matplotlib.pyplot as plt

    plot_style()
    dtypes = list(dict.fromkeys(table.index.get_level_values("dtype")))
    fig, axes = plt.subplots(
        1, len(dtypes), figsize=(8, 4.8), sharey=True, squeeze=False
    )
    for ax, dtype in zip(axes[0], dtypes):
        part = table.xs(dtype, level="dtype")
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, zorder=1)
        for name in part.columns:
            ax.plot(part.index, part[name], label=name, **line_style(name, ours))
        ax.set_xscale("log", base=2)
        label_sizes(ax, part.index, rotation=45)
        ax.set(title=dtype, xlabel="N (row length)", ylim=(0, None))
    axes[0, 0].set_ylabel("GB/s")
    axes[0, 0].plot([], [], "k--", linewidth=1, label="copy bandwidth (large buffer)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.05 + 0.045 * ((len(labels) + 2) // 3), 1, 1))
    return fig


def irregular_rows(scale):
    """Fresh inputs for an exercise check: (case, leaf, view) for every dtype of
    TOLERANCE and irregular shape, the input being view(leaf): the leaf itself,
    a column slice or a transposed view, of random values times scale. Row 0 of
    the input is shifted up by 100, past e^x's range in fp32 and fp16, so that
    a softmax must subtract the row's maximum."""
    generator = fresh_generator()
    shapes = [(1, 1), (1, 300), (7, 1), (5, 257), (37, 100)]
    cases = [(f"{M}x{N}", (M, N), lambda t: t) for M, N in shapes]
    cases += [
        ("13x200 column slice", (13, 300), lambda t: t[:, 7:207]),
        ("90x11 transposed view", (11, 90), lambda t: t.t()),
    ]
    for dtype in TOLERANCE:
        for name, shape, view in cases:
            leaf = (torch.randn(shape, generator=generator) * scale).to(DEVICE, dtype)
            view(leaf)[0] += 100
            yield f"{name} {str(dtype)[6:]}", leaf, view


# -- Attention: inputs, reference, checks ------------------------------------

ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)
# The kernels take sm_scale * log2(e) in fp32: past fp32's range it is infinite.
MAX_SM_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)


def fp8_supported():
    """fp8 matrix multiplies need compute capability 8.9 or newer."""
    return ON_GPU and torch.cuda.get_device_capability() >= (8, 9)


def head_span(t):
    """Elements between the first and last element of one head of a (B, H, N,
    D) tensor: the kernels add 64-bit offsets for batch and head, 32-bit ones
    inside a head."""
    _, _, n, d = t.shape
    _, _, row_stride, column_stride = t.stride()
    return (n - 1) * abs(row_stride) + (d - 1) * abs(column_stride)


def resolved_gradient(do):
    """dO as a backward kernel can read it: a negative view resolved, a head
    too wide for 32-bit offsets copied."""
    do = do.resolve_neg()
    return do.contiguous() if head_span(do) >= 2**31 else do


def check_sm_scale(sm_scale):
    """sm_scale as a float, or a clear error: a finite real number that the kernels'
    fp32 scores can hold."""
    real = isinstance(sm_scale, numbers.Real) and not (
        isinstance(sm_scale, bool) or type(sm_scale).__name__ == "bool_"
    )
    try:
        finite = real and math.isfinite(sm_scale)
    except OverflowError:  # a Python int past float's range
        finite = True
    if not finite:
        raise TypeError(f"sm_scale must be a finite real number, got {sm_scale!r}")
    if not abs(sm_scale) <= MAX_SM_SCALE:
        raise ValueError(
            f"sm_scale must be at most {MAX_SM_SCALE:.3g} in magnitude "
            f"(the kernels scale the scores in fp32), got {sm_scale!r}"
        )
    return float(sm_scale)


def check_attention_inputs(q, k, v, causal, sm_scale, fp8=False):
    """Raise a clear error for anything the attention kernels cannot handle;
    fp8: float8_e5m2 is accepted, forward only."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, heads, sequence, "
                f"head_dim), got shape {tuple(t.shape)}"
            )
        check_device(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if fp8 and q.dtype == torch.float8_e5m2:
        if not fp8_supported():
            raise TypeError(
                "float8_e5m2 attention needs a GPU with fp8 tensor cores "
                "(compute capability 8.9+)"
            )
        if any(t.requires_grad for t in (q, k, v)):
            raise TypeError(
                "float8_e5m2 attention is forward-only: its inputs must "
                "not require grad"
            )
        if q.shape[-1] < 32:
            raise ValueError(
                "float8_e5m2 attention needs head dim 32 or more (an "
                "8-bit tensor-core product sums at least 32 values at a "
                f"time), got {q.shape[-1]}"
            )
    elif q.dtype not in ATTENTION_DTYPES:
        also = " (or float8_e5m2 forward on fp8 GPUs)" if fp8 else ""
        raise TypeError(f"q, k and v must be float16 or bfloat16{also}, got {q.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must have the same shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on the same device, got {q.device}, "
            f"{k.device}, {v.device}"
        )
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if q.numel() == 0:
        raise ValueError(f"q, k and v must not be empty, got shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if (span := head_span(t)) >= 2**31:
            raise ValueError(
                f"{name}'s rows of one head span {span} elements, more "
                "than these kernels address with 32-bit offsets (2**31): "
                "split the sequence, or make the head's rows contiguous"
            )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    check_sm_scale(sm_scale)


def reference_attention(q, k, v, causal, sm_scale):
    """The definition, in the inputs' precision (float64 for a reference)."""
    s = (q @ k.transpose(-1, -2)) * sm_scale
    if causal:
        n = q.shape[2]
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(above, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def check_against_float64(
    attention_fn, q, k, v, causal, sm_scale, label, tolerance=1e-2, backward=True
):
    """Errors of o, dq, dk, dv (o alone without backward) relative to the
    largest float64 reference value (at least 1), on a fresh random dO;
    AssertionError naming label and the tensor when one is off or not finite
    (``error < tolerance`` is false for NaN)."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out = attention_fn(q, k, v, causal, sm_scale)
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, causal, sm_scale)
    compared = [("o", out, ref)]
    if backward:
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        grads64 = torch.autograd.grad(ref, (q64, k64, v64), do.double())
        compared += list(zip(("dq", "dk", "dv"), grads, grads64))
    errors = {}
    for name, got, want in compared:
        scale = want.abs().max().clamp(min=1.0)
        errors[name] = ((got.double() - want).abs().max() / scale).item()
        if not (torch.isfinite(got).all() and errors[name] < tolerance):
            bad = (~torch.isfinite(got)).sum().item()
            raise AssertionError(
                f"{label}: {name} is off, error {errors[name]:.2e} "
                f"relative to the largest value (tolerance "
                f"{tolerance:.0e}; non-finite values: {bad})"
            )
    return errors


def forward_and_backward(attention_fn, q, k, v, causal, sm_scale):
    """What check_against_float64 launches, unchecked: to compile it ahead."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention_fn(q, k, v, causal, sm_scale)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def check_attention_cases(attention_fn, label, head_dims=(64, 128)):
    """check_against_float64 of attention_fn on fresh (2, 3, N, D) inputs at every
    head dim of head_dims, dtype of ATTENTION_DTYPES and masking, at a length no
    block size divides (1,000 on a GPU), all compiled ahead first; prints each
    case's errors (the Hopper lessons' checks)."""
    N, cases = (1000 if ON_GPU else 65), {}
    for D, dtype, causal in itertools.product(
        head_dims, ATTENTION_DTYPES, (False, True)
    ):
        cases[D, dtype, causal] = [
            torch.randn(2, 3, N, D, device=DEVICE, dtype=dtype) for _ in range(3)
        ]
    compile_ahead(
        lambda: [
            forward_and_backward(attention_fn, *qkv, causal, D**-0.5)
            for (D, _, causal), qkv in cases.items()
        ]
    )
    for (D, dtype, causal), (q, k, v) in cases.items():
        case = f"{label}, D={D}, {dtype}, causal={causal}"
        tolerance = 1e-2 if dtype == torch.float16 else 3e-2
        errors = check_against_float64(
            attention_fn, q, k, v, causal, D**-0.5, case, tolerance=tolerance
        )
        shown = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        print(f"{case}, N={N}: {shown}")


# -- Attention: launching and compiling ahead ----------------------------------


class _CompileOnly:
    """Whether compile_ahead is running: launch() then only compiles."""

    active = False


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs); while compile_ahead runs, only compiles
    the kernel, on one of Triton's worker threads, and runs nothing."""
    if _CompileOnly.active:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def compiling_ahead():
    """Whether compile_ahead is running: a launch then returns no results to keep."""
    return _CompileOnly.active


def compile_ahead(calls):
    """(kernels, seconds): calls() run with launch() compiling on a pool of
    threads instead of launching; (0, 0.0) without a GPU or without Triton's
    AsyncCompileMode (internal in Triton 3.6 and 3.9). Triton otherwise
    compiles each new specialization one at a time, on one core."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return 0, 0.0
    if not ON_GPU:
        return 0, 0.0
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        mode = AsyncCompileMode(pool, ignore_errors=True)
        _CompileOnly.active = True
        try:
            with mode:  # leaving it waits for every compilation
                calls()
                kernels = len(mode.raw_futures)
        finally:
            _CompileOnly.active = False
    return kernels, time.perf_counter() - start


# -- Attention: peers and the benchmark -----------------------------------------

FLEX = "FlexAttention"
# torch.compile compiles FlexAttention once per shape (dynamic=False, as PyTorch's
# own FlexAttention benchmark does) and by default keeps 8 shapes of a function;
# past its limit it would run flex_attention eagerly, scores materialized. A
# benchmark's shapes (2 head dims x causal or not x 5 lengths) fit under this one.
FLEX_RECOMPILE_LIMIT = 64


def flex_attention_missing():
    """Why this PyTorch cannot time FlexAttention, or None where it can."""
    try:
        import torch._dynamo
        import torch.nn.attention.flex_attention  # noqa: F401
        from torch._dynamo.exc import FailOnRecompileLimitHit  # noqa: F401
    except ImportError as error:
        return f"PyTorch {torch.__version__} cannot import it ({error})"
    if not hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        return (
            f"PyTorch {torch.__version__} has no fail_on_recompile_limit_hit, "
            "without which FlexAttention could fall back to eager unnoticed"
        )
    return None


def _causal_mask(batch, head, q_idx, kv_idx):
    """FlexAttention's mask_mod of causal attention: a query sees the keys up to
    its own position."""
    return q_idx >= kv_idx


@functools.cache
def _causal_block_mask(q_len, kv_len, device):
    """The causal BlockMask for these lengths on device, built the first time a
    case calls for it (outside any timing) and kept: B and H None, so one mask
    serves every batch and head. FlexAttention skips the blocks it marks empty."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal_mask, None, None, q_len, kv_len, device=device)


@functools.cache
def compiled_flex_attention():
    """torch.compile(flex_attention), made once: one graph or an error
    (fullgraph), compiled for each shape (dynamic=False)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


@contextlib.contextmanager
def flex_settings():
    """FlexAttention's context, outside the timed region: room under
    torch.compile's recompile limit for a benchmark's shapes, an error past it
    (not a silent eager fallback), and no donated buffers, which a backward
    replayed with retain_graph=True (backward_timer) does not allow."""
    import torch._dynamo
    import torch._functorch.config

    with (
        torch._dynamo.config.patch(
            recompile_limit=FLEX_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True
        ),
        torch._functorch.config.patch(donated_buffer=False),
    ):
        yield


def _flex_provider(causal, scale, compiled):
    """FlexAttention as fn(q, k, v): compiled, PyTorch's generated Triton kernel,
    or eager (fn.compiled says which), which materializes the scores. Causal
    through a block mask, non-causal with none. Where this PyTorch cannot time
    it, fn raises RuntimeError and fn.missing says why."""
    missing = flex_attention_missing()
    if missing is not None:

        def unavailable(q, k, v):
            raise RuntimeError(f"{FLEX}: {missing}")

        unavailable.missing = missing
        return unavailable
    from torch._dynamo.exc import FailOnRecompileLimitHit
    from torch.nn.attention.flex_attention import flex_attention

    attend = compiled_flex_attention() if compiled else flex_attention

    def flex(q, k, v):
        mask = (
            _causal_block_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
        )
        try:
            return attend(q, k, v, block_mask=mask, scale=scale)
        except FailOnRecompileLimitHit as error:  # measure() reports a RuntimeError
            raise RuntimeError(
                f"{FLEX}: torch.compile reached its recompile limit; past it "
                "FlexAttention would run eagerly (enter fn.context() around the "
                f"calls for room for {FLEX_RECOMPILE_LIMIT} shapes)"
            ) from error

    flex.context, flex.compiled = flex_settings, compiled
    return flex


def sdpa_providers(causal, scale, backends):
    """{name: fn(q, k, v)} for each named peer, called as users call it: an SDPA
    backend ("SDPA cuDNN", "SDPA flash", "SDPA mem-efficient", "SDPA math") or FLEX
    (FlexAttention: compiled on a GPU; eager on the CPU, where no page times it
    and tests check its plumbing). fn.context, entered outside the timed region,
    selects the SDPA backend, or holds FlexAttention's settings (flex_settings)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    ids = {
        "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION,
        "SDPA flash": SDPBackend.FLASH_ATTENTION,
        "SDPA mem-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "SDPA math": SDPBackend.MATH,
    }
    if isinstance(backends, str):
        raise TypeError(
            f"backends must be a list of names, got the string {backends!r}"
        )
    for name in backends:
        if name not in (*ids, FLEX):
            raise ValueError(f"unknown peer {name!r}: one of {', '.join((*ids, FLEX))}")
    providers = {}
    for name in backends:
        if name == FLEX:
            providers[name] = _flex_provider(causal, scale, compiled=ON_GPU)
            continue
        fn = functools.partial(
            scaled_dot_product_attention, is_causal=causal, scale=scale
        )
        fn.context = functools.partial(sdpa_kernel, ids[name])
        providers[name] = fn
    return providers


# The math backend materializes the N x N scores: a peer only on the CPU.
SDPA_PEERS = (
    ("SDPA cuDNN", "SDPA flash", "SDPA mem-efficient") if ON_GPU else ("SDPA math",)
)
# The strongest SDPA backends, and with them the peers that the FlashAttention-2 and
# Hopper lessons race: FlexAttention too, on a GPU. Its compiles, one per shape, took
# 42 s of lesson 06's build and 61 s of lesson 07's on an H200 (engineering notes).
FAST_SDPA = ("SDPA cuDNN", "SDPA flash") if ON_GPU else ("SDPA math",)
FAST_PEERS = (*FAST_SDPA, FLEX) if ON_GPU else FAST_SDPA


def attention_flops(B, H, N, D, causal, mode):
    """Forward: two matrix products, 4BHN^2D, half when causal; backward 2.5x."""
    return (
        4
        * B
        * H
        * N
        * N
        * D
        * (0.5 if causal else 1.0)
        * (2.5 if mode == "bwd" else 1.0)
    )


def attention_benchmark(cases, sizes, providers, modes, extra_providers=None):
    """Rows of TFLOP/s: every provider of providers(causal, D) in each mode, at
    every case (B, H, D), causal or not, and size, and any {(provider, mode):
    Timer} that extra_providers(q, k, v, causal, D) adds. Everything is compiled
    ahead first, then timed in passes (measure). A provider with a `missing`
    reason (FlexAttention where PyTorch cannot time it) is left out, and the
    reason printed once. The compile pass also compiles FlexAttention, one graph
    per shape, and prints how much of the pass that took."""
    left_out, flex_seconds = {}, 0.0

    def each_case():
        for (B, H, D), causal, N in itertools.product(cases, (False, True), sizes):
            q, k, v = (
                torch.randn(
                    B, H, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True
                )
                for _ in range(3)
            )
            timers = {}
            for name, fn in providers(causal, D).items():
                if getattr(fn, "missing", None):
                    left_out[name] = fn.missing
                    continue
                for mode in modes:
                    timers[name, mode] = (
                        call_timer(fn, q, k, v)
                        if mode == "fwd"
                        else backward_timer(fn, q, k, v)
                    )
            if extra_providers is not None:
                timers.update(extra_providers(q, k, v, causal, D))
            yield (B, H, D, causal, N), f"D={D}, N={N}, causal={causal}", timers
            del q, k, v, timers

    def call_each_once():
        nonlocal flex_seconds
        for _, _, timers in each_case():
            for key, timer in timers.items():
                start = time.perf_counter()
                try:
                    with timer.context():
                        timer.make()()
                except RuntimeError:  # a backend that cannot run this case
                    pass
                if key[0] == FLEX:
                    flex_seconds += time.perf_counter() - start

    kernels, seconds = compile_ahead(call_each_once)
    if kernels and round(seconds, 1) > 0:  # not where Triton's cache held them all
        print(
            f"Compiled ahead: {kernels} kernels on "
            f"{len(os.sched_getaffinity(0))} threads in {seconds:.1f} s"
        )
    if round(flex_seconds, 1) > 0:
        print(f"{FLEX}'s torch.compile: {flex_seconds:.1f} s of the pass")
    rows = []
    for ((B, H, D, causal, N), (name, mode)), m in measure(each_case).items():
        work = attention_flops(B, H, N, D, causal, mode) * 1e-9  # TFLOP per ms
        rows.append(
            dict(D=D, causal=causal, N=N, mode=mode, provider=name, **m.row(work))
        )
    for name, reason in left_out.items():
        print(f"{name} left out: {reason}")
    return rows


def plot_attention(table, mode, peak, title, ours=()):
    """One figure for one mode: a panel per (head dim, masking), every provider
    against N, and the matmul ceiling dashed."""
    import matplotlib.pyplot as plt

    part = table.xs(mode, level="mode")
    keys = list(dict.fromkeys(part.index.droplevel("N")))
    rows = (len(keys) + 1) // 2
    fig, axes = plt.subplots(
        rows, 2, figsize=(8, 3.3 * rows + 0.6), sharex=True, squeeze=False
    )
    for ax, (D, causal) in zip(axes.flat, keys):
        panel = part.xs((D, causal), level=["D", "causal"]).dropna(axis=1, how="all")
        for name in panel.columns:
            color, marker = style(name, ours)
            ax.plot(
                panel.index,
                panel[name],
                color=color,
                marker=marker,
                label=name,
                zorder=3 if name in ours else 2,
            )  # ours on top where lines meet
        ax.axhline(peak, color="black", linestyle="--", zorder=0, label="matmul rate")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(panel.index), [str(n) for n in panel.index], fontsize=10)
        ax.minorticks_off()
        ax.set_title(f"D = {D}, {'causal' if causal else 'non-causal'}", fontsize=11)
        ax.set_ylim(0, max(peak, panel.max().max()) * 1.08)  # fp8 can pass fp16's
    for ax in axes[-1]:
        ax.set_xlabel("N (sequence length)")
    for ax in axes[:, 0]:
        ax.set_ylabel("TFLOP/s")
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.suptitle(title, fontsize=11)
    legend_rows = (len(labels) + 1) // 2
    fig.tight_layout(rect=(0, (0.05 + 0.04 * legend_rows) * 2 / (rows + 1), 1, 1))
    return fig


def rates_table(results, index, unit, value="gpu_value"):
    """The benchmark's rows as a wide table, one column per provider, the unit
    named once in the corner; ranges where timings spread past SPREAD_LIMIT."""
    column = value if value in results else "value"
    spread = "gpu_spread" if column == "gpu_value" else "spread"

    def shown(row):
        rate = row[column]
        return shown_rate(rate, rate / (1 + row[spread]))

    frame = results.assign(shown=results.apply(shown, axis=1))
    table = frame.pivot_table(
        index=index, columns="provider", values="shown", aggfunc="first", sort=False
    )
    table.columns.name = unit
    return table.fillna("")


def rate_tables(results, index):
    """(by GPU time, back to back): the benchmark's rates as two tables of
    numbers, one column per provider; both the back-to-back one where there is
    no GPU time (under the interpreter)."""

    def pivot(column):
        return results.pivot_table(
            index=list(index), columns="provider", values=column, sort=False
        )

    b2b = pivot("value")
    return (pivot("gpu_value") if "gpu_value" in results else b2b), b2b


def back_to_back_note(gpu, b2b, ours, peers):
    """A clause for a conclusion read by GPU time (gpu: rates of some cases, a
    column per provider), where back to back (b2b: the same cases) tells
    otherwise: ours slower than by GPU time past SPREAD_LIMIT, or its ratio to the
    fastest peer moved past it. "" where neither. It names no cause: these rates
    alone cannot tell one (lesson 13 sets host time beside them)."""
    if gpu is b2b:
        return ""
    slower = gpu[ours] / b2b[ours]
    by_gpu = gpu[ours] / gpu[list(peers)].max(axis=1)
    ratio = b2b[ours] / b2b[list(peers)].max(axis=1)
    paced = slower > 1 + SPREAD_LIMIT
    moved = (ratio / by_gpu - 1).abs() > SPREAD_LIMIT
    if not (paced | moved).any():
        return ""
    note = f"; back to back {ratio.min():.2f}x to {ratio.max():.2f}x"
    if paced.any():
        lengths = ", ".join(str(n) for n in paced[paced].index.get_level_values("N"))
        note += (
            f", at N = {lengths} up to {slower.max():.1f}x slower than by GPU "
            "time"
        )
    return note


def back_to_back_line(provider, case, ratio):
    """A sentence on provider's rate back to back in case (text, "n = 2048"), ratio
    times its rate by GPU time, and what can make it differ: faster, the L2 cache
    that GPU time flushes before each call; slower, what GPU time leaves out between
    calls. No host time is measured with it, so it names the host only as a
    possibility."""
    said = f"Back to back, {provider} at {case} runs at {ratio:.2f}x its GPU-time rate"
    if ratio > 1:
        return (
            said + ": faster, since calls in a row can find their inputs still in the "
            "L2 cache, which GPU time flushes before each call."
        )
    return (
        said + ": slower, since GPU time leaves out what happens between calls, "
        "the host's launches among it (lesson 13 measures them)."
    )


def same_kernel_gain(ratio, results, ours, same_from):
    """A sentence on ratio (ours[0]'s rate over ours[1]'s, by dtype and N) below
    same_from, where the two differ: the noise floor is their largest gap from
    same_from on, where both run the same kernel; sizes where either timing shows as
    a range (past SPREAD_LIMIT) are named apart and count as neither."""
    column = "gpu_spread" if "gpu_spread" in results else "spread"
    spread = results.pivot_table(
        index=["dtype", "N"], columns="provider", values=column, sort=False
    )
    ranged = (spread.loc[ratio.index, list(ours)] > SPREAD_LIMIT).any(axis=1)
    short = ratio.index.get_level_values("N") < same_from
    settled = ratio[short & ~ranged]

    def at(r, key):
        return f"{r[key]:.2f}x (at {key[0]}, N = {key[1]})"

    shown = settled if len(settled) else ratio[short]
    line = (
        f"below {same_from} columns, {ours[0]} runs at {at(shown, shown.idxmin())} to "
        f"{at(shown, shown.idxmax())} the speed of {ours[1]}."
    )
    same = (ratio[~short] - 1).abs()
    floor = same.max() if len(same) else 0.0
    if len(same):
        line += (
            f" From {same_from} on, where both run the same kernel, they differ by up "
            f"to {floor:.1%} (at {same.idxmax()[0]}, N = {same.idxmax()[1]}): the "
            f"noise floor. Counting only gaps wider than that floor, {ours[0]} is"
        )
    else:
        line += f" No size reaches {same_from} here to set a noise floor; {ours[0]} is"
    faster, slower = (settled > 1 + floor).sum(), (settled < 1 - floor).sum()
    line += (
        f" faster at {faster} and slower at {slower} of {len(settled)} sizes with "
        "settled timings"
    )
    wide = ratio[short & ranged]
    if wide.empty:
        return line + "."
    named = ", ".join(f"{d}, N = {n} ({r:.2f}x)" for (d, n), r in wide.items())
    return line + f"; timings spread past {SPREAD_LIMIT:.0%} at {named}."


def name_cases(index):
    """The cases of index as words: "N = 1, 2" for one level; for more, the last
    level within the others ("float32, N = 1, 2; bfloat16, N = 4")."""
    groups = {}
    for key in index:
        key = key if isinstance(key, tuple) else (key,)
        groups.setdefault(key[:-1], []).append(str(key[-1]))
    last = index.names[-1]
    return "; ".join(
        ", ".join([*map(str, outer), f"{last} = {', '.join(sizes)}"])
        for outer, sizes in groups.items()
    )


def loop_verdict(gpu, b2b, ours, peers, limit=SPREAD_LIMIT):
    """A sentence: where back to back (b2b: rates, a column per provider) ours runs
    more than limit slower than the fastest of peers, and further behind it than by
    GPU time (gpu: the same cases), by how much and why. "" under the interpreter,
    where the two tables are one."""
    if gpu is b2b:
        return ""
    peer = peers[0] if len(peers) == 1 else f"the fastest of {', '.join(peers)}"
    in_loop = b2b[ours] / b2b[list(peers)].max(axis=1)
    by_gpu = gpu[ours] / gpu[list(peers)].max(axis=1)
    behind = (in_loop < 1 - limit) & (in_loop < (1 - limit) * by_gpu)
    said = f"Back to back, as a loop calls them, {ours} runs at"
    if not behind.any():
        return (
            f"{said} {in_loop.min():.2f}x to {in_loop.max():.2f}x {peer}: at each "
            f"size within {limit:.0%} of it or of its ratio to it by GPU time."
        )
    loop, gpu_there = in_loop[behind], by_gpu[behind]
    return (
        f"{said} {loop.min():.2f}x to {loop.max():.2f}x {peer} at "
        f"{name_cases(loop.index)}, where by GPU time it runs at "
        f"{gpu_there.min():.2f}x to {gpu_there.max():.2f}x: the difference lies "
        "between the kernels, in each call's cost on the host, which for ours is "
        "a Python launcher and Triton's launch (lesson 13 measures it)."
    )


def below_one(ratio):
    """"0.998x", not "1.00x", for a ratio just under 1 (not counted at or above 1)."""
    digits = 2
    while float(f"{ratio:.{digits}f}") >= 1 > ratio and digits < 6:
        digits += 1
    return f"{ratio:.{digits}f}x"


def standing(choice, rates, spreads):
    """"fastest", "tie" or "slower": choice among rates ({provider: rate}, higher is
    faster), a tie where it and the fastest are no further apart than the larger of
    their timings' spreads ({provider: fraction})."""
    best = max(rates, key=rates.get)
    tied = [name for name, rate in rates.items()
            if rates[best] / rate - 1 <= max(spreads[name], spreads[best])]
    return "slower" if choice not in tied else "fastest" if tied == [choice] else "tie"


def b2b_overview(gpu, b2b, name=None):
    """One sentence over every timing: each call's back-to-back time over its GPU
    time (from the rates gpu and b2b, a column per provider, an "N" level in the
    index), the measure back_to_back_line uses, naming the calls more than
    SPREAD_LIMIT longer back to back by name(key) (key: the index, provider last),
    or by their lengths. "" where there is no GPU time. Faster back to back (the L2
    cache kept warm between calls) is never counted."""
    if gpu is b2b:
        return ""
    ratio = (gpu / b2b).stack().dropna()  # back-to-back time over GPU time
    line = (
        f"Back to back, a call takes {ratio.min():.2f}x to {ratio.max():.2f}x its "
        f"GPU time (median {ratio.median():.2f}x)"
    )
    over = ratio[ratio > 1 + SPREAD_LIMIT]
    if over.empty:
        return f"{line}; none takes more than {SPREAD_LIMIT:.0%} longer."
    if name is None:
        lengths = sorted(set(over.index.get_level_values("N")))
        where = f"at N = {', '.join(map(str, lengths))}"
    else:
        named = (f"{name(key)} ({r - 1:.1%} longer)" for key, r in over.items())
        where = ", ".join(named)
    return (
        f"{line}; {len(over)} of {len(ratio)} take more than {SPREAD_LIMIT:.0%} "
        f"longer: {where}."
    )


def peer_lines(table, b2b, peak, ours, peers, versus=None, name="ours"):
    """{(D, causal, mode): a line}: ours (a column of table, TFLOP/s by GPU time;
    shown as name) against the fastest of peers, its best fraction of the ceiling
    peak, against versus where that ran, and back_to_back_note from b2b (the
    same cases, back to back)."""
    lines = {}
    for (D, causal, mode), part in table.groupby(
        level=["D", "causal", "mode"], sort=False
    ):
        ratio = part[ours] / part[list(peers)].max(axis=1)
        line = (
            f"D={D:<3d} {'causal    ' if causal else 'non-causal'} {mode}: {name} is "
            f"{ratio.min():.2f}x to {ratio.max():.2f}x the fastest PyTorch peer, "
            f"up to {part[ours].max() / peak:.0%} of the matmul rate"
        )
        if versus is not None and versus in part:
            other = part[ours] / part[versus]
            line += f"; {other.min():.1f}x to {other.max():.1f}x {versus}"
        note = back_to_back_note(part, b2b.loc[part.index], ours, peers)
        lines[D, causal, mode] = line + note
    return lines


def spread_summary(results):
    """One sentence: how far one provider's timings of one case spread (the spread:
    how far apart its two fastest timings were)."""
    column = "gpu_spread" if "gpu_spread" in results else "spread"

    def where(row):  # the provider and every case column the rows have
        case = [f"{k}={row[k]}" for k in ("D", "causal", "dtype", "mode") if k in row]
        return ", ".join([row["provider"], *case, f"N={row['N']}"])

    worst = results.loc[results[column].idxmax()]
    worst_b2b = results.loc[results["spread"].idxmax()]
    ranged = (results[column] > SPREAD_LIMIT).sum()
    by = "GPU time" if column == "gpu_spread" else "wall clock"
    line = (
        f"Each provider was timed in {PASSES} or more passes over all cases; a case's "
        f"spread is how far its two fastest timings differ. By {by} the "
        f"median spread is {results[column].median():.1%}, the largest "
        f"{worst[column]:.0%} ({where(worst)})"
    )
    if column == "gpu_spread":
        line += (
            f"; back to back the largest is {worst_b2b['spread']:.0%} "
            f"({where(worst_b2b)})"
        )
    also = (
        f" ({(results['spread'] > SPREAD_LIMIT).sum()} back to back)"
        if column == "gpu_spread"
        else ""
    )
    return line + (
        f". {ranged} of {len(results)} timings by {by}{also} spread past "
        f"{SPREAD_LIMIT:.0%} after {MAX_PASSES} passes and show as ranges, in either "
        "table. Differences smaller than the spread are noise; larger ones can be "
        "too, as the clocks drift between passes."
    )


# -- Attention: the Hopper lessons' benchmark and verdicts -------------------
# Lessons 11 and 14 race their Gluon kernels against lessons 06 and 07's portable
# ones and the fastest peers, and read which path their `attention` takes by default.

GLUON_WS = "Triton, warp-specialized (Gluon)"
PORTABLE_V2 = "Triton v2 (lessons 06, 07)"
def capturing():
    """Whether the current CUDA stream is being captured into a CUDA graph: a call
    made now runs later, replayed, with no host in its way."""
    return ON_GPU and torch.cuda.is_current_stream_capturing()


def path_key(case, captured=None):
    """A key of the Hopper lessons' path tables for the tuned case `case` (None where
    there is none): the case and whether the call is captured (None: this one)."""
    return case and (*case, capturing() if captured is None else captured)


# -- Attention: a call settled once per layout -------------------------------
# Lessons 11 and 14's `attention` checks its inputs and picks its kernels from what it
# reads of their layout and its flags, and a model calls it with one layout step after
# step, on fresh tensors: what follows from the layout is worked out once and kept
# (lesson 13 measures what each step saves).

SETTLED = {}  # settled_key of a call -> its Settled


class Settled:
    """What settled_paths keeps of a layout: the paths chosen for it, whether its
    inputs are plain tensors (keyed by settled_key), and the call plans of its
    forward (call_plan) that calls have left: plans[keep_lse], without LSE_2 for
    calls that need no gradient."""

    __slots__ = ("paths", "plain", "plans")

    def __init__(self, paths, plain=False):
        self.paths, self.plain, self.plans = paths, plain, [None, None]


def settled_key(q, k, v, *arguments):
    """What the checks, the paths and a call plan read of a call: the current GPU,
    each tensor's device, shape, strides, dtype and offset from 16-byte alignment,
    each argument with its type (True == 1 in a key). None where a call takes the
    long way: off a GPU, a tensor subclass or negated view."""
    if not (ON_GPU and type(q) is type(k) is type(v) is torch.Tensor) or (
        q.is_neg() or k.is_neg() or v.is_neg()
    ):
        return None
    return (
        torch.cuda.current_device(), q.get_device(), k.get_device(), v.get_device(),
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
        q.dtype, k.dtype, v.dtype,
        q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
        tuple(map(type, arguments)), arguments,
    )  # fmt: skip


def settled_paths(choose, q, k, v, causal, sm_scale, *flags):
    """The Settled of choose(q, k, v, causal, sm_scale, *flags), run after the
    checks once per settled_key (a call being captured apart, and each choose
    apart: lessons 11 and 14 keep different paths); later calls read SETTLED."""
    key = settled_key(q, k, v, choose, causal, sm_scale, capturing(), *flags)
    try:
        settled = SETTLED.get(key)
    except TypeError:  # an unhashable argument: the checks will name it
        key = settled = None
    if settled is None:
        check_attention_inputs(q, k, v, causal, sm_scale)
        paths = choose(*resolved(q, k, v), causal, sm_scale, *flags)
        settled = Settled(paths, plain=key is not None)
        if key is not None:
            if len(SETTLED) >= 1024:  # lengths that keep changing: start afresh
                SETTLED.clear()
            SETTLED[key] = settled
    return settled


def planned_forward(settled, forward, q, k, v, causal, sm_scale, ws, keep_lse=True):
    """forward(q, k, v, causal, sm_scale, ws, keep_lse=keep_lse)'s O and LSE_2,
    through settled's call plan, which the first such call leaves (planned=True)."""
    plan = settled.plans[keep_lse]
    if plan is not None:
        return plan(q, k, v)
    o, lse, settled.plans[keep_lse] = forward(q, k, v, causal, sm_scale, ws,
                                              planned=True, keep_lse=keep_lse)
    return o, lse


def settled_call(settled, function, forward, ws, q, k, v, causal, sm_scale, *more):
    """The call that settled_paths settled: function.apply(q, k, v, causal, sm_scale,
    ws, settled, *more) where a gradient is needed, else planned_forward alone,
    which keeps no LSE_2. Written out: on the path of every call."""
    if not settled.plain:
        q, k, v = resolved(q, k, v)
    if (q.requires_grad or k.requires_grad or v.requires_grad) and (
        torch.is_grad_enabled()
    ):
        return function.apply(q, k, v, causal, float(sm_scale), ws, settled, *more)
    plan = settled.plans[False]
    if plan is not None:
        return plan(q, k, v)[0]
    return planned_forward(settled, forward, q, k, v, causal, float(sm_scale), ws,
                           keep_lse=False)[0]


def call_plan(launch, outputs, qk_scale):
    """An attention forward's whole call on fresh inputs of one layout, or None
    without a launch plan (lesson 06): new outputs laid out as `outputs` (the first
    call's O and LSE_2, contiguous; LSE_2 None: the kernel stores none), then
    launch(q, k, v, O, LSE_2 or O in its place, qk_scale). All the rest followed
    from the layout and was worked out once."""
    o, lse = outputs
    if launch is None or not all(t is None or t.is_contiguous() for t in outputs):
        return None
    # empty_like of a view with zero strides allocates a contiguous tensor of its
    # shape, with no sizes to read from Python: a few microseconds a call less.
    o_like = o.new_empty(1).expand(o.shape)
    lse_like = None if lse is None else lse.new_empty(1).expand(lse.shape)

    def call(q, k, v):
        o = torch.empty_like(o_like)
        if lse_like is None:  # the kernel stores no LSE_2: O fills its slot
            launch(q, k, v, o, o, qk_scale)
            return o, None
        lse = torch.empty_like(lse_like)
        launch(q, k, v, o, lse, qk_scale)
        return o, lse

    return call


def is_descriptor(argument):
    """Whether a launch argument is a TMA descriptor (Triton's or Gluon's)."""
    return hasattr(argument, "block_shape") and isinstance(argument.base, torch.Tensor)


def undescribed(arguments):
    """Launch arguments with each TMA descriptor replaced by the tensor it describes,
    as a bound launcher takes them."""
    return [a.base if is_descriptor(a) else a for a in arguments]


def hooks_set(hooks=triton.knobs.runtime):
    """Whether a profiler listens to Triton's launches: an enter or exit hook set, a
    function or a HookChain (Triton's default, never None) that holds one."""
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def bound_launcher(compiled, grid, first, rest):
    """A function of a launch's fresh arguments that launches compiled (a Triton
    CompiledKernel) on grid with rest after them (constexprs too, by position), on
    the current device, which a launch plan's key fixes. first: the first call's
    fresh arguments; where one was a TMA descriptor, later calls pass the tensor it
    describes (laid out as that one), and the rest of the descriptor is worked out
    once. Triton's own launcher, compiled[grid], looks up the device, the stream and
    its profiling hooks on every call; this one only the stream and the hooks."""
    import dataclasses

    # Undocumented Triton internals, as in 3.6 and 3.9: compiled[grid] calls
    # compiled.run so (tests/test_settled_calls.py checks the bits on a GPU).
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    grid, device = (*grid, 1, 1)[:3], torch.cuda.current_device()
    stream = triton.runtime.driver.active.get_current_stream
    redescribe = [is_descriptor(a) and a for a in first]

    def described(fresh):
        return [dataclasses.replace(d, base=t) if d else t
                for d, t in zip(redescribe, fresh)]  # fmt: skip

    def through_triton(*fresh):
        if hooks_set():
            compiled[grid](*described(fresh), *rest)
        else:  # without the launch metadata that only the hooks read
            run(*grid, stream(device), function, metadata, None, None, None,
                *described(fresh), *rest)  # fmt: skip

    bound = _c_launch(compiled, first)
    if bound is None:
        return through_triton
    c_launch, after, layouts = bound
    n, encode = len(layouts), triton.runtime.driver.active.utils.fill_tma_descriptor
    # A descriptor is a function of its address once the layout is fixed, and encoding
    # one costs a driver call (about 1.5 us): each keeps the last addresses it saw.
    # PyTorch's caching allocator hands a loop's fresh tensors the same few blocks.
    encoded_at = [{} for _ in layouts]

    def descriptor(t, fixed, seen):
        address = t.data_ptr()
        d = seen.get(address)
        if d is None:
            if len(seen) >= 64:  # bounded: addresses that never recur are let go
                seen.clear()
            d = seen[address] = encode(address, *fixed)
        return d

    def launch(*fresh):
        if hooks_set():  # Triton's launcher calls the profiler's hooks
            through_triton(*fresh)
        else:  # the n descriptors lead the fresh arguments: their tensors, encoded
            encoded = [x for t, (fixed, tail), seen in zip(fresh, layouts, encoded_at)
                       for x in (descriptor(t, fixed, seen), *tail)]  # fmt: skip
            c_launch(*grid, stream(device), *after, *encoded, *fresh[n:], *rest)

    return launch


def _c_launch(compiled, first):
    """(c_launch, after, layouts) to launch compiled as Triton 3.6's launcher does,
    through the C function it ends in: c_launch(*grid, stream, *after, *arguments),
    each TMA descriptor among them encoded by fill_tma_descriptor(address, *fixed)
    then *tail, for (fixed, tail) in layouts (those of the descriptors leading
    `first`, a launch's fresh arguments). None where Triton's launcher is laid out
    otherwise (other versions), or the kernel needs scratch memory."""
    from triton.backends.nvidia import driver as cuda
    # The launcher of Triton 3.6 (read in its source; tests/test_settled_calls.py
    # checks the bits on a GPU), which wraps its C function in one that encodes each
    # descriptor (make_tensordesc_arg) when the kernel takes any.
    if getattr(cuda, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO":
        return None
    run = compiled.run
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    c_launch, layouts = run.launch, []
    n = sum(map(is_descriptor, first))
    if n:
        metas = getattr(compiled.metadata, "tensordesc_meta", None) or ()
        cells = getattr(c_launch, "__closure__", None) or ()
        names = getattr(c_launch, "__code__", None)
        cells = dict(zip(names.co_freevars, cells)) if names else {}
        if ("launcher" not in cells or len(metas) != n
                or not all(map(is_descriptor, first[:n]))
                or any(m.get("fp4_padded") for m in metas)):  # fmt: skip
            return None
        c_launch = cells["launcher"].cell_contents
        for d, m in zip(first, metas):
            element = cuda.TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]]
            fixed = (m["swizzle"], m["elem_size"], element, m["block_size"],
                     d.shape, d.strides, 1 if d.padding == "nan" else 0)  # fmt: skip
            layouts.append((fixed, (*d.shape, *d.strides)))
    # After the grid and the stream: no scratch memory, no launch metadata, no hooks.
    after = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
             compiled.packed_metadata, None, None, None)  # fmt: skip
    return c_launch, after, layouts


DEFAULT_PATH = "Triton, default path"
ATTENTION_INDEX = ["D", "causal", "mode", "N"]
TIMED_BY = "by GPU time" if ON_GPU else "by the interpreter's wall-clock time"


def portable_and_peers(portable):
    """providers(causal, D) for attention_benchmark: portable(q, k, v, causal, scale)
    as PORTABLE_V2 and FAST_PEERS, the Hopper lessons' baselines."""

    def providers(causal, D):
        scale = D**-0.5
        return {
            PORTABLE_V2: lambda q, k, v: portable(q, k, v, causal, scale),
            **sdpa_providers(causal, scale, FAST_PEERS),
        }

    return providers


def hopper_benchmark(cases, sizes, providers, mode, extra_providers, title, ours):
    """attention_benchmark of one mode, plotted by GPU time: (results, peak)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    peak = matmul_tflops()
    print(ceiling_line(peak))
    results = pd.DataFrame(
        attention_benchmark(cases, sizes, providers, (mode,), extra_providers)
    )
    table = rate_tables(results, ATTENTION_INDEX)[0]
    table = table.drop(columns=DEFAULT_PATH, errors="ignore")  # one of ours, again
    plot_attention(table, mode, peak, f"{title}, {TIMED_BY}", ours)
    plt.show()
    return results, peak


def against_portable(results, peak, portable_name):
    """One line per (D, causal): Gluon (else the portable kernel) against the peers;
    returns the peers that ran."""
    gpu, b2b = rate_tables(results, ATTENTION_INDEX)
    column = "gpu_spread" if "gpu_spread" in results else "spread"
    spreads = results.pivot_table(
        index=ATTENTION_INDEX, columns="provider", values=column
    )
    peers = [c for c in FAST_PEERS if c in gpu]
    ours = GLUON_WS if GLUON_WS in gpu else PORTABLE_V2
    for (D, causal), part in gpu.groupby(level=["D", "causal"], sort=False):
        ratio = part[ours] / part[peers].max(axis=1)
        line = (
            f"D={D:<3d} {'causal    ' if causal else 'non-causal'}: "
            f"{'Gluon' if ours == GLUON_WS else portable_name} is {ratio.min():.2f}x "
            f"to {below_one(ratio.max())} the fastest PyTorch peer"
        )
        if ours == GLUON_WS:
            portable = part[GLUON_WS] / part[PORTABLE_V2]
            margin = spreads.loc[part.index, [GLUON_WS, PORTABLE_V2]].max(axis=1)
            line += (
                f" and {portable.min():.2f}x to {portable.max():.2f}x "
                f"{portable_name} (faster past the timings' spread at "
                f"{(portable > 1 + margin).sum()} of {len(portable)} sizes), up to "
                f"{part[GLUON_WS].max() / peak:.0%} of the matmul rate"
            )
        print(line + back_to_back_note(part, b2b.loc[part.index], ours, peers))
    return peers


def default_path(results, provider_of, peers, paths, short):
    """The default path's table: per case where DEFAULT_PATH ran (the lesson's
    ``attention`` as a user calls it, timed like any provider), the paths of table
    `paths` that it takes, provider_of(D, causal, N, captured) for a call made
    eagerly and one captured in a CUDA graph (short: {provider: its short name});
    its rate over the fastest peer's by GPU time and back to back; and its standing
    back to back among the other paths it could have taken. A line counts both."""
    import pandas as pd

    gpu, b2b = rate_tables(results, ATTENTION_INDEX)
    column = "gpu_spread" if "gpu_spread" in results else "spread"
    spreads = {
        name: results.pivot_table(
            index=ATTENTION_INDEX, columns="provider", values=value
        )
        for name, value in (("b2b", "spread"), ("gpu", column))
    }
    timed = DEFAULT_PATH in b2b
    ran = [case for case in gpu.index if timed and b2b.loc[case, DEFAULT_PATH] > 0]
    ours = [c for c in short if c in gpu]

    def pick(case, captured):
        return provider_of(case[0], case[1], case[3], captured)

    def stood(case):
        rates = b2b.loc[case, ours].dropna().drop(pick(case, False), errors="ignore")
        rates = {**rates.to_dict(), DEFAULT_PATH: b2b.loc[case, DEFAULT_PATH]}
        return standing(DEFAULT_PATH, rates, spreads["b2b"].loc[case].to_dict())

    def replayed_its_pick(case):
        """Whether its GPU time is its captured pick's within their spreads."""
        chosen, spread = pick(case, True), spreads["gpu"].loc[case]
        if chosen not in gpu:
            return False
        apart = abs(gpu.loc[case, DEFAULT_PATH] / gpu.loc[case, chosen] - 1)
        return apart <= max(spread[DEFAULT_PATH], spread[chosen], SPREAD_LIMIT)

    index = pd.MultiIndex.from_tuples(ran, names=ATTENTION_INDEX)
    ratio = gpu.loc[ran, DEFAULT_PATH] / gpu.loc[ran, peers].max(axis=1)
    paced = b2b.loc[ran, DEFAULT_PATH] / b2b.loc[ran, peers].max(axis=1)
    clocks = gpu is not b2b  # under the interpreter one clock, wall time
    table = pd.DataFrame(
        {
            "path": [short.get(pick(case, False)) for case in ran],
            "captured": [short.get(pick(case, True)) for case in ran],
            "x fastest peer": ratio.values,
            **({"x peer, back to back": paced.values} if clocks else {}),
            "back to back": [stood(case) for case in ran],
        },
        index,
    )
    standings = table["back to back"]
    slower = [
        f"D={D} {'causal' if c else 'non-causal'} N={N}"
        for (D, c, _, N), s in standings.items()
        if s == "slower"
    ]
    print(
        f"The default path ({paths}'s choice at each case, timed as a user calls "
        f"it; table below) ran at {ratio.min():.2f}x to {below_one(ratio.max())} "
        f"the fastest PyTorch peer {TIMED_BY}, at or above it at {(ratio >= 1).sum()}"
        f" of {len(ratio)} cases. "
        + (
            f"Back to back it ran at {paced.min():.2f}x to {below_one(paced.max())}, "
            f"at or above it at {(paced >= 1).sum()}. Replayed from a CUDA graph, "
            f"its GPU time was its captured pick's within the spread at "
            f"{sum(map(replayed_its_pick, ran))} of {len(ran)} cases. "
            if clocks
            else ""
        )
        + f"Back to back, against the other paths it could take, it was fastest at "
        f"{(standings == 'fastest').sum()}, tied with the fastest within the spread "
        f"at {(standings == 'tie').sum()} and slower past it at {len(slower)}"
        + (f" ({', '.join(slower)})" if slower else "")
        + f" of this run's {len(standings)} cases (every length, head dim and masking)."
    )
    return table.round(2)


# Gluon's reductions (gl.max, gl.sum) do not compile in a process whose Triton was
# imported with its interpreter on: a fresh Python, importing Triton first, does.
_FRESH_PYTHON = """import json, sys
import triton
sys.path.insert(0, sys.argv[1])
import stepkit as kit
fn = getattr(kit.load_lesson(sys.argv[2]), sys.argv[3])
try:
    out = [fn(**config) for config in json.loads(sys.argv[4])]
except Exception as error:
    out = f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"
print(json.dumps(out))"""


def compiled_where_triton_can(fn, lesson, configs):
    """[fn(**config) for config in configs], fn a function of lesson that compiles
    and returns JSON: here where this process's Triton compiles, else in a fresh
    Python with the interpreter off (no GPU needed to compile)."""
    if isinstance(triton.language.standard.max, triton.runtime.JITFunction):
        return [fn(**config) for config in configs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", _FRESH_PYTHON, str(HERE), lesson, fn.__name__]
    run = subprocess.run(
        [*command, json.dumps(configs)], capture_output=True, text=True, env=env
    )
    out = json.loads(run.stdout.splitlines()[-1]) if run.stdout.strip() else None
    if not isinstance(out, list):
        raise RuntimeError(out or f"the compiling Python failed ({run.returncode})")
    return out


# -- Diagrams ------------------------------------------------------------------
# Pictures of the lessons' ideas, drawn with matplotlib on any machine. Diagrams use
# their own neutral palette, apart from the providers' colours of STYLE.


def _attention_grid(ax, n_blocks, focus):
    """Query blocks against key blocks, causal: computed, on the diagonal, skipped;
    the row of query block focus outlined."""
    from matplotlib.patches import Rectangle

    shades = {"below": "#8fa3bf", "diagonal": "#d9c9a3", "skipped": "#f0f0f0"}
    for i in range(n_blocks):
        for j in range(n_blocks):
            kind = "below" if j < i else "diagonal" if j == i else "skipped"
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=shades[kind],
                                   edgecolor="white", linewidth=1.5,
                                   hatch="//" if kind == "diagonal" else None))
    ax.plot([0, n_blocks], [0, n_blocks], color="#444444", linewidth=1)
    ax.add_patch(Rectangle((0, focus), focus + 1, 1, fill=False,
                           edgecolor="#222222", linewidth=2.5))
    ax.annotate("", xy=(focus + 0.9, focus + 0.5), xytext=(0.1, focus + 0.5),
                arrowprops=dict(arrowstyle="->", color="#222222", linewidth=1.5))
    ax.set(xlim=(0, n_blocks), ylim=(n_blocks, 0), aspect="equal",
           xlabel="key block j", ylabel="query block i (one program each)",
           title="Causal attention, in blocks")
    ticks = [x + 0.5 for x in range(n_blocks)]
    ax.set_xticks(ticks, [str(x) for x in range(n_blocks)])
    ax.set_yticks(ticks, [str(x) for x in range(n_blocks)])
    labels = ["computed", "on the diagonal: masked", "skipped (all keys after)"]
    handles = [Rectangle((0, 0), 1, 1, facecolor=shades[k], hatch=h)
               for k, h in (("below", None), ("diagonal", "//"), ("skipped", None))]
    return handles, labels


def _attention_flow(ax, focus):
    """One query block's walk over key blocks 0..focus: S, then P, then the running
    state (m, l, O), rescaled at every step."""
    def box(x, y, text, color):
        ax.text(x, y, text, ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round,pad=0.3", facecolor=color,
                          edgecolor="#666666"))

    def arrow(start, end, label=None):
        ax.annotate("", xy=end, xytext=start,
                    arrowprops=dict(arrowstyle="->", color="#444444"))
        if label:
            ax.text((start[0] + end[0]) / 2, start[1] - 0.28, label, ha="center",
                    va="top", fontsize=8, color="#444444")

    for j in range(focus + 1):
        masked = "\nmasked" if j == focus else ""
        box(j, 2, f"$S = Q_{{{focus}}} K_{{{j}}}^T$", "#e8edf4")
        box(j, 1, f"$P = e^{{S - m'}}${masked}", "#f4efe3")
        box(j, 0, f"$m_{{{j}}}, \\ell_{{{j}}}, O_{{{j}}}$", "#e6e6e6")
        arrow((j, 1.8), (j, 1.2))
        arrow((j, 0.8), (j, 0.2))
        ax.text(j + 0.06, 0.5, f"$+P V_{{{j}}}$", va="center", fontsize=8)
        if j:
            arrow((j - 0.62, 0), (j - 0.38, 0), "rescale")
    box(focus + 1, 0, f"$O_{{{focus}}}$ stored", "#ffffff")
    arrow((focus + 0.38, 0), (focus + 0.62, 0))
    ax.text((focus + 1) / 2, -0.85,
            "each step: $m' = \\max(m, \\max_j S)$, $\\ell' = \\ell\\,e^{m-m'}"
            " + \\sum_j P$,\n$O$ rescaled by $e^{m-m'}$ (and by $\\ell/\\ell'$ if kept "
            "normalized) before $PV_j$ is added", ha="center", va="top", fontsize=9)
    ax.set(xlim=(-0.6, focus + 1.6), ylim=(-1.7, 2.5),
           title=f"Query block {focus} walks the key blocks: S → P → O")
    ax.axis("off")


def draw_attention_blocks(n_blocks=6, focus=3):
    """Attention's query blocks against key blocks with the causal diagonal (left),
    and the S -> P -> O flow of query block focus through its key blocks, the online
    softmax's running state rescaled at every step (right). Returns the figure."""
    import matplotlib.pyplot as plt

    if not 0 <= focus < n_blocks:
        raise ValueError(f"focus must name a query block: 0 to {n_blocks - 1}")
    plot_style()
    fig, (grid, flow) = plt.subplots(
        1, 2, figsize=(8.8, 4.4), gridspec_kw={"width_ratios": [1, 1.7]}
    )
    handles, labels = _attention_grid(grid, n_blocks, focus)
    _attention_flow(flow, focus)
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# Lessons 03 and 04: tiles of a matmul, program order, a row shared by programs.

DIAGRAM = dict(band="#e4e4e4", done="#a9bfd2", now="#35658f", line="#808080")


def _tile_panel(ax, rows, cols, title, band, done, now):
    """One matrix as rows x cols tiles; band, done and now are lists of
    (row, col) tiles shaded light, medium and dark."""
    from matplotlib.patches import Rectangle

    for shade, cells in (("band", band), ("done", done), ("now", now)):
        for r, c in cells:
            ax.add_patch(Rectangle((c, r), 1, 1, color=DIAGRAM[shade], lw=0))
    for x in range(cols + 1):
        ax.plot([x, x], [0, rows], color=DIAGRAM["line"], lw=0.6)
    for y in range(rows + 1):
        ax.plot([0, cols], [y, y], color=DIAGRAM["line"], lw=0.6)
    ax.set(xlim=(-0.2, cols + 0.2), ylim=(rows + 0.2, -0.2), title=title)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_matmul_tiles(tiles_m=4, tiles_n=6, tiles_k=5, tile=(1, 3), step=2):
    """One program's tile of C = AB and the slabs of A and B its K loop walks:
    light, the row of A and column of B it reads; medium, the BLOCK_K steps
    already summed; dark, the step in progress and the tile itself."""
    import matplotlib.pyplot as plt

    plot_style()
    i, j = tile
    widths = [tiles_k, tiles_n, tiles_n]
    fig, axes = plt.subplots(1, 3, figsize=(8.5, 3.0), width_ratios=widths)
    a_row = [(i, k) for k in range(tiles_k)]
    b_col = [(k, j) for k in range(tiles_k)]
    _tile_panel(
        axes[0], tiles_m, tiles_k, "A: row slab, BLOCK_K at a time",
        a_row, a_row[:step], [a_row[step]],
    )  # fmt: skip
    _tile_panel(
        axes[1], tiles_k, tiles_n, "B: column slab",
        b_col, b_col[:step], [b_col[step]],
    )  # fmt: skip
    _tile_panel(axes[2], tiles_m, tiles_n, "C: one program's tile", [], [], [tile])
    axes[0].annotate(
        "", xy=(tiles_k, i - 0.3), xytext=(0, i - 0.3),
        arrowprops=dict(arrowstyle="->", color="black"),
    )  # fmt: skip
    axes[1].annotate(
        "", xy=(j - 0.3, tiles_k), xytext=(j - 0.3, 0),
        arrowprops=dict(arrowstyle="->", color="black"),
    )  # fmt: skip
    fig.text(
        0.5, 0.02,
        f"tile ({i}, {j}) of C sums tl.dot(A slice, B slice) over the K loop: "
        f"step {step + 1} of {tiles_k} in progress (dark), {step} done (medium)",
        ha="center",
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def draw_program_orders(orders, in_flight):
    """Heat maps side by side of {title: order}, order[i, j] the id of the
    program computing tile (i, j) of C; the first in_flight programs, those
    running together, are outlined, with the slabs of A and B they read."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    plot_style()
    fig, axes = plt.subplots(1, len(orders), figsize=(8.5, 4.2), squeeze=False)
    for ax, (title, order) in zip(axes[0], orders.items()):
        order = np.asarray(order)
        image = ax.imshow(order, cmap="Greys_r", vmin=0, vmax=order.size - 1)
        if order.size <= 144:
            for (r, c), p in np.ndenumerate(order):
                shade = "black" if p > order.size / 2 else "white"
                ax.text(c, r, str(p), ha="center", va="center", color=shade)
        running = order < in_flight
        for r, c in zip(*np.nonzero(running)):
            ax.add_patch(
                Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec="#35658f", lw=2)
            )
        slabs = int(running.any(axis=1).sum()), int(running.any(axis=0).sum())
        ax.set_title(  # three short lines: two panels' titles must not meet
            f"{title}\nfirst {in_flight} outlined:\n"
            f"{slabs[0]} slabs of A, {slabs[1]} of B",
            fontsize=10,
        )
        ax.set(xlabel="tile column (slab of B)", ylabel="tile row (slab of A)")
    fig.colorbar(image, ax=list(axes[0]), label="program id", shrink=0.8)
    return fig


def draw_memory_traffic(versions, title):
    """Device-memory traffic of each version of a computation, in units of its input's
    size: a bar per version, a segment per kernel, its reads then its writes, each
    labelled; versions: {version: [(kernel, reads, writes), ...]}."""
    import matplotlib.pyplot as plt

    plot_style()
    fig, ax = plt.subplots(figsize=(8.5, 2.2 + 0.5 * len(versions)))
    shades = {"read": DIAGRAM["done"], "written": DIAGRAM["now"]}
    for y, (version, kernels) in enumerate(versions.items()):
        x = 0.0
        for kernel, *amounts in kernels:
            for (what, shade), amount in zip(shades.items(), amounts):
                if amount:
                    ax.barh(y, amount, left=x, color=shade, edgecolor="white")
                    color = "white" if what == "written" else "black"
                    ax.text(x + amount / 2, y, f"{kernel}\n{what}", ha="center",
                            va="center", fontsize=8, color=color)
                    x += amount
        ax.text(x + 0.1, y, f"{x:g} in all", va="center")
    ax.set_yticks(range(len(versions)), list(versions))
    ax.invert_yaxis()
    ax.set(xlabel="elements moved, in units of the input's size", title=title)
    ax.set_xlim(0, ax.get_xlim()[1] + 1)
    fig.tight_layout()
    return fig


def draw_split_row(splits=4):
    """Schematic of split-row softmax: SPLITS programs share a row, each
    reduces its chunk to (m, d), publishes it and bumps the row's arrival
    counter, waits until the counter reads SPLITS, then combines every pair
    and normalizes its own chunk."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    plot_style()
    fig, ax = plt.subplots(figsize=(8.5, 4.0))
    box = dict(boxstyle="round,pad=0.3", fc=DIAGRAM["band"], ec=DIAGRAM["line"])
    arrow = dict(arrowstyle="->", color="black", lw=1)
    width = 10 / splits
    for s in range(splits):
        x = s * width
        ax.add_patch(
            FancyBboxPatch((x + 0.05, 3.6), width - 0.1, 0.6, boxstyle="square,pad=0",
                           fc=DIAGRAM["done"], ec=DIAGRAM["line"])
        )  # fmt: skip
        mid = x + width / 2
        ax.text(mid, 3.9, f"program {s}\nchunk {s}", ha="center", va="center")
        ax.text(mid, 2.6, f"$(m_{s}, d_{s})$", ha="center", va="center", bbox=box)
        ax.annotate("", xy=(mid, 2.85), xytext=(mid, 3.55), arrowprops=arrow)
        ax.annotate("", xy=(5, 1.45), xytext=(mid, 2.35), arrowprops=arrow)
    ax.text(5, 4.55, "one row of N elements, shared by SPLITS programs", ha="center")
    ax.text(
        5, 1.1, f"arrival counter of the row: +1 per program (release), "
        f"each waits until it reads {splits} (acquire)",
        ha="center", va="center", bbox=dict(box, fc=DIAGRAM["now"]), color="white",
    )  # fmt: skip
    ax.text(
        5, 0.2, "then each program combines all (m, d) pairs into the row's m and d,\n"
        "and normalizes and stores its own chunk",
        ha="center", va="center",
    )  # fmt: skip
    ax.annotate("", xy=(5, 0.45), xytext=(5, 0.8), arrowprops=arrow)
    labels = ["1. reduce own chunk,\npublish (m, d)", "2. arrive, wait", "3. normalize"]
    for y, label in zip((3.1, 1.8, 0.55), labels):
        ax.text(10.3, y, label, va="center", fontsize=9)
    ax.set(xlim=(-0.4, 12), ylim=(-0.2, 4.9))
    ax.axis("off")
    fig.tight_layout()
    return fig


def draw_programs_and_blocks(n, block):
    """The grid of a one-dimensional launch: n elements in blocks of block, one
    program per block, cdiv(n, block) programs; the offsets of the last block past
    n masked (no load, no store). Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    programs = triton.cdiv(n, block) if n > 0 and block > 0 else 0
    slots = programs * block
    if not 0 < slots <= 64:
        raise ValueError(
            f"a picture of a small launch: n and block positive, at most 64 offsets "
            f"in all, got n = {n}, block = {block}"
        )
    plot_style()
    fig, ax = plt.subplots(figsize=(8, 2.4))
    shades = ("#c9d3e0", "#e3dccb")
    for i in range(slots):
        masked = i >= n
        ax.add_patch(Rectangle(
            (i, 0), 1, 1, edgecolor="white", linewidth=1.5, hatch="//" if masked
            else None, facecolor="#eeeeee" if masked else shades[i // block % 2]))
        ax.text(i + 0.5, 0.5, str(i), ha="center", va="center", fontsize=8,
                color="#888888" if masked else "#222222")
    for p in range(programs):
        left, right = p * block + 0.1, (p + 1) * block - 0.1
        ax.plot([left, left, right, right], [1.15, 1.3, 1.3, 1.15], color="#444444")
        ax.text((left + right) / 2, 1.45, f"program {p}", ha="center", va="bottom",
                fontsize=9)
    ax.annotate("masked: offsets >= n,\nno load, no store", xy=(n + (slots - n) / 2,
                0), xytext=(n + (slots - n) / 2, -0.55), ha="center", va="top",
                fontsize=9, arrowprops=dict(arrowstyle="->", color="#444444"))
    ax.text(0, -0.3, f"offsets = pid * {block} + arange(0, {block})",
            va="top", fontsize=9, family="monospace")
    ax.set(xlim=(-0.2, slots + 0.2), ylim=(-1.4, 2.1), aspect="equal",
           title=f"n = {n} elements, BLOCK = {block}: grid = cdiv({n}, {block})"
           f" = {programs} programs")
    ax.axis("off")
    fig.tight_layout()
    return fig


def draw_roles(ring_slot, blocks=4, stages=2, **durations):
    """Lesson 11's roles in one program over `blocks` key blocks, as role_timeline
    (below) schedules them by the ring's rules: the loader's TMA copies, each
    consumer group's products and exponentials. durations: role_timeline's. Returns
    the figure."""
    import matplotlib.pyplot as plt

    plot_style()
    bars = role_timeline(ring_slot, blocks, stages, **durations)
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    colours = {"copy": "#7f7f7f", "product": "#3b7dd8", "exp": "#e4a23c"}
    rows = {"copy": 0.0, "product": 0.17, "exp": -0.17}  # products above exponentials
    for y, (lane, lane_bars) in enumerate(reversed(bars.items())):
        for start, length, label, kind in lane_bars:
            height = 0.6 if kind == "copy" else 0.3
            ax.broken_barh([(start, length)], (y + rows[kind] - height / 2, height),
                           color=colours[kind], edgecolor="white")
            ax.text(start + length / 2, y + rows[kind], label, ha="center",
                    va="center", fontsize=7 if kind == "copy" else 8,
                    color="black" if kind == "exp" else "white")
    ax.set_yticks(range(len(bars)), list(reversed(bars)))
    product = durations.get("product", 1.0)  # a tick and a grid line per product
    end = max(start + length for lane in bars.values() for start, length, *_ in lane)
    ticks = range(math.ceil(end / product) + 1)
    ax.set_xticks([t * product for t in ticks], [str(t) for t in ticks])
    ax.grid(axis="x", color="#dddddd")
    ax.set_axisbelow(True)
    ax.set(ylim=(-0.5, len(bars) - 0.5), xlabel="time (a model, in units of one "
           "product)", title=f"Roles in one program, by the ring's rules: {stages} "
           "buffers each for K and V")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    names = ["TMA copy (K2 →0: K_2 into buffer 0)", "tensor cores (wgmma)",
             "exponentials (ordinary cores)"]
    fig.legend(handles, names, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def draw_ring(ring_slot, blocks=6, stages=2):
    """Lesson 11's ring of K/V buffers: for each key block, its buffer and the parity
    each wait names, from ring_slot(j, stages) -> (buffer, full, empty)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    colors = ["#3b7dd8", "#e4a23c", "#2ca02c"]
    for j in range(blocks):
        buffer, full, empty = ring_slot(j, stages)
        ax.add_patch(plt.Rectangle((j, buffer), 0.92, 0.9, color=colors[buffer % 3]))
        label = f"block {j}\nfull: wait {full}\nempty: wait {empty}"
        ax.text(j + 0.46, buffer + 0.45, label, ha="center", va="center", color="white")
    ax.set(xlim=(0, blocks), ylim=(stages, 0), xticks=[],
           xlabel="key blocks, in the order the loader fills them",
           title=f"A ring of {stages} buffers: the parity each wait names, per use")
    buffers = range(stages)
    ax.set_yticks([b + 0.45 for b in buffers], [f"buffer {b}" for b in buffers])
    fig.tight_layout()
    return fig


def draw_split(keys=128, queries=64, D=128):
    """Lesson 14's split of a query block between two consumer groups: their dK, dV
    accumulators, the shared dS^T, and the dQ tile sent in 32-column boxes."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(8, 3.4),
                             gridspec_kw={"width_ratios": [1, 1, 1.4]})
    colors = ("#3b7dd8", "#e4a23c")
    text = dict(ha="center", va="center", fontsize=10, color="white")
    for g in range(2):
        first, last = g * keys // 2, (g + 1) * keys // 2 - 1
        axes[0].add_patch(plt.Rectangle((0, g * keys / 2), D, keys / 2,
                                        color=colors[g]))
        axes[0].text(D / 2, g * keys / 2 + keys / 4,
                     f"group {g}:\nkeys {first}-{last}\ndK, dV", **text)
        axes[1].add_patch(plt.Rectangle((0, g * keys / 2), queries, keys / 2,
                                        color=colors[g], alpha=0.8))
        axes[1].text(queries / 2, g * keys / 2 + keys / 4,
                     f"$dS^T$ of\ngroup {g}\n(shared)", **text)
        axes[2].add_patch(plt.Rectangle((g * D / 2, 0), D / 2, queries,
                                        color=colors[g]))
        axes[2].text(g * D / 2 + D / 4, queries / 2,
                     f"group {g}:\ncolumns\n{g * D // 2}-{(g + 1) * D // 2 - 1}",
                     zorder=3, bbox=dict(facecolor=colors[g], edgecolor="none", pad=1),
                     **text)
    panels = [("accumulators", D, keys, "head dim", "key"),
              ("$dS^T$ in shared memory", queries, keys, "query", "key"),
              ("dQ tile sent by TMA reduction", D, queries, "head dim", "query")]
    for ax, (title, w, h, xl, yl) in zip(axes, panels):
        ax.set(xlim=(0, w), ylim=(h, 0))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xl, fontsize=10)
        ax.set_ylabel(yl, fontsize=10)
        ax.tick_params(labelsize=10)
    for column in range(32, D, 32):
        axes[2].axvline(column, color="white", linestyle="--", linewidth=1.5)
    fig.suptitle(f"Two consumer groups share a query block (D = {D}, {keys} keys per "
                 f"program, {queries} queries per block)", fontsize=11)
    fig.tight_layout()
    return fig


def draw_decode_layout(lengths=(13, 5, 9), chunk=4, page=4):
    """Left: each sequence's cache in chunks, a program each, those past its length
    skipped. Right: its block table, then the shuffled pool of pages."""
    import matplotlib.pyplot as plt

    plot_style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.8, 3.6), width_ratios=[1.4, 1])
    shades, empty = ["#a9bfd2", "#d9c9a3", "#b7d3b0", "#e0b4b4"], "#eeeeee"

    def cell(ax, x, y, color, text="", width=1.0):
        ax.add_patch(plt.Rectangle((x, y), width, 0.8, fc=color, ec="white"))
        ax.text(x + width / 2, y + 0.4, text, ha="center", va="center", fontsize=8)

    capacity, rows = triton.cdiv(max(lengths), chunk) * chunk, len(lengths)
    for b, n in enumerate(lengths):
        y = 1.6 * (rows - 1 - b)
        for j in range(capacity):
            cell(left, j, y, shades[j // chunk % 4] if j < n else empty)
        for s in range(capacity // chunk):
            left.text(s * chunk + chunk / 2, y + 0.95, f"state {s}" if s * chunk < n
                      else "skipped", ha="center", fontsize=7)  # fmt: skip
        left.text(-0.3, y + 0.4, f"b = {b}, length {n}", ha="right", va="center")
        left.annotate(f"merge: $o_{b}$", (capacity + 0.2, y + 0.4), va="center",
                      xytext=(capacity + 2, y + 0.4), arrowprops=dict(arrowstyle="<-"))
    left.set(xlim=(-6.5, capacity + 5.5), ylim=(-0.2, 1.6 * rows),
             title=f"Split-KV: chunks of {chunk} keys, a program each")
    pages = [triton.cdiv(n, page) for n in lengths]
    table = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(3))
    for b, row in enumerate(t.tolist() for t in table.split(pages)):
        right.text(-0.2, rows - b + 0.4, f"b = {b}", ha="right", va="center")
        for i in range(max(pages)):
            cell(right, i, rows - b, *((shades[b], row[i]) if i < len(row) else
                                       (empty, "pad")))  # fmt: skip
        for p in row:
            cell(right, 0.5 * p, -0.6, shades[b], p, width=0.5)
    right.set(xlim=(-1.5, max(max(pages), sum(pages) / 2) + 0.2), ylim=(-0.8, rows + 1),
              title=f"Paged: a block table (rows),\nthen the pool of {page}-key pages")
    left.axis("off"), right.axis("off")
    fig.tight_layout()
    return fig


# Lessons 11 and 14 (Hopper): the roles' timeline by the ring's rules, a register
# layout, a shared-memory budget, what the backward's programs own.


def role_timeline(ring_slot, blocks=4, stages=2, copy=0.5, product=1.0, exp=1.0):
    """A model of lesson 11's forward over one tile of `blocks` key blocks, scheduled
    by the kernel's rules, not measured: {lane: [(start, length, label, kind)]} for
    lanes "loader warp" (kind "copy") and "consumer group 0" and "1" ("product",
    "exp"). The loader copies Q, then K_j and V_j into buffer ring_slot(j, stages)[0],
    each once both groups have released the block `stages` before it there; copies run
    one at a time, and so do products: both groups share the SM's tensor cores. Each
    group runs the kernel's loop: issue S_j, then P_{j-1} V_{j-1} (run in that order);
    when S_j is done, release K_j and compute exp_j; when P_{j-1} V_{j-1} is done,
    release V_{j-1}. Durations are in any one unit."""
    if blocks < 1 or stages < 1:
        raise ValueError(f"blocks and stages must be at least 1, got {blocks} and "
                         f"{stages}")
    groups = ("consumer group 0", "consumer group 1")
    bars = {"loader warp": [], **{g: [] for g in groups}}
    busy, landed, released = [], {}, {}  # tensor cores' (start, end); per copy
    order = iter([("Q", 0)] + [(x, j) for j in range(blocks) for x in "KV"])
    loader = {"issued": 0.0, "copying until": 0.0}

    def on_tensor_cores(ready):
        start = ready
        for begin, end in sorted(busy):  # the first gap from ready that fits
            if begin < start + product and start < end:
                start = end
        busy.append((start, start + product))
        return start

    def arrival(what, j):
        """When the copy of what_j lands: the loader issues copies in its order."""
        while (what, j) not in landed:
            name, i = next(order)
            buffer = ring_slot(i, stages)[0]
            if name != "Q" and i >= stages:  # the buffer's last block released
                loader["issued"] = max(loader["issued"], released[name, i - stages])
            start = max(loader["issued"], loader["copying until"])
            loader["copying until"] = landed[name, i] = start + copy
            label = "Q" if name == "Q" else f"{name}{i}\n→{buffer}"
            bars["loader warp"].append((start, copy, label, "copy"))
        return landed[what, j]

    def release(what, j, when):
        released[what, j] = max(released.get((what, j), 0.0), when)

    free = dict.fromkeys(groups, 0.0)  # when each group's warps go on
    for j in range(blocks + 1):
        for g in groups:
            s_end = free[g]
            if j < blocks:
                s = on_tensor_cores(max(free[g], arrival("Q", 0), arrival("K", j)))
                s_end = s + product
                bars[g].append((s, product, f"S{j}", "product"))
            if j > 0:
                v = on_tensor_cores(max(free[g], s_end, arrival("V", j - 1)))
                bars[g].append((v, product, f"P{j - 1}V{j - 1}", "product"))
            free[g] = s_end
            if j < blocks:
                release("K", j, s_end)
                bars[g].append((s_end, exp, f"exp{j}", "exp"))
                free[g] += exp
            if j > 0:
                free[g] = max(free[g], v + product)
                release("V", j - 1, free[g])
    return bars


def draw_register_layout(title, held, zoom=(16, 8)):
    """Which thread holds each element of a register tile: held as lesson 09's
    owners(layout, shape) gives it (arrays "warp", "lane", "register" of the tile's
    shape). Above, the tile coloured by warp; below, its top-left corner of zoom rows
    and columns, each cell its thread (lane), coloured by register index. Returns the
    figure."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    rows, cols = (min(z, n) for z, n in zip(zoom, held["lane"].shape))
    corner = held["register"][:rows, :cols]
    shades = ["#8fb4e3", "#f2b872", "#b7d3b0", "#e3a6c6", "#c9b7e0", "#e8de8c"]
    if corner.max() >= len(shades):
        raise ValueError(f"the corner holds {corner.max() + 1} register indices, "
                         f"more than {len(shades)} colours tell apart: zoom in")
    plot_style()
    fig, (tile, zoomed) = plt.subplots(2, 1, figsize=(7.2, 7.4),
                                       height_ratios=[1, 2.1])
    tile.imshow(held["warp"], cmap="Pastel1", vmin=0, vmax=8, aspect="auto")
    for w in np.unique(held["warp"]):
        r, c = np.argwhere(held["warp"] == w).mean(axis=0)
        tile.text(c, r, f"warp {w}", ha="center", va="center", fontsize=12)
    tile.add_patch(plt.Rectangle((-0.5, -0.5), cols, rows, fill=False, lw=2.5))
    tile.set(xlabel="column", ylabel="row", title=f"{title}: "
             f"{held['register'].max() + 1} registers per thread")
    used = int(corner.max()) + 1
    image = zoomed.imshow(corner, cmap=ListedColormap(shades[:used]), vmin=-0.5,
                          vmax=used - 0.5, aspect="auto")
    fig.colorbar(image, ax=zoomed, ticks=range(used), label="register index")
    for (r, c), lane in np.ndenumerate(held["lane"][:rows, :cols]):
        zoomed.text(c, r, f"T{lane}", ha="center", va="center", fontsize=12)
    zoomed.set(xlabel="column", ylabel="row", title="The boxed corner: each cell's "
               "thread (lane), coloured by register index")
    fig.tight_layout()
    return fig


def draw_shared_budget(programs, limit, limit_name):
    """Shared memory per program as stacked columns: programs {name: (bytes the
    compiled program uses, or None where it could not be compiled, {buffer: bytes})};
    what the compiled program uses past its buffers is "Triton's own". limit: the
    bytes one program may have (dashed), limit_name says whose. Parts under 5% of the
    limit are too thin to label: a note under the chart gives their bytes. Returns the
    figure."""
    import matplotlib.pyplot as plt

    plot_style()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    palette = ["#8fb4e3", "#b7d3b0", "#d9c9a3", "#e0b4b4", "#c9b7e0"]
    colours = {"Triton's own": "#d0d0d0"}  # part: colour, the same in every column
    thin, tallest = {}, limit  # thin: {part: {bytes}} of the parts too thin to label
    for x, (name, (used, buffers)) in enumerate(programs.items()):
        shown = dict(buffers)
        if used is not None:
            if used < sum(buffers.values()):
                raise ValueError(f"{name}: the compiled program uses {used:,} bytes, "
                                 f"less than its buffers' {sum(buffers.values()):,}")
            shown["Triton's own"] = used - sum(buffers.values())
        bottom = 0
        for part, size in shown.items():
            colour = colours.setdefault(part, palette[(len(colours) - 1) % 5])
            ax.bar(x, size / 1024, bottom=bottom / 1024, width=0.7, color=colour,
                   edgecolor="white")
            if size >= 0.05 * limit:
                ax.text(x, (bottom + size / 2) / 1024, f"{part}: {size / 1024:.0f} "
                        "KiB", ha="center", va="center", fontsize=12)
            else:
                thin.setdefault(part, set()).add(size)
            bottom += size
        what = "in all" if used is not None else "in buffers\n(not compiled)"
        ax.text(x, bottom / 1024 + 0.01 * limit / 1024, f"{bottom / 1024:.0f} KiB "
                f"{what}", ha="center", va="bottom", fontsize=12)
        tallest = max(tallest, bottom)
    ax.axhline(limit / 1024, color="black", linestyle="--")
    ax.text(-0.45, 1.01 * limit / 1024, limit_name, va="bottom", fontsize=12)
    ax.set_xticks(range(len(programs)), list(programs), fontsize=12)
    ax.set(xlim=(-0.5, len(programs) - 0.5), ylim=(0, 1.15 * tallest / 1024),
           ylabel="KiB of shared memory")
    ax.set_title("Shared memory a program holds, against its limit", fontsize=12)
    if thin:
        note = "; ".join(f"{part} {' or '.join(f'{s:,}' for s in sorted(sizes))} bytes"
                         for part, sizes in thin.items())
        fig.text(0.5, 0.01, f"Too thin to draw: {note}", ha="center", va="bottom",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.05 if thin else 0, 1, 1))
    return fig


def draw_program_ownership(n, block_n, block_m, walks):
    """Lesson 14's backward over one head of n keys and queries: one program per key
    block of block_n keys; walks {program: (first, unmasked_from, last)}, the query
    blocks of block_m rows it walks (masked before unmasked_from). Each program
    writes its keys' rows of dK and dV alone (named above the columns); a query
    block's rows of dQ are summed over the programs that walk it (named at the right,
    once per run of blocks with the same programs). Returns the figure."""
    import itertools

    import matplotlib.pyplot as plt

    plot_style()
    fig, ax = plt.subplots(figsize=(7.5, 6))
    colours = ["#3b7dd8", "#e4a23c", "#2ca02c", "#9467bd", "#8c564b", "#17becf"]
    adders = {}  # query block: programs that add into its rows of dQ
    for p, (first, unmasked_from, last) in walks.items():
        for j in range(first, last):
            ax.add_patch(plt.Rectangle(
                (p * block_n, j * block_m), block_n, block_m, edgecolor="white",
                facecolor=colours[p % len(colours)], alpha=0.85,
                hatch="//" if j < unmasked_from else None))
            adders.setdefault(j, []).append(p)
    ax.set(xlim=(0, n), ylim=(n, 0), xlabel=f"keys (a program each {block_n})",
           ylabel=f"queries (blocks of {block_m})")
    ax.set_xticks(range(0, n + 1, block_n))
    ax.set_yticks(range(0, n + 1, block_m))
    owners = ax.secondary_xaxis("top")
    owners.set_xticks([(p + 0.5) * block_n for p in walks],
                      [f"program {p}" for p in walks])
    for p, label in zip(walks, owners.get_xticklabels()):
        label.set_color(colours[p % len(colours)])
    owners.set_xlabel("dK, dV: each program writes its own keys' rows")
    runs = [(programs, [j for j, _ in run]) for programs, run in
            itertools.groupby(sorted(adders.items()), key=lambda item: item[1])]
    summed = ax.secondary_yaxis("right")
    summed.set_yticks(
        [(run[0] + run[-1] + 1) / 2 * block_m for _, run in runs],
        [f"dQ += program{'s' * (len(p) > 1)} {', '.join(map(str, p))}"
         for p, _ in runs])
    ax.set_title("What each backward program owns (one head, causal; hatched: "
                 "masked)")
    fig.tight_layout()
    return fig


# Lesson 14's exchange of dS^T between its two consumer groups.


def exchange_timeline(exchange, blocks=3, make=2.5, store=0.5, product=1.0, rest=1.0):
    """A model of lesson 14's two consumer groups over `blocks` query blocks, each
    running exchange(i, group), the kernel's steps for block i in its order: (action,
    what, parity) with actions "wait" (barrier, parity), "arrive" (barrier), "store"
    (slot), "sync" (within the group) and "read" (slots). Barriers take two arrivals
    a phase; a wait for parity p passes while the last phase completed has parity p
    (a fresh barrier counts the phase before its first, parity 1). Scheduled by those
    rules, not measured: a group makes its dS^T (`make`) before the steps and
    finishes the block (`rest`: dK, dV, sending dQ) after them; a store takes `store`;
    a read is dQ's product (`product`), and both groups' run one at a time on the
    SM's tensor cores, group 0's first on a tie. Returns (bars, phases): bars {lane:
    [(start, length, label, kind)]} for lanes "group 0", "slot 0", "slot 1" (a
    block's dS^T held from its store to the end of the last read of it) and
    "group 1", a wait that passes at once as a bar of length 0; phases {barrier:
    [(time, parity) of each phase completed]}. ValueError where the groups
    deadlock, or a slot is read while it holds another block or overwritten while
    it is read."""
    if blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {blocks}")
    steps = [[(i, *step) for i in range(blocks) for step in
              [("make", None, None), *exchange(i, g), ("rest", None, None)]]
             for g in (0, 1)]
    bars = {"group 0": [], "slot 0": [], "slot 1": [], "group 1": []}
    phases, arrivals = {}, {}  # per barrier: completed phases' times; arrivals since
    clock, at, tensor_cores, held = [0.0, 0.0], [0, 0], 0.0, {}

    def start(g):
        """When group g's next step can start, None while it waits."""
        _, action, what, parity = steps[g][at[g]]
        if action != "wait":
            return clock[g]
        done = phases.get(what, [])
        if len(done) % 2 == parity:  # the barrier is in a phase of that parity
            return None
        return max(clock[g], done[-1][0]) if done else clock[g]

    while any(at[g] < len(steps[g]) for g in (0, 1)):
        ready = [(start(g), g) for g in (0, 1) if at[g] < len(steps[g])]
        if all(t is None for t, _ in ready):
            stuck = [steps[g][at[g]] for _, g in ready]
            raise ValueError(f"the groups deadlock, waiting at {stuck}")
        now, g = min((t, g) for t, g in ready if t is not None)
        i, action, what, parity = steps[g][at[g]]
        at[g] += 1
        begin, length, label = now, 0.0, None
        if action == "wait":  # drawn from when the group reached it
            begin, length = clock[g], now - clock[g]
            label = f"{what.removeprefix('ds_')}:{parity}"
        elif action == "arrive":
            arrivals[what] = arrivals.get(what, 0) + 1
            if arrivals[what] == 2:
                arrivals[what] = 0
                done = phases.setdefault(what, [])
                done.append((now, len(done) % 2))
        elif action == "store":
            if held.get((what, i - 1), [0, 0])[1] > now:
                raise ValueError(f"group {g} overwrites slot {what} while block "
                                 f"{i - 1} is read from it")
            length, label = store, ""
            held[what, i] = [now, now + store]
        elif action == "read":
            begin = max(now, tensor_cores)
            length, label = product, f"dQ{i}"
            tensor_cores = begin + product
            for slot in what:
                if (slot, i) not in held or (slot, i + 1) in held:
                    raise ValueError(f"group {g} reads slot {slot} for block {i} "
                                     "while it holds another block")
                held[slot, i][1] = max(held[slot, i][1], tensor_cores)
        elif action in ("make", "rest"):
            length = make if action == "make" else rest
            label = f"$dS^T_{i}$" if action == "make" else "dK dV"
        elif action != "sync":
            raise ValueError(f"unknown action {action!r} in {steps[g][at[g] - 1]}")
        if label is not None:
            bars[f"group {g}"].append((begin, length, label, action))
        clock[g] = begin + length
    for (slot, i), (begin, end) in sorted(held.items()):
        bars[f"slot {slot}"].append((begin, end - begin, f"$dS^T_{i}$", "held"))
    return bars, phases


def draw_exchange(exchange, blocks=2, half=64, **durations):
    """Lesson 14's exchange of dS^T between its two consumer groups, as
    exchange_timeline (above) schedules it by exchange(i, group): each group's steps,
    the two shared-memory slots, and when each barrier completes a phase (dotted,
    named by the phase's parity above). durations: exchange_timeline's. Large type,
    few words: it is read on phones too. Returns the figure."""
    import matplotlib.pyplot as plt

    plot_style()
    bars, phases = exchange_timeline(exchange, blocks, **durations)
    fig, ax = plt.subplots(figsize=(9, 5))
    passes = "#c0392b"
    rows = {"group 0": (3.0, 0.8), "slot 0": (1.95, 0.55), "slot 1": (1.25, 0.55),
            "group 1": (0.2, 0.8)}  # lane: (y, height)
    look = {"make": ("#e4a23c", None), "store": ("#333333", None),
            "read": ("#3b7dd8", None), "rest": ("#c7c7c7", None),
            "held": ("#b7d3b0", None), "wait": ("white", "///")}
    for lane, lane_bars in bars.items():
        y, height = rows[lane]
        for begin, length, label, kind in lane_bars:
            if kind == "wait" and length == 0:  # passes at once: a tick
                ax.plot([begin] * 2, [y - 0.65 * height, y + 0.65 * height],
                        color=passes, linewidth=3, zorder=3)
                continue
            colour, hatch = look[kind]
            ax.broken_barh([(begin, length)], (y - height / 2, height),
                           facecolor=colour, edgecolor="#555555", hatch=hatch)
            if kind in ("make", "read", "held"):
                ax.text(begin + length / 2, y, label, ha="center", va="center",
                        fontsize=18, color="white" if kind == "read" else "black")
    for t, _ in (mark for done in phases.values() for mark in done):
        ax.axvline(t, color="black", linestyle=":", linewidth=1.5, zorder=0)
    top = ax.secondary_xaxis("top")
    marks = sorted((t, f"{name.removeprefix('ds_')} {p}")
                   for name, done in phases.items() for t, p in done)
    top.set_xticks(*zip(*marks), fontsize=16)
    top.tick_params(length=0)
    names = [f"group 0\nkeys 0-{half - 1}", "slot 0", "slot 1",
             f"group 1\nkeys {half}-{2 * half - 1}"]
    ax.set_yticks([y for y, _ in rows.values()], names, fontsize=17)
    ax.tick_params(length=0)
    ax.set_xticks([])
    end = max(b + n for lane in bars.values() for b, n, *_ in lane)
    ax.set(xlim=(0, end), ylim=(-0.3, 3.5))
    for spine in ax.spines.values():
        spine.set_visible(False)
    top.spines["top"].set_visible(False)
    ax.set_title("Two groups share $dS^T$ in two slots", fontsize=18, pad=12)
    keys = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="#555555", hatch=h)
            for c, h in (look["store"], look["wait"], look["rest"])]
    keys.insert(2, plt.Line2D([], [], color=passes, linewidth=3))
    fig.legend(keys, ["store", "wait", "passes", "dK, dV, dQ out"],
               loc="lower center", ncol=4, frameon=False, fontsize=16)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
