"""Lesson 05's exercises, and lesson 06's key-padding one, solved in Triton as a reader would, from the
lessons' own kernels, with known-wrong variants switched on by flags: each check accepts the solutions and
rejects the mistakes. test_attention.py tests the other checks of lessons 06 and 07, and lesson 06's
key-padding check against a PyTorch answer. At the end, lesson 05's readings of its numbers, on made-up
tables."""

import functools
import math

import pytest
import torch
from lessons import load

# Loaded before Triton is imported: the lessons' stepkit switches the interpreter on where there is no GPU.
V1, V2 = load("05-fused-attention-v1"), load("06-fused-attention-v2-forward")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE, ON_GPU = V1.DEVICE, V1.kit.ON_GPU
BLOCK = V1.BLOCK


# -- Lesson 05, exercises 1 and 2: the forward kernel, normalized once, with an optional key-padding mask ------


@triton.jit
def _forward_kernel(
    Q, K, V, O, LENGTHS, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PADDED: tl.constexpr, OFF_BY_ONE: tl.constexpr, STOP_AT_LENGTH: tl.constexpr,
    PER_STEP: tl.constexpr, RESCALE: tl.constexpr, DIVIDE: tl.constexpr,
):
    """PER_STEP: the lesson's normalized accumulator; else the unnormalized one, rescaled (RESCALE) and divided
    once at the end (DIVIDE). PADDED: keys at or past LENGTHS[b] (OFF_BY_ONE: past it) score -inf, and with
    STOP_AT_LENGTH the loop ends at the length."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=rows[:, None] < N, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_head = K + b * skb + h * skh + d[None, :] * skd
    v_head = V + b * svb + h * svh + d[None, :] * svd
    n_keys = N
    if PADDED:
        n_keys = tl.load(LENGTHS + b).to(tl.int32) + OFF_BY_ONE
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum((start_m + 1) * BLOCK_M, N) if CAUSAL else N
    if STOP_AT_LENGTH:
        end = tl.minimum(end, n_keys)
    for start_n in range(0, end, BLOCK_N):
        keys = start_n + cols
        key_ok = keys[:, None] < N
        k = tl.load(k_head + keys[:, None] * skn, mask=key_ok, other=0.0)
        v = tl.load(v_head + keys[:, None] * svn, mask=key_ok, other=0.0)
        if UPCAST_DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        valid = (keys[None, :] < N) & (keys[None, :] < n_keys)
        if CAUSAL:
            valid = valid & (keys[None, :] <= rows[:, None])
        s = tl.where(valid, s, -float("inf"))
        m_ij = tl.max(s, axis=1)
        if PER_STEP:
            p = tl.exp(s - m_ij[:, None])
            m_new = tl.maximum(m_i, m_ij)
            alpha, beta = tl.exp(m_i - m_new), tl.exp(m_ij - m_new)
            l_new = alpha * l_i + beta * tl.sum(p, axis=1)
            acc = acc * (l_i * alpha / l_new)[:, None]
            p = p * (beta / l_new)[:, None]
        else:
            m_new = tl.maximum(m_i, m_ij)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_new = alpha * l_i + tl.sum(p, axis=1)
            if RESCALE:
                acc = acc * alpha[:, None]
        acc += tl.dot(p.to(v.dtype), v)
        l_i, m_i = l_new, m_new
    if DIVIDE:
        acc = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, acc.to(O.dtype.element_ty),
             mask=rows[:, None] < N)


def forward(q, k, v, causal, sm_scale, key_lengths=None, *, off_by_one=False, stop_at_length=True,
            per_step=False, rescale=True, divide=None, q_contiguous=False):
    """Exercise 1's attention_once (key_lengths None) or exercise 2's padded_attention, right by default
    (divided at the end unless per_step); the flags switch on the mistakes (q_contiguous: q's strides taken
    to be a contiguous tensor's)."""
    B, H, N, D = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    q_strides = (H * N * D, N * D, D, 1) if q_contiguous else q.stride()
    upcast = not ON_GPU and q.dtype == torch.bfloat16
    _forward_kernel[(triton.cdiv(N, BLOCK), B * H)](
        q, k, v, o, key_lengths if key_lengths is not None else q, sm_scale, H, N,
        *q_strides, *k.stride(), *v.stride(), *o.stride(),
        D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=causal, UPCAST_DOT=upcast, PADDED=key_lengths is not None,
        OFF_BY_ONE=int(off_by_one), STOP_AT_LENGTH=stop_at_length and key_lengths is not None,
        PER_STEP=per_step, RESCALE=rescale,
        DIVIDE=not per_step if divide is None else divide)
    return o


def padded(**mistakes):
    """padded_attention(q, k, v, causal, sm_scale, key_lengths), with the mistakes given."""
    return lambda q, k, v, causal, sm_scale, key_lengths: forward(q, k, v, causal, sm_scale, key_lengths,
                                                                  **mistakes)


def nan_like(q, *args):
    return torch.full_like(q, math.nan)


NORMALIZE_ONCE_WRONG = {
    "no division by l at the end": functools.partial(forward, divide=False),
    "no rescaling by e^(m - m')": functools.partial(forward, rescale=False),
    "normalized at every step and divided again": functools.partial(forward, per_step=True, divide=True),
    "q's strides taken to be contiguous": functools.partial(forward, q_contiguous=True),
    "float32 output": lambda q, *args: forward(q, *args).float(),
    "NaN output": nan_like,
}

PADDED_WRONG = {
    "the lengths ignored": lambda q, k, v, causal, sm_scale, key_lengths: V1.attention(q, k, v, causal, sm_scale),
    "off by one: key_lengths[b] seen too": padded(off_by_one=True),
    "normalized at every step, loop not stopped at the length (NaN)": padded(per_step=True, stop_at_length=False),
    "float32 output": lambda *args: padded()(*args).float(),
    "output as (B, N, H, D)": lambda *args: padded()(*args).transpose(1, 2).contiguous(),
    "NaN output": nan_like,
}


def test_normalize_once_accepts_the_solution(capsys):
    V1.check_normalize_once(forward)
    out = capsys.readouterr().out
    assert "attention_once is right" in out
    assert ("yours takes" in out) if ON_GPU else ("measured only on a GPU" in out)


def test_normalize_once_sees_only_outputs_so_the_lesson_passes_too(capsys):
    """The page says so: the output of the per-step normalization is the same attention."""
    V1.check_normalize_once(V1.attention)
    assert "attention_once is right" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", NORMALIZE_ONCE_WRONG)
def test_normalize_once_rejects(wrong, capsys):
    with pytest.raises(AssertionError, match=r"attention_once on B, H, N, D = .*causal=(True|False): the output"):
        V1.check_normalize_once(NORMALIZE_ONCE_WRONG[wrong])
    assert "is right" not in capsys.readouterr().out


@pytest.mark.parametrize("solution", [
    padded(), padded(stop_at_length=False), padded(per_step=True)],
    ids=["normalized once, loop stopped at the length", "normalized once, every key block",
         "normalized at every step, loop stopped at the length"])
def test_padded_attention_accepts_solutions(solution, capsys):
    V1.check_padded_attention(solution)
    out = capsys.readouterr().out
    assert "padded_attention is right" in out
    assert ("yours takes" in out) if ON_GPU else ("measured only on a GPU" in out)


@pytest.mark.parametrize("wrong", PADDED_WRONG)
def test_padded_attention_rejects(wrong, capsys):
    with pytest.raises(AssertionError, match=r"padded_attention on B, H, N, D = .*key lengths \d+(, \d+)*: "):
        V1.check_padded_attention(PADDED_WRONG[wrong])
    assert "is right" not in capsys.readouterr().out


def test_padded_attention_failure_names_the_first_wrong_element():
    with pytest.raises(AssertionError) as error:
        V1.check_padded_attention(padded(off_by_one=True))
    message = str(error.value)
    assert "element (" in message and "float64 reference" in message and "off by" in message


# -- Lesson 06, exercise 2: the same mask in the v2 kernel, whose unmasked loop must end below the length ------


@triton.jit
def _v2_padded_kernel(
    Q, K, V, O, LENGTHS, qk_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WHOLE_BLOCKS_TO_N: tl.constexpr,
):
    """Lesson 06's attn_fwd_kernel with the length n_keys in N's place for the keys (WHOLE_BLOCKS_TO_N: the
    mistake of leaving the unmasked loop's end where N, not the length, puts it)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    n_keys = tl.load(LENGTHS + b).to(tl.int32)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=rows[:, None] < N, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    kt_ptrs = K + b * skb + h * skh + d[:, None] * skd
    v_ptrs = V + b * svb + h * svh + d[None, :] * svd
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full = ((N if WHOLE_BLOCKS_TO_N else n_keys) // BLOCK_N) * BLOCK_N  # keys below: all real
    if CAUSAL:
        diag = start_m * BLOCK_M
        unmasked_end = tl.minimum(diag, full)
        masked_end = tl.minimum(diag + BLOCK_M, n_keys)
    else:
        unmasked_end, masked_end = full, n_keys
    acc, l_i, m_i = V2._attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, 0, unmasked_end, rows, n_keys,
                                       qk_scale, BLOCK_N, False, CAUSAL, NEGATIVE_SCALE)
    acc, l_i, m_i = V2._attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, unmasked_end, masked_end, rows,
                                       n_keys, qk_scale, BLOCK_N, True, CAUSAL, NEGATIVE_SCALE)
    o = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, o.to(O.dtype.element_ty),
             mask=rows[:, None] < N)


def v2_padded(q, k, v, causal, sm_scale, key_lengths, whole_blocks_to_n=False):
    B, H, N, D = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_m, block_n, warps, _ = V2.INTERPRETER_CONFIGS["fwd"]
    _v2_padded_kernel[(triton.cdiv(N, block_m), B * H)](
        q, k, v, o, key_lengths, sm_scale * V2.LOG2E, H, N, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        D=D, CAUSAL=causal, UPCAST_DOT=V2._upcast(q), NEGATIVE_SCALE=sm_scale < 0, BLOCK_M=block_m,
        BLOCK_N=block_n, WHOLE_BLOCKS_TO_N=whole_blocks_to_n, num_warps=warps)
    return o


V2_PADDED_WRONG = {
    "unmasked loop up to N's last whole block": functools.partial(v2_padded, whole_blocks_to_n=True),
    "the lengths ignored": lambda q, k, v, causal, sm_scale, key_lengths: V2.attention(q, k, v, causal, sm_scale),
    "NaN output": nan_like,
}


def test_lesson_06_padded_attention_accepts_a_v2_solution(capsys):
    V2.check_padded_attention(v2_padded)
    assert "padded_attention is right" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", V2_PADDED_WRONG)
def test_lesson_06_padded_attention_rejects(wrong, capsys):
    with pytest.raises(AssertionError, match=r"padded_attention on B, H, N, D = .*key lengths"):
        V2.check_padded_attention(V2_PADDED_WRONG[wrong])
    assert "is right" not in capsys.readouterr().out


# -- Lesson 05, exercise 3: the backward with one program per key block, dQ added atomically -----------------


@triton.jit
def _backward_atomic_kernel(
    Q, K, V, DO_SCALED, DQ, DK, DV, Mx, DELTA, sm_scale, H, N,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    UPCAST_DOT: tl.constexpr, ATOMIC: tl.constexpr, DQ_SCALED: tl.constexpr, SWAP_DK_DV: tl.constexpr,
):
    """The body of lesson 05's outer loop as a program of its own (ATOMIC: dQ by tl.atomic_add, else the
    lesson's read-add-write; DQ_SCALED: sm_scale kept in dQ; SWAP_DK_DV: each stored in the other's place)."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    d = tl.arange(0, D)
    start_n = tl.program_id(0) * BLOCK_N
    keys = start_n + tl.arange(0, BLOCK_N)
    key_ok = keys < N
    k = tl.load(K + b * skb + h * skh + keys[:, None] * skn + d[None, :] * skd, mask=key_ok[:, None], other=0.0)
    v = tl.load(V + b * svb + h * svh + keys[:, None] * svn + d[None, :] * svd, mask=key_ok[:, None], other=0.0)
    if UPCAST_DOT:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
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
        p = tl.where(valid, tl.exp(s - m[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dk += tl.dot(tl.trans((ds * sm_scale).to(q.dtype)), q)
        dq_part = tl.dot(((ds * sm_scale) if DQ_SCALED else ds).to(k.dtype), k)
        dq_ptrs = DQ + bh * N * D + rows[:, None] * D + d[None, :]
        if ATOMIC:
            tl.atomic_add(dq_ptrs, dq_part, mask=row_ok[:, None], sem="relaxed")
        else:
            tl.store(dq_ptrs, tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0) + dq_part, mask=row_ok[:, None])
    out = bh * N * D + keys[:, None] * D + d[None, :]
    tl.store((DV if SWAP_DK_DV else DK) + out, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store((DK if SWAP_DK_DV else DV) + out, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


def atomic_dq_attention(atomic=True, dq_scaled=True, swap_dk_dv=False):
    """attention_atomic_dq as the page's hint builds it: lesson 05's Function with another backward."""

    class AtomicDQ(V1._AttentionV1):
        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, do):
            q, k, v, o, l, m = ctx.saved_tensors
            do = V1.kit.resolved_gradient(do)
            B, H, N, D = q.shape
            do_scaled, dk, dv = (torch.empty((B, H, N, D), dtype=q.dtype, device=q.device) for _ in range(3))
            delta = torch.empty_like(l)
            V1.attn_bwd_preprocess_v1_kernel[(triton.cdiv(N, BLOCK), B * H)](
                o, do, l, do_scaled, delta, H, N, *o.stride(), *do.stride(), D=D, BLOCK_M=BLOCK)
            dq = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
            _backward_atomic_kernel[(triton.cdiv(N, BLOCK), B * H)](
                q, k, v, do_scaled, dq, dk, dv, m, delta, ctx.sm_scale, H, N, *q.stride(), *k.stride(), *v.stride(),
                D=D, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=ctx.causal, UPCAST_DOT=ctx.upcast, ATOMIC=atomic,
                DQ_SCALED=dq_scaled, SWAP_DK_DV=swap_dk_dv)
            return dq.to(q.dtype), dk, dv, None, None

    return lambda q, k, v, causal, sm_scale: AtomicDQ.apply(q, k, v, causal, sm_scale)


class NanGradient(torch.autograd.Function):
    """The identity, whose gradient is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.nan)


ATOMIC_DQ_WRONG = {
    "dQ without sm_scale": atomic_dq_attention(dq_scaled=False),
    "dK and dV swapped": atomic_dq_attention(swap_dk_dv=True),
    "the output detached from autograd": lambda *args: V1.attention(*args).detach(),
    "NaN in dQ": lambda q, *args: V1.attention(NanGradient.apply(q), *args),
}


def test_atomic_dq_accepts_the_solution(capsys):
    V1.check_atomic_dq(atomic_dq_attention())
    out = capsys.readouterr().out
    assert "attention_atomic_dq's gradients are right" in out
    assert ("yours takes" in out) if ON_GPU else ("measured only on a GPU" in out)


@pytest.mark.skipif(ON_GPU, reason="on a GPU, programs adding into dQ without atomics race")
def test_atomic_dq_passes_a_plain_read_add_write_under_the_interpreter(capsys):
    """What the page warns of: the interpreter runs one program at a time, so there is no race to see."""
    V1.check_atomic_dq(atomic_dq_attention(atomic=False))
    assert "right" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", ATOMIC_DQ_WRONG)
def test_atomic_dq_rejects(wrong, capsys):
    with pytest.raises(AssertionError, match=r"attention_atomic_dq on B, H, N, D = .*causal=(True|False): "
                                             r"(dq|dk|dv|the output)"):
        V1.check_atomic_dq(ATOMIC_DQ_WRONG[wrong])
    assert "are right" not in capsys.readouterr().out


# -- Lesson 05's readings of its numbers, on made-up tables (the benchmark's run only on a GPU) ---------------


def _rates(values, providers, causal=(False, True), modes=("fwd",), sizes=(1024, 2048)):
    """A table of rates as lesson 05's benchmark gives it: index (D, causal, mode, N), a column per
    provider; values in that order, a row each."""
    import pandas as pd

    index = pd.MultiIndex.from_product([[64], causal, modes, sizes], names=V1.INDEX)
    return pd.DataFrame(values, index=index, columns=providers)


def test_v1_against_flash_is_read_per_masking():
    """The H100 build: non-causal within 15% at every N, causal 0.80x to 0.86x from 2048 on. The line says
    so per masking, not one range over both."""
    near = _rates([1.03, 1.02, 1.06, 0.97, 0.98, 0.97, 0.86, 0.84, 0.80, 0.83], ["v1"],
                  sizes=(1024, 2048, 4096, 8192, 16384))["v1"]
    line = V1.against_flash(near)
    assert "non-causal 0.97x to 1.06x, within 15% at every N" in line
    assert "causal 0.80x to 0.97x, more than 15% apart at N = 4096, 8192, 16384" in line
    # Faster than flash by more than 15% is apart too, not "close".
    ahead = V1.against_flash(_rates([1.2, 1.0, 1.0, 1.0], ["v1"])["v1"])
    assert "non-causal 1.00x to 1.20x, more than 15% apart at N = 1024" in ahead
    assert "causal 1.00x to 1.00x, within 15% at every N" in ahead


def test_back_to_back_is_one_measure_the_calls_time_over_their_gpu_time():
    """The H100 build's lines disagreed: the peer line named v1 1.1x slower back to back at N = 4096 (GPU
    317, back to back 287 TFLOP/s) while the overview, by rate, named only cuDNN at 8192. One measure, a
    call's back-to-back time over its GPU time, names both, and nothing within 10%."""
    providers = ["Triton v1", "SDPA cuDNN"]
    gpu = _rates([[317, 440], [300, 469]], providers, causal=(False,), sizes=(4096, 8192))
    b2b = _rates([[287, 432], [298, 412]], providers, causal=(False,), sizes=(4096, 8192))
    line = V1.kit.b2b_overview(gpu, b2b, V1.call_name)
    assert "a call takes 1.01x to 1.14x its GPU time" in line
    assert "2 of 4 take more than 10% longer: Triton v1 fwd at N = 4096 (10.5% longer), SDPA cuDNN fwd at " \
           "N = 8192 (13.8% longer)." in line
    causal = V1.kit.b2b_overview(_rates([[100], [100]], ["v1"], modes=("bwd",), sizes=(1024,)),
                                 _rates([[100], [80]], ["v1"], modes=("bwd",), sizes=(1024,)), V1.call_name)
    assert "1 of 2 take more than 10% longer: v1 bwd causal at N = 1024 (25.0% longer)." in causal
    same = V1.kit.b2b_overview(gpu, gpu * 1.05, V1.call_name)  # faster back to back: L2 kept warm, never "slower"
    assert "0.95x to 0.95x" in same and "none takes more than 10% longer." in same


def test_the_price_of_dividing_do_is_read_for_both_backwards():
    """The section's comparison: v1's dV far off with a small dO (the H100 build: 7.1e-4, then 2.4e-1),
    lesson 07's not; each against the 1e-2 of the site's tests, NaN counted as past it."""
    errors = {("v1", 1.0): 7.1e-4, ("v1", 1e-4): 2.4e-1, ("lesson 07", 1.0): 6.3e-4, ("lesson 07", 1e-4): 3.6e-3}
    line = V1.price_of_dividing(errors)
    assert "dV's error is 338x as large for v1 (2.4e-01: past the tests' 0.01) and 5.71x as large for " \
           "lesson 07 (3.6e-03: within the tests' 0.01)." in line
    errors["lesson 07", 1e-4] = float("nan")
    assert "(nan: past the tests' 0.01)" in V1.price_of_dividing(errors)
