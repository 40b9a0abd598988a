"""Lesson 03's split-row softmax on every valid shape, on a GPU (issue 43, item 5).

Its programs wait for each other, so the launcher starts no more than the GPU holds, and
launches them cooperatively. The count of programs that fit depends on the compiled
kernel's registers, and Triton compiles one kernel apart for each *variant* of the
arguments (integers equal to 1 or divisible by 16, addresses aligned to 16 bytes). A count
kept for one variant and reused for another was refused by CUDA on an H100 ("too many
blocks in cooperative launch") at 1823 x 781 and 4096 x 12672. These tests run shapes of
every variant in both orders, and the edges of the counted grid.

On a CPU the interpreter cannot split a row (its programs run one after another), so the
split itself is tested here only on a GPU; run by hand:
    python3 -m pytest -q tests/test_split_row.py
"""

import pytest
import torch
from lessons import load

LESSON_03 = load("03-long-softmax")

ON_GPU = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not ON_GPU, reason="the split-row kernel's programs share a row only on a GPU")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The shapes, beside aligned ones of the same chunk and split count, so that each
# dtype compiles more than one variant with the same constants.
SHAPES = [(1823, 781), (4096, 12672), (4096, 8192), (1, 1), (7, 16385), (33, 65537), (2, 262144), (4096, 65536)]


def check(x, **kwargs):
    y = LESSON_03.split_row_softmax(x, **kwargs)
    torch.cuda.synchronize()
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), dim=1), rtol=tol, atol=tol * 1e-2)


def test_variant_tells_apart_what_triton_compiles_apart():
    x = torch.empty(4, 16)
    aligned = LESSON_03.variant((x, 16, 32))
    assert LESSON_03.variant((x, 17, 32)) != aligned  # 17 is not a multiple of 16
    assert LESSON_03.variant((x, 1, 32)) != LESSON_03.variant((x, 3, 32))  # 1 is specialized
    assert LESSON_03.variant((x[:, 1:], 16, 32)) != aligned  # 4 bytes past an aligned address
    assert LESSON_03.variant((x, 16, 2**31)) != LESSON_03.variant((x, 16, 2**30))  # int64


@gpu_only
@pytest.mark.parametrize("order", ["as listed", "reversed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_shape_in_either_order(dtype, order):
    LESSON_03._resident.clear()  # counts from an earlier test must not decide this order
    shapes = SHAPES if order == "as listed" else SHAPES[::-1]
    for M, N in shapes:
        check(torch.randn(M, N, device="cuda", dtype=dtype) * 10)


@gpu_only
@pytest.mark.parametrize("num_warps", [1, 2, 8])
@pytest.mark.parametrize("chunk", [64, 1024, 8192])
def test_other_chunks_and_warps(chunk, num_warps):
    LESSON_03._resident.clear()
    for M, N in [(4096, 8192), (1823, 781), (300, 12345)]:
        check(torch.randn(M, N, device="cuda") * 10, chunk=chunk, num_warps=num_warps)


@gpu_only
@pytest.mark.parametrize("M, N", [(1823, 781), (4096, 12672), (1024, 65536), (1000, 50001)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_counted_grid_runs_and_one_group_more_is_refused(M, N, dtype):
    """At the edge of the count: the grid it allows runs cooperatively and computes the softmax, one group of
    programs more is refused by CUDA (not left to hang), and the GPU stays usable."""
    warps = LESSON_03.SPLIT_WARPS
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    chunk = LESSON_03.SPLIT_BYTES // x.element_size()

    def launch(extra_groups):
        y, args, meta = LESSON_03._split_row_args(x, chunk)
        groups = LESSON_03._programs_that_fit(args, meta, warps) // meta["SPLITS"] + extra_groups
        LESSON_03.split_row_kernel[(groups * meta["SPLITS"],)](*args, **meta, num_warps=warps,
                                                                **LESSON_03.COOPERATIVE)
        torch.cuda.synchronize()
        return y

    tol = TOLERANCE[dtype]
    torch.testing.assert_close(launch(0).double(), torch.softmax(x.double(), dim=1), rtol=tol, atol=tol * 1e-2)
    with pytest.raises(RuntimeError, match="cooperative"):
        launch(1)
    torch.cuda.synchronize()


LESSON_10 = load("10-long-softmax-gluon")
ON_HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not ON_HOPPER, reason="lesson 10's shared-memory kernel needs a Hopper GPU")
@pytest.mark.parametrize("chunk", [1024, 4096, 8192, 16384, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lesson_10s_count_by_hand_is_cudas(chunk, dtype):
    """Lesson 10 derives programs per SM from registers, threads and shared memory; lesson 03 asks CUDA. For
    lesson 10's kernel (4 warps) the two must agree, or its page teaches a wrong count."""
    x = torch.randn(64, 65536, device="cuda", dtype=dtype)
    kernel, by_hand = LESSON_10.compiled_kernel(*LESSON_10._shared_args(x, chunk)[1:])
    assert by_hand == LESSON_03.programs_per_sm(kernel, LESSON_10.SHARED_WARPS)
