"""
Hopper: where a short forward's time goes
=========================================

Lesson 11's benchmark times each call the way ``triton.testing.do_bench`` does, from the GPU's side.
This lesson takes the calls of that lesson's two forwards apart at the shortest length, where a call
is a few tens of microseconds of GPU work, with two more clocks: a timer on the host, which measures
how long Python, the input checks and the launch take to *enqueue* a call, and the CUDA profiler,
which measures how long the kernels themselves run. Then it measures one design choice of lesson 11
on its own: the persistent grid, one program per SM, against one program per tile.

You will learn:

* the three times of a kernel call (the host's, the GPU's and the benchmark's) and which of them sets
  the pace of calls made back to back, with a picture of each case;
* how to measure each: a host timer over calls that are not waited for, the CUDA profiler's kernel
  durations, and ``do_bench``;
* why ``do_bench``'s clearing of the L2 cache hides host time, and so why lesson 11's path table,
  which counts host time, can disagree with lesson 11's benchmark at the shortest length;
* what one program per SM buys, measured by launching the same kernel both ways;
* how to share causal tiles of unequal length evenly between programs, and how much host time a
  benchmark can hide (the exercises).

It needs ``05-fused-attention-v1.py`` to ``11-hopper-forward-gluon.py`` next to it (the site's zip of
all lessons has them). The measurements need a GPU, and the Gluon kernel a Hopper GPU: on a CPU the
page shows the first picture and the exercises, and says what it skipped.
"""

# %%
# Where the kernels run
# ---------------------
# A CUDA GPU when there is one, otherwise the Triton interpreter on the CPU, switched on before the
# first ``@triton.jit`` (here, before the earlier lessons are loaded).

import functools
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def load_sibling(stem):
    """Another lesson of this site, imported once from the file next to this one: its script, or else its
    notebook (the site's two zips of all lessons hold one or the other side by side); ImportError, saying
    what to download, when neither is there."""
    import json
    import linecache
    import sys
    import types
    from pathlib import Path

    name = "lesson_" + stem.replace("-", "_")
    if name in sys.modules:
        return sys.modules[name]
    here = Path(__file__).parent if "__file__" in globals() else Path.cwd()
    path = here / f"{stem}.py"
    if path.exists():
        source = path.read_text(encoding="utf-8")
    elif path.with_suffix(".ipynb").exists():
        path = path.with_suffix(".ipynb")
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        source = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
        # Triton reads a kernel's source back through linecache: give it the code, not the notebook's JSON.
        linecache.cache[str(path)] = (len(source), None, source.splitlines(keepends=True), str(path))
    else:
        raise ImportError(f"this lesson needs {stem}.py or {stem}.ipynb in the same folder: download all lessons "
                          "as a zip from the site")
    module = types.ModuleType(name)  # not __main__: the lesson defines its kernels and runs nothing heavy
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]  # a half-run lesson must not be found by the next import
        raise
    return module


V2 = load_sibling("06-fused-attention-v2-forward")  # which loads 05-fused-attention-v1 in turn
FWD = load_sibling("11-hopper-forward-gluon")  # which loads 07-fused-attention-v2-backward

if __name__ == "__main__":
    print(V2.describe_platform())

# %%
# Three times of one call
# -----------------------
# A call of ``attention`` runs in two places. On the host, Python checks the inputs, the autograd
# function records the call, and the launcher finds the compiled kernel, packs its arguments (for the
# Gluon forward, three TMA descriptors too) and hands the launch to the CUDA driver, which queues it
# and returns at once. On the GPU, the kernel runs when it reaches the front of the queue. So a call
# has a *host time*, the time to enqueue it, and a *GPU time*, the time its kernels run; and calls made
# back to back, as in training, go at the pace of the slower of the two. When the host is the slower,
# the GPU idles between kernels, and no change to the kernel makes the calls faster.
#
# A benchmark gives a third time. ``do_bench`` clears the L2 cache before each timed call, by
# writing a 256 MiB buffer, and times from the end of that write to the end of the call with CUDA
# events, which read the GPU's clock. While the GPU writes the buffer, the host enqueues the call: a
# host slower than the kernel can still keep ahead of the GPU, and the benchmark then reads the GPU
# time (and a few microseconds more: the events themselves, and the gap between the write and the
# call). The picture's three panels play a few calls through, in illustrative units: host 1.0 and
# GPU 1.6 per call, then host 1.6 and GPU 1.0, then the same in the benchmark, with a write of 1.2
# before each call. It is a schedule, not a measurement; ``timeline`` computes it the way the queue
# works.


