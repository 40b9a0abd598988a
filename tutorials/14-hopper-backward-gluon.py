"""
Hopper: the FlashAttention-3 backward in Gluon
==============================================

The portable backward of :doc:`07-fused-attention-v2-backward` executes seven matrix
products per pair of blocks where five would do, or five with one atomic addition per
element of :math:`dQ`. FlashAttention-3's backward (Shah et al., 2024,
`arXiv:2407.08608 <https://arxiv.org/abs/2407.08608>`_) keeps the five products and
makes the additions cheap: :math:`dS` shared between two warp groups through shared
memory, and :math:`dQ` summed by the TMA engine in bulk. Here it is in Gluon, measured
against the portable backward and cuDNN, with a profile of where its time goes.
You will learn:

* how one program computes :math:`dK`, :math:`dV` and its share of :math:`dQ` with five
  matrix products, and why it multiplies :math:`S^T` rather than :math:`S`;
* how two warp groups split :math:`dQ`'s columns so that each element gets one addition
  per program, and how a TMA bulk reduction adds a whole fp32 tile in the L2 cache;
* how register pressure limits this kernel, and the changes that keep spills down;
* how to find where a backward's time goes with the CUDA profiler, kernel by kernel.

It runs lesson 07's preprocess, lesson 13's host timer and lesson 11's forward, and
falls back to lesson 07's backward where Gluon cannot run, and says why. Previous:
:doc:`13-hopper-forward-profiled`; this is the last of the path (:doc:`list <index>`).
"""

import functools

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

V2 = kit.load_lesson("06-fused-attention-v2-forward")
V2_BWD = kit.load_lesson("07-fused-attention-v2-backward")
FWD = kit.load_lesson("11-hopper-forward-gluon")
PROFILE = kit.load_lesson("13-hopper-forward-profiled")

# %%
# Five products, one program per key block
# ----------------------------------------
# One program owns 128 keys, split between two consumer warp groups (lesson 11) of 64
# keys each, plus a loader warp that streams blocks of 64 queries (128 at :math:`D =
# 64`: below) of :math:`Q` and :math:`dO`, with their rows' :math:`\mathrm{LSE}_2` and
# :math:`\Delta`, through a ring of shared-memory buffers. Per query block, each group:
#
# 1. issues :math:`S^T = K Q^T` and :math:`dP^T = V\,dO^T` (its 64 keys by the queries);
# 2. makes :math:`P^T` and :math:`dS^T = P^T \circ (dP^T - \Delta)`, and starts
#    :math:`dV \mathrel{+}= P^T dO` with :math:`P^T` from registers (``wgmma``'s left
#    operand may be in registers, lesson 09: hence :math:`S^T`, not :math:`S`);
# 3. trades :math:`dS^T` with the other group (drawn after the kernel) and multiplies
#    :math:`dS\,K` for *half of the columns* of :math:`dQ` (64 of 128 at :math:`D =
#    128`) over both groups' keys: one addition per element per program, not two;
# 4. starts :math:`dK \mathrel{+}= dS^T Q` last and, while it runs, sends its :math:`dQ`
#    columns out: to shared memory, then a *TMA reduction* (``cp.reduce.async.bulk``)
#    adds the fp32 tile into global memory in bulk, in the L2 cache.
#
# The picture: what each group holds and multiplies for one query block at :math:`D =
# 128`; dashed lines in :math:`dQ` mark the 32-column boxes its TMA reductions send.

if __name__ == "__main__":
    kit.draw_split()

# %%
# What decides its speed
# ----------------------
# Six details, each found by measuring (the engineering notes keep the numbers):
#
# * **Bulk reductions, not element atomics.** One atomic addition per element of
#   :math:`dQ` (``red.global.add.f32``) keeps the L2 cache busy with tiny transactions;
#   a TMA reduction sends a whole tile. Triton 3.6's Gluon has no Python name for it
#   (later: ``tma.async_atomic_add``): the lesson defines the builtin itself.
# * **A bank-conflict-free staging tile.** TMA reads the fp32 tile in the *swizzled*
#   layout of ``NVMMASharedLayout`` (rows' 16-byte pieces permuted: a column's values
#   fall in different banks; unswizzled, the 8 rows a warp writes would conflict 8-way),
#   whose rows hold at most 128 bytes: :math:`dQ`'s 64 columns go as two boxes of 32.
# * **Registers.** A consumer thread holds :math:`dK` and :math:`dV` for 64 keys (128
#   registers at :math:`D = 128`), :math:`S^T` and :math:`dP^T` (64 more), and its
#   :math:`dQ` columns (32), of the 240 that ``setmaxnreg`` gives it; the rest spills
#   to local memory. Four changes cut the spills: the loader brings each block's
#   :math:`\mathrm{LSE}_2` and :math:`\Delta` by TMA too (no pointers, masks or index
#   vectors in the consumers); :math:`P^T` is kept in 16 bits once :math:`dS^T` is made;
#   the causal mask's index vectors are made where used; one loop, the mask behind a
#   branch, serves all query blocks: the compiler plans registers for one loop body.
# * **Query blocks as large as the registers allow.** At :math:`D = 64`, :math:`dK`,
#   :math:`dV` take half the registers, leaving room for 128-query :math:`S^T`,
#   :math:`dP^T`: each exchange and reduction then serves twice the products.
# * **Overlap.** :math:`dK`'s product, issued after :math:`dQ`'s, runs while the tile is
#   stored and sent; ``warpgroup_mma_wait(1)`` waits for :math:`S^T` alone (products
#   finish in order): :math:`P^T`'s exponentials run under :math:`dP^T`'s product.
# * **Wide stores, where they pay.** ``wgmma`` leaves each thread pairs of adjacent
#   values of :math:`dK` and :math:`dV` (4-byte stores); without the causal mask they go
#   through lesson 11's 16-byte store layout, with it as they are (measured both ways).
#
# Past the end of the sequence TMA loads fill zeros and reductions skip the rows: no
# bounds masks. :math:`dQ` is summed in fp32 in varying order, so its last bits vary
# between runs; ``atomic_dq=False`` asks for lesson 07's two-pass backward: same bits.

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_tma_load, _ws_barrier_ring = FWD._tma_load, FWD._ws_barrier_ring

