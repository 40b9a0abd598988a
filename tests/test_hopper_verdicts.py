"""The verdicts that the Hopper lessons (10 to 14) print from their measured numbers, tested on made-up tables from
both sides: each verdict is given where the numbers support it and withheld where they do not. The GPU cells that
measure the real numbers cannot run here; these functions are what those cells print through. Also the titles
that Sphinx-Gallery turns into the figures' alt texts."""

import re

import matplotlib
import pandas as pd
import pytest
import stepkit
from lessons import load

matplotlib.use("Agg")

SOFTMAX = load("10-long-softmax-gluon")
FWD = load("11-hopper-forward-gluon")
PROFILE = load("13-hopper-forward-profiled")
BWD = load("14-hopper-backward-gluon")
LIMIT = stepkit.SPREAD_LIMIT


# -- Lesson 13's who_paced: what set the pace back to back ------------------------------------------------------


@pytest.mark.parametrize("gpu, b2b, host", [(248, 291, 401), (240, 276, 325), (198, 329, 373)])
def test_a_host_time_longer_than_back_to_back_is_inconsistent_not_host_bound(gpu, b2b, host):
    """Lesson 14's H100 page called these host-bound 'and the host time accounts for it'. Calls made in a row end
    only after the host has enqueued them all, so a host time measured alone that exceeds back to back past the
    limit says the host ran slower then: no verdict."""
    verdict = PROFILE.who_paced(gpu=gpu, b2b=b2b, host=host, spread=0.02)
    assert verdict.startswith("inconsistent"), verdict
    assert f"{host / b2b - 1:.0%} longer than back to back" in verdict
    assert "host-bound" not in verdict and "accounts for it" not in verdict


def test_the_inconsistency_starts_just_past_the_limit():
    b2b, gpu = 100.0, 50.0
    at_limit = PROFILE.who_paced(gpu=gpu, b2b=b2b, host=b2b * (1 + LIMIT), spread=0.0)
    past = PROFILE.who_paced(gpu=gpu, b2b=b2b, host=b2b * (1 + LIMIT) * 1.001, spread=0.0)
    assert at_limit.startswith("host-bound") and past.startswith("inconsistent")
    # Also where back to back is GPU time: a longer host time is no longer "the host was faster" guesswork.
    assert PROFILE.who_paced(gpu=30.0, b2b=32.0, host=40.0, spread=0.0).startswith("inconsistent")


def test_unsettled_timings_give_no_verdict_before_anything_else():
    verdict = PROFILE.who_paced(gpu=190.0, b2b=217.0, host=289.0, spread=0.36)
    assert verdict.startswith("unsettled") and "differ by 36%" in verdict


@pytest.mark.parametrize("gpu, b2b, host, start", [
    (302.0, 337.0, 320.0, "host-bound"),   # host within the limit of back to back, below it
    (30.0, 48.0, 52.0, "host-bound"),      # host within the limit of back to back, above it
    (30.0, 30.5, 20.0, "GPU-bound"),
    (68.0, 69.0, 67.0, "GPU-bound"),
    (30.0, 32.5, 35.0, "host and GPU about even"),
    (30.0, 40.0, 25.0, "back to back exceeds GPU time by 33%"),
])
def test_the_other_verdicts_still_follow_the_three_times(gpu, b2b, host, start):
    verdict = PROFILE.who_paced(gpu=gpu, b2b=b2b, host=host, spread=0.01)
    assert verdict.startswith(start), verdict
    assert not verdict.startswith("inconsistent")


def test_a_gap_that_neither_time_explains_names_no_cause_it_did_not_measure():
    verdict = PROFILE.who_paced(gpu=30.0, b2b=40.0, host=25.0, spread=0.01)
    assert "neither accounts for it" in verdict and "do not show" in verdict


# -- Lesson 11's standing: fastest, a tie within the spread, or slower -----------------------------------------


def test_standing_counts_a_difference_within_the_spread_as_a_tie():
    rates = {"portable": 100.0, "Gluon": 99.5}
    spreads = {"portable": 0.01, "Gluon": 0.01}
    assert FWD.kit.standing("portable", rates, spreads) == "tie"
    assert FWD.kit.standing("Gluon", rates, spreads) == "tie"


def test_standing_names_the_fastest_and_the_slower_past_the_spread():
    rates, spreads = {"portable": 110.0, "Gluon": 100.0}, {"portable": 0.01, "Gluon": 0.02}
    assert FWD.kit.standing("portable", rates, spreads) == "fastest"
    assert FWD.kit.standing("Gluon", rates, spreads) == "slower"
    assert FWD.kit.standing("Gluon", {"Gluon": 5.0}, {"Gluon": 0.0}) == "fastest"  # alone


