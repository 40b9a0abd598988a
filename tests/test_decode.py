"""Lesson 08's decode attention (split-KV, GQA, ragged lengths, a paged cache) against float64 on fresh random
inputs at irregular shapes, its refusals of bad input, validate=False, the rule that picks the number of splits,
the functions that read the benchmark's numbers, and the checks of its exercises (with the solutions, which the
page leaves out, and realistic mistakes each check must reject).

Under the interpreter the kernels run on 16-key tiles, with chunks of at least 32 keys on a pretend GPU of 4 SMs,
so that these small shapes run many tiles and several splits."""

import math

import pytest
import torch
from lessons import load

L08 = load("08-decode-attention")
kit = L08.kit
DEVICE = L08.DEVICE
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOLERANCE)


def randn(shape, dtype, rng):
    return torch.randn(shape, generator=rng).to(DEVICE, dtype)


def gather_pages(pages, block_table, lengths):
    """The contiguous (B, Hkv, max_pages * page_size, D) cache of a paged one, written independently of the lesson;
    the table's padding (past each length's last page) reads page 0."""
    page = pages.shape[1]
    needed = torch.arange(block_table.shape[1], device=pages.device) < (lengths[:, None] + page - 1) // page
    table = torch.where(needed, block_table, 0).long()
    return pages[table].flatten(1, 2).transpose(1, 2)


