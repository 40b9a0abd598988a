"""tools/tune.py on the CPU: every sweep end to end under the Triton interpreter, with a stand-in timer, one
point of its grid and a temporary tables file (never the committed one; Gluon's branches skip themselves
there); the lesson names the tool reads; how it merges into the tables file, resumes an interrupted sweep,
and writes what stepkit.tuned_table reads back."""

import dataclasses
import json
import random

import lessons
import pytest
import stepkit as kit
import torch
import tune

COMMITTED = tune.TABLES_FILE
# The stand-in timer and the one-point grids are the CPU's: on a GPU the sweeps run their Gluon branches
# and real sizes, and are checked by running them (python3 tools/tune.py attention --grid small --out ...).
pytestmark = pytest.mark.skipif(kit.ON_GPU, reason="tools/tune.py's CPU tests; on a GPU, run the tool itself")


@pytest.fixture(autouse=True)
def committed_table_untouched():
    """No test here writes the committed table, and none leaves lesson 06's launchers patched."""
    before = COMMITTED.read_bytes()
    V2 = lessons.load("06-fused-attention-v2-forward")
    configs, tuned_case = dict(V2.TUNED_CONFIGS), V2.tuned_case
    yield
    assert COMMITTED.read_bytes() == before
    assert V2.TUNED_CONFIGS == configs and V2.tuned_case is tuned_case


class StandIn(tune.Timing):
    """Runs every call it is asked to time once (so the lessons' kernels run, under the interpreter), and
    gives it a scripted time instead: times(key) in ms, back to back alone or (back to back, GPU time);
    1 ms where not given. Records what it timed, in order."""

    def __init__(self, times=None):
        self.times = times or (lambda key: 1.0)
        self.timed = []

    def measured(self, key):
        ms = self.times(key)
        b2b, gpu = ms if isinstance(ms, tuple) else (ms, None)
        measured = kit.Measured()
        measured.add({"b2b": b2b, "gpu": gpu, "gpu_method": "stand-in" if gpu else None})
        self.timed.append(key)
        return measured

    def calls(self, timers):
        found = {}
        for key, timer in timers.items():
            with timer.context():
                timer.make()()
            found[key] = self.measured(key)
        return found

    def kernel_ms(self, fn, kernel):
        fn()
        return self.measured(kernel).b2b[0]


def run_tool(out, *argv, timing=None):
    tune.main([*argv, "--grid", "small", "--out", str(out)], timing=timing or StandIn())
    return json.loads(out.read_text()) if out.exists() else None


def progress_files(folder):
    return sorted(p.name for p in folder.glob(".*progress*"))


def fixture_tables(path, tables):
    path.write_text(tune.tables_text(tables))


def table(tool, rows, **measured_on):
    return {"tool": tool, "measured_on": {**tune.platform(), "date": "2026-01-01", **measured_on}, "rows": rows}


# -- The names the tool reads --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", tune.LESSON_NAMES)
def test_every_lesson_and_name_the_tool_uses_exists(stem):
    module = lessons.load(stem)
    missing = [name for name in tune.LESSON_NAMES[stem] if not hasattr(module, name)]
    assert not missing, f"tools/tune.py needs {stem}.{', '.join(missing)}"


def test_the_tool_reads_only_the_names_it_lists():
    with pytest.raises(AttributeError, match="LESSON_NAMES does not list"):
        tune.Lesson("02-fused-softmax").naive_softmax
    V2 = lessons.load("06-fused-attention-v2-forward")
    assert isinstance(V2.TUNED_CONFIGS, dict) and callable(V2.tuned_case)  # the sweep sets and patches these


# -- Every sweep, end to end -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sweep, says", [("softmax", "current"), ("split-row", "online")])
def test_the_sweeps_that_print_run_end_to_end(sweep, says, tmp_path, capsys):
    assert run_tool(tmp_path / "tables.json", sweep) is None  # they write no table
    assert says in capsys.readouterr().out
    assert progress_files(tmp_path) == []


def test_the_shared_row_sweep_writes_its_table(tmp_path, capsys):
    tables = run_tool(tmp_path / "tables.json", "shared-row")
    assert list(tables) == ["shared-row-chunks"]
    written = tables["shared-row-chunks"]
    assert written["tool"] == "tools/tune.py shared-row --grid small"
    assert written["measured_on"] == {**tune.platform(), "date": written["measured_on"]["date"]}
    # The Gluon kernel needs a Hopper GPU: under the interpreter lesson 03's registers kernel is the choice.
    assert written["rows"] == [{"dtype": "float32", "N": 1024, "chunk": None}]
    assert "lesson 10's kernel skipped" in capsys.readouterr().out
    assert progress_files(tmp_path) == []


