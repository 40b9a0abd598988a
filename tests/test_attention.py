"""The attention lessons (05 to 07, 11 to 13), forward and backward, against float64 autograd on fresh random inputs,
and the checks of their exercises."""

import math
import re
from functools import partial

import numpy as np
import pytest
import stepkit
import torch
from lessons import ROOT, load
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

V1, V2 = load("05-fused-attention-v1"), load("06-fused-attention-v2-forward")
V2_BWD = load("07-fused-attention-v2-backward")
HOPPER_FWD, HOPPER = load("11-hopper-forward-gluon"), load("14-hopper-backward-gluon")
PROFILE = load("13-hopper-forward-profiled")


def gluon_where_it_runs(attention):
    """attention, insisting on the Gluon kernels wherever they can take the inputs."""
    def run(q, k, v, causal, sm_scale, **options):
        try:
            runs = HOPPER_FWD.warp_specialized_unsupported(q, k, v, float(sm_scale)) is None
        except (AttributeError, TypeError, ValueError, OverflowError):  # bad input: attention says why
            runs = False
        return attention(q, k, v, causal, sm_scale, warp_specialized=True if runs else None, **options)
    return run

# v2's backward strategies: dQ in its own pass, or added atomically by the dK, dV programs.
VERSIONS = {"v1": V1.attention, "v2": V2_BWD.attention, "v2-atomic-dq": partial(V2_BWD.attention, atomic_dq=True)}
DEVICE = V2.DEVICE  # the lessons run where Triton does: the GPU if there is one
ON_HOPPER = stepkit.ON_GPU and torch.cuda.get_device_capability()[0] == 9
if ON_HOPPER:
    # Lessons 11 and 14 run their Gluon kernels here: the Gluon forward with the two-pass backward,
    # the Gluon forward and backward, and the Gluon forward with the two-pass backward asked for.
    VERSIONS["hopper-forward"] = HOPPER_FWD.attention
    VERSIONS["hopper"] = HOPPER.attention
    VERSIONS["hopper-two-pass-backward"] = partial(HOPPER.attention, atomic_dq=False)
    # The tables pick lesson 06's kernels for sequences as short as the tests': these insist on Gluon.
    VERSIONS["hopper-forward-gluon"] = gluon_where_it_runs(HOPPER_FWD.attention)
    VERSIONS["hopper-gluon"] = gluon_where_it_runs(HOPPER.attention)
# Max error over the largest reference value (at least 1: with one key, dQ and dK are exactly 0).
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


