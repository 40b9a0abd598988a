"""
Hopper: where a short forward's time goes, and what a program holds
===================================================================

Lesson 11's benchmark gives every call two times: its GPU time, and its time back to
back, as a training loop calls it. At the shortest length, where a call is a few tens of
microseconds of GPU work, the two can differ. This lesson takes the calls of lesson 11's
two forwards apart there with a third clock, a timer on the host, which measures how
long Python, the input checks and the launch take to *enqueue* a call. Then it measures
one design choice of lesson 11 on its own: the persistent grid, one program per SM,
against one program per tile; and what a program of it holds, its shared memory, read
from the kernel compiled for Hopper. Previous lesson: :doc:`12-hopper-forward-steps`;
next: :doc:`14-hopper-backward-gluon`.

You will learn:

* the three times of a call (the host's, the GPU's, back to back) and why back to back
  goes at the pace of the slower of the other two, with a picture of each case;
* how to measure the host's time: a timer over calls that are not waited for; and
  what skipping a call's checks and autograd saves;
* how to tell, from numbers measured in one run, whether a call is host-bound, and what
  lesson 06's launch plans buy;
* what one program per SM buys, measured by launching the same kernel both ways;
* how to take the host out: a CUDA graph, and the forward registered as an operator
  (``torch.library.triton_op``) that ``torch.compile(fullgraph=True)`` takes whole;
* what the forward keeps in shared memory, computed from its constexprs and checked
  against the compiled kernel, and so how deep its ring of K and V tiles can go;
* how to share causal tiles of unequal length evenly between programs, how many calls
  it takes for back to back to reach its pace, and how the tile width trades against
  the ring's depth (the exercises).

The measurements need a GPU, and the Gluon kernel a Hopper GPU: on a CPU the page shows
the pictures, the compiled kernel's shared memory and the exercises, and says what it
skipped.
"""

import functools
import itertools
import math
import time

import torch
import torch.nn.functional as F

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

V2 = kit.load_lesson("06-fused-attention-v2-forward")
FWD = kit.load_lesson("11-hopper-forward-gluon")

import triton  # after stepkit, which may switch the interpreter on first

if __name__ == "__main__":
    print(kit.describe_platform())

# %%
# Three times of one call
# -----------------------
# A call of ``attention`` runs in two places. On the host, Python checks the inputs, the
# autograd function records the call, and the launcher finds the compiled kernel, packs
# its arguments (for the Gluon forward, three TMA descriptors too) and hands the launch
# to the CUDA driver, which queues it and returns at once. On the GPU, the kernel runs
# when it reaches the front of the queue. So a call has a *host time*, the time to
# enqueue it, and a *GPU time*, the time its kernels run. Calls made back to back, as in
# training, go at the pace of the slower of the two: when the host is the slower, the
# GPU idles between kernels, and no change to the kernel makes the calls faster.
#
# **How we time.** The benchmarks of these lessons give each call its GPU time, with the
# host's work taken out (a CUDA graph replays the call's launches), and its time back to
# back, host and GPU together, as :doc:`../performance` defines them under "How we
# time". The host time is this lesson's own measurement, below.
#
# So back to back should read about the larger of host time and GPU time. The picture
# plays a few calls through, in illustrative units: host 1.0 and GPU 1.6 per call, then
# host 1.6 and GPU 1.0. It is a schedule, not a measurement; ``timeline`` computes it
# the way the queue works.


def timeline(host, gpu, calls):
    """(start, length) of each enqueue on the host and of each kernel on the GPU, for
    calls enqueued back to back: each kernel starts once it is enqueued and the GPU has
    finished what came before it."""
    enqueues, kernels, gpu_free = [], [], 0.0
    for i in range(calls):
        enqueues.append((i * host, host))
        start = max((i + 1) * host, gpu_free)
        kernels.append((start, gpu))
        gpu_free = start + gpu
    return enqueues, kernels


