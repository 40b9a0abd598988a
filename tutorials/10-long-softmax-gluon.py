"""
Hopper: long softmax rows in shared memory, in Gluon
====================================================

Lesson 03's split-row softmax reads each element of a long row once, yet in bf16 it can
stay further from the copy bandwidth than in fp32 (its section "Registers and bytes in
flight, by dtype"): each program holds its chunk in registers, as fp32, until the row's
statistics arrive, so fewer programs fit on an SM. This lesson keeps the chunk in
shared memory instead, as the 16-bit values read, which Gluon allows and Triton not.

Previous lesson: :doc:`09-gluon-primer`, which shows each Gluon piece alone;
next: :doc:`11-hopper-forward-gluon`. This one builds on :doc:`03-long-softmax`, its
split-row kernel and the online softmax of Milakov and Gimelshein (`arXiv:1805.02867
<https://arxiv.org/abs/1805.02867>`_). Gluon is introduced by Triton's own `Gluon
tutorials <https://github.com/triton-lang/triton/tree/main/python/tutorials/gluon>`_.

You will learn:

* where a waiting program can keep data, registers or shared memory, in bytes per SM;
* how to copy global memory into shared memory without passing through registers
  (``cp.async``) in Gluon, and when the compiler refuses to;
* how to keep the copies in flight while the program computes: the maximum and the sum
  in one pass, each piece used as it lands, the next row's copy started as this leaves;
* a pitfall: read the same shared memory twice and the compiler may keep the first
  read's values in registers; a barrier between the reads stops it;
* how many programs fit on an SM at once (registers, threads, shared memory, 1 KiB
  reserved per program), and why waiting programs must not count one too many;
* what the bytes of the row held per SM say about the speed, measured over chunk sizes.

This lesson needs ``03-long-softmax.py`` and ``02-fused-softmax.py`` next to it (the
site's zip of all lessons has them) for their launch code and backward pass. Gluon
kernels run only compiled, never under the Triton interpreter, and this one was written
for Hopper (H100): elsewhere its ``long_softmax`` runs lesson 03's, and this page shows
the design and says why the kernel did not run.
"""

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

LONG = kit.load_lesson("03-long-softmax")  # which loads 02-fused-softmax in turn

# %%
# Where a waiting program keeps its chunk
# ---------------------------------------
# A split-row program reads its chunk, computes the chunk's maximum and sum, publishes
# them and waits for the other chunks of the row (lesson 03 explains the waiting and its
# memory ordering). Only then can it normalize, so the chunk must stay on the SM through
# the wait, in one of an H100 SM's two places:
#
# * **Registers**: 64K 32-bit registers, 256 KiB. Lesson 03's kernel converts each
#   element to fp32 as it loads it and the compiler keeps those values until the
#   normalization, so a bf16 chunk takes twice its bytes: fewer programs per SM in bf16
#   than in fp32, and fewer bytes of the row held per SM (lesson 03's section
#   "Registers and bytes in flight, by dtype" prints them).
# * **Shared memory**: 228 KiB, which holds the 16-bit values as they were read. Triton
#   decides on its own what goes there; Gluon lets a program allocate it and copy in.
#
# The kernel below copies its chunk from global memory straight into shared memory with
# ``cp.async``, Ampere's asynchronous copy, which needs no destination registers while
# in flight, as a plain load does. It reads the chunk back a *piece* at a time (2,048
# elements, 16 per thread of its 4 warps), twice: for the maximum and the sum, and,
# after the wait, to normalize and write the output. Through the wait the chunk sits in
# shared memory; the registers hold a piece's fp32 values and the bookkeeping. As soon
# as a piece has been read for the output, its space takes the program's next row's
# copy. The picture, a diagram and not a measurement, shows one program's path among
# the :math:`S` programs of a row.


def draw_data_path():
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, ax = plt.subplots(figsize=(8, 3.4))
    boxes = [  # x, y, width, height, colour, label
        (0.0, 0.5, 2.2, 2.0, "#d9d9d9",
         "global memory\nrow r, in S chunks:\none per program"),
        (3.2, 1.6, 2.2, 1.0, "#9ecae1",
         "shared memory\nthis program's chunk,\nin the input's dtype"),
        (3.2, 0.0, 2.2, 1.0, "#fdd0a2", "registers\none piece at a time,\nin fp32"),
        (6.8, 1.6, 1.9, 1.0, "#c7e9c0",
         "every chunk's\n(max, sum), and the\nrow's arrival count"),
        (6.8, 0.0, 1.9, 1.0, "#d9d9d9", "output row r\n(global memory)"),
    ]  # fmt: skip
    for x, y, w, h, color, label in boxes:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black"))
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=10)
    arrows = [  # from, to, style, label, where, alignment
        ((2.2, 2.1), (3.2, 2.1), "-|>",
         "1. cp.async\n(next row's:\nin step 4)", (2.7, 2.25), "center"),
        ((4.3, 1.6), (4.3, 1.0), "-|>",
         "read back for\n2. max and sum,\n4. normalize", (4.2, 1.3), "right"),
        ((5.4, 0.8), (6.8, 1.8), "<|-|>",
         "3. publish,\nwait, read all", (5.5, 1.75), "left"),
        ((5.4, 0.3), (6.8, 0.3), "-|>", "4. write", (6.1, 0.45), "center"),
    ]  # fmt: skip
    for start, end, style, label, (tx, ty), align in arrows:
        arrow = FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=14)
        ax.add_patch(arrow)
        va = "center" if align == "right" else "bottom"
        ax.text(tx, ty, label, fontsize=10, ha=align, va=va)
    others = "the row's other S - 1 programs\ndo the same with their chunks"
    ax.text(7.75, 2.75, others, ha="center", va="bottom", fontsize=10, style="italic")
    ax.set(xlim=(-0.1, 8.8), ylim=(-0.2, 3.3), aspect="equal")
    ax.axis("off")
    ax.set_title("A split-row program: the chunk waits in shared memory, not registers")
    fig.tight_layout()
    plt.show()