def timeline(host, gpu, flush, calls):
    """(start, length) of each enqueue on the host and of each flush and kernel on the GPU, for calls
    enqueued back to back: each kernel starts once it is enqueued and the GPU has finished what came
    before it; the flush before it (of length flush, 0 for none) is enqueued by the host the moment it is
    done with the previous call, and starts then or when the GPU is free."""
    enqueues, flushes, kernels, host_free, gpu_free = [], [], [], 0.0, 0.0
    for _ in range(calls):
        if flush:
            start = max(host_free, gpu_free)
            flushes.append((start, flush))
            gpu_free = start + flush
        enqueues.append((host_free, host))
        host_free += host
        start = max(host_free, gpu_free)
        kernels.append((start, gpu))
        gpu_free = start + gpu
    return enqueues, flushes, kernels


def draw_pacing(calls=4):
    import matplotlib.pyplot as plt

    cases = [("GPU time longer than host time: the GPU runs call after call", 1.0, 1.6, 0.0),
             ("host time longer than GPU time: the GPU waits for each call", 1.6, 1.0, 0.0),
             ("the same calls in do_bench, with L2 cleared before each: the write hides the host", 1.6, 1.0, 1.2)]
    fig, axes = plt.subplots(len(cases), 1, figsize=(8, 5.6), sharex=True)
    host_colour, gpu_colour, flush_colour = "#e4a23c", "#3b7dd8", "#7f7f7f"
    for ax, (title, host, gpu, flush) in zip(axes, cases):
        enqueues, flushes, kernels = timeline(host, gpu, flush, calls)
        ax.broken_barh(enqueues, (1.7, 0.6), color=host_colour, edgecolor="white")
        ax.broken_barh(flushes, (0.7, 0.6), color=flush_colour, edgecolor="white")
        ax.broken_barh(kernels, (0.7, 0.6), color=gpu_colour, edgecolor="white")
        for i, ((h, _), (k, _)) in enumerate(zip(enqueues, kernels)):
            ax.text(h + host / 2, 2.0, f"call {i}", ha="center", va="center", fontsize=9)
            ax.text(k + gpu / 2, 1.0, f"kernel {i}", ha="center", va="center", fontsize=9, color="white")
        ax.set_yticks([1.0, 2.0], ["GPU", "host"], fontsize=10)
        ax.set_ylim(0.5, 2.5)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1].set_xticks([])
    axes[-1].set_xlabel("time (illustrative)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (host_colour, gpu_colour, flush_colour)]
    fig.legend(handles, ["host enqueues a call", "kernel runs", "do_bench clears L2"], loc="lower center",
               ncol=3, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


if __name__ == "__main__":
    draw_pacing()

# %%
# In the last panel the GPU is busy with the write and the kernel, 2.2 units per call, while the
# host needs 1.6: the host gets further ahead with every call, and from the second call on each
# kernel starts as soon as its write ends, so the events read the kernel's 1.0. A benchmark that
# clears the cache hides, from the second call on, any host time up to the write plus the kernel
# (exercise 2 finds that limit); the first call hides only host time up to the write, and above the
# limit each call reads its host time minus the write. The model gives the host no time for
# enqueueing the write and the events, which ``do_bench`` spends, so the real limit is a little
# lower. That is why the sweep that wrote lesson 11's path table (``tools/tune.py attention``, or
# ``attention-paths`` for that table alone) scores each path by the slower of its GPU time and its
# host time, not by ``do_bench``: at the shortest length a call with more host time can win the
# benchmark and lose back to back.
#
# The benchmark at the smallest size
# ----------------------------------
# Lesson 11's forwards and SDPA's backends at lesson 06's shortest length, measured as lesson 11
# measures them, so that the host and GPU times below can be set beside the benchmark's in this run.

WS, PORTABLE = FWD.WS, FWD.PORTABLE
PROVIDER_OF = {"SDPA cuDNN": "SDPA cuDNN", "portable": PORTABLE, "Gluon": WS}  # the calls timed below, by name


def gluon_forward(q, k, v, causal, D):
    """Lesson 11's Gluon forward, where it can run."""
    if FWD.warp_specialized_unsupported(q, k, v) is not None:
        return {}
    return {(WS, "fwd"): functools.partial(FWD.attention, causal=causal, sm_scale=D ** -0.5, warp_specialized=True)}


if __name__ == "__main__" and ON_GPU:
    import pandas as pd

    cases, sizes = V2.CASES, V2.SIZES
    results = pd.DataFrame(V2.run_benchmark(cases, sizes[:1], FWD.portable_and_sdpa, ("fwd",), gluon_forward))
elif __name__ == "__main__":
    print("The benchmark and the measurements below are GPU questions: under the interpreter every call runs on "
          "the host, one program after another.")
V2.results_table(results) if __name__ == "__main__" and ON_GPU else None

# %%
# Host time and GPU time at the smallest size
# -------------------------------------------
# For each case at that length this cell measures the pieces: the host's time to enqueue one call
# without waiting for the GPU (the fastest of ten loops of 50 calls, in two rounds taking turns with
# the other calls, since the host's speed drifts), also with lesson 06's launch plans cleared before
# every call, so that each goes through Triton's JIT; the GPU's own time per call (its kernels'
# durations from the CUDA profiler), for both forwards and for cuDNN; and the write that clears L2.
# Where our ratio to cuDNN by GPU time agrees with the benchmark's, the host did not pace the
# benchmark, and the gap at this size is GPU time. Host times vary from machine to machine far more
# than GPU times do. (The usual cures for host time are CUDA graphs, which replay a whole sequence of
# launches at once, or more work per call.)


def kernel_ms(fn, calls=20):
    """{kernel name: GPU milliseconds per call of fn}, from the CUDA profiler."""
    import warnings

    fn()
    torch.cuda.synchronize()
    # The profiler warns about its own setup, with paths of the machine that runs it: not for the page.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / calls / 1e3 for e in profile.key_averages()
            if e.self_device_time_total > 0}


def benchmark_ms(results, provider, B, H, N, D, causal, mode):
    """Milliseconds per call that the benchmark measured for provider in this case, from its TFLOP/s."""
    row = results[(results["provider"] == provider) & (results["D"] == D) & (results["causal"] == causal)
                  & (results["N"] == N) & (results["mode"] == mode)]
    work = 4 * B * H * N * N * D * (0.5 if causal else 1.0) * (2.5 if mode == "bwd" else 1.0)
    return work / float(row["value"].iloc[0]) * 1e-9


def l2_write_ms():
    """GPU milliseconds of the write with which do_bench clears the L2 cache before each timed call."""
    return sum(kernel_ms(triton.runtime.driver.active.get_empty_cache_for_benchmark().zero_).values())


def who_paced(by_gpu, by_benchmark, host, gpu, write):
    """What set the pace of our calls in the benchmark, from our ratio to cuDNN by GPU time and by the benchmark,
    and our call's host time and GPU time and the L2 write (ms): the benchmark hides host time up to the write
    plus the GPU time ("Three times of one call")."""
    hidden = write + gpu
    if by_benchmark >= 0.95 * by_gpu:
        return (f"the benchmark's is not 5% lower, so the host did not pace it (host time {1e3 * host:.0f} us; the "
                f"L2 write and the GPU time, which the benchmark hides, {1e3 * hidden:.0f} us).")
    if host >= 0.9 * hidden:
        return (f"the benchmark's is lower, and the host time measured here, {1e3 * host:.0f} us, comes within a "
                f"tenth of the {1e3 * hidden:.0f} us of the L2 write and the GPU time, all that the benchmark hides: "
                "there the host can have paced our calls.")
    return (f"the benchmark's is lower, yet the host time measured here, {1e3 * host:.0f} us, is under the "
            f"{1e3 * hidden:.0f} us of the L2 write and the GPU time, which the benchmark hides: the host was slower "
            "while the benchmark ran, or something else slowed those calls, and these measurements cannot tell which.")


def host_ms(fn, calls=50, loops=5):
    """Host milliseconds to enqueue one call of fn, not waiting for the GPU: the fastest of several loops, since
    other work on the machine only ever adds time (the benchmark keeps its fastest timing too)."""
    import time

    fn()
    torch.cuda.synchronize()
    fastest = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        fastest = min(fastest, (time.perf_counter() - start) / calls * 1e3)
        torch.cuda.synchronize()
    return fastest


def interleaved_host_ms(calls, rounds=2):
    """{name: host_ms of calls[name]}, the fastest of rounds that take the calls in turn, sharing out the drift."""
    host = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            host[name] = min(host.get(name, float("inf")), host_ms(fn))
    return host


if __name__ == "__main__" and ON_GPU:
    N, flush = sizes[0], l2_write_ms()
    print(f"Clearing L2 before each timed call: {1e3 * flush:.0f} us of GPU time.")
    measured = []
    for B, H, D in cases:
        for causal in (False, True):
            # Inputs that require gradients, as in the benchmark: autograd then records each call's graph.
            q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16, requires_grad=True)
                       for _ in range(3))
            calls = {"SDPA cuDNN": functools.partial(V2.sdpa_providers(causal, D ** -0.5, ["SDPA cuDNN"])["SDPA cuDNN"],
                                                     q, k, v),
                     "portable": functools.partial(FWD.attention, q, k, v, causal, D ** -0.5, warp_specialized=False)}
            if FWD.warp_specialized_unsupported(q, k, v) is None:
                calls["Gluon"] = functools.partial(FWD.attention, q, k, v, causal, D ** -0.5, warp_specialized=True)
            host = interleaved_host_ms({**calls, **{(name, "unplanned"): lambda fn=fn: (V2.PLANS.clear(), fn())
                                                     for name, fn in calls.items() if name != "SDPA cuDNN"}})
            gpu = {name: sum(kernel_ms(fn).values()) for name, fn in calls.items()}
            ours = min((name for name in calls if name != "SDPA cuDNN"), key=gpu.get)  # less GPU time
            timed = {name: benchmark_ms(results, PROVIDER_OF[name], B, H, N, D, causal, "fwd") for name in calls}
            measured += [{"D": D, "causal": causal, "call": name, "host (us)": round(1e3 * host[name]),
                          "host, plans cleared (us)": round(1e3 * host[name, "unplanned"]) if name != "SDPA cuDNN"
                          else None, "GPU (us)": round(1e3 * gpu[name]), "benchmark (us)": round(1e3 * timed[name])}
                         for name in calls]
            by_gpu, by_benchmark = gpu["SDPA cuDNN"] / gpu[ours], timed["SDPA cuDNN"] / timed[ours]
            print(f"D={D:3d} {'causal    ' if causal else 'non-causal'}: the call with less GPU time ({ours}) is "
                  f"{by_gpu:.2f}x cuDNN by GPU time and {by_benchmark:.2f}x in the benchmark; "
                  + who_paced(by_gpu, by_benchmark, host[ours], gpu[ours], flush))
    measured = pd.DataFrame(measured).set_index(["D", "causal", "call"])
    measured["host, plans cleared (us)"] = measured["host, plans cleared (us)"].astype("Int64")  # none for cuDNN
    # Back to back, as in training, a call goes at the pace of the slower of its host time and its GPU time.
    measured["back to back (us)"] = measured[["host (us)", "GPU (us)"]].max(axis=1)
