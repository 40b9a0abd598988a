"""FlexAttention as a peer of the attention benchmarks (stepkit.sdpa_providers): compiled
on a GPU, eager on the CPU. On the CPU these tests check the plumbing at small sizes: the
eager forward against float64, the causal block mask, the compiled path's settings (with
torch.compile's eager backend standing in for Inductor), and a PyTorch without
FlexAttention. On a GPU they check the compiled kernels forward and backward and that the
benchmark compiles them before it times them."""

import sys

import pytest
import stepkit as kit
import torch

# The eager path warns, once, that it materializes the scores: why only a GPU times it.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

on_the_cpu = pytest.mark.skipif(kit.ON_GPU, reason="on a GPU the provider is the compiled one")
on_a_gpu = pytest.mark.skipif(not kit.ON_GPU, reason="compiled FlexAttention is a GPU peer")


def flex(causal, scale):
    """The provider the lessons get from kit.sdpa_providers."""
    (name, fn), = kit.sdpa_providers(causal, scale, [kit.FLEX]).items()
    assert name == "FlexAttention"
    return fn


def qkv(N, dtype, rng, requires_grad=False, D=16):
    return [torch.randn(2, 3, N, D, dtype=dtype, generator=rng).requires_grad_(requires_grad)
            for _ in range(3)]


def reference(q, k, v, causal, scale):
    return kit.reference_attention(*(t.detach().double() for t in (q, k, v)), causal, scale)


def test_the_lessons_race_flexattention_on_a_gpu_only():
    # On the CPU it would run eagerly, forward only: not the FlexAttention users run.
    assert (kit.FLEX in kit.FAST_PEERS) == kit.ON_GPU
    assert kit.FLEX not in kit.FAST_SDPA and kit.FLEX not in kit.SDPA_PEERS
    assert set(kit.FAST_SDPA) <= set(kit.FAST_PEERS)


def test_sdpa_providers_name_a_peer_they_do_not_know():
    with pytest.raises(ValueError, match="unknown peer 'Flex'.*FlexAttention"):
        kit.sdpa_providers(False, 0.25, ["Flex"])
    with pytest.raises(TypeError, match="list of names"):
        kit.sdpa_providers(False, 0.25, "FlexAttention")


@on_the_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 37, 100])
def test_on_the_cpu_flexattention_is_eager_and_matches_float64(N, causal, dtype, rng):
    scale = 0.3  # not 1/sqrt(16), FlexAttention's default: the scale must reach it
    fn = flex(causal, scale)
    assert fn.compiled is False  # eager on the CPU, by choice: no page times it there
    q, k, v = qkv(N, dtype, rng)
    timer = kit.call_timer(fn, q, k, v)
    with timer.context():
        out = timer.make()()
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), reference(q, k, v, causal, scale),
                               rtol=tolerance, atol=tolerance)


@on_the_cpu
@pytest.mark.parametrize("causal", [False, True])
def test_a_cpu_backward_is_a_runtime_error_the_benchmark_skips_or_is_right(causal, rng):
    """PyTorch 2.13 refuses FlexAttention's backward on the CPU (NotImplementedError, a
    RuntimeError: measure() reports the case as skipped). Should a later PyTorch run it,
    its gradients must match float64's."""
    fn = flex(causal, 0.25)
    q, k, v = qkv(37, torch.float64, rng, requires_grad=True)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=rng)
    try:
        with fn.context():
            grads = torch.autograd.grad(fn(q, k, v), (q, k, v), dout, retain_graph=True)
    except RuntimeError as error:
        assert "backward" in str(error)
        return
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = kit.reference_attention(q64, k64, v64, causal, 0.25)
    for got, want in zip(grads, torch.autograd.grad(out, (q64, k64, v64), dout)):
        torch.testing.assert_close(got, want)


@on_the_cpu
def test_the_causal_block_mask_is_made_once_per_length_and_broadcasts(rng):
    causal, full = flex(True, 0.25), flex(False, 0.25)
    q, k, v = qkv(45, torch.float32, rng)
    before = kit._causal_block_mask.cache_info()
    causal(q, k, v)
    causal(q, k, v)
    after = kit._causal_block_mask.cache_info()
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 1
    full(q, k, v)  # no mask at all without causal masking
    assert kit._causal_block_mask.cache_info() == after
    mask = kit._causal_block_mask(45, 45, q.device)
    assert mask.shape == (1, 1, 45, 45)  # B and H None: one mask for every batch and head
    assert mask.mask_mod(0, 0, torch.tensor(3), torch.tensor(4)).item() is False


