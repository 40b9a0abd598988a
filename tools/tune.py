"""Sweep the launch choices of the lessons' kernels on a GPU, to pick the defaults the lessons ship.

    python tools/tune.py softmax          # lesson 02: tile height, warps, pipelining depth, persistent or not
    python tools/tune.py split-row        # lesson 03: chunk and warps of the row-sharing kernel
    python tools/tune.py shared-row       # lesson 10's chunk per dtype and row length, or lesson 03's kernel:
                                          # the table "shared-row-chunks"
    python tools/tune.py attention        # the tiles of lessons 06 and 07 ("attention-tiles"), then the fastest
                                          # forward and backward of lessons 07, 11 and 14 ("forward-paths",
                                          # "backward-paths")
    python tools/tune.py attention-paths 1024 2048   # only the forward and backward choices, at these lengths

Options:

    --out PATH      the tables file to merge into (default: tutorials/tuned_tables.json, which the lessons
                    read through stepkit.tuned_table)
    --grid small    one point of each sweep (on a GPU at the real sizes; under the interpreter, tiny ones):
                    a check that the tool runs, not a measurement to ship; needs --out
    --restart       forget the cases that an interrupted run of the same sweep finished

Prints, per case, the fastest settings and their speed next to the lesson's current choice. Uses the lessons'
own kernels and launchers (imported, not copied), and of each lesson only the names that LESSON_NAMES lists;
times with stepkit's one method (GPU time and back to back, kit.time_calls), and the tiles by each kernel's
own GPU time from the profiler (kit.kernel_ms).

The tables file holds one table per name, each with "tool" (the commands that measured it), "measured_on"
(gpu, capability, torch, triton, date) and "rows" (one dict per case). A sweep merges into it: it replaces
the rows of the cases it measured (a case is a row's fields other than its value) and keeps every other row
and table, rewriting the whole file atomically after each case. It refuses to mix rows of another GPU or
other versions into a table it measures only in part. An interrupted sweep leaves a progress file beside
the tables file; run the same command again to go on from the cases it finished.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import lessons  # first: it puts tutorials/ on sys.path, where stepkit is
import stepkit as kit  # before Triton: it switches the interpreter on where there is no GPU
import torch
import triton

TABLES_FILE = lessons.TUTORIALS / "tuned_tables.json"

# What this tool reads of each lesson, and nothing else (Lesson refuses other names): the lessons' authors
# keep these, and tests/test_tune.py checks that every one exists.
LESSON_NAMES = {
    "02-fused-softmax": ("softmax_kernel", "_persistent_grid", "softmax"),
    "03-long-softmax": ("split_row_softmax", "online_softmax"),
    "06-fused-attention-v2-forward": ("TUNED_CONFIGS", "tuned_case", "_configs", "_prune_fwd", "FWD_SHAPES",
                                      "forward"),
    "07-fused-attention-v2-backward": ("_prune_bwd", "BWD_SHAPES", "backward"),
    "10-long-softmax-gluon": ("SHARED_LENGTHS", "shared_split_row_softmax", "shared_unsupported"),
    "11-hopper-forward-gluon": ("warp_specialized_unsupported", "attention"),
    "14-hopper-backward-gluon": ("attention",),
}


class Lesson:
    """A lesson module as this tool may use it: only the names LESSON_NAMES lists for it."""

    def __init__(self, stem):
        object.__setattr__(self, "stem", stem)
        object.__setattr__(self, "module", lessons.load(stem))

    def _check(self, name):
        if name not in LESSON_NAMES[self.stem]:
            raise AttributeError(f"tools/tune.py uses {self.stem}.{name}, which its LESSON_NAMES does not list")

    def __getattr__(self, name):
        self._check(name)
        return getattr(self.module, name)

    @contextlib.contextmanager
    def patched(self, name, value):
        """The lesson's name set to value while the block runs, then restored."""
        self._check(name)
        saved = getattr(self.module, name)
        setattr(self.module, name, value)
        try:
            yield
        finally:
            setattr(self.module, name, saved)


# -- The grid ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Grid:
    """The cases each sweep measures and the candidates it tries."""

    name: str
    rows: int  # M of the softmax sweeps
    dtypes: tuple
    softmax_lengths: tuple
    softmax_block_m: tuple
    softmax_warps: tuple
    softmax_stages: tuple
    split_lengths: tuple
    split_chunks: tuple
    split_warps: tuple
    shared_lengths: tuple | None  # None: lesson 10's SHARED_LENGTHS, the lengths its table is looked up by
    shared_chunk_bytes: tuple
    batch: int
    heads: dict  # head dim -> heads; B * H * D = 8192 in the lessons' benchmarks
    causal: tuple
    sizes: tuple  # the sequence lengths, the tables' buckets
    tiles: int | None = None  # candidate tiles per kernel (None: every one the lesson lists)


