"""
Hopper: the forward built up in steps
=====================================

Lesson 11's forward arrives whole: TMA, ``wgmma``, a ring, a loader warp, two consumer
groups and persistence at once. This lesson builds it up from the portable kernel of
lesson 06, one piece at a time, and times each step on the GPU at a short and a long
sequence, so that each piece shows what it buys. Previous:
:doc:`11-hopper-forward-gluon`; next: :doc:`13-hopper-forward-profiled`. You will learn:

* the smallest Gluon attention forward: one warp group, Q, K and V copied by TMA into
  shared memory, both products on ``wgmma`` straight from there, in order;
* what a ring of stages adds: the next key block's copy in flight while this one
  computes, with a picture of both schedules;
* what lesson 11's roles add on top (a loader warp, two consumer groups sharing each
  K and V tile) and what persistence adds after them, each measured against the step
  before it in the same run;
* how deep the ring of this lesson's kernel can go, and whether a third stage pays (the
  exercises).

The kernels need a Hopper GPU. On a CPU the page draws the schedules, compiles the
kernel for ``sm_90a`` to read its shared memory, and says what it skipped.
"""

import functools

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

V2 = kit.load_lesson("06-fused-attention-v2-forward")
FWD = kit.load_lesson("11-hopper-forward-gluon")

# %%
# The steps
# ---------
# Step 0 is where Hopper's Triton already stands; steps 1 to 4 each build on the one
# before, by hand, in Gluon:
#
# 0. **Portable** (lesson 06): every warp loads with pointer arithmetic, multiplies
#    with ``tl.dot`` and computes exponentials, with a tile tuned per case; Triton's
#    compiler picks the instructions and pipelines the loads (``num_stages``).
# 1. **TMA and wgmma, in order.** One warp group (4 warps) owns 64 query rows. For each
#    key block it asks TMA to copy K and V into shared memory, waits on an mbarrier,
#    and runs :math:`S = QK^\top` and :math:`O \mathrel{+}= PV` on ``wgmma`` with the
#    operands read from shared memory (P from registers). Within a program nothing
#    overlaps: its tensor cores wait for each copy and for the exponentials.
# 2. **A ring of two stages.** The same warps, but block :math:`j + 1`'s copy is
#    issued before block :math:`j` computes, into the other buffer, so that the copy
#    can hide behind the compute.
# 3. **Roles** (lesson 11's kernel, one program per tile, or per pair of tiles under
#    causal masking): everything lesson 11 built but persistence, at once. A loader
#    warp issues every copy; two consumer groups of 64 rows each share every K and V
#    tile (128 query rows a program: half the loads per query of step 2), keep a
#    product in flight while they compute exponentials, and store O 16 bytes at a time
#    through shared memory; ``setmaxnreg`` gives them the loader's spare registers.
# 4. **Persistence** (lesson 11's kernel as ``attention`` runs it): one program per
#    SM, walking tile after tile (causal: equal-cost pairs), so that a program loads
#    its next tile while it finishes the last.
#
# Steps 1 and 2 are one kernel: ``STAGES`` buffers for K and V, the next
# ``STAGES - 1`` blocks' copies in flight. With one stage, block :math:`j`'s copy is
# issued at the top of its own iteration and waited for at once.

# After stepkit, which may switch the interpreter on first:
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma

# Lesson 11's pieces, as names of this module: a Gluon kernel calls module globals.
_tma_load, _ws_barrier_ring = FWD._tma_load, FWD._ws_barrier_ring
_ws_softmax_step, wgmma_accumulator = FWD._ws_softmax_step, FWD.wgmma_accumulator

STEP_ROWS, STEP_BLOCK_N = 64, 128  # one warp group's rows; keys per block, as lesson 11


@gluon.jit
def _step_key_blocks(start_m, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     CAUSAL: gl.constexpr):
    """(key blocks wholly visible, key blocks to visit) for query block start_m: under
    causal masking the blocks up to the last query row, the first of them masked being
    the one that holds the block's first row."""
    if CAUSAL:
        last = gl.minimum((start_m + 1) * BLOCK_M, N)
        return (start_m * BLOCK_M) // BLOCK_N, gl.cdiv(last, BLOCK_N)
    else:
        return N // BLOCK_N, gl.cdiv(N, BLOCK_N)


