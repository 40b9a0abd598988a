"""
Fused attention v2: FlashAttention-2, forward and backward
==========================================================

FlashAttention-2 (Dao, 2023) reorganizes the FlashAttention-1 algorithm of the previous lesson so
that a GPU spends its time in matrix multiplications. This lesson builds it in portable Triton,
forward and backward, correct for every sequence length, head dimension and masking mode, and
measures it against PyTorch's cuDNN and flash backends. The two lessons after it take the same
algorithm to Hopper's warp-specialized design (FlashAttention-3) in Gluon.

You will learn:

* what FlashAttention-2 changes from v1, and why each change pays;
* how to split causal attention into blocks that need no mask and blocks that do, drawn as a grid;
* the backward pass derived from the forward, including why :math:`\\Delta = \\mathrm{rowsum}(dO \\circ O)`;
* how the backward splits into a :math:`dQ` pass and a :math:`dK, dV` pass, why the :math:`dQ` pass
  runs first, and what FlashAttention-2's atomic additions to :math:`dQ` save and cost instead;
* how to autotune a kernel without making every build slow;
* the mistakes that learners' versions of this kernel make, and the tests that catch each one.

This lesson needs ``04-fused-attention-v1.py`` next to it (the site's zip of all lessons has
both): it reuses that lesson's input checks, its float64 check and its benchmark harness, and
compares the two versions.
"""

# %%
# Where the kernels run
# ---------------------
# A CUDA GPU when there is one, otherwise the Triton interpreter on the CPU, switched on before the
# first ``@triton.jit``.

import functools
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

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


V1 = load_sibling("04-fused-attention-v1")
# Lesson 04's input checks, float64 check and benchmark harness, under their own names here.
check_inputs, resolved, resolved_gradient, reference_attention, check_against_float64 = (
    V1.check_inputs, V1.resolved, V1.resolved_gradient, V1.reference_attention, V1.check_against_float64)
describe_platform, bench_ms, matmul_tflops, save_results = (
    V1.describe_platform, V1.bench_ms, V1.matmul_tflops, V1.save_results)
sdpa_providers, backward_ms, run_benchmark, plot_mode = (
    V1.sdpa_providers, V1.backward_ms, V1.run_benchmark, V1.plot_mode)
results_table, spread_summary, ROUNDS = V1.results_table, V1.spread_summary, V1.ROUNDS

# %%
# What changes from v1, and why
# -----------------------------
# * **Normalize once, at the end.** v1 kept its accumulator normalized: at every key block it
#   computed two per-row factors (each with a division by the new running sum) and multiplied
#   the whole accumulator and the whole probability tile by them. v2 keeps the *unnormalized* sum
#   :math:`a = \sum_j e^{s_j - m} v_j` and divides by :math:`\ell` once after the loop. Inside the
#   loop only the rescaling of the accumulator by :math:`e^{m - m'}` remains: one multiplication
#   per accumulator element per block, and none on the probabilities.
# * **exp2, with** :math:`\log_2 e` **folded into the scale.** The scores are multiplied by
#   ``sm_scale`` anyway; multiplying by ``sm_scale * log2(e)`` instead makes every exponential a
#   bare ``exp2``, one hardware instruction, and saves the multiplication by :math:`\log_2 e` that
#   ``tl.exp`` performs before its own ``exp2``. The backward then saves
#   :math:`\mathrm{LSE}_2 = m + \log_2 \ell` per row, in the same base-2 units.
# * **Parallel over the sequence in the backward too.** The forward grid has one program per
#   (query block, batch, head), as the 2022 kernel of the previous lesson already had. Its
#   backward had one program per (batch, head), each walking every key block in turn. v2's
#   backward runs one program per key block, which owns that block's :math:`dK, dV`. :math:`dQ` is
#   the awkward one: every key block contributes to every query row's :math:`dQ`. The
#   FlashAttention-2 paper has the key-block programs *add* their contributions into an fp32
#   :math:`dQ` with atomic instructions. This lesson builds that, and also the alternative that
#   Triton's own tutorial uses: a pass of its own with one program per query block, which owns
#   its rows of :math:`dQ` outright. Which is faster is measured below.
# * **Causal work split by the diagonal.** For a query block, key blocks entirely below the
#   diagonal are fully visible and need no mask; only the blocks that the diagonal crosses are
#   masked. Blocks above it are skipped altogether: causal attention does about half the work
#   (more than half at short lengths, where the diagonal's blocks weigh more). The grid
#   below, drawn by this lesson's own code, shows which is which for a small case.

LOG2E = 1.4426950408889634


def block_kinds(n, block_m, block_n, causal):
    """For each (query block, key block) pair: 0 skipped, 1 computed with a mask, 2 computed without one."""
    kinds = torch.zeros(triton.cdiv(n, block_m), triton.cdiv(n, block_n), dtype=torch.int64)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            rows, keys = (i * block_m, min(n, (i + 1) * block_m) - 1), (j * block_n, min(n, (j + 1) * block_n) - 1)
            if causal and keys[0] > rows[1]:
                continue  # every key is after every query: nothing to compute
            ragged = keys[1] - keys[0] + 1 < block_n
            crosses = causal and keys[1] > rows[0]
            kinds[i, j] = 1 if ragged or crosses else 2
    return kinds


