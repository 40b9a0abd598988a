"""
Fused attention v2: FlashAttention-2's backward
===============================================

The previous lesson, :doc:`06-fused-attention-v2-forward`, built the forward pass of
FlashAttention-2 (`arXiv:2307.08691 <https://arxiv.org/abs/2307.08691>`_). This lesson
derives the backward pass from it and builds it in portable Triton, correct for every
sequence length, head dimension and masking mode, in two versions: with a pass of its
own for :math:`dQ`, and with FlashAttention-2's atomic additions (`tl.atomic_add
<https://triton-lang.org/main/python-api/generated/triton.language.atomic_add.html>`_).
It connects them to PyTorch's autograd and measures both against PyTorch's cuDNN and
flash backends and FlexAttention. Next: :doc:`08-decode-attention`, attention at one
query token; the Hopper part, from :doc:`09-gluon-primer` on, takes both passes to
Gluon (:doc:`11-hopper-forward-gluon`, :doc:`14-hopper-backward-gluon`).

You will learn:

* what v2's backward changes from v1's: :math:`P` recomputed from one saved number per
  row, with no division;
* how the backward splits into a :math:`dQ` pass and a :math:`dK, dV` pass, why the
  :math:`dQ` pass runs first, and what FlashAttention-2's atomic additions to
  :math:`dQ` save and cost instead;
* how to hand PyTorch's autograd a forward and a backward of your own;
* the mistakes that learners' backward passes make, and the tests that catch each one.

This lesson needs ``06-fused-attention-v2-forward.py`` and ``05-fused-attention-v1.py``
next to it, with ``stepkit.py`` and ``tuned_tables.json`` (the site's zip of all
lessons has them): it runs lesson 06's forward, launcher and tile table, and compares
lesson 05's kernel.
"""

# %%
# Where the kernels run
# ---------------------
# ``stepkit``, the module beside the lessons, picks a CUDA GPU when there is one,
# otherwise the Triton interpreter on the CPU, before the first ``@triton.jit``.

import collections
import functools
import hashlib
import itertools
import numbers

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

V2 = kit.load_lesson("06-fused-attention-v2-forward")  # the forward and its launcher

# %%
# The backward, recalled
# ----------------------
# Lesson 05 derived the gradients. For one (batch, head), with the scale :math:`s`
# folded into the scores, the forward is :math:`S = s\,QK^T`,
# :math:`P = \mathrm{softmax}_\text{rows}(S)`, :math:`O = PV`, and walking back from
# :math:`dO`:
#
# .. math::
#
#    dV &= P^T dO, \qquad dP = dO\,V^T, \\
#    dS &= P \circ (dP - \Delta), \\
#    \Delta_i &= \textstyle\sum_j P_{ij}\, dP_{ij} = dO_i \cdot O_i, \\
#    dQ &= s\,dS\,K, \qquad dK = s\,dS^T Q.
#
# :math:`\Delta_i` looks as if it needed the whole row of :math:`P`, which is never
# stored; since :math:`O_i = \sum_j P_{ij} V_j`, it is the dot product of two rows
# already in memory.
#
# What v2 changes is how :math:`P` comes back. v1 saved :math:`m` and :math:`\ell` and,
# to avoid a division by :math:`\ell` at every tile, divided :math:`dO` by :math:`\ell`
# in a preprocess kernel (lesson 05 measures what that rounding costs). v2's forward
# saved one number per row, :math:`\mathrm{LSE}_2 = m + \log_2 \ell` (lesson 06), and
# each tile of :math:`P` comes back already normalized,
# :math:`P = 2^{S \cdot \log_2 e - \mathrm{LSE}_2}`: one ``exp2`` per element, no
# division, and :math:`dO` used as it is. Then five matrix products per block pair:
# :math:`QK^T` again, :math:`dV`, :math:`dP`, :math:`dK` and :math:`dQ`, where the
# forward did two.
#
# Who owns what
# -------------
# The :math:`dK, dV` program owns a block of keys and walks the query blocks that can
# see them: with causal masking, only those at or below the diagonal. At each query
# block it has :math:`dS` in registers, and :math:`dS\,K` is exactly this key block's
# share of those rows' :math:`dQ`. There are two ways to finish :math:`dQ`:
#
# * **Atomically** (``atomic_dq=True``, the paper's way): multiply :math:`dS\,K` right
#   there and add it into an fp32 buffer with ``tl.atomic_add``. Five matrix products
#   per block pair, the minimum. The price: traffic to the GPU's L2 cache for every
#   addition, an fp32 buffer of :math:`BHND` elements, and a :math:`dQ` whose last bits
#   depend on the order in which programs happened to add, so two runs can differ
#   slightly. ``sem="relaxed"`` tells Triton that the additions need no ordering with
#   other memory operations, only atomicity.
# * **In a pass of its own** (the default): a :math:`dQ` program owns a block of
#   queries and walks the key blocks it sees. It must recompute :math:`S` and
#   :math:`dP`, two matrix products that the :math:`dK, dV` pass also does: seven
#   products instead of five, 40% more tensor-core work, but no atomics, nothing extra
#   in memory, and the same bits on every run.
#
# Both passes need :math:`\Delta`, and the :math:`dQ` pass decides where it comes from.
# A :math:`dQ` program holds its rows of :math:`dO` anyway; it loads the same rows of
# :math:`O`, computes their :math:`\Delta`, uses it, and stores it. So this pass runs
# *first*, and the :math:`dK, dV` pass, which walks every query block and needs every
# row's :math:`\Delta`, reads what it stored. v1 and Triton's own tutorial launch a
# preprocess for :math:`\Delta`; here it would make a third launch, which counts where
# the host's time per call paces the GPU, and the two passes stay two. The atomic
# backward has no :math:`dQ` pass to fold it into, so it keeps the preprocess.
#
# In both, masking is needed only on the diagonal and the ragged edges: a query row
# past :math:`N` loads as zeros, so its :math:`dO` and :math:`\Delta` are zero and it
# adds nothing; a key row past :math:`N` loads as zeros, adds nothing to :math:`dQ`,
# and its :math:`dK, dV` rows are never stored. The picture shows one program of each
# pass on the causal grid of blocks: what it owns, and which blocks it walks.


