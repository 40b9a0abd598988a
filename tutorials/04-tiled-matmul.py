"""
Tiles and tl.dot
================

A matrix multiplication :math:`C = AB` written as one Triton kernel, in which each
program computes one tile of :math:`C` with ``tl.dot``. The softmax lessons moved bytes;
this one does arithmetic. The attention lessons that follow are built from exactly these
tiles: they compute :math:`QK^T` and :math:`PV` one block of queries against one block
of keys or values at a time. Previous lesson: :doc:`03-long-softmax`; next:
:doc:`05-fused-attention-v1`. The Triton functions used here are documented in
`triton.language <https://triton-lang.org/main/python-api/triton.language.html>`_, the
heart of this lesson at `tl.dot
<https://triton-lang.org/main/python-api/generated/triton.language.dot.html>`_.

You will learn:

* how a program computes a ``BLOCK_M x BLOCK_N`` tile of :math:`C` by walking
  :math:`K` in ``BLOCK_K`` steps, with ``tl.dot`` accumulating in fp32;
* the masks, strides and 64-bit offsets that make one kernel correct for any shape and
  layout;
* the roofline arithmetic: how many FLOPs a tile does per byte it loads, why larger
  tiles do more, and what stops them growing;
* how the order in which programs run changes which slices of :math:`A` and
  :math:`B` they can share in the L2 cache, whether that shows in this GPU's times, and
  why attention faces the same question;
* an interpreter pitfall with bf16 in ``tl.dot``, and the ``UPCAST_DOT`` flag the
  attention lessons use for it.
"""

# %%
# Where the kernels run
# ---------------------
# ``stepkit``, the module beside the lessons, picks the device: a CUDA GPU when there is
# one, otherwise the Triton interpreter on the CPU, switched on before Triton loads.

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

# %%
# Count the FLOPs and the bytes
# -----------------------------
# Multiplying an :math:`M \times K` matrix by a :math:`K \times N` one takes
# :math:`2MNK` floating-point operations (a multiply and an add per term) on
# :math:`MK + KN` input elements. If every element of :math:`A` and :math:`B` were read
# from memory once and :math:`C` written once, a square fp16 product of size :math:`n`
# would do :math:`2n^3` FLOPs on :math:`6n^2` bytes (two bytes per element of three
# matrices), :math:`n/3` FLOPs per byte: far more math than memory traffic. The question
# is how close a kernel can get to reading each element once.
#
# A program keeps one ``BLOCK_M x BLOCK_N`` tile of :math:`C` on chip and, at every step
# of ``BLOCK_K`` along :math:`K`, loads a ``BLOCK_M x BLOCK_K`` slice of :math:`A` and a
# ``BLOCK_K x BLOCK_N`` slice of :math:`B`: :math:`(B_M + B_N) B_K` elements for
# :math:`2 B_M B_N B_K` FLOPs. Its *arithmetic intensity* is therefore
#
# .. math::
#
#    I = \frac{2 B_M B_N}{(B_M + B_N)\, s} \ \text{FLOP per byte},
#
# where :math:`s` is the number of bytes per element: set by the tile alone, whatever
# the size of the matrices. The roofline model calls a kernel compute-bound when its
# intensity passes the *ridge point*, the peak FLOP rate over the memory bandwidth. For
# an H100 SXM, NVIDIA's datasheet gives 989 TFLOP/s of dense fp16 tensor-core math, 3.35
# TB/s of bandwidth to its HBM3 (*high-bandwidth memory*, the GPU's main memory, stacked
# beside the chip), a 50 MB L2 cache and 132 SMs.

H100_DATASHEET = dict(fp16_tflops=989.4, hbm_tbs=3.35, sms=132)  # NVIDIA H100 SXM


def tile_intensity(block_m, block_n, element_size=2):
    """FLOP per byte that a program loads for one BLOCK_M x BLOCK_N tile of C
    (BLOCK_K cancels out)."""
    return 2 * block_m * block_n / ((block_m + block_n) * element_size)


