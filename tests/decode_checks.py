"""How the decode tests check (shared by the GPU tests and the CPU emulator's): int32 device
vectors for lengths and block tables, fresh bf16 inputs, the check of an output and its LSE
against the float64 reference with a message that names the rows, heads and sizes of what is
wrong (one device run finds a bug), and the paged-cache case: shuffled pages, a block table
padded with -1 as transformers pads it, and the contiguous caches the reference reads."""

from __future__ import annotations

import numpy as np

import ptxattn
from ptxattn import driver, tensors
from ptxattn.decode_reference import contiguous_from_pages, kvcache_reference
from ptxattn.reference import BF16, error_metrics, passes

LSE_TOL = 2e-3


class DeviceInt32:
    """An int32 device vector offered through __cuda_array_interface__ (the library's own
    DeviceArray holds bf16 and float32 only)."""

    def __init__(self, values):
        values = np.ascontiguousarray(values, dtype=np.int32)
        self.buffer = driver.DeviceBuffer(max(values.nbytes, 4))
        driver.memcpy_htod(self.buffer.ptr, values)
        self.values = values
        self.__cuda_array_interface__ = {"shape": values.shape, "typestr": "<i4",
                                         "data": (self.buffer.ptr, False), "strides": None,
                                         "version": 3}

    def set(self, values):
        values = np.ascontiguousarray(values, dtype=np.int32)
        driver.memcpy_htod(self.buffer.ptr, values)
        self.values = values


def bf16(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16)


def shape_of(layout, b, h, l, d):
    return (b, l, h, d) if layout == "bshd" else (b, h, l, d)


def describe_rows(got, ref, layout, limit=6) -> str:
    """The worst rows as (batch, query, head): error, reference scale, NaN."""
    g = np.asarray(got, np.float64)
    if layout == "bhld":
        g, ref = g.transpose(0, 2, 1, 3), ref.transpose(0, 2, 1, 3)
    err = np.abs(g - ref).max(axis=-1)                     # (B, Lq, H)
    err = np.where(np.isnan(err), np.inf, err)
    order = np.argsort(err, axis=None)[::-1][:limit]
    parts = []
    for flat in order:
        b, lq, h = np.unravel_index(flat, err.shape)
        parts.append(f"(b={b}, lq={lq}, h={h}): max|err| {err[b, lq, h]:.3g}, "
                     f"max|ref| {np.abs(ref[b, lq, h]).max():.3g}")
    bad_heads = sorted(set(np.nonzero(err > 1e-2 * max(np.abs(ref).max(), 1e-30))[2].tolist()))
    return "; ".join(parts) + f"; heads with errors: {bad_heads[:16]}"


def check(out, lse, ref, ref_lse, layout, what):
    got = out.astype(np.float32)
    nan = int(np.count_nonzero(~np.isfinite(got)))
    assert nan == 0, f"{what}: {nan} NaN/Inf in the output (unwritten rows?) " \
        + describe_rows(got, ref, layout)
    m = error_metrics(got, ref)
    if np.abs(ref).max() > 0:
        assert passes(m), f"{what}: {m}; " + describe_rows(got, ref, layout)
    else:
        assert m["max_abs"] == 0, f"{what}: rows that see no key must be 0: {m}"
    if lse is not None:
        assert not np.isnan(lse).any(), f"{what}: {int(np.isnan(lse).sum())} LSE left NaN"
        empty = np.isneginf(ref_lse)
        wrong_empty = np.argwhere(np.isneginf(lse) != empty)
        assert wrong_empty.size == 0, f"{what}: LSE -inf exactly where no key is seen; first " \
            f"wrong (b, h, lq): {wrong_empty[:5].tolist()}"
        if (~empty).any():
            err = np.abs(lse[~empty] - ref_lse[~empty])
            with np.errstate(invalid="ignore"):             # -inf - -inf where no key
                worst = np.argwhere(np.abs(lse - ref_lse) == err.max())[0].tolist()
            assert err.max() <= LSE_TOL, f"{what}: LSE max abs error {err.max():.3g} at " \
                f"(b, h, lq) {worst}"
    return m



# --------------------------------------------------------------------------- the paged cache

