"""The sharded build (tools/shard_build.py): the plan, the workers' shares of the machine, the guard of the
merging build (docs/conf.py: SHARD_MERGE, SHARD_REQUIRE_GPU), the rerun rule across shards and CI's shard
and merge steps, on copies of the site with tiny lessons; and the real site built by one worker and by
two, which must give the same pages."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser

import pytest
import shard_build
from conftest import ROOT, TUTORIALS, copy_docs_for_other_lessons, sphinx

SEEDED = json.loads((ROOT / "tools" / "lesson-times.json").read_text())["seconds"]
GPU_LINE = "GPU: NVIDIA Fake (torch 0, Triton 0)"
CPU_LINE = "Triton interpreter on CPU (x86_64; torch 0, Triton 0): these timings measure the interpreter, not a GPU"


# -- The plan and the machine --------------------------------------------------------------------------


def makespan(shards, times):
    return max(sum(times[n] for n in shard) for shard in shards)


def test_the_committed_times_name_every_lesson():
    assert sorted(SEEDED) == shard_build.lesson_files.lessons(TUTORIALS)
    assert all(seconds > 0 for seconds in SEEDED.values())


def best_makespan(times, workers):
    """The shortest makespan of any plan, by a search over plans (longest job first, pruned)."""
    jobs, best = sorted(times, reverse=True), [float("inf")]

    def place(i, loads):
        if max(loads) >= best[0]:
            return
        if i == len(jobs):
            best[0] = max(loads)
            return
        for w in sorted(set(range(workers)), key=lambda w: loads[w]):
            if loads[w] in loads[:w]:
                continue  # a worker as loaded as an earlier one gives the same plans
            loads[w] += jobs[i]
            place(i + 1, loads)
            loads[w] -= jobs[i]

    place(0, [0.0] * workers)
    return best[0]


def test_the_plan_puts_the_longest_lesson_first_on_the_least_loaded_worker():
    shards = shard_build.plan(list(SEEDED), 4, SEEDED)
    assert shards == [
        ["14-hopper-backward-gluon", "02-fused-softmax", "01-first-kernel"],
        ["07-fused-attention-v2-backward", "05-fused-attention-v1", "04-tiled-matmul", "09-gluon-primer"],
        ["11-hopper-forward-gluon", "06-fused-attention-v2-forward", "03-long-softmax"],
        ["12-hopper-forward-steps", "08-decode-attention", "10-long-softmax-gluon",
         "13-hopper-forward-profiled"]]
    # Longest-first is within 4/3 - 1/(3 * workers) of the best possible plan (Graham's bound), which a
    # search over every plan finds here.
    assert makespan(shards, SEEDED) <= (4 / 3 - 1 / 12) * best_makespan(SEEDED.values(), 4)
    assert [len(s) for s in shard_build.plan(list(SEEDED), 1, SEEDED)] == [len(SEEDED)]
    assert shard_build.plan(list(SEEDED), 1, SEEDED)[0][0] == max(SEEDED, key=SEEDED.get)


def test_the_plan_is_deterministic_and_every_lesson_runs_once():
    names = list(SEEDED)
    for workers in range(1, 13):
        shards = shard_build.plan(names, workers, SEEDED)
        assert shard_build.plan(list(reversed(names)), workers, dict(reversed(SEEDED.items()))) == shards
        assert sorted(n for s in shards for n in s) == sorted(names)
        assert len(shards) == workers
    # Equal times go by name; a lesson no file knows counts as the mean of those known.
    assert shard_build.plan(["b", "a", "c"], 2, {}) == [["a", "c"], ["b"]]
    assert shard_build.estimates(["a", "b", "new"], {"a": 10.0, "b": 30.0}) == {"a": 10.0, "b": 30.0, "new": 20.0}
    assert shard_build.estimates(["new"], {}) == {"new": shard_build.UNKNOWN_SECONDS}


def test_recorded_times_come_before_the_committed_ones(tmp_path):
    recorded, committed = tmp_path / "recorded.json", tmp_path / "committed.json"
    committed.write_text(json.dumps({"source": "x", "seconds": {"a": 1.0, "b": 2.0}}))
    assert shard_build.read_times(recorded, committed) == {"a": 1.0, "b": 2.0}
    recorded.write_text(json.dumps({"source": "y", "seconds": {"b": 5.0}}))
    assert shard_build.read_times(recorded, committed) == {"a": 1.0, "b": 5.0}


def test_workers_never_outnumber_the_gpus():
    assert shard_build.default_jobs([]) == 1
    assert shard_build.default_jobs(["GPU-a", "GPU-b"]) == 2
    assert shard_build.check_jobs(4, []) == 4, "without a GPU any number of interpreter workers"
    assert shard_build.check_jobs(2, ["GPU-a", "GPU-b"]) == 2
    with pytest.raises(ValueError, match="never share a GPU"):
        shard_build.check_jobs(3, ["GPU-a", "GPU-b"])
    with pytest.raises(ValueError, match="at least one"):
        shard_build.check_jobs(0, [])


@pytest.mark.parametrize("cores, workers", [(range(16), 4), (range(16), 3), (range(2), 2), (range(8, 14), 4)])
def test_each_worker_gets_its_own_share_of_the_cores(cores, workers):
    shares = shard_build.core_shares(set(cores), workers)
    assert len(shares) == workers and all(shares)
    assert sorted(c for share in shares for c in share) == sorted(cores), "disjoint, and none left out"
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert shard_build.core_shares({0, 1}, 3) == [{0}, {1}, {0}], "more workers than cores: they share"
    assert shard_build.ranges({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch, tmp_path):
    listing = ("GPU 0: NVIDIA H100 (UUID: GPU-aaa)\nGPU 1: NVIDIA H100 (UUID: GPU-bbb)\n"
               "  MIG 1g.10gb Device 0: (UUID: MIG-c)\n")
    monkeypatch.setattr(shard_build.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(shard_build, "nvidia_smi", lambda *args: listing)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert shard_build.visible_gpus() == ["GPU-aaa", "GPU-bbb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert shard_build.visible_gpus() == ["1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert shard_build.visible_gpus() == []
    monkeypatch.setattr(shard_build, "nvidia_smi", lambda *args: "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert shard_build.visible_gpus() == []
    # A driver but no nvidia-smi: CUDA counts them (in a child process); no driver: no GPU.
    monkeypatch.setattr(shard_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(shard_build, "cuda_device_count", lambda: 2)
    monkeypatch.setattr(shard_build, "NVIDIA_DRIVER_GPUS", tmp_path)
    assert shard_build.visible_gpus() == ["0", "1"]
    monkeypatch.setattr(shard_build, "NVIDIA_DRIVER_GPUS", tmp_path / "none")
    assert shard_build.visible_gpus() == []


def test_the_guard_knows_the_platform_lines_stepkit_prints():
    """docs/conf.py's SHARD_REQUIRE_GPU reads the line stepkit.describe_platform() prints: "GPU: <name>
    (...)" on a GPU, and this interpreter's line here; the tiny lessons below print the same shapes."""
    import inspect

    import stepkit

    assert stepkit.describe_platform().startswith("Triton interpreter on CPU (")
    assert CPU_LINE.startswith("Triton interpreter on CPU (") and GPU_LINE.startswith("GPU: ")
    assert 'f"GPU: {torch.cuda.get_device_name()} (' in inspect.getsource(stepkit.describe_platform)