def draw_block_grid(n=300, block_m=64, block_n=32):
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#f2f2f2", "#e4a23c", "#3b7dd8"])
    fig, axes = plt.subplots(1, 2, figsize=(8, 4.2))
    for ax, causal in zip(axes, (False, True)):
        kinds = block_kinds(n, block_m, block_n, causal)
        ax.imshow(kinds, cmap=cmap, vmin=0, vmax=2, aspect="auto")
        ax.set_xticks(range(kinds.shape[1]), [str(j * block_n) for j in range(kinds.shape[1])], rotation=90,
                      fontsize=10)
        ax.set_yticks(range(kinds.shape[0]), [str(i * block_m) for i in range(kinds.shape[0])], fontsize=10)
        ax.set_xticks([x - 0.5 for x in range(kinds.shape[1] + 1)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(kinds.shape[0] + 1)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        ax.set(title=f"{'causal' if causal else 'non-causal'}, N = {n}", xlabel="first key of the block",
               ylabel="first query of the block")
        counts = [(kinds == k).sum().item() for k in (2, 1, 0)]
        ax.text(0.5, -0.32, f"{counts[0]} without mask, {counts[1]} masked, {counts[2]} skipped",
                transform=ax.transAxes, ha="center", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in cmap.colors[::-1]]
    fig.legend(handles, ["no mask needed", "masked (diagonal or ragged end)", "skipped"], loc="upper center",
               ncol=3, fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


if __name__ == "__main__":
    draw_block_grid()

# %%
# How much work, and what bounds it? The forward does two matrix products of :math:`2N^2D`
# floating-point operations per (batch, head): :math:`4BHN^2D` FLOPs, half that when causal. The
# backward recomputes :math:`QK^T` and does four more products: 2.5 times the forward. The tiles
# lesson counted the bytes a *tile* loads: a program with ``BLOCK_M`` query rows reads all of
# :math:`K` and :math:`V` once, :math:`2ND` elements, to do :math:`4 \cdot \mathrm{BLOCK\_M} \cdot ND`
# FLOPs: :math:`2 \cdot \mathrm{BLOCK\_M}` FLOPs per element, :math:`\mathrm{BLOCK\_M}` per byte in
# fp16, 128 for 128-row tiles. That is below the H100's ridge point (about 990 TFLOP/s over
# 3.35 TB/s, some 300 FLOPs per byte, datasheet figures): if every program fetched K and V from
# device memory, attention would be memory-bound. It is not, because the :math:`N / \mathrm{BLOCK\_M}`
# programs of one (batch, head) run at nearly the same time and read the same K and V: after the
# first reads them, the others find them in the L2 cache. That is the L2 reuse of the tiles
# lesson, and it is why the grid puts the query block, not the head, on its fastest-varying axis.
# Counted from device memory, each of :math:`Q, K, V, O` moves once, and the intensity is about
# :math:`N/2` FLOPs per byte. Attention is bound by the tensor cores, and its speed is best given
# as a fraction of the matrix-multiply rate.
#
# The forward kernel
# ------------------
# The inner loop walks key blocks from ``lo`` to ``hi``. ``MASKED`` is a compile-time flag: the
# compiler produces one loop without any masking for the bulk of the keys, and one with masks for
# the causal diagonal and for the ragged last block when :math:`N` is not a multiple of
# ``BLOCK_N``. Keys past :math:`N` get a score of :math:`-\infty`; their loads read zeros.



@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, lo, hi, rows, N, qk_scale,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    NEGATIVE_SCALE: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        keys = start_n + cols
        if MASKED:
            kt = tl.load(kt_ptrs + keys[None, :] * skn, mask=keys[None, :] < N, other=0.0)
            v = tl.load(v_ptrs + keys[:, None] * svn, mask=keys[:, None] < N, other=0.0)
        else:
            kt = tl.load(kt_ptrs + keys[None, :] * skn)
            v = tl.load(v_ptrs + keys[:, None] * svn)
        if q.dtype == tl.float32:  # interpreter bf16 workaround: see the note below
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, kt)
        if MASKED:
            valid = keys[None, :] < N
            if CAUSAL:
                valid = valid & (keys[None, :] <= rows[:, None])
            s = tl.where(valid, s * qk_scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            s = s - m_new[:, None]
        else:
            # The largest scaled score, without scaling them all first: a negative scale flips which is largest.
            extreme = tl.min(s, axis=1) if NEGATIVE_SCALE else tl.max(s, axis=1)
            m_new = tl.maximum(m_i, extreme * qk_scale)
            s = s * qk_scale - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Under a causal mask, the last query block first: it has the most keys, and the GPU starts programs
    # roughly in order, so the ones that start last, as the GPU runs dry, are the shortest.
    start_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=rows[:, None] < N, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    kt_ptrs = K + b * skb + h * skh + d[:, None] * skd  # K transposed: (D, keys)
    v_ptrs = V + b * svb + h * svh + d[None, :] * svd
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        # Off the diagonal: every key is visible, no mask. On it: the causal mask.
        diag = start_m * BLOCK_M
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, 0, diag, rows, N, qk_scale,
                                        BLOCK_N, False, CAUSAL, NEGATIVE_SCALE)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, diag,
                                        tl.minimum(diag + BLOCK_M, N), rows, N, qk_scale, BLOCK_N, True, CAUSAL,
                                        NEGATIVE_SCALE)
    else:
        full = (N // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, 0, full, rows, N, qk_scale,
                                        BLOCK_N, False, CAUSAL, NEGATIVE_SCALE)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, full, N, rows, N, qk_scale,
                                        BLOCK_N, True, CAUSAL, NEGATIVE_SCALE)
    row_ok = rows < N
    tl.store(LSE + bh * N + rows, m_i + tl.math.log2(l_i), mask=row_ok)
    o = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, o.to(O.dtype.element_ty),
             mask=row_ok[:, None])


# %%
# The causal split requires ``BLOCK_M`` to be a multiple of ``BLOCK_N``, so that the diagonal of a
# query block covers whole key blocks.
#
# Tuning once, not at every build
# -------------------------------
# The best tile sizes depend on the GPU, the head dimension, the masking and the sequence length.
# ``triton.autotune`` would find them by timing every candidate the first time it meets a case,
# which costs each build minutes of compiling and timing, and costs each call of an autotuned kernel
# some host time to look its case up. This lesson measures instead once, offline:
# ``python tools/tune.py attention`` (in this repository) times every candidate below on a GPU,
# for each head dimension, masking and sequence length of the benchmark, and writes the winners
# into the table ``TUNED_CONFIGS`` below (a line per kernel, head dimension and masking, with a
# configuration per sequence-length bucket), with the GPU and versions that produced them. On a GPU of
# that architecture the launchers take the configuration from the table (a sequence length between
# two measured ones takes its power-of-two bucket, one outside them the nearest bucket). Anywhere
# else the autotuner picks from the same candidates, keyed on the head dimension, the causal flag
# and the sequence length rounded up to a power of two, so that it tunes once per bucket rather
# than once per length.
#
# The sweep compares tiles by the kernel's own time on the GPU, read from the CUDA profiler, not by
# the time of a whole call: every tile of one kernel costs the host the same, and at short lengths
# the host's time per call moves more from run to run than the kernels differ.
#
# Candidates that cannot work are never compiled: tiles that break the causal split, and pipelines
# whose buffered key and value tiles (``num_stages x 2 x BLOCK_N x D`` elements) would not fit in
# the SM's shared memory. The best two or three configurations are often within a few percent of
# each other, about the GPU's run-to-run noise, and every distinct configuration a build runs is
# one more compilation. So the sweep treats configurations within 3% of a length's fastest as tied,
# and among tied ones keeps as few distinct configurations per kernel, head dimension and masking
# as it can ("Which tiles ran", below, counts them). Under the interpreter there is nothing to
# tune, and one configuration runs.


def _configs(shapes):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


SHARED_MEMORY_BYTES = 227 * 1024  # per block on Hopper; smaller GPUs fail to compile the rest


def _fits(config, D):
    return config.num_stages * 2 * config.kwargs["BLOCK_N"] * D * 2 <= SHARED_MEMORY_BYTES


def _prune_fwd(configs, named_args, **kwargs):
    D = kwargs.get("D", named_args.get("D"))
    keep = [c for c in configs if c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0 and _fits(c, D)]
    return keep or configs[-1:]


def _prune_bwd(configs, named_args, **kwargs):
    D = kwargs.get("D", named_args.get("D"))
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= c.kwargs["BLOCK_N"] and _fits(c, D)]
    return keep or configs[-1:]


# The candidates, (BLOCK_M, BLOCK_N, warps, stages): those that won somewhere on an H100 in wider sweeps.
FWD_SHAPES = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)]
BWD_SHAPES = [(64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 4), (32, 128, 4, 3)]
# Under the interpreter: one configuration per kernel, obeying the same rules.
INTERPRETER_CONFIGS = {"fwd": (64, 32, 4, 1), "dkdv": (32, 64, 4, 1), "dkdv-atomic": (32, 64, 4, 1),
                       "dq": (32, 64, 4, 1)}