FULL = Grid(
    "full", rows=4096, dtypes=(torch.float32, torch.bfloat16),
    softmax_lengths=(256, 512, 1024, 2048, 4096, 8192, 12288, 16384), softmax_block_m=(1, 2, 4, 8, 16, 32),
    softmax_warps=(4, 8, 16, 32), softmax_stages=(1, 2), split_lengths=(65536, 131072, 262144),
    split_chunks=(4096, 8192, 16384, 32768), split_warps=(4, 8, 16, 32), shared_lengths=None,
    shared_chunk_bytes=(8192, 16384, 32768, 65536), batch=4, heads={64: 32, 128: 16}, causal=(False, True),
    sizes=(1024, 2048, 4096, 8192, 16384))
# One point of each sweep. On a GPU, at the full grid's sizes: the tool runs end to end in minutes.
SMALL_GPU = dataclasses.replace(
    FULL, name="small", dtypes=(torch.bfloat16,), softmax_lengths=(1024,), split_lengths=(65536,),
    shared_lengths=(65536,), heads={64: 32}, causal=(False,), sizes=(1024,))
# Under the interpreter (the tests), at sizes it runs in seconds, with two candidates where there are many.
SMALL_CPU = dataclasses.replace(
    SMALL_GPU, rows=4, dtypes=(torch.float32,), softmax_lengths=(256,), softmax_block_m=(2, 4),
    softmax_warps=(4,), softmax_stages=(1,), split_lengths=(1024,), split_chunks=(1024, 2048), split_warps=(4,),
    shared_lengths=(1024,), batch=1, heads={16: 1}, sizes=(64,), tiles=2)
GRIDS = {"full": FULL, "small": SMALL_GPU if kit.ON_GPU else SMALL_CPU}


# -- Timing ----------------------------------------------------------------------------------------------------


class Timing:
    """How the sweeps time (tests substitute a stand-in): stepkit's one method for whole calls, and the
    profiler's kernel time for the tiles of one kernel."""

    def calls(self, timers):
        """{key: kit.Measured} for {key: kit.Timer}, timed in passes as the lessons time."""
        return kit.time_calls(timers)

    def kernel_ms(self, fn, kernel):
        """GPU milliseconds per call of fn spent in the kernel named kernel, on a warm GPU. Tiles are compared
        by the kernel's own time: every tile of one kernel costs the host the same, and at short lengths the
        host's time per call varies more on a shared machine than the kernels differ. (The interpreter has no
        kernel times: there, the whole call's.)"""
        if not kit.ON_GPU:
            return best_ms(self.calls({kernel: kit.call_timer(fn)})[kernel])
        return kit.kernel_ms(fn, max(3, min(30, kit.warm_up(fn))))[kernel]


def best_ms(measured):
    """A Measured's fastest time: GPU time on a GPU, back to back under the interpreter."""
    return min(measured.gpu) if measured.gpu else min(measured.b2b)


def host_excess_ms(measured):
    """How far a call's back-to-back time exceeds its GPU time: the host's launches, not the GPU, set the pace
    of calls made in a row by that much (0 under the interpreter, which has no GPU time)."""
    return max(0.0, min(measured.b2b) - min(measured.gpu)) if measured.gpu else 0.0


# -- The tables file ---------------------------------------------------------------------------------------------

# Each table's fields in the order its rows hold them: (the case's, the values'). A path row's values are the
# eager pick, the pick for calls captured in a CUDA graph, and both times of every path; rows written before
# the last two existed hold the first alone.
TABLE_FIELDS = {
    "attention-tiles": (("kernel", "D", "causal", "N"), ("tile",)),
    "forward-paths": (("D", "causal", "N"), ("path", "captured", "ms")),
    "backward-paths": (("D", "causal", "N"), ("path", "captured", "ms")),
    "shared-row-chunks": (("dtype", "N"), ("chunk",)),
}


def case_of(table, row):
    """A row's case: its case fields, in order."""
    return tuple(row[field] for field in TABLE_FIELDS[table][0])


def platform():
    """What measures now: gpu, capability, torch, triton (measured_on without its date)."""
    if kit.ON_GPU:
        gpu, capability = torch.cuda.get_device_name(), list(torch.cuda.get_device_capability())
    else:
        gpu, capability = "none (the Triton interpreter on the CPU)", None
    return {"gpu": gpu, "capability": capability, "torch": torch.__version__, "triton": triton.__version__}