@gluon.jit
def _step_copy(desc_k, desc_v, k_smem, v_smem, kv_full, b, h, j, STAGES: gl.constexpr):
    """Key block j's K and V into buffer j % STAGES; its barrier counts their bytes."""
    stage = j % STAGES
    rows: gl.constexpr = desc_k.block_type.shape[2]
    ready = kv_full.index(stage)
    mbarrier.expect(ready, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
    _tma_load(desc_k, [b, h, j * rows, 0], ready, k_smem.index(stage))
    _tma_load(desc_v, [b, h, j * rows, 0], ready, v_smem.index(stage))


@gluon.jit
def attn_fwd_step_kernel(desc_q, desc_k, desc_v, O, LSE, qk_scale, H, N, sob, soh, son,
                         D: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    n_m = gl.cdiv(N, BLOCK_M)
    if CAUSAL:  # the longest query blocks first, as lesson 06 orders them
        start_m = n_m - 1 - gl.program_id(0)
    else:
        start_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    s_layout: gl.constexpr = wgmma_accumulator(BLOCK_N)
    o_layout: gl.constexpr = wgmma_accumulator(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, D], desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D], desc_v.layout)
    q_full = _ws_barrier_ring(1, 1).index(0)
    kv_full = _ws_barrier_ring(STAGES, 1)
    n_full, n_blocks = _step_key_blocks(start_m, N, BLOCK_M, BLOCK_N, CAUSAL)
    mbarrier.expect(q_full, desc_q.block_type.nbytes)
    _tma_load(desc_q, [b, h, start_m * BLOCK_M, 0], q_full, q_smem)
    for j in gl.static_range(STAGES - 1):  # the ring's first blocks, before the loop
        if j < n_blocks:
            _step_copy(desc_k, desc_v, k_smem, v_smem, kv_full, b, h, j, STAGES)
    rows = start_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    mbarrier.wait(q_full, 0)
    q = q_smem.reshape([BLOCK_M, D])
    for j in range(n_blocks):
        # Block j + STAGES - 1 goes into the buffer that block j - 1 used: its products
        # ran to the end before this iteration began (wgmma without is_async waits).
        if j + STAGES - 1 < n_blocks:
            _step_copy(desc_k, desc_v, k_smem, v_smem, kv_full, b, h, j + STAGES - 1,
                       STAGES)
        stage = j % STAGES
        mbarrier.wait(kv_full.index(stage), (j // STAGES) & 1)
        kt = k_smem.index(stage).reshape([BLOCK_N, D]).permute((1, 0))
        s = warpgroup_mma(q, kt, zeros, use_acc=False)
        if j >= n_full:
            p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows,
                                                  cols + j * BLOCK_N, N, True, CAUSAL)
        else:
            p, m_i, l_i, alpha = _ws_softmax_step(s, m_i, l_i, qk_scale, rows, cols,
                                                  N, False, CAUSAL)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(stage).reshape([BLOCK_N, D]), acc)
    gl.store(LSE + bh * N + rows, m_i + gl.log2(l_i), mask=rows < N)
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    # Stored from the accumulator's layout, 4 bytes a thread at a time (lesson 11
    # converts through shared memory to store 16).
    o_rows = start_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, D, gl.SliceLayout(0, o_layout))
    o_ptrs = (O + b.to(gl.int64) * sob + h.to(gl.int64) * soh
              + o_rows[:, None] * son + o_cols[None, :])
    gl.store(o_ptrs, o.to(O.dtype.element_ty), mask=o_rows[:, None] < N)


def step_launch(q, k, v, o, lse, causal, sm_scale, stages):
    """attn_fwd_step_kernel on inputs that lesson 11's Gluon kernels take
    (FWD.warp_specialized_unsupported says which); returns the compiled kernel."""
    B, H, N, D = q.shape
    return attn_fwd_step_kernel[(V2.host_cdiv(N, STEP_ROWS), B * H)](
        FWD._ws_descriptor(q, STEP_ROWS), FWD._ws_descriptor(k, STEP_BLOCK_N),
        FWD._ws_descriptor(v, STEP_BLOCK_N), o, lse, sm_scale * V2.LOG2E, H, N,
        *o.stride()[:3], D=D, CAUSAL=causal, BLOCK_M=STEP_ROWS, BLOCK_N=STEP_BLOCK_N,
        STAGES=stages, num_warps=4)