measured if __name__ == "__main__" and ON_GPU else None

# %%
# The same times as bars, two for each call: its host time and its GPU time. Where the host's bar is
# the longer, calls made back to back go at the host's pace. The black mark is the call's GPU time
# plus the write that clears L2: host time short of it does not show in the benchmark.


def draw_host_and_gpu(measured, flush_us):
    import matplotlib.pyplot as plt

    labels = [f"D={D}{', causal' if causal else ''}: {call}" for D, causal, call in measured.index]
    rows = range(len(labels))
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(labels) + 1.6))
    ax.barh([r - 0.2 for r in rows], measured["host (us)"], height=0.4, color="#e4a23c", label="host time")
    ax.barh([r + 0.2 for r in rows], measured["GPU (us)"], height=0.4, color="#3b7dd8", label="GPU time")
    ax.scatter(measured["GPU (us)"] + flush_us, list(rows), marker="|", s=250, color="black",
               label="GPU time + the L2 write")
    ax.set_yticks(list(rows), labels, fontsize=10)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds per call", fontsize=10)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=10, frameon=False)
    fig.tight_layout()
    return fig


if __name__ == "__main__" and ON_GPU:
    draw_host_and_gpu(measured, 1e3 * flush)
    ours_only = measured.drop(index="SDPA cuDNN", level="call")
    fastest = ours_only.groupby(level=["D", "causal"])
    benchmark_pick = fastest["benchmark (us)"].idxmin().str[-1]
    paced_pick = fastest["back to back (us)"].idxmin().str[-1]
    differ = [f"D={D} {'causal' if causal else 'non-causal'}" for (D, causal), name in paced_pick.items()
              if name != benchmark_pick[D, causal]]
    saved = (ours_only["host, plans cleared (us)"] - ours_only["host (us)"]).astype(float)
    print(f"Lesson 06's launch plans saved {saved.min():.0f} to {saved.max():.0f} us of host time per call of ours "
          f"here: the column with the plans cleared, where each call goes through Triton's JIT, minus the host column.")
    call_of = {provider: name for name, provider in PROVIDER_OF.items()}
    table_pick = {case: call_of[FWD.default_forward(*case, N)] for case in paced_pick.index}
    agree = sum(table_pick[case] == name for case, name in paced_pick.items())
    print(f"Of our two forwards, the benchmark and the back-to-back pace pick the same one in "
          f"{len(paced_pick) - len(differ)} of {len(paced_pick)} cases" + (f"; not at {', '.join(differ)}" if differ
                                                                          else "") +
          f". Lesson 11's FORWARD_PATHS, which the sweep wrote before this build, picks the back-to-back one in "
          f"{agree} of {len(paced_pick)}.")