def test_standing_reads_the_larger_of_the_two_spreads():
    """Lesson 13's D=64 non-causal case: 94 us each back to back, Gluon's timings 27% apart."""
    rates = {"portable": 100.0, "Gluon": 85.0}
    assert FWD.kit.standing("Gluon", rates, {"portable": 0.0, "Gluon": 0.27}) == "tie"
    assert FWD.kit.standing("Gluon", rates, {"portable": 0.27, "Gluon": 0.0}) == "tie"
    assert FWD.kit.standing("Gluon", rates, {"portable": 0.05, "Gluon": 0.05}) == "slower"


# -- Lesson 11's default_path and lesson 13's clocks_and_paths: the same count ---------------------------------


def _results(cases):
    """Benchmark rows from {(D, causal, N): {provider: (rate back to back, spread, rate by GPU time)}}."""
    return pd.DataFrame([dict(D=D, causal=causal, N=N, mode="fwd", provider=provider, value=b2b, spread=spread,
                              gpu_value=gpu, gpu_spread=0.01)
                         for (D, causal, N), rates in cases.items()
                         for provider, (b2b, spread, gpu) in rates.items()])


WS, PORTABLE, PEER = FWD.WS, FWD.PORTABLE, "SDPA cuDNN"
CASES = {  # (D, causal, N): {provider: (back to back, its spread, by GPU time)}
    (64, False, 1024): {WS: (367.0, 0.27, 379.0), PORTABLE: (365.0, 0.01, 355.0), PEER: (399.0, 0.01, 391.0)},
    (64, True, 1024): {WS: (202.0, 0.01, 247.0), PORTABLE: (250.0, 0.01, 255.0), PEER: (283.0, 0.01, 277.0)},
    (128, False, 1024): {WS: (375.0, 0.01, 517.0), PORTABLE: (396.0, 0.01, 384.0), PEER: (533.0, 0.01, 510.0)},
    (128, True, 1024): {WS: (191.0, 0.01, 331.0), PORTABLE: (261.0, 0.01, 269.0), PEER: (339.0, 0.01, 333.0)},
}


def _with_default(cases, pick, captured_pick=None):
    """cases with the default path timed too: back to back as its eager pick, by GPU time as its captured pick
    (pick(D, causal, N) and captured_pick, which defaults to pick), as a run that takes those paths measures."""
    captured_pick = captured_pick or pick
    out = {}
    for key, rates in cases.items():
        eager, captured = rates[pick(*key)], rates[captured_pick(*key)]
        out[key] = {**rates, FWD.DEFAULT: (eager[0], eager[1], captured[2])}
    return out


def test_default_path_shows_its_choices_per_case_and_counts_ties_as_ties(capsys):
    results = _results(_with_default(CASES, lambda D, causal, N: WS))
    table = stepkit.default_path(results, lambda D, causal, N, captured: WS, [PEER], "FORWARD_PATHS", FWD.PATHS)
    line = capsys.readouterr().out
    assert list(table["path"]) == list(table["captured"]) == ["Gluon"] * 4
    # Against the path it could have taken instead (portable): within Gluon's 27% spread at the first case.
    assert list(table["back to back"]) == ["tie", "slower", "slower", "slower"]
    assert table.loc[(128, False, "fwd", 1024), "x fastest peer"] == round(517 / 510, 2)
    assert table.loc[(128, False, "fwd", 1024), "x peer, back to back"] == round(375 / 533, 2)
    assert "fastest at 0, tied with the fastest within the spread at 1 and slower past it at 3" in line
    assert "of this run's 4 cases" in line and "at or above it at 1 of 4 cases" in line
    assert "its GPU time was its captured pick's within the spread at 4 of 4 cases" in line


def test_default_path_says_where_its_replays_did_not_run_its_captured_pick(capsys):
    """A run whose captured calls ran the eager pick (portable) where the table picks Gluon for them: a GPU time
    of 384 against Gluon's 517 at D=128 non-causal cannot pass for Gluon's, nor 269 against 331 causal."""
    eager = {(64, False): WS, (64, True): PORTABLE, (128, False): PORTABLE, (128, True): PORTABLE}
    results = _results(_with_default(CASES, lambda D, causal, N: eager[D, causal]))

    def provider_of(D, causal, N, captured):
        return WS if captured and D == 128 else eager[D, causal]

    table = stepkit.default_path(results, provider_of, [PEER], "FORWARD_PATHS", FWD.PATHS)
    assert list(table["path"]) == ["Gluon", "portable", "portable", "portable"]
    assert list(table["captured"]) == ["Gluon", "portable", "Gluon", "Gluon"]
    assert "its GPU time was its captured pick's within the spread at 2 of 4 cases" in capsys.readouterr().out