if __name__ == "__main__":
    import pandas as pd

    ridge = H100_DATASHEET["fp16_tflops"] / H100_DATASHEET["hbm_tbs"]
    print(
        f"H100 ridge point from the datasheet: {ridge:.0f} FLOP/byte; an 8192^3 fp16 "
        f"product that read each element once: {8192 / 3:.0f} FLOP/byte"
    )
    tiles = {
        f"{m} x {n}": (tile_intensity(m, n), m * n * 4 / 1024, (m + n) * 64 * 2 / 1024)
        for m, n in [(16, 16), (32, 32), (64, 64), (128, 128), (128, 256), (256, 256)]
    }
    columns = ["intensity, fp16 (FLOP/byte)", "fp32 accumulator (KiB)"]
    columns.append("one stage of A and B slices, BLOCK_K = 64 (KiB)")
    tiles = pd.DataFrame.from_dict(tiles, orient="index", columns=columns)
tiles.rename_axis("tile (BM x BN)").round(1) if __name__ == "__main__" else None

# %%
# Two conclusions. Doubling both sides of a tile doubles its intensity, so tiles should
# be as large as possible. Yet even a 128 x 256 tile sits far below the ridge point: if
# every slice came from HBM, no tile that fits on chip would keep the tensor cores busy.
# Most loads must hit in L2, where another program running at the same time already
# brought them; the section on program order is about exactly that.
#
# What stops a tile from growing is on-chip storage. The accumulator lives in registers:
# an SM has 65,536 32-bit registers (256 KiB) for all the programs it runs (NVIDIA's
# CUDA programming guide). A 128 x 256 fp32 accumulator takes half of them, 128 per
# thread with 8 warps; 256 x 256 would take all of them, leaving none for addresses and
# loaded values, and spill to slow local memory. The slices of :math:`A` and :math:`B`
# wait in shared memory, one set per pipeline *stage*, so that the loads of the next
# steps overlap the math of this one; one program may use up to 227 KiB of the 228 KiB
# of shared memory that an H100 SM has (same guide), which at the sizes in the table
# allows four stages of 128 x 256 with ``BLOCK_K = 64``.
#
# The kernel
# ----------
# One program owns one tile of :math:`C` (dark, right) and reads the row slab of
# :math:`A` and the column slab of :math:`B` that meet there, one ``BLOCK_K`` slice of
# each per step of its loop along :math:`K`: the steps already summed into its
# accumulator are shaded medium, the one in progress dark.

if __name__ == "__main__":
    kit.draw_matmul_tiles()

# %%
# Program ``pid`` first works out which tile of :math:`C` it owns (``tile_of_program``;
# its order is the subject of a later section), then walks :math:`K`:
#
# * ``tl.dot(a, b, acc)`` multiplies the two slices on the tensor cores and adds the
#   product to ``acc``, an fp32 tile: a 16-bit running sum would round at every step and
#   lose digits over a long :math:`K`. The tile is converted to the output dtype once,
#   when stored.
# * Masks make any :math:`M, N, K` work. Rows past :math:`M` and columns past :math:`N`
#   are computed on zeros and never stored. Along :math:`K`, *both* loads are masked to
#   zero: past the end, memory may hold anything, NaN included, and
#   :math:`0 \times \mathrm{NaN}` is NaN.
# * Every stride is an argument, so transposed and sliced views work without a copy, and
#   Triton specializes an integer argument equal to 1 at compile time, so the contiguous
#   dimension still gets wide, vectorized loads.
# * Offsets (index times stride) are computed in int64: they pass :math:`2^{31}` in any
#   matrix of more than :math:`2^{31}` elements (4 GiB of fp16) or a strided view of a
#   large buffer, and int32 arithmetic would wrap around to wrong addresses without an
#   error. The indices themselves stay int32, which is safe because the launcher keeps
#   :math:`M, N, K` below :math:`2^{30}`, so an index plus one block cannot reach
#   :math:`2^{31}`.
#
# One more pitfall, this time in the interpreter: in Triton 3.9 the interpreter stores
# bf16 values as 16-bit integers and multiplies them as integers inside ``tl.dot``,
# giving nonsense. The kernel takes an ``UPCAST_DOT`` flag that converts both slices to
# fp32 first, as the attention kernels do; the launcher sets it only for bf16 under the
# interpreter, so the GPU path is untouched.
#
# The tile sizes are tuned, not guessed: ``triton.autotune`` times each configuration
# below once per shape and keeps the fastest. On a GPU they are three of the
# configurations that Triton's own matrix-multiplication tutorial lists for NVIDIA GPUs,
# few enough to keep compile time short. Under the interpreter a single 64 x 64 x 32
# tile keeps the run short (``tl.dot`` needs every side to be at least 16).


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
GPU_TILES = [(128, 256, 64, 3, 8), (128, 128, 32, 4, 4), (64, 128, 32, 4, 4)]
CONFIGS = [
    triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k), num_stages=s, num_warps=w)
    for m, n, k, s, w in (GPU_TILES if kit.ON_GPU else [(64, 64, 32, 3, 4)])
]