def test_the_attention_sweep_writes_tiles_and_paths(tmp_path):
    timing = StandIn()
    tables = run_tool(tmp_path / "tables.json", "attention", timing=timing)
    assert list(tables) == ["attention-tiles", "forward-paths", "backward-paths"]
    for written in tables.values():
        assert written["tool"] == "tools/tune.py attention --grid small"
    shapes = tune.candidate_tiles(tune.GRIDS["small"], 16)
    tiles = {row["kernel"]: row["tile"] for row in tables["attention-tiles"]["rows"]}
    assert set(tiles) == set(tune.TILE_KERNELS)
    for kernel, tile in tiles.items():
        assert tuple(tile) in shapes["fwd" if kernel == "fwd" else "bwd"]
    # No Gluon kernel under the interpreter: lessons 06 and 07's paths, and lesson 05's peer timed beside them.
    (forward,) = tables["forward-paths"]["rows"]
    assert {key: forward[key] for key in ("D", "causal", "N", "path", "captured")} == {
        "D": 16, "causal": False, "N": 64, "path": "portable", "captured": "portable"}  # no GPU time: the eager pick
    assert list(forward["ms"]) == ["portable"] and forward["ms"]["portable"]["gpu"] is None
    assert forward["ms"]["portable"]["b2b"] > 0
    backward = tables["backward-paths"]["rows"][0]
    assert backward["path"] in ("two-pass", "atomic") and backward["captured"] == backward["path"]
    assert set(backward["ms"]) == {"two-pass", "atomic"}
    assert {("SDPA math", "fwd"), ("SDPA math", "bwd")} <= set(timing.timed)
    assert timing.timed.count("attn_fwd_kernel") == len(shapes["fwd"])  # every candidate tile, once
    assert progress_files(tmp_path) == []


def paths_fixture(path):
    """A tables file as the attention sweep leaves it, with a second length (128) besides the grid's (64)."""
    tiles = [{"kernel": kernel, "D": 16, "causal": False, "N": N, "tile": [64, 64, 4, 3]}
             for kernel in tune.TILE_KERNELS for N in (64, 128)]
    paths = {mode: [{"D": 16, "causal": False, "N": N, "path": path} for N in (64, 128)]
             for mode, path in (("forward", "portable"), ("backward", "atomic"))}
    fixture_tables(path, {"attention-tiles": table("tools/tune.py attention", tiles),
                          "forward-paths": table("tools/tune.py attention", paths["forward"]),
                          "backward-paths": table("tools/tune.py attention", paths["backward"])})


def test_the_paths_only_sweep_replaces_the_paths_at_its_lengths(tmp_path):
    out = tmp_path / "tables.json"
    paths_fixture(out)
    before = json.loads(out.read_text())
    # Back to back, two-pass is 2% cheaper but its host paces it (GPU time 0.5 of 1.0 ms); atomic is paced by
    # the GPU: within PATH_TIED, the path the host paces least.
    times = {("two-pass", "bwd"): (1.0, 0.5), ("atomic", "bwd"): (1.02, 1.02)}
    tables = run_tool(out, "attention-paths", "64", timing=StandIn(lambda key: times.get(key, (1.0, 1.0))))
    assert tables["attention-tiles"] == before["attention-tiles"]
    backward = tables["backward-paths"]
    # Replayed from a CUDA graph the host's pace is gone: by GPU time two-pass is twice as fast.
    ms = {"two-pass": {"gpu": 0.5, "b2b": 1.0}, "atomic": {"gpu": 1.02, "b2b": 1.02}}
    assert backward["rows"] == [{"D": 16, "causal": False, "N": 64, "path": "atomic", "captured": "two-pass",
                                 "ms": ms},
                                before["backward-paths"]["rows"][1]]  # N = 128 kept, as it was written
    assert backward["tool"] == ("tools/tune.py attention-paths 64 --grid small (D = 16; causal = False; N = 64); "
                                "tools/tune.py attention (the rest)")


def test_the_paths_only_sweep_refuses_lengths_the_tables_do_not_have(tmp_path):
    out = tmp_path / "tables.json"
    with pytest.raises(SystemExit, match="has no table 'attention-tiles'"):
        run_tool(out, "attention-paths", "64")
    paths_fixture(out)
    with pytest.raises(SystemExit, match=r"buckets \(64, 128\), got \[1000\]"):
        run_tool(out, "attention-paths", "1000")
    with pytest.raises(SystemExit, match=r"got \[\]"):
        run_tool(out, "attention-paths")


