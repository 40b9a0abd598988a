"""
Fused attention v2: FlashAttention-2, forward and backward
==========================================================

FlashAttention-2 (Dao, 2023) reorganizes the FlashAttention-1 algorithm of the previous lesson so
that a GPU spends its time in matrix multiplications. This lesson builds it in Triton, forward and
backward, correct for every sequence length, head dimension and masking mode, and measures it
against PyTorch's cuDNN and flash backends. On Hopper GPUs the forward and the backward then go one
step further, to the warp-specialized design of FlashAttention-3.

You will learn:

* what FlashAttention-2 changes from v1, and why each change pays;
* how to split causal attention into blocks that need no mask and blocks that do;
* how the backward splits into a preprocess, a :math:`dK, dV` pass and a :math:`dQ` pass, and what
  FlashAttention-2's atomic additions to :math:`dQ` save and cost instead;
* how to autotune a kernel without making every build slow;
* on Hopper, how FlashAttention-3's warp specialization (a loader warp, two consumer warp groups,
  asynchronous tensor-core products) speeds up the forward, written in Gluon, Triton's
  lower-level language;
* how its backward computes :math:`dQ` without recomputing anything, with :math:`dS` shared in
  shared memory and TMA bulk reductions, and what its register budget decides;
* how to find where a backward's time goes with the CUDA profiler;
* the mistakes that learners' versions of this kernel make, and the tests that catch each one.
"""

# %%
# Where the kernels run
# ---------------------
# A CUDA GPU when there is one, otherwise the Triton interpreter on the CPU, switched on before the
# first ``@triton.jit``.

import functools
import math
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# %%
# What changes from v1, and why
# -----------------------------
# * **Normalize once, at the end.** v1 divided the accumulator by the running sum at every key
#   block. v2 keeps the *unnormalized* sum :math:`a = \sum_j e^{s_j - m} v_j` and divides by
#   :math:`\ell` once after the loop: one division per output element instead of one per element
#   per block. Only the rescaling by :math:`e^{m - m'}` remains inside the loop.
# * **exp2, with** :math:`\log_2 e` **folded into the scale.** The scores are multiplied by
#   ``sm_scale`` anyway; multiplying by ``sm_scale * log2(e)`` instead makes every exponential a
#   bare ``exp2``, one hardware instruction. The backward then saves
#   :math:`\mathrm{LSE}_2 = m + \log_2 \ell` per row, in the same base-2 units.
# * **Parallel over the sequence, in both passes.** The forward grid has one program per
#   (query block, batch, head), as in v1. The v1 backward had one program per (batch, head), far
#   fewer programs than an H100 has SMs at small batch sizes. v2's backward runs one program per
#   key block, which owns that block's :math:`dK, dV`. :math:`dQ` is the awkward one: every key
#   block contributes to every query row's :math:`dQ`. The FlashAttention-2 paper has the key-block
#   programs *add* their contributions into an fp32 :math:`dQ` with atomic instructions. This
#   lesson builds that, and also the alternative that Triton's own tutorial uses: a second pass
#   with one program per query block, which owns its rows of :math:`dQ` outright. Which is faster
#   is measured below.
# * **Causal work split by the diagonal.** For a query block, key blocks entirely below the
#   diagonal are fully visible and need no mask; only the block on the diagonal is masked. Blocks
#   above it are skipped altogether: causal attention does half the work.
#
# How much work, and is it compute-bound? The forward does two matrix products of
# :math:`2N^2D` floating-point operations per (batch, head): :math:`4BHN^2D` FLOPs, half that when
# causal. The backward recomputes :math:`QK^T` and does four more products: 2.5 times the forward.
# The bytes that must move are :math:`Q, K, V, O`: :math:`4BHND` elements. The arithmetic
# intensity is therefore about :math:`N` FLOPs per element, :math:`N/2` per byte in fp16: at
# :math:`N = 4096`, about 2,000 FLOPs per byte, far past the H100's ridge point (about 990 TFLOP/s
# over 3.35 TB/s, some 300 FLOPs per byte). Attention is bound by the tensor cores, and its speed is
# best given as a fraction of the matrix-multiply rate.
#
# The forward kernel
# ------------------
# The inner loop walks key blocks from ``lo`` to ``hi``. ``MASKED`` is a compile-time flag: the
# compiler produces one loop without any masking for the bulk of the keys, and one with masks for
# the causal diagonal and for the ragged last block when :math:`N` is not a multiple of
# ``BLOCK_N``. Keys past :math:`N` get a score of :math:`-\infty`; their loads read zeros.

LOG2E = 1.4426950408889634


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, lo, hi, rows, N, qk_scale,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        keys = start_n + cols
        if MASKED:
            kt = tl.load(kt_ptrs + keys[None, :] * skn, mask=keys[None, :] < N, other=0.0)
            v = tl.load(v_ptrs + keys[:, None] * svn, mask=keys[:, None] < N, other=0.0)
        else:
            kt = tl.load(kt_ptrs + keys[None, :] * skn)
            v = tl.load(v_ptrs + keys[:, None] * svn)
        if q.dtype == tl.float32:  # interpreter bf16 workaround: see the note below
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, kt)
        if MASKED:
            valid = keys[None, :] < N
            if CAUSAL:
                valid = valid & (keys[None, :] <= rows[:, None])
            s = tl.where(valid, s * qk_scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            s = s - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            s = s * qk_scale - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=rows[:, None] < N, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    kt_ptrs = K + b * skb + h * skh + d[:, None] * skd  # K transposed: (D, keys)
    v_ptrs = V + b * svb + h * svh + d[None, :] * svd
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        # Off the diagonal: every key is visible, no mask. On it: the causal mask.
        diag = start_m * BLOCK_M
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, 0, diag, rows, N, qk_scale,
                                        BLOCK_N, False, CAUSAL)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, diag,
                                        tl.minimum(diag + BLOCK_M, N), rows, N, qk_scale, BLOCK_N, True, CAUSAL)
    else:
        full = (N // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, 0, full, rows, N, qk_scale,
                                        BLOCK_N, False, CAUSAL)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, full, N, rows, N, qk_scale,
                                        BLOCK_N, True, CAUSAL)
    row_ok = rows < N
    tl.store(LSE + bh * N + rows, m_i + tl.math.log2(l_i), mask=row_ok)
    o = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, o.to(O.dtype.element_ty), mask=row_ok[:, None])


# %%
# The causal split requires ``BLOCK_M`` to be a multiple of ``BLOCK_N``, so that the diagonal of a
# query block covers whole key blocks.
#
# Autotuning without a slow build
# -------------------------------
# The best tile sizes depend on the GPU, the head dimension and the masking. ``triton.autotune``
# times each configuration the first time it meets a new *key* and remembers the winner. Two
# choices keep that affordable: the key is the head dimension, the causal flag and the sequence
# length rounded to a power of two (not the exact length, which would re-tune for every new
# :math:`N`), and configurations that cannot work are pruned before any is compiled: tiles that
# break the causal split, and pipelines whose buffered key and value tiles
# (``num_stages x 2 x BLOCK_N x D`` elements) would not fit in the SM's shared memory. The candidate
# list itself is short because it was measured: ``tools/tune.py attention`` in this repository
# sweeps a wider space on a GPU, and these are the configurations that won somewhere on an H100.
# (An early version of this lesson also pruned 128 x 128 tiles at :math:`D = 128`, guessing that
# they would spill registers; in the sweep they won at several sizes. Measure, don't guess.) The
# best two or three tiles are often within a few percent of each other, less than the GPU's
# run-to-run noise, so two builds on the same machine can pick different winners: the table near
# the end of this page shows what this build picked. Under the interpreter there is nothing to
# tune, and one configuration runs.


def _configs(shapes):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


SHARED_MEMORY_BYTES = 227 * 1024  # per block on Hopper; smaller GPUs fail to compile the rest


def _fits(config, D):
    return config.num_stages * 2 * config.kwargs["BLOCK_N"] * D * 2 <= SHARED_MEMORY_BYTES


def _prune_fwd(configs, named_args, **kwargs):
    keep = [c for c in configs if c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0 and _fits(c, kwargs.get("D", named_args.get("D")))]
    return keep or configs[-1:]


def _prune_bwd(configs, named_args, **kwargs):
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= c.kwargs["BLOCK_N"] and _fits(c, kwargs.get("D", named_args.get("D")))]
    return keep or configs[-1:]


# %%
# The backward kernels
# --------------------
# With :math:`P` recomputed from the saved :math:`\mathrm{LSE}_2` as
# :math:`P = 2^{S \cdot \mathrm{scale} \cdot \log_2 e - \mathrm{LSE}_2}` (already normalized, no
# division), the gradients are
#
# .. math::
#
#    dV = P^T dO,\quad dP = dO\,V^T,\quad dS = P \circ (dP - \Delta),\quad
#    dK = \mathrm{scale}\cdot dS^T Q,\quad dQ = \mathrm{scale}\cdot dS\,K,
#
# with :math:`\Delta_i = \sum_d O_{id}\,dO_{id}`, computed by a small preprocess kernel.
#
# The :math:`dK, dV` program owns a block of keys and walks the query blocks that can see them:
# with causal masking, only those at or below the diagonal. At each query block it has
# :math:`dS` in registers, and :math:`dS\,K` is exactly this key block's share of those rows'
# :math:`dQ`. There are two ways to finish :math:`dQ`:
#
# * **Atomically** (``atomic_dq=True``, the paper's way): multiply :math:`dS\,K` right there and
#   add it into an fp32 buffer with ``tl.atomic_add``. Five matrix products per block pair, the
#   minimum. The price: traffic to the GPU's L2 cache for every addition, an fp32 buffer of
#   :math:`BHND` elements, and a :math:`dQ` whose last bits depend on the order in which programs
#   happened to add, so two runs can differ slightly. ``sem="relaxed"`` tells Triton that the
#   additions need no ordering with other memory operations, only atomicity.
# * **In a second pass** (the default): a :math:`dQ` program owns a block of queries and walks the
#   key blocks it sees. It must recompute :math:`S` and :math:`dP`, two matrix products that the
#   :math:`dK, dV` pass already did: seven products instead of five, 40% more tensor-core work,
#   but no atomics, nothing extra in memory, and the same bits on every run.
#
# In both, masking is needed only on the diagonal and on ragged edges: a query row past :math:`N`
# is loaded as zeros, so its :math:`dO` and :math:`\Delta` are zero and it contributes nothing; a
# key row past :math:`N` is loaded as zeros, so it adds nothing to :math:`dQ`, and its own
# :math:`dK, dV` rows are never stored.


