"""Lesson 01 (a first kernel): add against float64 on irregular lengths, views and dtypes; bad input refused
by name; the block-sum and printing kernels; each exercise's check shown to accept a right answer (written
here, off the page) and to reject wrong ones; the lesson's diagram, drawn with Agg."""

import pytest
import torch
from lessons import load

# Loaded before Triton is imported: the lesson switches the interpreter on where there is no GPU.
LESSON = load("01-first-kernel")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

kit = LESSON.kit
DEVICE = LESSON.DEVICE
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LENGTHS = [1, 2, 17, 1023, 1025, 4099, 98_765]


def check_add(x, y, **kwargs):
    out = LESSON.add(x, y, **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    expected = x.double() + y.double()
    # One rounding of the exact sum: relative error within the dtype's, no absolute slack.
    torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[x.dtype], atol=0)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_add_matches_float64_on_irregular_lengths(n, dtype, rng):
    x, y = ((torch.randn(n, generator=rng) * 100).to(DEVICE, dtype) for _ in "xy")
    check_add(x, y)


@pytest.mark.parametrize("block", [1, 16, 64, 2**14])
def test_any_power_of_two_block_covers_the_tensor(block, rng):
    x, y = (torch.randn(4099, generator=rng).to(DEVICE) for _ in "xy")
    check_add(x, y, block=block)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_views_far_into_a_buffer_strided_and_negative(dtype, rng):
    base = torch.randn(2**21 + 98_765, generator=rng).to(DEVICE, dtype)
    far = base[2**21 + 3 :]  # a large offset from the buffer's start, not 16-byte aligned
    other = base[2**20 + 1 : 2**20 + 1 + far.numel()]
    check_add(far, other)
    grid = torch.randn(300, 37, generator=rng).to(DEVICE, dtype)
    check_add(grid.t(), torch.randn(37, 300, generator=rng).to(DEVICE, dtype))  # transposed: copied first
    check_add(grid[:, :36:3], grid[:, 1::3])  # strided columns
    check_add(torch._neg_view(grid), grid)  # a negative view: x + y is zero, not 2y
    assert LESSON.add(torch._neg_view(grid), grid).abs().max() == 0


def test_an_empty_tensor_gives_an_empty_result():
    x = torch.empty(0, 5, device=DEVICE)
    assert LESSON.add(x, x).shape == (0, 5)


@pytest.mark.parametrize("x, y, error, message", [
    ([1.0, 2.0], None, TypeError, "x is a list"),
    (None, 3.0, TypeError, "y is a float"),
    (torch.arange(5), None, TypeError, "torch.int64"),
    (None, torch.zeros(5, dtype=torch.float64), TypeError, "torch.float64"),
    (None, torch.zeros(5, dtype=torch.float16), TypeError, "must match.*float32.*float16"),
    (None, torch.zeros(6), ValueError, "shape"),
    (None, torch.zeros(5, 1), ValueError, "shape"),
    (torch.zeros(5, device="meta"), None, ValueError, "device"),
], ids=["list", "float", "int64", "float64", "two dtypes", "length", "rank", "device"])
def test_bad_input_is_refused_by_name(x, y, error, message):
    def on_device(t):
        return t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t

    x = on_device(torch.zeros(5) if x is None else x)
    y = on_device(torch.zeros(5) if y is None else y)
    with pytest.raises(error, match=message):
        LESSON.add(x, y)


@pytest.mark.parametrize("block, error", [(3, ValueError), (0, ValueError), (2**21, ValueError),
                                          ("64", TypeError), (64.0, TypeError), (True, TypeError)], ids=repr)
def test_an_unusable_block_is_refused_by_name(block, error):
    x = torch.zeros(10, device=DEVICE)
    with pytest.raises(error, match="block"):
        LESSON.add(x, x, block=block)


def test_too_many_elements_for_32_bit_offsets_are_refused_before_any_copy():
    x = torch.zeros(1, device=DEVICE).expand(2**31 + 1)  # no memory behind it: contiguous() would allocate 8 GiB
    with pytest.raises(ValueError, match="32-bit offsets"):
        LESSON.add(x, x)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000])
def test_block_sums_add_up_to_the_float64_sum(n, rng):
    x = torch.rand(n, generator=rng).to(DEVICE)
    sums = torch.empty(triton.cdiv(n, 64), device=DEVICE)
    LESSON.block_sum_kernel[(len(sums),)](x, sums, n, BLOCK=64)
    expected = torch.stack([x[i:i + 64].double().sum() for i in range(0, n, 64)])
    torch.testing.assert_close(sums.double(), expected, rtol=1e-5, atol=0)


def test_the_printing_kernel_prints_each_program_and_masks_the_tail(capfd):
    if kit.ON_GPU:
        pytest.skip("on a GPU each thread prints: the interpreter's two lines are checked here")
    LESSON.where_am_i_kernel[(2,)](6, BLOCK=4, num_warps=1)
    out = capfd.readouterr().out
    assert "(0, 0, 0)" in out and "[0 1 2 3]" in out
    assert "(1, 0, 0)" in out and "[ 4  5 -1 -1]" in out


