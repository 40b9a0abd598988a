"""
Hopper: a warp-specialized forward in Gluon
===========================================

Lesson 06's portable FlashAttention-2 forward has every warp do everything in turn. FlashAttention-3
(Shah et al., 2024) gives a program's warps *roles*: one warp only loads, two warp groups only compute,
their matrix products overlapping the next block's exponentials. Here it is written for Hopper
(H100, H200) in Gluon, Triton's lower-level language, and measured beside the portable kernel and cuDNN.

You will learn:

* why "all warps, one step at a time" leaves the tensor cores idle, and which roles fix it;
* what Gluon lets a program say that Triton decides for itself: layouts, shared-memory buffers,
  TMA copies, mbarriers, asynchronous ``warpgroup_mma`` and ``warp_specialize``;
* how a ring of buffers and its mbarrier *phases* work, with a picture of who waits for what;
* how registers move between warps with ``setmaxnreg``;
* why one program per SM walks tile after tile, and how causal tiles in pairs keep programs evenly loaded;
* why fp8 needs V stored with the keys contiguous on Hopper, and what fp8 buys;
* how ``attention`` picks the Gluon or portable forward per case, from a table measured once, on an H100.

Lesson 12 splits this forward's calls into host and GPU time, and measures what one program per SM buys.
This lesson needs ``05-fused-attention-v1.py`` to ``07-fused-attention-v2-backward.py`` next to it (the
site's zip of all lessons has them) for lesson 07's backward and the earlier lessons' checks and
benchmark helpers. Where Gluon cannot run (a CPU, a GPU other than Hopper) it runs lesson 06's portable
forward: the page still shows the design and that kernel's numbers, and says why Gluon did not run.
"""

# %%
# Where the kernels run
# ---------------------
# A CUDA GPU when there is one, otherwise the Triton interpreter on the CPU, switched on before the
# first ``@triton.jit``. The interpreter cannot run Gluon: Gluon kernels run only compiled, on Hopper.

import functools
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

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


V2 = load_sibling("06-fused-attention-v2-forward")  # which loads 05-fused-attention-v1 in turn
V2_BWD = load_sibling("07-fused-attention-v2-backward")

# %%
# Who waits for whom in the portable forward
# ------------------------------------------
# In the portable kernel a program's 4 or 8 warps do everything in turn per key block: issue the next
# loads, wait for :math:`S = QK_j^T` on the tensor cores, compute exponentials on the ordinary cores
# (tensor cores idle), wait for :math:`O \mathrel{+}= P_j V_j`. Triton pipelines loads and overlaps some
# of this, but it stays "all warps, one step at a time". cuDNN and FlashAttention-3 assign roles:
#
# * **A producer warp** only issues bulk asynchronous copies (Hopper's Tensor Memory Accelerator, TMA)
#   of K and V tiles into a ring of shared-memory buffers, each with two *mbarriers* (shared-memory
#   counters the hardware completes): "full" once the copy lands, "empty" once all consumers are done.
# * **Two consumer warp groups** (4 warps, 128 threads each) own 64 query rows each and never load:
#   while one computes exponentials, the other's matrix products can run.
# * **Registers move to the work.** ``setmaxnreg`` lets the loader (one of 4 + 4 + 1 = 9 warps) keep 24
#   per thread, handing the rest over: up to 240 per consumer thread, for its :math:`S` and :math:`O`.
# * **Overlap inside each consumer.** ``wgmma``, Hopper's tensor-core instruction, is asynchronous: a
#   consumer issues :math:`S_{j+1} = QK_{j+1}^T` and :math:`O \mathrel{+}= P_j V_j`, waits only for the
#   first, and computes block :math:`j+1`'s exponentials while :math:`P_j V_j` runs.
#
# The picture is a schedule, not a measurement: one program's first key blocks in the kernel's order.