def by_bucket(rows):
    """{(*case, N): value} from {case: [its value at each of TUNED_ON's buckets, in order]}: the tables are
    written one line per case and looked up per sequence-length bucket."""
    buckets = TUNED_ON["buckets"]
    for case, values in rows.items():
        if len(values) != len(buckets):
            raise ValueError(f"table row {case} has {len(values)} values for the {len(buckets)} buckets {buckets}")
    return {(*case, N): value for case, values in rows.items() for N, value in zip(buckets, values)}


# BEGIN tools/tune.py attention: written by the sweep; run it again rather than edit these lines.
TUNED_ON = {
    'buckets': (1024, 2048, 4096, 8192, 16384),
    'capability': (9, 0),
    'date': '2026-11-23',
    'gpu': 'NVIDIA H100 80GB HBM3',
    'torch': '2.11.0+cu130',
    'triton': '3.6.0',
}
TUNED_CONFIGS = by_bucket({
    ('dkdv', 64, False): [(64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)],
    ('dkdv', 64, True): [(64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)],
    ('dkdv', 128, False): [(64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2)],
    ('dkdv', 128, True): [(64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2)],
    ('dkdv-atomic', 64, False): [(64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3)],
    ('dkdv-atomic', 64, True): [(64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)],
    ('dkdv-atomic', 128, False): [(64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3)],
    ('dkdv-atomic', 128, True): [(64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3)],
    ('dq', 64, False): [(64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3)],
    ('dq', 64, True): [(64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2)],
    ('dq', 128, False): [(64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3)],
    ('dq', 128, True): [(32, 64, 4, 4), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 3)],
    ('fwd', 64, False): [(128, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 4), (128, 64, 8, 3)],
    ('fwd', 64, True): [(64, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 64, 8, 4), (128, 64, 8, 4)],
    ('fwd', 128, False): [(64, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 3)],
    ('fwd', 128, True): [(64, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 4)],
})
# END tools/tune.py attention


def host_cdiv(a, b):
    """ceil(a / b) for the launchers. triton.cdiv gives the same, but is built to run inside kernels too, and
    from the host every call first unwraps its arguments: microseconds, which count where the host paces the
    GPU (lesson 07, "Host time and GPU time at the smallest size")."""
    return -(-a // b)


def host_next_power_of_2(n):
    """The smallest power of 2 >= n, for n >= 1: triton.next_power_of_2 without its cost on the host."""
    return 1 << (n - 1).bit_length()


@functools.cache
def _capability(device):
    return torch.cuda.get_device_capability(device)


def tuned_case(q, causal):
    """(D, causal, N bucket): this case's key in the tables that tools/tune.py measured, or None where
    they do not apply (no GPU, another GPU architecture, a dtype other than fp16 and bf16)."""
    if (not ON_GPU or not TUNED_ON or q.dtype not in (torch.float16, torch.bfloat16)
            or _capability(q.device) != TUNED_ON["capability"]):
        return None
    buckets = TUNED_ON["buckets"]
    return q.shape[3], causal, min(max(host_next_power_of_2(q.shape[2]), buckets[0]), buckets[-1])


# %%
# The backward, derived
# ---------------------
# Write the forward for one (batch, head) with the scale folded into the scores:
#
# .. math::
#
#    S &= \mathrm{scale}\cdot Q K^T, \\
#    P &= \mathrm{softmax}_{\text{rows}}(S), \\
#    O &= P V.
#
# Given :math:`dO = \partial L / \partial O`, walk back one step at a time.
#
# * :math:`O = PV` is a matrix product, so :math:`dV = P^T dO` and :math:`dP = dO\, V^T`.
# * The softmax acts on each row separately. For one row, :math:`p = \mathrm{softmax}(s)` has the
#   Jacobian :math:`\partial p_j / \partial s_k = p_j(\delta_{jk} - p_k)`, so
#   :math:`ds_k = \sum_j dp_j\, p_j (\delta_{jk} - p_k) = p_k\,(dp_k - \sum_j p_j\, dp_j)`: the
#   same rule as the softmax backward of the first lesson. For the whole matrix,
#   :math:`dS = P \circ (dP - \Delta)` with :math:`\Delta_i = \sum_j P_{ij}\, dP_{ij}`.
# * :math:`\Delta_i` looks as if it needed the whole row of :math:`P`, which is never stored. It
#   does not: substitute :math:`dP = dO\,V^T`,
#
#   .. math::
#
#      \Delta_i &= \sum_j P_{ij} \sum_d dO_{id} V_{jd} \\
#               &= \sum_d dO_{id} \sum_j P_{ij} V_{jd} \\
#               &= \sum_d dO_{id}\, O_{id},
#
#   a dot product of two rows that are already in memory. Triton's tutorial computes it in a
#   small *preprocess* kernel before the main passes. In this lesson's default, two-pass
#   backward it costs no kernel of its own; only the atomic backward keeps the preprocess (see
#   "Who owns what").
# * :math:`S = \mathrm{scale}\cdot QK^T` gives :math:`dQ = \mathrm{scale}\cdot dS\,K` and
#   :math:`dK = \mathrm{scale}\cdot dS^T Q`.
#
# The backward recomputes each tile of :math:`P` from the row statistic the forward saved,
# :math:`P = 2^{S \cdot \log_2 e - \mathrm{LSE}_2}` (already normalized, no division), and
# multiplies: :math:`QK^T` again, then :math:`dV`, :math:`dP`, :math:`dK`, :math:`dQ`, five
# products where the forward did two. (v1 instead divided :math:`dO` by :math:`\ell` in its
# preprocess, so that the unnormalized :math:`e^{S - m}` could stand in for :math:`P`; saving
# :math:`\mathrm{LSE}` makes that unnecessary.)
#
# Who owns what
# -------------
# The :math:`dK, dV` program owns a block of keys and walks the query blocks that can see them:
# with causal masking, only those at or below the diagonal. At each query block it has
# :math:`dS` in registers, and :math:`dS\,K` is exactly this key block's share of those rows'
# :math:`dQ`. There are two ways to finish :math:`dQ`:
#
# * **Atomically** (``atomic_dq=True``, the paper's way): multiply :math:`dS\,K` right there and
#   add it into an fp32 buffer with ``tl.atomic_add``. Five matrix products per block pair, the
#   minimum. The price: traffic to the GPU's L2 cache for every addition, an fp32 buffer of
#   :math:`BHND` elements, and a :math:`dQ` whose last bits depend on the order in which programs
#   happened to add, so two runs can differ slightly. ``sem="relaxed"`` tells Triton that the
#   additions need no ordering with other memory operations, only atomicity.
# * **In a pass of its own** (the default): a :math:`dQ` program owns a block of queries and walks
#   the key blocks it sees. It must recompute :math:`S` and :math:`dP`, two matrix products that
#   the :math:`dK, dV` pass also does: seven products instead of five, 40% more tensor-core work,
#   but no atomics, nothing extra in memory, and the same bits on every run.
#
# Both passes need :math:`\Delta`, and the :math:`dQ` pass decides where it comes from. A :math:`dQ`
# program holds its rows of :math:`dO` anyway; it loads the same rows of :math:`O`, computes their
# :math:`\Delta`, uses it, and stores it. So this pass runs *first*, and the :math:`dK, dV` pass,
# which walks every query block and needs every row's :math:`\Delta`, reads what it stored. The
# preprocess kernel is gone: one launch fewer per backward (launching it took 30 us of host time at
# :math:`N = 1024` in an H100 probe, the engineering notes' row for ``c85df52``). The atomic
# backward has no :math:`dQ` pass to fold it into, so it keeps the preprocess.
#
# In both, masking is needed only on the diagonal and on ragged edges: a query row past :math:`N`
# is loaded as zeros, so its :math:`dO` and :math:`\Delta` are zero and it contributes nothing; a
# key row past :math:`N` is loaded as zeros, so it adds nothing to :math:`dQ`, and its own
# :math:`dK, dV` rows are never stored. The picture shows one program of each pass on the causal
# grid of blocks: what it owns, and which blocks it walks.


def draw_backward_passes(n_blocks=8, key_block=2, query_block=5):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 4.4))
    titles = [f"dK, dV pass: one program owns key block {key_block}",
              f"dQ pass: one program owns query block {query_block}"]
    for ax, title, owns_keys in zip(axes, titles, (True, False)):
        for i in range(n_blocks):  # query blocks, top to bottom
            for j in range(i + 1):  # causal: key blocks at or left of the diagonal
                walked = j == key_block if owns_keys else i == query_block
                color = "#3b7dd8" if walked else "#dddddd"
                ax.add_patch(plt.Rectangle((j, i), 0.94, 0.94, color=color, alpha=1.0 if walked else 0.7))
                if walked and i == j:
                    ax.text(j + 0.47, i + 0.5, "mask", ha="center", va="center", fontsize=10, color="white")
        if owns_keys:
            ax.annotate("", xy=(key_block + 0.47, n_blocks - 0.1), xytext=(key_block + 0.47, key_block + 0.9),
                        arrowprops=dict(arrowstyle="->", lw=2, color="#c0392b"))
            note = "walks down the query blocks;\nholds dK, dV in registers;\nadds dS K to dQ (atomic) or not"
        else:
            ax.annotate("", xy=(query_block - 0.05, query_block + 0.47), xytext=(0.05, query_block + 0.47),
                        arrowprops=dict(arrowstyle="->", lw=2, color="#c0392b"))
            note = "walks across the key blocks;\nholds dQ in registers;\nrecomputes S and dP"
        ax.text(n_blocks - 0.1, 0.3, note, ha="right", va="top", fontsize=10)
        ax.set(xlim=(0, n_blocks), ylim=(n_blocks, 0), xlabel="key block", ylabel="query block")
        ax.set_title(title, fontsize=11)
        ax.set_xticks([j + 0.47 for j in range(n_blocks)], range(n_blocks), fontsize=10)
        ax.set_yticks([i + 0.47 for i in range(n_blocks)], range(n_blocks), fontsize=10)
        ax.set_aspect("equal")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    draw_backward_passes()

