"""Lesson 09, the Gluon primer: its kernels compile for sm_90a on any machine with the facts the page reads from
them, its layout reader agrees with the PTX ISA's wgmma accumulator fragment, its diagrams draw on a CPU, and
its two exercise checks accept a reader's right answers and reject wrong ones. The solutions live here, not on
the page. Tests marked `hopper` run the kernels and need a Hopper GPU."""

import re

import numpy as np
import pytest
import torch
from lessons import load

# Loaded before Triton is imported: the lesson's stepkit switches the interpreter on where there is no GPU.
L = load("09-gluon-primer")

import triton  # noqa: E402

gluon, gl, mbarrier, tma_load = L.gluon, L.gl, L.mbarrier, L.tma_load
hopper = pytest.mark.skipif(L.why_not_run() is not None, reason="runs Gluon kernels: needs a Hopper GPU")


def test_this_triton_has_every_name_the_primer_uses():
    assert L.gluon_problem() is None


def test_a_moved_name_is_reported_by_name_not_by_a_traceback(monkeypatch):
    monkeypatch.setitem(L.USED, "gl", [*L.USED["gl"], "NoSuchLayout"])
    message = L.gluon_problem()
    assert "gl.NoSuchLayout" in message and "3.6.0" in message
    monkeypatch.setattr(L, "IMPORT_PROBLEM", "cannot import name 'tma'")
    assert "moved" in L.gluon_problem() and "cannot import name 'tma'" in L.gluon_problem()


def test_owners_of_a_blocked_layout():
    held = L.owners(gl.BlockedLayout([4], [32], [4], [0]), [1024])
    thread = held["warp"] * 32 + held["lane"]
    for t in (0, 5, 127):
        assert np.flatnonzero(thread == t).tolist() == [*range(4 * t, 4 * t + 4), *range(512 + 4 * t, 516 + 4 * t)]