def paged_case(rng, *, B, H, Hkv, Lq, D, page_size, lengths, max_pages=None, spare_pages=3,
               new=0):
    """A paged cache for `lengths` (the keys each sequence holds after `new` appended ones):
    every sequence's pages taken from one shuffled pool (not in order, not contiguous, with
    spare pages no sequence uses), its block-table row padded with -1 past its last page.
    Returns a dict of host arrays: q (B, Lq, H, D), k_pages / v_pages (num_pages, page_size,
    Hkv, D), table (B, max_pages) int32, lengths, cached (lengths - new) and, with new keys,
    k_new / v_new (B, new, Hkv, D)."""
    lengths = np.asarray(lengths, np.int64)
    need = -(-lengths // page_size)
    max_pages = int(max(need.max(initial=0), 1)) if max_pages is None else max_pages
    num_pages = int(need.sum()) + spare_pages
    pool = rng.permutation(num_pages)
    table = np.full((B, max_pages), -1, np.int32)
    at = 0
    for b in range(B):
        table[b, :need[b]] = pool[at:at + need[b]]
        at += need[b]
    case = dict(q=bf16(rng, (B, Lq, H, D)),
                k_pages=bf16(rng, (num_pages, page_size, Hkv, D)),
                v_pages=bf16(rng, (num_pages, page_size, Hkv, D)),
                table=table, lengths=lengths, cached=lengths - new)
    if new:
        case["k_new"] = bf16(rng, (B, new, Hkv, D))
        case["v_new"] = bf16(rng, (B, new, Hkv, D))
    return case


def pages_after_append(case, table):
    """The host pages with the new keys written where the append writes them: sequence b's
    position cached[b] + t on page table[b, pos // page_size] (entries outside the pages drop
    the write)."""
    k_pages, v_pages = case["k_pages"].copy(), case["v_pages"].copy()
    if "k_new" not in case:
        return k_pages, v_pages
    page = k_pages.shape[1]
    for b in range(table.shape[0]):
        for t in range(case["k_new"].shape[1]):
            pos = int(case["cached"][b]) + t
            j = pos // page
            if j >= table.shape[1]:
                continue
            entry = int(table[b, j])
            if 0 <= entry < k_pages.shape[0]:
                k_pages[entry, pos % page] = case["k_new"][b, t]
                v_pages[entry, pos % page] = case["v_new"][b, t]
    return k_pages, v_pages


def run_paged(case, *, causal=False, window=(-1, -1), splits=0, what="", table=None,
              device_table=True, device_lengths=True):
    """flash_attn_with_kvcache on the paged case (outputs poisoned with NaN first), the pages
    checked after the append, the output and LSE against the reference on the contiguous
    caches the pages stand for. `table`: the block table the kernels get (default: the
    case's; one with bad entries planted is what the reference reads too: such a page's keys
    are zeros, its appends dropped). Returns the metrics."""
    q = case["q"]
    B, Lq, H, D = q.shape
    qd, kd, vd = (tensors.from_numpy(case[n]) for n in ("q", "k_pages", "v_pages"))
    extra = {}
    if "k_new" in case:
        extra = dict(k=tensors.from_numpy(case["k_new"]), v=tensors.from_numpy(case["v_new"]))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    lse_out = tensors.empty((B, H, Lq), dtype=np.float32)
    driver.memset_u16(lse_out.ptr, 0xFFFF, 2 * lse_out.size)
    table = case["table"] if table is None else table
    cached = np.asarray(case["cached"], np.int32)
    ptxattn.flash_attn_with_kvcache(
        qd, kd, vd, cache_seqlens=DeviceInt32(cached) if device_lengths else cached,
        block_table=DeviceInt32(table) if device_table else table, causal=causal,
        window_size=window, num_splits=splits, return_lse=True, out=out, lse_out=lse_out,
        **extra)
    driver.synchronize()
    k_pages, v_pages = pages_after_append(case, table)
    if extra:
        for name, dev, want in (("k_pages", kd, k_pages), ("v_pages", vd, v_pages)):
            back = dev.to_numpy()
            diff = np.argwhere(back.astype(np.float32) != want.astype(np.float32))
            assert diff.size == 0, f"{what}: {name} after the append differs at (page, row, " \
                f"head, col) {diff[:5].tolist()}"
    kc, vc = contiguous_from_pages(k_pages, v_pages, table, case["lengths"])
    ref, ref_lse = kvcache_reference(q, kc, vc, case["lengths"], causal=causal, window=window)
    what = (f"{what} B={B} H={H}:{case['k_pages'].shape[2]} Lq={Lq} D={D} page="
            f"{case['k_pages'].shape[1]} lengths={case['lengths'].tolist()} causal={causal} "
            f"window={window} splits={splits}")
    m = check(out.to_numpy(), lse_out.to_numpy(), ref, ref_lse, "bshd", what)
    for x in (qd, kd, vd, out, lse_out, *extra.values()):
        x.free()
    return m