@triton.jit
def attn_bwd_preprocess_kernel(O, DO, DELTA, H, N, sob, soh, son, sod, sdb, sdh, sdn, sdd,
                               D: tl.constexpr, BLOCK_M: tl.constexpr):
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    ok = rows[:, None] < N
    o = tl.load(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, mask=ok, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd, mask=ok, other=0.0)
    tl.store(DELTA + bh * N + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < N)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys, lo, hi, N, sm_scale,
                    qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    for start_m in tl.range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        if MASKED:
            q = tl.load(q_ptrs + rows[:, None] * sqn, mask=rows[:, None] < N, other=0.0)
            do = tl.load(do_ptrs + rows[:, None] * sdn, mask=rows[:, None] < N, other=0.0)
            lse = tl.load(LSE_bh + rows, mask=rows < N, other=0.0)
            delta = tl.load(DELTA_bh + rows, mask=rows < N, other=0.0)
        else:
            q = tl.load(q_ptrs + rows[:, None] * sqn)
            do = tl.load(do_ptrs + rows[:, None] * sdn)
            lse = tl.load(LSE_bh + rows)
            delta = tl.load(DELTA_bh + rows)
        if k.dtype == tl.float32:  # interpreter bf16 workaround
            q, do = q.to(tl.float32), do.to(tl.float32)
        pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # P^T: (keys, queries)
        if MASKED and CAUSAL:
            pt = tl.where(keys[:, None] <= rows[None, :], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk)
        if ATOMIC_DQ:
            # This key block's share of dQ for these query rows, added to an fp32 buffer that every
            # key block of the head adds to as well: the fifth matrix product, no second pass.
            dq = tl.dot(tl.trans(dst), k) * sm_scale
            if MASKED:
                tl.atomic_add(dq_ptrs + rows[:, None] * D, dq, mask=rows[:, None] < N, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs + rows[:, None] * D, dq, sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA, sm_scale, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdn, sdd,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    keys = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    key_ok = keys[:, None] < N
    k = tl.load(K + b * skb + h * skh + keys[:, None] * skn + d[None, :] * skd, mask=key_ok, other=0.0)
    v = tl.load(V + b * svb + h * svh + keys[:, None] * svn + d[None, :] * svd, mask=key_ok, other=0.0)
    if UPCAST_DOT:
        k, v = k.to(tl.float32), v.to(tl.float32)
    q_ptrs = Q + b * sqb + h * sqh + d[None, :] * sqd
    do_ptrs = DO + b * sdb + h * sdh + d[None, :] * sdd
    dq_ptrs = DQ + bh * N * D + d[None, :]  # the fp32 dQ buffer: contiguous, D elements per row
    LSE_bh, DELTA_bh = LSE + bh * N, DELTA + bh * N
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    full = (N // BLOCK_M) * BLOCK_M  # query rows below this need no bounds mask
    if CAUSAL:
        # Query blocks that cross this key block's diagonal need the mask; those below do not.
        past_diag = tl.minimum(start_n + BLOCK_N, N)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
                                 start_n, past_diag, N, sm_scale, qk_scale, D, BLOCK_M, True, CAUSAL, ATOMIC_DQ)
        lo = start_n + BLOCK_N
    else:
        lo = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
                             lo, tl.maximum(lo, full), N, sm_scale, qk_scale, D, BLOCK_M, False, CAUSAL, ATOMIC_DQ)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
                             tl.maximum(lo, full), N, N, sm_scale, qk_scale, D, BLOCK_M, True, False, ATOMIC_DQ)
    out = bh * N * D + keys[:, None] * D + d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, lo, hi, N, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            kt = tl.load(kt_ptrs + keys[None, :] * skn, mask=keys[None, :] < N, other=0.0)
            vt = tl.load(vt_ptrs + keys[None, :] * svn, mask=keys[None, :] < N, other=0.0)
        else:
            kt = tl.load(kt_ptrs + keys[None, :] * skn)
            vt = tl.load(vt_ptrs + keys[None, :] * svn)
        if q.dtype == tl.float32:  # interpreter bf16 workaround
            kt, vt = kt.to(tl.float32), vt.to(tl.float32)
        p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])
        if MASKED and CAUSAL:
            p = tl.where(keys[None, :] <= rows[:, None], p, 0.0)
        dp = tl.dot(do, vt)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, sm_scale, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdn, sdd,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # BLOCK_M / BLOCK_N are swapped on launch: this program owns BLOCK_N query rows.
    start_m = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = start_m + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    row_ok = rows < N
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd, mask=row_ok[:, None], other=0.0)
    if UPCAST_DOT:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(LSE + bh * N + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * N + rows, mask=row_ok, other=0.0)
    kt_ptrs = K + b * skb + h * skh + d[:, None] * skd
    vt_ptrs = V + b * svb + h * svh + d[:, None] * svd
    dq = tl.zeros([BLOCK_N, D], tl.float32)
    if CAUSAL:
        diag = start_m
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, 0, diag, N, qk_scale,
                           BLOCK_M, False, CAUSAL)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, diag,
                           tl.minimum(diag + BLOCK_N, N), N, qk_scale, BLOCK_M, True, CAUSAL)
    else:
        full = (N // BLOCK_M) * BLOCK_M
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, 0, full, N, qk_scale,
                           BLOCK_M, False, CAUSAL)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, full, N, N, qk_scale,
                           BLOCK_M, True, CAUSAL)
    tl.store(DQ + bh * N * D + rows[:, None] * D + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# %%
# In the :math:`dQ` kernel the roles of the two block sizes swap: it owns the large block (of
# queries) and walks the small one (of keys), just as the :math:`dK, dV` kernel owns the large
# block of keys. One tuned pair of sizes serves both.
#
# A note on the interpreter: in Triton 3.9 it stores bf16 values as 16-bit integers and
# multiplies those integers inside ``tl.dot``. The kernels take an ``UPCAST_DOT`` flag that turns
# the first operands into fp32 (and the helpers follow the dtype they see); the launcher sets it
# only for bf16 under the interpreter, so compiled GPU code never pays for it.
#
# On Hopper: a warp-specialized forward, written in Gluon
# -------------------------------------------------------
# The forward kernel above reaches about 0.8x cuDNN's speed at :math:`D = 128` on an H100, and no
# choice of tiles, stages or warps moves it further (the section "Where the backward's time goes"
# below lists what was tried). The reason is how its warps spend their time. Every
# warp does everything in turn: it issues the loads of the next key block, waits for :math:`QK^T`
# on the tensor cores, computes the exponentials on the ordinary cores while the tensor cores
# idle, then waits for :math:`PV`. Triton
# overlaps some of this on its own, but the program shape stays "all warps, one step at a time".
#
# FlashAttention-3 (Shah et al., 2024), and cuDNN, give the warps *roles* instead:
#
# * **A producer warp** does nothing but issue bulk asynchronous copies (Hopper's Tensor Memory
#   Accelerator, TMA) of K and V tiles into a ring of shared-memory buffers. Each buffer has two
#   *mbarriers*, hardware counters in shared memory: "full" flips when the copy has landed, and
#   "empty" when every consumer is done with the tile, so the producer may refill it.
# * **Two consumer warp groups** (4 warps, 128 threads each) own 64 query rows each, so that while
#   one computes exponentials, the other's matrix products can run. They never load anything.
# * **Registers move to where the work is.** A loader needs few registers; ``setmaxnreg`` lets it
#   give most of its share back, so each consumer thread may hold 240 instead of the 168 that an
#   even split of the SM's 65,536 registers among 12 warps would give.
# * **Overlap inside each consumer.** The tensor cores run asynchronously (``wgmma``): a consumer
#   issues :math:`S_{j+1} = QK_{j+1}^T` and :math:`O \mathrel{+}= P_j V_j`, waits only for the first,
#   and computes the exponentials of block :math:`j+1` while :math:`P_j V_j` still runs.
#
# Triton's compiler decides for itself which warps do what, and on Hopper its automatic warp
# specialization did not find this schedule. *Gluon*, Triton's lower-level language, lets the
# program say it: explicit layouts, shared-memory buffers, mbarriers, TMA copies, asynchronous
# ``warpgroup_mma`` and ``warp_specialize``, which runs one function in the program's own 4 warps
# (the first consumer) and others in extra warps (the second consumer, and the loader). The kernel
# below is that design, small enough to read in one sitting.
#
# Three details are worth knowing before reading it:
#
# * The TMA copies read 4-D boxes (1 batch, 1 head, 64 or 128 rows, :math:`D`) out of the
#   (B, H, N, D) tensors, with whatever strides those have, and fill rows past :math:`N` with zeros.
#   So any sequence length and the transposed inputs work. Only the last, ragged key block needs a
#   mask. The price: TMA needs the last dimension contiguous and the other strides to be positive
#   multiples of 16 bytes (a head broadcast with ``expand``, stride 0, does not qualify). Other
#   inputs take the portable kernel.
# * An mbarrier's *phase* flips each time it completes, and a wait names the phase it waits for. A
#   ring of ``STAGES`` buffers is reused every ``STAGES`` blocks, so block :math:`j` waits for phase
#   :math:`\lfloor j / \text{STAGES} \rfloor \bmod 2`. A fresh barrier counts as having completed
#   phase 1, which is why the producer's first wait for "empty" passes at once.
# * The tiles are fixed: 128 queries (two halves of 64) by 128 keys, with 2 buffers each for K and V:
#   at :math:`D = 128`, 32 KiB of Q and 128 KiB of K and V in shared memory. On an H100, 64-key
#   tiles were slower at both head dims. A third buffer (it fits even at :math:`D = 128`: 224 of
#   the 227 KiB a program may have) ran at 0.96x to 1.03x the speed of two at both head dims and
#   :math:`N` from 4096 to 16384, the best of three timings each: a tie. There is no autotuning
#   here: the descriptors' boxes and the barriers are sized with the tiles.
#
# Gluon is experimental, and its names still move: Triton 3.6 calls the TMA copy
# ``async_copy_global_to_shared``, later versions ``async_load``. The interpreter cannot run Gluon
# at all, so on a CPU (and on GPUs other than Hopper) ``attention`` uses the portable kernel above.

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

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
def _ws_loader(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_full, k_full, k_empty, v_full, v_empty,
               b, h, first_row, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    half: gl.constexpr = desc_q.block_type.shape[2]
    mbarrier.expect(q_full, 2 * desc_q.block_type.nbytes)
    _tma_load(desc_q, [b, h, first_row, 0], q_full, q_smem.index(0))
    _tma_load(desc_q, [b, h, first_row + half, 0], q_full, q_smem.index(1))
    for j in range(n_blocks):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        # K and V have their own barriers: a consumer is done with K_j long before V_j.
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_full.index(stage), desc_k.block_type.nbytes)
        _tma_load(desc_k, [b, h, j * BLOCK_N, 0], k_full.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_full.index(stage), desc_v.block_type.nbytes)
        _tma_load(desc_v, [b, h, j * BLOCK_N, 0], v_full.index(stage), v_smem.index(stage))


@gluon.jit
def _ws_consumer(HALF: gl.constexpr, q_smem, k_smem, v_smem, q_full, k_full, k_empty, v_full, v_empty, O, LSE,
                 qk_scale, b, h, bh, start_m, N, n_full, n_blocks, sob, soh, son, D: gl.constexpr,
                 CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    # One warp group: wgmma's accumulator layouts for S (ROWS x BLOCK_N) and O (ROWS x D), and P
    # as the register operand of the second product.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(HALF).reshape([ROWS, D])
    rows = start_m * 2 * ROWS + HALF * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)

    # Block 0: S_0 and its exponentials, before the loop's steady state.
    mbarrier.wait(q_full, 0)
    mbarrier.wait(k_full.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), zeros, use_acc=False)
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_full == 0:
        p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, True, CAUSAL)
    else:
        p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, False, CAUSAL)
    for j in range(1, n_blocks):
        ks = j % STAGES
        mbarrier.wait(k_full.index(ks), (j // STAGES) & 1)
        s_next = warpgroup_mma(q, k_smem.index(ks).reshape([BLOCK_N, D]).permute((1, 0)), zeros, use_acc=False,
                               is_async=True)
        vs = (j - 1) % STAGES
        mbarrier.wait(v_full.index(vs), ((j - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_next = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, D]), acc, is_async=True)
        # wgmma groups finish in order: "at most 1 in flight" means S_j is ready, P_{j-1} V_{j-1} may still run.
        s = warpgroup_mma_wait(1, deps=[s_next])
        mbarrier.arrive(k_empty.index(ks), count=1)
        if j >= n_full:
            p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols + j * BLOCK_N, N, True, CAUSAL)
        else:
            p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols, N, False, CAUSAL)
        acc, p_op = warpgroup_mma_wait(0, deps=[o_next, p_op])
        mbarrier.arrive(v_empty.index(vs), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    vs = (n_blocks - 1) % STAGES
    mbarrier.wait(v_full.index(vs), ((n_blocks - 1) // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(vs).reshape([BLOCK_N, D]), acc)

    gl.store(LSE + bh * N + rows, m_i + gl.log2(l_i), mask=rows < N)
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = start_m * 2 * ROWS + HALF * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    gl.store(O + b * sob + h * soh + o_rows[:, None] * son + o_cols[None, :], o.to(O.dtype.element_ty),
             mask=o_rows[:, None] < N)


@gluon.jit
def _ws_barrier_ring(STAGES: gl.constexpr, ARRIVALS: gl.constexpr):
    """STAGES mbarriers in shared memory, one per buffer of a ring, each completing after ARRIVALS arrivals."""
    ring = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ring.index(s), count=ARRIVALS)
    return ring


@gluon.jit
def attn_fwd_ws_kernel(desc_q, desc_k, desc_v, O, LSE, qk_scale, H, N, sob, soh, son,
                       D: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr):
    start_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    if CAUSAL:
        n_full = start_m * (BLOCK_M // BLOCK_N)  # key blocks wholly below the diagonal
        n_blocks = gl.minimum(n_full + BLOCK_M // BLOCK_N, gl.cdiv(N, BLOCK_N))
    else:
        n_full = N // BLOCK_N
        n_blocks = gl.cdiv(N, BLOCK_N)
    dtype: gl.constexpr = desc_q.dtype
    # Leading 1, 1: the TMA boxes are 4-D (batch, head, rows, D); the consumers view them as 2-D.
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M // 2, D], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_v.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_full, count=1)
    k_full = _ws_barrier_ring(STAGES, 1)
    v_full = _ws_barrier_ring(STAGES, 1)
    k_empty = _ws_barrier_ring(STAGES, 2)  # one arrival from each consumer
    v_empty = _ws_barrier_ring(STAGES, 2)
    # The argument tuples are written out in the call: a tuple stored in a variable first would
    # turn its compile-time constants into run-time values.
    gl.warp_specialize([
        (_ws_consumer, (0, q_smem, k_smem, v_smem, q_full, k_full, k_empty, v_full, v_empty, O, LSE, qk_scale, b, h,
                        bh, start_m, N, n_full, n_blocks, sob, soh, son, D, CAUSAL, BLOCK_M // 2, BLOCK_N, STAGES)),
        (_ws_consumer, (1, q_smem, k_smem, v_smem, q_full, k_full, k_empty, v_full, v_empty, O, LSE, qk_scale, b, h,
                        bh, start_m, N, n_full, n_blocks, sob, soh, son, D, CAUSAL, BLOCK_M // 2, BLOCK_N, STAGES)),
        (_ws_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_full, k_full, k_empty, v_full, v_empty,
                      b, h, start_m * BLOCK_M, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


def tma_loadable(t):
    """Whether TMA can copy boxes of t: its last dimension contiguous, its other strides positive
    multiples of 16 bytes (a broadcast axis, stride 0, as in k.expand(...), is out) and its data
    16-byte aligned."""
    return (t.stride(-1) == 1 and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0)


def warp_specialized_unsupported(q, k, v):
    """Why the warp-specialized kernels cannot take these inputs here, or None when they can."""
    if not ON_GPU or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"it takes float16 or bfloat16, not {q.dtype}"
    if q.shape[-1] not in WS_HEAD_DIMS:
        return f"it takes head dims {WS_HEAD_DIMS}, not {q.shape[-1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not tma_loadable(t):
            return (f"TMA copies need {name}'s last dimension contiguous, its other strides positive multiples of "
                    f"16 bytes and its data 16-byte aligned; it has strides {t.stride()}")
    return None


@functools.lru_cache
def _ws_box_layout(rows, D, dtype):
    """The shared-memory layout of one TMA box, (1, 1, rows, D): cached, as computing it costs host time at each call."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, D], gl.float16 if dtype == torch.float16 else gl.bfloat16)


def _ws_descriptor(t, rows):
    """A TMA descriptor for (1, 1, rows, D) boxes of a (B, H, N, D) tensor, with whatever strides it has."""
    D = t.shape[-1]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, D], _ws_box_layout(rows, D, t.dtype))


def _ws_forward(q, k, v, o, lse, causal, sm_scale):
    B, H, N, D = q.shape
    attn_fwd_ws_kernel[(triton.cdiv(N, WS_BLOCK_M), B * H)](
        _ws_descriptor(q, WS_BLOCK_M // 2), _ws_descriptor(k, WS_BLOCK_N), _ws_descriptor(v, WS_BLOCK_N), o, lse,
        sm_scale * LOG2E, H, N, *o.stride()[:3], D=D, CAUSAL=causal, BLOCK_M=WS_BLOCK_M, BLOCK_N=WS_BLOCK_N,
        STAGES=WS_STAGES, CONSUMER_REGISTERS=WS_CONSUMER_REGISTERS, LOADER_REGISTERS=WS_LOADER_REGISTERS, num_warps=4)


# %%
# The backward on Hopper: FlashAttention-3's design
# -------------------------------------------------
# The portable backward above executes seven matrix products per block pair where five would do:
# its :math:`dQ` pass recomputes :math:`S` and :math:`dP`. Its atomic variant executes five, but
# adds every element of :math:`dQ` with its own atomic instruction, and on an H100 that costs more
# than the two products it saves (the benchmark below measures both). FlashAttention-3's backward
# keeps the five products and makes the additions cheap. One program owns 128 keys, split between
# two consumer warp groups of 64 keys each, plus a loader warp that streams 64-query blocks of
# :math:`Q` and :math:`dO` through a ring of shared-memory buffers, as in the forward. Per query
# block, each consumer group:
#
# 1. issues :math:`S^T = K Q^T` and :math:`dP^T = V\,dO^T` for its keys (64 x 64 each);
# 2. makes :math:`P^T` and :math:`dS^T = P^T \circ (dP^T - \Delta)`, and starts
#    :math:`dV \mathrel{+}= P^T dO` with :math:`P^T` straight from registers (the left operand of
#    ``wgmma`` may live in registers; that is why the kernel computes :math:`S^T` and not :math:`S`);
# 3. writes its :math:`dS^T` to shared memory and waits for the other group's. Each query's
#    :math:`dQ` row needs :math:`dS` for all 128 keys of the program, so each group multiplies
#    :math:`dS\,K` for *half of the columns* of :math:`dQ` (64 of 128 at :math:`D = 128`) over both
#    groups' keys: one addition per element per program, not two;
# 4. starts :math:`dK \mathrel{+}= dS^T Q` last, and while it runs, sends its :math:`dQ` columns
#    out: registers to shared memory, then a *TMA reduction* (``cp.reduce.async.bulk``) adds the
#    whole fp32 tile into global memory in one bulk operation, in the L2 cache, while the warps go on.
#
# Four details decided its speed, each measured on an H100 against the two-pass backward in the
# same run (Triton 3.6, :math:`D = 128`, :math:`N` from 4096 to 16384; the numbers are in the
# section "Where the backward's time goes" below):
#
# * **Bulk reductions, not element atomics.** With ``gl.atomic_add`` (one ``red.global.add.f32``
#   per element) the same design ran at 0.74x to 0.87x the two-pass speed; with TMA reductions it
#   reached 0.94x. Triton 3.6's Gluon can emit the operation but has no name for it yet (later
#   versions call it ``tma.async_atomic_add``), so the lesson defines the builtin itself, the way it
#   bridges ``async_load``'s two names.
# * **A bank-conflict-free staging tile.** TMA reads the fp32 tile from shared memory in the
#   swizzled layout that ``NVMMASharedLayout`` describes, whose rows may be at most 128 bytes: 32
#   fp32 values. So :math:`dQ`'s 64 columns go out as two 32-column boxes. In an unswizzled 256-byte
#   row layout, the eight rows that one warp writes land on the same memory banks: an 8-way
#   conflict on every store.
# * **Registers.** A consumer thread holds :math:`dK` and :math:`dV` for 64 keys (128 registers at
#   :math:`D = 128`), :math:`S^T` and :math:`dP^T` (64 more), and its :math:`dQ` columns (32), of
#   the 240 that ``setmaxnreg`` gives it. The first working version spilled 412 bytes per thread to
#   local memory without masking and 1004 bytes with it (``ptxas -v``). Four changes brought that to
#   116 and 144 bytes: the loader also brings each query block's :math:`\mathrm{LSE}_2` and
#   :math:`\Delta` into shared memory by TMA (no pointers, masks or index vectors in the
#   consumers); :math:`P^T` is kept in 16 bits once :math:`dS^T` is made; the causal mask's index
#   vectors are made where they are used, not kept across the loop; and one loop handles the masked
#   and the unmasked query blocks, with the mask behind a branch, since a second loop made the
#   compiler spill in both.
# * **Overlap.** :math:`dK`'s product is issued after :math:`dQ`'s, so the wait for :math:`dQ`
#   leaves it running while the tile is stored and sent.
#
# Where the TMA box crosses the end of the sequence, the loads fill zeros and the reductions skip
# the rows past :math:`N`, so no query block needs a bounds mask. :math:`dQ` is summed in an fp32
# buffer and rounded to the input dtype at the end. As with ``atomic_dq=True``, the order of the
# additions varies, so :math:`dQ`'s last bits can differ from run to run; ``atomic_dq=False``
# asks for the two-pass backward, which gives the same bits every time.

WS_BWD_BLOCK_M, WS_BWD_BLOCK_N, WS_BWD_STAGES = 64, 128, 2
_WS_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
_WS_DQ_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)

if hasattr(tma, "async_atomic_add"):
    _tma_reduce_add = tma.async_atomic_add
else:  # Triton 3.6: the compiler has the operation, Gluon no name for it yet
    from triton._C.libtriton import ir as _ir  # noqa: E402
    from triton.experimental.gluon.language._core import builtin as _gluon_builtin  # noqa: E402

    @_gluon_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

_group_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier  # named so since Triton 3.7


@gluon.jit
def _ws_bwd_loader(desc_q, desc_k, desc_v, desc_do, desc_lse, desc_delta, q_smem, k_smem, v_smem, do_smem, lse_smem,
                   delta_smem, kv_full, q_full, q_empty, do_full, do_empty, b, h, bh, start_n, first, last,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = desc_k.block_type.shape[2]
    mbarrier.expect(kv_full, 2 * desc_k.block_type.nbytes + 2 * desc_v.block_type.nbytes)
    for g in gl.static_range(2):  # the keys of both consumer groups
        _tma_load(desc_k, [b, h, start_n + g * ROWS, 0], kv_full, k_smem.index(g))
        _tma_load(desc_v, [b, h, start_n + g * ROWS, 0], kv_full, v_smem.index(g))
    for j in range(first, last):
        stage = (j - first) % STAGES
        phase = ((j - first) // STAGES) & 1
        # Q travels with its rows' LSE, dO with their Delta, each pair under one barrier.
        mbarrier.wait(q_empty.index(stage), phase ^ 1)
        mbarrier.expect(q_full.index(stage), desc_q.block_type.nbytes + desc_lse.block_type.nbytes)
        _tma_load(desc_q, [b, h, j * BLOCK_M, 0], q_full.index(stage), q_smem.index(stage))
        _tma_load(desc_lse, [bh, j * BLOCK_M], q_full.index(stage), lse_smem.index(stage))
        mbarrier.wait(do_empty.index(stage), phase ^ 1)
        mbarrier.expect(do_full.index(stage), desc_do.block_type.nbytes + desc_delta.block_type.nbytes)
        _tma_load(desc_do, [b, h, j * BLOCK_M, 0], do_full.index(stage), do_smem.index(stage))
        _tma_load(desc_delta, [bh, j * BLOCK_M], do_full.index(stage), delta_smem.index(stage))


@gluon.jit
def _ws_bwd_step(j, i, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, q_full,
                 q_empty, do_full, do_empty, ds_ready, ds_free, desc_dq, b, h, first_key, unmasked_from, qk_scale,
                 sm_scale, GROUP: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                 t_layout: gl.constexpr, a_layout: gl.constexpr, q_layout: gl.constexpr):
    """Query block j, the i-th of this program: dV, dK for this group's keys, and its columns of dQ."""
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
    st, dpt = warpgroup_mma_wait(0, deps=[st, dpt])
    pt = gl.exp2(st * qk_scale - lse_smem.index(stage).load(t_layout))
    if CAUSAL and j < unmasked_from:
        # Key row r sees query column c when first_key + r <= j * BLOCK_M + c.
        rel = gl.arange(0, ROWS, gl.SliceLayout(1, t_layout)) + (first_key - j * BLOCK_M)
        pt = gl.where(rel[:, None] <= gl.arange(0, BLOCK_M, gl.SliceLayout(0, t_layout))[None, :], pt, 0.0)
    dst = (pt * (dpt - delta_smem.index(stage).load(t_layout))).to(qs.dtype)
    pt_op = gl.convert_layout(pt.to(qs.dtype), a_layout)
    dv = warpgroup_mma(pt_op, dos, dv, is_async=True)
    # Share dS^T: the other group's is needed for this group's columns of dQ, and vice versa.
    mbarrier.wait(ds_free, (i & 1) ^ 1)  # both groups are done with the previous block's
    ds_smem.index(GROUP).store(dst)
    fence_async_shared()
    _group_barrier()
    mbarrier.arrive(ds_ready, count=1)
    mbarrier.wait(ds_ready, i & 1)
    dq = gl.zeros([BLOCK_M, DH], gl.float32, q_layout)
    for g in gl.static_range(2):
        kg = k_smem.index(g).reshape([ROWS, D]).slice(GROUP * DH, DH, dim=1)
        dq = warpgroup_mma(ds_smem.index(g).permute((1, 0)), kg, dq, use_acc=g > 0, is_async=True)
    dst_op = gl.convert_layout(dst, a_layout)
    dk = warpgroup_mma(dst_op, qs, dk, is_async=True)  # issued last: it runs while dQ is sent out
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
        _tma_reduce_add(desc_dq, [b, h, j * BLOCK_M, GROUP * DH + p * 32], dq_smem.index(GROUP * (DH // 32) + p))
    dk, dst_op = warpgroup_mma_wait(0, deps=[dk, dst_op])
    mbarrier.arrive(q_empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def _ws_bwd_consumer(GROUP: gl.constexpr, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                     kv_full, q_full, q_empty, do_full, do_empty, ds_ready, ds_free, desc_dq, DK, DV, qk_scale, sm_scale,
                     b, h, bh, start_n, N, first, unmasked_from, last, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = k_smem.shape[-2]
    D: gl.constexpr = k_smem.shape[-1]
    BLOCK_M: gl.constexpr = q_smem.shape[-2]
    # S^T, dP^T: ROWS x BLOCK_M; dK, dV: ROWS x D; dQ: BLOCK_M x D/2; P^T, dS^T as a register operand.
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(0, g_layout, 2)
    dk = gl.zeros([ROWS, D], gl.float32, g_layout)
    dv = gl.zeros([ROWS, D], gl.float32, g_layout)
    first_key = start_n + GROUP * ROWS
    mbarrier.wait(kv_full, 0)
    for j in range(first, last):
        dk, dv = _ws_bwd_step(j, j - first, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem,
                              dq_smem, q_full, q_empty, do_full, do_empty, ds_ready, ds_free, desc_dq, b, h, first_key,
                              unmasked_from, qk_scale, sm_scale, GROUP, CAUSAL, STAGES, t_layout, a_layout, q_layout)
    keys = first_key + gl.arange(0, ROWS, gl.SliceLayout(1, g_layout))
    out = bh * N * D + keys[:, None] * D + gl.arange(0, D, gl.SliceLayout(0, g_layout))[None, :]
    gl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=keys[:, None] < N)
    gl.store(DV + out, dv.to(DV.dtype.element_ty), mask=keys[:, None] < N)


@gluon.jit(do_not_specialize=["N"])  # Triton 3.6 fails to compile this kernel with N = 1 specialized in
def attn_bwd_ws_kernel(desc_q, desc_k, desc_v, desc_do, desc_lse, desc_delta, desc_dq, DK, DV, qk_scale, sm_scale, H,
                       N, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGISTERS: gl.constexpr, LOADER_REGISTERS: gl.constexpr):
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    last = gl.cdiv(N, BLOCK_M)
    if CAUSAL:
        first = start_n // BLOCK_M  # query blocks above the diagonal see none of these keys
        unmasked_from = first + BLOCK_N // BLOCK_M  # the blocks that cross the diagonal need the mask
    else:
        first = 0
        unmasked_from = 0
    dtype: gl.constexpr = desc_q.dtype
    D: gl.constexpr = desc_q.block_type.shape[3]
    ROWS: gl.constexpr = BLOCK_N // 2
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, D], desc_v.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D], desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, D], desc_do.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], desc_lse.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], desc_delta.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_M], gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_M], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [D // 32, 1, 1, BLOCK_M, 32], desc_dq.layout)
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
    shared = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_full, q_full, q_empty,
              do_full, do_empty, ds_ready, ds_free, desc_dq, DK, DV, qk_scale, sm_scale, b, h, bh, start_n, N, first,
              unmasked_from, last, CAUSAL, STAGES)
    gl.warp_specialize([
        (_ws_bwd_consumer, (0,) + shared),
        (_ws_bwd_consumer, (1,) + shared),
        (_ws_bwd_loader, (desc_q, desc_k, desc_v, desc_do, desc_lse, desc_delta, q_smem, k_smem, v_smem, do_smem,
                          lse_smem, delta_smem, kv_full, q_full, q_empty, do_full, do_empty, b, h, bh, start_n, first,
                          last, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, LOADER_REGISTERS])


def _ws_row_descriptor(x):
    """(1, WS_BWD_BLOCK_M) boxes of a (B*H, N) fp32 tensor. TMA needs the row stride in multiples of
    16 bytes, so rows whose length is not a multiple of 4 are copied into a wider buffer first."""
    rows, n = x.shape
    if n % 4:
        x = torch.zeros((rows, n + 4 - n % 4), dtype=x.dtype, device=x.device)[:, :n].copy_(x)
    return TensorDescriptor(x, [rows, n], list(x.stride()), [1, WS_BWD_BLOCK_M], _WS_ROW_LAYOUT)


def _ws_backward(q, k, v, do, lse, delta, causal, sm_scale):
    """dQ, dK, dV from the warp-specialized kernel; dQ is summed in fp32 by TMA reductions."""
    B, H, N, D = q.shape
    if not tma_loadable(do):
        do = do.contiguous()
    dq = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
    dk = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    attn_bwd_ws_kernel[(triton.cdiv(N, WS_BWD_BLOCK_N), B * H)](
        _ws_descriptor(q, WS_BWD_BLOCK_M), _ws_descriptor(k, WS_BWD_BLOCK_N // 2),
        _ws_descriptor(v, WS_BWD_BLOCK_N // 2), _ws_descriptor(do, WS_BWD_BLOCK_M), _ws_row_descriptor(lse),
        _ws_row_descriptor(delta), TensorDescriptor(dq, list(dq.shape), list(dq.stride()), [1, 1, WS_BWD_BLOCK_M, 32],
                                                    _WS_DQ_LAYOUT),
        dk, dv, sm_scale * LOG2E, sm_scale, H, N, CAUSAL=causal, BLOCK_M=WS_BWD_BLOCK_M, BLOCK_N=WS_BWD_BLOCK_N,
        STAGES=WS_BWD_STAGES, CONSUMER_REGISTERS=WS_CONSUMER_REGISTERS, LOADER_REGISTERS=WS_LOADER_REGISTERS, num_warps=4)
    return dq.to(q.dtype), dk, dv


# %%
# The launcher and autograd
# -------------------------
# ``attention`` runs the warp-specialized kernels wherever they can run (``warp_specialized=None``),
# and the portable ones everywhere else: on other GPUs, under the interpreter, for fp8 and for head
# dims 16 and 32. ``warp_specialized=False`` asks for the portable kernels, ``True`` for the Gluon
# ones, with an error that says why when they cannot run. Both forwards write the same output and
# the same :math:`\mathrm{LSE}_2`, so either backward can follow either forward. The backward
# follows the forward's choice, unless ``atomic_dq=False`` asks for the two-pass backward, whose
# :math:`dQ` has the same bits on every run.

if ON_GPU:
    FWD_SHAPES = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)]
    BWD_SHAPES = [(64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 4), (32, 128, 4, 3)]
    _fwd = triton.autotune(_configs(FWD_SHAPES), key=["D", "CAUSAL", "N_BUCKET"],
                           prune_configs_by={"early_config_prune": _prune_fwd})(attn_fwd_kernel)
    # Timing a configuration runs the kernel, and with ATOMIC_DQ that adds to the dQ buffer:
    # reset_to_zero clears it before each trial and before the real call.
    _dkdv = triton.autotune(_configs(BWD_SHAPES), key=["D", "CAUSAL", "ATOMIC_DQ", "N_BUCKET"], reset_to_zero=["DQ"],
                            prune_configs_by={"early_config_prune": _prune_bwd})(attn_bwd_dkdv_kernel)
    _dq = triton.autotune(_configs(BWD_SHAPES), key=["D", "CAUSAL", "N_BUCKET"],
                          prune_configs_by={"early_config_prune": _prune_bwd})(attn_bwd_dq_kernel)
    _FIXED_FWD = _FIXED_BWD = {}
else:
    # One configuration each, obeying the same rules as the pruned autotuning space.
    _fwd, _dkdv, _dq = attn_fwd_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
    _FIXED_FWD, _FIXED_BWD = {"BLOCK_M": 64, "BLOCK_N": 32}, {"BLOCK_M": 32, "BLOCK_N": 64}

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)


def fp8_supported():
    """fp8 matrix multiplies need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper)."""
    return ON_GPU and torch.cuda.get_device_capability() >= (8, 9)


def keys_contiguous(v, dtype=None):
    """The same (B, H, N, D) values, stored with the sequence axis contiguous, cast to dtype on the way."""
    return v.transpose(2, 3).to(dtype or v.dtype, memory_format=torch.contiguous_format).transpose(2, 3)


def check_inputs(q, k, v, causal, sm_scale):
    """Raise a clear error for anything the kernels cannot handle."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, sequence, head_dim), got shape {tuple(t.shape)}")
        if t.device.type != DEVICE.type:
            raise ValueError(f"{name} is on device '{t.device}', but Triton runs these kernels on '{DEVICE.type}' here")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == torch.float8_e5m2:
        if not fp8_supported():
            raise TypeError("float8_e5m2 attention needs a GPU with fp8 tensor cores (compute capability 8.9+)")
        if any(t.requires_grad for t in (q, k, v)):
            raise TypeError("float8_e5m2 attention is forward-only: its inputs must not require grad")
    elif q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k and v must be float16 or bfloat16 (or float8_e5m2 forward on fp8 GPUs), got {q.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if q.dtype == torch.float8_e5m2 and q.shape[-1] < 32:
        raise ValueError(f"float8_e5m2 attention needs head dim 32 or more (an 8-bit tensor-core product sums at "
                         f"least 32 values at a time), got {q.shape[-1]}")
    if q.numel() == 0:
        raise ValueError(f"q, k and v must not be empty, got shape {tuple(q.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
        raise TypeError(f"sm_scale must be a finite number, got {sm_scale!r}")


class _AttentionV2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, atomic_dq, warp_specialized):
        B, H, N, D = q.shape
        out_dtype = torch.float16 if q.dtype == torch.float8_e5m2 else q.dtype
        o = torch.empty((B, H, N, D), dtype=out_dtype, device=q.device)
        lse = torch.empty((B * H, N), dtype=torch.float32, device=q.device)
        upcast = (not ON_GPU) and q.dtype == torch.bfloat16
        if warp_specialized:
            _ws_forward(q, k, v, o, lse, causal, sm_scale)
        else:
            if q.dtype == torch.float8_e5m2 and v.stride(2) != 1 and N > 1:
                v = keys_contiguous(v)  # see "fp8: the layout of V" below
            grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * H)  # noqa: E731
            _fwd[grid](q, k, v, o, lse, sm_scale * LOG2E, H, N, triton.next_power_of_2(N), *q.stride(), *k.stride(),
                       *v.stride(), *o.stride(), D=D, CAUSAL=causal, UPCAST_DOT=upcast, **_FIXED_FWD)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.upcast, ctx.atomic_dq = causal, sm_scale, upcast, atomic_dq
        ctx.warp_specialized = warp_specialized
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        B, H, N, D = q.shape
        delta = torch.empty_like(lse)
        attn_bwd_preprocess_kernel[(triton.cdiv(N, 64), B * H)](o, do, delta, H, N, *o.stride(), *do.stride(),
                                                                D=D, BLOCK_M=64)
        if ctx.warp_specialized and ctx.atomic_dq is not False:
            return *_ws_backward(q, k, v, do, lse, delta, ctx.causal, ctx.sm_scale), None, None, None, None
        dk = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
        dv = torch.empty_like(dk)
        # With atomics, dQ is summed in fp32 (adding fp16 partial sums would lose bits at every add).
        atomic = bool(ctx.atomic_dq)  # None: the two-pass backward, in the portable kernels
        dq = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device) if atomic else torch.empty_like(dk)
        args = (ctx.sm_scale, ctx.sm_scale * LOG2E, H, N, triton.next_power_of_2(N), *q.stride(), *k.stride(), *v.stride(), *do.stride())
        meta = dict(D=D, CAUSAL=ctx.causal, UPCAST_DOT=ctx.upcast, **_FIXED_BWD)
        grid = lambda m: (triton.cdiv(N, m["BLOCK_N"]), B * H)  # noqa: E731
        _dkdv[grid](q, k, v, do, dq, dk, dv, lse, delta, *args, ATOMIC_DQ=atomic, **meta)
        if atomic:
            dq = dq.to(q.dtype)
        else:
            _dq[grid](q, k, v, do, dq, lse, delta, *args, **meta)
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, causal, sm_scale, atomic_dq=None, warp_specialized=None):
    """FlashAttention-2: softmax(q k^T * sm_scale) v over (batch, heads, sequence, head_dim) tensors.

    ``warp_specialized`` picks the kernels: None runs the Gluon kernels for Hopper where they can
    run and the portable ones elsewhere; True insists on the Gluon kernels, False on the portable ones.
    ``atomic_dq`` picks how dQ is summed. True: inside the dK, dV pass, with atomic additions
    (the Gluon backward's TMA reductions, or FlashAttention-2's element atomics in the portable
    backward): fewer matrix products, but dQ's rounding varies from run to run. False: in a second
    pass, the same bits every run. None: atomically with the Gluon backward, in a second pass otherwise.
    """
    check_inputs(q, k, v, causal, sm_scale)
    if atomic_dq is not None and not isinstance(atomic_dq, bool):
        raise TypeError(f"atomic_dq must be None, True or False, got {atomic_dq!r}")
    if warp_specialized is not None and not isinstance(warp_specialized, bool):
        raise TypeError(f"warp_specialized must be None, True or False, got {warp_specialized!r}")
    if warp_specialized is not False:
        reason = warp_specialized_unsupported(q, k, v)
        if reason and warp_specialized:
            raise ValueError(f"warp_specialized=True, but the warp-specialized kernels cannot run here: {reason}")
        warp_specialized = reason is None
    return _AttentionV2.apply(q, k, v, causal, float(sm_scale), atomic_dq, warp_specialized)


# %%
# Correctness
# -----------
# Forward and all three gradients against float64 PyTorch, causal and not, both ways of
# computing :math:`dQ`, at a sequence length one past a block boundary, and with ``q`` made by
# transposing a (batch, sequence, heads, dim) tensor, so that its strides are not the contiguous ones.


def reference_attention(q, k, v, causal, sm_scale):
    """The definition, in whatever precision the inputs have (float64 for a reference)."""
    s = (q @ k.transpose(-1, -2)) * sm_scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def relative_errors(q, k, v, causal, sm_scale, atomic_dq=False):
    """Max error of o, dq, dk, dv relative to the largest reference value, on a fresh random dO."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal, sm_scale, atomic_dq)
    do = torch.randn_like(out)
    out.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, causal, sm_scale)
    ref.backward(do.double())
    return {name: ((a.double() - b).abs().max() / b.abs().max()).item()
            for name, a, b in [("o", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)]}


if __name__ == "__main__":
    torch.manual_seed(0)
    B, H, N, D = 2, 3, 129 if ON_GPU else 65, 64
    for causal in (False, True):
        for atomic_dq in (False, True):
            q = torch.randn(B, N, H, D, device=DEVICE, dtype=torch.float16).transpose(1, 2)  # strided
            k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16) for _ in range(2))
            errors = relative_errors(q, k, v, causal, D ** -0.5, atomic_dq)
            print(f"causal={causal!s:5}, atomic_dq={atomic_dq!s:5}, N={N}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
            assert max(errors.values()) < 1e-2, errors
    reason = warp_specialized_unsupported(q, k, v)
    print("The forward above ran " + ("the warp-specialized Gluon kernel; with atomic_dq=True the backward was the "
                                      "Gluon one, with atomic_dq=False the two-pass one." if reason is None else
                                      f"the portable kernel, and the backward the portable one; the Gluon kernels did "
                                      f"not apply: {reason}."))

# %%
# fp8: the layout of V
# --------------------
# Hopper's tensor cores (and Ada's) also multiply 8-bit floats, at twice the fp16 rate, and an
# 8-bit tile is half the bytes to load. The forward kernel takes ``float8_e5m2`` inputs as they
# are: ``tl.dot`` of two fp8 tiles accumulates in fp32, :math:`P` is cast to V's dtype before the
# second product, and the output is fp16. What must change is not in the kernel but in memory.
# Hopper's matrix instruction (``wgmma``) accepts an 8-bit tile from shared memory only with the
# *reduction* axis contiguous (16-bit tiles may come either way round), and it reduces over at
# least 32 values, so head dims below 32 are refused. In :math:`QK^T` the reduction runs over the
# head dimension, which is contiguous in Q and K as they are usually stored. In :math:`PV` it runs over
# the keys, and a (B, H, N, D) tensor stores each key's D values together: the wrong way round.
# Fed that, the compiler has to transpose every V tile on its way to the tensor cores, and an
# earlier version of this lesson ran its fp8 forward at 0.56–1.11x the speed of fp16 on an H100.
#
# The fix is a layout: the same V with the sequence axis contiguous. The kernel needs no change,
# since it takes every stride and Triton sees from them which axis of a tile is contiguous. The
# launcher makes that copy when it is given another layout; code that quantizes V to fp8 anyway can
# write the layout during the cast, at no extra cost, as ``keys_contiguous`` does in the benchmark
# below. With e5m2's two mantissa bits, the check below compares against float64 attention *on the
# same fp8 inputs*, so that it measures the kernel (including :math:`P` rounded to fp8) rather than
# the quantization of the inputs.

if __name__ == "__main__":
    if fp8_supported():
        N, D = 1000, 64
        q8, k8 = (torch.randn(2, 3, N, D, device=DEVICE).to(torch.float8_e5m2) for _ in range(2))
        v8 = keys_contiguous(torch.randn(2, 3, N, D, device=DEVICE), torch.float8_e5m2)
        for causal in (False, True):
            out = attention(q8, k8, v8, causal, D ** -0.5)
            ref = reference_attention(q8.double(), k8.double(), v8.double(), causal, D ** -0.5)
            error = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            print(f"fp8 forward, causal={causal!s:5}, N={N}: max error {error:.1e} of the largest output")
    else:
        print("fp8 forward skipped: it needs a GPU with fp8 tensor cores (compute capability 8.9 or newer).")

# %%
# Mistakes learners make, and the test that catches each
# ------------------------------------------------------
# Versions of this kernel written from scratch, and even the published tutorial, share a handful
# of bugs. Each is caught by a test in this project's suite (``tests/test_attention.py``):
#
# * **dO loaded through O's pointers.** A from-scratch backward that reuses the output's pointer
#   block to load the upstream gradient computes the gradient of the wrong function. It runs, and
#   the loss even goes down. Caught by comparing every gradient with float64 autograd on a random
#   :math:`dO` (never on :math:`dO = 1` or :math:`dO = O`, which can hide it).
# * **Q.shape(3).** ``shape`` is a tuple, not a function: ``Q.shape[3]``. The launcher fails before
#   any kernel runs; caught by any test that runs the code at all.
# * **M (the row statistics) allocated on the CPU.** ``torch.empty(...)`` without ``device=``
#   hands a host pointer to a GPU kernel: a crash or silent garbage. Here every buffer is created
#   with ``device=q.device``, and the input checks refuse tensors on different devices.
# * **A backward that ignores** ``causal=False``. The published v2 tutorial computed the causal
#   gradient whatever it was asked; the forward was right, so only a gradient test of the
#   non-causal case sees it. The tests run both modes.
# * **Sequence lengths that must be a multiple of 128.** Unmasked loads read past the end of the
#   tensors. Here the ragged edge is masked; the tests use :math:`N = 1, 77, 300` and one past a
#   block boundary.
# * **Contiguity assumed.** Computing offsets as ``row * D + col`` breaks on a transposed view.
#   The kernels take every stride, and the tests feed transposed inputs.
#
# Benchmark
# ---------
# TFLOP/s, forward and backward, causal and not, at :math:`D = 64` (:math:`B = 4, H = 32`) and
# :math:`D = 128` (:math:`B = 4, H = 16`), against PyTorch SDPA's cuDNN and flash backends, the
# ``flash-attn`` package when it is installed, and the v1 kernel of the previous lesson when its
# file sits next to this one. The ceiling is the fp16 matrix-multiply rate measured in this run.

import importlib.util  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention  # noqa: E402


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


def matmul_tflops():
    """The device's fp16 matrix-multiply rate, measured now: the ceiling for attention."""
    n = 8192 if ON_GPU else 256
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.float16 if ON_GPU else torch.float32) for _ in range(2))
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


def load_v1():
    """The previous lesson's attention, if its file is next to this one (it is in the site build)."""
    here = Path(__file__).parent if "__file__" in globals() else Path.cwd()
    path = here / "04-fused-attention-v1.py"
    if not path.exists():
        print("04-fused-attention-v1.py is not next to this file: the v1 comparison is skipped.")
        return None
    spec = importlib.util.spec_from_file_location("fused_attention_v1", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.attention


def providers_for(causal, D, attention_v1):
    scale = D ** -0.5
    providers = {"Triton v2 (this tutorial)": lambda q, k, v: attention(q, k, v, causal, scale)}
    backends = {"SDPA cuDNN": SDPBackend.CUDNN_ATTENTION, "SDPA flash": SDPBackend.FLASH_ATTENTION} if ON_GPU \
        else {"SDPA math": SDPBackend.MATH}
    for name, backend in backends.items():
        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        providers[name] = sdpa
    try:
        from flash_attn import flash_attn_func

        providers["flash-attn package"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=scale).transpose(1, 2)
    except ImportError:
        pass
    if attention_v1 is not None:
        providers["Triton v1 (lesson 04)"] = lambda q, k, v: attention_v1(q, k, v, causal, scale)
    return providers


ATOMIC = "Triton v2, portable, atomic dQ"  # the portable backward with FlashAttention-2's element atomics
PORTABLE = "Triton v2, portable"  # the portable forward and two-pass backward, where the Gluon kernels are the default


def backward_ms(fn, q, k, v):
    """Time of the backward pass alone: the forward runs once, outside the timing."""
    o = fn(q, k, v)
    do = torch.randn_like(o)
    return bench_ms(lambda: o.backward(do, retain_graph=True))


# A GPU's speed drifts while it runs (its clocks follow its temperature and power draw), and on the
# H100 this lesson was developed on, one kernel timed three times in a row in the same process
# could differ by 10% or more. A single timing per provider would let that drift decide which of
# two close providers looks faster. So on a GPU every provider is timed ROUNDS times, the rounds
# in alternating order (first to last, then last to first), and each keeps its fastest timing.
# Every provider gets the same treatment, and the page prints how far the timings spread.
ROUNDS = 2 if ON_GPU else 1


def measure_in_rounds(timers, label):
    """{(provider, mode): [ms, ...]}, each timer run ROUNDS times; a provider that fails here is left out."""
    times, failed = {}, set()
    for r in range(ROUNDS):
        for key in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            if key[0] in failed:
                continue
            try:
                times.setdefault(key, []).append(timers[key]())
            except RuntimeError as error:  # a backend that does not support this case here
                print(f"{key[0]} skipped at {label}: {str(error).splitlines()[0][:100]}")
                failed.add(key[0])
    return {key: ms for key, ms in times.items() if key[0] not in failed}


def run_benchmark(cases, sizes, attention_v1):
    rows = []
    for B, H, D in cases:
        for causal in (False, True):
            for N in sizes:
                q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(3))
                flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
                timers = {}  # (provider, mode): one timing, in ms
                for name, fn in providers_for(causal, D, attention_v1).items():
                    timers[name, "fwd"] = functools.partial(bench_ms, functools.partial(fn, q, k, v))
                    timers[name, "bwd"] = functools.partial(backward_ms, fn, q, k, v)
                portable = functools.partial(attention, causal=causal, sm_scale=D ** -0.5, warp_specialized=False)
                timers[ATOMIC, "bwd"] = functools.partial(backward_ms, functools.partial(portable, atomic_dq=True), q, k, v)
                if warp_specialized_unsupported(q, k, v) is None:
                    timers[PORTABLE, "fwd"] = functools.partial(bench_ms, functools.partial(portable, q, k, v))
                    timers[PORTABLE, "bwd"] = functools.partial(backward_ms, portable, q, k, v)
                if fp8_supported():
                    q8, k8 = (t.detach().to(torch.float8_e5m2) for t in (q, k))
                    v8 = keys_contiguous(v.detach(), torch.float8_e5m2)  # the layout, written by the cast
                    timers["Triton v2 fp8", "fwd"] = functools.partial(bench_ms, functools.partial(
                        attention, q8, k8, v8, causal, D ** -0.5))
                for (name, mode), ms in measure_in_rounds(timers, f"D={D}, N={N}, causal={causal}").items():
                    work = flops * (2.5 if mode == "bwd" else 1.0)
                    rows.append(dict(D=D, causal=causal, N=N, mode=mode, provider=name, value=work / min(ms) * 1e-9,
                                     spread=max(ms) / min(ms) - 1))
                del q, k, v
    return rows


if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    print(describe_platform())
    if ON_GPU:
        cases, sizes = [(4, 32, 64), (4, 16, 128)], [1024, 2048, 4096, 8192, 16384]
    else:
        cases, sizes = [(1, 2, 64), (1, 1, 128)], [64, 128]
    peak = matmul_tflops()
    print(f"fp16 matrix-multiply rate, measured now: {peak:.3g} TFLOP/s")
    results = pd.DataFrame(run_benchmark(cases, sizes, load_v1()))
    table = results.pivot_table(index=["D", "causal", "mode", "N"], columns="provider", values="value", sort=False)
    groups = list(table.groupby(level=["D", "causal", "mode"], sort=False))
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.4), squeeze=False)
    for ax, ((D, causal, mode), part) in zip(axes.flat, groups):
        part.droplevel(["D", "causal", "mode"]).dropna(axis=1, how="all").plot(ax=ax, marker="o", logx=True)
        ax.axhline(peak, color="black", linestyle="--", label="fp16 matmul rate")
        ax.set(title=f"{mode}, {'causal' if causal else 'non-causal'}, D = {D}", xlabel="N (sequence length)",
               ylabel="TFLOP/s", ylim=(0, None))
        ax.set_xticks(sizes, [str(n) for n in sizes], minor=False)
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
    table.round(1)

# %%
# Reading the numbers
# -------------------
# Computed from the table above, in this run: v2 against the strongest PyTorch backend (cuDNN where
# it runs), and against v1. Where the warp-specialized kernels ran (a Hopper GPU), each of them
# against its portable counterpart. For the portable backward, the two ways of finishing
# :math:`dQ` against each other, and the rate at which the two-pass backward really multiplies
# matrices: it executes seven products where the FLOP count above credits five. Last, on a GPU,
# how far the repeated timings of one provider spread: the yardstick for which differences above
# mean anything.

if __name__ == "__main__":
    ours = "Triton v2 (this tutorial)"
    peers = [c for c in table.columns if c.startswith("SDPA") or c == "flash-attn package"]
    for (D, causal, mode), part in groups:
        ratio = part[ours] / part[peers].max(axis=1)
        line = (f"D={D:3d} {'causal    ' if causal else 'non-causal'} {mode}: v2 is {ratio.min():.2f}x to "
                f"{ratio.max():.2f}x the fastest SDPA backend, at up to {part[ours].max() / peak:.0%} of the matmul rate")
        if "Triton v1 (lesson 04)" in part:
            v1 = part[ours] / part["Triton v1 (lesson 04)"]
            line += f"; {v1.min():.1f}x to {v1.max():.1f}x v1"
        print(line)
        if PORTABLE in part:
            ws = part[ours] / part[PORTABLE]
            print(f"    the warp-specialized {'forward' if mode == 'fwd' else 'backward'} is {ws.min():.2f}x to "
                  f"{ws.max():.2f}x the portable one (faster at {(ws > 1).sum()} of {len(ws)} sizes)")
        if mode == "bwd":
            two_pass = part[PORTABLE] if PORTABLE in part else part[ours]
            atomic = part[ATOMIC] / two_pass
            executed = 7 / 5 * two_pass.max()
            print(f"    in the portable kernels, atomic dQ is {atomic.min():.2f}x to {atomic.max():.2f}x the two-pass "
                  f"backward (faster at {(atomic > 1).sum()} of {len(atomic)} sizes); the two-pass backward multiplies "
                  f"matrices at up to {executed:.3g} TFLOP/s, {executed / peak:.0%} of the matmul rate")
    if "Triton v2 fp8" in table:
        fp8 = (table["Triton v2 fp8"] / table[ours]).dropna()
        long_rows = fp8[fp8.index.get_level_values("N") >= 4096]
        print(f"fp8 forward vs. fp16 forward: {fp8.min():.2f}x to {fp8.max():.2f}x "
              f"(at N >= 4096: {long_rows.min():.2f}x to {long_rows.max():.2f}x)")
    if ROUNDS > 1:
        spread = results.groupby("N")["spread"].agg(["median", "max"])
        print(f"Each number is the fastest of {ROUNDS} timings taken in alternating order. How far the timings of one "
              "provider in one case spread, over all providers and cases, median (largest): "
              + ", ".join(f"N={n}: {row['median']:.1%} ({row['max']:.0%})" for n, row in spread.iterrows()))
    if not ON_GPU:
        print("These are interpreter timings: they measure NumPy on the CPU, not GPU kernels.")
    save_results("05-fused-attention-v2", [{
        "name": f"attention v2 {mode}", "unit": "TFLOP/s", "ceiling_name": "fp16 matmul rate", "ceiling": peak,
        "ours": [ours] + ([PORTABLE] if PORTABLE in table else []) + ([ATOMIC] if mode == "bwd" else []), "peers": peers,
        "rows": [r for r in results.drop(columns="spread").to_dict("records") if r["mode"] == mode]}
        for mode in ("fwd", "bwd")])

# %%
# Where the backward's time goes
# ------------------------------
# Why did the portable two-pass backward need replacing on Hopper, when its kernels are tuned? A
# profile answers that better than a guess. The CUDA profiler below times each kernel of the
# two-pass backward over a few passes at :math:`D = 128` and the longest sequence of the sweep. It
# counts the matrix products that each kernel executes, so it can give each kernel's own multiply
# rate. On a Hopper GPU it then profiles the warp-specialized backward the same way.

BACKWARD_PRODUCTS = {"attn_bwd_preprocess_kernel": 0, "attn_bwd_dkdv_kernel": 4, "attn_bwd_dq_kernel": 3,
                     "attn_bwd_ws_kernel": 5}


def backward_kernel_ms(q, k, v, causal, sm_scale, atomic_dq, passes=3):
    """{kernel name: GPU milliseconds per backward pass}, measured with the CUDA profiler."""
    o = attention(q, k, v, causal, sm_scale, atomic_dq)
    do = torch.randn_like(o)
    o.backward(do, retain_graph=True)  # autotuning happens here, outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(passes):
            o.backward(do, retain_graph=True)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / passes / 1e3 for e in profile.key_averages() if e.key in BACKWARD_PRODUCTS}


if __name__ == "__main__" and ON_GPU:
    B, H, D = cases[-1]
    N = sizes[-1]
    for causal in (False, True):
        q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(3))
        times = backward_kernel_ms(q, k, v, causal, D ** -0.5, atomic_dq=False)
        total = sum(times.values())
        per_product = 2 * B * H * N * N * D * (0.5 if causal else 1.0)  # about half the blocks when causal
        print(f"backward, {'causal' if causal else 'non-causal'}, D={D}, N={N}: {total:.2f} ms of GPU time")
        rates = {}
        for name, ms in times.items():
            line = f"    {name:27} {ms:7.2f} ms ({ms / total:4.0%})"
            if BACKWARD_PRODUCTS[name]:
                rates[name] = BACKWARD_PRODUCTS[name] * per_product / ms * 1e-9
                line += f", {BACKWARD_PRODUCTS[name]} products at {rates[name]:.0f} TFLOP/s, {rates[name] / peak:.0%} of the matmul rate"
            print(line)
        recompute = 2 / 3 * times["attn_bwd_dq_kernel"] / total
        line = (f"    recomputing S and dP in the dQ pass takes about {recompute:.0%} of the backward; these kernels "
                f"multiply at {min(rates.values()) / peak:.0%} to {max(rates.values()) / peak:.0%} of the matmul rate")
        cudnn = table.get("SDPA cuDNN", pd.Series(dtype=float)).get((D, causal, "bwd", N), float("nan"))
        if math.isfinite(cudnn):
            line += f", cuDNN's backward (five products) at {cudnn / peak:.0%}: " + (
                "the gap is the two extra products, not the speed of each" if min(rates.values()) >= cudnn
                else "cuDNN also multiplies faster than at least one of them")
        print(line)
        if warp_specialized_unsupported(q, k, v) is None:
            ws = backward_kernel_ms(q, k, v, causal, D ** -0.5, atomic_dq=None)
            rate = 5 * per_product / ws["attn_bwd_ws_kernel"] * 1e-9
            print(f"    the warp-specialized backward: {sum(ws.values()):.2f} ms of GPU time, attn_bwd_ws_kernel "
                  f"{ws['attn_bwd_ws_kernel']:.2f} ms, 5 products at {rate:.0f} TFLOP/s, {rate / peak:.0%} of the matmul rate")
        del q, k, v
elif __name__ == "__main__":
    print("The profile of the backward's kernels needs a GPU: under the interpreter there are no GPU kernels to time.")

# %%
# The last line of each case puts the numbers side by side. Two products in seven are work that
# cuDNN does not do: its backward computes :math:`dQ` with :math:`dS` at hand, in the same program
# as :math:`dK` and :math:`dV`, and adds it up across programs in fp32. If each of the portable
# kernels multiplies at least as fast as cuDNN's backward (as on the H100 this lesson was written
# on), a faster schedule for them cannot close the gap by much, while cutting the two products
# could. That is what the warp-specialized backward does, and the line under each case gives its
# own multiply rate.
#
# The speed the kernels do reach comes from a budget. A :math:`dK, dV` program with 128 keys keeps
# two 128 x 128 fp32 accumulators: 128 KiB. Spread over 8 warps (256 threads) that is 128 of the
# 255 registers a thread may have, before the tiles of :math:`P^T` and :math:`dP^T` in flight and
# the addresses. One way to live within that budget is in the autotuner's list: a program with half
# the keys (64) and half the warps (one warp group of 4). Each thread still holds 128 registers of
# accumulators, but the program as a whole is small: 128 threads of at most 255 registers, and in
# shared memory :math:`K` and :math:`V` (:math:`2 \times 64 \times D` fp16 values) plus two
# pipeline stages of :math:`Q` and :math:`dO` (:math:`2 \times 2 \times 64 \times D`), 96 KiB at
# :math:`D = 128`. Two such programs fit on one SM of an H100 (65,536 registers and 228 KiB of
# shared memory), and they are independent: while one waits for its exponentials or its loads,
# the SM's warp schedulers can run the other's matrix products. On an H100 the autotuner picks
# this shape for the :math:`dK, dV` kernel at :math:`D = 128` nearly every time, over the 8-warp
# program with 128 keys. A sweep of twelve shapes on an H200, each timed twice, put it first by 4%
# to 16% at :math:`N = 4096` and 16384, and showed how narrow the budget is: the same shape with a
# third pipeline stage ran at 0.8x its speed with causal masking and at half its speed without.
# The table below shows what each kernel chose at :math:`D = 128` on the GPU that built this page
# (``BLOCK_M x BLOCK_N``; the :math:`dQ` kernel owns ``BLOCK_N`` queries and walks ``BLOCK_M`` keys).
#
# The warp-specialized backward took several steps to find, and the dead ends teach as much as the
# result. The first step was to make that overlap deliberate without cutting products: a Gluon
# :math:`dK, dV` kernel with a loader warp and two consumer warp groups (the backward kernel above,
# without its :math:`dQ` part). Against the Triton :math:`dK, dV` kernel in the same run on an H100
# (:math:`D = 128`, :math:`N` from 4096 to 16384) it ran at 1.04x to 1.21x without masking and 0.91x
# to 1.11x with causal masking, and at 0.86x to 0.95x at :math:`D = 64`: for the whole backward, a
# change within the GPU's run-to-run noise, as the profile predicts. The products had to go.
#
# Five-product versions followed, all correct against float64 and all measured against the
# two-pass backward in the same run on an H100 (Triton 3.6, best of two timings, :math:`N` from
# 4096 to 16384):
#
# * the portable ``atomic_dq=True`` kernel with Triton's TMA reductions
#   (``desc.atomic_add(offsets, tile)``) in place of ``tl.atomic_add``: about 2% faster than with
#   element atomics at :math:`D = 128`, still 0.91x to 1.02x the two-pass speed. Its
#   :math:`dK, dV` program carries a fifth product and its fp32 result, and at :math:`D = 128` the
#   autotuner has to give it a larger, slower shape than the four-product program gets;
# * the Gluon design above with one ``gl.atomic_add`` per element of :math:`dQ`: 0.58x to 0.75x
#   when each group added the share of its own 64 keys, 0.74x to 0.87x with :math:`dS` shared so
#   that each element gets one addition per program, 0.64x to 0.73x with two extra warps issuing
#   the atomics in place of the consumers;
# * the same design with TMA reductions: 0.94x without masking and 0.84x to 0.89x with it at
#   :math:`D = 128`;
# * plus the swizzled 32-column staging tile and :math:`dK` issued last: 0.97x to 1.08x without
#   masking, 0.78x to 0.86x with it;
# * plus :math:`\mathrm{LSE}_2` and :math:`\Delta` through TMA and :math:`P^T` kept in 16 bits:
#   1.19x to 1.26x without masking, 0.95x to 0.99x with it;
# * plus one loop for the masked and the unmasked blocks: 1.19x to 1.23x without masking and 1.16x
#   to 1.27x with it at :math:`D = 128`; 1.13x to 1.26x and 1.02x to 1.15x at :math:`D = 64`. In
#   that run it reached 0.92x to 0.98x of cuDNN's speed in all twelve cases.
#
# The last steps are about registers, not about the schedule: the spills that ``ptxas -v``
# reported fell from 412 and 1004 bytes per thread (without and with masking) to 116 and 144. The
# tables above and the profile lines give the numbers of the build that made this page.
#
# Before the Gluon kernel, the portable forward was pushed as far as Triton's own tools would take
# it (Triton 3.6, on an H100 or H200, each variant against the lesson's forward in the same run).
# Loading through TMA tensor descriptors gave no gain. Triton's automatic warp specialization
# (``tl.range(..., warp_specialize=True)``) was slower on Hopper. Issuing the next :math:`QK^T` by
# hand before this block's exponentials was 2% to 18% slower, splitting each key tile in halves at
# best 0.4% faster, and one-warp-group programs slower at every size. Two cheaper ideas did not pay
# either. *Half the exponentials*: PTX's ``ex2.approx.f16x2`` computes two fp16 exponentials per
# instruction, and :math:`P` is rounded to fp16 anyway. On an H100 it ran at 0.90x to 1.02x the
# speed of the fp32 ``exp2``; the row sums need :math:`P` back in fp32, which costs about what the
# halved exponentials saved. *Rescale rarely* (FlashAttention-4's trick): keep a stale row maximum
# until some row's maximum grows by more than 8 (a factor of :math:`2^8`, harmless in fp32), so that
# the accumulator is rescaled only at those blocks. On an H200 that ran 7% to 13% slower: deciding
# whether *any* row needs rescaling is a reduction across the whole program, a trip through shared
# memory and a barrier at every key block, which costs more than the multiplications it skips. In
# every case the work that was cut was not what the tensor cores were waiting for. What they were
# waiting for was the schedule, which is what the warp-specialized kernel changes.


def tuned_choices(D):
    """{kernel and mode: {N bucket: configuration}} that the autotuner picked at head dim D, as text."""
    picks = {}
    for kernel, tuner in (("forward", _fwd), ("dK, dV", _dkdv), ("dQ", _dq)):
        for key, config in tuner.cache.items():
            named = dict(zip(tuner.keys, key))
            if named["D"] != D or "float8" in str(key):
                continue
            mode = "causal" if named["CAUSAL"] else "non-causal"
            label = f"{kernel}{' (atomic dQ)' if named.get('ATOMIC_DQ') else ''}, {mode}"
            picks.setdefault(label, {})[named["N_BUCKET"]] = (
                f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']}, {config.num_warps} warps, "
                f"{config.num_stages} stages")
    return picks


if __name__ == "__main__" and ON_GPU:
    choices = pd.DataFrame(tuned_choices(128)).T.sort_index(axis=1)
    print(f"Autotuner's choices at D = 128, by sequence length:\n{choices.to_string()}")

# %%
# Why the smallest sizes look slow: who waits for whom
# ----------------------------------------------------
# At :math:`N = 1024` the whole forward pass is a fraction of a millisecond of GPU work. Launching
# it is not free: the autograd function, the autotuner's lookup and Triton's binding of some thirty
# arguments (every stride of every tensor) run in Python for each call. When the host needs longer
# to enqueue a call than the GPU needs to run it, the GPU idles between calls and the benchmark
# measures the host. The check below times both for the smallest and largest size of the sweep.
# The warp-specialized forward adds its own host work: each call builds three TMA descriptors in
# Python, about 20 microseconds on the H100 this lesson was developed on. At :math:`N = 1024` its
# GPU work takes about as long as the portable kernel's (replayed from CUDA graphs there, the two
# measured within 20% of each other, either way round, across head dims and masking), so at the
# smallest sizes the benchmark's lines for the two forwards mostly compare host noise. (The usual
# cures are CUDA graphs, which replay a whole sequence of launches at once, or larger batches of
# work per call.)


def host_and_gpu_ms(fn, calls=50):
    """(host ms to enqueue one call, device ms per call), the first without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host, bench_ms(fn)


if __name__ == "__main__" and ON_GPU:
    B, H, D = cases[0]
    for N in (sizes[0], sizes[-1]):
        q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16) for _ in range(3))
        host, gpu = host_and_gpu_ms(lambda: attention(q, k, v, False, D ** -0.5))
        verdict = "the host is the bottleneck" if host > 0.8 * gpu else "the GPU is the bottleneck"
        print(f"forward, D={D}, N={N}: host {1e3 * host:.0f} us to launch, GPU {1e3 * gpu:.0f} us to run: {verdict}")
elif __name__ == "__main__":
    print("Launch overhead is a GPU question: under the interpreter every call runs on the host anyway.")
