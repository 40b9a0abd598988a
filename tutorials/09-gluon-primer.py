"""
Hopper: a Gluon primer, one piece at a time
===========================================

Lessons 01 to 08 write Triton: the compiler decides which thread holds which element,
what goes through shared memory and which warps do what. Hopper's fastest paths need
the program to decide: bulk copies by the Tensor Memory Accelerator (TMA), tensor-core
products reading shared memory (``wgmma``), warps with roles, registers moved to the
warps that need them. Gluon, Triton's lower-level language, lets a kernel say all of
it. Lessons 10 to 14 use these pieces together; here each comes alone, in the smallest
kernel that shows it. You will learn:

* what a *layout* is: which thread holds which element, read from the layout object;
* how a TMA copy fills shared memory and signals an *mbarrier*, and what its *phase* is;
* one ``wgmma``: which operands may be in registers, and who holds the result (drawn);
* ``warp_specialize``: a producer warp and consumers passing tiles through a two-slot
  ring (its timeline drawn);
* ``setmaxnreg``, which acts on a *warp group* (4 warps), and why 9 working warps
  launch as 12 (the register budget drawn);
* how to read a compiled kernel's warps, ``.reqntid``, ``.maxnreg``, shared memory and
  registers from its metadata and PTX, on any machine.

Each kernel is compiled here for an H100 (``sm_90a``), which needs no GPU; the facts
printed come from the compiled kernels, and a Hopper GPU also runs them. Gluon's API
moves between releases: the lesson is written for Triton 3.6.0, the GPU build's, checked
with 3.9.0, the CPU build's (same facts), and says which names moved on another.
Previous: :doc:`08-decode-attention`; next: :doc:`10-long-softmax-gluon`, a real kernel
of these pieces. Triton's `Gluon tutorials
<https://github.com/triton-lang/triton/tree/main/python/tutorials/gluon>`_ go further.
"""

# %%
# Which Triton, and compiling for an H100 anywhere
# ------------------------------------------------
# Given ``GPUTarget("cuda", 90, 32)``, ``triton.compile`` compiles for ``sm_90a`` with
# no GPU, down to the PTX and the binary ``ptxas`` makes of it. Each kernel below
# prints, from its ``metadata``, its PTX and its binary (by ``cuobjdump``, shipped with
# Triton): warps; ``.reqntid``, the threads per program the PTX promises, so ``ptxas``
# can plan registers for exactly that many; ``.maxnreg``, a cap on registers per thread
# that Triton sets unasked only in warp-specialized kernels; shared memory; registers
# per thread; and *local memory*, per-thread DRAM where ``ptxas`` spills registers
# (cuobjdump's STACK; 0: no spills). A CPU only compiles them: Gluon has no interpreter.

import collections
import inspect
import os
import re
import subprocess
import tempfile
import types

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

TESTED_WITH = ("3.6.0", "3.9.0")
HOPPER = GPUTarget("cuda", 90, 32)  # an H100: sm_90a, 32 threads per warp
try:
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    mbarrier, tma, warpgroup_mma = hopper.mbarrier, hopper.tma, hopper.warpgroup_mma
    IMPORT_PROBLEM = None
except (ImportError, AttributeError) as error:  # kernels defined, never compiled
    IMPORT_PROBLEM = str(error)
    gluon = types.SimpleNamespace(jit=lambda fn: fn)
    gl, tma, mbarrier = (types.SimpleNamespace(constexpr=None) for _ in range(3))
# TMA's copies: async_copy_global_to_shared and async_copy_shared_to_global in Triton
# 3.6, async_load and async_store later (3.9 refuses the old names).
tma_load = getattr(tma, "async_load", None) or getattr(
    tma, "async_copy_global_to_shared", None)
tma_store = getattr(tma, "async_store", None) or getattr(
    tma, "async_copy_shared_to_global", None)
USED = dict(gl=["BlockedLayout", "DotOperandLayout", "NVMMADistributedLayout",
                "NVMMASharedLayout", "SliceLayout", "allocate_shared_memory",
                "num_warps", "static_range", "warp_specialize"], tma=["store_wait"],
            mbarrier=["MBarrierLayout", "arrive", "expect", "init", "wait"])


def gluon_problem():
    """Why this Triton cannot build the primer's kernels as written; None if it can."""
    version = f"Triton {triton.__version__}"
    tested = f"this primer was written for Triton {' and '.join(TESTED_WITH)}"
    if IMPORT_PROBLEM:
        return f"{version} moved part of Gluon ({IMPORT_PROBLEM}); {tested}."
    modules = {"gl": gl, "mbarrier": mbarrier, "tma": tma}
    missing = [f"{module}.{name}" for module, names in USED.items()
               for name in names if not hasattr(modules[module], name)]
    missing += [f"tma.{what}" for what, fn in (("async_load", tma_load),
                                              ("async_store", tma_store)) if not fn]
    if missing:
        return f"{version} has no {', '.join(missing)}: {tested}."
    return None


