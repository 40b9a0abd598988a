"""
Fused attention v1: the FlashAttention-1 algorithm
==================================================

Attention, :math:`O = \\mathrm{softmax}(QK^T \\cdot s)\\,V`, computed without ever writing the
:math:`N \\times N` matrix of scores to memory, as FlashAttention (Dao et al., 2022) first did. This
lesson keeps that first algorithm alive on purpose: it is the step between the online softmax of
the previous lesson and FlashAttention-2 in the next, and it is what Triton's 2022 tutorial taught.

You will learn:

* how the online softmax becomes an online *softmax-weighted sum*, first for one query row, then
  for a block of rows with matrix multiplications;
* the FlashAttention-1 forward: running maximum :math:`m` and sum :math:`\\ell` kept separately,
  the output rescaled at every step, and the statistics saved for the backward;
* the FlashAttention-1 backward: a preprocessing step, one program per (batch, head) walking the
  key blocks, and :math:`dQ` accumulated in fp32 through memory;
* what the 2022 code needed that today's Triton no longer has, and what replaces it.
"""

# %%
# Where the kernels run
# ---------------------
# A CUDA GPU when there is one, otherwise the Triton interpreter on the CPU, switched on before the
# first ``@triton.jit``.

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
# One query row, one key at a time
# --------------------------------
# For one query row :math:`q`, attention is a weighted average of the value rows :math:`v_j`, with
# weights :math:`\mathrm{softmax}_j(s_j)` where :math:`s_j = q \cdot k_j \cdot \mathrm{scale}`. The
# online softmax of the last lesson kept a running maximum :math:`m` and a running sum :math:`\ell`
# rescaled whenever :math:`m` grows. The weighted sum :math:`a = \sum_j e^{s_j - m} v_j` is rescaled
# by the same factor, so one loop over the keys computes everything:
#
# .. math::
#
#    m' = \max(m, s_j), \quad
#    \ell' = \ell\, e^{m - m'} + e^{s_j - m'}, \quad
#    a' = a\, e^{m - m'} + e^{s_j - m'}\, v_j, \qquad o = a / \ell.
#
# In plain Python, to see it work before any kernel:


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
    print("one query row, one key at a time, max error:", (one_row_attention(q1, k1, v1, 1 / 4) - expected).abs().max().item())

# %%
# From rows to blocks
# -------------------
# A GPU wants matrix multiplications, not dot products. Take ``BLOCK_M`` query rows at once and
# ``BLOCK_N`` keys per step: the scores become a ``BLOCK_M x BLOCK_N`` tile
# :math:`S = Q_i K_j^T`, the maximum and sum are taken along the tile's rows, and
# :math:`e^{S - m} V_j` is a second matrix multiplication. Nothing larger than a tile ever exists.
#
# FlashAttention-1 keeps the output *normalized* at every step: after each key block, the
# accumulator holds :math:`o = a / \ell` for the keys seen so far. Its update therefore rescales by
# :math:`\ell e^{m - m'} / \ell'` and scales the new probabilities by :math:`1 / \ell'`, a division
# per element per step that FlashAttention-2 later removed. At the end it saves :math:`\ell` and
# :math:`m` per row for the backward pass.
#
# The kernel handles any sequence length: key columns past :math:`N` get a score of
# :math:`-\infty` (weight 0), query rows past :math:`N` are computed on zeros and never stored.
# With ``CAUSAL``, query :math:`i` sees only keys :math:`j \le i`, so a query block stops at the
# diagonal instead of walking every key.


