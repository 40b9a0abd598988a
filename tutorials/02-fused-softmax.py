"""
Fused softmax
=============

A row-wise softmax written as one Triton kernel that reads its input once and writes its
output once, measured against PyTorch to see how close it gets to the speed of copying
memory; and its backward, written the same way and checked against float64 autograd.
Previous lesson: :doc:`01-first-kernel`, on programs, blocks and masks; next:
:doc:`03-long-softmax`. Triton's functions are documented in `triton.language
<https://triton-lang.org/main/python-api/triton.language.html>`_ (the row's reductions:
`tl.max <https://triton-lang.org/main/python-api/generated/triton.language.max.html>`_).

You will learn:

* why a *fused* kernel beats a sequence of PyTorch operations, with the memory-traffic
  arithmetic;
* how a Triton program holds a row on chip, with masking for row lengths that are not
  powers of two;
* how to make softmax numerically stable, and why the math runs in fp32 whatever the
  input dtype;
* how to go from one program per row to a *persistent* grid of row tiles sized from the
  GPU's occupancy, and how to measure what that step buys;
* how to derive softmax's backward from its Jacobian, write it as a kernel, and wire it
  into autograd;
* where a row stops fitting in one program, and why;
* how to benchmark a memory-bound kernel honestly: in GB/s, beside copies measured in
  the same run.
"""

# %%
# Where the kernels run
# ---------------------
# As in lesson 01, ``stepkit``, imported before Triton, picks a CUDA GPU where there is
# one, and otherwise the Triton interpreter on the CPU, at small sizes.

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

# %%
# Motivation: count the bytes
# ---------------------------
# Softmax turns each row :math:`x` of a matrix into
# :math:`y_i = e^{x_i - m} / \sum_j e^{x_j - m}`, where subtracting the row maximum
# :math:`m = \max_j x_j` changes nothing mathematically but keeps :math:`e^{x}` from
# overflowing (fp32 overflows past :math:`e^{88.7}`, fp16 past :math:`e^{11.1}`).
#
# Written with PyTorch operations, each step is a separate kernel that reads its input
# from device memory and writes its result back:


def naive_softmax(x):
    """Row-wise softmax in five PyTorch operations: the baseline fusion improves on."""
    x_max = x.max(dim=1)[0]  # read MN, write M
    z = x - x_max[:, None]  # read MN + M, write MN
    numerator = torch.exp(z)  # read MN, write MN
    denominator = numerator.sum(dim=1)  # read MN, write M
    return numerator / denominator[:, None]  # read MN + M, write MN


# %%
# For an :math:`M \times N` input that is :math:`5MN + 2M` elements read and
# :math:`3MN + 2M` written. A fused kernel loads each row once, does every step on chip,
# and writes the result once: :math:`MN` read and :math:`MN` written. Softmax does a
# handful of arithmetic operations per element, far less than a GPU can do in the time
# it takes to move that element, so its run time is set by memory traffic, and the fused
# kernel should approach :math:`(8MN + 4M) / 2MN \approx 4\times` the naive version's
# speed. ``torch.softmax`` is already a single fused kernel, so against it the question
# is only how close each comes to the hardware. The traffic, kernel by kernel, from the
# comments above (the :math:`M`-element terms left out):

if __name__ == "__main__":
    kit.draw_memory_traffic({
        "naive: five kernels": [("max", 1, 0), ("x - max", 1, 1), ("exp", 1, 1),
                                ("sum", 1, 0), ("divide", 1, 1)],
        "fused: one kernel": [("softmax", 1, 1)],
    }, "A row-wise softmax's traffic through device memory, in units of MN elements")

# %%
# Step 1: one program per row
# ---------------------------
# The simplest fused kernel gives each row to its own program: the grid is :math:`(M,)`,
# and program ``i`` loads row ``i`` into registers, reduces it twice (maximum, then sum)
# and stores it. The row is loaded as a block of ``BLOCK_N`` columns, the row length
# rounded up to a power of two (Triton's block shapes must be powers of two); the
# columns past :math:`N` are masked: loads there return :math:`-\infty`, which adds
# :math:`e^{-\infty} = 0` to the sum, and stores there are skipped.


@triton.jit
def softmax_row_kernel(
    x_ptr, y_ptr, N, x_row_stride, x_col_stride, y_row_stride, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask,
                other=-float("inf")).to(tl.float32)  # fmt: skip
    numerator = tl.exp(x - tl.max(x, axis=0))
    y = numerator / tl.sum(numerator, axis=0)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# %%
