"""flash_attn_varlen_func's validation and plan: every argument checked before any launch, the
offsets' contract, and the tile table in NumPy (what ptx/sm90/production/varlen_tiles.ptx
writes on the device, integer for integer: the model the tests hold it to, and what a plan()
with host copies of the offsets uploads instead of launching it).

The offsets (issue 25): cu_seqlens_q / cu_seqlens_k are int32 (B + 1) arrays, seqused_k an
optional int32 (B) array of the keys each sequence uses from cu_seqlens_k[b] on.
- Host data (NumPy, CPU tensors) is checked here: each starts at 0, never decreases and ends
  at the tensor's rows (total_q, total_k); seqused_k[b] within its sequence's keys; no
  sequence longer than max_seqlen_q / max_seqlen_k. A ValueError names the array and index.
- Device data is never read on the host (no sync: a call can be captured in a CUDA graph).
  The tile kernel clamps every offset into the tensors, so no row outside q, k, v and the
  output is ever read or written whatever the arrays hold; PTXATTN_CHECK_BOUNDS=1 reports the
  first broken offset as a ValueError (a debug mode: it waits for the GPU).
Rows of q past cu_seqlens_q[-1] (padding, e.g. a CUDA-graph batch's) are never written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import builds

UNBOUNDED = 1 << 30                  # an unbounded window side, as the kernels read it
MAX_ROWS = (1 << 30) - 1             # total_q, total_k: the kernels' s32 row arithmetic
SORT_MAX = 8192                      # varlen_tiles.ptx sorts at most this many entries
RECORD_WORDS = 4                     # {q_row, k_start, q_end, seq_k}
TABLE_HEADER_BYTES = 16              # word 0: the entries; records from byte 16
TILES_THREADS = 1024                 # varlen_tiles.ptx's one CTA
TILES_SMEM = 8 * SORT_MAX + 32 * 4   # its sort keys and the warp totals
# the check-bounds report: words 0-2 a broken offset (kind, index, value: varlen_tiles.ptx),
# words 4-6 a bad block-table entry in a reached page (sequence + 1, page, entry: the paged
# forward build's, kv_paged.ptxh)
BOUNDS_WORDS = 8
BOUNDS_NAMES = {1: "cu_seqlens_q", 2: "cu_seqlens_k", 3: "seqused_k",
                4: "cu_seqlens_k", 5: "seqused_k"}   # 4, 5: a paged length past its pages
PAGED_TOTAL_K = (1 << 31) - 1        # the tile kernel's total_k with paged keys (binds nothing)


@dataclass
class Offsets:
    """An int32 offsets argument: "device" (at ptr, read by the kernels only) or "host"
    (a NumPy copy, checked here, copied in per call)."""
    kind: str
    length: int
    ptr: int = 0
    host: np.ndarray | None = None
    owner: object = None


@dataclass
class VarlenCall:
    """A flash_attn_varlen_func call that passed validation."""
    q: object                        # DeviceArray views, (total, heads, D)
    k: object
    v: object
    out: object | None               # the caller's out view, or None
    out_given: object
    total_q: int
    heads: int
    head_dim: int
    total_k: int
    heads_kv: int
    batch: int
    cu_q: Offsets
    cu_k: Offsets
    seqused_k: Offsets | None
    max_seqlen_q: int
    max_seqlen_k: int
    window: tuple[int, int]          # (left, right), -1 unbounded
    scale: float
    want_lse: bool
    stream: int
    stream_object: object = None
    torch: bool = False
    build: builds.Build = field(default=None)
    objects: dict = field(default_factory=dict)
    paging: object = None            # a paged K/V cache (block_table=: decode_plan.Paging)

    @property
    def paged_keys(self) -> int:
        """The keys a sequence's block-table row reaches (0: packed keys)."""
        return self.paging.capacity if self.paging is not None else 0

    @property
    def block_m(self) -> int:
        return self.build.block_m

    @property
    def max_entries(self) -> int:
        return max_entries(self.batch, self.total_q, self.block_m)

    @property
    def window_params(self) -> tuple[int, int]:
        return window_params(self.window)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.total_q, self.heads, self.head_dim)

    @property
    def lse_shape(self) -> tuple[int, int]:
        return (self.heads, self.total_q)

    @property
    def empty(self) -> bool:
        return self.total_q == 0 or self.heads == 0 or self.batch == 0

    @property
    def workspace_bytes(self) -> int:
        """The tile table (header + records) and the tile kernel's scratch records."""
        return workspace_bytes(self.max_entries)


