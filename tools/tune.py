"""Sweep the launch choices of the lessons' kernels on a GPU, to pick the defaults the lessons ship.

    python tools/tune.py softmax        # tile height, warps, pipelining depth, persistent or not
    python tools/tune.py split-row      # chunk and warps of lesson 03's row-sharing kernel
    python tools/tune.py shared-row     # lesson 10's chunk per dtype and row length, or lesson 03's kernel:
                                        # rewrites the table in lesson 10
    python tools/tune.py attention      # the tiles of lessons 06 and 07 (one table, in lesson 06), and the
                                        # fastest forward and backward of 07 and 09: rewrites those tables
    python tools/tune.py attention-paths 1024   # only the forward and backward choices, at these lengths

Prints, per problem, the fastest settings and their speed next to the lesson's current choice.
Uses the lessons' own kernels (imported, not copied); needs a CUDA GPU.
"""

import datetime
import functools
import itertools
import sys

import torch
import triton
from lessons import TUTORIALS, load


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def tune_softmax():
    lesson = load("02-fused-softmax")
    M = 4096
    for dtype in (torch.float32, torch.bfloat16):
        for N in (256, 512, 1024, 2048, 4096, 8192, 12288, 16384):
            x = torch.randn(M, N, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            size = x.element_size()
            gbs = lambda ms: 2 * x.numel() * size / ms * 1e-6  # noqa: E731
            BLOCK_N = triton.next_power_of_2(N)
            results = []
            for block_m, warps, stages, persistent in itertools.product(
                    (1, 2, 4, 8, 16, 32), (4, 8, 16, 32), (1, 2), (True, False)):
                per_thread = block_m * BLOCK_N / (warps * 32)
                if not 4 <= per_thread <= 64 or (not persistent and stages > 1):
                    continue
                args = (x, y, M, N, x.stride(0), x.stride(1), y.stride(0))
                meta = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, NUM_STAGES=stages)
                tiles = triton.cdiv(M, block_m)
                try:
                    grid = lesson._persistent_grid(args, meta, warps, tiles) if persistent else tiles
                except triton.runtime.errors.OutOfResources:
                    continue
                fn = lambda: lesson.softmax_kernel[(grid,)](*args, **meta, num_warps=warps)  # noqa: E731
                try:
                    fn()
                except triton.runtime.errors.OutOfResources:
                    continue
                torch.testing.assert_close(y.float(), torch.softmax(x.float(), 1), atol=1e-2, rtol=1e-2)
                results.append((gbs(bench(fn)), block_m, warps, stages, persistent))
            results.sort(reverse=True)
            current = gbs(bench(lambda: lesson.softmax(x)))
            top = "; ".join(f"{g:.0f} GB/s BM={bm} w={w} s={s} p={int(p)}" for g, bm, w, s, p in results[:3])
            print(f"{str(dtype)[6:]:9s} N={N:6d} current {current:5.0f} | best {top}", flush=True)


def tune_split_row():
    lesson = load("03-long-softmax")
    M = 4096
    for dtype in (torch.float32, torch.bfloat16):
        for N in (65536, 131072, 262144):
            x = torch.randn(M, N, device="cuda", dtype=dtype)
            gbs = lambda ms: 2 * x.numel() * x.element_size() / ms * 1e-6  # noqa: E731
            reference = torch.softmax(x.double(), dim=1)
            results = []
            for chunk, warps in itertools.product((4096, 8192, 16384, 32768), (4, 8, 16, 32)):
                if not 4 <= chunk // (warps * 32) <= 128:
                    continue
                fn = lambda: lesson.split_row_softmax(x, chunk=chunk, num_warps=warps)  # noqa: E731
                error = (fn().double() - reference).abs().max().item()
                assert error < 1e-2, (chunk, warps, error)
                results.append((gbs(bench(fn)), chunk, warps))
            results.sort(reverse=True)
            online = gbs(bench(lambda: lesson.online_softmax(x)))
            top = "; ".join(f"{g:.0f} GB/s chunk={c} w={w}" for g, c, w in results[:4])
            print(f"{str(dtype)[6:]:9s} N={N:6d} online {online:5.0f} | split {top}", flush=True)


