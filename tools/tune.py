"""Sweep the launch choices of the lessons' kernels on a GPU, to pick the defaults the lessons ship.

    python tools/tune.py softmax        # tile height, warps, pipelining depth, persistent or not
    python tools/tune.py split-row      # chunk and warps of lesson 02's row-sharing kernel
    python tools/tune.py attention      # forward and backward configurations of lesson 05

Prints, per problem, the fastest settings and their speed next to the lesson's current choice.
Uses the lessons' own kernels (imported, not copied); needs a CUDA GPU.
"""

import itertools
import sys

import torch
import triton
from lessons import load


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def tune_softmax():
    lesson = load("01-fused-softmax")
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
    lesson = load("02-long-softmax")
    M = 4096
    for dtype in (torch.float32, torch.bfloat16):
        for N in (65536, 131072, 262144):
            x = torch.randn(M, N, device="cuda", dtype=dtype)
            gbs = lambda ms: 2 * x.numel() * x.element_size() / ms * 1e-6  # noqa: E731
            reference = torch.softmax(x.double(), dim=1)
            results = []
            for chunk, warps in itertools.product((4096, 8192, 16384, 32768), (4, 8, 16, 32)):
                if not 4 <= chunk // (warps * 32) <= 64:
                    continue
                fn = lambda: lesson.split_row_softmax(x, chunk=chunk, num_warps=warps)  # noqa: E731
                error = (fn().double() - reference).abs().max().item()
                assert error < 1e-2, (chunk, warps, error)
                results.append((gbs(bench(fn)), chunk, warps))
            results.sort(reverse=True)
            online = gbs(bench(lambda: lesson.online_softmax(x)))
            top = "; ".join(f"{g:.0f} GB/s chunk={c} w={w}" for g, c, w in results[:4])
            print(f"{str(dtype)[6:]:9s} N={N:6d} online {online:5.0f} | split {top}", flush=True)


def tune_attention():
    lesson = load("05-fused-attention-v2")
    fwd_space = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 8, 4),
                 (128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 128, 16, 2), (256, 64, 16, 3)]
    bwd_space = [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4), (64, 128, 8, 2), (64, 64, 4, 2),
                 (32, 128, 8, 3), (64, 64, 8, 3), (16, 128, 4, 4), (32, 64, 8, 3), (128, 128, 8, 2)]
    for D, H in ((64, 32), (128, 16)):
        for causal in (False, True):
            for N in (4096, 16384):
                q, k, v = (torch.randn(4, H, N, D, device="cuda", dtype=torch.float16, requires_grad=True)
                           for _ in range(3))
                flops = 4 * 4 * H * N * N * D * (0.5 if causal else 1.0)
                scale = D ** -0.5
                best = {"fwd": []}
                for bm, bn, w, s in fwd_space:
                    if bm % bn:
                        continue
                    lesson._fwd.configs = lesson._configs([(bm, bn, w, s)])
                    lesson._fwd.cache.clear()
                    try:
                        ms = bench(lambda: lesson.attention(q, k, v, causal, scale))
                    except Exception as error:  # out of shared memory, for example
                        print(f"  fwd {bm},{bn},{w},{s} failed: {str(error).splitlines()[0][:80]}")
                        continue
                    best["fwd"].append((flops / ms * 1e-9, (bm, bn, w, s)))
                lesson._fwd.configs = lesson._configs([(128, 64, 8, 3)])
                lesson._fwd.cache.clear()
                for atomic_dq, mode in ((False, "bwd"), (True, "bwd, atomic dQ")):
                    o = lesson.attention(q, k, v, causal, scale, atomic_dq)
                    do = torch.randn_like(o)
                    best[mode] = []
                    for bm, bn, w, s in bwd_space:
                        if bm > bn:
                            continue
                        config = lesson._configs([(bm, bn, w, s)])
                        lesson._dkdv.configs, lesson._dq.configs = config, config
                        lesson._dkdv.cache.clear()
                        lesson._dq.cache.clear()
                        try:
                            ms = bench(lambda: o.backward(do, retain_graph=True))
                        except Exception as error:
                            print(f"  {mode} {bm},{bn},{w},{s} failed: {str(error).splitlines()[0][:80]}")
                            continue
                        best[mode].append((2.5 * flops / ms * 1e-9, (bm, bn, w, s)))
                for mode, rows in best.items():
                    rows.sort(reverse=True)
                    print(f"D={D} causal={causal} N={N} {mode}: " +
                          "; ".join(f"{t:.0f} TF/s {c}" for t, c in rows[:4]), flush=True)


if __name__ == "__main__":
    {"softmax": tune_softmax, "split-row": tune_split_row, "attention": tune_attention}[sys.argv[1]]()