def reference(q, k, v, lengths=None, sm_scale=None):
    """The definition in float64, one sequence and query head at a time (independent of naive_decode)."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1:3]
    scale = D**-0.5 if sm_scale is None else sm_scale
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = L if lengths is None else int(lengths[b])
        for h in range(Hq):
            keys, values = k[b, h // (Hq // Hkv), :n].double().cpu(), v[b, h // (Hq // Hkv), :n].double().cpu()
            weights = torch.softmax(keys @ q[b, h].double().cpu() * scale, dim=0)
            out[b, h] = weights @ values
    return out


def assert_matches(got, expected, dtype):
    assert got.dtype == dtype and got.is_contiguous() and got.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double().cpu(), expected, rtol=tol, atol=tol)


def cache(B, Hkv, L, D, dtype, rng, layout):
    """A (B, Hkv, L, D) cache: contiguous, token-major (B, L, Hkv, D) transposed, a slice of a longer cache, or
    every other element of a wider head dim."""
    if layout == "contiguous":
        return randn((B, Hkv, L, D), dtype, rng)
    if layout == "token-major":
        return randn((B, L, Hkv, D), dtype, rng).transpose(1, 2)
    if layout == "slice of a longer cache":
        return randn((B, Hkv, L + 37, D), dtype, rng)[:, :, 5 : 5 + L]
    return randn((B, Hkv, L, 2 * D), dtype, rng)[..., ::2]  # head dim strided


# (B, Hq, Hkv, L, D): GQA ratios 1, 4 and 8, MQA, length 1, lengths no tile or chunk divides.
SHAPES = [(3, 4, 4, 77, 64), (2, 8, 2, 100, 64), (2, 16, 2, 45, 128), (3, 8, 1, 70, 64), (2, 4, 1, 1, 128),
          (1, 32, 8, 33, 64)]
LAYOUTS = ["contiguous", "token-major", "slice of a longer cache", "strided head dim"]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_contiguous_cache_matches_float64(shape, dtype, rng):
    B, Hq, Hkv, L, D = shape
    q = randn((B, Hq, D), dtype, rng)
    k, v = cache(B, Hkv, L, D, dtype, rng, "token-major"), cache(B, Hkv, L, D, dtype, rng, "contiguous")
    lengths = torch.randint(1, L + 1, (B,), generator=rng)
    lengths[0] = 1
    lengths[-1] = L
    assert_matches(L08.decode_attention(q, k, v, lengths.to(DEVICE)), reference(q, k, v, lengths), dtype)
    assert_matches(L08.decode_attention(q, k, v), reference(q, k, v), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_any_strides_and_either_index_dtype(layout, index_dtype, rng):
    B, Hq, Hkv, L, D, dtype = 3, 8, 2, 53, 64, torch.float16
    q = randn((B, Hq, 3 * D), dtype, rng)[:, :, D : 2 * D]  # q strided too
    k, v = cache(B, Hkv, L, D, dtype, rng, layout), cache(B, Hkv, L, D, dtype, rng, layout)
    lengths = torch.tensor([L, 1, 20], dtype=index_dtype)
    assert_matches(L08.decode_attention(q, k, v, lengths.to(DEVICE)), reference(q, k, v, lengths), dtype)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_number_of_splits(splits, dtype, rng):
    """One split (no merge), splits whose last chunk is ragged, and more splits asked for than tiles exist; with
    lengths ending inside, at and before chunks (chunks past a length are skipped)."""
    B, Hq, Hkv, L, D = 4, 8, 2, 100, 64
    q, k, v = randn((B, Hq, D), dtype, rng), randn((B, Hkv, L, D), dtype, rng), randn((B, Hkv, L, D), dtype, rng)
    lengths = torch.tensor([1, 16, 17, 100])
    got = L08._launch(q, k, v, lengths.to(DEVICE), None, D**-0.5, splits)
    assert_matches(got, reference(q, k, v, lengths), dtype)


@pytest.mark.parametrize("sm_scale", [0.3, -0.7, 2.0, 0.0, 3])
def test_any_finite_scale(sm_scale, rng):
    q, k, v = randn((2, 4, 64), torch.float16, rng), randn((2, 2, 40, 64), torch.float16, rng), randn(
        (2, 2, 40, 64), torch.float16, rng)
    got = L08.decode_attention(q, k, v, sm_scale=sm_scale)
    assert_matches(got, reference(q, k, v, sm_scale=sm_scale), torch.float16)


def test_negated_views_are_read_as_their_values(rng):
    q, k, v = randn((2, 4, 64), torch.float16, rng), randn((2, 2, 40, 64), torch.float16, rng), randn(
        (2, 2, 40, 64), torch.float16, rng)
    got = L08.decode_attention(torch._neg_view(q), k, torch._neg_view(v))
    assert_matches(got, reference(-q, k, -v), torch.float16)


def paged(B, Hq, Hkv, D, page, lengths, dtype, rng, table_dtype=torch.int32, spare_pages=3):
    """q, pools of shuffled pages (and spare pages nobody owns), a block table padded past each sequence's pages
    with garbage (-1 and huge indices, which must never be read), and lengths."""
    needed = [math.ceil(n / page) for n in lengths]
    max_pages = max(needed) + 2
    num_pages = sum(needed) + spare_pages
    k_pages, v_pages = randn((num_pages, page, Hkv, D), dtype, rng), randn((num_pages, page, Hkv, D), dtype, rng)
    order = torch.randperm(num_pages, generator=rng)
    table = torch.full((B, max_pages), -1, dtype=table_dtype)
    table[:, -1] = 10**6
    start = 0
    for b, count in enumerate(needed):
        table[b, :count] = order[start : start + count]
        start += count
    return randn((B, Hq, D), dtype, rng), k_pages, v_pages, table.to(DEVICE), torch.tensor(lengths).to(DEVICE)


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)], ids=["gqa4", "mha", "mqa"])
def test_paged_cache_matches_float64(page, dtype, heads, rng):
    Hq, Hkv = heads
    lengths = [1, 37, 2 * page, 2 * page + 1]  # no page divides 37; a length ending on a page boundary
    q, k_pages, v_pages, table, lens = paged(4, Hq, Hkv, 64, page, lengths, dtype, rng)
    got = L08.paged_decode_attention(q, k_pages, v_pages, table, lens)
    k, v = gather_pages(k_pages, table, lens), gather_pages(v_pages, table, lens)
    assert_matches(got, reference(q, k, v, lens), dtype)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_paged_equals_contiguous_on_the_same_values(splits, rng, monkeypatch):
    """The page lookup changes addresses only: in the same tiles, the same arithmetic
    and the same bits."""
    paged_tiles = L08.launch_config(128, 16)
    monkeypatch.setattr(L08, "launch_config", lambda D, page: paged_tiles)
    q, k_pages, v_pages, table, lens = paged(3, 8, 2, 128, 16, [5, 60, 93], torch.bfloat16, rng,
                                             table_dtype=torch.int64)
    k, v = gather_pages(k_pages, table, lens), gather_pages(v_pages, table, lens)
    paged_out = L08._launch(q, k_pages, v_pages, lens, table, 0.125, splits)
    assert torch.equal(paged_out, L08._launch(q, k, v, lens, None, 0.125, splits))


def test_strided_pools(rng):
    """Pools that are views: the heads of a wider pool, K and V interleaved in one tensor."""
    lengths = [20, 47]
    q, _, _, table, lens = paged(2, 4, 2, 64, 16, lengths, torch.float16, rng)
    both = randn((8, 16, 4, 2, 64), torch.float16, rng)  # pages, slots, 4 heads, (k, v), D
    k_pages, v_pages = both[:, :, 1:3, 0], both[:, :, 1:3, 1]
    table = torch.tensor([[3, 0, -1, -1], [7, 1, 5, -1]], device=DEVICE)
    got = L08.paged_decode_attention(q, k_pages, v_pages, table, lens)
    k, v = gather_pages(k_pages, table, lens), gather_pages(v_pages, table, lens)
    assert_matches(got, reference(q, k, v, lens), torch.float16)


def test_offsets_past_2_31_elements(rng):
    """Sequences and pages 2**30 + 64 elements apart (a stride that fits in 32 bits), the third starting past 2**31
    elements, over one mostly untouched allocation: offsets computed in 32 bits would wrap there."""
    L, D, apart = 40, 64, 2**30 + 64
    storage = torch.empty(2 * apart + 2 * L * D, dtype=torch.float16, device=DEVICE)
    for start in (0, apart, 2 * apart):
        storage[start : start + 2 * L * D] = torch.randn(2 * L * D, generator=rng).to(torch.float16)
    k = storage.as_strided((3, 1, L, D), (apart, L * D, D, 1))
    v = storage.as_strided((3, 1, L, D), (apart, L * D, D, 1), storage_offset=L * D)
    q = randn((3, 4, D), torch.float16, rng)
    assert_matches(L08.decode_attention(q, k, v), reference(q, k, v), torch.float16)
    k_pages, v_pages = k.transpose(1, 2)[:, :32], v.transpose(1, 2)[:, :32]  # three pages of 32 tokens
    table = torch.tensor([[2], [0], [1]], dtype=torch.int32, device=DEVICE)  # int32 pages, times a stride
    lens = torch.tensor([32, 32, 32], device=DEVICE)
    got = L08.paged_decode_attention(q, k_pages, v_pages, table, lens)
    assert_matches(got, reference(q, k[[2, 0, 1], :, :32], v[[2, 0, 1], :, :32]), torch.float16)


# -- Bad input ---------------------------------------------------------------------------------------------------

def good(dtype=torch.float16):
    return [torch.randn(2, 8, 64, dtype=dtype, device=DEVICE), torch.randn(2, 2, 30, 64, dtype=dtype, device=DEVICE),
            torch.randn(2, 2, 30, 64, dtype=dtype, device=DEVICE)]


def swap(i, value, args=None):
    args = good() if args is None else args
    args[i] = value
    return args


def lengths(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


CONTIGUOUS_BAD = [
    ("q not a tensor", lambda: (swap(0, [[0.0]]), {}), TypeError, "q must be a torch.Tensor"),
    ("q of 4 dims", lambda: (swap(0, torch.randn(2, 8, 1, 64, dtype=torch.float16)), {}), ValueError, "3 dim"),
    ("k of 3 dims", lambda: (swap(1, torch.randn(2, 30, 64, dtype=torch.float16)), {}), ValueError, "4 dim"),
    ("fp32", lambda: (good(torch.float32), {}), TypeError, "float16 or all bfloat16"),
    ("mixed dtypes", lambda: (swap(2, torch.randn(2, 2, 30, 64, dtype=torch.bfloat16)), {}), TypeError,
     "float16 or all bfloat16"),
    ("head dim 32", lambda: ([torch.randn(*s, 32, dtype=torch.float16) for s in ((2, 8), (2, 2, 30), (2, 2, 30))],
                             {}), ValueError, "head dims"),
    ("mismatched head dims", lambda: (swap(1, torch.randn(2, 2, 30, 128, dtype=torch.float16)), {}), ValueError,
     "head dims"),
    ("k and v shapes", lambda: (swap(2, torch.randn(2, 2, 31, 64, dtype=torch.float16)), {}), ValueError,
     "one shape"),
    ("heads do not divide", lambda: (swap(0, torch.randn(2, 7, 64, dtype=torch.float16)), {}), ValueError,
     "heads do not divide"),
    ("batch", lambda: (swap(0, torch.randn(3, 8, 64, dtype=torch.float16)), {}), ValueError, "sequences"),
    ("empty cache", lambda: ([torch.randn(2, 8, 64, dtype=torch.float16)] + [torch.randn(2, 2, 0, 64,
                             dtype=torch.float16)] * 2, {}), ValueError, "empty"),
    ("k on another device", lambda: (swap(1, torch.randn(2, 2, 30, 64, dtype=torch.float16, device="meta")), {}),
     ValueError, "device"),
    ("lengths not a tensor", lambda: (good(), {"lengths": [30, 30]}), TypeError, "lengths must be a torch.Tensor"),
    ("float lengths", lambda: (good(), {"lengths": lengths(30, 30).float()}), TypeError, "int32 or int64"),
    ("lengths of 2 dims", lambda: (good(), {"lengths": lengths(30, 30)[None]}), ValueError, "1 dim"),
    ("lengths too short", lambda: (good(), {"lengths": lengths(30)}), ValueError, r"shape \(2\)"),
    ("lengths on another device", lambda: (good(), {"lengths": lengths(30, 30).to("meta")}), ValueError, "device"),
    ("a length of 0", lambda: (good(), {"lengths": lengths(30, 0)}), ValueError, r"lengths\[1\] is 0"),
    ("a negative length", lambda: (good(), {"lengths": lengths(-2, 3, dtype=torch.int64)}), ValueError,
     r"lengths\[0\] is -2"),
    ("a length past the cache", lambda: (good(), {"lengths": lengths(31, 30)}), ValueError,
     r"lengths\[0\] is 31: a length must be 1 to 30"),
    ("nan scale", lambda: (good(), {"sm_scale": float("nan")}), TypeError, "sm_scale"),
    ("bool scale", lambda: (good(), {"sm_scale": True}), TypeError, "sm_scale"),
    ("text scale", lambda: (good(), {"sm_scale": "0.1"}), TypeError, "sm_scale"),
    ("huge scale", lambda: (good(), {"sm_scale": 1e300}), ValueError, "sm_scale"),
    ("validate not a bool", lambda: (good(), {"validate": "no"}), TypeError, "validate"),
]


@pytest.mark.parametrize("make, error, message", [c[1:] for c in CONTIGUOUS_BAD], ids=[c[0] for c in CONTIGUOUS_BAD])
def test_decode_attention_refuses_bad_input_clearly(make, error, message):
    args, kwargs = make()
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) and a.device.type != "meta" else a for a in args]
    with pytest.raises(error, match=message):
        L08.decode_attention(*args, **kwargs)


def paged_good(page=16, num_pages=6):
    q = torch.randn(2, 8, 64, dtype=torch.float16, device=DEVICE)
    k_pages, v_pages = (torch.randn(num_pages, page, 2, 64, dtype=torch.float16, device=DEVICE) for _ in "kv")
    table = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32, device=DEVICE)
    return [q, k_pages, v_pages, table, lengths(40, 20)]


PAGED_BAD = [
    ("page size 8", lambda: paged_good(page=8), ValueError, "power of two of at least 16"),
    ("page size 24", lambda: paged_good(page=24), ValueError, "power of two of at least 16"),
    ("float table", lambda: swap(3, torch.zeros(2, 3, device=DEVICE), paged_good()), TypeError, "int32 or int64"),
    ("table not a tensor", lambda: swap(3, [[0, 1, 2], [3, 4, 5]], paged_good()), TypeError,
     "block_table must be a torch.Tensor"),
    ("table of another batch", lambda: swap(3, torch.zeros(3, 3, dtype=torch.int32, device=DEVICE), paged_good()),
     ValueError, r"block_table must have shape \(2, any\)"),
    ("table with no pages", lambda: swap(3, torch.zeros(2, 0, dtype=torch.int32, device=DEVICE), paged_good()),
     ValueError, "block_table must have shape"),
    ("lengths None", lambda: swap(4, None, paged_good()), TypeError, "lengths must be a torch.Tensor"),
    ("a length of 0", lambda: swap(4, lengths(0, 20), paged_good()), ValueError, r"lengths\[0\] is 0"),
    ("a length past the pages", lambda: swap(4, lengths(40, 49), paged_good()), ValueError,
     r"lengths\[1\] is 49: a length must be 1 to 48"),
    ("a page index past the pool", lambda: swap(3, torch.tensor([[0, 1, 6], [3, 4, -1]], device=DEVICE),
                                                paged_good()), ValueError, r"block_table\[0, 2\] is 6"),
    ("a negative page index", lambda: swap(3, torch.tensor([[0, 1, 2], [-1, 4, 5]], device=DEVICE), paged_good()),
     ValueError, r"block_table\[1, 0\] is -1"),
    ("heads do not divide", lambda: swap(0, torch.randn(2, 5, 64, dtype=torch.float16, device=DEVICE),
                                         paged_good()), ValueError, "heads do not divide"),
    ("mixed dtypes", lambda: swap(2, torch.randn(6, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE), paged_good()),
     TypeError, "float16 or all bfloat16"),
    ("pool of 3 dims", lambda: swap(1, torch.randn(6, 16, 64, dtype=torch.float16, device=DEVICE), paged_good()),
     ValueError, "k_pages must have 4 dim"),
]


@pytest.mark.parametrize("make, error, message", [c[1:] for c in PAGED_BAD], ids=[c[0] for c in PAGED_BAD])
def test_paged_decode_attention_refuses_bad_input_clearly(make, error, message):
    with pytest.raises(error, match=message):
        L08.paged_decode_attention(*make())


def test_padding_past_a_sequences_pages_is_never_checked_or_read(rng):
    """Only the first ceil(length / page) entries of a table row count: servers pad the rest with anything."""
    q, k_pages, v_pages, table, lens = paged_good()  # row 1 needs 2 pages (length 20), and says -1 after them
    expected = L08.paged_decode_attention(q, k_pages, v_pages, table, lens)
    for padding in (10**9, 0, 5):
        table[1, 2] = padding
        assert torch.equal(L08.paged_decode_attention(q, k_pages, v_pages, table, lens), expected)


# -- validate=False ----------------------------------------------------------------------------------------------

def test_validate_false_reads_no_values_on_the_host(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("validate=False must not read lengths or page indices on the host")

    monkeypatch.setattr(L08, "_check_values", refuse)
    q, k, v = good()
    L08.decode_attention(q, k, v, lengths(30, 2), validate=False)
    L08.paged_decode_attention(*paged_good(), validate=False)
    with pytest.raises(AssertionError, match="host"):
        L08.decode_attention(q, k, v, lengths(30, 2))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's NaN, on purpose
@pytest.mark.parametrize("splits", [1, 3])
def test_validate_false_keeps_its_promises(splits, rng):
    """Unchecked bad values: NaN for a length of 0, a length past the cache cut at the cache, a page index out of
    range clamped into the pool (never a read outside the tensors); the other sequences stay right."""
    q, k, v = randn((3, 4, 64), torch.float16, rng), randn((3, 2, 40, 64), torch.float16, rng), randn(
        (3, 2, 40, 64), torch.float16, rng)
    got = L08._launch(q, k, v, lengths(0, 41, 7), None, 0.125, splits)
    assert got[0].isnan().all()
    full = L08._launch(q, k, v, lengths(1, 40, 7), None, 0.125, splits)
    torch.testing.assert_close(got[1:], full[1:], rtol=0, atol=0)
    q, k_pages, v_pages, table, lens = paged(2, 4, 2, 64, 16, [20, 33], torch.float16, rng)
    table[1, :3] = torch.tensor([-5, 10**6, 2**40 if table.dtype == torch.int64 else 2**30])
    got = L08.paged_decode_attention(q, k_pages, v_pages, table, lens, validate=False)
    assert got.isfinite().all()
    torch.testing.assert_close(got[:1], L08.paged_decode_attention(q[:1], k_pages, v_pages, table[:1], lens[:1]))


# -- How many splits ---------------------------------------------------------------------------------------------

@pytest.fixture
def gpu_rule(monkeypatch):
    """The rule's constants as on a GPU, whatever runs the tests."""
    monkeypatch.setattr(L08, "MIN_CHUNK", 256)
    monkeypatch.setattr(L08, "MAX_SPLITS", 64)