def draw_backward_passes(n_blocks=8, key_block=2, query_block=5):
    import matplotlib.pyplot as plt

    kit.plot_style()
    fig, axes = plt.subplots(1, 2, figsize=(8, 4.4))
    titles = [f"dK, dV pass: one program owns key block {key_block}",
              f"dQ pass: one program owns query block {query_block}"]
    arrow = dict(arrowstyle="->", lw=2, color="#c0392b")
    for ax, title, owns_keys in zip(axes, titles, (True, False)):
        for i in range(n_blocks):  # query blocks, top to bottom
            for j in range(i + 1):  # causal: key blocks at or left of the diagonal
                walked = j == key_block if owns_keys else i == query_block
                color = "#3b7dd8" if walked else "#dddddd"
                ax.add_patch(plt.Rectangle((j, i), 0.94, 0.94, color=color,
                                           alpha=1.0 if walked else 0.7))
                if walked and i == j:
                    ax.text(j + 0.47, i + 0.5, "mask", ha="center", va="center",
                            color="white")
        if owns_keys:
            x = key_block + 0.47
            ax.annotate("", xy=(x, n_blocks - 0.1), xytext=(x, key_block + 0.9),
                        arrowprops=arrow)
            note = ("walks down the query blocks;\nholds dK, dV in registers;\n"
                    "adds dS K to dQ (atomic) or not")
        else:
            y = query_block + 0.47
            ax.annotate("", xy=(query_block - 0.05, y), xytext=(0.05, y),
                        arrowprops=arrow)
            note = ("walks across the key blocks;\nholds dQ in registers;\n"
                    "recomputes S and dP")
        ax.text(n_blocks - 0.1, 0.3, note, ha="right", va="top")
        ax.set(xlim=(0, n_blocks), ylim=(n_blocks, 0), xlabel="key block",
               ylabel="query block", title=title)
        ax.set_xticks([j + 0.47 for j in range(n_blocks)], range(n_blocks))
        ax.set_yticks([i + 0.47 for i in range(n_blocks)], range(n_blocks))
        ax.set_aspect("equal")
    fig.tight_layout()
    return fig


figure = draw_backward_passes() if __name__ == "__main__" else None

# %%
# The kernels: the preprocess that computes :math:`\Delta` for the atomic backward (and
# clears its fp32 :math:`dQ`), the :math:`dK, dV` pass, and the :math:`dQ` pass, which
# the two-pass backward runs first.