def step_forward(q, k, v, causal, sm_scale, stages):
    """Steps 1 (stages=1) and 2 (stages=2): O."""
    B, H, N, D = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B * H, N), dtype=torch.float32, device=q.device)
    step_launch(q, k, v, o, lse, causal, sm_scale, stages)
    return o


def roles_forward(q, k, v, causal, sm_scale, persistent):
    """Steps 3 (persistent=False: a program per tile, or per causal pair) and 4."""
    B, H, N, D = q.shape
    tiles = B * H * V2.host_cdiv(N, FWD.WS_BLOCK_M)  # _ws_forward caps it at the pairs
    return FWD.forward(q, k, v, causal, sm_scale, True,
                       None if persistent else tiles)[0]


STEPS = {  # name: forward(q, k, v, causal, sm_scale)
    "0 portable": lambda *args: FWD.forward(*args, False)[0],
    "1 TMA + wgmma": functools.partial(step_forward, stages=1),
    "2 + ring": functools.partial(step_forward, stages=2),
    "3 + roles": functools.partial(roles_forward, persistent=False),
    "4 + persistence": functools.partial(roles_forward, persistent=True),
}

# %%
# Two schedules
# -------------
# A model of one program alone on an SM, not a measurement: a copy takes ``copy`` time
# units, a block's products and exponentials ``compute``. In order (one stage), each
# block waits for its own copy; with two stages, block :math:`j + 1`'s copy runs during
# block :math:`j`'s compute, and the tensor cores wait only for the first. Programs side
# by side on one SM change the picture ("Programs side by side" below).


def schedule(blocks, stages, copy=1.0, compute=1.6):
    """[(copy start, copy end, compute start, compute end)] per key block: a copy
    starts once the copy before it has landed and its buffer's last block has
    computed; a block computes once its copy landed and the block before finished."""
    times = []
    for j in range(blocks):
        landed = times[j - 1][1] if j else 0.0
        buffer_free = times[j - stages][3] if j >= stages else 0.0
        start = max(landed, buffer_free)
        begin = max(start + copy, times[j - 1][3] if j else 0.0)
        times.append((start, start + copy, begin, begin + compute))
    return times


def draw_schedules(blocks=5):
    import matplotlib.pyplot as plt

    kit.plot_style()
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharex=True)
    for ax, stages in zip(axes, (1, 2)):
        for j, (c0, c1, m0, m1) in enumerate(schedule(blocks, stages)):
            ax.barh(1, c1 - c0, left=c0, color="#7f7f7f", height=0.6)
            ax.barh(0, m1 - m0, left=m0, color="#3b7dd8", height=0.6)
            ax.text((c0 + c1) / 2, 1, f"K{j}V{j}", ha="center", va="center",
                    color="white", fontsize=10)
            ax.text((m0 + m1) / 2, 0, f"block {j}", ha="center", va="center",
                    color="white", fontsize=10)
        end = schedule(blocks, stages)[-1][3]
        ax.set(yticks=[0, 1], yticklabels=["products, exp", "TMA copy"])
        ax.set_title(f"{stages} stage{'s' if stages > 1 else ''}: {blocks} blocks "
                     f"end at {end:.1f}", fontsize=10)
    axes[-1].set_xlabel("time (model units: a copy 1.0, a block's compute 1.6)")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    draw_schedules()

# %%
# Correctness
# -----------
# Every step against float64 PyTorch on fresh random inputs, at both head dims and
# dtypes, causal and not, at lengths no block divides (1, 77 and 1,000 queries).


def check_steps(lengths=(1, 77, 1000)):
    """kit.check_against_float64 (forward) of every step; prints the worst error."""
    for name, forward in STEPS.items():
        worst = 0.0
        for D in FWD.WS_HEAD_DIMS:
            for dtype in kit.ATTENTION_DTYPES:
                for causal in (False, True):
                    for N in lengths:
                        q, k, v = (torch.randn(2, 3, N, D, device=kit.DEVICE,
                                               dtype=dtype) for _ in range(3))
                        tolerance = 1e-2 if dtype == torch.float16 else 3e-2
                        case = f"step {name}, D={D}, {dtype}, causal={causal}, N={N}"
                        errors = kit.check_against_float64(
                            forward, q, k, v, causal, D**-0.5, case, tolerance,
                            backward=False)
                        worst = max(worst, errors["o"])
        print(f"step {name}: matches float64, largest error {worst:.1e}")