def read_tables(path):
    """{name: table} from a tables file; {} where there is none."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def tables_text(tables):
    """The tables file's text: a table's provenance on a line each, one line per row."""
    line = functools.partial(json.dumps, ensure_ascii=False)
    parts = []
    for name, table in tables.items():
        fields = [f'  {line(key)}: {line(value)}' for key, value in table.items() if key != "rows"]
        rows = ",\n".join(f"   {line(row)}" for row in table.get("rows", []))
        fields.append(f'  "rows": [\n{rows}\n  ]' if rows else '  "rows": []')
        parts.append(f" {line(name)}: {{\n" + ",\n".join(fields) + "\n }")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_atomically(path, text):
    """Write the whole file through a temporary file beside it and a rename: a reader (or an interrupted
    sweep) sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                     suffix=".tmp", delete=False) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(f.name, 0o644)  # a temporary file is private; the tables are not
    os.replace(f.name, path)


def describe_cases(cases, fields):
    """The cases a partial sweep measured, for a table's "tool" line: the values of each field that it
    measured, e.g. "N = 1024, 2048" or "dtype = float32, N = 65536"."""
    parts = []
    for i, field in enumerate(fields):
        values = sorted({case[i] for case in cases}, key=lambda v: (str(type(v)), v))
        parts.append(f"{field} = {', '.join(str(v) for v in values)}")
    return "; ".join(parts)


class Tables:
    """The tables file a sweep merges into. Each finished case's rows replace that case's rows, and the whole
    file is rewritten; the tables and rows that the sweep does not measure stay as they were."""

    def __init__(self, path, command, grid_cases):
        """grid_cases: {table: the cases the sweep will measure}, to check before measuring anything that
        the rows it keeps come from this GPU and these versions, and to say which rows it measured."""
        self.path, self.command, self.rows = Path(path), command, {}
        self.started = read_tables(self.path)
        now = platform()
        for name, cases in grid_cases.items():
            old = self.started.get(name)
            if old is None or {case_of(name, row) for row in old["rows"]} <= set(cases):
                continue  # a new table, or every row of it measured again
            then = {key: old["measured_on"].get(key) for key in now}
            if then != now:
                raise SystemExit(
                    f"{self.path} holds table {name!r} measured on {then}; this sweep measures only some of its "
                    f"cases, on {now}, and would mix the two: run the whole sweep, or write to another --out")

    def put(self, name, rows):
        """Merge rows (whole cases) into table name and rewrite the file."""
        self.rows.setdefault(name, {}).update({case_of(name, row): row for row in rows})
        tables = read_tables(self.path)  # as it is now, in case another table changed meanwhile
        tables[name] = self.merged(name, tables.get(name))
        write_atomically(self.path, tables_text(tables))

    def merged(self, name, current):
        case_fields, value_fields = TABLE_FIELDS[name]
        mine = self.rows[name]
        kept = {case_of(name, row): row for row in (current or {}).get("rows", []) if case_of(name, row) not in mine}
        rows = [{field: row[field] for field in (*case_fields, *value_fields) if field in row}
                for _, row in sorted({**kept, **mine}.items())]
        started = self.started.get(name)
        if not kept or started is None:
            tool = self.command
        else:
            tool = f"{self.command} ({describe_cases(mine, case_fields)}); {started['tool']} (the rest)"
        today = datetime.date.today().isoformat()
        return {"tool": tool, "measured_on": dict(platform(), date=today), "rows": rows}


class Progress:
    """The cases an interrupted sweep finished, in a file beside the tables file: run the same command (same
    sweep, grid and GPU) again and it goes on from there. Removed when the sweep completes."""

    def __init__(self, out, sweep, identity, restart=False):
        out = Path(out)
        self.path = out.with_name(f".{out.name}.{sweep}-progress.json")
        self.identity, self.done = identity, {}
        if self.path.exists() and not restart:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            if saved.get("identity") == identity:
                self.done = {json.dumps(key): result for key, result in saved["cases"]}
                print(f"Resuming: {len(self.done)} cases already measured ({self.path})", flush=True)
            else:
                print(f"Starting over: {self.path} is from another run ({saved.get('identity')})", flush=True)

    def case(self, key, measure):
        """measure()'s result for this case, measured now or by the interrupted run; JSON values only."""
        key = json.loads(json.dumps(key))  # as the file holds it: tuples become lists
        if json.dumps(key) not in self.done:
            self.done[json.dumps(key)] = measure()
            cases = [[json.loads(k), result] for k, result in self.done.items()]
            write_atomically(self.path, json.dumps({"identity": self.identity, "cases": cases}))
        return self.done[json.dumps(key)]

    def finish(self):
        self.path.unlink(missing_ok=True)


