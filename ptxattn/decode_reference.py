"""The decode call in NumPy: a float64 reference of flash_attn_with_kvcache, and a model of
what the kernels compute CTA by CTA (tile ranges, splits, partials, the combine), written with
the kernels' own integer formulas.

tests/test_decode_cpu.py checks the model against the reference (so the index math of
decode.ptx and combine.ptx is tested without a GPU), and the GPU tests and the benchmark check
the kernels against the reference.
"""

from __future__ import annotations

import math

import numpy as np

from .decode_builds import ROWS
from .decode_plan import UNBOUNDED
from .reference import _bf16_to_f64


def clamped_lengths(raw, seq_new: int, cache_len: int) -> np.ndarray:
    """What the kernels use: each cached length clamped to [0, Lmax], plus the appended keys,
    clamped to Lmax again (SEQUENCE_LENGTH in decode_kv_address.ptxh)."""
    raw = np.asarray(raw, dtype=np.int64)
    return np.minimum(np.clip(raw, 0, cache_len) + seq_new, cache_len)


def appended_caches(k_cache, v_cache, k_new, v_new, raw_lengths, layout: str = "bshd"):
    """Copies of the caches with the new keys written as ptxattn_append writes them: at
    clamp(length, 0, Lmax) + t, writes past Lmax dropped."""
    k_cache, v_cache = np.array(k_cache), np.array(v_cache)
    seq_axis = 1 if layout == "bshd" else 2
    lmax = k_cache.shape[seq_axis]
    lnew = k_new.shape[seq_axis]
    start = np.clip(np.asarray(raw_lengths, np.int64), 0, lmax)
    for b in range(k_cache.shape[0]):
        for t in range(lnew):
            pos = int(start[b]) + t
            if pos >= lmax:
                continue
            if layout == "bshd":
                k_cache[b, pos], v_cache[b, pos] = k_new[b, t], v_new[b, t]
            else:
                k_cache[b, :, pos], v_cache[b, :, pos] = k_new[b, :, t], v_new[b, :, t]
    return k_cache, v_cache


def _to_bhld(x, layout):
    x = _bf16_to_f64(x)
    return x if layout == "bhld" else x.transpose(0, 2, 1, 3)


def visible(lq: int, seq_q: int, length: int, window: tuple[int, int]) -> tuple[int, int]:
    """[first, last] keys query lq of Lq sees in a sequence of `length` keys (bottom-right;
    window sides -1 unbounded): empty when first > last."""
    left, right = window
    diag = length - seq_q
    first = 0 if left < 0 else max(0, diag + lq - left)
    last = length - 1 if right < 0 else min(length - 1, diag + lq + right)
    return first, last


def _operands(q, k_cache, v_cache, causal, window, scale, layout):
    """BHLD float64 operands, the group size, the (left, right) window with causal folded in
    (right = min(right, 0)) and the scale."""
    qh, kh, vh = (_to_bhld(x, layout) for x in (q, k_cache, v_cache))
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    scale = 1.0 / math.sqrt(qh.shape[-1]) if scale is None else float(scale)
    return qh, kh, vh, qh.shape[1] // kh.shape[1], (left, right), scale