@triton.jit
def attn_bwd_preprocess_kernel(
    O, DO, DELTA, DQ, H, N, sob, soh, son, sod, sdb, sdh, sdn, sdd,
    D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    ok = rows[:, None] < N
    o_ptrs = O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod
    do_ptrs = DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd
    o = tl.load(o_ptrs, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * N + rows, tl.sum(o * do, axis=1), mask=rows < N)
    # The same rows of the fp32 dQ that the main kernel adds into, cleared here: no
    # launch of its own for the zeros.
    zeros = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    tl.store(DQ + (bh * N + rows[:, None]) * D + d[None, :], zeros, mask=ok)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys, lo, hi,
    N, sm_scale, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    for start_m in tl.range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_rows, do_rows = q_ptrs + rows[:, None] * sqn, do_ptrs + rows[:, None] * sdn
        if MASKED:
            q = tl.load(q_rows, mask=rows[:, None] < N, other=0.0)
            do = tl.load(do_rows, mask=rows[:, None] < N, other=0.0)
            lse = tl.load(LSE_bh + rows, mask=rows < N, other=0.0)
            delta = tl.load(DELTA_bh + rows, mask=rows < N, other=0.0)
        else:
            q = tl.load(q_rows)
            do = tl.load(do_rows)
            lse = tl.load(LSE_bh + rows)
            delta = tl.load(DELTA_bh + rows)
        if k.dtype == tl.float32:  # interpreter bf16 workaround
            q, do = q.to(tl.float32), do.to(tl.float32)
        # P^T: (keys, queries)
        pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED and CAUSAL:
            pt = tl.where(keys[:, None] <= rows[None, :], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk)
        if ATOMIC_DQ:
            # This key block's share of dQ for these query rows, added to an fp32
            # buffer that every key block of the head adds to as well: the fifth
            # matrix product, no dQ pass.
            dq = tl.dot(tl.trans(dst), k) * sm_scale
            dq_rows = dq_ptrs + rows[:, None] * D
            if MASKED:
                tl.atomic_add(dq_rows, dq, mask=rows[:, None] < N, sem="relaxed")
            else:
                tl.atomic_add(dq_rows, dq, sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA, sm_scale, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdn, sdd,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    keys = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    key_ok = keys[:, None] < N
    k_ptrs = K + b * skb + h * skh + keys[:, None] * skn + d[None, :] * skd
    v_ptrs = V + b * svb + h * svh + keys[:, None] * svn + d[None, :] * svd
    k = tl.load(k_ptrs, mask=key_ok, other=0.0)
    v = tl.load(v_ptrs, mask=key_ok, other=0.0)
    if UPCAST_DOT:
        k, v = k.to(tl.float32), v.to(tl.float32)
    q_ptrs = Q + b * sqb + h * sqh + d[None, :] * sqd
    do_ptrs = DO + b * sdb + h * sdh + d[None, :] * sdd
    dq_ptrs = DQ + bh * N * D + d[None, :]  # the fp32 dQ buffer: D elements per row
    LSE_bh, DELTA_bh = LSE + bh * N, DELTA + bh * N
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    full = (N // BLOCK_M) * BLOCK_M  # query rows below this need no bounds mask
    if CAUSAL:
        # Query blocks that cross this key block's diagonal need the mask; those
        # below do not.
        past_diag = tl.minimum(start_n + BLOCK_N, N)
        dk, dv = _bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
            start_n, past_diag, N, sm_scale, qk_scale,
            D, BLOCK_M, True, CAUSAL, ATOMIC_DQ,
        )
        lo = start_n + BLOCK_N
    else:
        lo = 0
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
        lo, tl.maximum(lo, full), N, sm_scale, qk_scale,
        D, BLOCK_M, False, CAUSAL, ATOMIC_DQ,
    )
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
        tl.maximum(lo, full), N, N, sm_scale, qk_scale,
        D, BLOCK_M, True, False, ATOMIC_DQ,
    )
    out = bh * N * D + keys[:, None] * D + d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, lo, hi, N, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    for start_n in tl.range(lo, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        kt_cols, vt_cols = kt_ptrs + keys[None, :] * skn, vt_ptrs + keys[None, :] * svn
        if MASKED:
            kt = tl.load(kt_cols, mask=keys[None, :] < N, other=0.0)
            vt = tl.load(vt_cols, mask=keys[None, :] < N, other=0.0)
        else:
            kt = tl.load(kt_cols)
            vt = tl.load(vt_cols)
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
    Q, K, V, O, DO, DQ, LSE, DELTA, sm_scale, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sob, soh, son, sod, sdb, sdh, sdn, sdd,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # This kernel's query block is BLOCK_N rows and its key block BLOCK_M: the dK, dV
    # pass's names turned round, so that one list of (small, large) candidate pairs
    # serves both passes. Causal: the last query block first, as in the forward.
    if CAUSAL:
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_N
    else:
        start_m = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = start_m + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    row_ok = rows < N
    q_ptrs = Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd
    do_ptrs = DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd
    o_ptrs = O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
    o = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
    # These rows' Delta, for this pass and, stored, for the dK, dV pass that runs next.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * N + rows, delta, mask=row_ok)
    if UPCAST_DOT:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(LSE + bh * N + rows, mask=row_ok, other=0.0)
    kt_ptrs = K + b * skb + h * skh + d[:, None] * skd
    vt_ptrs = V + b * svb + h * svh + d[:, None] * svd
    dq = tl.zeros([BLOCK_N, D], tl.float32)
    if CAUSAL:
        diag = start_m
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, 0, diag, N,
            qk_scale, BLOCK_M, False, CAUSAL,
        )
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, diag,
            tl.minimum(diag + BLOCK_N, N), N, qk_scale, BLOCK_M, True, CAUSAL,
        )
    else:
        full = (N // BLOCK_M) * BLOCK_M
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, 0, full, N,
            qk_scale, BLOCK_M, False, CAUSAL,
        )
        dq = _bwd_dq_inner(
            dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, full, N, N,
            qk_scale, BLOCK_M, True, CAUSAL,
        )
    dq_ptrs = DQ + bh * N * D + rows[:, None] * D + d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# %%
