"""Serving without a GPU: the paged cache's addressing (a NumPy model of the boxes the decode
kernel issues per K/V tile, against the contiguous caches the pages stand for), and the
validation of paged calls (page sizes, block tables, host data checked, nothing launched).

The kernels themselves run on the CPU emulator (tests/test_emulator_serving.py) and on the
H200 (tests/test_gpu_serving.py)."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeDLPack

from ptxattn import decode
from ptxattn.decode_builds import DECODE_BUILDS
from ptxattn.decode_reference import contiguous_from_pages, gather_tile, paged_tile_boxes
from ptxattn.reference import BF16

BASE = 0x7F00_0000_0000


# --------------------------------------------------------------------------- the page addressing

@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("d", sorted(DECODE_BUILDS))
def test_the_boxes_of_a_tile_are_the_contiguous_tile(page, d):
    """For shuffled tables and random lengths, every K/V tile the decode kernel loads from
    pages (decode_kv_address.ptxh's boxes, modelled integer for integer) equals the
    contiguous cache's rows below the length; the boxes tile the tile exactly once; no table
    index leaves the row; pages past the length are not read (page -1)."""
    block_n = DECODE_BUILDS[d].block_n
    rng = np.random.default_rng(page + d)
    max_pages = 1 + 600 // page
    B, hkv = 3, 2
    num_pages = B * max_pages + 2
    k_pages = rng.standard_normal((num_pages, page, hkv, d)).astype(BF16)
    v_pages = k_pages                                   # (the same addressing)
    table = np.full((B, max_pages), -1, np.int32)
    lengths = rng.integers(0, max_pages * page + 1, size=B)
    lengths[0] = max_pages * page                       # a full sequence
    pool = rng.permutation(num_pages)
    for b in range(B):
        n = -(-lengths[b] // page)
        table[b, :n] = pool[b * max_pages:b * max_pages + n]
    kc, _ = contiguous_from_pages(k_pages, v_pages, table, lengths)
    for b in range(B):
        for tile in range(-(-int(lengths[b]) // block_n)):
            key_base = tile * block_n
            boxes = paged_tile_boxes(key_base, int(lengths[b]), table[b], page, block_n, d)
            assert len(boxes) == (1 if page >= block_n else (block_n // page) * (d // 64))
            for box in boxes:
                first_key = key_base + box["tile_row"]
                assert (box["page"] == -1) == (first_key >= lengths[b]), box
            for h in range(hkv):
                got = gather_tile(k_pages, boxes, h, block_n)
                live = min(block_n, int(lengths[b]) - key_base)
                want = kc[b, key_base:key_base + live, h].astype(np.float64)
                np.testing.assert_array_equal(got[:live], want)


def test_a_table_index_never_leaves_the_row():
    """The clamp: a tile that would need a page past max_pages (a length longer than the
    table) reads entry max_pages - 1, never the next row."""
    row = np.array([5, 6, 7], np.int32)
    boxes = paged_tile_boxes(key_base=256, seq_len=10**6, table_row=row, page_size=16,
                             block_n=128, head_dim=64)
    assert {b["page"] for b in boxes} == {7}


def test_contiguous_from_pages_reads_bad_entries_as_zeros():
    k = np.ones((2, 16, 1, 64), BF16)
    table = np.array([[0, 9, -1]], np.int32)
    kc, _ = contiguous_from_pages(k, k, table, [40])
    assert (kc[0, :16] == 1).all() and (kc[0, 16:] == 0).all()


# --------------------------------------------------------------------------- validation

def _paged(B=2, Lq=1, H=8, Hkv=2, D=128, page=64, num_pages=10, max_pages=4, new=0,
           table_dtype="int32", table_shape=None):
    q = FakeDLPack((B, Lq, H, D), ptr=BASE)
    kc = FakeDLPack((num_pages, page, Hkv, D), ptr=BASE + (1 << 32))
    vc = FakeDLPack((num_pages, page, Hkv, D), ptr=BASE + (2 << 32))
    table = FakeDLPack(table_shape or (B, max_pages), ptr=BASE + (3 << 32), dtype=table_dtype)
    extra = {}
    if new:
        extra = dict(k=FakeDLPack((B, new, Hkv, D), ptr=BASE + (4 << 32)),
                     v=FakeDLPack((B, new, Hkv, D), ptr=BASE + (5 << 32)))
    return q, kc, vc, table, extra


def test_a_paged_call_validates_without_the_driver(no_driver):
    q, kc, vc, table, extra = _paged(new=1)
    lens = FakeDLPack((2,), ptr=BASE + (6 << 32), dtype="int32")
    call = decode.validate(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True,
                           **extra)
    p = call.paging
    assert (p.kind, p.page_size, p.num_pages, p.max_pages, p.row_stride, p.ptr) == (
        "device", 64, 10, 4, 4, BASE + (3 << 32))
    assert call.cache_len == 4 * 64 == p.capacity and p.page_shift == 6
    assert (call.batch, call.heads_kv, call.seq_new) == (2, 2, 1)


def test_a_strided_table_row_is_taken(no_driver):
    """transformers passes block_table[group] of a (groups, B, max_blocks) tensor sliced to
    the batch: rows further apart than their width."""
    q, kc, vc, _, _ = _paged()
    table = FakeDLPack((2, 4), strides=(16, 1), ptr=BASE + (3 << 32), dtype="int32")
    assert decode.validate(q, kc, vc, block_table=table).paging.row_stride == 16


@pytest.mark.parametrize("page", [8, 24, 512])
def test_page_sizes_outside_16_to_256_or_not_powers_of_two(no_driver, page):
    q, kc, vc, table, _ = _paged(page=page)
    with pytest.raises(ValueError, match=rf"k_cache: page size {page} .* power of two from "
                                         "16 to 256"):
        decode.validate(q, kc, vc, block_table=table)


def test_block_table_errors_name_it(no_driver):
    q, kc, vc, _, _ = _paged()
    cases = [
        (_paged(table_dtype="float32")[3], TypeError, "block_table: expected dtype int32"),
        (_paged(table_shape=(3, 4))[3], ValueError, r"block_table: expected shape \(2, "),
        (_paged(table_shape=(2,))[3], ValueError, r"block_table: expected shape"),
        (_paged(table_shape=(2, 0))[3], ValueError, "no page"),
        (FakeDLPack((2, 4), strides=(1, 2), ptr=BASE, dtype="int32"), ValueError,
         "contiguous entries"),
        (7, TypeError, "block_table: expected an int32 array"),
    ]
    for table, kind, text in cases:
        with pytest.raises(kind, match=text):
            decode.validate(q, kc, vc, block_table=table)


def test_paged_caches_are_bshd_only(no_driver):
    q, kc, vc, table, _ = _paged()
    with pytest.raises(ValueError, match="layout: a paged cache"):
        decode.validate(q, kc, vc, block_table=table, layout="bhld")


def test_new_keys_must_fit_the_pages(no_driver):
    q, kc, vc, table, extra = _paged(page=16, max_pages=1, new=17)
    with pytest.raises(ValueError, match="k: 17 new keys do not fit 1 pages of 16"):
        decode.validate(q, kc, vc, cache_seqlens=np.array([0, 0], np.int32),
                        block_table=table, **extra)


def test_host_lengths_are_checked_against_the_pages(no_driver):
    q, kc, vc, table, _ = _paged()                     # capacity 4 * 64 = 256
    with pytest.raises(ValueError, match=r"cache_seqlens: sequence 1 has length 257, outside "
                                         r"\[0, 256\]"):
        decode.validate(q, kc, vc, cache_seqlens=np.array([3, 257], np.int32),
                        block_table=table)


def test_a_host_table_is_checked_within_the_reached_pages(no_driver):
    q, kc, vc, _, _ = _paged()                         # 10 pages of 64
    lengths = np.array([130, 64], np.int32)            # 3 pages, 1 page
    ok = np.array([[4, 0, 9, -1], [3, -1, 77, -5]], np.int32)   # garbage past the last page
    call = decode.validate(q, kc, vc, cache_seqlens=lengths, block_table=ok)
    assert call.paging.kind == "host" and call.paging.host is not None
    for bad, where in (([[4, 0, 10, -1], [3, -1, -1, -1]], "sequence 0's page 2"),
                       ([[4, 0, 9, -1], [-1, -1, -1, -1]], "sequence 1's page 0")):
        with pytest.raises(ValueError, match=rf"block_table: {where} .* outside \[0, 10\)"):
            decode.validate(q, kc, vc, cache_seqlens=lengths,
                            block_table=np.array(bad, np.int32))
    # with the lengths on the device nothing is known to be reached: the kernels clamp
    lens = FakeDLPack((2,), ptr=BASE + (6 << 32), dtype="int32")
    decode.validate(q, kc, vc, cache_seqlens=lens, block_table=np.full((2, 4), -9, np.int32))


def test_the_paged_map_box():
    from ptxattn.decode_plan import Paging
    for page, d, want in ((16, 128, (16, 1)), (32, 256, (32, 1)), (64, 256, (64, None)),
                          (128, 128, (128, None)), (256, 256, (64, None))):
        p = Paging("device", page_size=page, num_pages=1, max_pages=1)
        assert p.map_box(d, DECODE_BUILDS[d].block_n) == want


# --------------------------------------------------------------------------- varlen: the model

from ptxattn import varlen, varlen_plan  # noqa: E402


def _model(lens_q, lens_k, block_m=128, block_n=128, window=(-1, -1), seqused=None,
           room=None):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    return varlen_plan.tile_table(cu_q, cu_k, seqused, int(cu_q[-1]), int(cu_k[-1]), block_m,
                                  block_n, varlen_plan.window_params(window), room)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (100, 0), (30, 30)])
def test_the_tile_table_covers_every_row_once_and_sorts_longest_first(window):
    rng = np.random.default_rng(3)
    lens_q = rng.integers(0, 700, size=37)
    lens_q[:5] = (0, 1, 127, 128, 129)
    lens_k = lens_q + rng.integers(0, 300, size=37)          # chunked prefill: Lk >= Lq
    table = _model(lens_q, lens_k, window=window)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)])
    seen = np.zeros(cu_q[-1], np.int64)
    works = []
    for q_row, k0, q_end, seq_k in table:
        b = int(np.searchsorted(cu_q, q_row, side="right")) - 1
        assert q_end == cu_q[b + 1] and seq_k == lens_k[b], (b, q_row)
        seen[q_row:min(q_row + 128, q_end)] += 1
        r0 = q_row - cu_q[b]
        works.append(varlen_plan.block_work(r0, min(r0 + 128, lens_q[b]), lens_q[b], seq_k,
                                            varlen_plan.window_params(window), 128))
    assert (seen == 1).all(), "every q row of every sequence in exactly one tile"
    assert works == sorted(works, reverse=True), "most K/V tiles first"
    assert len(table) == sum(-(-lens_q // 128))


def test_block_work_counts_the_key_tiles_a_block_sees():
    # causal bottom-right, 1000 queries against 1000 keys: the block of rows 896..999 sees keys
    # 0..999 (8 tiles of 128), rows 0..127 keys 0..127 (1 tile)
    assert varlen_plan.block_work(896, 1000, 1000, 1000, (1 << 30, 0), 128) == 8
    assert varlen_plan.block_work(0, 128, 1000, 1000, (1 << 30, 0), 128) == 1
    # chunked prefill: 100 queries at the end of 4096 keys see every tile but none past
    assert varlen_plan.block_work(0, 100, 100, 4096, (1 << 30, 0), 128) == 32
    # no key at all: still the one fully masked tile
    assert varlen_plan.block_work(0, 5, 5, 0, (1 << 30, 1 << 30), 128) == 1


def test_the_table_is_cut_at_its_room_and_unsorted_past_sort_max():
    lens = [5000] * 3
    table = _model(lens, lens, room=10)
    assert len(table) == 10
    big = _model([128] * (varlen_plan.SORT_MAX + 1), [1] * (varlen_plan.SORT_MAX + 1))
    np.testing.assert_array_equal(big[:, 0], np.arange(varlen_plan.SORT_MAX + 1) * 128)


def test_sequence_spans_clamp_broken_offsets_into_the_tensors():
    spans = varlen_plan.sequence_spans([0, 200, 50, 10**6], [-5, 100, 90, 2**31 - 1], None,
                                       total_q=240, total_k=240)
    for q0, q1, k0, seq_k in spans:
        assert 0 <= q0 <= q1 <= 240 and 0 <= k0 and k0 + seq_k <= 240 and seq_k >= 0
    assert varlen_plan.sequence_spans([0, 3], [0, 9], [50], 3, 9)[0] == (0, 3, 0, 9)


def test_table_words_are_what_the_kernel_reads():
    table = np.array([[0, 0, 5, 7], [5, 7, 9, 1]], np.int64)
    words = varlen_plan.table_bytes(table, room=4)
    assert words[0] == 2 and list(words[4:12]) == [0, 0, 5, 7, 5, 7, 9, 1]
    assert words.nbytes == varlen_plan.TABLE_HEADER_BYTES + 16 * 4


# --------------------------------------------------------------------------- varlen: validation

def _varlen_args(lens_q=(3, 5), lens_k=None, H=8, Hkv=2, D=128, host=True):
    lens_k = lens_q if lens_k is None else lens_k
    tq, tk = sum(lens_q), sum(lens_k)
    q = FakeDLPack((tq, H, D), ptr=BASE)
    k = FakeDLPack((tk, Hkv, D), ptr=BASE + (1 << 32))
    v = FakeDLPack((tk, Hkv, D), ptr=BASE + (2 << 32))
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    if not host:
        cu_q = FakeDLPack((len(lens_q) + 1,), ptr=BASE + (3 << 32), dtype="int32")
        cu_k = FakeDLPack((len(lens_q) + 1,), ptr=BASE + (4 << 32), dtype="int32")
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def test_a_varlen_call_validates_without_the_driver(no_driver):
    call = varlen.validate(*_varlen_args(host=False), causal=True)
    assert (call.total_q, call.heads, call.head_dim, call.total_k, call.heads_kv,
            call.batch) == (8, 8, 128, 8, 2, 2)
    assert call.cu_q.kind == "device" and call.window == (-1, 0)
    assert call.max_entries == 2 + 1 and call.lse_shape == (8, 8)
    call = varlen.validate(*_varlen_args(), window_size=(4, 0))
    assert call.cu_q.kind == "host" and call.window == (4, 0)


@pytest.mark.parametrize("cu,text", [
    ([1, 3, 8], r"cu_seqlens_q: expected offsets starting at 0, got 1"),
    ([0, 5, 3], r"cu_seqlens_q: offsets must not decrease, but index 2 holds 3 after 5"),
    ([0, 3, 7], r"cu_seqlens_q: the last offset 7 does not match q's 8 rows"),
    ([0, 3, 9], r"cu_seqlens_q: the last offset 9 does not match q's 8 rows"),
])
def test_host_offsets_are_checked(no_driver, cu, text):
    q, k, v, _, cu_k, mq, mk = _varlen_args()
    with pytest.raises(ValueError, match=text):
        varlen.validate(q, k, v, np.array(cu, np.int32), cu_k, mq, mk)


def test_varlen_argument_errors_name_the_argument(no_driver):
    q, k, v, cu_q, cu_k, mq, mk = _varlen_args()
    cases = [
        (dict(cu_seqlens_q=cu_q.astype(np.int64)), TypeError, "cu_seqlens_q: expected dtype int32"),
        (dict(cu_seqlens_k=cu_k[:-1]), ValueError, r"cu_seqlens_k: expected 3 offsets"),
        (dict(cu_seqlens_k=np.array([0, 3, 9], np.int32)), ValueError,
         "cu_seqlens_k: the last offset 9 does not match k's 8 rows"),
        (dict(max_seqlen_q=4), ValueError, "max_seqlen_q: sequence 1 has 5 rows, above"),
        (dict(max_seqlen_k=2.5), TypeError, "max_seqlen_k: expected an int"),
        (dict(seqused_k=np.array([3, 6], np.int32)), ValueError,
         r"seqused_k: sequence 1 uses 6 keys"),
        (dict(seqused_k=np.array([3], np.int32)), ValueError, r"seqused_k: expected shape \(2,\)"),
        (dict(block_table=np.zeros((2, 4), np.int32)), ValueError,
         r"k: with block_table, expected a paged cache of rank 4"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(window_size=(3, 1), causal=True), ValueError, "window_size: causal=True"),
        (dict(return_lse=1), TypeError, "return_lse"),
    ]
    base = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                max_seqlen_k=mk)
    for over, kind, text in cases:
        with pytest.raises(kind, match=text):
            varlen.validate(**{**base, **over})


def test_varlen_shape_errors(no_driver):
    _, k, v, cu_q, cu_k, mq, mk = _varlen_args()
    cases = [
        (FakeDLPack((8, 8, 96), ptr=BASE), "k: head dim 128 does not match q's head dim 96"),
        (FakeDLPack((8, 7, 128), ptr=BASE), "k: 2 K/V heads do not divide q's 7 heads"),
        (FakeDLPack((1, 8, 8, 128), ptr=BASE), "q: expected a rank-3 array"),
    ]
    for q, text in cases:
        with pytest.raises(ValueError, match=text):
            varlen.validate(q, k, v, cu_q, cu_k, mq, mk)
    k96, v96 = (FakeDLPack((8, 2, 96), ptr=BASE + (i << 32)) for i in (1, 2))
    with pytest.raises(ValueError, match="q: head dim 96; flash_attn_varlen_func is built"):
        varlen.validate(FakeDLPack((8, 8, 96), ptr=BASE), k96, v96, cu_q, cu_k, mq, mk)
    q = FakeDLPack((8, 8, 128), ptr=BASE)
    with pytest.raises(ValueError, match="v: expected the same shape as k"):
        varlen.validate(q, k, FakeDLPack((8, 1, 128), ptr=BASE + (2 << 32)), cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="out: overlaps q"):
        varlen.validate(q, k, v, cu_q, cu_k, mq, mk, out=FakeDLPack((8, 8, 128), ptr=BASE))


def _paged_varlen_args(lens_q=(3, 5), lens_k=(40, 7), page=16, pages=8, max_pages=4, H=8,
                       Hkv=2, D=128):
    q = FakeDLPack((sum(lens_q), H, D), ptr=BASE)
    k = FakeDLPack((pages, page, Hkv, D), ptr=BASE + (1 << 32))
    v = FakeDLPack((pages, page, Hkv, D), ptr=BASE + (2 << 32))
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    table = np.full((len(lens_q), max_pages), -1, np.int32)
    table[0, :3], table[1, 0] = (5, 0, 7), 2
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k), block_table=table)


def test_a_paged_varlen_call_validates_without_the_driver(no_driver):
    """k, v are pages; cu_seqlens_k counts each sequence's own keys (no packed rows to end
    at); the record's keys are a table row's (paged_keys); -1 past a sequence's pages is
    fine."""
    call = varlen.validate(**_paged_varlen_args(), causal=True)
    assert call.paging.kind == "host" and call.paging.page_size == 16
    assert call.paged_keys == 4 * 16 and call.total_k == 8 * 16
    device = dict(_paged_varlen_args(), block_table=FakeDLPack((2, 4), ptr=BASE + (5 << 32),
                                                              dtype="int32"))
    assert varlen.validate(**device).paging.kind == "device"
    detached = varlen.detached(call)
    assert detached.paging.host is None and detached.paging.max_pages == 4
    with pytest.raises(ValueError, match="block_table: a plan"):
        varlen.validate(**_paged_varlen_args(), padded_ok=True)


def test_paged_varlen_errors_name_the_argument(no_driver):
    base = _paged_varlen_args()
    cases = [
        (dict(k=FakeDLPack((8, 24, 2, 128), ptr=BASE + (1 << 32)),
              v=FakeDLPack((8, 24, 2, 128), ptr=BASE + (2 << 32))), ValueError,
         r"k: page size 24 .* must be a power of two from 16 to 256"),
        (dict(k=FakeDLPack((8, 512, 2, 128), ptr=BASE + (1 << 32)),
              v=FakeDLPack((8, 512, 2, 128), ptr=BASE + (2 << 32))), ValueError,
         r"k: page size 512"),
        (dict(v=FakeDLPack((8, 16, 1, 128), ptr=BASE + (2 << 32))), ValueError,
         "v: expected the same shape as k"),
        (dict(block_table=np.zeros((3, 4), np.int32)), ValueError,
         r"block_table: expected shape \(2, "),
        (dict(block_table=np.zeros((2, 4), np.float32)), TypeError,
         "block_table: expected dtype int32"),
        # 70 keys need 5 pages of 16; the row holds 4
        (dict(cu_seqlens_k=np.array([0, 70, 77], np.int32), max_seqlen_k=70), ValueError,
         r"cu_seqlens_k: sequence 0 has 70 keys, more than its block_table row reaches "
         r"\(4 pages of 16 keys: 64\)"),
        (dict(seqused_k=np.array([3, 65], np.int32), max_seqlen_k=65), ValueError,
         r"seqused_k: sequence 1 has 65 keys, more than"),
        (dict(cu_seqlens_k=np.array([0, 40, 30], np.int32)), ValueError,
         "cu_seqlens_k: offsets must not decrease"),
    ]
    for over, kind, text in cases:
        with pytest.raises(kind, match=text):
            varlen.validate(**{**base, **over})
    # a host table's reached entries within the pool; entries past the pages not read
    for bad, where in (((0, 2), 8), ((1, 0), -1)):
        table = base["block_table"].copy()
        table[bad] = where
        with pytest.raises(ValueError, match=r"block_table: .* outside \[0, 8\)"):
            varlen.validate(**{**base, "block_table": table})
    table = base["block_table"].copy()
    table[0, 3], table[1, 1:] = 10**6, -5            # past both sequences' pages
    varlen.validate(**{**base, "block_table": table})


def test_paged_varlen_takes_no_key_offsets_with_seqused_k(no_driver):
    """vLLM's call: cu_seqlens_k=None, the counts from seqused_k (checked against the table
    row's reach as before); without seqused_k, or without block_table, None is refused."""
    base = dict(_paged_varlen_args(), cu_seqlens_k=None)
    call = varlen.validate(**base, seqused_k=np.array([40, 7], np.int32), causal=True)
    assert call.seqused_k.host.tolist() == [40, 7] and call.cu_k is call.cu_q
    with pytest.raises(ValueError, match=r"seqused_k: sequence 1 has 65 keys, more than"):
        varlen.validate(**{**base, "max_seqlen_k": 65}, seqused_k=np.array([3, 65], np.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k: None needs block_table= and seqused_k="):
        varlen.validate(**base)
    packed = dict(q=FakeDLPack((8, 8, 128), ptr=BASE),
                  k=FakeDLPack((47, 2, 128), ptr=BASE + (1 << 32)), v=FakeDLPack((47, 2, 128), ptr=BASE + (2 << 32)),
                  cu_seqlens_q=np.array([0, 3, 8], np.int32), cu_seqlens_k=None,
                  max_seqlen_q=5, max_seqlen_k=40, seqused_k=np.array([40, 7], np.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k: None needs block_table="):
        varlen.validate(**packed)


def test_the_paged_tile_table_model_names_the_sequence():
    cu_q = np.array([0, 130, 130, 131], np.int32)
    cu_k = np.array([0, 300, 310, 310], np.int32)
    table = varlen_plan.tile_table(cu_q, cu_k, None, 131, varlen_plan.PAGED_TOTAL_K, 128,
                                   128, (1 << 30, 0), paged_keys=256)
    # {q_row, k_start: the sequence, q_end, seq_k}: sequence 0's 300 keys clamped to the
    # row's 256; sequence 1 has no query; sequence 2 no key
    assert sorted(map(tuple, table.tolist())) == [(0, 0, 130, 256), (128, 0, 130, 256),
                                                 (130, 2, 131, 0)]


# --------------------------------------------------------------------------- varlen: the kernels

def _tiles_entry():
    import re
    text = varlen.tiles_source()
    m = re.search(r"\.entry ptxattn_varlen_tiles\((.*?)\)\s*\.maxntid", text, re.S)
    return [(p.group(2), p.group(1)) for p in
            re.finditer(r"\.param\s+(\.\w+)\s+(\w+)", m.group(1))]


def test_the_tile_kernel_parameter_table_matches_its_ptx():
    kinds = {".u64": ("c_void_p", "c_ulong", "c_uint64"), ".u32": ("c_uint",), ".s32": ("c_int",)}
    got = _tiles_entry()
    assert [n for n, _ in got] == [n for n, _ in varlen.TILES_PARAMS]
    for (name, ptx_type), (_, ctype) in zip(got, varlen.TILES_PARAMS):
        assert ctype.__name__ in kinds[ptx_type], name


def test_the_tile_kernel_and_the_varlen_builds_assemble_without_spills():
    from ptxattn import ptx
    from ptxattn.tools import sass
    try:
        sass.find_tool("ptxas")
    except Exception as e:                            # noqa: BLE001
        pytest.skip(f"no ptxas: {e}")
    a = sass.assemble_ptx(varlen.tiles_source(), "sm_90a", name="varlen_tiles")
    f = sass.parse_ptxas_log(a.log)["functions"][varlen.TILES_ENTRY]
    assert f["spill_stores"] == 0 and f["stack_frame"] == 0 and f["registers"] <= 64, f
    for d in (64, 128, 256):
        stage = varlen.forward_build(d)
        a = sass.assemble_ptx(ptx.source(stage, dict(stage.defines)), "sm_90a",
                              name=f"varlen_fwd_{d}")
        f = sass.parse_ptxas_log(a.log)["functions"]["ptxattn_fwd"]
        assert f["spill_stores"] == 0 and f["spill_loads"] == 0 and f["stack_frame"] == 0, (d, f)


# the paged builds' spills (bytes a thread): the producer's page registers past its 24 after
# setmaxnreg, stored once a Q tile and reloaded per K/V tile ahead of the ring (bench/notes.md,
# sessions 16 and 17: the warp producer spills less than the single thread's 68/64/0); a change
# that grows them is a change to measure again
PAGED_SPILL_BYTES = {64: 60, 128: 24, 256: 0}


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_paged_varlen_builds_assemble_within_their_spills(d):
    from ptxattn import ptx
    from ptxattn.tools import sass
    try:
        sass.find_tool("ptxas")
    except Exception as e:                            # noqa: BLE001
        pytest.skip(f"no ptxas: {e}")
    stage = varlen.forward_build(d, paged=True)
    a = sass.assemble_ptx(ptx.source(stage, dict(stage.defines)), "sm_90a",
                          name=f"varlen_paged_{d}")
    f = sass.parse_ptxas_log(a.log)["functions"]["ptxattn_fwd"]
    assert f["spill_stores"] <= PAGED_SPILL_BYTES[d], (d, f)


def test_the_varlen_build_is_the_masked_build_with_a_tile_table():
    stage = varlen.forward_build(128)
    assert dict(stage.defines) == {"HEAD_DIM": "128", "PTXATTN_MASKED": "1",
                                   "PTXATTN_VARLEN": "1"}
    assert stage.varlen and stage.block_m == 128 and stage.block_n == 128


# --------------------------------------------------------------------------- plan / run

def test_decode_plan_splits_follow_the_host_lengths(no_driver):
    """The plan's split count from the longest sequence it is told of, not the capacity."""
    import ptxattn
    from ptxattn.decode_plan import choose_splits
    short = ptxattn.plan_decode(batch=1, heads=32, heads_kv=8, head_dim=128, cache_len=131072,
                                host_lengths=np.array([600], np.int32), sm_count=132)
    full = ptxattn.plan_decode(batch=1, heads=32, heads_kv=8, head_dim=128, cache_len=131072,
                               sm_count=132)
    assert short.splits == choose_splits(1, 8, 1, 600, 128, 132) == 5
    assert full.splits == 16
    forced = ptxattn.plan_decode(batch=1, heads=32, heads_kv=8, head_dim=128, cache_len=131072,
                                 host_lengths=np.array([600], np.int32), num_splits=64)
    assert forced.splits == 5, "never more splits than the longest sequence has tiles"


def test_decode_plan_checks_host_data(no_driver):
    import ptxattn
    with pytest.raises(ValueError, match="cache_seqlens: sequence 0 has length 200"):
        ptxattn.plan_decode(batch=1, heads=8, heads_kv=2, head_dim=128, cache_len=128,
                            host_lengths=np.array([200], np.int32), sm_count=132)
    with pytest.raises(ValueError, match="page_size, num_pages: needed"):
        ptxattn.plan_decode(batch=1, heads=8, heads_kv=2, head_dim=128,
                            block_table=FakeDLPack((1, 4), ptr=BASE, dtype="int32"))
