"""Both softmax lessons against a float64 reference: irregular shapes, strides, dtypes, extreme values
and bad input."""

import pytest
import torch
from lessons import load

LESSON_01 = load("01-fused-softmax")
LESSON_02 = load("02-long-softmax")
KERNELS = {
    "fused": LESSON_01.softmax,
    "three-pass": lambda x: LESSON_02.three_pass_softmax(x, block_n=64),
    "online": lambda x: LESSON_02.online_softmax(x, block_n=64),
    "online-default-chunk": LESSON_02.online_softmax,
    "row-on-chip": LESSON_02.row_on_chip_softmax,
    "split-row": LESSON_02.split_row_softmax,
    "long": LESSON_02.long_softmax,
}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SHAPES = [(1, 1), (1, 781), (7, 1), (3, 2), (37, 100), (5, 257), (2, 4099)]


def check(kernel, x):
    x = x.to(LESSON_01.DEVICE)  # the lessons run where Triton does: the GPU if there is one
    y = kernel(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    reference = torch.softmax(x.double(), dim=1)
    torch.testing.assert_close(y.double(), reference, rtol=TOLERANCE[x.dtype], atol=TOLERANCE[x.dtype] * 1e-2)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_matches_float64_reference(name, shape, dtype, rng):
    check(KERNELS[name], (torch.randn(shape, generator=rng) * 4).to(dtype))


@pytest.mark.parametrize("name", KERNELS)
def test_strided_rows_and_columns(name, rng):
    # Views are made on the lessons' device: moving a view to another device would make it contiguous.
    wide = torch.randn(13, 300, generator=rng).to(LESSON_01.DEVICE)
    check(KERNELS[name], wide[:, 7:207])  # rows with a stride: a slice of a wider tensor
    check(KERNELS[name], torch.randn(90, 11, generator=rng).to(LESSON_01.DEVICE).t())  # a transposed view


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_numerically_stable(name, dtype, rng):
    big = torch.finfo(dtype).max / 2
    x = torch.randn(6, 203, generator=rng) * 30
    x[0, 5] = big  # one huge value: exp would overflow without subtracting the max
    x[1] -= 1e4  # a very negative row
    x[2, ::3] = -float("inf")  # masked-out logits
    x[3, 1:] = -float("inf")  # all but one
    x[4] += 1e4
    check(KERNELS[name], x.to(dtype))


def test_row_on_chip_refuses_rows_too_long():
    x = torch.randn(1, LESSON_02.ROW_ON_CHIP_LIMIT + 1, device=LESSON_02.DEVICE)
    with pytest.raises(ValueError, match="at most"):
        LESSON_02.row_on_chip_softmax(x)


def test_split_row_refuses_to_split_under_the_interpreter():
    if LESSON_02.ON_GPU:
        pytest.skip("on a GPU the programs of a row run together")
    with pytest.raises(ValueError, match="one after another"):
        LESSON_02.split_row_softmax(torch.randn(2, 100), chunk=32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programs sharing a row need a GPU")
@pytest.mark.parametrize("N, chunk", [(5001, 512), (70001, 8192), (1000, 64), (4096, 4096)])
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_split_row_shares_rows_between_programs_on_gpu(N, chunk, dtype):
    x = (torch.randn(37, N, device="cuda") * 10).to(dtype)
    check(lambda t: LESSON_02.split_row_softmax(t, chunk=chunk), x)


BAD_INPUTS = [
    (lambda: [[1.0, 2.0]], TypeError, "torch.Tensor"),
    (lambda: torch.randn(5), ValueError, "2-D"),
    (lambda: torch.randn(2, 3, 4), ValueError, "2-D"),
    (lambda: torch.ones(3, 4, dtype=torch.int32), TypeError, "int32"),
    (lambda: torch.randn(3, 4, dtype=torch.float64), TypeError, "float64"),
    (lambda: torch.empty(0, 4), ValueError, "at least one row"),
    (lambda: torch.empty(4, 0), ValueError, "at least one row"),
    (lambda: torch.randn(3, 4, device="meta"), ValueError, "device"),
]


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("make, error, message", BAD_INPUTS, ids=lambda v: getattr(v, "__name__", str(v))[:20])
def test_bad_input_is_refused_clearly(name, make, error, message):
    with pytest.raises(error, match=message):
        KERNELS[name](make())