@triton.jit
def tile_of_program(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row, column) of the tile of C that program pid computes: GROUP_M rows of
    tiles at a time, column by column. GROUP_M = 1 is plain row-major order."""
    programs_per_group = GROUP_M * tiles_n
    first_m = (pid // programs_per_group) * GROUP_M
    # the last group may be shorter
    group_height = tl.minimum(tiles_m - first_m, GROUP_M)
    in_group = pid % programs_per_group
    return first_m + in_group % group_height, in_group // group_height


@triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """C = A @ B, one BLOCK_M x BLOCK_N tile of C per program, summed in fp32 over
    K in steps of BLOCK_K; UPCAST_DOT multiplies in fp32 (the interpreter's bf16)."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_of_program(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    # The loop-invariant part of the addresses, in int64.
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        a_mask = row_ok[:, None] & (k[None, :] < K)
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=a_mask, other=0.0)
        b_mask = (k[:, None] < K) & col_ok[None, :]
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=b_mask, other=0.0)
        if UPCAST_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    c_ptrs = (
        c_ptr
        + rows.to(tl.int64)[:, None] * stride_cm
        + cols.to(tl.int64)[None, :] * stride_cn
    )
    c_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# %%
# The launcher
# ------------
# A kernel handed a bad pointer does not raise: it computes nonsense or crashes the
# process. So the launcher checks everything first, and resolves negative views with
# ``resolve_neg()`` (a kernel reads memory, not the view's flag: lesson 02's launch
# helpers explain it). The conjugate bit exists only on complex tensors, which the
# dtype check refuses.

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
TOLERANCE = {
    torch.float16: dict(rtol=2e-3, atol=1e-2),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}
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
        kit.check_device(name, t)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype}, {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device}, {b.device}")
    (M, K), (K_b, N) = a.shape, b.shape
    shapes = f"a is {M} x {K} and b {K_b} x {N}"
    if K != K_b:
        raise ValueError(f"{shapes}: the columns of a must match the rows of b")
    if min(M, N, K) == 0:
        raise ValueError(f"{shapes}: matmul needs non-empty matrices")
    if max(M, N, K) >= MAX_DIM:
        raise ValueError(
            f"{shapes}: every dimension must be below 2**30 (int32 indices)"
        )
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        # A Triton kernel's output carries no graph: a loss built on it would
        # silently never reach a or b.
        raise TypeError(
            "this matmul is forward-only (it has no backward): pass tensors that "
            "do not require grad (a.detach()), or call it under torch.no_grad()"
        )


def matmul(a, b, group_m=GROUP_M):
    """a @ b for 2-D float16 or bfloat16 matrices with any strides, as a new
    contiguous matrix of their dtype."""
    check_operands(a, b)
    is_int = isinstance(group_m, int) and not isinstance(group_m, bool)
    if not (is_int and 1 <= group_m < MAX_DIM):
        raise ValueError(f"group_m must be a positive int below 2**30, got {group_m!r}")
    a, b = a.resolve_neg(), b.resolve_neg()
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    strides = (*a.stride(), *b.stride(), *c.stride())
    upcast = not kit.ON_GPU and a.dtype == torch.bfloat16
    matmul_kernel[grid](a, b, c, M, N, K, *strides, GROUP_M=group_m, UPCAST_DOT=upcast)
    return c


# %%
# Is it correct?
# --------------
# Against float64 on a shape that no tile divides, in both dtypes, then with :math:`B`
# given as a transposed view, the layout in which attention reads :math:`K^T`.
# ``torch.testing.assert_close`` fails on NaN, where a bare maximum of the error would
# not (``max`` of a tensor holding NaN is NaN, and ``NaN < tolerance`` is merely False,
# easy to test the wrong way round).