if __name__ == "__main__":
    probe = torch.empty(1, 1, 8, 64, dtype=torch.float16, device=kit.DEVICE)
    reason = FWD.warp_specialized_unsupported(probe, probe, probe)
    if reason is None:
        check_steps()
    else:
        print(f"The Gluon kernels did not run on this machine: {reason}. This page "
              "checks and times nothing else.")

# %%
# What each step buys
# -------------------
# Each step timed by GPU time (a CUDA graph replayed after an L2 flush, as the
# benchmarks of lessons 06 and 11), in the same passes, at lesson 06's shortest and
# longest lengths and its two cases (:math:`B = 4`, :math:`H \cdot D = 2048`), fp16.

LENGTHS = (V2.SIZES[0], V2.SIZES[-1])
STEP_INDEX = ["D", "causal", "N"]  # a case's columns, as the tables below index them


def step_timers(case):
    """{step: kit.Timer} of one case's fresh inputs."""
    B, H = {D: (B, H) for B, H, D in V2.CASES}[case["D"]]
    q, k, v = (torch.randn(B, H, case["N"], case["D"], device=kit.DEVICE,
                           dtype=torch.float16) for _ in range(3))
    return {name: kit.call_timer(forward, q, k, v, case["causal"], case["D"]**-0.5)
            for name, forward in STEPS.items()}


def step_flops(case):
    """One call's work in TFLOP per millisecond of the rate (TFLOP/s)."""
    B, H = {D: (B, H) for B, H, D in V2.CASES}[case["D"]]
    return kit.attention_flops(B, H, case["N"], case["D"], case["causal"], "fwd") * 1e-9


if __name__ == "__main__" and reason is None:
    cases = [dict(zip(STEP_INDEX, (D, causal, N))) for D in FWD.WS_HEAD_DIMS
             for causal in (False, True) for N in LENGTHS]
    results, gpu, _ = kit.case_benchmark(cases, step_timers, step_flops)
# TFLOP/s by GPU time: a row per case, a column per step.
gpu.round().astype("Int64") if __name__ == "__main__" and reason is None else None

# %%
# The gain of each step over the one before it, per case (above 1: faster). Where the
# two steps' timings spread past ``kit.SPREAD_LIMIT`` the gain is marked with a "~":
# within the spread, it is not a measured difference.


def step_gains(results):
    """A table of each step's GPU-time rate over the step before it, per case, with
    "~" where either timing spread past kit.SPREAD_LIMIT."""
    import pandas as pd

    rates = kit.rate_tables(results, STEP_INDEX)[0]
    spreads = results.pivot_table(index=STEP_INDEX, columns="provider",
                                  values="gpu_spread", sort=False)  # rates' order
    names = list(STEPS)
    gains = {}
    for before, after in zip(names, names[1:]):
        gain = rates[after] / rates[before]
        loose = (spreads[[before, after]] > kit.SPREAD_LIMIT).any(axis=1)
        gains[after.split(" ", 1)[1]] = [f"{'~' if s else ''}{g:.2f}"
                                         for g, s in zip(gain, loose)]
    return pd.DataFrame(gains, index=rates.index)


def summary(rates):
    """A sentence per step: its gain over the step before, lowest to highest, from
    the GPU-time rates (a column per step, indexed by STEP_INDEX)."""
    names = list(STEPS)
    for before, after in zip(names, names[1:]):
        gain = rates[after] / rates[before]
        short, long = gain.xs(LENGTHS[0], level="N"), gain.xs(LENGTHS[-1], level="N")
        print(f"step {after}: {short.min():.2f}x to {short.max():.2f}x the step before "
              f"at N = {LENGTHS[0]}, {long.min():.2f}x to {long.max():.2f}x at "
              f"N = {LENGTHS[-1]}")
    for D, by_d in rates.groupby(level="D"):
        gains = {after: by_d[after] / by_d[before] for before, after in
                 zip(names, names[1:])}  # fmt: skip
        best = max(gains, key=lambda name: gains[name].min())
        lost = [name for name, gain in gains.items() if (gain < 1).all()]
        total = by_d[names[-1]] / by_d[names[0]]
        print(f"D = {D}: the step with the best worst case is {best} "
              f"({gains[best].min():.2f}x to {gains[best].max():.2f}x); "
              f"{', '.join(lost) or 'no step'} lost in every case; all four: "
              f"{total.min():.2f}x to {total.max():.2f}x the portable kernel")


