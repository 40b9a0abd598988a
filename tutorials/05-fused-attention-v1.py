"""
Fused attention v1: FlashAttention as Triton's 2022 tutorial wrote it
=====================================================================

Attention, :math:`O = \\mathrm{softmax}(\\tau\\,QK^T)\\,V` with a scale :math:`\\tau`,
computed without ever writing the :math:`N \\times N` matrix of scores to memory. Rabe
and Staats were the first to avoid it (`Self-attention Does Not Need O(n²) Memory
<https://arxiv.org/abs/2112.05682>`_, 2021); FlashAttention (Dao et al., 2022,
`arXiv:2205.14135 <https://arxiv.org/abs/2205.14135>`_) made it the first IO-aware
fused GPU kernel, built on the online softmax of Milakov and Gimelshein
(`arXiv:1805.02867 <https://arxiv.org/abs/1805.02867>`_), taught in
:doc:`03-long-softmax`; the matrix products are :doc:`04-tiled-matmul`'s tiles.

This lesson's forward is Triton's 2022 tutorial kernel, not Algorithm 1 of the
FlashAttention paper. Algorithm 1 loops over key/value blocks outside and query blocks
inside, so it reads and writes :math:`O`, :math:`m` and :math:`\\ell` in memory at every
step. Triton's kernel runs one program per query block (parallel over query blocks,
batch and heads) whose loop walks the key blocks, with :math:`O`, :math:`m` and
:math:`\\ell` in registers: the loop order FlashAttention-2
(`arXiv:2307.08691 <https://arxiv.org/abs/2307.08691>`_) later adopted. From
FlashAttention-1 it keeps the arithmetic: the output normalized at every step,
:math:`m` and :math:`\\ell` saved apart. How close that loop order brings its forward
to PyTorch's flash backend, which runs FlashAttention-2, with and without the causal
mask, "Reading the numbers" computes in this run, on a GPU. It is the step from the
online softmax to FlashAttention-2 (next lesson, :doc:`06-fused-attention-v2-forward`),
kept alive here on purpose.

You will learn:

* how the online softmax becomes an online *softmax-weighted sum*, for one query row,
  then for a block of rows with matrix multiplications;
* the forward: one program per query block walking the key blocks (drawn below),
  running maximum :math:`m` and sum :math:`\\ell` kept apart, the output rescaled at
  every step, the statistics saved for the backward;
* its backward: a preprocess, one program per (batch, head) walking the key blocks,
  :math:`dQ` accumulated in fp32 through memory; why it divides :math:`dO` by
  :math:`\\ell` first (derived), what that costs in fp16, and one reason it is slow
  (measured: how many programs an SM needs);
* what the 2022 code needed that today's Triton no longer has, and what replaces it;
* how to benchmark attention: FLOPs, forward and backward timed apart, every SDPA
  backend beside it, the matrix-multiply rate as the ceiling, and a kernel's GPU time
  against the time that a loop of calls sees.
"""

# %%
# Where the kernels run
# ---------------------
# ``stepkit``, the module beside the lessons, picks a CUDA GPU if there is one, else the
# Triton interpreter on the CPU, before the first ``@triton.jit``.

import functools
import itertools
import math

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

# %%
# One query row, one key at a time
# --------------------------------
# For a query row :math:`q`, attention averages the value rows :math:`v_j` with weights
# :math:`\mathrm{softmax}_j(s_j)`, :math:`s_j = q \cdot k_j \cdot \mathrm{scale}`.
# Lesson 03's online softmax rescales its running sum :math:`\ell` whenever the running
# maximum :math:`m` grows; the weighted sum :math:`a = \sum_j e^{s_j - m} v_j` takes the
# same factor, so one loop over the keys computes everything:
#
# .. math::
#
#    m' &= \max(m, s_j), \\
#    \ell' &= \ell\, e^{m - m'} + e^{s_j - m'}, \\
#    a' &= a\, e^{m - m'} + e^{s_j - m'}\, v_j, \\
#    o &= a / \ell \quad \text{(after the last key).}


def one_row_attention(q, k, v, scale):
    """Attention for one query row, one key at a time: the algorithm's scalar form."""
    m, l, a = -math.inf, 0.0, torch.zeros_like(v[0], dtype=torch.float64)
    for k_j, v_j in zip(k.double(), v.double()):
        s = float(q.double() @ k_j) * scale
        m_new = max(m, s)
        l = l * math.exp(m - m_new) + math.exp(s - m_new)
        a = a * math.exp(m - m_new) + math.exp(s - m_new) * v_j
        m = m_new
    return a / l


if __name__ == "__main__":
    torch.manual_seed(0)
    q1, k1, v1 = torch.randn(16), torch.randn(50, 16), torch.randn(50, 16)
    expected = torch.softmax(k1.double() @ q1.double() / 4, dim=0) @ v1.double()
    error = (one_row_attention(q1, k1, v1, 1 / 4) - expected).abs().max().item()
    print(f"one query row, one key at a time, max error: {error:.1e}")