# The math is fp32 even for fp16 and bf16 inputs: a sum of thousands of small terms in
# 16-bit precision would lose most of its digits, and converting costs nothing next to
# the memory traffic. The column stride is a parameter: a kernel assuming contiguous
# rows would compute garbage on a transposed view, and Triton specializes a stride of 1
# at compile time, so the common case still gets wide, vectorized loads.
#
# The launch helpers
# ------------------
# A kernel handed a bad pointer does not raise: it computes nonsense or crashes the
# process. So every launcher checks its input, and resolves a tensor that looks fine
# but is not: a *negative view* (``torch._neg_view(x)``, or ``x.conj().imag`` of a
# complex tensor) shares its memory with the un-negated values and only carries a flag,
# "negate on read". A kernel reads raw memory, never the flag, so the launcher
# materializes such a view first (lesson 01's ``add`` does too). Offsets are a
# second trap: an element's address is ``row * row_stride + column * column_stride``,
# and an int32 product wraps past :math:`2^{31}`. The kernels compute the row part in
# int64 (a tall tensor passes that easily) and the per-element column part in int32, the
# cheaper type; the rare view whose column stride would wrap it is copied to a
# contiguous layout first (``kit.int32_columns``).
#
# A row must fit in one program's registers. A program runs on one streaming
# multiprocessor (SM), which shares its 65,536 32-bit registers among the programs it
# runs; a program has at most 1,024 threads, so even alone it gets at most 64 registers
# per thread. A row of 32,768 fp32 values takes 32 of them per thread, leaving room for
# addresses and temporaries; a row of 65,536 would need all 64 for the values alone, and
# the compiler would *spill* the rest to local memory, device memory behind the caches
# (lesson 03 prints the registers and spills of such a kernel). The launchers refuse
# rows longer than ``FUSED_LIMIT``, pointing to the next lesson, for rows of any length.
#
# The helpers below launch the forward pass only; the public, differentiable launchers,
# ``softmax_one_row_per_program`` and ``softmax``, come with the backward pass.

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FUSED_LIMIT = 32768  # the longest row (elements) one program's registers hold


def check_input(x):
    """Raise a clear error for anything the kernels cannot handle."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"softmax expects a torch.Tensor, got {type(x).__name__}")
    shape = tuple(x.shape)
    if x.dim() != 2:
        raise ValueError(f"softmax expects a 2-D tensor (rows, columns), got {shape}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"softmax takes float32, float16 and bfloat16, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"softmax needs at least one row and one column, got {shape}")
    kit.check_device("x", x)


def _prepare(x):
    """The checked input, ready for a kernel: rows that fit, no negative-view flag."""
    check_input(x)
    if x.shape[1] > FUSED_LIMIT:
        raise ValueError(
            "the fused softmax holds a row in one program's registers: at most "
            f"{FUSED_LIMIT} columns, got {x.shape[1]}. For longer rows use the next "
            "lesson, 03-long-softmax.py (Softmax over rows too long for one tile)."
        )
    # Conjugate views exist only for complex tensors, which check_input refuses.
    return kit.int32_columns(x.resolve_neg())


def _num_warps(elements):
    """About 16 elements per thread, 4 warps at least, 32 at most (1,024 threads)."""
    return max(4, min(32, elements // (16 * 32)))


def _one_row_per_program(x):
    """Forward only: softmax_row_kernel on a prepared input."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_N = triton.next_power_of_2(N)
    args = (x, y, N, x.stride(0), x.stride(1), y.stride(0))
    softmax_row_kernel[(M,)](*args, BLOCK_N=BLOCK_N, num_warps=_num_warps(BLOCK_N))
    return y


# %%
# Is it correct?
# --------------
# Before timing a kernel, check it: here against ``torch.softmax`` in float64 on 1823
# rows of 781 columns (not a power of two: the mask is exercised).
# ``torch.testing.assert_close`` compares element by element, each against a relative
# and an absolute tolerance, and counts a ``NaN`` as a mismatch.

if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(1823, 781, device=DEVICE)
    reference = torch.softmax(x.double(), dim=1)
    y = _one_row_per_program(_prepare(x))
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-7)
    error = (y.double() - reference).abs().max().item()
    print(f"one row per program, 1823x781 fp32: max abs error {error:.2e}")

