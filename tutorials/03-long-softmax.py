"""
Softmax over rows too long for one tile
=======================================

Lesson 02's fused softmax keeps a whole row in registers, which stops working once a
row outgrows them. This lesson walks a row in chunks instead: in three passes, then in
two with the *online softmax* that FlashAttention is built on. Previous lesson:
:doc:`02-fused-softmax`, whose file must sit next to this one (the site's zip of all
lessons has both): ``long_softmax`` runs its kernel for short rows. Next:
:doc:`04-tiled-matmul`. Triton's functions: `triton.language
<https://triton-lang.org/main/python-api/triton.language.html>`_, `tl.exp2
<https://triton-lang.org/main/python-api/generated/triton.language.exp2.html>`_.

You will learn:

* why the one-tile kernel stops scaling, and what walking a row in chunks costs;
* the three-pass softmax (max, sum, normalize) and the bytes it moves;
* the online softmax of Milakov and Gimelshein (`Online normalizer calculation for
  softmax <https://arxiv.org/abs/1805.02867>`_, 2018), derived step by step, and the
  *combine step* that merges two partial states, which split-K decoding reuses;
* what ``exp2`` really saves over ``exp``, read from the compiler's instructions;
* how far one program stretches before a row must leave the chip, and (optional) how
  several programs can share a row so that it is read only once;
* which kernel to run at which row length, and a backward for rows of any length;
* how each compares with ``torch.softmax`` and ``torch.compile``, as fractions of the
  copy bandwidth.
"""

# %%
# Where the kernels run
# ---------------------
# As in every lesson, ``stepkit`` picks a CUDA GPU, else the Triton interpreter (CPU).

import ctypes
import functools

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

FUSED = kit.load_lesson("02-fused-softmax")  # short rows share a program there

# %%
# Why one tile per row stops scaling
# ----------------------------------
# A Triton program runs on one streaming multiprocessor (SM) and holds everything in
# that SM's registers (64K 32-bit registers, 256 KiB, on an H100) and shared memory
# (228 KiB per SM, of which one program may use up to 227 KiB), shared by the programs
# it runs at once. A program has at most 1,024 threads, so even alone on the SM it gets
# at most 64 registers per thread. A row of :math:`N = 65{,}536` fp32 values is 256
# KiB, 64 values per thread: with addresses and temporaries it cannot fit, and the
# compiler *spills* the rest to local memory (device memory behind the caches). Half
# that row fits (the limit is measured below). Past it, a kernel walks the row in
# ``BLOCK_N``-element chunks, at a price: a softmax needs the row's maximum and sum
# before any output, so each chunk is read more than once.
#
# Three passes
# ------------
# Walking the row three times, for the maximum :math:`m`, the sum
# :math:`d = \sum_j e^{x_j - m}` and the output :math:`y_j = e^{x_j - m} / d`, reads
# :math:`3MN` elements and writes :math:`MN`: half the speed of an ideal one-pass
# kernel, before anything else goes wrong.
#
# Two details recur below. First, GPUs compute :math:`2^x` in hardware (``MUFU.EX2``)
# and :math:`e^x = 2^{x \log_2 e}`, so the kernels write ``exp2((x - m) * LOG2E)``.
# ``tl.exp`` compiles to the same multiply and :math:`2^x`, so this saves less than it
# seems ("What exp2 saves" reads the compiler's output); where a kernel multiplies
# anyway (attention's scale), :math:`\log_2 e` folds into that constant. Subtract the
# maximum *before* scaling: near :math:`10^4`, :math:`x \log_2 e` is rounded to fp32's
# spacing there (about :math:`10^{-3}`), an error in every output, while the difference
# of nearby values is exact. Second, each chunk's maximum and sum are kept *per lane*
# (a vector of ``BLOCK_N`` partial results), reduced across lanes once, after the loop.


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): e^x = 2^(x * LOG2E)


@triton.jit
def three_pass_kernel(
    x_ptr, y_ptr, N, x_row_stride, x_col_stride, y_row_stride, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_N)
    # Pass 1: the maximum, per lane, then across lanes.
    lane_max = tl.full([BLOCK_N], -float("inf"), tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        offs = start + cols
        x = tl.load(x_row + offs * x_col_stride, mask=offs < N, other=-float("inf"))
        lane_max = tl.maximum(lane_max, x.to(tl.float32))
    row_max = tl.max(lane_max, axis=0)
    # Pass 2: the sum of exponentials.
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        offs = start + cols
        x = tl.load(x_row + offs * x_col_stride, mask=offs < N, other=-float("inf"))
        lane_sum += tl.exp2((x.to(tl.float32) - row_max) * LOG2E)
    row_sum = tl.sum(lane_sum, axis=0)
    # Pass 3: normalize and store.
    for start in tl.range(0, N, BLOCK_N):
        offs = start + cols
        x = tl.load(x_row + offs * x_col_stride, mask=offs < N, other=-float("inf"))
        y = tl.exp2((x.to(tl.float32) - row_max) * LOG2E) / row_sum
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=offs < N)


