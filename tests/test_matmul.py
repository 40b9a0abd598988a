"""Lesson 04's tiled matmul against float64 on fresh random inputs (shapes, layouts, dtypes, offsets past
2**31, bad input), its program order, and the checks of its exercises: each accepts a correct solution
and rejects known-wrong ones."""

import pytest
import torch
from lessons import load

# Loaded before Triton is imported: the lesson's stepkit switches the interpreter on where there is no GPU,
# and Triton's own library functions (tl.cdiv, tl.max, ...) are defined for one mode or the other at import.
L = load("04-tiled-matmul")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = L.DEVICE


def randn(rng, *shape, dtype=torch.float16):
    """Fresh inputs on the lesson's device, so that views taken of them keep their strides there."""
    return torch.randn(*shape, generator=rng).to(DEVICE, dtype)


def check(a, b):
    c = L.matmul(a, b)
    assert c.shape == (a.shape[0], b.shape[1]) and c.dtype == a.dtype and c.is_contiguous()
    torch.testing.assert_close(c.double(), a.double() @ b.double(), **L.TOLERANCE[a.dtype])


# (M, N, K): ones, sizes below, at and just past a tile, and odd sizes that no tile divides.
SHAPES = [(1, 1, 1), (1, 37, 5), (29, 1, 16), (3, 5, 1), (64, 64, 32), (65, 63, 33), (100, 47, 131)]