# %%
# What one program per SM buys
# ----------------------------
# Lesson 11 made its Gluon kernel persistent ("One program per SM" there), so that a program loads
# its next tile while it finishes the last. Here that kernel runs twice, by GPU time per call (the
# profiler's, as above): with one program per SM, as ``attention`` launches it, and with one program
# per tile (per pair of tiles under causal masking), close to a kernel that is not persistent, whose
# programs have nothing after their one unit of work to overlap. Same kernel, same tiles (the
# repository's tests check that both give the same bits); only the number of programs differs. Each
# is profiled twice, in alternating order, and keeps its faster profile: at the shortest length one
# kernel's profile can move from one cell or run to the next (compare the Gluon GPU times above,
# through ``attention``, with the times with one program per SM below), so only the two launches
# measured side by side here are compared. At the longest length a tile's start and end are a small
# part of its work, and the two come out close either way. The table, on a Hopper GPU, gives both
# times per call and the gain: the time with one program per tile over the time with one per SM,
# above 1 where one per SM is faster.

if __name__ == "__main__" and ON_GPU:
    persistence = []
    for B, H, D in cases:
        for causal in (False, True):
            for N in (sizes[0], sizes[1], sizes[-1]):
                q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16) for _ in range(3))
                if FWD.warp_specialized_unsupported(q, k, v) is not None:
                    continue
                o, lse = torch.empty_like(q), torch.empty((B, H, N), device=DEVICE)
                programs = {"per SM": None, "per tile": B * H * V2.host_cdiv(N, FWD.WS_BLOCK_M)}  # capped at the pairs
                ms = {}
                for order in (list(programs), list(programs)[::-1]):
                    for name in order:
                        call = functools.partial(FWD._ws_forward, q, k, v, o, lse, causal, D ** -0.5, programs[name])
                        ms[name] = min(ms.get(name, float("inf")), sum(kernel_ms(call).values()))
                persistence.append({"D": D, "causal": causal, "N": N,
                                    "one per tile or pair (us)": round(1e3 * ms["per tile"]),
                                    "one per SM (us)": round(1e3 * ms["per SM"]),
                                    "gain": round(ms["per tile"] / ms["per SM"], 2)})