# %%
# Step 2: persistent programs over row tiles
# ------------------------------------------
# One program per row has two costs for short rows: a row of 256 fp32 values (1 KiB)
# is too little work to hide the latency of its own load, and thousands of rows make
# thousands of tiny programs to start and retire. The second kernel changes two things:
#
# * each program owns a *tile* of ``BLOCK_M`` rows by ``BLOCK_N`` columns, so a short
#   row travels with its neighbours;
# * the program is *persistent*: the grid holds only as many programs as fit on the GPU
#   at once, and each loops over row tiles with a stride of the grid size.
#   ``tl.range(..., num_stages=...)`` lets the compiler issue the load of the next tile
#   while the current one is still being computed on (software pipelining).
#
# Whether this pays off is for the benchmark below to say. The loop costs registers:
# its counters and addresses stay live beside the tile, which matters at the longest
# rows, where the row alone takes half of them; and a long row needs no neighbours to
# be worth a program. So the grid is persistent only where a row's power-of-two width
# is below ``LONG_ROW`` elements; longer rows go to step 1's kernel, which holds its
# row without the loop (``tools/tune.py softmax`` measured the limit on a GPU; the
# :doc:`engineering notes <../engineering-notes>` give its numbers).


@triton.jit
def softmax_kernel(
    x_ptr, y_ptr, M, N, x_row_stride, x_col_stride, y_row_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    for first_row in tl.range(
        pid * BLOCK_M, M, num_programs * BLOCK_M, num_stages=NUM_STAGES
    ):
        rows = first_row + tl.arange(0, BLOCK_M)
        # Rows past the end re-read the last row instead of loading all -inf (whose
        # max is -inf, and -inf - -inf is NaN); their results are never stored.
        # int64: M * stride can pass 2**31.
        load_rows = tl.minimum(rows, M - 1).to(tl.int64)
        x = tl.load(
            x_ptr + load_rows[:, None] * x_row_stride + cols[None, :] * x_col_stride,
            mask=col_ok[None, :],
            other=-float("inf"),
        ).to(tl.float32)
        row_max = tl.max(x, axis=1)
        numerator = tl.exp(x - row_max[:, None])
        denominator = tl.sum(numerator, axis=1)
        y = numerator / denominator[:, None]
        tl.store(
            y_ptr + load_rows[:, None] * y_row_stride + cols[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=(rows < M)[:, None] & col_ok[None, :],
        )


# %%
# The launcher picks the tile and the grid:
#
# * ``BLOCK_M``: enough rows that each tile holds at least 2,048 elements, so that short
#   rows still give each program a worthwhile amount of memory traffic, yet tiles stay
#   small enough that many programs share each SM and overlap one another's loads.
#   Tiles are sized in elements, not bytes: the math, and the fp32 registers that hold
#   it, grow with elements whatever the dtype, so a byte budget would give 16-bit tiles
#   twice the work per program of fp32 ones.
# * ``num_warps``: about 16 elements per thread (at least 4 warps), so that the tile
#   fits in registers, the same rule as for one row per program.
# * ``NUM_STAGES = 1``: no software pipelining across tiles. Pipelining keeps the next
#   tile in shared memory while the current one is computed on; with this many small
#   programs per SM, the programs already overlap each other's loads.
# * the grid: *occupancy* is how many programs an SM can host at once, limited by its
#   registers, its shared memory and its thread slots. We compile the kernel first, read
#   the registers and shared memory it uses, and launch exactly as many programs as fit
#   at once on all SMs. Each then loops over its share of the tiles.
#
# These rules follow the winners of ``tools/tune.py softmax`` (in this site's
# repository), which sweeps tile heights, warps, stages and grid styles on a GPU.


def _tile_shape(N):
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_M = max(1, 2048 // BLOCK_N)
    return BLOCK_M, BLOCK_N, _num_warps(BLOCK_M * BLOCK_N)


_occupancy = {}


def _persistent_grid(args, meta, num_warps, row_tiles):
    """How many programs fit on the GPU at once (at most one per tile)."""
    if not kit.ON_GPU:
        return row_tiles  # the interpreter runs programs one after another
    key = (args[0].device, args[0].dtype, meta["BLOCK_M"], meta["BLOCK_N"], num_warps)
    if key not in _occupancy:
        kernel = softmax_kernel.warmup(*args, **meta, num_warps=num_warps, grid=(1,))
        kernel._init_handles()
        props = torch.cuda.get_device_properties(args[0].device)
        threads = num_warps * 32
        by_registers = props.regs_per_multiprocessor // max(1, kernel.n_regs * threads)
        by_threads = props.max_threads_per_multi_processor // threads
        shared, smem = kernel.metadata.shared, props.shared_memory_per_multiprocessor
        by_smem = smem // shared if shared else by_threads
        per_sm = max(1, min(by_registers, by_threads, by_smem))
        _occupancy[key] = props.multi_processor_count * per_sm
    return min(row_tiles, _occupancy[key])


# From this many columns on, a tile holds one row, which is work enough for one
# program, and the loop only costs registers: step 1's kernel takes over.
LONG_ROW = 2048


def _persistent(x):
    """Forward only: row tiles below LONG_ROW columns, step 1's kernel from there."""
    M, N = x.shape
    BLOCK_M, BLOCK_N, num_warps = _tile_shape(N)
    if BLOCK_N >= LONG_ROW:
        return _one_row_per_program(x)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    args = (x, y, M, N, x.stride(0), x.stride(1), y.stride(0))
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=1)
    grid = _persistent_grid(args, meta, num_warps, triton.cdiv(M, BLOCK_M))
    softmax_kernel[(grid,)](*args, **meta, num_warps=num_warps)
    return y


if __name__ == "__main__":
    y = _persistent(_prepare(x))
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-7)
    error = (y.double() - reference).abs().max().item()
    print(f"persistent row tiles, 1823x781 fp32: max abs error {error:.2e}")

# %%
# The backward pass
# -----------------
# Training needs :math:`\partial L / \partial x` given
# :math:`dy = \partial L / \partial y`. For one row, :math:`y_i = e^{x_i} / \sum_k
# e^{x_k}` (subtracting the maximum does not change :math:`y`, so it does not change its
# derivatives either), and differentiating the quotient gives the Jacobian
#
# .. math::
#
#    \frac{\partial y_i}{\partial x_j} &= y_i \delta_{ij} - y_i y_j, \\
#    J &= \operatorname{diag}(y) - y\,y^\top .
#
# :math:`J` is symmetric, so the chain rule :math:`dx = J^\top dy` reads
#
# .. math::
#
#    dx_i &= \sum_j \left(y_i \delta_{ij} - y_i y_j\right) dy_j \\
#         &= y_i \Big(dy_i - \sum_j dy_j\, y_j\Big), \\
#    dx &= y \circ \big(dy - \operatorname{rowsum}(dy \circ y)\big).
#
# The :math:`N \times N` Jacobian is never formed: each row needs one dot product and
# one element-wise update. The backward needs the *output* :math:`y`, which the forward
# saves. Fused, it reads :math:`y` and :math:`dy` once and writes :math:`dx` once,
# :math:`3MN` elements, the least it can move. The math is fp32 again (the dot product
# sums :math:`N` terms). A tile now holds two arrays, so the backward runs short of
# registers sooner than the forward, at the longest rows that the forward still holds.
#
# The backward kernel takes one tile of rows per program, no persistent loop: simpler,
# and this lesson does not benchmark it. ``dy`` comes with any strides (autograd hands
# over an expanded tensor of stride 0 for ``y.sum().backward()``), so its strides are
# parameters; ``y`` and ``dx`` are allocated here, contiguous.


@triton.jit
def softmax_backward_kernel(
    y_ptr, dy_ptr, dx_ptr, M, N, dy_row_stride, dy_col_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)
    at = rows[:, None] * N + cols[None, :]  # y and dx are contiguous
    # Padding loads 0 for both: it adds nothing to the dot product and is never stored.
    y = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(
        dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def softmax_backward(y, dy):
    """dx = y * (dy - rowsum(dy * y)), for y a contiguous softmax output."""
    dy = kit.int32_columns(dy.resolve_neg())
    M, N = y.shape
    dx = torch.empty_like(y)
    BLOCK_M, BLOCK_N, num_warps = _tile_shape(N)
    softmax_backward_kernel[(triton.cdiv(M, BLOCK_M),)](
        y, dy, dx, M, N, dy.stride(0), dy.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=num_warps,
    )  # fmt: skip
    return dx


# %%
# ``torch.autograd.Function`` ties the two together: ``forward`` runs a forward
# launcher and saves :math:`y`, ``backward`` runs the kernel above. A Triton kernel's
# output has no autograd history, so without this wrapper a loss built on ``softmax(x)``
# would silently never reach ``x``. Calls that want no graph, such as the benchmark's,
# skip the wrapper and pay nothing for it. ``once_differentiable``: the backward builds
# no graph, so a second derivative through it raises an error instead of silently
# treating the first as a constant. The next lesson plugs its own backward launcher,
# for rows of any length, into this wrapper.


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, launch, backward):
        y = launch(x)
        ctx.save_for_backward(y)
        ctx.backward_launch = backward
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return ctx.backward_launch(y, dy), None, None


def differentiable(launch, x, backward=softmax_backward):
    """launch(x), its backward backward(y, dy), where autograd wants a graph."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Softmax.apply(x, launch, backward)
    return launch(x)


def softmax_one_row_per_program(x):
    """Row-wise softmax into a new tensor, one program per row; differentiable."""
    return differentiable(_one_row_per_program, _prepare(x))


def softmax(x):
    """Row-wise softmax into a new tensor, by persistent programs over row tiles,
    rows of LONG_ROW columns or more by step 1's kernel; differentiable."""
    return differentiable(_persistent, _prepare(x))


# %%
# The gradient, checked against float64 autograd through ``torch.softmax``, on a row
# length that is not a power of two and a transposed (strided) input:

if __name__ == "__main__":
    base = torch.randn(300, 37, device=DEVICE)
    for fn in (softmax_one_row_per_program, softmax):
        x = base.t().detach().requires_grad_()  # 37 rows of 300 columns, stride 37
        dy = torch.randn(37, 300, device=DEVICE)
        fn(x).backward(dy)
        x64 = x.detach().double().requires_grad_()
        torch.softmax(x64, dim=1).backward(dy.double())
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)
        error = (x.grad.double() - x64.grad).abs().max().item()
        print(
            f"{fn.__name__}: gradient on 37x300 (strided) fp32 matches float64 "
            f"autograd; max abs error {error:.2e}"
        )

