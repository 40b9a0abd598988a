"""
Tiles and tl.dot
================

A matrix multiplication :math:`C = AB` written as one Triton kernel, in which each program computes
one tile of :math:`C` with ``tl.dot``. The softmax lessons moved bytes; this one does arithmetic.
The attention lessons that follow are built from exactly these tiles: they compute :math:`QK^T`
and :math:`PV` one block of queries against one block of keys or values at a time.

You will learn:

* how a program computes a ``BLOCK_M x BLOCK_N`` tile of :math:`C` by walking :math:`K` in
  ``BLOCK_K`` steps, with ``tl.dot`` accumulating in fp32;
* the masks, strides and 64-bit offsets that make one kernel correct for any shape and layout;
* the roofline arithmetic: how many FLOPs a tile does per byte it loads, why larger tiles do more,
  and what stops them growing;
* how the order in which programs run decides what the L2 cache can share, timed side by side,
  and why attention faces the same question;
* an interpreter pitfall with bf16 in ``tl.dot``, and the ``UPCAST_DOT`` flag the attention
  lessons use for it.
"""

# %%
# Where the kernels run
# ---------------------
# A CUDA GPU when there is one, otherwise the Triton interpreter on the CPU, switched on before the
# first ``@triton.jit``.

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (imported after the interpreter switch on purpose)
import triton.language as tl  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# %%
# Count the FLOPs and the bytes
# -----------------------------
# Multiplying an :math:`M \times K` matrix by a :math:`K \times N` one takes :math:`2MNK`
# floating-point operations (a multiply and an add per term) on :math:`MK + KN` input elements. If
# every element of :math:`A` and :math:`B` were read from memory once and :math:`C` written once,
# a square fp16 product of size :math:`n` would do :math:`2n^3` FLOPs on :math:`6n^2` bytes (two
# bytes per element of three matrices), :math:`n/3` FLOPs per byte: far more math than memory
# traffic. The question is how close a kernel can get to reading each element once.
#
# A program keeps one ``BLOCK_M x BLOCK_N`` tile of :math:`C` on chip and, at every step of
# ``BLOCK_K`` along :math:`K`, loads a ``BLOCK_M x BLOCK_K`` slice of :math:`A` and a
# ``BLOCK_K x BLOCK_N`` slice of :math:`B`: :math:`(B_M + B_N) B_K` elements for
# :math:`2 B_M B_N B_K` FLOPs. Its *arithmetic intensity* is therefore
#
# .. math::
#
#    I = \frac{2 B_M B_N}{(B_M + B_N)\, s} \ \text{FLOP per byte},
#
# where :math:`s` is the number of bytes per element: set by the tile alone, whatever the size of
# the matrices. The roofline model calls a kernel compute-bound when its intensity passes the
# *ridge point*, the peak FLOP rate over the memory bandwidth. For an H100 SXM, NVIDIA's
# datasheet gives 989 TFLOP/s of dense fp16 tensor-core math, 3.35 TB/s of bandwidth to its HBM3
# (*high-bandwidth memory*, the GPU's main memory, stacked beside the chip), a 50 MB L2 cache and
# 132 SMs.

H100_DATASHEET = dict(fp16_tflops=989.4, hbm_tbs=3.35, sms=132)  # NVIDIA H100 SXM datasheet figures


def tile_intensity(block_m, block_n, element_size=2):
    """FLOP per byte that a program loads for one BLOCK_M x BLOCK_N tile of C (BLOCK_K cancels out)."""
    return 2 * block_m * block_n / ((block_m + block_n) * element_size)