def compile_for_hopper(kernel, num_warps=4, multiples_of_16=(), **args):
    """kernel compiled for sm_90a, no GPU needed. args by name (left out: defaults): a
    type string for a run-time argument ("*fp32", "i32", a descriptor_type) or a
    constexpr's value. Pointers are 16-byte aligned, as PyTorch allocates them, and so
    are the integers in multiples_of_16 (Triton compiles a variant for such calls)."""
    parameters = inspect.signature(kernel.fn).parameters.items()
    args = {**{name: p.default for name, p in parameters if p.default is not p.empty},
            **args}
    signature = {name: args[name] if isinstance(args[name], str) else "constexpr"
                 for name in kernel.arg_names}
    constants = {name: value for name, value in args.items()
                 if not isinstance(value, str)}
    aligned = {(i,): [["tt.divisibility", 16]]
               for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*") or name in multiples_of_16}
    source = GluonASTSource(kernel, signature, constants, aligned)
    options = dict(num_warps=num_warps, enable_fp_fusion=True)  # 3.6's default
    return triton.compile(source, target=HOPPER, options=options)


def descriptor_type(shape):
    """The signature of a TMA descriptor for fp16 boxes of shape, laid for wgmma."""
    layout = gl.NVMMASharedLayout.get_default_for(list(shape), gl.float16)
    return f"tensordesc<fp16[{','.join(map(str, shape))}],{layout!r}>"


def compiled_facts(compiled):
    """What the compiled kernel launches with and uses, read from its metadata, its
    PTX and cuobjdump's report of the binary (local memory: STACK, where spills go)."""
    ptx = compiled.asm["ptx"]
    found = {name: int(m[1]) if (m := re.search(rf"\.{name}\s+(\d+)", ptx)) else None
             for name in ("reqntid", "maxnreg")}
    with tempfile.TemporaryDirectory() as folder:
        binary = os.path.join(folder, "kernel.cubin")
        with open(binary, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = triton.knobs.nvidia.cuobjdump.path
        usage = subprocess.run([tool, "-res-usage", binary], capture_output=True,
                               text=True, check=True).stdout
    count = {field: int(n) for field, n in re.findall(r"(\w+):(\d+)", usage)}
    return dict(warps=compiled.metadata.num_warps, shared=compiled.metadata.shared,
                registers=count["REG"], local=count["STACK"] + count["LOCAL"], **found)


def show_facts(name, compiled, instructions):
    """Print a compiled kernel's facts and the PTX instructions matching a regex."""
    f = compiled_facts(compiled)
    counts = collections.Counter(re.findall(instructions, compiled.asm["ptx"]))
    found = [f"{ptx} (x{count})" for ptx, count in sorted(counts.items())]
    cap = f".maxnreg {f['maxnreg']}" if f["maxnreg"] else "no .maxnreg (one role)"
    print(f"{name} (Triton {triton.__version__}, sm_90a): {f['warps']} warps, "
          f".reqntid {f['reqntid']}, {cap}, {f['shared']} bytes of "
          f"shared memory, {f['registers']} registers and {f['local']} bytes of local "
          f"memory per thread; in its PTX: {', '.join(found)}")


def why_not_run():
    """Why the primer's kernels cannot run here; None on a Hopper GPU."""
    if not kit.ON_GPU:
        return "there is no GPU here, and the Triton interpreter cannot run Gluon"
    if torch.cuda.get_device_capability()[0] != 9:
        return "they are written for Hopper (compute capability 9.x)"
    return None


SHOW = RUN = False
if __name__ == "__main__":
    problem = gluon_problem()
    SHOW = problem is None
    RUN = SHOW and why_not_run() is None
    if kit.ON_GPU:  # on a CPU its line is about interpreter timings: none here
        print(kit.describe_platform())
    print(problem or f"Triton {triton.__version__} has every Gluon name the primer "
          f"uses (written for {' and '.join(TESTED_WITH)}). " + (
              "The kernels run below." if RUN else "The kernels are compiled for "
              f"sm_90a but do not run: {why_not_run()}."))

# %%
# A layout and a load
# -------------------
# A Triton kernel says *what* a program computes on a block; the compiler spreads the
# block over threads. Gluon makes the spread part of the tensor's type: a *layout*.
# ``BlockedLayout([4], [32], [4], [0])`` reads "4 adjacent elements per thread, 32
# threads per warp, 4 warps, dimension 0 fastest": 512 elements, and a block of 1,024
# wraps around once, so each thread holds two runs of 4. Four adjacent fp32 elements are
# 16 bytes, the widest load one thread issues (``ld.global.v4``), when the length is a
# multiple of 16 (the variant compiled here: the mask is then the same for all 4). The
# layout object is data: Triton turns any layout into a *linear layout* (Zhou et al.,
# 2025, `arXiv:2505.23819 <https://arxiv.org/abs/2505.23819>`_): each bit of a register,
# lane or warp index stands for an element, and an index holds the XOR of its bits'.
# ``owners(layout, shape)`` reads it back: three arrays of the tensor's shape, the warp,
# lane and register holding each element.


@gluon.jit
def copy_kernel(x_ptr, y_ptr, n, BLOCK: gl.constexpr, VEC: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
    offsets = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout)
    inside = offsets < n
    gl.store(y_ptr + offsets, gl.load(x_ptr + offsets, mask=inside), mask=inside)


def owners(layout, shape):
    """{"warp", "lane", "register"}: arrays of shape saying who holds each element of
    a tensor in layout, from Triton's linear-layout form of it."""
    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    linear = builder.to_linear_layout(layout._to_ir(builder), list(shape))
    spans = []  # per index kind: each index's element, the XOR of its bits' bases
    for bases in (linear.warp_bases, linear.lane_bases, linear.reg_bases):
        span = np.zeros((1, len(shape)), dtype=int)
        for basis in bases:
            span = np.concatenate([span, span ^ np.array(basis)])
        spans.append(span)
    held = {kind: np.full(shape, -1) for kind in ("warp", "lane", "register")}
    for index in np.ndindex(*(len(span) for span in spans)):
        where = np.bitwise_xor.reduce([span[i] for span, i in zip(spans, index)])
        for kind, i in zip(held, index):
            held[kind][tuple(where)] = i
    return held


def copy(x, block=1024, vec=4):
    y = torch.empty_like(x)
    copy_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), block, vec)
    return y


