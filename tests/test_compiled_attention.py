"""Lesson 13's lessons::flash_forward: lesson 06's forward kernel registered as an operator with
torch.library.triton_op, so that torch.compile(fullgraph=True) and CUDA graphs take it whole (issue 42, item 4).
Eager, it matches float64 on any machine; on a GPU, compiled, reduce-overhead and replayed calls match eager ones."""

import pytest
import stepkit
import torch
from lessons import load

L13 = load("13-hopper-forward-profiled")
FWD = load("11-hopper-forward-gluon")
DEVICE = stepkit.DEVICE
gpu_only = pytest.mark.skipif(not stepkit.ON_GPU, reason="torch.compile of a Triton operator needs a GPU")


def _inputs(B, H, N, D, dtype, generator, transposed=False):
    shape = (B, N, H, D) if transposed else (B, H, N, D)
    tensors = [torch.randn(shape, generator=generator).to(DEVICE, dtype) for _ in range(3)]
    return [t.transpose(1, 2) for t in tensors] if transposed else tensors


@pytest.mark.parametrize("N", [1, 77, 130])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_operator_matches_float64(N, D, causal, dtype):
    generator = stepkit.fresh_generator()
    q, k, v = _inputs(1, 2, N, D, dtype, generator, transposed=N == 77)  # a strided view too
    scale = D**-0.5
    got = L13.flash_forward(q, k, v, causal, scale)
    assert got.shape == q.shape and got.dtype == dtype and got.is_contiguous()
    expected = stepkit.reference_attention(q.double(), k.double(), v.double(), causal, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=stepkit.TOLERANCE[dtype], atol=stepkit.TOLERANCE[dtype])


def test_a_negative_scale_is_right_too():
    q, k, v = _inputs(1, 1, 40, 64, torch.float16, stepkit.fresh_generator())
    expected = stepkit.reference_attention(q.double(), k.double(), v.double(), True, -0.2)
    torch.testing.assert_close(L13.flash_forward(q, k, v, True, -0.2).double(), expected, rtol=1e-2, atol=1e-2)


def test_the_operator_is_registered_once_however_often_the_lesson_loads():
    again = stepkit.load_lesson("13-hopper-forward-profiled")
    assert again.flash_forward is torch.ops.lessons.flash_forward is L13.flash_forward


@gpu_only
def test_opcheck_passes():
    q, k, v = _inputs(2, 3, 200, 64, torch.float16, stepkit.fresh_generator())
    torch.library.opcheck(torch.ops.lessons.flash_forward.default, (q, k, v, True, 0.125))


@gpu_only
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_and_reduce_overhead_match_eager_bit_for_bit(causal):
    q, k, v = _inputs(2, 4, 333, 128, torch.bfloat16, stepkit.fresh_generator())
    eager = L13.flash_attention(q, k, v, 0.09, causal)
    compiled = torch.compile(L13.flash_attention, fullgraph=True)
    graphed = torch.compile(L13.flash_attention, fullgraph=True, mode="reduce-overhead")
    assert torch.equal(compiled(q, k, v, 0.09, causal), eager)
    for _ in range(3):  # reduce-overhead records its CUDA graph after warm-up calls
        out = graphed(q, k, v, 0.09, causal)
    assert torch.equal(out, eager)


@gpu_only
def test_a_recorded_attention_replays_new_inputs():
    generator = stepkit.fresh_generator()
    q, k, v = _inputs(2, 4, 1000, 64, torch.float16, generator)
    replay, recorded = stepkit.captured(FWD.attention, q, k, v, True, 0.125)
    for _ in range(2):  # new values in the recorded inputs, as a server's next step
        for t, new in zip((q, k, v), _inputs(2, 4, 1000, 64, torch.float16, generator)):
            t.copy_(new)
        replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(recorded, FWD.attention(q, k, v, True, 0.125), rtol=2e-3, atol=2e-3)


@gpu_only
def test_the_pages_host_free_calls_check_their_outputs_and_all_run():
    q, k, v = _inputs(4, 32, 1024, 64, torch.float16, stepkit.fresh_generator())
    calls = L13.host_free_calls(q, k, v, 0.125)  # raises where an output is off
    assert list(calls) == ["plain SDPA", "flash_forward, eager", "flash_forward, torch.compile",
                           "... mode='reduce-overhead'", "attention, CUDA graph replay"]
    for call in calls.values():
        call()
    torch.cuda.synchronize()
