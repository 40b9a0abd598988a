"""Build the site with the lessons run in shards, then merge them in one Sphinx build that runs none.

    python tools/shard_build.py                        # make html: JOBS workers on this box
    python tools/shard_build.py --jobs 4               # 4 workers (a GPU box: at most one per GPU)
    python tools/shard_build.py --shard 2 --shards 4 --out shard   # CI: one runner's share
    python tools/shard_build.py --merge shards/* --require-gpu     # CI: merge the shards, build the site

How it works. Sphinx-Gallery skips a lesson whose checksum (docs/tutorials/<lesson>.py.md5) matches its
source and reuses what it generated then: the page, plots, notebook, zip and run time (.cost.json).
docs/_ext/lesson_files.py adds the rerun rule (a lesson runs again when a file it needs changed,
recorded in <lesson>.needs.json) by removing the checksum. This tool plans with the same rule
(lesson_files.stale_lessons), so a lesson runs where the plain build would run it.

* A worker is an ordinary Sphinx build (the dummy builder: it reads every page and writes none) in a
  copy of docs/ and tutorials/ of its own (build/shards/<n>/), told by
  ``sphinx_gallery_conf.filename_pattern`` to run only its lessons, with its own results folder, one
  GPU (CUDA_VISIBLE_DEVICES) on a GPU box, and its own share of the CPU cores (affinity; OMP and
  TorchInductor threads capped to it, and stepkit.compile_ahead uses the affinity). Lessons go to
  workers longest first, each to the worker with the least work so far, by the run times of the last
  build here (build/lesson-times.json) or the committed tools/lesson-times.json.
* The merge copies each lesson's generated files (its needs record included) and results into
  docs/tutorials and build/results, then runs the final build with SHARD_MERGE=1: docs/conf.py stops
  it before Sphinx-Gallery starts if any lesson would run there. That build writes the gallery's
  index, zips, Computation times page (from the .cost.json files) and performance page as a
  one-worker build does.
* Every build that writes the site then writes the Chinese edition (build/html/zh_CN) from the same
  executed pages: a second Sphinx build with SHARD_MERGE=1, which runs no lesson (chinese_build).
* With one worker (JOBS=1, the default without a GPU, or a single lesson to run) the build is the
  plain Sphinx build, which a merge would only repeat.
* In CI each GPU runner runs one shard of every lesson (--shard; the plan from the committed times, so
  that all runners draw the same one) and leaves its files, with shard.json (its lessons, GPU and
  driver), in --out. The merge job (--merge) checks that the shards make one whole, copies them in and
  builds with SHARD_MERGE=1 and, with --require-gpu, SHARD_REQUIRE_GPU=1 (every lesson page's platform
  line names a GPU, and the shards ran on one model); the performance page names the shards' driver.

A lesson that fails fails the build with its name and the end of its worker's log, once every worker
has finished; the lessons that passed are kept, so the next build runs only those that failed.
"""

import argparse
import filecmp
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "tutorials"
GALLERY = ROOT / "docs" / "tutorials"
BUILD = ROOT / "build"
SHARDS = BUILD / "shards"
RECORDED_TIMES = BUILD / "lesson-times.json"
COMMITTED_TIMES = ROOT / "tools" / "lesson-times.json"
# A lesson no times file knows: this long, if no lesson is known either.
UNKNOWN_SECONDS = 60.0
LOG_TAIL = 60  # lines of a failed worker's log to show
NVIDIA_DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # there when the NVIDIA driver is loaded

sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import lesson_files  # noqa: E402  (the rerun rule, shared with the build)
from edition import CHINESE  # noqa: E402  (the Chinese edition's language and folder: build/html/zh_CN)


def say(text):
    print(text, flush=True)


def results_dir():
    """Where the build reads the lessons' results (docs/conf.py: TUTORIAL_RESULTS_DIR)."""
    return Path(os.environ.get("TUTORIAL_RESULTS_DIR", BUILD / "results")).resolve()


# -- The plan ------------------------------------------------------------------------------------------


def read_times(*paths):
    """{lesson: seconds}: each lesson from the first file that has it (a file is {"seconds": {...}})."""
    times = {}
    for path in reversed(paths):
        if Path(path).is_file():
            times.update(json.loads(Path(path).read_text())["seconds"])
    return times