# %%
# Benchmark
# ---------
# On a GPU each provider runs at :math:`M = 4096` rows and a range of row lengths (under
# the interpreter, a few small sizes). Speed is effective bandwidth, :math:`2MN \times`
# the element size over the time: the bytes a perfect fused kernel must move. Two
# copies give the scale, both measured in the same run:
#
# * a copy of a large buffer (256 MiB on a GPU), far bigger than the caches: the best
#   estimate this page has of what the memory system sustains (itself a kernel with
#   its own overheads: an estimate, not a bound);
# * a copy of *the same tensor* at each size: for small inputs, launching a kernel and
#   ramping the memory system up and down take a fixed few microseconds, and even a
#   copy falls short of the large-buffer figure (on a CPU a small tensor sits in the
#   caches, and its copy can beat it). A reference, not a ceiling: the copy is
#   PyTorch's elementwise kernel (a multiply by one into a new buffer), whose launch
#   shape is chosen for elementwise work in general, so a kernel can finish sooner at
#   some sizes, and the copy itself can dip.
#
# Each provider, the copies included, is timed two ways (the :doc:`performance page
# <../performance>` gives the details): *GPU time*, the call replayed from a CUDA graph
# after an L2 flush, and *back to back*, calls enqueued in a row, as a loop makes them.
# Under the interpreter both are wall-clock times of NumPy on the CPU: illustrative.
# ``torch.compile`` fuses the naive version into Triton code, compiled per shape; it
# runs only on a GPU (on a CPU it would generate C++, which says nothing of Triton).

