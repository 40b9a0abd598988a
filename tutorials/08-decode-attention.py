"""
Decode attention: split-KV, grouped heads and a paged cache
===========================================================

A model that generates text runs attention for one new token per sequence against a
cache of every key and value before it. That step, *decoding*, is most of the attention
that runs today, and the grid of :doc:`06-fused-attention-v2-forward` leaves most of a
GPU idle there. This lesson builds the kernel inference servers write instead: the
cache split among programs, merged with :doc:`03-long-softmax`'s combine step
(`Flash-Decoding <https://crfm.stanford.edu/2023/10/12/flashdecoding.html>`_), query
heads sharing key/value heads (`GQA <https://arxiv.org/abs/2305.13245>`_), a batch of
different lengths, and a cache in pages (`PagedAttention
<https://arxiv.org/abs/2309.06180>`_). It needs ``stepkit.py`` next to it. Previous:
:doc:`07-fused-attention-v2-backward`; next: :doc:`09-gluon-primer`.

You will learn:

* why one query token per sequence leaves FlashAttention's grid with too few programs;
* split-KV: chunks of the cache reduced to partial states by programs of their own,
  merged by lesson 03's combine step, and how many chunks to cut, and why;
* grouped-query attention: the query heads of one key/value head as the rows of one
  ``tl.dot``, so that each cached byte is read once;
* ragged batches and a paged cache, as servers keep them, and what checking costs;
* why a short decode step is paced by the host, and how a CUDA graph (a recording of
  a step's kernel launches that the GPU replays in one call) removes that;
* how it compares with SDPA's cuDNN and flash backends, FlexAttention, plain PyTorch
  and a copy of the same bytes (on a GPU; see below for a build without one).
"""

# %%
# Where the kernels run
# ---------------------
# ``stepkit`` picks a CUDA GPU when there is one, else the Triton interpreter (below).

import functools
import math

import torch

import stepkit as kit  # picks the device; no GPU: the Triton interpreter

DEVICE = kit.DEVICE

import triton
import triton.language as tl

INTERPRETED = "" if kit.ON_GPU else (  # printed here and beside the benchmark
    "\nNo GPU: the timings are the Triton interpreter's, NumPy on the CPU, only "
    "illustrative. A GPU build times the split rule, the peers and a copy instead.")
print(kit.describe_platform() + INTERPRETED) if __name__ == "__main__" else None

# %%
# One token against the cache
# ---------------------------
# At each step, sequence :math:`b` brings one query :math:`q` per head and attends to
# its :math:`L` cached keys and values: :math:`o = \mathrm{softmax}(c\, q K^\top) V`,
# the scale :math:`c` being :math:`1/\sqrt{D}` by default. With :math:`H_q` query heads
# sharing :math:`H_{kv}` key/value heads, a step reads :math:`2 B H_{kv} L D` cached
# elements for :math:`4 B H_q L D` FLOPs: :math:`H_q / H_{kv}` FLOPs per byte in fp16 or
# bf16 (4 in the model timed on a GPU: 32 query, 8 key/value heads), where an H100 can
# do some 300. Decoding is bound by memory; its yardstick is a copy of the same bytes
# (which reads and writes them: a kernel that only reads can pass it).
# Lesson 06's grid gives each program a block of queries of one head: here,
# :math:`B H_q` programs each walking a whole cache, at :math:`B = 1` 32 programs for an
# H100's 132 SMs, most idle, the rest with few loads in flight (measured below).
#
# Split-KV
# --------
# Cut each cache into :math:`S` chunks, a program each. Program :math:`s` runs
# FlashAttention's loop over its chunk and leaves a partial state: its maximum
# :math:`m_s`, sum :math:`\ell_s = \sum_j e^{x_j - m_s}` and unnormalized output
# :math:`\mathit{acc}_s = \sum_j e^{x_j - m_s} v_j` over its keys' scores
# :math:`x_j = c\, q \cdot k_j`. A second, small kernel merges each query head's states
# with lesson 03's combine step, exact in any grouping (lesson 03's second exercise):
#
# .. math::
#
#    m = \max_s m_s, \qquad
#    o = \frac{\sum_s e^{m_s - m}\, \mathit{acc}_s}{\sum_s e^{m_s - m}\, \ell_s}.
#
# It moves :math:`D + 2` floats per chunk and query head, little next to the chunk's
# :math:`2 \cdot \mathrm{chunk} \cdot D` cached elements once it holds 100s of keys.
#
# Grouped heads, read once
# ------------------------
# In grouped-query attention (GQA), :math:`G = H_q / H_{kv}` query heads share each
# key/value head; multi-query attention (MQA) is :math:`H_{kv} = 1`. A program per query
# head would read each key :math:`G` times. Here one program takes the :math:`G` query
# heads of its key/value head as the rows of ``tl.dot(q, k^T)``: :math:`G` rows of
# scores from one load of the keys. ``tl.dot`` wants 16 rows or more, so they are padded
# with zeros, never stored: useless work for the tensor cores, which a memory-bound
# kernel does not notice. As in lesson 06, :math:`\log_2 e` is folded into the scale.
#
# Ragged lengths and a paged cache
# --------------------------------
# A server's batch mixes lengths: a tensor ``lengths`` gives each sequence's; a program
# whose chunk starts past its sequence's end loads and leaves nothing, and the merge
# skips it. Nor do servers keep a slab of the longest length per sequence, but a pool
# of fixed-size *pages* and a *block table* listing each sequence's pages in order:
# token :math:`j` of sequence :math:`b` is in page ``block_table[b, j // P]``, slot
# ``j % P``. In the kernel: one more small load per tile of keys. Drawn by the function
# below: a ragged batch in chunks, and the same batch in pages.