def estimates(names, times):
    """Seconds for each lesson: its recorded time, else the mean of the known ones."""
    known = [times[n] for n in names if n in times]
    guess = sum(known) / len(known) if known else UNKNOWN_SECONDS
    return {n: float(times.get(n, guess)) for n in names}


def plan(names, workers, times):
    """Longest lesson first, each to the worker with the least work so far (the lowest-numbered one on a
    tie): [[lessons of worker 0], ...]. Deterministic: ties in time go by name."""
    seconds = estimates(names, times)
    shards = [[] for _ in range(workers)]
    load = [0.0] * workers
    for name in sorted(names, key=lambda n: (-seconds[n], n)):
        worker = load.index(min(load))
        shards[worker].append(name)
        load[worker] += seconds[name]
    return shards


# -- The machine ---------------------------------------------------------------------------------------


def nvidia_smi(*args):
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def cuda_device_count():
    """What CUDA counts under this environment, asked of a child process (this one keeps no CUDA context)."""
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=300)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def visible_gpus():
    """The GPUs the workers may be given, one each, as CUDA_VISIBLE_DEVICES names them. nvidia-smi lists
    them (every GPU by UUID, which no device order can confuse), or CUDA in a child process where the
    driver is loaded but nvidia-smi is missing; CUDA_VISIBLE_DEVICES, when set, keeps its own names."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    named = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if shutil.which("nvidia-smi"):
        found = re.findall(r"^GPU \d+: .*\(UUID: (GPU-[^)]+)\)", nvidia_smi("-L"), re.M)
        return found if named is None else named[:len(found)]
    if NVIDIA_DRIVER_GPUS.is_dir():
        count = cuda_device_count()
        return [str(i) for i in range(count)] if named is None else named[:count]
    return []


def gpu_description(device):
    """(name, driver) of one GPU, as nvidia-smi gives them, or (None, None)."""
    line = nvidia_smi("-i", device, "--query-gpu=name,driver_version", "--format=csv,noheader").strip()
    name, _, driver = line.partition(", ")
    return (name, driver) if driver else (None, None)


def default_jobs(gpus):
    return max(1, len(gpus))


def check_jobs(jobs, gpus):
    """The number of workers, or ValueError: at least one, and never more than the GPUs where there are."""
    if jobs < 1:
        raise ValueError(f"JOBS={jobs}: at least one worker")
    if gpus and jobs > len(gpus):
        raise ValueError(f"JOBS={jobs}, but {len(gpus)} GPUs are visible: lessons never share a GPU")
    return jobs


def core_shares(cores, workers):
    """Each worker's CPU cores: consecutive runs of near-equal length (workers sharing cores only where
    there are fewer cores than workers)."""
    cores = sorted(cores)
    if workers >= len(cores):
        return [{cores[i % len(cores)]} for i in range(workers)]
    bounds = [round(i * len(cores) / workers) for i in range(workers + 1)]
    return [set(cores[bounds[i]:bounds[i + 1]]) for i in range(workers)]


def ranges(cores):
    """'0-3,8' for {0, 1, 2, 3, 8}."""
    cores, runs = sorted(cores), []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


# -- Workers -------------------------------------------------------------------------------------------


def copy_sources(dest):
    """docs/ and tutorials/ as they are now, without anything a build generated."""
    shutil.copytree(ROOT / "docs", dest / "docs",
                    ignore=shutil.ignore_patterns("tutorials", "sg_execution_times.rst", "__pycache__"))
    shutil.copytree(TUTORIALS, dest / "tutorials", ignore=shutil.ignore_patterns("__pycache__"))


def generated_files(gallery, name):
    """What Sphinx-Gallery and lesson_files generated for one lesson, relative to the gallery folder:
    <lesson>.py, .py.md5, .rst, .ipynb, .zip, .cost.json, .codeobj.json, .needs.json and its images."""
    gallery = Path(gallery)
    found = [p for p in gallery.glob(f"{name}.*") if p.is_file()]
    found += [p for p in (gallery / "images").rglob(f"sphx_glr_{name}_*") if p.is_file()]
    return sorted(p.relative_to(gallery) for p in found)


def pattern(names):
    """Sphinx-Gallery's filename_pattern that runs these lessons and no other."""
    return "/(" + "|".join(re.escape(n) for n in names) + r")\.py$"