# In the :math:`dQ` kernel the roles of the two block sizes swap: it owns the large
# block (of queries) and walks the small one (of keys), just as the :math:`dK, dV`
# kernel owns the large block of keys. One list of candidate pairs serves both, and
# each kernel gets its own measured pick. As in lesson 06, ``UPCAST_DOT`` is for bf16
# under the interpreter only.
#
# The launcher and autograd
# -------------------------
# Each kernel runs through lesson 06's launcher: with the configuration that lesson
# 06's table gives for its case (the table holds this lesson's kernels as ``dq``,
# ``dkdv`` and ``dkdv-atomic``), with a launch plan after the first call, or, where no
# measurement applies, with its autotuner's pick. The candidates keep
# ``BLOCK_M <= BLOCK_N``: the small block is the one walked, the large one the one
# owned. ``attention`` checks its inputs, and an autograd function calls lesson 06's
# forward and, when PyTorch asks for gradients, the backward. The backward is also a
# plain function, ``backward``, and its preprocess another, ``backward_preprocess``: the
# Hopper lessons reuse them.


def _prune_bwd(configs, named_args, **kwargs):
    D = kwargs.get("D", named_args.get("D"))
    keep = [c for c in configs
            if c.kwargs["BLOCK_M"] <= c.kwargs["BLOCK_N"] and V2._fits(c, D)]
    return keep or configs[-1:]


# The candidates that the sweep compares: (BLOCK_M, BLOCK_N, warps, stages).
BWD_SHAPES = [(64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 4),
              (32, 128, 4, 3)]
DKDV_KEY = ["D", "CAUSAL", "ATOMIC_DQ", "N_BUCKET"]
DKDV_TUNER = V2.autotuned(attn_bwd_dkdv_kernel, BWD_SHAPES, _prune_bwd, DKDV_KEY)
# Timing a configuration runs the kernel, and with ATOMIC_DQ that adds to the dQ
# buffer: reset_to_zero clears it before each trial and before the real call. The
# two-pass dK, dV pass has the tuner above, without it, since there DQ holds the dQ
# pass's finished result.
DKDV_ATOMIC_TUNER = V2.autotuned(attn_bwd_dkdv_kernel, BWD_SHAPES, _prune_bwd,
                                 DKDV_KEY, reset_to_zero=["DQ"])
DQ_TUNER = V2.autotuned(attn_bwd_dq_kernel, BWD_SHAPES, _prune_bwd,
                        ["D", "CAUSAL", "N_BUCKET"])


def backward_preprocess(o, do):
    """The preprocess kernel, for the atomic backward and lesson 14's: Delta =
    rowsum(dO * O) in fp32, shape (B * H, N), and a zeroed fp32 dQ of O's shape."""
    B, H, N, D = o.shape
    delta = torch.empty((B * H, N), dtype=torch.float32, device=o.device)
    dq = torch.empty((B, H, N, D), dtype=torch.float32, device=o.device)
    V2.launch_planned(
        V2.plan_key(o, do), attn_bwd_preprocess_kernel, (V2.host_cdiv(N, 64), B * H),
        4, (o, do, delta, dq, H, N, *o.stride(), *do.stride()), dict(D=D, BLOCK_M=64),
    )
    return delta, dq


