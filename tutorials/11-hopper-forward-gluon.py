"""
Hopper: a warp-specialized forward in Gluon
===========================================

The portable FlashAttention-2 forward of :doc:`06-fused-attention-v2-forward` has every
warp do everything in turn. FlashAttention-3 (Shah et al., 2024,
`arXiv:2407.08608 <https://arxiv.org/abs/2407.08608>`_) gives a program's warps *roles*:
one warp only loads, two *warp groups* (4 warps each, which issue Hopper's matrix
instruction together) only compute, their products overlapping the next block's
exponentials. Here it is in Gluon, Triton's lower-level language, for Hopper (H100,
H200), measured beside the portable kernel and cuDNN. You will learn:

* why "all warps, one step at a time" idles the tensor cores, and which roles fix it,
  with the pieces lesson 09 introduced: a ring of buffers, mbarrier phases, TMA,
  ``warpgroup_mma``, ``warp_specialize`` and ``setmaxnreg``; the roles' timeline and
  the accumulators' register layout, drawn from the kernel's own rules and layouts;
* why one program per SM walks tile after tile, and how causal pairs balance programs;
* why fp8 needs V stored with the keys contiguous on Hopper, and what fp8 buys; how
  ``attention`` picks the Gluon or portable forward per case, from a measured table.

Previous: :doc:`10-long-softmax-gluon` (:doc:`09-gluon-primer` shows each Gluon piece
alone); next: :doc:`12-hopper-forward-steps`. Where Gluon cannot run (a CPU, a GPU
other than Hopper) the page runs lesson 06's portable forward and says why.
"""

import functools

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

V2 = kit.load_lesson("06-fused-attention-v2-forward")
V2_BWD = kit.load_lesson("07-fused-attention-v2-backward")
L09 = kit.load_lesson("09-gluon-primer")  # compiling for sm_90a, reading layouts

# %%
# Who waits for whom in the portable forward
# ------------------------------------------
# In the portable kernel a program's 4 or 8 warps do everything in turn per key block:
# issue the next loads, wait for :math:`S = QK_j^T` on the tensor cores, compute
# exponentials (tensor cores idle), wait for :math:`O \mathrel{+}= P_j V_j`. Hopper's
# ``wgmma`` is issued by a *warp group* (4 warps, 128 threads) and runs
# asynchronously. cuDNN and FlashAttention-3 assign roles:
#
# * **A producer warp** only issues TMA copies of K and V tiles into a ring of
#   shared-memory buffers, each with a "full" and an "empty" *mbarrier* (lesson 09).
# * **Two consumer warp groups** own 64 query rows each and never load. Nothing in the
#   kernel orders one group against the other: whether one group's products overlap the
#   other's exponentials is left to the hardware (the timeline below shows why it can).
# * **Registers move to the work.** ``setmaxnreg`` lets the loader keep 24 registers per
#   thread and hands the rest over: up to 240 per consumer thread, for S and O.
# * **Overlap inside each consumer.** A consumer issues :math:`S_{j+1} = QK_{j+1}^T` and
#   :math:`O \mathrel{+}= P_j V_j`, waits only for the first, and computes block
#   :math:`j+1`'s exponentials while :math:`P_j V_j` runs.

# %%
# A ring of buffers, and the phases of its barriers
# -------------------------------------------------
# As in lesson 09's two-slot ring: key block :math:`j` goes into buffer
# :math:`j \bmod \mathrm{STAGES}`, its use :math:`u = \lfloor j / \mathrm{STAGES}
# \rfloor`; the consumer waits for "full" with parity :math:`u \bmod 2`, the loader for
# "empty" with the opposite one (a fresh barrier passes parity 1 at once).
# ``ring_slot`` computes it as the kernel does, numbering key blocks across a program's
# tiles ("One program per SM"); the picture draws it.