def tune_shared_row():
    """Lesson 10's kernel with chunks of 8 to 64 KiB against lesson 03's registers kernel, per dtype and row
    length, fastest of 4 alternating timings; the winner of each case rewritten into lesson 10's table."""
    lesson = load("10-long-softmax-gluon")
    M, table = 4096, {}
    for dtype in (torch.float32, torch.bfloat16):
        for N in lesson.SHARED_LENGTHS:
            x = torch.randn(M, N, device="cuda", dtype=dtype)
            reference = torch.softmax(x.double(), dim=1)
            timers = {None: functools.partial(lesson.LONG.split_row_softmax, x)}
            for chunk_bytes in (8192, 16384, 32768, 65536):
                chunk = chunk_bytes // x.element_size()
                timers[chunk] = functools.partial(lesson.shared_split_row_softmax, x, chunk)
            for key, fn in timers.items():
                error = (fn().double() - reference).abs().max().item()
                assert error < 1e-2, (dtype, N, key, error)
            times = {key: [] for key in timers}
            for r in range(4):
                for key in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
                    times[key].append(bench(timers[key]))
            fastest = {key: min(ms) for key, ms in times.items()}
            table[(str(dtype)[6:], N)] = min(fastest, key=fastest.get)
            gbs = {key: 2 * x.numel() * x.element_size() / ms * 1e-6 for key, ms in fastest.items()}
            print(f"{str(dtype)[6:]:9s} N={N:6d} " + ", ".join(
                f"{'registers' if key is None else key}: {g:.0f} GB/s" for key, g in gbs.items()), flush=True)
    note = (f"# tools/tune.py shared-row, {datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, Triton {triton.__version__}")
    write_block(TUTORIALS / "10-long-softmax-gluon.py", "shared-row chunks", [note] + literal("SHARED_CHUNKS", table))


def write_block(path, title, lines):
    """Replace the lines between "# BEGIN tools/tune.py <title>" and "# END tools/tune.py <title>" in a file."""
    source = path.read_text().splitlines(keepends=True)
    begin = next(i for i, line in enumerate(source) if line.startswith(f"# BEGIN tools/tune.py {title}:"))
    end = next(i for i, line in enumerate(source) if line.startswith(f"# END tools/tune.py {title}"))
    path.write_text("".join(source[:begin + 1] + [line + "\n" for line in lines] + source[end:]))


def literal(name, table):
    """A dict as Python source, one entry per line, sorted: what write_block puts into a lesson."""
    return [f"{name} = {{"] + [f"    {key!r}: {value!r}," for key, value in sorted(table.items())] + ["}"]


def literal_by_bucket(name, table, expand):
    """A table keyed (*case, N) as Python source, one line per case holding its values in the order of N,
    wrapped in the lesson's function `expand` (lesson 06's by_bucket) that turns it back into the table."""
    rows = {}
    for key, value in sorted(table.items()):
        rows.setdefault(key[:-1], []).append(value)
    return [f"{name} = {expand}({{"] + [f"    {case!r}: {values!r}," for case, values in rows.items()] + ["})"]


# Timings of one kernel on this machine spread by a few percent from run to run, so tile configurations
# within this fraction of the fastest count as tied; each distinct one the lessons run is one more
# compilation in every cold build.
TIED = 0.03


def fewest_configs(times, tied=TIED):
    """{bucket: configuration} from {bucket: {configuration: ms}}: a configuration within `tied` of the
    fastest at every bucket, using as few distinct configurations as a greedy cover finds."""
    near = {bucket: {c for c, ms in t.items() if ms <= (1 + tied) * min(t.values())} for bucket, t in times.items()}
    candidates = set().union(*near.values())
    chosen, open_buckets = [], set(times)
    while open_buckets:
        def merit(c):
            covered = [b for b in open_buckets if c in near[b]]
            return len(covered), -sum(times[b][c] / min(times[b].values()) for b in covered), c
        pick = max(candidates, key=merit)
        chosen.append(pick)
        open_buckets -= {b for b in open_buckets if pick in near[b]}
    fastest = {bucket: min(t, key=t.get) for bucket, t in times.items()}
    if len(set(fastest.values())) <= len(chosen):  # a greedy cover can come out larger than the optimum
        return fastest
    return {bucket: min((c for c in chosen if c in near[bucket]), key=times[bucket].get) for bucket in times}