@pytest.mark.parametrize("M, N, K", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", L.SUPPORTED_DTYPES, ids=str)
def test_matches_float64(M, N, K, dtype, rng):
    check(randn(rng, M, K, dtype=dtype), randn(rng, K, N, dtype=dtype))


LAYOUTS = {
    "a transposed": lambda rng: (randn(rng, 40, 70).t(), randn(rng, 40, 50)),
    "b transposed": lambda rng: (randn(rng, 70, 40), randn(rng, 50, 40).t()),
    "both transposed": lambda rng: (randn(rng, 40, 70).t(), randn(rng, 50, 40).t()),
    "column slices": lambda rng: (randn(rng, 70, 100)[:, 13:53], randn(rng, 40, 90)[:, 7:57]),
    "every other row and third column": lambda rng: (randn(rng, 140, 40)[::2], randn(rng, 40, 150)[:, ::3]),
    "broadcast rows (stride 0)": lambda rng: (randn(rng, 1, 40).expand(70, 40), randn(rng, 40, 50)),
    "negative-bit views": lambda rng: (torch._neg_view(randn(rng, 70, 40)), torch._neg_view(randn(rng, 40, 50))),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", L.SUPPORTED_DTYPES, ids=str)
def test_any_strides(layout, dtype, rng):
    a, b = LAYOUTS[layout](rng)
    check(a.to(dtype), b.to(dtype))


def test_negative_bit_view_is_resolved_not_read_raw(rng):
    a, b = randn(rng, 20, 30), randn(rng, 30, 10)
    assert torch._neg_view(a).is_neg()
    torch.testing.assert_close(L.matmul(torch._neg_view(a), b), -L.matmul(a, b))


def test_offsets_past_2_to_the_31(rng):
    # A and B are views into one buffer of 2**31 + 2**12 fp16 elements whose rows lie 2**30 + 2**10
    # elements apart, a stride that still fits int32: row 2 starts past 2**31, so int32 offsets
    # (row * stride_am, k * stride_bk) would wrap. torch.empty leaves the 4 GiB untouched on a CPU,
    # so only the few pages written here become real memory.
    stride = 2**30 + 2**10
    big = torch.empty(2 * stride + 2**11, dtype=torch.float16, device=DEVICE)
    M, K, N = 3, 3, 24
    a = big.as_strided((M, K), (stride, 1), 0)
    b = big.as_strided((K, N), (stride, 1), 8)
    a.copy_(randn(rng, M, K))
    b.copy_(randn(rng, K, N))
    assert a.storage_offset() + (M - 1) * stride >= 2**31 and b.storage_offset() + (K - 1) * stride >= 2**31
    check(a, b)


def ones(*shape, dtype=torch.float16, device=None):
    return torch.ones(*shape, dtype=dtype, device=device or DEVICE)


BAD_INPUTS = [
    ("list", lambda: ([[1.0]], ones(1, 1)), TypeError, "a must be a torch.Tensor, got list"),
    ("1-D", lambda: (ones(4), ones(4, 2)), ValueError, "a must be a 2-D matrix"),
    ("3-D", lambda: (ones(4, 2), ones(2, 3, 4)), ValueError, "b must be a 2-D matrix"),
    ("float32", lambda: (ones(3, 4, dtype=torch.float32),) * 2, TypeError, "float16 or bfloat16, got torch.float32"),
    ("int32", lambda: (ones(3, 4, dtype=torch.int32),) * 2, TypeError, "got torch.int32"),
    ("complex conj", lambda: (ones(3, 4, dtype=torch.complex64).conj(), ones(4, 2, dtype=torch.complex64)), TypeError,
     "got torch.complex64"),
    ("dtype mismatch", lambda: (ones(3, 4), ones(4, 2, dtype=torch.bfloat16)), TypeError, "same dtype"),
    ("inner dims", lambda: (ones(3, 4), ones(5, 2)), ValueError, "columns of a must match the rows of b"),
    ("empty M", lambda: (ones(0, 4), ones(4, 2)), ValueError, "non-empty"),
    ("empty K", lambda: (ones(3, 0), ones(0, 2)), ValueError, "non-empty"),
    ("meta device", lambda: (ones(3, 4), ones(4, 2, device="meta")), ValueError, "b is on device 'meta'"),
    # Broadcast, so 2**30 rows cost one element.
    ("2**30 rows", lambda: (ones(1, 1).expand(2**30, 1), ones(1, 1)), ValueError, r"below 2\*\*30"),
    ("a requires grad", lambda: (ones(3, 4).requires_grad_(), ones(4, 2)), TypeError, "forward-only"),
    ("b requires grad", lambda: (ones(3, 4), ones(4, 2).requires_grad_()), TypeError, "forward-only"),
]


@pytest.mark.parametrize("name, make, error, message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused_clearly(name, make, error, message):
    with pytest.raises(error, match=message):
        L.matmul(*make())


@pytest.mark.parametrize("group_m", [0, -1, 2.0, None, True, 2**40])
def test_bad_group_m_is_refused(group_m):
    with pytest.raises(ValueError, match="group_m"):
        L.matmul(ones(2, 2), ones(2, 2), group_m)


def test_inputs_that_require_grad_are_fine_without_a_graph():
    a, b = ones(3, 4).requires_grad_(), ones(4, 2)
    with torch.no_grad():
        torch.testing.assert_close(L.matmul(a, b).float(), torch.full((3, 2), 4.0, device=a.device))


@pytest.mark.parametrize("group_m", [1, 2, 3, 8])
@pytest.mark.parametrize("tiles_m, tiles_n", [(1, 1), (1, 7), (7, 1), (5, 6), (11, 9), (64, 32)])
def test_program_order_covers_every_tile_once(tiles_m, tiles_n, group_m):
    order = L.program_order(tiles_m, tiles_n, group_m)
    assert sorted(order.flatten().tolist()) == list(range(tiles_m * tiles_n))
    if group_m == 1:  # row-major
        assert order.flatten().tolist() == list(range(tiles_m * tiles_n))
    # Grouped: the first programs go down the first column of the first group.
    height = min(group_m, tiles_m)
    assert order[:height, 0].tolist() == list(range(height))


@pytest.mark.parametrize("group_m", [1, 3, 8])
def test_grouped_and_row_major_orders_compute_the_same_product(group_m, rng):
    a, b = randn(rng, 333, 131), randn(rng, 131, 277)
    torch.testing.assert_close(L.matmul(a, b, group_m), L.matmul(a, b, 1), rtol=0, atol=0)


def test_grouped_order_needs_fewer_slices_in_flight():
    # The lesson's H100 example: 8192 x 8192 with 128 x 256 tiles, 132 programs at a time.
    row_major = L.slices_in_flight(L.program_order(64, 32, 1), 132)
    grouped = L.slices_in_flight(L.program_order(64, 32, 8), 132)
    assert row_major == (5, 32) and grouped == (8, 17)


def test_the_benchmark_rows_carry_both_times_and_the_tile_picked():
    """Every row has value (back to back) and spread, and on a GPU gpu_value (GPU time): the results contract."""
    rows, tiles = L.run_benchmark([16, 32])
    assert {(row["size"], row["provider"]) for row in rows} == {
        (n, name) for n in (16, 32) for name in (*L.ORDERS, L.PEER)}
    for row in rows:
        assert row["value"] > 0 and row["spread"] >= 0
        assert ("gpu_value" in row) == L.kit.ON_GPU
    assert set(tiles) == {16, 32} and all({"BLOCK_M", "BLOCK_N", "BLOCK_K"} <= set(t) for t in tiles.values())


def test_tile_intensity():
    assert L.tile_intensity(128, 128) == 64 and L.tile_intensity(128, 256, 2) == pytest.approx(85.33, abs=0.01)
    assert L.tile_intensity(64, 64, 4) == 16


# The exercises, solved in Triton as a reader would, plus known-wrong variants switched on by flags.
BLOCK, BLOCK_K = 32, 16


@triton.jit
def _product(a_ptr, b_ptr, rows, cols, M, N, K, sam, sak, sbk, sbn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SHORT: tl.constexpr):
    k_end = K - 1 if K_SHORT else K  # K_SHORT: the off-by-one mask that drops the last k
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * sam + k[None, :] * sak, mask=(rows[:, None] < M) & (k[None, :] < k_end),
                    other=0.0)
        b = tl.load(b_ptr + k[:, None] * sbk + cols[None, :] * sbn, mask=(k[:, None] < k_end) & (cols[None, :] < N),
                    other=0.0)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _bias_relu_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn,
                      BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, ADD_BIAS: tl.constexpr, K_SHORT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = _product(a_ptr, b_ptr, rows, cols, M, N, K, sam, sak, sbk, sbn, BLOCK, BLOCK, BLOCK_K, K_SHORT)
    if ADD_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    acc = tl.maximum(acc, 0.0)
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.float16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def bias_relu(a, b, bias, add_bias=True, k_short=False):
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=torch.float16, device=a.device)
    _bias_relu_kernel[(triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))](
        a, b, bias, c, M, N, K, *a.stride(), *b.stride(), BLOCK=BLOCK, BLOCK_K=BLOCK_K, ADD_BIAS=add_bias,
        K_SHORT=k_short)
    return c