# %%
# The kernels: the preprocess that computes :math:`\Delta` for the atomic backward, the
# :math:`dK, dV` pass, and the :math:`dQ` pass, which the two-pass backward runs first.


@triton.jit
def attn_bwd_preprocess_kernel(O, DO, DELTA, H, N, sob, soh, son, sod, sdb, sdh, sdn, sdd,
                               D: tl.constexpr, BLOCK_M: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    ok = rows[:, None] < N
    o = tl.load(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, mask=ok, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd, mask=ok, other=0.0)
    tl.store(DELTA + bh * N + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=rows < N)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys, lo, hi, N, sm_scale,
                    qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    for start_m in tl.range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        if MASKED:
            q = tl.load(q_ptrs + rows[:, None] * sqn, mask=rows[:, None] < N, other=0.0)
            do = tl.load(do_ptrs + rows[:, None] * sdn, mask=rows[:, None] < N, other=0.0)
            lse = tl.load(LSE_bh + rows, mask=rows < N, other=0.0)
            delta = tl.load(DELTA_bh + rows, mask=rows < N, other=0.0)
        else:
            q = tl.load(q_ptrs + rows[:, None] * sqn)
            do = tl.load(do_ptrs + rows[:, None] * sdn)
            lse = tl.load(LSE_bh + rows)
            delta = tl.load(DELTA_bh + rows)
        if k.dtype == tl.float32:  # interpreter bf16 workaround
            q, do = q.to(tl.float32), do.to(tl.float32)
        pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # P^T: (keys, queries)
        if MASKED and CAUSAL:
            pt = tl.where(keys[:, None] <= rows[None, :], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk)
        if ATOMIC_DQ:
            # This key block's share of dQ for these query rows, added to an fp32 buffer that every
            # key block of the head adds to as well: the fifth matrix product, no dQ pass.
            dq = tl.dot(tl.trans(dst), k) * sm_scale
            if MASKED:
                tl.atomic_add(dq_ptrs + rows[:, None] * D, dq, mask=rows[:, None] < N, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs + rows[:, None] * D, dq, sem="relaxed")
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA, sm_scale, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdn, sdd,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    keys = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    key_ok = keys[:, None] < N
    k = tl.load(K + b * skb + h * skh + keys[:, None] * skn + d[None, :] * skd, mask=key_ok, other=0.0)
    v = tl.load(V + b * svb + h * svh + keys[:, None] * svn + d[None, :] * svd, mask=key_ok, other=0.0)
    if UPCAST_DOT:
        k, v = k.to(tl.float32), v.to(tl.float32)
    q_ptrs = Q + b * sqb + h * sqh + d[None, :] * sqd
    do_ptrs = DO + b * sdb + h * sdh + d[None, :] * sdd
    dq_ptrs = DQ + bh * N * D + d[None, :]  # the fp32 dQ buffer: contiguous, D elements per row
    LSE_bh, DELTA_bh = LSE + bh * N, DELTA + bh * N
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    full = (N // BLOCK_M) * BLOCK_M  # query rows below this need no bounds mask
    if CAUSAL:
        # Query blocks that cross this key block's diagonal need the mask; those below do not.
        past_diag = tl.minimum(start_n + BLOCK_N, N)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
                                 start_n, past_diag, N, sm_scale, qk_scale, D, BLOCK_M, True, CAUSAL, ATOMIC_DQ)
        lo = start_n + BLOCK_N
    else:
        lo = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
                             lo, tl.maximum(lo, full), N, sm_scale, qk_scale, D, BLOCK_M, False, CAUSAL, ATOMIC_DQ)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, sqn, sdn, LSE_bh, DELTA_bh, keys,
                             tl.maximum(lo, full), N, N, sm_scale, qk_scale, D, BLOCK_M, True, False, ATOMIC_DQ)
    out = bh * N * D + keys[:, None] * D + d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=key_ok)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, lo, hi, N, qk_scale,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            kt = tl.load(kt_ptrs + keys[None, :] * skn, mask=keys[None, :] < N, other=0.0)
            vt = tl.load(vt_ptrs + keys[None, :] * svn, mask=keys[None, :] < N, other=0.0)
        else:
            kt = tl.load(kt_ptrs + keys[None, :] * skn)
            vt = tl.load(vt_ptrs + keys[None, :] * svn)
        if q.dtype == tl.float32:  # interpreter bf16 workaround
            kt, vt = kt.to(tl.float32), vt.to(tl.float32)
        p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])
        if MASKED and CAUSAL:
            p = tl.where(keys[None, :] <= rows[:, None], p, 0.0)
        dp = tl.dot(do, vt)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, O, DO, DQ, LSE, DELTA, sm_scale, qk_scale, H, N, N_BUCKET,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod, sdb, sdh, sdn, sdd,
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # This kernel's query block is BLOCK_N rows and its key block BLOCK_M: the dK, dV pass's names
    # turned round, so that one list of (small, large) candidate pairs serves both passes.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)) * BLOCK_N  # as in the forward
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = start_m + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    row_ok = rows < N
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + rows[:, None] * sdn + d[None, :] * sdd, mask=row_ok[:, None], other=0.0)
    o = tl.load(O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod, mask=row_ok[:, None], other=0.0)
    # These rows' Delta, for this pass and, stored, for the dK, dV pass that runs next.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * N + rows, delta, mask=row_ok)
    if UPCAST_DOT:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(LSE + bh * N + rows, mask=row_ok, other=0.0)
    kt_ptrs = K + b * skb + h * skh + d[:, None] * skd
    vt_ptrs = V + b * svb + h * svh + d[:, None] * svd
    dq = tl.zeros([BLOCK_N, D], tl.float32)
    if CAUSAL:
        diag = start_m
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, 0, diag, N, qk_scale,
                           BLOCK_M, False, CAUSAL)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, diag,
                           tl.minimum(diag + BLOCK_N, N), N, qk_scale, BLOCK_M, True, CAUSAL)
    else:
        full = (N // BLOCK_M) * BLOCK_M
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, 0, full, N, qk_scale,
                           BLOCK_M, False, CAUSAL)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, kt_ptrs, vt_ptrs, skn, svn, rows, full, N, N, qk_scale,
                           BLOCK_M, True, CAUSAL)
    tl.store(DQ + bh * N * D + rows[:, None] * D + d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# %%
# In the :math:`dQ` kernel the roles of the two block sizes swap: it owns the large block (of
# queries) and walks the small one (of keys), just as the :math:`dK, dV` kernel owns the large
# block of keys. One list of candidate pairs serves both, and each kernel gets its own measured pick.
#
# A note on the interpreter (of Triton 3.9, which the pinned requirements install; a GPU build of
# this page may use another Triton, printed above its benchmark): it stores bf16
# values as 16-bit integers and multiplies those integers inside ``tl.dot``. The kernels take an
# ``UPCAST_DOT`` flag that turns the first operands into fp32 (and the helpers follow the dtype
# they see); the launcher sets it only for bf16 under the interpreter, so compiled GPU code never
# pays for it.
#
# The launcher and autograd
# -------------------------
# Each kernel runs with the configuration that the table above gives for its case, or, where no
# measurement applies, the autotuner's pick; under the interpreter, with its one configuration.
# ``attention`` checks its inputs, and an autograd function calls the forward and, when PyTorch
# asks for gradients, the backward. The forward and the backward are also plain functions
# (``forward``, ``backward_delta``, ``backward``): the two Hopper lessons that follow reuse them.
# ``backward_delta`` is the preprocess, for the backwards that need :math:`\Delta` before they start.
#
# At short lengths the host's work per call matters as much as the GPU's (lesson 07's section "Host
# time and GPU time at the smallest size" measures both). One large piece is Triton's JIT dispatch:
# on every call it inspects each of some thirty arguments, to find what the compiled kernel was
# specialized on (dtypes, integers equal to 1 or divisible by 16, pointers aligned to 16 bytes), and
# looks the kernel up by that. Every one of those answers, and every argument besides the tensors
# and the scale, follows from the inputs' shapes, strides, dtypes and alignment. So the first call
# with a given layout goes through the JIT and keeps a *launch plan*: the compiled kernel, its grid
# and those arguments. Later calls with the same layout pass only their tensors and scale to the
# compiled kernel's own launcher. (Only launches with a known configuration keep plans: a case that
# the table does not cover, fp8 among them, goes through the autotuner and the JIT on every call.)

if ON_GPU:
    _fwd = triton.autotune(_configs(FWD_SHAPES), key=["D", "CAUSAL", "N_BUCKET"],
                           prune_configs_by={"early_config_prune": _prune_fwd})(attn_fwd_kernel)
    # Timing a configuration runs the kernel, and with ATOMIC_DQ that adds to the dQ buffer:
    # reset_to_zero clears it before each trial and before the real call. The two-pass dK, dV pass
    # gets its own tuner without it, since there DQ holds the dQ pass's finished result.
    _dkdv_atomic = triton.autotune(_configs(BWD_SHAPES), key=["D", "CAUSAL", "ATOMIC_DQ", "N_BUCKET"],
                                   reset_to_zero=["DQ"], prune_configs_by={"early_config_prune": _prune_bwd}
                                   )(attn_bwd_dkdv_kernel)
    _dkdv = triton.autotune(_configs(BWD_SHAPES), key=["D", "CAUSAL", "ATOMIC_DQ", "N_BUCKET"],
                            prune_configs_by={"early_config_prune": _prune_bwd})(attn_bwd_dkdv_kernel)
    _dq = triton.autotune(_configs(BWD_SHAPES), key=["D", "CAUSAL", "N_BUCKET"],
                          prune_configs_by={"early_config_prune": _prune_bwd})(attn_bwd_dq_kernel)
    TUNERS = {"fwd": _fwd, "dkdv": _dkdv, "dkdv-atomic": _dkdv_atomic, "dq": _dq}


PLANS = {}  # plan key -> replay(*fresh arguments)


def plan_key(*tensors):
    """The layout part of a launch plan's key on a GPU, None under the interpreter: the current GPU, and each
    tensor's shape, strides, dtype and 16-byte alignment."""
    if not ON_GPU:
        return None
    return (torch.cuda.current_device(), *((t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors))


def launch_planned(key, kernel, grid, fresh, args, constexprs, **options):
    """kernel[grid](*args, **constexprs, **options): through Triton's JIT the first time this launch is seen,
    then through the plan it leaves. The call site promises that key (plan_key of the inputs) fixes the
    arguments after the first fresh; the kernel, the grid, the constexprs and the options complete the key.
    Lesson 04's launch() does the rest, and while its compile_ahead runs, only compiles."""
    if key is None or V1.compiling_ahead():
        V1.launch(kernel, grid, *args, **constexprs, **options)
        return
    key = (kernel, key, grid, *constexprs.values(), *options.values())
    replay = PLANS.get(key)
    if replay is not None:
        replay(*args[:fresh])
        return
    compiled = kernel[grid](*args, **constexprs, **options)
    rest = (*args[fresh:], *(constexprs[name] for name in kernel.arg_names[len(args):]))
    run = compiled[(*grid, 1, 1)[:3]]
    if len(PLANS) >= 1024:  # a caller whose lengths keep changing would otherwise grow it without end
        PLANS.clear()
    PLANS[key] = lambda *values: run(*values, *rest)


def _launch(kernel, name, key, case, grid, fresh, *args, **meta):
    """Run kernel with the configuration measured for this case, else (a GPU the table does not cover)
    let the autotuner pick one; grid(BLOCK_M, BLOCK_N) is the launch grid, key and fresh as for launch_planned."""
    if not ON_GPU:
        config = INTERPRETER_CONFIGS[name]
    else:
        config = TUNED_CONFIGS.get((name, *case)) if case else None
    if config is None:
        V1.launch(TUNERS[name], lambda m: grid(m["BLOCK_M"], m["BLOCK_N"]), *args, **meta)
    else:
        block_m, block_n, warps, stages = config
        launch_planned(key, kernel, grid(block_m, block_n), fresh, args,
                       dict(meta, BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps, num_stages=stages)


def keys_contiguous(v, dtype=None):
    """The same (B, H, N, D) values, stored with the sequence axis contiguous, cast to dtype on the way."""
    return v.transpose(2, 3).to(dtype or v.dtype, memory_format=torch.contiguous_format).transpose(2, 3)


def forward(q, k, v, causal, sm_scale):
    """O and LSE_2 (base-2 log-sum-exp of each row's scores, in fp32) from the portable forward kernel."""
    B, H, N, D = q.shape
    o = torch.empty((B, H, N, D), dtype=torch.float16 if q.dtype == torch.float8_e5m2 else q.dtype, device=q.device)
    lse = torch.empty((B * H, N), dtype=torch.float32, device=q.device)
    if q.dtype == torch.float8_e5m2 and v.stride(2) != 1 and N > 1:
        v = keys_contiguous(v)  # lesson 07, "fp8 on Hopper: the layout of V", says why
    _launch(attn_fwd_kernel, "fwd", plan_key(q, k, v), tuned_case(q, causal),
            lambda bm, bn: (host_cdiv(N, bm), B * H), 6, q, k, v, o, lse, sm_scale * LOG2E, H, N,
            host_next_power_of_2(N), *q.stride(), *k.stride(), *v.stride(), *o.stride(), D=D, CAUSAL=causal,
            UPCAST_DOT=_upcast(q), NEGATIVE_SCALE=sm_scale < 0)
    return o, lse


def _upcast(q):
    """Whether tl.dot needs fp32 operands: bf16 under the interpreter (see the note above)."""
    return (not ON_GPU) and q.dtype == torch.bfloat16


def backward_delta(o, do):
    """Delta = rowsum(dO * O) in fp32, shape (B * H, N): the preprocess kernel, for the atomic backward
    and lesson 08's."""
    B, H, N, D = o.shape
    delta = torch.empty((B * H, N), dtype=torch.float32, device=o.device)
    launch_planned(plan_key(o, do), attn_bwd_preprocess_kernel, (host_cdiv(N, 64), B * H), 3,
                   (o, do, delta, H, N, *o.stride(), *do.stride()), dict(D=D, BLOCK_M=64))
    return delta


def backward(q, k, v, o, do, lse, causal, sm_scale, atomic_dq):
    """dQ, dK, dV from the portable kernels: the two-pass backward (the dQ pass, which also computes Delta,
    then the dK, dV pass), or with atomic_dq the preprocess and one dK, dV pass that adds into dQ."""
    B, H, N, D = q.shape
    dk = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    scales = (sm_scale, sm_scale * LOG2E, H, N, host_next_power_of_2(N))
    meta = dict(D=D, CAUSAL=causal, UPCAST_DOT=_upcast(q))
    case = tuned_case(q, causal)
    grid = lambda bm, bn: (host_cdiv(N, bn), B * H)  # noqa: E731
    if atomic_dq:
        # dQ is summed in fp32: adding fp16 partial sums would lose bits at every add.
        dq = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
        delta = backward_delta(o, do)
    else:
        dq = torch.empty_like(dk)
        delta = torch.empty((B * H, N), dtype=torch.float32, device=q.device)
        _launch(attn_bwd_dq_kernel, "dq", plan_key(q, k, v, o, do), case, grid, 10, q, k, v, o, do, dq, lse, delta,
                *scales, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), **meta)
    _launch(attn_bwd_dkdv_kernel, "dkdv-atomic" if atomic_dq else "dkdv", plan_key(q, k, v, do), case, grid, 11, q, k,
            v, do, dq, dk, dv, lse, delta, *scales, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
            ATOMIC_DQ=atomic_dq, **meta)
    return (dq.to(q.dtype) if atomic_dq else dq), dk, dv


class _AttentionV2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, atomic_dq):
        o, lse = forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.atomic_dq = causal, sm_scale, atomic_dq
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = resolved_gradient(do)
        return *backward(q, k, v, o, do, lse, ctx.causal, ctx.sm_scale, ctx.atomic_dq), None, None, None


def attention(q, k, v, causal, sm_scale, atomic_dq=False):
    """FlashAttention-2: softmax(q k^T * sm_scale) v over (batch, heads, sequence, head_dim) tensors.

    ``atomic_dq`` picks how the backward sums dQ. False: in a pass of its own, the same bits every run.
    True: inside the dK, dV pass, with FlashAttention-2's atomic additions: fewer matrix products,
    but dQ's rounding varies from run to run.
    """
    check_inputs(q, k, v, causal, sm_scale, fp8=True)
    if not isinstance(atomic_dq, bool):
        raise TypeError(f"atomic_dq must be True or False, got {atomic_dq!r}")
    return _AttentionV2.apply(*resolved(q, k, v), causal, float(sm_scale), atomic_dq)


# %%
# Correctness
# -----------
# Right after the kernels, before any timing: the forward and all three gradients against float64
# PyTorch on fresh random inputs, causal and not, both ways of computing :math:`dQ`, at a sequence
# length one past a block boundary, and with ``q`` made by transposing a (batch, sequence, heads,
# dim) tensor, so that its strides are not the contiguous ones. The check is lesson 04's
# ``check_against_float64``, which fails on NaN or infinity anywhere and names what is off.


if __name__ == "__main__":
    torch.manual_seed(0)
    B, H, N, D = 2, 3, 129 if ON_GPU else 65, 64
    cases = {(causal, atomic_dq): (torch.randn(B, N, H, D, device=DEVICE, dtype=torch.float16).transpose(1, 2),
                                   *(torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16) for _ in range(2)))
             for causal in (False, True) for atomic_dq in (False, True)}  # q strided
    # Every kernel the checks launch, compiled first on all CPU cores (lesson 04's compile_ahead).
    V1.compile_ahead(lambda: [V1.forward_and_backward(functools.partial(attention, atomic_dq=atomic_dq), *qkv,
                                                      causal, D ** -0.5) for (causal, atomic_dq), qkv in cases.items()])
    for (causal, atomic_dq), (q, k, v) in cases.items():
        errors = check_against_float64(functools.partial(attention, atomic_dq=atomic_dq), q, k, v, causal,
                                       D ** -0.5, f"05-fused-attention-v2, causal={causal}, atomic_dq={atomic_dq}")
        print(f"causal={causal!s:5}, atomic_dq={atomic_dq!s:5}, N={N}: "
              + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))

