"""
Fused attention v1: the FlashAttention-1 algorithm
==================================================

Attention, :math:`O = \\mathrm{softmax}(\\tau\\,QK^T)\\,V` with a scale :math:`\\tau`, computed without ever writing
the :math:`N \\times N` matrix of scores to memory, as FlashAttention (Dao et al., 2022) first did. That algorithm,
taught by Triton's 2022 tutorial, is the step from lesson 03's online softmax to FlashAttention-2 (next lesson),
kept alive here on purpose.

You will learn:

* how the online softmax becomes an online *softmax-weighted sum*, for one query row, then for a block of rows with
  matrix multiplications;
* the FlashAttention-1 forward: running maximum :math:`m` and sum :math:`\\ell` kept apart, the output rescaled at
  every step, the statistics saved for the backward;
* its backward: a preprocess, one program per (batch, head) walking the key blocks, :math:`dQ` accumulated in fp32
  through memory; why it divides :math:`dO` by :math:`\\ell` first (derived), what that costs in fp16, and one
  reason it is slow (measured: how many programs an SM needs);
* what the 2022 code needed that today's Triton no longer has, and what replaces it;
* how to benchmark attention honestly: FLOPs, forward and backward timed apart, every SDPA backend beside it,
  repeated timings, the matrix-multiply rate as the ceiling. The later attention lessons load this file, when it
  sits next to them, for this benchmark and its checks.
"""

# %%
# Where the kernels run
# ---------------------
# A CUDA GPU if there is one, else the Triton interpreter on the CPU, switched on before the first ``@triton.jit``.

import functools
import itertools
import math
import numbers
import os
import platform
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# %%
# One query row, one key at a time
# --------------------------------
# For a query row :math:`q`, attention averages the value rows :math:`v_j` with weights
# :math:`\mathrm{softmax}_j(s_j)`, :math:`s_j = q \cdot k_j \cdot \mathrm{scale}`. Lesson 03's online softmax
# rescales its running sum :math:`\ell` whenever the running maximum :math:`m` grows; the weighted sum
# :math:`a = \sum_j e^{s_j - m} v_j` takes the same factor, so one loop over the keys computes everything:
#
# .. math::
#
#    m' &= \max(m, s_j), \\
#    \ell' &= \ell\, e^{m - m'} + e^{s_j - m'}, \\
#    a' &= a\, e^{m - m'} + e^{s_j - m'}\, v_j, \\
#    o &= a / \ell \quad \text{(after the last key).}


def one_row_attention(q, k, v, scale):
    """Attention for one query row, one key at a time: the scalar form of the algorithm."""
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
# A GPU wants matrix multiplications, not dot products: with ``BLOCK_M`` query rows and ``BLOCK_N`` keys per step,
# scores form a ``BLOCK_M x BLOCK_N`` tile :math:`S = Q_i K_j^T`, maximum and sum run along its rows, and a second
# matrix product gives :math:`e^{S - m} V_j`. Nothing larger than a tile exists. Any sequence length works: key
# columns past :math:`N` score :math:`-\infty` (weight 0), query rows past :math:`N` are computed on zeros, never
# stored. With ``CAUSAL``, query :math:`i` sees only keys :math:`j \le i`: query blocks stop at the diagonal.
#
# FlashAttention-1 keeps the output *normalized*, :math:`o = a / \ell` over the keys so far: each step multiplies it
# by :math:`\ell e^{m - m'} / \ell'` and the new probability tile, made against the block's own row maximum
# :math:`m_{ij}`, by :math:`e^{m_{ij} - m'} / \ell'`. That is two divisions per row and one extra multiplication
# per probability, every step, which FlashAttention-2 removed by normalizing once at the end (it still rescales the
# accumulator by :math:`e^{m - m'}`). v1 saves :math:`\ell` and :math:`m` per row for the backward.