@triton.jit
def _batched_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sab, sam, sak, sbb, sbk, sbn,
                    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BATCH_0_ONLY: tl.constexpr):
    batch = 0 if BATCH_0_ONLY else tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = _product(a_ptr + batch * sab, b_ptr + batch * sbb, rows, cols, M, N, K, sam, sak, sbk, sbn,
                   BLOCK, BLOCK, BLOCK_K, False)
    tl.store(c_ptr + tl.program_id(2) * M * N + rows[:, None] * N + cols[None, :], acc.to(tl.float16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def batched(a, b, batch_0_only=False, assume_contiguous=False, assume_a_contiguous=False, packed_batches=False):
    (B, M, K), N = a.shape, b.shape[2]
    c = torch.empty(B, M, N, dtype=torch.float16, device=a.device)
    b_strides = (K * N, N, 1) if assume_contiguous else b.stride()  # the wrong variants ignore a layout
    a_strides = (M * K, K, 1) if assume_a_contiguous else a.stride()
    if packed_batches:  # one matrix right after another, whatever the batch stride says
        a_strides, b_strides = (M * K, *a_strides[1:]), (K * N, *b_strides[1:])
    _batched_kernel[(triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK), B)](
        a, b, c, M, N, K, *a_strides, *b_strides, BLOCK=BLOCK, BLOCK_K=BLOCK_K, BATCH_0_ONLY=batch_0_only)
    return c


@triton.jit
def _softmax_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn,
                    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAD_WITH_ZERO: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_N)
    s = _product(a_ptr, b_ptr, rows, cols, M, N, K, sam, sak, sbk, sbn, BLOCK, BLOCK_N, BLOCK_K, False)
    s = tl.where(cols[None, :] < N, s, 0.0 if PAD_WITH_ZERO else -float("inf"))
    p = tl.exp(s - tl.max(s, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], p.to(tl.float16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul_softmax(a, b, pad_with_zero=False):
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=torch.float16, device=a.device)
    _softmax_kernel[(triton.cdiv(M, BLOCK),)](a, b, c, M, N, K, *a.stride(), *b.stride(), BLOCK=BLOCK,
                                              BLOCK_N=max(16, triton.next_power_of_2(N)), BLOCK_K=BLOCK_K,
                                              PAD_WITH_ZERO=pad_with_zero)
    return c


EXERCISES = {
    "bias_relu": (L.check_bias_relu, bias_relu, {
        "missing bias": lambda a, b, bias: bias_relu(a, b, bias, add_bias=False),
        "off-by-one K mask": lambda a, b, bias: bias_relu(a, b, bias, k_short=True),
        "one block of 64 along K, no loop": lambda a, b, bias: torch.relu(
            a[:, :64].float() @ b[:64].float() + bias.float()).half(),
        "float32 result": lambda a, b, bias: torch.relu(a.float() @ b.float() + bias.float()),
        "NaN in the result": lambda a, b, bias: torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.float16,
                                                           device=a.device),
    }),
    "batched_matmul": (L.check_batched_matmul, batched, {
        "every batch uses batch 0": lambda a, b: batched(a, b, batch_0_only=True),
        "b assumed contiguous": lambda a, b: batched(a, b, assume_contiguous=True),
        "a assumed contiguous": lambda a, b: batched(a, b, assume_a_contiguous=True),
        "batch strides assumed packed": lambda a, b: batched(a, b, packed_batches=True),
        "batch dimension dropped": lambda a, b: batched(a, b)[0],
    }),
    "matmul_softmax": (L.check_matmul_softmax, matmul_softmax, {
        "padded columns counted as zero scores": lambda a, b: matmul_softmax(a, b, pad_with_zero=True),
        "softmax over the wrong axis": lambda a, b: torch.softmax(a.float() @ b.float(), dim=0).half(),
        "no row maximum subtracted": lambda a, b: (torch.exp(a.float() @ b.float())
                                                   / torch.exp(a.float() @ b.float()).sum(1, keepdim=True)).half(),
        "not a tensor": lambda a, b: (a @ b).tolist(),
    }),
}