ONE_ROW = "Triton, one row per program"
PERSISTENT = "Triton, row tiles (step 2)"
OURS = (PERSISTENT, ONE_ROW)
INDEX = ["dtype", "N"]  # a case of the benchmark


def providers(x):
    """What the benchmark times on x, each as fn(x)."""
    calls = {
        ONE_ROW: softmax_one_row_per_program,
        PERSISTENT: softmax,
        "torch.softmax": lambda t: torch.softmax(t, dim=1),
        "naive PyTorch": naive_softmax,
        kit.SAME_BYTES: kit.same_bytes_copy(x),
    }
    if kit.ON_GPU:
        calls["torch.compile"] = kit.compiled_for(naive_softmax, x)
    return calls


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    print(kit.describe_platform())
    dtypes = [torch.float32, torch.bfloat16]
    if kit.ON_GPU:
        M, sizes = 4096, [256, 512, 1024, 2048, 4096, 8192, 12288, 16384, 32768]
    else:
        M, sizes = 64, [64, 200, 781]
    copy_gbs = kit.copy_bandwidth_gbs()
    print(f"device copy bandwidth (large buffer), measured now: {copy_gbs:.0f} GB/s")
    results, table, b2b = kit.bandwidth_benchmark(M, sizes, dtypes, providers)

