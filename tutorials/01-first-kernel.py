"""
A first kernel: programs, blocks and masks
==========================================

Vector addition as a Triton kernel, checked against float64, printed from inside and
timed against a copy of the same bytes. It expects PyTorch and the idea of a CUDA
kernel, nothing of Triton. Next: :doc:`02-fused-softmax`; all lessons: the
:doc:`list <index>`. Triton's functions are documented in `triton.language
<https://triton-lang.org/main/python-api/triton.language.html>`_.

You will learn:

* what a Triton *program* is, and how it compares with a CUDA thread block;
* what you decide (the block size and the grid) and what Triton decides (the threads,
  and how many elements each loads at once);
* ``@triton.jit``, ``tl.program_id``, ``tl.arange``, blocks of pointers, ``mask=`` and
  ``other=``, ``tl.constexpr``, ``kernel[grid](...)`` and ``triton.cdiv``;
* how to run a kernel on a CPU with the Triton interpreter, and print from inside it;
* how to check a kernel against float64, and judge a memory-bound kernel's speed
  against a copy of the same bytes, on the GPU and in a loop.
"""

# %%
# Where the kernels run
# ---------------------
# Triton compiles kernels for a GPU. Without one, its *interpreter* runs the same
# kernels on the CPU with NumPy: slowly, but every value can be printed. It is switched
# on by ``TRITON_INTERPRET=1``, which Triton reads when ``@triton.jit`` runs: set it
# *before* the first kernel. In a script of your own, two lines at the top do it:
#
# .. code-block:: python
#
#    import os
#    os.environ["TRITON_INTERPRET"] = "1"  # before the first @triton.jit
#
# The lessons leave it to ``stepkit``, the module beside them, imported before Triton:
# it sets the variable where there is no GPU.

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

# %%
# Programs, not threads
# ---------------------
# A CUDA kernel is written for one *thread* and launched over a grid of thread blocks;
# a block's threads (up to 1,024) run on one streaming multiprocessor and can share
# memory. A Triton kernel is written for one *program*, which plays the part of a CUDA
# block: it is launched over a grid of programs, and each program handles a *block* of
# elements at once, as NumPy handles an array, with no thread in sight.
#
# * **You** decide what one program computes, the block size, and the grid.
# * **Triton** decides how a block is spread over the program's threads: which
#   elements each thread holds, and how many neighbours it loads with one instruction
#   (the vector width: up to 16 bytes, where it can prove the addresses aligned). The
#   thread count is a launch option, ``num_warps`` warps of 32 threads (default 4).
#
# To add two vectors of ``n`` elements, program ``pid`` adds elements ``pid * BLOCK``
# to ``pid * BLOCK + BLOCK - 1``:


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # which program this is: 0 to the grid's size - 1
    offsets = pid * BLOCK + tl.arange(0, BLOCK)  # the elements it handles
    mask = offsets < n  # False past the end of the tensors
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
    result = x.to(tl.float32) + y.to(tl.float32)  # why fp32: see the launcher
    tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=mask)


# %%
# Line by line:
#
# * ``@triton.jit`` compiles the function when it is first launched; a tensor passed
#   to it arrives as a pointer to its first element.
# * ``tl.program_id(0)``: this program's index along the grid's axis 0 (``blockIdx.x``).
# * ``tl.arange(0, BLOCK)`` is the block of integers 0 to ``BLOCK - 1``. ``BLOCK`` is a
#   ``tl.constexpr``, a compile-time constant: the compiler knows the block's shape (a
#   power of two), and each new value compiles a new kernel.
# * ``x_ptr + offsets`` is a block of pointers; ``tl.load`` reads them all,
#   ``tl.store`` writes a block of values to them.
# * ``mask``: the grid covers whole blocks, so the last one can reach past ``n``.
#   Where the mask is False nothing is read or written, and a load returns ``other``.
#
# The launch names the grid in brackets, a tuple of program counts:
# ``add_kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)``, where
# ``triton.cdiv(n, BLOCK)`` is ``n / BLOCK`` rounded up. For 13 elements in blocks of
# 4, four programs, the last with three offsets masked:

if __name__ == "__main__":
    import matplotlib.pyplot as plt

    print(kit.describe_platform())
    kit.draw_programs_and_blocks(13, 4)
    plt.show()

# %%
# Here ``other`` changes nothing: masked values are never stored. In a reduction it
# decides the result. Each program below sums its block, so the masked offsets must
# add 0 (the next lesson loads ``other=-inf`` before taking a maximum).


