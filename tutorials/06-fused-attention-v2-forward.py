"""
Fused attention v2: FlashAttention-2's forward
==============================================

FlashAttention-2 (Dao, 2023, `arXiv:2307.08691 <https://arxiv.org/abs/2307.08691>`_)
reorganizes FlashAttention-1 (`arXiv:2205.14135 <https://arxiv.org/abs/2205.14135>`_),
whose arithmetic the previous lesson, :doc:`05-fused-attention-v1`, runs, so that a GPU
spends its time in matrix multiplications. This lesson builds its forward pass in
portable Triton, correct for every sequence length, head dimension and masking mode, and
measures it against PyTorch's cuDNN and flash backends and FlexAttention. The next
lesson, :doc:`07-fused-attention-v2-backward`, derives and builds the backward pass on
top of it, and lessons 11 to 14 take the same algorithm to Hopper's warp-specialized
design (FlashAttention-3, `arXiv:2407.08608 <https://arxiv.org/abs/2407.08608>`_) in
Gluon.

You will learn:

* what FlashAttention-2 changes from v1, and why each change pays;
* how to split causal attention into blocks that need no mask and those that do;
* why attention is bound by the tensor cores and not by memory, unlike one tile alone;
* how to tune a kernel's tiles once, offline, instead of autotuning in every build;
* how to cut the host's cost of a launch where the host, not the GPU, sets the pace;
* the mistakes that learners' versions of this kernel make, and the tests for each.

This lesson needs ``stepkit.py``, ``tuned_tables.json`` and ``05-fused-attention-v1.py``
next to it (the site's zip of all lessons has them): the shared module, the tile table,
and lesson 05, whose kernel the benchmark compares and whose check exercise 2 uses.
"""

# %%
# Where the kernels run
# ---------------------
# ``stepkit``, the module beside the lessons, picks a CUDA GPU when there is one,
# otherwise the Triton interpreter on the CPU, before the first ``@triton.jit``.

import functools
import itertools

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

V1 = kit.load_lesson("05-fused-attention-v1")  # its kernel, compared below

# %%
# What changes from v1, and why
# -----------------------------
# * **Already in lesson 05: the loop order, and a grid over the sequence.** The
#   FlashAttention paper's Algorithm 1 loops over key/value blocks outside, reading and
#   writing :math:`O`, :math:`m` and :math:`\ell` in memory at every step.
#   FlashAttention-2 (its sections 3.1 and 3.2) has one program per query block walk
#   the key blocks with them in registers, on a grid over the sequence as well as batch
#   and heads. Lesson 05's kernel already does; against it, v2 changes what follows.
# * **Normalize once, at the end.** At every key block, v1 multiplied the whole
#   accumulator and probability tile by two per-row factors, each with a division by the
#   new running sum. v2 keeps the *unnormalized* sum :math:`a = \sum_j e^{s_j - m} v_j`,
#   divided by :math:`\ell` once, after the loop; inside it only the rescaling by
#   :math:`e^{m - m'}` remains, one multiplication per accumulator element per block:
#   the paper's "fewer non-matmul FLOPs" (its section 3.1), and lesson 05's exercise 1.
# * **exp2, with** :math:`\log_2 e` **folded into the scale.** The scores are multiplied
#   by ``sm_scale`` anyway; multiplying by ``sm_scale * log2(e)`` instead makes every
#   exponential a bare ``exp2``, one hardware instruction, and saves the multiplication
#   by :math:`\log_2 e` that ``tl.exp`` performs before its own ``exp2``. For the
#   backward it saves :math:`\mathrm{LSE}_2 = m + \log_2 \ell` per row, in base 2.
# * **Parallel over the sequence in the backward too**: one program per key block, not
#   per (batch, head) as in v1. That is the next lesson's subject.
# * **A mask only where one is needed.** v1 already stopped a query block at the
#   diagonal (causal attention does about half the work, more at short lengths) but
#   masked every block it computed. v2 masks only the blocks that the diagonal crosses
#   and the ragged last block; the rest run a loop compiled without any mask. The grid
#   below, drawn by this lesson's own code, shows which is which.

LOG2E = 1.4426950408889634


def block_kinds(n, block_m, block_n, causal):
    """For each (query block, key block) pair: 0 skipped, 1 computed with a mask, 2
    computed without one."""
    kinds = torch.zeros(triton.cdiv(n, block_m), triton.cdiv(n, block_n), dtype=int)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            rows = (i * block_m, min(n, (i + 1) * block_m) - 1)
            keys = (j * block_n, min(n, (j + 1) * block_n) - 1)
            if causal and keys[0] > rows[1]:
                continue  # every key is after every query: nothing to compute
            ragged = keys[1] - keys[0] + 1 < block_n
            crosses = causal and keys[1] > rows[0]
            kinds[i, j] = 1 if ragged or crosses else 2
    return kinds


