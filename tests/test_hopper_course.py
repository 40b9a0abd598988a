"""Lessons 11 and 14 as a course: the roles' timeline follows the ring's rules, the register layout drawn is the
kernel's own, the shared-memory budget computed from the constexprs agrees with the kernel compiled for sm_90a (on a
CPU too, where a fresh Python compiles it), the backward's ownership picture, the backward's exchange of dS^T (the
model is the kernel's order, no interleaving of the two groups breaks it, and its timeline keeps the barriers' rules),
and lesson 13's exercise 3 check, which accepts the right depths and rejects realistic wrong ones. The solution lives
here, not on the page."""

import inspect
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
L13 = load("13-hopper-forward-profiled")
BWD = load("14-hopper-backward-gluon")
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
    facts = L13.forward_facts([{"D": 64}, {"D": 128}, {"D": 128, "BLOCK_N": 64, "STAGES": 5}])
    configs = [(64, 128, 2), (128, 128, 2), (128, 64, 5)]
    for (D, block_n, stages), f in zip(configs, facts):
        buffers = sum(L13.shared_buffers(D, block_n, stages).values())
        assert 0 <= f["shared"] - buffers <= 17 * 1024, (D, block_n, stages, f["shared"], buffers)
        # No claim on its local memory: its stack frame (spills) is 0 to 96 bytes by version and D (3.6, 3.9).
        assert (f["warps"], f["reqntid"], f["maxnreg"]) == (12, 384, 168)
    assert L13.shared_buffers(128) == {"Q": 32768, "K": 65536, "V": 65536, "mbarriers": 80}
    assert facts[1]["shared"] <= L09.H100_SHARED_PER_PROGRAM


