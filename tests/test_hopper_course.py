"""Lessons 11 and 13 as a course: the roles' timeline follows the ring's rules, the register layout drawn is the
kernel's own, the shared-memory budget computed from the constexprs agrees with the kernel compiled for sm_90a (on a
CPU too, where a fresh Python compiles it), the backward's ownership picture, and lesson 12's exercise 3 check, which
accepts the right depths and rejects realistic wrong ones. The solution lives here, not on the page."""

import re

import matplotlib
import numpy as np
import pytest
import stepkit
import torch
from lessons import load

matplotlib.use("Agg")

L09 = load("09-gluon-primer")
FWD = load("11-hopper-forward-gluon")
L12 = load("12-hopper-forward-profiled")
BWD = load("13-hopper-backward-gluon")
SOLUTION = {64: 5, 32: 11}  # the deepest rings of 64- and 32-key tiles at D = 128 on an H100


# -- The roles' timeline: kit.role_timeline by the ring's rules --------------------------------------------------------


def _bars(bars, lane, label):
    """(start, end) of the bar labelled label in lane."""
    (start, length), = [(s, n) for s, n, text, _ in bars[lane] if text == label]
    return start, start + length


@pytest.mark.parametrize("blocks, stages, copy", [(4, 2, 0.5), (6, 2, 1.5), (5, 3, 0.2), (3, 1, 0.5)])
def test_the_role_timeline_follows_the_rings_rules(blocks, stages, copy):
    product = 1.0
    bars = stepkit.role_timeline(FWD.ring_slot, blocks, stages, copy=copy, product=product, exp=0.9)
    groups = ["consumer group 0", "consumer group 1"]
    copies = [label for _, _, label, _ in bars["loader warp"]]
    assert copies == ["Q"] + [f"{x}{j}\n→{FWD.ring_slot(j, stages)[0]}" for j in range(blocks) for x in "KV"]
    loads = sorted(bars["loader warp"])
    assert all(a[0] + a[1] <= b[0] + 1e-9 for a, b in zip(loads, loads[1:]))  # one copy at a time
    products = sorted((s, s + n) for g in groups for s, n, _, kind in bars[g] if kind == "product")
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(products, products[1:]))  # the tensor cores: one at a time
    landed = {label.split("\n")[0]: start + length for start, length, label, _ in bars["loader warp"]}
    for g in groups:
        for j in range(blocks):
            s_start, s_end = _bars(bars, g, f"S{j}")
            pv_start, pv_end = _bars(bars, g, f"P{j}V{j}")
            assert s_start >= landed[f"K{j}"] and pv_start >= landed[f"V{j}"]
            assert _bars(bars, g, f"exp{j}")[0] >= s_end  # exp_j needs S_j
            if j + 1 < blocks:
                assert pv_start >= _bars(bars, g, f"S{j + 1}")[1]  # issued after S_{j+1}, run in order
    for j in range(stages, blocks):  # a buffer is refilled only once both groups released it
        k_free = max(_bars(bars, g, f"S{j - stages}")[1] for g in groups)
        v_free = max(_bars(bars, g, f"P{j - stages}V{j - stages}")[1] for g in groups)
        assert landed[f"K{j}"] - copy >= k_free - 1e-9 and landed[f"V{j}"] - copy >= v_free - 1e-9


def test_the_role_timeline_refuses_an_empty_ring():
    with pytest.raises(ValueError, match="at least 1"):
        stepkit.role_timeline(FWD.ring_slot, blocks=4, stages=0)


# -- The register layout: the kernel's own, read by lesson 09's owners -------------------------------------------------