# %%
# The results
# -----------
# Every provider's GB/s at each row length by GPU time, in this run (three significant
# digits under the interpreter; a range where its timings spread by more than 10%):

kit.rates_table(results, INDEX, "GB/s") if __name__ == "__main__" else None

# %%
# The same rates back to back, calls enqueued in a row as a loop makes them (under the
# interpreter, the wall-clock times above again):

kit.rates_table(results, INDEX, "GB/s", "value") if __name__ == "__main__" else None

# %%
# What the numbers say
# --------------------
# Computed from the two tables just above, in this run. Two measures of noise appear:
# a case's *spread*, how far one provider's two fastest timings differ (median and
# largest in the last line), and the *noise floor*, the largest gap between the two
# Triton kernels where they run the same kernel: how far two providers' timings of one
# kernel drift apart, so a gain of one kernel over the other counts only past it.


def span(r, fmt, unit=""):
    """'lowest (at its case) to highest (at its case)' of a ratio over the cases."""
    at = {key: f"{r[key]:{fmt}}{unit} (at {key[0]}, N = {key[1]})" for key in r.index}
    return f"{at[r.idxmin()]} to {at[r.idxmax()]}"


def versus_naive(ratio, copy_share, limit=kit.SPREAD_LIMIT):
    """A sentence: step 2's speed over the naive version's (ratio, by case) against
    the byte count's 4x, explained where more than limit off; copy_share: the copy
    of the same tensor's fraction of the large-buffer copy, by case."""
    high, low = ratio > 4 * (1 + limit), ratio < 4 * (1 - limit)
    line = (
        f"Step 2 vs. naive PyTorch: {ratio.min():.1f}x to {ratio.max():.1f}x; the "
        "byte count predicts about 4x."
    )
    if high.any():
        line += (
            f" More than {limit:.0%} above it at {high.sum()} of {len(ratio)} sizes: "
            "the naive version's kernels move their bytes slower than step 2."
        )
    if low.any():
        share, cases = copy_share[low], kit.name_cases(ratio[low].index)
        why = "too few bytes to keep the memory system busy, and times are not "
        why += "proportional to bytes, as the count assumes"
        line += (
            f" More than {limit:.0%} below it at {cases}, where the copy of the "
            f"same tensor reaches {share.min():.0%} to {share.max():.0%} of the "
            "large-buffer copy: "
            + (why if share.max() < 1 - limit else "the count does not explain it")
            + "."
        )
    return line


if __name__ == "__main__":
    others = (*OURS, "naive PyTorch", kit.SAME_BYTES)
    peers = [c for c in table.columns if c not in others]
    ratio = table[PERSISTENT] / table[ONE_ROW]
    persistence = ratio[ratio.index.get_level_values("N") < LONG_ROW]  # persistent
    gain = kit.same_kernel_gain(ratio, results, OURS, LONG_ROW)
    print(f"What persistence buys, {gain}")
    speedup = table[PERSISTENT] / table[peers].max(axis=1)
    print(f"Step 2 vs. the best of {', '.join(peers)}: {span(speedup, '.2f', 'x')}.")
    small = table[kit.SAME_BYTES] / copy_gbs
    print(versus_naive(table[PERSISTENT] / table["naive PyTorch"], small))
    fraction = table[PERSISTENT] / copy_gbs
    print(f"Step 2 reaches {span(fraction, '.0%')} of the large-buffer bandwidth.")
    same = table[PERSISTENT] / table[kit.SAME_BYTES]
    print(
        f"A copy of the same tensor reaches {span(small, '.0%')} of the large-buffer "
        f"bandwidth; against it, step 2 reaches {span(same, '.0%')}, at least 95% "
        f"at {(same >= 0.95).sum()} of {len(same)} sizes."
    )
    print(kit.reference_dips(table, copy_gbs, PERSISTENT, "step 2"))
    if kit.ON_GPU:
        print(kit.loop_verdict(table, b2b, PERSISTENT, peers))
        print(kit.spread_summary(results))
    else:
        print("Interpreter timings: the ratios measure NumPy on the CPU, illustrative.")
    benchmark = dict(name=f"softmax, M = {M}", unit="GB/s", ceiling=copy_gbs)
    kit.save_results("02-fused-softmax", [dict(
        benchmark, ceiling_name="copy bandwidth", ceiling_per_case=kit.SAME_BYTES,
        ours=list(OURS), peers=peers, rows=results.to_dict("records"),
    )])  # fmt: skip