@pytest.fixture
def compiled_on_the_cpu(monkeypatch):
    """The GPU's compiled path, on the CPU: torch.compile with Dynamo's guards and
    recompile limit as on a GPU, its eager backend standing in for Inductor's kernels."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    monkeypatch.setattr(kit, "ON_GPU", True)
    monkeypatch.setattr(kit, "compiled_flex_attention", lambda: torch.compile(
        flex_attention, backend="eager", dynamic=False, fullgraph=True))
    yield
    torch._dynamo.reset()


@on_the_cpu
def test_the_compiled_path_has_room_for_the_shapes_and_fails_loudly_past_it(
        compiled_on_the_cpu, monkeypatch, rng):
    import torch._dynamo
    import torch._functorch.config

    limit = torch._dynamo.config.recompile_limit
    fn = flex(True, 0.25)
    assert fn.compiled is True
    with fn.context():
        assert torch._dynamo.config.recompile_limit == kit.FLEX_RECOMPILE_LIMIT
        assert torch._dynamo.config.fail_on_recompile_limit_hit
        assert not torch._functorch.config.donated_buffer  # backward_timer retains graphs
        for N in (1, 37, 100):  # a graph for each shape
            q, k, v = qkv(N, torch.float32, rng)
            torch.testing.assert_close(fn(q, k, v).double(), reference(q, k, v, True, 0.25),
                                       rtol=1e-5, atol=1e-5)
            with torch.compiler.set_stance("fail_on_recompile"):
                fn(q, k, v)  # the same shape again: the cached graph, no compile in a timing
    assert torch._dynamo.config.recompile_limit == limit  # only while fn's context is open
    monkeypatch.setattr(kit, "FLEX_RECOMPILE_LIMIT", 3)
    with fn.context(), pytest.raises(RuntimeError, match="recompile limit.*run eagerly"):
        fn(*qkv(50, torch.float32, rng))  # a fourth shape: an error, not a silent eager run


def test_without_flexattention_the_provider_says_why_and_the_benchmark_leaves_it_out(
        monkeypatch, capsys, rng):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)  # not importable
    reason = kit.flex_attention_missing()
    assert reason.startswith(f"PyTorch {torch.__version__} cannot import it")
    fn = flex(False, 0.25)
    assert fn.missing == reason
    with pytest.raises(RuntimeError, match="FlexAttention: PyTorch .* cannot import it"):
        fn(*qkv(8, torch.float32, rng))
    monkeypatch.setattr(kit, "PASSES", 1)
    rows = kit.attention_benchmark(
        [(1, 1, 16)], [8],
        lambda causal, D: kit.sdpa_providers(causal, D**-0.5, ["SDPA math", kit.FLEX]),
        ("fwd", "bwd"))
    assert {r["provider"] for r in rows} == {"SDPA math"} and len(rows) == 4
    out = capsys.readouterr().out
    assert out.count(f"FlexAttention left out: {reason}") == 1
    assert "skipped" not in out


def test_without_fail_on_recompile_limit_hit_flexattention_is_left_out(monkeypatch):
    """An older PyTorch could fall back to eager past the recompile limit, unnoticed."""
    import torch._dynamo

    monkeypatch.delattr(torch._dynamo.config, "fail_on_recompile_limit_hit")
    assert "fall back to eager unnoticed" in kit.flex_attention_missing()
    assert "fall back to eager" in flex(True, 0.25).missing


@on_a_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_compiled_flexattention_matches_float64_forward_and_backward(D, causal):
    scale = D**-0.5
    fn = flex(causal, scale)
    assert fn.compiled is True
    q, k, v = (torch.randn(2, 3, 1000, D, device="cuda", dtype=torch.float16) for _ in range(3))
    with fn.context():
        kit.check_against_float64(lambda q, k, v, causal, scale: fn(q, k, v), q, k, v,
                                  causal, scale, f"FlexAttention, D={D}, causal={causal}")


@on_a_gpu
def test_the_benchmark_compiles_flexattention_first_then_times_it_without_compiling(
        monkeypatch, capsys):
    """Every (mode, masking, length) gets rows, timed from CUDA graphs; the pass before
    timing compiled it, and a compile while timing would be an error."""
    def providers(causal, D):
        return kit.sdpa_providers(causal, D**-0.5, [kit.FLEX])

    real_measure = kit.measure

    def measure_without_compiling(timing_cases):
        with torch.compiler.set_stance("fail_on_recompile"):
            return real_measure(timing_cases)

    monkeypatch.setattr(kit, "measure", measure_without_compiling)
    rows = kit.attention_benchmark([(1, 2, 64)], [256, 1000], providers, ("fwd", "bwd"))
    out = capsys.readouterr().out
    assert "skipped" not in out, out
    assert "FlexAttention's torch.compile" in out
    assert len(rows) == 8 and {r["provider"] for r in rows} == {"FlexAttention"}
    assert {r["gpu_method"] for r in rows} == {"CUDA graph"}