@dataclasses.dataclass
class Run:
    """One run of a sweep: where it writes, what it measures, how it times."""

    out: Path
    grid: Grid
    timing: Timing
    command: str
    restart: bool = False

    def progress(self, sweep):
        identity = {"command": self.command, "grid": dataclasses.asdict(self.grid), **platform()}
        return Progress(self.out, sweep, json.loads(json.dumps(identity, default=str)), self.restart)


# -- Softmax sweeps (lessons 02, 03, 10) ---------------------------------------------------------------------------


def dtype_name(dtype):
    return str(dtype).split(".")[-1]


def gbs(x, ms):
    """GB/s of reading and writing x once in ms."""
    return 2 * x.numel() * x.element_size() / ms * 1e-6


def checked_calls(calls, reference, tolerance=1e-2):
    """The calls ({key: fn}) that run and match reference; a configuration the GPU cannot launch is left out."""
    kept = {}
    for key, fn in calls.items():
        try:
            error = (fn().double() - reference).abs().max().item()
        except (triton.runtime.errors.OutOfResources, ValueError) as reason:
            print(f"  {key}: skipped ({str(reason).splitlines()[0][:100]})")
            continue
        assert error < tolerance, (key, error)
        kept[key] = fn
    return kept


def timed_gbs(run, x, calls):
    """{key: GB/s by the fastest time} of calls ({key: fn() on x}), timed together, in passes."""
    measured = run.timing.calls({key: kit.call_timer(fn) for key, fn in calls.items()})
    return {key: gbs(x, best_ms(m)) for key, m in measured.items()}


def fastest(rates, count):
    """The `count` fastest of {settings: GB/s}, as a line."""
    top = sorted(rates.items(), key=lambda item: -item[1])[:count]
    return "; ".join(f"{kit.shown_rate(g)} GB/s {settings}" for settings, g in top)


def against(run, x, name, baseline, calls, count):
    """A line: baseline's GB/s (named name), then the `count` fastest of calls ({settings: fn}) that run and
    match the softmax of x, all timed together."""
    rates = timed_gbs(run, x, {name: baseline, **checked_calls(calls, torch.softmax(x.double(), dim=1))})
    return f"{name} {kit.shown_rate(rates.pop(name))} | {fastest(rates, count)}"


def tune_softmax(run):
    """Lesson 02's softmax_kernel at every tile height, warp count, pipelining depth and grid style that keeps
    4 to 64 elements per thread, against the lesson's own choice (softmax)."""
    lesson, grid = Lesson("02-fused-softmax"), run.grid
    progress = run.progress("softmax")
    for dtype, N in itertools.product(grid.dtypes, grid.softmax_lengths):
        def measure():
            M = grid.rows
            x = torch.randn(M, N, device=kit.DEVICE, dtype=dtype)
            y = torch.empty_like(x)
            BLOCK_N = triton.next_power_of_2(N)
            args = (x, y, M, N, x.stride(0), x.stride(1), y.stride(0))
            calls = {}
            for block_m, warps, stages, persistent in itertools.product(
                    grid.softmax_block_m, grid.softmax_warps, grid.softmax_stages, (True, False)):
                per_thread = block_m * BLOCK_N / (warps * 32)
                if not 4 <= per_thread <= 64 or (not persistent and stages > 1):
                    continue
                meta = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, NUM_STAGES=stages)
                tiles = triton.cdiv(M, block_m)
                try:
                    programs = lesson._persistent_grid(args, meta, warps, tiles) if persistent else tiles
                except triton.runtime.errors.OutOfResources:
                    continue

                def launch(programs=programs, meta=meta, warps=warps):
                    lesson.softmax_kernel[(programs,)](*args, **meta, num_warps=warps)
                    return y
                calls[f"BM={block_m} w={warps} s={stages} p={int(persistent)}"] = launch
            current = functools.partial(lesson.softmax, x)
            return f"{dtype_name(dtype):9s} N={N:6d} " + against(run, x, "current", current, calls, 3)
        print(progress.case(("softmax", dtype_name(dtype), N), measure), flush=True)
    progress.finish()