@pytest.mark.parametrize("exercise", EXERCISES)
def test_exercise_check_accepts_a_correct_solution(exercise, capsys):
    check_fn, solution, _ = EXERCISES[exercise]
    check_fn(solution)
    out = capsys.readouterr().out
    assert "correct on every shape" in out
    if exercise == "bias_relu":  # then its speed: timed on a GPU, only announced elsewhere
        assert ("of the speed of this lesson's matmul" if L.kit.ON_GPU else "measured only on a GPU") in out


@pytest.mark.parametrize("exercise, wrong", [(e, w) for e, (_, _, wrongs) in EXERCISES.items() for w in wrongs])
def test_exercise_check_rejects_a_wrong_solution(exercise, wrong, capsys):
    check_fn, _, wrongs = EXERCISES[exercise]
    # The message names the case, then the first wrong element (or what the result should be) and how far off.
    with pytest.raises(AssertionError, match=r"on (B, )?M, N, K = [^:]*: the result(: element \(\d+, \d+(, \d+)?\) is "
                                             r".* off by | should be a)"):
        check_fn(wrongs[wrong])
    assert "correct" not in capsys.readouterr().out


def test_exercise_check_names_the_first_nan():
    with pytest.raises(AssertionError, match=r"^\(a\) bias \+ ReLU on M, N, K = 1, 1, 1: the result: element "
                                             r"\(0, 0\) is nan, the float64 reference [0-9.e-]+: off by nan"):
        L.check_bias_relu(EXERCISES["bias_relu"][2]["NaN in the result"])


def test_exercise_check_names_the_first_wrong_element_of_a_batch():
    # Every batch computed from batch 0: the first wrong element is in batch 1 of the first case with two.
    with pytest.raises(AssertionError, match=r"on B, M, N, K = 3, 37, 29, 45 \(a transposed\): the result: element "
                                             r"\(1, \d+, \d+\) is "):
        L.check_batched_matmul(EXERCISES["batched_matmul"][2]["every batch uses batch 0"])