class Worker:
    """A Sphinx build in build/shards/<index> that runs only `names`, pinned to `gpu` and `cores`."""

    def __init__(self, index, names, gpu, cores, sphinxopts):
        self.index, self.names, self.gpu, self.cores = index, names, gpu, cores
        self.home = SHARDS / str(index)
        self.gallery = self.home / "src" / "docs" / "tutorials"
        self.results = self.home / "results"
        self.done = []
        if self.home.exists():
            shutil.rmtree(self.home)
        copy_sources(self.home / "src")
        threads = str(len(cores))
        env = dict(os.environ, TUTORIAL_RESULTS_DIR=str(self.results), OMP_NUM_THREADS=threads,
                   TORCHINDUCTOR_COMPILE_THREADS=threads)
        env.pop("SHARD_MERGE", None)
        env.pop("SHARD_REQUIRE_GPU", None)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        # Sphinx's dummy builder reads every page (so a lesson's page that Sphinx would warn about fails
        # here, under -W, as in a plain build) and writes none: the merging build writes them all.
        command = [sys.executable, "-m", "sphinx", "-b", "dummy", *sphinxopts,
                   "-D", f"sphinx_gallery_conf.filename_pattern={pattern(names)}",
                   "-d", str(self.home / "doctrees"), str(self.home / "src" / "docs"), str(self.home / "out")]
        self.log = self.home / "log.txt"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=self.home / "src", env=env, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.sched_setaffinity(0, cores))
        self.start = time.perf_counter()

    def where(self):
        """'CPU', or the GPU as CUDA_VISIBLE_DEVICES names it (a UUID cut to its first 8 digits)."""
        if self.gpu is None:
            return "CPU"
        return f"GPU {self.gpu[4:12]}" if self.gpu.startswith("GPU-") else f"GPU {self.gpu}"

    def finished_lessons(self):
        """Lessons of this worker that ran to the end since the last call (their .py.md5 appeared)."""
        new = [n for n in self.names if n not in self.done and (self.gallery / f"{n}.py.md5").is_file()]
        self.done += new
        return new

    def failed(self):
        """After the process ended: the lessons it did not leave current."""
        return [n for n in self.names if not lesson_files.current(self.home / "src" / "tutorials", self.gallery, n)]

    def tail(self):
        lines = self.log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        return "\n".join(lines)


def lesson_seconds(gallery, name):
    try:
        return float(json.loads((Path(gallery) / f"{name}.cost.json").read_text())["time"])
    except (OSError, ValueError, KeyError):
        return None


def run_workers(shards, gpus, sphinxopts, seconds, first=0):
    """Run one worker per shard side by side (numbered from `first`), reporting each lesson as it ends;
    the workers, once all have ended. A worker with no lessons is not started."""
    cores = core_shares(os.sched_getaffinity(0), len(shards))
    workers = [Worker(first + i, names, gpus[i] if gpus else None, cores[i], sphinxopts)
               for i, names in enumerate(shards) if names]
    total = sum(len(w.names) for w in workers)
    for w in workers:
        planned = sum(seconds[n] for n in w.names)
        pinned = f"CUDA_VISIBLE_DEVICES={w.gpu}" if w.gpu is not None else "CPU"
        say(f"  worker {w.index} ({pinned}, cores {ranges(w.cores)}; log {w.log.relative_to(ROOT)}): "
            f"{', '.join(w.names)}  [{planned:.0f} s planned]")
    start, count, running = time.perf_counter(), 0, list(workers)
    try:
        while running:
            time.sleep(1.0)
            for w in workers:
                for name in w.finished_lessons():
                    count += 1
                    took = lesson_seconds(w.gallery, name)
                    say(f"[{time.perf_counter() - start:5.0f} s] {name} ran on worker {w.index} "
                        f"({w.where()})" + (f" in {took:.1f} s" if took is not None else "") + f"  [{count}/{total}]")
            for w in list(running):
                if w.process.poll() is not None:
                    running.remove(w)
                    w.finished_lessons()
                    say(f"[{time.perf_counter() - start:5.0f} s] worker {w.index} ended"
                        + (f" with exit code {w.process.returncode}" if w.process.returncode else ""))
    except BaseException:
        for w in running:
            w.process.terminate()
        for w in running:
            w.process.wait()
        raise
    return workers