@triton.jit
def block_sum_kernel(x_ptr, sums_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(sums_ptr + pid, tl.sum(x, axis=0))  # one value per program


if __name__ == "__main__":
    x = torch.rand(1000, device=DEVICE)
    sums = torch.empty(triton.cdiv(1000, 64), device=DEVICE)
    block_sum_kernel[(len(sums),)](x, sums, 1000, BLOCK=64)
    error = (sums.sum().double() / x.double().sum() - 1).abs().item()
    print(f"{len(sums)} block sums add up to x's sum (relative error {error:.1e})")

# %%
# Printing from inside a kernel
# -----------------------------
# ``tl.device_print(prefix, value)`` prints as each program runs; under the
# interpreter a kernel is plain Python, so ``print`` and breakpoints work too. On a
# GPU every *thread* prints each element it holds (32 lines or more per program, the
# same line from each thread that holds a copy) into a buffer that the GPU hands over
# when it synchronizes. C's ``printf`` then writes it to the process's standard output
# (file descriptor 1), which a terminal shows but a notebook or this page does not:
# they capture only Python's ``sys.stdout``. So below, on a GPU, the lines written to
# descriptor 1 during the synchronization are collected and printed through Python,
# each distinct line once. ``tl.static_print`` prints at compile time (under the
# interpreter, in each program): constexprs only. Two programs, 6 elements, blocks of 4:


@triton.jit
def where_am_i_kernel(n, BLOCK: tl.constexpr):
    tl.static_print("compiling for BLOCK =", BLOCK)
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    shown = tl.where(offsets < n, offsets, -1)
    tl.device_print("offsets, -1 where masked", shown)


if __name__ == "__main__":
    where_am_i_kernel[(2,)](6, BLOCK=4, num_warps=1)
    if kit.ON_GPU:  # the printed lines leave the GPU at the synchronization
        lines = kit.c_printed(torch.cuda.synchronize).splitlines()
        print(f"{len(lines)} lines from the GPU's threads, {len(set(lines))} distinct:")
        print("\n".join(sorted(set(lines))))

# %%
# The launcher
# ------------
# A kernel handed the wrong thing does not raise: it reads the wrong memory. So the
# function a user calls checks its inputs, says what is wrong, and hands the kernel
# what it assumes: one contiguous run of memory per tensor (a strided view is copied;
# exercise 2 removes that copy), offsets that fit in 32 bits. ``BLOCK = 1024`` gives
# 128 threads (4 warps) 8 elements each. The kernel adds in fp32, which costs nothing
# next to the memory traffic and which the interpreter needs: it adds bf16 raw bits.

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def add(x, y, block=1024):
    """x + y, element by element, by add_kernel, into a new tensor of x's shape."""
    for name, t in (("x", x), ("y", y)):
        what = t.dtype if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        if what not in DTYPES:
            raise TypeError(f"add takes fp32, fp16 or bf16 tensors; {name} is {what}")
        kit.check_device(name, t)
    if (x.dtype, x.shape) != (y.dtype, y.shape):  # a dtype is a type, a shape a value
        error = TypeError if x.dtype != y.dtype else ValueError
        shapes = f"shape {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}"
        raise error(f"x and y must match, got x of {shapes}")
    kit.check_block("block", block)
    n = x.numel()
    if triton.cdiv(n, block) * block > 2**31:
        raise ValueError(f"add computes 32-bit offsets: {n} elements are too many")
    # resolved: values of views that PyTorch negates on read (lesson 02 explains)
    x, y = (t.contiguous() for t in kit.resolved(x, y))
    out = torch.empty_like(x)
    if n:  # a grid of no programs is not launched
        add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out


# %%
# Is it correct?
# --------------
# Against the float64 sum at an odd length, 98,765, and at length 1 (all but one offset
# masked), in each dtype: the result must be the exact sum rounded to the dtype
# (relative tolerance ``kit.TOLERANCE``, no absolute one); a ``NaN`` fails.

if __name__ == "__main__":
    generator = torch.Generator().manual_seed(0)
    for n in (98_765, 1):
        for dtype in DTYPES:
            x, y = (torch.randn(n, generator=generator).to(DEVICE, dtype) for _ in "xy")
            got, want = add(x, y).double(), x.double() + y.double()
            torch.testing.assert_close(got, want, rtol=kit.TOLERANCE[dtype], atol=0)
    print("add matches float64 at n = 98,765 and n = 1 in fp32, fp16 and bf16.")

# %%
# Measured against a copy of the same bytes
# -----------------------------------------
# An fp32 addition reads 8 bytes and writes 4: far less arithmetic than a GPU does in
# the time those bytes take to move, so memory traffic sets the time. The yardstick is
# a copy of the same bytes, ``1.5 n`` elements read and written (``3n`` moved, as by
# the addition), timed at each size in the same run: a reference, not a ceiling, since
# reads and writes need not cost the same. Beside it, ``torch.add``; speeds are GB/s
# of ``12 n`` bytes. Each call is timed two ways (the :doc:`performance page
# <../performance>` gives the details): *GPU time*, the call replayed from a CUDA graph
# after an L2 flush, and *back to back*, calls enqueued in a row, as a loop makes them.
# Under the interpreter both are wall-clock times of NumPy on the CPU: illustrative.

OURS, PEERS = "Triton add", ["torch.add"]


def timers(n):
    """{provider: Timer} of the benchmark at n fp32 elements."""
    x, y = (torch.randn(n, device=DEVICE) for _ in "xy")
    same = torch.randn(3 * n // 2, device=DEVICE)  # 3n elements moved, as x + y
    copy = kit.same_bytes_copy(same)
    return {OURS: kit.call_timer(add, x, y), PEERS[0]: kit.call_timer(torch.add, x, y),
            kit.SAME_BYTES: kit.call_timer(copy, same)}  # fmt: skip


if __name__ == "__main__":
    sizes = [2**14, 2**17, 2**20, 2**23, 2**26] if kit.ON_GPU else [2**10, 2**13, 2**16]
    copy_gbs = kit.copy_bandwidth_gbs()
    print(f"device copy bandwidth (large buffer), measured now: {copy_gbs:.0f} GB/s")
    # 12 n bytes a call, counted in GB per ms: rates in GB/s.
    results, gpu, b2b = kit.size_benchmark(sizes, timers, lambda n: 12 * n * 1e-6)

# %%
# Each provider's GB/s at each length N, by GPU time in this run (a range where its
# timings spread by more than 10%):

kit.rates_table(results, ["N"], "GB/s") if __name__ == "__main__" else None

# %%
# Each provider as a fraction of the copy of the same bytes, from the table just
# above; then the same numbers against N (a log scale: they span decades), the
# large-buffer copy bandwidth dashed. On a GPU a launch costs time whatever it moves,
# so at small lengths even the copy stays below that line; on a CPU, small tensors stay
# in the caches and can pass it.

if __name__ == "__main__":
    for n in sizes:
        of_copy = gpu.loc[n, [OURS, *PEERS]] / gpu.at[n, kit.SAME_BYTES]
        shown = ", ".join(f"{p} {100 * f:.3g}%" for p, f in of_copy.items())
        print(f"N = {n:10,}: {shown} of the copy")
    kit.save_results("01-first-kernel", [dict(
        name="vector add, fp32", unit="GB/s", ceiling_name="copy bandwidth",
        ceiling=copy_gbs, ceiling_per_case=kit.SAME_BYTES, ours=[OURS], peers=PEERS,
        rows=results.to_dict("records"))])  # fmt: skip
    title = "Vector add, fp32: GB/s against the copy bandwidth"
    kit.plot_rates(gpu, copy_gbs, "large-buffer copy", "GB/s", title, [OURS], True)
    plt.show()

# %%
# In a loop
# ---------
# GPU time leaves the host out: the Python of ``add`` with its checks, then Triton's
# launch of the kernel, which every call pays before the GPU starts on it. Back to
# back, a call takes about the longer of its host time and its GPU time, so a kernel
# the GPU runs as fast as ``torch.add`` can still run slower in a loop. The same rates,
# back to back (under the interpreter, the wall-clock times above again):

kit.rates_table(results, ["N"], "GB/s", "value") if __name__ == "__main__" else None

# %%
# Where ours falls behind ``torch.add`` in a loop, and by how much, read from the
# table just above and the one by GPU time; then every provider's two rates compared:


if __name__ == "__main__":
    if kit.ON_GPU:
        print(kit.loop_verdict(gpu, b2b, OURS, PEERS))
        print(kit.b2b_overview(gpu, b2b))
    else:
        print("Interpreter timings: illustrative only.")

# %%
# Exercises
# ---------
# Write each attempt in a new cell at the end of this lesson's notebook (linked at the
# end of the page), below the checks, or in a file next to the lessons that loads this
# one first (a file name starting with a digit cannot be imported):
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L01 = kit.load_lesson("01-first-kernel")
#    # ... your kernel, and relu(x) that launches it ...
#    L01.check_relu(relu)  # in the notebook: check_relu(relu)
#
# A check runs your function on fresh random inputs of irregular lengths in fp32, fp16
# and bf16 (compute in fp32, as ``add_kernel`` does), compares with float64, and raises
# ``AssertionError`` at the first wrong element, saying how far off (``NaN`` is wrong).
#
# 1. **ReLU.** Write ``relu(x)``: a new tensor of ``max(x, 0)``, by a Triton kernel
#    over a 1-D ``x``. Check it with ``check_relu(relu)``. On a GPU the check also
#    prints its speed against a copy of :math:`2^{24}` elements: aim for 90% or more.
# 2. **Strided add.** ``add`` copies a strided view such as ``x[::3]`` first. Write
#    ``add_strided(x, y)`` for 1-D ``x`` and ``y`` of one length and any strides,
#    reading them where they are (hint: pass ``x.stride(0)`` and load from
#    ``x_ptr + offsets * x_stride``). Check it with ``check_add_strided(add_strided)``.


def check_relu(fn):
    """Check fn(x) -> max(x, 0); on a GPU, print its speed against a copy of x."""
    kit.check_elementwise("relu", fn, lambda x: x.clamp_min(0))
    if kit.ON_GPU:
        fraction = kit.copy_fraction(fn, torch.randn(2**24, device=DEVICE))
        print(f"relu, 2**24 fp32 elements: {fraction:.0%} of a copy's speed (aim: 90%)")


def check_add_strided(fn):
    """Check fn(x, y) -> x + y on views of x with stride 3 and y with stride 2."""
    kit.check_elementwise("add_strided", fn, torch.add, strides=(3, 2))