def test_exercise_speed_line_of_bias_relu_reads_the_matmul_alone_and_unfused(monkeypatch):
    """The line of check_bias_relu's timing, on a pretend GPU whose time_calls gives each timer a GPU time."""
    from types import SimpleNamespace

    ms = {"fused": 2.0, "matmul": 1.9, "unfused": 3.0}
    monkeypatch.setattr(L.kit, "ON_GPU", True)
    monkeypatch.setattr(L.kit, "time_calls", lambda timers: {k: SimpleNamespace(gpu=[ms[k]]) for k in timers})
    line = L.bias_relu_speed(bias_relu, M=40, N=30, K=20)
    assert "M, N, K = 40, 30, 20, by GPU time (not enforced)" in line
    assert "95% of the speed of this lesson's matmul alone" in line and "1.50x the matmul followed by" in line


def test_the_back_to_back_sentence_follows_the_ratio():
    """Lesson 04's line where back to back differs from GPU time: above 1 it is faster (no L2 flush between
    calls), below 1 slower (GPU time leaves out what happens between calls); never the host for a faster one."""
    faster = L.kit.back_to_back_line("cuBLAS (torch.matmul)", "n = 2048", 1.11)
    assert "1.11x" in faster and "faster" in faster and "L2" in faster and "host" not in faster
    slower = L.kit.back_to_back_line("Triton, grouped order", "n = 1024", 0.29)
    assert "0.29x" in slower and "slower" in slower and "host" in slower and "L2" not in slower


def test_the_order_verdict_reads_each_size_and_the_counted_case():
    """Lesson 04's line on grouped against row-major order, on the H100 build's table: level within 3% or
    the timings' spread, and at n = 8192, the case whose slices the lesson counted, it says that grouped
    order ran slower although it loads fewer bytes there, rather than naming only the largest ratio."""
    import pandas as pd

    ratio = pd.Series({1024: 147 / 149, 2048: 497 / 503, 4096: 567 / 541, 8192: 548 / 576})
    spread = pd.Series({1024: 0.01, 2048: 0.004, 4096: 0.01, 8192: 0.02})
    line = L.order_effect(ratio, spread, L.COUNTED_N)
    assert "0.99x at n = 1024 (level)" in line and "0.99x at n = 2048 (level)" in line
    assert "1.05x at n = 4096 (faster)" in line and "0.95x at n = 8192 (slower)" in line
    assert "At n = 8192, the size counted above, grouped order ran 5% slower, although it loads fewer" in line


def test_the_order_verdict_says_when_the_counted_case_helped_or_stayed_level():
    import pandas as pd

    faster = L.order_effect(pd.Series({4096: 1.0, 8192: 1.06}), pd.Series({4096: 0.0, 8192: 0.01}), 8192)
    assert "1.06x at n = 8192 (faster)" in faster and "ran 6% faster" in faster and "although" not in faster
    # A 4% gap within a 5% spread of timings is level, not slower.
    level = L.order_effect(pd.Series({8192: 0.96}), pd.Series({8192: 0.05}), 8192)
    assert "(level, within a 5% spread)" in level and "did not show" in level and "slower" not in level
    assert "beyond its timings' spread" in level
    tight = L.order_effect(pd.Series({8192: 0.98}), pd.Series({8192: 0.01}), 8192)
    assert "(level)" in tight and "spread" not in tight
    # The interpreter's sizes leave out the counted case: no sentence about it.
    cpu = L.order_effect(pd.Series({64: 0.5, 128: 1.0}), pd.Series({64: 0.0, 128: 0.0}), 8192)
    assert "0.50x at n = 64 (slower)" in cpu and "At n =" not in cpu


def test_tile_diagram_draws_on_a_cpu():
    """The figure of one program's tile of C and the slabs of A and B its K loop walks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = L.kit.draw_matmul_tiles(tiles_m=3, tiles_n=4, tiles_k=5, tile=(2, 1), step=4)
    assert len(fig.axes) == 3 and fig.get_size_inches()[0] <= 9
    plt.close(fig)


def test_program_order_heat_maps_count_the_slabs_in_flight():
    """The heat maps of program order, drawn from program_order, title the slabs of A and B that the first
    programs read: the same counts as slices_in_flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orders = {f"GROUP_M = {g}": L.program_order(8, 8, g) for g in (1, 4)}
    fig = L.kit.draw_program_orders(orders, in_flight=16)
    titles = [ax.get_title() for ax in fig.axes[:2]]
    assert "2 slabs of A, 8 of B" in titles[0] and "4 slabs of A, 4 of B" in titles[1]
    assert fig.get_size_inches()[0] <= 9
    plt.close(fig)