if __name__ == "__main__":
    import pandas as pd

    ridge = H100_DATASHEET["fp16_tflops"] / H100_DATASHEET["hbm_tbs"]
    print(f"H100 ridge point from the datasheet: {ridge:.0f} FLOP/byte; an 8192^3 fp16 product that read "
          f"each element once: {8192 / 3:.0f} FLOP/byte")
    tile_table = pd.DataFrame([{"tile (BM x BN)": f"{m} x {n}", "intensity, fp16 (FLOP/byte)": tile_intensity(m, n),
                                "fp32 accumulator (KiB)": m * n * 4 / 1024,
                                "one stage of A and B slices, BLOCK_K = 64 (KiB)": (m + n) * 64 * 2 / 1024}
                               for m, n in [(16, 16), (32, 32), (64, 64), (128, 128), (128, 256), (256, 256)]])
tile_table.round(1) if __name__ == "__main__" else None

# %%
# Two conclusions. Doubling both sides of a tile doubles its intensity, so tiles should be as large
# as possible. Yet even a 128 x 256 tile sits far below the ridge point: if every slice came from
# HBM, no tile that fits on chip would keep the tensor cores busy. Most loads must hit in L2, where
# another program running at the same time already brought them; the section on program order is
# about exactly that.
#
# What stops a tile from growing is on-chip storage. The accumulator lives in registers: an SM has
# 65,536 32-bit registers (256 KiB) for all the programs it runs (NVIDIA's CUDA programming guide).
# A 128 x 256 fp32 accumulator takes half of them, 128 per thread with 8 warps; 256 x 256 would take
# all of them, leaving none for addresses and loaded values, and spill to slow local memory. The
# slices of :math:`A` and :math:`B` wait in shared memory, one set per pipeline *stage*, so that the
# loads of the next steps overlap the math of this one; a program may use 227 KiB of shared memory
# on an H100 (same guide), which at the sizes in the table allows four stages of 128 x 256 with
# ``BLOCK_K = 64``.
#
# The kernel
# ----------
# Program ``pid`` first works out which tile of :math:`C` it owns (``tile_of_program``; its order
# is the subject of a later section), then walks :math:`K`:
#
# * ``tl.dot(a, b, acc)`` multiplies the two slices on the tensor cores and adds the product to
#   ``acc``, an fp32 tile: a 16-bit running sum would round at every step and lose digits over a
#   long :math:`K`. The tile is converted to the output dtype once, when stored.
# * Masks make any :math:`M, N, K` work. Rows past :math:`M` and columns past :math:`N` are
#   computed on zeros and never stored. Along :math:`K`, *both* loads are masked to zero: past the
#   end, memory may hold anything, NaN included, and :math:`0 \times \mathrm{NaN}` is NaN.
# * Every stride is an argument, so transposed and sliced views work without a copy, and Triton
#   specializes an integer argument equal to 1 at compile time, so the contiguous dimension still
#   gets wide, vectorized loads.
# * Offsets (index times stride) are computed in int64: they pass :math:`2^{31}` in any matrix of
#   more than :math:`2^{31}` elements (4 GiB of fp16) or a strided view of a large buffer, and
#   int32 arithmetic would wrap around to wrong addresses without an error. The indices themselves
#   stay int32, which is safe because the launcher keeps :math:`M, N, K` below :math:`2^{30}`, so
#   an index plus one block cannot reach :math:`2^{31}`.
#
# One more pitfall, this time in the interpreter: in Triton 3.9 the interpreter stores bf16 values
# as 16-bit integers and multiplies them as integers inside ``tl.dot``, giving nonsense. The kernel
# takes an ``UPCAST_DOT`` flag that converts both slices to fp32 first, as the attention kernels do;
# the launcher sets it only for bf16 under the interpreter, so the GPU path is untouched.
#
# The tile sizes are tuned, not guessed: ``triton.autotune`` times each configuration below once per
# shape and keeps the fastest. On a GPU they are three of the configurations that Triton's own
# matrix-multiplication tutorial lists for NVIDIA GPUs, few enough to keep compile time short.
# Under the interpreter a single 64 x 64 x 32 tile keeps the run short (``tl.dot`` needs every side
# to be at least 16).

