"""The lessons' shared module: sibling loading, the tuned tables, the results file and the
one timing method's rules (passes, retiming, ranges), with scripted timings where the rule
is what is tested."""

import json
import sys

import pytest
import stepkit as kit
import torch
from conftest import TUTORIALS


def scripted(script):
    """A time_once stand-in: each key's timings in the order given, b2b and GPU alike."""
    calls = []

    def time_once(timer, flush=None):
        key = timer.key
        calls.append(key)
        ms = script[key].pop(0)
        if isinstance(ms, Exception):
            raise ms
        return {"b2b": ms, "gpu": ms, "gpu_method": "CUDA graph"}

    return time_once, calls


def timers(*keys):
    made = {}
    for key in keys:
        timer = kit.Timer(lambda: (lambda: None))
        timer.key = key
        made[key] = timer
    return made


def cases(*keys, n=2):
    return lambda: iter([(case, f"case {case}", timers(*keys)) for case in range(n)])


def test_passes_alternate_their_order_and_settled_timings_are_not_retimed(monkeypatch):
    script = {key: [1.0, 1.05] * 2 for key in "abc"}
    time_once, calls = scripted(script)
    monkeypatch.setattr(kit, "time_once", time_once)
    monkeypatch.setattr(kit, "PASSES", 2)
    measured = kit.measure(cases("a", "b", "c"))
    assert calls == list("abcabc") + list("cbacba")  # pass 1 in order, pass 2 reversed
    assert all(len(m.b2b) == 2 for m in measured.values())


def test_a_spread_past_the_limit_is_retimed_up_to_max_passes_then_kept_as_a_range(monkeypatch):
    script = {"steady": [1.0, 1.05], "disturbed": [1.0, 2.0, 1.02], "always": [1.0, 3.0, 3.0, 3.0]}
    time_once, calls = scripted(script)
    monkeypatch.setattr(kit, "time_once", time_once)
    monkeypatch.setattr(kit, "PASSES", 2)
    measured = kit.measure(cases("steady", "disturbed", "always", n=1))
    timings = {key: m.b2b for (_, key), m in measured.items()}
    assert timings == {"steady": [1.0, 1.05], "disturbed": [1.0, 2.0, 1.02], "always": [1.0, 3.0, 3.0, 3.0]}
    assert len(timings["always"]) == kit.MAX_PASSES
    row = measured[(0, "always")].row(work=6.0)
    assert row["value"] == 6.0 and row["gpu_value"] == 6.0 and row["spread"] == pytest.approx(2.0)
    assert measured[(0, "disturbed")].row(1.0)["spread"] == pytest.approx(0.02)  # its two fastest
    assert kit.shown_rate(row["value"], row["value"] / (1 + row["spread"])) != kit.shown_rate(row["value"])


def test_a_failing_provider_is_reported_and_left_out_of_that_case_only(monkeypatch, capsys):
    script = {"ok": [1.0] * 4, "bad": [RuntimeError("no kernel for this case\nmore"), 1.0, 1.0]}
    time_once, calls = scripted(script)
    monkeypatch.setattr(kit, "time_once", time_once)
    monkeypatch.setattr(kit, "PASSES", 2)
    measured = kit.measure(cases("ok", "bad"))
    assert (0, "bad") not in measured and (1, "bad") in measured
    assert calls.count("bad") == 3  # never again in case 0
    assert "bad skipped at case 0: no kernel for this case" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_timing_that_is_not_a_positive_number_is_refused(bad):
    m = kit.Measured()
    m.add({"b2b": 1.0, "gpu": None, "gpu_method": None})
    with pytest.raises(ValueError, match="timing"):
        m.add({"b2b": bad, "gpu": None, "gpu_method": None})
    with pytest.raises(ValueError, match="timing"):
        m.add({"b2b": 1.0, "gpu": bad, "gpu_method": "CUDA graph"})


def test_a_real_timing_has_gpu_time_exactly_where_there_is_a_gpu():
    x = torch.randn(1 << 16, device=kit.DEVICE)
    measured = kit.time_calls({"copy": kit.call_timer(torch.empty_like(x).copy_, x)})
    row = measured["copy"].row(1.0)
    assert row["value"] > 0
    if kit.ON_GPU:
        assert row["gpu_value"] > 0 and row["gpu_method"] == "CUDA graph"
    else:
        assert "gpu_value" not in row


@pytest.mark.skipif(not kit.ON_GPU, reason="CUDA graphs need a GPU")
def test_a_backward_is_captured_in_a_graph_not_timed_by_the_profiler():
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    (name, fn), = kit.sdpa_providers(False, 0.125, ["SDPA flash"]).items()
    measured = kit.time_calls({"bwd": kit.backward_timer(fn, q, k, v)})
    assert measured["bwd"].gpu_method == "CUDA graph" and q.grad is None