def test_forward_facts_names_what_failed_in_the_compiling_python():
    """On a CPU a fresh Python compiles (RuntimeError naming its error); on a GPU this process (the error itself)."""
    with pytest.raises((RuntimeError, TypeError), match="NO_SUCH_CONSTEXPR"):
        L13.forward_facts([{"D": 128, "NO_SUCH_CONSTEXPR": 1}])


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
        "shared": stepkit.draw_shared_budget({"D = 64": (98400, L13.shared_buffers(64)),
                                              "not compiled": (None, L13.shared_buffers(128))},
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


# -- The backward's exchange of dS^T: lesson 14's ds_exchange, the kernel's order -------------------------------------


def _kernel_exchange(i, group):
    """The steps of _ws_bwd_step from its wait on ds_free to its arrival on it, read from the kernel's source in
    ds_exchange's terms, for query block i of consumer group `group`."""
    source = inspect.getsource(BWD._ws_bwd_step.fn)
    start = source.index("mbarrier.wait(ds_free")
    body = source[start:source.index("\n", source.index("mbarrier.arrive(ds_free", start))]
    assert "fence_async_shared()\n    _group_barrier()" in body  # the stores reach the tensor cores' proxy first
    steps, loop = [], None
    for line in body.splitlines():
        code = line.split("#")[0].strip()
        if wait := re.fullmatch(r"mbarrier\.wait\((ds_\w+), (.+)\)", code):
            steps.append(("wait", wait[1], eval(wait[2], {"__builtins__": {}}, {"i": i})))
        elif arrive := re.fullmatch(r"mbarrier\.arrive\((ds_\w+), count=1\)", code):
            steps.append(("arrive", arrive[1], None))
        elif code == "ds_smem.index(GROUP).store(dst)":
            steps.append(("store", group, None))
        elif code == "_group_barrier()":
            steps.append(("sync", "group", None))
        elif over := re.fullmatch(r"for g in gl\.static_range\((\d+)\):", code):
            loop = tuple(range(int(over[1])))
        elif code.startswith("dq = warpgroup_mma(ds_smem.index(g)"):
            steps.append(("read", loop, None))
    return steps


def _arrivals(barrier):
    """The arrivals a phase of `barrier` takes, as attn_bwd_ws_kernel initializes it."""
    return int(re.search(rf"mbarrier\.init\({barrier}, count=(\d+)\)", inspect.getsource(BWD.attn_bwd_ws_kernel.fn))[1])


def _exchange_hazard(exchange, blocks=3):
    """Every interleaving of the two groups running exchange(i, group) for `blocks` query blocks, one step at a time,
    by an mbarrier's rules (a phase completes at the kernel's count of arrivals; a wait for parity p passes while the
    completed phases number p + 1 modulo 2): the first hazard met, or None. Hazards: a deadlock, a read of a slot that
    holds another block, a store into a slot while the other group's product reads it (from its "read" step to its
    next step)."""
    steps = [[(i, *step) for i in range(blocks) for step in exchange(i, g)] for g in (0, 1)]
    count = {"ds_ready": _arrivals("ds_ready"), "ds_free": _arrivals("ds_free")}
    todo, seen = [((0, 0), (("ds_free", 0, 0), ("ds_ready", 0, 0)), (None, None), (None, None))], set()
    while todo:
        state = todo.pop()
        if state in seen:
            continue
        seen.add(state)
        at, barriers, slots, reading = state
        if all(at[g] == len(steps[g]) for g in (0, 1)):
            continue
        moved = False
        for g in (g for g in (0, 1) if at[g] < len(steps[g])):
            i, action, what, parity = steps[g][at[g]]
            phases = {name: [done, waiting] for name, done, waiting in barriers}
            held, busy = list(slots), list(reading)
            busy[g] = None  # the group goes on: a product it started has finished
            if action == "wait" and phases[what][0] % 2 == parity:
                continue  # blocked: the last phase of that parity has not completed
            if action == "arrive":
                phases[what][1] += 1
                if phases[what][1] == count[what]:
                    phases[what] = [phases[what][0] + 1, 0]
            elif action == "store":
                if any(read and what in read[1] for read in busy):
                    return f"group {g} stores block {i} into slot {what} while the other group's product reads it"
                held[what] = i
            elif action == "read":
                for slot in what:
                    if held[slot] != i:
                        return f"group {g} reads slot {slot} for block {i} while it holds block {held[slot]}"
                busy[g] = (i, what)
            moved = True
            todo.append(((*at[:g], at[g] + 1, *at[g + 1:]), tuple((n, *phases[n]) for n in sorted(phases)),
                         tuple(held), tuple(busy)))
        if not moved:
            return f"deadlock: the groups wait at {[steps[g][at[g]] for g in (0, 1) if at[g] < len(steps[g])]}"
    return None


def test_the_exchange_model_is_the_kernels_order():
    for i in range(4):
        for group in (0, 1):
            assert BWD.ds_exchange(i, group) == _kernel_exchange(i, group), (i, group)
    assert _arrivals("ds_ready") == _arrivals("ds_free") == 2  # one from each consumer group


def test_no_interleaving_of_the_two_groups_breaks_the_exchange():
    assert _exchange_hazard(BWD.ds_exchange, blocks=4) is None


def _without(action, barrier):
    return lambda i, g: [s for s in BWD.ds_exchange(i, g) if s[:2] != (action, barrier)]


def _flipped(barrier):
    return lambda i, g: [(a, w, p ^ 1) if (a, w) == ("wait", barrier) else (a, w, p)
                         for a, w, p in BWD.ds_exchange(i, g)]


def _moved(step, before):
    """ds_exchange with its step `step` (an action) moved just before the first step whose action is `before`."""
    def exchange(i, g):
        steps = BWD.ds_exchange(i, g)
        moving = next(s for s in steps if s[0] == step[0] and s[1] == step[1])
        steps.remove(moving)
        steps.insert(next(k for k, s in enumerate(steps) if s[0] == before), moving)
        return steps
    return exchange


OVERWRITTEN = "stores block 1 into slot . while the other group's product reads it|for block 0 while it holds block 1"


@pytest.mark.parametrize("exchange, hazard", [
    (_without("wait", "ds_free"), OVERWRITTEN),  # block 1's half lands on block 0's, before or under its read
    (_without("wait", "ds_ready"), "reads slot . for block 0 while it holds block None"),
    (_flipped("ds_free"), "deadlock"),  # block 0 waits for a phase that only block 0 completes
    (_flipped("ds_ready"), "reads slot . for block 0"),  # a fresh barrier passes parity 1 at once
    (_moved(("arrive", "ds_free"), "read"), OVERWRITTEN),  # released before it is read
    (_moved(("arrive", "ds_ready"), "store"), "reads slot . for block 0"),  # announced before storing
])
def test_the_exchange_breaks_without_each_rule(exchange, hazard):
    """The checker above has teeth: each barrier, its parity and its place is needed."""
    assert re.search(hazard, _exchange_hazard(exchange) or "no hazard")


@pytest.mark.parametrize("durations", [{}, {"make": 0.2, "product": 3.0}, {"store": 2.0, "rest": 0.1}])
def test_the_exchange_timeline_keeps_the_barriers_rules(durations):
    blocks = 3
    bars, phases = stepkit.exchange_timeline(BWD.ds_exchange, blocks, **durations)
    for name, done in phases.items():
        assert [p for _, p in done] == [i % 2 for i in range(blocks)], name  # a phase per block, parities alternating
    ready, free = ([t for t, _ in phases[name]] for name in ("ds_ready", "ds_free"))
    stores = {(g, i): start for g in (0, 1) for i, (start, n, _, kind) in
              enumerate(b for b in bars[f"group {g}"] if b[3] == "store")}
    reads = sorted((start, start + n, g, label) for g in (0, 1) for start, n, label, kind in bars[f"group {g}"]
                   if kind == "read")
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(reads, reads[1:]))  # the tensor cores: one product at a time
    for start, end, g, label in reads:
        i = int(label.removeprefix("dQ"))
        assert start >= ready[i] >= max(stores[0, i], stores[1, i])  # both halves stored, then read
        assert end <= free[i]  # freed only once both products have read
        if i + 1 < blocks:
            assert min(stores[0, i + 1], stores[1, i + 1]) >= free[i]  # refilled only once freed
    for g in (0, 1):
        for start, n, label, kind in bars[f"group {g}"]:
            if kind == "wait":
                barrier, parity = label.split(":")
                done = [t for t, p in phases[f"ds_{barrier}"] if p == int(parity)]
                assert n == 0 or any(abs(start + n - t) < 1e-9 for t in done)  # a wait ends as its phase completes
    for slot in (0, 1):  # a slot holds a block from its store to the end of the last read of it
        held = bars[f"slot {slot}"]
        assert [round(start, 9) for start, *_ in held] == [round(stores[slot, i], 9) for i in range(blocks)]
        assert all(a[0] + a[1] <= b[0] + 1e-9 for a, b in zip(held, held[1:]))