# -- Copies of the site with tiny lessons ---------------------------------------------------------------


def tiny_site(root, lessons):
    """A copy of the site whose lessons are {stem: (platform line or None, [stems it loads])}; each lesson
    waits 0.2 s, prints its line and appends to $RAN_TXT where it ran (its results folder: a worker's or
    the build's own), on which GPU and on which cores. The lessons are the same files in every copy, as they are on
    every machine that builds one commit."""
    copy_docs_for_other_lessons(root / "docs")
    (root / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "shard_build.py", root / "tools")
    (root / "tools" / "lesson-times.json").write_text(json.dumps(
        {"source": "test", "seconds": {stem: 10.0 * (i + 1) for i, stem in enumerate(lessons)}}))
    tutorials = root / "tutorials"
    tutorials.mkdir()
    shutil.copy(TUTORIALS / "GALLERY_HEADER.rst", tutorials)
    (tutorials / "stepkit.py").write_text("def load_lesson(stem):\n    pass\n")
    (tutorials / "tuned_tables.json").write_text("{}\n")
    for stem, (line, loads) in lessons.items():
        code = [f'"""\n{stem}\n{"=" * len(stem)}\n"""', "import os", "import time", "", "import stepkit as kit", ""]
        code += [f'kit.load_lesson("{name}")' for name in loads]
        code += ["time.sleep(0.2)"]
        code += [f"print({line!r})"] if line else []
        code += ["with open(os.environ['RAN_TXT'], 'a') as ran:",
                 f"    print('{stem}', os.environ['TUTORIAL_RESULTS_DIR'], os.environ.get('CUDA_VISIBLE_DEVICES'),",
                 "          sorted(os.sched_getaffinity(0)), file=ran)"]
        (tutorials / f"{stem}.py").write_text("\n".join(code) + "\n")
    return root