def test_the_backward_timer_leaves_grad_untouched():
    x = torch.randn(3, 4, requires_grad=True)
    fn = kit.backward_timer(lambda t: (t * 2).sum(1), x).make()
    (dx,) = fn()
    assert x.grad is None  # torch.autograd.grad, not .backward()
    assert torch.equal(dx, dx[:, :1].expand(3, 4))  # 2 * dout of each row, down every column


def test_sdpa_providers_select_their_backend_outside_the_call():
    (name, fn), = kit.sdpa_providers(False, 0.5, ["SDPA math"]).items()
    q, k, v = (torch.randn(1, 1, 5, 16) for _ in range(3))
    timer = kit.call_timer(fn, q, k, v)
    with timer.context():
        out = timer.make()()
    torch.testing.assert_close(out, kit.reference_attention(q, k, v, False, 0.5))


def test_load_lesson_reads_a_notebook_when_no_script_is_there(tmp_path, monkeypatch):
    source = "X = 41\n\ndef f():\n    return X + 1\n"
    notebook = {"cells": [{"cell_type": "markdown", "source": ["# t"]},
                          {"cell_type": "code", "source": source.splitlines(keepends=True)}]}
    (tmp_path / "98-notebook-only.ipynb").write_text(json.dumps(notebook))
    monkeypatch.setattr(kit, "HERE", tmp_path)
    monkeypatch.delitem(sys.modules, "lesson_98_notebook_only", raising=False)
    module = kit.load_lesson("98-notebook-only")
    assert module.f() == 42 and module.__name__ != "__main__"
    assert kit.load_lesson("98-notebook-only") is module
    sys.modules.pop("lesson_98_notebook_only")


def test_load_lesson_says_what_to_download_when_neither_file_is_there(tmp_path, monkeypatch):
    monkeypatch.setattr(kit, "HERE", tmp_path)
    with pytest.raises(ImportError, match="97-missing.py or 97-missing.ipynb.*zip"):
        kit.load_lesson("97-missing")


def test_a_lesson_that_fails_to_load_is_not_left_half_loaded(tmp_path, monkeypatch):
    (tmp_path / "96-broken.py").write_text("raise ValueError('broken on purpose')\n")
    monkeypatch.setattr(kit, "HERE", tmp_path)
    with pytest.raises(ValueError, match="broken on purpose"):
        kit.load_lesson("96-broken")
    assert "lesson_96_broken" not in sys.modules


def test_tuned_tables_hold_their_provenance_and_rows():
    tables = json.loads((TUTORIALS / "tuned_tables.json").read_text())
    assert tables, "no tuned tables"
    for name in tables:
        table = kit.tuned_table(name)
        assert {"gpu", "torch", "triton", "capability"} <= set(table["measured_on"]), name
        assert table["rows"] and all(isinstance(row, dict) for row in table["rows"]), name
    with pytest.raises(KeyError, match="no table 'nonexistent'"):
        kit.tuned_table("nonexistent")


def test_save_results_writes_the_record_only_when_the_build_asks(tmp_path, monkeypatch):
    monkeypatch.delenv("TUTORIAL_RESULTS_DIR", raising=False)
    kit.save_results("99-nothing", [])
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("TUTORIAL_RESULTS_DIR", str(tmp_path))
    kit.save_results("99-something", [{"name": "b"}])
    record = json.loads((tmp_path / "99-something.json").read_text())
    assert record["tutorial"] == "99-something" and record["on_gpu"] is kit.ON_GPU
    assert record["platform"] == kit.describe_platform() and record["benchmarks"] == [{"name": "b"}]


def test_one_style_per_peer_and_distinct_colours_for_ours():
    assert kit.style("SDPA cuDNN") == kit.STYLE["SDPA cuDNN"]
    ours = ["Triton a", "Triton b", "Gluon c"]
    colours = {kit.style(name, ours)[0] for name in ours}
    assert len(colours) == 3 and not colours & {c for c, _ in kit.STYLE.values()}


@pytest.mark.parametrize("value, slowest, shown", [(123.4, 120.0, "123"), (150.0, 100.0, "100–150"),
                                                     (0.001234, None, "0.00123")])
def test_rates_show_as_a_range_only_past_the_spread_limit(monkeypatch, value, slowest, shown):
    monkeypatch.setattr(kit, "ON_GPU", True)
    if value < 1:
        monkeypatch.setattr(kit, "ON_GPU", False)
    assert kit.shown_rate(value, slowest) == shown