@pytest.mark.parametrize("exchange, durations, error", [
    (_flipped("ds_free"), {}, "deadlock"),
    (_flipped("ds_ready"), {}, "deadlock"),  # group 1 completes the phase group 0 passed early, then waits for it
    (_without("wait", "ds_free"), {"make": 0.2, "product": 3.0}, "group 0 overwrites slot 0 while block 0 is read"),
    (lambda i, g: [("swap", g, None)], {}, "unknown action 'swap'"),
])
def test_the_exchange_timeline_refuses_a_broken_exchange(exchange, durations, error):
    with pytest.raises(ValueError, match=error):
        stepkit.exchange_timeline(exchange, blocks=3, **durations)
    with pytest.raises(ValueError, match="at least 1"):
        stepkit.exchange_timeline(BWD.ds_exchange, blocks=0)


def test_the_exchange_figure_draws_large_for_a_phone():
    import matplotlib.pyplot as plt
    from sphinx_gallery.scrapers import _matplotlib_fig_titles

    fig = stepkit.draw_exchange(BWD.ds_exchange, half=BWD.WS_BWD_BLOCK_N // 2)
    assert len(_matplotlib_fig_titles(fig)) > 30
    texts = _labels(fig)
    assert {"ready 0", "free 0", "ready 1", "free 1", "group 0\nkeys 0-63", "group 1\nkeys 64-127", "slot 0",
            "dQ0", "dQ1", "$dS^T_1$"} <= set(texts)
    legend = [t for legend in fig.legends for t in legend.get_texts()]
    axes = [a for ax in fig.axes for a in (ax, *ax.child_axes)]
    shown = [t for ax in axes for t in (*ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels(), ax.title)]
    sizes = [t.get_fontsize() for t in shown + legend if t.get_text()]
    assert min(sizes) >= 16  # at 0.45 of a 9-inch figure, still about 7 pixels a letter
    plt.close("all")


# -- Lesson 13's exercise 3: a narrower tile, a deeper ring ------------------------------------------------------------


def test_check_ring_depths_accepts_the_deepest_rings(capsys):
    L13.check_ring_depths(dict(SOLUTION))
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
        L13.check_ring_depths(depths)
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
        L13.check_ring_depths(depths)


HOPPER_PROBE = torch.empty(1, 1, 8, 128, dtype=torch.float16, device=stepkit.DEVICE)


@pytest.mark.skipif(FWD.warp_specialized_unsupported(HOPPER_PROBE, HOPPER_PROBE, HOPPER_PROBE) is not None,
                    reason="runs the Gluon forward: needs a Hopper GPU")
def test_the_forward_runs_at_the_deeper_rings_on_a_hopper_gpu(capsys):
    L13.check_ring_depths(dict(SOLUTION))
    assert "by GPU time at N = 2048" in capsys.readouterr().out