def test_owners_of_the_wgmma_accumulator_match_the_ptx_isa_fragment():
    """PTX ISA, wgmma's m64nNk16 f32 accumulator: warp w holds rows 16w..16w+15; lane l holds rows 16w + l // 4
    and 16w + l // 4 + 8, columns 8i + 2 (l % 4) and the next one."""
    n = 32
    held = L.owners(L.accumulator_layout(n), [64, n])
    rows, cols = np.indices((64, n))
    assert (held["warp"] == rows // 16).all()
    assert (held["lane"] == (rows % 8) * 4 + (cols % 8) // 2).all()
    owners = set(zip(held["warp"].flat, held["lane"].flat, held["register"].flat))
    assert len(owners) == 64 * n  # every element held once, none twice


def _ptx(compiled, pattern):
    return re.findall(pattern, compiled.asm["ptx"])


def test_primer_kernels_compile_for_sm90a_with_the_facts_the_page_reads():
    copier = L.compile_for_hopper(L.copy_kernel, x_ptr="*fp32", y_ptr="*fp32", n="i32", BLOCK=1024, VEC=4,
                                  multiples_of_16=["n"])
    facts = L.compiled_facts(copier)
    assert (facts["warps"], facts["reqntid"], facts["maxnreg"], facts["shared"]) == (4, 128, None, 0)
    assert _ptx(copier, r"ld\.global\.v4\.b32") and facts["registers"] > 0
    box = L.descriptor_type([64, 64])
    tma = L.compile_for_hopper(L.tma_copy_kernel, in_desc=box, out_desc=box, tiles="i32")
    assert tma.metadata.shared == 64 * 64 * 2 + 8
    assert _ptx(tma, r"cp\.async\.bulk\.tensor\.2d\S*mbarrier::complete_tx") and _ptx(tma, r"try_wait\.parity")
    for a_in_registers in (False, True):
        assert len(_ptx(L.compile_mma(a_in_registers), r"wgmma\.mma_async\.sync\.aligned\.m64n64k16")) == 2
    with pytest.raises(triton.CompilationError, match="first operand to be in registers"):
        L.compile_mma(False, b_in_registers=True)


@gluon.jit
def _sum_of_rows(x_ptr, y_ptr, rows, N: gl.constexpr):
    # One warp sums rows of N floats: the running sum, N / 32 values a thread, stays live across the loop.
    layout: gl.constexpr = gl.BlockedLayout([N // 32], [32], [1], [0])
    offs = gl.arange(0, N, layout)
    total = gl.zeros([N], gl.float32, layout)
    for r in range(rows):
        total += gl.load(x_ptr + r * N + offs)
    gl.store(y_ptr + offs, total)


def test_local_memory_counts_the_spills_that_ptxas_puts_in_the_stack_frame():
    # cuobjdump reports spills under STACK, not LOCAL: a fact read from LOCAL alone said 0 for a kernel that spills.
    def facts(n):
        return L.compiled_facts(L.compile_for_hopper(_sum_of_rows, num_warps=1, x_ptr="*fp32", y_ptr="*fp32",
                                                     rows="i32", N=n))

    assert facts(1024)["local"] == 0  # 32 values a thread: registers suffice
    spilled = facts(16384)  # 512 values a thread, past the 255 registers a thread can have
    assert spilled["registers"] <= 255 and spilled["local"] >= 4 * (512 - 255)


def test_warp_specialize_pads_to_warp_groups_and_setmaxnreg_splits_the_budget():
    one = L.compiled_facts(L.compile_ring(1))
    assert (one["warps"], one["reqntid"]) == (8, 256)  # 4 + 1 working warps, padded to 2 warp groups
    two = L.compile_ring(2)
    facts = L.compiled_facts(two)
    assert (facts["warps"], facts["reqntid"], facts["maxnreg"]) == (12, 384, 168)
    moves = L.partition_registers(two, [L._ring_consumer, L._ring_producer])
    assert moves == {"_ring_consumer": {240}, "_ring_producer": {24}}
    assert 128 * (240 + 240 + 24) <= 65536


def test_the_facts_line_says_when_a_kernel_has_no_register_cap(capsys):
    copier = L.compile_for_hopper(L.copy_kernel, x_ptr="*fp32", y_ptr="*fp32", n="i32", BLOCK=1024, VEC=4)
    L.show_facts("copy_kernel", copier, r"ld\.global[.\w]*")
    L.show_facts("ring_kernel", L.compile_ring(2), r"setmaxnreg\.\w+")
    first, second = capsys.readouterr().out.splitlines()
    assert "no .maxnreg" in first and "None" not in first
    assert ".maxnreg 168," in second


def test_ring_timeline_follows_the_ring_rules():
    times = L.ring_timeline(tiles=8)
    for t, (start, landed, use, done) in enumerate(times):
        assert start < landed <= use < done
        if t >= 2:
            assert start >= times[t - 2][3]  # the slot's previous tile has been used
        if t >= 1:
            assert use >= times[t - 1][3] and start >= times[t - 1][0]


def test_the_diagrams_draw_without_a_gpu(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda: None)
    plt.close("all")  # figures that other tests in this worker left open
    L.draw_accumulator()
    L.draw_ring_timeline()
    two = L.compile_ring(2)
    L.draw_register_budget(L.compiled_facts(two), 240, 24)
    L.draw_shared_budget({"ring_kernel, 2 groups": (two, {"slots": 4 * 64 * 64 * 2, "mbarriers": 32})})
    assert len(plt.get_fignums()) == 4
    plt.close("all")


# -- Exercise 1: a deeper ring. The solution: ring_kernel with STAGES slots; mistakes switched on by flags. ---------


@gluon.jit
def _deep_producer(desc, ring, full, empty, tiles, STAGES: gl.constexpr):
    for t in range(tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(slot), desc.block_type.nbytes)
        tma_load(desc, [t * desc.block_type.shape[0], 0], full.index(slot), ring.index(slot))


@gluon.jit
def _deep_consumer(ring, full, empty, y_ptr, tiles, GROUP: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
                   STAGES: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    total = gl.zeros([ROWS, COLS], gl.float32, layout)
    for t in range(tiles):
        slot = t % STAGES
        mbarrier.wait(full.index(slot), (t // STAGES) & 1)
        total += ring.index(slot).slice(GROUP * ROWS, ROWS).load(layout).to(gl.float32)
        mbarrier.arrive(empty.index(slot), count=1)
    rows = GROUP * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    gl.store(y_ptr + rows[:, None] * COLS + cols[None, :], total)


@gluon.jit
def deep_ring_kernel(desc, y_ptr, tiles, GROUPS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                     PRODUCER_REGISTERS: gl.constexpr, STAGES: gl.constexpr, SLOTS_ALLOCATED: gl.constexpr = 0,
                     BROKEN: gl.constexpr = False):
    """SLOTS_ALLOCATED, where not 0: a ring allocated with that many slots whatever STAGES says. BROKEN: a call
    that does not compile."""
    BLOCK_M: gl.constexpr = desc.block_type.shape[0]
    COLS: gl.constexpr = desc.block_type.shape[1]
    ROWS: gl.constexpr = BLOCK_M // GROUPS
    SLOTS: gl.constexpr = SLOTS_ALLOCATED if SLOTS_ALLOCATED else STAGES
    ring = gl.allocate_shared_memory(desc.dtype, [SLOTS, BLOCK_M, COLS], desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(SLOTS):
        mbarrier.init(full.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=GROUPS)
    if BROKEN:
        gl.no_such_function(ring)
    gl.warp_specialize([
        (_deep_consumer, (ring, full, empty, y_ptr, tiles, 0, ROWS, COLS, SLOTS)),
        (_deep_consumer, (ring, full, empty, y_ptr, tiles, 1, ROWS, COLS, SLOTS)),
        (_deep_producer, (desc, ring, full, empty, tiles, SLOTS)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


DEEPEST = 7  # 7 x 32 KiB tiles, 14 barriers and Triton's own bytes fit in 227 KiB; 8 tiles are 256 KiB


def test_deeper_ring_accepts_the_deepest_ring_that_fits(capsys):
    L.check_ring_depth(deep_ring_kernel, DEEPEST)
    assert "deepest ring that fits" in capsys.readouterr().out


@pytest.mark.parametrize("stages, error", [(DEEPEST - 1, "so does a deeper ring"), (DEEPEST + 1, "more than an H100"),
                                            (2, "so does a deeper ring")])
def test_deeper_ring_rejects_depths_that_are_not_the_deepest(stages, error):
    with pytest.raises(AssertionError, match=error) as failure:
        L.check_ring_depth(deep_ring_kernel, stages)
    assert f"STAGES = {DEEPEST} " not in str(failure.value) + " "  # the answer stays unsaid


@gluon.jit
def two_slots_kernel(desc, y_ptr, tiles, GROUPS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                     PRODUCER_REGISTERS: gl.constexpr, STAGES: gl.constexpr):
    """A mistake: STAGES taken, but the ring keeps its 2 slots."""
    deep_ring_kernel(desc, y_ptr, tiles, GROUPS, CONSUMER_REGISTERS, PRODUCER_REGISTERS, STAGES, 2)


@gluon.jit
def broken_kernel(desc, y_ptr, tiles, GROUPS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                  PRODUCER_REGISTERS: gl.constexpr, STAGES: gl.constexpr):
    deep_ring_kernel(desc, y_ptr, tiles, GROUPS, CONSUMER_REGISTERS, PRODUCER_REGISTERS, STAGES, 0, True)


def test_deeper_ring_rejects_a_ring_that_does_not_grow_with_stages():
    with pytest.raises(AssertionError, match="allocate STAGES slots"):
        L.check_ring_depth(two_slots_kernel, DEEPEST)


def test_deeper_ring_says_where_a_kernel_does_not_compile():
    with pytest.raises(AssertionError, match="does not compile for sm_90a"):
        L.check_ring_depth(broken_kernel, DEEPEST)


@gluon.jit
def renamed_kernel(tile_desc, y_ptr, tiles, GROUPS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
                   PRODUCER_REGISTERS: gl.constexpr, STAGES: gl.constexpr):
    """A mistake: ring_kernel's first argument renamed, which compile_ring cannot pass by name."""
    deep_ring_kernel(tile_desc, y_ptr, tiles, GROUPS, CONSUMER_REGISTERS, PRODUCER_REGISTERS, STAGES)


@pytest.mark.parametrize("kernel", [renamed_kernel, L.ring_kernel, deep_ring_kernel.fn])
def test_deeper_ring_names_the_arguments_a_kernel_must_keep(kernel):
    with pytest.raises(TypeError, match="desc, y_ptr, tiles, GROUPS, CONSUMER_REGISTERS, PRODUCER_REGISTERS, STAGES"):
        L.check_ring_depth(kernel, DEEPEST)


@pytest.mark.parametrize("stages, error", [("7", TypeError), (True, TypeError), (0, ValueError), (7.0, TypeError)])
def test_deeper_ring_refuses_what_is_no_depth(stages, error):
    with pytest.raises(error, match="stages"):
        L.check_ring_depth(deep_ring_kernel, stages)


# -- Exercise 2: a busier producer. The answer: (65,536 / 128 - 56) / 2 = 228, down to a multiple of 8. -----------

BUSIER = 224


def test_busier_producer_accepts_equal_groups(capsys):
    L.check_busier_producer(BUSIER)
    assert "both consumer groups get" in capsys.readouterr().out


@pytest.mark.parametrize("count, error", [(BUSIER + 8, "gets fewer"), (240, "gets fewer"), (BUSIER - 8, "gets more"),
                                           (128, "gets more")])
def test_busier_producer_rejects_unequal_groups(count, error):
    with pytest.raises(AssertionError, match=error) as failure:
        L.check_busier_producer(count)
    assert str(BUSIER) not in str(failure.value)


@pytest.mark.parametrize("count, error", [(230, ValueError), (16, ValueError), (264, ValueError), ("224", TypeError)])
def test_busier_producer_refuses_what_is_no_register_count(count, error):
    with pytest.raises(error, match="consumer_registers"):
        L.check_busier_producer(count)


# -- On a Hopper GPU ------------------------------------------------------------------------------------------------


@hopper
def test_every_primer_kernel_matches_pytorch_on_the_gpu(capsys):
    L.check_on_gpu()
    assert "matches float64" in capsys.readouterr().out


@hopper
def test_deeper_ring_runs_the_solution_on_the_gpu(capsys):
    L.check_ring_depth(deep_ring_kernel, DEEPEST)
    assert "sums" in capsys.readouterr().out


@hopper
def test_ring_sum_goes_around_the_ring_many_times():
    x = torch.randn(64 * 2 * 101, 64, device=L.kit.DEVICE, dtype=torch.float16)
    expected = x.double().view(101, 128, 64).sum(0)
    torch.testing.assert_close(L.ring_sum(x, 2).double(), expected, rtol=1e-5, atol=1e-4)