@triton.jit
def attn_fwd_v1_kernel(
    Q, K, V, O, L, Mx, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
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
    tl.store(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, acc.to(O.dtype.element_ty), mask=row_ok[:, None])


# %%
# The backward pass, as in 2022
# -----------------------------
# With :math:`P = \mathrm{softmax}(S)` and the upstream gradient :math:`dO`, the gradients are
#
# .. math::
#
#    dV = P^T dO, \quad dP = dO\, V^T, \quad
#    dS = P \circ (dP - \Delta), \ \Delta_i = \textstyle\sum_d O_{id}\, dO_{id}, \quad
#    dQ = dS\, K \cdot s, \quad dK = dS^T Q \cdot s.
#
# Nothing of :math:`P` was saved, only :math:`m` and :math:`\ell`, so the backward recomputes each
# tile :math:`e^{S - m}`. The 2022 kernel first runs a *preprocess* that divides :math:`dO` by
# :math:`\ell` (so that :math:`e^{S-m}` needs no division) and computes :math:`\Delta`. Then one
# program per (batch, head) walks the key blocks: for each, it loops over the query blocks,
# accumulates :math:`dK` and :math:`dV` in registers, and adds its share of :math:`dQ` to an fp32
# buffer in memory, read and written again for every key block.
#
# That last part is why FlashAttention-2 changed the backward: one program per (batch, head) leaves
# most of a large GPU idle when :math:`B \cdot H` is smaller than the number of SMs, and
# :math:`dQ` makes a round trip through memory for every key block.


@triton.jit
def attn_bwd_preprocess_v1_kernel(O, DO, L, DO_SCALED, DELTA, H, N,
                                  sob, soh, son, sod, sdb, sdh, sdn, sdd,
                                  D: tl.constexpr, BLOCK_M: tl.constexpr):
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    ok = rows < N
    o = tl.load(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd, mask=ok[:, None], other=0.0).to(tl.float32)
    l = tl.load(L + bh * N + rows, mask=ok, other=1.0)
    do = do / l[:, None]
    tl.store(DO_SCALED + bh * N * D + rows[:, None] * D + d[None, :], do.to(DO_SCALED.dtype.element_ty), mask=ok[:, None])
    tl.store(DELTA + bh * N + rows, tl.sum(o * do, axis=1), mask=ok)


@triton.jit
def attn_bwd_v1_kernel(
    Q, K, V, DO_SCALED, DQ, DK, DV, Mx, DELTA, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    bh = tl.program_id(0)
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
# The 2022 tutorial no longer runs. Its kernels called ``tl.dot(q, k, trans_b=True)``; today one
# writes ``tl.dot(q, tl.trans(k))``. It kept a scratch buffer (``TMP``) to store and reload a
# value, a workaround for a compiler bug long since fixed. Its 2-D blocks of pointers were built by
# hand, as here; later versions of the tutorial moved to ``tl.make_block_ptr``, which current
# Triton has removed, so this port keeps plain pointer arithmetic. Its test used ``triton.testing.assert_almost_equal``, now gone
# (``torch.testing.assert_close`` replaces it), and its benchmark passed ``percentiles=`` to
# ``do_bench``, which now takes ``quantiles=`` or ``return_mode=``. Its backward also required the
# sequence length to be a multiple of the block size; the masks above remove that limit.
#
# One more pitfall, this time in the interpreter: in Triton 3.9 the interpreter stores bf16 values
# as 16-bit integers and multiplies them as integers inside ``tl.dot``, giving nonsense. The
# kernels above take an ``UPCAST_DOT`` flag that converts the operands to fp32 first; the launcher
# sets it only for bf16 under the interpreter, so the GPU path is untouched.
#
# The autograd wrapper
# --------------------
# ``attention(q, k, v, causal, sm_scale)`` takes tensors of shape (batch, heads, sequence, head
# dim) with any strides, checks them, and returns a tensor that PyTorch can differentiate.

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)


def check_inputs(q, k, v, sm_scale):
    """Raise a clear error for anything the kernels cannot handle."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, sequence, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.device.type != DEVICE.type:
            raise ValueError(f"{name} is on device '{t.device}', but Triton runs these kernels on '{DEVICE.type}' here")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k and v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if q.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        raise ValueError(f"q, k and v must not be empty, got shape {tuple(q.shape)}")
    if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
        raise TypeError(f"sm_scale must be a finite number, got {sm_scale!r}")


BLOCK = 64


class _AttentionV1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        B, H, N, D = q.shape
        o = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
        l = torch.empty((B * H, N), dtype=torch.float32, device=q.device)
        m = torch.empty_like(l)
        upcast = (not ON_GPU) and q.dtype == torch.bfloat16
        grid = (triton.cdiv(N, BLOCK), B * H)
        attn_fwd_v1_kernel[grid](q, k, v, o, l, m, sm_scale, H, N, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                                 D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=causal, UPCAST_DOT=upcast, num_warps=4)
        ctx.save_for_backward(q, k, v, o, l, m)
        ctx.causal, ctx.sm_scale, ctx.upcast = causal, sm_scale, upcast
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, l, m = ctx.saved_tensors
        B, H, N, D = q.shape
        do_scaled = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
        delta = torch.empty_like(l)
        attn_bwd_preprocess_v1_kernel[(triton.cdiv(N, BLOCK), B * H)](
            o, do, l, do_scaled, delta, H, N, *o.stride(), *do.stride(), D=D, BLOCK_M=BLOCK)
        dq = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
        dk = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
        dv = torch.empty_like(dk)
        attn_bwd_v1_kernel[(B * H,)](q, k, v, do_scaled, dq, dk, dv, m, delta, ctx.sm_scale, H, N,
                                     *q.stride(), *k.stride(), *v.stride(),
                                     D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=ctx.causal, UPCAST_DOT=ctx.upcast,
                                     num_warps=4 if D <= 64 else 8)
        return dq.to(q.dtype), dk, dv, None, None


def attention(q, k, v, causal, sm_scale):
    """FlashAttention-1: softmax(q k^T * sm_scale) v over (batch, heads, sequence, head_dim) tensors."""
    check_inputs(q, k, v, sm_scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    return _AttentionV1.apply(q, k, v, causal, float(sm_scale))


# %%
# Correctness
# -----------
# Forward and backward against float64 PyTorch on a sequence length that is not a multiple of the
# block size, causal and not.


def reference_attention(q, k, v, causal, sm_scale):
    """The definition, in whatever precision the inputs have (float64 for a reference)."""
    s = (q @ k.transpose(-1, -2)) * sm_scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v


if __name__ == "__main__":
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 77, 32
    for causal in (False, True):
        q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16)
        out = attention(q, k, v, causal, D ** -0.5)
        out.backward(do)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = reference_attention(q64, k64, v64, causal, D ** -0.5)
        ref.backward(do.double())
        errors = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
                  for name, a, b in [("o", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)]}
        print(f"causal={causal}: relative max error " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        assert max(errors.values()) < 1e-2, errors

# %%
# Benchmark
# ---------
# TFLOP/s for the forward and the backward, :math:`B = 4`, :math:`H = 32`, :math:`D = 64`, against
# each backend of PyTorch's ``scaled_dot_product_attention`` that runs here. The forward does
# :math:`4BHN^2D` floating-point operations (two matrix products of :math:`2BHN^2D` each), half that
# when causal; the backward does 2.5 times the forward (five matrix products instead of two).
# The ceiling is the device's fp16 matrix-multiply rate, measured in this run.

import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

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


# The math backend materializes the N x N scores (68 GB at N = 16384 here): a peer only on the CPU.
SDPA_BACKENDS = {"SDPA cuDNN": SDPBackend.CUDNN_ATTENTION, "SDPA flash": SDPBackend.FLASH_ATTENTION,
                 "SDPA mem-efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_fwd_bwd(fn, q, k, v):
    """(forward ms, backward ms) of o = fn(q, k, v)."""
    fwd = bench_ms(lambda: fn(q, k, v))
    o = fn(q, k, v)
    do = torch.randn_like(o)
    bwd = bench_ms(lambda: o.backward(do, retain_graph=True))
    return fwd, bwd


def run_benchmark(B, H, D, sizes, causal_modes, providers):
    rows = []
    for causal in causal_modes:
        for N in sizes:
            q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(3))
            flops = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
            for name, fn in providers(causal, D).items():
                try:
                    fwd, bwd = time_fwd_bwd(fn, q, k, v)
                except RuntimeError as error:  # a backend that does not support this case here
                    print(f"{name} skipped at N={N}, causal={causal}: {str(error).splitlines()[0][:100]}")
                    continue
                for mode, ms, f in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
                    rows.append(dict(causal=causal, N=N, mode=mode, provider=name, value=f / ms * 1e-9))
    return rows


def v1_providers(causal, D):
    providers = {"Triton v1 (this tutorial)": lambda q, k, v: attention(q, k, v, causal, D ** -0.5)}
    backends = SDPA_BACKENDS if ON_GPU else {"SDPA math": SDPBackend.MATH}
    for name, backend in backends.items():
        def sdpa(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=D ** -0.5)
        providers[name] = sdpa
    return providers


if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    print(describe_platform())
    if ON_GPU:
        B, H, D, sizes = 4, 32, 64, [1024, 2048, 4096, 8192, 16384]
    else:
        B, H, D, sizes = 1, 2, 64, [64, 128]
    peak = matmul_tflops()
    print(f"matrix-multiply rate, measured now: {peak:.0f} TFLOP/s")
    results = pd.DataFrame(run_benchmark(B, H, D, sizes, (False, True), v1_providers))
    table = results.pivot_table(index=["causal", "mode", "N"], columns="provider", values="value", sort=False)
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2), squeeze=False)
    for ax, ((causal, mode), part) in zip(axes[0], table.groupby(level=["causal", "mode"], sort=False)):
        part.droplevel(["causal", "mode"]).plot(ax=ax, marker="o", logx=True)
        ax.axhline(peak, color="black", linestyle="--", label="matmul rate")
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
# Computed from the table above, in this run:

if __name__ == "__main__":
    ours = "Triton v1 (this tutorial)"
    peers = [c for c in table.columns if c != ours and c != "SDPA math"] or ["SDPA math"]
    for (causal, mode), part in table.groupby(level=["causal", "mode"], sort=False):
        ratio = part[ours] / part[peers].max(axis=1)
        print(f"{mode} {'causal' if causal else 'non-causal'}: v1 reaches {part[ours].max() / peak:.0%} of the "
              f"matmul rate at best and {ratio.min():.2f}x to {ratio.max():.2f}x the fastest SDPA backend.")
    if not ON_GPU:
        print("These are interpreter timings: they measure NumPy on the CPU, not GPU kernels.")
    save_results("04-fused-attention-v1", [{
        "name": f"attention v1, B={B}, H={H}, D={D}", "unit": "TFLOP/s", "ceiling_name": "fp16 matmul rate",
        "ceiling": peak, "ours": [ours], "peers": peers, "rows": results.to_dict("records")}])

# %%
# On the H100 this site is built on, v1's forward keeps pace with the older SDPA backends but
# trails cuDNN, and its backward trails every backend but the memory-efficient one by a wide
# margin (the lines above give this build's ratios). The reasons are the ones given earlier:
# :math:`B \cdot H = 128` programs for the whole backward, each walking every key block in turn
# with :math:`dQ` going through memory, and a division per element per step in the forward. The
# next lesson fixes each of these.