def test_default_path_under_the_interpreter_gives_one_clock(capsys):
    """Without GPU time (the interpreter's wall time is the only clock) the table and line do not repeat it."""
    results = _results(_with_default(CASES, lambda D, causal, N: WS)).drop(columns=["gpu_value", "gpu_spread"])
    table = stepkit.default_path(results, lambda D, causal, N, captured: WS, [PEER], "FORWARD_PATHS", FWD.PATHS)
    line = capsys.readouterr().out
    assert list(table.columns) == ["path", "captured", "x fastest peer", "back to back"]
    assert table.loc[(128, False, "fwd", 1024), "x fastest peer"] == round(375 / 533, 2)
    assert "Replayed" not in line and "Back to back it ran" not in line


def test_default_path_leaves_out_a_case_where_it_did_not_run(capsys):
    cases = _with_default(CASES, lambda D, causal, N: WS)
    cases[64, True, 1024] = {p: v for p, v in cases[64, True, 1024].items() if p != FWD.DEFAULT}
    table = stepkit.default_path(_results(cases), lambda D, causal, N, captured: WS, [PEER], "FORWARD_PATHS",
                                 FWD.PATHS)
    assert (64, True, "fwd", 1024) not in table.index and len(table) == 3
    assert "of this run's 3 cases" in capsys.readouterr().out


def test_lessons_11_and_13_count_the_table_choice_the_same_way(capsys):
    """Lesson 11 said 19 of 20 while lesson 13 said 2 of 4, a tie counted as a miss: both now read standing."""
    choice = {(64, False): PORTABLE, (64, True): PORTABLE, (128, False): WS, (128, True): PORTABLE}

    def default_of(D, causal, N, captured=False):
        return choice[D, causal]

    results = _results(_with_default(CASES, default_of))
    table = stepkit.default_path(results, default_of, [PEER], "FORWARD_PATHS", FWD.PATHS)
    capsys.readouterr()
    stood = table["back to back"].value_counts()
    line = PROFILE.clocks_and_paths(results, 1024, default_of)
    assert (f"was the fastest back to back at {stood.get('fastest', 0)}, tied with the fastest within the spread "
            f"at {stood.get('tie', 0)} and slower past it at {stood.get('slower', 0)} (D=128 non-causal) of these 4"
            ) in line


def test_clocks_and_paths_tells_agreement_disagreement_and_ties_apart():
    cases = {key: {p: v for p, v in rates.items() if p != PEER} for key, rates in CASES.items()}
    cases[64, True, 1024] = {WS: (240.0, 0.01, 247.0), PORTABLE: (250.0, 0.01, 255.0)}  # portable on both clocks
    cases[64, False, 2048] = {PORTABLE: (300.0, 0.01, 300.0)}  # another length: not counted at N = 1024
    line = PROFILE.clocks_and_paths(_results(cases), 1024, lambda D, causal, N: PORTABLE)
    assert "in this page's run (4 cases)" in line
    assert "by GPU time and back to back at 1;" in line
    assert "different ones at 2 (D=128 non-causal, D=128 causal)" in line
    assert "a tie within the spread, by one time or both at 1 (D=64 non-causal)" in line
    # Gluon absent at a case (not Hopper, say): nothing to choose between, so the case is not counted.
    alone = {(64, False, 1024): {PORTABLE: (300.0, 0.01, 300.0)}, (64, True, 1024): cases[64, True, 1024]}
    assert "in this page's run (1 cases)" in PROFILE.clocks_and_paths(_results(alone), 1024,
                                                                      lambda D, causal, N: PORTABLE)


# -- Lesson 10's held_and_speed: what the bytes held per SM show ---------------------------------------------------


H100_POINTS = [(96, 1.048, "shared, 4096 per program"), (192, 1.176, "shared, 8192 per program"),
               (192, 1.174, "shared, 16384 per program"), (192, 1.168, "shared, 32768 per program"),
               (96, 1.089, "registers (lesson 03)")]


def _spreads(points, spread=0.01):
    return {name: spread for _, _, name in points}


