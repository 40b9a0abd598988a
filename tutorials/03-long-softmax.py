"""
Softmax over rows too long for one tile
=======================================

The fused softmax of the previous lesson keeps a whole row in registers, which stops working once a
row outgrows a program's registers. This lesson walks a row in chunks instead: first in three passes,
then in two, with the *online softmax* trick that FlashAttention is built on.

You will learn:

* why the one-tile kernel stops scaling, and what it costs to walk a row in chunks;
* the three-pass softmax (max, sum, normalize) and the bytes it moves;
* the online softmax of Milakov and Gimelshein (2018), derived step by step: a running maximum
  with a rescaled running sum, in two passes;
* the *combine step* that merges two partial softmax states, which split-K decoding kernels reuse;
* what ``exp2`` really saves over ``exp``, read from the instructions the compiler emits;
* how far a single program can stretch before a row must leave the chip, and how several programs
  can share one row so that it is still read only once;
* which kernel to run at which row length, from measurements;
* how to give chunked kernels a backward pass that works for rows of any length;
* how each compares with ``torch.softmax`` and ``torch.compile``, as fractions of the copy bandwidth.

This lesson needs ``02-fused-softmax.py`` next to it (the site's zip of all lessons has both): for
short rows, its ``long_softmax`` runs that lesson's kernel.
"""

# %%
# Where the kernels run
# ---------------------
# As in every lesson: a CUDA GPU when there is one, otherwise the Triton interpreter on the CPU,
# switched on before the first ``@triton.jit``.

import functools
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def load_sibling(stem):
    """Another lesson of this site, imported once from the file next to this one: its script, or else its
    notebook (the site's two zips of all lessons hold one or the other side by side); ImportError, saying
    what to download, when neither is there."""
    import json
    import linecache
    import sys
    import types
    from pathlib import Path

    name = "lesson_" + stem.replace("-", "_")
    if name in sys.modules:
        return sys.modules[name]
    here = Path(__file__).parent if "__file__" in globals() else Path.cwd()
    path = here / f"{stem}.py"
    if path.exists():
        source = path.read_text(encoding="utf-8")
    elif path.with_suffix(".ipynb").exists():
        path = path.with_suffix(".ipynb")
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        source = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
        # Triton reads a kernel's source back through linecache: give it the code, not the notebook's JSON.
        linecache.cache[str(path)] = (len(source), None, source.splitlines(keepends=True), str(path))
    else:
        raise ImportError(f"this lesson needs {stem}.py or {stem}.ipynb in the same folder: download all lessons "
                          "as a zip from the site")
    module = types.ModuleType(name)  # not __main__: the lesson defines its kernels and runs nothing heavy
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]  # a half-run lesson must not be found by the next import
        raise
    return module


FUSED = load_sibling("02-fused-softmax")  # for rows short enough to share a program (long_softmax)

# %%
# Why one tile per row stops scaling
# ----------------------------------
# A Triton program runs on one streaming multiprocessor (SM) and holds everything in that SM's
# registers (64K 32-bit registers, 256 KiB, on an H100) and shared memory (up to 228 KiB). With at
# most 1,024 threads, a program taking the whole SM gets at most 64 registers per thread. A row of
# :math:`N = 65{,}536` fp32 values is 256 KiB, 64 values per thread: with the addresses and
# temporaries the math needs, it cannot fit, and the compiler *spills* the rest to local memory
# (device memory behind the caches). Half that row fits; the exact limit is measured below. Past
# it, a kernel walks the row in ``BLOCK_N``-element chunks, at a price: a softmax needs the row's
# maximum and sum before any output, so each chunk is read more than once.
#
# Three passes
# ------------
# Walking the row three times, for the maximum :math:`m`, the sum :math:`d = \sum_j e^{x_j - m}` and
# the output :math:`y_j = e^{x_j - m} / d`, reads :math:`3MN` elements and writes :math:`MN`: half
# the speed of an ideal one-pass kernel, before anything else goes wrong.
#
# Two details recur in the kernels below. First, the exponential: GPUs have a hardware instruction for
# :math:`2^x` (``ex2.approx`` in PTX, ``MUFU.EX2`` in machine code), and :math:`e^x = 2^{x \log_2 e}`,
# so the kernels write ``exp2((x - m) * log2(e))``. That saves less than it seems: compiled without a
# GPU for an H100 (sm_90) with Triton 3.6.0 (ptxas 12.8) and 3.9.0 (ptxas 13.4) alike, ``tl.exp(x)``
# is already that multiply by :math:`\log_2 e` and an ``ex2.approx.f32``. Only two differences remain:
#
# * ``tl.exp2`` emits the flush-to-zero ``ex2.approx.ftz.f32``, one ``MUFU.EX2`` after ptxas;
#   ``tl.exp``'s ``ex2.approx.f32`` gets a compare and two predicated multiplies around it per
#   element, to compute results below :math:`2^{-126}` (subnormals) correctly. Flushing them to
#   zero moves a softmax output by less than :math:`1.2 \times 10^{-38}`.
# * where a kernel multiplies its input anyway (attention's scale), :math:`\log_2 e` folds into that
#   constant: ``tl.exp(s * scale)`` is two multiplies per element, ``tl.exp2(s * (scale * LOG2E))`` one.
#
# With no other multiply here, each element costs one subtract, one multiply and one ``MUFU.EX2``,
# where ``tl.exp(x - m)`` would add the compare and two multiplies (whether that shows in the time
# of these memory-bound kernels is not measured). The order of subtract and multiply matters:
# scaling :math:`x` by :math:`\log_2 e` on load and subtracting a scaled maximum later is tempting,
# but for logits near :math:`10^4` the product is rounded to fp32's spacing there (about
# :math:`10^{-3}`): a :math:`10^{-3}` relative error in every output. Subtracting first is exact for
# nearby values, and the small difference then scales without loss. (The attention lessons fold the
# scale into the scores anyway: their scores are small.) Second, each chunk's maximum and sum are
# kept *per lane* (a vector of ``BLOCK_N`` partial results), reduced across lanes once, after the loop.