if __name__ == "__main__":
    torch.manual_seed(0)
    M, N, K = 333, 277, 131
    for dtype in SUPPORTED_DTYPES:
        a = torch.randn(M, K, device=DEVICE, dtype=dtype)
        b = torch.randn(K, N, device=DEVICE, dtype=dtype)
        b_t = torch.randn(N, K, device=DEVICE, dtype=dtype).t()
        for layout, b in (("b contiguous", b), ("b transposed (a view)", b_t)):
            reference, c = a.double() @ b.double(), matmul(a, b).double()
            torch.testing.assert_close(c, reference, **TOLERANCE[dtype])
            error = (c - reference).abs().max() / reference.abs().max()
            print(
                f"{M} x {N} x {K}, {str(dtype)[6:]}, {layout}: matches float64, "
                f"max error {error:.1e} of the largest value"
            )

# %%
# Which tiles run together
# ------------------------
# Programs do not all run at once. A 128 x 256 program fills an H100's SM (its
# accumulator and pipeline stages above), so 132 run together while an 8192 x 8192
# :math:`C` has 2,048 such tiles. The programs running together step through :math:`K`
# at about the same pace, and a slice that one of them brought into L2 is there for the
# others: what they can share depends only on *which* tiles they are, that is, on how
# program ids map to tiles. The GPU starts programs roughly in the order of their ids.
#
# *Row-major* order gives out a whole row of tiles before the next: the programs in
# flight share a few slices of :math:`A` but need every slice of :math:`B`. *Grouped*
# order walks ``GROUP_M`` rows of tiles column by column, a squarer patch that needs
# fewer distinct slices for as many tiles. The small kernel below runs
# ``tile_of_program`` for every program id and writes down which program computes each
# tile. The heat maps draw it for a grid of 8 x 8 tiles (dark: early), the first 16
# programs outlined, in row-major order and in groups of four rows.


@triton.jit
def program_order_kernel(
    order_ptr, tiles_m, tiles_n, GROUP_M: tl.constexpr, BLOCK: tl.constexpr
):
    # BLOCK program ids at once: it is only arithmetic
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = pid < tiles_m * tiles_n
    tile_m, tile_n = tile_of_program(tl.where(valid, pid, 0), tiles_m, tiles_n, GROUP_M)
    tl.store(order_ptr + tile_m * tiles_n + tile_n, pid, mask=valid)


def program_order(tiles_m, tiles_n, group_m):
    """order[i, j] = the id of the program that computes tile (i, j) of C."""
    order = torch.full((tiles_m, tiles_n), -1, dtype=torch.int32, device=DEVICE)
    grid = (triton.cdiv(tiles_m * tiles_n, 1024),)
    program_order_kernel[grid](order, tiles_m, tiles_n, GROUP_M=group_m, BLOCK=1024)
    return order.cpu()


COUNTED_N = 8192  # the product whose slices in flight the cell below counts


def slices_in_flight(order, programs):
    """How many tile rows (slices of A) and tile columns (slices of B) programs
    0 .. programs-1 need."""
    running = order < programs
    return int(running.any(dim=1).sum()), int(running.any(dim=0).sum())