@pytest.mark.parametrize("programs, length, sms, block_n, splits, expected", [
    (8, 4096, 132, 64, None, (16, 256)),  # B = 1, Hkv = 8: chunks of MIN_CHUNK
    (8, 65536, 132, 64, None, (16, 4096)),  # one program per SM, rounded down
    (64, 16384, 132, 128, None, (2, 8192)),  # B = 8: 128 programs, not 192
    (1, 65536, 132, 64, None, (64, 1024)),  # MQA at B = 1: capped at MAX_SPLITS
    (256, 4096, 132, 64, None, (1, 4096)),  # B = 32: already more programs than SMs
    (1024, 4096, 132, 64, None, (1, 4096)),  # enough programs without splitting
    (8, 100, 132, 64, None, (1, 128)),  # shorter than one chunk: one split, one ragged tile
    (8, 1000, 132, 64, None, (3, 384)),
    (8, 100, 132, 16, 7, (7, 16)),  # forced
    (8, 100, 132, 16, 64, (7, 16)),  # more than there are tiles: fewer
])
def test_choose_splits_on_made_up_cases(gpu_rule, programs, length, sms, block_n, splits, expected):
    assert L08.choose_splits(programs, length, sms, block_n, splits) == expected


def test_choose_splits_asks_paged_caches_for_more_programs(gpu_rule):
    per_sm = L08.launch_config(128, 16)[3] if L08.kit.ON_GPU else 4
    assert L08.choose_splits(64, 16384, 132, 64, per_sm=per_sm) == (8, 2048)  # B = 8
    assert L08.choose_splits(8, 65536, 132, 64, per_sm=per_sm) == (64, 1024)  # B = 1: capped