def draw_pacing(calls=4):
    import matplotlib.pyplot as plt

    cases = [("GPU time longer than host time: the GPU runs call after call", 1.0, 1.6),
             ("host time longer than GPU time: the GPU waits for each call", 1.6, 1.0)]
    fig, axes = plt.subplots(len(cases), 1, figsize=(8, 4.0), sharex=True)
    host_colour, gpu_colour = "#e4a23c", "#3b7dd8"
    for ax, (title, host, gpu) in zip(axes, cases):
        enqueues, kernels = timeline(host, gpu, calls)
        ax.broken_barh(enqueues, (1.7, 0.6), color=host_colour, edgecolor="white")
        ax.broken_barh(kernels, (0.7, 0.6), color=gpu_colour, edgecolor="white")
        for i, ((h, _), (k, _)) in enumerate(zip(enqueues, kernels)):
            ax.text(h + host / 2, 2.0, f"call {i}", ha="center", va="center",
                    fontsize=9)
            ax.text(k + gpu / 2, 1.0, f"kernel {i}", ha="center", va="center",
                    fontsize=9, color="white")
        ax.set_yticks([1.0, 2.0], ["GPU", "host"], fontsize=10)
        ax.set_ylim(0.5, 2.5)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1].set_xticks([])
    axes[-1].set_xlabel("time (illustrative)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (host_colour, gpu_colour)]
    fig.legend(handles, ["host enqueues a call", "kernel runs"], loc="lower center",
               ncol=2, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


if __name__ == "__main__":
    draw_pacing()

# %%
# In the first panel the host gets further ahead with every call, and the GPU runs
# kernel after kernel: back to back, a call costs its GPU time. In the second the GPU
# waits for each call: a call costs its host time. (Over a few calls the first kernel's
# wait still shows; exercise 2 works out how many calls it takes to fade.) So this page
# calls a case *host-bound* where its back-to-back time exceeds its GPU time by more
# than ``kit.SPREAD_LIMIT`` (past which the benchmark retimes, so nearer times count as
# equal) and the host time, measured on its own, comes within that of back to back.
#
# The host's own time cannot exceed back to back: calls made in a row end only after
# the host has enqueued the last of them. A host time measured alone that is longer,
# past the limit, says that the host ran slower then than while the benchmark ran (its
# speed drifts with the machine's other work and its clocks): ``who_paced``, below,
# calls such a case *inconsistent* rather than name a cause, and says what else the
# three times can show.
#
# The benchmark at the smallest size
# ----------------------------------
# Lesson 11's forwards and SDPA's backends at lesson 06's shortest length, measured as
# lesson 11 measures them (on a GPU, two tables: by GPU time, then back to back):

WS, PORTABLE = FWD.WS, FWD.PORTABLE
PROVIDER_OF = {"SDPA cuDNN": "SDPA cuDNN", "portable": PORTABLE, "Gluon": WS}


def gluon_forward(q, k, v, causal, D):
    """Lesson 11's Gluon forward, where it can run."""
    if FWD.warp_specialized_unsupported(q, k, v) is not None:
        return {}
    return {(WS, "fwd"): kit.call_timer(FWD.attention, q, k, v, causal, D**-0.5,
                                        warp_specialized=True)}


if __name__ == "__main__" and kit.ON_GPU:
    import pandas as pd

    N = V2.SIZES[0]
    results = pd.DataFrame(kit.attention_benchmark(
        V2.CASES, [N], FWD.BASELINES, ("fwd",), gluon_forward))
elif __name__ == "__main__":
    print("The benchmark and the measurements below are GPU questions: under the "
          "interpreter every call runs on the host, one program after another.")
(kit.rates_table(results, FWD.INDEX, "TFLOP/s")
 if __name__ == "__main__" and kit.ON_GPU else None)

# %%

(kit.rates_table(results, FWD.INDEX, "TFLOP/s", value="value")
 if __name__ == "__main__" and kit.ON_GPU else None)

# %%
# Host time, GPU time and back to back at the smallest size
# ---------------------------------------------------------
# For each case at that length this cell measures the host's time to enqueue one call
# without waiting for the GPU (``host_ms``: the fastest of five loops of 50 calls, in
# two rounds taking turns with the other calls, since the host's speed drifts), also
# with lesson 06's launch plans cleared before every call of ours, so that each goes
# through Triton's JIT; and sets it beside the GPU and back-to-back times that the
# benchmark above measured, in microseconds per call. ``who_paced`` reads the three.
# Host times vary from machine to machine, and from one minute to the next, far more
# than GPU times do. Two sections below cut the host's time down, then take it out.


def host_ms(call, calls=50, loops=5):
    """Host milliseconds to enqueue one call, not waiting for the GPU: the fastest of
    several loops, since other work on the machine only ever adds time. call: a
    function, or a kit.Timer (made, and its context entered, outside the loops)."""
    if isinstance(call, kit.Timer):
        with call.context():
            return host_ms(call.make(), calls, loops)
    call()
    torch.cuda.synchronize()
    fastest = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        fastest = min(fastest, (time.perf_counter() - start) / calls * 1e3)
        torch.cuda.synchronize()
    return fastest


def interleaved_host_ms(calls, rounds=2):
    """{name: host_ms of calls[name]}, the fastest of rounds that take the calls in
    turn, sharing out the drift."""
    host = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            host[name] = min(host.get(name, float("inf")), host_ms(fn))
    return host


def planless(timer):
    """timer's call with lesson 06's launch plans cleared first: through the JIT."""
    call = timer.make()
    return lambda: (V2.PLANS.clear(), call())


def benchmark_ms(results, provider, B, H, N, D, causal, mode, column="value"):
    """Milliseconds per call that the benchmark measured for provider in this case,
    from its rate: back to back ("value") or by GPU time ("gpu_value")."""
    row = results[(results["provider"] == provider) & (results["D"] == D)
                  & (results["causal"] == causal) & (results["N"] == N)
                  & (results["mode"] == mode)]
    flops = kit.attention_flops(B, H, N, D, causal, mode)
    return flops / float(row[column].iloc[0]) * 1e-9


def who_paced(gpu, b2b, host, spread):
    """What set the pace of a call made back to back, from its GPU, back-to-back and
    host times (in microseconds) and the spread of the timings (a fraction: how far
    apart its two fastest timings were). Times within kit.SPREAD_LIMIT of each other
    count as equal: the benchmark retimes only past that."""
    limit = kit.SPREAD_LIMIT
    times = f"back to back {b2b:.0f} us, GPU {gpu:.0f} us, host {host:.0f} us"

    def past(fraction):  # a fraction past the limit: within a point, one more digit
        return f"{fraction:.0%}" if fraction >= limit + 0.01 else f"{fraction:.1%}"

    if spread > limit:
        return (f"unsettled ({times}): its two fastest timings differ by "
                f"{past(spread)}, more than the {limit:.0%} a verdict needs.")
    if host > b2b * (1 + limit):
        return (f"inconsistent ({times}): the host time measured alone is "
                f"{past(host / b2b - 1)} longer than back to back, yet calls in a row "
                "end only after the host has enqueued them all. The host ran slower "
                "when measured alone; these numbers cannot tell what set the pace.")
    if b2b <= gpu * (1 + limit):
        if host <= gpu * (1 + limit):
            return (f"GPU-bound ({times}): back to back and the host time are "
                    f"within {limit:.0%} of GPU time, or below it.")
        return (f"host and GPU about even ({times}): back to back is within "
                f"{limit:.0%} of GPU time, the host time within {limit:.0%} of back to "
                "back; either can set the pace.")
    if host * (1 + limit) >= b2b:
        return (f"host-bound ({times}): back to back exceeds GPU time by "
                f"{past(b2b / gpu - 1)}, and the host time accounts for it.")
    return (f"back to back exceeds GPU time by {past(b2b / gpu - 1)} ({times}), and "
            "neither accounts for it: the GPU idles between the kernels for a reason "
            "these numbers do not show (or the host ran faster when measured alone).")


def pacing_rows(results, B, H, N, D, causal, mode, calls, provider_of=PROVIDER_OF):
    """Rows of the times of each {name: kit.Timer} of calls (provider_of[name] in
    results), in microseconds per call: its host time, measured now, also without
    launch plans for ours; the GPU and back-to-back times the benchmark measured; and
    who_paced's verdict, printed."""
    ours = [name for name in calls if not name.startswith("SDPA")]
    host = interleaved_host_ms({**calls, **{(n, "planless"): planless(calls[n])
                                            for n in ours}})
    rows = []
    for name in calls:
        provider = provider_of[name]
        row = results[(results["provider"] == provider) & (results["D"] == D)
                      & (results["causal"] == causal) & (results["N"] == N)
                      & (results["mode"] == mode)]
        if row.empty:  # the benchmark could not run it here
            continue
        spread = max(row["spread"].iloc[0], row["gpu_spread"].iloc[0])
        us = {"host": 1e3 * host[name],
              "host, no plans": 1e3 * host[name, "planless"] if name in ours else None,
              **{c: 1e3 * benchmark_ms(results, provider, B, H, N, D, causal, mode, v)
                 for c, v in (("GPU", "gpu_value"), ("back to back", "value"))}}
        label = f"D={D:<3d} {'causal    ' if causal else 'non-causal'} {name}"
        verdict = who_paced(us["GPU"], us["back to back"], us["host"], spread)
        print(f"{label}: {verdict}")
        rows.append({"D": D, "causal": causal, "call": name,
                     **{f"{c} (us)": None if t is None else round(t)
                        for c, t in us.items()}})
    return rows


def plans_saved(ours):
    """A sentence on what lesson 06's launch plans saved, from rows of our calls with
    "host (us)" and "host, no plans (us)"; where clearing the plans came out faster,
    it says so: host times drift by that much."""
    saved = (ours["host, no plans (us)"] - ours["host (us)"]).astype(float)
    line = (f"Clearing lesson 06's launch plans before each call, so that it goes "
            f"through Triton's JIT, changed the host time of our calls here by "
            f"{saved.min():+.0f} to {saved.max():+.0f} us")
    lower = saved[saved < 0]
    if lower.empty:
        return line + ": what the plans save."
    return (line + f"; in {len(lower)} of {len(saved)} calls it came out lower, by up "
            f"to {-lower.min():.0f} us, which is how far host times drift between "
            "measurements: smaller differences say nothing.")


def forward_calls(q, k, v, causal):
    """{name: kit.Timer}: cuDNN's forward and lesson 11's two (Gluon where it runs),
    each the very call the benchmark timed, so that host and back to back time the
    same (the portable one through lesson 07's attention, as lesson 11's benchmark)."""
    scale = q.shape[-1] ** -0.5
    cudnn = kit.sdpa_providers(causal, scale, ["SDPA cuDNN"])["SDPA cuDNN"]
    calls = {"SDPA cuDNN": kit.call_timer(cudnn, q, k, v),
             "portable": kit.call_timer(FWD.V2_BWD.attention, q, k, v, causal, scale)}
    if FWD.warp_specialized_unsupported(q, k, v) is None:
        calls["Gluon"] = kit.call_timer(FWD.attention, q, k, v, causal, scale,
                                        warp_specialized=True)
    return calls


if __name__ == "__main__" and kit.ON_GPU:
    measured = []
    for B, H, D in V2.CASES:
        for causal in (False, True):
            # Inputs that require gradients, as in the benchmark: autograd then
            # records each call's graph.
            q, k, v = (torch.randn(B, H, N, D, device=kit.DEVICE, dtype=torch.float16,
                                   requires_grad=True) for _ in range(3))
            measured += pacing_rows(results, B, H, N, D, causal, "fwd",
                                    forward_calls(q, k, v, causal))
    measured = pd.DataFrame(measured).set_index(["D", "causal", "call"])
    measured["host, no plans (us)"] = measured["host, no plans (us)"].astype("Int64")
measured if __name__ == "__main__" and kit.ON_GPU else None

# %%
# The same times as bars, two for each call: its host time and its GPU time; the black
# mark is its time back to back. Where the host's bar is the longer, the mark should sit
# at its end: calls made back to back go at the host's pace. The last lines read the
# benchmark's two tables for our two forwards: whether GPU time and back to back name
# the same one faster, and how lesson 11's table of paths chose, counted as lesson 11
# counts it (a difference within the two timings' spreads is a tie).


def draw_host_and_gpu(measured, N):
    import matplotlib.pyplot as plt

    labels = [f"D={D}{', causal' if causal else ''}: {call}"
              for D, causal, call in measured.index]
    rows = range(len(labels))
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(labels) + 1.9))
    ax.barh([r - 0.2 for r in rows], measured["host (us)"], height=0.4,
            color="#e4a23c", label="host time")
    ax.barh([r + 0.2 for r in rows], measured["GPU (us)"], height=0.4,
            color="#3b7dd8", label="GPU time")
    ax.scatter(measured["back to back (us)"], list(rows), marker="|", s=250,
               color="black", label="back to back")
    ax.set_yticks(list(rows), labels, fontsize=10)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds per call", fontsize=10)
    ax.set_title(f"Host time, GPU time and back to back per call at N = {N}", size=11)
    fig.legend(loc="lower center", ncol=3, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def clocks_and_paths(results, N, default_of):
    """Sentences on our two forwards at length N of results: whether GPU time and
    back to back name the same one faster (within the spread: a tie), and how
    default_of(D, causal, N) stood back to back (kit.standing for both)."""
    same, differ, tied = 0, [], []
    stood = {"fastest": [], "tie": [], "slower": []}
    ours = results[(results["N"] == N) & results["provider"].isin([PORTABLE, WS])]
    for (D, causal), case in ours.groupby(["D", "causal"], sort=False):
        if len(case) < 2:  # Gluon did not run: nothing to choose between
            continue
        where = f"D={D} {'causal' if causal else 'non-causal'}"

        def of(column):
            return dict(zip(case["provider"], case[column]))

        fastest = []  # by each clock: the one faster past the spread, or none
        for rate, spread in (("gpu_value", "gpu_spread"), ("value", "spread")):
            rates, spreads = of(rate), of(spread)
            fastest.append([name for name in rates
                            if kit.standing(name, rates, spreads) == "fastest"])
        if not all(fastest):
            tied.append(where)
        elif fastest[0] == fastest[1]:
            same += 1
        else:
            differ.append(where)
        choice = default_of(D, causal, N)
        stood[kit.standing(choice, of("value"), of("spread"))].append(where)
    cases = same + len(differ) + len(tied)
    line = (f"At N = {N}, in this page's run ({cases} cases), the faster of our two "
            f"forwards is the same by GPU time and back to back at {same}")
    for where, what in ((differ, "different ones"),
                        (tied, "a tie within the spread, by one time or both")):
        line += f"; {what} at {len(where)} ({', '.join(where)})" if where else ""
    slower = stood["slower"]
    return line + (
        f". Lesson 11's FORWARD_PATHS, which tools/tune.py measured before this build, "
        f"was the fastest back to back at {len(stood['fastest'])}, tied with the "
        f"fastest within the spread at {len(stood['tie'])} and slower past it at "
        f"{len(slower)}" + (f" ({', '.join(slower)})" if slower else "")
        + f" of these {cases}; lesson 11 counts the same way over its own run, at "
        "every length.")


if __name__ == "__main__" and kit.ON_GPU:
    draw_host_and_gpu(measured, N)
    print(plans_saved(measured.drop(index="SDPA cuDNN", level="call")))
    print(clocks_and_paths(results, N, FWD.default_forward))

# %%
# What one program per SM buys
# ----------------------------
# Lesson 11 made its Gluon kernel persistent ("One program per SM" there), so that a
# program loads its next tile while it finishes the last. Here that kernel runs twice,
# by GPU time per call: with one program per SM, as ``attention`` launches it, and with
# one program per tile (per pair of tiles under causal masking), close to a kernel that
# is not persistent, whose programs have nothing after their one unit of work to
# overlap. Same kernel, same tiles (the repository's tests check that both give the same
# bits); only the number of programs differs. At the longest length a tile's start and
# end are a small part of its work: there the two should come out close. The table gives
# both times and the gain (per tile over per SM: above 1 where one per SM is faster; a
# range where the timings spread past the kit's limit).


def gain(per_tile, per_sm):
    """(lowest, highest) gain of one program per SM from two kit.Measured, by GPU
    time: the same where the timings spread less than kit.SPREAD_LIMIT."""
    if max(per_tile.spread(), per_sm.spread()) > kit.SPREAD_LIMIT:
        return min(per_tile.gpu) / max(per_sm.gpu), max(per_tile.gpu) / min(per_sm.gpu)
    return (min(per_tile.gpu) / min(per_sm.gpu),) * 2


if __name__ == "__main__" and kit.ON_GPU:
    persistence, sizes = [], V2.SIZES
    for B, H, D in V2.CASES:
        for causal in (False, True):
            for N in (sizes[0], sizes[1], sizes[-1]):
                q, k, v = (torch.randn(B, H, N, D, device=kit.DEVICE,
                                       dtype=torch.float16) for _ in range(3))
                if FWD.warp_specialized_unsupported(q, k, v) is not None:
                    continue
                o = torch.empty_like(q)
                lse = torch.empty((B * H, N), device=kit.DEVICE)
                tiles = B * H * V2.host_cdiv(N, FWD.WS_BLOCK_M)  # capped at the pairs
                m = kit.time_calls({
                    name: kit.call_timer(FWD._ws_forward, q, k, v, o, lse, causal,
                                         D**-0.5, programs)
                    for name, programs in (("per SM", None), ("per tile", tiles))})
                low, high = gain(m["per tile"], m["per SM"])
                persistence.append({
                    "D": D, "causal": causal, "N": N,
                    "one per tile or pair (us)": round(1e3 * min(m["per tile"].gpu)),
                    "one per SM (us)": round(1e3 * min(m["per SM"].gpu)),
                    "gain": f"{low:.2f}–{high:.2f}" if low < high else f"{low:.2f}",
                    "low": low, "high": high})
(pd.DataFrame(persistence).drop(columns=["low", "high"]).set_index(["D", "causal", "N"])
 if __name__ == "__main__" and kit.ON_GPU and persistence else None)

# %%
# Computed from those times, on a Hopper GPU:

if __name__ == "__main__" and kit.ON_GPU and persistence:
    gains = pd.DataFrame(persistence)
    short, longest = gains[gains["N"] < sizes[-1]], gains[gains["N"] == sizes[-1]]
    print(f"One program per SM was faster, by more than the spread, at "
          f"{(short['low'] > 1).sum()} of {len(short)} cases at N = {sizes[0]} and "
          f"{sizes[1]}, by {short['low'].min():.2f}x to {short['high'].max():.2f}x; "
          f"at N = {sizes[-1]} the gain was {longest['low'].min():.2f} to "
          f"{longest['high'].max():.2f}.")

# %%
# Less Python per call
# --------------------
# Lesson 11's ``attention`` could check its inputs, pick its forward, go through
# autograd and work out its launch's arguments on every call, as ``before`` below does;
# all of that reads only the inputs' layout and the flags. So ``kit.settled_paths`` runs
# the checks and the pick once per layout (keyed by ``kit.settled_key``, a few
# microseconds); a no-grad call skips autograd and :math:`\mathrm{LSE}_2` (lesson 06's
# ``STORE_LSE``); and a layout's first call leaves lesson 06's *call plan*, which later
# calls run: the allocations (``empty_like`` of a zero-stride view) and a launch
# straight into the C function at the end of Triton's launcher (``kit.bound_launcher``),
# each TMA descriptor encoded once per address: PyTorch's allocator gives a loop's new
# tensors the same few blocks. Below: host µs per call by step, beside plain SDPA's.


def host_steps(B, H, N, D, scale, sets=8):
    """{name: host microseconds per call}, without and with inputs requiring grad."""
    pools = [[[torch.randn(B, H, N, D, device=kit.DEVICE, dtype=torch.float16,
                           requires_grad=grad) for _ in range(3)]
              for _ in range(sets)] for grad in (False, True)]  # fmt: skip
    settled = kit.settled_paths(FWD.use_warp_specialized, *pools[0][0], False, scale,
                                None)  # .paths: the pick; .plans[keep_lse]: call plans
    FWD.attention(*pools[0][0], False, scale)  # leaves the call plan

    def before(q, k, v):  # on every call: the checks, the pick, autograd, the forward
        kit.check_attention_inputs(q, k, v, False, scale)
        pick = FWD.use_warp_specialized(q, k, v, False, scale, None)
        unplanned = kit.Settled(pick)  # its "plan": the forward, the long way
        unplanned.plans[True] = lambda q, k, v: FWD.forward(q, k, v, False, scale, pick)
        return FWD._AttentionHopperForward.apply(q, k, v, False, scale, pick, unplanned)

    sdpa = functools.partial(F.scaled_dot_product_attention, scale=scale)
    after = functools.partial(FWD.attention, causal=False, sm_scale=scale)
    forward = functools.partial(FWD.forward, causal=False, sm_scale=scale,
                                warp_specialized=settled.paths, keep_lse=False)
    calls = {"plain SDPA": (sdpa, 0), "every call: checks, pick, autograd": (before, 0),
             "the forward, its launch plan only": (forward, 0),
             "the call plan alone": (settled.plans[False], 0),
             "attention, settled": (after, 0), "plain SDPA, with grad": (sdpa, 1),
             "attention, with grad": (after, 1)}
    host = interleaved_host_ms({name: lambda fn=fn, sets=itertools.cycle(pools[grad]):
                                fn(*next(sets)) for name, (fn, grad) in calls.items()})
    return {name: 1e3 * ms for name, ms in host.items()}


if __name__ == "__main__" and kit.ON_GPU:
    N = V2.SIZES[0]  # the shortest length again, after the loops above
    steps = pd.Series(host_steps(4, 32, N, 64, 0.125), name="host (us per call)")
    print(f"No grad: {steps['attention, settled'] / steps['plain SDPA']:.2f}x plain "
          "SDPA's host time (target: at most 1); with grad: "
          f"{steps['attention, with grad'] / steps['plain SDPA, with grad']:.2f}x "
          "(target: at most 1.5). The call plan alone took "
          f"{steps['the call plan alone'] / steps['plain SDPA']:.2f}x plain SDPA's.")
elif __name__ == "__main__":
    print("Host times per call are a GPU question: not measured here.")
steps.round(1).to_frame() if __name__ == "__main__" and kit.ON_GPU else None

# %%
# Taking the host out: one operator, recorded once
# ------------------------------------------------
# Where the host paces a short call, the cure is to stop running Python on every call. A
# *CUDA graph* records the kernels that a call launches, once, and replays them with one
# host call; ``attention`` can be recorded as it is (the benchmark's GPU time does).
# ``torch.compile(fullgraph=True)`` goes further, tracing a whole model into one graph,
# but it cannot trace through a launcher's Python (Triton's JIT, launch plans): the
# forward must be one *operator*. ``torch.library.triton_op`` registers
# ``lessons::flash_forward``, whose body launches lesson 06's kernel through
# ``wrap_triton``, which the compiler sees into; ``mode="reduce-overhead"`` then replays
# the compiled graph as a CUDA graph that reads buffers of its own, into which each call
# first copies its inputs (``torch._foreach_copy_``; the GPU time below sums a call's
# kernels, copies too). A graph recorded by hand (the last row) reads the tensors it was
# recorded with. Forward only: a compiled backward needs its kernels registered too.


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   sm_scale: float) -> torch.Tensor:
    """Lesson 06's forward kernel, with the table's tile for the case; no backward
    reads LSE_2 here, so the kernel skips it (STORE_LSE off, o in its place)."""
    B, H, N, D = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    case = V2.tuned_case(q, causal)
    tile = V2.TUNED_CONFIGS.get(("fwd", *case)) if case else None
    block_m, block_n, warps, stages = tile or (
        V2.FWD_SHAPES[-1] if kit.ON_GPU else V2.INTERPRETER_CONFIGS["fwd"])
    torch.library.wrap_triton(V2.attn_fwd_kernel)[(V2.host_cdiv(N, block_m), B * H)](
        q, k, v, o, o, sm_scale * V2.LOG2E, H, N, V2.host_next_power_of_2(N),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), D=int(D), CAUSAL=causal,
        UPCAST_DOT=V2._upcast(q), NEGATIVE_SCALE=sm_scale < 0, BLOCK_M=block_m,
        BLOCK_N=block_n, STORE_LSE=False, num_warps=warps, num_stages=stages)
    return o