# Paths differ in host time, which moves between runs: at N = 1024 one path's benchmark came out at 240,
# 271 and 160 TFLOP/s in three cold builds of this project. A path must be this much cheaper to be
# preferred over one that asks less of the host.
PATH_TIED = 0.05


def steadiest_of_the_fastest(cost, host, tied=PATH_TIED):
    """The path to run from {path: ms per call} and {path: host ms per call}: of the paths within `tied` of
    the cheapest, the one that asks least of the host. A call's host time drifts with the machine far
    more than its GPU time does, so on a near-tie the path with more room between the two keeps its
    pace on more machines (one sweep picked a path that was 3% cheaper, which a later build measured
    host-paced at 0.61x the other)."""
    near = [path for path, ms in cost.items() if ms <= (1 + tied) * min(cost.values())]
    return min(near, key=lambda path: (host[path], cost[path]))


# A call's host time is a fraction of a millisecond: longer calls skip its measurement, which would wait
# for hundreds of them.
HOST_PACED_BELOW_MS = 1.0


def host_times(measured, calls, rounds=3):
    """{key: the host's ms to enqueue one call} for every key of `measured`: 0 for those without a call in
    `calls` (calls too long for the host to pace); the others by lesson 12's interleaved_host_ms, in rounds
    that take every call in turn, so that a slow spell of the host falls on all the paths alike. Timed one
    path after another, a slow spell had once fallen on one path alone (348 us against 195 to 235 us in
    the other runs) and picked the other backward."""
    timed = load("12-hopper-forward-profiled").interleaved_host_ms(calls, rounds)
    return {key: timed.get(key, 0.0) for key in measured}


HEADS = {64: 32, 128: 16}  # B = 4, H * D = 2048, as in the lessons' benchmarks


def attention_inputs(D, N):
    return [torch.randn(4, HEADS[D], N, D, device="cuda", dtype=torch.float16, requires_grad=True)
            for _ in range(3)]


def fastest_paths(D, causal, N):
    """(forward path, backward path) to run in one case, with the tiles that the lessons' tables hold now: the
    faster forward (Gluon or portable) and the fastest backward (Gluon, two-pass or atomic), each costing the
    slower of its GPU time and the host's time per call, as a user's back-to-back calls see it (on a near-tie,
    the one with less host time: steadiest_of_the_fastest). Prints what it measured."""
    V1, V2 = load("05-fused-attention-v1"), load("06-fused-attention-v2-forward")
    V2_BWD = load("07-fused-attention-v2-backward")
    FWD, HOPPER = load("11-hopper-forward-gluon"), load("13-hopper-backward-gluon")
    q, k, v = attention_inputs(D, N)
    case, scale = (D, causal, N), D ** -0.5
    tflops = lambda ms, work=4 * 4 * HEADS[D] * N * N * D * (0.5 if causal else 1.0): work / ms * 1e-9  # noqa: E731
    gluon_runs = FWD.warp_specialized_unsupported(q, k, v) is None
    forwards = {"portable": lambda: V2_BWD.attention(q, k, v, causal, scale)}
    backwards = {"two-pass": lambda q, k, v: V2_BWD.attention(q, k, v, causal, scale, False),
                 "atomic": lambda q, k, v: V2_BWD.attention(q, k, v, causal, scale, True)}
    if gluon_runs:
        forwards["gluon"] = lambda: FWD.attention(q, k, v, causal, scale, warp_specialized=True)
        backwards["gluon"] = lambda q, k, v: HOPPER.attention(q, k, v, causal, scale, warp_specialized=True)
    # In alternating rounds, timed again where two timings disagree, as the lessons' benchmarks
    # time them: one timing each let noise pick the path at the shortest lengths.
    timers = {(path, "fwd"): functools.partial(V1.bench_ms, fn) for path, fn in forwards.items()}
    timers.update({(path, "bwd"): functools.partial(V1.backward_ms, fn, q, k, v)
                   for path, fn in backwards.items()})
    measured = V1.measure_in_rounds(timers, f"D={D}, N={N}, causal={causal}")
    # The benchmark clears L2 before each timed call, which hides up to that write's GPU time of
    # host time; a user's back-to-back calls hide none. So a path costs the slower of its GPU time
    # and the host's time to enqueue one call: where the host paces the GPU (the shortest
    # lengths), the path that asks less of the host wins, on any build machine's processor.
    calls = {(path, mode): forwards[path] if mode == "fwd" else V1.backward_call(backwards[path], q, k, v)
             for (path, mode), ms in measured.items() if min(ms) <= HOST_PACED_BELOW_MS}
    host = host_times(measured, calls)
    cost = {key: max(min(ms), host[key]) for key, ms in measured.items()}
    forward = {path: ms for (path, mode), ms in cost.items() if mode == "fwd"}
    backward_times = {path: ms for (path, mode), ms in cost.items() if mode == "bwd"}
    sdpa = V1.sdpa_providers(causal, scale, ["SDPA cuDNN"])["SDPA cuDNN"]
    peer_fwd, peer_bwd = V1.bench_ms(lambda: sdpa(q, k, v)), V1.backward_ms(sdpa, q, k, v)
    print(f"D={D} causal={causal!s:5} N={N:5d} fwd " +
          " ".join(f"{p} {tflops(ms):.0f}" for p, ms in forward.items()) +
          f" cuDNN {tflops(peer_fwd):.0f} TFLOP/s | bwd " +
          " ".join(f"{p} {2.5 * tflops(ms):.0f}" for p, ms in backward_times.items()) +
          f" cuDNN {2.5 * tflops(peer_bwd):.0f} | host us " +
          " ".join(f"{p}-{m} {1e3 * ms:.0f}" for (p, m), ms in host.items()) + " | " +
          " ".join(f"{name} {V2.TUNED_CONFIGS[(name, *case)]}" for name in V2.INTERPRETER_CONFIGS),
          flush=True)
    return (steadiest_of_the_fastest(forward, {p: host[p, "fwd"] for p in forward}),
            steadiest_of_the_fastest(backward_times, {p: host[p, "bwd"] for p in backward_times}))