def test_the_forward_draws_its_own_accumulator_layout():
    for columns in (64, 128):
        assert FWD.wgmma_accumulator(columns) == L09.accumulator_layout(columns)
    held = L09.owners(FWD.wgmma_accumulator(FWD.WS_BLOCK_N), [64, FWD.WS_BLOCK_N])
    assert held["register"].max() + 1 == 64  # S: 64 fp32 values per thread
    rows = np.arange(64)
    for r in rows[::7]:  # a row lives in the 4 threads of one quad
        assert set(held["lane"][r]) == {4 * (r % 8) + i for i in range(4)} and len(set(held["warp"][r])) == 1


# -- The shared-memory budget: constexprs against the compiled kernel --------------------------------------------------


def test_the_budget_from_the_constexprs_agrees_with_the_compiled_kernel():
    facts = L12.forward_facts([{"D": 64}, {"D": 128}, {"D": 128, "BLOCK_N": 64, "STAGES": 5}])
    configs = [(64, 128, 2), (128, 128, 2), (128, 64, 5)]
    for (D, block_n, stages), f in zip(configs, facts):
        buffers = sum(L12.shared_buffers(D, block_n, stages).values())
        assert 0 <= f["shared"] - buffers <= 17 * 1024, (D, block_n, stages, f["shared"], buffers)
        assert (f["warps"], f["reqntid"], f["maxnreg"], f["local"]) == (12, 384, 168, 0)
    assert L12.shared_buffers(128) == {"Q": 32768, "K": 65536, "V": 65536, "mbarriers": 80}
    assert facts[1]["shared"] <= L09.H100_SHARED_PER_PROGRAM


def test_forward_facts_names_what_failed_in_the_compiling_python():
    """On a CPU a fresh Python compiles (RuntimeError naming its error); on a GPU this process (the error itself)."""
    with pytest.raises((RuntimeError, TypeError), match="NO_SUCH_CONSTEXPR"):
        L12.forward_facts([{"D": 128, "NO_SUCH_CONSTEXPR": 1}])


def test_the_shared_budget_refuses_a_kernel_smaller_than_its_buffers():
    with pytest.raises(ValueError, match="less than its buffers"):
        stepkit.draw_shared_budget({"x": (100, {"Q": 200})}, 1000, "a limit")


# -- Figures: each draws on a CPU with a title for its alt text --------------------------------------------------------


def _labels(fig):
    """Every text of fig: in its axes (secondary ones too), their tick labels, and the figure's own."""
    axes = [a for ax in fig.axes for a in (ax, *ax.child_axes)]
    texts = [t for ax in axes for t in (*ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels())]
    return [t.get_text() for t in texts + fig.texts]


def test_the_new_diagrams_draw_with_titles():
    import matplotlib.pyplot as plt
    from sphinx_gallery.scrapers import _matplotlib_fig_titles

    held = L09.owners(FWD.wgmma_accumulator(64), [64, 64])
    walks = {p: (2 * p, 2 * p + 2, 8) for p in range(4)}
    limit = L09.H100_SHARED_PER_PROGRAM
    figures = {
        "roles": stepkit.draw_roles(FWD.ring_slot, stages=FWD.WS_STAGES),
        "registers": stepkit.draw_register_layout("O, 64 x 64", held),
        "shared": stepkit.draw_shared_budget({"D = 64": (98400, L12.shared_buffers(64)),
                                              "not compiled": (None, L12.shared_buffers(128))},
                                             limit, "an H100's limit: 227 KiB a program"),
        "ownership": stepkit.draw_program_ownership(512, BWD.WS_BWD_BLOCK_N, 64, walks),
    }
    for name, fig in figures.items():
        alt = _matplotlib_fig_titles(fig)
        assert len(alt) > 30, (name, alt)
    texts = _labels(figures["ownership"])
    assert {"dQ += program 0", "dQ += programs 0, 1", "dQ += programs 0, 1, 2, 3", "program 2"} <= set(texts)
    assert figures["ownership"].axes[0].get_xlim() == (0, 512)  # the head's keys, no wider
    texts = _labels(figures["shared"])
    assert {"Triton's own: 16 KiB", "Q: 16 KiB", "96 KiB in all", "160 KiB in buffers\n(not compiled)"} <= set(texts)
    assert "Too thin to draw: mbarriers 80 bytes" in texts  # 80 bytes: noted, not a label on a sliver
    assert figures["shared"].axes[0].get_ylim()[1] < 1.2 * limit / 1024  # the axis ends just past the limit
    plt.close("all")