if not hasattr(torch.ops.lessons, "flash_forward"):  # once, however often loaded
    torch.library.triton_op("lessons::flash_forward", mutates_args=())(_flash_forward)
flash_forward = torch.ops.lessons.flash_forward


def flash_attention(q, k, v, sm_scale, causal=False):
    """The operator as a model calls it: what torch.compile traces below."""
    return flash_forward(q, k, v, causal, sm_scale)


def host_free_calls(q, k, v, scale):
    """{name: call}: plain SDPA, ours eager, compiled and replayed, each checked against
    eager attention first; RuntimeError where torch cannot compile or record them."""
    compiled = torch.compile(flash_attention, fullgraph=True)
    graphed = torch.compile(flash_attention, fullgraph=True, mode="reduce-overhead")
    replay, recorded = kit.captured(FWD.attention, q, k, v, False, scale)
    replay()
    eager = FWD.attention(q, k, v, False, scale)  # maybe Gluon: equal within rounding
    tolerance = kit.TOLERANCE[q.dtype]
    for out in (compiled(q, k, v, scale), graphed(q, k, v, scale), recorded):
        torch.testing.assert_close(out, eager, rtol=tolerance, atol=tolerance)
    return {"plain SDPA": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
            "flash_forward, eager": lambda: flash_attention(q, k, v, scale),
            "flash_forward, torch.compile": lambda: compiled(q, k, v, scale),
            "... mode='reduce-overhead'": lambda: graphed(q, k, v, scale),
            "attention, CUDA graph replay": replay}