def ran(root):
    """[(lesson, where it ran, its CUDA_VISIBLE_DEVICES, its cores)] since the last call."""
    path = root / "ran.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    path.write_text("")
    return sorted(tuple(line.split(" ", 3)) for line in lines)


def shard_build_in(root, *args, **env):
    # The English pages alone: these lessons have no Chinese catalogs (test_edition.py builds the real site's).
    env = dict(os.environ, RAN_TXT=str(root / "ran.txt"), DOCS_CHINESE="0", **env)
    result = subprocess.run([sys.executable, str(root / "tools" / "shard_build.py"), *args], cwd=root,
                            capture_output=True, text=True, env=env, timeout=900)
    return result, result.stdout + result.stderr


def execution_times(root):
    """{lesson: seconds} from the Computation times page's source, as the final build wrote it."""
    text = (root / "docs" / "sg_execution_times.rst").read_text()
    rows = re.findall(r":ref:`sphx_glr_tutorials_([\w.-]+)\.py`.*\n\s+- (\d\d):(\d\d)\.(\d\d\d)", text)
    return {stem: int(m) * 60 + int(s) + int(ms) / 1000 for stem, m, s, ms in rows}


TINY = {"01-a": (GPU_LINE, []), "02-b": (GPU_LINE, ["01-a"]), "03-c": (GPU_LINE, []), "04-d": (GPU_LINE, [])}


def test_make_html_with_two_workers_runs_each_lesson_once_in_a_worker_and_merges(tmp_path):
    root = tiny_site(tmp_path, TINY)
    result, output = shard_build_in(root, "--jobs", "2")
    assert result.returncode == 0, output[-5000:]
    assert "4 lessons to run on 2 workers" in output
    for stem in TINY:
        assert re.search(rf"{stem} ran on worker \d", output), output
    runs = ran(root)
    assert [stem for stem, *_ in runs] == list(TINY), "each lesson once, none in the merging build"
    where = {stem: place for stem, place, *_ in runs}
    assert {where[s] for s in TINY} == {str(root / "build" / "shards" / n / "results") for n in "01"}
    if len(os.sched_getaffinity(0)) >= 2:
        cores = {place: c for _, place, _, c in runs}
        assert len(set(cores.values())) == 2, f"the workers shared cores: {cores}"
    for stem in TINY:
        assert (root / "build" / "html" / "tutorials" / f"{stem}.html").is_file()
        assert (root / "docs" / "tutorials" / f"{stem}.needs.json").is_file()
        assert GPU_LINE in (root / "build" / "html" / "tutorials" / f"{stem}.html").read_text()
    times = execution_times(root)
    assert sorted(times) == list(TINY) and min(times.values()) >= 0.2, times
    recorded = json.loads((root / "build" / "lesson-times.json").read_text())["seconds"]
    assert sorted(recorded) == list(TINY) and min(recorded.values()) >= 0.2

    # The rerun rule holds across shards: a changed stepkit reruns every lesson, in the workers.
    (root / "tutorials" / "stepkit.py").write_text("def load_lesson(stem):\n    return None\n")
    result, output = shard_build_in(root, "--jobs", "2")
    assert result.returncode == 0, output[-5000:]
    assert [stem for stem, place, *_ in ran(root) if "shards" in place] == list(TINY)

    # Nothing changed: nothing runs, and one plain build makes the site.
    result, output = shard_build_in(root, "--jobs", "2")
    assert result.returncode == 0, output[-5000:]
    assert "0 lesson(s) to run: one Sphinx build" in output
    assert ran(root) == []