# %%
# Mistakes learners make, and the test that catches each
# ------------------------------------------------------
# Versions of this kernel written from scratch, and even the published tutorial, share a handful
# of bugs. Each is caught by a test in this project's suite (``tests/test_attention.py``):
#
# * **dO loaded through O's pointers.** A from-scratch backward that reuses the output's pointer
#   block to load the upstream gradient computes the gradient of the wrong function. It runs, and
#   the loss even goes down. Caught by comparing every gradient with float64 autograd on a random
#   :math:`dO` (never on :math:`dO = 1` or :math:`dO = O`, which can hide it).
# * **Q.shape(3).** ``shape`` is a tuple, not a function: ``Q.shape[3]``. The launcher fails before
#   any kernel runs; caught by any test that runs the code at all.
# * **The row statistics allocated on the CPU** (the upstream tutorial's ``M``, this lesson's
#   LSE). ``torch.empty(...)`` without ``device=`` hands a host pointer to a GPU kernel: a crash
#   or silent garbage. Here every buffer is created with ``device=q.device``, and the input checks
#   refuse tensors on different devices.
# * **A backward that ignores** ``causal=False``. The published v2 tutorial computed the causal
#   gradient whatever it was asked; the forward was right, so only a gradient test of the
#   non-causal case sees it. The tests run both modes.
# * **Sequence lengths that must be a multiple of 128.** Unmasked loads read past the end of the
#   tensors. Here the ragged edge is masked; the tests use :math:`N = 1, 77, 300` and one past a
#   block boundary.
# * **Contiguity assumed.** Computing offsets as ``row * D + col`` breaks on a transposed view.
#   The kernels take every stride, and the tests feed transposed inputs.