def report_failures(workers):
    """Name each failed lesson, with the end of its worker's log; return the names (or the workers that
    failed with every lesson current, a warning under -W for instance)."""
    failed = []
    for w in workers:
        lessons = w.failed()
        if lessons or w.process.returncode:
            what = ", ".join(lessons) if lessons else f"every lesson ran, but the build exited {w.process.returncode}"
            say(f"\nworker {w.index} ({w.where()}) FAILED: {what}\n--- the last lines of {w.log} ---\n{w.tail()}\n---")
            failed += lessons or [f"worker {w.index}"]
    return failed


def replace_lesson_files(source_gallery, target_gallery, name):
    """A lesson's generated files in target_gallery become those in source_gallery (old plots go)."""
    for relative in generated_files(target_gallery, name):
        (target_gallery / relative).unlink()
    for relative in generated_files(source_gallery, name):
        (target_gallery / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source_gallery / relative, target_gallery / relative)


def copy_results(source, target, names):
    for name in names:
        result = Path(source) / f"{name}.json"
        if result.is_file():
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy(result, Path(target) / result.name)


# -- Builds --------------------------------------------------------------------------------------------


def sphinx_build(sphinxopts, env=None):
    """docs/ into build/html, then the Chinese edition into build/html/zh_CN from the same pages."""
    command = [sys.executable, "-m", "sphinx", "-b", "html", *sphinxopts, "-d", str(BUILD / "doctrees"),
               str(ROOT / "docs"), str(BUILD / "html")]
    code = subprocess.run(command, cwd=ROOT, env=dict(os.environ, **(env or {}))).returncode
    # DOCS_CHINESE=0 builds the English pages alone: for the tests of sharding, whose lessons of their own
    # have no catalogs. Every build that publishes makes both.
    return code or (chinese_build(sphinxopts, env) if os.environ.get("DOCS_CHINESE") != "0" else 0)


def chinese_build(sphinxopts, env=None, out=BUILD):
    """The Chinese edition: the English build's executed pages with their prose from the catalogs.

    It runs no lesson (SHARD_MERGE=1: the build stops if one would run), writes the Chinese notebooks
    from the English ones first (tools/i18n.py), and shows the English build's copy of every file the
    two share (share_files), so a version publishes it once. `out` holds the English build's html/
    (build/ for make html)."""
    start = time.perf_counter()
    code = subprocess.run([sys.executable, str(ROOT / "tools" / "i18n.py"), "notebooks"], cwd=ROOT).returncode
    if code:
        return code
    command = [sys.executable, "-m", "sphinx", "-b", "html", *sphinxopts, "-d", str(out / f"doctrees-{CHINESE}"),
               str(ROOT / "docs"), str(out / "html" / CHINESE)]
    environment = {**os.environ, **(env or {}), "SHARD_MERGE": "1", "DOCS_LANGUAGE": CHINESE}
    code = subprocess.run(command, cwd=ROOT, env=environment).returncode
    if code == 0:
        saved = share_files(out / "html", out / "html" / CHINESE)
        say(f"shard_build: the Chinese edition took {time.perf_counter() - start:.0f} s; it shows "
            f"{saved / 2**20:.1f} MiB of the English build's files instead of copies")
    return code


# What the Chinese pages link to that the English build also wrote (images, downloads, the theme's
# files, the pages' sources): the same file is published once.
SHARED_FOLDERS = ("_images", "_downloads", "_static", "_sources")


