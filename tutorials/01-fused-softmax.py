"""
Fused softmax
=============

A row-wise softmax written as one Triton kernel that reads its input once and writes its output once,
and measured against PyTorch to see how close that gets to the speed of copying memory.

You will learn:

* why a *fused* kernel beats a sequence of PyTorch operations, with the memory-traffic arithmetic;
* how a Triton program processes a tile of rows held entirely on chip, with masking for row
  lengths that are not powers of two;
* how to make softmax numerically stable, and why the math runs in fp32 whatever the input dtype;
* how to size a *persistent* grid from the GPU's occupancy so that every SM stays busy;
* how to benchmark a memory-bound kernel honestly: in GB/s, beside the copy bandwidth measured in
  the same run.
"""

# %%
# Where the kernels run
# ---------------------
# With a CUDA GPU, Triton compiles the kernels for it. Without one, the same kernels run through the
# Triton interpreter on the CPU, at small sizes. The interpreter is switched on by an environment
# variable that Triton reads when ``@triton.jit`` runs, so it must be set *before* the first kernel
# is defined: setting it later has no effect, a pitfall worth remembering.

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (imported after the interpreter switch on purpose)
import triton.language as tl  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# %%
# Motivation: count the bytes
# ---------------------------
# Softmax turns each row :math:`x` of a matrix into :math:`y_i = e^{x_i - m} / \sum_j e^{x_j - m}`,
# where subtracting the row maximum :math:`m = \max_j x_j` changes nothing mathematically but
# keeps :math:`e^{x}` from overflowing (fp32 overflows past :math:`e^{88.7}`, fp16 past
# :math:`e^{11.1}`).
#
# Written with PyTorch operations, each step is a separate kernel that reads its input from
# device memory and writes its result back:


def naive_softmax(x):
    """Row-wise softmax in five PyTorch operations: the baseline that fusion improves on."""
    x_max = x.max(dim=1)[0]  # read MN, write M
    z = x - x_max[:, None]  # read MN + M, write MN
    numerator = torch.exp(z)  # read MN, write MN
    denominator = numerator.sum(dim=1)  # read MN, write M
    return numerator / denominator[:, None]  # read MN + M, write MN


# %%
# For an :math:`M \times N` input that is :math:`5MN + 2M` elements read and :math:`3MN + 2M`
# written. A fused kernel loads each row once, does every step on chip, and writes the result once:
# :math:`MN` read and :math:`MN` written. Softmax does a handful of arithmetic operations per
# element, far less than a GPU can do in the time it takes to move that element, so its run time is
# set by memory traffic, and the fused kernel should approach
# :math:`(8MN + 4M) / 2MN \approx 4\times` the naive version's speed. ``torch.softmax`` is already a
# single fused kernel, so against it the question is only how close each comes to the hardware.
#
# The kernel
# ----------
# Each program owns a tile of ``BLOCK_M`` rows by ``BLOCK_N`` columns. ``BLOCK_N`` is the row length
# rounded up to a power of two (Triton's tile shapes must be powers of two); the columns past
# :math:`N` are masked: loads there return :math:`-\infty`, which adds :math:`e^{-\infty} = 0` to
# the sum, and stores there are skipped. Several rows per program matter for short rows: one row of
# 256 fp32 values is only 1 KiB, too little work to hide the latency of a memory load.
#
# The program is *persistent*: it loops over row tiles with a stride of the grid size, instead of
# the grid having one program per tile. ``tl.range(..., num_stages=...)`` lets the compiler issue
# the load of the next tile while the current one is still being computed on (software
# pipelining).