# %%
# Benchmark
# ---------
# TFLOP/s, forward and backward, causal and not, on a GPU at :math:`D = 64` (:math:`B = 4, H = 32`)
# and :math:`D = 128` (:math:`B = 4, H = 16`), under the interpreter at :math:`B = 1` and a head
# or two of two short sequences; against PyTorch SDPA's cuDNN and flash backends (the math backend
# under the interpreter) and the v1 kernel of the previous lesson, with lesson 04's harness. The
# ceiling is the matrix-multiply rate measured in this run.

PEERS = ("SDPA cuDNN", "SDPA flash") if ON_GPU else ("SDPA math",)
OURS = "Triton v2 (this lesson)"
ATOMIC = "Triton v2, atomic dQ"  # the backward with FlashAttention-2's atomic additions


def providers_for(causal, D):
    """What this lesson times: its own kernel, the SDPA backends, and v1."""
    scale = D ** -0.5
    providers = {OURS: lambda q, k, v: attention(q, k, v, causal, scale)}
    providers.update(sdpa_providers(causal, scale, PEERS))
    providers["Triton v1 (lesson 04)"] = lambda q, k, v: V1.attention(q, k, v, causal, scale)
    return providers


def atomic_provider(q, k, v, causal, D):
    """The backward with atomic dQ, timed beside the two-pass one."""
    return {(ATOMIC, "bwd"): functools.partial(attention, causal=causal, sm_scale=D ** -0.5, atomic_dq=True)}


