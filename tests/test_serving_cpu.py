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