# %%
# From rows to blocks
# -------------------
# A GPU wants matrix multiplications, not dot products: with ``BLOCK_M`` query rows and
# ``BLOCK_N`` keys per step, scores form a ``BLOCK_M x BLOCK_N`` tile
# :math:`S = Q_i K_j^T`, maximum and sum run along its rows, and a second matrix product
# gives :math:`e^{S - m} V_j`. Nothing larger than a tile exists. Any sequence length
# works: key columns past :math:`N` score :math:`-\infty` (weight 0), query rows past
# :math:`N` are computed on zeros, never stored. With ``CAUSAL``, query :math:`i` sees
# only keys :math:`j \le i`: query blocks stop at the diagonal.
#
# FlashAttention-1 keeps the output *normalized*, :math:`o = a / \ell` over the keys so
# far: each step multiplies it by :math:`\ell e^{m - m'} / \ell'` and the new
# probability tile, made against the block's own row maximum :math:`m_{ij}`, by
# :math:`e^{m_{ij} - m'} / \ell'`. That is two divisions per row and one extra
# multiplication per probability, every step, which FlashAttention-2 removed by
# normalizing once at the end (it still rescales the accumulator by
# :math:`e^{m - m'}`). v1 saves :math:`\ell` and :math:`m` per row for the backward.
#
# The figure after the kernel draws it: on the left, one program per query block
# (a row of the grid), walking the key blocks up to the causal diagonal; on the right,
# one query block's walk, each key block's scores :math:`S` turned into probabilities
# :math:`P` and added into the running state, which is rescaled at every step. The
# Triton documentation describes the two calls that do the work: `tl.dot`_, the matrix
# products, and `tl.max`_, the rows' maxima.
#
# .. _tl.dot: https://triton-lang.org/main/python-api/generated/triton.language.dot.html
# .. _tl.max: https://triton-lang.org/main/python-api/generated/triton.language.max.html


@triton.jit
def attn_fwd_v1_kernel(
    Q, K, V, O, L, Mx, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    q_ptrs = Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd
    q = tl.load(q_ptrs, mask=rows[:, None] < N, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_head = K + b * skb + h * skh + d[None, :] * skd
    v_head = V + b * svb + h * svh + d[None, :] * svd
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum((start_m + 1) * BLOCK_M, N) if CAUSAL else N
    for start_n in range(0, end, BLOCK_N):
        keys = start_n + cols
        key_ok = keys[:, None] < N
        k = tl.load(k_head + keys[:, None] * skn, mask=key_ok, other=0.0)
        v = tl.load(v_head + keys[:, None] * svn, mask=key_ok, other=0.0)
        if UPCAST_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        valid = keys[None, :] < N
        if CAUSAL:
            valid = valid & (keys[None, :] <= rows[:, None])
        s = tl.where(valid, s, -float("inf"))
        # The block's own maximum and sum, then the merge with the running ones.
        m_ij = tl.max(s, axis=1)
        p = tl.exp(s - m_ij[:, None])
        l_ij = tl.sum(p, axis=1)
        m_new = tl.maximum(m_i, m_ij)
        alpha = tl.exp(m_i - m_new)
        beta = tl.exp(m_ij - m_new)
        l_new = alpha * l_i + beta * l_ij
        # Keep the output normalized: rescale what is there, weight the new block
        # by beta / l_new.
        acc = acc * (l_i * alpha / l_new)[:, None]
        p = p * (beta / l_new)[:, None]
        acc += tl.dot(p.to(v.dtype), v)
        l_i, m_i = l_new, m_new
    row_ok = rows < N
    tl.store(L + bh * N + rows, l_i, mask=row_ok)
    tl.store(Mx + bh * N + rows, m_i, mask=row_ok)
    o_ptrs = O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])


if __name__ == "__main__":
    kit.draw_attention_blocks(n_blocks=6, focus=3)

# %%
# The backward pass, derived
# --------------------------
# For one (batch, head), with the scale folded into the scores, the forward is
# :math:`S = \tau\,QK^T`, :math:`P = \mathrm{softmax}_\text{rows}(S)`, :math:`O = PV`.
# Walking back from :math:`dO`:
#
# * :math:`O = PV` gives :math:`dV = P^T dO` and :math:`dP = dO\,V^T`.
# * For one row, softmax's Jacobian is
#   :math:`\partial p_j/\partial s_k = p_j(\delta_{jk} - p_k)`, so
#   :math:`dS = P \circ (dP - \Delta)` with :math:`\Delta_i = \sum_j P_{ij}\,dP_{ij}`,
#   and since :math:`dP_{ij} = dO_i \cdot v_j`,
#   :math:`\Delta_i = dO_i \cdot \sum_j P_{ij} v_j = dO_i \cdot O_i`: one dot product of
#   two stored rows.
# * :math:`S = \tau\,QK^T` gives :math:`dQ = \tau\,dS\,K` and :math:`dK = \tau\,dS^T Q`.
#
# Only :math:`m` and :math:`\ell` were saved, so the backward recomputes each tile of
# :math:`P`: :math:`e^{S - m}` is cheap, dividing by :math:`\ell` row by row at every
# tile is not, so the 2022 kernel moves the division out of the loop. Row :math:`i` of
# :math:`e^{S-m}` is :math:`\ell_i P_i`; divide row :math:`i` of :math:`dO` by
# :math:`\ell_i` first, and :math:`dV = \sum_i (\ell_i P_i)^T (dO_i / \ell_i)` is
# unchanged, :math:`dP` and :math:`\Delta` (linear in :math:`dO`) come out divided by
# :math:`\ell_i`, and :math:`(\ell_i P_i) \circ (dP_i - \Delta_i)/\ell_i` is the same
# :math:`dS`. So a *preprocess* divides :math:`dO` by :math:`\ell` and computes
# :math:`\Delta` from it, once per row; then one program per (batch, head) walks the key
# blocks, each over every query block: :math:`dK` and :math:`dV` accumulate in
# registers, :math:`dQ` in an fp32 buffer in memory, read and written again per key
# block (how well that uses a GPU is measured after the benchmark).


