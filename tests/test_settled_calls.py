"""Lesson 11's settled_paths: a call's checks and path choice run once per layout of its inputs (issue 42, item 3).
The cache must never let through what the checks refuse, nor key on data pointers: a training step's tensors are new.
(A call plan's TMA descriptors are kept by address, as what they are: a function of the address, once the layout is
fixed; the last test checks that.)
On the CPU the cache is off (the interpreter pays no launch cost); the logic is tested here with it switched on and a
stand-in for the path choice, and on a GPU through the real attention."""

import pytest
import stepkit
import torch
from lessons import load

FWD, HOPPER = load("11-hopper-forward-gluon"), load("14-hopper-backward-gluon")
V2 = load("06-fused-attention-v2-forward")
gpu_only = pytest.mark.skipif(not stepkit.ON_GPU, reason="the kernels' host path is a GPU question")


@pytest.fixture
def cache_on(monkeypatch):
    """settled_paths as on a GPU, with a layout key that needs no GPU, and a fresh cache; yields the list of
    calls that reached the path choice."""
    monkeypatch.setattr(stepkit, "ON_GPU", True)
    monkeypatch.setattr(stepkit, "capturing", lambda: False)  # no CUDA to ask here
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(stepkit, "SETTLED", {})
    chosen = []

    def choose(q, k, v, causal, sm_scale, flag):
        FWD.check_flag("warp_specialized", flag)
        chosen.append((q.dtype, causal, sm_scale, flag))
        return "path"

    yield lambda *args, flag=None: stepkit.settled_paths(choose, *args, flag).paths, chosen


def _qkv(shape=(1, 2, 9, 64), dtype=torch.float16):
    return [torch.randn(shape).to(stepkit.DEVICE, dtype) for _ in range(3)]


def test_a_layout_is_checked_and_chosen_once_whatever_the_tensors(cache_on):
    settled, chosen = cache_on
    for _ in range(3):  # fresh tensors each time: new data pointers, one layout
        assert settled(*_qkv(), True, 0.125) == "path"
    assert len(chosen) == 1
    settled(*_qkv(dtype=torch.bfloat16), True, 0.125)
    settled(*_qkv(shape=(1, 2, 10, 64)), True, 0.125)
    settled(*[t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv()], True, 0.125)
    settled(*_qkv(), False, 0.125)
    settled(*_qkv(), True, 0.25)
    settled(*_qkv(), True, 0.125, flag=True)
    assert len(chosen) == 7


def test_each_choice_of_paths_is_settled_apart(cache_on):
    # Lessons 11 and 14 keep different paths in one cache: a layout settled by one must not answer for the other.
    settled, chosen = cache_on
    q, k, v = _qkv()
    settled(q, k, v, True, 0.125)
    other = stepkit.settled_paths(lambda *args: "other path", q, k, v, True, 0.125, None)
    assert other.paths == "other path" and settled(q, k, v, True, 0.125) == "path" and len(chosen) == 1


@pytest.mark.parametrize("bad, error, message", [
    (dict(causal=1), TypeError, "causal must be True or False"),
    (dict(sm_scale=True), TypeError, "sm_scale"),
    (dict(sm_scale=float("nan")), TypeError, "sm_scale must be a finite real number"),
    (dict(flag=1), TypeError, "warp_specialized must be None, True or False"),
    (dict(flag=[True]), TypeError, "warp_specialized must be None, True or False"),
])
def test_what_the_checks_refuse_is_refused_after_a_good_call_too(cache_on, bad, error, message):
    # 1 == True and hash(1) == hash(True): a key without types would hand these the settled path.
    settled, _ = cache_on
    good = dict(causal=True, sm_scale=1, flag=True)
    settled(*_qkv(), good["causal"], good["sm_scale"], flag=good["flag"])
    args = {**good, **bad}
    for _ in range(2):
        with pytest.raises(error, match=message):
            settled(*_qkv(), args["causal"], args["sm_scale"], flag=args["flag"])