# -- The exercises: right answers, off the page -----------------------------------------------------------


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, SHORT: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n - SHORT  # SHORT = 1: the off-by-one mistake, the last element never written
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, tl.maximum(x, 0.0).to(out_ptr.dtype.element_ty), mask=mask)


def relu(x, short=0):
    out = torch.full_like(x, 1e4)  # what an unwritten element holds, so that missing one is always seen
    n = x.numel()
    relu_kernel[(triton.cdiv(n, 256),)](x, out, n, BLOCK=256, SHORT=short)
    return out


@triton.jit
def add_strided_kernel(x_ptr, y_ptr, out_ptr, n, x_stride, y_stride, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets * x_stride, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets * y_stride, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def add_strided(x, y, same_stride=False):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.numel()
    y_stride = x.stride(0) if same_stride else y.stride(0)  # same_stride: the mistake of one stride for both
    add_strided_kernel[(triton.cdiv(n, 256),)](x, y, out, n, x.stride(0), y_stride, BLOCK=256)
    return out


def test_check_relu_accepts_a_right_answer(capsys):
    LESSON.check_relu(relu)
    assert "relu passed" in capsys.readouterr().out


def test_check_add_strided_accepts_a_right_answer(capsys):
    LESSON.check_add_strided(add_strided)
    assert "add_strided passed" in capsys.readouterr().out


def with_nan(fn):
    def wrong(*args):
        out = fn(*args)
        out[-1] = float("nan")
        return out

    return wrong


@pytest.mark.parametrize("wrong, message", [
    (lambda x: relu(x, short=1), r"element \d+ is 10000, the float64 reference .*off by"),
    (with_nan(relu), r"element \d+ is nan"),
    (lambda x: relu(x)[:-1] if len(x) > 1 else relu(x).double(), "should be a"),
    (lambda x: x.clamp_(min=0), "changed its input"),
    (lambda x: relu(x) + (torch.arange(len(x), device=x.device) == 5) * 0.5, "element 5 is"),
], ids=["off-by-one mask", "NaN", "wrong shape or dtype", "in place", "one wrong element"])
def test_check_relu_rejects_a_wrong_answer(wrong, message):
    with pytest.raises(AssertionError, match=message):
        LESSON.check_relu(wrong)


@pytest.mark.parametrize("wrong, message", [
    (lambda x, y: add_strided(x, y, same_stride=True), r"element \d+ is .*off by"),
    (lambda x, y: LESSON.add(x.contiguous(), y.contiguous()) * 1.05, "off by"),
    (with_nan(add_strided), r"element \d+ is nan"),
], ids=["one stride for both", "five percent off", "NaN"])
def test_check_add_strided_rejects_a_wrong_answer(wrong, message):
    with pytest.raises(AssertionError, match=message):
        LESSON.check_add_strided(wrong)


def test_the_diagram_draws_the_grid_the_blocks_and_the_masked_tail():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = kit.draw_programs_and_blocks(13, 4)
    ax = fig.axes[0]
    cells = [p for p in ax.patches if p.get_width() == 1]
    assert len(cells) == 16  # 4 programs of 4
    assert sum(p.get_hatch() == "//" for p in cells) == 3  # offsets 13, 14, 15 masked
    assert "= 4 programs" in ax.get_title()
    assert fig.get_size_inches()[0] <= 9
    fig.canvas.draw()
    plt.close(fig)
    for n, block in [(0, 4), (13, 0), (100, 64)]:
        with pytest.raises(ValueError, match="small launch"):
            kit.draw_programs_and_blocks(n, block)


# -- Printing from the GPU: what C writes to file descriptor 1 ---------------------------------------------


def test_c_printed_captures_what_c_writes_to_descriptor_1_and_restores_it(capfd):
    """The GPU's printf lands on file descriptor 1 through C's buffered stdout, which a page never sees:
    c_printed collects it, C's buffer flushed, and puts descriptor 1 back."""
    import ctypes
    import os

    libc = ctypes.CDLL(None)

    def write():
        os.write(1, b"raw write\n")
        libc.printf(b"buffered %d\n", 42)  # C buffers it when descriptor 1 is not a terminal

    print("printed before", flush=True)
    assert LESSON.kit.c_printed(write).splitlines() == ["raw write", "buffered 42"]
    os.write(1, b"after\n")
    out = capfd.readouterr().out
    assert "printed before" in out and "after" in out and "raw write" not in out


def test_c_printed_puts_descriptor_1_back_when_the_call_raises(capfd):
    import os

    def fail():
        os.write(1, b"lost\n")
        raise RuntimeError("the launch failed")

    with pytest.raises(RuntimeError, match="the launch failed"):
        LESSON.kit.c_printed(fail)
    os.write(1, b"still here\n")
    out = capfd.readouterr().out
    assert "still here" in out and "lost" not in out


# -- In a loop: the verdict on back-to-back rates against the peer -----------------------------------------


def two_tables(gpu_ours, b2b_ours, peer=100.0, sizes=(16384, 131072, 1048576, 67108864)):
    """(by GPU time, back to back): rates of ours and a peer at 100 GB/s, an "N" index."""
    import pandas as pd

    def table(ours):
        return pd.DataFrame({"ours": ours, "peer": [peer] * len(ours)}, index=pd.Index(sizes, name="N"))

    return table(gpu_ours), table(b2b_ours)


def test_the_loop_verdict_names_where_ours_falls_behind_only_in_a_loop():
    """The H100 build's shape: level with torch.add by GPU time, 0.26x to 0.35x of it back to back at small N."""
    gpu, b2b = two_tables([109.0, 101.0, 101.0, 100.0], [30.0, 35.0, 26.0, 99.0])
    line = kit.loop_verdict(gpu, b2b, "ours", ["peer"])
    assert "runs at 0.26x to 0.35x peer at N = 16384, 131072, 1048576," in line
    assert "by GPU time it runs at 1.01x to 1.09x" in line
    assert "host" in line and "lesson 13" in line and "67108864" not in line


def test_the_loop_verdict_blames_no_host_where_the_gpu_time_is_as_far_behind():
    """Behind the peer back to back, but as far behind by GPU time: the kernel, not the loop, is slower."""
    gpu, b2b = two_tables([50.0, 50.0, 92.0, 100.0], [48.0, 47.0, 95.0, 100.0])
    line = kit.loop_verdict(gpu, b2b, "ours", ["peer"])
    assert line.startswith("Back to back, as a loop calls them, ours runs at 0.47x to 1.00x peer:")
    assert "within 10%" in line and "host" not in line


def test_the_loop_verdict_reads_the_fastest_of_several_peers_by_case():
    import pandas as pd

    index = pd.MultiIndex.from_tuples([("float32", 256), ("float32", 4096), ("bfloat16", 256)], names=["dtype", "N"])
    gpu = pd.DataFrame({"ours": [100.0, 100.0, 100.0], "a": [100.0, 60.0, 90.0], "b": [50.0, 100.0, 95.0]},
                       index=index)
    b2b = pd.DataFrame({"ours": [20.0, 100.0, 30.0], "a": [100.0, 60.0, 20.0], "b": [40.0, 100.0, 100.0]},
                       index=index)
    line = kit.loop_verdict(gpu, b2b, "ours", ["a", "b"])
    assert "0.20x to 0.30x the fastest of a, b at float32, N = 256; bfloat16, N = 256," in line
    assert "by GPU time it runs at 1.00x to 1.05x" in line


def test_the_loop_verdict_says_nothing_under_the_interpreter():
    gpu, _ = two_tables([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    assert kit.loop_verdict(gpu, gpu, "ours", ["peer"]) == ""  # one wall-clock table for both


def test_cases_are_named_by_their_last_level_within_the_others():
    import pandas as pd

    assert kit.name_cases(pd.Index([1024, 2048], name="N")) == "N = 1024, 2048"
    index = pd.MultiIndex.from_tuples([("float32", 256), ("float32", 512), ("bfloat16", 256)], names=["dtype", "N"])
    assert kit.name_cases(index) == "float32, N = 256, 512; bfloat16, N = 256"


# -- The figure: ours in sight above the peers -------------------------------------------------------------


def test_the_rates_figure_draws_ours_above_the_peers_on_a_log_axis():
    """Lesson 01's figure: Triton add on top of torch.add and the copy, with hollow markers that leave the peer's
    markers in sight where the curves meet; a log rate axis; sizes labelled where the labels fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    sizes = [2**13, 12288, 2**14, 2**17]
    table = pd.DataFrame({"Triton add": [39.4, 50.0, 60.0, 271.0], "torch.add": [36.1, 50.0, 60.0, 269.0],
                          kit.SAME_BYTES: [38.9, 50.0, 60.0, 260.0]}, index=pd.Index(sizes, name="N"))
    fig = kit.plot_rates(table, 3000.0, "large-buffer copy", "GB/s", "t", [LESSON.OURS], log_y=True)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    ours, peer, copy = lines["Triton add"], lines["torch.add"], lines[kit.SAME_BYTES]
    assert ours.get_zorder() > peer.get_zorder() and ours.get_zorder() > copy.get_zorder()
    assert ours.get_markerfacecolor() == "none" and ours.get_markersize() > peer.get_markersize()
    assert ours.get_color() != peer.get_color() and copy.get_linestyle() == ":"
    assert ax.get_yscale() == "log"
    fig.canvas.draw()
    labels = [label.get_text() for label in ax.get_xticklabels()]
    assert labels == ["8192", "", "16384", "131072"]  # 12288 keeps its tick, not a label that would overlap
    plt.close(fig)


def test_two_of_ours_on_one_curve_both_stay_in_sight():
    """Lesson 02's two Triton kernels run one kernel from LONG_ROW on: the second is drawn above the first,
    narrower, so the first shows around it."""
    first, second = (kit.line_style(name, ["a", "b"]) for name in "ab")
    assert second["zorder"] > first["zorder"]
    assert second["linewidth"] < first["linewidth"] and second["markersize"] < first["markersize"]
    assert first["color"] != second["color"]