@triton.jit
def attn_bwd_preprocess_v1_kernel(
    O, DO, L, DO_SCALED, DELTA, H, N, sob, soh, son, sod, sdb, sdh, sdn, sdd,
    D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    ok = rows < N
    o_ptrs = O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod
    do_ptrs = DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd
    o = tl.load(o_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    l = tl.load(L + bh * N + rows, mask=ok, other=1.0)
    do = do / l[:, None]
    out_ptrs = DO_SCALED + bh * N * D + rows[:, None] * D + d[None, :]
    tl.store(out_ptrs, do.to(DO_SCALED.dtype.element_ty), mask=ok[:, None])
    tl.store(DELTA + bh * N + rows, tl.sum(o * do, axis=1), mask=ok)


@triton.jit
def attn_bwd_v1_kernel(
    Q, K, V, DO_SCALED, DQ, DK, DV, Mx, DELTA, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    d = tl.arange(0, D)
    for start_n in range(0, N, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < N
        k_ptrs = K + b * skb + h * skh + keys[:, None] * skn + d[None, :] * skd
        v_ptrs = V + b * svb + h * svh + keys[:, None] * svn + d[None, :] * svd
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        if UPCAST_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        # Causal: query blocks above the diagonal never see these keys.
        first_m = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
        for start_m in range(first_m, N, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < N
            q_ptrs = Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd
            do_ptrs = DO_SCALED + bh * N * D + rows[:, None] * D + d[None, :]
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            if UPCAST_DOT:
                q, do = q.to(tl.float32), do.to(tl.float32)
            m = tl.load(Mx + bh * N + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + bh * N + rows, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            valid = row_ok[:, None] & key_ok[None, :]
            if CAUSAL:
                valid = valid & (keys[None, :] <= rows[:, None])
            # P * l, since do was divided by l
            p = tl.where(valid, tl.exp(s - m[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None]) * sm_scale
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
            # dQ lives in fp32 memory: read, add this key block's share, write back.
            dq_ptrs = DQ + bh * N * D + rows[:, None] * D + d[None, :]
            dq = tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
            dq += tl.dot(ds.to(k.dtype), k)
            tl.store(dq_ptrs, dq, mask=row_ok[:, None])
        out = bh * N * D + keys[:, None] * D + d[None, :]
        tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


# %%
# What changed since 2022
# -----------------------
# The 2022 tutorial no longer runs. ``tl.dot(q, k, trans_b=True)`` is now
# ``tl.dot(q, tl.trans(k))``; its scratch buffer ``TMP``, stored and reloaded to dodge a
# long-fixed compiler bug, is gone. Its 2-D blocks of pointers built by hand stay: the
# later ``tl.make_block_ptr`` runs in Triton 3.6 but raises ``NotImplementedError`` in
# 3.9. ``triton.testing.assert_almost_equal`` gave way to
# ``torch.testing.assert_close``, and ``do_bench``'s ``percentiles=`` to
# ``quantiles=`` or ``return_mode=``. Its backward needed the sequence length to be a
# multiple of the block size; the masks above lift that limit. One pitfall is new:
# Triton 3.9's interpreter stores bf16 values as 16-bit integers and multiplies them as
# integers inside ``tl.dot``, giving nonsense, so the kernels take an ``UPCAST_DOT``
# flag, set only for bf16 under the interpreter, that converts the operands to fp32.
#
# The autograd wrapper
# --------------------
# ``attention(q, k, v, causal, sm_scale)`` checks (batch, heads, sequence, head dim)
# tensors of any strides (``kit.check_attention_inputs``, which every attention lesson
# calls) and returns a tensor PyTorch can differentiate. :math:`dO` comes unchecked from
# the caller's ``loss.backward()``, so ``kit.resolved_gradient`` resolves a negative
# view and copies a layout too wide for 32-bit offsets. As in the softmax lessons, the
# backward is ``once_differentiable``: a second derivative (a gradient penalty, say)
# raises an error, not a wrong result. The launches go through ``kit.launch``, which the
# benchmark uses to compile every kernel ahead, on all CPU cores, before it times.

BLOCK = 64


class _AttentionV1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        B, H, N, D = q.shape
        o = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
        l, m = (
            torch.empty((B * H, N), dtype=torch.float32, device=q.device)
            for _ in range(2)
        )
        upcast = (not kit.ON_GPU) and q.dtype == torch.bfloat16
        grid = (triton.cdiv(N, BLOCK), B * H)
        strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
        kit.launch(
            attn_fwd_v1_kernel, grid, q, k, v, o, l, m, sm_scale, H, N, *strides,
            D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=causal, UPCAST_DOT=upcast,
            num_warps=4,
        )
        ctx.save_for_backward(q, k, v, o, l, m)
        ctx.causal, ctx.sm_scale, ctx.upcast = causal, sm_scale, upcast
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, l, m = ctx.saved_tensors
        do = kit.resolved_gradient(do)
        B, H, N, D = q.shape
        do_scaled, dk, dv = (
            torch.empty((B, H, N, D), dtype=q.dtype, device=q.device) for _ in range(3)
        )
        delta = torch.empty_like(l)
        kit.launch(
            attn_bwd_preprocess_v1_kernel, (triton.cdiv(N, BLOCK), B * H),
            o, do, l, do_scaled, delta, H, N, *o.stride(), *do.stride(),
            D=D, BLOCK_M=BLOCK,
        )
        dq = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
        kit.launch(
            attn_bwd_v1_kernel, (B * H,), q, k, v, do_scaled, dq, dk, dv, m, delta,
            ctx.sm_scale, H, N, *q.stride(), *k.stride(), *v.stride(),
            D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=ctx.causal,
            UPCAST_DOT=ctx.upcast, num_warps=4 if D <= 64 else 8,
        )
        return dq.to(q.dtype), dk, dv, None, None


def attention(q, k, v, causal, sm_scale):
    """v1 attention: softmax(q k^T * sm_scale) v over (batch, heads, sequence,
    head_dim) tensors."""
    kit.check_attention_inputs(q, k, v, causal, sm_scale)
    return _AttentionV1.apply(*kit.resolved(q, k, v), causal, float(sm_scale))


# %%
# Correctness
# -----------
# Forward and backward against float64 PyTorch on fresh random inputs, causal and not,
# at a length not a multiple of the block size, with ``kit.check_against_float64``
# (every attention lesson uses it). It fails on NaN or infinity anywhere: ``error <
# tolerance`` is false for NaN, and it never tests ``max(errors) < tolerance``
# (Python's ``max`` skips a NaN that is not first).

if __name__ == "__main__":
    torch.manual_seed(0)
    for causal in (False, True):
        q, k, v = torch.randn(3, 1, 2, 77, 32, device=DEVICE, dtype=torch.float16)
        label = f"05-fused-attention-v1, causal={causal}"
        errors = kit.check_against_float64(attention, q, k, v, causal, 32**-0.5, label)
        shown = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        print(f"causal={causal}, N=77: relative max error {shown}")

# %%
# The price of dividing :math:`dO` by :math:`\ell` first
# ------------------------------------------------------
# The preprocess stores :math:`dO / \ell` in the input's dtype, and :math:`\ell` can
# reach :math:`N`: attention spread evenly over 1,024 keys divides each row of
# :math:`dO` by about 1,024, ten binades (factors of two). A gradient already small
# lands among fp16's *subnormal* numbers (below :math:`6 \cdot 10^{-5}`), which carry
# fewer significant bits the smaller they are: the identity above is exact, the stored
# tensor is not. Below: near-uniform attention (small queries) at :math:`N = 1024`,
# :math:`dO` of order 1 or :math:`10^{-4}` (a loss scaled down or averaged over many
# tokens), and :math:`dV`'s error relative to its own largest value (not floored at 1
# as in the check above, which would hide it), for this backward and for lesson 07's
# (FlashAttention-2, loaded from its file beside this one), which recomputes :math:`P`
# normalized from the saved log-sum-exp and never divides :math:`dO`. This site's
# tests allow fp16 an error of 1e-2 here. Lesson 07 rounds
# :math:`dS = P \circ (dP - \Delta)` to fp16 for the tensor cores, like Triton's own
# tutorial, and with :math:`P` near :math:`1/1024` and :math:`dP - \Delta` the size of
# :math:`dO`, :math:`dS` is subnormal too: its :math:`dQ` and :math:`dK` lose bits (not
# shown here). Hence fp16 training's loss scaling (``torch.amp.GradScaler``), and one
# reason to train in bf16 (fp32's exponent range: no subnormals at this scale).


def price_of_dividing(dv_errors, tolerance=1e-2):
    """A sentence on dv_errors, {(kernel, size of dO): dV's error relative to its
    largest value}, kernels "v1" and "lesson 07", sizes 1 and 1e-4, to tolerance."""
    small = {name: dv_errors[name, 1e-4] for name in ("v1", "lesson 07")}
    said = [f"{e / dv_errors[name, 1.0]:.3g}x as large for {name} ({e:.1e}: "
            f"{'within' if e < tolerance else 'past'} the tests' {tolerance:g})"
            for name, e in small.items()]  # fmt: skip
    return f"With dO of order 1e-4 instead of 1, dV's error is {' and '.join(said)}."


if __name__ == "__main__":
    torch.manual_seed(0)
    shape = (1, 1, 1024, 64)
    q = torch.randn(shape, device=DEVICE, dtype=torch.float16) * 0.01
    k, v = (torch.randn(shape, device=DEVICE, dtype=torch.float16) for _ in range(2))
    V2_BACKWARD = kit.load_lesson("07-fused-attention-v2-backward")
    kernels, dv_errors = {"v1": attention, "lesson 07": V2_BACKWARD.attention}, {}
    for size in (1.0, 1e-4):
        do = torch.randn(shape, device=DEVICE, dtype=torch.float16) * size
        qkv64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref = kit.reference_attention(*qkv64, False, 0.125)
        (dv64,) = torch.autograd.grad(ref, qkv64[2], do.double())
        for name, fn in kernels.items():
            qkv = [t.clone().requires_grad_() for t in (q, k, v)]
            (dv,) = torch.autograd.grad(fn(*qkv, False, 0.125), qkv[2], do)
            error = (dv.double() - dv64).abs().max() / dv64.abs().max()
            dv_errors[name, size] = error.item()
        shown = ", ".join(f"{dv_errors[name, size]:.1e} ({name})" for name in kernels)
        print(f"dO of order {size:g}: dV off by {shown} of its largest value")
    print(price_of_dividing(dv_errors))

# %%
# Benchmark
# ---------
# TFLOP/s of forward and backward beside each backend of PyTorch's
# ``scaled_dot_product_attention`` that runs here, on a GPU at :math:`B = 4`,
# :math:`H = 32`, :math:`D = 64` (under the interpreter at :math:`B = 1`, :math:`H = 2`
# and two short sequences). The forward does :math:`4BHN^2D` floating-point operations
# (two matrix products), half that when causal; the backward 2.5 times as many (five).
# The ceiling is the device's fp16 matrix-multiply rate, measured now at the clocks a
# GPU keeps under load; under the interpreter, PyTorch's fp32 one on the CPU.
#
# How we time: every provider's GPU time is its call captured in a CUDA graph and
# replayed after the L2 cache is flushed; its *back-to-back* time is that of many calls
# enqueued in a row, what a training loop sees, which the host's work per call can
# slow. A backward is timed alone, as ``torch.autograd.grad`` after one forward. Each
# case is timed in several passes, and a range is shown where they disagree. The
# :doc:`performance page <../performance>` gives the method in full ("How we time").
# Under the interpreter, the numbers time NumPy on the CPU: they only illustrate.

OURS = "Triton v1"
INDEX = ["D", "causal", "mode", "N"]


def v1_providers(causal, D):
    """What the benchmark times: this lesson's attention and the SDPA backends."""
    ours = functools.partial(attention, causal=causal, sm_scale=D**-0.5)
    return {OURS: ours, **kit.sdpa_providers(causal, D**-0.5, kit.SDPA_PEERS)}


if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    print(kit.describe_platform())
    gpu_problem = [(4, 32, 64)], [1024, 2048, 4096, 8192, 16384]
    cases, sizes = gpu_problem if kit.ON_GPU else ([(1, 2, 64)], [64, 128])
    peak = kit.matmul_tflops()
    print(kit.ceiling_line(peak))
    benchmark = kit.attention_benchmark(cases, sizes, v1_providers, ("fwd", "bwd"))
    results = pd.DataFrame(benchmark)
    table, b2b = kit.rate_tables(results, INDEX)
    ((B, H, D),) = cases
    kit.plot_style()
    for mode, name in (("fwd", "Forward"), ("bwd", "Backward")):
        title = f"{name} pass, B = {B}, H = {H}, D = {D}, by GPU time"
        kit.plot_attention(table, mode, peak, title, ours=[OURS])
    plt.show()

# %%
# The table, by GPU time (under the interpreter, by wall-clock time):

kit.rates_table(results, INDEX, "TFLOP/s") if __name__ == "__main__" else None

# %%
# The same calls back to back, as a loop that calls attention again and again sees
# them. Where a call's GPU time is shorter than the host's time to enqueue it, the host
# paces the GPU and the rate falls below the one above; "Reading the numbers" says how
# far the two tables differ in this run.

(
    kit.rates_table(results, INDEX, "TFLOP/s", value="value")
    if __name__ == "__main__" and kit.ON_GPU
    else None
)

# %%
# Reading the numbers
# -------------------
# Computed from the tables above, in this run: by GPU time, and back to back where that
# tells another story, always as a call's back-to-back time over its GPU time.

def against_flash(near, close=0.15):
    """A sentence on near, v1's forward rate over SDPA flash's by (D, causal, N):
    per masking, its range and the lengths more than close (a fraction) apart."""
    parts = []
    for causal, part in near.groupby(level="causal"):
        far = part[(part - 1).abs() > close].index.get_level_values("N")
        where = (f"more than {close:.0%} apart at N = {', '.join(map(str, far))}"
                 if len(far) else f"within {close:.0%} at every N")
        masking = "causal" if causal else "non-causal"
        parts.append(f"{masking} {part.min():.2f}x to {part.max():.2f}x, {where}")
    return ("Forward, v1 against SDPA flash (FlashAttention-2): " + "; ".join(parts)
            + ". What else FlashAttention-2 changes is lesson 06's subject.")


def call_name(key):
    """A call of the tables as the overview names it: "v1 fwd causal at N = 1024"."""
    _, causal, mode, N, provider = key
    return f"{provider} {mode}{' causal' if causal else ''} at N = {N}"


if __name__ == "__main__":
    peers = [c for c in kit.SDPA_PEERS if c in table]
    print("\n".join(kit.peer_lines(table, b2b, peak, OURS, peers, name="v1").values()))
    if "SDPA flash" in table:  # FlashAttention-2, the loop order v1's forward shares
        fwd = table.xs("fwd", level="mode")
        print(against_flash(fwd[OURS] / fwd["SDPA flash"]))
    if kit.ON_GPU:
        print(kit.b2b_overview(table, b2b, call_name))
    interpreted = "These are interpreter timings: they measure NumPy on the CPU."
    print(kit.spread_summary(results) if kit.ON_GPU else interpreted)
    kit.save_results("05-fused-attention-v1", [{
        "name": f"attention v1, B={B}, H={H}, D={D}", "unit": "TFLOP/s",
        "ceiling_name": kit.MATMUL_CEILING, "ceiling": peak, "ours": [OURS],
        "peers": peers, "rows": results.to_dict("records"),
    }])

# %%
# Why the backward is slow: how many programs an SM needs
# -------------------------------------------------------
# At the benchmark's :math:`B \cdot H = 128`, the backward runs 128 programs, one per
# (batch, head): about one per SM on a large GPU. The GPU does not idle for lack of
# programs, but each SM idles inside its one program, whose 4 warps walk the key blocks
# in turn: while they wait for a load or the tensor cores, no other program is there to
# use the SM. Below, :math:`N` is fixed and :math:`B \cdot H` is 1, 2, 4 and 8 times
# this GPU's SM count. If the rate grows with programs per SM, the kernel is
# latency-bound, and part of the fix is more, smaller, independent programs:
# FlashAttention-2's backward, one program per *key block*. The last line sets what
# they buy beside the gap to SDPA in the benchmark.


def per_sm_cases(sms, N, D):
    """The cases for kit.measure: v1's backward at 1 to 8 programs per SM."""
    for per_sm in (1, 2, 4, 8):
        q, k, v = (
            torch.randn(1, per_sm * sms, N, D, device=DEVICE, dtype=torch.float16,
                        requires_grad=True)
            for _ in range(3)
        )
        timer = kit.backward_timer(attention, q, k, v, causal=False, sm_scale=D**-0.5)
        yield per_sm, f"{per_sm} per SM", {"v1": timer}


if __name__ == "__main__" and kit.ON_GPU:
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    N, D = 2048, 64
    rates = {}
    for (per_sm, _), m in sorted(kit.measure(lambda: per_sm_cases(sms, N, D)).items()):
        work = kit.attention_flops(1, per_sm * sms, N, D, False, "bwd") * 1e-9
        rates[per_sm] = m.row(work)["gpu_value"]
        print(f"{per_sm} program(s) per SM ({per_sm * sms} in all), N={N}, D={D}: "
              f"backward at {rates[per_sm]:.0f} TFLOP/s")
    gain = rates[8] / rates[1]
    best = max(rates.values())
    enough = min(per_sm for per_sm, rate in rates.items() if rate >= 0.95 * best)
    print(f"Eight programs per SM run the same kernel {gain:.1f}x as fast as one, and "
          f"{enough} per SM already come within 5% of the fastest: "
          + ("the backward is latency-bound, and more independent programs per SM "
             "hide it." if gain > 1.2
             else "more programs per SM do not help here; its limit is elsewhere."))
    case = table.loc[(D, False, "bwd", N)]
    gap = case[peers].max() / case[OURS]
    print(f"In the benchmark above (N={N}, D={D}, non-causal) the fastest SDPA "
          f"backend's backward ran {gap:.1f}x as fast as this one. More programs per "
          f"SM account for {gain:.2f}x of that"
          + (f"; the other {gap / gain:.1f}x lies in the work each program does, which "
             "lesson 07's backward changes too (dQ in a pass of its own, not added "
             "through memory at every key block)." if gap > 1.05 * gain
             else ", all of it at this size."))
elif __name__ == "__main__":
    print("Programs per SM are a GPU question: the interpreter runs one at a time.")

# %%
# Exercises
# ---------
# Each exercise changes this lesson's kernels: copy them under new names (a copy named
# ``attn_fwd_v1_kernel`` in the notebook would replace the lesson's) and edit the copy.
# Each check runs your function on fresh fp16 and bf16 inputs, causal and not, at
# :math:`N` = 1, 77 and 130 (no block size divides the last two), head dims 16 and 64,
# ``q`` a transposed view, against float64: it raises ``AssertionError`` at the first
# wrong element, saying how far off (NaN is wrong), or says all is right, and on a GPU
# reports your kernel's time against this lesson's (not required). Compute in fp32
# inside the kernel, as the lesson's does (``UPCAST_DOT`` too): Triton 3.9's
# interpreter gets bf16 arithmetic wrong.
#
# Write each attempt in a new cell at the end of this lesson's notebook (linked at the
# end of the page), below the checks, and call its check as the exercise shows; or in a
# file next to the lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L05 = kit.load_lesson("05-fused-attention-v1")
#    # ... your kernel, and attention_once(q, k, v, causal, sm_scale) ...
#    L05.check_normalize_once(attention_once)  # in the notebook: check_normalize_once
#
# 1. **Normalize once, at the end.** Write ``attention_once(q, k, v, causal,
#    sm_scale)``, forward only, whose kernel keeps the unnormalized sum :math:`a` of
#    ``one_row_attention`` in place of the normalized output: per key block, make the
#    probabilities against the new maximum :math:`m'` and rescale :math:`a` and
#    :math:`\ell` by :math:`e^{m - m'}`, no division; divide by :math:`\ell` once,
#    after the loop. Check it with ``check_normalize_once(attention_once)``. One query
#    row's scores pass 88, where :math:`e^s` overflows fp32. The check sees outputs
#    only (this lesson's ``attention`` passes it too): the time on a GPU tells them
#    apart.
# 2. **A key-padding mask.** Sequences of different lengths are padded to one
#    :math:`N`. Write ``padded_attention(q, k, v, causal, sm_scale, key_lengths)``,
#    forward only, for ``key_lengths`` an integer tensor of shape ``(B,)`` on ``q``'s
#    device: batch element ``b`` sees only its first ``key_lengths[b]`` keys, the others
#    get probability zero. Hint: load the length once per program, beside ``b``, and
#    let it end the loop. Every length is at least 1 (length 0 would leave query rows
#    with no key to attend to, so the check never asks for it). Check it with
#    ``check_padded_attention(padded_attention)``; on a GPU it times every length
#    :math:`N/2` against ``attention`` at :math:`N`.
# 3. **dQ by atomics.** The backward runs one program per (batch, head), and "Why the
#    backward is slow" measured what that costs. Give it one program per key block and
#    (batch, head): the outer loop's body becomes the program, and since several
#    programs now add into the same rows of :math:`dQ`, its read-add-write becomes one
#    ``tl.atomic_add``. Hint: subclass ``_AttentionV1`` and replace its ``backward``.
#    Check ``attention_atomic_dq(q, k, v, causal, sm_scale)`` with
#    ``check_atomic_dq(attention_atomic_dq)``. The interpreter runs one program at a
#    time, so a plain read-add-write passes there; on a GPU it loses additions.

# (B, H, N, D): one key; an odd length; 130, three key blocks of 64, the last ragged.
CHECK_SHAPES = [(3, 1, 1, 16), (3, 1, 77, 64), (3, 2, 130, 16)]
# Relative to the reference's largest value (at least 1), as in the correctness check.
CHECK_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def exercise_inputs(generator, peaked=True):
    """Fresh (case, q, k, v, causal) at every shape of CHECK_SHAPES, fp16 and bf16,
    causal and not, q a transposed view. peaked: query row N // 2 scaled by 60, so
    that its scores reach about 150 (e^150 overflows fp32)."""
    dtypes, modes = kit.ATTENTION_DTYPES, (False, True)
    for (B, H, N, D), dtype, causal in itertools.product(CHECK_SHAPES, dtypes, modes):
        q = torch.randn(B, N, H, D, generator=generator).transpose(1, 2)
        k, v = (torch.randn(B, H, N, D, generator=generator) for _ in "kv")
        if peaked:
            q[:, :, N // 2] *= 60
        name = f"B, H, N, D = {B}, {H}, {N}, {D}, {str(dtype)[6:]}, causal={causal}"
        yield name, *(t.to(DEVICE, dtype) for t in (q, k, v)), causal


def expect_attention(exercise, case, what, got, want, dtype):
    """kit.expect_close within CHECK_TOLERANCE of want's largest value."""
    tol = CHECK_TOLERANCE[dtype]
    atol = tol * max(1.0, want.abs().max().item())
    kit.expect_close(exercise, case, what, got, want, dtype, tol, atol)


def report_speed(what, timers):
    """On a GPU, print how long timers()["yours"] takes beside timers()["lesson"], by
    GPU time (kit.time_calls): reported, never required."""
    if not kit.ON_GPU:
        print(f"{what}: speed is measured only on a GPU.")
        return
    ms = {name: min(m.gpu) for name, m in kit.time_calls(timers()).items()}
    print(f"{what}: yours takes {ms['yours'] / ms['lesson']:.2f}x the time of this "
          "lesson's, by GPU time.")


def gpu_inputs(B=4, H=32, N=4096, D=64):
    """q, k, v for the checks' timing: fp16, on the GPU."""
    return [torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16) for _ in "qkv"]


def check_normalize_once(fn):
    """Exercise 1: fn(q, k, v, causal, sm_scale) must return attention, in q's
    dtype."""
    for case, q, k, v, causal in exercise_inputs(kit.fresh_generator()):
        D = q.shape[-1]
        want = kit.reference_attention(q.double(), k.double(), v.double(), causal,
                                       D**-0.5)
        got = fn(q, k, v, causal, D**-0.5)
        expect_attention("attention_once", case, "the output", got, want, q.dtype)
    print("attention_once is right at every shape, dtype and masking.")

    def timers():
        q, k, v = gpu_inputs()
        return {"yours": kit.call_timer(fn, q, k, v, False, 0.125),
                "lesson": kit.call_timer(attention, q, k, v, False, 0.125)}

    report_speed("Forward, B, H, N, D = 4, 32, 4096, 64, fp16, non-causal", timers)


def check_padded_attention(fn, lesson_attention=attention):
    """Exercise 2: fn(q, k, v, causal, sm_scale, key_lengths) must return attention
    over each batch element's first key_lengths[b] keys, in q's dtype. Lesson 06's
    check is this one, timed against lesson_attention, its own."""
    generator = kit.fresh_generator()
    for case, q, k, v, causal in exercise_inputs(generator):
        B, _, N, D = q.shape
        middle = int(torch.randint(2, N, (), generator=generator)) if N > 2 else N
        while middle % 16 == 0:  # no block size divides it
            middle -= 1
        lengths = torch.tensor([N, 1, middle][:B], device=DEVICE)
        padded = torch.arange(N, device=DEVICE) >= lengths[:, None]  # (B, keys)
        s = q.double() @ k.double().transpose(-1, -2) * D**-0.5
        s = s.masked_fill(padded[:, None, None, :], -float("inf"))
        if causal:
            above = torch.ones(N, N, dtype=torch.bool, device=DEVICE).triu(1)
            s = s.masked_fill(above, -float("inf"))
        want = torch.softmax(s, dim=-1) @ v.double()
        case += f", key lengths {', '.join(map(str, lengths.tolist()))}"
        got = fn(q, k, v, causal, D**-0.5, lengths)
        expect_attention("padded_attention", case, "the output", got, want, q.dtype)
    print("padded_attention is right at every shape, dtype, masking and key length.")

    def timers():
        q, k, v = gpu_inputs()
        lengths = torch.full((4,), 2048, device=DEVICE)
        return {"yours": kit.call_timer(fn, q, k, v, False, 0.125, lengths),
                "lesson": kit.call_timer(lesson_attention, q, k, v, False, 0.125)}

    report_speed("Forward, B, H, N, D = 4, 32, 4096, 64, fp16, non-causal, every key "
                 "length 2048 (yours) against all 4096 keys (the lesson's; a loop "
                 "that stops at the length: about 0.5x)", timers)


def check_atomic_dq(fn):
    """Exercise 3: fn(q, k, v, causal, sm_scale) must return attention that autograd
    differentiates, each gradient in its input's dtype."""
    generator = kit.fresh_generator()
    # Not peaked: rounding O to fp16 costs dK precision there, in this lesson's
    # backward too.
    for case, q, k, v, causal in exercise_inputs(generator, peaked=False):
        D = q.shape[-1]
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        want = kit.reference_attention(*leaves, causal, D**-0.5)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = fn(q, k, v, causal, D**-0.5)
        expect_attention("attention_atomic_dq", case, "the output", out, want, q.dtype)
        if out.grad_fn is None:
            raise AssertionError(f"attention_atomic_dq on {case}: the output has no "
                                 "gradient; return what your Function's apply returns")
        do = torch.randn(out.shape, generator=generator).to(DEVICE, out.dtype)
        grads = torch.autograd.grad(out, (q, k, v), do)
        wanted = torch.autograd.grad(want, leaves, do.double())
        for what, got, expected in zip(("dq", "dk", "dv"), grads, wanted):
            expect_attention("attention_atomic_dq", case, what, got, expected, q.dtype)
    print("attention_atomic_dq's gradients are right at every shape, dtype and "
          "masking.")

    def timers():
        q, k, v = (t.requires_grad_() for t in gpu_inputs(N=2048))
        return {
            "yours": kit.backward_timer(lambda *qkv: fn(*qkv, False, 0.125), q, k, v),
            "lesson": kit.backward_timer(attention, q, k, v, causal=False,
                                         sm_scale=0.125),
        }

    report_speed("Backward, B, H, N, D = 4, 32, 2048, 64, fp16, non-causal", timers)