def test_choose_splits_covers_every_key_in_whole_tiles(gpu_rule):
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        programs, length, sms = (int(torch.randint(1, high, (), generator=gen)) for high in (2000, 200_000, 200))
        block_n = 2 ** int(torch.randint(4, 8, (), generator=gen))
        splits, chunk = L08.choose_splits(programs, length, sms, block_n)
        assert chunk % block_n == 0 and 1 <= splits <= 64
        assert (splits - 1) * chunk < length <= splits * chunk
        assert splits == 1 or chunk >= min(256, block_n * math.ceil(256 / block_n)) or length < 512


# -- Reading the numbers -----------------------------------------------------------------------------------------

def made_up_table(rows):
    """GB/s by (B, L): rows of (B, L, ours, cuDNN, flash, copy)."""
    import pandas as pd

    frame = pd.DataFrame(rows, columns=["B", "L", L08.OURS, "SDPA cuDNN", "SDPA flash", kit.SAME_BYTES])
    return frame.set_index(["B", "L"])


def test_target_misses_names_each_missed_target():
    table = made_up_table([
        (1, 1024, 100, 800, 700, 1000),  # short: no target
        (1, 4096, 1700, 1600, 1500, 2000),  # above the best SDPA: met
        (1, 16384, 2000, 2100, 1900, 2500),  # below SDPA, and 80% of the copy
        (8, 131072, 2950, 3000, 2900, 3000),  # SDPA at the copy: 0.98x of it is enough
        (32, 131072, 2900, 3000, 2900, 3000),  # 0.967x: missed
    ])
    misses = L08.target_misses(table, ["SDPA cuDNN", "SDPA flash"])
    assert misses == [
        "B = 1, L = 16384: 0.95x the best SDPA backend, below the 1.00x targeted",
        "B = 1, L = 16384: 80% of the copy, below 90%",
        "B = 32, L = 131072: 0.97x the best SDPA backend, below the 0.98x targeted",
    ]