if SHOW:
    held = owners(gl.BlockedLayout([4], [32], [4], [0]), [1024])
    thread = held["warp"] * 32 + held["lane"]
    for t in (0, 1, 127):
        mine = np.flatnonzero(thread == t)
        print(f"thread {t:3d} holds elements {mine.tolist()}")
    show_facts("copy_kernel", compile_for_hopper(
        copy_kernel, x_ptr="*fp32", y_ptr="*fp32", n="i32", BLOCK=1024, VEC=4,
        multiples_of_16=["n"]), r"(?:ld|st)\.global[.\w]*")

# %%
# Shared memory, a TMA copy and its mbarrier
# ------------------------------------------
# A buffer from ``gl.allocate_shared_memory`` has a layout; TMA and ``wgmma`` read
# ``NVMMASharedLayout``, whose swizzled rows let threads reading a column hit different
# memory banks. A *TMA descriptor*, made on the host, holds the tensor's address, shape,
# strides and the *box* one copy moves: a whole 64 x 64 tile, issued by one thread.
#
# A copy lands in its own time. An *mbarrier*, a counter in shared memory, completes
# when the arrivals it expects have come and the bytes ``mbarrier.expect`` announced
# have landed (the copy names its barrier), then starts over. Its *phases* are numbered
# 0, 1, 2, ...: ``mbarrier.wait(bar, p)`` waits for the current phase to complete if
# its number's parity is ``p``, and returns at once if not. Below, the tiles of a row
# go through one buffer and one barrier: tile ``t`` completes phase ``t``, so its wait
# names parity ``t & 1`` (the wrong one returns at once, the last tile still there).
# ``tma.store_wait(0)`` waits for the store to read the buffer before the next copy.


@gluon.jit
def tma_copy_kernel(in_desc, out_desc, tiles):
    BLOCK_M: gl.constexpr = in_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = in_desc.block_type.shape[1]
    tile = gl.allocate_shared_memory(in_desc.dtype, [BLOCK_M, BLOCK_N], in_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)  # one arrival: expect's, plus the bytes it names
    row = gl.program_id(0) * BLOCK_M
    for t in range(tiles):
        mbarrier.expect(bar, in_desc.block_type.nbytes)
        tma_load(in_desc, [row, t * BLOCK_N], bar, tile)
        mbarrier.wait(bar, t & 1)  # the t-th completion: parity t & 1
        tma_store(out_desc, [row, t * BLOCK_N], tile)
        tma.store_wait(0)  # the store has read the tile: the next copy may land


def descriptor(t, box):
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.float16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)