if __name__ == "__main__" and kit.ON_GPU:
    B, H, D = 4, 32, 64
    q, k, v = torch.randn(3, B, H, N, D, device=kit.DEVICE, dtype=torch.float16)
    try:
        calls = host_free_calls(q, k, v, D**-0.5)
        print(f"B={B}, H={H}, N={N}, D={D}, fp16, no grad; compiled and replayed "
              "outputs match eager attention's. Microseconds per call:")
    except RuntimeError as error:  # a compiler that cannot take the operator yet
        calls = {}
        print(f"Not compiled or recorded with torch {torch.__version__}: "
              f"{kit.error_summary(error)}")
    host = interleaved_host_ms(calls)
    for name, fn in calls.items():
        kit.warm_up(fn)
        gpu = sum(kit.kernel_ms(fn).values())  # all the call's kernels, copies too
        print(f"{name:30s} host {1e3 * host[name]:6.1f}, GPU {1e3 * gpu:6.1f}, back "
              f"to back {1e3 * kit.back_to_back_ms(fn, 200):6.1f}")
elif __name__ == "__main__":
    print("CUDA graphs and torch.compile of a Triton operator need a GPU: the "
          "tests call lessons::flash_forward here, eagerly, against float64.")

# %%
# What a program holds: the shared-memory budget
# ----------------------------------------------
# ``shared_buffers`` computes what the kernel allocates from its constexprs; the chart
# sets it against the shared memory of the kernel compiled for ``sm_90a`` (lesson 09's
# ``compile_for_hopper``, no GPU needed), which adds bytes that Triton allocates on its
# own (scratch, alignment: the chart shows how many). An H100 gives a program at most
# 227 KiB: a third stage of 128-key tiles fits at :math:`D = 64`, not at 128 (exercise 3
# goes on). The warps and registers printed are lesson 09's: 9 working warps (two groups
# of 4, a loader) padded to 3 groups.