def tune_attention():
    """For each head dim, masking and sequence length of lesson 06's benchmark: the GPU time of every tile
    configuration of each kernel of lessons 06 and 07, then (fewest_configs) one configuration per bucket with
    as few distinct ones as keep every bucket within TIED of its fastest. With those, fastest_paths picks
    each case's forward and backward. Writes the tables into lessons 06, 11 and 13.

    Tiles are compared by the kernel's own GPU time, from the profiler: every tile of one kernel costs
    the host the same, and at short lengths the host's time per call varies more on a shared machine
    than the kernels differ."""
    V1 = load("05-fused-attention-v1")
    V2, V2_BWD = load("06-fused-attention-v2-forward"), load("07-fused-attention-v2-backward")
    PROFILE = load("12-hopper-forward-profiled")
    sizes = (1024, 2048, 4096, 8192, 16384)
    # The launchers read the table while it is being filled: each timing below runs one candidate.
    V2.TUNED_ON.clear()
    V2.TUNED_ON.update(gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
                       torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat(),
                       buckets=sizes)
    V2.TUNED_CONFIGS.clear()

    def kernel_ms(fn, kernel):
        """GPU milliseconds per call of fn spent in the kernel named kernel, on a warm GPU."""
        return PROFILE.kernel_ms(fn, max(3, min(30, V1.warm_up(fn))))[kernel]

    times = {}  # (kernel name, D, causal) -> {N: {configuration: ms}}
    for D in HEADS:
        shapes = {name: [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                         for c in prune(V2._configs(candidates), {}, D=D)]
                  for name, prune, candidates in (("fwd", V2._prune_fwd, V2.FWD_SHAPES),
                                                  ("bwd", V2_BWD._prune_bwd, V2_BWD.BWD_SHAPES))}
        for causal in (False, True):
            scale = D ** -0.5
            for N in sizes:
                q, k, v = (t.detach() for t in attention_inputs(D, N))
                o, lse = V2.forward(q, k, v, causal, scale)
                do = torch.randn_like(o)
                case = (D, causal, N)

                def sweep(name, candidates, timer):
                    measured = times.setdefault((name, D, causal), {})[N] = {}
                    for shape in candidates:
                        V2.TUNED_CONFIGS[(name, *case)] = shape
                        measured[shape] = timer()
                    V2.TUNED_CONFIGS[(name, *case)] = min(measured, key=measured.get)

                def backward(atomic_dq, kernel):
                    return kernel_ms(lambda: V2_BWD.backward(q, k, v, o, do, lse, causal, scale, atomic_dq), kernel)

                sweep("fwd", shapes["fwd"], lambda: kernel_ms(lambda: V2.forward(q, k, v, causal, scale),
                                                              "attn_fwd_kernel"))
                V2.TUNED_CONFIGS[("dkdv", *case)] = shapes["bwd"][0]  # until its own turn below
                sweep("dq", shapes["bwd"], lambda: backward(False, "attn_bwd_dq_kernel"))
                sweep("dkdv", shapes["bwd"], lambda: backward(False, "attn_bwd_dkdv_kernel"))
                sweep("dkdv-atomic", shapes["bwd"], lambda: backward(True, "attn_bwd_dkdv_kernel"))
                fastest = {name: min(times[(name, D, causal)][N].items(), key=lambda item: item[1])
                           for name in V2.INTERPRETER_CONFIGS}
                print(f"D={D} causal={causal!s:5} N={N:5d} fastest: " +
                      " ".join(f"{name} {shape} {ms:.3f} ms" for name, (shape, ms) in fastest.items()), flush=True)
    distinct = 0
    for (name, D, causal), per_size in times.items():
        kept = fewest_configs(per_size)
        for N, shape in kept.items():
            V2.TUNED_CONFIGS[(name, D, causal, N)] = shape
        distinct += len(set(kept.values()))
    print(f"distinct configurations: {distinct} (fastest at every bucket: "
          f"{sum(len({min(t, key=t.get) for t in per_size.values()}) for per_size in times.values())})")

    forward_paths, backward_paths = {}, {}
    for D in HEADS:
        for causal in (False, True):
            for N in sizes:
                forward_paths[D, causal, N], backward_paths[D, causal, N] = fastest_paths(D, causal, N)
    write_block(TUTORIALS / "06-fused-attention-v2-forward.py", "attention",
                literal("TUNED_ON", V2.TUNED_ON) + literal_by_bucket("TUNED_CONFIGS", V2.TUNED_CONFIGS, "by_bucket"))
    write_block(TUTORIALS / "11-hopper-forward-gluon.py", "forward paths",
                literal_by_bucket("FORWARD_PATHS", forward_paths, "V2.by_bucket"))
    write_block(TUTORIALS / "13-hopper-backward-gluon.py", "backward paths",
                literal_by_bucket("BACKWARD_PATHS", backward_paths, "V2.by_bucket"))