def test_inputs_the_checks_refuse_are_refused_after_a_good_call_with_their_layout(cache_on):
    settled, _ = cache_on
    q, k, v = _qkv()
    settled(q, k, v, False, 0.5)
    with pytest.raises(TypeError, match="same dtype"):
        settled(q, k.bfloat16(), v, False, 0.5)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        settled(q, k, v.tolist(), False, 0.5)


def test_negated_views_and_subclasses_take_the_long_way_every_time(cache_on):
    settled, chosen = cache_on
    q, k, v = _qkv()
    negated = torch._neg_view(k)  # a lazy negation: the kernel must read resolved values
    assert negated.is_neg()
    for _ in range(2):
        settled(q, negated, v, False, 0.5)
        settled(torch.nn.Parameter(q), k, v, False, 0.5)
    assert len(chosen) == 4
    assert stepkit.settled_key(q, negated, v, False, 0.5) is None


def test_an_unhashable_argument_reaches_the_checks_and_nothing_is_kept(cache_on):
    settled, chosen = cache_on
    with pytest.raises(TypeError, match="sm_scale"):
        settled(*_qkv(), False, [0.5])
    assert not chosen and not stepkit.SETTLED


def test_off_a_gpu_nothing_is_kept():
    if stepkit.ON_GPU:
        pytest.skip("a CPU fact")
    q, k, v = _qkv()
    assert stepkit.settled_key(q, k, v, True, 0.125) is None
    FWD.attention(q, k, v, True, 0.125)
    assert not stepkit.SETTLED


@gpu_only
@pytest.mark.parametrize("lesson", [FWD, HOPPER], ids=["11", "14"])
@pytest.mark.parametrize("causal", [False, True])
def test_settled_calls_match_float64_with_and_without_grad(lesson, causal):
    generator = stepkit.fresh_generator()
    for grad in (False, False, True, True):  # the second of each runs settled
        qkv = [torch.randn(2, 3, 333, 128, generator=generator).to("cuda", torch.bfloat16).requires_grad_(grad)
               for _ in range(3)]
        exact = [t.detach().double().requires_grad_(grad) for t in qkv]
        out = lesson.attention(*qkv, causal, 0.09)
        expected = stepkit.reference_attention(*exact, causal, 0.09)
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
        assert out.requires_grad == grad
        if grad:
            dout = torch.randn_like(out)
            got = torch.autograd.grad(out, qkv, dout)
            want = torch.autograd.grad(expected, exact, dout.double())
            for g, w in zip(got, want):
                torch.testing.assert_close(g.double(), w, rtol=5e-2, atol=5e-2)


@gpu_only
def test_a_settled_call_skips_the_checks_and_the_choice(monkeypatch):
    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    first = FWD.attention(q, k, v, False, 0.125)

    def refuse(*args):
        raise AssertionError("ran again")

    monkeypatch.setattr(stepkit, "check_attention_inputs", refuse)
    monkeypatch.setattr(FWD, "forward_choice", refuse)  # inside the choice (itself part of the key)
    assert torch.equal(FWD.attention(q.clone(), k.clone(), v.clone(), False, 0.125), first)
    with pytest.raises(AssertionError, match="ran again"):
        FWD.attention(q, k, v, False, 0.25)  # another scale: not settled


def test_a_call_being_captured_is_settled_apart(cache_on, monkeypatch):
    # Its path may differ (the tables' pick by GPU time): a layout settled eagerly must not answer for it.
    settled, chosen = cache_on
    q, k, v = _qkv()
    for captured in (False, True, False, True):
        monkeypatch.setattr(stepkit, "capturing", lambda: captured)
        settled(q, k, v, True, 0.125)
    assert len(chosen) == 2


ON_HOPPER = stepkit.ON_GPU and torch.cuda.get_device_capability()[0] == 9