# %%
# What produced the numbers below (the plots come from the same run):

if __name__ == "__main__":
    print(describe_platform())

# %%

if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    if ON_GPU:
        cases, sizes = [(4, 32, 64), (4, 16, 128)], [1024, 2048, 4096, 8192, 16384]
    else:
        cases, sizes = [(1, 2, 64), (1, 1, 128)], [64, 128]
    peak = matmul_tflops()
    print(f"{V1.CEILING_NAME}, measured now: {peak:.3g} TFLOP/s")
    results = pd.DataFrame(run_benchmark(cases, sizes, providers_for, ("fwd", "bwd"), atomic_provider))
    table = results.pivot_table(index=["D", "causal", "mode", "N"], columns="provider", values="value", sort=False)
    plot_mode(table, "fwd", peak, "Forward pass")
    plot_mode(table, "bwd", peak, "Backward pass")
    plt.show()

# %%
# The table: every provider's speed in TFLOP/s, by head dimension, masking, pass and sequence
# length (the plots above draw the same numbers).

results_table(results) if __name__ == "__main__" else None

# %%
# Reading the numbers
# -------------------
# Computed from the table above, in this run: v2 against the strongest PyTorch backend (cuDNN where
# it runs) and against v1; the two ways of finishing :math:`dQ` against each other; the rate at
# which the two-pass backward really multiplies matrices (it executes seven products where the
# FLOP count credits five); and how far the repeated timings spread, the yardstick for which
# differences mean anything.

if __name__ == "__main__":
    peers = [c for c in PEERS if c in table]
    for (D, causal, mode), part in table.groupby(level=["D", "causal", "mode"], sort=False):
        ratio = part[OURS] / part[peers].max(axis=1)
        line = (f"D={D:3d} {'causal    ' if causal else 'non-causal'} {mode}: v2 is {ratio.min():.2f}x to "
                f"{ratio.max():.2f}x the fastest SDPA backend, up to {part[OURS].max() / peak:.0%} of the matmul rate")
        if "Triton v1 (lesson 04)" in part:
            v1 = part[OURS] / part["Triton v1 (lesson 04)"]
            line += f"; {v1.min():.1f}x to {v1.max():.1f}x v1"
        print(line)
        if mode == "bwd":
            atomic = part[ATOMIC] / part[OURS]
            executed = 7 / 5 * part[OURS].max()
            print(f"    atomic dQ is {atomic.min():.2f}x to {atomic.max():.2f}x the two-pass backward (faster at "
                  f"{(atomic > 1).sum()} of {len(atomic)} sizes); the two-pass backward multiplies matrices at up "
                  f"to {executed:.3g} TFLOP/s, {executed / peak:.0%} of the matmul rate")
    if ROUNDS > 1:
        print(spread_summary(results))
    else:
        print("These are interpreter timings: they measure NumPy on the CPU, not GPU kernels.")
    save_results("05-fused-attention-v2", [{
        "name": f"attention v2 {mode}", "unit": "TFLOP/s", "ceiling_name": V1.CEILING_NAME, "ceiling": peak,
        "ours": [OURS] + ([ATOMIC] if mode == "bwd" else []), "peers": peers,
        "rows": [r for r in results.drop(columns="spread").to_dict("records") if r["mode"] == mode]}
        for mode in ("fwd", "bwd")])

# %%
# Which tiles ran
# ---------------
# The tile shapes behind the benchmark at :math:`D = 128` (``BLOCK_M x BLOCK_N``; the :math:`dQ`
# kernel owns ``BLOCK_N`` queries and walks ``BLOCK_M`` keys): from the table where it covers this
# GPU, otherwise the autotuner's picks in this run. A :math:`dK, dV` program with 128 keys keeps
# two 128 x 128 fp32 accumulators, 128 KiB: spread over 8 warps (256 threads) that is 128 of the
# 255 registers a thread may have, before the tiles in flight. A program with half the keys and
# one warp group of 4 warps holds the same 128 registers of accumulators per thread, but is small
# enough that two fit on one SM, where each can run its matrix products while the other waits.
# Which wins is for the sweep to measure.

KERNEL_NAMES = {"fwd": "forward", "dkdv": "dK, dV", "dkdv-atomic": "dK, dV (atomic dQ)", "dq": "dQ"}


