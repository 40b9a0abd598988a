"""Lesson 12: lesson 11's forward built up in steps (issue 44). The steps' kernels against float64 on a Hopper GPU;
everywhere, the schedule model, the kernel compiled for sm_90a (shared memory as the lesson counts it), the exercise
check on right and wrong answers, and the gains table's reading of spreads."""

import pandas as pd
import pytest
import stepkit
import torch
from lessons import load

L12 = load("12-hopper-forward-steps")
FWD = load("11-hopper-forward-gluon")
_probe = torch.empty(1, 1, 8, 64, dtype=torch.float16, device=stepkit.DEVICE)
hopper_only = pytest.mark.skipif(FWD.warp_specialized_unsupported(_probe, _probe, _probe) is not None,
                                 reason="the Gluon kernels need a Hopper GPU")


def test_a_ring_of_two_ends_sooner_and_never_reuses_a_buffer_early():
    one, two = L12.schedule(6, 1), L12.schedule(6, 2)
    assert two[-1][3] < one[-1][3]
    for times, stages in ((one, 1), (two, 2)):
        for j, (c0, c1, m0, m1) in enumerate(times):
            assert c1 <= m0 and (j == 0 or times[j - 1][3] <= m0)  # its copy landed, the block before done
            assert j == 0 or times[j - 1][1] <= c0  # copies one at a time
            if j >= stages:
                assert times[j - stages][3] <= c0  # its buffer's last block has computed
    # In order, the tensor cores wait for every copy; with two stages only for the first.
    assert all(one[j][2] - one[j - 1][3] == pytest.approx(1.0) for j in range(1, 6))
    assert all(two[j][2] == pytest.approx(two[j - 1][3]) for j in range(1, 6))


def test_the_schedules_draw_without_a_gpu():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = L12.draw_schedules()
    assert len(fig.axes) == 2
    plt.close(fig)


@pytest.mark.parametrize("D", [64, 128])
def test_the_compiled_kernel_holds_what_the_lesson_counts(D):
    configs = [dict(D=D, STAGES=s) for s in (1, 2, 3)]
    for config, fact in zip(configs, L12.step_facts(configs)):
        counted = sum(L12.step_buffers(D, config["STAGES"]).values())
        assert 0 <= fact["shared"] - counted <= 64, (config, fact["shared"], counted)
        assert fact["warps"] == 4 and fact["local"] == 0


def test_the_deepest_ring_check_accepts_the_answer(capsys):
    L12.check_deepest_ring({64: 6, 128: 3})  # the solution: kept here, not on the page
    assert "right" in capsys.readouterr().out


@pytest.mark.parametrize("depths, says", [
    ({64: 5, 128: 3}, "so does a deeper ring"),  # one stage short at D = 64
    ({64: 6, 128: 2}, "so does a deeper ring"),
    ({64: 7, 128: 3}, "more than an H100 gives a program"),  # Q forgotten: 7 x 32 KiB fits, with Q it does not
    ({64: 6, 128: 4}, "more than an H100 gives a program"),
])
def test_the_deepest_ring_check_rejects_wrong_depths(depths, says):
    with pytest.raises(AssertionError, match=says):
        L12.check_deepest_ring(depths)


@pytest.mark.parametrize("depths, error", [
    ([6, 3], TypeError), ({64: 6}, TypeError), ({64: 6, 128: 0}, ValueError), ({64: True, 128: 3}, ValueError),
    ({64: 6, 128: 2.5}, ValueError),
])
def test_the_deepest_ring_check_refuses_what_is_no_answer(depths, error):
    with pytest.raises(error):
        L12.check_deepest_ring(depths)


def _results(rates, spreads):
    rows = []
    for (D, causal, N), by_step in rates.items():
        for step, rate in by_step.items():
            rows.append(dict(D=D, causal=causal, N=N, provider=step, value=rate, gpu_value=rate,
                             gpu_spread=spreads.get((D, causal, N, step), 0.01)))
    return pd.DataFrame(rows)


def test_the_gains_are_each_step_over_the_one_before_and_marked_within_the_spread():
    steps = list(L12.STEPS)
    rates = {(64, False, 1024): dict(zip(steps, [100, 110, 99, 150, 165])),
             (64, False, 16384): dict(zip(steps, [200, 200, 200, 200, 200]))}
    gains = L12.step_gains(_results(rates, {(64, False, 1024, steps[2]): 0.2}))
    assert list(gains.columns) == [s.split(" ", 1)[1] for s in steps[1:]]
    assert list(gains.loc[(64, False, 1024)]) == ["1.10", "~0.90", "~1.52", "1.10"]
    assert list(gains.loc[(64, False, 16384)]) == ["1.00"] * 4


@hopper_only
def test_every_step_matches_float64():
    L12.check_steps(lengths=(1, 77, 300))


@hopper_only
def test_the_third_stage_check_runs_and_checks_its_output():
    ratio = L12.check_third_stage(N=2048)
    assert ratio > 0


def test_the_summary_reads_the_gains_per_head_dim(capsys):
    steps = list(L12.STEPS)
    rows = {(D, causal, N): dict(zip(steps, rates)) for D, rates in (
        (64, [100, 90, 95, 120, 130]), (128, [100, 95, 80, 140, 150])) for causal in (False, True)
        for N in L12.LENGTHS}
    L12.summary(stepkit.rate_tables(_results(rows, {}), L12.STEP_INDEX)[0])
    printed = capsys.readouterr().out
    assert "D = 64: the step with the best worst case is 3 + roles (1.26x to 1.26x); 1 TMA + wgmma lost" in printed
    assert ("D = 128: the step with the best worst case is 3 + roles (1.75x to 1.75x); 1 TMA + wgmma, 2 + ring "
            "lost") in printed
    assert "all four: 1.30x to 1.30x" in printed and "all four: 1.50x to 1.50x" in printed


def test_the_steps_figure_draws_from_a_rates_table():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {(D, causal, N): dict(zip(L12.STEPS, [100, 110, 120, 130, 140])) for D in (64, 128)
            for causal in (False, True) for N in L12.LENGTHS}
    fig = L12.draw_steps(stepkit.rate_tables(_results(rows, {}), L12.STEP_INDEX)[0])
    assert len(fig.axes) == len(L12.LENGTHS)
    assert [len(ax.patches) for ax in fig.axes] == [4 * len(L12.STEPS)] * len(L12.LENGTHS)
    plt.close(fig)