@gpu_only
@pytest.mark.parametrize("ws", [False, True] if ON_HOPPER else [False], ids=lambda ws: "gluon" if ws else "portable")
@pytest.mark.parametrize("c_launch", [True, False], ids=["C launch", "Triton's launcher"])
def test_a_call_plan_gives_the_bits_of_tritons_own_launcher_on_fresh_inputs(monkeypatch, ws, c_launch):
    # Both ways a plan launches: straight into Triton 3.6's C launch, and through Triton's launcher (other versions).
    stepkit.SETTLED.clear()
    V2.PLANS.clear()
    if not c_launch:
        monkeypatch.setattr(stepkit, "_c_launch", lambda *args: None)

    def fresh():
        return [torch.randn(2, 3, 333, 128, device="cuda", dtype=torch.float16) for _ in range(3)]

    FWD.attention(*fresh(), False, 0.09, warp_specialized=ws)  # settles the layout, leaves its call plan
    q, k, v = fresh()
    V2.PLANS.clear()  # so that this forward launches through Triton's JIT and its own launcher
    long_way = FWD.forward(q, k, v, False, 0.09, ws)[0]

    def refuse(*args, **kwargs):
        raise AssertionError("took the long way")

    monkeypatch.setattr(FWD, "forward", refuse)
    assert torch.equal(FWD.attention(q, k, v, False, 0.09, warp_specialized=ws), long_way)


@gpu_only
def test_a_call_plan_calls_tritons_launch_hooks_while_a_profiler_sets_them(monkeypatch):
    import triton

    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    FWD.attention(q, k, v, False, 0.125)
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", seen.append)
    FWD.attention(q, k, v, False, 0.125)
    assert len(seen) == 1
    monkeypatch.undo()
    chain = triton.knobs.runtime.launch_enter_hook  # a chain of hooks, as profilers add theirs (Triton 3.6, 3.9)
    chain.add(seen.append)
    try:
        FWD.attention(q, k, v, False, 0.125)
    finally:
        chain.remove(seen.append)
    assert len(seen) == 2
    FWD.attention(q, k, v, False, 0.125)  # the chain empty again: no hook set
    assert len(seen) == 2


def test_a_launch_hook_counts_as_set_only_when_there_is_one():
    # Triton's default hooks are empty chains, never None: taking those for a listening profiler
    # would send every planned launch the long way.
    from types import SimpleNamespace

    import triton

    def hooks(enter, leave=None):
        return SimpleNamespace(launch_enter_hook=enter, launch_exit_hook=leave)

    chain = triton.knobs.HookChain()
    assert not stepkit.hooks_set(hooks(None)) and not stepkit.hooks_set(hooks(chain, chain))
    assert stepkit.hooks_set(hooks(print)) and stepkit.hooks_set(hooks(None, print))
    chain.add(print)
    assert stepkit.hooks_set(hooks(chain)) and stepkit.hooks_set(hooks(None, chain))
    assert not stepkit.hooks_set()  # Triton's own, here: none set


@gpu_only
@pytest.mark.skipif(not stepkit.ON_GPU or not __import__("triton").__version__.startswith("3.6."),
                    reason="the C launch is bound as Triton 3.6 lays it out")
@pytest.mark.parametrize("ws", [False, True] if ON_HOPPER else [False], ids=lambda ws: "gluon" if ws else "portable")
def test_on_triton_3_6_a_call_plan_launches_through_the_c_function(monkeypatch, ws):
    # Else the plans would fall back to Triton's launcher unnoticed, at twice its host time.
    stepkit.SETTLED.clear()
    V2.PLANS.clear()
    bound = []
    c_launch = stepkit._c_launch
    monkeypatch.setattr(stepkit, "_c_launch", lambda *args: bound.append(c_launch(*args)) or bound[-1])
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    FWD.attention(q, k, v, False, 0.125, warp_specialized=ws)
    assert bound and all(direct is not None for direct in bound)