if ON_GPU:
    CONFIGS = [triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64), num_stages=3, num_warps=8),
               triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32), num_stages=4, num_warps=4),
               triton.Config(dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32), num_stages=4, num_warps=4)]
else:
    CONFIGS = [triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32))]


@triton.jit
def tile_of_program(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row, column) of the tile of C that program pid computes: GROUP_M rows of tiles at a time,
    column by column. GROUP_M = 1 is plain row-major order."""
    programs_per_group = GROUP_M * tiles_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_height = tl.minimum(tiles_m - first_m, GROUP_M)  # the last group may be shorter
    in_group = pid % programs_per_group
    return first_m + in_group % group_height, in_group // group_height


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    pid_m, pid_n = tile_of_program(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am  # loop-invariant part of the addresses
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=(k[:, None] < K) & col_ok[None, :], other=0.0)
        if UPCAST_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# %%
# The launcher
# ------------
# A kernel handed a bad pointer does not raise: it computes nonsense or crashes the process. So the
# launcher checks everything first. It also resolves *negative-bit* views: ``torch._neg_view`` (and
# some autograd formulas) return a tensor whose memory holds :math:`x` while its value is
# :math:`-x`, and a kernel reading raw memory would see :math:`x`. ``resolve_neg()`` materializes
# the negation (a copy only when the bit is set). The conjugate bit exists only on complex tensors,
# which the dtype check refuses.

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=1e-2), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
MAX_DIM = 2**30
GROUP_M = 8


def check_operands(a, b):
    """Raise a clear error for anything the kernel cannot handle."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.device.type != DEVICE.type:
            raise ValueError(f"{name} is on device '{t.device}', but Triton runs these kernels on '{DEVICE.type}' here")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    (M, K), (K_b, N) = a.shape, b.shape
    if K != K_b:
        raise ValueError(f"a is {M} x {K} and b is {K_b} x {N}: the columns of a must match the rows of b")
    if min(M, N, K) == 0:
        raise ValueError(f"matmul needs non-empty matrices, got a {M} x {K} and b {K_b} x {N}")
    if max(M, N, K) >= MAX_DIM:
        raise ValueError(f"every dimension must be below 2**30 (indices are int32), got M={M}, N={N}, K={K}")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        # A Triton kernel's output carries no graph: a loss built on it would silently never reach a or b.
        raise TypeError("this matmul is forward-only (it has no backward): pass tensors that do not require grad "
                        "(a.detach()), or call it under torch.no_grad()")


def matmul(a, b, group_m=GROUP_M):
    """a @ b for 2-D float16 or bfloat16 matrices with any strides, as a new contiguous matrix of their dtype."""
    check_operands(a, b)
    if isinstance(group_m, bool) or not isinstance(group_m, int) or not 1 <= group_m < MAX_DIM:
        raise ValueError(f"group_m must be a positive int below 2**30, got {group_m!r}")
    a, b = a.resolve_neg(), b.resolve_neg()
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    matmul_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                        GROUP_M=group_m, UPCAST_DOT=not ON_GPU and a.dtype == torch.bfloat16)
    return c


# %%
# Is it correct?
# --------------
# Against float64 on a shape that no tile divides, in both dtypes, then with :math:`B` given as a
# transposed view, the layout in which attention reads :math:`K^T`. ``torch.testing.assert_close``
# fails on NaN, where a bare maximum of the error would not (``max`` of a tensor holding NaN is NaN,
# and ``NaN < tolerance`` is merely False, easy to test the wrong way round).