def backward(q, k, v, o, do, lse, causal, sm_scale, atomic_dq):
    """dQ, dK, dV from the portable kernels: the two-pass backward (the dQ pass, which
    also computes Delta, then the dK, dV pass), or with atomic_dq the preprocess and
    one dK, dV pass that adds into dQ."""
    B, H, N, D = q.shape
    dk = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    scales = (sm_scale, sm_scale * V2.LOG2E, H, N, V2.host_next_power_of_2(N))
    meta = dict(D=D, CAUSAL=causal, UPCAST_DOT=V2._upcast(q))
    case = V2.tuned_case(q, causal)

    def grid(bm, bn):
        return V2.host_cdiv(N, bn), B * H

    if atomic_dq:
        # dQ is summed in fp32: adding fp16 partial sums would lose bits at every add.
        delta, dq = backward_preprocess(o, do)
    else:
        dq = torch.empty_like(dk)
        delta = torch.empty((B * H, N), dtype=torch.float32, device=q.device)
        V2._launch(
            attn_bwd_dq_kernel, DQ_TUNER, "dq", V2.plan_key(q, k, v, o, do), case,
            grid, 10, q, k, v, o, do, dq, lse, delta, *scales, *q.stride(),
            *k.stride(), *v.stride(), *o.stride(), *do.stride(), **meta,
        )
    V2._launch(
        attn_bwd_dkdv_kernel, DKDV_ATOMIC_TUNER if atomic_dq else DKDV_TUNER,
        "dkdv-atomic" if atomic_dq else "dkdv", V2.plan_key(q, k, v, do), case, grid,
        11, q, k, v, do, dq, dk, dv, lse, delta, *scales, *q.stride(), *k.stride(),
        *v.stride(), *do.stride(), ATOMIC_DQ=atomic_dq, **meta,
    )
    return (dq.to(q.dtype) if atomic_dq else dq), dk, dv


class _AttentionV2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, atomic_dq):
        o, lse = V2.forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.atomic_dq = causal, sm_scale, atomic_dq
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = kit.resolved_gradient(do)
        grads = backward(q, k, v, o, do, lse, ctx.causal, ctx.sm_scale, ctx.atomic_dq)
        return *grads, None, None, None


def attention(q, k, v, causal, sm_scale, atomic_dq=False):
    """FlashAttention-2: softmax(q k^T * sm_scale) v over (batch, heads, sequence,
    head_dim) tensors.

    ``atomic_dq`` picks how the backward sums dQ. False: in a pass of its own, the same
    bits every run. True: inside the dK, dV pass, with FlashAttention-2's atomic
    additions: fewer matrix products, but dQ's rounding varies from run to run.
    """
    kit.check_attention_inputs(q, k, v, causal, sm_scale, fp8=True)
    if not isinstance(atomic_dq, bool):
        raise TypeError(f"atomic_dq must be True or False, got {atomic_dq!r}")
    q, k, v = kit.resolved(q, k, v)
    return _AttentionV2.apply(q, k, v, causal, float(sm_scale), atomic_dq)


# %%
# Correctness
# -----------
# Before any timing: the output and all three gradients against float64 PyTorch on
# fresh random inputs and a random :math:`dO`, causal and not, both ways of computing
# :math:`dQ`, at a length one past a block boundary, with ``q`` a transposed view.
# ``kit.check_against_float64`` fails on NaN or infinity and names what is off; on a
# GPU every kernel it launches is compiled first, on all CPU cores.


if __name__ == "__main__":
    torch.manual_seed(0)
    B, H, N, D = 2, 3, 129 if kit.ON_GPU else 65, 64
    keys = [(causal, atomic) for causal in (False, True) for atomic in (False, True)]
    cases = V2.strided_cases(B, H, N, D, keys)

    def versions():
        return [(functools.partial(attention, atomic_dq=a), c, qkv)
                for (c, a), qkv in cases.items()]

    kit.compile_ahead(lambda: [kit.forward_and_backward(fn, *qkv, c, D**-0.5)
                               for fn, c, qkv in versions()])
    for fn, causal, (q, k, v) in versions():
        atomic_dq = fn.keywords["atomic_dq"]
        label = f"07-fused-attention-v2-backward, {causal=}, {atomic_dq=}"
        errors = kit.check_against_float64(fn, q, k, v, causal, D**-0.5, label)
        shown = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        print(f"causal={causal!s:5}, atomic_dq={atomic_dq!s:5}, N={N}: {shown}")


# %%
# Mistakes learners make, and the test that catches each
# ------------------------------------------------------
# Two bugs of from-scratch backwards, the second also in Triton's own tutorial (lesson
# 06 lists those the forward shares). The Correctness cell above catches both, as do
# the tests named below, in this repository's ``tests/test_attention.py``:
#
# * **dO loaded through O's pointers.** A from-scratch backward that reuses the
#   output's pointer block to load the upstream gradient computes the gradient of the
#   wrong function. It runs, and the loss even goes down. Caught by comparing every
#   gradient with float64 autograd on a random :math:`dO` (never on :math:`dO = 1` or
#   :math:`dO = O`, which can hide it), as ``test_forward_and_backward`` does.
# * **A backward that ignores** ``causal=False``. In Triton's tutorial
#   (``python/tutorials/06-fused-attention.py``) the backward kernel ``_attn_bwd`` has
#   no causal flag and always masks the diagonal, and its ``test_op`` runs
#   ``causal=True`` only. The forward is right, so only a gradient test of the
#   non-causal case sees it: ``test_forward_and_backward`` runs both modes, and
#   ``test_v2_non_causal_gradient_differs_from_causal`` checks that they differ.