pd.DataFrame(persistence).set_index(["D", "causal", "N"]) if __name__ == "__main__" and ON_GPU and persistence else None

# %%
# Computed from those times, on a Hopper GPU:

if __name__ == "__main__" and ON_GPU and persistence:
    gains = pd.DataFrame(persistence)
    shorter, longest = gains[gains["N"] < sizes[-1]]["gain"], gains[gains["N"] == sizes[-1]]["gain"]
    print(f"One program per SM was faster at {(shorter > 1).sum()} of {len(shorter)} cases at N = {sizes[0]} and "
          f"{sizes[1]}, by {shorter.min():.2f}x to {shorter.max():.2f}x; at N = {sizes[-1]} the gain was "
          f"{longest.min():.2f} to {longest.max():.2f}.")

# %%
# Exercises
# ---------
# 1. **Balancing causal tiles.** Under causal masking query block :math:`m` of a head loads
#    :math:`m + 1` key blocks. Write ``schedule(n_m, heads, programs)`` (``heads`` counts batch
#    times heads): one list per program (empty where nothing is left to run) of the ``(head, m)``
#    tiles it runs, so that every tile of every head runs exactly once and no program loads more
#    than an even share of the key blocks plus :math:`n_m` (one tile's worth).
#    ``check_schedule(schedule)`` tries it at several sizes and prints how close your busiest
#    program comes to that limit. The tempting answer, tile :math:`t = \mathrm{head} \cdot n_m + m`
#    (lesson 11's order without causal masking) to program :math:`t \bmod` ``programs``, fails at
#    the shortest length here (8 blocks, 128 heads, 132 programs): the check says by how much.
#    Lesson 11's pairs are one answer; longest tile first to the least loaded program is another,
#    which a kernel would have to read from a table.
# 2. **What the benchmark reads.** ``do_bench`` records a CUDA event when the write that clears L2
#    ends and another when the kernel ends, and reports the time between the two. Write
#    ``events_read(host, gpu, flush, calls)``: that time for each of the calls, a list of ``calls``
#    numbers (for a write of ``flush`` > 0), from the schedule that ``timeline`` computes.
#    ``check_events_read(events_read)`` compares it with the schedule at several settings, then uses
#    it to find the longest host time at which, for a kernel of 1.0 and a write of 1.2, the second
#    call reads the kernel alone: the most host time the benchmark hides, which the verdict under
#    "Host time and GPU time at the smallest size" compares the measured host time with.