if __name__ == "__main__":
    torch.manual_seed(0)
    M, N, K = 333, 277, 131
    for dtype in SUPPORTED_DTYPES:
        a = torch.randn(M, K, device=DEVICE, dtype=dtype)
        for layout, b in [("b contiguous", torch.randn(K, N, device=DEVICE, dtype=dtype)),
                          ("b transposed (a view)", torch.randn(N, K, device=DEVICE, dtype=dtype).t())]:
            reference = a.double() @ b.double()
            c = matmul(a, b)
            torch.testing.assert_close(c.double(), reference, **TOLERANCE[dtype])
            error = ((c.double() - reference).abs().max() / reference.abs().max()).item()
            print(f"{M} x {N} x {K}, {str(dtype)[6:]}, {layout}: matches float64, "
                  f"max error {error:.1e} of the largest value")

# %%
# Which tiles run together
# ------------------------
# Programs do not all run at once. A 128 x 256 program fills an H100's SM (its accumulator and
# pipeline stages above), so 132 run together while an 8192 x 8192 :math:`C` has 2,048 such tiles.
# The programs running together step through :math:`K` at about the same pace, and a slice that one
# of them brought into L2 is there for the others: what they can share depends only on *which*
# tiles they are, that is, on how program ids map to tiles. The GPU starts programs roughly in the
# order of their ids.
#
# *Row-major* order gives out a whole row of tiles before the next: the programs in flight share a
# few slices of :math:`A` but need every slice of :math:`B`. *Grouped* order walks ``GROUP_M`` rows
# of tiles column by column, a squarer patch that needs fewer distinct slices for as many tiles.
# The small kernel below runs ``tile_of_program`` for every program id and writes down which
# program computes each tile, first on a grid of 5 x 6 tiles.