def tma_copy(x, box=(64, 64)):
    y = torch.empty_like(x)
    grid = (x.shape[0] // box[0],)
    tma_copy_kernel[grid](descriptor(x, list(box)), descriptor(y, list(box)),
                          x.shape[1] // box[1])
    return y


if SHOW:
    box = descriptor_type([64, 64])
    copier = compile_for_hopper(tma_copy_kernel, in_desc=box, out_desc=box, tiles="i32")
    show_facts("tma_copy_kernel", copier,
               r"cp\.async\.bulk\.tensor[.\w:]*|mbarrier\.(?:try_wait|arrive)[.\w:]*")

# %%
# One wgmma
# ---------
# ``warpgroup_mma(a, b, acc)`` computes ``acc + a @ b`` on the tensor cores with one
# warp group, its 128 threads as one. The compiler enforces its operands' rules:
#
# * ``a`` (M x K) may come from registers, in ``DotOperandLayout(0, acc_layout, 2)`` (2:
#   a thread's adjacent 16-bit values along K, 32 bits), or from shared memory;
# * ``b`` (K x N) must be in shared memory, in an ``NVMMASharedLayout``;
# * ``acc`` lives in registers, in an ``NVMMADistributedLayout``: its ``instr_shape``
#   [16, N, 16] says each warp covers 16 rows and each instruction reduces 16 values of
#   K (16-bit inputs), so one warp group covers 64 rows and K = 32 takes two
#   ``wgmma.mma_async ... m64n64k16`` instructions.
#
# The kernel below loads A and B with TMA and multiplies them once, A from shared memory
# or from registers; asked to take B from registers, the compiler refuses, and the cell
# prints why.


def accumulator_layout(n):
    """wgmma's accumulator layout for a 64 x n tile over one warp group."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 16])


@gluon.jit
def mma_kernel(a_desc, b_desc, c_ptr, ACC: gl.constexpr, A_IN_REGISTERS: gl.constexpr,
               B_IN_REGISTERS: gl.constexpr):
    M: gl.constexpr = a_desc.block_type.shape[0]
    K: gl.constexpr = a_desc.block_type.shape[1]
    N: gl.constexpr = b_desc.block_type.shape[1]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [M, K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [K, N], b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [0, 0], bar, a_smem)
    tma_load(b_desc, [0, 0], bar, b_smem)
    mbarrier.wait(bar, 0)
    acc = gl.zeros([M, N], gl.float32, ACC)
    a = a_smem.load(gl.DotOperandLayout(0, ACC, 2)) if A_IN_REGISTERS else a_smem
    b = b_smem.load(gl.DotOperandLayout(1, ACC, 2)) if B_IN_REGISTERS else b_smem
    acc = warpgroup_mma(a, b, acc)
    rows = gl.arange(0, M, gl.SliceLayout(1, ACC))
    cols = gl.arange(0, N, gl.SliceLayout(0, ACC))
    gl.store(c_ptr + rows[:, None] * N + cols[None, :], acc)


def mma(a, b, a_in_registers=False):
    c = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32)
    mma_kernel[(1,)](descriptor(a, list(a.shape)), descriptor(b, list(b.shape)), c,
                     accumulator_layout(b.shape[1]), a_in_registers, False)
    return c


def compile_mma(a_in_registers, b_in_registers=False):
    return compile_for_hopper(
        mma_kernel, a_desc=descriptor_type([64, 32]), b_desc=descriptor_type([32, 64]),
        c_ptr="*fp32", ACC=accumulator_layout(64), A_IN_REGISTERS=a_in_registers,
        B_IN_REGISTERS=b_in_registers)


if SHOW:
    for a_in_registers in (False, True):
        show_facts(f"mma_kernel, A from {'registers' if a_in_registers else 'shared'}",
                   compile_mma(a_in_registers), r"wgmma\.mma_async[.\w]*")
    try:
        compile_mma(False, b_in_registers=True)
    except triton.CompilationError as error:
        print("B from registers, the compiler:", str(error).strip().splitlines()[-1])

# %%
# Which thread holds which element of the accumulator: the layout object, read through
# ``owners``. Each warp owns 16 rows; a thread holds pairs of adjacent columns in two
# rows 8 apart, every 8 columns. Lesson 11 stores its output through another layout for
# this reason: 8-byte pairs make narrow stores.


def draw_accumulator(n=64):
    import matplotlib.pyplot as plt

    held = owners(accumulator_layout(n), [64, n])
    fig, (whole, zoom) = plt.subplots(1, 2, figsize=(10, 5.4),
                                      gridspec_kw=dict(width_ratios=[1, 1.3]))
    whole.imshow(held["warp"], cmap="Pastel1", vmin=0, vmax=8, aspect="auto")
    for w in range(4):
        whole.text(n / 2, 16 * w + 7.5, f"warp {w}", ha="center", va="center")
    whole.add_patch(plt.Rectangle((-0.5, -0.5), 8, 16, fill=False, lw=2))
    whole.set(title=f"the 64 x {n} accumulator, by warp", xlabel="column",
              ylabel="row")
    colours = zoom.imshow(held["register"][:16, :8], cmap=plt.get_cmap("Pastel2", 4),
                          vmin=-0.5, vmax=3.5, aspect="auto")
    fig.colorbar(colours, ax=zoom, ticks=range(4), label="register index")
    for (r, c), lane in np.ndenumerate(held["lane"][:16, :8]):
        zoom.text(c, r, f"T{lane}", ha="center", va="center", fontsize=12)
    zoom.set(title="the boxed corner: thread (lane) per cell, colour: register",
             xlabel="column", ylabel="row")
    fig.tight_layout()
    plt.show()


if SHOW:
    draw_accumulator()

# %%
# Two roles: ``warp_specialize`` and a two-slot ring
# --------------------------------------------------
# In ``tma_copy_kernel`` every warp waits for each copy. With *roles*, one warp only
# issues copies (the *producer*) and the others only use the tiles (the *consumers*); a
# *ring* of two buffers lets tile ``t + 1`` land while tile ``t`` is used.
# ``gl.warp_specialize([(consumer, args), (producer, args)], [1], [24])`` runs the first
# function in the kernel's own 4 warps (the *default partition*) and each other in extra
# warps: 1 for the producer, asking for 24 registers per thread (see the next section).
#
# Each slot has two mbarriers: ``full`` completes when the slot's copy lands (one
# arrival, ``expect``'s, and its bytes), ``empty`` when every consumer group has arrived
# after reading the slot. Tile ``t`` goes to slot ``t % 2`` as the slot's use
# ``u = t // 2``: the consumer waits on ``full`` for phase ``u``, parity ``u & 1``. The
# producer, before refilling, waits on ``empty`` for phase ``u - 1``, the previous
# tile's release: the opposite parity, so for ``u = 0`` it names 1 while the fresh
# barrier is in phase 0, and the first wait on each slot returns at once. The consumers
# sum the tiles, each group its rows: ``y[r, c]`` sums row ``r`` of each tile.


@gluon.jit
def _ring_producer(desc, ring, full, empty, tiles):
    for t in range(tiles):
        slot = t % 2
        mbarrier.wait(empty.index(slot), ((t // 2) & 1) ^ 1)  # the slot's last use
        mbarrier.expect(full.index(slot), desc.block_type.nbytes)
        tma_load(desc, [t * desc.block_type.shape[0], 0], full.index(slot),
                  ring.index(slot))


@gluon.jit
def _ring_consumer(ring, full, empty, y_ptr, tiles, GROUP: gl.constexpr,
                   ROWS: gl.constexpr, COLS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    total = gl.zeros([ROWS, COLS], gl.float32, layout)
    for t in range(tiles):
        slot = t % 2
        mbarrier.wait(full.index(slot), (t // 2) & 1)
        mine = ring.index(slot).slice(GROUP * ROWS, ROWS)  # this group's rows
        total += mine.load(layout).to(gl.float32)
        mbarrier.arrive(empty.index(slot), count=1)
    rows = GROUP * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    gl.store(y_ptr + rows[:, None] * COLS + cols[None, :], total)


@gluon.jit
def ring_kernel(desc, y_ptr, tiles, GROUPS: gl.constexpr,
                CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
    BLOCK_M: gl.constexpr = desc.block_type.shape[0]
    COLS: gl.constexpr = desc.block_type.shape[1]
    ROWS: gl.constexpr = BLOCK_M // GROUPS
    ring = gl.allocate_shared_memory(desc.dtype, [2, BLOCK_M, COLS], desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(2):
        mbarrier.init(full.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=GROUPS)  # one arrival per group
    # The partitions are written out in the call: kept in a variable, their
    # constexpr arguments would turn into run-time values.
    if GROUPS == 1:
        gl.warp_specialize([
            (_ring_consumer, (ring, full, empty, y_ptr, tiles, 0, ROWS, COLS)),
            (_ring_producer, (desc, ring, full, empty, tiles)),
        ], [1], [PRODUCER_REGISTERS])
    else:
        gl.warp_specialize([
            (_ring_consumer, (ring, full, empty, y_ptr, tiles, 0, ROWS, COLS)),
            (_ring_consumer, (ring, full, empty, y_ptr, tiles, 1, ROWS, COLS)),
            (_ring_producer, (desc, ring, full, empty, tiles)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def ring_sum(x, groups=1, registers=(240, 24), kernel=None, **constants):
    """Sum x's tiles of 64 * groups rows: y[r, c] = sum over t of x[t * rows + r, c],
    by ring_kernel (or kernel, with its extra constants) on the GPU."""
    rows = 64 * groups
    y = torch.empty(rows, x.shape[1], device=x.device, dtype=torch.float32)
    (kernel or ring_kernel)[(1,)](descriptor(x, [rows, x.shape[1]]), y,
                                  x.shape[0] // rows, groups, *registers, **constants)
    return y


def compile_ring(groups, registers=(240, 24), kernel=None, cols=64, **constants):
    return compile_for_hopper(
        kernel or ring_kernel, desc=descriptor_type([64 * groups, cols]),
        y_ptr="*fp32", tiles="i32", GROUPS=groups, CONSUMER_REGISTERS=registers[0],
        PRODUCER_REGISTERS=registers[1], **constants)


if SHOW:
    show_facts("ring_kernel, 1 consumer group", compile_ring(1), r"setmaxnreg\.\w+")

# %%
# The ring's timeline by its rules, not a measurement: a copy starts when the producer
# has issued the previous one and its slot's last tile has been used; a tile is used
# once it has landed and the consumer is done with the one before. Use takes longer than
# copy here, so the producer waits on ``empty``. Labels: each wait's parity.


def ring_timeline(tiles=6, copy_time=1.0, use_time=1.6):
    """[(copy start, copy end, use start, use end)] of each tile through two slots."""
    times = []
    for t in range(tiles):
        slot_free = times[t - 2][3] if t >= 2 else 0.0
        start = max(times[-1][0] if times else 0.0, slot_free)
        use = max(start + copy_time, times[-1][3] if times else 0.0)
        times.append((start, start + copy_time, use, use + use_time))
    return times


def draw_ring_timeline(tiles=6):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.8))
    for t, (start, landed, use, done) in enumerate(ring_timeline(tiles)):
        slot, u = t % 2, t // 2
        for begin, end, y, color, label in (
            (start, landed, 1.75 - slot / 2, "#7f7f7f", f"copy {t}\nempty {u & 1 ^ 1}"),
            (use, done, 0.4, f"C{slot}", f"tile {t}, slot {slot}\nfull {u & 1}"),
        ):
            ax.broken_barh([(begin, end - begin)], (y - 0.2, 0.4), color=color)
            ax.text((begin + end) / 2, y, label, ha="center", va="center",
                    color="white", fontsize=8)
    ax.set_yticks([0.4, 1.25, 1.75],
                  ["consumer", "producer: slot 1", "producer: slot 0"])
    ax.set(xlabel="time (illustrative)", xticks=[], ylim=(0, 2.1))
    ax.set_title("Tiles through a two-slot ring; each label: the parity its wait names")
    fig.tight_layout()
    plt.show()


if SHOW:
    draw_ring_timeline()

# %%
# ``setmaxnreg``, and the warps nobody asked for
# ----------------------------------------------
# An SM has 65,536 32-bit registers. In a warp-specialized kernel Triton caps each
# thread at launch at ``.maxnreg``: 65,536 over the program's threads, down to a
# multiple of 8 (kernels with one role have none). A producer, which only issues copies,
# gives registers back to the program's pool with ``setmaxnreg.dec``; the consumers take
# them with ``setmaxnreg.inc``; counts are multiples of 8.
#
# ``setmaxnreg`` acts on a whole warp group, so Triton pads ``warp_specialize``'s extra
# warps to whole groups (its ``AllocateWarpGroups`` pass): the producer's warp comes
# with 3 that only give registers back, the ring above launched more than its 5 working
# warps, and the budget counts every launched warp. The default partition asks for
# nothing and gets what the others leave. Below, two consumer groups (half the tile's
# rows each) ask for 240 and the producer for 24; ``partition_registers`` finds each
# partition's count in the PTX by its source lines (``.loc``).


def partition_registers(compiled, partitions):
    """{partition function's name: {register counts}}: the last setmaxnreg of the PTX
    before each stretch of a partition's code, found by its source lines (.loc)."""
    ptx = compiled.asm["ptx"]
    files = dict(re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', ptx))
    owner = {}
    for fn in partitions:
        lines, first = inspect.getsourcelines(fn.fn)
        where = os.path.basename(fn.fn.__code__.co_filename)
        owner.update({(where, first + i): fn.__name__ for i in range(len(lines))})
    counts, last = {}, None
    for line in ptx.splitlines():
        if found := re.search(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", line):
            last = int(found[1])
        elif (found := re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line)) and last:
            name = owner.get((os.path.basename(files.get(found[1], "")), int(found[2])))
            if name:
                counts.setdefault(name, set()).add(last)
                last = None
    return counts


def draw_register_budget(facts, consumer, producer):
    """Registers per warp group at launch and after setmaxnreg, against the SM's."""
    import matplotlib.pyplot as plt

    groups = facts["warps"] // 4
    launch = [facts["maxnreg"]] * groups
    working = [consumer] * (groups - 1) + [producer]
    fig, ax = plt.subplots(figsize=(8, 2.6))
    for y, counts in ((1, launch), (0, working)):
        left = 0
        for g, count in enumerate(counts):
            ax.barh(y, 128 * count, left=left, color=f"C{g}", edgecolor="white")
            small = 128 * count < 8000  # labelled past the SM's line
            role = "producer\n+ 3 padding warps" if g == groups - 1 else "consumer"
            label = f"group {g}" + (f": {role}" if y == 0 else "") + f"\n128 x {count}"
            ax.text(66500 if small else left + 64 * count, y, label, fontsize=8,
                    ha="left" if small else "center", va="center")
            left += 128 * count
    ax.axvline(65536, color="black", linestyle="--")
    ax.set_yticks([1, 0], [f"launch (.maxnreg {facts['maxnreg']})", "after setmaxnreg"])
    ax.set(xlabel="registers (dashed: the SM's 65,536)", xlim=(0, 84000))
    ax.set_title(f"{facts['warps']} warps = {groups} warp groups: the register budget")
    fig.tight_layout()
    plt.show()


if SHOW:
    two_groups = compile_ring(2)
    show_facts("ring_kernel, 2 consumer groups", two_groups, r"setmaxnreg\.\w+")
    moves = partition_registers(two_groups, [_ring_consumer, _ring_producer])
    facts = compiled_facts(two_groups)
    (consumer,), (producer,) = moves["_ring_consumer"], moves["_ring_producer"]
    print(f"{facts['warps']} warps launch for 9 working (two groups of 4, a loader); "
          f"setmaxnreg sets {consumer} (consumers), {producer} (loader) as roles start")
    print(f"budget: 128 x ({consumer} + {consumer} + {producer}) = "
          f"{128 * (2 * consumer + producer):,} of 65,536 registers; at launch "
          f"{facts['reqntid']} threads x .maxnreg {facts['maxnreg']} = "
          f"{facts['reqntid'] * facts['maxnreg']:,}")
    draw_register_budget(facts, consumer, producer)

# %%
# The shared-memory budget of a program
# -------------------------------------
# Registers are one budget, shared memory the other: an H100 gives a program at most 227
# KiB (232,448 bytes, CUDA's ``sharedMemPerBlockOptin`` for compute capability 9.0); a
# program asking for more does not launch. The metadata's ``shared`` holds the buffers a
# program allocates, 8 bytes per mbarrier and what Triton adds (the arguments
# ``warp_specialize`` hands its worker warps, alignment): the chart splits it.

H100_SHARED_PER_PROGRAM = 232_448


def draw_shared_budget(programs):
    """programs: {name: (compiled kernel, {buffer: bytes})}, as stacked bars."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.8))
    for y, (name, (compiled, buffers)) in enumerate(programs.items()):
        parts = dict(buffers)
        parts["Triton's own"] = compiled.metadata.shared - sum(buffers.values())
        left = 0
        for part, size in parts.items():
            color = {"mbarriers": "C3", "Triton's own": "C7"}.get(part, "C0")
            ax.barh(y, size / 1024, left=left / 1024, color=color, edgecolor="white")
            left += size
        ax.text(left / 1024 + 2, y, f"{compiled.metadata.shared:,} bytes: "
                + ", ".join(f"{part} {size:,}" for part, size in parts.items()),
                va="center", fontsize=8)
    ax.axvline(H100_SHARED_PER_PROGRAM / 1024, color="black", linestyle="--")
    ax.set_yticks(range(len(programs)), list(programs))
    ax.set(xlabel="KiB of shared memory (dashed: an H100's 227 KiB per program)",
           xlim=(0, 240), title="Shared memory per program: buffers, mbarriers "
           "and Triton's own bytes")
    fig.tight_layout()
    plt.show()


if SHOW:
    tile = 64 * 64 * 2
    draw_shared_budget({
        "tma_copy_kernel": (copier, {"tile": tile, "mbarriers": 8}),
        "mma_kernel": (compile_mma(False), {"A and B": tile, "mbarriers": 8}),
        "ring_kernel, 1 group": (compile_ring(1), {"slots": 2 * tile, "mbarriers": 32}),
        "ring_kernel, 2 groups": (two_groups, {"slots": 4 * tile, "mbarriers": 32}),
    })  # fmt: skip

# %%
# On a Hopper GPU: every kernel against PyTorch
# ---------------------------------------------
# Each kernel on fresh random inputs against float64 PyTorch; the ring sums 9 tiles
# through 2 slots, several phases each. Without a Hopper GPU the cell says it skipped.


def check_on_gpu():
    generator = kit.fresh_generator()

    def randn(*shape, dtype=torch.float16):
        return torch.randn(*shape, generator=generator).to(kit.DEVICE, dtype)

    for name, fn, x in (("copy_kernel", copy, randn(10_000, dtype=torch.float32)),
                        ("tma_copy_kernel", tma_copy, randn(256, 512))):
        kit.expect_close(name, f"{tuple(x.shape)}", "the copy", fn(x), x, x.dtype, 0, 0)
    a, b = randn(64, 32), randn(32, 64)
    for in_registers in (False, True):
        kit.expect_close("mma_kernel", f"A in registers: {in_registers}", "A @ B",
                         mma(a, b, in_registers), a.double() @ b.double(),
                         torch.float32, 1e-4, 1e-4)
    for groups in (1, 2):
        x = randn(9 * 64 * groups, 64)
        kit.expect_close("ring_kernel", f"{groups} consumer group(s), 9 tiles",
                         "the sum", ring_sum(x, groups),
                         x.double().view(9, 64 * groups, 64).sum(0), torch.float32,
                         1e-5, 1e-5)
    print("Every primer kernel matches float64 PyTorch on fresh random inputs.")


if RUN:
    check_on_gpu()
elif __name__ == "__main__":
    print(f"Skipped, nothing run: {problem or why_not_run()}.")

# %%
# Exercises
# ---------
# Lesson 11's forward is these pieces at full size: TMA loads into a ring of K and V
# tiles, a producer warp, two consumer groups of ``wgmma``, and ``setmaxnreg``. The
# exercises change ``ring_kernel``; their checks compile it for ``sm_90a``, no GPU
# needed (on a Hopper GPU the first also runs it), and never print the number you look
# for. Write your attempt in a new cell at the end of this lesson's notebook, or in a
# file next to the lessons that does ``L09 = kit.load_lesson("09-gluon-primer")`` and
# uses its names (``L09.gl``, ``L09.check_ring_depth``...).
#
# 1. **A deeper ring.** Copy ``ring_kernel``, its producer and its consumer, and give
#    the ring ``STAGES`` slots (keep the argument names, which the check passes, and add
#    ``STAGES: gl.constexpr`` last; tile ``t`` goes to slot ``t % STAGES`` as use
#    ``t // STAGES``). With 128 x 128 fp16 tiles and two consumer groups, what is the
#    deepest ring one H100 program may have? Predict it from the chart, then run
#    ``check_ring_depth(my_ring_kernel, stages)``: it compiles your kernel at that depth
#    and one deeper and reads their shared memory.
# 2. **A busier producer.** A producer that computes addresses needs 56 registers, not
#    24. How many can the two consumer groups then ask for, both getting the same?
#    Counts are multiples of 8; the three warp groups split the program's launch budget
#    (its threads x ``.maxnreg``, printed above). Predict it, then run
#    ``check_busier_producer(count)``: it compiles ``ring_kernel`` with your count and
#    reads its PTX.


def _checkable(exercise, name, value, low, high, step=1):
    """Refuse a value that is no answer; False (saying why) if Gluon names moved."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high or value % step:
        raise ValueError(f"{name} must be a multiple of {step} from {low} to {high}, "
                         f"got {value}")
    problem = gluon_problem()
    if problem:
        print(f"{exercise}: cannot check with this Triton: {problem}")
    return problem is None


def _compiled_ring(exercise, **ring):
    """compile_ring(**ring); AssertionError, in the compiler's words, if it fails."""
    try:
        return compile_ring(**ring)
    except triton.CompilationError as error:
        cause = error.__cause__ or error  # the compiler's own message ends in "^"
        why = f"{type(cause).__name__}: {kit.error_summary(cause)}"
        raise AssertionError(f"{exercise}: the kernel does not compile for sm_90a: "
                             f"{why}") from None


def check_ring_depth(kernel, stages):
    """kernel: ring_kernel with a last argument STAGES; stages: the deepest ring of
    128 x 128 fp16 tiles, two consumer groups, that one H100 program may have."""
    exercise = "A deeper ring"
    if not _checkable(exercise, "stages", stages, 1, 64):
        return
    names = [*ring_kernel.arg_names, "STAGES"]  # compile_ring passes them by name
    if list(getattr(kernel, "arg_names", []))[:len(names)] != names:
        raise TypeError(f"kernel must be a @gluon.jit kernel whose arguments start "
                        f"{', '.join(names)}, as ring_kernel's; got {kernel!r}")
    shared = {depth: _compiled_ring(exercise, groups=2, kernel=kernel, cols=128,
                                    STAGES=depth).metadata.shared
              for depth in (stages, stages + 1)}
    if shared[stages + 1] - shared[stages] < 128 * 128 * 2:
        raise AssertionError(f"{exercise}: one stage more adds less shared memory "
                             "than a 128 x 128 fp16 tile: allocate STAGES slots")
    if shared[stages] > H100_SHARED_PER_PROGRAM:
        raise AssertionError(f"{exercise}: at STAGES = {stages} your program needs "
                             f"{shared[stages]:,} bytes of shared memory, more than "
                             f"an H100 gives one ({H100_SHARED_PER_PROGRAM:,})")
    if shared[stages + 1] <= H100_SHARED_PER_PROGRAM:
        raise AssertionError(f"{exercise}: STAGES = {stages} fits, and so does a "
                             "deeper ring")
    ran = "it needs a Hopper GPU to run"
    if why_not_run() is None:
        generator, tiles = kit.fresh_generator(), 3 * stages + 1  # around 3 times
        x = torch.randn(tiles * 128, 128, generator=generator).half().to(kit.DEVICE)
        expected = x.double().view(tiles, 128, 128).sum(0)
        got = ring_sum(x, 2, kernel=kernel, STAGES=stages)
        kit.expect_close(exercise, f"{tiles} tiles through {stages} slots", "the sum",
                         got, expected, torch.float32, 1e-4, 1e-3)
        ran = f"and on the GPU it sums {tiles} tiles right"
    print(f"{exercise}: STAGES = {stages} is the deepest ring that fits "
          f"({shared[stages]:,} bytes of shared memory); {ran}.")


def check_busier_producer(consumer_registers):
    """consumer_registers: what ring_kernel's two consumer groups may ask for, the
    producer asking for 56, so that both groups get the same count."""
    exercise = "A busier producer"
    if not _checkable(exercise, "consumer_registers", consumer_registers, 24, 256, 8):
        return
    compiled = _compiled_ring(exercise, groups=2, registers=(consumer_registers, 56))
    moves = partition_registers(compiled, [_ring_consumer, _ring_producer])
    if "_ring_consumer" not in moves:
        raise AssertionError(f"{exercise}: the compiled kernel has no setmaxnreg: "
                             "Triton drops it when the requests do not fit")
    other = moves["_ring_consumer"] - {consumer_registers}
    if other:
        more = "more" if min(other) > consumer_registers else "fewer"
        raise AssertionError(f"{exercise}: the default consumer group gets {more} "
                             f"registers than the {consumer_registers} you asked "
                             "for the other: the two groups differ")
    print(f"{exercise}: both consumer groups get {consumer_registers} registers, the "
          "producer 56, all within 65,536 (read from the compiled PTX).")