def share_files(english, chinese):
    """Point the Chinese pages at the English build's copy of each file of SHARED_FOLDERS that is the
    same file, and remove theirs; returns the bytes saved. Each edition's pages sit at the same paths, so
    one more "../" leads from a Chinese page's relative link to the English file."""
    same = set()
    for folder in SHARED_FOLDERS:
        for path in (chinese / folder).rglob("*"):
            twin = english / path.relative_to(chinese)
            if path.is_file() and twin.is_file() and filecmp.cmp(path, twin, shallow=False):
                same.add(path.relative_to(chinese).as_posix())
    link = re.compile(r'(?<=["\s,])((?:\.\./)*)((?:%s)/[^"\s,?#]+)' % "|".join(SHARED_FOLDERS))
    for page in chinese.rglob("*.html"):
        up = "../" * (len(page.relative_to(chinese).parts) - 1)
        text = page.read_text(encoding="utf-8")
        shared = link.sub(lambda m: up + "../" + m.group(2) if m.group(1) == up and m.group(2) in same
                          else m.group(0), text)
        if shared != text:
            page.write_text(shared, encoding="utf-8")
    saved = 0
    for name in same:
        saved += (chinese / name).stat().st_size
        (chinese / name).unlink()
    for folder in SHARED_FOLDERS:  # folders the moves emptied
        for path in sorted((chinese / folder).rglob("*"), reverse=True):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    return saved


def merge_build(sphinxopts, require_gpu, driver=None):
    """The final build of a sharded one: SHARD_MERGE=1, so docs/conf.py refuses to run any lesson."""
    env = {"SHARD_MERGE": "1"}
    if require_gpu:
        env["SHARD_REQUIRE_GPU"] = "1"
    if driver:
        env["SHARD_GPU_DRIVER"] = driver
    return sphinx_build(sphinxopts, env)


def record_times():
    """build/lesson-times.json from each lesson's .cost.json: the plan of the next build here."""
    seconds = {n: round(s, 1) for n in lesson_files.lessons(TUTORIALS)
               if (s := lesson_seconds(GALLERY, n)) is not None}
    BUILD.mkdir(exist_ok=True)
    RECORDED_TIMES.write_text(json.dumps({
        "source": "Sphinx-Gallery's run times (.cost.json) of the last build in this tree, on this machine",
        "seconds": seconds}, indent=1, sort_keys=True) + "\n")


def build_here(jobs, sphinxopts):
    """make html: run the stale lessons on `jobs` workers (one per GPU on a GPU box), then merge."""
    gpus = visible_gpus()
    jobs = check_jobs(jobs if jobs is not None else default_jobs(gpus), gpus)
    stale = lesson_files.stale_lessons(TUTORIALS, GALLERY)
    workers = min(jobs, len(stale))
    if workers <= 1:
        say(f"shard_build: {len(stale)} lesson(s) to run: one Sphinx build"
            + (f" ({', '.join(stale)})" if stale else ""))
        code = sphinx_build(sphinxopts)
    else:
        times = read_times(RECORDED_TIMES, COMMITTED_TIMES)
        seconds = estimates(stale, times)
        shards = plan(stale, workers, times)
        say(f"shard_build: {len(stale)} lessons to run on {workers} workers "
            f"({'one GPU each' if gpus else 'the Triton interpreter, on the CPU'}), longest first")
        start = time.perf_counter()
        if SHARDS.exists():  # the workers of an earlier build, however many there were
            shutil.rmtree(SHARDS)
        ran = run_workers(shards, gpus, sphinxopts, seconds)
        for w in ran:
            passed = [n for n in w.names if n not in w.failed()]
            for name in passed:
                replace_lesson_files(w.gallery, GALLERY, name)
            copy_results(w.results, results_dir(), passed)
        failed = report_failures(ran)
        if failed:
            say(f"shard_build: lessons failed: {', '.join(failed)} (the others are kept: the next build runs "
                "only what failed)")
            return 1
        say(f"shard_build: lessons ran in {time.perf_counter() - start:.0f} s on {workers} workers; "
            "merging: one Sphinx build that runs no lesson")
        code = merge_build(sphinxopts, require_gpu=False)  # pages kept from earlier builds stay, as in a plain one
    if code == 0:
        record_times()
    return code