@triton.jit
def program_order_kernel(order_ptr, tiles_m, tiles_n, GROUP_M: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # BLOCK program ids at once: it is only arithmetic
    valid = pid < tiles_m * tiles_n
    tile_m, tile_n = tile_of_program(tl.where(valid, pid, 0), tiles_m, tiles_n, GROUP_M)
    tl.store(order_ptr + tile_m * tiles_n + tile_n, pid, mask=valid)


def program_order(tiles_m, tiles_n, group_m):
    """order[i, j] = the id of the program that computes tile (i, j) of C."""
    order = torch.full((tiles_m, tiles_n), -1, dtype=torch.int32, device=DEVICE)
    program_order_kernel[(triton.cdiv(tiles_m * tiles_n, 1024),)](order, tiles_m, tiles_n, GROUP_M=group_m, BLOCK=1024)
    return order.cpu()


def slices_in_flight(order, programs):
    """How many tile rows (slices of A) and tile columns (slices of B) programs 0 .. programs-1 need."""
    running = order < programs
    return int(running.any(dim=1).sum()), int(running.any(dim=0).sum())


if __name__ == "__main__":
    for group_m in (1, 2):
        print(f"GROUP_M = {group_m}:")
        print("\n".join(" ".join(f"{p:3d}" for p in row) for row in program_order(5, 6, group_m).tolist()))
    BM, BN, BK, n, sms = 128, 256, 64, 8192, H100_DATASHEET["sms"]
    flops = sms * 2 * BM * BN * BK
    for group_m in (1, GROUP_M):
        tile_rows, tile_cols = slices_in_flight(program_order(n // BM, n // BN, group_m), sms)
        loaded = (tile_rows * BM + tile_cols * BN) * BK * 2
        print(f"n = {n}, {BM} x {BN} tiles, GROUP_M = {group_m}: the first {sms} programs need {tile_rows} slices "
              f"of A and {tile_cols} of B, {loaded / 1024:.0f} KiB per K step: {flops / loaded:.0f} FLOP per byte")

# %%
# The last two lines count the distinct bytes that the first 132 programs need per :math:`K` step,
# as if each slice came from HBM once and reached the others through L2: in that idealized picture
# grouped order loads markedly fewer bytes for the same FLOPs. In that picture both orders already
# pass the ridge point (compare the H100's, computed above), so neither would wait on memory;
# grouped order only leaves more margin for what the picture ignores: real programs drift apart in
# time, slices can leave L2 before their last reader comes, and L2 has a bandwidth of its own.
# Whether the difference shows in the run time is for the benchmark to say, and the line under its
# table says how far apart the two orders ran.
#
# Attention faces the same question. Each of its programs owns a block of queries and reads *all*
# of :math:`K` and :math:`V` for its (batch, head), so the programs of one head should run together.
# The next lessons launch a grid of (query blocks, batch x heads) with the query block on axis 0,
# which varies fastest: the programs of one head are adjacent in launch order, so :math:`K` and
# :math:`V` can come from HBM about once per head and from L2 for its other query blocks.
#
# Benchmark
# ---------
# TFLOP/s (:math:`2n^3` over the time) for square fp16 products, this kernel in both orders and
# ``torch.matmul`` (cuBLAS on a GPU). The ceiling is ``torch.matmul``'s rate on an 8192 x 8192 fp16
# product (256 x 256 fp32 on a CPU), measured in this run by the helper the attention lessons use.

import functools  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402


def describe_platform():
    """What produced the numbers on this page."""
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name()} ({versions})"
    return (f"Triton interpreter on CPU ({platform.processor() or platform.machine()}; {versions}): "
            "these timings measure the interpreter, not a GPU")


def warm_up(fn, seconds=0.05):
    """Run fn on the GPU for `seconds` (50 ms unless asked) and return how many calls that took.

    While the host compiles, the GPU idles and its clocks drop; do_bench sizes its repetitions from the
    first few calls, so a kernel timed right after its compilation was timed on a cold GPU (seen on an
    H100: 90 GB/s for a softmax that runs at 1000)."""
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:  # waiting each time: a queue of slow calls would take minutes
        fn()
        torch.cuda.synchronize()
        calls += 1
    return calls


def bench_ms(fn):
    """Time of fn() in milliseconds: do_bench's median on a GPU; under the interpreter the fastest of three
    wall-clock runs, since on a shared CPU other processes only ever add time (a test run building the
    site beside its test processes once slowed one copy 30-fold)."""
    if ON_GPU:
        warm_up(fn)
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def matmul_tflops():
    """The device's fp16 matrix-multiply rate, sustained, measured now: the ceiling for attention.

    A GPU's clocks follow its power draw and its temperature. In one process on an H100 fresh from
    idling, the first timing of this multiply gave 759 TFLOP/s and the next thirteen, over half a
    minute, 583 to 678; timed once per lesson, this ceiling came out between 641 and 768 in three
    builds of this site in November 2026. So the multiply runs for a second before it is timed, and
    meets the clocks that the benchmarks' kernels, run one after another, meet."""
    n = 8192 if ON_GPU else 256
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.float16 if ON_GPU else torch.float32) for _ in range(2))
    if ON_GPU:
        warm_up(lambda: a @ b, seconds=1.0)
    return 2 * n**3 / bench_ms(lambda: a @ b) * 1e-9


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


# A single timing per provider lets chance decide between close providers. At n = 1024 a product
# takes microseconds, and the host's time to launch it can set the pace: one timing each put grouped
# order anywhere from 0.4x to 3.2x row-major order across five H100 builds of this page, with the
# same tile. So, as in lesson 02, on a GPU every provider is timed ROUNDS times in alternating order
# (first to last, then last to first), keeps its fastest timing, and is timed again (up to
# MAX_TIMINGS times) while its two fastest timings differ by more than AGREE.
ROUNDS = 2 if ON_GPU else 1
AGREE, MAX_TIMINGS = 0.25, 4


def retime_disagreeing(times, timers):
    """times ({key: [ms, ...]}) after passes that time again each timers[key] whose two fastest timings differ
    by more than AGREE, one more timing per pass, until it has MAX_TIMINGS of them."""
    for _ in range(MAX_TIMINGS - ROUNDS if ROUNDS > 1 else 0):
        for key, ms in times.items():
            fastest, second = sorted(ms)[:2]
            if second > (1 + AGREE) * fastest:
                ms.append(timers[key]())
    return times