# %%
# The online softmax: two passes
# ------------------------------
# The first two passes can be merged. Suppose we have read the first :math:`j` elements
# and kept
#
# .. math::
#
#    m_j &= \max_{i \le j} x_i, \\
#    d_j &= \sum_{i \le j} e^{x_i - m_j}.
#
# Reading :math:`x_{j+1}`, the new maximum is :math:`m_{j+1} = \max(m_j, x_{j+1})`.
# Every term of :math:`d_j` was computed relative to the old maximum; multiplying by
# :math:`e^{m_j - m_{j+1}}` moves them all to the new one at once:
#
# .. math::
#
#    d_{j+1} &= \sum_{i \le j+1} e^{x_i - m_{j+1}} \\
#            &= d_j \, e^{m_j - m_{j+1}} + e^{x_{j+1} - m_{j+1}}.
#
# After the last element, :math:`m_N` and :math:`d_N` are the true maximum and sum, and
# one more pass writes the output: :math:`2MN` read, :math:`MN` written. The rescaling
# factor is at most 1, so nothing overflows (and exactly 1 while the maximum stays).
# Each lane updates a state of its own; at the end the lanes merge by the same rule,
# :math:`m = \max_\ell m_\ell` and :math:`d = \sum_\ell d_\ell e^{m_\ell - m}`, which
# everything later reuses. For the states of two disjoint parts :math:`a` and :math:`b`:
#
# .. math::
#
#    (m_a, d_a) \oplus (m_b, d_b) = \big(m,\; d_a e^{m_a - m} + d_b e^{m_b - m}\big),
#    \quad m = \max(m_a, m_b).
#
# This is **the combine step**. It is exact and associative, so parts merge in any
# order and grouping: one element at a time (the update above), lane by lane after a
# loop, or program by program (the split-row kernel below). Split-K attention decoding
# (flash-decoding) merges partial states with it too, carrying an accumulator
# :math:`\mathit{acc} = \sum e^{x - m} v` rescaled like :math:`d` (the second exercise).
#
# One trap: a lane that has seen only :math:`-\infty` (masked padding, or ``-inf``
# logits) has :math:`m_\ell = -\infty`, and :math:`e^{m_\ell - m_\ell}` is
# :math:`e^{-\infty + \infty}`, ``NaN``. So the kernel rescales against a maximum
# replaced by 0 while it is :math:`-\infty`; the terms are then :math:`e^{-\infty} = 0`.