def test_the_command_line_refuses_what_it_cannot_do(tmp_path, capsys):
    for argv in (["shared-row", "--grid", "small"],  # one point into the committed table
                 ["softmax", "1024", "--grid", "small", "--out", str(tmp_path / "t.json")],
                 *([["attention", "--out", str(tmp_path / "t.json")]] if not kit.ON_GPU else [])):
        with pytest.raises(SystemExit):
            tune.main(argv, timing=StandIn())
    assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


# -- Merging, resuming, reading back -----------------------------------------------------------------------------------


def test_a_sweep_replaces_its_own_cases_and_keeps_everything_else(tmp_path):
    out = tmp_path / "tables.json"
    other = table("tools/tune.py attention", [{"D": 64, "causal": True, "N": 1024, "path": "gluon"}])
    fixture_tables(out, {"forward-paths": other, "shared-row-chunks": table("tools/tune.py shared-row", [
        {"dtype": "bfloat16", "N": 65536, "chunk": 8192}, {"dtype": "float32", "N": 1024, "chunk": 4096}])})
    tables = run_tool(out, "shared-row")
    assert tables["forward-paths"] == other
    chunks = tables["shared-row-chunks"]
    assert chunks["rows"] == [{"dtype": "bfloat16", "N": 65536, "chunk": 8192},
                              {"dtype": "float32", "N": 1024, "chunk": None}]
    assert chunks["tool"] == ("tools/tune.py shared-row --grid small (dtype = float32; N = 1024); "
                              "tools/tune.py shared-row (the rest)")


def test_a_sweep_refuses_to_mix_its_rows_with_another_gpus(tmp_path):
    out = tmp_path / "tables.json"
    rows = [{"dtype": "bfloat16", "N": 65536, "chunk": 8192}]
    fixture_tables(out, {"shared-row-chunks": table("tools/tune.py shared-row", rows, gpu="Another GPU")})
    before = out.read_text()
    with pytest.raises(SystemExit, match="would mix the two"):
        run_tool(out, "shared-row")
    assert out.read_text() == before
    # Where the sweep measures every case of the table again, nothing is mixed: the table is replaced.
    fixture_tables(out, {"shared-row-chunks": table("tools/tune.py shared-row", [
        {"dtype": "float32", "N": 1024, "chunk": 4096}], gpu="Another GPU")})
    assert run_tool(out, "shared-row")["shared-row-chunks"]["measured_on"]["gpu"] == tune.platform()["gpu"]


class Interrupted(StandIn):
    """Stops the sweep (as Ctrl-C would) when asked to time its second case."""

    def calls(self, timers):
        if self.timed:
            raise KeyboardInterrupt
        return super().calls(timers)


def test_an_interrupted_sweep_keeps_its_finished_cases_and_resumes(tmp_path):
    out = tmp_path / "tables.json"
    grid = dataclasses.replace(tune.GRIDS["small"], shared_lengths=(1024, 2048))
    command = "tools/tune.py shared-row --grid two-lengths"
    with pytest.raises(KeyboardInterrupt):
        tune.tune_shared_row(tune.Run(out, grid, Interrupted(), command))
    rows = json.loads(out.read_text())["shared-row-chunks"]["rows"]
    assert rows == [{"dtype": "float32", "N": 1024, "chunk": None}]  # written as soon as measured
    assert len(progress_files(tmp_path)) == 1
    again = StandIn()
    tune.tune_shared_row(tune.Run(out, grid, again, command))
    assert again.timed == [None]  # lesson 03's kernel at N = 2048 alone: N = 1024 was done
    assert [row["N"] for row in json.loads(out.read_text())["shared-row-chunks"]["rows"]] == [1024, 2048]
    assert progress_files(tmp_path) == []
    # Another grid (or command, GPU, versions) starts over; so does --restart.
    with pytest.raises(KeyboardInterrupt):
        tune.tune_shared_row(tune.Run(out, grid, Interrupted(), command))
    fresh = StandIn()
    tune.tune_shared_row(tune.Run(out, grid, fresh, command, restart=True))
    assert fresh.timed == [None, None]


def test_what_the_tool_writes_reads_back_through_stepkit(tmp_path, monkeypatch):
    out = tmp_path / "tuned_tables.json"
    paths_fixture(out)
    run_tool(out, "shared-row")
    monkeypatch.setattr(kit, "HERE", tmp_path)  # where stepkit.tuned_table looks
    assert kit.tuned_table("shared-row-chunks") == json.loads(out.read_text())["shared-row-chunks"]
    assert kit.tuned_table("backward-paths")["rows"][1]["path"] == "atomic"