def tune_split_row(run):
    """Lesson 03's split-row kernel at every chunk and warp count that keeps 4 to 128 elements per thread,
    against its online softmax."""
    lesson, grid = Lesson("03-long-softmax"), run.grid
    progress = run.progress("split-row")
    for dtype, N in itertools.product(grid.dtypes, grid.split_lengths):
        def measure():
            x = torch.randn(grid.rows, N, device=kit.DEVICE, dtype=dtype)
            calls = {f"chunk={chunk} w={warps}": functools.partial(lesson.split_row_softmax, x, chunk, warps)
                     for chunk, warps in itertools.product(grid.split_chunks, grid.split_warps)
                     if 4 <= chunk // (warps * 32) <= 128}
            online = functools.partial(lesson.online_softmax, x)
            return f"{dtype_name(dtype):9s} N={N:6d} " + against(run, x, "online", online, calls, 4)
        print(progress.case(("split-row", dtype_name(dtype), N), measure), flush=True)
    progress.finish()


def shared_row_cases(run):
    lengths = run.grid.shared_lengths or Lesson("10-long-softmax-gluon").SHARED_LENGTHS
    return [(dtype_name(dtype), N) for dtype in run.grid.dtypes for N in lengths]


def tune_shared_row(run):
    """Lesson 10's kernel with chunks of 8 to 64 KiB against lesson 03's registers kernel, per dtype and row
    length, timed together; the fastest of each case goes into the table "shared-row-chunks" (None where
    lesson 03's kernel won). Where lesson 10's Gluon kernel cannot run (not a Hopper GPU), only lesson 03's."""
    lesson, registers = Lesson("10-long-softmax-gluon"), Lesson("03-long-softmax")
    cases = shared_row_cases(run)
    tables = Tables(run.out, run.command, {"shared-row-chunks": cases})
    progress = run.progress("shared-row")
    for dtype, N in cases:
        def measure():
            x = torch.randn(run.grid.rows, N, device=kit.DEVICE, dtype=getattr(torch, dtype))
            calls = {None: functools.partial(registers.split_row_softmax, x)}
            reason = lesson.shared_unsupported(x)
            if reason:
                print(f"  lesson 10's kernel skipped: {reason}")
            else:
                calls.update({chunk_bytes // x.element_size(): functools.partial(
                    lesson.shared_split_row_softmax, x, chunk_bytes // x.element_size())
                    for chunk_bytes in run.grid.shared_chunk_bytes})
            rates = timed_gbs(run, x, checked_calls(calls, torch.softmax(x.double(), dim=1)))
            shown = {"registers" if key is None else f"chunk {key}": g for key, g in rates.items()}
            print(f"{dtype:9s} N={N:6d} {fastest(shown, len(shown))}", flush=True)
            return max(rates, key=rates.get)
        chunk = progress.case(("shared-row", dtype, N), measure)
        tables.put("shared-row-chunks", [{"dtype": dtype, "N": N, "chunk": chunk}])
    progress.finish()


# -- Attention (lessons 06, 07, 11, 14) ------------------------------------------------------------------------

TILE_KERNELS = {"fwd": "attn_fwd_kernel", "dq": "attn_bwd_dq_kernel", "dkdv": "attn_bwd_dkdv_kernel",
                "dkdv-atomic": "attn_bwd_dkdv_kernel"}

# Timings of one kernel on this machine spread by a few percent from run to run, so tile configurations
# within this fraction of the fastest count as tied; each distinct one the lessons run is one more
# compilation in every cold build.
TIED = 0.03


def fewest_configs(times, tied=TIED):
    """{bucket: configuration} from {bucket: {configuration: ms}}: a configuration within `tied` of the
    fastest at every bucket, using as few distinct configurations as a greedy cover finds."""
    near = {bucket: {c for c, ms in t.items() if ms <= (1 + tied) * min(t.values())} for bucket, t in times.items()}
    candidates = set().union(*near.values())
    chosen, open_buckets = [], set(times)
    while open_buckets:
        def merit(c):
            covered = [b for b in open_buckets if c in near[b]]
            return len(covered), -sum(times[b][c] / min(times[b].values()) for b in covered), c
        pick = max(candidates, key=merit)
        chosen.append(pick)
        open_buckets -= {b for b in open_buckets if pick in near[b]}
    fastest = {bucket: min(t, key=t.get) for bucket, t in times.items()}
    if len(set(fastest.values())) <= len(chosen):  # a greedy cover can come out larger than the optimum
        return fastest
    return {bucket: min((c for c in chosen if c in near[bucket]), key=times[bucket].get) for bucket in times}


# Paths differ in host time, which moves between runs and machines far more than GPU time does. A path must
# be this much cheaper, back to back, to be preferred over one whose calls the host paces less.
PATH_TIED = 0.05


def steadiest_of_the_fastest(cost, host, tied=PATH_TIED):
    """The path to run from {path: ms per call back to back} and {path: how much the host paces it, in ms}:
    of the paths within `tied` of the cheapest, the one that asks least of the host. On a near-tie the path
    with more room between host and GPU keeps its pace on more machines (one sweep picked a path that was 3%
    cheaper, which a later build measured host-paced at 0.61x the other)."""
    near = [path for path, ms in cost.items() if ms <= (1 + tied) * min(cost.values())]
    return min(near, key=lambda path: (host[path], cost[path]))


def captured_pick(gpu_ms):
    """The path to run where the host is out of the way (a call captured in a CUDA graph), from {path: GPU
    milliseconds per call}: the fastest by GPU time. No near-tie rule: GPU times repeat to a few percent from
    run to run, and two runs on H100s picked alike in all 16 cases at N = 1024 and 2048 (the eager picks, paced
    by the host, differed in 10)."""
    return min(gpu_ms, key=gpu_ms.get)


def attention_inputs(grid, D, N, requires_grad=True):
    return [torch.randn(grid.batch, grid.heads[D], N, D, device=kit.DEVICE, dtype=torch.float16,
                        requires_grad=requires_grad) for _ in range(3)]


def attention_cases(grid, sizes=None):
    return [(D, causal, N) for D in grid.heads for causal in grid.causal for N in (sizes or grid.sizes)]


def candidate_tiles(grid, D):
    """{"fwd": [...], "bwd": [...]}: the (BLOCK_M, BLOCK_N, warps, stages) the lessons list for head dim D,
    after their own pruning."""
    V2, V2_BWD = Lesson("06-fused-attention-v2-forward"), Lesson("07-fused-attention-v2-backward")
    shapes = {}
    for kind, prune, listed in (("fwd", V2._prune_fwd, V2.FWD_SHAPES), ("bwd", V2_BWD._prune_bwd, V2_BWD.BWD_SHAPES)):
        configs = prune(V2._configs(listed), {}, D=D)
        shapes[kind] = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]
        shapes[kind] = shapes[kind][:grid.tiles]
    return shapes