def test_closing_table_gives_ratios_and_microseconds():
    gpu = made_up_table([(1, 4096, 2000, 1000, 500, 2500)])
    b2b = made_up_table([(1, 4096, 500, 400, 500, 2500)])
    table = L08.closing_table(gpu, b2b, ["SDPA cuDNN", "SDPA flash"])
    row = table.loc[(1, 4096)]
    assert row["x best SDPA, GPU time"] == "2.00" and row["x copy, GPU time"] == "0.800"  # 3 figures, zeros too
    assert row["x best SDPA, back to back"] == "1.00" and row["x copy, back to back"] == "0.200"
    microseconds = L08.cache_bytes(1, 4096) / 2000 * 1e-3  # GB/s is bytes per microsecond over 1e3
    assert row["µs per step, GPU time"] == f"{microseconds:,.1f}"
    assert row["µs per step, back to back"] == f"{4 * microseconds:,.1f}"


def test_closing_table_under_the_interpreter_has_one_timing_and_shows_tiny_ratios():
    """The interpreter's one table (gpu is b2b): one set of columns, named for the wall clock and for SDPA math,
    and ratios thousands of times below 1 in significant figures, never 0.0."""
    table = made_up_table([(1, 256, 0.00109, 2.4, 2.0, 103.0)])
    closing = L08.closing_table(table, table, ["SDPA cuDNN"])
    assert list(closing.columns) == ["x SDPA cuDNN, wall clock", "x copy, wall clock", "µs per step, wall clock"]
    row = closing.loc[(1, 256)]
    assert row["x SDPA cuDNN, wall clock"] == "0.000454" and row["x copy, wall clock"] == "1.06e-05"
    assert row["µs per step, wall clock"] == f"{L08.cache_bytes(1, 256) * 1e-3 / 0.00109:,.1f}"