@triton.jit
def attn_fwd_v1_kernel(
    Q, K, V, O, L, Mx, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=rows[:, None] < N, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum((start_m + 1) * BLOCK_M, N) if CAUSAL else N
    for start_n in range(0, end, BLOCK_N):
        keys = start_n + cols
        k = tl.load(K + b * skb + h * skh + keys[:, None] * skn + d[None, :] * skd, mask=keys[:, None] < N, other=0.0)
        v = tl.load(V + b * svb + h * svh + keys[:, None] * svn + d[None, :] * svd, mask=keys[:, None] < N, other=0.0)
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
        # Keep the output normalized: rescale what is there, weight the new block by beta / l_new.
        acc = acc * (l_i * alpha / l_new)[:, None]
        p = p * (beta / l_new)[:, None]
        acc += tl.dot(p.to(v.dtype), v)
        l_i, m_i = l_new, m_new
    row_ok = rows < N
    tl.store(L + bh * N + rows, l_i, mask=row_ok)
    tl.store(Mx + bh * N + rows, m_i, mask=row_ok)
    tl.store(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, acc.to(O.dtype.element_ty),
             mask=row_ok[:, None])


# %%
# The backward pass, derived
# --------------------------
# For one (batch, head), with the scale folded into the scores, the forward is :math:`S = \tau\,QK^T`,
# :math:`P = \mathrm{softmax}_\text{rows}(S)`, :math:`O = PV`. Walking back from :math:`dO`:
#
# * :math:`O = PV` gives :math:`dV = P^T dO` and :math:`dP = dO\,V^T`.
# * For one row, softmax's Jacobian is :math:`\partial p_j/\partial s_k = p_j(\delta_{jk} - p_k)`, so
#   :math:`dS = P \circ (dP - \Delta)` with :math:`\Delta_i = \sum_j P_{ij}\,dP_{ij}`, and since
#   :math:`dP_{ij} = dO_i \cdot v_j`, :math:`\Delta_i = dO_i \cdot \sum_j P_{ij} v_j = dO_i \cdot O_i`: one dot
#   product of two stored rows.
# * :math:`S = \tau\,QK^T` gives :math:`dQ = \tau\,dS\,K` and :math:`dK = \tau\,dS^T Q`.
#
# Only :math:`m` and :math:`\ell` were saved, so the backward recomputes each tile of :math:`P`: :math:`e^{S - m}`
# is cheap, dividing by :math:`\ell` row by row at every tile is not, so the 2022 kernel moves the division out of
# the loop. Row :math:`i` of :math:`e^{S-m}` is :math:`\ell_i P_i`; divide row :math:`i` of :math:`dO` by
# :math:`\ell_i` first, and :math:`dV = \sum_i (\ell_i P_i)^T (dO_i / \ell_i)` is unchanged, :math:`dP` and
# :math:`\Delta` (linear in :math:`dO`) come out divided by :math:`\ell_i`, and
# :math:`(\ell_i P_i) \circ (dP_i - \Delta_i)/\ell_i` is the same :math:`dS`. So a *preprocess* divides :math:`dO`
# by :math:`\ell` and computes :math:`\Delta` from it, once per row; then one program per (batch, head) walks the
# key blocks, each over every query block: :math:`dK` and :math:`dV` accumulate in registers, :math:`dQ` in an fp32
# buffer in memory, read and written again per key block (how well that uses a GPU is measured after the benchmark).


@triton.jit
def attn_bwd_preprocess_v1_kernel(O, DO, L, DO_SCALED, DELTA, H, N,
                                  sob, soh, son, sod, sdb, sdh, sdn, sdd,
                                  D: tl.constexpr, BLOCK_M: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    ok = rows < N
    o = tl.load(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, mask=ok[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd, mask=ok[:, None], other=0.0)
    o, do = o.to(tl.float32), do.to(tl.float32)
    l = tl.load(L + bh * N + rows, mask=ok, other=1.0)
    do = do / l[:, None]
    tl.store(DO_SCALED + bh * N * D + rows[:, None] * D + d[None, :], do.to(DO_SCALED.dtype.element_ty),
             mask=ok[:, None])
    tl.store(DELTA + bh * N + rows, tl.sum(o * do, axis=1), mask=ok)


@triton.jit
def attn_bwd_v1_kernel(
    Q, K, V, DO_SCALED, DQ, DK, DV, Mx, DELTA, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    d = tl.arange(0, D)
    for start_n in range(0, N, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < N
        k = tl.load(K + b * skb + h * skh + keys[:, None] * skn + d[None, :] * skd, mask=key_ok[:, None], other=0.0)
        v = tl.load(V + b * svb + h * svh + keys[:, None] * svn + d[None, :] * svd, mask=key_ok[:, None], other=0.0)
        if UPCAST_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        # Causal: query blocks above the diagonal never see these keys.
        first_m = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
        for start_m in range(first_m, N, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < N
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
            do = tl.load(DO_SCALED + bh * N * D + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            if UPCAST_DOT:
                q, do = q.to(tl.float32), do.to(tl.float32)
            m = tl.load(Mx + bh * N + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + bh * N + rows, mask=row_ok, other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            valid = row_ok[:, None] & key_ok[None, :]
            if CAUSAL:
                valid = valid & (keys[None, :] <= rows[:, None])
            p = tl.where(valid, tl.exp(s - m[:, None]), 0.0)  # = P * l, since do was divided by l
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None]) * sm_scale
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
            # dQ lives in fp32 memory: read, add this key block's share, write back.
            dq_ptrs = DQ + bh * N * D + rows[:, None] * D + d[None, :]
            dq = tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
            tl.store(dq_ptrs, dq + tl.dot(ds.to(k.dtype), k), mask=row_ok[:, None])
        out = bh * N * D + keys[:, None] * D + d[None, :]
        tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


# %%
# What changed since 2022
# -----------------------
# The 2022 tutorial no longer runs. ``tl.dot(q, k, trans_b=True)`` is now ``tl.dot(q, tl.trans(k))``; its scratch
# buffer ``TMP``, stored and reloaded to dodge a long-fixed compiler bug, is gone. It built its 2-D blocks of
# pointers by hand, as here; later versions moved to ``tl.make_block_ptr``, which runs in Triton 3.6 but raises
# ``NotImplementedError`` in 3.9, so this port keeps plain pointer arithmetic, which both run.
# ``triton.testing.assert_almost_equal`` gave way to ``torch.testing.assert_close``, and ``do_bench``'s
# ``percentiles=`` to ``quantiles=`` or ``return_mode=``. Its backward needed the sequence length to be a multiple
# of the block size; the masks above lift that limit. One pitfall is new: Triton 3.9's interpreter stores bf16
# values as 16-bit integers and multiplies them as integers inside ``tl.dot``, giving nonsense, so the kernels take
# an ``UPCAST_DOT`` flag, set only for bf16 under the interpreter, that converts the operands to fp32 first.
#
# The autograd wrapper
# --------------------
# ``attention(q, k, v, causal, sm_scale)`` checks (batch, heads, sequence, head dim) tensors of any strides
# (``check_inputs``, which every later attention lesson calls too) and returns a tensor PyTorch can differentiate.
# :math:`dO` comes unchecked from the caller's ``loss.backward()``, so ``resolved_gradient`` resolves a negative
# view and copies a layout too wide for 32-bit offsets. As in the softmax lessons, the backward is
# ``once_differentiable``: a second derivative (a gradient penalty, say) raises an error, not a wrong result.

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)


def fp8_supported():
    """fp8 matrix multiplies need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper)."""
    return ON_GPU and torch.cuda.get_device_capability() >= (8, 9)


def check_inputs(q, k, v, causal, sm_scale, fp8=False):
    """Raise a clear error for anything the kernels cannot handle; fp8: float8_e5m2 is accepted, forward only."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, sequence, head_dim), "
                             f"got shape {tuple(t.shape)}")
        if t.device.type != DEVICE.type:
            raise ValueError(f"{name} is on device '{t.device}', but Triton runs these kernels on '{DEVICE.type}' here")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if fp8 and q.dtype == torch.float8_e5m2:
        if not fp8_supported():
            raise TypeError("float8_e5m2 attention needs a GPU with fp8 tensor cores (compute capability 8.9+)")
        if any(t.requires_grad for t in (q, k, v)):
            raise TypeError("float8_e5m2 attention is forward-only: its inputs must not require grad")
        if q.shape[-1] < 32:
            raise ValueError(f"float8_e5m2 attention needs head dim 32 or more (an 8-bit tensor-core product sums "
                             f"at least 32 values at a time), got {q.shape[-1]}")
    elif q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k and v must be float16 or bfloat16{' (or float8_e5m2 forward on fp8 GPUs)' * fp8}, "
                        f"got {q.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if q.numel() == 0:
        raise ValueError(f"q, k and v must not be empty, got shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if (span := head_span(t)) >= 2**31:
            raise ValueError(f"{name}'s rows of one head span {span} elements, more than these kernels address "
                             f"with 32-bit offsets (2**31): split the sequence, or make the head's rows contiguous")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    # Any real number: Python's, or NumPy's scalars (registered as numbers.Real); a bool is a mistake.
    real = isinstance(sm_scale, numbers.Real) and not (isinstance(sm_scale, bool) or type(sm_scale).__name__ == "bool_")
    try:
        finite = real and math.isfinite(sm_scale)
    except OverflowError:  # a Python int past float's range
        finite = True
    if not finite:
        raise TypeError(f"sm_scale must be a finite real number, got {sm_scale!r}")
    # The kernels take sm_scale * log2(e) as an fp32 number: past fp32's range it would become infinite.
    if not abs(sm_scale) <= MAX_SM_SCALE:
        raise ValueError(f"sm_scale must be at most {MAX_SM_SCALE:.3g} in magnitude (the kernels scale the scores "
                         f"in fp32), got {sm_scale!r}")


MAX_SM_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)


def head_span(t):
    """How many elements apart the first and last element of one head of a (B, H, N, D) tensor lie: the kernels
    add 64-bit offsets for batch and head, and 32-bit ones inside one head."""
    _, _, n, d = t.shape
    _, _, row_stride, column_stride = t.stride()
    return (n - 1) * abs(row_stride) + (d - 1) * abs(column_stride)


def resolved(*tensors):
    """The tensors with any lazy negation or conjugation applied: a kernel reads memory, not those flags."""
    return tuple(t.resolve_neg().resolve_conj() for t in tensors)


def resolved_gradient(do):
    """dO as the backward kernels can read it: a negative view resolved, a head too wide for 32-bit offsets copied."""
    do = do.resolve_neg()
    return do.contiguous() if head_span(do) >= 2**31 else do


BLOCK = 64
_compile_only = False  # True while compile_ahead (in the benchmark's section) runs


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs): the attention lessons launch through this, so that while compile_ahead
    runs a launch only compiles the kernel, on one of Triton's worker threads, and runs nothing."""
    if _compile_only:
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def compiling_ahead():
    """Whether compile_ahead is running: lesson 06's launch plans must not keep what such a launch returns."""
    return _compile_only


class _AttentionV1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        B, H, N, D = q.shape
        o = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
        l, m = (torch.empty((B * H, N), dtype=torch.float32, device=q.device) for _ in range(2))
        upcast = (not ON_GPU) and q.dtype == torch.bfloat16
        grid = (triton.cdiv(N, BLOCK), B * H)
        launch(attn_fwd_v1_kernel, grid, q, k, v, o, l, m, sm_scale, H, N, *q.stride(), *k.stride(), *v.stride(),
               *o.stride(), D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=causal, UPCAST_DOT=upcast, num_warps=4)
        ctx.save_for_backward(q, k, v, o, l, m)
        ctx.causal, ctx.sm_scale, ctx.upcast = causal, sm_scale, upcast
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, l, m = ctx.saved_tensors
        do = resolved_gradient(do)
        B, H, N, D = q.shape
        do_scaled, dk, dv = (torch.empty((B, H, N, D), dtype=q.dtype, device=q.device) for _ in range(3))
        delta = torch.empty_like(l)
        launch(attn_bwd_preprocess_v1_kernel, (triton.cdiv(N, BLOCK), B * H),
               o, do, l, do_scaled, delta, H, N, *o.stride(), *do.stride(), D=D, BLOCK_M=BLOCK)
        dq = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
        launch(attn_bwd_v1_kernel, (B * H,), q, k, v, do_scaled, dq, dk, dv, m, delta, ctx.sm_scale, H, N,
               *q.stride(), *k.stride(), *v.stride(), D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=ctx.causal,
               UPCAST_DOT=ctx.upcast, num_warps=4 if D <= 64 else 8)
        return dq.to(q.dtype), dk, dv, None, None


def attention(q, k, v, causal, sm_scale):
    """FlashAttention-1: softmax(q k^T * sm_scale) v over (batch, heads, sequence, head_dim) tensors."""
    check_inputs(q, k, v, causal, sm_scale)
    return _AttentionV1.apply(*resolved(q, k, v), causal, float(sm_scale))


# %%
# Correctness
# -----------
# Forward and backward against float64 PyTorch on fresh random inputs, causal and not, at a length not a multiple of
# the block size (later attention lessons use it too). It fails on NaN or infinity anywhere: ``error < tolerance``
# is false for NaN, and it never tests ``max(errors) < tolerance`` (Python's ``max`` skips a NaN that is not first).


def reference_attention(q, k, v, causal, sm_scale):
    """The definition, in whatever precision the inputs have (float64 for a reference)."""
    s = (q @ k.transpose(-1, -2)) * sm_scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


def check_against_float64(attention_fn, q, k, v, causal, sm_scale, label, tolerance=1e-2, backward=True):
    """Errors of o, dq, dk, dv (o alone without backward) relative to the largest float64 reference value (at
    least 1), on a fresh random dO; raises AssertionError naming label and the tensor when one is off or not finite."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out = attention_fn(q, k, v, causal, sm_scale)
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, causal, sm_scale)
    compared = [("o", out, ref)]
    if backward:
        do = torch.randn_like(out)
        out.backward(do)
        ref.backward(do.double())
        compared += [("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)]
    errors = {}
    for name, got, want in compared:
        errors[name] = ((got.double() - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
        if not (torch.isfinite(got).all() and errors[name] < tolerance):
            raise AssertionError(f"{label}: {name} is off, error {errors[name]:.2e} relative to the largest value "
                                 f"(tolerance {tolerance:.0e}; non-finite values: "
                                 f"{(~torch.isfinite(got)).sum().item()})")
    return errors


def forward_and_backward(attention_fn, q, k, v, causal, sm_scale):
    """What check_against_float64 launches, without the check: to compile it ahead (compile_ahead, below)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention_fn(q, k, v, causal, sm_scale)
    out.backward(torch.randn_like(out))


if __name__ == "__main__":
    torch.manual_seed(0)
    for causal in (False, True):
        q, k, v = (torch.randn(1, 2, 77, 32, device=DEVICE, dtype=torch.float16) for _ in range(3))
        errors = check_against_float64(attention, q, k, v, causal, 32 ** -0.5,
                                       f"05-fused-attention-v1, causal={causal}")
        print(f"causal={causal}, N=77: relative max error " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))

# %%
# The price of dividing :math:`dO` by :math:`\ell` first
# ------------------------------------------------------
# The preprocess stores :math:`dO / \ell` in the input's dtype, and :math:`\ell` can reach :math:`N`: attention
# spread evenly over 1,024 keys divides each row of :math:`dO` by about 1,024, ten binades (factors of two). A
# gradient already small lands among fp16's *subnormal* numbers (below :math:`6 \cdot 10^{-5}`), which carry fewer
# significant bits the smaller they are: the identity above is exact, the stored tensor is not. Below: near-uniform
# attention (small queries) at :math:`N = 1024`, :math:`dO` of order 1 or :math:`10^{-4}` (a loss scaled down or
# averaged over many tokens), and :math:`dV`'s error relative to its own largest value, not floored at 1 as in the
# check above, which would hide the error at this scale.

if __name__ == "__main__":
    torch.manual_seed(0)
    q = torch.randn(1, 1, 1024, 64, device=DEVICE, dtype=torch.float16) * 0.01
    k, v = (torch.randn(1, 1, 1024, 64, device=DEVICE, dtype=torch.float16) for _ in range(2))
    dv_errors = {}
    for size in (1.0, 1e-4):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        do = torch.randn(1, 1, 1024, 64, device=DEVICE, dtype=torch.float16) * size
        attention(qq, kk, vv, False, 64 ** -0.5).backward(do)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        reference_attention(q64, k64, v64, False, 64 ** -0.5).backward(do.double())
        dv_errors[size] = ((vv.grad.double() - v64.grad).abs().max() / v64.grad.abs().max()).item()
        print(f"dO of order {size:g}: dV off by {dv_errors[size]:.1e} of its largest value")
    print(f"The small gradient's dV is {dv_errors[1e-4] / dv_errors[1.0]:.0f}x as far off as the large one's.")

# %%
# FlashAttention-2's backward (lesson 07) does not divide :math:`dO`: it recomputes :math:`P` already normalized
# from the saved log-sum-exp, and its :math:`dV`, of order :math:`10^{-4}` itself, loses a few bits but stays within
# the fp16 tolerance of this site's tests in this same case (``test_a_small_output_gradient_over_many_keys`` in
# ``tests/test_attention.py``, not run on this page). Its :math:`dQ` and :math:`dK` do not escape: like Triton's own
# tutorial, it rounds :math:`dS = P \circ (dP - \Delta)` to fp16 for the tensor cores, and with :math:`P` near
# :math:`1/1024` and :math:`dP - \Delta` the size of :math:`dO`, :math:`dS` is subnormal too. Hence fp16 training's
# loss scaling (``torch.amp.GradScaler``), and one reason to train in bf16 (fp32's exponent range: no subnormals at
# this scale).

# %%
# Benchmark
# ---------
# TFLOP/s of forward and backward beside each backend of PyTorch's ``scaled_dot_product_attention`` that runs here,
# on a GPU at :math:`B = 4`, :math:`H = 32`, :math:`D = 64` (under the interpreter at :math:`B = 1`, :math:`H = 2`
# and two short sequences). The forward does :math:`4BHN^2D` floating-point operations (two matrix products), half
# that when causal; the backward 2.5 times as many (five). The ceiling is the device's fp16 matrix-multiply rate
# measured now, at the clocks a GPU keeps under load (``matmul_tflops`` says why); under the interpreter, PyTorch's
# fp32 one on the CPU, which multiplies fp16 slowly. Every attention lesson uses the harness below.

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention  # noqa: E402


def describe_platform():
    """What produced the numbers on this page."""
    versions = f"torch {torch.__version__}, Triton {triton.__version__}"
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name()} ({versions})"
    return (f"Triton interpreter on CPU ({platform.processor() or platform.machine()}; {versions}): "
            "these timings measure the interpreter, not a GPU")


def warm_up(fn, seconds=0.05):
    """Run fn on the GPU for `seconds` (50 ms unless asked) and return how many calls that took.

    While the host compiles, the GPU idles and its clocks drop; do_bench sizes its repetitions from the
    first few calls, so a kernel timed right after its compilation was timed on a cold GPU (seen on an
    H100: 90 GB/s for a softmax that runs at 1000)."""
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:  # waiting each time: a queue of slow calls would take minutes
        fn()
        torch.cuda.synchronize()
        calls += 1
    return calls


def bench_ms(fn):
    """Time of fn() in milliseconds: do_bench's median on a GPU; under the interpreter the fastest of three
    wall-clock runs, since on a shared CPU other processes only ever add time (a test run building the
    site beside its test processes once slowed one copy 30-fold)."""
    if ON_GPU:
        warm_up(fn)
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


# Triton compiles a kernel for each new specialization a launch meets (a configuration, a dtype, whether an integer
# is a multiple of 16), one at a time on one CPU core: 8 s of lesson 05, 41 s of lessons 06 and 07 (one lesson when
# measured) and 78 s of lesson 11 in a cold run on an H100 host (engineering notes, 2026-11-26). Launches that only
# *warm up* a kernel can compile on a pool of threads (``AsyncCompileMode``, internal in Triton 3.6 and 3.9), so the
# harness first calls everything it will time once, ``launch`` only compiling; failures are left to the timed call.


def compile_ahead(calls):
    """(kernels, seconds): calls() run with launch() compiling on a pool of threads instead of launching; (0, 0.0)
    without a GPU or without Triton's AsyncCompileMode. The kernels are those not compiled in this process before."""
    global _compile_only
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return 0, 0.0
    if not ON_GPU:
        return 0, 0.0
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        mode = AsyncCompileMode(pool, ignore_errors=True)
        _compile_only = True
        try:
            with mode:  # leaving it waits for every compilation
                calls()
                kernels = len(mode.raw_futures)
        finally:
            _compile_only = False
    return kernels, time.perf_counter() - start


CEILING_NAME = "fp16 matmul rate" if ON_GPU else "fp32 matmul rate on the CPU"


def matmul_tflops():
    """The device's fp16 matrix-multiply rate, sustained, measured now: the ceiling for attention.

    A GPU's clocks follow its power draw and its temperature. In one process on an H100 fresh from
    idling, the first timing of this multiply gave 759 TFLOP/s and the next thirteen, over half a
    minute, 583 to 678; timed once per lesson, this ceiling came out between 641 and 768 in three
    builds of this site in November 2026. So the multiply runs for a second before it is timed, and
    meets the clocks that the benchmarks' kernels, run one after another, meet."""
    n = 8192 if ON_GPU else 256
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.float16 if ON_GPU else torch.float32) for _ in range(2))
    if ON_GPU:
        warm_up(lambda: a @ b, seconds=1.0)
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


def sdpa_providers(causal, scale, backends):
    """{name: fn(q, k, v)} for each named SDPA backend, as users call it."""
    def sdpa(q, k, v, backend):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    ids = {"SDPA cuDNN": SDPBackend.CUDNN_ATTENTION, "SDPA flash": SDPBackend.FLASH_ATTENTION,
           "SDPA mem-efficient": SDPBackend.EFFICIENT_ATTENTION, "SDPA math": SDPBackend.MATH}
    return {name: functools.partial(sdpa, backend=ids[name]) for name in backends}


# The math backend materializes the N x N scores (68 GB at N = 16384 here): a peer only on the CPU.
PEERS = ("SDPA cuDNN", "SDPA flash", "SDPA mem-efficient") if ON_GPU else ("SDPA math",)
OURS = "Triton v1 (this lesson)"


def backward_call(fn, q, k, v):
    """The backward pass of fn(q, k, v) alone, as a call to repeat: the forward runs once, now."""
    o = fn(q, k, v)
    return functools.partial(o.backward, torch.randn_like(o), retain_graph=True)


def backward_ms(fn, q, k, v):
    """Time of the backward pass alone: the forward runs once, outside the timing."""
    return bench_ms(backward_call(fn, q, k, v))


# A GPU's speed drifts as its clocks follow temperature and power draw: a kernel's back-to-back timings can differ
# by several percent, enough to reorder two close providers. A disturbance, most often the host pacing the GPU at
# the shortest lengths, can last a second or more: in an H100 probe (2026-11-26, N = 1024) a provider's two
# back-to-back timings came out 20% slow together and agreed. So on a GPU every provider is timed ROUNDS times, in
# passes over all cases in alternating order, its timings of one case seconds apart; it keeps its fastest, and the
# page prints how far they spread. A provider whose two fastest differ by more than AGREE gets one more timing per
# further pass, up to MAX_TIMINGS in all.
ROUNDS = 2 if ON_GPU else 1
AGREE, MAX_TIMINGS = 0.25, 4


def measure_in_passes(timing_cases):
    """{(case, (provider, mode)): [ms, ...]}, timed as the comment above ROUNDS says, in passes over what
    timing_cases() yields: (case, label, {(provider, mode): timer}); a provider failing in a case is left out of it."""
    times, failed = {}, set()

    def one_pass(reverse, wanted):
        for case, label, timers in timing_cases():
            for key in (list(timers)[::-1] if reverse else list(timers)):
                if (case, key[0]) in failed or not wanted(times.get((case, key), [])):
                    continue
                try:
                    times.setdefault((case, key), []).append(timers[key]())
                except RuntimeError as error:  # a backend that does not support this case here
                    print(f"{key[0]} skipped at {label}: {str(error).splitlines()[0][:100]}")
                    failed.add((case, key[0]))

    def disagrees(ms):
        return len(ms) < MAX_TIMINGS and sorted(ms)[1] > (1 + AGREE) * min(ms)

    for r in range(ROUNDS):
        one_pass(r % 2 == 1, lambda ms: True)
    for _ in range(MAX_TIMINGS - ROUNDS if ROUNDS > 1 else 0):
        if not any(disagrees(ms) for (case, key), ms in times.items() if (case, key[0]) not in failed):
            break  # a pass would only make every case's inputs again
        one_pass(False, disagrees)
    return {(case, key): ms for (case, key), ms in times.items() if (case, key[0]) not in failed}


def run_benchmark(cases, sizes, providers, modes, extra_providers=None):
    """Rows of TFLOP/s: every provider of providers(causal, D) in each mode, at every case and size, and any
    {(provider, mode): fn(q, k, v)} that extra_providers(q, k, v, causal, D) adds (one mode, or from the inputs)."""
    def each_case():
        for (B, H, D), causal, N in itertools.product(cases, (False, True), sizes):
            q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True)
                       for _ in range(3))
            calls = {(name, mode): fn for name, fn in providers(causal, D).items() for mode in modes}
            if extra_providers is not None:
                calls.update(extra_providers(q, k, v, causal, D))
            yield D, causal, N, 4 * B * H * N * N * D * (0.5 if causal else 1.0), (q, k, v), calls
            del q, k, v, calls

    def call_each_once():
        for *_, qkv, calls in each_case():
            for (name, mode), fn in calls.items():
                try:
                    fn(*qkv) if mode == "fwd" else backward_call(fn, *qkv)()
                except RuntimeError:  # a backend that does not support this case: the timings report it
                    pass

    kernels, seconds = compile_ahead(call_each_once)
    if kernels:
        print(f"Compiled ahead: {kernels} kernels that the cells above had not compiled, on {os.cpu_count()} "
              f"threads, in a pass of {seconds:.1f} s that also ran every other provider once per case"
              + (" (too short to compile: Triton's cache on disk held them)" if seconds < 0.1 * kernels else ""))
    def timing_cases():
        for D, causal, N, flops, qkv, calls in each_case():
            timers = {(name, mode): functools.partial(bench_ms, functools.partial(fn, *qkv)) if mode == "fwd" else
                      functools.partial(backward_ms, fn, *qkv) for (name, mode), fn in calls.items()}
            yield (D, causal, N, flops), f"D={D}, N={N}, causal={causal}", timers

    return [dict(D=D, causal=causal, N=N, mode=mode, provider=name,
                 value=flops * (2.5 if mode == "bwd" else 1.0) / min(ms) * 1e-9, spread=max(ms) / min(ms) - 1)
            for ((D, causal, N, flops), (name, mode)), ms in measure_in_passes(timing_cases).items()]