def tiles_that_ran(D, sizes):
    """{kernel and masking: {N: configuration}} at head dim D, as text: the table's, or the autotuner's."""
    def text(block_m, block_n, warps, stages):
        return f"{block_m}x{block_n}, {warps} warps, {stages} stages"

    picks = {}
    for name, label in KERNEL_NAMES.items():
        for causal in (False, True):
            row = f"{label}, {'causal' if causal else 'non-causal'}"
            for N in sizes:
                case = tuned_case(torch.empty(1, 1, N, D, dtype=torch.float16, device=DEVICE), causal)
                config = TUNED_CONFIGS.get((name, *case)) if case else None
                if config is None and ON_GPU:  # the autotuner's pick, if this run made one
                    tuner = TUNERS[name]
                    key = {"D": D, "CAUSAL": causal, "N_BUCKET": triton.next_power_of_2(N),
                           "ATOMIC_DQ": name == "dkdv-atomic"}
                    for cached, choice in tuner.cache.items():
                        named = dict(zip(tuner.keys, cached))
                        if all(named[k] == key[k] for k in tuner.keys) and "float8" not in str(cached):
                            config = (choice.kwargs["BLOCK_M"], choice.kwargs["BLOCK_N"], choice.num_warps,
                                      choice.num_stages)
                if config is not None:
                    picks.setdefault(row, {})[f"N = {N}"] = text(*config)
    return picks


if __name__ == "__main__":
    choices = pd.DataFrame(tiles_that_ran(128, sizes)).T
    if not ON_GPU:
        print(f"Under the interpreter nothing is tuned: one configuration per kernel ran, {INTERPRETER_CONFIGS}.")
    elif TUNED_ON and tuned_case(torch.empty(1, 1, 1, 128, dtype=torch.float16, device=DEVICE), False):
        distinct = {(name, D, causal, config) for (name, D, causal, _), config in TUNED_CONFIGS.items()}
        print(f"From the table, measured on {TUNED_ON['gpu']} with torch {TUNED_ON['torch']} and Triton "
              f"{TUNED_ON['triton']} on {TUNED_ON['date']}. For its {len(TUNED_CONFIGS)} cases (kernel, head dim, "
              f"masking, length) it names {len(distinct)} distinct configurations: one compilation each, per dtype.")
    else:
        print("The table does not cover this GPU: the autotuner picked these in this run.")

choices if __name__ == "__main__" and not choices.empty else None

# %%
# Exercises
# ---------
# Each exercise comes with a check: call it on your function, and it compares your answer with a
# float64 reference on fresh random inputs, and says what is wrong or that you got it right.
#
# 1. **The mask of one block pair.** Write ``causal_block_mask(start_m, start_n, block_m,
#    block_n, n)``: a ``(block_m, block_n)`` boolean tensor that is True where query
#    ``start_m + i`` may see key ``start_n + j`` under causal masking, and both exist (index below
#    ``n``). Then ``check_causal_block_mask(causal_block_mask)``. Compare your answer with
#    ``block_kinds``: a pair whose mask is all True needs no mask in the kernel.
# 2. **One row's backward, by hand.** Using only the derivation above, write
#    ``one_row_backward(q, K, V, do, scale)`` for a single query row ``q`` of shape ``(D,)``, keys
#    and values ``(N, D)`` and the gradient ``do`` of its output, returning ``(dq, dK, dV)`` (no
#    autograd). Then ``check_one_row_backward(one_row_backward)``.
# 3. **A key-padding mask.** Batches often hold sequences of different lengths, padded to one
#    ``N``. Write ``padded_attention(q, k, v, key_lengths, sm_scale)`` in which batch ``b`` sees
#    only its first ``key_lengths[b]`` keys (at least 1), forward only, by giving the forward kernel
#    one more argument. Then ``check_padded_attention(padded_attention)``.


def check_causal_block_mask(fn):
    """Your causal_block_mask against the definition, on random block pairs, including ragged ends."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(50):
        block_m, block_n = (int(2 ** torch.randint(2, 6, (), generator=gen)) for _ in range(2))
        n = int(torch.randint(1, 200, (), generator=gen))
        start_m = int(torch.randint(0, triton.cdiv(n, block_m), (), generator=gen)) * block_m
        start_n = int(torch.randint(0, triton.cdiv(n, block_n), (), generator=gen)) * block_n
        rows = start_m + torch.arange(block_m)[:, None]
        keys = start_n + torch.arange(block_n)[None, :]
        want = (keys <= rows) & (rows < n) & (keys < n)
        got = torch.as_tensor(fn(start_m, start_n, block_m, block_n, n)).to("cpu")
        if got.shape != want.shape or got.dtype != torch.bool:
            raise AssertionError(f"expected a bool tensor of shape {tuple(want.shape)}, got {got.dtype} "
                                 f"{tuple(got.shape)}")
        if not torch.equal(got, want):
            i, j = (got != want).nonzero()[0].tolist()
            raise AssertionError(f"start_m={start_m}, start_n={start_n}, blocks {block_m}x{block_n}, n={n}: "
                                 f"query {start_m + i} and key {start_n + j} should be {bool(want[i, j])}")
    print("causal_block_mask is right on 50 random block pairs.")


def check_one_row_backward(fn):
    """Your one_row_backward against float64 autograd, on 10 random rows of random sizes."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(10):
        N, D = int(torch.randint(1, 40, (), generator=gen)), int(torch.randint(1, 17, (), generator=gen))
        q, do = torch.randn(D, generator=gen, dtype=torch.float64), torch.randn(D, generator=gen, dtype=torch.float64)
        K, V = (torch.randn(N, D, generator=gen, dtype=torch.float64) for _ in range(2))
        scale = float(torch.rand((), generator=gen)) + 0.1
        leaves = [t.clone().requires_grad_() for t in (q, K, V)]
        out = torch.softmax(leaves[1] @ leaves[0] * scale, dim=0) @ leaves[2]
        want = torch.autograd.grad(out, leaves, do)
        got = fn(q.clone(), K.clone(), V.clone(), do.clone(), scale)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise AssertionError(f"one_row_backward must return three gradients (dq, dK, dV), got {got!r:.80}")
        for name, g, w in zip(("dq", "dK", "dV"), got, want):
            torch.testing.assert_close(torch.as_tensor(g, dtype=torch.float64), w, rtol=1e-6, atol=1e-8,
                                       msg=lambda m, name=name, N=N, D=D: f"{name} (N={N}, D={D}) is off: {m}")
    print("one_row_backward matches autograd on 10 random rows.")


def check_padded_attention(fn):
    """Your padded_attention against float64 attention on the unpadded keys of each batch."""
    B, H, N, D = 3, 2, 77, 32
    q, k, v = (torch.randn(B, H, N, D, device=DEVICE, dtype=torch.float16) for _ in range(3))
    lengths = torch.tensor([N, 1, 40], device=DEVICE)
    # The answer gets copies: one that rewrote its inputs in place would otherwise fool the reference.
    out = fn(q.clone(), k.clone(), v.clone(), lengths.clone(), D ** -0.5)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        raise AssertionError(f"padded_attention must return a tensor of shape {tuple(q.shape)}")
    for b, n in enumerate(lengths.tolist()):
        want = reference_attention(q[b].double(), k[b, :, :n].double(), v[b, :, :n].double(), False, D ** -0.5)
        torch.testing.assert_close(out[b].double(), want, rtol=1e-2, atol=1e-2,
                                   msg=lambda m, b=b, n=n: f"batch {b} (key length {n}) is off: {m}")
    print("padded_attention is right for key lengths " + ", ".join(map(str, lengths.tolist())) + ".")