def kvcache_reference(q, k_cache, v_cache, lengths, *, causal=False, window=(-1, -1),
                      scale=None, layout="bshd"):
    """(out, lse) in float64 of attention of q against the first lengths[b] keys of each cache,
    bottom-right masks; out in q's layout, lse (B, H, Lq). A query that sees no key: 0, -inf."""
    qh, kh, vh, g, (left, right), scale = _operands(q, k_cache, v_cache, causal, window, scale,
                                                   layout)
    b_, h_, lq_, d_ = qh.shape
    out = np.zeros((b_, h_, lq_, d_))
    lse = np.full((b_, h_, lq_), -np.inf)
    for b in range(b_):
        length = int(lengths[b])
        if length <= 0:
            continue
        for h in range(h_):
            s = qh[b, h] @ kh[b, h // g, :length].T * scale          # (Lq, L)
            for lq in range(lq_):
                first, last = visible(lq, lq_, length, (left, right))
                if first > last:
                    continue
                row = s[lq, first:last + 1]
                m = row.max()
                p = np.exp(row - m)
                total = p.sum()
                out[b, h, lq] = p @ vh[b, h // g, first:last + 1] / total
                lse[b, h, lq] = m + math.log(total)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return out, lse


# --------------------------------------------------------------------------- the kernels' model

def cta_tiles(length: int, seq_q: int, group: int, m_tile: int, split: int, splits: int,
              window_params: tuple[int, int], block_n: int) -> dict:
    """decode.ptx's "key ranges" for one CTA, integer for integer: its K/V tiles [lo, hi), the
    masked-tile bounds and the rows. window_params as the kernel reads them (2^30 unbounded)."""
    left, right = window_params
    shift = block_n.bit_length() - 1
    rows = group * seq_q
    row0 = ROWS * m_tile
    live = min(ROWS, rows - row0)
    lq_min, lq_max = row0 // group, (row0 + live - 1) // group
    diag = length - seq_q
    len_last = length - 1
    key_first = max(diag + lq_min - left, 0)
    key_last = min(diag + lq_max + right, len_last)
    mask_below = diag + lq_max - left
    mask_above = min(diag + lq_min + right, len_last)
    kv_first = key_first >> shift
    kv_end = (key_last >> shift) + 1
    count = 0 if key_first > key_last else max(kv_end - kv_first, 0)
    lo = kv_first + split * count // splits
    hi = kv_first + (split + 1) * count // splits
    return dict(lo=lo, hi=hi, mask_below=mask_below, mask_above=mask_above, row0=row0,
                live=live, rows=rows)


def tile_is_masked(tile: int, mask_below: int, mask_above: int, block_n: int) -> bool:
    """DECODE_TILE_STRADDLES_EDGE: the tile starts below some row's first key or ends past
    some row's last."""
    base = tile * block_n
    return base < mask_below or base + block_n - 1 > mask_above


def masked_runs(lo: int, hi: int, mask_below: int, mask_above: int, block_n: int):
    """The tiles decode.ptx runs with the masked step: the prologue's tile when it straddles,
    then [lo + 1, front_end) and [plain_end, hi) (its runs), as a set."""
    shift = block_n.bit_length() - 1
    out = set()
    if hi <= lo:
        return out
    if tile_is_masked(lo, mask_below, mask_above, block_n):
        out.add(lo)
    front_end = min(max((mask_below + block_n - 1) >> shift, lo + 1), hi)
    plain_end = min(max((mask_above + 1) >> shift, front_end), hi)
    out.update(range(lo + 1, front_end))
    out.update(range(plain_end, hi))
    return out


def model_decode(q, k_cache, v_cache, lengths, *, splits: int, block_n: int, causal=False,
                 window=(-1, -1), scale=None, layout="bshd"):
    """The kernels' answer in float64: every CTA's partial (its tiles' keys only), then the
    combine's sum (or the single split's own output). (out, lse, partials) where partials
    lists (b, h, lq, split, O, lse) of every stored row."""
    qh, kh, vh, g, (left, right), scale = _operands(q, k_cache, v_cache, causal, window, scale,
                                                   layout)
    b_, h_, lq_, d_ = qh.shape
    hkv = kh.shape[1]
    params = tuple(UNBOUNDED if x < 0 else min(x, UNBOUNDED) for x in (left, right))
    m_tiles = -(-g * lq_ // ROWS)
    part_o = np.zeros((splits, b_, h_, lq_, d_))
    part_lse = np.full((splits, b_, h_, lq_), -np.inf)
    for b in range(b_):
        length = int(lengths[b])
        for hk in range(hkv):
            for m in range(m_tiles):
                for s in range(splits):
                    t = cta_tiles(length, lq_, g, m, s, splits, params, block_n)
                    keys = np.arange(t["lo"] * block_n, t["hi"] * block_n)
                    for r in range(t["row0"], t["row0"] + t["live"]):
                        lq, hg = divmod(r, g)
                        h = hk * g + hg
                        first = length - lq_ + lq - params[0]
                        last = min(length - lq_ + lq + params[1], length - 1)
                        seen = keys[(keys >= first) & (keys <= last)]
                        if seen.size == 0:
                            continue
                        sc = qh[b, h, lq] @ kh[b, hk, seen].T * scale
                        mx = sc.max()
                        p = np.exp(sc - mx)
                        part_o[s, b, h, lq] = p @ vh[b, hk, seen] / p.sum()
                        part_lse[s, b, h, lq] = mx + math.log(p.sum())
    out, lse = combine(part_o, part_lse)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return out, lse, (part_o, part_lse)


def combine(part_o: np.ndarray, part_lse: np.ndarray):
    """combine.ptx's arithmetic: w_s = exp(lse_s - max lse), out = sum w_s O_s / sum w_s,
    lse = max + log(sum w_s); a split with lse -inf weighs 0 and its O is never used (so any
    value there, NaN included, changes nothing); a row no split saw: 0 and -inf."""
    m = part_lse.max(axis=0)
    none = np.isneginf(m)
    safe_m = np.where(none, 0.0, m)
    w = np.where(np.isneginf(part_lse), 0.0, np.exp(part_lse - safe_m))
    total = w.sum(axis=0)
    used = np.where((w > 0)[..., None], part_o, 0.0)
    acc = (w[..., None] * used).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(none[..., None], 0.0, acc / np.where(total > 0, total, 1.0)[..., None])
        lse = np.where(none, -np.inf, safe_m + np.log(np.where(total > 0, total, 1.0)))
    return out, lse


# --------------------------------------------------------------------------- the paged cache

def contiguous_from_pages(k_pages, v_pages, block_table, lengths):
    """The contiguous caches (B, max_pages * page_size, Hkv, D) a paged cache stands for:
    sequence b's key j is row j % page_size of page block_table[b, j // page_size], for the
    keys below lengths[b]; positions past a sequence's length, and keys on a page outside
    [0, num_pages), are zero (what the kernels read there: TMA fills them with zeros)."""
    k_pages, v_pages = np.asarray(k_pages), np.asarray(v_pages)
    table = np.asarray(block_table, np.int64)
    num_pages, page, hkv, d = k_pages.shape
    batch, max_pages = table.shape
    k = np.zeros((batch, max_pages * page, hkv, d), k_pages.dtype)
    v = np.zeros_like(k)
    for b in range(batch):
        length = min(max(int(lengths[b]), 0), max_pages * page)
        for j in range(-(-length // page)):
            entry = int(table[b, j])
            if 0 <= entry < num_pages:
                k[b, j * page:(j + 1) * page] = k_pages[entry]
                v[b, j * page:(j + 1) * page] = v_pages[entry]
        k[b, length:] = 0
        v[b, length:] = 0
    return k, v


def paged_tile_boxes(key_base: int, seq_len: int, table_row, page_size: int, block_n: int,
                     head_dim: int) -> list[dict]:
    """The TMA boxes decode_kv_address.ptxh issues for the K (or V) tile at key_base, integer
    for integer, each as {page, row (in the page), dblk (first 64-column block of D), dblks,
    rows, tile_row, smem (byte offset in the tile: dblk * block_n * 128 + tile_row * 128)}. A
    page that holds a tile: one box of block_n rows and all of D; smaller pages: a box per
    page and 64 columns of D. Pages the length does not reach go to page -1 (zero fill, no
    read); the table index is clamped to its row (max_pages - 1)."""
    page_shift = page_size.bit_length() - 1
    block_shift = block_n.bit_length() - 1
    box_shift = min(page_shift, block_shift)
    pages_per_tile = 1 << (block_shift - box_shift)
    split_d = pages_per_tile > 1
    max_page_idx = len(table_row) - 1
    first = key_base >> page_shift
    row = key_base & (page_size - 1)
    boxes = []
    for j in range(pages_per_tile):
        idx = first + j
        reached = (idx << page_shift) < seq_len
        page = int(table_row[min(idx, max_page_idx)]) if reached else -1
        tile_row = j << box_shift
        for dblk in range(head_dim // 64 if split_d else 1):
            boxes.append(dict(page=page, row=row, dblk=dblk,
                              dblks=1 if split_d else head_dim // 64, rows=1 << box_shift,
                              tile_row=tile_row, smem=dblk * block_n * 128 + tile_row * 128))
    return boxes


def gather_tile(k_pages, boxes, head: int, block_n: int) -> np.ndarray:
    """The (block_n, D) tile the boxes land as in shared memory ([D / 64][block_n][64], shown
    unswizzled: the swizzle is the same pattern for every box), zero where a box lies outside
    the pages (TMA's fill). Every byte of the tile must be written by exactly one box."""
    k_pages = np.asarray(k_pages)
    num_pages, _, _, d = k_pages.shape
    tile = np.zeros((block_n, d), np.float64)
    written = np.zeros((block_n, d), np.int64)
    for box in boxes:
        r0, rows = box["tile_row"], box["rows"]
        c0, c1 = 64 * box["dblk"], 64 * (box["dblk"] + box["dblks"])
        assert box["smem"] == box["dblk"] * block_n * 128 + r0 * 128
        written[r0:r0 + rows, c0:c1] += 1
        if 0 <= box["page"] < num_pages:
            tile[r0:r0 + rows, c0:c1] = _bf16_to_f64(
                k_pages[box["page"], box["row"]:box["row"] + rows, head, c0:c1])
    assert (written == 1).all(), "the boxes do not tile the K/V tile exactly once"
    return tile