# %%
# Benchmark
# ---------
# TFLOP/s of the backward pass (2.5 times the forward's FLOPs: five matrix products
# where the forward has two), causal and not, at lesson 06's sizes, against PyTorch
# SDPA's cuDNN and flash backends, FlexAttention (the math backend alone under the
# interpreter) and lesson 05's v1 kernel. The ceiling is the matrix-multiply rate
# measured in this run. How we time: a backward alone, as ``torch.autograd.grad`` of one
# forward's output, by GPU time (a CUDA graph replayed after an L2 flush) and back to
# back (many calls in a row), in passes, a range where they spread; the
# :doc:`performance page <../performance>` gives the method. Under the interpreter the
# numbers only illustrate.

OURS = V2.OURS
ATOMIC = "Triton v2, atomic dQ"  # the backward with FlashAttention-2's atomic additions


def providers_for(causal, D):
    """What this lesson times: its own backward, the SDPA backends, and v1 (lesson
    06's list)."""
    return V2.providers_for(causal, D, ours=attention)


def atomic_provider(q, k, v, causal, D):
    """The backward with atomic dQ, timed beside the two-pass one."""
    timer = kit.backward_timer(attention, q, k, v, causal=causal, sm_scale=D**-0.5,
                               atomic_dq=True)
    return {(ATOMIC, "bwd"): timer}


if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    print(kit.describe_platform())
    peak = kit.matmul_tflops()
    print(kit.ceiling_line(peak))
    results = pd.DataFrame(kit.attention_benchmark(
        V2.CASES, V2.SIZES, providers_for, ("bwd",), atomic_provider))
    table, b2b = kit.rate_tables(results, V2.INDEX)
    kit.plot_style()
    kit.plot_attention(table, "bwd", peak, "Backward pass, by GPU time",
                       ours=[OURS, V2.V1_NAME, ATOMIC])
    plt.show()

# %%
# The table: every provider's speed in TFLOP/s by GPU time, by head dimension, masking
# and sequence length (the plot above draws the same numbers).

kit.rates_table(results, V2.INDEX, "TFLOP/s") if __name__ == "__main__" else None

# %%
# The same calls back to back, as a loop sees them, which "back to back" below reads
# (on a GPU; under the interpreter the table above is already wall-clock time).

(kit.rates_table(results, V2.INDEX, "TFLOP/s", value="value")
 if __name__ == "__main__" and kit.ON_GPU else None)

# %%
# Reading the numbers
# -------------------
# Computed from the tables above, in this run: v2 against the fastest PyTorch peer
# (cuDNN, flash or FlexAttention) and against v1, by GPU time, and back to back where
# that tells another story; the two ways of finishing :math:`dQ` against each other; the
# rate at which the two-pass backward really multiplies matrices (it executes seven
# products where the FLOP count credits five); and how far the repeated timings spread,
# the yardstick for which differences mean anything.
#
# If matrix products were all that counted, the atomic backward, with five products
# where the two-pass one has seven, would take 5/7 (0.71x) of the two-pass backward's
# time. The line "atomic dQ takes ... the two-pass backward's time" says what it took
# here. Besides its products it pays for an addition into L2 for every element of each
# key block's :math:`dS\,K` (each element of :math:`dQ` gets one from each key block it
# sees), a preprocess launch, an fp32 :math:`dQ` buffer zeroed (there) and cast after,
# and tiles of its own ("Which tiles ran", below), so the count of products alone does
# not predict the winner: only the measurement does.

if __name__ == "__main__":
    peers = [c for c in V2.PEERS if c in table]
    lines = kit.peer_lines(table, b2b, peak, OURS, peers, versus=V2.V1_NAME, name="v2")
    for case, part in table.groupby(level=V2.INDEX[:3], sort=False):
        # Time ratios: the rates' inverse, to set beside 5/7.
        atomic = part[OURS] / part[ATOMIC]
        in_a_row = b2b.loc[part.index, OURS] / b2b.loc[part.index, ATOMIC]
        moved = ((in_a_row / atomic - 1).abs() > kit.SPREAD_LIMIT).any()
        executed = 7 / 5 * part[OURS].max()
        print(lines[case])
        faster = f"faster at {(atomic < 1).sum()} of {len(atomic)} sizes"
        print(f"    atomic dQ takes {atomic.min():.2f}x to {atomic.max():.2f}x the "
              f"two-pass backward's time (5/7 = 0.71x by products; {faster}"
              + (f"; back to back {in_a_row.min():.2f}x to {in_a_row.max():.2f}x"
                 if moved else "")
              + f"); the two-pass backward multiplies matrices at up to "
              f"{executed:.3g} TFLOP/s, {executed / peak:.0%} of the matmul rate")
    interpreted = "These are interpreter timings: they measure NumPy on the CPU."
    print(kit.spread_summary(results) if kit.ON_GPU else interpreted)
    kit.save_results("07-fused-attention-v2-backward", [{
        "name": "attention v2 bwd", "unit": "TFLOP/s",
        "ceiling_name": kit.MATMUL_CEILING, "ceiling": peak, "ours": [OURS, ATOMIC],
        "peers": peers, "rows": results.to_dict("records"),
    }])