def test_splits_verdict():
    import pandas as pd

    curve = pd.DataFrame({4096: [500.0, 1000.0, 2000.0, 1900.0]}, index=pd.Index([1, 2, 4, 8], name="splits"))
    expected = "L = 4096: the rule's 8 splits reach 95% of the best measured (splits = 4, 2000 GB/s); one split 25%"
    assert L08.splits_verdict(curve, {4096: 8}, on_gpu=False) == [expected]  # within 5%: nothing to explain
    assert L08.splits_verdict(curve, {4096: 8}, on_gpu=True) == [expected]


def test_splits_verdict_says_why_the_rule_loses_under_the_interpreter_only():
    import pandas as pd

    curve = pd.DataFrame({256: [0.0018, 0.0015, 0.0013, 0.0011]}, index=pd.Index([1, 2, 4, 8], name="splits"))
    numbers = "L = 256: the rule's 8 splits reach 61% of the best measured (splits = 1, 0.0018 GB/s); one split 100%"
    on_gpu = L08.splits_verdict(curve, {256: 8}, on_gpu=True)
    assert on_gpu == [numbers]
    interpreted = L08.splits_verdict(curve, {256: 8}, on_gpu=False)
    assert interpreted[0].startswith(numbers) and "one after another" in interpreted[0]
    assert "merge work" in interpreted[0] and "not a GPU's verdict" in interpreted[0]
    more = pd.DataFrame({256: [0.001, 0.0015, 0.0013, 0.0018]}, index=pd.Index([1, 2, 4, 8], name="splits"))
    assert L08.splits_verdict(more, {256: 2}, on_gpu=False) == [  # the best has more splits: no such cause
        "L = 256: the rule's 2 splits reach 83% of the best measured (splits = 8, 0.0018 GB/s); one split 56%"]