FAKE_NVIDIA_SMI = """#!/bin/sh
# Two GPUs, as nvidia-smi lists them; the lessons here never touch CUDA.
case "$*" in
  -L) echo "GPU 0: NVIDIA Fake (UUID: GPU-00000000-0000-0000-0000-000000000000)"
      echo "GPU 1: NVIDIA Fake (UUID: GPU-11111111-1111-1111-1111-111111111111)";;
  *query-gpu=name,driver_version*) echo "NVIDIA Fake, 580.1";;
  *query-gpu=driver_version*) echo "580.1";;
esac
"""


def test_on_a_gpu_box_each_worker_has_a_gpu_of_its_own(tmp_path):
    root = tiny_site(tmp_path, TINY)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    result, output = shard_build_in(root, "--jobs", "3", PATH=path)
    assert result.returncode == 2 and "JOBS=3, but 2 GPUs are visible: lessons never share a GPU" in output
    assert ran(root) == []
    result, output = shard_build_in(root, PATH=path)  # as many workers as GPUs
    assert result.returncode == 0, output[-5000:]
    assert "4 lessons to run on 2 workers (one GPU each)" in output
    runs = ran(root)
    assert [stem for stem, *_ in runs] == list(TINY)
    gpus = {place: gpu for _, place, gpu, _ in runs}
    assert sorted(gpus.values()) == ["GPU-00000000-0000-0000-0000-000000000000",
                                     "GPU-11111111-1111-1111-1111-111111111111"], gpus
    # A CI runner's shard names its GPU and driver for the merge.
    result, output = shard_build_in(root, "--shard", "0", "--shards", "2", "--out", str(tmp_path / "out"), PATH=path)
    assert result.returncode == 0, output[-5000:]
    info = json.loads((tmp_path / "out" / "shard.json").read_text())
    assert (info["gpu"], info["driver"]) == ("NVIDIA Fake", "580.1")
    assert {gpu for _, _, gpu, _ in ran(root)} == {"GPU-00000000-0000-0000-0000-000000000000"}


def test_a_failing_lesson_fails_the_sharded_build_by_name(tmp_path):
    lessons = {**TINY}
    root = tiny_site(tmp_path, lessons)
    (root / "tutorials" / "03-c.py").write_text(
        '"""\n03-c\n====\n"""\n\nraise RuntimeError("lesson 03-c is broken on purpose")\n')
    result, output = shard_build_in(root, "--jobs", "2")
    assert result.returncode == 1
    assert "lessons failed: 03-c" in output
    assert "lesson 03-c is broken on purpose" in output, "the end of the worker's log"
    # The lessons that passed are kept: the next build runs only the one that failed.
    (root / "tutorials" / "03-c.py").write_text(f'"""\n03-c\n====\n"""\n\nprint({GPU_LINE!r})\n')
    ran(root)
    result, output = shard_build_in(root, "--jobs", "2")
    assert result.returncode == 0, output[-5000:]
    assert "1 lesson(s) to run: one Sphinx build (03-c)" in output


def merge_build(root, **env):
    """The final build of a sharded one, straight from Sphinx, with the guard's variables set."""
    env = dict(os.environ, TUTORIAL_RESULTS_DIR=str(root / "results"), RAN_TXT=str(root / "ran.txt"), **env)
    return sphinx(root, root / "build", env=env)