if __name__ == "__main__":
    import matplotlib.pyplot as plt

    kit.draw_decode_layout()
    plt.show()

# %%
# The kernels
# -----------
# ``split_kv_kernel`` runs a program per (sequence, key/value head, chunk); with one
# chunk (``DIRECT``) it stores the output itself and no merge runs. ``PAGE`` is the page
# size, 0 for a contiguous cache. Addresses are 64-bit: at :math:`B = 32`,
# :math:`L = 128\mathrm{K}` a cache holds :math:`4.3 \cdot 10^9` elements. ``UPCAST``
# computes bf16 in fp32 under the interpreter, which multiplies bf16 as raw integers in
# ``tl.dot`` (lesson 06). Lengths are cut at the cache, page indices clamped into the
# pool: unchecked values (``validate=False``, below) cannot make it read out of bounds.


@triton.jit
def split_kv_kernel(
    Q, K, V, O, M_PART, L_PART, ACC_PART, LENGTHS, TABLE,
    qk_scale, HKV, capacity, chunk, splits, last_page,
    sqb, sqh, sqd, sk_outer, sk_head, sk_row, skd, sv_outer, sv_head, sv_row, svd,
    st_row, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, RAGGED: tl.constexpr,
    DIRECT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    seq_head = tl.program_id(0).to(tl.int64)  # b * HKV + key/value head
    split = tl.program_id(1)  # split-KV: which chunk of the cache
    b, kv_head = seq_head // HKV, seq_head % HKV
    length = capacity
    if RAGGED:  # a ragged batch: this sequence's own length
        length = tl.minimum(tl.load(LENGTHS + b), capacity)
    lo = split * chunk  # this program's keys: lo to hi, none if it starts past the end
    hi = tl.minimum(lo + chunk, length)
    rows = tl.arange(0, G_PAD)  # grouped: this key/value head's G query heads, padded
    d = tl.arange(0, D)
    q_at = Q + b * sqb + (kv_head * G + rows)[:, None] * sqh + d[None, :] * sqd
    q = tl.load(q_at, mask=rows[:, None] < G, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_head = K + kv_head * sk_head + d[None, :] * skd
    v_head = V + kv_head * sv_head + d[None, :] * svd
    m = tl.full([G_PAD], -float("inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for start in tl.range(lo, hi, BLOCK_N):  # no pass at all past the length
        keys = start + tl.arange(0, BLOCK_N)
        ok = keys < hi
        if PAGE >= BLOCK_N:  # paged, a tile within one page: one index, rows in order
            outer = tl.load(TABLE + b * st_row + start // PAGE).to(tl.int64)
            row = (start % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
        elif PAGE:  # paged, small pages: each key's page from the table, its slot
            outer = tl.load(TABLE + b * st_row + keys // PAGE, mask=ok, other=0)
            outer, row = outer.to(tl.int64), (keys % PAGE).to(tl.int64)
        else:  # contiguous: row `keys` of sequence b's cache
            outer, row = b, keys.to(tl.int64)
        if PAGE:  # an unchecked index (validate=False) still reads inside the pool
            outer = tl.minimum(tl.maximum(outer, 0), last_page)
        k_at = outer * sk_outer + row * sk_row
        v_at = outer * sv_outer + row * sv_row
        k = tl.load(k_head + k_at[:, None], mask=ok[:, None], other=0.0)
        v = tl.load(v_head + v_at[:, None], mask=ok[:, None], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * qk_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: key `start` is valid
        alpha = tl.exp2(m - m_new)  # lesson 06's online softmax, G rows at once
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out_rows = seq_head * G + rows  # b * Hq + query head
    if DIRECT:  # one chunk: the state is the answer (0 / 0 = NaN for a length 0)
        o = (acc / l[:, None]).to(O.dtype.element_ty)
        tl.store(O + out_rows[:, None] * D + d[None, :], o, mask=rows[:, None] < G)
    else:  # split: a partial state (m, l, acc) for merge_kernel
        part = out_rows * splits + split
        keep = rows < tl.where(lo < length, G, 0)  # past the end: nothing to leave
        tl.store(M_PART + part, m, mask=keep)
        tl.store(L_PART + part, l, mask=keep)
        tl.store(ACC_PART + part[:, None] * D + d[None, :], acc, mask=keep[:, None])


@triton.jit
def merge_kernel(
    O, M_PART, L_PART, ACC_PART, LENGTHS, HQ, capacity, chunk, splits,
    D: tl.constexpr, SPLITS_POW2: tl.constexpr, RAGGED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # b * Hq + query head
    length = capacity
    if RAGGED:
        length = tl.minimum(tl.load(LENGTHS + row // HQ), capacity)
    live = tl.arange(0, SPLITS_POW2) < tl.cdiv(length, chunk)  # chunks with keys
    part = row * splits + tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, D)
    m = tl.load(M_PART + part, mask=live, other=-float("inf"))
    l = tl.load(L_PART + part, mask=live, other=0.0)
    acc_at = ACC_PART + part[:, None] * D + d[None, :]
    acc = tl.load(acc_at, mask=live[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # 0 for the chunks that were skipped
    o = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(O + row * D + d, o.to(O.dtype.element_ty))


# %%
# How many splits
# ---------------
# Unsplit, there are :math:`B H_{kv}` programs. Memory runs at full speed only with many
# bytes in flight, so the rule cuts chunks until there is about one program per SM,
# rounding down: a second, partial wave would leave most SMs idle while it runs. A paged
# tile waits for its table entry before its keys have addresses, so a paged program
# keeps fewer bytes in flight: there the rule asks for four programs per SM. No chunk
# is shorter than ``MIN_CHUNK`` keys (where the merge and each program's set-up cost
# more than the parallelism brings), and there are at most ``MAX_SPLITS`` (which bounds
# the merge's registers); chunks are whole tiles. It sees shapes, never the lengths'
# values, so that a CUDA graph can replay the grid it chose. "How many splits,
# measured" tests it.

DTYPES, HEAD_DIMS = (torch.float16, torch.bfloat16), (64, 128)
MAX_SPLITS = 64
MIN_CHUNK = 256 if kit.ON_GPU else 32  # keys; under the interpreter, small chunks
INTERPRETER_SMS = 16  # and a pretend GPU of 16 SMs, so that small tests split too
# (keys per tile, warps, stages, programs per SM), contiguous by head dim and paged,
# from a sweep of tiles and split counts on an H200 (engineering notes).
CONTIGUOUS_CONFIG = {64: (128, 4, 3, 1), 128: (128, 4, 3, 1)}
PAGED_CONFIG = (64, 4, 2, 4)  # a 64-key tile within one page: one table entry per tile


def launch_config(D, page):
    """CONTIGUOUS_CONFIG[D], or PAGED_CONFIG for pages of page keys (32-key tiles in
    smaller pages); under the interpreter, tiles of 16 keys, so that tests run many."""
    if not kit.ON_GPU:
        return 16, 4, 1, 1
    tile = min(PAGED_CONFIG[0], max(32, page))  # 32 keys in pages of 16
    return (tile, *PAGED_CONFIG[1:]) if page else CONTIGUOUS_CONFIG[D]


def choose_splits(programs, length, sms, block_n, splits=None, per_sm=1):
    """(splits, chunk) for caches of length keys read by programs = B * Hkv programs
    unsplit, on a GPU of sms SMs: chunks of whole tiles, about splits of them where
    given (fewer where whole tiles leave some empty), else the rule's count for
    per_sm programs per SM."""
    if splits is None:
        wanted = per_sm * sms // programs
        splits = max(1, min(wanted, length // MIN_CHUNK, MAX_SPLITS))
    chunk = triton.cdiv(triton.cdiv(length, splits), block_n) * block_n
    return triton.cdiv(length, chunk), chunk


@functools.cache
def sm_count(device):
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# %%
# The launchers
# -------------
# ``decode_attention(q, k, v, lengths=None, sm_scale=None, validate=True)``: ``q`` is
# (B, Hq, D), one token per sequence; ``k`` and ``v`` are (B, Hkv, L, D), any strides;
# ``lengths`` is None (all :math:`L`) or an int32 or int64 tensor (B,), each 1 to
# :math:`L`. ``paged_decode_attention(q, k_pages, v_pages, block_table, lengths,
# sm_scale=None, validate=True)`` reads pools of (num_pages, page_size, Hkv, D), the
# page size a power of two of at least 16, through an int32 or int64 (B, max_pages)
# table, reading in row :math:`b` only the pages that ``lengths[b]`` needs (servers pad
# the rest). fp16 or bf16, :math:`D` of 64 or 128, :math:`H_q` a multiple of
# :math:`H_{kv}`; both return a contiguous (B, Hq, D) tensor in q's dtype. Anything else
# gets a ``TypeError`` or ``ValueError`` that names it. Checking lengths and page
# indices reads them on the host, a synchronization that a CUDA graph cannot capture:
# ``validate=False`` skips just that, for a caller that captures the step. It then
# promises no read outside the tensors and NaN for a length of 0, but no right answer
# for a length or page index out of range.


def _check(q, k, v, names, heads_at, sm_scale, validate):
    """The checks that need no values; returns the scale as a float."""
    for name, t, dims in (("q", q, 3), (names[0], k, 4), (names[1], v, 4)):
        kit.check_tensor(name, t, dims, q)
    if q.dtype not in DTYPES or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, {names[0]} and {names[1]} must all be float16 or all "
                        f"bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] not in HEAD_DIMS or not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(f"the head dims must be equal and one of {HEAD_DIMS}, got "
                         f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape != v.shape or 0 in (*q.shape, *k.shape):
        raise ValueError(f"{names[0]} and {names[1]} must have one shape, nothing "
                         f"empty: got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[heads_at]:
        raise ValueError(f"the heads do not divide: {q.shape[1]} query heads for "
                         f"{k.shape[heads_at]} key/value heads")
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be True or False, got {validate!r}")
    return q.shape[-1] ** -0.5 if sm_scale is None else kit.check_sm_scale(sm_scale)


def _check_values(lengths, capacity, table=None, page=None, pool=None):
    """The checks that read values on the host, which validate=False skips."""
    values = lengths.tolist()
    for b in (b for b, n in enumerate(values) if not 1 <= n <= capacity):
        held = "the cache holds" if table is None else "the block table's pages hold"
        raise ValueError(f"lengths[{b}] is {values[b]}: a length must be 1 to "
                         f"{capacity}, what {held}")
    if table is not None:
        needed = torch.arange(table.shape[1]) < torch.tensor(values)[:, None] / page
        entries = table.cpu()
        for b, j in (needed & ((entries < 0) | (entries >= pool))).nonzero()[:1]:
            raise ValueError(f"block_table[{b}, {j}] is {int(entries[b, j])}, a page "
                             f"index out of range: the pool has {pool} pages")


def _launch(q, k, v, lengths, table, sm_scale, splits=None):
    """split_kv_kernel, then merge_kernel unless one chunk suffices. table None: k and
    v are (B, Hkv, L, D); else pools of pages. splits: choose_splits' unless given."""
    B, Hq, D = q.shape
    if table is None:
        page, last_page, (Hkv, capacity) = 0, 0, k.shape[1:3]
        k_strides, v_strides = k.stride(), v.stride()  # outer, head, row, d
    else:
        pool, page, Hkv = k.shape[:3]
        capacity, last_page = table.shape[1] * page, pool - 1
        k_strides, v_strides = ((t.stride(0), t.stride(2), t.stride(1), t.stride(3))
                                for t in (k, v))  # fmt: skip
    block_n, warps, stages, per_sm = launch_config(D, page)
    splits, chunk = choose_splits(B * Hkv, capacity, sm_count(q.device), block_n,
                                  splits, per_sm)  # fmt: skip
    o = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    parts = [o] * 3 if splits == 1 else [torch.empty(
        (B * Hq, splits, *extra), dtype=torch.float32, device=q.device)
        for extra in ((), (), (D,))]  # fmt: skip
    ragged = lengths is not None
    split_kv_kernel[(B * Hkv, splits)](
        q, k, v, o, *parts, lengths if ragged else q, q if table is None else table,
        sm_scale * math.log2(math.e), Hkv, capacity, chunk, splits, last_page,
        *q.stride(), *k_strides, *v_strides, 0 if table is None else table.stride(0),
        D=D, G=Hq // Hkv, G_PAD=max(16, triton.next_power_of_2(Hq // Hkv)),
        BLOCK_N=block_n, PAGE=page, RAGGED=ragged, DIRECT=splits == 1,
        UPCAST=not kit.ON_GPU and q.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        merge_kernel[(B * Hq,)](
            o, *parts, lengths if ragged else q, Hq, capacity, chunk, splits,
            D=D, SPLITS_POW2=triton.next_power_of_2(splits), RAGGED=ragged,
        )  # fmt: skip
    return o


def decode_attention(q, k, v, lengths=None, sm_scale=None, validate=True):
    """One decoding step: softmax(q k^T * sm_scale) v per sequence and query head,
    over the first lengths[b] keys of sequence b (all L if lengths is None)."""
    sm_scale = _check(q, k, v, ("k", "v"), 1, sm_scale, validate)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, k and v {k.shape[0]}")
    if lengths is not None:
        kit.check_index("lengths", lengths, q, (q.shape[0],))
        if validate:
            _check_values(lengths, k.shape[2])
    return _launch(*kit.resolved(q, k, v), lengths, None, sm_scale)


def paged_decode_attention(q, k_pages, v_pages, block_table, lengths, sm_scale=None,
                           validate=True):  # fmt: skip
    """decode_attention over a paged cache: token j of sequence b is in page
    block_table[b, j // page_size], at slot j % page_size."""
    sm_scale = _check(q, k_pages, v_pages, ("k_pages", "v_pages"), 2, sm_scale,
                      validate)  # fmt: skip
    pool, page = k_pages.shape[:2]
    if page < 16 or page & (page - 1):
        raise ValueError(f"page_size must be a power of two of at least 16, got {page}")
    kit.check_index("block_table", block_table, q, (q.shape[0], None))
    kit.check_index("lengths", lengths, q, (q.shape[0],))
    if validate:
        _check_values(lengths, block_table.shape[1] * page, block_table, page, pool)
    q, k_pages, v_pages = kit.resolved(q, k_pages, v_pages)
    return _launch(q, k_pages, v_pages, lengths, block_table, sm_scale)


# %%
# The definition in PyTorch
# -------------------------
# ``naive_decode`` is the definition (the query heads viewed as (Hkv, G), no key copied
# per head): in float64 the reference, in bf16 the benchmark's plain-PyTorch peer;
# ``window`` is exercise 1's. ``paged_copy`` copies caches into pools of shuffled pages.


def naive_decode(q, k, v, lengths=None, sm_scale=None, window=None):
    """softmax(q k^T * sm_scale) v in PyTorch, the scores in fp32 or better."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1:3]
    s = q.reshape(B, Hkv, Hq // Hkv, D) @ k.transpose(-1, -2)  # (B, Hkv, G, L)
    s = s.to(torch.promote_types(s.dtype, torch.float32))
    s = s * (D**-0.5 if sm_scale is None else sm_scale)
    keys = torch.arange(L, device=q.device)
    ends = keys.new_full((B, 1), L) if lengths is None else lengths[:, None]
    hidden = (keys >= ends) | (keys < ends - (window or L))
    s = s.masked_fill(hidden[:, None, None, :], -math.inf)
    return (torch.softmax(s, dim=-1).to(v.dtype) @ v).reshape(B, Hq, D)


def paged_copy(k, v, page, generator=None):
    """(k_pages, v_pages, block_table): caches k and v (B, Hkv, L, D) copied into pools
    of pages of page tokens, shuffled (in order without a generator)."""
    B, Hkv, L, D = k.shape
    per_seq = triton.cdiv(L, page)
    order = torch.randperm(B * per_seq, generator=generator) if generator else (
        torch.arange(B * per_seq))  # fmt: skip
    pools = [torch.empty((B * per_seq, page, Hkv, D), dtype=k.dtype, device=k.device)
             .index_copy_(0, order.to(k.device), torch.nn.functional.pad(
                 t, (0, 0, 0, per_seq * page - L)).view(B, Hkv, per_seq, page, D)
                 .permute(0, 2, 3, 1, 4).reshape(B * per_seq, page, Hkv, D))
             for t in (k, v)]  # fmt: skip
    return *pools, order.view(B, per_seq).to(k.device, torch.int32)


# %%
# Correctness
# -----------
# Against float64: a ragged batch (lengths 1, one no chunk or page divides, and all of
# the cache), 4 query heads per key/value head, a cache stored token-major (strides not
# a contiguous tensor's), and the same in shuffled pages of 16 tokens. The tests
# (``tests/test_decode.py``) run many more shapes.

if __name__ == "__main__":
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, D = 3, 8, 2, 1000 if kit.ON_GPU else 77, 64
    for dtype in DTYPES:
        q = torch.randn(B, Hq, D, generator=gen).to(DEVICE, dtype)
        k, v = (torch.randn(B, L, Hkv, D, generator=gen).to(DEVICE, dtype)
                .transpose(1, 2) for _ in "kv")  # fmt: skip
        lengths = torch.tensor([1, L // 2 + 3, L], device=DEVICE)
        expected = naive_decode(q.double(), k.double(), v.double(), lengths)
        paged = paged_decode_attention(q, *paged_copy(k, v, 16, gen), lengths)
        for name, got in (("contiguous", decode_attention(q, k, v, lengths)),
                          ("paged", paged)):  # fmt: skip
            tol, error = kit.TOLERANCE[dtype], (got.double() - expected).abs().max()
            torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
            print(f"{str(dtype)[6:]:>8s} {name:>10s}: max abs error {error:.1e}")

# %%
# How many splits, measured
# -------------------------
# At :math:`B = 1`, the kernel with forced splits, from 1 (lesson 06's grid with grouped
# heads) up, in GB/s of cache read by *GPU time* (a CUDA graph replayed after an L2
# flush; :doc:`performance page <../performance>`); a star marks the rule's choice. The
# interpreter runs programs one after another: no SM idles, no rule is on trial.

OURS, NAIVE, PAGED = "Triton split-KV", "naive PyTorch", "Triton paged"
BY = "by GPU time" if kit.ON_GPU else "by the interpreter's wall-clock time"
HQ, HKV, HEAD_DIM = (32, 8, 128) if kit.ON_GPU else (4, 2, 64)
DTYPE = torch.bfloat16


def cache_bytes(B, L):
    return 2 * B * HKV * L * HEAD_DIM * DTYPE.itemsize


def random_case(B, L):
    shapes = ((B, HQ, HEAD_DIM), (B, HKV, L, HEAD_DIM), (B, HKV, L, HEAD_DIM))
    return [torch.randn(shape, device=DEVICE, dtype=DTYPE) for shape in shapes]


def splits_timers(case):
    q, k, v = random_case(1, case["L"])
    return {OURS: kit.call_timer(_launch, q, k, v, None, None, HEAD_DIM**-0.5,
                                 splits=case["splits"])}  # fmt: skip


def splits_verdict(curve, chosen, on_gpu=kit.ON_GPU):
    """A line per length (a column of curve: GB/s by splits): the rule's choice
    (chosen[L]) and one split over the best; under the interpreter, why fewer win."""
    lines = []
    for L, rates in curve.items():
        n, best, top = chosen[L], rates.idxmax(), rates.max()
        share = rates[n] / top  # no "100%" beside another count, unless a tie
        share = f"{share:.0%}" if n == best or share < 0.995 else f"{share:.1%}"
        lines.append(f"L = {L}: the rule's {n} splits reach {share} of "
                     f"the best measured (splits = {best}, {top:.4g} GB/s); one split "
                     f"{rates[1] / top:.0%}")  # fmt: skip
        if not on_gpu and best < n and rates[n] < 0.95 * top:
            lines[-1] += (": not a GPU's verdict, as the interpreter runs programs one "
                          "after another, so splitting only adds merge work")
    return lines


if __name__ == "__main__":
    copy_gbs = kit.copy_bandwidth_gbs()
    lengths = [4096, 16384, 65536] if kit.ON_GPU else [256]
    counts = [1, 2, 4, 8, 16, 32, 64] if kit.ON_GPU else [1, 2, 4, 8]
    split = functools.partial(choose_splits, HKV, sms=sm_count(DEVICE),
                              block_n=launch_config(HEAD_DIM, 0)[0])  # fmt: skip
    chosen = {L: split(L)[0] for L in lengths}  # the counts that run, the rule's too:
    runs = {L: {split(L, splits=n)[0] for n in counts} | {chosen[L]} for L in lengths}
    _, by_splits, _ = kit.case_benchmark(
        [dict(L=L, splits=n) for L in lengths for n in sorted(runs[L])], splits_timers,
        lambda c: cache_bytes(1, c["L"]) * 1e-6)  # fmt: skip
    curve = by_splits[OURS].unstack("L")
    print("\n".join(splits_verdict(curve, chosen)))
    fig = kit.plot_rates(curve.rename(columns=lambda L: f"L = {L}"), copy_gbs,
                         "copy bandwidth (large buffer)", "GB/s of cache read",
                         f"B = 1, {HQ} query and {HKV} key/value heads, {BY}",
                         ours=[f"L = {L}" for L in lengths], log_y=not kit.ON_GPU)
    for L in lengths:  # the rule's choice, drawn above the curves' markers
        fig.axes[0].plot(chosen[L], curve.loc[chosen[L], L], "k*", ms=12, zorder=9)
    plt.show()

# %%
# Benchmark
# ---------
# GB/s of cache read (K and V, once) from a contiguous bf16 cache, 32 query heads on 8
# key/value heads, :math:`D = 128` (4 on 2, :math:`D = 64` and tiny caches under the
# interpreter), beside the PyTorch definition, a copy moving as many bytes and, on a
# GPU, SDPA's cuDNN and flash backends (``enable_gqa=True``, chosen outside the timed
# call) and FlexAttention set up for decoding (compiled per shape, a block mask of one
# query row); on a CPU, "SDPA math", SDPA's backend in plain PyTorch operations.
# Printed: the peers that ran, any case past the free memory. GB/s by GPU time, or by
# the interpreter's wall-clock time (a log scale: it is far slower than PyTorch), a
# range where timings spread by over 10%.

BATCHES = [1, 8, 32] if kit.ON_GPU else [1, 2]
LENGTHS = [1024, 4096, 16384, 65536, 131072] if kit.ON_GPU else [256, 1024]


def flex_decoding(scale, length):
    """FlexAttention for caches of length keys (None where it cannot run): compiled,
    a block mask of one query row (the engineering notes time it without one)."""
    if kit.flex_attention_missing():
        return None
    from torch.nn.attention import flex_attention as flex

    every_key = flex.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, None,
                                       None, 1, length, device=DEVICE)  # fmt: skip
    decode = functools.partial(kit.compiled_flex_attention(), block_mask=every_key,
                               scale=scale, enable_gqa=True)  # fmt: skip
    decode.context = kit.flex_settings
    return decode


def peers_note(columns, on_gpu=kit.ON_GPU):
    """The peers timed (columns: the benchmark's), and those the text names not."""
    absent = [p for p in ("SDPA cuDNN", "SDPA flash", kit.FLEX) if p not in columns]
    why = "which this GPU or PyTorch lacks" if on_gpu else "which need a GPU"
    return (f"Peers timed in this build: {', '.join(c for c in columns if c != OURS)}."
            + (f" Not timed: {', '.join(absent)}, {why}." if absent else ""))


def timers(case):
    """{provider: Timer} at case {"B": ..., "L": ...}."""
    q, k, v = random_case(case["B"], case["L"])
    scale, q4 = HEAD_DIM**-0.5, q.unsqueeze(2)  # SDPA's shape: (B, Hq, 1, D)
    calls = {OURS: kit.call_timer(decode_attention, q, k, v)}
    for name, fn in kit.sdpa_providers(False, scale, kit.FAST_SDPA).items():
        grouped = functools.partial(fn, enable_gqa=True)
        grouped.context = fn.context
        calls[name] = kit.call_timer(grouped, q4, k, v)
    if (flex := flex_decoding(scale, case["L"]) if kit.ON_GPU else None):
        calls[kit.FLEX] = kit.call_timer(flex, q4, k, v)
    calls[NAIVE] = kit.call_timer(naive_decode, q, k, v)
    # K holds half the cache's bytes: copying it reads half and writes half.
    calls[kit.SAME_BYTES] = kit.call_timer(kit.same_bytes_copy(k), k)
    return calls


if __name__ == "__main__":
    fits = kit.cases_that_fit(  # 1.7: the cache, a copy of K, the scores
        [dict(B=B, L=L) for B in BATCHES for L in LENGTHS],
        lambda c: 1.7 * cache_bytes(c["B"], c["L"]))  # fmt: skip
    results, gpu, b2b = kit.case_benchmark(
        fits, timers, lambda c: cache_bytes(c["B"], c["L"]) * 1e-6)
    print(peers_note(gpu.columns) + INTERPRETED)
    for B in dict.fromkeys(c["B"] for c in fits):
        kit.plot_rates(gpu.xs(B, level="B"), copy_gbs, "copy bandwidth (large buffer)",
                       "GB/s of cache read", f"B = {B}, {BY}", ours=[OURS],
                       log_y=not kit.ON_GPU)  # fmt: skip
    plt.show()

kit.rates_table(results, ["B", "L"], "GB/s") if __name__ == "__main__" else None

# %%
# Reading the numbers
# -------------------
# Per :math:`(B, L)`: the kernel over the best SDPA backend and the copy, and µs per
# step, by GPU time (as a server replays it) and back to back (eager). Targets, on a
# GPU: from 4K keys the best SDPA backend (0.98x of it where it reads at 0.9 of the
# copy or more); at :math:`B = 1` from 16K keys, 0.9 of the copy.


def closing_table(gpu, b2b, peers):
    """Per (B, L): ours over the best peer and the copy, µs per step, per timing."""
    best = peers[0] if len(peers) == 1 else "best SDPA"
    timings = [("wall clock", b2b)] if gpu is b2b else [("GPU time", gpu),
                                                        ("back to back", b2b)]
    columns, sizes = {}, [cache_bytes(B, L) * 1e-3 for B, L in gpu.index]
    for how, table in timings:
        ratios = {best: table[peers].max(axis=1), "copy": table[kit.SAME_BYTES]}
        for name, peer in ratios.items():
            columns[f"x {name}, {how}"] = (table[OURS] / peer).map("{:#.3g}".format)
        columns[f"µs per step, {how}"] = (sizes / table[OURS]).map("{:,.1f}".format)
    return gpu[[]].assign(**columns).rename_axis(columns=None)


def target_misses(gpu, peers):
    """The targets missed, a sentence each, from GB/s by GPU time indexed by (B, L)."""
    misses = []
    for (B, L), row in gpu.iterrows():
        best, copy, ours = row[peers].max(), row[kit.SAME_BYTES], row[OURS]
        need = 0.98 if best >= 0.9 * copy else 1.0
        if L >= 4096 and ours < need * best:
            misses.append(f"B = {B}, L = {L}: {ours / best:.2f}x the best SDPA "
                          f"backend, below the {need:.2f}x targeted")
        if B == 1 and L >= 16384 and ours < 0.9 * copy:
            misses.append(f"B = 1, L = {L}: {ours / copy:.0%} of the copy, below 90%")
    return misses


if __name__ == "__main__":
    sdpa = [p for p in kit.FAST_SDPA if p in gpu]
    none = "none" if kit.ON_GPU else "none (no target is for the interpreter's sizes)"
    print("Targets missed:", "".join(f"\n  {m};" for m in target_misses(gpu, sdpa))
          or f"{none}.")  # fmt: skip
    kit.save_results("08-decode-attention", [dict(
        name="decode attention, bf16", unit="GB/s", ceiling_name="copy bandwidth",
        ceiling=copy_gbs, ceiling_per_case=kit.SAME_BYTES, ours=[OURS],
        peers=[p for p in gpu if p not in (OURS, kit.SAME_BYTES)],
        rows=results.to_dict("records"))])  # fmt: skip

closing_table(gpu, b2b, sdpa) if __name__ == "__main__" else None

# %%
# One sequence, kernel by kernel
# ------------------------------
# Where :math:`B = 1` falls short of the copy, on a GPU: the CUDA profiler's µs per
# step of each kernel (calls back to back), the split kernel's rate over a copy
# kernel's on the same bytes, and the step's GPU time from the table above (each replay
# timed alone, after an L2 flush; "Launch cost" below replays steps back to back).

if __name__ == "__main__" and kit.ON_GPU:
    for L in (L for L in LENGTHS if L >= 16384 and (1, L) in gpu.index):
        q, k, v = random_case(1, L)
        ours = kit.kernel_ms(functools.partial(decode_attention, q, k, v))
        copy = sum(kit.kernel_ms(functools.partial(kit.same_bytes_copy(k), k)).values())
        split = sum(ms for name, ms in ours.items() if "split" in name)
        step = cache_bytes(1, L) / gpu.loc[(1, L), OURS] * 1e-3  # µs, from the GB/s
        each = ", ".join(f"{name} {ms * 1e3:.1f} µs" for name, ms in ours.items())
        outside = step - 1e3 * sum(ours.values())
        print(f"L = {L}: {each}; split at {copy / split:.0%} of a copy kernel's rate"
              f"; the step {step:.1f} µs by GPU time, {outside:.1f} outside kernels")

# %%
# The page size
# -------------
# The paged kernel against the contiguous one on the same values, at :math:`B = 8` (1
# under the interpreter), pages shuffled, ``validate=False`` as in a captured step. On
# a GPU pages under 64 keys take 32-key tiles: pages of 16, a table entry per key.

PAGE_SIZES, PAGE_BATCH = [16, 32, 64, 128, 256], 8 if kit.ON_GPU else 1


def page_timers(case):
    q, k, v = random_case(PAGE_BATCH, case["L"])
    lengths = torch.full((PAGE_BATCH,), case["L"], device=DEVICE)
    pools = paged_copy(k, v, case["page"], torch.Generator().manual_seed(0))
    return {OURS: kit.call_timer(decode_attention, q, k, v), PAGED: kit.call_timer(
        paged_decode_attention, q, *pools, lengths, validate=False)}  # fmt: skip


def page_verdict(ratio, on_gpu=kit.ON_GPU):
    """A sentence from ratio, paged over contiguous speed indexed by (L, page)."""
    slow = ", ".join(f"L = {L} in pages of {p} ({r:.2f}x)"
                     for (L, p), r in ratio[ratio < 0.95].items())  # fmt: skip
    return (f"Paged over contiguous: {ratio.min():.2f}x to {ratio.max():.2f}x; "
            + (f"more than 5% slower at {slow}." if slow else "within 5% everywhere.")
            + (" The interpreter pays per operation, and a paged tile has more (the "
               "table's load, page and slot): not a GPU's verdict."
               if slow and not on_gpu else ""))  # fmt: skip


if __name__ == "__main__":
    _, by_page, _ = kit.case_benchmark(
        [dict(L=L, page=p) for L in ([16384, 65536] if kit.ON_GPU else [256])
         for p in PAGE_SIZES], page_timers,
        lambda c: cache_bytes(PAGE_BATCH, c["L"]) * 1e-6)  # fmt: skip
    print(page_verdict(by_page[PAGED] / by_page[OURS]))
    by_page.columns.name = "GB/s"  # named once, in the table's corner

by_page.map(kit.shown_rate) if __name__ == "__main__" else None

# %%
# Launch cost: a decode step in a CUDA graph
# ------------------------------------------
# At short lengths launching the kernels from Python (checks, Triton's argument
# handling, two launches) takes longer than running them: the host sets the pace (on a
# GPU, the closing table's back-to-back columns). Servers capture a step in a CUDA
# graph once and replay it per token, lengths in a device tensor updated in place
# (``validate=False``). At :math:`B = 1`, in pages of 64 keys: capture, step, check,
# and time the same call both ways, eager (from Python, back to back) and replayed.

if __name__ == "__main__" and kit.ON_GPU:
    for L in (1024, 4096, 16384, 65536):
        q, k, v = random_case(1, L)
        pools, lengths = paged_copy(k, v, 64), torch.full((1,), L - 1, device=DEVICE)
        step = functools.partial(paged_decode_attention, q, *pools, lengths,
                                 validate=False)  # fmt: skip
        replay, out = kit.captured(step)
        lengths += 1  # the next token
        replay()
        torch.testing.assert_close(out, step())  # the replay read the new length
        for name, fn in (("eager", step), ("replayed from the graph", replay)):
            kit.warm_up(fn)
            print(f"L = {L:6d}: {1e3 * kit.back_to_back_ms(fn, 200):.1f} µs per token,"
                  f" {name}")
elif __name__ == "__main__":
    print("CUDA graphs need a GPU.")

# %%
# Exercises
# ---------
# Each check compares with float64 (exact for a copy) on fresh random inputs, fails on
# ``NaN`` and names the first wrong element. Write each attempt in a new cell at the end
# of the notebook (linked at the end of the page), or in a file next to the lessons:
#
# .. code-block:: python
#
#    import stepkit as kit
#    L08 = kit.load_lesson("08-decode-attention")
#    L08.check_window_decode(window_decode_attention)
#    L08.check_append_to_pages(append_to_pages)
#
# 1. **A sliding window.** Write ``window_decode_attention(q, k, v, lengths, window)``:
#    sequence :math:`b` sees only keys ``max(0, lengths[b] - window)`` to
#    ``lengths[b] - 1``. From copies of both kernels: chunks that end before the window
#    load nothing, the first live one masks the keys before it, and the merge skips the
#    dead chunks at the start too. ``check_window_decode(window_decode_attention)``
#    (on a GPU it times a 2,048-key window over 64K keys against a 2,048-key cache).
# 2. **Append the new token.** Write ``append_to_pages(k_pages, v_pages, block_table,
#    lengths, k_new, v_new)``, ``k_new`` and ``v_new`` (B, Hkv, D), which a step runs
#    before attending: in place, they become token ``lengths[b]`` of sequence :math:`b`
#    (paged as the kernels read it; ``lengths[b]`` may be 0, and the caller advances it
#    after); nothing else changes. ``check_append_to_pages(append_to_pages)``.


def check_window_decode(fn):
    """fn(q, k, v, lengths, window) against float64, on fresh ragged batches."""
    gen, count = kit.fresh_generator(), 0
    for dtype in DTYPES:
        for B, Hq, Hkv, L, D, window in ((3, 8, 2, 77, 64, 20), (2, 4, 4, 40, 128, 1),
                                         (2, 8, 1, 33, 64, 100)):  # fmt: skip
            q = torch.randn(B, Hq, D, generator=gen).to(DEVICE, dtype)
            k, v = (torch.randn(B, L, Hkv, D, generator=gen).to(DEVICE, dtype)
                    .transpose(1, 2) for _ in "kv")  # fmt: skip
            lengths = torch.randint(1, L + 1, (B,), generator=gen).to(DEVICE)
            lengths[0], tol, count = L, kit.TOLERANCE[dtype], count + 1
            as_64 = (t.double() for t in (q, k, v))
            expected = naive_decode(*as_64, lengths, window=window)
            case = (f"B={B}, Hq={Hq}, Hkv={Hkv}, D={D}, {str(dtype)[6:]}, lengths "
                    f"{lengths.tolist()}, window {window}")
            kit.expect_close("window_decode_attention", case, "the output",
                             fn(q, k, v, lengths, window), expected, dtype, tol, tol)
    print(f"window_decode_attention passed on {count} fresh ragged batches (GQA and "
          "MQA, fp16 and bf16, windows from 1 key to past the length).")
    if not kit.ON_GPU:
        return print("Its speed is measured only on a GPU.")
    (q, k, v), whole = random_case(4, 65536), torch.full((4,), 65536, device=DEVICE)
    ms = {name: min(m.gpu) for name, m in kit.time_calls({
        "window": kit.call_timer(fn, q, k, v, whole, 2048), "cache": kit.call_timer(
            decode_attention, q, k[:, :, -2048:], v[:, :, -2048:])}).items()}
    print(f"A window of 2,048 keys over 64K takes {ms['window'] / ms['cache']:.2f}x the"
          " time of a 2,048-key cache (aim: about 1x).")


def check_append_to_pages(fn):
    """fn(k_pages, v_pages, block_table, lengths, k_new, v_new) on fresh pools."""
    gen, names = kit.fresh_generator(), ("block_table", "lengths", "k_new", "v_new")
    for page, dtype in ((16, torch.float16), (32, torch.bfloat16)):
        lengths = torch.tensor([0, page - 1, page, 2 * page + 5], device=DEVICE)[
            torch.randperm(4, generator=gen)]  # fmt: skip
        k, v, *new = (torch.randn(4, 2, *shape, generator=gen).to(DEVICE, dtype)
                      for shape in ((3 * page, 64),) * 2 + ((64,),) * 2)  # fmt: skip
        seed = int(torch.randint(2**62, (), generator=gen))
        *pools, table = paged_copy(k, v, page, torch.Generator().manual_seed(seed))
        for cache, token in zip((k, v), new):
            cache[torch.arange(4), :, lengths] = token
        expected = paged_copy(k, v, page, torch.Generator().manual_seed(seed))
        case = f"pages of {page}, {str(dtype)[6:]}, lengths {lengths.tolist()}"
        given = (table, lengths, *new)
        before = [t.clone() for t in given]
        fn(*pools, *given)
        for name, got, want in zip(("k_pages", "v_pages"), pools, expected):
            kit.expect_close("append_to_pages", case, name, got, want, dtype, 0, 0)
        for name, old, now in zip(names, before, given):
            kit.expect_unchanged("append_to_pages", case, name, old, now)
    print("append_to_pages passed on 2 fresh shuffled pools (pages of 16 and 32, fp16 "
          "and bf16, tokens that open a page and that close one).")