# %%
# Which tiles ran
# ---------------
# The tile shapes behind the benchmark at :math:`D = 128` (``BLOCK_M x BLOCK_N``; the
# :math:`dQ` kernel owns ``BLOCK_N`` queries and walks ``BLOCK_M`` keys): from lesson
# 06's table where it covers this GPU's architecture, otherwise the autotuner's picks
# in this run. A :math:`dK, dV` program with 128 keys keeps two 128 x 128 fp32
# accumulators, 128 KiB: spread over 8 warps (256 threads) that is 128 of the 255
# registers a thread may have, before the tiles in flight. A program with half the keys
# and one warp group of 4 warps holds the same 128 registers of accumulators per
# thread, but is small enough that two fit on one SM, where each can run its matrix
# products while the other waits. Which wins is for the sweep to measure; the second
# line printed below says what ran.

KERNELS = {"dkdv": ("dK, dV", DKDV_TUNER),
           "dkdv-atomic": ("dK, dV (atomic dQ)", DKDV_ATOMIC_TUNER),
           "dq": ("dQ", DQ_TUNER)}


def keys_per_program(picks):
    """A sentence read from picks (lesson 06's tiles_that_ran): the keys per program
    (BLOCK_N) and warps that each dK, dV kernel ran most, in how many of its cases;
    "" where neither ran."""
    said, most = [], set()
    for name, label in (("dkdv", "the two-pass backward's dK, dV kernel"),
                        ("dkdv-atomic", "the atomic backward's")):
        ran = collections.Counter(tile[1:3] for (kernel, _, _), tile in picks.items()
                                  if kernel == name)
        if ran:
            (keys, warps), count = ran.most_common(1)[0]
            most.add((keys, warps))
            said.append(f"{label} ran {keys} keys on {warps} warps in {count} of its "
                        f"{ran.total()} cases")
    if not said:
        return ""
    differ = len(said) == 2 and len(most) == 2
    return (f"What ran: {'; '.join(said)}"
            + (": the two backwards chose differently." if differ else "."))


if __name__ == "__main__":
    picks = V2.tiles_that_ran(128, V2.SIZES, KERNELS)
    choices = pd.DataFrame(V2.tiles_table(picks, KERNELS)).T
    print(V2.where_tiles_came_from(list(KERNELS)))
    if picks:
        print(keys_per_program(picks))

choices if __name__ == "__main__" and not choices.empty else None

# %%
# Exercises
# ---------
# Each check compares your answer with a float64 reference on fresh random inputs,
# raising ``AssertionError`` at the first wrong element, with how far off it is (NaN is
# wrong), or says that all is right. Write each attempt in a new cell at the end of this
# lesson's notebook (linked at the end of the page) and call its check as the exercise
# shows; or in a file next to the lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L07 = kit.load_lesson("07-fused-attention-v2-backward")
#    # ... your one_row_backward(q, K, V, do, scale) ...
#    L07.check_one_row_backward(one_row_backward)
#
# 1. **One row's backward, by hand.** Using only the gradients recalled above, write
#    ``one_row_backward(q, K, V, do, scale)`` for a single query row ``q`` of shape
#    ``(D,)``, keys and values ``(N, D)`` and the gradient ``do`` of its output,
#    returning ``(dq, dK, dV)`` in the inputs' float64 (no autograd). Then
#    ``check_one_row_backward(one_row_backward)``.
# 2. **dV alone.** A model that trains only what feeds :math:`V` needs
#    :math:`dV = P^T dO` and nothing else: no :math:`\Delta`, no :math:`dP`, no
#    :math:`dQ` or :math:`dK`. Write ``dv_only(q, k, v, do, lse, causal, sm_scale)``, a
#    Triton kernel and its launcher, from the :math:`dK, dV` kernel above, keeping only
#    what :math:`dV` needs; ``lse`` is what lesson 06's ``forward`` returns beside
#    :math:`O`. Then ``check_dv_only(dv_only)``: fp16 and bf16, causal and not, at
#    lengths no block size divides; on a GPU it also prints your kernel's time beside
#    this lesson's whole backward (reported, not required). How many matrix products
#    per block pair are left? Check your count with ``check_dv_products(count)``.