def draw_steps(rates):
    """TFLOP/s by GPU time of every step, a panel per length, a bar group per case."""
    import matplotlib.pyplot as plt

    kit.plot_style()
    fig, axes = plt.subplots(len(LENGTHS), 1, figsize=(8, 3.2 * len(LENGTHS)))
    colours = ["#9e9e9e", "#c6dbef", "#6baed6", "#2171b5", "#08306b"]
    for ax, N in zip(axes, LENGTHS):
        table = rates.xs(N, level="N")
        width = 0.8 / len(STEPS)
        for i, (name, colour) in enumerate(zip(STEPS, colours)):
            ax.bar([c + i * width for c in range(len(table))], table[name], width,
                   color=colour, label=name)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(table))],
                      [f"D={D}{', causal' if c else ''}" for D, c in table.index])
        ax.set(ylabel="TFLOP/s (GPU time)", title=f"N = {N}")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3,
               fontsize=10, frameon=False)  # below the panels, clear of the bars
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


if __name__ == "__main__" and reason is None:
    draw_steps(gpu)
    summary(gpu)
step_gains(results) if __name__ == "__main__" and reason is None else None

# %%
# What the kernel holds
# ---------------------
# The step kernel's shared memory, from its buffers and as compiled for ``sm_90a``
# (lesson 09's ``compile_for_hopper``, no GPU needed): Q's 64 rows, ``STAGES`` buffers
# each of K and V, an mbarrier per buffer and one for Q; the compiled kernel (causal)
# adds what Triton allocates on its own, printed apart.


def step_buffers(D, stages, block_n=STEP_BLOCK_N):
    """{buffer: bytes} of attn_fwd_step_kernel for fp16 inputs."""
    return {"Q": STEP_ROWS * D * 2, "K": stages * block_n * D * 2,
            "V": stages * block_n * D * 2, "mbarriers": 8 * (1 + stages)}


def compile_step(D, STAGES, BLOCK_N=STEP_BLOCK_N):
    """attn_fwd_step_kernel compiled for sm_90a (fp16, causal), with no GPU."""
    def box(rows):
        layout = FWD._ws_box_layout(rows, D, torch.float16)
        return f"tensordesc<fp16[1,1,{rows},{D}],{layout!r}>"

    return FWD.L09.compile_for_hopper(
        attn_fwd_step_kernel, desc_q=box(STEP_ROWS), desc_k=box(BLOCK_N),
        desc_v=box(BLOCK_N), O="*fp16", LSE="*fp32", qk_scale="fp32",
        **dict.fromkeys(["H", "N", "sob", "soh", "son"], "i32"), D=D, CAUSAL=True,
        BLOCK_M=STEP_ROWS, BLOCK_N=BLOCK_N, STAGES=STAGES)


def step_fact(**config):
    """Lesson 09's compiled_facts of compile_step(**config)."""
    return FWD.L09.compiled_facts(compile_step(**config))


def step_facts(configs):
    """step_fact(**config) for each of configs, on any machine."""
    return kit.compiled_where_triton_can(step_fact, "12-hopper-forward-steps", configs)


if __name__ == "__main__":
    import triton

    configs = [dict(D=D, STAGES=s) for D in FWD.WS_HEAD_DIMS for s in (1, 2)]
    try:
        for config, fact in zip(configs, step_facts(configs)):
            own = fact["shared"] - sum(step_buffers(*config.values()).values())
            print(f"D = {config['D']}, {config['STAGES']} stage(s): {fact['shared']:,} "
                  f"bytes of shared memory ({own:,} Triton's own), {fact['warps']} "
                  f"warps, {fact['registers']} registers a thread, {fact['local']} "
                  f"bytes spilled; Triton {triton.__version__}")
    except (RuntimeError, triton.CompilationError) as error:  # an API moved
        print(f"Not compiled with Triton {triton.__version__}: "
              f"{kit.error_summary(error)}")

# %%
# Programs side by side
# ---------------------
# An SM runs as many programs at once as its shared memory and registers hold, and
# programs side by side overlap one another's copies and products with no ring at all.
# A ring's buffers take shared memory, so it can cost the SM a program. CUDA's count
# (``cuOccupancyMaxActiveBlocksPerMultiprocessor``, as lesson 03 asks it) for the step
# kernel as loaded on this GPU, beside the ring's gain measured above. That the count
# explains the gain is a candidate reading, which this page does not test further.