def draw_block_grid(n=300, block_m=64, block_n=32):
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    kit.plot_style()
    cmap = ListedColormap(["#f2f2f2", "#e4a23c", "#3b7dd8"])
    fig, axes = plt.subplots(1, 2, figsize=(8, 4.2))
    for ax, causal in zip(axes, (False, True)):
        kinds = block_kinds(n, block_m, block_n, causal)
        rows, cols = kinds.shape
        ax.imshow(kinds, cmap=cmap, vmin=0, vmax=2, aspect="auto")
        ax.set_xticks(range(cols), [str(j * block_n) for j in range(cols)], rotation=90)
        ax.set_yticks(range(rows), [str(i * block_m) for i in range(rows)])
        ax.set_xticks([x - 0.5 for x in range(cols + 1)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(rows + 1)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        ax.set(title=f"{'causal' if causal else 'non-causal'}, N = {n}",
               xlabel="first key of the block", ylabel="first query of the block")
        counts = [(kinds == k).sum().item() for k in (2, 1, 0)]
        ax.text(0.5, -0.32,
                f"{counts[0]} without mask, {counts[1]} masked, {counts[2]} skipped",
                transform=ax.transAxes, ha="center")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in cmap.colors[::-1]]
    labels = ["no mask needed", "masked (diagonal or ragged end)", "skipped"]
    fig.legend(handles, labels, loc="upper center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


if __name__ == "__main__":
    draw_block_grid()

# %%
# How much work, and what bounds it? The forward does two matrix products of
# :math:`2N^2D` FLOPs per (batch, head): :math:`4BHN^2D` FLOPs, half that when causal;
# the backward recomputes :math:`QK^T` and does four more products, 2.5 times as many.
# A program with ``BLOCK_M`` query rows reads all of :math:`K` and :math:`V`,
# :math:`2ND` elements, to do :math:`4 \cdot \mathrm{BLOCK\_M} \cdot ND` FLOPs:
# :math:`\mathrm{BLOCK\_M}` FLOPs per byte in fp16, 128 for 128-row tiles. That is
# below an H100's ridge point (about 990 TFLOP/s over 3.35 TB/s, some 300 FLOPs per
# byte, from NVIDIA's datasheet for the SXM card): if every program fetched K and V
# from device memory, attention would be memory-bound. It is not, because the
# :math:`N / \mathrm{BLOCK\_M}` programs of one (batch, head) run at nearly the same
# time and read the same K and V: after the first, the others find them in the L2
# cache (the tiles lesson's L2 reuse, and why the grid puts the query block, not the
# head, on its fastest-varying axis). Counted from device memory, each of
# :math:`Q, K, V, O` moves once: about :math:`N/2` FLOPs per byte. Attention is bound
# by the tensor cores; its speed is best given as a fraction of the matmul rate.
#
# The forward kernel
# ------------------
# The inner loop walks key blocks from ``lo`` to ``hi``. ``MASKED`` is a compile-time
# flag: one loop is compiled without any masking, for the bulk of the keys, and one with
# masks, for the causal diagonal and the ragged last block. Keys past :math:`N` get a
# score of :math:`-\infty`; their loads read zeros.


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, lo, hi, rows, N, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        keys = start_n + cols
        kt_block = kt_ptrs + keys[None, :] * skn
        v_block = v_ptrs + keys[:, None] * svn
        if MASKED:
            kt = tl.load(kt_block, mask=keys[None, :] < N, other=0.0)
            v = tl.load(v_block, mask=keys[:, None] < N, other=0.0)
        else:
            kt = tl.load(kt_block)
            v = tl.load(v_block)
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
            # The largest scaled score, without scaling them all first: a negative
            # scale flips which is largest.
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
    D: tl.constexpr, CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes an fp64 float
    # Under a causal mask, the last query block first: it has the most keys, and the
    # GPU starts programs roughly in order, so the ones that start last, as the GPU
    # runs dry, are the shortest.
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # b * stride can pass 2**31 elements
    b, h = bh // H, bh % H
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q_ptrs = Q + b * sqb + h * sqh + rows[:, None] * sqn + d[None, :] * sqd
    q = tl.load(q_ptrs, mask=rows[:, None] < N, other=0.0)
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
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, 0, diag, rows, N, qk_scale,
            BLOCK_N, False, CAUSAL, NEGATIVE_SCALE,
        )
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, diag,
            tl.minimum(diag + BLOCK_M, N), rows, N, qk_scale,
            BLOCK_N, True, CAUSAL, NEGATIVE_SCALE,
        )
    else:
        full = (N // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, 0, full, rows, N, qk_scale,
            BLOCK_N, False, CAUSAL, NEGATIVE_SCALE,
        )
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, kt_ptrs, v_ptrs, skn, svn, full, N, rows, N, qk_scale,
            BLOCK_N, True, CAUSAL, NEGATIVE_SCALE,
        )
    row_ok = rows < N
    if STORE_LSE:  # only a backward reads it: inference skips it (LSE: any pointer)
        tl.store(LSE + bh * N + rows, m_i + tl.math.log2(l_i), mask=row_ok)
    o = acc / l_i[:, None]
    o_ptrs = O + b * sob + h * soh + rows[:, None] * son + d[None, :] * sod
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])