def build_shard(shard, shards, out, sphinxopts):
    """CI: run this runner's share of every lesson (the plan from the committed times, so that every
    runner draws the same one) and leave its files in `out`, laid out as the merge expects."""
    mine = plan(lesson_files.lessons(TUTORIALS), shards, read_times(COMMITTED_TIMES))[shard]
    gpus = visible_gpus()
    say(f"shard_build: shard {shard} of {shards}: {', '.join(mine) or 'no lesson'}")
    seconds = estimates(mine, read_times(COMMITTED_TIMES))
    # Worker number `shard`, so that shards run side by side in one tree do not meet (build/shards/<shard>).
    ran = run_workers([mine], gpus[:1], sphinxopts, seconds, first=shard) if mine else []
    failed = report_failures(ran)
    if failed:
        say(f"shard_build: lessons failed: {', '.join(failed)}")
        return 1
    name, driver = gpu_description(gpus[0]) if gpus else (None, None)
    for old in (out / "docs", out / "build"):  # what an earlier run of this command left there
        if old.exists():
            shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)
    for w in ran:
        for lesson in w.names:
            replace_lesson_files(w.gallery, out / "docs" / "tutorials", lesson)
        copy_results(w.results, out / "build" / "results", w.names)
    (out / "shard.json").write_text(json.dumps(
        {"shard": shard, "shards": shards, "lessons": mine, "gpu": name, "driver": driver}, indent=1) + "\n")
    return 0


def merge_shards(folders, require_gpu, sphinxopts):
    """CI: copy the shards' files into docs/tutorials and build/results, then the merging build."""
    if missing := [str(f) for f in folders if not (Path(f) / "shard.json").is_file()]:
        raise ValueError(f"not a shard's output (no shard.json): {', '.join(missing)}")
    infos = [json.loads((Path(f) / "shard.json").read_text()) for f in folders]
    counts = {info["shards"] for info in infos}
    indices = sorted(info["shard"] for info in infos)
    if len(counts) != 1 or indices != list(range(counts.pop())):
        raise ValueError(f"the shards do not make one whole: shard {indices} of {sorted({i['shards'] for i in infos})}")
    ran = [lesson for info in infos for lesson in info["lessons"]]
    missing = sorted(set(lesson_files.lessons(TUTORIALS)) - set(ran))
    if missing or len(ran) != len(set(ran)):
        raise ValueError(f"the shards ran {sorted(ran)}, not each lesson once (no shard ran: {missing})")
    for folder, info in zip(folders, infos):
        for lesson in info["lessons"]:
            replace_lesson_files(Path(folder) / "docs" / "tutorials", GALLERY, lesson)
        copy_results(Path(folder) / "build" / "results", results_dir(), info["lessons"])
    gpus = sorted({info["gpu"] for info in infos if info["lessons"]}, key=str)
    drivers = sorted({info["driver"] for info in infos if info["lessons"] and info["driver"]})
    if require_gpu and (len(gpus) > 1 or None in gpus):
        raise ValueError(f"the shards ran on {gpus}, not on one model of GPU")
    say(f"shard_build: merging {len(infos)} shards (GPUs: {', '.join(map(str, gpus))}; "
        f"drivers: {', '.join(drivers) or 'none'}): one Sphinx build that runs no lesson")
    return merge_build(sphinxopts, require_gpu, ", ".join(drivers))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--jobs", type=int, help="workers on this box (default: the visible GPUs, or 1 without)")
    parser.add_argument("--shard", type=int, help="CI: run this shard (from 0) of --shards N, into --out")
    parser.add_argument("--shards", type=int)
    parser.add_argument("--out", type=Path, help="CI: where a shard leaves its lessons' files")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="SHARD_OUT",
                        help="CI: merge these shards' outputs and build the site")
    parser.add_argument("--require-gpu", action="store_true",
                        help="with --merge: every lesson page's platform line must name a GPU")
    parser.add_argument("--sphinxopts", default="-W --keep-going", help="options for every Sphinx build")
    args = parser.parse_args(argv)
    sphinxopts = shlex.split(args.sphinxopts)
    try:
        if args.merge:
            return merge_shards(args.merge, args.require_gpu, sphinxopts)
        if args.shard is not None or args.shards is not None or args.out is not None:
            if args.shard is None or not args.shards or args.out is None or not 0 <= args.shard < args.shards:
                parser.error("--shard I needs --shards N (0 <= I < N) and --out DIR")
            return build_shard(args.shard, args.shards, args.out, sphinxopts)
        return build_here(args.jobs, sphinxopts)
    except ValueError as error:
        print(f"shard_build: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