def fastest_of_rounds(timers):
    """{name: fastest milliseconds} of each timer in timers, each run ROUNDS times in alternating order, and
    again (up to MAX_TIMINGS) while its two fastest timings differ by more than AGREE."""
    times = {name: [] for name in timers}
    for r in range(ROUNDS):
        for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            times[name].append(timers[name]())
    return {name: min(ms) for name, ms in retime_disagreeing(times, timers).items()}


CEILING_NAME = "torch.matmul, 8192 x 8192 fp16" if ON_GPU else "torch.matmul, 256 x 256 fp32 on the CPU"
ORDERS = {"Triton, grouped order": GROUP_M, "Triton, row-major order": 1}


def run_benchmark(sizes):
    """One row per (size, provider) in TFLOP/s, and the tile the autotuner picked at each size."""
    rows, tiles = [], {}
    for n in sizes:
        a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.float16) for _ in range(2))
        # Grouped order's first call autotunes, before any timing; row-major then reuses the same tile.
        matmul(a, b, GROUP_M)
        timers = {name: functools.partial(bench_ms, functools.partial(matmul, a, b, group_m))
                  for name, group_m in ORDERS.items()}
        timers["torch.matmul"] = functools.partial(bench_ms, functools.partial(torch.matmul, a, b))
        for name, ms in fastest_of_rounds(timers).items():
            rows.append(dict(size=n, provider=name, value=2 * n**3 / ms * 1e-9))
        tiles[n] = matmul_kernel.best_config.kwargs
    return rows, tiles


# %%
# What produced the numbers below (the plots come from the same run):

if __name__ == "__main__":
    print(describe_platform())

# %%