@triton.jit
def online_softmax_kernel(
    x_ptr, y_ptr, N, x_row_stride, x_col_stride, y_row_stride, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK_N)
    lane_max = tl.full([BLOCK_N], -float("inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_N], tl.float32)
    # Pass 1: running maximum and rescaled running sum.
    for start in tl.range(0, N, BLOCK_N):
        offs = start + cols
        x = tl.load(x_row + offs * x_col_stride, mask=offs < N, other=-float("inf"))
        x = x.to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        rescale = tl.exp2((lane_max - safe_max) * LOG2E)
        lane_sum = lane_sum * rescale + tl.exp2((x - safe_max) * LOG2E)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    row_sum = tl.sum(lane_sum * tl.exp2((lane_max - row_max) * LOG2E), axis=0)
    # Pass 2: normalize and store.
    for start in tl.range(0, N, BLOCK_N):
        offs = start + cols
        x = tl.load(x_row + offs * x_col_stride, mask=offs < N, other=-float("inf"))
        y = tl.exp2((x.to(tl.float32) - row_max) * LOG2E) / row_sum
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=offs < N)


# %%
# One pass, while the row still fits
# ----------------------------------
# Between "fits in a few warps" and "cannot fit at all", a row fits in one program of
# 32 warps (1,024 threads, the most a program has), a few dozen elements per thread,
# alone on its SM: read once and written once, like the fused kernel. Where it starts
# to spill, the compiler and GPU say in "Where a row stops fitting on chip", below.


@triton.jit
def row_on_chip_kernel(
    x_ptr, y_ptr, N, x_row_stride, x_col_stride, y_row_stride, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x_at = x_ptr + row * x_row_stride + cols * x_col_stride
    x = tl.load(x_at, mask=mask, other=-float("inf")).to(tl.float32)
    numerator = tl.exp2((x - tl.max(x, axis=0)) * LOG2E)
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# %%
# What exp2 saves
# ---------------
# Lesson 02's ``softmax_row_kernel`` and ``row_on_chip_kernel`` differ only in the
# exponential: ``tl.exp(x - m)`` there, ``tl.exp2((x - m) * LOG2E)`` here. On a GPU
# this cell compiles both for a row of 1,024 fp32 values (8 per thread) and counts the
# ``ex2`` instructions in the PTX (Triton's output) and the ``MUFU.EX2``, compares
# (``FSETP``) and multiplies (``FMUL``) in the machine code. ``tl.exp2`` emits the
# flush-to-zero ``ex2.approx.ftz.f32``; ``tl.exp``'s ``ex2.approx.f32`` must get
# results below :math:`2^{-126}` right, which the hardware unit does not, so the
# assembler adds compares and multiplies: the difference is what ``tl.exp`` costs (a
# softmax output moves by less than :math:`10^{-38}` without it).

if __name__ == "__main__" and kit.ON_GPU:
    x = torch.randn(1, 1024, device=DEVICE)
    kernels = {"tl.exp": FUSED.softmax_row_kernel, "tl.exp2": row_on_chip_kernel}
    for name, kernel in kernels.items():
        compiled = kernel.warmup(x, x, 1024, 1024, 1, 1024, BLOCK_N=1024, grid=(1,))
        ops = ("ex2.approx.f32", "ex2.approx.ftz.f32")
        ptx = ", ".join(f"{compiled.asm['ptx'].count(op)} {op}" for op in ops)
        ops = ("MUFU.EX2", "FSETP", "FMUL")
        sass = ", ".join(f"{compiled.asm['sass'].count(op)} {op}" for op in ops)
        print(f"{name:>7s}: PTX {ptx}; machine code {sass}")
elif __name__ == "__main__":
    print("The compiler's output for the exponential needs a GPU to compile for.")

# %%
# The backward, for rows of any length
# ------------------------------------
# Every launcher below returns a tensor autograd can differentiate, with lesson 02's
# :math:`dx = y \circ \big(dy - \operatorname{rowsum}(dy \circ y)\big)` (from the
# Jacobian :math:`\operatorname{diag}(y) - y\,y^\top`), which needs only the saved
# output :math:`y`. A long row does not fit in registers, so the backward walks it in
# chunks: one loop for the dot product of :math:`dy` and :math:`y` (per lane, reduced
# once), one to write :math:`dx`. It reads :math:`y` and :math:`dy` twice (lesson 02's
# fused backward reads them once), but serves rows of any length, from any forward.


@triton.jit
def softmax_backward_kernel(
    y_ptr, dy_ptr, dx_ptr, N, dy_row_stride, dy_col_stride, BLOCK_N: tl.constexpr
):
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
        dy_at = dy_row + (start + cols) * dy_col_stride
        dy = tl.load(dy_at, mask=mask, other=0.0).to(tl.float32)
        lane_dot += y * dy
    dot = tl.sum(lane_dot, axis=0)
    # Pass 2: dx = y * (dy - dot).
    for start in tl.range(0, N, BLOCK_N):
        mask = start + cols < N
        y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        dy_at = dy_row + (start + cols) * dy_col_stride
        dy = tl.load(dy_at, mask=mask, other=0.0).to(tl.float32)
        dx_at = dx_row + start + cols
        tl.store(dx_at, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


# %%
# The launch helpers
# ------------------
# One program per row: :math:`M = 4096` rows give many more programs than SMs, so the
# hardware scheduler keeps every SM busy without a persistent loop. Chunks are 4,096
# elements on 8 warps (16 per thread); tests force tiny ones with ``block_n`` so that
# the loops run many times. A chunk must be a power of two, like Triton's block shapes:
# a bad ``block_n`` is refused here by name, not deep in the kernel. As in lesson 02,
# negative views are resolved first, and the autograd wrapper is lesson 02's, with the
# backward above; calls that want no graph, such as the benchmark's, pay nothing for it.

check_input, SUPPORTED_DTYPES = FUSED.check_input, FUSED.SUPPORTED_DTYPES
ROW_ON_CHIP_LIMIT = 32768  # longest row (elements) row_on_chip_kernel is launched for


def _prepare(x):
    check_input(x)
    # Conjugate views exist only for complex tensors, which check_input refuses.
    return kit.int32_columns(x.resolve_neg())


def softmax_backward(y, dy, block_n):
    """dx = y * (dy - rowsum(dy * y)), y contiguous, in chunks of at most block_n."""
    dy = kit.int32_columns(dy.resolve_neg())
    M, N = y.shape
    dx = torch.empty_like(y)
    BLOCK_N = min(block_n, triton.next_power_of_2(N))
    args = (y, dy, dx, N, dy.stride(0), dy.stride(1))
    softmax_backward_kernel[(M,)](*args, BLOCK_N=BLOCK_N, num_warps=8)
    return dx


def differentiable(launch, x, block_n=4096):
    """launch(x) in lesson 02's autograd wrapper, with the backward above."""
    backward = functools.partial(softmax_backward, block_n=block_n)
    return FUSED.differentiable(launch, x, backward)


def _launcher(kernel, block_n, num_warps):
    """A function launching kernel on x, one program per row: the forward alone."""

    def launch(x):
        M, N = x.shape
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        args = (x, y, N, x.stride(0), x.stride(1), y.stride(0))
        kernel[(M,)](*args, BLOCK_N=block_n, num_warps=num_warps)
        return y

    return launch


def three_pass_softmax(x, block_n=4096):
    """Row-wise softmax, walking each row three times in chunks of block_n."""
    x = _prepare(x)
    kit.check_block("block_n", block_n)
    return differentiable(_launcher(three_pass_kernel, block_n, 8), x, block_n)


def online_softmax(x, block_n=4096):
    """Row-wise softmax, walking each row twice with the online max-and-sum update."""
    x = _prepare(x)
    kit.check_block("block_n", block_n)
    return differentiable(_launcher(online_softmax_kernel, block_n, 8), x, block_n)


def row_on_chip_softmax(x):
    """Row-wise softmax reading each row once; rows up to ROW_ON_CHIP_LIMIT elements."""
    x = _prepare(x)
    if x.shape[1] > ROW_ON_CHIP_LIMIT:
        raise ValueError("row_on_chip_softmax holds a row in registers: at most "
                         f"{ROW_ON_CHIP_LIMIT} columns, got {x.shape[1]}")
    block_n = triton.next_power_of_2(x.shape[1])
    num_warps = max(1, min(32, block_n // 32))
    return differentiable(_launcher(row_on_chip_kernel, block_n, num_warps), x)


# %%
# Optional: programs that share a row
# -----------------------------------
# FlashAttention does not need this section (its programs split queries, not a row);
# skip to "Correctness" on a first reading. Past one SM, the two-pass kernel reads a
# row twice: a ceiling of two thirds of the copy bandwidth, unless the L2 cache serves
# the second read ("What the numbers say" prints the two-pass share: past 2/3, it did).
# To read a long row once, several programs share it. Each of ``SPLITS`` programs holds
# one chunk in registers, computes its maximum :math:`m_c` and sum
# :math:`d_c = \sum e^{x - m_c}`, publishes the pair to a small buffer in device memory,
# increments the row's *arrival counter*, waits until every chunk has arrived, merges
# the pairs with the combine step and normalizes the chunk it still holds: each element
# read and written once, for rows of any length the whole GPU can hold:

if __name__ == "__main__":
    kit.draw_split_row()

# %%
# A kernel's programs normally never wait for one another, so this takes care:
#
# * **Every program of a row must be running at the same time**, or the waiting ones
#   spin forever on a chunk that never arrives. So the launcher compiles the kernel,
#   asks CUDA how many of its programs fit on the GPU at once (its occupancy; lesson
#   10 derives that count by hand) and launches no more, each group of ``SPLITS``
#   programs walking its share of the rows, *cooperatively*
#   (``launch_cooperative_grid=True``): CUDA starts them all together or refuses a grid
#   too large for that ("too many blocks in cooperative launch") instead of letting it
#   hang.
# * **Memory ordering.** The pair must be visible before the counter says it is: the
#   increment is an atomic with *release* semantics, the polling read one with
#   *acquire* semantics, and the pairs are read back with ``volatile`` loads that
#   bypass the SM's non-coherent L1 cache.
# * **The interpreter runs programs one after another**, so a waiting program would
#   wait forever: there each row gets one program (``SPLITS = 1``), exercising all but
#   the waiting. The correctness check below runs rows split ten ways on a GPU.


@triton.jit
def split_row_kernel(
    x_ptr, y_ptr, stats_ptr, arrived_ptr, M, N, x_row_stride, x_col_stride,
    y_row_stride, CHUNK: tl.constexpr, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // SPLITS
    split = pid % SPLITS
    cols = split * CHUNK + tl.arange(0, CHUNK)
    col_ok = cols < N
    chunks = tl.arange(0, SPLITS_POW2)
    for row in tl.range(pid // SPLITS, M, groups):
        row64 = tl.cast(row, tl.int64)
        x_at = x_ptr + row64 * x_row_stride + cols * x_col_stride
        x = tl.load(x_at, mask=col_ok, other=-float("inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        safe_max = tl.where(chunk_max == -float("inf"), 0.0, chunk_max)
        chunk_sum = tl.sum(tl.exp2((x - safe_max) * LOG2E), axis=0)
        stats = stats_ptr + (row64 * SPLITS + split) * 2
        tl.store(stats, chunk_max)
        tl.store(stats + 1, chunk_sum)
        tl.debug_barrier()  # every thread's stores are done before one thread signals
        tl.atomic_add(arrived_ptr + row, 1, sem="release")
        while tl.atomic_add(arrived_ptr + row, 0, sem="acquire") < SPLITS:
            pass
        all_stats = stats_ptr + (row64 * SPLITS + chunks) * 2
        ok = chunks < SPLITS
        maxes = tl.load(all_stats, mask=ok, other=-float("inf"), volatile=True)
        sums = tl.load(all_stats + 1, mask=ok, other=0.0, volatile=True)
        row_max = tl.max(maxes, axis=0)
        row_sum = tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0)
        y = tl.exp2((x - row_max) * LOG2E) / row_sum
        y_at = y_ptr + row64 * y_row_stride + cols
        tl.store(y_at, y.to(y_ptr.dtype.element_ty), mask=col_ok)


# 32 KiB of the row per program, 4 warps: 8,192 fp32 or 16,384 bf16 elements, the
# fastest that tools/tune.py split-row timed on an H100, as the engineering notes
# record (tools/ is in this site's repository, not in the lessons' zips).
SPLIT_BYTES, SPLIT_WARPS = 32768, 4
# All programs resident at once, or CUDA refuses the launch (see above).
COOPERATIVE = dict(launch_cooperative_grid=True)
_resident = {}


def variant(args):
    """What Triton compiles a kernel apart for, per argument: an integer equal to 1,
    divisible by 16, or past int32; a tensor's address aligned to 16 bytes. Each
    variant has registers of its own, so a count of programs holds for one only."""
    return tuple(a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor)
                 else (a == 1, a % 16 == 0, a >= 2**31) for a in args)  # fmt: skip


def _compiled(args, meta, num_warps):
    kernel = split_row_kernel.warmup(*args, **meta, num_warps=num_warps, grid=(1,),
                                     **COOPERATIVE)  # fmt: skip
    kernel._init_handles()  # loads it on the GPU: its registers are known from here
    return kernel


def programs_per_sm(kernel, num_warps):
    """CUDA's count of a loaded kernel's programs that one SM holds at once, the
    count a cooperative launch is checked against (lesson 10 derives it by hand)."""
    count = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(count), ctypes.c_void_p(kernel.function), 32 * num_warps,
        ctypes.c_size_t(kernel.metadata.shared))  # fmt: skip
    if status:
        raise RuntimeError(f"CUDA's occupancy query failed with error {status}")
    return count.value


def _programs_that_fit(args, meta, num_warps):
    """How many programs of this kernel the GPU holds at once: all run together."""
    key = (args[0].device, args[0].dtype, variant(args), tuple(sorted(meta.items())),
           num_warps)  # fmt: skip
    if key not in _resident:
        kernel = _compiled(args, meta, num_warps)
        sms = torch.cuda.get_device_properties(args[0].device).multi_processor_count
        _resident[key] = sms * programs_per_sm(kernel, num_warps)
    return _resident[key]


def _split_row_args(x, chunk):
    """The output, the kernel's arguments and its constants for x in chunks."""
    M, N = x.shape
    splits = triton.cdiv(N, chunk)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    stats = torch.empty((M, splits, 2), dtype=torch.float32, device=x.device)
    arrived = torch.zeros((M,), dtype=torch.int32, device=x.device)
    args = (x, y, stats, arrived, M, N, x.stride(0), x.stride(1), y.stride(0))
    pow2 = triton.next_power_of_2(splits)
    return y, args, dict(CHUNK=chunk, SPLITS=splits, SPLITS_POW2=pow2)


def _split_row(x, chunk, num_warps):
    M, N = x.shape
    if not chunk:
        on_gpu = SPLIT_BYTES // x.element_size()
        chunk = on_gpu if kit.ON_GPU else triton.next_power_of_2(N)
    splits = triton.cdiv(N, chunk)
    if splits > 1 and not kit.ON_GPU:
        raise ValueError("split_row_softmax cannot split a row under the Triton "
                         "interpreter: its programs run one after another, and one "
                         "waiting would wait forever")
    y, args, meta = _split_row_args(x, chunk)
    num_warps = SPLIT_WARPS if num_warps is None else num_warps
    groups = M
    if kit.ON_GPU:
        groups = min(M, _programs_that_fit(args, meta, num_warps) // splits)
        if groups == 0:
            raise ValueError(f"a row of {N} elements needs {splits} programs at once, "
                             "more than this GPU holds")
    grid = (groups * splits,)
    split_row_kernel[grid](*args, **meta, num_warps=num_warps, **COOPERATIVE)
    return y


def split_row_softmax(x, chunk=None, num_warps=None):
    """Row-wise softmax reading each row once, any length: programs share a row."""
    x = _prepare(x)
    if chunk is not None:
        kit.check_block("chunk", chunk)
    if num_warps is not None:
        kit.check_warps(num_warps)
    return differentiable(lambda t: _split_row(t, chunk, num_warps), x)


# Measured on an H100, not on this page (its benchmark starts past it): up to this row
# length lesson 02's softmax beat the row-on-chip kernel, as the engineering notes say.
TILE_LIMIT = 8192


def long_softmax(x):
    """The fastest kernel measured for the row length: lesson 02's for short rows,
    one per row while it fits in an SM, then split rows (on a GPU) or online."""
    check_input(x)
    if x.shape[1] <= TILE_LIMIT:
        return FUSED.softmax(x)
    if x.shape[1] <= ROW_ON_CHIP_LIMIT:
        return row_on_chip_softmax(x)
    return split_row_softmax(x) if kit.ON_GPU else online_softmax(x)


# %%
# Correctness
# -----------
# All four kernels, values and gradients, against float64 on an irregular shape, with
# chunks small enough that the loops run many times and the last chunk is ragged.
# ``torch.testing.assert_close`` compares element by element: a single ``NaN`` fails.

if __name__ == "__main__":
    torch.manual_seed(0)
    # On a GPU, more rows than groups of split-row programs: each walks several.
    M = 2000 if kit.ON_GPU else 37
    x = torch.randn(M, 5001, device=DEVICE) * 10
    dy = torch.randn(M, 5001, device=DEVICE)
    x64 = x.double().requires_grad_()
    reference = torch.softmax(x64, dim=1)
    reference.backward(dy.double())
    chunk = 512 if kit.ON_GPU else None  # the interpreter cannot split a row
    launchers = {"three-pass": functools.partial(three_pass_softmax, block_n=512),
                 "online": functools.partial(online_softmax, block_n=512),
                 "row on chip": row_on_chip_softmax,
                 "split row": functools.partial(split_row_softmax, chunk=chunk)}
    for name, fn in launchers.items():
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        y.backward(dy)
        torch.testing.assert_close(y.double(), reference.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(leaf.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
        errors = [(a.double() - b).abs().max().item()
                  for a, b in ((y, reference), (leaf.grad, x64.grad))]
        print(f"{name:12s} {M}x5001 fp32 vs float64: max abs error {errors[0]:.2e}, "
              f"gradient {errors[1]:.2e}")

# %%
# Benchmark
# ---------
# On a GPU, :math:`M = 4096` rows of 16K to 256K elements (under the interpreter, a few
# small rows), in GB/s (:math:`2MN \times` element size over time), beside
# ``torch.softmax``, ``torch.compile`` (GPU only) and this run's copy bandwidth. How we
# time: by *GPU time* (CUDA graph replays after an L2 flush; the table) and *back to
# back* (calls in a row, as a loop sees them; the sentences), as the
# :doc:`performance page <../performance>` defines them ("How we time"). Under the
# interpreter both are NumPy's wall-clock time on the CPU: illustrative.

OURS = {"three-pass": three_pass_softmax, "online (two-pass)": online_softmax,
        "row on chip (one pass)": row_on_chip_softmax,
        "split row (one pass)": split_row_softmax}  # fmt: skip


def providers(x):
    """What the benchmark times on x, each as fn(x)."""
    calls = dict(OURS)
    if x.shape[1] > ROW_ON_CHIP_LIMIT:
        del calls["row on chip (one pass)"]
    calls["torch.softmax"] = lambda t: torch.softmax(t, dim=1)
    if kit.ON_GPU:
        calls["torch.compile"] = kit.compiled_for(calls["torch.softmax"], x)
    return calls


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    print(kit.describe_platform())
    gpu_problem = 4096, [16384, 32768, 65536, 131072, 262144]
    M, sizes = gpu_problem if kit.ON_GPU else (4, [4096, 16384])
    dtypes = [torch.float32, torch.bfloat16]
    copy_gbs = kit.copy_bandwidth_gbs()
    print(f"device copy bandwidth, measured now: {copy_gbs:.0f} GB/s")
    results, table, b2b = kit.bandwidth_benchmark(M, sizes, dtypes, providers)

# %%
# The results
# -----------
# Each provider's GB/s per row length, by GPU time (empty where a kernel does not run,
# as row-on-chip past ``ROW_ON_CHIP_LIMIT``; a range where its timings spread past 10%):

kit.rates_table(results, ["dtype", "N"], "GB/s") if __name__ == "__main__" else None

# %%
# What the numbers say
# --------------------
# From the table above, per row length: the fastest of this lesson's kernels, against
# the best PyTorch peer and as a share of the copy bandwidth, by GPU time, then back to
# back; then any length where every provider of a dtype ran over 10% slower than at the
# one before. The byte counts predict at most 1/2 of the copy bandwidth for three
# passes, 2/3 for two, all of it for one; a pass re-reading a row still in L2 can beat
# that, the more so the shorter the row. The plot draws the same table, one panel per
# dtype, the copy bandwidth dashed behind the curves so that a kernel at it shows.


def common_drops(table, limit=kit.SPREAD_LIMIT):
    """{(dtype, N): (least, most)}: where every provider in table (rates by dtype
    and N) ran more than limit slower than at the dtype's previous length."""
    lost = 1 - table / table.groupby(level="dtype", sort=False).shift(1)
    return {key: (row.min(), row.max()) for key, row in lost.iterrows()
            if row.notna().any() and (row.dropna() > limit).all()}


if __name__ == "__main__":
    peers = [c for c in table.columns if c not in OURS]
    for key, row in table.iterrows():
        best = row[list(OURS)].dropna().idxmax()
        loop = b2b.loc[key, best] / b2b.loc[key, peers].max()
        loop = f" ({loop:.2f}x back to back)" if kit.ON_GPU else ""
        two = row["online (two-pass)"]
        print(f"{key[0]:>8s} N = {key[1]:>6d}: best is {best} at "
              f"{row[best] / copy_gbs:.0%} of copy bandwidth, "
              f"{row[best] / row[peers].max():.2f}x the best PyTorch peer{loop}; "
              f"two-pass {two / copy_gbs:.0%}, "
              f"{two / row['three-pass']:.2f}x three-pass")
    print(*[f"{dtype:>8s} N = {n:>6d}: every provider, PyTorch's too, ran {least:.0%}"
            f" to {most:.0%} slower than at the length before: a cause they share."
            for (dtype, n), (least, most) in common_drops(table).items()]
          or ["No length slowed every provider by over 10%."], sep="\n")  # fmt: skip
    if not kit.ON_GPU:
        print("Interpreter timings: the ratios measure NumPy on the CPU, illustrative.")
    benchmark = dict(name=f"long-row softmax, M = {M}", unit="GB/s", ceiling=copy_gbs)
    kit.save_results("03-long-softmax", [dict(
        benchmark, ceiling_name="copy bandwidth", ours=list(OURS), peers=peers,
        rows=results.to_dict("records"),
    )])  # fmt: skip
    title = f"Long-row softmax, M = {M} rows: speed against the copy bandwidth"
    kit.plot_bandwidth(table, copy_gbs, title, list(OURS))
    plt.show()

# %%
# Registers and bytes in flight, by dtype
# ---------------------------------------
# Each split-row program gets 32 KiB of the row, twice the elements in bf16, each held
# as fp32 in registers until the row's statistics arrive: more registers per thread,
# fewer programs per SM, and while a program waits, only the SM's others keep loads in
# flight. This cell asks the compiler, per dtype, how much of the row each SM can be
# loading at once; its last line says where each dtype ran further from the copy (a
# length where every provider dropped is named above). Lesson 10 keeps the chunk in
# shared memory instead.


def by_dtype(speed, copy_gbs):
    """Split-row speed (by dtype, N) over the copy's; where each dtype is further."""
    s = (speed / copy_gbs).unstack("dtype")
    bf16, fp32 = (("every length" if (s[a] < s[b]).all() else ", ".join(
        f"N = {n}" for n in s.index[s[a] < s[b]]) or "none")
        for a, b in (("bfloat16", "float32"), ("float32", "bfloat16")))  # fmt: skip
    return ("Split row, share of the copy bandwidth in fp32 and bf16: " + ", ".join(
        f"N = {n}: {r['float32']:.0%} and {r['bfloat16']:.0%}" for n, r in s.iterrows())
        + f". Further from it in bf16 at: {bf16}; in fp32 at: {fp32}.")


if __name__ == "__main__" and kit.ON_GPU:
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for dtype in dtypes:
        x = torch.empty(M, sizes[-1], device=DEVICE, dtype=dtype)
        y, args, meta = _split_row_args(x, SPLIT_BYTES // x.element_size())
        compiled = _compiled(args, meta, SPLIT_WARPS)
        per_sm = _programs_that_fit(args, meta, SPLIT_WARPS) // sms
        print(f"{str(dtype)[6:]:>8s}: {meta['CHUNK']} elements per program, "
              f"{compiled.n_regs} registers per thread, {per_sm} programs per SM, so "
              f"{per_sm * SPLIT_BYTES // 1024} KiB of the row in flight per SM")
    print(by_dtype(table["split row (one pass)"], copy_gbs))
elif __name__ == "__main__":
    print("Registers and occupancy need a kernel compiled for a GPU.")

# %%
# Where a row stops fitting on chip
# ---------------------------------
# By the register argument at the top, a row of 32,768 fp32 values (32 per thread of
# 1,024) fits with room for temporaries; one of 65,536 (64 per thread) cannot. On a
# GPU, this cell compiles the row-on-chip kernel with 32 warps for rows of 16,384,
# 32,768 and 65,536 fp32 values (launched directly, past the launcher's limit) and
# prints the registers and spills per thread and the speed on 4096 rows (GPU time).

if __name__ == "__main__" and kit.ON_GPU:
    for block_n in (16384, 32768, 65536):
        x = torch.randn(4096, block_n, device=DEVICE)
        y = torch.empty_like(x)
        args = (x, y, block_n, x.stride(0), x.stride(1), y.stride(0))
        meta = dict(BLOCK_N=block_n, num_warps=32)
        compiled = row_on_chip_kernel.warmup(*args, **meta, grid=(1,))
        compiled._init_handles()
        launch = functools.partial(row_on_chip_kernel[(4096,)], *args, **meta)
        timed = kit.time_calls({"row": kit.call_timer(launch)})["row"]
        gbs = timed.row(2 * x.numel() * 4 * 1e-6)["gpu_value"]
        print(f"N = {block_n:6d}: {compiled.n_regs} registers and "
              f"{4 * compiled.n_spills} bytes of local memory per thread; "
              f"{gbs / copy_gbs:.0%} of the copy bandwidth")
elif __name__ == "__main__":
    print("Registers and spills need a kernel compiled for a GPU.")

# %%
# Exercises
# ---------
# Each check compares with float64 on fresh irregular inputs (``NaN`` fails) and names
# the first wrong element. Write each attempt in a new cell at the end of this lesson's
# notebook (linked at the end of the page), below the checks, and call its check as the
# exercise shows; or in a file next to the lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L03 = kit.load_lesson("03-long-softmax")
#    # ... your kernel, and two_loop_softmax(x, block_n) that launches it ...
#    L03.check_two_loop_softmax(two_loop_softmax)
#
# 1. **Two loops, one state per row.** Turn ``three_pass_kernel`` into two loops: the
#    first keeps one running :math:`(m, d)` per row (not per lane, as
#    ``online_softmax_kernel`` does), merging each chunk's own maximum and sum into it
#    with the combine step; the second writes the output. Wrap it in
#    ``two_loop_softmax(x, block_n)``, checked by
#    ``check_two_loop_softmax(two_loop_softmax)``: its 16-element chunks make the loops
#    run many times, and some rows' first chunk is all ``-inf`` (mind the trap above).
# 2. **The decoding combine.** A split-K (flash-decoding) attention kernel leaves, for
#    each of :math:`M` rows, :math:`S` partial states :math:`(m_s, d_s, \mathit{acc}_s)`
#    with :math:`\mathit{acc}_s = \sum e^{x - m_s} v` of length :math:`D` over split
#    :math:`s`'s keys. Write ``merge_partials(m, d, acc)`` as a Triton kernel: ``m`` and
#    ``d`` are (M, S) fp32, ``acc`` is (M, S, D) fp32 with any strides, and the result
#    is the (M, D) fp32 output
#    :math:`\sum_s e^{m_s - m} \mathit{acc}_s / \sum_s e^{m_s - m} d_s`. Splits that saw
#    only masked keys have :math:`m_s = -\infty`, :math:`d_s = 0`,
#    :math:`\mathit{acc}_s = 0`. Check with ``check_merge_partials(merge_partials)``.


def check_two_loop_softmax(fn):
    """Check fn(x, 16) -> row-wise softmax, on rows that start with -inf."""
    for count, (case, leaf, view) in enumerate(kit.irregular_rows(scale=10), 1):
        x = view(leaf)
        x[len(x) // 2] += 100  # e^100 overflows fp32: subtract the running max
        x[0, :20] = -float("inf")  # the first chunk of row 0 (all of it when N <= 20)
        x[0, -1] = 0.0  # one finite logit per row: an all -inf row has no softmax
        x[-1, ::3] = -float("inf")
        x[-1, -1] = 0.0
        expected = torch.softmax(x.double(), dim=1)
        tol = kit.TOLERANCE[x.dtype]
        kit.expect_close("two_loop_softmax", case, "the output", fn(x, 16), expected,
                         x.dtype, tol, tol / 100)  # fmt: skip
    print(f"two_loop_softmax passed on {count} fresh inputs (irregular shapes, "
          "fp32/fp16/bf16, masked logits, strided views).")


def check_merge_partials(fn):
    """Check fn(m, d, acc) -> the (M, D) output merged from S partial states."""
    shapes = [(1, 1, 1, 1), (1, 10, 4, 3), (3, 50, 4, 16), (5, 257, 7, 24)]
    for count, (M, N, S, D) in enumerate(shapes + [(2, 1000, 3, 64)], 1):
        x = torch.randn(M, N, device=DEVICE, dtype=torch.float64) * 10
        v = torch.randn(M, N, D, device=DEVICE, dtype=torch.float64)
        width = triton.cdiv(N, S)
        x[-1] += 100  # e^100 overflows fp32: the splits' maxima must be subtracted
        x[0, : min(2, S - 1) * width] = -float("inf")  # splits 0 and 1 of row 0: masked
        x[:, -1] = 0.0  # one key per row stays visible
        cuts = [slice(s * width, (s + 1) * width) for s in range(S)]
        m = torch.stack([x[:, cut].amax(dim=1) for cut in cuts], 1)
        safe = torch.where(m == -float("inf"), 0.0, m)
        w = [torch.exp(x[:, cut] - safe[:, s, None]) for s, cut in enumerate(cuts)]
        d = torch.stack([ws.sum(dim=1) for ws in w], 1)
        acc = [(ws[:, :, None] * v[:, cut]).sum(dim=1) for ws, cut in zip(w, cuts)]
        m, d, acc = m.float(), d.float(), torch.stack(acc, 1).float()
        acc = acc.transpose(1, 2).contiguous().transpose(1, 2)  # strides (S*D, 1, S)
        # The definition, in float64 from the very fp32 states given: at m near 130,
        # rounding m to fp32 alone moves a weight by about 1e-5, past the tolerance.
        weights = torch.exp(m.double() - m.double().amax(dim=1, keepdim=True))
        merged = (weights[:, :, None] * acc.double()).sum(dim=1)
        expected = merged / (weights * d.double()).sum(dim=1)[:, None]
        case = f"M={M}, S={S}, D={D}"
        kit.expect_close("merge_partials", case, "the output", fn(m, d, acc), expected,
                         torch.float32, 1e-5, 1e-6)  # fmt: skip
    print(f"merge_partials passed on {count} fresh inputs (irregular M, S and D, "
          "masked splits, strided acc).")