def draw_roles(blocks=4):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    lanes = {"loader warp": 2.0, "consumer group 0": 1.0, "consumer group 1": 0.0}
    tensor, alu, copy = "#3b7dd8", "#e4a23c", "#7f7f7f"
    for j in range(blocks + 1):
        if j < blocks:
            ax.broken_barh([(j * 3.0, 1.2), (j * 3.0 + 1.3, 1.2)], (lanes["loader warp"] - 0.3, 0.6), color=copy)
            ax.text(j * 3.0 + 0.6, 2.0, f"K{j}", ha="center", va="center", fontsize=10, color="white")
            ax.text(j * 3.0 + 1.9, 2.0, f"V{j}", ha="center", va="center", fontsize=10, color="white")
        for lane, offset in (("consumer group 0", 1.4), ("consumer group 1", 2.4)):
            t, y = j * 3.0 + offset, lanes[lane]
            if j < blocks:
                ax.broken_barh([(t, 0.8)], (y - 0.3, 0.6), color=tensor)
                ax.text(t + 0.4, y, f"S{j}", ha="center", va="center", fontsize=10, color="white")
                ax.broken_barh([(t + 0.85, 1.1)], (y - 0.3, 0.6), color=alu)
                ax.text(t + 1.4, y, f"exp{j}", ha="center", va="center", fontsize=10)
            if j > 0:  # P_{j-1} V_{j-1} runs on the tensor cores while exp_j runs
                ax.broken_barh([(t + 0.85, 1.1)], (y - 0.42, 0.12), color=tensor)
                ax.text(t + 1.4, y - 0.55, f"P{j - 1}V{j - 1}", ha="center", va="center", fontsize=10)
    ax.set_yticks(list(lanes.values()), list(lanes.keys()), fontsize=10)
    ax.set(xticks=[], ylim=(-0.8, 2.5))
    ax.set_xlabel("time (illustrative)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (copy, tensor, alu)]
    ax.legend(handles, ["TMA copy into a buffer", "tensor cores (wgmma)", "exponentials (ordinary cores)"],
              loc="upper center", bbox_to_anchor=(0.5, 1.22), ncol=3, fontsize=10, frameon=False)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    draw_roles()

# %%
# A ring of buffers, and the phases of its barriers
# -------------------------------------------------
# Block :math:`j` of K or V goes into buffer :math:`j \bmod \mathrm{STAGES}` of a ring, as that buffer's use
# number :math:`u = \lfloor j / \mathrm{STAGES} \rfloor`; each use completes the buffer's "full" and "empty"
# barriers once.
# An mbarrier remembers only the *parity* of its completed uses (its phase), and a wait names a parity:
# the consumer waits for "full" to reach :math:`u \bmod 2`; the loader, before refilling, waits for
# "empty" to show the previous use consumed, the opposite parity. A fresh barrier counts as having
# completed parity 1, so the loader's first wait on each buffer passes at once. ``ring_slot`` computes
# what the kernel does; the picture draws it. (The kernel numbers key blocks across a program's tiles,
# not from zero in each: see "One program per SM".)


def ring_slot(j, stages):
    """(buffer, parity the consumer waits for on "full", parity the loader waits for on "empty") of block j."""
    phase = (j // stages) & 1
    return j % stages, phase, phase ^ 1


def draw_ring(blocks=6, stages=2):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    for j in range(blocks):
        buffer, full, empty = ring_slot(j, stages)
        ax.add_patch(plt.Rectangle((j, buffer), 0.92, 0.9, color=["#3b7dd8", "#e4a23c", "#2ca02c"][buffer % 3]))
        ax.text(j + 0.46, buffer + 0.45, f"block {j}\nfull: wait {full}\nempty: wait {empty}", ha="center",
                va="center", fontsize=10, color="white")
    ax.set(xlim=(0, blocks), ylim=(stages, 0), xticks=[])
    ax.set_yticks([b + 0.45 for b in range(stages)], [f"buffer {b}" for b in range(stages)], fontsize=10)
    ax.set_xlabel("key blocks, in the order the loader fills them", fontsize=10)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    draw_ring()

# %%
# Why Gluon
# ---------
# Triton's compiler decides which warps do what, and on Hopper its automatic warp specialization
# (``tl.range(..., warp_specialize=True)``) does not find this schedule. Gluon lets the program say it:
# explicit layouts, shared-memory buffers, mbarriers, TMA copies, asynchronous ``warpgroup_mma``, and
# ``warp_specialize``, which runs one function in the program's own 4 warps (the first consumer) and
# others in extra warps (the second consumer, the loader). Gluon is experimental: Triton 3.6's TMA copy
# ``async_copy_global_to_shared`` is renamed ``async_load`` in later releases, and the lesson takes whichever
# exists. Also:
#
# * TMA copies 4-D boxes (1 batch, 1 head, 64 or 128 rows, :math:`D`) out of (B, H, N, D) tensors of any
#   strides, zero-filling rows past :math:`N`: any length and transposed inputs work, and only the last,
#   ragged key block is masked. It needs the last dimension contiguous, other strides positive multiples
#   of 16 bytes (not a head broadcast by ``expand``, stride 0); others take the portable kernel.
# * The tiles are fixed, not autotuned, as the TMA boxes and barriers are sized with them: 128 queries
#   (two halves of 64) by 128 keys, 2 buffers each for K and V; at :math:`D = 128`, 32 KiB of Q and
#   128 KiB of K and V in shared memory. The engineering notes record other shapes and buffer counts.
# * O leaves through a new layout: ``warpgroup_mma``'s accumulator gives each thread pairs of adjacent
#   values over eight rows (4-byte stores); 8 adjacent values (16 bytes) per thread and whole rows per
#   warp give wide, coalesced stores. On an H100 (2026-11-23, engineering notes, not this page) that alone
#   made the kernel 12% faster by GPU time at :math:`D = 128`, N = 1024, unmasked (462 to 517 TFLOP/s),
#   and left long sequences unchanged: the epilogue runs once per tile, so it weighs most where a tile has
#   few key blocks, at short sequences.

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

# %%
# One program per SM
# ------------------
# At :math:`N = 1024` a tile of 128 queries meets only 8 key blocks, so a one-tile program would spend
# much of its life starting (loading Q, waiting for the first K) and finishing (the last product,
# dividing by the row sums, storing O), tensor cores idle. So the kernel is *persistent*: one program
# per SM, program ``pid`` taking tiles (causal: pairs) ``pid``, ``pid + programs``, and so on. Hence:
#
# * The ring runs on across tiles: loader and consumers count the program's key blocks (``used``), and
#   each barrier's phase is wherever the previous tile left it.
# * Q has barriers of its own, released by the consumers after their last product with it: the loader
#   fetches the next tile's Q and first K and V while they finish the previous tile.
# * Causal query block :math:`m` loads :math:`m + 1` key blocks, so round robin would give some programs
#   mostly long tiles. Blocks :math:`m` and :math:`n_m - 1 - m` (of :math:`n_m`) together load
#   :math:`n_m + 1`: each program takes whole pairs, all of one cost (for odd :math:`n_m` the middle
#   block is a pair by itself, at half the cost).
#
# Consecutive tiles share a head, so programs running at once share its K and V through L2, as with one
# program per tile. Lesson 12 measures what persistence buys, against this kernel run one per tile.

WS_HEAD_DIMS = (64, 128)
WS_BLOCK_M, WS_BLOCK_N, WS_STAGES = 128, 128, 2
WS_CONSUMER_REGISTERS, WS_LOADER_REGISTERS = 240, 24


@gluon.jit
def _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    if MASKED:
        if CAUSAL:
            valid = cols[None, :] <= rows[:, None]
        else:
            valid = cols[None, :] < N
        s = gl.where(valid, s * qk_scale, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        s = s - m_new[:, None]
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        s = s * qk_scale - m_new[:, None]
    p = gl.exp2(s)
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _ws_tile(k, pid, programs, n_m, CAUSAL: gl.constexpr):
    """(query block, batch * head, whether to run it) of the k-th tile of program pid."""
    if CAUSAL:
        # Whole pairs (m, n_m - 1 - m), the heavy tile first; when n_m is odd the middle block pairs with itself.
        pairs = (n_m + 1) // 2
        pair = pid + (k // 2) * programs
        light = pair % pairs
        heavy = n_m - 1 - light
        return gl.where(k % 2 == 0, heavy, light), pair // pairs, (k % 2 == 0) | (light != heavy)
    else:
        t = pid + k * programs  # consecutive tiles share a head, so the programs running at once share its K, V
        return t % n_m, t // n_m, t >= 0  # every tile runs; a tensor like the causal case's answer


@gluon.jit
def _ws_tile_count(pid, programs, n_m, BH, CAUSAL: gl.constexpr):
    if CAUSAL:
        return 2 * gl.cdiv((n_m + 1) // 2 * BH - pid, programs)
    else:
        return gl.cdiv(n_m * BH - pid, programs)


@gluon.jit
def _ws_key_blocks(start_m, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(key blocks that need no mask, key blocks to load) for query block start_m."""
    if CAUSAL:
        n_full = start_m * (BLOCK_M // BLOCK_N)  # key blocks wholly below the diagonal
        return n_full, gl.minimum(n_full + BLOCK_M // BLOCK_N, gl.cdiv(N, BLOCK_N))
    else:
        return N // BLOCK_N, gl.cdiv(N, BLOCK_N)


@gluon.jit
def _ws_loader(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
               pid, programs, n_m, BH, H, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr):
    half: gl.constexpr = desc_q.block_type.shape[2]
    used = 0  # key blocks loaded by this program so far: the ring runs on across tiles
    tiles = 0
    for k in range(_ws_tile_count(pid, programs, n_m, BH, CAUSAL)):
        start_m, bh, run = _ws_tile(k, pid, programs, n_m, CAUSAL)
        if run:
            b = bh // H
            h = bh % H
            n_full, n_blocks = _ws_key_blocks(start_m, N, BLOCK_M, BLOCK_N, CAUSAL)
            # The next tile's Q waits only until both consumers have issued their last product with this one.
            mbarrier.wait(q_empty, (tiles & 1) ^ 1)
            mbarrier.expect(q_full, 2 * desc_q.block_type.nbytes)
            _tma_load(desc_q, [b, h, start_m * BLOCK_M, 0], q_full, q_smem.index(0))
            _tma_load(desc_q, [b, h, start_m * BLOCK_M + half, 0], q_full, q_smem.index(1))
            for j in range(n_blocks):
                stage = (used + j) % STAGES
                phase = ((used + j) // STAGES) & 1
                # K and V have their own barriers: a consumer is done with K_j long before V_j.
                mbarrier.wait(k_empty.index(stage), phase ^ 1)
                mbarrier.expect(k_full.index(stage), desc_k.block_type.nbytes)
                _tma_load(desc_k, [b, h, j * BLOCK_N, 0], k_full.index(stage), k_smem.index(stage))
                mbarrier.wait(v_empty.index(stage), phase ^ 1)
                mbarrier.expect(v_full.index(stage), desc_v.block_type.nbytes)
                _tma_load(desc_v, [b, h, j * BLOCK_N, 0], v_full.index(stage), v_smem.index(stage))
            used += n_blocks
            tiles += 1


@gluon.jit
def _ws_consumer(HALF: gl.constexpr, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, O,
                 LSE, qk_scale, pid, programs, n_m, BH, H, N, sob, soh, son, D: gl.constexpr, CAUSAL: gl.constexpr,
                 ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    # One warp group's wgmma accumulator layouts for S (ROWS x BLOCK_N) and O (ROWS x D); P as PV's register operand.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    # The 16-byte, coalesced store layout of "Why Gluon" (the compiler converts to it through shared memory).
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(HALF).reshape([ROWS, D])
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    used = 0
    tiles = 0
    for k in range(_ws_tile_count(pid, programs, n_m, BH, CAUSAL)):
        start_m, bh, run = _ws_tile(k, pid, programs, n_m, CAUSAL)
        if run:
            n_full, n_blocks = _ws_key_blocks(start_m, N, 2 * ROWS, BLOCK_N, CAUSAL)
            rows = start_m * 2 * ROWS + HALF * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
            m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([ROWS, D], gl.float32, o_layout)

            # Block 0: S_0 and its exponentials, before the loop's steady state.
            mbarrier.wait(q_full, tiles & 1)
            ks = used % STAGES
            mbarrier.wait(k_full.index(ks), (used // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(ks).reshape([BLOCK_N, D]).permute((1, 0)), zeros, use_acc=False)
            mbarrier.arrive(k_empty.index(ks), count=1)
            if n_blocks == 1:
                mbarrier.arrive(q_empty, count=1)
            if n_full == 0:
                p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, True, CAUSAL)
            else:
                p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, False, CAUSAL)
            for j in range(1, n_blocks):
                ks = (used + j) % STAGES
                mbarrier.wait(k_full.index(ks), ((used + j) // STAGES) & 1)
                s_next = warpgroup_mma(q, k_smem.index(ks).reshape([BLOCK_N, D]).permute((1, 0)), zeros,
                                       use_acc=False, is_async=True)
                vs = (used + j - 1) % STAGES
                mbarrier.wait(v_full.index(vs), ((used + j - 1) // STAGES) & 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                o_next = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, D]), acc, is_async=True)
                # wgmma groups finish in order: "at most 1 in flight" means S_j is ready, P_{j-1} V_{j-1} may run on.
                s = warpgroup_mma_wait(1, deps=[s_next])
                mbarrier.arrive(k_empty.index(ks), count=1)
                if j == n_blocks - 1:
                    mbarrier.arrive(q_empty, count=1)  # the tile's last product with Q is done
                if j >= n_full:
                    p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols + j * BLOCK_N, N, True,
                                                          CAUSAL)
                else:
                    p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, False, CAUSAL)
                acc, p_op = warpgroup_mma_wait(0, deps=[o_next, p_op])
                mbarrier.arrive(v_empty.index(vs), count=1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            vs = (used + n_blocks - 1) % STAGES
            mbarrier.wait(v_full.index(vs), ((used + n_blocks - 1) // STAGES) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(vs).reshape([BLOCK_N, D]), acc)
            mbarrier.arrive(v_empty.index(vs), count=1)
            used += n_blocks
            tiles += 1

            # While this epilogue runs, the loader is already filling Q and K of the program's next tile.
            gl.store(LSE + bh * N + rows, m_i + gl.log2(l_i), mask=rows < N)
            o = (acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]).to(O.dtype.element_ty)
            o = gl.convert_layout(o, store_layout)
            o_rows = start_m * 2 * ROWS + HALF * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, store_layout))
            o_cols = gl.arange(0, D, gl.SliceLayout(0, store_layout))
            # The pointer offset is 64-bit: it can pass 2**31 elements.
            o_ptrs = (O + (bh // H).to(gl.int64) * sob + (bh % H).to(gl.int64) * soh + o_rows[:, None] * son
                      + o_cols[None, :])
            gl.store(o_ptrs, o, mask=o_rows[:, None] < N)


@gluon.jit
def _ws_barrier_ring(STAGES: gl.constexpr, ARRIVALS: gl.constexpr):
    """STAGES mbarriers in shared memory, one per buffer of a ring, each completing after ARRIVALS arrivals."""
    ring = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ring.index(s), count=ARRIVALS)
    return ring


@gluon.jit
def attn_fwd_ws_kernel(desc_q, desc_k, desc_v, O, LSE, qk_scale, H, BH, N, sob, soh, son,
                       D: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_m = gl.cdiv(N, BLOCK_M)
    dtype: gl.constexpr = desc_q.dtype
    # Leading 1, 1: the TMA boxes are 4-D (batch, head, rows, D); the consumers view them as 2-D.
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M // 2, D], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_v.layout)
    q_full = _ws_barrier_ring(1, 1).index(0)
    q_empty = _ws_barrier_ring(1, 2).index(0)  # one arrival from each consumer
    k_full = _ws_barrier_ring(STAGES, 1)
    v_full = _ws_barrier_ring(STAGES, 1)
    k_empty = _ws_barrier_ring(STAGES, 2)
    v_empty = _ws_barrier_ring(STAGES, 2)
    # Argument tuples are written out in the call: one stored in a variable first turns its constexprs run-time.
    gl.warp_specialize([
        (_ws_consumer, (0, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, O, LSE,
                        qk_scale, pid, programs, n_m, BH, H, N, sob, soh, son, D, CAUSAL, BLOCK_M // 2, BLOCK_N,
                        STAGES)),
        (_ws_consumer, (1, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, O, LSE,
                        qk_scale, pid, programs, n_m, BH, H, N, sob, soh, son, D, CAUSAL, BLOCK_M // 2, BLOCK_N,
                        STAGES)),
        (_ws_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                      v_empty, pid, programs, n_m, BH, H, N, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


def tma_loadable(t):
    """Whether TMA can copy boxes of t: the strides "Why Gluon" asks for (no broadcast stride 0), aligned data."""
    return (t.stride(-1) == 1 and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0)


def warp_specialized_unsupported(q, k, v, sm_scale=1.0):
    """Why the warp-specialized kernels cannot take these inputs here, or None when they can."""
    if not ON_GPU or V2._capability(q.device)[0] != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if q.dtype not in V2.V1.SUPPORTED_DTYPES:
        return f"it takes float16 or bfloat16, not {q.dtype}"
    if q.shape[-1] not in WS_HEAD_DIMS:
        return f"it takes head dims {WS_HEAD_DIMS}, not {q.shape[-1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not tma_loadable(t):
            return (f"TMA copies need {name}'s last dimension contiguous, its other strides positive multiples of "
                    f"16 bytes and its data 16-byte aligned; it has strides {t.stride()}")
    if sm_scale < 0:  # _ws_softmax_step scales the row maximum, which is the scaled maximum only for sm_scale >= 0
        return "it takes sm_scale >= 0"
    return None


@functools.lru_cache
def _ws_box_layout(rows, D, dtype):
    """The shared-memory layout of one TMA box, (1, 1, rows, D); cached, as computing it costs host time."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, D], gl.float16 if dtype == torch.float16 else gl.bfloat16)


class CheckedDescriptor(TensorDescriptor):
    """A TensorDescriptor without its checks of alignment, strides and box, which cost host time on every call
    (lesson 12): the launchers describe only tensors they allocated or warp_specialized_unsupported accepted."""

    def __post_init__(self):
        pass


def _ws_descriptor(t, rows):
    """A TMA descriptor for (1, 1, rows, D) boxes of a (B, H, N, D) tensor, with whatever strides it has."""
    D = t.shape[-1]
    return CheckedDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, D], _ws_box_layout(rows, D, t.dtype))


@functools.lru_cache
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _ws_forward(q, k, v, o, lse, causal, sm_scale, programs=None):
    """The persistent kernel, with one program per SM unless programs says how many."""
    B, H, N, D = q.shape
    n_m = V2.host_cdiv(N, WS_BLOCK_M)
    work = (n_m + 1) // 2 * B * H if causal else n_m * B * H  # pairs of tiles, or tiles
    programs = min(programs or _sm_count(q.device.index), work)
    # Lesson 06's launch plans ("The launcher"): the descriptors hold this call's tensors, so they are passed afresh.
    V2.launch_planned(
        V2.plan_key(q, k, v), attn_fwd_ws_kernel, (programs,), 6,
        (_ws_descriptor(q, WS_BLOCK_M // 2), _ws_descriptor(k, WS_BLOCK_N), _ws_descriptor(v, WS_BLOCK_N), o, lse,
         sm_scale * V2.LOG2E, H, B * H, N, *o.stride()[:3]),
        dict(D=D, CAUSAL=causal, BLOCK_M=WS_BLOCK_M, BLOCK_N=WS_BLOCK_N, STAGES=WS_STAGES,
             CONSUMER_REGISTERS=WS_CONSUMER_REGISTERS, LOADER_REGISTERS=WS_LOADER_REGISTERS), num_warps=4)


# %%
# The launcher and autograd
# -------------------------
# Neither forward wins everywhere: the Gluon call's three TMA descriptors cost host time, and its one
# tile shape is not the best at every head dimension and length, where the portable kernel runs the
# tiles measured for the case. So ``attention`` follows ``FORWARD_PATHS``, from the sweep that tuned
# lesson 06's tiles (``python tools/tune.py attention``): it timed both forwards as a user calls them,
# each as the slower of its GPU time and the host's time to enqueue a call (back to back, as in
# training, the slower sets the pace), and kept the faster per case. At :math:`N = 1024` the Gluon
# call's host time is about its GPU time or more (lesson 12 measures both), so the portable call,
# lighter on the host, can win with more GPU time. The sweep ran before this build: lesson 06's
# ``TUNED_ON`` says on which GPU, and the comment above the table which rows ``tools/tune.py
# attention-paths`` measured again later. This page's benchmark
# hides host time that the table counts (lesson 12 shows how), so the two can disagree at the shortest
# lengths and where two paths are close; the last line under "Reading the numbers" counts where they
# agree. ``warp_specialized=None`` runs the table's path (Gluon where it can, in cases the table does
# not cover), ``True`` insists on Gluon (an error says why when it cannot run), ``False`` asks for the
# portable kernel. Both forwards write the same output and :math:`\mathrm{LSE}_2`, so the backward is
# lesson 07's two-pass one either way (lesson 13 replaces it on Hopper).

# BEGIN tools/tune.py forward paths: written by the sweep; run it again rather than edit these lines.
# N = 1024, 2048: tools/tune.py attention-paths, 2026-11-26, NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0
FORWARD_PATHS = V2.by_bucket({
    (64, False): ['gluon', 'gluon', 'gluon', 'gluon', 'gluon'],
    (64, True): ['portable', 'gluon', 'gluon', 'gluon', 'gluon'],
    (128, False): ['gluon', 'gluon', 'gluon', 'gluon', 'gluon'],
    (128, True): ['portable', 'gluon', 'gluon', 'gluon', 'gluon'],
})
# END tools/tune.py forward paths


class _AttentionHopperForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, warp_specialized):
        if warp_specialized:
            B, H, N, D = q.shape
            o = torch.empty_like(q, memory_format=torch.contiguous_format)
            lse = torch.empty((B * H, N), dtype=torch.float32, device=q.device)
            _ws_forward(q, k, v, o, lse, causal, sm_scale)
        else:
            o, lse = V2.forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = V2.resolved_gradient(do)
        return *V2_BWD.backward(q, k, v, o, do, lse, ctx.causal, ctx.sm_scale, False), None, None, None


def gluon_allowed(q, k, v, warp_specialized, sm_scale):
    """Whether the Gluon kernels may run: False when asked not to or when they cannot (a ValueError that
    says why if warp_specialized=True insists)."""
    if warp_specialized is False:
        return False
    reason = warp_specialized_unsupported(q, k, v, sm_scale)
    if reason and warp_specialized:
        raise ValueError(f"warp_specialized=True, but the warp-specialized kernels cannot run here: {reason}")
    return reason is None


def check_flag(name, value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None, True or False, got {value!r}")


def forward_choice(q, causal, warp_specialized, gluon):
    """Whether to run the Gluon forward: the faster one measured for this case, unless the caller chose.
    gluon() gives gluon_allowed's answer, asked only when neither the table nor the caller settles it."""
    return bool(warp_specialized or FORWARD_PATHS.get(V2.tuned_case(q, causal), "gluon") == "gluon") and gluon()


def use_warp_specialized(q, k, v, causal, sm_scale, warp_specialized):
    check_flag("warp_specialized", warp_specialized)
    return forward_choice(q, causal, warp_specialized, lambda: gluon_allowed(q, k, v, warp_specialized, sm_scale))


def attention(q, k, v, causal, sm_scale, warp_specialized=None):
    """softmax(q k^T * sm_scale) v with the faster of the warp-specialized forward (Hopper) and the portable
    one for the case, and the portable two-pass backward. warp_specialized=True or False picks the forward."""
    V2.check_inputs(q, k, v, causal, sm_scale)
    q, k, v = V2.resolved(q, k, v)
    ws = use_warp_specialized(q, k, v, causal, sm_scale, warp_specialized)
    return _AttentionHopperForward.apply(q, k, v, causal, float(sm_scale), ws)


# %%
# Correctness
# -----------
# The forward and the gradients through it against float64 PyTorch on fresh random inputs: both head
# dims, both dtypes, causal and not, at a length no block size divides (1,000 on a GPU). Where Gluon
# cannot run, the same checks run the portable fallback, and the first line printed says which ran.


def check_every_case(checked, lesson):
    """Lesson 05's check_against_float64 of `checked` in the cases above, compiled ahead (lesson 05's
    compile_ahead); prints each case's errors. Lesson 13 checks its backward with it too."""
    N = 1000 if ON_GPU else 65
    cases = {(D, dtype, causal): [torch.randn(2, 3, N, D, device=DEVICE, dtype=dtype) for _ in range(3)]
             for D in (64, 128) for dtype in (torch.float16, torch.bfloat16) for causal in (False, True)}
    V2.V1.compile_ahead(lambda: [V2.V1.forward_and_backward(checked, *qkv, causal, D ** -0.5)
                                 for (D, _, causal), qkv in cases.items()])
    for (D, dtype, causal), (q, k, v) in cases.items():
        label = f"{lesson}, D={D}, {dtype}, causal={causal}"
        errors = V2.check_against_float64(checked, q, k, v, causal, D ** -0.5, label,
                                          tolerance=1e-2 if dtype == torch.float16 else 3e-2)
        print(f"{label}, N={N}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


if __name__ == "__main__":
    torch.manual_seed(0)
    probe = torch.empty(1, 1, 8, 64, dtype=torch.float16, device=DEVICE)
    reason = warp_specialized_unsupported(probe, probe, probe)
    print("The Gluon forward runs here." if reason is None else "The Gluon forward did not run on this machine: "
          f"{reason}. The checks and timings below are of the portable fallback (lesson 06's kernel).")
    # At this length the tables pick lesson 06's kernel in some cases (lesson 06 checks it): insist on Gluon.
    check_every_case(functools.partial(attention, warp_specialized=None if reason else True), "11-hopper-forward-gluon")

# %%
# fp8 on Hopper: the layout of V
# -------------------------------
# Hopper's tensor cores (and Ada's) also multiply 8-bit floats, by the datasheets at twice the fp16 rate
# (the benchmark below measures what lesson 06's kernel gets of it), and an 8-bit tile is half the bytes
# to load. Lesson 06's portable forward takes ``float8_e5m2`` inputs as they are: ``tl.dot`` of two fp8
# tiles accumulates in fp32, :math:`P` is cast to V's dtype before the second product, the output is
# fp16. What must change is the layout. ``wgmma`` takes an 8-bit tile from shared memory only with the
# *reduction* axis contiguous (16-bit tiles either way round), and reduces over at least 32 values, so
# head dims below 32 are refused. :math:`QK^T` reduces over the head dimension, contiguous in Q and K as
# usually stored; :math:`PV` over the keys, but a (B, H, N, D) tensor stores each key's D values
# together, so the compiler transposes every V tile (its cost on an H100: engineering notes).
#
# The fix: V with the sequence axis contiguous. The kernel takes any strides (Triton reads the
# contiguous axis from them), so it needs no change; the launcher makes that copy when given another
# layout, and ``keys_contiguous`` shows how code quantizing V to fp8 anyway can write the layout in the
# cast for free. With e5m2's two mantissa bits the check compares against float64 attention *on the same
# fp8 inputs*, to measure the kernel (:math:`P` rounded to fp8 included), not the inputs' rounding.

if __name__ == "__main__":
    if V2.V1.fp8_supported():
        N, D = 1000, 64
        q8, k8 = (torch.randn(2, 3, N, D, device=DEVICE).to(torch.float8_e5m2) for _ in range(2))
        v8 = V2.keys_contiguous(torch.randn(2, 3, N, D, device=DEVICE), torch.float8_e5m2)
        for causal in (False, True):
            out = V2.attention(q8, k8, v8, causal, D ** -0.5)
            ref = V2.reference_attention(q8.double(), k8.double(), v8.double(), causal, D ** -0.5)
            error = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            print(f"fp8 forward, causal={causal!s:5}, N={N}: max error {error:.1e} of the largest output")
            # P is rounded to e5m2 before the second product; a wrong layout of V gives errors near 1.
            if not (torch.isfinite(out).all() and error < 0.1):
                raise AssertionError(f"11-hopper-forward-gluon: fp8 forward is off, error {error:.2e}")
    else:
        print("fp8 forward skipped: it needs a GPU with fp8 tensor cores (compute capability 8.9 or newer).")

# %%
# Benchmark
# ---------
# The forward in TFLOP/s at lesson 06's sizes against the portable kernel and SDPA's backends, all
# measured in this run the same way (on a GPU each provider timed twice, in two passes over the cases,
# more often where the two disagree, the fastest kept), with the fp16 matrix-multiply rate measured now
# as the ceiling (lesson 06's fp8 forward, also shown, can pass it). Under the interpreter lessons 06
# and 06's kernels stand in for Gluon's, against SDPA's math backend.

WS = "Triton, warp-specialized (Gluon)"
PORTABLE = "Triton v2 (lessons 06, 07)"
ATOMIC = V2_BWD.ATOMIC  # lesson 07's atomic backward, which lesson 13's table may choose
DEFAULT = "Triton, default path"
FP8 = "Triton v2 fp8"


def portable_and_sdpa(causal, D):
    """Lessons 06 and 07's kernels and SDPA's backends: what both Hopper lessons measure themselves against."""
    scale = D ** -0.5
    return {PORTABLE: lambda q, k, v: V2_BWD.attention(q, k, v, causal, scale),
            **V2.sdpa_providers(causal, scale, V2.PEERS)}


def hopper_benchmark(mode, extra_providers, title):
    """Lesson 06's cases in one mode (fwd or bwd), plotted: (results, table, peak, cases, sizes)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    cases, sizes, peak = V2.CASES, V2.SIZES, V2.matmul_tflops()
    print(f"{V2.V1.CEILING_NAME}, measured now: {peak:.3g} TFLOP/s")
    results = pd.DataFrame(V2.run_benchmark(cases, sizes, portable_and_sdpa, (mode,), extra_providers))
    table = results.pivot_table(index=["D", "causal", "mode", "N"], columns="provider", values="value", sort=False)
    V2.plot_mode(table, mode, peak, title + (" on this GPU" if ON_GPU else " on the interpreter"))
    plt.show()
    return results, table, peak, cases, sizes


def against_portable(table, peak, portable_name):
    """One line per (head dim, masking): Gluon against SDPA and the portable kernel, or else the portable one."""
    peers = [c for c in V2.PEERS if c in table]
    for (D, causal, _), part in table.groupby(level=["D", "causal", "mode"], sort=False):
        best_peer = part[peers].max(axis=1)
        line = f"D={D:3d} {'causal    ' if causal else 'non-causal'}: "
        if WS in part:
            ws, portable = part[WS] / best_peer, part[WS] / part[PORTABLE]
            line += (f"Gluon is {ws.min():.2f}x to {_below_one(ws.max())} the fastest SDPA backend and "
                     f"{portable.min():.2f}x to {portable.max():.2f}x {portable_name} (faster at "
                     f"{(portable > 1).sum()} of {len(portable)} sizes), up to {part[WS].max() / peak:.0%} of the "
                     "matmul rate")
        else:
            ratio = part[PORTABLE] / best_peer
            line += f"{portable_name} is {ratio.min():.2f}x to {_below_one(ratio.max())} the fastest SDPA backend"
        print(line)
    return peers


def _below_one(ratio):
    """"0.998x" rather than "1.00x" for a ratio just under 1, which the count of cases at or above 1 leaves out."""
    digits = 2
    while float(f"{ratio:.{digits}f}") >= 1 > ratio and digits < 6:
        digits += 1
    return f"{ratio:.{digits}f}x"


def default_path(results, table, provider_of, peers, paths):
    """The default path's rows, the measurements of provider_of(D, causal, N), which ``attention`` runs by
    default there (paths names the table it follows), and a line that reads them."""
    rows = [dict(row, provider=DEFAULT) for row in results.drop(columns="spread").to_dict("records")
            if row["provider"] == provider_of(row["D"], row["causal"], row["N"])]
    chosen = {(row["D"], row["causal"], row["mode"], row["N"]): row["value"] for row in rows}
    ratio = [value / table.loc[case, peers].max() for case, value in chosen.items()]
    candidates = [c for c in (WS, PORTABLE, ATOMIC) if c in table]
    faster = sum(value >= table.loc[case, candidates].max() for case, value in chosen.items())
    print(f"The default path ({paths}'s choice at each case) ran at {min(ratio):.2f}x to {_below_one(max(ratio))} the "
          f"fastest SDPA backend, at or above it at {sum(r >= 1 for r in ratio)} of {len(ratio)} cases; {paths}'s "
          f"choice was the fastest of {', '.join(candidates)} in this run at {faster} of {len(chosen)} cases.")
    return rows


def default_forward(D, causal, N):
    """Which provider of this page ``attention`` runs by default for a (B, H, N, D) fp16 input."""
    q = torch.empty(1, 1, N, D, dtype=torch.float16, device=DEVICE)
    return WS if use_warp_specialized(q, q, q, causal, D ** -0.5, None) else PORTABLE


def hopper_providers(q, k, v, causal, D):
    """The Gluon forward where it runs; lesson 06's fp8 forward, on fp8 copies, where the GPU has fp8 tensor cores."""
    providers = {}
    if warp_specialized_unsupported(q, k, v) is None:
        providers[WS, "fwd"] = functools.partial(attention, causal=causal, sm_scale=D ** -0.5, warp_specialized=True)
    if V2.V1.fp8_supported():
        q8, k8 = (t.detach().to(torch.float8_e5m2) for t in (q, k))
        v8 = V2.keys_contiguous(v.detach(), torch.float8_e5m2)  # the layout, written by the cast
        providers[FP8, "fwd"] = lambda *_: V2.attention(q8, k8, v8, causal, D ** -0.5)
    return providers


# %%
# What produced the numbers below (the plot comes from the same run):

if __name__ == "__main__":
    print(V2.describe_platform())

# %%
# The plot, the ceiling measured for it, then the table in TFLOP/s:

if __name__ == "__main__":
    results, table, peak, cases, sizes = hopper_benchmark("fwd", hopper_providers, "Forward pass")
V2.results_table(results) if __name__ == "__main__" else None

# %%
# Reading the numbers
# -------------------
# From this run's table. Expect :math:`D = 64` further below the matmul rate than :math:`D = 128`, for
# cuDNN too. A score costs one exponential and :math:`4D` FLOPs of matrix products; the FlashAttention-3
# paper gives the H100 SXM5 989 TFLOP/s of fp16 products against 3.9 T exponentials per second, about
# 254 FLOPs per exponential. At :math:`D = 64` (256 FLOPs per score) the exponentials take as long as
# the products, at :math:`D = 128` half as long, so at 64 the speed rests on how well the two overlap.
# An Nsight Compute profile at :math:`N = 4096` (engineering notes; an H200, not this build) found the
# tensor cores busy about half the time at :math:`D = 64` in this kernel and cuDNN's alike, and at
# :math:`D = 128` 76% to 79% (ours) against 70% to 75% (cuDNN's). The matmul rate, measured once per
# page after a second of warm-up, differs by a few percent between the pages of one build (compare the
# attention lessons' ceilings): a kernel within a few percent of it, or past it, is at the ceiling.

if __name__ == "__main__":
    peers = against_portable(table, peak, "lesson 06's kernel")
    if FP8 in table:
        fp8 = (table[FP8] / table[PORTABLE]).dropna()
        lengths = fp8.index.get_level_values("N")
        shortest, longer = fp8[lengths == lengths.min()], fp8[lengths > lengths.min()]
        print(f"fp8 forward vs. lesson 06's fp16 forward: {longer.min():.2f}x to {longer.max():.2f}x from "
              f"N = {lengths[lengths > lengths.min()].min()}, where the datasheet's matrix rates differ by 2x: the "
              f"exponentials and the rescaling do not get faster with fp8. At N = {lengths.min()}: "
              f"{shortest.min():.2f}x to {shortest.max():.2f}x (no table covers fp8, so each of its calls goes through "
              "the autotuner and Triton's JIT, without a launch plan).")
    if V2.ROUNDS > 1:
        print(V2.spread_summary(results))
    else:
        print("These are interpreter timings: they measure NumPy on the CPU, not GPU kernels.")
    defaults = default_path(results, table, default_forward, peers, "FORWARD_PATHS")
    V2.save_results("11-hopper-forward-gluon", [{
        "name": "attention forward, " + ("warp-specialized" if WS in table else "no Gluon kernel ran"),
        "unit": "TFLOP/s", "ceiling_name": V2.V1.CEILING_NAME,
        "ceiling": peak, "ours": [DEFAULT] + [c for c in (WS, PORTABLE) if c in table], "peers": peers,
        "rows": results.drop(columns="spread").to_dict("records") + defaults}])

# %%
# Exercise
# --------
# **Making a tensor loadable.** Write ``tma_ready(t)``: a tensor equal to the 4-D ``t`` that TMA can
# load (``tma_loadable`` says what that takes), ``t`` itself where it already is, a copy only where not.
# ``check_tma_ready(tma_ready)`` tries it on contiguous, transposed, sliced, broadcast and misaligned
# tensors. Watch out: ``t.contiguous()`` returns ``t`` itself whenever it is contiguous, even with data
# off a 16-byte boundary. (Lesson 12's exercise shares causal tiles between persistent programs.)


def check_tma_ready(fn):
    """Your tma_ready on tensors that TMA can and cannot load as they are."""
    base = torch.randn(2, 3, 40, 64, dtype=torch.float16)
    cases = {
        "contiguous": base,
        "(B, N, H, D) viewed as (B, H, N, D)": torch.randn(2, 40, 3, 64, dtype=torch.float16).transpose(1, 2),
        "every other column": torch.randn(2, 3, 40, 128, dtype=torch.float16)[..., ::2],
        "keys along the last axis": base.transpose(2, 3),
        "one head broadcast with expand": torch.randn(2, 1, 40, 64, dtype=torch.float16).expand(2, 3, 40, 64),
        "contiguous, starting one element in": torch.randn(2 * 3 * 40 * 64 + 1, dtype=torch.float16)[1:].view(
            2, 3, 40, 64),
    }
    for name, t in cases.items():
        ready = fn(t)
        if (not isinstance(ready, torch.Tensor) or ready.shape != t.shape or ready.dtype != t.dtype
                or ready.device != t.device or not torch.equal(ready, t)):
            raise AssertionError(f"{name}: tma_ready must return a tensor with t's shape, dtype, device and values")
        if not tma_loadable(ready):
            raise AssertionError(f"{name}: TMA cannot load the result (strides {ready.stride()}, data "
                                 f"{ready.data_ptr() % 16} bytes past a 16-byte boundary)")
        if tma_loadable(t) and ready.data_ptr() != t.data_ptr():
            raise AssertionError(f"{name}: TMA could load t as it was; the copy costs a pass over memory")
    print(f"tma_ready is right on all {len(cases)} tensors.")