@triton.jit
def softmax_kernel(
    x_ptr, y_ptr, M, N, x_row_stride, x_col_stride, y_row_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    for first_row in tl.range(pid * BLOCK_M, M, num_programs * BLOCK_M, num_stages=NUM_STAGES):
        rows = first_row + tl.arange(0, BLOCK_M)
        # Rows past the end re-read the last row instead of loading all -inf (whose max is -inf,
        # and -inf - -inf is NaN); their results are never stored. int64: M * stride can pass 2**31.
        load_rows = tl.minimum(rows, M - 1).to(tl.int64)
        x = tl.load(x_ptr + load_rows[:, None] * x_row_stride + cols[None, :] * x_col_stride,
                    mask=col_ok[None, :], other=-float("inf")).to(tl.float32)
        row_max = tl.max(x, axis=1)
        numerator = tl.exp(x - row_max[:, None])
        denominator = tl.sum(numerator, axis=1)
        y = numerator / denominator[:, None]
        tl.store(y_ptr + load_rows[:, None] * y_row_stride + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_ok[None, :])


# %%
# Two details deserve a word. The math is fp32 even for fp16 and bf16 inputs: the sum of
# thousands of small terms in 16-bit precision would lose most of its digits, and the conversion
# costs nothing next to the memory traffic. And the column stride is a parameter: a kernel that
# assumed contiguous rows would silently compute garbage on a transposed view, while Triton
# specializes a stride equal to 1 at compile time, so the common case still gets wide, vectorized
# loads.
#
# The launch helper
# -----------------
# The launcher checks its input (a kernel that receives a bad pointer does not raise, it computes
# nonsense or crashes the process), then picks the tile and the grid:
#
# * ``BLOCK_M``: enough rows that each tile holds at least 2,048 elements, so that short rows
#   still give each program a worthwhile amount of memory traffic, yet tiles stay small enough
#   that many programs share each SM and overlap one another's loads.
# * ``num_warps``: about 16 elements per thread (at least 4 warps), so that the tile fits in
#   registers. A tile that needs more registers than a thread may have spills to slow local
#   memory.
# * ``NUM_STAGES = 1``: no software pipelining across tiles. Pipelining keeps the next tile in
#   shared memory while the current one is computed on; with this many small programs per SM, the
#   programs already overlap each other's loads, and on an H100 a second stage was no faster.
# * the grid: *occupancy* is how many programs an SM can host at once, limited by its registers
#   (65,536 32-bit registers on recent NVIDIA GPUs), its shared memory and its thread slots. We
#   compile the kernel first, read how many registers and how much shared memory it uses, compute
#   the occupancy, and launch exactly as many programs as fit at once on all SMs. Each then loops
#   over its share of the tiles.
#
# These choices were not guessed: ``tools/tune.py softmax`` in this site's repository sweeps tile
# heights, warps, stages and grid styles on a GPU, and the rules above follow its winners. Earlier
# versions of this lesson sized tiles in bytes (16 KiB, then 8 KiB); for bf16 that halves the
# warps in flight for short rows, and a full build measured bf16 rows of 256 and 1,024 elements
# at half the speed of the element-based rule.

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_input(x):
    """Raise a clear error for anything the kernels cannot handle."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"softmax expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"softmax expects a 2-D tensor (rows, columns), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"softmax supports float32, float16 and bfloat16, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"softmax needs at least one row and one column, got shape {tuple(x.shape)}")
    if x.device.type != DEVICE.type:
        raise ValueError(f"x is on device '{x.device}', but Triton runs these kernels on '{DEVICE.type}' here")


def _tile_shape(N, element_size):
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_M = max(1, 2048 // BLOCK_N)
    num_warps = max(4, min(32, BLOCK_M * BLOCK_N // (16 * 32)))
    return BLOCK_M, BLOCK_N, num_warps


_occupancy = {}


def _persistent_grid(args, meta, num_warps, row_tiles):
    """How many programs fit on the GPU at once (at most one per tile)."""
    if not ON_GPU:
        return row_tiles  # the interpreter runs programs one after another; no SMs to fill
    key = (args[0].device, args[0].dtype, meta["BLOCK_M"], meta["BLOCK_N"], num_warps)
    if key not in _occupancy:
        kernel = softmax_kernel.warmup(*args, **meta, num_warps=num_warps, grid=(1,))
        kernel._init_handles()
        props = torch.cuda.get_device_properties(args[0].device)
        threads = num_warps * 32
        by_registers = props.regs_per_multiprocessor // max(1, kernel.n_regs * threads)
        by_threads = props.max_threads_per_multi_processor // threads
        by_smem = (props.shared_memory_per_multiprocessor // kernel.metadata.shared
                   if kernel.metadata.shared else by_threads)
        _occupancy[key] = props.multi_processor_count * max(1, min(by_registers, by_threads, by_smem))
    return min(row_tiles, _occupancy[key])


def softmax(x):
    """Row-wise softmax of a 2-D tensor in one fused Triton kernel; returns a new contiguous tensor."""
    check_input(x)
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M, BLOCK_N, num_warps = _tile_shape(N, x.element_size())
    args = (x, y, M, N, x.stride(0), x.stride(1), y.stride(0))
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=1)
    grid = _persistent_grid(args, meta, num_warps, triton.cdiv(M, BLOCK_M))
    softmax_kernel[(grid,)](*args, **meta, num_warps=num_warps)
    return y


# %%
# A tile of ``BLOCK_M x BLOCK_N`` values must fit in one program's registers, so this kernel has a
# limit: past roughly 16,384 fp32 values per row, the tile no longer fits, and the compiler spills.
# The next tutorial handles rows of any length.
#
# Is it correct?
# --------------
# Always check a kernel against a trusted reference before timing it. The shape below is
# deliberately irregular: 1823 rows (not a multiple of any tile height) of 781 columns (not a power
# of two, so the mask is exercised). The reference is ``torch.softmax`` in float64.

if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(1823, 781, device=DEVICE)
    y = softmax(x)
    reference = torch.softmax(x.double(), dim=1)
    error = (y.double() - reference).abs().max().item()
    print(f"max abs error vs float64 reference on 1823x781 fp32: {error:.2e}")
    assert error < 1e-6, error

# %%
# Benchmark
# ---------
# Each provider runs at :math:`M = 4096` rows and a range of row lengths. Speed is given as
# effective bandwidth, :math:`2MN \times` the element size over the time: the bytes a perfect fused
# kernel must move. A device-to-device copy of a large buffer, measured in the same run, is the
# ceiling no softmax can pass, since it moves the same bytes and does no math. On a GPU the time is
# the median of ``triton.testing.do_bench``; under the interpreter it is the median wall-clock time
# of a few runs, which measures NumPy on the CPU, not a GPU.

import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402


def describe_platform():
    """What produced the numbers on this page."""
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name()} ({versions})"
    return (f"Triton interpreter on CPU ({platform.processor() or platform.machine()}; {versions}): "
            "these timings measure the interpreter, not a GPU")


def bench_ms(fn):
    """Median time of fn() in milliseconds: do_bench on a GPU, wall clock under the interpreter."""
    if ON_GPU:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def copy_bandwidth_gbs():
    """Device copy bandwidth (bytes read + written per second) on a buffer far larger than caches."""
    n = (256 << 20) if ON_GPU else (8 << 20)
    src = torch.randn(n // 4, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * n / bench_ms(lambda: dst.copy_(src)) * 1e-6


def save_results(tutorial, benchmarks):
    """Leave the measured numbers for the site's "Performance at a glance" page, when built by it."""
    out = os.environ.get("TUTORIAL_RESULTS_DIR")
    if not out:
        return
    import json

    os.makedirs(out, exist_ok=True)
    record = {"tutorial": tutorial, "platform": describe_platform(), "on_gpu": ON_GPU,
              "date": time.strftime("%Y-%m-%d"), "benchmarks": benchmarks}
    with open(os.path.join(out, tutorial + ".json"), "w") as f:
        json.dump(record, f, indent=1)


# %%
# Beside the large-buffer copy, each size also gets a copy of *the same tensor*: for small inputs,
# launching a kernel and ramping the memory system up and down take a fixed few microseconds, so
# even a plain copy falls short of the large-buffer figure there. That curve is the honest ceiling
# at each size.
#
# ``torch.compile`` fuses the naive version into generated Triton code. It compiles once per shape,
# which takes seconds on a GPU; on a CPU it would generate C++ instead, which says nothing about
# Triton, so it only runs on a GPU.

# A copy of the same tensor moves exactly the bytes a perfect softmax must: the ceiling at each size.
SAME_SIZE_COPY = "copy of x (same bytes)"
PROVIDERS = {
    "Triton (this tutorial)": softmax,
    "torch.softmax": lambda x: torch.softmax(x, dim=1),
    "naive PyTorch": naive_softmax,
}


def run_benchmark(M, sizes, dtypes):
    rows = []
    for dtype in dtypes:
        for N in sizes:
            x = torch.randn(M, N, device=DEVICE, dtype=dtype)
            gbs = lambda ms: 2 * x.numel() * x.element_size() / ms * 1e-6  # noqa: E731
            for name, fn in PROVIDERS.items():
                rows.append(dict(dtype=str(dtype).split(".")[1], N=N, provider=name, value=gbs(bench_ms(lambda: fn(x)))))
            copy_of_x = torch.empty_like(x)
            rows.append(dict(dtype=str(dtype).split(".")[1], N=N, provider=SAME_SIZE_COPY,
                             value=gbs(bench_ms(lambda: copy_of_x.copy_(x)))))
            if ON_GPU:
                torch._dynamo.reset()  # one compiled graph per shape, never the recompile limit
                compiled = torch.compile(naive_softmax, dynamic=False)
                rows.append(dict(dtype=str(dtype).split(".")[1], N=N, provider="torch.compile",
                                 value=gbs(bench_ms(lambda: compiled(x)))))
    return rows


if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    print(describe_platform())
    if ON_GPU:
        M, sizes, dtypes = 4096, [256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384], [torch.float32, torch.bfloat16]
    else:
        M, sizes, dtypes = 64, [64, 200, 781], [torch.float32, torch.bfloat16]
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy bandwidth, measured now: {copy_gbs:.0f} GB/s")
    results = pd.DataFrame(run_benchmark(M, sizes, dtypes))

# %%
# The table gives GB/s; the plot shows the same numbers with the copy bandwidth as a dashed line.

if __name__ == "__main__":
    pd.set_option("display.width", 200)
    table = results.pivot_table(index=["dtype", "N"], columns="provider", values="value", sort=False)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.2), sharey=True, squeeze=False)
    for ax, (dtype, part) in zip(axes[0], table.groupby(level="dtype", sort=False)):
        part = part.droplevel("dtype")
        part.drop(columns=SAME_SIZE_COPY).plot(ax=ax, marker="o", logx=True)
        part[SAME_SIZE_COPY].plot(ax=ax, color="gray", linestyle=":", marker=".", logx=True)
        ax.axhline(copy_gbs, color="black", linestyle="--", label="copy bandwidth (256 MiB)")
        ax.set(title=f"softmax, M = {M}, {dtype}", xlabel="N (row length)", ylabel="GB/s", ylim=(0, None))
        ax.set_xticks(sizes, [str(n) for n in sizes], rotation=45, minor=False)
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    table.round(1)