def test_peers_note_names_the_peers_that_ran_and_why_others_did_not():
    cpu = [L08.OURS, "SDPA math", L08.NAIVE, kit.SAME_BYTES]
    assert L08.peers_note(cpu, on_gpu=False) == (
        "Peers timed in this build: SDPA math, naive PyTorch, copy of the same bytes. Not timed: SDPA cuDNN, "
        "SDPA flash, FlexAttention, which need a GPU.")
    gpu = [L08.OURS, "SDPA cuDNN", "SDPA flash", kit.FLEX, L08.NAIVE, kit.SAME_BYTES]
    assert L08.peers_note(gpu, on_gpu=True) == (
        "Peers timed in this build: SDPA cuDNN, SDPA flash, FlexAttention, naive PyTorch, copy of the same bytes.")
    assert L08.peers_note(gpu[:3] + gpu[4:], on_gpu=True).endswith(
        "Not timed: FlexAttention, which this GPU or PyTorch lacks.")


def test_page_verdict():
    import pandas as pd

    index = pd.MultiIndex.from_tuples([(16384, 16), (16384, 256), (65536, 16)], names=["L", "page"])
    for on_gpu in (True, False):  # within 5%: the same sentence everywhere
        assert L08.page_verdict(pd.Series([0.99, 1.01, 0.97], index=index), on_gpu) == (
            "Paged over contiguous: 0.97x to 1.01x; within 5% everywhere.")
    slower = "Paged over contiguous: 0.90x to 1.00x; more than 5% slower at L = 16384 in pages of 16 (0.90x)."
    assert L08.page_verdict(pd.Series([0.90, 1.0, 0.97], index=index), on_gpu=True) == slower
    interpreted = L08.page_verdict(pd.Series([0.90, 1.0, 0.97], index=index), on_gpu=False)
    assert interpreted.startswith(slower) and "per operation" in interpreted and "not a GPU's verdict" in interpreted


def test_the_diagram_draws():
    import matplotlib

    matplotlib.use("Agg")
    fig = L08.kit.draw_decode_layout()
    assert len(fig.axes) == 2
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_paged_copy_round_trips(rng):
    k, v = randn((2, 3, 37, 64), torch.float16, rng), randn((2, 3, 37, 64), torch.float16, rng)
    k_pages, v_pages, table = L08.paged_copy(k, v, 16, rng)
    full = torch.tensor([37, 37], device=DEVICE)
    assert torch.equal(gather_pages(k_pages, table, full)[:, :, :37], k)
    assert torch.equal(gather_pages(v_pages, table, full)[:, :, :37], v)