def ring_slot(j, stages):
    """(buffer, parity the consumer waits for on "full", the loader on "empty")."""
    phase = (j // stages) & 1
    return j % stages, phase, phase ^ 1


WS_HEAD_DIMS = (64, 128)
WS_BLOCK_M, WS_BLOCK_N, WS_STAGES = 128, 128, 2
WS_CONSUMER_REGISTERS, WS_LOADER_REGISTERS = 240, 24

if __name__ == "__main__":
    kit.draw_ring(ring_slot)

# %%
# The roles by these rules (``kit.role_timeline``), a model, not a measurement: copies
# take half a product (a guess), both groups share the SM's tensor cores, and a
# block's exponentials take as long as one of its two products (:math:`2D` FLOPs a
# score) at :math:`D = 128` (the paper's rates, "Reading the numbers"). The tensor
# cores idle only while the first blocks arrive: each group's exponentials run under
# the other's products with no turn-taking in the kernel, which is why it has no
# explicit ping-pong (FlashAttention-3's paper adds one). Loader waits on "empty" show.

if __name__ == "__main__":
    kit.draw_roles(ring_slot, blocks=4, stages=WS_STAGES, exp=989 / (2 * 128 * 3.9))

# %%
# Why Gluon
# ---------
# Triton's compiler decides which warps do what (its automatic warp specialization,
# ``warp_specialize=True`` in `tl.range
# <https://triton-lang.org/main/python-api/generated/triton.language.range.html>`_,
# picks a schedule of its own). Gluon lets the program say this one (lesson 09 shows
# each piece and the names that moved between Triton releases), with the first consumer
# in the program's own 4 warps, the second consumer and the loader in extra warps.
#
# * TMA copies 4-D boxes (1 batch, 1 head, 64 or 128 rows, :math:`D`) out of tensors of
#   any strides, zero-filling rows past :math:`N`. It needs the last dimension
#   contiguous and other strides positive multiples of 16 bytes (not a head broadcast
#   by ``expand``); other inputs take the portable kernel.
# * The tiles are fixed, as the boxes and barriers are sized with them: 128 queries
#   (two halves of 64) by 128 keys, 2 buffers each for K and V (lesson 13 draws the
#   shared memory they take).

# After stepkit, which may switch the interpreter on first:
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.constexpr_function
def wgmma_accumulator(columns):
    """The layout of one warp group's wgmma accumulator, 64 rows by columns: S and O."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, columns, 16])


# %%
# Who holds S: the kernel's own layout (``wgmma_accumulator``, which the kernel below
# calls too), read by lesson 09's ``owners``; :math:`O`'s is the same, :math:`D`
# columns wide. A consumer thread holds 64 fp32 values of :math:`S` (the title counts
# them) and :math:`D / 2` of :math:`O`, of the 240 registers ``setmaxnreg`` gives it.
# A row lives in the 4 threads of a quad (T0 to T3 hold row 0; registers 2 and 3 are
# the same columns 8 rows down): its maximum and sum combine within one warp. Each
# thread holds pairs of adjacent columns, so a store straight from this layout writes
# 4 bytes; the kernel converts :math:`O` through shared memory to a layout in which
# each thread stores 8 adjacent values (16 bytes) and a warp whole rows.

if __name__ == "__main__":
    kit.draw_register_layout(f"S, 64 x {WS_BLOCK_N}", L09.owners(
        wgmma_accumulator(WS_BLOCK_N), [64, WS_BLOCK_N]))

# %%
# One program per SM
# ------------------
# At :math:`N = 1024` a tile of 128 queries meets only 8 key blocks, so a one-tile
# program would spend much of its life starting and finishing, tensor cores idle. So
# the kernel is *persistent*: one program per SM, program ``pid`` taking tiles (causal:
# pairs) ``pid``, ``pid + programs``, and so on. Hence:
#
# * The ring runs on across tiles: loader and consumers count the program's key blocks
#   (``used``), and each barrier's phase is wherever the previous tile left it.
# * Q has barriers of its own, released by the consumers after their last product with
#   it: the loader fetches the next tile's Q, K and V while they finish the last tile.
# * Causal query block :math:`m` loads :math:`m + 1` key blocks, so round robin would
#   give some programs mostly long tiles. Blocks :math:`m` and :math:`n_m - 1 - m`
#   together load :math:`n_m + 1`: each program takes whole pairs, all of one cost (for
#   odd :math:`n_m` the middle block is a pair alone, at half the cost).
#
# Consecutive tiles share a head, so programs running at once share its K and V through
# L2. Lesson 13 measures what persistence buys.

@gluon.jit
def _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, MASKED: gl.constexpr,
                     CAUSAL: gl.constexpr):
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
    """(query block, batch * head, whether to run it) of program pid's k-th tile."""
    if CAUSAL:
        # Pairs (m, n_m - 1 - m), heavy tile first; odd n_m: the middle is alone.
        pairs = (n_m + 1) // 2
        pair = pid + (k // 2) * programs
        light = pair % pairs
        heavy = n_m - 1 - light
        return (gl.where(k % 2 == 0, heavy, light), pair // pairs,
                (k % 2 == 0) | (light != heavy))
    else:
        # Consecutive tiles share a head; t >= 0: a tensor like the causal answer.
        t = pid + k * programs
        return t % n_m, t // n_m, t >= 0


@gluon.jit
def _ws_tile_count(pid, programs, n_m, BH, CAUSAL: gl.constexpr):
    if CAUSAL:
        return 2 * gl.cdiv((n_m + 1) // 2 * BH - pid, programs)
    else:
        return gl.cdiv(n_m * BH - pid, programs)


@gluon.jit
def _ws_key_blocks(start_m, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr):
    """(key blocks that need no mask, key blocks to load) for query block start_m."""
    if CAUSAL:
        n_full = start_m * (BLOCK_M // BLOCK_N)  # key blocks wholly below the diagonal
        return n_full, gl.minimum(n_full + BLOCK_M // BLOCK_N, gl.cdiv(N, BLOCK_N))
    else:
        return N // BLOCK_N, gl.cdiv(N, BLOCK_N)


@gluon.jit
def _ws_loader(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_full, q_empty, k_full,
               k_empty, v_full, v_empty, pid, programs, n_m, BH, H, N,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
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
            # The next Q waits until both consumers issued their last product.
            mbarrier.wait(q_empty, (tiles & 1) ^ 1)
            mbarrier.expect(q_full, 2 * desc_q.block_type.nbytes)
            _tma_load(desc_q, [b, h, start_m * BLOCK_M, 0], q_full, q_smem.index(0))
            _tma_load(desc_q, [b, h, start_m * BLOCK_M + half, 0], q_full,
                      q_smem.index(1))
            for j in range(n_blocks):
                stage = (used + j) % STAGES
                phase = ((used + j) // STAGES) & 1
                # K and V have their own barriers: K_j is done long before V_j.
                mbarrier.wait(k_empty.index(stage), phase ^ 1)
                mbarrier.expect(k_full.index(stage), desc_k.block_type.nbytes)
                _tma_load(desc_k, [b, h, j * BLOCK_N, 0], k_full.index(stage),
                          k_smem.index(stage))
                mbarrier.wait(v_empty.index(stage), phase ^ 1)
                mbarrier.expect(v_full.index(stage), desc_v.block_type.nbytes)
                _tma_load(desc_v, [b, h, j * BLOCK_N, 0], v_full.index(stage),
                          v_smem.index(stage))
            used += n_blocks
            tiles += 1


@gluon.jit
def _ws_consumer(HALF: gl.constexpr, q_smem, k_smem, v_smem, q_full, q_empty, k_full,
                 k_empty, v_full, v_empty, O, LSE, qk_scale, pid, programs, n_m, BH, H,
                 N, sob, soh, son, D: gl.constexpr, CAUSAL: gl.constexpr,
                 ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 STORE_LSE: gl.constexpr):
    # One warp group's accumulator layouts for S and O; P as PV's register operand.
    s_layout: gl.constexpr = wgmma_accumulator(BLOCK_N)
    o_layout: gl.constexpr = wgmma_accumulator(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    # 16-byte stores, a warp whole rows (converted through shared memory).
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8],
                                                  [4, 1], [1, 0])
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
            rows = (start_m * 2 * ROWS + HALF * ROWS
                    + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout)))
            m_i = gl.full([ROWS], -float("inf"), gl.float32,
                          gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([ROWS, D], gl.float32, o_layout)
            # Block 0: S_0 and its exponentials, before the loop's steady state.
            mbarrier.wait(q_full, tiles & 1)
            ks = used % STAGES
            mbarrier.wait(k_full.index(ks), (used // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(ks).reshape([BLOCK_N, D]).permute((1, 0)),
                              zeros, use_acc=False)
            mbarrier.arrive(k_empty.index(ks), count=1)
            if n_blocks == 1:
                mbarrier.arrive(q_empty, count=1)
            if n_full == 0:
                p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols,
                                                      N, True, CAUSAL)
            else:
                p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols,
                                                      N, False, CAUSAL)
            for j in range(1, n_blocks):
                ks = (used + j) % STAGES
                mbarrier.wait(k_full.index(ks), ((used + j) // STAGES) & 1)
                kt = k_smem.index(ks).reshape([BLOCK_N, D]).permute((1, 0))
                s_next = warpgroup_mma(q, kt, zeros, use_acc=False, is_async=True)
                vs = (used + j - 1) % STAGES
                mbarrier.wait(v_full.index(vs), ((used + j - 1) // STAGES) & 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                v = v_smem.index(vs).reshape([BLOCK_N, D])
                o_next = warpgroup_mma(p_op, v, acc, is_async=True)
                # Products finish in order: "1 in flight" means S_j is ready.
                s = warpgroup_mma_wait(1, deps=[s_next])
                mbarrier.arrive(k_empty.index(ks), count=1)
                if j == n_blocks - 1:
                    mbarrier.arrive(q_empty, count=1)  # the tile's last product with Q
                if j >= n_full:
                    p, m_i, l_i, alpha = _ws_softmax_step(
                        s, m_i, l_i, qk_scale, rows, cols + j * BLOCK_N, N, True,
                        CAUSAL)
                else:
                    p, m_i, l_i, alpha = _ws_softmax_step(
                        s, m_i, l_i, qk_scale, rows, cols, N, False, CAUSAL)
                acc, p_op = warpgroup_mma_wait(0, deps=[o_next, p_op])
                mbarrier.arrive(v_empty.index(vs), count=1)
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
                acc = acc * alpha_o[:, None]
            vs = (used + n_blocks - 1) % STAGES
            mbarrier.wait(v_full.index(vs), ((used + n_blocks - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, D]), acc)
            mbarrier.arrive(v_empty.index(vs), count=1)
            used += n_blocks
            tiles += 1
            # Meanwhile the loader fills Q and K of the program's next tile.
            if STORE_LSE:  # for a backward; inference skips it, as lesson 06's
                gl.store(LSE + bh * N + rows, m_i + gl.log2(l_i), mask=rows < N)
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            o = (acc / l_o[:, None]).to(O.dtype.element_ty)
            o = gl.convert_layout(o, store_layout)
            o_rows = (start_m * 2 * ROWS + HALF * ROWS
                      + gl.arange(0, ROWS, gl.SliceLayout(1, store_layout)))
            o_cols = gl.arange(0, D, gl.SliceLayout(0, store_layout))
            # The pointer offset is 64-bit: it can pass 2**31 elements.
            o_ptrs = (O + (bh // H).to(gl.int64) * sob + (bh % H).to(gl.int64) * soh
                      + o_rows[:, None] * son + o_cols[None, :])
            gl.store(o_ptrs, o, mask=o_rows[:, None] < N)


@gluon.jit
def _ws_barrier_ring(STAGES: gl.constexpr, ARRIVALS: gl.constexpr):
    """A ring's STAGES mbarriers in shared memory, completing after ARRIVALS each."""
    ring = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ring.index(s), count=ARRIVALS)
    return ring


@gluon.jit
def attn_fwd_ws_kernel(desc_q, desc_k, desc_v, O, LSE, qk_scale, H, BH, N, sob, soh,
                       son, D: gl.constexpr, CAUSAL: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                       LOADER_REGISTERS: gl.constexpr, STORE_LSE: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_m = gl.cdiv(N, BLOCK_M)
    dtype: gl.constexpr = desc_q.dtype
    # Leading 1, 1: 4-D TMA boxes (batch, head, rows, D), viewed as 2-D.
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M // 2, D], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_v.layout)
    q_full = _ws_barrier_ring(1, 1).index(0)
    q_empty = _ws_barrier_ring(1, 2).index(0)  # one arrival from each consumer
    k_full = _ws_barrier_ring(STAGES, 1)
    v_full = _ws_barrier_ring(STAGES, 1)
    k_empty = _ws_barrier_ring(STAGES, 2)
    v_empty = _ws_barrier_ring(STAGES, 2)
    # Tuples written out in the call: stored in a variable, constexprs turn run-time.
    gl.warp_specialize([
        (_ws_consumer, (0, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty,
                        v_full, v_empty, O, LSE, qk_scale, pid, programs, n_m, BH, H, N,
                        sob, soh, son, D, CAUSAL, BLOCK_M // 2, BLOCK_N, STAGES,
                        STORE_LSE)),
        (_ws_consumer, (1, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty,
                        v_full, v_empty, O, LSE, qk_scale, pid, programs, n_m, BH, H, N,
                        sob, soh, son, D, CAUSAL, BLOCK_M // 2, BLOCK_N, STAGES,
                        STORE_LSE)),
        (_ws_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_full, q_empty,
                      k_full, k_empty, v_full, v_empty, pid, programs, n_m, BH, H, N,
                      BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


def tma_loadable(t):
    """Whether TMA can copy boxes of t: strides as "Why Gluon" says, aligned data."""
    strides_ok = all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
    return t.stride(-1) == 1 and strides_ok and t.data_ptr() % 16 == 0


_capability = functools.cache(torch.cuda.get_device_capability)


def warp_specialized_unsupported(q, k, v, sm_scale=1.0):
    """Why the Gluon kernels cannot take these inputs here; None where they can."""
    if not kit.ON_GPU or _capability(q.device)[0] != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if q.dtype not in kit.ATTENTION_DTYPES:
        return f"it takes float16 or bfloat16, not {q.dtype}"
    if q.shape[-1] not in WS_HEAD_DIMS:
        return f"it takes head dims {WS_HEAD_DIMS}, not {q.shape[-1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not tma_loadable(t):
            return (f"TMA copies need {name}'s last dimension contiguous, its other "
                    "strides positive multiples of 16 bytes and its data 16-byte "
                    f"aligned; it has strides {t.stride()}")
    # _ws_softmax_step scales the row maximum: the scaled maximum only for sm_scale >= 0
    if sm_scale < 0:
        return "it takes sm_scale >= 0"
    return None


@functools.lru_cache
def _ws_box_layout(rows, D, dtype):
    """One TMA box's shared-memory layout; cached: computing it costs host time."""
    element = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, D], element)


class CheckedDescriptor(TensorDescriptor):
    """A TensorDescriptor without its checks, which cost host time on every call: the
    launchers describe only tensors they made or warp_specialized_unsupported took."""

    def __post_init__(self):
        pass


def _ws_descriptor(t, rows):
    """The TMA descriptor for (1, 1, rows, D) boxes of t, whatever its strides."""
    D = t.shape[-1]
    return CheckedDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, D],
                             _ws_box_layout(rows, D, t.dtype))


@functools.lru_cache
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _ws_forward(q, k, v, o, lse, causal, sm_scale, programs=None, block_n=WS_BLOCK_N,
                stages=WS_STAGES):
    """The persistent kernel, with one program per SM unless programs says how many."""
    B, H, N, D = q.shape
    n_m = V2.host_cdiv(N, WS_BLOCK_M)
    work = (n_m + 1) // 2 * B * H if causal else n_m * B * H  # pairs of tiles, or tiles
    programs = min(programs or _sm_count(q.device.index), work)
    # Lesson 06's launch plans (returned): a plan takes the tensors and describes
    # them itself, from the layout worked out once. lse None: STORE_LSE off, o in
    # its slot (lesson 06).
    return V2.launch_planned(
        V2.plan_key(q, k, v), attn_fwd_ws_kernel, (programs,), 6,
        (_ws_descriptor(q, WS_BLOCK_M // 2), _ws_descriptor(k, block_n),
         _ws_descriptor(v, block_n), o, o if lse is None else lse,
         sm_scale * V2.LOG2E, H, B * H, N, *o.stride()[:3]),
        dict(D=D, CAUSAL=causal, BLOCK_M=WS_BLOCK_M, BLOCK_N=block_n,
             STAGES=stages, CONSUMER_REGISTERS=WS_CONSUMER_REGISTERS,
             LOADER_REGISTERS=WS_LOADER_REGISTERS, STORE_LSE=lse is not None),
        num_warps=4)


# %%
# The launcher and autograd
# -------------------------
# Neither forward wins everywhere: the Gluon call's three TMA descriptors cost host
# time, and its one tile shape is not always the best. So ``attention`` follows
# ``FORWARD_PATHS``, a table of ``tuned_tables.json`` that ``tools/tune.py attention``
# measured before this build: per case, the forward faster back to back (host time
# included; lesson 13 measures both), and for a call captured in a CUDA graph, with no
# host in its way, the faster by GPU time. ``warp_specialized=None`` runs the table's
# path (Gluon where it can, in cases the table does not cover), ``True`` insists on
# Gluon (an error says why not), ``False`` the portable kernel. Both forwards write
# the same output and :math:`\mathrm{LSE}_2`: lesson 07's backward serves both.


def paths_table(name):
    """{(D, causal, N bucket, captured): path}: a table of tuned_tables.json."""
    return {(r["D"], r["causal"], r["N"], c): r.get("captured", r["path"]) if c else
            r["path"] for r in kit.tuned_table(name)["rows"] for c in (False, True)}


FORWARD_PATHS = paths_table("forward-paths")


def forward(q, k, v, causal, sm_scale, warp_specialized, programs=None, planned=False,
            keep_lse=True):
    """O and LSE_2 from the Gluon forward (programs: _ws_forward's), or lesson 06's;
    planned and keep_lse as lesson 06's forward."""
    if not warp_specialized:
        return V2.forward(q, k, v, causal, sm_scale, planned, keep_lse)
    B, H, N, D = q.shape
    o = q.new_empty(q.shape)
    lse = q.new_empty((B * H, N), dtype=torch.float32) if keep_lse else None
    plan = _ws_forward(q, k, v, o, lse, causal, sm_scale, programs)
    if not planned:
        return o, lse
    return o, lse, kit.call_plan(plan, (o, lse), sm_scale * V2.LOG2E)


class _AttentionHopperForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, warp_specialized, settled):
        o, lse = kit.planned_forward(settled, forward, q, k, v, causal, sm_scale,
                                     warp_specialized)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = V2_BWD.backward(q, k, v, o, kit.resolved_gradient(do), lse, ctx.causal,
                                ctx.sm_scale, False)
        return *grads, None, None, None, None


def gluon_allowed(q, k, v, warp_specialized, sm_scale):
    """Whether the Gluon kernels may run (if True insists but they cannot: why)."""
    if warp_specialized is False:
        return False
    reason = warp_specialized_unsupported(q, k, v, sm_scale)
    if reason and warp_specialized:
        raise ValueError("warp_specialized=True, but the warp-specialized kernels "
                         f"cannot run here: {reason}")
    return reason is None


def check_flag(name, value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None, True or False, got {value!r}")


def forward_choice(q, causal, warp_specialized, gluon, captured=None):
    """Whether to run the Gluon forward: the table's (for a captured call or not;
    None: this one), unless the caller chose; gluon() (gluon_allowed) is asked only
    when neither the table nor the caller settles it."""
    case = kit.path_key(V2.tuned_case(q, causal), captured)
    measured = FORWARD_PATHS.get(case, "gluon")
    return bool(warp_specialized or measured == "gluon") and gluon()


def use_warp_specialized(q, k, v, causal, sm_scale, warp_specialized):
    check_flag("warp_specialized", warp_specialized)
    return forward_choice(q, causal, warp_specialized,
                          lambda: gluon_allowed(q, k, v, warp_specialized, sm_scale))


# The checks and the path read only the inputs' layout and the flags, and a model calls
# attention with one layout step after step, on fresh tensors: ``kit.settled_paths``
# keeps the path per layout that passed the checks, so later calls skip both, a call
# that needs no gradient skips autograd too, and the first call of a layout leaves
# lesson 06's call plan, which later calls run. Lesson 13 measures each step.


def attention(q, k, v, causal, sm_scale, warp_specialized=None):
    """softmax(q k^T * sm_scale) v: the table's forward for the case (or the one
    warp_specialized names) and lesson 07's two-pass backward."""
    settled = kit.settled_paths(use_warp_specialized, q, k, v, causal, sm_scale,
                                warp_specialized)
    return kit.settled_call(settled, _AttentionHopperForward, forward, settled.paths,
                            q, k, v, causal, sm_scale)


# %%
# Correctness
# -----------
# The forward and the gradients through it against float64 PyTorch on fresh random
# inputs (``kit.check_attention_cases``): both head dims and dtypes, causal and not, at
# a length no block size divides; the first line says which forward ran.


def say_which_runs(what, fallback):
    """Print whether the Gluon kernels run on this machine; return why not, or None."""
    probe = torch.empty(1, 1, 8, 64, dtype=torch.float16, device=kit.DEVICE)
    reason = warp_specialized_unsupported(probe, probe, probe)
    print(f"The Gluon {what} runs here." if reason is None else
          f"The Gluon {what} did not run on this machine: {reason}. The checks and "
          f"timings below are of the portable fallback ({fallback}).")
    return reason


if __name__ == "__main__":
    reason = say_which_runs("forward", "lesson 06's kernel")
    # The table picks lesson 06's kernel (lesson 06 checks it) in some cases: insist.
    checked = functools.partial(attention, warp_specialized=None if reason else True)
    kit.check_attention_cases(checked, "11-hopper-forward-gluon")

# %%
# fp8 on Hopper: the layout of V
# -------------------------------
# Hopper's tensor cores (and Ada's) also multiply 8-bit floats, by the datasheets at
# twice the fp16 rate, and an 8-bit tile is half the bytes to load. Lesson 06's forward
# takes ``float8_e5m2`` inputs as they are (fp32 accumulation, :math:`P` cast to V's
# dtype, fp16 output); what must change is the layout. ``wgmma`` takes an 8-bit tile
# from shared memory only with the *reduction* axis contiguous, over at least 32 values.
# :math:`QK^T` reduces over the head dimension, contiguous in Q and K; :math:`PV` over
# the keys, which (B, H, N, D) stores apart, so the compiler would transpose every V
# tile. So V comes with the sequence axis contiguous: the launcher makes that copy, and
# ``keys_contiguous`` shows how quantizing code can write it in the cast for free. This
# is E5M2 without scaling, and the check compares against float64 attention *on the
# same fp8 inputs*: it measures the kernel, not the inputs' rounding. Production fp8
# attention is more careful: FlashAttention-3's paper quantizes to E4M3 with a scale
# per block and first rotates Q and K by a random orthogonal matrix ("incoherent
# processing") so that outliers cost less accuracy.

if __name__ == "__main__" and kit.fp8_supported():
    N, D, f8 = 1000, 64, torch.float8_e5m2
    q8, k8 = (torch.randn(2, 3, N, D, device=kit.DEVICE).to(f8) for _ in range(2))
    v8 = V2.keys_contiguous(torch.randn(2, 3, N, D, device=kit.DEVICE), f8)
    q64, k64, v64 = (t.double() for t in (q8, k8, v8))
    for causal in (False, True):
        out = V2.attention(q8, k8, v8, causal, D**-0.5)
        ref = kit.reference_attention(q64, k64, v64, causal, D**-0.5)
        error = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        print(f"fp8 forward, causal={causal!s:5}, N={N}: max error {error:.1e} of the "
              "largest output")
        # P is rounded to e5m2 too; a wrong layout of V gives errors near 1.
        if not (torch.isfinite(out).all() and error < 0.1):
            raise AssertionError(f"11-hopper-forward-gluon: fp8 forward is off, error "
                                 f"{error:.2e}")
elif __name__ == "__main__":
    print("fp8 forward skipped: it needs fp8 tensor cores (compute capability 8.9+).")

# %%
# Benchmark
# ---------
# The forward in TFLOP/s at lesson 06's sizes against the portable kernel and SDPA's
# backends, the fp16 matrix-multiply rate measured now the ceiling (lesson 06's fp8
# forward, also shown, can pass it). The default path is ``attention`` as users call
# it: the table's eager pick back to back, its captured pick in a CUDA graph. GPU time
# and back to back (:doc:`../performance`, "How we time") in two tables; the plot (not
# the default path: one of ours again) and verdicts read GPU time and say where back to
# back differs. Under the interpreter they illustrate.

WS, PORTABLE, DEFAULT = kit.GLUON_WS, kit.PORTABLE_V2, kit.DEFAULT_PATH
ATOMIC = V2_BWD.ATOMIC  # lesson 07's atomic backward, which lesson 14 may choose
FP8 = "Triton v2 fp8"
OURS = (WS, PORTABLE, ATOMIC, FP8, DEFAULT)
PATHS = {WS: "Gluon", PORTABLE: "portable", ATOMIC: "atomic"}  # short names
INDEX, PEERS = kit.ATTENTION_INDEX, kit.FAST_PEERS
BASELINES = kit.portable_and_peers(V2_BWD.attention)  # lessons 06 and 07, the peers
hopper_benchmark = functools.partial(  # (mode, extra_providers, title), lesson 14's too
    kit.hopper_benchmark, V2.CASES, V2.SIZES, BASELINES, ours=OURS)


def default_forward(D, causal, N, captured=False):
    """The provider ``attention`` runs by default on a (B, H, N, D) fp16 input."""
    q = torch.empty(1, 1, N, D, dtype=torch.float16, device=kit.DEVICE)
    gluon = functools.partial(gluon_allowed, q, q, q, None, D**-0.5)
    return WS if forward_choice(q, causal, None, gluon, captured) else PORTABLE


def hopper_providers(q, k, v, causal, D):
    """The default path; Gluon where it runs; lesson 06's on fp8 copies (fp8 cores)."""
    f8, scale = torch.float8_e5m2, D**-0.5
    providers = {(DEFAULT, "fwd"): kit.call_timer(attention, q, k, v, causal, scale)}
    if warp_specialized_unsupported(q, k, v) is None:
        providers[WS, "fwd"] = kit.call_timer(attention, q, k, v, causal, scale,
                                              warp_specialized=True)
    if kit.fp8_supported():
        q8, k8 = (t.detach().to(f8) for t in (q, k))
        v8 = V2.keys_contiguous(v.detach(), f8)  # the layout, written by the cast
        providers[FP8, "fwd"] = kit.call_timer(V2.attention, q8, k8, v8, causal, scale)
    return providers


# %%
# The platform, the ceiling, the plot, then the table in TFLOP/s by GPU time:

if __name__ == "__main__":
    print(kit.describe_platform())
    results, peak = hopper_benchmark("fwd", hopper_providers, "Forward pass")
kit.rates_table(results, INDEX, "TFLOP/s") if __name__ == "__main__" else None

# %%
# The same calls back to back, in TFLOP/s:

(kit.rates_table(results, INDEX, "TFLOP/s", value="value")
 if __name__ == "__main__" else None)

# %%
# Reading the numbers
# -------------------
# From this run's two tables; the default path's own table comes last. Expect
# :math:`D = 64` further below the matmul rate than :math:`D = 128`, for cuDNN too. A
# score costs one exponential and :math:`4D` FLOPs of products; the FlashAttention-3
# paper gives the H100 SXM5 989 TFLOP/s of fp16 products against 3.9 T exponentials
# per second, about 254 FLOPs per exponential. At :math:`D = 64` (256 FLOPs per score)
# the exponentials take as long as the products, at :math:`D = 128` half as long, so at
# 64 the speed rests on how well the two overlap. The matmul rate, measured once per
# page, has noise of its own: a kernel within a few percent of it, or past it, is at it.

if __name__ == "__main__":
    peers = kit.against_portable(results, peak, "lesson 06's kernel")
    gpu = kit.rate_tables(results, INDEX)[0]
    if FP8 in gpu:
        fp8 = (gpu[FP8] / gpu[PORTABLE]).dropna()
        N = fp8.index.get_level_values("N")
        short, longer = fp8[N == N.min()], fp8[N > N.min()]
        print(f"fp8 forward vs. lesson 06's fp16 forward, by GPU time: "
              f"{longer.min():.2f}x to {longer.max():.2f}x from N = "
              f"{N[N > N.min()].min()}, where the datasheet's matrix rates differ "
              "by 2x: the exponentials and the rescaling do not get faster with fp8. "
              f"At N = {N.min()}: {short.min():.2f}x to {short.max():.2f}x (no table "
              "covers fp8: each call takes the autotuner and JIT, no launch plan).")
    print(kit.spread_summary(results) if kit.ON_GPU else
          "These are interpreter timings: they measure NumPy on the CPU.")
    paths = kit.default_path(results, default_forward, peers, "FORWARD_PATHS", PATHS)
    ran = [c for c in (WS, PORTABLE) if c in gpu]
    kit.save_results("11-hopper-forward-gluon", [{
        "name": "attention forward, "
        f"{'warp-specialized' if WS in ran else 'no Gluon kernel ran'}",
        "unit": "TFLOP/s", "ceiling_name": kit.MATMUL_CEILING, "ceiling": peak,
        "ours": [DEFAULT, *ran], "peers": peers,
        "rows": results.to_dict("records")}])
paths if __name__ == "__main__" else None

# %%
# Exercises
# ---------
# Write the attempt in a new cell at the end of this lesson's notebook (linked at the
# end of the page) and call its check there, or in a file next to the lessons that
# loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L11 = kit.load_lesson("11-hopper-forward-gluon")
#    # ... your tma_ready(t) ...
#    L11.check_tma_ready(tma_ready)
#
# **Making a tensor loadable.** Write ``tma_ready(t)``: a tensor equal to the 4-D ``t``
# that TMA can load (``tma_loadable``, defined above, says what that takes), ``t``
# itself where it already is, a copy only where not. ``check_tma_ready`` (no GPU needed)
# tries contiguous, transposed, sliced, broadcast and misaligned tensors. Watch out:
# ``t.contiguous()`` returns ``t`` itself whenever it is contiguous, even with data off
# a 16-byte boundary.


def check_tma_ready(fn):
    """Your tma_ready on tensors that TMA can and cannot load as they are."""
    randn = functools.partial(torch.randn, dtype=torch.float16)
    cases = {"contiguous": randn(2, 3, 40, 64),
             "(B, N, H, D) viewed as (B, H, N, D)": randn(2, 40, 3, 64).transpose(1, 2),
             "every other column": randn(2, 3, 40, 128)[..., ::2],
             "keys along the last axis": randn(2, 3, 40, 64).transpose(2, 3),
             "one head broadcast with expand": randn(2, 1, 40, 64).expand(2, 3, 40, 64),
             "contiguous, starting one element in":
                 randn(2 * 3 * 40 * 64 + 1)[1:].view(2, 3, 40, 64)}
    for name, t in cases.items():
        ready = fn(t)
        same = isinstance(ready, torch.Tensor) and ready.device == t.device
        if not (same and ready.dtype == t.dtype and ready.shape == t.shape
                and torch.equal(ready, t)):
            raise AssertionError(f"{name}: tma_ready must return a tensor with t's "
                                 "shape, dtype, device and values")
        if not tma_loadable(ready):
            raise AssertionError(f"{name}: TMA cannot load the result (strides "
                                 f"{ready.stride()}, data {ready.data_ptr() % 16} "
                                 "bytes past a 16-byte boundary)")
        if tma_loadable(t) and ready.data_ptr() != t.data_ptr():
            raise AssertionError(f"{name}: TMA could load t as it was; the copy costs "
                                 "a pass over memory")
    print(f"tma_ready is right on all {len(cases)} tensors.")