@contextlib.contextmanager
def tiles_in_force(configs, case=None):
    """Lesson 06's launchers run the tiles of `configs` ({(kernel, D, causal, N): tile}) while the block runs,
    for the case given (or for any case whose inputs are of a bucket's length), whatever the lesson's table
    holds and whichever GPU it was measured on."""
    V2 = Lesson("06-fused-attention-v2-forward")
    saved = dict(V2.TUNED_CONFIGS)
    V2.TUNED_CONFIGS.update(configs)
    if case is None:
        buckets = sorted({key[3] for key in configs})

        def tuned_case(q, causal):
            N = q.shape[2]
            return q.shape[3], causal, next((n for n in buckets if N <= n), buckets[-1])
    else:
        def tuned_case(q, causal):
            return case
    try:
        with V2.patched("tuned_case", tuned_case):
            yield V2.TUNED_CONFIGS
    finally:
        V2.TUNED_CONFIGS.clear()
        V2.TUNED_CONFIGS.update(saved)


def tile_times(run, case, shapes):
    """{kernel: [[tile, ms], ...]} for one case: each candidate tile of each kernel of lessons 06 and 07 by the
    kernel's own GPU time, the kernels measured one after another, each with the tiles already picked for the
    others (the fastest of theirs)."""
    V2, V2_BWD = Lesson("06-fused-attention-v2-forward"), Lesson("07-fused-attention-v2-backward")
    D, causal, N = case
    scale = D ** -0.5
    q, k, v = attention_inputs(run.grid, D, N, requires_grad=False)
    times = {}
    with tiles_in_force({("dkdv", *case): shapes["bwd"][0]}, case) as configs:  # until its own turn below
        o, lse = V2.forward(q, k, v, causal, scale)
        do = torch.randn_like(o)
        calls = {"fwd": lambda: V2.forward(q, k, v, causal, scale),
                 "dq": lambda: V2_BWD.backward(q, k, v, o, do, lse, causal, scale, False),
                 "dkdv": lambda: V2_BWD.backward(q, k, v, o, do, lse, causal, scale, False),
                 "dkdv-atomic": lambda: V2_BWD.backward(q, k, v, o, do, lse, causal, scale, True)}
        for kernel, call in calls.items():
            measured = {}
            for shape in shapes["fwd" if kernel == "fwd" else "bwd"]:
                configs[(kernel, *case)] = shape
                measured[shape] = run.timing.kernel_ms(call, TILE_KERNELS[kernel])
            configs[(kernel, *case)] = min(measured, key=measured.get)
            times[kernel] = [[list(shape), ms] for shape, ms in measured.items()]
    return times


def tile_rows(case, times):
    """The table rows of one case from tile_times' {kernel: [[tile, ms], ...]}: its fastest tiles."""
    D, causal, N = case
    return [{"kernel": kernel, "D": D, "causal": causal, "N": N, "tile": min(pairs, key=lambda p: p[1])[0]}
            for kernel, pairs in times.items()]