def test_the_merging_build_runs_no_lesson_and_requires_gpu_lines(tmp_path):
    lessons = {"01-a": (GPU_LINE, []), "02-b": (GPU_LINE, ["01-a"]), "03-c": (CPU_LINE, []), "04-d": (None, [])}
    root = tiny_site(tmp_path, lessons)
    first = merge_build(root)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert [stem for stem, *_ in ran(root)] == list(lessons)

    # Every lesson current: the merging build runs none and passes.
    result = merge_build(root, SHARD_MERGE="1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert ran(root) == []

    # A lesson whose source changed would run: the build stops before Sphinx-Gallery, naming it.
    lesson = root / "tutorials" / "03-c.py"
    lesson.write_text(lesson.read_text() + "# changed\n")
    result = merge_build(root, SHARD_MERGE="1")
    assert result.returncode != 0
    assert "these lessons would run on the merge machine: 03-c." in result.stderr, result.stderr[-3000:]
    assert ran(root) == []
    lesson.write_text(lesson.read_text().removesuffix("# changed\n"))

    # Every page must name a GPU: 03-c printed the interpreter's line, 04-d none.
    result = merge_build(root, SHARD_MERGE="1", SHARD_REQUIRE_GPU="1")
    assert result.returncode != 0
    assert "these lesson pages did not run on a GPU: 03-c (Triton interpreter on CPU" in result.stderr
    assert "04-d (printed no platform line)" in result.stderr
    assert "01-a" not in result.stderr.split("did not run on a GPU")[1]
    assert ran(root) == []

    # The rerun rule: a changed stepkit would run every lesson again; the guard names them all.
    (root / "tutorials" / "stepkit.py").write_text("def load_lesson(stem):\n    return None\n")
    result = merge_build(root, SHARD_MERGE="1")
    assert result.returncode != 0
    assert "would run on the merge machine: 01-a, 02-b, 03-c, 04-d." in result.stderr, result.stderr[-3000:]
    assert ran(root) == []


def test_ci_shards_merge_on_a_machine_that_runs_no_lesson(tmp_path):
    # Three runners, here three shards side by side in one tree (each in build/shards/<shard>).
    sources = tiny_site(tmp_path / "runner", TINY)
    outs = [tmp_path / f"shard-{shard}" for shard in range(3)]
    env = dict(os.environ, RAN_TXT=str(sources / "ran.txt"))
    runs = [subprocess.Popen([sys.executable, str(sources / "tools" / "shard_build.py"), "--shard", str(shard),
                              "--shards", "3", "--out", str(out)], cwd=sources, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
            for shard, out in enumerate(outs)]
    for run in runs:
        output = run.communicate(timeout=600)[0]
        assert run.returncode == 0, output[-5000:]
    infos = [json.loads((out / "shard.json").read_text()) for out in outs]
    assert sorted(n for info in infos for n in info["lessons"]) == list(TINY)
    assert [info["shard"] for info in infos] == [0, 1, 2] and {info["shards"] for info in infos} == {3}
    # Committed times 10, 20, 30, 40 s: 04-d, then 03-c, then 02-b and 01-a on the least loaded.
    assert [info["lessons"] for info in infos] == [["04-d"], ["03-c"], ["02-b", "01-a"]]
    for info, out in zip(infos, outs):
        for stem in info["lessons"]:
            for suffix in (".rst", ".py.md5", ".cost.json", ".needs.json", ".ipynb"):
                assert (out / "docs" / "tutorials" / f"{stem}{suffix}").is_file()
    assert sorted(stem for stem, *_ in ran(sources)) == list(TINY)

    # The merge machine: a fresh checkout, where lessons would run on the CPU if the guard let them, and
    # a Python with Sphinx but none of the lessons' packages (docs.yml installs none there).
    merger = tiny_site(tmp_path / "merger", TINY)
    missing = tmp_path / "missing-packages"
    missing.mkdir()
    for package in ("torch", "triton", "matplotlib", "pandas", "stepkit"):
        (missing / f"{package}.py").write_text(f"raise ImportError('the merge machine has no {package}')\n")
    result, output = shard_build_in(merger, "--merge", *map(str, outs[:2]), "--require-gpu")
    assert result.returncode == 2 and "do not make one whole" in output
    result, output = shard_build_in(merger, "--merge", *map(str, outs), "--require-gpu")
    assert result.returncode == 2 and "not on one model of GPU" in output, "these shards ran on the CPU"
    # As GPU runners of two models would leave them, then of one.
    for info, out, (gpu, driver) in zip(infos, outs, [("NVIDIA H100", "580.1"), ("NVIDIA A100", "580.1")] * 2):
        (out / "shard.json").write_text(json.dumps(dict(info, gpu=gpu, driver=driver)))
    result, output = shard_build_in(merger, "--merge", *map(str, outs), "--require-gpu")
    assert result.returncode == 2 and "not on one model of GPU" in output
    for info, out in zip(infos, outs):
        (out / "shard.json").write_text(json.dumps(dict(info, gpu="NVIDIA Fake", driver="580.1")))
    result, output = shard_build_in(merger, "--merge", *map(str, outs), "--require-gpu", PYTHONPATH=str(missing))
    assert result.returncode == 0, output[-5000:]
    assert "drivers: 580.1" in output
    assert ran(merger) == []
    times = execution_times(merger)
    assert sorted(times) == list(TINY) and min(times.values()) >= 0.2, "Sphinx-Gallery's times survive the merge"
    for stem in TINY:
        page = (merger / "build" / "html" / "tutorials" / f"{stem}.html").read_text()
        assert GPU_LINE in page


def test_the_performance_page_names_the_driver_the_shards_ran_on(tmp_path):
    """The merge machine has no GPU: SHARD_GPU_DRIVER stands in for its nvidia-smi on the performance page."""
    root = tiny_site(tmp_path, TINY)
    script = "import runpy; runpy.run_path('docs/conf.py'); import perf_summary; print(perf_summary.gpu_driver())"
    for env, driver in [({"SHARD_GPU_DRIVER": "580.1"}, "580.1"), ({}, None)]:
        result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                                env=dict(os.environ, TUTORIAL_RESULTS_DIR=str(root / "results"), **env))
        assert result.returncode == 0, result.stderr
        if driver:
            assert result.stdout.strip() == driver
        else:
            assert result.stdout.strip() != "580.1"


# -- The real site, by one worker and by two -------------------------------------------------------------


class Outputs(HTMLParser):
    """Counts a page's blocks of printed output (Sphinx-Gallery's class)."""

    def __init__(self):
        super().__init__()
        self.outputs = 0

    def handle_starttag(self, tag, attrs):
        self.outputs += "sphx-glr-script-out" in (dict(attrs).get("class") or "").split()


def site_files(html):
    """The built site's pages and the names of its downloads and images (Sphinx puts each download in a
    folder named by a hash of its path)."""
    pages = sorted(str(p.relative_to(html)) for p in html.rglob("*.html"))
    downloads = sorted(p.name for p in (html / "_downloads").rglob("*") if p.is_file())
    images = sorted(p.name for p in (html / "_images").glob("*"))
    return pages, downloads, images


@pytest.mark.slow
def test_two_workers_build_the_same_site_as_one(tmp_path):
    """`make html JOBS=2` against `make html JOBS=1`, each from a fresh copy of the repository's sources
    (slow: two interpreter builds of the whole site). Their wall times are printed, not asserted."""
    trees, seconds = {}, {}
    for jobs in (1, 2):
        root = tmp_path / f"jobs-{jobs}"
        shutil.copytree(ROOT / "docs", root / "docs",
                        ignore=shutil.ignore_patterns("tutorials", "sg_execution_times.rst", "__pycache__"))
        shutil.copytree(TUTORIALS, root / "tutorials", ignore=shutil.ignore_patterns("__pycache__"))
        (root / "tools").mkdir()
        for name in ("shard_build.py", "lesson-times.json"):
            shutil.copy(ROOT / "tools" / name, root / "tools")
        start = time.perf_counter()
        result, output = shard_build_in(root, "--jobs", str(jobs))
        seconds[jobs] = time.perf_counter() - start
        assert result.returncode == 0, output[-8000:]
        assert ("on 2 workers" in output) == (jobs == 2), output[-3000:]
        trees[jobs] = root
    print(f"\nthe real site on the CPU: JOBS=1 {seconds[1]:.0f} s, JOBS=2 {seconds[2]:.0f} s "
          f"({seconds[2] / seconds[1]:.2f} of JOBS=1)")
    one, two = (site_files(trees[j] / "build" / "html") for j in (1, 2))
    assert one[0] == two[0], "the same pages"
    assert one[1] == two[1], "the same downloads"
    assert one[2] == two[2], "the same images"
    lessons = shard_build.lesson_files.lessons(TUTORIALS)
    for root in trees.values():
        assert sorted(execution_times(root)) == lessons and min(execution_times(root).values()) > 0
        results = sorted(p.stem for p in (root / "build" / "results").glob("*.json"))
        assert results == sorted(p.stem for p in (trees[1] / "build" / "results").glob("*.json"))
        for stem in lessons:
            parser = Outputs()
            parser.feed((root / "build" / "html" / "tutorials" / f"{stem}.html").read_text())
            assert parser.outputs > 0, f"{root.name}: {stem} has no output"
        performance = (root / "build" / "html" / "performance.html").read_text()
        assert all(f"tutorials/{stem}.html" in performance for stem in results)