# -- Exercise 1: a sliding window --------------------------------------------------------------------------------

def window_solution(q, k, v, lengths, window, *, extra=0, from_start=False, ignore_lengths=False):
    """A right answer in PyTorch (the page has none), or a mistake: one key too many (extra=1), the first window
    keys instead of the last, or the last keys of the cache instead of the sequence."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1:3]
    out = torch.empty(B, Hq, D, dtype=torch.float32)
    for b in range(B):
        end = L if ignore_lengths else int(lengths[b])
        start = 0 if from_start else max(0, end - window - extra)
        stop = min(end, window) if from_start else end
        for h in range(Hq):
            keys = k[b, h // (Hq // Hkv), start:stop].float().cpu()
            weights = torch.softmax(keys @ q[b, h].float().cpu() * D**-0.5, dim=0)
            out[b, h] = weights @ v[b, h // (Hq // Hkv), start:stop].float().cpu()
    return out.to(q.dtype).to(q.device)


def test_window_check_accepts_a_right_answer(capsys):
    L08.check_window_decode(window_solution)
    assert "window_decode_attention passed" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", [
    dict(extra=1), dict(from_start=True), dict(ignore_lengths=True)], ids=["one key too many", "first keys",
                                                                           "last keys of the cache"])
def test_window_check_rejects_mistakes(mistake):
    with pytest.raises(AssertionError, match="window_decode_attention on"):
        L08.check_window_decode(lambda *args: window_solution(*args, **mistake))


def test_window_check_rejects_no_window_and_nan():
    with pytest.raises(AssertionError, match="window_decode_attention on"):
        L08.check_window_decode(lambda q, k, v, lengths, window: L08.decode_attention(q, k, v, lengths))
    with pytest.raises(AssertionError, match="window_decode_attention on"):
        L08.check_window_decode(lambda q, *rest: torch.full_like(q, math.nan))


# -- Exercise 2: appending the new token --------------------------------------------------------------------------

def append_solution(k_pages, v_pages, block_table, lengths, k_new, v_new, *, at=0, ignore_table=False,
                    slot_from_page=False, only_k=False):
    """A right answer in PyTorch, or a mistake: the token one slot off (at=-1), pages taken in order without the
    table, the slot computed as the page number, or only K written."""
    page = k_pages.shape[1]
    for b, n in enumerate((lengths + at).tolist()):
        index = b * block_table.shape[1] + n // page if ignore_table else int(block_table[b, n // page])
        slot = n // page if slot_from_page else n % page
        k_pages[index, slot] = k_new[b]
        if not only_k:
            v_pages[index, slot] = v_new[b]


def test_append_check_accepts_a_right_answer(capsys):
    L08.check_append_to_pages(append_solution)
    assert "append_to_pages passed" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", [dict(at=-1), dict(ignore_table=True), dict(slot_from_page=True),
                                     dict(only_k=True)], ids=["one slot early", "no table", "slot", "only k"])
def test_append_check_rejects_mistakes(mistake):
    with pytest.raises(AssertionError, match="append_to_pages on"):
        L08.check_append_to_pages(lambda *args: append_solution(*args, **mistake))


def test_append_check_rejects_changing_the_inputs():
    def advancing(k_pages, v_pages, block_table, lengths, k_new, v_new):
        append_solution(k_pages, v_pages, block_table, lengths, k_new, v_new)
        lengths += 1  # the server's job, after the step: not this function's

    with pytest.raises(AssertionError, match="changed its input lengths"):
        L08.check_append_to_pages(advancing)


def test_splits_verdict_never_says_100_percent_beside_another_count():
    import pandas as pd

    curve = pd.DataFrame({4096: [300.0, 1056.0, 1052.0]}, index=[1, 8, 16])
    line, = L08.splits_verdict(curve, {4096: 16}, on_gpu=True)
    assert "the rule's 16 splits reach 99.6% of the best measured (splits = 8, 1056 GB/s)" in line
    tie, = L08.splits_verdict(curve, {4096: 8}, on_gpu=True)
    assert "the rule's 8 splits reach 100% of the best measured (splits = 8" in tie