@triton.jit
def three_pass_kernel(x_ptr, y_ptr, N, x_row_stride, x_col_stride, y_row_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_N)
    # Pass 1: the maximum, per lane, then across lanes.
    lane_max = tl.full([BLOCK_N], -float("inf"), tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        x = tl.load(x_row + (start + cols) * x_col_stride, mask=start + cols < N, other=-float("inf"))
        lane_max = tl.maximum(lane_max, x.to(tl.float32))
    row_max = tl.max(lane_max, axis=0)
    # Pass 2: the sum of exponentials.
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        x = tl.load(x_row + (start + cols) * x_col_stride, mask=start + cols < N, other=-float("inf"))
        lane_sum += tl.exp2((x.to(tl.float32) - row_max) * 1.4426950408889634)
    row_sum = tl.sum(lane_sum, axis=0)
    # Pass 3: normalize and store.
    for start in tl.range(0, N, BLOCK_N):
        mask = start + cols < N
        x = tl.load(x_row + (start + cols) * x_col_stride, mask=mask, other=-float("inf"))
        y = tl.exp2((x.to(tl.float32) - row_max) * 1.4426950408889634) / row_sum
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# %%
# The online softmax: two passes
# ------------------------------
# The first two passes can be merged. Suppose we have read the first :math:`j` elements and kept
#
# .. math::
#
#    m_j &= \max_{i \le j} x_i, \\
#    d_j &= \sum_{i \le j} e^{x_i - m_j}.
#
# Reading :math:`x_{j+1}`, the new maximum is :math:`m_{j+1} = \max(m_j, x_{j+1})`. Every term of
# :math:`d_j` was computed relative to the old maximum; multiplying by :math:`e^{m_j - m_{j+1}}`
# moves them all to the new one at once:
#
# .. math::
#
#    d_{j+1} &= \sum_{i \le j+1} e^{x_i - m_{j+1}} \\
#            &= d_j \, e^{m_j - m_{j+1}} + e^{x_{j+1} - m_{j+1}}.
#
# After the last element, :math:`m_N` and :math:`d_N` are the true maximum and sum, and one more
# pass writes the output: :math:`2MN` read, :math:`MN` written. The rescaling factor is at most 1,
# so nothing overflows, and it is exactly 1 when the maximum does not change. Per lane, the same
# update runs on a vector of partial states, and at the end the lanes merge by the same rule,
# :math:`m = \max_\ell m_\ell` and :math:`d = \sum_\ell d_\ell e^{m_\ell - m}`. Everything later reuses
# that rule, so it deserves a name. For the states of two disjoint parts :math:`a` and :math:`b`:
#
# .. math::
#
#    &(m_a, d_a) \oplus (m_b, d_b) = (m,\; d), \quad \text{where} \\
#    &m = \max(m_a, m_b), \\
#    &d = d_a e^{m_a - m} + d_b e^{m_b - m}.
#
# This is **the combine step**. It is exact and associative, so parts merge in any order and
# grouping: one element at a time (the update above), lane by lane after a loop, or program by
# program, as the split-row kernel below does. Attention decoding kernels (split-K, also called
# flash-decoding) use exactly this step: programs each walk part of a long key sequence and leave a
# partial :math:`(m, d, \mathit{acc})`, with :math:`\mathit{acc} = \sum e^{x - m} v` rescaled by
# :math:`e^{m_a - m}` like :math:`d`, for a last step to merge (the second exercise).
#
# One trap: a lane that has seen only :math:`-\infty` (masked padding, or genuine ``-inf`` logits)
# has :math:`m_\ell = -\infty`, and :math:`e^{m_\ell - m_\ell}` is :math:`e^{-\infty + \infty}`,
# ``NaN``. The kernel rescales against a maximum replaced by 0 while it is still :math:`-\infty`;
# the terms are then :math:`e^{-\infty} = 0`, as they should be.


@triton.jit
def online_softmax_kernel(x_ptr, y_ptr, N, x_row_stride, x_col_stride, y_row_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_N)
    lane_max = tl.full([BLOCK_N], -float("inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    # Pass 1: running maximum and rescaled running sum.
    for start in tl.range(0, N, BLOCK_N):
        x = tl.load(x_row + (start + cols) * x_col_stride, mask=start + cols < N, other=-float("inf"))
        x = x.to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        lane_sum = (lane_sum * tl.exp2((lane_max - safe_max) * 1.4426950408889634)
                    + tl.exp2((x - safe_max) * 1.4426950408889634))
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    row_sum = tl.sum(lane_sum * tl.exp2((lane_max - row_max) * 1.4426950408889634), axis=0)
    # Pass 2: normalize and store.
    for start in tl.range(0, N, BLOCK_N):
        mask = start + cols < N
        x = tl.load(x_row + (start + cols) * x_col_stride, mask=mask, other=-float("inf"))
        y = tl.exp2((x.to(tl.float32) - row_max) * 1.4426950408889634) / row_sum
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# %%
# One pass, while the row still fits
# ----------------------------------
# Between "fits in a few warps" and "cannot fit at all", a row fits in one program only if that
# program takes the whole SM: 32 warps (1,024 threads), each thread holding a few dozen elements in
# registers. The row is then read once and written once, like the fused kernel. Where it starts to
# spill is for the compiler and GPU to say: see "Where a row stops fitting on chip", after the benchmark.


@triton.jit
def row_on_chip_kernel(x_ptr, y_ptr, N, x_row_stride, x_col_stride, y_row_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    numerator = tl.exp2((x - tl.max(x, axis=0)) * 1.4426950408889634)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# %%
# The backward, for rows of any length
# ------------------------------------
# Every launcher below returns a tensor that autograd can differentiate, with lesson 02's math: the
# Jacobian of a softmax row is :math:`\operatorname{diag}(y) - y\,y^\top`, so
# :math:`dx = y \circ \big(dy - \operatorname{rowsum}(dy \circ y)\big)`, which needs only the saved
# output :math:`y`. A long row no longer fits in registers, so the backward walks it in chunks like
# the forward: one loop for the dot product of :math:`dy` and :math:`y` (per lane, reduced once), one
# to write :math:`dx`. This reads :math:`y` and :math:`dy` twice (lesson 02's fused backward reads them
# once), but one kernel serves rows of any length, whichever forward produced :math:`y`.


@triton.jit
def softmax_backward_kernel(y_ptr, dy_ptr, dx_ptr, N, dy_row_stride, dy_col_stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * N  # y and dx are contiguous: the launchers allocate them
    dx_row = dx_ptr + row * N
    dy_row = dy_ptr + row * dy_row_stride
    cols = tl.arange(0, BLOCK_N)
    # Pass 1: the dot product of y and dy, per lane, then across lanes. Padding adds 0.
    lane_dot = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        mask = start + cols < N
        y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + (start + cols) * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        lane_dot += y * dy
    dot = tl.sum(lane_dot, axis=0)
    # Pass 2: dx = y * (dy - dot).
    for start in tl.range(0, N, BLOCK_N):
        mask = start + cols < N
        y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + (start + cols) * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_row + start + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


# %%
# The launch helpers
# ------------------
# One program per row: :math:`M = 4096` rows give many more programs than SMs, so the hardware
# scheduler keeps every SM busy without a persistent loop. Chunks are 4,096 elements on 8 warps (16
# per thread); tests force tiny ones with ``block_n`` so that the loops run many times. A chunk must
# be a power of two, like Triton's block shapes: a bad ``block_n`` is refused here by name, not deep
# in the kernel by the interpreter with a message about ``arange``. As in lesson 02, a
# *negative view* (``torch._neg_view(x)``, or ``x.conj().imag`` of a complex tensor) is resolved
# first: it shares memory with the un-negated values, carrying only a flag that a kernel reading raw
# memory never sees. The autograd wrapper is lesson 02's, with the backward above (``forward``
# saves :math:`y`); calls that want no graph, such as the benchmark's, skip it and pay nothing.

check_input, SUPPORTED_DTYPES = FUSED.check_input, FUSED.SUPPORTED_DTYPES  # lesson 02's, under their own names
ROW_ON_CHIP_LIMIT = 32768  # longest row (elements) row_on_chip_kernel is launched for
MAX_BLOCK = 2 ** 20  # the most elements Triton allows in one block


def _check_block(name, value):
    """Refuse a chunk size that is not a power of two Triton accepts as a block, naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (a power of two), got {value!r} of type {type(value).__name__}")
    if not 1 <= value <= MAX_BLOCK or value & (value - 1):
        raise ValueError(f"{name} must be a power of two from 1 to {MAX_BLOCK}, got {value}")


def _check_warps(value):
    """Refuse a warp count Triton cannot launch (a power of two up to 32: 1,024 threads), naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_warps must be an int, got {value!r} of type {type(value).__name__}")
    if value not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {value}")


def _prepare(x):
    check_input(x)
    # Conjugate views exist only for complex tensors, which check_input refuses; negative views remain.
    # Lesson 02's int32_columns copies the rare view whose column offsets would pass 32 bits.
    return FUSED.int32_columns(x.resolve_neg())


def softmax_backward(y, dy, block_n):
    """dx = y * (dy - rowsum(dy * y)) for a contiguous softmax output y, in chunks of at most block_n."""
    dy = FUSED.int32_columns(dy.resolve_neg())
    M, N = y.shape
    dx = torch.empty_like(y)
    softmax_backward_kernel[(M,)](y, dy, dx, N, dy.stride(0), dy.stride(1),
                                  BLOCK_N=min(block_n, triton.next_power_of_2(N)), num_warps=8)
    return dx


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, launch, block_n):
        y = launch(x)
        ctx.save_for_backward(y)
        ctx.block_n = block_n
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, dy, ctx.block_n), None, None


def _differentiable(launch, x, block_n=4096):
    if torch.is_grad_enabled() and x.requires_grad:
        return _Softmax.apply(x, launch, block_n)
    return launch(x)


def _launch(kernel, x, block_n, num_warps):
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    kernel[(M,)](x, y, N, x.stride(0), x.stride(1), y.stride(0), BLOCK_N=block_n, num_warps=num_warps)
    return y


def three_pass_softmax(x, block_n=4096):
    """Row-wise softmax, walking each row three times in chunks of block_n (a power of two)."""
    x = _prepare(x)
    _check_block("block_n", block_n)
    return _differentiable(lambda t: _launch(three_pass_kernel, t, block_n, num_warps=8), x, block_n)


def online_softmax(x, block_n=4096):
    """Row-wise softmax, walking each row twice with the online max-and-sum update."""
    x = _prepare(x)
    _check_block("block_n", block_n)
    return _differentiable(lambda t: _launch(online_softmax_kernel, t, block_n, num_warps=8), x, block_n)


def row_on_chip_softmax(x):
    """Row-wise softmax reading each row once; rows up to ROW_ON_CHIP_LIMIT elements."""
    x = _prepare(x)
    if x.shape[1] > ROW_ON_CHIP_LIMIT:
        raise ValueError(f"row_on_chip_softmax holds a row in registers: at most {ROW_ON_CHIP_LIMIT} columns, "
                         f"got {x.shape[1]}")
    block_n = triton.next_power_of_2(x.shape[1])
    num_warps = max(1, min(32, block_n // 32))
    return _differentiable(lambda t: _launch(row_on_chip_kernel, t, block_n, num_warps), x)


# %%
# Beyond one SM: programs that share a row
# ----------------------------------------
# Past one SM, the two-pass kernel reads a row twice: a ceiling of two thirds of the copy bandwidth,
# unless the L2 cache serves the second read ("What the numbers say" shows where it does).
# To read a long row once, several programs share it. Each of ``SPLITS`` programs holds one chunk in
# registers, computes its maximum :math:`m_c` and sum :math:`d_c = \sum e^{x - m_c}`, publishes the
# pair to a small buffer in device memory, increments the row's *arrival counter*, waits until it
# shows every chunk has arrived, merges the pairs with the combine step and normalizes the chunk it
# still holds: each element read and written once, like the fused kernel, for rows of any length the
# whole GPU can hold. A kernel's programs normally never wait for one another, so this takes care (on
# Hopper, thread-block clusters with distributed shared memory do the exchange in hardware, without a
# round trip through device memory; Triton does not expose them):
#
# * **Every program of a row must be running at the same time**, or the waiting ones spin forever
#   on a chunk that never arrives. So the launcher compiles the kernel first, reads how many
#   programs fit on the GPU at once (its occupancy) and launches no more, each group of ``SPLITS``
#   programs walking its share of the rows, *cooperatively* (``launch_cooperative_grid=True``):
#   CUDA starts them all together, or refuses a grid too large for that with an error ("too many
#   blocks in cooperative launch") instead of letting it hang.
# * **Memory ordering.** The pair must be visible before the counter says it is: the increment is
#   an atomic with *release* semantics, the polling read one with *acquire* semantics, and the pairs
#   are read back with ``volatile`` loads that bypass the SM's non-coherent L1 cache.
# * **The interpreter runs programs one after another**, so a program waiting for a later one would
#   wait forever: there each row gets one program (``SPLITS = 1``), exercising all but the waiting.
#   The correctness check below runs the cooperative version on a GPU, on rows split ten ways.


@triton.jit
def split_row_kernel(x_ptr, y_ptr, stats_ptr, arrived_ptr, M, N, x_row_stride, x_col_stride, y_row_stride,
                     CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // SPLITS
    split = pid % SPLITS
    cols = split * CHUNK + tl.arange(0, CHUNK)
    col_ok = cols < N
    chunks = tl.arange(0, SPLITS_POW2)
    for row in tl.range(pid // SPLITS, M, groups):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(x_ptr + row64 * x_row_stride + cols * x_col_stride, mask=col_ok, other=-float("inf"))
        x = x.to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        safe_max = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
        chunk_sum = tl.sum(tl.exp2((x - safe_max) * 1.4426950408889634), axis=0)
        stats = stats_ptr + (row64 * SPLITS + split) * 2
        tl.store(stats, chunk_max)
        tl.store(stats + 1, chunk_sum)
        tl.debug_barrier()  # every thread's stores are done before one thread signals
        tl.atomic_add(arrived_ptr + row, 1, sem="release")
        while tl.atomic_add(arrived_ptr + row, 0, sem="acquire") < SPLITS:
            pass
        all_stats = stats_ptr + (row64 * SPLITS + chunks) * 2
        maxes = tl.load(all_stats, mask=chunks < SPLITS, other=-float("inf"), volatile=True)
        sums = tl.load(all_stats + 1, mask=chunks < SPLITS, other=0.0, volatile=True)
        row_max = tl.max(maxes, axis=0)
        row_sum = tl.sum(sums * tl.exp2((maxes - row_max) * 1.4426950408889634), axis=0)
        y = tl.exp2((x - row_max) * 1.4426950408889634) / row_sum
        tl.store(y_ptr + row64 * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


# 32 KiB of the row per program, 4 warps: 8,192 fp32 or 16,384 bf16 elements, the H100 winners of
# tools/tune.py split-row (bf16 with fp32's 8,192: 83% of a same-size copy at 65,536 columns, against 89% with 16,384).
SPLIT_BYTES, SPLIT_WARPS = 32768, 4
COOPERATIVE = dict(launch_cooperative_grid=True)  # all programs resident at once, or CUDA refuses (see above)
_resident = {}


def max_programs_per_sm(props):
    """Programs (thread blocks) an SM holds at most, by compute capability: 16 or 24 on these, 32 on the others
    from Volta to Hopper (the CUDA programming guide's table of limits)."""
    return {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}.get((props.major, props.minor), 32)


def _programs_that_fit(args, meta, num_warps):
    """How many programs of this kernel the GPU holds at once (all of them must run together)."""
    key = (args[0].device, args[0].dtype, tuple(sorted(meta.items())), num_warps)
    if key not in _resident:
        kernel = split_row_kernel.warmup(*args, **meta, num_warps=num_warps, grid=(1,), **COOPERATIVE)
        kernel._init_handles()
        props = torch.cuda.get_device_properties(args[0].device)
        threads = num_warps * 32
        regs = -(-kernel.n_regs // 8) * 8  # registers are handed out in blocks of 256 per warp
        per_sm = min(props.regs_per_multiprocessor // max(1, regs * threads),
                     props.max_threads_per_multi_processor // threads,
                     props.shared_memory_per_multiprocessor // max(1, kernel.metadata.shared),
                     max_programs_per_sm(props))
        _resident[key] = props.multi_processor_count * per_sm
    return _resident[key]


def _split_row_args(x, chunk):
    """The output and the split-row kernel's arguments and compile-time constants for x in chunks."""
    M, N = x.shape
    splits = triton.cdiv(N, chunk)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    stats = torch.empty((M, splits, 2), dtype=torch.float32, device=x.device)
    arrived = torch.zeros((M,), dtype=torch.int32, device=x.device)
    args = (x, y, stats, arrived, M, N, x.stride(0), x.stride(1), y.stride(0))
    return y, args, dict(CHUNK=chunk, SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits))


def _split_row(x, chunk, num_warps):
    M, N = x.shape
    chunk = chunk or (SPLIT_BYTES // x.element_size() if ON_GPU else triton.next_power_of_2(N))
    splits = triton.cdiv(N, chunk)
    if splits > 1 and not ON_GPU:
        raise ValueError("split_row_softmax cannot split a row under the Triton interpreter: its programs run "
                         "one after another, and a program waiting for another would wait forever")
    y, args, meta = _split_row_args(x, chunk)
    num_warps = SPLIT_WARPS if num_warps is None else num_warps
    if ON_GPU:
        groups = min(M, _programs_that_fit(args, meta, num_warps) // splits)
        if groups == 0:
            raise ValueError(f"a row of {N} elements needs {splits} programs at once, more than this GPU holds")
    else:
        groups = M
    split_row_kernel[(groups * splits,)](*args, **meta, num_warps=num_warps, **COOPERATIVE)
    return y


def split_row_softmax(x, chunk=None, num_warps=None):
    """Row-wise softmax reading each row once, any length: SPLITS programs share a row on a GPU."""
    x = _prepare(x)
    if chunk is not None:
        _check_block("chunk", chunk)
    if num_warps is not None:
        _check_warps(num_warps)
    return _differentiable(lambda t: _split_row(t, chunk, num_warps), x)


# Up to this row length, lesson 02's ``softmax`` (tiles of several short rows per program, and from its
# ``LONG_ROW`` on its one-row kernel) beats the row-on-chip kernel: on an H100 at 4,096 columns, lesson
# 01's tiles reached 97% of a same-size copy against 89% in fp32, 99% against 64% in bf16.
TILE_LIMIT = 8192


def long_softmax(x):
    """The fastest kernel measured for the row length: lesson 02's softmax for short rows, one program per row
    while a row fits in one SM, then programs that share a row (on a GPU) or the two-pass online kernel."""
    check_input(x)
    if x.shape[1] <= TILE_LIMIT:
        return FUSED.softmax(x)
    if x.shape[1] <= ROW_ON_CHIP_LIMIT:
        return row_on_chip_softmax(x)
    return split_row_softmax(x) if ON_GPU else online_softmax(x)


# %%
# Correctness
# -----------
# Check all four kernels against a float64 reference on an irregular shape, with chunks small
# enough that the loops run many times and the last chunk is ragged, values and gradients alike.
# ``torch.testing.assert_close`` compares element by element, so a single ``NaN`` fails.

if __name__ == "__main__":
    torch.manual_seed(0)
    M = 2000 if ON_GPU else 37  # on a GPU more rows than groups of split-row programs: each group walks several
    x = torch.randn(M, 5001, device=DEVICE) * 10
    dy = torch.randn(M, 5001, device=DEVICE)
    x64 = x.double().requires_grad_()
    reference = torch.softmax(x64, dim=1)
    reference.backward(dy.double())
    for name, fn in [("three-pass", lambda t: three_pass_softmax(t, block_n=512)),
                     ("online", lambda t: online_softmax(t, block_n=512)),
                     ("row on chip", row_on_chip_softmax),
                     ("split row", lambda t: split_row_softmax(t, chunk=512 if ON_GPU else None))]:
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        y.backward(dy)
        torch.testing.assert_close(y.double(), reference.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(leaf.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
        print(f"{name:12s} {M}x5001 fp32 vs float64: max abs error {(y.double() - reference).abs().max().item():.2e}, "
              f"gradient {(leaf.grad.double() - x64.grad).abs().max().item():.2e}")

# %%
# Benchmark
# ---------
# On a GPU, :math:`M = 4096` rows of 16K to 256K elements (under the interpreter, a few small rows),
# in GB/s (:math:`2MN \times` element size over time), beside ``torch.softmax``, ``torch.compile``
# (GPU only) and the copy bandwidth measured in this run, timed with lesson 02's harness.

# Lesson 02's harness under its own names: platform, timing, copy bandwidth, results for the performance page.
describe_platform, bench_ms, fastest_of_rounds, ROUNDS = (
    FUSED.describe_platform, FUSED.bench_ms, FUSED.fastest_of_rounds, FUSED.ROUNDS)
copy_bandwidth_gbs, save_results = FUSED.copy_bandwidth_gbs, FUSED.save_results

OURS = {"three-pass": three_pass_softmax, "online (two-pass)": online_softmax,
        "row on chip (one pass)": row_on_chip_softmax, "split row (one pass)": split_row_softmax}


def run_benchmark(M, sizes, dtypes):
    rows = []
    for dtype in dtypes:
        for N in sizes:
            x = torch.randn(M, N, device=DEVICE, dtype=dtype)
            gbs = lambda ms: 2 * x.numel() * x.element_size() / ms * 1e-6  # noqa: E731
            case = dict(dtype=str(dtype).split(".")[1], N=N)
            providers = {name: fn for name, fn in OURS.items()
                         if N <= ROW_ON_CHIP_LIMIT or fn is not row_on_chip_softmax}
            providers["torch.softmax"] = lambda t: torch.softmax(t, dim=1)
            if ON_GPU:
                torch._dynamo.reset()
                providers["torch.compile"] = torch.compile(lambda t: torch.softmax(t, dim=1), dynamic=False)
            timers = {name: functools.partial(bench_ms, functools.partial(fn, x)) for name, fn in providers.items()}
            for name, ms in fastest_of_rounds(timers).items():
                rows.append(dict(case, provider=name, value=gbs(ms)))
    return rows


if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    print(describe_platform())
    if ON_GPU:
        M, sizes = 4096, [16384, 32768, 65536, 131072, 262144]
    else:
        M, sizes = 4, [4096, 16384]
    dtypes = [torch.float32, torch.bfloat16]
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy bandwidth, measured now: {copy_gbs:.0f} GB/s")
    results = pd.DataFrame(run_benchmark(M, sizes, dtypes))
    table = results.pivot_table(index=["dtype", "N"], columns="provider", values="value", sort=False)

# %%
# The results
# -----------
# Every provider's speed in GB/s at each row length, in this run (NaN where a kernel does not run,
# as row-on-chip past ``ROW_ON_CHIP_LIMIT``; to 0.1 GB/s on a GPU, three decimals for the interpreter):

table.rename_axis(columns="GB/s").round(1 if ON_GPU else 3) if __name__ == "__main__" else None

# %%
# What the numbers say
# --------------------
# From the table just above, in this run: for each row length, the fastest of this lesson's
# kernels, its speed relative to the best PyTorch peer, and its share of the copy bandwidth. The
# byte counts predict at most 1/2 of the copy bandwidth for three passes, 2/3 for two, all of it for
# one pass; a pass re-reading a row still in the L2 cache can beat that, the more so the shorter
# the row: the table shows by how much.

if __name__ == "__main__":
    peers = [c for c in table.columns if c not in OURS]
    for key, row in table.iterrows():
        ours = row[list(OURS)].dropna()
        best = ours.idxmax()
        print(f"{key[0]:>8s} N = {key[1]:>6d}: best is {best} at {row[best] / copy_gbs:.0%} of copy bandwidth, "
              f"{row[best] / row[peers].max():.2f}x the best PyTorch peer; "
              f"online vs. three-pass {row['online (two-pass)'] / row['three-pass']:.2f}x")
    if not ON_GPU:
        print("These are interpreter timings: the ratios measure NumPy on the CPU, not GPU kernels.")
    save_results("03-long-softmax", [{
        "name": f"long-row softmax, M = {M}", "unit": "GB/s", "ceiling_name": "copy bandwidth", "ceiling": copy_gbs,
        "ours": list(OURS), "peers": peers, "rows": results.to_dict("records")}])

# %%
# How close to the copy bandwidth?
# --------------------------------
# The same numbers as the results table above, one panel per dtype. The dashed line is the copy
# bandwidth, drawn behind the curves so that a kernel running at it stays visible.

if __name__ == "__main__":
    # Shown about 710 px wide on a desktop page: at 8 inches and 100 dpi, 10-point text reads as 9 points.
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 10,
                         "xtick.labelsize": 10, "ytick.labelsize": 10})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(8, 4.8), sharey=True, squeeze=False)
    for ax, (dtype, part) in zip(axes[0], table.groupby(level="dtype", sort=False)):
        ax.axhline(copy_gbs, color="black", linestyle="--", linewidth=1, zorder=1, label="copy bandwidth")
        part.droplevel("dtype").plot(ax=ax, marker="o", markersize=4, logx=True, zorder=3)
        ax.set(title=dtype, xlabel="N (row length)", ylabel="GB/s", ylim=(0, None))
        ax.set_xticks(sizes, [str(n) for n in sizes], rotation=45, minor=False)
        ax.minorticks_off()
        ax.get_legend().remove()
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    fig.suptitle(f"Long-row softmax, M = {M} rows: speed against the copy bandwidth")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    plt.show()

# %%
# Registers and bytes in flight, by dtype
# ---------------------------------------
# Where bf16 runs further from the copy than fp32 in the table above (as in this site's H100
# builds), look here: each split-row program gets 32 KiB of the row in both dtypes, twice the
# elements in bf16, each held as fp32 in registers until the row's statistics arrive. More
# registers per thread mean fewer programs per SM, and while a program waits for the rest of its
# row, only the other programs on its SM keep loads in flight. At the longest row, this cell asks
# the compiler per dtype for registers per thread and programs per SM, hence the part of the row
# each SM can be loading at once, beside the measured speed. Lesson 10 keeps the chunk in shared
# memory instead, as the 16-bit values it read, and measures what that buys.

if __name__ == "__main__" and ON_GPU:
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for dtype in dtypes:
        x = torch.empty(M, sizes[-1], device=DEVICE, dtype=dtype)
        y, args, meta = _split_row_args(x, SPLIT_BYTES // x.element_size())
        compiled = split_row_kernel.warmup(*args, **meta, num_warps=SPLIT_WARPS, grid=(1,), **COOPERATIVE)
        compiled._init_handles()
        per_sm = _programs_that_fit(args, meta, SPLIT_WARPS) // sms
        speed = table.loc[(str(dtype).split(".")[1], sizes[-1]), "split row (one pass)"]
        print(f"{str(dtype).split('.')[1]:>8s}: {meta['CHUNK']} elements per program, {compiled.n_regs} registers per "
              f"thread, {per_sm} programs per SM, so {per_sm * SPLIT_BYTES // 1024} KiB of the row in flight per SM; "
              f"{speed / copy_gbs:.0%} of the copy bandwidth at N = {sizes[-1]}")
elif __name__ == "__main__":
    print("Registers and occupancy need a kernel compiled for a GPU.")

# %%
# Where a row stops fitting on chip
# ---------------------------------
# By lesson 02's register argument (and this lesson's top), a row of 32,768 fp32 values (32 per
# thread of 1,024) fits with room for temporaries; one of 65,536 (64 per thread) cannot. On a GPU,
# this cell compiles the row-on-chip kernel with 32 warps for rows of 16,384, 32,768 and 65,536
# fp32 values (launched directly, past the launcher's limit) and prints the registers and local
# memory (spills) per thread it got, and its speed on :math:`M = 4096` rows. For readers without a GPU: a
# compile made offline for sm_90 with Triton 3.6 and 3.9, in fp32 and bf16 (not this page's
# numbers), used 42 to 48, 54 to 56 and 64 registers per thread for those lengths and spilled only
# at 65,536 (268 to 456 bytes of spill stores per thread, as ptxas counts them). The GPU's own
# compile can use fewer registers, but it too runs out at 65,536.

if __name__ == "__main__" and ON_GPU:
    for block_n in (16384, 32768, 65536):
        x = torch.randn(4096, block_n, device=DEVICE)
        y = torch.empty_like(x)
        args = (x, y, block_n, x.stride(0), x.stride(1), y.stride(0))
        compiled = row_on_chip_kernel.warmup(*args, BLOCK_N=block_n, num_warps=32, grid=(1,))
        compiled._init_handles()
        ms = bench_ms(lambda: row_on_chip_kernel[(4096,)](*args, BLOCK_N=block_n, num_warps=32))
        print(f"N = {block_n:6d}: {compiled.n_regs} registers and {4 * compiled.n_spills} bytes of local memory "
              f"per thread; {2 * x.numel() * 4 / ms * 1e-6 / copy_gbs:.0%} of the copy bandwidth")
elif __name__ == "__main__":
    print("Registers and spills need a kernel compiled for a GPU: see the offline figures in the text above.")

# %%
# Exercises
# ---------
# Each exercise has a check that runs your function on fresh random inputs of irregular shapes
# against a float64 reference with ``torch.testing.assert_close`` (so ``NaN`` fails), then raises
# ``AssertionError`` saying what is wrong or prints one line saying it passed. No solutions here.
#
# 1. **Two loops, one state per row.** Turn ``three_pass_kernel`` into two loops: the first keeps
#    one running :math:`(m, d)` per row (not per lane as in ``online_softmax_kernel``), merging each
#    chunk's own maximum and sum into it with the combine step; the second writes the output. Wrap
#    it in ``two_loop_softmax(x, block_n)`` and run ``check_two_loop_softmax(two_loop_softmax)``:
#    its 16-element chunks make the loops run many times, and some rows' whole first chunk is
#    ``-inf`` (mind the online softmax's trap).
# 2. **The decoding combine.** A split-K (flash-decoding) attention kernel leaves, for each of
#    :math:`M` rows, :math:`S` partial states :math:`(m_s, d_s, \mathit{acc}_s)`, with
#    :math:`\mathit{acc}_s = \sum e^{x - m_s} v` of length :math:`D` over split :math:`s`'s keys.
#    Write ``merge_partials(m, d, acc)`` as a Triton kernel: ``m`` and ``d`` are (M, S) fp32,
#    ``acc`` is (M, S, D) fp32 with any strides, and the result is the (M, D) fp32 output
#    :math:`\sum_s e^{m_s - m} \mathit{acc}_s / \sum_s e^{m_s - m} d_s`. Splits that saw only masked
#    keys have :math:`m_s = -\infty`, :math:`d_s = 0`, :math:`\mathit{acc}_s = 0`. Check with
#    ``check_merge_partials(merge_partials)``.

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _expect_close(exercise, case, got, expected, dtype, rtol, atol):
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != dtype:
        shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"{exercise} on {case}: the output should be a {tuple(expected.shape)} {dtype} tensor, "
                             f"got {shown}")
    try:
        torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol)
    except AssertionError as error:
        raise AssertionError(f"{exercise} on {case}: the output differs from the float64 reference.\n{error}") from None


def check_two_loop_softmax(fn):
    """Check fn(x, block_n) -> row-wise softmax, run with 16-element chunks on rows that start with -inf."""
    count = 0
    for dtype in SUPPORTED_DTYPES:
        for M, N, strided in [(1, 1, False), (7, 1, False), (1, 300, False), (5, 257, False), (13, 200, True)]:
            base = (torch.randn(M, N + 7 * strided, device=DEVICE) * 10).to(dtype)
            x = base[:, 7:] if strided else base
            x[M // 2] += 100  # e^100 overflows fp32: the running maximum must be subtracted
            x[0, :20] = -float("inf")  # the whole first chunk of row 0 (and all of it when N <= 20)
            x[0, -1] = 0.0  # one finite logit per row: an all -inf row has no softmax
            x[-1, ::3] = -float("inf")
            x[-1, -1] = 0.0
            case = f"{M}x{N} {str(dtype)[6:]}" + (" strided view" if strided else "")
            expected = torch.softmax(x.double(), dim=1)
            _expect_close("two_loop_softmax", case, fn(x, 16), expected, dtype, TOLERANCE[dtype],
                          TOLERANCE[dtype] * 1e-2)
            count += 1
    print(f"two_loop_softmax passed on {count} fresh inputs (irregular shapes, fp32/fp16/bf16, masked "
          "logits, strided views).")


def check_merge_partials(fn):
    """Check fn(m, d, acc) -> the (M, D) output merged from S partial softmax states per row."""
    count = 0
    for M, N, S, D in [(1, 1, 1, 1), (1, 10, 4, 3), (3, 50, 4, 16), (5, 257, 7, 24), (2, 1000, 3, 64)]:
        x = torch.randn(M, N, device=DEVICE, dtype=torch.float64) * 10
        v = torch.randn(M, N, D, device=DEVICE, dtype=torch.float64)
        width = triton.cdiv(N, S)
        x[-1] += 100  # e^100 overflows fp32: the splits' maxima must be subtracted
        x[0, :min(2, S - 1) * width] = -float("inf")  # splits 0 and 1 of row 0 saw only masked keys
        x[:, -1] = 0.0  # one key per row stays visible
        parts = [(x[:, s * width:(s + 1) * width], v[:, s * width:(s + 1) * width]) for s in range(S)]
        m = torch.stack([p.amax(dim=1) for p, _ in parts], 1)
        safe = torch.where(m == -float("inf"), 0.0, m)
        weights = [torch.exp(p - safe[:, s, None]) for s, (p, _) in enumerate(parts)]
        d = torch.stack([w.sum(dim=1) for w in weights], 1)
        acc = torch.stack([(w[:, :, None] * pv).sum(dim=1) for w, (_, pv) in zip(weights, parts)], 1)
        m, d = m.float(), d.float()
        acc = acc.float().transpose(1, 2).contiguous().transpose(1, 2)  # strides (S*D, 1, S), not contiguous
        # The definition, in float64 from the very fp32 states given: at m near 130, rounding m to fp32
        # alone moves a weight by about 1e-5, more than the tolerance.
        weights = torch.exp(m.double() - m.double().amax(dim=1, keepdim=True))
        expected = (weights[:, :, None] * acc.double()).sum(dim=1) / (weights * d.double()).sum(dim=1)[:, None]
        case = f"M={M}, S={S}, D={D}"
        _expect_close("merge_partials", case, fn(m, d, acc), expected, torch.float32, 1e-5, 1e-6)
        count += 1
    print(f"merge_partials passed on {count} fresh inputs (irregular M, S and D, masked splits, strided acc).")