# %%
# What the numbers say
# --------------------
# The sentences below are computed from the table above, in this run.

if __name__ == "__main__":
    ours = "Triton (this tutorial)"
    peers = [c for c in table.columns if c not in (ours, "naive PyTorch", SAME_SIZE_COPY)]
    best_peer = table[peers].max(axis=1)
    speedup = table[ours] / best_peer
    naive_ratio = table[ours] / table["naive PyTorch"]
    at = lambda key: f"{key[0]}, N = {key[1]}"  # noqa: E731
    print(f"Triton vs. the best of {', '.join(peers)}: from {speedup.min():.2f}x "
          f"(at {at(speedup.idxmin())}) to {speedup.max():.2f}x (at {at(speedup.idxmax())}).")
    print(f"Triton vs. naive PyTorch: {naive_ratio.min():.1f}x to {naive_ratio.max():.1f}x "
          f"(the byte count predicts about 4x on a GPU).")
    fraction = table[ours] / copy_gbs
    print(f"Triton reaches {fraction.min():.0%} (at {at(fraction.idxmin())}) to {fraction.max():.0%} "
          f"(at {at(fraction.idxmax())}) of the copy bandwidth.")
    same = table[ours] / table[SAME_SIZE_COPY]
    small = table[SAME_SIZE_COPY] / copy_gbs
    print(f"A copy of the same tensor reaches {small.min():.0%} (at {at(small.idxmin())}) to {small.max():.0%} of the "
          f"large-buffer bandwidth; against it, Triton reaches {same.min():.0%} to {same.max():.0%}.")
    if not ON_GPU:
        print("These are interpreter timings: the ratios measure NumPy on the CPU, not GPU kernels.")
    save_results("01-fused-softmax", [{
        "name": "softmax, M = %d" % M, "unit": "GB/s", "ceiling_name": "copy bandwidth", "ceiling": copy_gbs,
        "ours": [ours], "peers": peers, "rows": results.to_dict("records")}])

# %%
# On a GPU, expect the fused kernel to be a few times faster than the naive version, as the byte
# count predicts, and to sit close to the copy bandwidth once rows are long enough to keep the
# memory system busy. What is left between a kernel and the dashed line is the cost of starting
# and finishing each tile: loads cannot start before the program knows its addresses, and the
# store of a row waits for its reductions.