def test_the_tables_file_is_written_whole_in_its_own_layout(tmp_path):
    # The committed file is in the layout the tool writes: one line per row, so a sweep's diff is its rows.
    committed = COMMITTED.read_text()
    assert tune.tables_text(tune.read_tables(COMMITTED)) == committed
    out = tmp_path / "tables.json"
    tune.write_atomically(out, committed)
    tune.write_atomically(out, committed)  # over an existing file
    assert out.read_text() == committed and oct(out.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == ["tables.json"]  # no temporary file left


# -- Choosing -------------------------------------------------------------------------------------------------------


def test_the_sweep_breaks_near_ties_between_paths_by_host_time():
    # The case that went wrong: Gluon 3% cheaper, its host time almost its whole cost.
    cost, host = {"two-pass": 0.328, "gluon": 0.318, "atomic": 0.406}, {"two-pass": 0.231, "gluon": 0.311,
                                                                      "atomic": 0.273}
    assert tune.steadiest_of_the_fastest(cost, host) == "two-pass"
    assert tune.steadiest_of_the_fastest(cost, host, tied=0.0) == "gluon"  # no tie: the cheapest
    # A clear win is kept whatever it asks of the host; equal host times fall back to the cost.
    assert tune.steadiest_of_the_fastest({"a": 1.0, "b": 1.2}, {"a": 0.9, "b": 0.1}) == "a"
    assert tune.steadiest_of_the_fastest({"a": 1.01, "b": 1.0}, {"a": 0.0, "b": 0.0}) == "b"


def test_the_host_pace_is_what_back_to_back_adds_to_gpu_time():
    def measured(b2b, gpu):
        m = kit.Measured()
        for b, g in zip(b2b, gpu or [None] * len(b2b)):
            m.add({"b2b": b, "gpu": g, "gpu_method": "CUDA graph" if g else None})
        return m
    assert tune.host_excess_ms(measured([0.5, 0.4], [0.3, 0.25])) == pytest.approx(0.15)
    assert tune.host_excess_ms(measured([0.3], [0.31])) == 0.0  # paced by the GPU
    assert tune.host_excess_ms(measured([0.3], None)) == 0.0  # the interpreter: no GPU time
    assert tune.best_ms(measured([0.5], [0.3])) == 0.3 and tune.best_ms(measured([0.5, 0.4], None)) == 0.4


def test_the_sweep_keeps_every_bucket_within_a_tie_of_its_fastest_with_fewer_configurations():
    # One configuration within the tie of the fastest everywhere: it alone serves every bucket.
    times = {1024: {"a": 1.00, "b": 1.02}, 2048: {"a": 1.10, "b": 1.00}, 4096: {"a": 1.20, "b": 1.01, "c": 1.00}}
    assert tune.fewest_configs(times, tied=0.03) == {1024: "b", 2048: "b", 4096: "b"}
    # No tie: each bucket keeps its own fastest.
    assert tune.fewest_configs(times, tied=0.0) == {1024: "a", 2048: "b", 4096: "c"}
    rng = random.Random(0)
    for _ in range(200):
        table = {n: {c: rng.uniform(1.0, 1.2) for c in "abcdef" if rng.random() < 0.8 or c == "a"} for n in range(6)}
        picked = tune.fewest_configs(table, tied=0.03)
        assert set(picked) == set(table)
        for n, c in picked.items():
            assert table[n][c] <= 1.03 * min(table[n].values()), (table, picked)
        assert len(set(picked.values())) <= len({min(t, key=t.get) for t in table.values()})


def test_the_tiles_in_force_apply_to_their_case_and_are_undone():
    V2 = lessons.load("06-fused-attention-v2-forward")
    q = torch.empty(1, 1, 100, 64)
    with tune.tiles_in_force({("fwd", 64, True, 128): (64, 64, 4, 3), ("fwd", 64, True, 1024): (128, 64, 8, 3)}):
        assert V2.tuned_case(q, True) == (64, True, 128)  # the bucket at or above the length
        assert V2.tuned_case(torch.empty(1, 1, 5000, 64), True) == (64, True, 1024)  # the longest beyond
        assert V2.TUNED_CONFIGS[("fwd", 64, True, 128)] == (64, 64, 4, 3)
    with tune.tiles_in_force({}, case=(64, False, 2048)):
        assert V2.tuned_case(q, True) == (64, False, 2048)


def test_the_captured_pick_is_the_fastest_by_gpu_time():
    # Measured on an H100 at D = 128, N = 1024 (ms by GPU time): the host paced Gluon back to back, so one run's
    # eager pick was portable; replayed from a CUDA graph Gluon is the faster by 1.33x.
    assert tune.captured_pick({"portable": 0.1427, "gluon": 0.1071}) == "gluon"
    assert tune.captured_pick({"portable": 0.1000, "gluon": 0.0980}) == "gluon"  # no near-tie rule
    assert tune.captured_pick({"two-pass": 1.0, "atomic": 1.2, "gluon": 0.9}) == "gluon"