if __name__ == "__main__":
    import matplotlib.pyplot as plt

    sizes = [1024, 2048, 4096, 8192] if ON_GPU else [64, 128, 256]
    peak = matmul_tflops()
    print(f"ceiling ({CEILING_NAME}), measured now: {peak:.3g} TFLOP/s")
    rows, tiles = run_benchmark(sizes)
    results = pd.DataFrame(rows)
    table = results.pivot_table(index="size", columns="provider", values="value", sort=False)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in table.columns:
        ax.plot(table.index, table[name], marker="o", label=name)
    ax.axhline(peak, color="black", linestyle="--", label=f"ceiling: {CEILING_NAME}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set(title="fp16 matrix multiply, M = N = K", xlabel="M = N = K", ylabel="TFLOP/s")
    if ON_GPU:
        ax.set_ylim(0, None)
    else:
        ax.set_yscale("log")  # the interpreter runs thousands of times below the CPU's own matmul
    # Below the axes: inside, the legend would hide the ceiling line or the curves near it.
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.tight_layout()
    plt.show()
    shown = table.rename(columns=lambda name: f"{name} (TFLOP/s)")
    shown["tile picked (BM x BN x BK)"] = [f"{t['BLOCK_M']} x {t['BLOCK_N']} x {t['BLOCK_K']}" for t in tiles.values()]
    shown.index.name, shown.columns.name = "M = N = K", None
shown.round(1 if ON_GPU else 5) if __name__ == "__main__" else None  # the interpreter's rates are tiny

# %%
# What the numbers say
# --------------------
# Computed from the table above, in this run:

if __name__ == "__main__":
    grouped, row_major = ORDERS
    vs_torch = table[grouped] / table["torch.matmul"]
    vs_row_major = table[grouped] / table[row_major]
    n = table.index[-1]
    tile = tiles[n]
    print(f"At n = {n}, this kernel runs at {table[grouped][n]:.3g} TFLOP/s: {vs_torch[n]:.2f}x torch.matmul and "
          f"{table[grouped][n] / peak:.1%} of the ceiling.")
    print(f"Against torch.matmul it ranges from {vs_torch.min():.2f}x (n = {vs_torch.idxmin()}) to "
          f"{vs_torch.max():.2f}x (n = {vs_torch.idxmax()}).")
    print(f"Grouped order runs at {vs_row_major.min():.2f}x to {vs_row_major.max():.2f}x the speed of row-major "
          f"order, with the same tile; the largest ratio is at n = {vs_row_major.idxmax()}"
          + (": within 3% at every size, so in this run the order of the tiles made no difference that the "
             "timings resolve." if (vs_row_major - 1).abs().max() < 0.03 else "."))
    print(f"The tile picked at n = {n}, {tile['BLOCK_M']} x {tile['BLOCK_N']}, does "
          f"{tile_intensity(tile['BLOCK_M'], tile['BLOCK_N']):.0f} FLOP per byte it loads.")
    above = table["torch.matmul"][table["torch.matmul"] > peak]
    if len(above):
        print(f"torch.matmul's fastest timing beats the ceiling at n = {', '.join(map(str, above.index))} "
              f"(up to {above.max():.3g} TFLOP/s): the ceiling is timed after a second of multiplies, at the "
              "clocks a GPU holds under sustained load, while a table entry is the fastest of short timings.")
    if not ON_GPU:
        print("These are interpreter timings: they measure NumPy on the CPU, not GPU kernels. The interpreter runs "
              "one program after another and has no L2 to share, so the two orders differ only by noise.")
    save_results("04-tiled-matmul", [{
        "name": "fp16 matmul, M = N = K", "unit": "TFLOP/s", "ceiling_name": CEILING_NAME, "ceiling": peak,
        "ours": list(ORDERS), "peers": ["torch.matmul"], "rows": results.to_dict("records")}])

# %%
# Where this kernel trails ``torch.matmul`` on a GPU, the gap comes from what a library kernel adds
# beyond tiles. On Hopper that includes loading slices with the tensor memory accelerator (TMA) and
# *warp specialization*, some warps loading while others compute; the Hopper lessons later on this
# site use both. What this kernel has that a library call lacks is a place to put more work
# between the last ``tl.dot`` and the store, which is where the exercises start.
#
# Exercises
# ---------
# Each exercise has a check that runs your function on fresh random fp16 inputs at irregular shapes
# and compares it with a float64 reference. It raises ``AssertionError`` saying what is wrong (NaN
# counts as wrong), or prints one line when everything is right. Under the interpreter, tiles like
# this lesson's 64 x 64 x 32 keep each check to seconds.
#
# **(a) A fused epilogue.** Write ``matmul_bias_relu(a, b, bias)`` returning
# :math:`\mathrm{relu}(AB + \mathrm{bias})` in fp16, for ``bias`` of shape ``(N,)``, in one kernel:
# add the bias and apply the ReLU to the fp32 accumulator before the store, instead of writing
# :math:`C` and reading it back in a second kernel. Check it with ``check_bias_relu(matmul_bias_relu)``.
#
# **(b) A batch of products.** Write ``batched_matmul(a, b)`` for ``a`` of shape ``(B, M, K)`` and
# ``b`` of shape ``(B, K, N)``, returning ``(B, M, N)`` in fp16: add a grid axis for the batch and
# move the pointers by the batch strides. ``b`` arrives as a transposed view, and ``a`` as a
# transposed view or as every other matrix of a larger batch, so use every stride.
# Attention's grid has the same shape, with batch x heads on its second axis. Check it with
# ``check_batched_matmul(batched_matmul)``.
#
# **(c) Half of attention.** Write ``matmul_softmax(a, b)`` returning
# :math:`\mathrm{softmax}(AB)` along rows in fp16, for :math:`N \le 128`: one program owns
# ``BLOCK_M`` rows and all :math:`N` columns (``BLOCK_N`` is :math:`N` rounded up to a power of two,
# at least 16), computes the scores with ``tl.dot`` and then the softmax of lesson 02 on them, in
# fp32. Columns past :math:`N` must add nothing to the sum. Check it with
# ``check_matmul_softmax(matmul_softmax)``.

# (M, N, K): no tile divides them, and K = 130 needs a loop over K with any BLOCK_K up to 128.
EXERCISE_SHAPES = [(1, 1, 1), (37, 29, 45), (70, 100, 33), (19, 50, 130)]


def _randn(generator, *shape, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(DEVICE, torch.float16)


def _fresh_generator():
    """Unseeded: every check draws new inputs, so a solution cannot pass by luck on a fixed draw."""
    generator = torch.Generator()
    generator.seed()
    return generator


def _expect(out, expected, what, tolerance=TOLERANCE[torch.float16]):
    """Compare a reader's result with the float64 reference; AssertionError saying what is wrong."""
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(expected.shape) or out.dtype != torch.float16:
        raise AssertionError(f"{what}: expected a float16 tensor of shape {tuple(expected.shape)}, "
                             f"got {out.dtype} of shape {tuple(out.shape)}")
    try:
        torch.testing.assert_close(out.double(), expected, **tolerance)
    except AssertionError as error:
        raise AssertionError(f"{what}: wrong values (NaN counts as wrong)\n{error}") from None


def check_bias_relu(fn):
    """Exercise (a): fn(a, b, bias) must return relu(a @ b + bias) in float16."""
    generator = _fresh_generator()
    for M, N, K in EXERCISE_SHAPES:
        a, b, bias = _randn(generator, M, K), _randn(generator, K, N), _randn(generator, N)
        _expect(fn(a, b, bias), torch.relu(a.double() @ b.double() + bias.double()),
                f"bias + ReLU at M, N, K = {M}, {N}, {K}")
    print("(a) bias + ReLU epilogue: correct on every shape")


def check_batched_matmul(fn):
    """Exercise (b): fn(a, b) must return a @ b for (B, M, K) and (B, K, N) inputs, in float16."""
    generator = _fresh_generator()
    for batch, (M, N, K) in zip((1, 3, 2, 2), EXERCISE_SHAPES):
        b = _randn(generator, batch, N, K).transpose(1, 2)  # strides (N*K, 1, K)
        # a as a transposed view (odd M), or every other matrix of a larger batch (a batch stride of 2MK).
        a = _randn(generator, batch, K, M).transpose(1, 2) if M % 2 else _randn(generator, 2 * batch, M, K)[::2]
        _expect(fn(a, b), a.double() @ b.double(), f"batched matmul at B, M, N, K = {batch}, {M}, {N}, {K}"
                f"{' (a transposed)' if M % 2 else ' (a every other matrix)'}")
    print("(b) batched matmul: correct on every shape")


def check_matmul_softmax(fn):
    """Exercise (c): fn(a, b) must return softmax(a @ b) along rows in float16, for N <= 128."""
    generator = _fresh_generator()
    for M, N, K in EXERCISE_SHAPES:
        # Scores of order 1, so that a padded column wrongly counted in the sum changes the result visibly.
        a, b = _randn(generator, M, K, scale=K**-0.5), _randn(generator, K, N)
        a[0] *= 100  # but row 0's reach about 100: e^100 overflows fp32, so the row maximum must be subtracted
        _expect(fn(a, b), torch.softmax(a.double() @ b.double(), dim=1),
                f"softmax(a @ b) at M, N, K = {M}, {N}, {K}", tolerance=dict(rtol=2e-3, atol=1e-4))
    print("(c) matmul + softmax: correct on every shape")


# %%
# A check's message says where an attempt goes wrong. Here is what it reports for an answer to (a)
# that forgets the bias:

if __name__ == "__main__":
    try:
        check_bias_relu(lambda a, b, bias: torch.relu(a @ b))
    except AssertionError as error:
        print("AssertionError:", "\n".join([line for line in str(error).splitlines() if line][:4]))
