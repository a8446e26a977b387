"""flash_attn_with_kvcache's validation and plan: everything decided before the first driver
call (argument checks, the split count), as plain data. No GPU needed: tests/test_decode_cpu.py
runs all of it.

The contract for lengths (issue 24): `cache_seqlens` is an int32 device array (B,), an int, a
NumPy int32 array (host data, copied in per call) or None (every sequence is full: Lmax).
- Host data outside [0, Lmax - Lnew] (Lnew: keys appended by this call) is a ValueError here.
- Device data is never read on the host (no sync: a decode step can be captured in a CUDA graph
  and replayed with new lengths). The kernels clamp each length to [0, Lmax] (and the appended
  length to Lmax), so no read or write can leave the caches whatever the array holds; with
  PTXATTN_CHECK_BOUNDS=1 the decode kernel also reports the first sequence out of range, and
  the call raises ValueError naming it (a debug mode: it waits for the GPU).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from .plan import scale_of

from .decode_builds import (DEFAULT_PAGED_VARIANT, MAX_PAGE_SIZE, MAX_QUERIES, MAX_SPLITS,
                            MIN_PAGE_SIZE, ROWS, DecodeBuild, build_for, paged_variant)

LAYOUTS = ("bshd", "bhld")
_AXES = {"bshd": "(batch, seq, heads, head_dim)", "bhld": "(batch, heads, seq, head_dim)"}
UNBOUNDED = 1 << 30              # an unbounded window side, as the kernel reads it
MAX_CACHE_LEN = UNBOUNDED - 1    # the kernel's key arithmetic is s32 with 2^30 for "unbounded"
CHECK_BOUNDS_ENV = "PTXATTN_CHECK_BOUNDS"
POISON_WORKSPACE_ENV = "PTXATTN_POISON_WORKSPACE"   # tests: fill the workspace with NaN first


def check_bounds_requested() -> bool:
    return os.environ.get(CHECK_BOUNDS_ENV, "").strip() not in ("", "0")


# --------------------------------------------------------------------------- the split count

WAVE_FILL = 0.95      # the share of the best wave efficiency a split count must reach

def choose_splits(batch: int, heads_kv: int, m_tiles: int, cache_len: int, block_n: int,
                  sm_count: int, ctas_per_sm: int = 1, max_splits: int = MAX_SPLITS) -> int:
    """How many CTAs share one (batch, K/V head, M tile)'s keys: split-KV's split count.

    Chosen on the host from shapes alone (B, Hkv, M tiles, the cache's capacity Lmax, the SMs),
    never from the actual lengths, which live on the device: a decode step stays one
    asynchronous launch sequence and can be captured in a CUDA graph. The reasoning, in the
    spirit of FlashAttention-3's heuristic:
    - Decode reads memory; the work is spread well when enough CTAs stream at once. With one
      split there are B * Hkv * M tiles CTAs; when they fill >= 80% of the CTA slots
      (SMs x CTAs per SM) they already keep HBM busy, and splitting would only add the
      partials' traffic and a combine: 1.
    - A cache of <= 4 K/V tiles is too short to split usefully: 1.
    - Otherwise the wave efficiency of s splits is waves / ceil(waves), waves = CTAs * s /
      slots: how full the last wave is. Take the fewest splits that reach WAVE_FILL (95%) of
      the best efficiency over s = 1 .. min(max_splits, slots, tiles). A split costs little
      here (its partial O and LSE, a few KB, and the combine's read of them), while an idle SM
      is bandwidth not drawn: FlashAttention-3's 85% (a rule for compute-bound tiles) left
      B = 1 at 14 splits of 8 heads, 112 of 132 SMs.
    - Only split counts that change a split's share are considered (FlashAttention-2's
      rule): with 64 tiles, 13 to 15 splits all give some split 5 tiles, so 14 and 15 would
      add CTAs without shortening the longest one.
    Capped at max_splits (128: the combine reads at most 128 partials a row).
    """
    tiles = batch * heads_kv * m_tiles
    n_blocks = -(-cache_len // block_n)
    slots = sm_count * ctas_per_sm
    if tiles == 0 or n_blocks <= 4 or tiles >= 0.8 * slots:
        return 1
    cap = max(1, min(max_splits, slots, n_blocks))

    def share(s: int) -> int:
        return -(-n_blocks // s)

    def efficiency(s: int) -> float:
        waves = tiles * s / slots
        return waves / math.ceil(waves)

    eligible = [s for s in range(1, cap + 1) if s == 1 or share(s) != share(s - 1)]
    best = max(efficiency(s) for s in eligible)
    return next(s for s in eligible if efficiency(s) >= WAVE_FILL * best)


def m_tiles_of(group: int, seq_q: int) -> int:
    """M tiles of 64 packed rows for one K/V head: g query heads x Lq positions."""
    return -(-group * seq_q // ROWS)


def packed_row(row: int, group: int) -> tuple[int, int]:
    """(query position, head within the group) of packed row `row`: row = lq * g + hg, so a
    BSHD q with Lq = 1 has a group's heads side by side (decode.ptx's mapping)."""
    return divmod(row, group)


# --------------------------------------------------------------------------- the validated call

@dataclass
class Lengths:
    """How cache_seqlens reached us: "full" (None: Lmax), "int", "host" (a NumPy array,
    validated and copied in per call) or "device" (an int32 device array at ptr)."""
    kind: str
    value: int = 0                  # "int", "full": the one length
    ptr: int = 0                    # "device"
    host: np.ndarray | None = None  # "host": int32, shape (B,)
    owner: object = None            # keeps an imported device array alive


@dataclass
class Paging:
    """A paged cache (block_table=): k_cache and v_cache are (num_pages, page_size, Hkv, D)
    pages, and row b of the int32 block table (B, max_pages) names sequence b's pages in
    order: its key j is row j % page_size of page block_table[b, j // page_size]. The kernels
    see max_pages * page_size positions a sequence (its lengths are clamped to that). kind:
    "device" (an int32 device array at ptr, read by the kernels only) or "host" (a NumPy
    array, checked here and copied in per call)."""
    kind: str
    page_size: int
    num_pages: int
    max_pages: int
    row_stride: int = 0             # entries between two sequences' rows
    ptr: int = 0                    # "device"
    host: np.ndarray | None = None  # "host": int32 (B, max_pages), contiguous
    owner: object = None            # keeps an imported device array alive
    variant: str = DEFAULT_PAGED_VARIANT   # the paged build variant the call runs (validate's)

    @property
    def page_shift(self) -> int:
        return self.page_size.bit_length() - 1

    @property
    def capacity(self) -> int:
        """Positions a sequence's pages hold: the kernels' cache_len."""
        return self.max_pages * self.page_size

    def map_box(self, head_dim: int, block_n: int) -> tuple[int, int | None]:
        """(rows, d_blocks) of the paged caches' TMA box: a tile of all D when a page holds a
        tile, else a page of one 64-column block of D (decode_kv_address.ptxh)."""
        if self.page_size >= block_n:
            return block_n, None
        return self.page_size, 1


def check_page_size(page_size: int) -> None:
    """A page holds 16 to 256 rows, a power of two (ValueError naming k_cache)."""
    if (page_size & (page_size - 1) or not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE):
        raise ValueError(f"k_cache: page size {page_size} (the second dim of a paged cache "
                         f"(num_pages, page_size, Hkv, D)) must be a power of two from "
                         f"{MIN_PAGE_SIZE} to {MAX_PAGE_SIZE}")


def reached_pages(lengths: np.ndarray, page_size: int) -> np.ndarray:
    """The pages each sequence's keys reach: ceil(length / page_size) (lengths >= 0)."""
    return -(-np.asarray(lengths, np.int64) // page_size)


def check_host_block_table(table: np.ndarray, lengths: np.ndarray | None, paging: Paging,
                           name: str = "block_table") -> None:
    """Host data: the entries of every page a sequence's keys reach lie in [0, num_pages);
    entries past its last page are not read (may be anything, e.g. transformers' -1). Without
    host lengths (they live on the device) nothing is known to be reached: the kernels clamp."""
    if lengths is None:
        return
    reach = np.minimum(reached_pages(lengths, paging.page_size), paging.max_pages)
    used = np.arange(paging.max_pages)[None, :] < reach[:, None]
    bad = used & ((table < 0) | (table >= paging.num_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"{name}: sequence {b}'s page {j} (keys {j * paging.page_size} .. "
                         f"{(j + 1) * paging.page_size - 1}, within its length "
                         f"{int(lengths[b])}) is entry {int(table[b, j])}, outside [0, "
                         f"{paging.num_pages}) (the caches' pages); {int(bad.sum())} entries "
                         f"of reached pages are out of range")


@dataclass
class DecodeCall:
    """A flash_attn_with_kvcache call that passed validation: shapes, views and choices."""
    q: object                       # tensors.DeviceArray views (bf16)
    k_cache: object
    v_cache: object
    k_new: object | None
    v_new: object | None
    out: object | None              # the caller's out (a DeviceArray), or None
    out_given: object               # what the caller passed as out (returned as is)
    lse_out: object | None          # the caller's float32 (B, H, Lq) view (ptr, ...), or None
    layout: str
    batch: int
    seq_q: int
    heads: int
    heads_kv: int
    head_dim: int
    cache_len: int
    seq_new: int
    lengths: Lengths
    window: tuple[int, int]         # (left, right), -1 unbounded (FlashAttention's window_size)
    scale: float
    want_lse: bool
    splits: int                     # 0 until planned: the heuristic's or num_splits
    splits_requested: int
    stream: int
    stream_object: object = None
    torch: bool = False             # q is a torch.Tensor: torch outputs and workspace
    build: DecodeBuild = field(default=None)
    out_strides: tuple[int, int, int] = (0, 0, 0)   # bytes (batch, seq, head) of the output
    q_shape: tuple = ()                             # q's (and the output's) shape
    objects: dict = field(default_factory=dict)     # what the caller passed, by name
    paging: Paging | None = None                    # a paged cache (block_table=), or None

    @property
    def group(self) -> int:
        return self.heads // self.heads_kv

    @property
    def m_tiles(self) -> int:
        return m_tiles_of(self.group, self.seq_q)

    @property
    def rows(self) -> int:
        """Output rows (b, h, lq) of the combine and of the LSE."""
        return self.batch * self.heads * self.seq_q

    @property
    def empty(self) -> bool:
        return self.batch == 0 or self.seq_q == 0 or self.heads == 0

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return self.q_shape

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.heads, self.seq_q)

    @property
    def window_params(self) -> tuple[int, int]:
        """The window as the kernel reads it: 2^30 for an unbounded side."""
        return tuple(UNBOUNDED if x < 0 else min(x, UNBOUNDED) for x in self.window)

    @property
    def workspace_floats(self) -> int:
        """fp32 partial O (splits, B, H, Lq, D) then LSE (splits, B, H, Lq); 0 with one split."""
        return workspace_floats(self.splits, self.rows, self.head_dim)


def workspace_floats(splits: int, rows: int, head_dim: int) -> int:
    """DecodeCall.workspace_floats from plain figures."""
    return splits * rows * (head_dim + 1) if splits > 1 else 0


def bhld_of(name: str, shape, layout: str) -> tuple[int, int, int, int]:
    """(batch, heads, seq, head_dim) of a rank-4 array in `layout`."""
    if len(shape) != 4:
        raise ValueError(f"{name}: expected a rank-4 array {_AXES[layout]} for layout "
                         f"{layout!r}, got rank {len(shape)} (shape {tuple(shape)})")
    b, x, y, d = (int(n) for n in shape)
    return (b, y, x, d) if layout == "bshd" else (b, x, y, d)


def bytes_strides(arr, layout: str, name: str) -> tuple[int, int, int]:
    """(batch, seq, head) strides in bytes of a bf16 4-D view in `layout`; the last dim must
    have stride 1. A size-1 dim's stride is replaced by the contiguous one (frameworks report
    anything there)."""
    from .tma import bhl_strides
    b, h, r, d = bhl_strides(layout, arr.shape, arr.strides, name)
    if arr.shape[-1] > 1 and d != 1:
        raise ValueError(f"{name}: the last (head) dim must have stride 1, got stride {d}")
    return 2 * b, 2 * r, 2 * h


def check_rows_aligned(arr, layout: str, name: str) -> None:
    """16-byte base and strides: the kernels move rows in 16-byte chunks."""
    if arr.ptr % 16:
        raise ValueError(f"{name}: base address 0x{arr.ptr:x} is not 16-byte aligned")
    for label, s, n in zip(("batch", "seq", "head"), bytes_strides(arr, layout, name),
                           _sizes(arr.shape, layout)):
        if n > 1 and (s % 16 or s <= 0):
            raise ValueError(f"{name}: {label} stride of {s // 2} elements ({s} bytes) is not a "
                             "positive multiple of 16 bytes")


def _sizes(shape, layout):
    b, h, l, _ = bhld_of("", shape, layout)
    return b, l, h


def span(arr) -> tuple[int, int]:
    """[first, last + 1) bytes a view may touch."""
    return arr.span()


def overlaps(a, b) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_out_view(out_view, views: dict) -> None:
    """A caller's out (a bf16 DeviceArray view) for q's rows: q's shape, writable, aliasing
    none of the call's inputs (flash_attn_with_kvcache and flash_attn_varlen_func alike)."""
    if tuple(out_view.shape) != tuple(views["q"].shape):
        raise ValueError(f"out: expected q's shape {tuple(views['q'].shape)}, got "
                         f"{tuple(out_view.shape)}")
    if out_view.readonly:
        raise ValueError("out: the device array is exported read-only")
    for name, arr in views.items():
        if overlaps(out_view, arr):
            raise ValueError(f"out: overlaps {name}; the output must not alias an input")


def check_scale(scale, head_dim: int) -> float:
    """softmax_scale as attention()'s scale is checked (a real positive number a float32
    holds; None: 1/sqrt(D))."""
    return scale_of(scale, head_dim, "softmax_scale")


def check_num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits: expected an int (0: the heuristic), got "
                        f"{type(num_splits).__name__}")
    n = int(num_splits)
    if not 0 <= n <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected 0 (the heuristic) to {MAX_SPLITS}, got {n}")
    return n


def check_host_lengths(values: np.ndarray, batch: int, cache_len: int, seq_new: int) -> None:
    """Host-side lengths: each in [0, Lmax - Lnew] (the appended keys must fit)."""
    if values.shape != (batch,):
        raise ValueError(f"cache_seqlens: expected shape ({batch},), one length per sequence, "
                         f"got {values.shape}")
    top = cache_len - seq_new
    bad = np.flatnonzero((values < 0) | (values > top))
    if bad.size:
        i = int(bad[0])
        what = (f"[0, {cache_len}]" if not seq_new else
                f"[0, {top}] (Lmax {cache_len} minus the {seq_new} keys appended)")
        raise ValueError(f"cache_seqlens: sequence {i} has length {int(values[i])}, outside "
                         f"{what}; {bad.size} of {batch} are out of range")


def resolve_splits(call: DecodeCall, sm_count: int) -> int:
    """num_splits when given (clamped to the cache's K/V tiles: more splits than tiles would be
    empty CTAs), else the heuristic; either way fewer than 2^31 / rows, so that the
    workspace's row index (split x rows + row) stays a 32-bit number in the kernels."""
    return splits_of(call.build, call.batch, call.heads_kv, call.m_tiles, call.rows,
                     call.cache_len, call.splits_requested, sm_count, call.paging)


def splits_of(build: DecodeBuild, batch: int, heads_kv: int, m_tiles: int, rows: int,
              cache_len: int, requested: int, sm_count: int, paging=None) -> int:
    """resolve_splits from plain figures (a remembered call whose cache grew asks it for its
    new cache_len without a DecodeCall)."""
    n_blocks = -(-cache_len // build.block_n)
    if requested:
        splits = max(1, min(requested, n_blocks))
    else:
        splits = choose_splits(batch, heads_kv, m_tiles, cache_len, build.block_n, sm_count,
                               build.ctas_per_sm)
        splits = scaled_paged_splits(splits, paging, build.block_n, n_blocks)
    return max(1, min(splits, ((1 << 31) - 1) // max(rows, 1)))


def scaled_paged_splits(splits: int, paging: "Paging | None", block_n: int,
                        n_blocks: int) -> int:
    """The heuristic's split count times the paged variant's split_factor at pages below a
    tile (decode_builds.PAGED_VARIANTS), within MAX_SPLITS and the cache's K/V tiles."""
    if paging is None or paging.page_size >= block_n:
        return splits
    factor = paged_variant(paging.variant).split_factor
    return max(1, min(splits * factor, MAX_SPLITS, n_blocks)) if factor > 1 else splits


def check_shapes(q_dims, k_dims, v_shape, k_shape, layout: str, new=None,
                 paged: bool = False) -> None:
    """The shape rules between q, the caches and new keys (raises ValueError naming one).
    paged: the caches are (num_pages, page_size, Hkv, D) pages; their first dim is not q's
    batch, and Lmax below is one page (the block table's width makes the capacity)."""
    (b, h, lq, d), (bk, hk, lmax, dk) = q_dims, k_dims
    if tuple(v_shape) != tuple(k_shape):
        raise ValueError(f"v_cache: expected the same shape as k_cache, {tuple(k_shape)}, "
                         f"got {tuple(v_shape)}")
    if paged:
        if bk == 0:
            raise ValueError("k_cache: a paged cache of no page (num_pages 0)")
    elif bk != b:
        raise ValueError(f"k_cache: batch {bk} does not match q's batch {b} (layout "
                         f"{layout!r}: {_AXES[layout]})")
    if dk != d:
        raise ValueError(f"k_cache: head dim {dk} does not match q's head dim {d}")
    build_for(d)
    if hk == 0 or h % hk:
        raise ValueError(f"k_cache: {hk} K/V heads do not divide q's {h} heads (GQA/MQA needs "
                         f"Hkv dividing H)")
    if lq > MAX_QUERIES:
        raise ValueError(f"q: {lq} query positions; flash_attn_with_kvcache takes 1 to "
                         f"{MAX_QUERIES} (a decode step, speculative decoding): for longer "
                         f"query blocks call ptxattn.attention(q, k, v, causal=..., "
                         f"layout=...) on the cache's filled part")
    if lmax == 0:
        raise ValueError("k_cache: the cache holds no position (Lmax 0)")
    if lmax > MAX_CACHE_LEN:
        raise ValueError(f"k_cache: Lmax {lmax} exceeds {MAX_CACHE_LEN}")
    if new is not None:
        (nb, nh, lnew, nd), v_new_shape, k_new_shape = new
        if tuple(v_new_shape) != tuple(k_new_shape):
            raise ValueError(f"v: expected the same shape as k, {tuple(k_new_shape)}, got "
                             f"{tuple(v_new_shape)}")
        if (nb, nh, nd) != (b, hk, d):
            raise ValueError(f"k: expected {b} sequences, {hk} K/V heads and head dim {d} "
                             f"(the cache's), got {nb}, {nh}, {nd} (layout {layout!r}: "
                             f"{_AXES[layout]})")
        if lnew > lmax and not paged:
            raise ValueError(f"k: {lnew} new keys do not fit a cache of {lmax} positions")