def max_entries(batch: int, total_q: int, block_m: int) -> int:
    """The table's room: sum_b ceil(len_b / BLOCK_M) <= B + total_q / BLOCK_M for any valid
    offsets (broken ones are cut off there)."""
    return batch + -(-total_q // block_m)


def workspace_bytes(entries: int) -> int:
    return TABLE_HEADER_BYTES + 2 * 16 * entries


def window_params(window) -> tuple[int, int]:
    return tuple(UNBOUNDED if x < 0 else min(x, UNBOUNDED) for x in window)


# --------------------------------------------------------------------------- host checks

def check_host_offsets(name: str, values: np.ndarray, total: int, what: str,
                       padded_ok: bool = False) -> None:
    """cu_seqlens on the host: 1-D, starting at 0, non-decreasing, ending at `total` (the
    tensor's rows; at most `total` when padded_ok: a plan for static, padded buffers)."""
    if values.ndim != 1 or values.size < 1:
        raise ValueError(f"{name}: expected a 1-D int32 array of B + 1 offsets, got shape "
                         f"{values.shape}")
    if values[0] != 0:
        raise ValueError(f"{name}: expected offsets starting at 0, got {int(values[0])} at "
                         "index 0")
    steps = np.diff(values.astype(np.int64))
    if (steps < 0).any():
        i = int(np.flatnonzero(steps < 0)[0]) + 1
        raise ValueError(f"{name}: offsets must not decrease, but index {i} holds "
                         f"{int(values[i])} after {int(values[i - 1])}")
    last = int(values[-1])
    if last > total or (last != total and not padded_ok):
        raise ValueError(f"{name}: the last offset {last} does not match {what}'s {total} "
                         f"rows (total {'at most ' if padded_ok else ''}{total} expected)")


def check_host_used(used: np.ndarray, batch: int, cu_k: np.ndarray | None) -> None:
    if used.shape != (batch,):
        raise ValueError(f"seqused_k: expected shape ({batch},), one count per sequence, got "
                         f"{used.shape}")
    room = np.diff(cu_k.astype(np.int64)) if cu_k is not None else None
    bad = used < 0 if room is None else (used < 0) | (used > room)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        within = "" if room is None else f" (sequence {b} has {int(room[b])} keys)"
        raise ValueError(f"seqused_k: sequence {b} uses {int(used[b])} keys, outside "
                         f"[0, its keys]{within}")


def check_max_seqlen(name: str, value, lengths: np.ndarray | None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value}")
    if lengths is not None and lengths.size and int(lengths.max()) > value:
        b = int(np.argmax(lengths))
        raise ValueError(f"{name}: sequence {b} has {int(lengths[b])} rows, above "
                         f"{name} {value}")
    return value


# --------------------------------------------------------------------------- the tile table

def sequence_spans(cu_q, cu_k, seqused_k, total_q: int, total_k: int, paged_keys: int = 0):
    """Per sequence (q0, q1, k0, seq_k), clamped as varlen_tiles.ptx clamps them; with
    paged_keys (a block-table row's reach) k0 is the sequence (its table row) and seq_k its own
    count clamped into [0, paged_keys]."""
    cu_q = np.asarray(cu_q, np.int64)
    cu_k = np.asarray(cu_k, np.int64)
    spans = []
    for b in range(cu_q.size - 1):
        q0 = min(max(int(cu_q[b]), 0), total_q)
        q1 = min(max(int(cu_q[b + 1]), q0), total_q)
        k0 = min(max(int(cu_k[b]), 0), total_k)
        if seqused_k is None:
            seq_k = min(max(int(cu_k[b + 1]), k0), total_k) - k0
        else:
            seq_k = min(max(int(seqused_k[b]), 0), total_k - k0)
        if paged_keys:
            n = int(seqused_k[b]) if seqused_k is not None else int(cu_k[b + 1] - cu_k[b])
            k0, seq_k = b, min(max(n, 0), paged_keys)
        spans.append((q0, q1, k0, seq_k))
    return spans


def block_work(r0: int, r1: int, len_q: int, seq_k: int, window: tuple[int, int],
               block_n: int) -> int:
    """K/V tiles rows [r0, r1) of a sequence see (at least 1): masks.ptxh's KV_RANGE."""
    left, right = window
    shift = block_n.bit_length() - 1
    diag = seq_k - len_q
    key_first = max(r0 + diag - left, 0)
    key_last = min(r1 - 1 + diag + right, seq_k - 1)
    return max((key_last >> shift) - (key_first >> shift) + 1, 1)


def tile_table(cu_q, cu_k, seqused_k, total_q: int, total_k: int, block_m: int, block_n: int,
               window_params: tuple[int, int], entries_room: int | None = None,
               paged_keys: int = 0) -> np.ndarray:
    """The records varlen_tiles.ptx writes, in its order: (E, 4) int64 rows {q_row, k_start,
    q_end, seq_k}, the BLOCK_M-row blocks of every sequence, sorted by work (K/V tiles seen),
    most first, ties by the later entry first (the sort key is work << 32 | entry); in entry
    order when there are more than SORT_MAX. At most entries_room entries."""
    spans = sequence_spans(cu_q, cu_k, seqused_k, total_q, total_k, paged_keys)
    room = entries_room if entries_room is not None else max_entries(
        len(spans), total_q, block_m)
    records, works = [], []
    for q0, q1, k0, seq_k in spans:
        len_q = q1 - q0
        for r0 in range(0, len_q, block_m):
            if len(records) >= room:
                continue
            r1 = min(r0 + block_m, len_q)
            records.append((q0 + r0, k0, q1, seq_k))
            works.append(block_work(r0, r1, len_q, seq_k, window_params, block_n))
    total = sum(-(-(q1 - q0) // block_m) for q0, q1, _, _ in spans)
    table = np.array(records, np.int64).reshape(-1, RECORD_WORDS)
    if 1 < total <= SORT_MAX:
        keys = [(w << 32) | e for e, w in enumerate(works)]
        order = sorted(range(len(keys)), key=lambda e: keys[e], reverse=True)
        table = table[order]
    return table


def table_bytes(table: np.ndarray, room: int) -> np.ndarray:
    """The table as the kernels read it: int32 words, the entry count at word 0, records from
    byte 16, `room` records long."""
    words = np.zeros(TABLE_HEADER_BYTES // 4 + RECORD_WORDS * room, np.int32)
    words[0] = len(table)
    words[4:4 + table.size] = table.reshape(-1)
    return words


def reference_rows(cu_q, total_q: int) -> np.ndarray:
    """The q rows some sequence covers (the output rows the kernels write)."""
    cu_q = np.asarray(cu_q, np.int64)
    covered = np.zeros(total_q, bool)
    for b in range(cu_q.size - 1):
        covered[max(cu_q[b], 0):min(max(cu_q[b + 1], cu_q[b]), total_q)] = True
    return covered


def tiles_of(table: np.ndarray, heads: int) -> int:
    return len(table) * heads


def grid_of(entries: int, heads: int, sm_count: int) -> int:
    """The persistent grid: min(SMs, an upper bound of the tiles), at least one CTA."""
    return max(1, min(sm_count, entries * heads))