# %%
# How close to the memory system?
# -------------------------------
# The GPU-time table above, one panel per dtype: the large-buffer copy bandwidth
# dashed, the copy of the same tensor dotted. From ``LONG_ROW`` columns on, the two
# Triton curves run the same kernel: their largest gap there is the noise floor.

if __name__ == "__main__":
    title = f"Softmax, M = {M} rows: speed against the copy bandwidth"
    kit.plot_bandwidth(table, copy_gbs, title, OURS)
    plt.show()

# %%
# What does persistence buy?
# --------------------------
# The ratio of the two Triton kernels at each size below ``LONG_ROW``, where step 2's
# grid is persistent: above the line at 1, persistent programs over row tiles are faster
# than one program per row.

if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.axhline(1, color="black", linestyle="--", linewidth=1, label="equal speed")
    for dtype, ratio in persistence.groupby(level="dtype", sort=False):
        ratio.droplevel("dtype").plot(ax=ax, marker="o", logx=True, label=dtype)
    kit.label_sizes(ax, [n for n in sizes if n < LONG_ROW], rotation=45)
    title = "persistent row tiles / one program per row"
    ax.set(xlabel="N (row length)", ylabel="speed ratio", title=title)
    ax.legend()
    fig.tight_layout()
    plt.show()

# %%
# Where a fused kernel trails the copy of the same tensor, the gap is the kernel's own
# cost of starting and finishing each tile: loads cannot start before a program knows
# its addresses, and the store of a row waits for its reductions.
#
# Exercises
# ---------
# Each check runs your function on fresh random inputs of irregular shapes in fp32,
# fp16 and bf16 (strided views, a strided ``dy`` for the gradient), checks that it
# leaves its inputs as they were and compares it with float64, element by element
# (``NaN`` fails): it raises ``AssertionError`` naming the case, the first wrong
# element and how far off it is, or prints that the function passed. Write each attempt
# in a new cell at the end of this lesson's notebook (linked at the end of the page),
# below the checks, and call its check as shown; or in a file next to the lessons:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L02 = kit.load_lesson("02-fused-softmax")
#    # ... your kernel, and masked_softmax(x, lengths) that launches it ...
#    L02.check_masked_softmax(masked_softmax)
#
# 1. **Masked softmax.** Attention over padded sequences ignores the keys past each
#    row's length. Write ``masked_softmax(x, lengths)`` as a Triton kernel: ``x`` is
#    (M, N), ``lengths`` an int32 tensor of M lengths between 1 and N; row ``i`` is the
#    softmax of its first ``lengths[i]`` columns, and the columns past it are exactly 0.
#    Check it with ``check_masked_softmax(masked_softmax)``. On a GPU the check also
#    times it on one large fp16 input and prints its speed against a copy of ``x`` and
#    this lesson's ``softmax``: a target to read, not a test to pass (hint: a masked
#    load need not fetch the padding it masks off).
# 2. **Log-softmax and its backward.** Write ``log_softmax(x)``,
#    :math:`x_i - m - \log \sum_j e^{x_j - m}`, as a forward kernel and a backward
#    kernel wired together with ``torch.autograd.Function``. Derive the backward the way
#    this lesson derived softmax's (hint: it needs only the saved output and one sum per
#    row). Check it with ``check_log_softmax(log_softmax)``, which also compares the
#    gradient with float64 autograd.