def fastest_paths(run, case):
    """(forward, backward) picks in one case, with the tiles in force, each {"path", "captured", "ms"}: "path"
    the faster forward (Gluon or portable) or the fastest backward (Gluon, two-pass or atomic) by the time per
    call back to back, as a user's calls in a row see it (the slower of host and GPU), on a near-tie the one
    the host paces least (steadiest_of_the_fastest); "captured" the pick by GPU time, for calls replayed from
    a CUDA graph (captured_pick); "ms" both times of every path. Times the first SDPA peer beside them and
    prints what it measured."""
    FWD, HOPPER = Lesson("11-hopper-forward-gluon"), Lesson("14-hopper-backward-gluon")
    D, causal, N = case
    scale = D ** -0.5
    q, k, v = attention_inputs(run.grid, D, N)
    # Every path through the Hopper lessons' attention, as the default path calls it (settled once per layout,
    # with its call plan): the host's work per call is what separates paths at the shortest lengths.
    forwards = {"portable": functools.partial(FWD.attention, causal=causal, sm_scale=scale, warp_specialized=False)}
    backwards = {path: functools.partial(HOPPER.attention, causal=causal, sm_scale=scale, atomic_dq=atomic,
                                         warp_specialized=False)
                 for path, atomic in (("two-pass", False), ("atomic", True))}
    if FWD.warp_specialized_unsupported(q, k, v) is None:  # a Hopper GPU: the Gluon kernels run
        forwards["gluon"] = functools.partial(FWD.attention, causal=causal, sm_scale=scale, warp_specialized=True)
        backwards["gluon"] = functools.partial(HOPPER.attention, causal=causal, sm_scale=scale,
                                               warp_specialized=True)
    peer = kit.SDPA_PEERS[0]
    sdpa = kit.sdpa_providers(causal, scale, [peer])[peer]
    timers = {(path, "fwd"): kit.call_timer(fn, q, k, v) for path, fn in {**forwards, peer: sdpa}.items()}
    timers.update({(path, "bwd"): kit.backward_timer(fn, q, k, v) for path, fn in {**backwards, peer: sdpa}.items()})
    measured = run.timing.calls(timers)
    chosen = {}
    for mode, paths in (("fwd", forwards), ("bwd", backwards)):
        ran = [path for path in paths if (path, mode) in measured]
        cost = {path: min(measured[path, mode].b2b) for path in ran}
        host = {path: host_excess_ms(measured[path, mode]) for path in ran}
        gpu = {path: min(measured[path, mode].gpu) for path in ran if measured[path, mode].gpu}
        eager = steadiest_of_the_fastest(cost, host)
        # Both picks and both figures: the eager pick by the pace back to back, the captured one by GPU time
        # (under the interpreter, which has no GPU time, the eager pick).
        chosen[mode] = {"path": eager, "captured": captured_pick(gpu) if gpu else eager,
                        "ms": {path: {"gpu": round(gpu[path], 5) if path in gpu else None,
                                      "b2b": round(cost[path], 5)} for path in ran}}

    def rates(mode):
        work = kit.attention_flops(run.grid.batch, run.grid.heads[D], N, D, causal, mode) * 1e-9
        return " ".join(f"{path} {work / best_ms(m):.3g}/{work / min(m.b2b):.3g}"
                        for (path, m_mode), m in measured.items() if m_mode == mode)
    picks = ", ".join(f"{chosen[m]['path']} (captured: {chosen[m]['captured']})" for m in ("fwd", "bwd"))
    print(f"D={D} causal={causal!s:5} N={N:5d} TFLOP/s (GPU time/back to back) fwd {rates('fwd')} | "
          f"bwd {rates('bwd')} | chose {picks}", flush=True)
    return chosen["fwd"], chosen["bwd"]


def path_rows(run, cases, tables, progress):
    """fastest_paths at each case, each case's two rows written as soon as it is measured."""
    for case in cases:
        forward, backward = progress.case(("paths", *case), lambda: fastest_paths(run, case))
        D, causal, N = case
        tables.put("forward-paths", [{"D": D, "causal": causal, "N": N, **forward}])
        tables.put("backward-paths", [{"D": D, "causal": causal, "N": N, **backward}])