WS_BWD_BLOCK_N, WS_BWD_STAGES = 128, 2
# Queries per block by head dimension: at D = 64 the registers hold 128-query S^T, dP^T.
WS_BWD_BLOCK_M = {64: 128, 128: 64}
_WS_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
_WS_DQ_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                     rank=4)

if hasattr(tma, "async_atomic_add"):
    _tma_reduce_add = tma.async_atomic_add
else:  # Triton 3.6: the compiler has the operation, Gluon no name for it yet
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _gluon_builtin

    @_gluon_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(
            _ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

# named so since Triton 3.7
_group_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _ws_bwd_loader(desc_q, desc_k, desc_v, desc_do, desc_lse, desc_delta, q_smem,
                   k_smem, v_smem, do_smem, lse_smem, delta_smem, kv_full, q_full,
                   q_empty, do_full, do_empty, b, h, bh, start_n, first, last,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = desc_k.block_type.shape[2]
    mbarrier.expect(kv_full,
                    2 * desc_k.block_type.nbytes + 2 * desc_v.block_type.nbytes)
    for g in gl.static_range(2):  # the keys of both consumer groups
        _tma_load(desc_k, [b, h, start_n + g * ROWS, 0], kv_full, k_smem.index(g))
        _tma_load(desc_v, [b, h, start_n + g * ROWS, 0], kv_full, v_smem.index(g))
    for j in range(first, last):
        stage = (j - first) % STAGES
        phase = ((j - first) // STAGES) & 1
        row = j * BLOCK_M
        q_ready = q_full.index(stage)
        do_ready = do_full.index(stage)
        # Q travels with its rows' LSE, dO with their Delta, each pair under a barrier.
        mbarrier.wait(q_empty.index(stage), phase ^ 1)
        mbarrier.expect(q_ready, desc_q.block_type.nbytes + desc_lse.block_type.nbytes)
        _tma_load(desc_q, [b, h, row, 0], q_ready, q_smem.index(stage))
        _tma_load(desc_lse, [bh, row], q_ready, lse_smem.index(stage))
        mbarrier.wait(do_empty.index(stage), phase ^ 1)
        mbarrier.expect(do_ready,
                        desc_do.block_type.nbytes + desc_delta.block_type.nbytes)
        _tma_load(desc_do, [b, h, row, 0], do_ready, do_smem.index(stage))
        _tma_load(desc_delta, [bh, row], do_ready, delta_smem.index(stage))


@gluon.jit
def _ws_bwd_step(j, i, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                 ds_smem, dq_smem, q_full, q_empty, do_full, do_empty, ds_ready,
                 ds_free, desc_dq, b, h, first_key, unmasked_from, qk_scale, sm_scale,
                 GROUP: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                 t_layout: gl.constexpr, a_layout: gl.constexpr,
                 q_layout: gl.constexpr):
    """Query block j, the i-th of the program: dV, dK of the group's keys, its dQ."""
    ROWS: gl.constexpr = k_smem.shape[-2]
    D: gl.constexpr = k_smem.shape[-1]
    BLOCK_M: gl.constexpr = q_smem.shape[-2]
    DH: gl.constexpr = D // 2  # this group's columns of dQ
    stage = i % STAGES
    mbarrier.wait(q_full.index(stage), (i // STAGES) & 1)
    mbarrier.wait(do_full.index(stage), (i // STAGES) & 1)
    k = k_smem.index(GROUP).reshape([ROWS, D])
    v = v_smem.index(GROUP).reshape([ROWS, D])
    qs = q_smem.index(stage).reshape([BLOCK_M, D])
    dos = do_smem.index(stage).reshape([BLOCK_M, D])
    zeros = gl.zeros([ROWS, BLOCK_M], gl.float32, t_layout)
    st = warpgroup_mma(k, qs.permute((1, 0)), zeros, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v, dos.permute((1, 0)), zeros, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=[st])
    pt = gl.exp2(st * qk_scale - lse_smem.index(stage).load(t_layout))
    if CAUSAL and j < unmasked_from:
        # Key row r sees query column c when first_key + r <= j * BLOCK_M + c.
        rel = (gl.arange(0, ROWS, gl.SliceLayout(1, t_layout))
               + (first_key - j * BLOCK_M))
        cols = gl.arange(0, BLOCK_M, gl.SliceLayout(0, t_layout))
        pt = gl.where(rel[:, None] <= cols[None, :], pt, 0.0)
    dpt = warpgroup_mma_wait(0, deps=[dpt])
    dst = (pt * (dpt - delta_smem.index(stage).load(t_layout))).to(qs.dtype)
    pt_op = gl.convert_layout(pt.to(qs.dtype), a_layout)
    dv = warpgroup_mma(pt_op, dos, dv, is_async=True)
    # Trade dS^T with the other group: the steps of ds_exchange (after the kernel).
    mbarrier.wait(ds_free, (i & 1) ^ 1)  # both groups are done with the last block's
    ds_smem.index(GROUP).store(dst)
    fence_async_shared()
    _group_barrier()
    mbarrier.arrive(ds_ready, count=1)
    mbarrier.wait(ds_ready, i & 1)
    dq = gl.zeros([BLOCK_M, DH], gl.float32, q_layout)
    for g in gl.static_range(2):
        kg = k_smem.index(g).reshape([ROWS, D]).slice(GROUP * DH, DH, dim=1)
        dq = warpgroup_mma(ds_smem.index(g).permute((1, 0)), kg, dq, use_acc=g > 0,
                           is_async=True)
    dst_op = gl.convert_layout(dst, a_layout)
    dk = warpgroup_mma(dst_op, qs, dk, is_async=True)  # last: runs while dQ is sent out
    dv, dq, pt_op = warpgroup_mma_wait(1, deps=[dv, dq, pt_op])
    mbarrier.arrive(ds_free, count=1)
    mbarrier.arrive(do_empty.index(stage), count=1)
    dq = dq * sm_scale
    tma.store_wait(0)  # the previous block's reductions have read the staging tiles
    _group_barrier()
    if DH == 32:
        dq_smem.index(GROUP).reshape([BLOCK_M, 32]).store(dq)
    else:  # two 32-column boxes: the widest that a 128-byte swizzled fp32 row holds
        left, right = gl.split(gl.permute(gl.reshape(dq, [BLOCK_M, 2, 32]), (0, 2, 1)))
        dq_smem.index(2 * GROUP).reshape([BLOCK_M, 32]).store(left)
        dq_smem.index(2 * GROUP + 1).reshape([BLOCK_M, 32]).store(right)
    fence_async_shared()
    _group_barrier()
    for p in gl.static_range(DH // 32):
        _tma_reduce_add(desc_dq, [b, h, j * BLOCK_M, GROUP * DH + p * 32],
                        dq_smem.index(GROUP * (DH // 32) + p))
    dk, dst_op = warpgroup_mma_wait(0, deps=[dk, dst_op])
    mbarrier.arrive(q_empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def _ws_bwd_consumer(GROUP: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem,
                     delta_smem, ds_smem, dq_smem, kv_full, q_full, q_empty, do_full,
                     do_empty, ds_ready, ds_free, desc_dq, DK, DV, qk_scale, sm_scale,
                     b, h, bh, start_n, N, first, unmasked_from, last,
                     CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = k_smem.shape[-2]
    D: gl.constexpr = k_smem.shape[-1]
    BLOCK_M: gl.constexpr = q_smem.shape[-2]
    # S^T, dP^T: ROWS x BLOCK_M; dK, dV: ROWS x D; dQ: BLOCK_M x D/2; P^T, dS^T as a
    # register operand.
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(0, g_layout, 2)
    dk = gl.zeros([ROWS, D], gl.float32, g_layout)
    dv = gl.zeros([ROWS, D], gl.float32, g_layout)
    first_key = start_n + GROUP * ROWS
    mbarrier.wait(kv_full, 0)
    for j in range(first, last):
        dk, dv = _ws_bwd_step(j, j - first, dk, dv, k_smem, v_smem, q_smem, do_smem,
                              lse_smem, delta_smem, ds_smem, dq_smem, q_full, q_empty,
                              do_full, do_empty, ds_ready, ds_free, desc_dq, b, h,
                              first_key, unmasked_from, qk_scale, sm_scale, GROUP,
                              CAUSAL, STAGES, t_layout, a_layout, q_layout)
    dk = (dk * sm_scale).to(DK.dtype.element_ty)
    dv = dv.to(DV.dtype.element_ty)
    if CAUSAL:
        out_layout: gl.constexpr = g_layout
    else:
        # Unmasked, dK, dV leave by lesson 11's 16-byte store layout (masked: no gain).
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8],
                                                    [4, 1], [1, 0])
        dk = gl.convert_layout(dk, out_layout)
        dv = gl.convert_layout(dv, out_layout)
    keys = first_key + gl.arange(0, ROWS, gl.SliceLayout(1, out_layout))
    # 64-bit: B * H * N * D can pass 2**31 elements.
    cols = gl.arange(0, D, gl.SliceLayout(0, out_layout))
    out = bh.to(gl.int64) * N * D + keys[:, None] * D + cols[None, :]
    gl.store(DK + out, dk, mask=keys[:, None] < N)
    gl.store(DV + out, dv, mask=keys[:, None] < N)


# Triton 3.6 fails to compile this kernel with N = 1 specialized in.
@gluon.jit(do_not_specialize=["N"])
def attn_bwd_ws_kernel(desc_q, desc_k, desc_v, desc_do, desc_lse, desc_delta, desc_dq,
                       DK, DV, qk_scale, sm_scale, H, N, CAUSAL: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                       LOADER_REGISTERS: gl.constexpr):
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    last = gl.cdiv(N, BLOCK_M)
    if CAUSAL:
        first = start_n // BLOCK_M  # blocks above the diagonal see none of these keys
        unmasked_from = first + BLOCK_N // BLOCK_M  # blocks crossing it need the mask
    else:
        first = 0
        unmasked_from = 0
    dtype: gl.constexpr = desc_q.dtype
    D: gl.constexpr = desc_q.block_type.shape[3]
    ROWS: gl.constexpr = BLOCK_N // 2
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, D], desc_v.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D], desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D],
                                        desc_do.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M],
                                         desc_lse.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M],
                                           desc_delta.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_M],
                                                                   dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [D // 32, 1, 1, BLOCK_M, 32],
                                        desc_dq.layout)
    kv_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_full, count=1)
    mbarrier.init(ds_ready, count=2)  # one arrival from each consumer group
    mbarrier.init(ds_free, count=2)
    q_full = _ws_barrier_ring(STAGES, 1)
    do_full = _ws_barrier_ring(STAGES, 1)
    q_empty = _ws_barrier_ring(STAGES, 2)
    do_empty = _ws_barrier_ring(STAGES, 2)
    # Tuples written out in the call, as in lesson 11: stored, constexprs turn run-time.
    gl.warp_specialize([
        (_ws_bwd_consumer, (0, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                            ds_smem, dq_smem, kv_full, q_full, q_empty, do_full,
                            do_empty, ds_ready, ds_free, desc_dq, DK, DV, qk_scale,
                            sm_scale, b, h, bh, start_n, N, first, unmasked_from, last,
                            CAUSAL, STAGES)),
        (_ws_bwd_consumer, (1, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                            ds_smem, dq_smem, kv_full, q_full, q_empty, do_full,
                            do_empty, ds_ready, ds_free, desc_dq, DK, DV, qk_scale,
                            sm_scale, b, h, bh, start_n, N, first, unmasked_from, last,
                            CAUSAL, STAGES)),
        (_ws_bwd_loader, (desc_q, desc_k, desc_v, desc_do, desc_lse, desc_delta, q_smem,
                          k_smem, v_smem, do_smem, lse_smem, delta_smem, kv_full,
                          q_full, q_empty, do_full, do_empty, b, h, bh, start_n, first,
                          last, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


def _ws_row_descriptor(x, block_m):
    """(1, block_m) boxes of a (B*H, N) fp32 tensor. TMA needs 16-byte row strides:
    rows of a length not a multiple of 4 are copied into a wider buffer first."""
    rows, n = x.shape
    if n % 4:
        wider = torch.zeros((rows, n + 4 - n % 4), dtype=x.dtype, device=x.device)
        x = wider[:, :n].copy_(x)
    return FWD.CheckedDescriptor(x, [rows, n], list(x.stride()), [1, block_m],
                                 _WS_ROW_LAYOUT)


def _ws_backward(q, k, v, do, lse, delta, dq, causal, sm_scale):
    """dQ, dK, dV from the warp-specialized kernel, dQ summed by TMA into dq (fp32,
    zeroed by the preprocess)."""
    B, H, N, D = q.shape
    if not FWD.tma_loadable(do):
        # Copied: do.contiguous() keeps a do off a 16-byte boundary (TMA can't load).
        do = torch.empty(do.shape, dtype=do.dtype, device=do.device).copy_(do)
    dk = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    block_m, half = WS_BWD_BLOCK_M[D], WS_BWD_BLOCK_N // 2
    descriptors = (
        FWD._ws_descriptor(q, block_m), FWD._ws_descriptor(k, half),
        FWD._ws_descriptor(v, half), FWD._ws_descriptor(do, block_m),
        _ws_row_descriptor(lse, block_m), _ws_row_descriptor(delta, block_m),
        FWD.CheckedDescriptor(dq, list(dq.shape), list(dq.stride()),
                              [1, 1, block_m, 32], _WS_DQ_LAYOUT))
    V2.launch_planned(
        V2.plan_key(q, k, v, do), attn_bwd_ws_kernel,
        (V2.host_cdiv(N, WS_BWD_BLOCK_N), B * H), 11,
        (*descriptors, dk, dv, sm_scale * V2.LOG2E, sm_scale, H, N),
        dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=WS_BWD_BLOCK_N,
             STAGES=WS_BWD_STAGES, CONSUMER_REGISTERS=FWD.WS_CONSUMER_REGISTERS,
             LOADER_REGISTERS=FWD.WS_LOADER_REGISTERS),
        num_warps=4)
    return dq.to(q.dtype), dk, dv


# %%
# The grid: a program per key block and head writes its keys' rows of :math:`dK` and
# :math:`dV` alone and adds into :math:`dQ`'s rows of each query block it walks (causal:
# from ``first``, masked before ``unmasked_from``). Drawn for one head of 512, D = 128:

if __name__ == "__main__":
    n, block_m, block_n = 512, WS_BWD_BLOCK_M[128], WS_BWD_BLOCK_N
    kit.draw_program_ownership(n, block_n, block_m, {
        p: (p * block_n // block_m, (p + 1) * block_n // block_m, n // block_m)
        for p in range(n // block_n)})

# %%
# Trading :math:`dS`
# ------------------
# Each group makes :math:`dS^T` for its own 64 keys, but a query's row of :math:`dQ`
# sums over all 128: each group's :math:`dQ` columns need both halves. Each stores its
# half in its own slot of ``ds_smem``, then multiplies both, in ``ds_exchange``'s order.
# Two mbarriers, a phase per query block at an arrival from each group, keep it right:
# ``ds_ready`` once both halves are stored (else a group could read a stale or
# half-written half), ``ds_free`` once both :math:`dQ` products have read them (else a
# group ahead could overwrite its slot under the other's product): a wrong :math:`dQ`,
# silently, in some runs only. Below, a model by those rules, the :math:`dQ` products
# taking turns on the tensor cores; dotted: a phase completes, named by its parity.


def ds_exchange(i, group):
    """A group's steps in trading dS^T for its i-th query block, in the kernel's order:
    (action, what, parity of a wait)."""
    return [("wait", "ds_free", (i & 1) ^ 1),  # both read the last block's halves
            ("store", group, None),  # its keys' dS^T, into its own slot
            ("sync", "group", None),  # fence; all 4 warps of the group have stored
            ("arrive", "ds_ready", None),
            ("wait", "ds_ready", i & 1),  # the other half is stored
            ("read", (0, 1), None),  # the dQ product, from both slots
            ("arrive", "ds_free", None)]  # once that product is done


if __name__ == "__main__":
    kit.draw_exchange(ds_exchange, half=WS_BWD_BLOCK_N // 2)

# %%
# The launcher and autograd
# -------------------------
# Three backwards can follow either forward: this lesson's Gluon kernel and lesson 07's
# two-pass and atomic ones. ``attention`` runs the one ``tools/tune.py attention``
# measured fastest for the case before this build (``BACKWARD_PATHS``, as in lesson 11:
# a backward captured in a CUDA graph takes the pick by GPU time), with lesson 11's
# table's forward. Arguments overrule the tables: ``atomic_dq=False`` asks for the
# two-pass backward, ``True`` for an atomic one (Gluon's where it runs),
# ``warp_specialized`` for or against Gluon; cases the tables miss run Gluon where it
# can, else two-pass.

BACKWARD_PATHS = FWD.paths_table("backward-paths")


def choose_paths(q, k, v, causal, sm_scale, atomic_dq, warp_specialized):
    """(whether to run the Gluon forward, the backwards to run eagerly and captured)
    for this case and these arguments. Whether Gluon takes the inputs costs host
    time: it is asked at most once, only if the tables or arguments leave it open."""
    FWD.check_flag("atomic_dq", atomic_dq)
    FWD.check_flag("warp_specialized", warp_specialized)
    gluon = functools.cache(lambda: FWD.gluon_allowed(q, k, v, warp_specialized,
                                                      sm_scale))
    return (FWD.forward_choice(q, causal, warp_specialized, gluon),
            backward_path(q, causal, atomic_dq, warp_specialized, gluon))


def backward_path(q, causal, atomic_dq, warp_specialized, gluon):
    """("gluon", "two-pass" or "atomic") twice: the backward to run eagerly, and in a
    CUDA graph (the backward's own capture counts); gluon(): gluon_allowed's answer."""
    if atomic_dq is False:
        return ("two-pass",) * 2
    if warp_specialized or atomic_dq:
        return ("gluon" if gluon() else "atomic",) * 2
    keys = (kit.path_key(V2.tuned_case(q, causal), c) for c in (False, True))
    return tuple(("gluon" if gluon() else "two-pass") if m == "gluon" else m
                 for m in (BACKWARD_PATHS.get(key, "gluon") for key in keys))


class _AttentionHopper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, warp_specialized, settled, paths):
        ctx.paths = paths
        return FWD._AttentionHopperForward.forward(ctx, q, k, v, causal, sm_scale,
                                                   warp_specialized, settled)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do, path = kit.resolved_gradient(do), ctx.paths[kit.capturing()]
        if path == "gluon":
            delta, dq = V2_BWD.backward_preprocess(o, do)
            grads = _ws_backward(q, k, v, do, lse, delta, dq, ctx.causal,
                                 ctx.sm_scale)
        else:
            grads = V2_BWD.backward(q, k, v, o, do, lse, ctx.causal, ctx.sm_scale,
                                    path == "atomic")
        return *grads, None, None, None, None, None


def attention(q, k, v, causal, sm_scale, atomic_dq=None, warp_specialized=None):
    """softmax(q k^T * sm_scale) v with the forward and backward that tools/tune.py
    measured fastest for the case.

    ``atomic_dq``: None lets the measurement choose; False runs the two-pass backward
    (the same bits every run); True an atomic one (Gluon's TMA reductions on Hopper,
    lesson 07's atomics elsewhere), whose last bits vary from run to run.
    ``warp_specialized``: None lets the measurement choose; True insists on the Gluon
    kernels, False asks for lessons 06 and 07's."""
    settled = kit.settled_paths(choose_paths, q, k, v, causal, sm_scale, atomic_dq,
                                warp_specialized)  # as lesson 11: once per layout
    ws, paths = settled.paths
    return kit.settled_call(settled, _AttentionHopper, FWD.forward, ws, q, k, v, causal,
                            sm_scale, paths)


# %%
# Correctness
# -----------
# All three gradients against float64 PyTorch on fresh random inputs, at both head dims,
# both dtypes, causal and not, and a ragged sequence length.

if __name__ == "__main__":
    reason = FWD.say_which_runs("backward", "lessons 06 and 07's kernels")
    # The tables pick lesson 07's kernels (tested there) in some cases: insist on Gluon.
    checked = functools.partial(attention, warp_specialized=None if reason else True)
    kit.check_attention_cases(checked, "14-hopper-backward-gluon")

# %%
# Benchmark
# ---------
# The backward pass in TFLOP/s (2.5 times the forward's FLOPs: five products), at lesson
# 06's sizes, against lesson 07's two-pass and atomic backwards and SDPA's backends.
# **How we time**: as in lesson 11 (:doc:`../performance`); a backward alone, as
# ``torch.autograd.grad`` after one forward; the plot and the verdicts read GPU time.

WS, PORTABLE, ATOMIC = FWD.WS, FWD.PORTABLE, FWD.ATOMIC


def backward_providers(q, k, v, causal, D):
    """The default path; the Gluon backward where it runs, and lesson 07's atomic one:
    the two the table may pick besides the two-pass backward."""
    def call(fn, **flags):
        return kit.backward_timer(fn, q, k, v, causal=causal, sm_scale=D**-0.5, **flags)

    providers = {(ATOMIC, "bwd"): call(V2_BWD.attention, atomic_dq=True),
                 (FWD.DEFAULT, "bwd"): call(attention)}
    if FWD.warp_specialized_unsupported(q, k, v) is None:
        providers[WS, "bwd"] = call(attention, warp_specialized=True)
    return providers


def default_backward(D, causal, N, captured=False):
    """The provider ``attention``'s backward runs by default on (B, H, N, D) fp16."""
    q = torch.empty(1, 1, N, D, dtype=torch.float16, device=kit.DEVICE)
    path = choose_paths(q, q, q, causal, D**-0.5, None, None)[1][captured]
    return {"gluon": WS, "two-pass": PORTABLE, "atomic": ATOMIC}[path]


# %%
# What produced the numbers below, then the plot and the table (by GPU time) of one run:

if __name__ == "__main__":
    print(kit.describe_platform())
    results, peak = FWD.hopper_benchmark("bwd", backward_providers, "Backward pass")
kit.rates_table(results, FWD.INDEX, "TFLOP/s") if __name__ == "__main__" else None

# %%
# The same calls back to back, in TFLOP/s:

(kit.rates_table(results, FWD.INDEX, "TFLOP/s", value="value")
 if __name__ == "__main__" else None)

# %%
# Reading the numbers
# -------------------
# Computed from the two tables above, in this run; the default path's table follows.

if __name__ == "__main__":
    peers = kit.against_portable(results, peak, "lesson 07's two-pass backward")
    print(kit.spread_summary(results) if kit.ON_GPU else
          "These are interpreter timings: they measure NumPy on the CPU.")
    paths = kit.default_path(results, default_backward, peers, "BACKWARD_PATHS",
                             FWD.PATHS)
    ran = [c for c in (WS, PORTABLE, ATOMIC) if c in results["provider"].values]
    kit.save_results("14-hopper-backward-gluon", [{
        "name": "attention backward, "
        f"{'warp-specialized' if WS in ran else 'no Gluon kernel ran'}",
        "unit": "TFLOP/s", "ceiling_name": kit.MATMUL_CEILING, "ceiling": peak,
        "ours": [FWD.DEFAULT, *ran], "peers": peers,
        "rows": results.to_dict("records")}])
paths if __name__ == "__main__" else None

# %%
# The host at the smallest size
# -----------------------------
# At the smallest size the host's share of a call is largest (lesson 13): a backward is
# a few Python launches (two-pass: two kernels; atomic and Gluon: the preprocess, which
# zeroes the fp32 :math:`dQ` too, the main kernel, :math:`dQ`'s cast) after PyTorch's
# autograd engine. Lesson 13's ``pacing_rows`` puts each backward's host time, measured
# now (ours also with lesson 06's launch plans cleared), beside its GPU and back-to-back
# times, and ``who_paced`` says which set the pace; beside them, the host's floor for a
# Python backward: an autograd function whose backward launches nothing, the same work
# in every case: its range shows how far host times drift. cuDNN's is C++, no Python.


class _GradientsReady(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.grads = tuple(torch.empty_like(t) for t in (q, k, v))
        return torch.empty_like(q)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        return ctx.grads


BACKWARD_OF = {"SDPA cuDNN": "SDPA cuDNN", "two-pass": PORTABLE, "atomic": ATOMIC,
               "Gluon": WS}


def backward_calls(q, k, v, causal):
    """{name: kit.Timer} of the backwards of BACKWARD_OF (Gluon where it runs): the
    very calls that the benchmark timed, so that host and back to back time the same."""
    scale = q.shape[-1] ** -0.5
    cudnn = kit.sdpa_providers(causal, scale, ["SDPA cuDNN"])["SDPA cuDNN"]
    calls = {"SDPA cuDNN": kit.backward_timer(cudnn, q, k, v)}
    for name, atomic in (("two-pass", False), ("atomic", True)):
        calls[name] = kit.backward_timer(V2_BWD.attention, q, k, v, causal=causal,
                                         sm_scale=scale, atomic_dq=atomic)
    if FWD.warp_specialized_unsupported(q, k, v) is None:
        calls["Gluon"] = kit.backward_timer(attention, q, k, v, causal=causal,
                                            sm_scale=scale, warp_specialized=True)
    return calls


if __name__ == "__main__" and kit.ON_GPU:
    import pandas as pd

    N, hosts, floors = V2.SIZES[0], [], []
    for B, H, D in V2.CASES:
        for causal in (False, True):
            q, k, v = (torch.randn(B, H, N, D, device=kit.DEVICE, dtype=torch.float16,
                                   requires_grad=True) for _ in range(3))
            hosts += PROFILE.pacing_rows(results, B, H, N, D, causal, "bwd",
                                         backward_calls(q, k, v, causal), BACKWARD_OF)
            floors.append(1e3 * PROFILE.host_ms(
                kit.backward_timer(_GradientsReady.apply, q, k, v)))
            print(f"D={D:3d} {'causal    ' if causal else 'non-causal'}: a Python "
                  f"backward that launches nothing, host {floors[-1]:.0f} us")
            del q, k, v
    hosts = pd.DataFrame(hosts).set_index(["D", "causal", "call"])
    hosts["host, no plans (us)"] = hosts["host, no plans (us)"].astype("Int64")
    print(f"The backward that launches nothing, the same work in every case, measured "
          f"{min(floors):.0f} to {max(floors):.0f} us: host times drift that far. "
          + PROFILE.plans_saved(hosts.drop(index="SDPA cuDNN", level="call")))
elif __name__ == "__main__":
    print("Launch overhead is a GPU question: under the interpreter every call runs on "
          "the host anyway.")
hosts if __name__ == "__main__" and kit.ON_GPU else None

# %%
# Where the backward's time goes
# ------------------------------
# The CUDA profiler times each kernel of lesson 07's two-pass backward at :math:`D =
# 128` and the sweep's longest sequence, and its multiply rate from the products it
# executes; then, on Hopper, the warp-specialized backward; last SDPA's cuDNN backward,
# its longest kernel counted as five products, as FlashAttention's does. Each time is
# the fastest of a few profiles of three passes: one alone can be disturbed.

BACKWARD_PRODUCTS = {"attn_bwd_preprocess_kernel": 0, "attn_bwd_dkdv_kernel": 4,
                     "attn_bwd_dq_kernel": 3, "attn_bwd_ws_kernel": 5}


def backward_kernel_ms(fn, q, k, v, passes=3, **kwargs):
    """{kernel name: GPU milliseconds per backward pass} of every kernel fn's backward
    runs (kit.kernel_ms): per kernel, the fastest of kit.PASSES profiles."""
    timer = kit.backward_timer(fn, q, k, v, **kwargs)
    with timer.context():
        call = timer.make()
        profiles = [kit.kernel_ms(call, passes) for _ in range(kit.PASSES)]
    return {name: min(p.get(name, float("inf")) for p in profiles)
            for name in profiles[0]}


def profile_backward(B, H, N, D, causal, peak):
    """Print where the GPU time of each backward goes, kernel by kernel, with each
    kernel's multiply rate as a fraction of peak (TFLOP/s)."""
    q, k, v = (torch.randn(B, H, N, D, device=kit.DEVICE, dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    per_product = 2 * B * H * N * N * D * (0.5 if causal else 1.0)  # about half, causal
    scale = D**-0.5
    two_pass = backward_kernel_ms(V2_BWD.attention, q, k, v, causal=causal,
                                  sm_scale=scale)
    times = {name: ms for name, ms in two_pass.items() if name in BACKWARD_PRODUCTS}
    total = sum(times.values())
    print(f"two-pass backward, {'causal' if causal else 'non-causal'}, D={D}, N={N}: "
          f"{total:.2f} ms of GPU time")
    rates = {}
    for name, ms in times.items():
        line = f"    {name:27} {ms:7.2f} ms ({ms / total:4.0%})"
        if BACKWARD_PRODUCTS[name]:
            rates[name] = BACKWARD_PRODUCTS[name] * per_product / ms * 1e-9
            line += (f", {BACKWARD_PRODUCTS[name]} products at {rates[name]:.0f} "
                     f"TFLOP/s ({rates[name] / peak:.0%})")
        print(line)
    print("    recomputing S and dP in the dQ pass takes about "
          f"{2 / 3 * times['attn_bwd_dq_kernel'] / total:.0%} of the backward's GPU "
          "time")
    cudnn_fn = kit.sdpa_providers(causal, scale, ["SDPA cuDNN"])["SDPA cuDNN"]
    cudnn = backward_kernel_ms(cudnn_fn, q, k, v)
    cudnn_main = max(cudnn.values())
    cudnn_rate = 5 * per_product / cudnn_main * 1e-9
    gluon_runs = FWD.warp_specialized_unsupported(q, k, v) is None
    if gluon_runs:
        every = backward_kernel_ms(attention, q, k, v, causal=causal, sm_scale=scale,
                                   warp_specialized=True)
        main = every["attn_bwd_ws_kernel"]
        rate = 5 * per_product / main * 1e-9
        print(f"    the warp-specialized backward: attn_bwd_ws_kernel {main:.2f} ms, 5 "
              f"products at {rate:.0f} TFLOP/s ({rate / peak:.0%}); "
              f"{sum(every.values()) - main:.2f} ms in the other kernels of the call")
        if sum(every.values()) >= sum(two_pass.values()):
            print("    in this profile the warp-specialized backward took no less GPU "
                  "time than the two-pass one, all kernels of both calls counted")
        elif rate < min(rates.values()):
            print("    the warp-specialized kernel multiplies more slowly than either "
                  "two-pass kernel: its whole gain is the two products it skips")
        elif rate > max(rates.values()):
            print("    the warp-specialized kernel multiplies faster than either "
                  "two-pass kernel: part of its gain is the schedule")
        else:
            print("    the warp-specialized kernel multiplies between the two two-pass "
                  "kernels")
    print(f"    SDPA cuDNN's backward: its longest kernel {cudnn_main:.2f} ms, as 5 "
          f"products {cudnn_rate:.0f} TFLOP/s ({cudnn_rate / peak:.0%}); "
          f"{sum(cudnn.values()) - cudnn_main:.2f} ms in the other kernels of the call")
    if gluon_runs:
        print(f"    the warp-specialized kernel multiplies at {rate / cudnn_rate:.0%} "
              "of the rate of cuDNN's longest kernel")


if __name__ == "__main__" and kit.ON_GPU:
    B, H, D = V2.CASES[-1]
    for causal in (False, True):
        profile_backward(B, H, V2.SIZES[-1], D, causal, peak)
elif __name__ == "__main__":
    print("The profile of the backward's kernels needs a GPU: under the interpreter "
          "there are no GPU kernels to time.")

# %%
# The percentages are of the matrix-multiply rate measured above. cuDNN's call also
# runs small kernels around its main one (ours: :math:`\Delta`, zeroing and converting
# :math:`dQ`): where those take about as long as cuDNN's and our main kernel multiplies
# more slowly, the gap lies inside the main kernel.
#
# Exercises
# ---------
# Both are plain Python and run on a CPU. Write each attempt in a new cell at the end of
# this lesson's notebook (linked at the end of the page), or in a file next to the
# lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L14 = kit.load_lesson("14-hopper-backward-gluon")
#    # ... your query_block_range(start_n, block_n, block_m, n) ...
#    L14.check_query_block_range(query_block_range)
#
# 1. **Which query blocks need the mask.** A backward program owns keys ``start_n`` to
#    ``start_n + block_n - 1`` and, with causal masking, walks query blocks of
#    ``block_m`` rows from the first that can see any of its keys. Write
#    ``query_block_range(start_n, block_n, block_m, n)`` returning ``(first,
#    unmasked_from, last)``: the first query block it walks, the first that needs no
#    causal mask (``last`` if none), and one past the last. Blocks are full width, as in
#    the kernel: keys and queries past ``n`` count as present. Block sizes are powers of
#    two, either the larger: the kernel's ``first + BLOCK_N // BLOCK_M`` holds only
#    where ``BLOCK_M`` divides ``BLOCK_N``. Then ``check_query_block_range(...)``.
# 2. **Counting products.** Write ``products_per_block_pair(atomic_dq)`` for lesson 07's
#    backward: how many matrix products one (key block, query block) pair costs with and
#    without atomic :math:`dQ`, counting the :math:`dQ` pass's. Then
#    ``check_products(products_per_block_pair)``.


def check_query_block_range(fn):
    """Your query_block_range against the causal mask itself, over many block sizes and
    lengths. Blocks are full width, as in the kernel: keys and queries past n count as
    present (the loads give zeros)."""
    for block_n in (32, 64, 128):
        for block_m in (16, 32, 64, 128):
            for n in (1, 63, 64, 200, 517):
                last = -(-n // block_m)
                for start_n in range(0, n, block_n):
                    keys = torch.arange(start_n, start_n + block_n)[:, None]
                    rows = [torch.arange(b * block_m, (b + 1) * block_m)[None, :]
                            for b in range(last)]
                    sees = [b for b in range(last) if (keys <= rows[b]).any()]
                    free = [b for b in sees if (keys <= rows[b]).all()]
                    want = (sees[0], free[0] if free else last, last)
                    got = tuple(fn(start_n, block_n, block_m, n))
                    if got != want:
                        raise AssertionError(
                            f"start_n={start_n}, block_n={block_n}, block_m={block_m}, "
                            f"n={n}: expected (first, unmasked_from, last) = {want}, "
                            f"got {got}")
    print("query_block_range is right for every block size and length tried.")


def check_products(fn):
    """Your products_per_block_pair against the lesson's kernels."""
    for atomic, want in ((False, 7), (True, 5)):
        got = fn(atomic)
        if got != want:
            raise AssertionError(
                f"with atomic_dq={atomic} a block pair does not cost {got} products: "
                "count the matrix products of each kernel the backward runs, in "
                "lesson 07")
    print("products_per_block_pair counts both backward passes right.")