def check_schedule(fn):
    """Your schedule: every causal tile once, and the busiest program within one tile of an even share."""
    for n_m, heads, programs in [(8, 128, 132), (16, 128, 132), (128, 64, 132), (7, 5, 3), (1, 3, 4)]:
        plan = fn(n_m, heads, programs)
        if len(plan) != programs:
            raise AssertionError(f"{n_m} blocks, {heads} heads: {len(plan)} lists for {programs} programs")
        tiles = sorted(tile for tiles in plan for tile in tiles)
        if tiles != [(h, m) for h in range(heads) for m in range(n_m)]:
            raise AssertionError(f"{n_m} blocks, {heads} heads: every (head, m) must run exactly once")
        even = -(-(heads * n_m * (n_m + 1) // 2) // programs)  # the total, divided and rounded up
        busiest = max(sum(m + 1 for _, m in tiles) for tiles in plan)
        if busiest > even + n_m:
            raise AssertionError(f"{n_m} blocks, {heads} heads, {programs} programs: the busiest program loads "
                                 f"{busiest} key blocks, above the limit of {even + n_m} (the even share {even}, "
                                 f"plus {n_m})")
        print(f"{n_m} blocks, {heads} heads, {programs} programs: busiest {busiest} key blocks, limit {even + n_m} "
              f"(even share {even})")
    print("schedule runs every tile once and keeps every program within one tile of its share.")


def check_events_read(fn):
    """Your events_read against timeline's schedule; then the longest host time that the benchmark hides."""
    import math

    for host, gpu, flush in [(1.6, 1.0, 1.2), (2.5, 1.0, 1.2), (0.5, 2.0, 0.3), (3.0, 0.5, 1.0)]:
        _, flushes, kernels = timeline(host, gpu, flush, 12)
        expected = [start + length - (write_start + write_length)
                    for (write_start, write_length), (start, length) in zip(flushes, kernels)]
        got = list(fn(host, gpu, flush, 12))
        if len(got) != len(expected) or not all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(got, expected)):
            raise AssertionError(f"host {host}, GPU {gpu}, write {flush}: the events read {expected[:3]} ..., "
                                 f"events_read gave {got[:3]} ...")
    hidden = max(h / 100 for h in range(1, 500) if math.isclose(fn(h / 100, 1.0, 1.2, 2)[1], 1.0, rel_tol=1e-6))
    print(f"events_read follows the schedule. With a kernel of 1.0 and a write of 1.2, the second call reads the "
          f"kernel alone up to a host time of {hidden:.2f}: the write plus the kernel.")