def step_programs_per_sm(D, stages):
    """(CUDA's count of attn_fwd_step_kernel's programs that one SM holds, registers
    a thread) of the kernel as loaded (fp16, not causal, as the benchmark's first)."""
    q = torch.zeros(1, 1, STEP_ROWS, D, device=kit.DEVICE, dtype=torch.float16)
    o, lse = torch.empty_like(q), torch.empty(1, STEP_ROWS, device=kit.DEVICE)
    kernel = step_launch(q, q, q, o, lse, False, 1.0, stages)
    kernel._init_handles()  # loaded by the launch already; lesson 03 does the same
    held = kit.load_lesson("03-long-softmax").programs_per_sm(kernel, 4)
    return held, kernel.n_regs


if __name__ == "__main__" and reason is None:
    ring = gpu["2 + ring"] / gpu["1 TMA + wgmma"]
    for D in FWD.WS_HEAD_DIMS:
        (one, r1), (two, r2) = (step_programs_per_sm(D, s) for s in (1, 2))
        print(f"D = {D}: {one} programs per SM in order ({r1} registers a thread), "
              f"{two} with the ring ({r2}); the ring's gain {ring[D].min():.2f}x to "
              f"{ring[D].max():.2f}x")

# %%
# Exercises
# ---------
# Write your answers in a new cell at the end of the notebook, or in a file next to
# the lessons that loads this one: ``L12 = kit.load_lesson("12-hopper-forward-steps")``.
#
# 1. **The deepest ring.** How many stages of 128-key tiles can one H100 program of
#    ``attn_fwd_step_kernel`` hold, at :math:`D = 64` and at :math:`D = 128`? An H100
#    gives a program at most 227 KiB; count the buffers (``step_buffers``) and leave
#    room for what Triton adds (printed above). Check with
#    ``L12.check_deepest_ring({64: stages, 128: stages})``: it compiles the kernel for
#    ``sm_90a`` at your depths and one deeper, no GPU needed.
# 2. **Does a third stage pay?** On a Hopper GPU, time ``step_forward`` with
#    ``stages=3`` against ``stages=2`` at :math:`N = 16384`, :math:`D = 64`, by GPU time
#    (``kit.time_calls({name: kit.call_timer(...)})``) and explain the result from the
#    picture of the two schedules: what would a third buffer let run earlier?
#    ``L12.check_third_stage()`` times both, checks the three-stage output against
#    float64, and reports the ratio.


def check_deepest_ring(depths):
    """depths {64: stages, 128: stages}: the deepest ring of the step kernel that an
    H100 program holds, at each head dim."""
    exercise = "The deepest ring"
    kit.check_deepest_rings(exercise, depths, "D", (64, 128), lambda rings: [
        fact["shared"] for fact in step_facts([dict(D=D, STAGES=s) for D, s in rings])],
        FWD.L09.H100_SHARED_PER_PROGRAM)
    print(f"{exercise}: right, at both head dims.")


def check_third_stage(N=16384, D=64):
    """On a Hopper GPU: step_forward with three stages against two, checked against
    float64 first; prints the ratio by GPU time (a measurement, not a target)."""
    exercise = "Does a third stage pay?"
    probe = torch.empty(1, 1, 8, D, dtype=torch.float16, device=kit.DEVICE)
    if FWD.warp_specialized_unsupported(probe, probe, probe) is not None:
        print(f"{exercise}: the kernel runs only on a Hopper GPU; nothing timed here.")
        return None
    generator = kit.fresh_generator()
    q, k, v = (torch.randn(1, 4, 1000, D, generator=generator).to(
        kit.DEVICE, torch.float16) for _ in range(3))
    kit.check_against_float64(functools.partial(step_forward, stages=3), q, k, v,
                              True, D**-0.5, exercise, backward=False)
    q, k, v = (torch.randn(4, 2048 // D, N, D, device=kit.DEVICE,
                           dtype=torch.float16) for _ in range(3))
    timed = kit.time_calls({stages: kit.call_timer(step_forward, q, k, v, False,
                                                   D**-0.5, stages)
                            for stages in (2, 3)})
    ratio = min(timed[2].gpu) / min(timed[3].gpu)
    print(f"{exercise}: three stages ran at {ratio:.2f}x two by GPU time "
          f"(N = {N}, D = {D}).")
    return ratio