def check_masked_softmax(fn):
    """Check fn(x, lengths): the softmax of each row's first lengths[i] columns, then
    print its speed (masked_softmax_speed)."""
    name, generator = "masked_softmax", kit.fresh_generator()
    for count, (case, leaf, view) in enumerate(kit.irregular_rows(scale=4), 1):
        x = view(leaf)
        M, N = x.shape
        lengths = torch.randint(1, N + 1, (M,), generator=generator, dtype=torch.int32)
        lengths[-1], lengths[0] = 1, N  # a full row, a one-element row if M > 1
        lengths = lengths.to(DEVICE)
        keep = torch.arange(N, device=DEVICE)[None, :] < lengths[:, None]
        if M > 1:  # padding can hold anything: a maximum over it would overflow
            x[-1, 1:] = 120
        expected = torch.softmax(x.double().masked_fill(~keep, -float("inf")), dim=1)
        x_before, lengths_before = x.clone(), lengths.clone()
        y = fn(x, lengths)
        kit.expect_unchanged(name, case, "x", x_before, x)
        kit.expect_unchanged(name, case, "lengths", lengths_before, lengths)
        tol = kit.TOLERANCE[x.dtype]
        kit.expect_close(name, case, "the output", y, expected, x.dtype, tol, tol / 100)
        stray = (y != 0) & ~keep  # within atol of 0 is not enough: it must be 0
        if stray.any():
            i, j = stray.nonzero()[0].tolist()
            raise AssertionError(
                f"{name} on {case}: element ({i}, {j}), past row {i}'s length "
                f"{lengths[i].item()}, is {y[i, j].item():.3g}; columns past a row's "
                "length must be exactly 0"
            )
    print(
        f"{name} passed on {count} fresh inputs (irregular shapes, fp32/fp16/bf16, "
        "strided views)."
    )
    print(masked_softmax_speed(fn))


def masked_softmax_speed(fn, M=8192, N=1500):
    """A line on fn(x, lengths)'s GPU time on fresh M x N fp16 inputs, against
    copying x and this lesson's softmax of x: a target reported, not enforced."""
    if not kit.ON_GPU:
        return "masked_softmax: speed is measured only on a GPU."
    generator = kit.fresh_generator()
    x = torch.randn(M, N, generator=generator).to(DEVICE, torch.float16)
    lengths = torch.randint(1, N + 1, (M,), generator=generator, dtype=torch.int32)
    timers = {
        "yours": kit.call_timer(fn, x, lengths.to(DEVICE)),
        "softmax": kit.call_timer(softmax, x),
        "copy": kit.call_timer(kit.same_bytes_copy(x), x),
    }
    ms = {key: min(m.gpu) for key, m in kit.time_calls(timers).items()}
    return (
        f"masked_softmax on {M}x{N} fp16, by GPU time (not enforced): "
        f"{ms['copy'] / ms['yours']:.0%} of the speed of copying x (the target: "
        "about 100% for reading x once and writing y once, more where it skips "
        f"the padding) and {ms['softmax'] / ms['yours']:.2f}x this lesson's softmax."
    )


def check_log_softmax(fn):
    """Check fn(x) -> log_softmax(x) along rows, and its gradient."""
    name, generator = "log_softmax", kit.fresh_generator()
    for count, (case, leaf, view) in enumerate(kit.irregular_rows(scale=4), 1):
        leaf.requires_grad_()
        x = view(leaf)
        x64 = x.detach().double().requires_grad_()
        expected = torch.log_softmax(x64, dim=1)
        x_before = x.detach().clone()
        y = fn(x)
        kit.expect_unchanged(name, case, "x", x_before, x.detach())
        tol = kit.TOLERANCE[x.dtype]
        want = expected.detach()
        kit.expect_close(name, case, "the output", y, want, x.dtype, tol, tol)
        if y.grad_fn is None:
            raise AssertionError(
                f"{name} on {case}: the output has no autograd graph although x "
                "requires a gradient; wire the kernels together with "
                "torch.autograd.Function"
            )
        # dy as autograd may hand it over: a transposed view, not contiguous.
        dy = torch.randn(y.shape[::-1], generator=generator).to(DEVICE, y.dtype).t()
        y.backward(dy)
        expected.backward(dy.double())
        if leaf.grad is None:
            raise AssertionError(f"{name} on {case}: x received no gradient")
        grad, scale = view(leaf.grad), 1 + x64.grad.abs().max().item()
        kit.expect_close(
            name, case, "the gradient", grad, x64.grad, x.dtype, tol, tol * scale
        )
    print(
        f"{name} passed on {count} fresh inputs, output and gradient (irregular "
        "shapes, fp32/fp16/bf16, strided views, a strided dy)."
    )