def test_importing_stepkit_twice_keeps_no_state_between_lessons():
    state = {name for name, value in vars(kit).items()
             if isinstance(value, (dict, list, set)) and not name.isupper() and not name.startswith("__")}
    assert state == set(), f"module-level mutable state: {state}"


def rates(values, provider="ours"):
    import pandas as pd

    index = pd.MultiIndex.from_tuples([(64, n) for n in (1024, 2048, 4096)], names=["D", "N"])
    return pd.DataFrame({provider: values}, index=index)


def test_back_to_back_is_called_faster_or_slower_by_its_ratio_and_never_blames_the_host_alone():
    faster = kit.back_to_back_line("cuBLAS", "n = 2048", 1.11)
    slower = kit.back_to_back_line("cuBLAS", "n = 2048", 0.8)
    assert "1.11x" in faster and "faster" in faster and "slower" not in faster
    assert "0.80x" in slower and "slower" in slower and "host's launches, not the GPU" not in slower


def test_the_back_to_back_overview_counts_only_differences_past_the_spread_limit():
    gpu = rates([100.0, 100.0, 100.0])
    # Back to back 5% slower at most, or faster (the L2 cache kept warm): nothing named.
    assert "none takes more than 10% longer" in kit.b2b_overview(gpu, rates([95.0, 130.0, 99.0]))
    apart = kit.b2b_overview(gpu, rates([70.0, 100.0, 99.0]))
    assert "1 of 3 take more than 10% longer: at N = 1024." in apart
    assert kit.b2b_overview(gpu, gpu) == ""  # under the interpreter both tables are one


def test_the_back_to_back_note_names_no_cause():
    import pandas as pd

    gpu = pd.concat([rates([100.0, 100.0, 100.0]), rates([100.0, 100.0, 100.0], "peer")], axis=1)
    b2b = pd.concat([rates([50.0, 100.0, 100.0]), rates([100.0, 100.0, 100.0], "peer")], axis=1)
    note = kit.back_to_back_note(gpu, b2b, "ours", ["peer"])
    assert "at N = 1024 up to 2.0x slower than by GPU time" in note and "host" not in note
    assert kit.back_to_back_note(gpu, gpu, "ours", ["peer"]) == ""


def test_the_ceiling_line_says_what_was_measured():
    line = kit.ceiling_line(650.0)
    assert kit.MATMUL_CEILING in line and "650 TFLOP/s" in line


def test_the_traffic_diagram_draws_a_segment_per_read_and_write_and_the_totals():
    import matplotlib

    matplotlib.use("Agg")
    fig = kit.draw_memory_traffic({"naive": [("a", 1, 0), ("b", 1, 1)], "fused": [("c", 1, 1)]}, "t")
    ax = fig.axes[0]
    assert len(ax.patches) == 5  # a read; b read and written; c read and written
    texts = [t.get_text() for t in ax.texts]
    assert "3 in all" in texts and "2 in all" in texts and "b\nwritten" in texts
    assert [t.get_text() for t in ax.get_yticklabels()] == ["naive", "fused"]


def test_error_summary_finds_the_exception_a_compiler_message_wraps():
    wrapped = RuntimeError(
        "SubprocException: An exception occurred in a subprocess:\n  File x\n"
        "AssertionError('types int64 and int32')\n\nSet TORCHDYNAMO_VERBOSE=1 for more")
    assert kit.error_summary(wrapped) == "AssertionError('types int64 and int32')"
    assert kit.error_summary(RuntimeError("out of memory\nmore")) == "out of memory"
    assert kit.error_summary(RuntimeError("")) == "RuntimeError"
    assert len(kit.error_summary(RuntimeError("x" * 500))) == 160


def test_same_bytes_copy_copies_into_a_buffer_of_its_own():
    x = torch.randn(1000, device=kit.DEVICE)
    copy = kit.same_bytes_copy(x)
    out = copy(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    assert copy(x).data_ptr() == out.data_ptr()  # the same buffer every call: timed alone


def test_spread_summary_names_the_whole_case_of_its_largest_spreads():
    import pandas as pd

    rows = pd.DataFrame([
        dict(D=64, causal=False, mode="fwd", N=1024, provider="ours", value=1.0, spread=0.02, gpu_value=1.0,
             gpu_spread=0.01),
        dict(D=128, causal=True, mode="fwd", N=4096, provider="ours", value=1.0, spread=0.30, gpu_value=1.0,
             gpu_spread=0.12)])
    line = kit.spread_summary(rows)
    assert "the largest 12% (ours, D=128, causal=True, mode=fwd, N=4096)" in line
    assert "back to back the largest is 30% (ours, D=128, causal=True, mode=fwd, N=4096)" in line
    assert "1 of 2 timings by GPU time (1 back to back) spread past 10%" in line