def shared_buffers(D, block_n=FWD.WS_BLOCK_N, stages=FWD.WS_STAGES):
    """{buffer: bytes} that lesson 11's kernel allocates for fp16 inputs."""
    return {"Q": FWD.WS_BLOCK_M * D * 2, "K": stages * block_n * D * 2,
            "V": stages * block_n * D * 2, "mbarriers": 8 * (2 + 4 * stages)}


def compile_forward(D, BLOCK_N=FWD.WS_BLOCK_N, STAGES=FWD.WS_STAGES):
    """Lesson 11's kernel compiled for sm_90a (fp16, causal), with no GPU."""
    def box(rows):
        layout = FWD._ws_box_layout(rows, D, torch.float16)
        return f"tensordesc<fp16[1,1,{rows},{D}],{layout!r}>"

    return FWD.L09.compile_for_hopper(
        FWD.attn_fwd_ws_kernel, desc_q=box(FWD.WS_BLOCK_M // 2), desc_k=box(BLOCK_N),
        desc_v=box(BLOCK_N), O="*fp16", LSE="*fp32", qk_scale="fp32",
        **dict.fromkeys(["H", "BH", "N", "sob", "soh", "son"], "i32"), D=D,
        CAUSAL=True, BLOCK_M=FWD.WS_BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        CONSUMER_REGISTERS=FWD.WS_CONSUMER_REGISTERS,
        LOADER_REGISTERS=FWD.WS_LOADER_REGISTERS, STORE_LSE=True)


def forward_fact(**config):
    """Lesson 09's compiled_facts of compile_forward(**config)."""
    return FWD.L09.compiled_facts(compile_forward(**config))


def forward_facts(configs):
    """forward_fact(**config) for each of configs, on any machine."""
    return kit.compiled_where_triton_can(forward_fact, "13-hopper-forward-profiled",
                                         configs)  # fmt: skip


if __name__ == "__main__":
    try:
        dims = FWD.WS_HEAD_DIMS
        facts = dict(zip(dims, forward_facts([{"D": D} for D in dims])))
    except (RuntimeError, triton.CompilationError) as error:  # an API moved
        print(f"Not compiled with Triton {triton.__version__} ({error}): the chart "
              "shows the buffers alone.")
        facts = dict.fromkeys(FWD.WS_HEAD_DIMS)
    kit.draw_shared_budget({f"D = {D}": (f and f["shared"], shared_buffers(D))
                            for D, f in facts.items()},
                           FWD.L09.H100_SHARED_PER_PROGRAM,
                           "an H100's limit: 227 KiB a program")
    for D, f in facts.items():  # the bytes, warps and registers, as lesson 09 reads
        if f:
            own = f["shared"] - sum(shared_buffers(D).values())
            print(f"D = {D}, compiled for sm_90a by Triton {triton.__version__}: "
                  f"{f['shared']:,} bytes of shared memory ({own:,} Triton's own), "
                  f"{f['warps']} warps (.reqntid {f['reqntid']}), .maxnreg "
                  f"{f['maxnreg']}")


# %%
# Exercises
# ---------
# All three run on a CPU. Write each attempt in a new cell at the end of this lesson's
# notebook (linked at the end of the page), below the checks, and call its check as the
# exercise shows; or in a file next to the lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L13 = kit.load_lesson("13-hopper-forward-profiled")
#    # ... your schedule(n_m, heads, programs), your depths ...
#    L13.check_schedule(schedule)
#    L13.check_ring_depths(depths)
#
# 1. **Balancing causal tiles.** Under causal masking query block :math:`m` of a head
#    loads :math:`m + 1` key blocks. Write ``schedule(n_m, heads, programs)``
#    (``heads`` counts batch times heads): one list per program (empty where nothing is
#    left to run) of the ``(head, m)`` tiles it runs, so that every tile of every head
#    runs exactly once and no program loads more than an even share of the key blocks
#    plus :math:`n_m` (one tile's worth). ``check_schedule(schedule)`` tries it at
#    several sizes and prints how close your busiest program comes to that limit. The
#    tempting answer, tile :math:`t = \mathrm{head} \cdot n_m + m` (lesson 11's order
#    without causal masking) to program :math:`t \bmod` ``programs``, fails at the
#    shortest length here (8 blocks, 128 heads, 132 programs): the check says by how
#    much. Lesson 11's pairs are one answer; longest tile first to the least loaded
#    program is another, which a kernel would have to read from a table.
# 2. **How many calls back to back.** A benchmark that enqueues ``calls`` calls in a
#    row on an idle GPU and divides the wall time (from the first enqueue to the end of
#    the last kernel) by ``calls`` reads a little more than the slower of host and GPU:
#    the first call's host time, or the last kernel, is not hidden. Write
#    ``per_call(host, gpu, calls)``: that time per call, from the schedule that
#    ``timeline`` computes. ``check_per_call(per_call)`` compares it with the schedule
#    at several settings, then uses it to find how many calls of host 1.6 and GPU 1.0
#    it takes to come within 1% of the pace: why the kit times many calls in a row.
# 3. **A narrower tile, a deeper ring.** At :math:`D = 128` the ring holds 2 stages of
#    128-key tiles: 256 keys in flight. How deep can it go with 64-key tiles
#    (``BLOCK_N``), and with 32? Predict from the budget chart (Triton's own bytes
#    hardly change with the ring) and write ``depths = {64: ..., 32: ...}``.
#    ``check_ring_depths(depths)`` compiles the forward for ``sm_90a`` at each depth and
#    one deeper (no GPU needed) and reads their shared memory; on a Hopper GPU it also
#    runs each against float64 and reports its GPU time beside the lesson's tiles.


def check_schedule(fn):
    """Your schedule: every causal tile once, and the busiest program within one tile
    of an even share."""
    for n_m, heads, programs in [(8, 128, 132), (16, 128, 132), (128, 64, 132),
                                 (7, 5, 3), (1, 3, 4)]:
        plan = fn(n_m, heads, programs)
        where = f"{n_m} blocks, {heads} heads"
        if len(plan) != programs:
            raise AssertionError(f"{where}: {len(plan)} lists for {programs} programs")
        tiles = sorted(tile for tiles in plan for tile in tiles)
        if tiles != [(h, m) for h in range(heads) for m in range(n_m)]:
            raise AssertionError(f"{where}: every (head, m) must run exactly once")
        even = -(-(heads * n_m * (n_m + 1) // 2) // programs)  # the total, rounded up
        busiest = max(sum(m + 1 for _, m in tiles) for tiles in plan)
        if busiest > even + n_m:
            raise AssertionError(
                f"{where}, {programs} programs: the busiest program loads {busiest} "
                f"key blocks, above the limit of {even + n_m} (the even share {even}, "
                f"plus {n_m})")
        print(f"{where}, {programs} programs: busiest {busiest} key blocks, limit "
              f"{even + n_m} (even share {even})")
    print("schedule runs every tile once and keeps every program within one tile of "
          "its share.")


def check_per_call(fn):
    """Your per_call against timeline's schedule; then how many calls come within 1%
    of the pace."""
    for host, gpu in [(1.6, 1.0), (1.0, 1.6), (0.5, 2.0), (3.0, 0.5)]:
        for calls in (1, 2, 5, 12):
            _, kernels = timeline(host, gpu, calls)
            expected = (kernels[-1][0] + gpu) / calls
            got = fn(host, gpu, calls)
            if not math.isclose(got, expected, rel_tol=1e-9):
                raise AssertionError(f"host {host}, GPU {gpu}, {calls} calls: the "
                                     f"schedule gives {expected:.4g} per call, "
                                     f"per_call gave {got!r}")
    calls = next(n for n in range(1, 10**4) if fn(1.6, 1.0, n) <= 1.01 * 1.6)
    print(f"per_call follows the schedule. With host 1.6 and GPU 1.0, {calls} calls "
          "come within 1% of the host's pace.")


def check_ring_depths(depths):
    """depths {64: stages, 32: stages}: the deepest ring of BLOCK_N-key tiles that one
    H100 program of the forward holds at D = 128."""
    exercise = "A narrower tile, a deeper ring"
    kit.check_deepest_rings(exercise, depths, "BLOCK_N", (64, 32), lambda rings: [
        fact["shared"] for fact in forward_facts([
            dict(D=128, BLOCK_N=b, STAGES=s) for b, s in rings])],
        FWD.L09.H100_SHARED_PER_PROGRAM)
    rings = {FWD.WS_BLOCK_N: FWD.WS_STAGES, **depths}
    ran = "the forward itself runs only on a Hopper GPU"
    probe = torch.empty(1, 1, 8, 128, dtype=torch.float16, device=kit.DEVICE)
    if FWD.warp_specialized_unsupported(probe, probe, probe) is None:
        generator, scale = kit.fresh_generator(), 128**-0.5
        q, k, v = (torch.randn(1, 8, 2048, 128, generator=generator).to(
            kit.DEVICE, torch.float16) for _ in range(3))
        want = kit.reference_attention(q.double(), k.double(), v.double(), True, scale)
        o, lse = torch.empty_like(q), torch.empty(8, 2048, device=kit.DEVICE)
        for block_n, stages in rings.items():
            FWD._ws_forward(q, k, v, o, lse, True, scale, None, block_n, stages)
            kit.expect_close(exercise, f"BLOCK_N = {block_n}, STAGES = {stages}, "
                             "N = 2048", "O", o, want, torch.float16, 1e-2, 1e-2)
        ms = {b: min(m.gpu) for b, m in kit.time_calls({b: kit.call_timer(
            FWD._ws_forward, q, k, v, o, lse, True, scale, None, b, s)
            for b, s in rings.items()}).items()}
        ran = "by GPU time at N = 2048, causal: " + ", ".join(
            f"{ms[b] * 1e3:.0f} us with {b}-key tiles" for b in rings)
    print(f"{exercise}: right. Keys in flight: " + ", ".join(
        f"{b * s} with {b}-key tiles" for b, s in rings.items()) + f"; {ran}.")