# %%
# The causal split requires ``BLOCK_M`` to be a multiple of ``BLOCK_N``, so that the
# diagonal of a query block covers whole key blocks.
#
# Tuning once, not at every build
# -------------------------------
# The best tile sizes depend on the GPU, the head dimension, the masking and the
# sequence length. ``triton.autotune`` would time every candidate the first time it
# meets a case: minutes of compiling and timing in each build, and host time in each
# call to look its case up. This lesson measures once, offline, instead:
# ``python tools/tune.py attention`` (in this repository) times every candidate below
# on a GPU, for each case of the benchmark, and writes the winners, with the GPU and
# versions that produced them, into the table "attention-tiles" of
# ``tuned_tables.json``: a row per kernel, head dimension, masking and sequence-length
# bucket. On a GPU of that architecture the launchers take the configuration from the
# table (a length takes its power-of-two bucket, or the nearest one measured); anywhere
# else the autotuner picks from the same candidates, once per bucket. The sweep
# compares tiles by the kernel's own time, read from the CUDA profiler: every tile of
# one kernel costs the host the same, and at short lengths the host's time per call
# varies more than the kernels differ.
#
# Candidates that cannot work are never compiled: tiles that break the causal split,
# and pipelines whose buffered key and value tiles (``num_stages x 2 x BLOCK_N x D``
# elements) would not fit in the SM's shared memory. The best two or three candidates
# are often within a few percent of each other, about the GPU's run-to-run noise, and
# each distinct configuration a build runs is one more compilation. So the sweep treats
# those within 3% of a length's fastest as tied, and among them keeps as few distinct
# configurations per kernel, head dimension and masking as it can ("Which tiles ran",
# below, counts them). The interpreter runs one, untuned. One table holds the tiles of
# all four kernels of FlashAttention-2, measured by one sweep: this lesson's forward
# (``fwd``) and the next lesson's three backward kernels.


def _configs(shapes):
    config = triton.Config
    return [config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s)
            for m, n, w, s in shapes]


SHARED_MEMORY_BYTES = 227 * 1024  # per block on Hopper; smaller GPUs fail the rest


def _fits(config, D):
    stages, block_n = config.num_stages, config.kwargs["BLOCK_N"]
    return stages * 2 * block_n * D * 2 <= SHARED_MEMORY_BYTES


def _prune_fwd(configs, named_args, **kwargs):
    D = kwargs.get("D", named_args.get("D"))
    keep = [c for c in configs
            if c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0 and _fits(c, D)]
    return keep or configs[-1:]


# The candidates that the sweep compares: (BLOCK_M, BLOCK_N, warps, stages).
FWD_SHAPES = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)]
# Under the interpreter: one configuration per kernel (the next lesson's too).
INTERPRETER_CONFIGS = {"fwd": (64, 32, 4, 1), "dkdv": (32, 64, 4, 1),
                       "dkdv-atomic": (32, 64, 4, 1), "dq": (32, 64, 4, 1)}

# The table: where it was measured (TUNED_ON, with its length buckets), and each case's
# tile, {(kernel, head dim, causal, N bucket): (BLOCK_M, BLOCK_N, warps, stages)}.
_ROWS = kit.tuned_table("attention-tiles")["rows"]
TUNED_ON = dict(kit.tuned_table("attention-tiles")["measured_on"])
TUNED_ON.update(capability=tuple(TUNED_ON["capability"]),
                buckets=tuple(sorted({row["N"] for row in _ROWS})))
TUNED_CONFIGS = {(r["kernel"], r["D"], r["causal"], r["N"]): tuple(r["tile"])
                 for r in _ROWS}