def check_one_row_backward(fn):
    """Your one_row_backward against float64 autograd, on 10 random rows of random
    sizes."""
    gen = kit.fresh_generator()
    for _ in range(10):
        N = int(torch.randint(1, 40, (), generator=gen))
        D = int(torch.randint(1, 17, (), generator=gen))
        q, do = (torch.randn(D, generator=gen, dtype=torch.float64) for _ in "qo")
        K, V = (torch.randn(N, D, generator=gen, dtype=torch.float64) for _ in "kv")
        scale = float(torch.rand((), generator=gen)) + 0.1
        leaves = [t.clone().requires_grad_() for t in (q, K, V)]
        out = torch.softmax(leaves[1] @ leaves[0] * scale, dim=0) @ leaves[2]
        want = torch.autograd.grad(out, leaves, do)
        got = fn(q.clone(), K.clone(), V.clone(), do.clone(), scale)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise AssertionError("one_row_backward must return three gradients "
                                 f"(dq, dK, dV), got {got!r:.80}")
        for what, g, w in zip(("dq", "dK", "dV"), got, want):
            kit.expect_close("one_row_backward", f"N={N}, D={D}, scale={scale:.3f}",
                             what, g, w, torch.float64, 1e-6, 1e-8)
    print("one_row_backward matches autograd on 10 random rows.")


def check_dv_only(fn):
    """Your dv_only against float64 autograd on fresh inputs, fp16 and bf16, causal
    and not; on a GPU, its time beside the whole backward's."""
    generator = kit.fresh_generator()
    shapes = [(1, 2, 1, 16), (2, 3, 77, 32), (1, 2, 130, 64)]
    cases = itertools.product(shapes, kit.ATTENTION_DTYPES, (False, True))
    for (B, H, N, D), dtype, causal in cases:
        q, k, v, do = (torch.randn(B, H, N, D, generator=generator).to(DEVICE, dtype)
                       for _ in "qkvo")
        _, lse = V2.forward(q, k, v, causal, D**-0.5)
        v64 = v.double().requires_grad_()
        out = kit.reference_attention(q.double(), k.double(), v64, causal, D**-0.5)
        (want,) = torch.autograd.grad(out, v64, do.double())
        got = fn(q, k, v, do, lse, causal, D**-0.5)
        case = f"B, H, N, D = {B}, {H}, {N}, {D}, {str(dtype)[6:]}, causal={causal}"
        # Relative to the largest value (at least 1), as lesson 06's check allows.
        tol = 1e-2 if dtype == torch.float16 else 3e-2
        atol = tol * max(1.0, want.abs().max().item())
        kit.expect_close("dv_only", case, "dV", got, want, dtype, tol, atol)
    print("dv_only matches float64 autograd at every shape, dtype and masking.")
    if not kit.ON_GPU:
        print("dv_only: speed is measured only on a GPU.")
        return
    q, k, v, do = (torch.randn(4, 32, 4096, 64, device=DEVICE, dtype=torch.float16)
                   for _ in "qkvo")
    _, lse = V2.forward(q, k, v, False, 0.125)
    leaves = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
    timers = {"yours": kit.call_timer(fn, q, k, v, do, lse, False, 0.125),
              "backward": kit.backward_timer(attention, *leaves, causal=False,
                                             sm_scale=0.125)}
    ms = {name: min(m.gpu) for name, m in kit.time_calls(timers).items()}
    print(f"dv_only, B, H, N, D = 4, 32, 4096, 64, fp16, non-causal: yours takes "
          f"{ms['yours'] / ms['backward']:.2f}x the time of this lesson's whole "
          "backward (dQ, dK and dV), by GPU time.")


# The answer, hashed, so that the page does not print it.
_DV_PRODUCTS = "b52cb231ae055a2c6629d06cfe22a090c4ed3f0e50a91709928477dbb4344783"


def check_dv_products(count):
    """Your count of the matrix products per block pair left in dv_only: right or
    wrong, never the number."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise AssertionError(f"check_dv_products: give a whole number, got {count!r}")
    digest = hashlib.sha256(f"dv_only products: {int(count)}".encode()).hexdigest()
    if digest != _DV_PRODUCTS:
        raise AssertionError(
            f"check_dv_products: dv_only does not need {count} products per block "
            "pair. Hint: of the products in the dK, dV kernel's loop, keep dV = P^T dO "
            "and what it is computed from (P is not stored).")
    print(f"check_dv_products: right, {count} matrix products per block pair.")
