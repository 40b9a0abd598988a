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


@gpu_only
@pytest.mark.skipif(not stepkit.ON_GPU or FWD.warp_specialized_unsupported(
    *[torch.empty(1, 1, 8, 64, dtype=torch.float16, device=DEVICE)] * 3) is not None,
    reason="the captured picks choose between Gluon and portable kernels: a Hopper GPU")
@pytest.mark.parametrize("D, causal", [(64, False), (128, False), (128, True)])
def test_captured_calls_run_the_tables_captured_pick(monkeypatch, D, causal):
    """Issue 42, item 2, on the GPU itself: a forward captured in a CUDA graph, and a backward captured after an
    eager forward, launch the paths the tables pick for captured calls (at N = 1024 these differ from the eager
    picks in the shipped tables), and the replays give the eager call's result."""
    hopper = load("14-hopper-backward-gluon")
    key = (D, causal, 1024)
    if FWD.V2.tuned_case(torch.empty(1, 1, 1024, D, dtype=torch.float16, device=DEVICE), causal) != key:
        pytest.skip("the shipped tables were measured on another GPU")
    launched = []
    for module, name, path in ((FWD, "_ws_forward", "gluon"), (FWD.V2, "forward", "portable"),
                               (hopper, "_ws_backward", "gluon"), (hopper.V2_BWD, "backward", "other")):
        def record(*args, _run=getattr(module, name), _path=path, **kwargs):
            if stepkit.capturing():
                launched.append(_path)
            return _run(*args, **kwargs)
        monkeypatch.setattr(module, name, record)
    scale = D**-0.5
    q, k, v = (t.requires_grad_() for t in _inputs(2, 8, 1024, D, torch.float16, stepkit.fresh_generator()))
    stream = torch.cuda.Stream()  # capture needs a stream of its own, and a backward runs on its forward's
    with torch.cuda.stream(stream):
        for ws in (True, False):  # compiled before the captures
            out = hopper.attention(q, k, v, causal, scale, warp_specialized=ws)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        with torch.no_grad():
            eager = hopper.attention(q, k, v, causal, scale)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                recorded = hopper.attention(q, k, v, causal, scale)
            graph.replay()
        torch.cuda.synchronize()
        assert launched == [FWD.FORWARD_PATHS[key + (True,)]]
        torch.testing.assert_close(recorded, eager, rtol=2e-3, atol=2e-3)

        launched.clear()
        out = hopper.attention(q, k, v, causal, scale)  # eager: the backward alone is captured
        dout = torch.randn_like(out)
        expected = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        graph.replay()
        torch.cuda.synchronize()
    assert launched == ["gluon" if hopper.BACKWARD_PATHS[key + (True,)] == "gluon" else "other"]
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