if __name__ == "__main__":
    draw_data_path()

# %%
# The kernel
# ----------
# The row's programs and their waiting are lesson 03's ``split_row_kernel``; what
# changes is where the chunk lives, and how the program keeps its copies in flight.
# Gluon states what Triton decides alone: a *layout* says which thread holds which
# element of a tensor (``BlockedLayout``: each thread a block of adjacent elements;
# ``SliceLayout``: the same with one dimension dropped, for a value per row), or, in
# shared memory, how the elements sit in its 32 banks of 4 bytes (threads that read one
# bank at once take turns: a bank conflict).
#
# * ``gl.allocate_shared_memory`` gives the program a buffer of ``CHUNK`` elements in
#   the input's dtype, seen as rows of ``VEC`` elements (16 bytes). Call them
#   *thread-rows*: each thread owns whole ones, 2 per piece in bf16 and 4 in fp32 (a
#   piece of 2,048 elements over 128 threads). A plain shared layout
#   (``SwizzledSharedLayout(1, 1, 1, [1, 0])``) is enough: each thread reads back, in
#   the same register layout, the elements it copied, so no two threads collide on a
#   bank more than a plain copy does.
# * The copy is ``async_load`` from ``gluon.language.nvidia.ampere.async_copy`` (Triton
#   3.6 names it ``async_copy_global_to_shared``; later releases call it ``async_load``
#   and make the old name raise). Each thread issues 16-byte copies, and
#   ``commit_group`` closes each piece's copies into a group of their own.
# * **Each piece as it lands.** ``wait_group(n)`` waits until at most ``n`` of this
#   thread's groups are still in flight, so ``wait_group(PIECES - 1 - p)`` waits for
#   piece ``p`` and not the later ones: the program works on the first pieces while the
#   last are on their way. No thread reads another's copies, but the compiler does not
#   know that: after each wait, and between each piece's read and the copy that
#   overwrites it, it puts a barrier of all the program's threads (``bar.sync``), so
#   each piece waits for its slowest thread.
# * **One pass before the wait.** The maximum and the sum come from one read of each
#   piece: every thread keeps a running maximum and a sum rescaled to it for each of its
#   thread-rows (lesson 03's online softmax), merged at the end. That costs one
#   exponential per thread-row per piece (one per 8 bf16 or 4 fp32 elements) on top of
#   one per element, and saves a whole read of the chunk.
# * **The next row's copy starts as this one leaves.** As soon as the output pass has
#   read a piece, its space takes the next row's copy of the same piece: while the
#   program normalizes and writes, its next chunk is coming in (only the first starts
#   cold).
# * ``cp.async`` moves 4, 8 or 16 bytes, and the compiler must prove each one aligned.
#   Triton compiles a variant of the kernel for each set of such facts it sees in a
#   call, and knows that an integer argument is a multiple of 16 only in the variant
#   for calls where it was one. For 16-bit data whose row length or row stride is not a
#   multiple of 16, it can prove nothing wider than one 2-byte element, below the
#   copy's 4 bytes, and refuses to compile the copy. The launcher then picks
#   ``ASYNC=False`` (for every dtype: one rule), which copies through registers.
# * **A pitfall: values kept from the first read.** The two passes read the same shared
#   memory, and a compiler that sees nothing written in between may load each piece
#   once and keep every value for the second pass: exactly the registers this lesson
#   set out to save. Here the barrier that orders the statistics' stores before the
#   signal stands between the passes, and the compiler must assume that a barrier
#   changes shared memory. (Without one, watch the register count that the cell "Bytes
#   held and speed" prints.)
#
# The :doc:`engineering notes <../engineering-notes>` give what each of the three steps
# measured when it was made, against an earlier version with separate passes that
# waited for the whole chunk and copied each row only once the row before was written.
# This page's benchmark measures the result, not the steps.

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

_copy_to_shared = (
    getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
)
# Named so since Triton 3.7.
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _fetch(piece_smem, src, mask, ASYNC: gl.constexpr):
    """Start one piece's copy into shared memory: by cp.async, in a commit group of
    its own, or through registers where the copy cannot be proved aligned."""
    if ASYNC:
        _copy_to_shared(piece_smem, src, mask=mask)
        async_copy.commit_group()
    else:
        piece_smem.store(gl.load(src, mask=mask))