if __name__ == "__main__":
    orders = {f"GROUP_M = {g}": program_order(8, 8, g) for g in (1, 4)}
    kit.draw_program_orders(orders, in_flight=16)
    BM, BN, BK, n, sms = 128, 256, 64, COUNTED_N, H100_DATASHEET["sms"]
    flops = sms * 2 * BM * BN * BK
    for group_m in (1, GROUP_M):
        order = program_order(n // BM, n // BN, group_m)
        tile_rows, tile_cols = slices_in_flight(order, sms)
        loaded = (tile_rows * BM + tile_cols * BN) * BK * 2
        print(
            f"n = {n}, {BM} x {BN} tiles, GROUP_M = {group_m}: the first {sms} "
            f"programs need {tile_rows} slices of A and {tile_cols} of B, "
            f"{loaded / 1024:.0f} KiB per K step: {flops / loaded:.0f} FLOP per byte"
        )

# %%
# The last two lines count the distinct bytes that the first 132 programs need per
# :math:`K` step, as if each slice came from HBM once and reached the others through L2:
# in that idealized picture grouped order loads markedly fewer bytes for the same FLOPs.
# In that picture both orders already pass the ridge point (compare the H100's, computed
# above), so neither would wait on memory; grouped order only leaves more margin for
# what the picture ignores: real programs drift apart in time, slices can leave L2
# before their last reader comes, and L2 has a bandwidth of its own. Whether the
# difference shows in the run time is for the benchmark to say: the lines under its
# table read it size by size, and at this n = 8192 in particular.
#
# Attention faces the same question. Each of its programs owns a block of queries and
# reads *all* of :math:`K` and :math:`V` for its (batch, head), so the programs of one
# head should run together. The next lessons launch a grid of (query blocks, batch x
# heads) with the query block on axis 0, which varies fastest: the programs of one head
# are adjacent in launch order, so :math:`K` and :math:`V` can come from HBM about once
# per head and from L2 for its other query blocks.
#
# Benchmark
# ---------
# TFLOP/s (:math:`2n^3` over the time) for square fp16 products, this kernel in both
# orders and ``torch.matmul`` (cuBLAS on a GPU). The ceiling is ``torch.matmul``'s rate
# on an 8192 x 8192 fp16 product (256 x 256 fp32 on a CPU), measured in this run by the
# helper the attention lessons use.
#
# How we time: every lesson times its calls the same way, by GPU time (each call
# replayed from a CUDA graph after the L2 cache is flushed) and back to back (calls
# enqueued in a row, as a training loop makes them), in passes that time a case again
# where its timings spread; the :doc:`../performance` page defines it in its section
# "How we time". The tables and conclusions below read GPU time, and say where back to
# back differs. Under the interpreter the times measure NumPy on the CPU: they only
# illustrate.

ORDERS = {"Triton, grouped order": GROUP_M, "Triton, row-major order": 1}
PEER = "cuBLAS (torch.matmul)" if kit.ON_GPU else "torch.matmul"


def run_benchmark(sizes):
    """Rows of TFLOP/s per size and provider; the tile picked at each size."""
    tiles = {}

    def each_size():
        for n in sizes:
            a = torch.randn(n, n, device=DEVICE, dtype=torch.float16)
            b = torch.randn_like(a)
            matmul(a, b)  # the first call at a size autotunes, before any timing
            tiles[n] = matmul_kernel.best_config.kwargs
            timers = {o: kit.call_timer(matmul, a, b, g) for o, g in ORDERS.items()}
            timers[PEER] = kit.call_timer(torch.matmul, a, b)
            yield n, f"n = {n}", timers

    measured = kit.measure(each_size).items()
    rows = [
        dict(size=n, provider=p, **m.row(2 * n**3 * 1e-9)) for (n, p), m in measured
    ]
    return rows, tiles


# %%
# What produced the numbers below (the plot comes from the same run):

if __name__ == "__main__":
    print(kit.describe_platform())

# %%


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    sizes = [1024, 2048, 4096, 8192] if kit.ON_GPU else [64, 128, 256]
    peak = kit.matmul_tflops()
    print(kit.ceiling_line(peak))
    rows, tiles = run_benchmark(sizes)
    results = pd.DataFrame(rows)
    # GPU time first; under the interpreter there is only the wall clock.
    rate = "gpu_value" if "gpu_value" in results else "value"
    table = results.pivot_table(index="size", columns="provider", values=rate)
    table.index.name = "M = N = K"
    timed = "GPU time" if kit.ON_GPU else "interpreter, illustrative"
    ceiling, title = f"ceiling: {kit.MATMUL_CEILING}", "fp16 matrix multiply"
    # Under the interpreter, a log scale: it runs far below the CPU's own matmul.
    log_y = not kit.ON_GPU
    kit.plot_rates(table, peak, ceiling, f"TFLOP/s ({timed})", title, ORDERS, log_y)
    plt.show()
    shown = kit.rates_table(results, "size", "TFLOP/s")
    shown["tile picked (BM x BN x BK)"] = [
        "{BLOCK_M} x {BLOCK_N} x {BLOCK_K}".format(**tile) for tile in tiles.values()
    ]
shown.rename_axis("M = N = K") if __name__ == "__main__" else None

# %%
# What the numbers say
# --------------------
# Computed from the table above, in this run. The two orders run the same kernel, so
# gaps within 3%, or within either order's spread of timings at that size, count as
# level (the spread: how far a case's two fastest timings differ).

ORDERS_LEVEL = 0.03  # gaps this small between two runs of one kernel are not told apart


def order_effect(ratio, spread, analysed):
    """Sentences on ratio (grouped order's rate over row-major's, by n): faster,
    slower or level at each n, level within ORDERS_LEVEL or spread (by n); then what
    happened at n = analysed, where the count of slices predicted grouped to help."""
    margin = spread.clip(lower=ORDERS_LEVEL)
    said = {n: "faster" if r > 1 + margin[n] else "slower" if r < 1 - margin[n]
            else "level" for n, r in ratio.items()}  # fmt: skip
    noisy = {n: f", within a {margin[n]:.0%} spread" for n in ratio.index
             if said[n] == "level" and margin[n] > ORDERS_LEVEL}  # fmt: skip
    each = ", ".join(f"{r:.2f}x at n = {n} ({said[n]}{noisy.get(n, '')})"
                     for n, r in ratio.items())  # fmt: skip
    line = f"Grouped order against row-major order, same tile: {each}."
    if analysed not in ratio:
        return line
    r = ratio[analysed]
    ending = {
        "faster": f"ran {r - 1:.0%} faster, in line with its fewer bytes per K step in "
        "the count.",
        "level": "ran level with row-major: its fewer bytes per K step did not show in "
        "this GPU's time" + (" beyond its timings' spread (a steadier run could show "
        "them)." if analysed in noisy else "."),
        "slower": f"ran {1 - r:.0%} slower, although it loads fewer bytes per K step "
        "in the count: what the count leaves out outweighed them in this run, and this "
        "page does not measure which part.",
    }[said[analysed]]
    return f"{line} At n = {analysed}, the size counted above, grouped order {ending}"


if __name__ == "__main__":
    grouped, row_major = ORDERS
    n, tile = table.index[-1], tiles[table.index[-1]]
    vs_peer, vs_rows = table[grouped] / table[PEER], table[grouped] / table[row_major]
    if kit.ON_GPU:  # the interpreter's orders differ only by noise (see below)
        spread = results.pivot_table(values="gpu_spread", index="size",
                                     columns="provider")[list(ORDERS)]  # fmt: skip
        orders = order_effect(vs_rows, spread.max(axis=1), COUNTED_N)
    else:
        each = ", ".join(f"{r:.2f}x at n = {n}" for n, r in vs_rows.items())
        orders = f"Grouped order against row-major order, same tile: {each}."
    print(
        f"At n = {n}, this kernel runs at {table[grouped][n]:.3g} TFLOP/s: "
        f"{vs_peer[n]:.2f}x {PEER} and {table[grouped][n] / peak:.1%} of the ceiling. "
        f"Against {PEER} it ranges from {vs_peer.min():.2f}x (n = {vs_peer.idxmin()}) "
        f"to {vs_peer.max():.2f}x (n = {vs_peer.idxmax()}).\n"
        + orders
        + f"\nThe tile picked at n = {n}, {tile['BLOCK_M']} x {tile['BLOCK_N']}, "
        f"does {tile_intensity(tile['BLOCK_M'], tile['BLOCK_N']):.0f} FLOP per byte "
        "it loads."
    )
    for row in kit.back_to_back_gaps(results).itertuples():
        print(kit.back_to_back_line(row.provider, f"n = {row.size}", row.b2b_ratio))
    if kit.ON_GPU:  # programs of the picked tile against SMs: how many waves
        gpu_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        for n, t in tiles.items():
            count = triton.cdiv(n, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"])
            tile = f"{t['BLOCK_M']} x {t['BLOCK_N']}"
            print(f"n = {n}: {count} programs of {tile} for {gpu_sms} SMs")
    above = table[PEER][table[PEER] > peak]
    if len(above):
        print(
            f"{PEER} beats the ceiling at n = {', '.join(map(str, above.index))} "
            f"(up to {above.max():.3g} TFLOP/s): the ceiling is timed after a second "
            "of multiplies, at the clocks a GPU holds under sustained load."
        )
    if not kit.ON_GPU:
        print(
            "These are interpreter timings: they measure NumPy on the CPU, not GPU "
            "kernels. The interpreter runs one program after another and has no L2 to "
            "share, so the two orders differ only by noise."
        )
    benchmark = dict(name="fp16 matmul, M = N = K", unit="TFLOP/s", ceiling=peak)
    benchmark.update(ceiling_name=kit.MATMUL_CEILING, ours=list(ORDERS), peers=[PEER])
    kit.save_results("04-tiled-matmul", [dict(benchmark, rows=rows)])

# %%
# Where this kernel trails ``torch.matmul`` at the smallest size, count its programs
# first: on a GPU the last lines above divide the programs that the picked tile makes
# by the SMs. Programs start in *waves* of what the SMs hold at once; where there are
# fewer programs than SMs, or barely more than a whole number of them, SMs sit idle
# for all or part of the run however fast each program is (an SM runs several programs
# at once where their registers and shared memory fit, but it cannot run programs the
# grid does not have). A library can pick a smaller tile there, or split :math:`K`
# among programs, to make more of them; this kernel's autotuner only chooses among its
# three tiles. At the larger sizes the programs fill many waves, and what is left is
# how each program runs, which the Hopper lessons take apart. What this kernel has that
# a library call lacks is a place to put more work between the last ``tl.dot`` and the
# store, which is where the exercises start.
#
# Exercises
# ---------
# Each exercise has a check that runs your function on fresh random fp16 inputs at
# irregular shapes and compares it with a float64 reference, element by element. It
# raises ``AssertionError`` naming the case, the first wrong element and how far off it
# is (NaN counts as wrong), or prints one line when everything is right. Under the
# interpreter, tiles like this lesson's 64 x 64 x 32 keep each check to seconds.
#
# Write each attempt in a new cell at the end of this lesson's notebook (linked at the
# end of the page), below the checks, and call its check as the exercise shows; or in a
# file next to the lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L04 = kit.load_lesson("04-tiled-matmul")
#    # ... your kernel, and matmul_bias_relu(a, b, bias) that launches it ...
#    L04.check_bias_relu(matmul_bias_relu)
#
# **(a) A fused epilogue.** Write ``matmul_bias_relu(a, b, bias)`` returning
# :math:`\mathrm{relu}(AB + \mathrm{bias})` in fp16, for ``bias`` of shape ``(N,)``, in
# one kernel: add the bias and apply the ReLU to the fp32 accumulator before the store,
# instead of writing :math:`C` and reading it back in a second kernel. Check it with
# ``check_bias_relu(matmul_bias_relu)``. On a GPU the check then times it at one size
# against this lesson's ``matmul`` alone and against the same ``matmul`` followed by a
# separate bias and ReLU in PyTorch, and prints the ratios: a target to read, not a test
# to pass. The epilogue works on the accumulator while it is still in registers, so a
# fused kernel should run about as fast as the bare ``matmul`` (hint: start from this
# lesson's kernel and its tuned tiles).
#
# **(b) A batch of products.** Write ``batched_matmul(a, b)`` for ``a`` of shape
# ``(B, M, K)`` and ``b`` of shape ``(B, K, N)``, returning ``(B, M, N)`` in fp16: add a
# grid axis for the batch and move the pointers by the batch strides. ``b`` arrives as a
# transposed view, and ``a`` as a transposed view or as every other matrix of a larger
# batch, so use every stride. Attention's grid has the same shape, with batch x heads on
# its second axis. Check it with ``check_batched_matmul(batched_matmul)``.
#
# **(c) Half of attention.** Write ``matmul_softmax(a, b)`` returning
# :math:`\mathrm{softmax}(AB)` along rows in fp16, for :math:`N \le 128`: one program
# owns ``BLOCK_M`` rows and all :math:`N` columns (``BLOCK_N`` is :math:`N` rounded up
# to a power of two, at least 16), computes the scores with ``tl.dot`` and then the
# softmax of lesson 02 on them, in fp32. Columns past :math:`N` must add nothing to the
# sum. Check it with ``check_matmul_softmax(matmul_softmax)``.

# (M, N, K): no tile divides them, and K = 130 needs a loop over K with any BLOCK_K up
# to 128.
EXERCISE_SHAPES = [(1, 1, 1), (37, 29, 45), (70, 100, 33), (19, 50, 130)]


def _randn(generator, *shape, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(DEVICE, torch.float16)


def _expect(exercise, case, got, want, rtol=2e-3, atol=1e-2):
    kit.expect_close(exercise, case, "the result", got, want, torch.float16, rtol, atol)


def check_bias_relu(fn):
    """Exercise (a): fn(a, b, bias) must return relu(a @ b + bias) in float16;
    then prints its speed (bias_relu_speed)."""
    generator = kit.fresh_generator()
    for M, N, K in EXERCISE_SHAPES:
        a, b = _randn(generator, M, K), _randn(generator, K, N)
        bias = _randn(generator, N)
        expected = torch.relu(a.double() @ b.double() + bias.double())
        _expect("(a) bias + ReLU", f"M, N, K = {M}, {N}, {K}", fn(a, b, bias), expected)
    print("(a) bias + ReLU epilogue: correct on every shape")
    print(bias_relu_speed(fn))


def _unfused_bias_relu(a, b, bias):
    """This lesson's matmul, then the bias and the ReLU as two more kernels: C goes
    through memory five times (a store, then a load and a store per kernel added)
    where a fused kernel stores it once."""
    return torch.relu_(matmul(a, b) + bias)


# K is short next to M and N, so that C's traffic, which the fused epilogue saves, is a
# visible share of the time.
def bias_relu_speed(fn, M=4096, N=4096, K=1024):
    """A line on fn(a, b, bias)'s GPU time on fresh fp16 inputs of M x K and K x N,
    against this lesson's matmul alone and followed by a separate bias and ReLU: a
    target reported, not enforced."""
    if not kit.ON_GPU:
        return "(a) speed is measured only on a GPU."
    generator = kit.fresh_generator()
    a, b, bias = _randn(generator, M, K), _randn(generator, K, N), _randn(generator, N)
    matmul(a, b)  # autotunes at this size, before any timing
    timers = {
        "fused": kit.call_timer(fn, a, b, bias),
        "matmul": kit.call_timer(matmul, a, b),
        "unfused": kit.call_timer(_unfused_bias_relu, a, b, bias),
    }
    ms = {key: min(m.gpu) for key, m in kit.time_calls(timers).items()}
    tflops = 2 * M * N * K * 1e-9 / ms["fused"]
    return (
        f"(a) at M, N, K = {M}, {N}, {K}, by GPU time (not enforced): {tflops:.0f} "
        f"TFLOP/s, {ms['matmul'] / ms['fused']:.0%} of the speed of this lesson's "
        "matmul alone (the target: about 100%) and "
        f"{ms['unfused'] / ms['fused']:.2f}x the matmul followed by a separate bias "
        "and ReLU."
    )


def check_batched_matmul(fn):
    """Exercise (b): fn(a, b) must return a @ b in float16, batched."""
    generator = kit.fresh_generator()
    for batch, (M, N, K) in zip((1, 3, 2, 2), EXERCISE_SHAPES):
        b = _randn(generator, batch, N, K).transpose(1, 2)  # strides (N*K, 1, K)
        # a as a transposed view (odd M), or every other matrix of a larger batch
        # (a batch stride of 2MK).
        if M % 2:
            a, layout = _randn(generator, batch, K, M).transpose(1, 2), "a transposed"
        else:
            a, layout = _randn(generator, 2 * batch, M, K)[::2], "a every other matrix"
        case = f"B, M, N, K = {batch}, {M}, {N}, {K} ({layout})"
        _expect("(b) batched matmul", case, fn(a, b), a.double() @ b.double())
    print("(b) batched matmul: correct on every shape")


def check_matmul_softmax(fn):
    """Exercise (c): fn(a, b) must return softmax(a @ b) by rows in float16."""
    generator = kit.fresh_generator()
    for M, N, K in EXERCISE_SHAPES:
        # Scores of order 1, so that a padded column wrongly counted in the sum
        # changes the result visibly...
        a, b = _randn(generator, M, K, scale=K**-0.5), _randn(generator, K, N)
        # ...but row 0's reach about 100: e^100 overflows fp32, so the row maximum
        # must be subtracted.
        a[0] *= 100
        case = f"M, N, K = {M}, {N}, {K}"
        expected = torch.softmax(a.double() @ b.double(), dim=1)
        _expect("(c) softmax(a @ b)", case, fn(a, b), expected, atol=1e-4)
    print("(c) matmul + softmax: correct on every shape")


# %%
# A check's message says where an attempt goes wrong. Here is what it reports for an
# answer to (a) that forgets the bias:

if __name__ == "__main__":
    try:
        check_bias_relu(lambda a, b, bias: torch.relu(a @ b))
    except AssertionError as error:
        lines = [line for line in str(error).splitlines() if line]
        print("AssertionError:", "\n".join(lines[:4]))