def test_held_and_speed_reads_the_h100_page_as_one_comparison_with_noise_called_noise():
    lines = SOFTMAX.held_and_speed(H100_POINTS, _spreads(H100_POINTS), "shared, 16384 per program")
    assert lines[0].startswith("At 96 KiB per SM") and lines[0].endswith("(apart past the spread)")
    assert lines[1].startswith("At 192 KiB per SM") and lines[1].endswith("(within the spread: noise)")
    assert lines[2] == "Every point at 192 KiB per SM was faster than every point at 96 KiB, past the spread."
    assert lines[3] == "Two amounts held make one comparison, not a trend."
    assert lines[4].endswith("117.6%: 0.2% apart, within the spread: noise.")


def test_held_and_speed_says_when_the_bytes_held_do_not_order_the_speeds():
    points = [(96, 1.10, "a"), (192, 1.05, "b"), (192, 1.20, "c"), (288, 0.90, "d")]
    lines = SOFTMAX.held_and_speed(points, _spreads(points), "a")
    assert "The points at 96 and 192 KiB per SM overlap: the bytes held do not order their speeds." in lines
    assert "Every point at 288 KiB per SM was slower than every point at 192 KiB, past the spread." in lines
    assert not any("Two amounts" in line for line in lines)  # three amounts
    assert lines[-1].endswith("past the spread.") and "c, 120.0%" in lines[-1]


def test_held_and_speed_calls_a_gap_within_the_spread_a_tie_even_between_amounts():
    points = [(96, 1.00, "a"), (192, 1.05, "b")]
    assert "overlap" in SOFTMAX.held_and_speed(points, _spreads(points, 0.06), "a")[2]
    assert "faster than every point" in SOFTMAX.held_and_speed(points, _spreads(points, 0.01), "a")[2]
    assert SOFTMAX.held_and_speed(points, _spreads(points), "b")[-1] == "The table's choice, b, was the fastest here."


# -- Figures: Sphinx-Gallery's alt text is the figure's titles ----------------------------------------------------


def _alt_text(fig):
    from sphinx_gallery.scrapers import _matplotlib_fig_titles

    return _matplotlib_fig_titles(fig)


def test_the_hopper_diagrams_carry_titles_for_their_alt_texts():
    measured = pd.DataFrame({"host (us)": [31, 72], "GPU (us)": [88, 97], "back to back (us)": [86, 94]},
                            index=pd.MultiIndex.from_tuples([(64, False, "SDPA cuDNN"), (64, False, "portable")],
                                                            names=["D", "causal", "call"]))
    figures = {"roles": stepkit.draw_roles(FWD.ring_slot), "ring": stepkit.draw_ring(FWD.ring_slot),
               "split": stepkit.draw_split(), "pacing": PROFILE.draw_pacing(),
               "host and GPU": PROFILE.draw_host_and_gpu(measured, 1024)}
    for name, fig in figures.items():
        alt = _alt_text(fig)
        assert len(alt) > 30 and "hopper" not in alt.lower(), (name, alt)  # not the file name
    assert "N = 1024" in _alt_text(figures["host and GPU"])


def test_lesson_14s_diagram_writes_transposes_as_mathtext():
    fig = stepkit.draw_split()
    texts = [t.get_text() for ax in fig.axes for t in (*ax.texts, ax.title)]
    assert any("$dS^T$" in text for text in texts)
    for text in texts:
        outside_math = re.sub(r"\$[^$]*\$", "", text)
        assert "^" not in outside_math, text


def test_against_portable_counts_a_win_only_past_the_timings_spread(capsys):
    """Lesson 11 said 'faster at 5 of 5 sizes' where one size was 1.001x within 2-3% spreads."""
    rows = []
    for N, (ws, portable, spread) in {1024: (444.34, 443.85, 0.029), 2048: (500.0, 450.0, 0.01)}.items():
        for provider, rate, s in ((WS, ws, spread), (PORTABLE, portable, 0.024), (stepkit.FAST_PEERS[0], 400.0, 0.01)):
            rows.append(dict(D=64, causal=False, N=N, mode="fwd", provider=provider, value=rate, spread=s,
                             gpu_value=rate, gpu_spread=s))
    peers = stepkit.against_portable(pd.DataFrame(rows), 900.0, "lesson 06's kernel")
    line = capsys.readouterr().out
    assert peers == [stepkit.FAST_PEERS[0]] and "1.11x to 1.25x the fastest PyTorch peer" in line
    assert "faster past the timings' spread at 1 of 2 sizes" in line