@gluon.jit
def shared_split_row_kernel(
    x_ptr,
    y_ptr,
    stats_ptr,
    arrived_ptr,
    M,
    N,
    x_row_stride,
    x_col_stride,
    y_row_stride,
    CHUNK: gl.constexpr,
    PIECE: gl.constexpr,
    SPLITS: gl.constexpr,
    SPLITS_POW2: gl.constexpr,
    VEC: gl.constexpr,
    WARPS: gl.constexpr,
    ASYNC: gl.constexpr,
):
    PIECES: gl.constexpr = CHUNK // PIECE
    # A piece as LINES x VEC: VEC adjacent elements (16 bytes) per thread-row.
    LINES: gl.constexpr = PIECE // VEC
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32, 1], [WARPS, 1], [1, 0])
    lines: gl.constexpr = gl.SliceLayout(1, layout)
    stats_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    chunk_smem = gl.allocate_shared_memory(
        x_ptr.dtype.element_ty,
        [CHUNK // VEC, VEC],
        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
    )
    pid = gl.program_id(0)
    groups = gl.num_programs(0) // SPLITS
    split = pid % SPLITS
    in_line = gl.arange(0, VEC, gl.SliceLayout(0, layout))
    offs = gl.arange(0, LINES, lines)[:, None] * VEC + in_line[None, :]
    chunks = gl.arange(0, SPLITS_POW2, stats_layout)
    first = (pid // SPLITS).to(gl.int64)
    # The first row's copy; each later one starts in the output pass of the row before.
    for p in gl.static_range(PIECES):
        cols = split * CHUNK + p * PIECE + offs
        first_src = x_ptr + first * x_row_stride + cols * x_col_stride
        # A grid with more groups than rows leaves some without one.
        first_ok = (cols < N) & (first < M)
        _fetch(chunk_smem.slice(p * LINES, LINES), first_src, first_ok, ASYNC)
    for row in range(pid // SPLITS, M, groups):
        row64 = row.to(gl.int64)
        # Per thread-row, a running maximum and a sum rescaled to it (lesson 03's online
        # softmax). The scale to base 2 comes after the subtraction: a finite x times
        # log2(e) can overflow.
        m = gl.full([LINES], -float("inf"), gl.float32, lines)
        d = gl.zeros([LINES], gl.float32, lines)
        for p in gl.static_range(PIECES):
            if ASYNC:  # piece p has landed; the later ones may still be in flight
                async_copy.wait_group(PIECES - 1 - p)
            x = chunk_smem.slice(p * LINES, LINES).load(layout).to(gl.float32)
            x = gl.where(split * CHUNK + p * PIECE + offs < N, x, -float("inf"))
            m_new = gl.maximum(m, gl.max(x, axis=1))
            safe = gl.where(m_new == -float("inf"), 0.0, m_new)
            rescale = gl.exp2((m - safe) * LOG2E)
            d = d * rescale + gl.sum(gl.exp2((x - safe[:, None]) * LOG2E), axis=1)
            m = m_new
        chunk_max = gl.max(m, axis=0)
        safe_max = gl.where(chunk_max == -float("inf"), 0.0, chunk_max)
        chunk_sum = gl.sum(d * gl.exp2((m - safe_max) * LOG2E), axis=0)
        stats = stats_ptr + (row64 * SPLITS + split) * 2
        gl.store(stats, chunk_max)
        gl.store(stats + 1, chunk_sum)
        # Every thread's stores are done before one thread signals (and the passes are
        # kept apart).
        _barrier()
        gl.atomic_add(arrived_ptr + row, 1, sem="release")
        while gl.atomic_add(arrived_ptr + row, 0, sem="acquire") < SPLITS:
            pass
        all_stats = stats_ptr + (row64 * SPLITS + chunks) * 2
        ok = chunks < SPLITS
        maxes = gl.load(all_stats, mask=ok, other=-float("inf"), volatile=True)
        sums = gl.load(all_stats + 1, mask=ok, other=0.0, volatile=True)
        row_max = gl.max(maxes, axis=0)
        inv_sum = 1.0 / gl.sum(sums * gl.exp2((maxes - row_max) * LOG2E), axis=0)
        following = row64 + groups
        for p in gl.static_range(PIECES):
            cols = split * CHUNK + p * PIECE + offs
            piece = chunk_smem.slice(p * LINES, LINES)
            x = piece.load(layout).to(gl.float32)
            src = x_ptr + following * x_row_stride + cols * x_col_stride
            _fetch(piece, src, (cols < N) & (following < M), ASYNC)
            y = gl.exp2((x - row_max) * LOG2E) * inv_sum
            y_at = y_ptr + row64 * y_row_stride + cols
            gl.store(y_at, y.to(y_ptr.dtype.element_ty), mask=cols < N)
    if ASYNC:  # the copies after the last row, all masked off, end before the program
        async_copy.wait_group(0)


# %%
# How many programs fit
# ---------------------
# Every program of a row must run at the same time, or the ones that wait spin forever
# (lesson 03). CUDA promises that all programs run together only to a *cooperative*
# launch (``launch_cooperative_grid=True``), and refuses a grid too large for that,
# where a plain launch of one program too many would leave a row's last program waiting
# for an SM that never frees. So the count must be exact: too low leaves room unused,
# too high is refused. An SM runs as many programs as the tightest of its limits allows:
#
# * **registers**: ``regs_per_multiprocessor`` (65,536 on Hopper) over registers per
#   thread times threads per program, where registers are handed out in blocks of 256
#   per warp, so a thread's count rounds up to a multiple of 8;
# * **threads**: ``max_threads_per_multi_processor`` (2,048);
# * **shared memory**: ``shared_memory_per_multiprocessor`` (228 KiB on Hopper) over the
#   program's shared memory plus the 1 KiB that CUDA reserves for each program (Nsight
#   Compute lists it as "Driver Shared Memory Per Block"), in units of 128 bytes;
# * **programs**: at most 32 per SM on Hopper (the CUDA programming guide's table).
#
# The compiler reports registers per thread (``n_regs``) and shared memory per program
# (``metadata.shared``). The reserved kilobyte matters: 7 programs of 32 KiB chunks
# would fit in 228 KiB without it, 6 with it. This count is for this kernel's 4 warps
# per program; with 1 or 2 it counted too many on an H100, so lesson 03's launcher,
# which takes any warp count, asks CUDA (``programs_per_sm``). The page prints both
# after the correctness checks, and launches the grid counted and one group more.

SHARED_CHUNK_BYTES, SHARED_PIECE, SHARED_WARPS = 16384, 2048, 4
RESERVED_SHARED_BYTES = 1024
_compiled = {}


def max_programs_per_sm(props):
    """Programs (thread blocks) an SM holds at most: 16 or 24 on these, 32 on the
    others from Volta to Hopper (the CUDA programming guide's table of limits)."""
    limits = {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}
    return limits.get((props.major, props.minor), 32)


def program_limits(kernel, props, num_warps):
    """How many programs of a compiled kernel one SM could hold by each limit alone."""
    threads = 32 * num_warps
    regs = -(-kernel.n_regs // 8) * 8
    shared = -(-(kernel.metadata.shared + RESERVED_SHARED_BYTES) // 128) * 128
    return {
        "registers": props.regs_per_multiprocessor // (regs * threads),
        "threads": props.max_threads_per_multi_processor // threads,
        "shared memory": props.shared_memory_per_multiprocessor // shared,
        "programs": max_programs_per_sm(props),
    }


def programs_per_sm(kernel, props, num_warps):
    """How many programs of a compiled kernel one SM holds at once: the tightest
    of its limits."""
    return min(program_limits(kernel, props, num_warps).values())


def shared_unsupported(x):
    """Why the shared-memory kernel cannot run on x here, or None when it can."""
    major = x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0]
    if not kit.ON_GPU or major != 9:
        return "it needs a Hopper GPU (compute capability 9.x), where it was written"
    return None


def _shared_args(x, chunk):
    """The output, the kernel's arguments and compile-time constants for x in
    chunks: lesson 03's (the same buffers and arguments), with this kernel's added."""
    y, args, meta = LONG._split_row_args(x, chunk)
    # 16-byte copies only where Triton sees every row start and length as a
    # multiple of 16 elements.
    aligned = (
        x.stride(1) == 1
        and x.stride(0) % 16 == 0
        and x.shape[1] % 16 == 0
        and x.data_ptr() % 16 == 0
    )
    piece, vec = min(chunk, SHARED_PIECE), 16 // x.element_size()
    return y, args, dict(meta, PIECE=piece, VEC=vec, WARPS=SHARED_WARPS, ASYNC=aligned)


def compiled_kernel(args, meta):
    """The kernel compiled for these arguments, with the programs per SM it allows:
    (kernel, per SM)."""
    # Per variant of the compiled kernel (lesson 03's ``variant``): each has registers
    # of its own.
    key = (args[0].device, args[0].dtype, LONG.variant(args), *sorted(meta.items()))
    if key not in _compiled:
        kernel = shared_split_row_kernel.warmup(
            *args, **meta, num_warps=SHARED_WARPS, grid=(1,), **LONG.COOPERATIVE
        )
        kernel._init_handles()
        props = torch.cuda.get_device_properties(args[0].device)
        _compiled[key] = kernel, programs_per_sm(kernel, props, SHARED_WARPS)
    return _compiled[key]


def _launch(args, meta, programs):
    grid = (programs,)
    shared_split_row_kernel[grid](
        *args, **meta, num_warps=SHARED_WARPS, **LONG.COOPERATIVE
    )


def counted_grid(x, chunk, extra_groups=0):
    """The grid of the shared-memory kernel on x that this lesson's count allows
    (all the GPU holds), plus extra_groups groups of SPLITS programs:
    (programs, limits, launch). limits are program_limits'; launch() runs the grid
    cooperatively and returns the softmax, or raises CUDA's RuntimeError for a grid
    too large."""
    y, args, meta = _shared_args(x, chunk)
    kernel, per_sm = compiled_kernel(args, meta)
    props = torch.cuda.get_device_properties(x.device)
    groups = per_sm * props.multi_processor_count // meta["SPLITS"] + extra_groups
    programs = groups * meta["SPLITS"]

    def launch():
        _launch(args, meta, programs)
        return y

    return programs, program_limits(kernel, props, SHARED_WARPS), launch


def _shared_split_row(x, chunk):
    y, args, meta = _shared_args(x, chunk)
    M, splits = x.shape[0], meta["SPLITS"]
    _, per_sm = compiled_kernel(args, meta)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    groups = min(M, per_sm * sms // splits)
    if groups == 0:
        raise ValueError(
            f"a row of {x.shape[1]} elements needs {splits} programs at once, more "
            "than this GPU holds"
        )
    _launch(args, meta, groups * splits)
    return y


def shared_split_row_softmax(x, chunk=None):
    """Row-wise softmax, each row read once by programs that hold their chunks in
    shared memory (Hopper). chunk: elements per program, a power of two from 1,024
    to 32,768 (default 16 KiB of the row)."""
    x = LONG._prepare(x)
    if chunk is not None:
        kit.check_block("chunk", chunk)
        if not 1024 <= chunk <= 32768:
            raise ValueError(f"chunk must be from 1024 to 32768 elements, got {chunk}")
    reason = shared_unsupported(x)
    if reason:
        raise ValueError(f"shared_split_row_softmax cannot run here: {reason}")
    chunk = chunk or SHARED_CHUNK_BYTES // x.element_size()
    return LONG.differentiable(lambda t: _shared_split_row(t, chunk), x)


# Which kernel and chunk ``long_softmax`` runs is measured, not argued:
# ``tools/tune.py shared-row`` times this kernel with chunks of 8 to 64 KiB beside
# lesson 03's registers kernel, per dtype and row length, on M = 4096 rows, and writes
# the fastest, with the GPU and versions, into the table "shared-row-chunks" of
# ``tuned_tables.json`` beside the lessons (``None`` where lesson 03's kernel won). fp16
# moves the bytes of bf16 and takes its entries; a row length takes the entry of the
# nearest measured length at or above it (the longest beyond). Rows up to lesson 03's
# ``ROW_ON_CHIP_LIMIT`` stay with its row-on-chip kernel.
SHARED_LENGTHS = (65536, 131072, 262144)
SHARED_TABLE = kit.tuned_table("shared-row-chunks")
SHARED_CHUNKS = {(r["dtype"], r["N"]): r["chunk"] for r in SHARED_TABLE["rows"]}


def tuned_chunk(x):
    """The chunk (elements per program) that the sweep measured fastest for x's
    dtype and row length, or None where lesson 03's registers kernel was faster."""
    N = x.shape[1]
    length = next((n for n in SHARED_LENGTHS if N <= n), SHARED_LENGTHS[-1])
    dtype = "float32" if x.dtype == torch.float32 else "bfloat16"
    return SHARED_CHUNKS[(dtype, length)]


def long_softmax(x):
    """Lesson 03's long_softmax, with the rows that it gives to split-row programs
    held in shared memory where this kernel can run and the sweep measured it
    faster."""
    LONG.check_input(x)
    long_row = x.shape[1] > LONG.ROW_ON_CHIP_LIMIT
    if long_row and shared_unsupported(x) is None and tuned_chunk(x) is not None:
        return shared_split_row_softmax(x, tuned_chunk(x))
    return LONG.long_softmax(x)


# %%
# Correctness
# -----------
# Against a float64 reference, values and gradients, in every supported dtype at
# irregular shapes: rows shorter than a chunk, rows that no chunk divides, split into up
# to 9 chunks of 1,024 elements so that the programs wait for each other, rows of
# 65,552 elements in the default chunks (17 in fp32); row lengths that are multiples of
# 16 (copied by ``cp.async``) and ones that are not (through registers), a strided view.

if __name__ == "__main__":
    torch.manual_seed(0)
    reason = shared_unsupported(torch.empty(1, device=DEVICE))
    if reason is None:
        print("The shared-memory kernel runs here.")
    else:
        print(f"The shared-memory kernel did not run on this machine: {reason}.")
    shapes = [(1, 1, 0), (3, 1000, 0), (37, 8192, 0), (5, 8999, 24), (2, 65552, 0)]
    for dtype in LONG.SUPPORTED_DTYPES if reason is None else ():
        for M, N, offset in shapes:  # offset: a strided view, columns from there on
            base = torch.randn(M, N + offset, device=DEVICE) * 10
            leaf = base.to(dtype).requires_grad_()
            x = leaf[:, offset:]
            y = shared_split_row_softmax(x, chunk=1024 if N < 65536 else None)
            dy = torch.randn_like(y)
            y.backward(dy)
            x64 = x.detach().double().requires_grad_()
            reference = torch.softmax(x64, dim=1)
            reference.backward(dy.double())
            tol, grad = kit.TOLERANCE[dtype], leaf.grad[:, offset:]
            close = torch.testing.assert_close
            close(y.double(), reference.detach(), rtol=tol, atol=tol * 1e-2)
            close(grad.double(), x64.grad, rtol=tol, atol=tol * dy.abs().max().item())
        print(f"{str(dtype)[6:]:>8s}: values and gradients match float64 at 5 shapes")

# %%
# This lesson's count of programs against CUDA's: for bf16 rows of 65,536 elements, in
# chunks of 8,192 elements (16 KiB, where registers set the count) and of 16,384 (32
# KiB, where shared memory does, with the reserved kilobyte), the cell launches the
# grid counted cooperatively, then one group (the programs sharing a row) more.

if __name__ == "__main__" and reason is None:
    x = torch.randn(1024, 65536, device=DEVICE, dtype=torch.bfloat16)
    for chunk in (8192, 16384):
        for extra in (0, 1):
            programs, limits, launch = counted_grid(x, chunk, extra)
            if extra == 0:
                counted, binding = programs, min(limits, key=limits.get)
                kernel = compiled_kernel(*_shared_args(x, chunk)[1:])[0]
                cuda = LONG.programs_per_sm(kernel, SHARED_WARPS)
                what = (f"chunks of {chunk}: {programs} programs ({limits[binding]} "
                        f"per SM, set by {binding}; CUDA counts {cuda})")
            else:
                more = programs - counted
                what = f"chunks of {chunk}: {programs} programs (one group {more} more)"
            try:
                expected = torch.softmax(x.double(), dim=1)
                tol = kit.TOLERANCE[x.dtype]
                right = torch.allclose(launch().double(), expected, rtol=tol, atol=0)
                print(f"{what}: launched; softmax right: {right}")
            except RuntimeError as error:
                print(f"{what}: refused ({error})")
elif __name__ == "__main__":
    print("A cooperative launch of the shared-memory kernel needs a Hopper GPU.")

# %%
# Benchmark
# ---------
# :math:`M = 4096` rows of 32K to 256K elements in GB/s: the shared-memory kernel with
# its default chunk, this lesson's ``long_softmax`` (the kernel and chunk its table
# picks for the case), lesson 03's split-row kernel (which lesson 03's ``long_softmax``
# runs from 32,769 columns on), ``torch.softmax`` and ``torch.compile``. A copy of the
# same tensor, timed the same way, is each case's reference, as in lesson 02: not a
# ceiling, since its launch shape is a copy's, not tuned for this size, so a kernel can
# beat it; the device's copy bandwidth of the other lessons is printed too. Under the
# interpreter (no Gluon kernel to time), a few rows past lesson 03's row-on-chip limit
# time ``long_softmax``'s fallback beside ``torch.softmax``.
#
# How we time (:doc:`performance page <../performance>`, "How we time"): every
# provider by *GPU time* (replays of a CUDA graph after an L2 flush), which the table
# reads, and *back to back* (calls enqueued in a row, what a loop sees), which the
# sentences add. Under the interpreter both are NumPy's wall-clock time: illustrative.

SHARED = "split row, shared memory (Gluon)"
CHOICE = "long_softmax (default path)"
REGISTERS = "split row, registers (lesson 03)"


def providers(x):
    """What the benchmark times on x, each as fn(x)."""
    calls = {CHOICE: long_softmax, "torch.softmax": lambda t: torch.softmax(t, dim=1)}
    if reason is None:
        calls[SHARED] = shared_split_row_softmax
        calls[REGISTERS] = LONG.split_row_softmax
        calls["torch.compile"] = kit.compiled_for(calls["torch.softmax"], x)
    calls[kit.SAME_BYTES] = kit.same_bytes_copy(x)
    return calls


if __name__ == "__main__":
    print(kit.describe_platform())
    if reason is None:
        M, sizes = 4096, [32768, 65536, 131072, 262144]
    else:
        M, sizes = 2, [LONG.ROW_ON_CHIP_LIMIT + 4096]
    dtypes = [torch.float32, torch.bfloat16]
    results, table, b2b = kit.bandwidth_benchmark(M, sizes, dtypes, providers)
    copy_gbs = kit.copy_bandwidth_gbs()
    print(f"device copy bandwidth, as in lessons 02 and 03: {copy_gbs:.0f} GB/s")

# %%
# The results
# -----------
# Every provider in GB/s, by GPU time, in this run (whole GB/s on a GPU, three
# significant digits for the interpreter's tiny figures, a range where a provider's
# timings spread by more than 10%); the last column is the copy of the same tensor:

kit.rates_table(results, ["dtype", "N"], "GB/s") if __name__ == "__main__" else None

# %%
# What the numbers say
# --------------------
# Computed from the speeds above, by GPU time (the shared kernel's share back to back
# too): each kernel as a share of the same-size copy, and on Hopper the shared-memory
# kernel against the registers kernel and ``long_softmax`` against the best peer.

if __name__ == "__main__":
    peers = [name for name in ("torch.softmax", "torch.compile") if name in table]
    for (dtype, N), row in table.iterrows():
        copy, best_peer = row[kit.SAME_BYTES], row[peers].max()
        case = f"{dtype:>8s} N = {N:>6d}"
        if reason is None:
            loop = b2b.loc[(dtype, N), SHARED] / b2b.loc[(dtype, N), kit.SAME_BYTES]
            print(
                f"{case}: of the same-size copy, long_softmax "
                f"{row[CHOICE] / copy:.1%}, shared {row[SHARED] / copy:.1%} "
                f"({loop:.1%} back to back), "
                f"registers {row[REGISTERS] / copy:.1%}; shared / registers "
                f"{row[SHARED] / row[REGISTERS]:.2f}x, long_softmax / best PyTorch "
                f"peer {row[CHOICE] / best_peer:.2f}x"
            )
        else:
            print(
                f"{case}: long_softmax (lesson 03's fallback here) "
                f"{row[CHOICE] / copy:.2g}x the same-size copy, "
                f"{row[CHOICE] / best_peer:.2g}x torch.softmax"
            )
    if reason is not None:
        print("Interpreter timings: the ratios measure NumPy on the CPU, illustrative.")
    ours = [name for name in (SHARED, CHOICE) if name in table]
    benchmark = dict(name=f"long-row softmax, M = {M}", unit="GB/s", ceiling=copy_gbs)
    kit.save_results("10-long-softmax-gluon", [dict(
        benchmark, ceiling_name="copy bandwidth", ceiling_per_case=kit.SAME_BYTES,
        ours=ours, peers=peers, rows=results.to_dict("records"),
    )])  # fmt: skip

# %%
# Bytes held and speed
# ---------------------
# The idea of this lesson, measured: more of the row held on each SM while its programs
# wait should mean more speed. For bf16 rows of 262,144 elements the cell compiles
# lesson 03's kernel and this one with chunks of 4K to 32K elements, and prints each
# one's registers per thread, shared memory, programs per SM (the rule above, and the
# limit that binds), KiB of the row held per SM, and speed as a share of a same-size
# copy (GPU time). Bytes per SM are not the only term: the smaller the chunk, the more
# programs share a row and wait for its slowest (64 at 4K elements); the larger, the
# fewer programs an SM runs to cover one another's waits. ``held_and_speed`` reads the
# points: speeds at each amount held, whether more held beat less, and the chunk that
# ``SHARED_CHUNKS`` holds (the sweep's, before this build) beside the fastest here,
# calling differences within the timings' spread noise. A bar per configuration:


def held_and_speed(points, spreads, choice):
    """Lines reading points [(KiB held per SM, share of a copy, name)], with spreads
    {name: how far its two fastest timings differ} and choice, the table's point."""
    share = {name: s for _, s, name in points}

    def ahead(a, b):  # a faster than b by more than the larger of their spreads
        return share[a] / share[b] - 1 > max(spreads[a], spreads[b])

    held = {}
    for kib, _, name in sorted(points):
        held.setdefault(kib, []).append(name)
    lines = [f"At {kib} KiB per SM: " + ", ".join(f"{n} {share[n]:.1%}" for n in names)
             + ("" if len(names) < 2 else " (apart past the spread)"
                if ahead(names[-1], names[0]) else " (within the spread: noise)")
             for kib, names in held.items()]
    for less, more in zip(list(held), list(held)[1:]):
        pairs = [(m, n) for m in held[more] for n in held[less]]
        if all(ahead(m, n) for m, n in pairs) or all(ahead(n, m) for m, n in pairs):
            lines.append(f"Every point at {more} KiB per SM was "
                         f"{'faster' if ahead(*pairs[0]) else 'slower'} than every "
                         f"point at {less} KiB, past the spread.")
        else:
            lines.append(f"The points at {less} and {more} KiB per SM overlap: the "
                         "bytes held do not order their speeds.")
    if len(held) == 2:
        lines.append("Two amounts held make one comparison, not a trend.")
    best = max(share, key=share.get)
    apart = f"{share[best] / share[choice] - 1:.1%} apart, " + (
        "past the spread" if ahead(best, choice) else "within the spread: noise")
    return lines + [f"The table's choice, {choice}, {share[choice]:.1%}; the fastest "
                    f"here, {best}, {share[best]:.1%}: {apart}." if best != choice else
                    f"The table's choice, {choice}, was the fastest here."]


if __name__ == "__main__" and reason is None:
    import matplotlib.pyplot as plt

    kit.plot_style()
    N, props = sizes[-1], torch.cuda.get_device_properties(DEVICE)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    held, timers = {}, {"copy": kit.call_timer(kit.same_bytes_copy(x), x)}
    for chunk in (4096, 8192, 16384, 32768):
        name = f"shared, {chunk} per program"
        _, args, meta = _shared_args(x, chunk)
        held[name] = (compiled_kernel(args, meta)[0], SHARED_WARPS, chunk * 2)
        timers[name] = kit.call_timer(shared_split_row_softmax, x, chunk)
    _, args, meta = LONG._split_row_args(x, LONG.SPLIT_BYTES // 2)
    kernel = LONG.split_row_kernel.warmup(
        *args, **meta, num_warps=LONG.SPLIT_WARPS, grid=(1,), **LONG.COOPERATIVE
    )
    kernel._init_handles()
    held["registers (lesson 03)"] = (kernel, LONG.SPLIT_WARPS, LONG.SPLIT_BYTES)
    timers["registers (lesson 03)"] = kit.call_timer(LONG.split_row_softmax, x)
    measured = kit.time_calls(timers)
    ms = {name: min(m.gpu) for name, m in measured.items()}
    points, how_held = [], {}
    for name, (kernel, warps, chunk_bytes) in held.items():
        limits = program_limits(kernel, props, warps)
        per_sm, share = min(limits.values()), ms["copy"] / ms[name]
        kib = per_sm * chunk_bytes // 1024
        points.append((kib, share, name))
        how_held[name] = f"{per_sm} x {chunk_bytes // 1024} KiB = {kib} KiB per SM"
        print(f"{name:>26s}: {kernel.n_regs:3d} registers, {kernel.metadata.shared:5d} "
              f"bytes of shared memory; {per_sm:2d} programs per SM (by "
              f"{min(limits, key=limits.get)}), {kib:3d} KiB of the row per SM: "
              f"{share:.1%} of the same-size copy")
    tuned, made = SHARED_CHUNKS[("bfloat16", N)], SHARED_TABLE["measured_on"]
    choice = f"shared, {tuned} per program" if tuned else "registers (lesson 03)"
    spreads = {name: m.row(1.0)["gpu_spread"] for name, m in measured.items()}
    print("\n".join(held_and_speed(points, spreads, choice)) + " (The table: "
          f"tools/tune.py on {made['gpu']}, Triton {made['triton']}.)")
    points.sort()  # by KiB held per SM, then speed: from the bottom bar (least held) up
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(points) + 1.4))
    for i, (kib, share, name) in enumerate(points):
        color = "#e4a23c" if "registers" in name else "#3b7dd8"
        ax.barh(i, 100 * share, color=color, zorder=2)  # over the copy's dashed line
        label = f"{100 * share:.1f}%"
        ax.text(100 * share - 1, i, label, ha="right", va="center", color="white")
        ax.text(2, i, how_held[name], ha="left", va="center", color="white")
    names = [name.replace(" per program", "") for _, _, name in points]
    ax.set_yticks(range(len(points)), names)
    ax.axvline(100, color="black", linestyle="--", linewidth=1, zorder=1)
    right = 105 * max(1.0, max(share for _, share, _ in points))
    ax.set(xlim=(0, right), xlabel="% of a same-size copy (dashed: the copy)")
    ax.set_title(f"bf16 rows of {N}: the row held per SM, and speed")
    fig.tight_layout()
    plt.show()
elif __name__ == "__main__":
    print("Registers, shared memory and programs per SM need a Hopper compile.")

# %%
# Exercises
# ---------
# Both are open-ended projects for a Hopper GPU, larger than other lessons' exercises:
# ``check_split_row(fn)`` checks only that the softmax is right; whether the change
# pays is yours to measure. It runs ``fn(x)`` on fresh random inputs of irregular
# shapes in every supported dtype and compares with a float64 reference element by
# element (``NaN`` fails): it raises ``AssertionError`` naming the case and the first
# wrong element, or prints a line saying the function passed. No solutions here.
#
# Write each attempt in a new cell at the end of this lesson's notebook (linked at the
# end of the page), or in a file next to the lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L10 = kit.load_lesson("10-long-softmax-gluon")
#    # ... your Gluon kernel, and packed_softmax(x) that launches it ...
#    L10.check_split_row(packed_softmax)
#
# 1. **One round trip fewer.** After its statistics, a program waits for three trips to
#    the L2 cache in a row: the release of its count, the polls of the row's count, and
#    the read of every chunk's statistics. Drop the count: fill the statistics
#    beforehand with a marker that no chunk publishes (not a sum of 0: a chunk whose
#    logits are all :math:`-\infty` publishes that), store each chunk's maximum and sum
#    together as one 64-bit value (two fp32 bit patterns packed into an ``int64``, so
#    that no program can see one half without the other) with a releasing atomic
#    exchange, and poll the row's statistics themselves until no marker is left. Wrap it
#    in ``packed_softmax(x)``, run ``check_split_row(packed_softmax)`` (it masks the
#    first half of each input's last row), then time it against
#    ``shared_split_row_softmax`` with the same chunk at each length of the benchmark.
# 2. **One bulk copy per chunk.** Hopper's TMA copies a whole box with one instruction
#    from one thread (lesson 11 shows tensor descriptors, ``mbarrier`` and the TMA load
#    from ``gluon.language.nvidia.hopper``: ``tma.async_load``, called
#    ``async_copy_global_to_shared`` in Triton 3.6). View a row of :math:`N` elements as
#    an :math:`(N / 256) \times 256` matrix, load each chunk as one box, and handle the
#    rows whose length the view does not allow with the kernel above. Wrap it in
#    ``tma_softmax(x)``, run ``check_split_row(tma_softmax)`` and measure whether fewer
#    copy instructions move the speed.


def check_split_row(fn):
    """Check fn(x) -> row-wise softmax on irregular shapes, every dtype, rows up to
    70,000 elements."""
    count, name, generator = 0, "your split-row softmax", kit.fresh_generator()
    for dtype in LONG.SUPPORTED_DTYPES:
        for M, N in [(1, 1), (3, 1000), (5, 4099), (7, 65536), (2, 70000)]:
            x = (torch.randn(M, N, generator=generator) * 10).to(DEVICE, dtype)
            x[-1, : N // 2] = -float("inf")  # whole chunks of -inf, where it is split
            x[0, ::5] = -float("inf")
            x[0, -1] = 0.0  # one finite logit per row: an all -inf row has no softmax
            case, tol = f"{M}x{N} {str(dtype)[6:]}", kit.TOLERANCE[dtype]
            expected = torch.softmax(x.double(), dim=1)
            kit.expect_close(
                name, case, "the output", fn(x), expected, dtype, tol, tol / 100
            )
            count += 1
    print(
        f"{name} passed on {count} fresh inputs (irregular shapes, fp32/fp16/bf16, "
        "masked logits)."
    )