@pytest.mark.parametrize("ws", [False, True] if ON_HOPPER else [False], ids=lambda ws: "gluon" if ws else "portable")
@pytest.mark.parametrize("causal", [False, True])
def test_a_forward_that_keeps_no_lse_writes_the_same_output(ws, causal):
    # A call needing no gradient runs the kernels with STORE_LSE off: the output must not change by a bit.
    generator = stepkit.fresh_generator()
    q, k, v = (torch.randn(2, 3, 77, 64, generator=generator).to(stepkit.DEVICE, torch.float16) for _ in range(3))
    o, lse = FWD.forward(q, k, v, causal, 0.125, ws)
    o_alone, none = FWD.forward(q, k, v, causal, 0.125, ws, keep_lse=False)
    assert none is None and lse.shape == (6, 77) and torch.isfinite(lse).all()
    assert torch.equal(o_alone, o)
    stepkit.SETTLED.clear()
    for _ in range(2):  # the first call of the layout leaves the plan that keeps no LSE_2; the second runs it
        assert torch.equal(FWD.attention(q, k, v, causal, 0.125, warp_specialized=ws), o)


def test_a_triton_laid_out_otherwise_keeps_its_own_launcher():
    # The C launch is bound as Triton 3.6 lays it out; elsewhere (3.9 here, on the CPU) plans go through Triton's
    # launcher, and nothing of the CompiledKernel is read for it.
    from triton.backends.nvidia import driver

    if getattr(driver, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO":
        pytest.skip("Triton 3.6's launcher: the GPU tests above cover it")
    assert stepkit._c_launch(object(), []) is None


@gpu_only
@pytest.mark.skipif(not ON_HOPPER or not __import__("triton").__version__.startswith("3.6."),
                    reason="the C launch encodes Gluon's descriptors itself on Triton 3.6")
def test_a_descriptor_kept_for_an_address_describes_whatever_tensor_is_there_later(monkeypatch):
    # A plan keeps the TMA descriptors it encoded, by address: they must serve new values at an address seen
    # before, and addresses never seen must be encoded anew, past the bound too.
    import triton

    utils = triton.runtime.driver.active.utils
    encoded, encode = [], utils.fill_tma_descriptor
    monkeypatch.setattr(utils, "fill_tma_descriptor", lambda address, *rest: encoded.append(address)
                        or encode(address, *rest))
    stepkit.SETTLED.clear()
    V2.PLANS.clear()
    generator = stepkit.fresh_generator()

    def fresh():
        return [torch.randn(2, 3, 333, 128, generator=generator).to("cuda", torch.float16) for _ in range(3)]

    def long_way(q, k, v):  # through Triton's JIT and its own launcher, the plans set aside
        kept = dict(V2.PLANS)
        V2.PLANS.clear()
        try:
            return FWD.forward(q, k, v, False, 0.09, True, keep_lse=False)[0]
        finally:
            V2.PLANS.clear()
            V2.PLANS.update(kept)

    def planned(q, k, v):
        before = len(encoded)
        o = FWD.attention(q, k, v, False, 0.09, warp_specialized=True)
        return o, encoded[before:]

    FWD.attention(*fresh(), False, 0.09, warp_specialized=True)  # settles the layout, leaves the plan
    q, k, v = fresh()
    o, new = planned(q, k, v)
    assert sorted(new) == sorted(t.data_ptr() for t in (q, k, v))
    assert torch.equal(o, long_way(q, k, v))
    for t, values in zip((q, k, v), fresh()):
        t.copy_(values)  # new values, same addresses: the kept descriptors serve
    o, new = planned(q, k, v)
    assert new == [] and torch.equal(o, long_way(q, k, v))
    sets = [fresh() for _ in range(70)]  # alive together: 70 addresses each, past the 64 kept
    for qkv in sets:
        o, new = planned(*qkv)
        assert len(new) == 3
    assert torch.equal(o, long_way(*sets[-1]))
    o, new = planned(q, k, v)  # let go when the bound was reached: encoded again, right
    assert len(new) == 3 and torch.equal(o, long_way(q, k, v))