def tune_attention_paths(lengths):
    """fastest_paths again at the given sequence lengths only, with the tiles as the lessons hold them, and
    those entries of lessons 11 and 13's path tables rewritten. For a change to the host's work per call,
    which moves the choice between paths at the shortest lengths and no tile's GPU time; a change to a
    kernel needs the whole sweep."""
    V2 = load("06-fused-attention-v2-forward")
    FWD, HOPPER = load("11-hopper-forward-gluon"), load("13-hopper-backward-gluon")
    buckets = V2.TUNED_ON["buckets"]
    if not lengths or any(N not in buckets for N in lengths):
        sys.exit(f"attention-paths takes sequence lengths among the tables' buckets {buckets}, got {lengths}")
    forward_paths, backward_paths = dict(FWD.FORWARD_PATHS), dict(HOPPER.BACKWARD_PATHS)
    for D in HEADS:
        for causal in (False, True):
            for N in lengths:
                forward_paths[D, causal, N], backward_paths[D, causal, N] = fastest_paths(D, causal, N)
    # The tiles' provenance is lesson 06's TUNED_ON; these entries say their own.
    note = (f"# N = {', '.join(map(str, lengths))}: tools/tune.py attention-paths, "
            f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"Triton {triton.__version__}")
    write_block(TUTORIALS / "11-hopper-forward-gluon.py", "forward paths",
                [note] + literal_by_bucket("FORWARD_PATHS", forward_paths, "V2.by_bucket"))
    write_block(TUTORIALS / "13-hopper-backward-gluon.py", "backward paths",
                [note] + literal_by_bucket("BACKWARD_PATHS", backward_paths, "V2.by_bucket"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["attention-paths"]:
        tune_attention_paths([int(n) for n in sys.argv[2:]])
    else:
        {"softmax": tune_softmax, "split-row": tune_split_row, "shared-row": tune_shared_row,
         "attention": tune_attention}[sys.argv[1]]()