# One colour and marker per provider on every attention page.
STYLE = {"Triton v2 (this lesson)": ("#d62728", "o"), "Triton v2 (lessons 06, 07)": ("#d62728", "o"),
         "SDPA cuDNN": ("#1f77b4", "s"), "SDPA flash": ("#2ca02c", "^"), "SDPA mem-efficient": ("#bcbd22", "v"),
         "SDPA math": ("#7f7f7f", "v"), "Triton v1 (this lesson)": ("#9467bd", "D"),
         "Triton v1 (lesson 05)": ("#9467bd", "D"), "Triton v2, atomic dQ": ("#ff7f0e", "P"),
         "Triton v2 fp8": ("#8c564b", "X"), "Triton, warp-specialized (Gluon)": ("#e377c2", "*")}


def plot_mode(table, mode, peak, title):
    """One figure for one mode: a panel per (head dim, masking), every provider, and the ceiling."""
    import matplotlib.pyplot as plt

    part = table.xs(mode, level="mode")
    keys = list(dict.fromkeys(part.index.droplevel("N")))
    rows = len(keys) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(8, 3.3 * rows + 0.6), sharex=True, squeeze=False)
    for ax, (D, causal) in zip(axes.flat, keys):
        panel = part.xs((D, causal), level=["D", "causal"]).dropna(axis=1, how="all")
        for name in panel.columns:
            color, marker = STYLE.get(name, ("#17becf", "."))
            ax.plot(panel.index, panel[name], color=color, marker=marker, label=name,
                    zorder=3 if name.startswith("Triton") else 2)  # ours on top where lines meet
        ax.axhline(peak, color="black", linestyle="--", zorder=0, label=f"{CEILING_NAME} (ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(panel.index), [str(n) for n in panel.index], fontsize=10)
        ax.minorticks_off()
        ax.tick_params(labelsize=10)
        ax.set_title(f"D = {D}, {'causal' if causal else 'non-causal'}", fontsize=11)
        ax.set_ylim(0, max(peak, panel.max().max()) * 1.08)  # fp8 can pass the fp16 ceiling
    for ax in axes[-1]:
        ax.set_xlabel("N (sequence length)", fontsize=10)
    for ax in axes[:, 0]:
        ax.set_ylabel("TFLOP/s", fontsize=10)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=10, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, (0.07 + 0.04 * (len(labels) // 2)) * 2 / (rows + 1), 1, 1))
    return fig


def results_table(results):
    """The benchmark's rows as a wide table: one column per provider, in TFLOP/s (named once, in the corner, so
    that the columns stay narrow on a phone), and the pass only where the table has both."""
    index = ["D", "causal", "mode", "N"] if results["mode"].nunique() > 1 else ["D", "causal", "N"]
    table = results.pivot_table(index=index, columns="provider", values="value", sort=False)
    table.columns.name = "TFLOP/s"
    if ON_GPU:
        return table.round(0).astype("Int64")  # whole TFLOP/s; a provider that did not run stays empty
    return table.map(lambda value: float(f"{value:.3g}"))  # the interpreter's rates are tiny


def spread_summary(results):
    """How far the repeated timings of one provider spread, by N: the yardstick for small differences."""
    spread = results.groupby("N")["spread"].agg(["median", "max"])
    worst = results.loc[results["spread"].idxmax()]
    return (f"Each number is the fastest of {ROUNDS} timings taken in passes over all the cases, in alternating "
            f"order, or of up to {MAX_TIMINGS} where the two fastest differed by more than {AGREE:.0%}. The timings "
            "of one provider in one case differ by "
            + "; ".join(f"N={n}: median {row['median']:.1%}, largest {row['max']:.0%}" for n, row in spread.iterrows())
            + f"; the largest, {worst['spread']:.0%}, is {worst['provider']} ({worst['mode']}) at N={worst['N']}. "
            "Differences between providers smaller than the median spread at that N are noise; at the shortest "
            "N, where the host can pace the GPU, a whole run can also come out slower or faster than another.")


def v1_providers(causal, D):
    return {OURS: lambda q, k, v: attention(q, k, v, causal, D ** -0.5), **sdpa_providers(causal, D ** -0.5, PEERS)}


# %%
# What produced the numbers below (the plots come from the same run):

if __name__ == "__main__":
    print(describe_platform())

# %%

if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    cases, sizes = ([(4, 32, 64)], [1024, 2048, 4096, 8192, 16384]) if ON_GPU else ([(1, 2, 64)], [64, 128])
    peak = matmul_tflops()
    print(f"{CEILING_NAME}, measured now: {peak:.3g} TFLOP/s")
    results = pd.DataFrame(run_benchmark(cases, sizes, v1_providers, ("fwd", "bwd")))
    table = results.pivot_table(index=["D", "causal", "mode", "N"], columns="provider", values="value", sort=False)
    (B, H, D), = cases
    plot_mode(table, "fwd", peak, f"Forward pass, B = {B}, H = {H}, D = {D}")
    plot_mode(table, "bwd", peak, f"Backward pass, B = {B}, H = {H}, D = {D}")
    plt.show()

# %%
# The table, in TFLOP/s:

results_table(results) if __name__ == "__main__" else None

# %%
# Reading the numbers
# -------------------
# Computed from the table above, in this run:

if __name__ == "__main__":
    peers = [c for c in PEERS if c in table]
    for (_, causal, mode), part in table.groupby(level=["D", "causal", "mode"], sort=False):
        ratio = part[OURS] / part[peers].max(axis=1)
        print(f"{mode} {'causal' if causal else 'non-causal'}: v1 reaches {part[OURS].max() / peak:.0%} of the "
              f"matmul rate at best and {ratio.min():.2f}x to {ratio.max():.2f}x the fastest SDPA backend.")
    if ROUNDS > 1:
        print(spread_summary(results))
    else:
        print("These are interpreter timings: they measure NumPy on the CPU, not GPU kernels.")
    save_results("05-fused-attention-v1", [{
        "name": f"attention v1, B={B}, H={H}, D={D}", "unit": "TFLOP/s", "ceiling_name": CEILING_NAME,
        "ceiling": peak, "ours": [OURS], "peers": peers, "rows": results.drop(columns="spread").to_dict("records")}])

# %%
# Why the backward is slow: how many programs an SM needs
# -------------------------------------------------------
# At the GPU benchmark's :math:`B \cdot H = 128`, the backward's 128 programs are nearly one per SM on a GPU with
# 132: the GPU does not idle for lack of programs, but each SM idles inside its one program, whose 4 warps walk the
# key blocks in turn: while they wait for a load or the tensor cores, no other program can use the SM. Below,
# :math:`N` is fixed and :math:`B \cdot H` is 1, 2, 4 and 8 times the SM count. If the rate grows with programs per
# SM, the kernel is latency-bound, and part of the fix is more, smaller, independent programs: FlashAttention-2's
# backward, one program per *key block*. The last line sets what they buy beside the gap to SDPA in the benchmark.

if __name__ == "__main__" and ON_GPU:
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    N, D = 2048, 64
    rates = {}
    for per_sm in (1, 2, 4, 8):
        q, k, v = (torch.randn(1, per_sm * sms, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True)
                   for _ in range(3))
        ms = backward_ms(lambda q, k, v: attention(q, k, v, False, D ** -0.5), q, k, v)
        rates[per_sm] = 2.5 * 4 * per_sm * sms * N * N * D / ms * 1e-9
        print(f"{per_sm} program(s) per SM ({per_sm * sms} in all), N={N}, D={D}: backward at {rates[per_sm]:.0f} "
              "TFLOP/s")
    gain = rates[8] / rates[1]
    enough = min(per_sm for per_sm, rate in rates.items() if rate >= 0.95 * max(rates.values()))
    print(f"Eight programs per SM run the same kernel {gain:.1f}x as fast as one, and {enough} per SM already come "
          "within 5% of the fastest: "
          + ("the backward is latency-bound, and more independent programs per SM hide it."
             if gain > 1.2 else "more programs per SM do not help here; its limit is elsewhere."))
    case = table.loc[(D, False, "bwd", N)]
    gap = case[peers].max() / case[OURS]
    print(f"In the benchmark above (N={N}, D={D}, non-causal) the fastest SDPA backend's backward ran {gap:.1f}x as "
          f"fast as this one. More programs per SM account for {gain:.2f}x of that"
          + (f"; the other {gap / gain:.1f}x lies in the work each program does, which lesson 07's backward changes "
             "too (dQ in a pass of its own, not added through memory at every key block)." if gap > 1.05 * gain
             else ", all of it at this size."))
elif __name__ == "__main__":
    print("Programs per SM are a GPU question: the interpreter runs one program at a time.")

# %%
# Exercises
# ---------
# 1. **Normalized at every step.** ``one_row_attention`` keeps the unnormalized :math:`a`, as FlashAttention-2 does.
#    Write ``running_attention(q, k, v, scale)`` for one query row that keeps only the normalized output :math:`o`,
#    as FlashAttention-1 does (see "From rows to blocks"), updated key by key with the factors
#    :math:`\ell e^{m - m'} / \ell'` and :math:`e^{s_j - m'} / \ell'`, and returns an ``(n, d)`` tensor whose row
#    :math:`j` is :math:`o` after key :math:`j`. Then run ``check_running_attention(running_attention)``: it tries
#    20 random rows, some with a score of 1,000 (past what :math:`e^s` can hold even in float64), allows for
#    float32's rounding, and compares outputs only, so it cannot tell which update produced them.
# 2. **Merge two partial states.** Split one query row's keys in two, anywhere; each gives a state
#    :math:`(m, \ell, a)` as above. Write ``merge(state1, state2)`` returning the state of all keys (their maximum,
#    and sum and unnormalized output relative to it, so it can be merged again and ``a / l`` is the row's output),
#    then ``check_merge(merge)``: the combine step of lesson 03, and of decoding kernels that split the keys.


def check_running_attention(fn):
    """Your running attention against float64 softmax over each prefix of the keys, on 20 random rows."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for trial in range(20):
        n, d = int(torch.randint(1, 60, (), generator=gen)), int(torch.randint(1, 33, (), generator=gen))
        q, k, v = torch.randn(d, generator=gen), torch.randn(n, d, generator=gen) * 3, torch.randn(n, d, generator=gen)
        scale = float(torch.rand((), generator=gen)) + 0.1
        if trial % 4 == 0:  # one key scores 1000: e^1000 overflows even float64 unless the maximum is subtracted
            k[n // 2] = q * (1000 / (scale * float(q @ q)))
        s = k.double() @ q.double() * scale
        want = torch.stack([torch.softmax(s[:j + 1], dim=0) @ v[:j + 1].double() for j in range(n)])
        got = fn(q.clone(), k.clone(), v.clone(), scale)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (n, d):
            shown = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise AssertionError(f"n={n}, d={d}: expected a tensor of shape {(n, d)}, one row per key, got {shown}")
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=n, d=d: f"n={n}, d={d}: {m}")
    print("running attention is right after every key, on 20 random rows.")


def partial_state(q, k, v, scale):
    """(m, l, a) of one query row over the keys k: running maximum, sum and unnormalized output."""
    s = k.double() @ q.double() * scale
    m = s.max()
    p = torch.exp(s - m)
    return m, p.sum(), p @ v.double()


def check_merge(fn):
    """Your merge against the state of all keys, on random splits whose parts' maxima differ a lot."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for trial in range(20):
        n, d = int(torch.randint(2, 60, (), generator=gen)), int(torch.randint(1, 17, (), generator=gen))
        q, k, v = torch.randn(d, generator=gen), torch.randn(n, d, generator=gen) * 5, torch.randn(n, d, generator=gen)
        cut = int(torch.randint(1, n, (), generator=gen))
        k[:cut] += 3 if trial % 2 else -3  # first part's maximum far above, or far below, the second's
        want_m, want_l, want_a = partial_state(q, k, v, 0.5)
        m, l, a = fn(partial_state(q, k[:cut], v[:cut], 0.5), partial_state(q, k[cut:], v[cut:], 0.5))
        for name, got, want in (("m", m, want_m), ("l", l, want_l), ("a", a, want_a)):
            torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), want, rtol=1e-6, atol=1e-9,
                                       msg=lambda msg, n=n, cut=cut, name=name: f"keys split {cut} + {n - cut}, "
                                       f"{name} of the merged state: {msg}")
    print("merge combines partial states exactly, on 20 random splits.")