def reference(q, k, v, causal, sm_scale):
    """PyTorch's own attention in float64 (its math backend): independent of the lessons' code."""
    with sdpa_kernel(SDPBackend.MATH):
        return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def check(attention, q, k, v, causal, rng, sm_scale=None, passed_as=lambda do: do):
    """Output and gradients against float64; passed_as(dO) is the tensor handed to backward, of dO's values."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    q, k, v = (t.detach().to(DEVICE).requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal, sm_scale)
    do = torch.randn(out.shape, generator=rng).to(DEVICE, out.dtype)  # random dO: dO = 1 or dO = O hide bugs
    out.backward(passed_as(do))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, causal, float(sm_scale))
    ref.backward(do.double())
    assert out.shape == q.shape and out.dtype == q.dtype
    for name, got, want in [("o", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                            ("dv", v.grad, v64.grad)]:
        assert_matches(got, want, q.dtype, name)


def assert_matches(got, want, dtype, name):
    """Max error over the largest reference value (at least 1), within dtype's tolerance; NaN fails."""
    assert torch.isfinite(got).all(), f"{name}: not finite"
    error = ((got.double() - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
    assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


def randn(shape, dtype, rng):
    """Fresh inputs on the lessons' device, so that views taken of them keep their strides there."""
    return torch.randn(shape, generator=rng).to(DEVICE, dtype)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N", [1, 77, 300])
@pytest.mark.parametrize("D", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_forward_and_backward(version, causal, N, D, dtype, rng):
    B, H = (1, 2) if N < 300 else (1, 1)
    q, k, v = (randn((B, H, N, D), dtype, rng) for _ in range(3))
    check(VERSIONS[version], q, k, v, causal, rng)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N", [63, 65, 129])
def test_lengths_around_block_boundaries(version, causal, N, rng):
    q, k, v = (randn((2, 1, N, 32), torch.float16, rng) for _ in range(3))
    check(VERSIONS[version], q, k, v, causal, rng)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs(version, causal, rng):
    B, H, N, D = 2, 3, 70, 32
    q = randn((B, N, H, D), torch.float16, rng).transpose(1, 2)  # (B, N, H, D) viewed as (B, H, N, D)
    k = randn((B, H, D, N), torch.float16, rng).transpose(2, 3)  # column-major rows
    v = randn((B, H, N, 2 * D), torch.float16, rng)[..., ::2]  # every other column
    check(VERSIONS[version], q, k, v, causal, rng)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_heads_sharing_keys_and_values(version, causal, rng):
    # Grouped-query attention written with expand: k and v have stride 0 along the heads.
    B, H, N, D = 2, 4, 70, 64
    q = randn((B, H, N, D), torch.float16, rng)
    k, v = (randn((B, 1, N, D), torch.float16, rng).expand(B, H, N, D) for _ in range(2))
    check(VERSIONS[version], q, k, v, causal, rng)


def test_v2_non_causal_gradient_differs_from_causal(rng):
    """The published v2 tutorial returned the causal gradient for causal=False; the two must differ."""
    q, k, v = (randn((1, 1, 64, 32), torch.float16, rng).to(DEVICE).requires_grad_() for _ in range(3))
    grads = []
    for causal in (False, True):
        out = V2_BWD.attention(q, k, v, causal, 32 ** -0.5)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    assert not torch.allclose(grads[0][1].float(), grads[1][1].float(), atol=1e-2)


@pytest.mark.parametrize("attention", [V2_BWD.attention, partial(HOPPER.attention, atomic_dq=False)],
                         ids=["v2", "hopper"])
def test_two_pass_backward_gives_the_same_bits_every_run(attention, rng):
    """atomic_dq=False promises a reproducible dQ: nothing in it depends on the order of additions."""
    q, k, v = (randn((1, 2, 200, 64), torch.float16, rng).requires_grad_() for _ in range(3))
    do = randn((1, 2, 200, 64), torch.float16, rng)
    runs = [torch.autograd.grad(attention(q, k, v, True, 0.125), (q, k, v), do) for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def good():
    return [torch.randn(1, 2, 8, 32, dtype=torch.float16, device=DEVICE) for _ in range(3)]


def swap(i, tensor):
    qkv = good()
    qkv[i] = tensor
    return qkv


BAD_INPUTS = [
    (lambda: swap(1, torch.randn(1, 2, 9, 32, dtype=torch.float16, device=DEVICE)), ValueError, "same shape"),
    (lambda: swap(2, torch.randn(1, 2, 8, 32, dtype=torch.bfloat16, device=DEVICE)), TypeError, "same dtype"),
    (lambda: [torch.randn(1, 2, 8, 32, device=DEVICE) for _ in range(3)], TypeError, "float16 or bfloat16"),
    (lambda: [torch.randn(1, 2, 8, 48, dtype=torch.float16, device=DEVICE) for _ in range(3)], ValueError, "head dim"),
    (lambda: [torch.randn(2, 8, 32, dtype=torch.float16, device=DEVICE) for _ in range(3)], ValueError, "4 dimensions"),
    (lambda: swap(0, "not a tensor"), TypeError, "torch.Tensor"),
    (lambda: swap(1, torch.randn(1, 2, 8, 32, dtype=torch.float16, device="meta")), ValueError, "device"),
    (lambda: [torch.randn(1, 2, 0, 32, dtype=torch.float16, device=DEVICE) for _ in range(3)], ValueError, "empty"),
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("make, error, message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_is_refused_clearly(version, make, error, message):
    with pytest.raises(error, match=message):
        VERSIONS[version](*make(), True, 0.125)


@pytest.mark.parametrize("version", VERSIONS)
def test_bad_flags_are_refused(version):
    with pytest.raises(TypeError, match="causal"):
        VERSIONS[version](*good(), "yes", 0.125)
    with pytest.raises(TypeError, match="sm_scale"):
        VERSIONS[version](*good(), True, float("nan"))


@pytest.mark.parametrize("attention", [V2_BWD.attention, HOPPER.attention], ids=["v2", "hopper"])
def test_bad_atomic_flag_is_refused(attention):
    with pytest.raises(TypeError, match="atomic_dq"):
        attention(*good(), True, 0.125, atomic_dq="yes")


@pytest.mark.parametrize("attention", [HOPPER_FWD.attention, HOPPER.attention], ids=["hopper-forward", "hopper"])
def test_bad_warp_specialized_flag_is_refused(attention):
    with pytest.raises(TypeError, match="warp_specialized"):
        attention(*good(), True, 0.125, warp_specialized=1)


@pytest.mark.parametrize("attention", [HOPPER_FWD.attention, HOPPER.attention], ids=["hopper-forward", "hopper"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_lessons_fall_back_to_the_portable_kernels(attention, causal, rng):
    """Off Hopper (and for what TMA cannot load), lessons 11 and 14 must still compute attention."""
    q, k, v = (randn((1, 2, 70, 32), torch.float16, rng) for _ in range(3))  # head dim 32: never Gluon
    check(attention, q, k, v, causal, rng)


# The warp-specialized forward (Gluon, Hopper only). On other machines attention() must refuse to
# be forced onto it, and say why; on Hopper it must match float64 wherever it claims to apply.
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="the warp-specialized forward needs a Hopper GPU")
WARP_SPECIALIZED = partial(HOPPER.attention, warp_specialized=True)


def test_warp_specialized_refused_off_hopper():
    if ON_HOPPER:
        pytest.skip("this GPU is a Hopper")
    with pytest.raises(ValueError, match="Hopper GPU"):
        WARP_SPECIALIZED(*good(), False, 0.125)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N", [1, 77, 129, 300, 1000])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_warp_specialized_forward_and_backward(causal, N, D, dtype, rng):
    q, k, v = (randn((2, 3, N, D), dtype, rng) for _ in range(3))
    check(WARP_SPECIALIZED, q, k, v, causal, rng)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_warp_specialized_strided_inputs(causal, rng):
    B, H, N, D = 2, 3, 200, 64
    q = randn((B, N, H, D), torch.float16, rng).transpose(1, 2)  # (B, N, H, D) viewed as (B, H, N, D)
    k = randn((B, H, N + 8, D), torch.float16, rng)[:, :, 8:]  # starts 1 KiB in: still 16-byte aligned
    v = randn((H, B, N, D), torch.float16, rng).transpose(0, 1)
    check(WARP_SPECIALIZED, q, k, v, causal, rng)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N, D", [(1, 64), (300, 128), (1000, 64), (1100, 128)])
def test_persistent_forward_walks_every_tile_with_any_number_of_programs(causal, N, D, rng):
    """Few programs walk many tiles each (the ring and the barriers' phases run on across tiles); odd tile
    counts give the causal schedule a middle tile that pairs with itself. All give the same bits."""
    q, k, v = (randn((2, 3, N, D), torch.bfloat16, rng) for _ in range(3))
    runs = []
    for programs in (None, 1, 2, 5):
        o, lse = torch.empty_like(q), torch.empty((2, 3, N), device=DEVICE)
        HOPPER_FWD._ws_forward(q, k, v, o, lse, causal, 0.125, programs)
        runs.append((o, lse))
    want = reference(q.double(), k.double(), v.double(), causal, 0.125)
    error = ((runs[0][0].double() - want).abs().max() / want.abs().max()).item()
    assert error < TOLERANCE[torch.bfloat16], f"relative error {error:.2e}"
    for o, lse in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])


@needs_hopper
def test_warp_specialized_refuses_what_tma_cannot_load(rng):
    q, k, v = (randn((1, 2, 64, 32), torch.float16, rng) for _ in range(3))
    with pytest.raises(ValueError, match="head dims"):
        WARP_SPECIALIZED(q, k, v, False, 0.125)
    q, k = (randn((1, 2, 64, 64), torch.float16, rng) for _ in range(2))
    v = randn((1, 2, 64, 128), torch.float16, rng)[..., ::2]  # every other column
    with pytest.raises(ValueError, match="TMA"):
        WARP_SPECIALIZED(q, k, v, False, 0.125)
    check(HOPPER.attention, q, k, v, False, rng)  # the default falls back to the portable kernel
    k = randn((1, 1, 64, 64), torch.float16, rng).expand(1, 2, 64, 64)  # one key head shared: stride 0
    with pytest.raises(ValueError, match="positive multiples"):
        WARP_SPECIALIZED(q, k, v.contiguous(), False, 0.125)
    check(HOPPER.attention, q, k, v.contiguous(), False, rng)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_warp_specialized_backward_takes_any_gradient_layout(causal, rng):
    """dO comes from whatever follows attention: one that TMA cannot load is copied, not misread."""
    q, k, v = (randn((2, 3, 150, 128), torch.float16, rng).requires_grad_() for _ in range(3))
    do = randn((2, 3, 150, 256), torch.float16, rng)[..., ::2]  # every other column: not TMA-loadable
    assert not HOPPER_FWD.tma_loadable(do)
    got = torch.autograd.grad(WARP_SPECIALIZED(q, k, v, causal, 0.125), (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference(q64, k64, v64, causal, 0.125), (q64, k64, v64), do.double())
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        error = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert error < TOLERANCE[torch.float16], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("n", [1, 4, 77, 300])
@pytest.mark.parametrize("block_m", sorted(set(HOPPER.WS_BWD_BLOCK_M.values())))
def test_rows_of_lse_padded_for_tma(n, block_m, rng):
    """TMA wants row strides in multiples of 16 bytes: rows of any length are described by a padded copy."""
    x = torch.randn(3, n, generator=rng)
    desc = HOPPER._ws_row_descriptor(x, block_m)
    assert list(desc.shape) == [3, n] and desc.strides[0] % 4 == 0 and list(desc.block_shape) == [1, block_m]
    assert torch.equal(desc.base[:, :n], x)


@pytest.mark.parametrize("rows", [32, 64, 128])
def test_the_launchers_descriptors_hold_what_a_checked_one_holds(rows, rng):
    """CheckedDescriptor skips TensorDescriptor's checks, which TensorDescriptor would pass for these inputs:
    a transposed view, as the lessons feed, with every field the launcher reads the same."""
    t = torch.randn(2, 77, 3, 128, generator=rng).to(torch.float16).transpose(1, 2)
    checked = HOPPER_FWD._ws_descriptor(t, rows)
    assert isinstance(checked, HOPPER_FWD.TensorDescriptor)
    plain = HOPPER_FWD.TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, 128],
                                        HOPPER_FWD._ws_box_layout(rows, 128, t.dtype))
    for field in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(checked, field) == getattr(plain, field), field
    assert checked.base is t


def test_fp8_refused_without_fp8_tensor_cores():
    if stepkit.fp8_supported():
        pytest.skip("this GPU has fp8 tensor cores")
    qkv = [torch.randn(1, 2, 8, 32, device=DEVICE).to(torch.float8_e5m2) for _ in range(3)]
    with pytest.raises(TypeError, match="fp8 tensor cores"):
        V2.attention(*qkv, True, 0.125)


needs_fp8 = pytest.mark.skipif(not stepkit.fp8_supported(), reason="fp8 attention needs a GPU with fp8 tensor cores")
# P is rounded to e5m2 (2 mantissa bits) before the second product: up to 4.5e-2 seen on an H200,
# while a wrong layout or stride of V gives errors of order 1.
FP8_TOLERANCE = 0.1


def check_fp8(q, k, v, causal):
    """v2's fp8 forward against float64 attention on the same fp8 values: the kernel's error, not the inputs'."""
    sm_scale = q.shape[-1] ** -0.5
    out = V2.attention(q, k, v, causal, sm_scale)
    want = reference(q.double(), k.double(), v.double(), causal, sm_scale)
    assert out.shape == q.shape and out.dtype == torch.float16
    error = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert error < FP8_TOLERANCE, f"relative error {error:.2e}"


def test_keys_contiguous_keeps_values_and_shape(rng):
    v = randn((2, 3, 77, 32), torch.float32, rng)
    w = V2.keys_contiguous(v, torch.float16)
    assert w.shape == v.shape and w.dtype == torch.float16 and w.stride(2) == 1
    assert torch.equal(w, v.to(torch.float16))


@needs_fp8
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N", [1, 77, 300])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_fp8_forward(causal, N, D, rng):
    check_fp8(*(randn((2, 3, N, D), torch.float32, rng).to(torch.float8_e5m2) for _ in range(3)), causal)


@needs_fp8
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_forward_with_v_keys_contiguous(causal, rng):
    q, k, v = (randn((2, 3, 300, 64), torch.float32, rng).to(torch.float8_e5m2) for _ in range(3))
    check_fp8(q, k, V2.keys_contiguous(v), causal)


@needs_fp8
def test_fp8_refuses_head_dim_16(rng):
    qkv = [randn((1, 2, 8, 16), torch.float32, rng).to(torch.float8_e5m2) for _ in range(3)]
    with pytest.raises(ValueError, match="head dim 32 or more"):
        V2.attention(*qkv, False, 0.25)


def test_the_benchmark_calls_each_provider_once_in_its_compile_pass_then_times(monkeypatch, capsys):
    phase, log = ["timing"], []

    def compile_ahead(calls):  # on a GPU, launches in here only compile
        phase[0] = "compiling"
        calls()
        phase[0] = "timing"
        return 3, 0.5

    def provider(name):
        def fn(q, k, v):
            log.append((name, phase[0]))
            return q * 1.0 + k + v
        return fn

    def broken(q, k, v):
        raise RuntimeError("no kernel for this case")

    def extra(q, k, v, causal, D):
        return {("x", "bwd"): stepkit.backward_timer(provider("x"), q, k, v)}

    monkeypatch.setattr(stepkit, "compile_ahead", compile_ahead)
    monkeypatch.setattr(stepkit, "PASSES", 1)
    rows = stepkit.attention_benchmark([(1, 1, 16)], [8], lambda causal, D: {"a": provider("a"), "broken": broken},
                                       ("fwd", "bwd"), extra)
    # the pass: per case, "a" forward, "a" forward again to make the graph for its backward, "x" likewise
    assert log[:6] == [("a", "compiling")] * 2 + [("x", "compiling")] + [("a", "compiling")] * 2 + [("x", "compiling")]
    assert all(p == "timing" for _, p in log[6:]) and len(log) > 6
    assert sorted({(r["provider"], r["mode"]) for r in rows}) == [("a", "bwd"), ("a", "fwd"), ("x", "bwd")]
    out = capsys.readouterr().out
    assert "Compiled ahead: 3 kernels" in out
    for mode in ("fwd", "bwd"):  # each failing (provider, mode) once, at the first case
        assert out.count(f"('broken', '{mode}') skipped at D=16, N=8, causal=False: no kernel for this case") == 1


def test_compile_ahead_runs_nothing_without_a_gpu(monkeypatch):
    monkeypatch.setattr(stepkit, "ON_GPU", False)

    def calls():
        raise AssertionError("called")

    assert stepkit.compile_ahead(calls) == (0, 0.0)  # under the interpreter there is nothing to compile


@pytest.mark.skipif(not stepkit.ON_GPU, reason="Triton compiles only for a GPU")
def test_compile_ahead_compiles_launches_nothing_and_ends_even_on_error(rng):
    B, H, N, D = 1, 2, 77, 64
    o, do = (torch.randn(B, H, N, D, generator=rng).to(DEVICE, torch.float16) for _ in range(2))
    lse = torch.rand(B * H, N, generator=rng).to(DEVICE) + 1
    do_scaled = torch.empty_like(do)
    delta = torch.full((B * H, N), float("nan"), device=DEVICE)

    def preprocess():
        stepkit.launch(V1.attn_bwd_preprocess_v1_kernel, (math.ceil(N / V1.BLOCK), B * H), o, do, lse, do_scaled, delta,
                       H, N, *o.stride(), *do.stride(), D=D, BLOCK_M=V1.BLOCK)

    def compile_then_fail():
        preprocess()
        raise RuntimeError("after the launch")

    with pytest.raises(RuntimeError, match="after the launch"):
        stepkit.compile_ahead(compile_then_fail)
    assert not stepkit.compiling_ahead()
    assert stepkit.compile_ahead(preprocess)[0] in (0, 1)  # 0: the kernel was compiled above, or by another test
    assert delta.isnan().all(), "a launch made while compiling ahead ran the kernel"
    preprocess()
    want = (o.float() * do.float()).sum(-1).reshape(B * H, N) / lse
    assert torch.allclose(delta, want, rtol=1e-3, atol=1e-3)


# The exercises' checks: each must accept a correct answer and reject a known wrong one.


def test_exercise_causal_block_mask(capsys):
    def right(start_m, start_n, block_m, block_n, n):
        rows = start_m + torch.arange(block_m)[:, None]
        keys = start_n + torch.arange(block_n)[None, :]
        return (keys <= rows) & (rows < n) & (keys < n)

    V2.check_causal_block_mask(right)
    assert "right on 50 random block pairs" in capsys.readouterr().out
    first_wrong = r"causal_block_mask on start_m=\d+, .*, n=\d+: query \d+ and key \d+ should be (True|False); \d+ of"
    with pytest.raises(AssertionError, match=first_wrong):  # forgets the ragged end
        V2.check_causal_block_mask(lambda sm, sn, bm, bn, n: (sn + torch.arange(bn)[None, :])
                                   <= (sm + torch.arange(bm)[:, None]))
    with pytest.raises(AssertionError, match=first_wrong):  # the diagonal left out
        V2.check_causal_block_mask(lambda sm, sn, bm, bn, n: right(sm, sn, bm, bn, n)
                                   & (sn + torch.arange(bn)[None, :] != sm + torch.arange(bm)[:, None]))
    with pytest.raises(AssertionError, match="should be a bool tensor of shape"):  # 0 and 1, not a mask
        V2.check_causal_block_mask(lambda *args: right(*args).int())
    with pytest.raises(AssertionError, match="causal_block_mask on .*should be"):  # queries and keys swapped
        V2.check_causal_block_mask(lambda sm, sn, bm, bn, n: right(sn, sm, bn, bm, n))


def test_exercise_one_row_backward(capsys):
    def right(q, K, V, do, scale):
        p = torch.softmax(K @ q * scale, dim=0)
        dV = torch.outer(p, do)
        dp = V @ do
        ds = p * (dp - (p * dp).sum())
        return scale * ds @ K, scale * torch.outer(ds, q), dV

    V2_BWD.check_one_row_backward(right)
    assert "matches autograd on 10 random rows" in capsys.readouterr().out
    first_wrong = r"one_row_backward on N=\d+, D=\d+, scale=[\d.]+: {}: element .* off by"
    with pytest.raises(AssertionError, match=first_wrong.format("dq")):  # forgets Delta
        V2_BWD.check_one_row_backward(lambda q, K, V, do, scale: (
            scale * (torch.softmax(K @ q * scale, 0) * (V @ do)) @ K, *right(q, K, V, do, scale)[1:]))
    with pytest.raises(AssertionError, match=first_wrong.format("dK")):  # forgets the scale in dK
        V2_BWD.check_one_row_backward(lambda q, K, V, do, scale: (
            right(q, K, V, do, scale)[0], right(q, K, V, do, scale)[1] / scale, right(q, K, V, do, scale)[2]))
    with pytest.raises(AssertionError, match="three gradients"):  # zip would stop at the shorter answer
        V2_BWD.check_one_row_backward(lambda q, K, V, do, scale: right(q, K, V, do, scale)[:1])
    # dV transposed: the wrong shape, or where N = D the wrong values
    with pytest.raises(AssertionError, match=r"one_row_backward on N=\d+, D=\d+, scale=[\d.]+: dV"):
        V2_BWD.check_one_row_backward(lambda *args: (*right(*args)[:2], right(*args)[2].T.clone()))
    with pytest.raises(AssertionError, match=first_wrong.format("dq").replace("off by", "is nan")):
        V2_BWD.check_one_row_backward(lambda *args: (right(*args)[0] * math.nan, *right(*args)[1:]))


def test_exercise_dv_only(capsys):
    def right(q, k, v, do, lse, causal, sm_scale):
        v = v.double().requires_grad_()
        out = reference(q.double(), k.double(), v, causal, sm_scale)
        return torch.autograd.grad(out, v, do.double())[0].to(q.dtype)

    V2_BWD.check_dv_only(right)
    out = capsys.readouterr().out
    assert "dv_only matches" in out and (("yours takes" in out) if stepkit.ON_GPU else ("only on a GPU" in out))
    with pytest.raises(AssertionError, match=r"causal=True: dV: element \(\d+, \d+, \d+, \d+\) is .* off by"):
        V2_BWD.check_dv_only(lambda q, k, v, do, lse, causal, sm_scale: right(q, k, v, do, lse, False, sm_scale))
    with pytest.raises(AssertionError, match="dv_only on B, H, N, D = .*: dV: element"):  # dK in dV's place
        V2_BWD.check_dv_only(lambda q, k, v, do, lse, causal, sm_scale: V2_BWD.attention(
            *(t.requires_grad_() for t in (q, k, v)), causal, sm_scale).backward(do) or k.grad)
    with pytest.raises(AssertionError, match=r"dV should be a \(1, 2, 1, 16\) torch.float16 tensor, got NoneType"):
        V2_BWD.check_dv_only(lambda *args: None)
    with pytest.raises(AssertionError, match="got .* torch.float32"):  # the fp32 accumulator, never cast back
        V2_BWD.check_dv_only(lambda *args: right(*args).float())
    with pytest.raises(AssertionError, match="dV: element .* is nan"):
        V2_BWD.check_dv_only(lambda q, *args: torch.full_like(q, math.nan))


def test_exercise_dv_products(capsys):
    """The count is checked without being printed: right or wrong, with a hint on wrong."""
    V2_BWD.check_dv_products(2)  # P^T recomputed from K Q^T, then P^T dO
    V2_BWD.check_dv_products(np.int64(2))
    assert capsys.readouterr().out.count("right") == 2
    # 1: P taken as stored; 3: dP kept; 4: the two-pass dK, dV loop; 5: all, atomic dQ too.
    for wrong in (1, 3, 4, 5, 7, 0, -2):
        with pytest.raises(AssertionError, match=r"does not need -?\d+ products per block pair. Hint") as error:
            V2_BWD.check_dv_products(wrong)
        assert "2" not in str(error.value).replace(str(wrong), "")
    for not_a_count in (True, 2.0, "2", math.nan, None):
        with pytest.raises(AssertionError, match="give a whole number"):
            V2_BWD.check_dv_products(not_a_count)


# Which tiles ran: the sentences under the tables, read from made-up tables.


def test_tiles_compilations_are_counted_per_head_dim():
    tables = {("fwd", 64, False, 1024): (64, 64, 4, 3), ("fwd", 64, False, 2048): (64, 64, 4, 3),
              ("fwd", 64, True, 1024): (64, 64, 4, 3), ("fwd", 128, False, 1024): (128, 64, 8, 3),
              ("fwd", 128, False, 2048): (128, 128, 8, 3), ("dq", 128, False, 1024): (32, 64, 4, 4)}
    line = V2.compilations(tables, ["fwd"])
    # The same tile at D = 64 counts once per masking; the dq row is another kernel's.
    assert line.startswith("For these kernels' 5 cases") and "names 4 distinct configurations" in line
    assert "2 at D = 64, 2 at D = 128 (the table below)" in line
    only_128 = V2.compilations({k: t for k, t in tables.items() if k[1] == 128}, ["fwd", "dq"])
    assert "3 cases" in only_128 and "names 3 distinct" in only_128 and ": 3 at D = 128 (the table below);" in only_128
    assert "2 at D = 64 (the table below), 2 at D = 128;" in V2.compilations(tables, ["fwd"], shown=64)


def test_tiles_table_has_a_row_per_kernel_and_masking():
    kernels = {"fwd": ("forward", None)}
    picks = {("fwd", False, 1024): (64, 64, 4, 3), ("fwd", True, 1024): (128, 64, 8, 4),
             ("fwd", True, 2048): (128, 128, 8, 3)}
    assert V2.tiles_table(picks, kernels) == {
        "forward, non-causal": {"N = 1024": "64x64, 4 warps, 3 stages"},
        "forward, causal": {"N = 1024": "128x64, 8 warps, 4 stages", "N = 2048": "128x128, 8 warps, 3 stages"},
    }
    if not stepkit.ON_GPU:  # under the interpreter no table applies and no tuner runs: nothing to show
        assert V2.tiles_that_ran(128, [64, 128], kernels) == {}


def test_tiles_keys_per_program_reads_what_each_dkdv_kernel_ran():
    def picks(two_pass, atomic, n=5):
        """two_pass and atomic: (BLOCK_N, warps) for each case, both maskings; a dQ row that must not count."""
        rows = {("dq", False, 1024): (32, 128, 8, 3)}
        for name, tiles in (("dkdv", two_pass), ("dkdv-atomic", atomic)):
            for i, (keys, warps) in enumerate(tiles):
                rows[name, i % 2 == 1, 1024 * 2 ** (i // 2)] = (64, keys, warps, 3)
        return rows

    h100 = V2_BWD.keys_per_program(picks([(64, 4)] * 10, [(128, 8)] * 10))
    assert h100 == ("What ran: the two-pass backward's dK, dV kernel ran 64 keys on 4 warps in 10 of its 10 cases; "
                    "the atomic backward's ran 128 keys on 8 warps in 10 of its 10 cases: the two backwards chose "
                    "differently.")
    same = V2_BWD.keys_per_program(picks([(128, 8)] * 10, [(128, 8)] * 10))
    assert "128 keys on 8 warps in 10 of its 10" in same and same.endswith("cases.") and "differently" not in same
    mixed = V2_BWD.keys_per_program(picks([(64, 4)] * 6 + [(128, 8)] * 4, [(128, 8)] * 3 + [(64, 4)] * 7))
    assert "64 keys on 4 warps in 6 of its 10 cases" in mixed and "ran 64 keys on 4 warps in 7 of its 10" in mixed
    assert "differently" not in mixed
    one = V2_BWD.keys_per_program(picks([(64, 4)] * 2, []))
    assert one == "What ran: the two-pass backward's dK, dV kernel ran 64 keys on 4 warps in 2 of its 2 cases."
    assert V2_BWD.keys_per_program({}) == V2_BWD.keys_per_program(picks([], [])) == ""


def test_the_mistakes_sections_name_tests_that_exist():
    """Lessons 06 and 07 name the tests that catch each mistake: each must be one of this file's."""
    for stem in ("06-fused-attention-v2-forward", "07-fused-attention-v2-backward"):
        source = (ROOT / "tutorials" / f"{stem}.py").read_text()
        section = source.split("# Mistakes learners make")[1].split("# %%")[0]
        named = set(re.findall(r"(?<!its )``(test_\w+)``", section))  # "its ``test_op``": Triton's own
        assert named and all(callable(globals().get(name)) for name in named), (stem, named)


def test_the_forward_lesson_has_the_same_forward_and_says_where_the_backward_is(rng):
    q, k, v = (randn((2, 3, 77, 64), torch.float16, rng).requires_grad_() for _ in range(3))
    out = V2.attention(q, k, v, True, 0.125)
    assert torch.equal(out, V2_BWD.attention(q, k, v, True, 0.125))
    with pytest.raises(NotImplementedError, match="07-fused-attention-v2-backward"):
        out.sum().backward()


def test_exercise_padded_attention(capsys):
    """Lesson 06's check is lesson 05's (test_attention_exercises.py runs both on Triton solutions)."""
    def right(q, k, v, causal, sm_scale, lengths):
        keep = torch.arange(k.shape[2], device=k.device)[None, :] < lengths[:, None]  # (B, N)
        s = (q.float() @ k.float().transpose(-1, -2)) * sm_scale
        s = s.masked_fill(~keep[:, None, None, :], -math.inf)
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
        return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)

    V2.check_padded_attention(right)
    assert "padded_attention is right" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"key lengths \d+, 1, \d+: the output: element"):  # ignores them
        V2.check_padded_attention(lambda q, k, v, causal, sm_scale, lengths: V2.attention(q, k, v, causal, sm_scale))

    def rewrites_lengths(q, k, v, causal, sm_scale, lengths):
        lengths.fill_(k.shape[2])  # then ignores them: a check reading lengths afterwards would be fooled
        return V2.attention(q, k, v, causal, sm_scale)

    with pytest.raises(AssertionError, match=r"key lengths \d+, 1, \d+: the output: element"):
        V2.check_padded_attention(rewrites_lengths)


def _pairs_schedule(n_m, heads, programs):
    """The kernel's schedule: pairs of query blocks m and n_m - 1 - m, dealt out round robin."""
    plan = [[] for _ in range(programs)]
    half = (n_m + 1) // 2
    for pair in range(half * heads):
        head, light = divmod(pair, half)
        plan[pair % programs] += [(head, m) for m in dict.fromkeys((n_m - 1 - light, light))]
    return plan


def _round_robin_schedule(n_m, heads, programs):
    plan = [[] for _ in range(programs)]
    for t in range(n_m * heads):
        plan[t % programs].append(divmod(t, n_m))
    return plan


def test_host_cells_say_what_paced_the_benchmark():
    """The verdict lessons 13 and 14 print under their host measurements, from GPU, back-to-back and host times
    (us) and the timings' spread: host-bound only where back to back exceeds GPU time by more than the spread and
    the host time accounts for it; otherwise the page says what the numbers show and what they cannot tell."""
    gpu_bound = PROFILE.who_paced(gpu=30.0, b2b=30.5, host=20.0, spread=0.03)
    assert "GPU-bound" in gpu_bound and "30 us" in gpu_bound and "20 us" in gpu_bound
    host_bound = PROFILE.who_paced(gpu=30.0, b2b=48.0, host=47.0, spread=0.03)
    assert host_bound.startswith("host-bound") and "48 us" in host_bound and "47 us" in host_bound
    # Within SPREAD_LIMIT (10%) of GPU time is not host-bound, whatever the host time measured alone, even where
    # the two fastest timings agreed closely: the benchmark retimes only past that limit.
    assert "cannot tell" in PROFILE.who_paced(gpu=30.0, b2b=32.0, host=40.0, spread=0.10)
    assert "cannot tell" in PROFILE.who_paced(gpu=30.0, b2b=32.0, host=40.0, spread=0.0)
    assert PROFILE.who_paced(gpu=30.0, b2b=36.0, host=39.0, spread=0.03).startswith("host-bound")
    # A host time past back to back by more than 10% contradicts it: the host ran slower when measured.
    assert PROFILE.who_paced(gpu=30.0, b2b=36.0, host=40.0, spread=0.03).startswith("inconsistent")
    # A host time within 10% of back to back accounts for it (lesson 14, D=128 atomic: 302, 337, 320 us).
    assert PROFILE.who_paced(gpu=302.0, b2b=337.0, host=320.0, spread=0.10).startswith("host-bound")
    # Slower back to back, but not for the host's sake.
    assert "between the kernels" in PROFILE.who_paced(gpu=30.0, b2b=40.0, host=25.0, spread=0.03)
    # Times within 2 us of each other (lesson 13, D=64 causal portable) are GPU-bound, not a gap between kernels.
    assert PROFILE.who_paced(gpu=68.0, b2b=69.0, host=67.0, spread=0.01).startswith("GPU-bound")
    # Timings that spread past the limit give no verdict, and say what the spread is (lesson 14's 51%).
    unsettled = PROFILE.who_paced(gpu=217.0, b2b=243.0, host=382.0, spread=0.51)
    assert unsettled.startswith("unsettled") and "two fastest timings differ by 51%" in unsettled
    for verdict in (gpu_bound, host_bound, unsettled):
        assert "the spread (" not in verdict


def test_the_launch_plans_sentence_says_where_clearing_them_came_out_faster():
    """Lessons 13 and 14 print what lesson 06's launch plans saved; where the host time without plans came out
    lower (host times drift), the sentence says in how many calls and by how much, rather than a negative saving."""
    import pandas as pd

    rows = pd.DataFrame({"host (us)": [191, 382, 317], "host, no plans (us)": [356, 356, 301]})
    line = PROFILE.plans_saved(rows)
    assert "-26 to +165 us" in line and "in 2 of 3 calls it came out lower, by up to 26 us" in line
    clean = PROFILE.plans_saved(rows.assign(**{"host, no plans (us)": [356, 400, 350]}))
    assert "+18 to +165 us" in clean and "came out lower" not in clean


def test_host_times_are_taken_in_turns_and_keep_the_fastest(monkeypatch):
    """The host cells of lessons 13 and 14 (GPU only) time every call once per round, in turn, and keep each
    call's fastest."""
    seen, times = [], iter([5.0, 3.0, 9.0, 4.0, 1.0, 2.0])
    monkeypatch.setattr(PROFILE, "host_ms", lambda fn: (seen.append(fn()), next(times))[1])
    calls = {"a": lambda: "a", ("a", "unplanned"): lambda: "a'", "b": lambda: "b"}
    assert PROFILE.interleaved_host_ms(calls) == {"a": 4.0, ("a", "unplanned"): 1.0, "b": 2.0}
    assert seen == ["a", "a'", "b"] * 2


def _per_call(host, gpu, calls):
    """Lesson 13's exercise 2, answered by reasoning: the slower side's pace for every call, plus the faster
    side's one call that nothing hides (the first enqueue, or the last kernel)."""
    return (max(host, gpu) * calls + min(host, gpu)) / calls


def test_the_pacing_timeline_follows_the_slower_side():
    """Lesson 13's picture: back to back, calls go at the pace of the slower of host and GPU."""
    enqueues, kernels = PROFILE.timeline(host=1.0, gpu=1.6, calls=5)
    assert [start for start, _ in enqueues] == pytest.approx([1.0 * i for i in range(5)])
    assert [start for start, _ in kernels] == pytest.approx([1.0 + 1.6 * i for i in range(5)])  # back to back
    _, kernels = PROFILE.timeline(host=1.6, gpu=1.0, calls=5)
    assert [start for start, _ in kernels] == pytest.approx([1.6 * (i + 1) for i in range(5)])  # the GPU waits
    for host, gpu in ((1.0, 1.6), (1.6, 1.0), (2.0, 2.0)):
        _, kernels = PROFILE.timeline(host, gpu, 8)
        assert all(b[0] >= a[0] + gpu for a, b in zip(kernels, kernels[1:]))  # one kernel at a time
        assert (kernels[-1][0] + gpu) / 8 == pytest.approx(_per_call(host, gpu, 8))


def test_exercise_schedule_accepts_balanced_answers():
    PROFILE.check_schedule(_pairs_schedule)

    def longest_first(n_m, heads, programs):
        plan, loads = [[] for _ in range(programs)], [0] * programs
        for head, m in sorted(((h, m) for h in range(heads) for m in range(n_m)), key=lambda t: -t[1]):
            least = loads.index(min(loads))
            plan[least].append((head, m))
            loads[least] += m + 1
        return plan

    PROFILE.check_schedule(longest_first)


def test_exercise_schedule_rejects_round_robin_and_lost_tiles():
    with pytest.raises(AssertionError, match="busiest program loads"):
        PROFILE.check_schedule(_round_robin_schedule)
    with pytest.raises(AssertionError, match="exactly once"):
        PROFILE.check_schedule(lambda n_m, heads, programs: [tiles[1:] for tiles in
                                                                _pairs_schedule(n_m, heads, programs)])
    with pytest.raises(AssertionError, match="lists for"):
        PROFILE.check_schedule(lambda n_m, heads, programs: _pairs_schedule(n_m, heads, programs)[:-1])


def test_exercise_per_call(capsys):
    PROFILE.check_per_call(_per_call)
    assert "63 calls come within 1%" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="host 1.6, GPU 1.0, 1 calls"):
        PROFILE.check_per_call(lambda host, gpu, calls: max(host, gpu))  # the steady pace alone
    with pytest.raises(AssertionError, match="per_call gave"):  # host and GPU one after the other
        PROFILE.check_per_call(lambda host, gpu, calls: host + gpu if calls > 1 else _per_call(host, gpu, 1))
    with pytest.raises(AssertionError, match="per_call gave"):
        PROFILE.check_per_call(lambda host, gpu, calls: float("nan"))


def test_the_persistence_gain_is_a_range_where_its_timings_spread():
    """Lesson 13's gain of one program per SM, by GPU time: one ratio of the fastest timings where both launches'
    timings agree within the kit's limit, else the lowest to the highest ratio they allow."""
    def measured(*gpu_ms):
        m = PROFILE.kit.Measured()
        for ms in gpu_ms:
            m.add({"b2b": ms, "gpu": ms, "gpu_method": "CUDA graph"})
        return m

    assert PROFILE.gain(measured(1.2, 1.21), measured(1.0, 1.02)) == pytest.approx((1.2, 1.2))
    low, high = PROFILE.gain(measured(1.2, 1.5), measured(1.0, 1.02))
    assert low == pytest.approx(1.2 / 1.02) and high == pytest.approx(1.5)


def test_exercise_tma_ready():
    def right(t):
        return t if HOPPER_FWD.tma_loadable(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)

    HOPPER_FWD.check_tma_ready(right)
    with pytest.raises(AssertionError, match="starting one element in: TMA cannot load"):
        HOPPER_FWD.check_tma_ready(lambda t: t if HOPPER_FWD.tma_loadable(t) else t.contiguous())
    with pytest.raises(AssertionError, match="the copy costs"):
        HOPPER_FWD.check_tma_ready(lambda t: torch.empty(t.shape, dtype=t.dtype).copy_(t))
    with pytest.raises(AssertionError, match="dtype, device and values"):  # a copy in another dtype
        HOPPER_FWD.check_tma_ready(lambda t: t if HOPPER_FWD.tma_loadable(t) else t.float().contiguous())


def test_exercise_query_block_range():
    def right(start_n, block_n, block_m, n):
        last = -(-n // block_m)
        return start_n // block_m, min(last, -(-(start_n + block_n - 1) // block_m)), last

    HOPPER.check_query_block_range(right)
    with pytest.raises(AssertionError, match="expected"):  # masks one block too few
        HOPPER.check_query_block_range(lambda sn, bn, bm, n: (sn // bm, sn // bm + bn // bm - 1, -(-n // bm)))
    with pytest.raises(AssertionError, match="expected"):  # the kernel's formula, right only where bm divides bn
        HOPPER.check_query_block_range(lambda sn, bn, bm, n: (sn // bm, min(sn // bm + bn // bm, -(-n // bm)),
                                                              -(-n // bm)))


def test_exercise_products():
    HOPPER.check_products(lambda atomic: 5 if atomic else 7)
    with pytest.raises(AssertionError, match="products"):
        HOPPER.check_products(lambda atomic: 5)


# Inputs that used to be computed wrong, or refused without reason.
SCALES = [-1.0, -0.125, 0.0, 1e-6, 4.0, np.float32(0.125), np.float64(-0.5), np.int64(1)]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("sm_scale", SCALES, ids=repr)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_finite_sm_scale(version, sm_scale, causal, rng):
    """The forward used to take the row maximum before scaling: wrong (inf, NaN) for a negative scale."""
    q, k, v = (randn((1, 2, 77, 64), torch.float16, rng) for _ in range(3))
    check(VERSIONS[version], q, k, v, causal, rng, sm_scale=sm_scale)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("sm_scale", [1e3, -1e3], ids=repr)
def test_huge_sm_scale_forward(version, sm_scale, rng):
    """A huge scale makes each row's softmax nearly one-hot: the output must pick the right values. (Gradients
    there are differences of nearly equal fp16-rounded numbers times the scale: no tolerance fits them.)"""
    q, k, v = (randn((1, 2, 77, 64), torch.float16, rng) for _ in range(3))
    out = VERSIONS[version](q, k, v, False, sm_scale)
    want = reference(q.double(), k.double(), v.double(), False, sm_scale)
    error = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert torch.isfinite(out).all() and error < TOLERANCE[torch.float16], f"relative error {error:.2e}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("sm_scale", [True, float("inf"), float("nan"), "0.1", None, 1j], ids=repr)
def test_sm_scale_that_is_not_a_finite_real_is_refused(version, sm_scale):
    with pytest.raises(TypeError, match="sm_scale"):
        VERSIONS[version](*good(), False, sm_scale)


@pytest.mark.parametrize("version", VERSIONS)
def test_negated_views_are_read_as_their_values(version, rng):
    """torch._neg_view flips a flag, not the memory: a kernel reading memory must see the negated values."""
    q, k, v = (randn((1, 2, 50, 32), torch.float16, rng) for _ in range(3))
    check(VERSIONS[version], torch._neg_view(q), k, torch._neg_view(v), True, rng)


# Every public attention: off Hopper, lessons 11 and 14 run their own autograd functions over lesson 06's kernels.
ENTRIES = {**VERSIONS, "hopper-forward": HOPPER_FWD.attention, "hopper": HOPPER.attention}


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_negated_view_of_the_output_gradient_is_read_as_its_values(entry, rng):
    """dO reaches the backward from the caller, past check_inputs: its negative bit must be resolved too
    (it used to flip the sign of every gradient)."""
    q, k, v = (randn((1, 2, 37, 32), torch.float16, rng) for _ in range(3))
    check(ENTRIES[entry], q, k, v, True, rng, passed_as=lambda do: torch._neg_view(-do))


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_output_gradient_whose_head_passes_2_31_elements(entry, rng):
    """A dO with rows 2**30 + 64 elements apart (a 4 GiB allocation, mostly never touched) is copied before
    the kernels read it with 32-bit offsets (it used to crash the process)."""
    def spread(do):
        storage = torch.empty(2 * (2**30 + 64) + 32, dtype=do.dtype, device=do.device)
        return storage.as_strided(do.shape, (0, 0, 2**30 + 64, 1)).copy_(do)

    q, k, v = (randn((1, 1, 3, 32), torch.float16, rng) for _ in range(3))
    check(ENTRIES[entry], q, k, v, False, rng, passed_as=spread)


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_output_gradient_that_starts_off_16_bytes(entry, rng):
    """A contiguous dO one element into its allocation: TMA cannot load it, and contiguous() leaves it as it is."""
    def shifted(do):
        return torch.empty(do.numel() + 1, dtype=do.dtype, device=do.device)[1:].view(do.shape).copy_(do)

    q, k, v = (randn((1, 2, 128, 64), torch.float16, rng) for _ in range(3))
    check(ENTRIES[entry], q, k, v, True, rng, passed_as=shifted)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "v1"])
def test_a_small_output_gradient_over_many_keys(entry, rng):
    """dO of order 1e-4 under near-uniform attention over 1,024 keys: v1 divides dO by l (about 1,024) into
    fp16 subnormals and loses dV (lesson 05 shows it); the later kernels never divide dO, so dV keeps its
    precision. (dQ and dK do not: dS, rounded to fp16 for the tensor cores, is subnormal there too.)"""
    q = (randn((1, 1, 1024, 64), torch.float16, rng) * 0.01).requires_grad_()
    k, v = (randn((1, 1, 1024, 64), torch.float16, rng).requires_grad_() for _ in range(2))
    do = randn((1, 1, 1024, 64), torch.float16, rng) * 1e-4
    ENTRIES[entry](q, k, v, False, 0.125).backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(q64, k64, v64, False, 0.125).backward(do.double())
    # Relative to dV's own largest value: assert_matches's floor of 1 would hide any error at this scale.
    error = ((v.grad.double() - v64.grad).abs().max() / v64.grad.abs().max()).item()
    assert torch.isfinite(v.grad).all() and error < TOLERANCE[torch.float16], f"dv: relative error {error:.2e}"


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_second_derivative_is_refused(entry, rng):
    """The backward builds no graph: differentiating it again must raise, not silently treat the first
    derivative as a constant (a gradient penalty would vanish)."""
    q, k, v = (randn((1, 2, 37, 32), torch.float16, rng).requires_grad_() for _ in range(3))
    out = ENTRIES[entry](q, k, v, False, 0.177)
    (dq,) = torch.autograd.grad(out.float().pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        dq.float().pow(2).sum().backward()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("sm_scale", [1e39, -1e39, 10**400], ids=["1e39", "-1e39", "10**400"])
def test_sm_scale_past_fp32_is_refused(version, sm_scale):
    """The kernels scale in fp32, where 1e39 is infinite (it used to give NaN, or an OverflowError)."""
    with pytest.raises(ValueError, match="sm_scale"):
        VERSIONS[version](*good(), False, sm_scale)


def test_a_head_spanning_more_than_2_31_elements_is_refused():
    # Three rows 2**30 elements apart: a 4 GiB allocation, never written.
    huge = torch.empty(2**31 + 32, dtype=torch.float16, device=DEVICE).as_strided((1, 1, 3, 32), (0, 0, 2**30, 1))
    with pytest.raises(ValueError, match="2\\*\\*31"):
        V2.attention(huge, huge, huge, False, 0.125)


@pytest.mark.parametrize("version", ["v1", "v2", "v2-atomic-dq"])
def test_offsets_past_2_31_elements(version, rng):
    """Batch strides below 2**31 whose last batch starts past it: 32-bit offsets overflow there. The views
    share one allocation that is mostly never touched, so the test does little real work."""
    if stepkit.ON_GPU:
        pytest.skip("the GPU version of this test uses real tensors (test_real_shape_past_2_31_elements)")
    B, N, D, stride_b = 3, 64, 32, 1_200_000_000
    storage = torch.empty(stride_b * (B - 1) + 3 * N * D, dtype=torch.float16)
    q, k, v = (storage.as_strided((B, 1, N, D), (stride_b, N * D, D, 1), i * N * D) for i in range(3))
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=rng))
    assert q.storage_offset() + (B - 1) * stride_b > 2**31
    check(VERSIONS[version], q, k, v, True, rng)


@pytest.mark.skipif(not stepkit.ON_GPU, reason="needs a GPU with room for 4 GiB tensors")
@pytest.mark.parametrize("version", VERSIONS)
def test_real_shape_past_2_31_elements(version):
    """(129, 32, 4096, 128) in fp16: 2**31 + 2**24 elements per tensor. Compared with float64 on a few heads."""
    from filelock import FileLock

    B, H, N, D = 129, 32, 4096, 128
    # Up to 50 GB of GPU memory each: test processes sharing the GPU take turns.
    (ROOT / "build").mkdir(exist_ok=True)
    with FileLock(ROOT / "build" / ".gpu-memory.lock"):
        q, k, v = (torch.randn((B, H, N, D), device=DEVICE, dtype=torch.float16).requires_grad_() for _ in range(3))
        out = VERSIONS[version](q, k, v, True, D ** -0.5)
        do = torch.randn_like(out)
        out.backward(do)
        check_heads(q, k, v, out, do, D)
        del q, k, v, out, do
        torch.cuda.empty_cache()


def check_heads(q, k, v, out, do, D):
    B, H = q.shape[:2]
    for b, h in ((0, 0), (B - 1, H - 1), (B // 2, 7)):
        qh, kh, vh = (t[b:b + 1, h:h + 1].detach().double().requires_grad_() for t in (q, k, v))
        ref = reference(qh, kh, vh, True, D ** -0.5)
        ref.backward(do[b:b + 1, h:h + 1].double())
        for name, got, want in (("o", out, ref), ("dq", q.grad, qh.grad), ("dk", k.grad, kh.grad),
                                ("dv", v.grad, vh.grad)):
            assert_matches(got[b:b + 1, h:h + 1], want, torch.float16, f"{name} at b={b}, h={h}")


# The tables that tools/tune.py measured and wrote into tuned_tables.json, as lessons 06, 11 and 14 read them.
CASES = [(D, causal, bucket) for D in (64, 128) for causal in (False, True) for bucket in V2.TUNED_ON["buckets"]]


def test_the_tuned_tables_cover_every_case_with_valid_choices():
    assert V2.TUNED_ON["capability"] == tuple(V2.TUNED_ON["capability"]) and V2.TUNED_ON["gpu"]
    for name in V2.INTERPRETER_CONFIGS:
        for D, causal, bucket in CASES:
            config = V2.TUNED_CONFIGS[(name, D, causal, bucket)]
            shapes, prune = (V2.FWD_SHAPES, V2._prune_fwd) if name == "fwd" else (V2_BWD.BWD_SHAPES, V2_BWD._prune_bwd)
            assert config in shapes, (name, D, causal, bucket, config)
            assert prune(V2._configs([config]), {}, D=D)[0].kwargs == V2._configs([config])[0].kwargs
            block_m, block_n = config[:2]
            assert (block_m % block_n == 0) if name == "fwd" else (block_m <= block_n), config
            assert V2._fits(V2._configs([config])[0], D), config
    assert len(V2.TUNED_CONFIGS) == len(V2.INTERPRETER_CONFIGS) * len(CASES)
    keys = sorted((*case, captured) for case in CASES for captured in (False, True))  # eager, in a CUDA graph
    assert sorted(HOPPER_FWD.FORWARD_PATHS) == keys
    assert set(HOPPER_FWD.FORWARD_PATHS.values()) <= {"gluon", "portable"}
    assert sorted(HOPPER.BACKWARD_PATHS) == keys
    assert set(HOPPER.BACKWARD_PATHS.values()) <= {"gluon", "two-pass", "atomic"}


class RecordingKernel:
    """Stands in for a jitted kernel: kernel[grid](...) is a launch through the JIT, and returns the compiled
    kernel, whose compiled[grid] launches it directly. Both are recorded."""
    arg_names = ["X", "Y", "n", "BLOCK"]

    def __init__(self):
        self.jit, self.replayed = [], []

    def __getitem__(self, grid):
        def through_jit(*args, **keywords):
            self.jit.append((grid, args, keywords))
            return Compiled(self)
        return through_jit


class Compiled:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args: self.kernel.replayed.append((grid, args))


def test_a_launch_plan_replays_only_the_launch_it_was_made_from(monkeypatch):
    monkeypatch.setattr(V2, "PLANS", {})
    # bound_launcher reads Triton's CompiledKernel (a GPU test checks it): here, compiled[grid] stands in.
    monkeypatch.setattr(stepkit, "bound_launcher", lambda compiled, grid, first, rest: lambda *fresh: compiled[
        (*grid, 1, 1)[:3]](*fresh, *rest))
    kernel = RecordingKernel()

    def launch(x, grid=(3, 2), block=16, warps=4, key=("k",)):
        V2.launch_planned(key, kernel, grid, 2, (x, "y-" + x, 7), {"BLOCK": block}, num_warps=warps)

    launch("a")
    launch("b")
    assert kernel.jit == [((3, 2), ("a", "y-a", 7), {"BLOCK": 16, "num_warps": 4})]
    assert kernel.replayed == [((3, 2, 1), ("b", "y-b", 7, 16))]  # fresh arguments, then the plan's, constexprs last
    launch("c", block=32)
    launch("d", grid=(4, 2))
    launch("e", warps=8)
    assert [args[0] for _, args, _ in kernel.jit] == ["a", "c", "d", "e"]  # each another launch: through the JIT
    launch("f", key=None)  # no key (the interpreter): the JIT every time, and no plan kept
    launch("g", key=None)
    assert [args[0] for _, args, _ in kernel.jit][-2:] == ["f", "g"] and len(V2.PLANS) == 4


@pytest.mark.skipif(not stepkit.ON_GPU, reason="launch plans are kept on a GPU only")
def test_plans_give_the_jit_bits_and_another_layout_gets_its_own(rng):
    V2.PLANS.clear()
    q, k, v = (randn((2, 3, 77, 64), torch.float16, rng) for _ in range(3))
    first = V2.forward(q, k, v, True, 0.125)
    planned = len(V2.PLANS)
    again = V2.forward(q, k, v, True, 0.125)
    assert len(V2.PLANS) == planned == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    # Same shape and strides, with the data 2 bytes off a 16-byte boundary; then other strides.
    shifted = randn((q.numel() + 1,), torch.float16, rng)[1:].view(q.shape).copy_(q)
    transposed = randn((2, 77, 3, 64), torch.float16, rng).transpose(1, 2).copy_(q)
    for other in (shifted, transposed):
        out, _ = V2.forward(other, k, v, True, 0.125)
        assert_matches(out, reference(q.double(), k.double(), v.double(), True, 0.125), torch.float16, "o")
    assert len(V2.PLANS) == 3
    assert V2.plan_key(shifted) != V2.plan_key(q) != V2.plan_key(transposed)


def test_the_host_cells_read_a_benchmark_rate_back_as_time_per_call():
    import pandas as pd

    rows = pd.DataFrame([dict(D=64, causal=c, N=1024, mode=m, provider=p, value=v, spread=0.0, gpu_value=2 * v)
                         for c, m, p, v in ((False, "fwd", "x", 200.0), (True, "fwd", "x", 100.0),
                                            (True, "bwd", "x", 50.0), (True, "bwd", "y", 1.0))])
    flops = 4 * 2 * 3 * 1024 * 1024 * 64
    assert math.isclose(PROFILE.benchmark_ms(rows, "x", 2, 3, 1024, 64, False, "fwd"), flops / 200e9)
    assert math.isclose(PROFILE.benchmark_ms(rows, "x", 2, 3, 1024, 64, True, "fwd"), flops / 2 / 100e9)
    assert math.isclose(PROFILE.benchmark_ms(rows, "x", 2, 3, 1024, 64, True, "bwd"), 2.5 * flops / 2 / 50e9)
    by_gpu = PROFILE.benchmark_ms(rows, "x", 2, 3, 1024, 64, True, "bwd", "gpu_value")
    assert math.isclose(by_gpu, 2.5 * flops / 2 / 100e9)


def test_the_host_cells_set_host_time_beside_the_benchmarks_two_times(monkeypatch, capsys):
    """Lessons 13 and 14's pacing_rows: each call's GPU and back-to-back times from its own row of the benchmark
    (the right provider, case and mode), its host time measured (also without launch plans, for ours only), in
    microseconds, and a verdict read with the larger of the two spreads."""
    import pandas as pd

    flops = 4 * 2 * 3 * 1024 * 1024 * 64 / 1e9  # per call: 1 ms at 1 TFLOP per ms
    rows = pd.DataFrame([dict(D=64, causal=False, N=1024, mode=m, provider=p, value=flops / b2b, spread=s,
                              gpu_value=flops / gpu, gpu_spread=g)
                         for m, p, b2b, gpu, s, g in (("fwd", "Ours", 0.048, 0.030, 0.01, 0.02),
                                                      ("bwd", "Ours", 1.0, 1.0, 0.0, 0.0),
                                                      ("fwd", "SDPA cuDNN", 0.031, 0.030, 0.2, 0.0))])
    hosts = {"ours": 0.047, ("ours", "planless"): 0.090, "SDPA cuDNN": 0.020}
    monkeypatch.setattr(PROFILE, "interleaved_host_ms", lambda calls: {name: hosts[name] for name in calls})
    monkeypatch.setattr(PROFILE, "planless", lambda timer: timer)
    calls = {"ours": "a timer", "SDPA cuDNN": "another"}
    table = PROFILE.pacing_rows(rows, 2, 3, 1024, 64, False, "fwd", calls, {"ours": "Ours", "SDPA cuDNN": "SDPA cuDNN"})
    assert table == [dict(D=64, causal=False, call="ours", **{"host (us)": 47, "host, no plans (us)": 90,
                                                              "GPU (us)": 30, "back to back (us)": 48}),
                     dict(D=64, causal=False, call="SDPA cuDNN", **{"host (us)": 20, "host, no plans (us)": None,
                                                                    "GPU (us)": 30, "back to back (us)": 31})]
    printed = capsys.readouterr().out.splitlines()
    assert "ours: host-bound" in printed[0] and "exceeds GPU time by 60%" in printed[0]
    # Its back-to-back timings spread 20%, past the limit: read with the larger spread, no verdict.
    assert "SDPA cuDNN: unsettled" in printed[1] and "differ by 20%" in printed[1]


def test_the_host_integer_helpers_agree_with_tritons():
    import triton

    for n in [*range(1, 300), 1023, 1024, 1025, 2**20 - 1, 2**20, 2**31 + 5]:
        assert V2.host_next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (16, 64, 128):
            assert V2.host_cdiv(n, block) == triton.cdiv(n, block), (n, block)


def test_tuned_case_applies_on_the_measured_architecture_only(monkeypatch):
    q = torch.empty(1, 1, 1500, 64, dtype=torch.float16)
    assert stepkit.ON_GPU or V2.tuned_case(q, True) is None  # the interpreter runs its one configuration
    monkeypatch.setattr(stepkit, "ON_GPU", True)
    monkeypatch.setattr(V2, "_capability", lambda device: V2.TUNED_ON["capability"])
    buckets = V2.TUNED_ON["buckets"]
    for N, bucket in ((1, buckets[0]), (1500, 2048), (2048, 2048), (2049, 4096), (10 ** 6, buckets[-1])):
        case = V2.tuned_case(torch.empty(1, 1, N, 128, dtype=torch.bfloat16), False)
        assert case == (128, False, bucket), (N, case)
    assert V2.tuned_case(q.to(torch.float32), True) is None
    monkeypatch.setattr(V2, "_capability", lambda device: (8, 0))
    assert V2.tuned_case(q, True) is None


@pytest.mark.parametrize("measured", ["gluon", "two-pass", "atomic"])
@pytest.mark.parametrize("gluon_runs", [False, True])
def test_backward_path_follows_the_table_unless_the_caller_chooses(monkeypatch, measured, gluon_runs):
    monkeypatch.setattr(V2, "tuned_case", lambda q, causal: (64, causal, 1024))
    monkeypatch.setattr(HOPPER, "BACKWARD_PATHS", {(64, True, 1024, c): measured for c in (False, True)})

    def allowed(q, k, v, warp_specialized, sm_scale):
        if warp_specialized is True and not gluon_runs:
            raise ValueError("cannot run here")
        return gluon_runs and warp_specialized is not False

    monkeypatch.setattr(HOPPER_FWD, "gluon_allowed", allowed)
    q = torch.empty(1, 1, 8, 64, dtype=torch.float16)
    def path(atomic_dq, warp_specialized):
        eager, captured = HOPPER.choose_paths(q, q, q, True, 0.125, atomic_dq, warp_specialized)[1]
        assert eager == captured  # one table row for both
        return eager

    fallback = "gluon" if gluon_runs else "two-pass"
    assert path(None, None) == (measured if gluon_runs or measured != "gluon" else fallback)
    assert path(False, None) == path(False, False) == "two-pass"
    assert path(True, None) == ("gluon" if gluon_runs else "atomic")
    assert path(True, False) == "atomic"
    assert path(None, False) == (measured if measured != "gluon" else "two-pass")
    if gluon_runs:
        assert path(None, True) == "gluon"
    else:
        with pytest.raises(ValueError, match="cannot run here"):
            path(None, True)
    monkeypatch.setattr(HOPPER, "BACKWARD_PATHS", {})
    assert path(None, None) == fallback


@pytest.mark.parametrize("measured", ["gluon", "portable"])
def test_forward_path_follows_the_table_unless_the_caller_chooses(monkeypatch, measured):
    monkeypatch.setattr(V2, "tuned_case", lambda q, causal: (64, causal, 1024))
    monkeypatch.setattr(HOPPER_FWD, "FORWARD_PATHS", {(64, False, 1024, False): measured})
    monkeypatch.setattr(HOPPER_FWD, "gluon_allowed", lambda q, k, v, ws, scale: ws is not False)
    q = torch.empty(1, 1, 8, 64, dtype=torch.float16)
    choose = partial(HOPPER_FWD.use_warp_specialized, q, q, q, False, 0.125)
    assert choose(None) == (measured == "gluon")
    assert choose(True) is True and choose(False) is False
    monkeypatch.setattr(HOPPER_FWD, "FORWARD_PATHS", {})
    assert choose(None) is True


def test_a_call_captured_in_a_cuda_graph_follows_the_pick_by_gpu_time(monkeypatch):
    # tools/tune.py measured both on an H100 at D = 128, N = 1024: back to back the host paced Gluon (portable
    # was the eager pick); replayed from a graph Gluon was 1.33x faster.
    monkeypatch.setattr(V2, "tuned_case", lambda q, causal: (128, causal, 1024))
    monkeypatch.setattr(HOPPER_FWD, "gluon_allowed", lambda *args: True)
    monkeypatch.setattr(HOPPER_FWD, "FORWARD_PATHS", {(128, False, 1024, False): "portable",
                                                      (128, False, 1024, True): "gluon"})
    monkeypatch.setattr(HOPPER, "BACKWARD_PATHS", {(128, False, 1024, False): "two-pass",
                                                   (128, False, 1024, True): "gluon"})
    q = torch.empty(1, 1, 8, 128, dtype=torch.float16)
    # The forward by the capture of the call; the backward's two picks both, for the backward's own capture.
    for captured in (False, True):
        monkeypatch.setattr(stepkit, "capturing", lambda: captured)
        assert HOPPER.choose_paths(q, q, q, False, 0.125, None, None) == (captured, ("two-pass", "gluon"))
    monkeypatch.setattr(stepkit, "capturing", lambda: False)
    assert stepkit.path_key(None) is None and stepkit.path_key((64, True, 2048)) == (64, True, 2048, False)


def test_a_backward_runs_the_pick_for_its_own_capture(monkeypatch):
    # A training step may run its forward eagerly and capture only the backward, as lesson 14's benchmark does:
    # the backward reads the capture when it runs, not when the forward chose.
    ran = []
    monkeypatch.setattr(HOPPER, "_ws_backward", lambda q, k, v, *rest: ran.append("gluon") or (q, k, v))
    monkeypatch.setattr(HOPPER.V2_BWD, "backward", lambda q, k, v, *rest: ran.append("two-pass") or (q, k, v))
    monkeypatch.setattr(HOPPER.V2_BWD, "backward_preprocess", lambda o, do: (None, None))
    q, k, v = (torch.randn(1, 1, 8, 64, requires_grad=True) for _ in range(3))
    out = HOPPER._AttentionHopper.apply(q, k, v, False, 0.125, False, stepkit.Settled(False), ("two-pass", "gluon"))
    for captured in (False, True):
        monkeypatch.setattr(stepkit, "capturing", lambda: captured)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out), retain_graph=True)
    assert ran == ["two-pass", "gluon"]


def test_a_table_without_captured_picks_serves_its_eager_pick_to_captured_calls(monkeypatch):
    rows = [{"D": 64, "causal": False, "N": 1024, "path": "portable"},  # written before the captured picks
            {"D": 64, "causal": False, "N": 2048, "path": "portable", "captured": "gluon", "ms": {}}]
    monkeypatch.setattr(stepkit, "tuned_table", lambda name: {"rows": rows})
    assert HOPPER_FWD.paths_table("forward-paths") == {
        (64, False, 1024, False): "portable", (64, False, 1024, True): "portable",
        (64, False, 2048, False): "portable", (64, False, 2048, True): "gluon"}


def test_the_gluon_check_runs_only_when_its_answer_matters(monkeypatch):
    # Asking whether the Gluon kernels can take the inputs costs host time on every call: where the tables
    # pick the portable kernels, a call must not ask; where they pick Gluon, it asks once for both choices.
    asked = []
    monkeypatch.setattr(V2, "tuned_case", lambda q, causal: (64, causal, 1024))
    monkeypatch.setattr(HOPPER_FWD, "gluon_allowed", lambda *args: asked.append(args) or True)
    q = torch.empty(1, 1, 8, 64, dtype=torch.float16)
    for forward, backward, expected in (("portable", "two-pass", 0), ("portable", "atomic", 0),
                                        ("gluon", "two-pass", 1), ("portable", "gluon", 1), ("gluon", "gluon", 1)):
        monkeypatch.setattr(HOPPER_FWD, "FORWARD_PATHS", {(64, True, 1024, False): forward})
        monkeypatch.setattr(HOPPER, "BACKWARD_PATHS", {(64, True, 1024, c): backward for c in (False, True)})
        asked.clear()
        assert HOPPER.choose_paths(q, q, q, True, 0.125, None, None) == (forward == "gluon", (backward,) * 2)
        assert len(asked) == expected, (forward, backward, asked)
    with pytest.raises(TypeError, match="warp_specialized must be None, True or False"):
        HOPPER.choose_paths(q, q, q, True, 0.125, None, 0)
    with pytest.raises(TypeError, match="atomic_dq must be None, True or False"):
        HOPPER.choose_paths(q, q, q, True, 0.125, 1, None)
    with pytest.raises(TypeError, match="warp_specialized must be None, True or False"):
        HOPPER_FWD.use_warp_specialized(q, q, q, True, 0.125, "yes")


@pytest.mark.parametrize("ratio, text", [(0.5, "0.50x"), (0.998, "0.998x"), (0.99997, "0.99997x"), (1.0005, "1.00x")])
def test_the_default_paths_best_ratio_under_one_does_not_print_as_one(ratio, text):
    assert HOPPER_FWD.kit.below_one(ratio) == text


def test_the_attention_blocks_diagram_draws_on_a_cpu():
    """Lesson 05's picture: the causal grid of query against key blocks (one patch per block, the
    focus row outlined) and one query block's S -> P -> O walk, no wider than the page allows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = stepkit.draw_attention_blocks(n_blocks=5, focus=2)
    try:
        grid, flow = fig.axes
        assert len(grid.patches) == 5 * 5 + 1  # every block, then the focus row's outline
        assert grid.patches[-1].get_width() == 3  # query block 2 walks key blocks 0 to 2
        texts = [t.get_text() for t in flow.texts]
        assert sum("S = Q_{2}" in t for t in texts) == 3
        assert texts.count("rescale") == 2  # between the three steps
        assert any("masked" in t for t in texts)
        assert fig.get_figwidth() <= 9
        fig.canvas.draw()
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="focus"):
        stepkit.draw_attention_blocks(n_blocks=4, focus=4)