def tune_attention(run):
    """For each head dim, masking and sequence length of the grid: the GPU time of every tile of each kernel
    of lessons 06 and 07 (tile_times), then, per kernel, head dim and masking, one tile per length with as few
    distinct ones as keep every length within TIED of its fastest (fewest_configs): the table
    "attention-tiles". With those tiles, fastest_paths picks each case's forward and backward: the tables
    "forward-paths" and "backward-paths". Until the tiles of every case are measured, the file holds each
    measured case's fastest tiles."""
    grid = run.grid
    cases = attention_cases(grid)
    tile_cases = [(kernel, *case) for kernel in TILE_KERNELS for case in cases]
    tables = Tables(run.out, run.command, {"attention-tiles": tile_cases, "forward-paths": cases,
                                           "backward-paths": cases})
    progress = run.progress("attention")
    times = {}  # (kernel, D, causal) -> {N: {tile: ms}}
    for case in cases:
        D, causal, N = case
        measured = progress.case(("tiles", *case), lambda: tile_times(run, case, candidate_tiles(grid, D)))
        tables.put("attention-tiles", tile_rows(case, measured))
        for kernel, pairs in measured.items():
            times.setdefault((kernel, D, causal), {})[N] = {tuple(tile): ms for tile, ms in pairs}
        fastest = {kernel: min(pairs, key=lambda p: p[1]) for kernel, pairs in measured.items()}
        print(f"D={D} causal={causal!s:5} N={N:5d} fastest: " +
              " ".join(f"{kernel} {tuple(tile)} {ms:.3f} ms" for kernel, (tile, ms) in fastest.items()), flush=True)
    configs = {(kernel, D, causal, N): tile for (kernel, D, causal), per_size in times.items()
               for N, tile in fewest_configs(per_size).items()}
    distinct = len({(kernel, D, causal, tile) for (kernel, D, causal, _), tile in configs.items()})
    fastest = sum(len({min(t, key=t.get) for t in per_size.values()}) for per_size in times.values())
    print(f"distinct configurations: {distinct} (fastest at every bucket: {fastest})")
    tables.put("attention-tiles", [{"kernel": kernel, "D": D, "causal": causal, "N": N, "tile": list(tile)}
                                   for (kernel, D, causal, N), tile in configs.items()])
    with tiles_in_force(configs):
        path_rows(run, cases, tables, progress)
    progress.finish()


def tune_attention_paths(run, lengths):
    """fastest_paths again at the given sequence lengths only, with the tiles that the tables file holds, and
    those rows of "forward-paths" and "backward-paths" replaced. For a change to the host's work per call,
    which moves the choice between paths at the shortest lengths and no tile's GPU time; a change to a
    kernel needs the whole sweep."""
    tiles = read_tables(run.out).get("attention-tiles")
    if tiles is None:
        sys.exit(f"{run.out} has no table 'attention-tiles': run the attention sweep first")
    buckets = tuple(sorted({row["N"] for row in tiles["rows"]}))
    if not lengths or any(N not in buckets for N in lengths):
        sys.exit(f"attention-paths takes sequence lengths among the tables' buckets {buckets}, got {lengths}")
    cases = attention_cases(run.grid, lengths)
    tables = Tables(run.out, run.command, {"forward-paths": cases, "backward-paths": cases})
    progress = run.progress("attention-paths")
    configs = {(row["kernel"], row["D"], row["causal"], row["N"]): tuple(row["tile"]) for row in tiles["rows"]}
    with tiles_in_force(configs):
        path_rows(run, cases, tables, progress)
    progress.finish()


# -- Command line ----------------------------------------------------------------------------------------------

SWEEPS = {"softmax": tune_softmax, "split-row": tune_split_row, "shared-row": tune_shared_row,
          "attention": tune_attention}


def main(argv=None, timing=None):
    parser = argparse.ArgumentParser(prog="tools/tune.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", choices=[*SWEEPS, "attention-paths"])
    parser.add_argument("lengths", nargs="*", type=int, help="attention-paths: the sequence lengths")
    parser.add_argument("--out", type=Path, help=f"the tables file (default: {TABLES_FILE})")
    parser.add_argument("--grid", choices=GRIDS, default="full")
    parser.add_argument("--restart", action="store_true", help="forget an interrupted run's finished cases")
    args = parser.parse_args(argv)
    if args.lengths and args.sweep != "attention-paths":
        parser.error(f"{args.sweep} takes no lengths")
    if args.grid == "small" and args.out is None:
        parser.error("--grid small measures one point: write it to a file of its own with --out")
    if args.grid == "full" and not kit.ON_GPU:
        parser.error("the sweeps measure a GPU: under the interpreter only --grid small runs (a test of the tool)")
    command = " ".join(["tools/tune.py", args.sweep, *map(str, args.lengths)]
                       + (["--grid", args.grid] if args.grid != "full" else []))
    run = Run(args.out or TABLES_FILE, GRIDS[args.grid], timing or Timing(), command, args.restart)
    if args.sweep == "attention-paths":
        tune_attention_paths(run, args.lengths)
    else:
        SWEEPS[args.sweep](run)


if __name__ == "__main__":
    main()