def test_the_roles_timeline_ticks_time_in_products():
    import matplotlib.pyplot as plt

    fig = stepkit.draw_roles(FWD.ring_slot, stages=FWD.WS_STAGES, product=2.0)
    ticks = fig.axes[0].get_xticks()
    assert ticks[0] == 0 and set(np.diff(ticks)) == {2.0}  # a tick per product
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][:3] == ["0", "1", "2"]
    plt.close("all")


def test_the_register_layout_picture_refuses_more_registers_than_colours():
    held = L09.owners(FWD.wgmma_accumulator(FWD.WS_BLOCK_N), [64, FWD.WS_BLOCK_N])
    with pytest.raises(ValueError, match="register indices"):
        stepkit.draw_register_layout("S", held, zoom=(16, 64))


# -- Lesson 12's exercise 3: a narrower tile, a deeper ring ------------------------------------------------------------


def test_check_ring_depths_accepts_the_deepest_rings(capsys):
    L12.check_ring_depths(dict(SOLUTION))
    out = capsys.readouterr().out
    assert "right" in out and "320 with 64-key tiles" in out and "352 with 32-key tiles" in out


@pytest.mark.parametrize("depths, why", [
    ({64: 6, 32: 12}, r"BLOCK_N = 64, STAGES = 6 needs [\d,]+ bytes"),  # Triton's own bytes left out
    ({64: 5, 32: 12}, r"BLOCK_N = 32, STAGES = 12 needs [\d,]+ bytes"),  # ... for the narrower tile only
    ({64: 12, 32: 24}, r"BLOCK_N = 64, STAGES = 12 needs [\d,]+ bytes"),  # V's ring left out
    ({64: 4, 32: 11}, "BLOCK_N = 64: STAGES = 4 fits, and so does a deeper ring"),  # one short
    ({64: 5, 32: 10}, "BLOCK_N = 32: STAGES = 10 fits, and so does a deeper ring"),
    ({64: 3, 32: 4}, "BLOCK_N = 64: STAGES = 3 fits"),  # Q counted in every stage
])
def test_check_ring_depths_rejects_wrong_depths_without_giving_the_answer(depths, why):
    with pytest.raises(AssertionError, match=why) as error:
        L12.check_ring_depths(depths)
    message = str(error.value)
    for block_n, stages in SOLUTION.items():
        if depths[block_n] != stages:
            assert not re.search(rf"\b{stages}\b", message.replace(f"BLOCK_N = {block_n}", "")), message


@pytest.mark.parametrize("depths, error", [
    ([5, 11], TypeError), ({64: 5}, TypeError), ({64: 5, 32: 11, 128: 2}, TypeError),
    ({64: 5.0, 32: 11}, ValueError), ({64: True, 32: 11}, ValueError), ({64: 0, 32: 11}, ValueError),
])
def test_check_ring_depths_refuses_what_is_no_answer(depths, error):
    with pytest.raises(error, match="depths"):
        L12.check_ring_depths(depths)


HOPPER_PROBE = torch.empty(1, 1, 8, 128, dtype=torch.float16, device=stepkit.DEVICE)


@pytest.mark.skipif(FWD.warp_specialized_unsupported(HOPPER_PROBE, HOPPER_PROBE, HOPPER_PROBE) is not None,
                    reason="runs the Gluon forward: needs a Hopper GPU")
def test_the_forward_runs_at_the_deeper_rings_on_a_hopper_gpu(capsys):
    L12.check_ring_depths(dict(SOLUTION))
    assert "by GPU time at N = 2048" in capsys.readouterr().out