def host_cdiv(a, b):
    """ceil(a / b): triton.cdiv without its unwrapping of arguments, microseconds that
    count where the host paces the GPU (lesson 13 measures the host's time)."""
    return -(-a // b)


def host_next_power_of_2(n):
    """triton.next_power_of_2(n), n >= 1 (an int or a SymInt), without host cost."""
    return 1 << (int(n) - 1).bit_length()


_capability = functools.cache(torch.cuda.get_device_capability)


def tuned_case(q, causal):
    """(D, causal, N bucket): this case's key in the tables that tools/tune.py
    measured, or None where they do not apply (no GPU, another GPU architecture, a
    dtype other than fp16 and bf16)."""
    if not (kit.ON_GPU and TUNED_ON and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    if _capability(q.device) != TUNED_ON["capability"]:
        return None
    low, high = TUNED_ON["buckets"][0], TUNED_ON["buckets"][-1]
    bucket = min(max(host_next_power_of_2(q.shape[2]), low), high)
    return int(q.shape[3]), causal, bucket  # int(): torch.compile passes SymInts


# %%
# A note on the interpreter (of Triton 3.9, which the pinned requirements install; a
# GPU build of this page may use another Triton, printed in the Benchmark section
# below): it stores bf16 values as 16-bit integers and multiplies those integers inside
# ``tl.dot``. The kernels take an ``UPCAST_DOT`` flag that turns the first operands into
# fp32 (and the helpers follow the dtype they see); the launcher sets it only for bf16
# under the interpreter, so compiled GPU code never pays for it.
#
# The launcher
# ------------
# The kernel runs with the table's configuration for its case, else the autotuner's
# pick; under the interpreter, with its one configuration. ``forward`` launches it and
# returns :math:`O` and the row statistic :math:`\mathrm{LSE}_2` that the backward
# needs (the next lesson and the Hopper lessons reuse it). ``attention``, what a user
# calls for inference, checks its inputs first; asked for gradients, it says that the
# next lesson's ``attention`` has them.
#
# At short lengths the host's work per call matters as much as the GPU's (lesson 13
# measures both). One large piece is Triton's JIT dispatch: on every call it inspects
# each of some thirty arguments for what the compiled kernel was specialized on (dtypes,
# integers equal to 1 or divisible by 16, pointers aligned to 16 bytes), and looks the
# kernel up by that. All of it, and every argument besides the tensors and the scale,
# follows from the inputs' shapes, strides, dtypes and alignment. So the first call with
# a given layout goes through the JIT and keeps a *launch plan*: the compiled kernel's
# launch bound to its grid and those arguments (``kit.bound_launcher``, which calls the
# C function that Triton's launcher ends in); later calls with that layout pass only
# their tensors and scale. ``planned=True`` also returns a *call plan* (allocate the
# outputs, launch) for lesson 11 to keep per layout. (A case the table does not cover,
# such as lesson 11's fp8 inputs, goes through the autotuner and the JIT each time.)


def autotuned(kernel, shapes, prune, key, **options):
    """kernel under triton.autotune over shapes, for a GPU the table does not cover
    (None under the interpreter)."""
    if not kit.ON_GPU:
        return None
    pruning = {"early_config_prune": prune}
    tune = triton.autotune(_configs(shapes), key, prune_configs_by=pruning, **options)
    return tune(kernel)


FWD_KEY = ["D", "CAUSAL", "N_BUCKET"]
FWD_TUNER = autotuned(attn_fwd_kernel, FWD_SHAPES, _prune_fwd, FWD_KEY)


PLANS = {}  # plan key -> launch(*fresh arguments)


def plan_key(*tensors):
    """The layout part of a launch plan's key on a GPU, None under the interpreter:
    the current GPU, and each tensor's shape, strides, dtype and 16-byte alignment."""
    if not kit.ON_GPU:
        return None
    layouts = ((t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors)
    return (torch.cuda.current_device(), *layouts)


def launch_planned(key, kernel, grid, fresh, args, constexprs, **options):
    """kernel[grid](*args, **constexprs, **options), through Triton's JIT the first
    time, then through the plan it leaves and returns (None if none is kept): a
    function of the first fresh arguments (for lesson 11's TMA descriptors, their
    tensors); key (plan_key of the inputs) fixes the rest. Through kit.launch while
    kit.compile_ahead runs."""
    if key is None or kit.compiling_ahead():
        kit.launch(kernel, grid, *args, **constexprs, **options)
        return None
    plan_id = (kernel, key, grid, *constexprs.values(), *options.values())
    plan = PLANS.get(plan_id)
    if plan is not None:
        plan(*kit.undescribed(args[:fresh]))
        return plan
    # Triton internals, as in 3.6 and 3.9 (tests/test_attention.py checks them on a
    # GPU): a JIT launch returns the CompiledKernel it ran; arg_names lists parameters.
    compiled = kernel[grid](*args, **constexprs, **options)
    later = kernel.arg_names[len(args):]
    rest = (*args[fresh:], *(constexprs[name] for name in later))
    launch = kit.bound_launcher(compiled, grid, args[:fresh], rest)
    if len(PLANS) >= 1024:  # a caller whose lengths keep changing would grow it forever
        PLANS.clear()
    PLANS[plan_id] = launch
    return launch


def _launch(kernel, tuner, name, key, case, grid, fresh, *args, **meta):
    """Run kernel with the configuration measured for this case (name: the kernel's
    in the table), else with its tuner's pick; grid(BLOCK_M, BLOCK_N) gives the grid;
    key, fresh and what it returns: launch_planned's."""
    config = (INTERPRETER_CONFIGS[name] if not kit.ON_GPU else
              TUNED_CONFIGS.get((name, *case)) if case else None)
    if config is not None:
        block_m, block_n, warps, stages = config
        return launch_planned(key, kernel, grid(block_m, block_n), fresh, args,
                              dict(meta, BLOCK_M=block_m, BLOCK_N=block_n),
                              num_warps=warps, num_stages=stages)
    kit.launch(tuner, lambda m: grid(m["BLOCK_M"], m["BLOCK_N"]), *args, **meta)


def keys_contiguous(v, dtype=None):
    """v's values, cast to dtype, stored with the sequence axis contiguous."""
    v = v.transpose(2, 3)
    return v.to(dtype or v.dtype, memory_format=torch.contiguous_format).transpose(2, 3)


def forward(q, k, v, causal, sm_scale, planned=False, keep_lse=True):
    """O and LSE_2 (base-2 log-sum-exp of each row's scores, in fp32; None unless
    keep_lse) from the portable forward kernel; planned: and a call plan for this
    layout, or None."""
    B, H, N, D = q.shape
    # fp8 (float8_e5m2) is lesson 11's subject; it calls this launcher with fp8 inputs.
    fp8 = q.dtype == torch.float8_e5m2
    # new_empty: fewer microseconds than torch.empty(..., device=)
    o = q.new_empty(q.shape, dtype=torch.float16 if fp8 else q.dtype)
    lse = q.new_empty((B * H, N), dtype=torch.float32) if keep_lse else None
    if fp8 and v.stride(2) != 1 and N > 1:
        v = keys_contiguous(v)  # lesson 11, "fp8 on Hopper: the layout of V", says why
    plan = _launch(
        attn_fwd_kernel, FWD_TUNER, "fwd", plan_key(q, k, v), tuned_case(q, causal),
        lambda bm, bn: (host_cdiv(N, bm), B * H), 6,  # fresh: q, k, v, O, LSE, scale
        q, k, v, o, o if lse is None else lse, sm_scale * LOG2E, H, N,
        host_next_power_of_2(N), *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        D=D, CAUSAL=causal, UPCAST_DOT=_upcast(q), NEGATIVE_SCALE=sm_scale < 0,
        STORE_LSE=keep_lse,
    )
    plan = kit.call_plan(None if fp8 else plan, (o, lse), sm_scale * LOG2E)
    return (o, lse, plan) if planned else (o, lse)


def _upcast(q):
    """Whether tl.dot needs fp32 operands: bf16 under the interpreter (see above)."""
    return (not kit.ON_GPU) and q.dtype == torch.bfloat16


class _ForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        return forward(q, k, v, causal, sm_scale, keep_lse=False)[0]

    @staticmethod
    def backward(ctx, do):
        raise NotImplementedError("this lesson's attention has no backward: lesson "
                                  "07's (07-fused-attention-v2-backward.py) has one")


def attention(q, k, v, causal, sm_scale):
    """FlashAttention-2's forward: softmax(q k^T * sm_scale) v over (batch, heads,
    sequence, head_dim) tensors."""
    kit.check_attention_inputs(q, k, v, causal, sm_scale, fp8=True)
    return _ForwardOnly.apply(*kit.resolved(q, k, v), causal, float(sm_scale))


# %%
# Correctness
# -----------
# Before any timing: the forward against float64 PyTorch on fresh random inputs, causal
# and not, at a length one past a block boundary, with ``q`` a transposed view (strides
# not the contiguous ones). ``kit.check_against_float64`` fails on NaN or infinity and
# names what is off. On a GPU, ``kit.compile_ahead`` compiles on all CPU cores first.


def strided_cases(B, H, N, D, keys=(False, True)):
    """{key: (q, k, v)}: fresh fp16 inputs for each key, q a transposed view."""
    make = functools.partial(torch.randn, device=DEVICE, dtype=torch.float16)
    return {key: (make(B, N, H, D).transpose(1, 2), make(B, H, N, D), make(B, H, N, D))
            for key in keys}


if __name__ == "__main__":
    torch.manual_seed(0)
    B, H, N, D = 2, 3, 129 if kit.ON_GPU else 65, 64
    cases = strided_cases(B, H, N, D)
    kit.compile_ahead(lambda: [attention(*qkv, c, D**-0.5) for c, qkv in cases.items()])
    for causal, (q, k, v) in cases.items():
        label = f"06-fused-attention-v2-forward, causal={causal}"
        errors = kit.check_against_float64(attention, q, k, v, causal, D**-0.5, label,
                                           backward=False)
        shown = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        print(f"causal={causal!s:5}, N={N}: {shown}")

# %%
# Mistakes learners make, and the test that catches each
# ------------------------------------------------------
# Versions of this kernel written from scratch share a handful of bugs; Triton's own
# tutorial (``python/tutorials/06-fused-attention.py``) has the third, in its backward.
# Each is caught by a test named below, in this repository's ``tests/test_attention.py``
# (not in the lessons' zip); the Correctness cell above runs the third and fourth too.
#
# * **Q.shape(3).** ``shape`` is a tuple, not a function: ``Q.shape[3]``. The launcher
#   fails before any kernel runs, in every test: ``test_forward_and_backward`` first.
# * **The row statistics allocated on the CPU** (the upstream tutorial's ``M``, this
#   lesson's LSE). ``torch.empty(...)`` without ``device=`` hands a host pointer to a
#   GPU kernel: a crash or silent garbage, which ``test_forward_and_backward`` meets on
#   a GPU (under the interpreter all is on the CPU, and nothing can see it). Here every
#   buffer is created with ``device=q.device``, and inputs on different devices are
#   refused (``test_bad_input_is_refused_clearly``, its ``device`` cases).
# * **Sequence lengths that must be a multiple of 128.** Unmasked loads read past the
#   end of the tensors. Here the ragged edge is masked: ``test_forward_and_backward``
#   runs :math:`N = 1, 77, 300`, ``test_lengths_around_block_boundaries`` 63, 65, 129.
# * **Contiguity assumed.** Offsets computed as ``row * D + col`` break on a transposed
#   view. The kernel takes every stride; ``test_strided_inputs`` feeds transposed views.
# * **A scale taken to be positive.** The unmasked loop finds each row's largest scaled
#   score before scaling; with a negative ``sm_scale`` that is the smallest raw score
#   (``NEGATIVE_SCALE``). ``test_every_finite_sm_scale`` runs -1, -0.5 and -0.125.

# %%
# Benchmark
# ---------
# TFLOP/s of the forward, causal and not, on a GPU at :math:`D = 64`
# (:math:`B = 4, H = 32`) and :math:`D = 128` (:math:`B = 4, H = 16`), under the
# interpreter at :math:`B = 1` and two short sequences; against PyTorch SDPA's cuDNN and
# flash backends and FlexAttention (compiled for each shape before any timing; under
# the interpreter SDPA's math backend alone) and lesson 05's v1 kernel. The ceiling
# is the matrix-multiply rate measured in this run. How we time: as in lesson 05, by
# GPU time (a CUDA graph replayed after an L2 flush) and back to back (many calls in a
# row), in passes, a range where they spread; the :doc:`performance page
# <../performance>` gives the method. Under the interpreter the numbers only
# illustrate.

PEERS = kit.FAST_PEERS
OURS = "Triton v2"
V1_NAME = "Triton v1 (lesson 05)"
if kit.ON_GPU:
    CASES, SIZES = [(4, 32, 64), (4, 16, 128)], [1024, 2048, 4096, 8192, 16384]
else:
    CASES, SIZES = [(1, 2, 64), (1, 1, 128)], [64, 128]
INDEX = ["D", "causal", "mode", "N"]


def providers_for(causal, D, ours=None):
    """What this lesson times: its own attention (or `ours`, lesson 07's), the SDPA
    backends, and v1."""
    scale, ours = D**-0.5, ours or attention
    return {
        OURS: functools.partial(ours, causal=causal, sm_scale=scale),
        **kit.sdpa_providers(causal, scale, PEERS),
        V1_NAME: functools.partial(V1.attention, causal=causal, sm_scale=scale),
    }


if __name__ == "__main__":
    import matplotlib.pyplot as plt
    import pandas as pd

    print(kit.describe_platform())
    peak = kit.matmul_tflops()
    print(kit.ceiling_line(peak))
    benchmark = kit.attention_benchmark(CASES, SIZES, providers_for, ("fwd",))
    results = pd.DataFrame(benchmark)
    table, b2b = kit.rate_tables(results, INDEX)
    kit.plot_style()
    kit.plot_attention(table, "fwd", peak, "Forward pass, by GPU time",
                       ours=[OURS, V1_NAME])
    plt.show()

# %%
# The table: every provider's speed in TFLOP/s by GPU time, by head dimension, masking
# and sequence length (the plot above draws the same numbers).

kit.rates_table(results, INDEX, "TFLOP/s") if __name__ == "__main__" else None

# %%
# The same calls back to back, as a loop sees them, which "back to back" below reads
# (on a GPU; under the interpreter the table above is already wall-clock time).

(kit.rates_table(results, INDEX, "TFLOP/s", value="value")
 if __name__ == "__main__" and kit.ON_GPU else None)

# %%
# Reading the numbers
# -------------------
# Computed from the tables above, in this run: v2 against the fastest PyTorch peer
# (cuDNN, flash or FlexAttention) and against v1, by GPU time, and back to back where
# that tells another story; then how far the repeated timings spread, the yardstick for
# which differences mean anything.

if __name__ == "__main__":
    peers = [c for c in PEERS if c in table]
    lines = kit.peer_lines(table, b2b, peak, OURS, peers, versus=V1_NAME, name="v2")
    print("\n".join(lines.values()))
    interpreted = "These are interpreter timings: they measure NumPy on the CPU."
    print(kit.spread_summary(results) if kit.ON_GPU else interpreted)
    kit.save_results("06-fused-attention-v2-forward", [{
        "name": "attention v2 fwd", "unit": "TFLOP/s",
        "ceiling_name": kit.MATMUL_CEILING, "ceiling": peak, "ours": [OURS],
        "peers": peers, "rows": results.to_dict("records"),
    }])

# %%
# Which tiles ran
# ---------------
# The tile shapes behind the benchmark at :math:`D = 128` (``BLOCK_M x BLOCK_N``): from
# the table where it covers this GPU's architecture, otherwise the autotuner's picks in
# this run.


def config_text(block_m, block_n, warps, stages):
    return f"{block_m}x{block_n}, {warps} warps, {stages} stages"


def tuner_pick(tuner, key):
    """The configuration that tuner picked in this run where its key's values are
    key's (not for fp8), or None."""
    config = None
    for cached, choice in tuner.cache.items():
        named = dict(zip(tuner.keys, cached))
        if all(named[k] == key[k] for k in tuner.keys) and "float8" not in str(cached):
            block_m, block_n = choice.kwargs["BLOCK_M"], choice.kwargs["BLOCK_N"]
            config = (block_m, block_n, choice.num_warps, choice.num_stages)
    return config


def tiles_that_ran(D, sizes, kernels):
    """{(kernel's name in the table, causal, N): (BLOCK_M, BLOCK_N, warps, stages)} at
    head dim D, for kernels ({name: (label, its tuner)}): the table's, or the
    autotuner's picks."""
    picks = {}
    each = itertools.product(kernels.items(), (False, True), sizes)
    for (name, (_, tuner)), causal, N in each:
        q = torch.empty(1, 1, N, D, dtype=torch.float16, device=DEVICE)
        case = tuned_case(q, causal)
        config = TUNED_CONFIGS.get((name, *case)) if case else None
        if config is None and tuner is not None:
            key = dict(D=D, CAUSAL=causal, N_BUCKET=host_next_power_of_2(N),
                       ATOMIC_DQ=name == "dkdv-atomic")
            config = tuner_pick(tuner, key)
        if config is not None:
            picks[name, causal, N] = config
    return picks


def tiles_table(picks, kernels):
    """tiles_that_ran's picks as rows of text: {kernel and masking: {N: tile}}."""
    rows = {}
    for (name, causal, N), config in picks.items():
        row = f"{kernels[name][0]}, {'causal' if causal else 'non-causal'}"
        rows.setdefault(row, {})[f"N = {N}"] = config_text(*config)
    return rows


def compilations(configs, names, shown=128):
    """A sentence: how many distinct tiles configs ({(kernel, D, causal, N bucket):
    tile}) gives the kernels in names, in all and per head dim (the page shows D =
    shown's)."""
    rows = {key: tile for key, tile in configs.items() if key[0] in names}
    distinct = {(name, D, causal, tile) for (name, D, causal, _), tile in rows.items()}
    dims, below = [D for _, D, _, _ in distinct], {shown: " (the table below)"}
    each = ", ".join(f"{dims.count(D)} at D = {D}{below.get(D, '')}"
                     for D in sorted(set(dims)))
    return (f"For these kernels' {len(rows)} cases (kernel, head dim, masking, length) "
            f"it names {len(dims)} distinct configurations, counted per kernel, head "
            f"dim and masking, which compile apart: {each}; one compilation each, per "
            "dtype.")


def where_tiles_came_from(names):
    """A sentence: the table (with its provenance and how many compilations it costs
    these kernels), the autotuner, or the interpreter's one configuration."""
    if not kit.ON_GPU:
        ran = (f"{name} {config_text(*INTERPRETER_CONFIGS[name])}" for name in names)
        return "Under the interpreter nothing is tuned: " + ", ".join(ran) + " ran."
    probe = torch.empty(1, 1, 1, 128, dtype=torch.float16, device=DEVICE)
    if not tuned_case(probe, False):
        return "The table does not cover this GPU: the autotuner picked these here."
    here, gpu = torch.cuda.get_device_name(DEVICE), TUNED_ON["gpu"]
    return (
        f"From the table, measured on {gpu} with torch {TUNED_ON['torch']} and Triton "
        f"{TUNED_ON['triton']}"
        + (f" (not on this {here}, of the same architecture)" if here != gpu else "")
        + ". " + compilations(TUNED_CONFIGS, names)
    )


if __name__ == "__main__":
    kernels = {"fwd": ("forward", FWD_TUNER)}
    choices = pd.DataFrame(tiles_table(tiles_that_ran(128, SIZES, kernels), kernels)).T
    print(where_tiles_came_from(["fwd"]))

choices if __name__ == "__main__" and not choices.empty else None

# %%
# Exercises
# ---------
# Each check compares your answer with a reference on fresh random inputs, raising
# ``AssertionError`` at the first wrong element, or prints one line when all is right.
# Write each attempt in a new cell at the end of this lesson's notebook (linked at the
# end of the page) and call its check as the exercise shows; or in a file next to the
# lessons that loads this one first:
#
# .. code-block:: python
#
#    import stepkit as kit
#
#    L06 = kit.load_lesson("06-fused-attention-v2-forward")
#    # ... your causal_block_mask(start_m, start_n, block_m, block_n, n) ...
#    L06.check_causal_block_mask(causal_block_mask)
#
# 1. **The mask of one block pair.** Write ``causal_block_mask(start_m, start_n,
#    block_m, block_n, n)``: a ``(block_m, block_n)`` boolean tensor, True where query
#    ``start_m + i`` may see key ``start_n + j`` under causal masking and both exist
#    (index below ``n``). Then ``check_causal_block_mask(causal_block_mask)``. Compare
#    with ``block_kinds``: a pair whose mask is all True needs no mask in the kernel
#    (``block_kinds`` looks at keys only: a query row past ``n`` needs no mask inside
#    the loop, since its loads read zeros and its store is masked).
# 2. **A key-padding mask, in the split loops.** Lesson 05's exercise 2 in this kernel:
#    ``padded_attention(q, k, v, causal, sm_scale, key_lengths)``, forward only, where
#    batch element ``b`` sees only its first ``key_lengths[b]`` keys (at least 1). The
#    unmasked loop must now end at the last whole key block below the length, not below
#    :math:`N`, and the masked one at the length (hint: ``_attn_fwd_inner`` masks the
#    keys at and past its argument ``N``). Check it with
#    ``check_padded_attention(padded_attention)``: lesson 05's check, timing on a GPU
#    every length :math:`N/2` against this lesson's ``attention`` at :math:`N`.


def check_causal_block_mask(fn):
    """Your causal_block_mask against the definition, on random block pairs, including
    ragged ends."""
    gen = kit.fresh_generator()

    def randint(low, high):
        return int(torch.randint(low, high, (), generator=gen))

    for _ in range(50):
        block_m, block_n, n = 2 ** randint(2, 6), 2 ** randint(2, 6), randint(1, 200)
        start_m = randint(0, triton.cdiv(n, block_m)) * block_m
        start_n = randint(0, triton.cdiv(n, block_n)) * block_n
        rows = start_m + torch.arange(block_m)[:, None]
        keys = start_n + torch.arange(block_n)[None, :]
        want = (keys <= rows) & (rows < n) & (keys < n)
        got = torch.as_tensor(fn(start_m, start_n, block_m, block_n, n)).to("cpu")
        case = (f"causal_block_mask on start_m={start_m}, start_n={start_n}, block "
                f"{block_m}x{block_n}, n={n}")
        if got.shape != want.shape or got.dtype != torch.bool:
            shown = f"{got.dtype} {tuple(got.shape)}"
            raise AssertionError(f"{case}: should be a bool tensor of shape "
                                 f"{tuple(want.shape)}, got {shown}")
        wrong = got != want
        if wrong.any():
            i, j = wrong.nonzero()[0].tolist()
            raise AssertionError(f"{case}: query {start_m + i} and key {start_n + j} "
                                 f"should be {bool(want[i, j])}; {wrong.sum()} of "
                                 f"{wrong.numel()} elements are wrong")
    print("causal_block_mask is right on 50 random block pairs.")


def check_padded_attention(fn):
    """Your padded_attention through lesson 05's check (its inputs, float64 reference
    and messages), timed on a GPU against this lesson's attention."""
    V1.check_padded_attention(fn, attention)
