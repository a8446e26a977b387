"""How the varlen tests check (shared by the GPU tests and the CPU emulator's): packed cases
built from per-sequence lengths, the call on NaN-poisoned outputs, and every sequence against
the float64 reference on its own rows, with a message naming the sequences, rows and heads
that are wrong (one device run finds a bug). Rows no sequence covers (padding past
cu_seqlens_q[-1]) must stay as poisoned: the kernels never write them."""

from __future__ import annotations

import numpy as np
from decode_checks import DeviceInt32, bf16

import ptxattn
from ptxattn import driver, tensors
from ptxattn.reference import attention_reference, error_metrics, passes

LSE_TOL = 2e-3


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int32)


def varlen_case(rng, lens_q, lens_k=None, *, H=4, Hkv=2, D=64, pad_q=0, pad_k=0):
    """q (total_q + pad_q, H, D), k and v (total_k + pad_k, Hkv, D) packed from the lengths
    (fresh normal values, the padding rows too), with their offsets."""
    lens_q = np.asarray(lens_q, np.int64)
    lens_k = lens_q if lens_k is None else np.asarray(lens_k, np.int64)
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    return dict(q=bf16(rng, (int(cu_q[-1]) + pad_q, H, D)),
                k=bf16(rng, (int(cu_k[-1]) + pad_k, Hkv, D)),
                v=bf16(rng, (int(cu_k[-1]) + pad_k, Hkv, D)),
                cu_q=cu_q, cu_k=cu_k, lens_q=lens_q, lens_k=lens_k)


def sequence_reference(case, b, *, causal, window, seqused=None):
    """(out (Lq, H, D), lse (H, Lq)) of sequence b in float64."""
    q0, q1 = int(case["cu_q"][b]), int(case["cu_q"][b + 1])
    k0 = int(case["cu_k"][b])
    n = int(case["lens_k"][b] if seqused is None else seqused[b])
    h, d = case["q"].shape[1], case["q"].shape[2]
    if n == 0:
        return np.zeros((q1 - q0, h, d)), np.full((h, q1 - q0), -np.inf)
    bhld = (lambda x: x.transpose(1, 0, 2)[None])
    out, lse = attention_reference(bhld(case["q"][q0:q1]), bhld(case["k"][k0:k0 + n]),
                                   bhld(case["v"][k0:k0 + n]), causal=causal,
                                   window=None if window == (-1, -1) else window,
                                   return_lse=True)
    return out[0].transpose(1, 0, 2), lse[0]


def run_varlen(case, *, causal=False, window=(-1, -1), lse=True, device_offsets=True,
               seqused=None, what="", cu_q=None, cu_k=None, check=True):
    """flash_attn_varlen_func on the case (out and LSE poisoned with NaN first); every
    sequence checked against the reference, padding rows checked unwritten. cu_q / cu_k: the
    offsets the kernels get (default: the case's; planted bad ones for bounds tests, then
    check=False). Returns (out, lse) as host arrays."""
    q = case["q"]
    total_q, H, D = q.shape
    dev = {n: tensors.from_numpy(case[n]) for n in ("q", "k", "v")}
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    lse_out = None
    cu_q = case["cu_q"] if cu_q is None else cu_q
    cu_k = case["cu_k"] if cu_k is None else cu_k
    wrap = DeviceInt32 if device_offsets else (lambda x: np.asarray(x, np.int32))
    kw = dict(causal=causal, window_size=window, return_lse=lse, out=out)
    if seqused is not None:
        kw["seqused_k"] = wrap(seqused)
    return _call_and_check(case, (dev["q"], dev["k"], dev["v"], wrap(cu_q), wrap(cu_k)), kw,
                           dev, out, seqused=seqused, check=check, what=what)


def _call_and_check(case, args, kw, dev, out, *, seqused, check, what):
    """flash_attn_varlen_func(*args, max lengths, **kw), then (check) every sequence against
    the reference; the device buffers freed. Returns (out, lse) as host arrays."""
    res = ptxattn.flash_attn_varlen_func(
        *args, int(max(case["lens_q"], default=0)), int(max(case["lens_k"], default=0)), **kw)
    driver.synchronize()
    got = out.to_numpy().astype(np.float32)
    got_lse = res[1].to_numpy() if kw["return_lse"] else None
    if check:
        check_varlen(case, got, got_lse, causal=kw["causal"], window=kw["window_size"],
                     seqused=seqused, what=what)
    for x in (*dev.values(), out):
        x.free()
    return got, got_lse


def check_varlen(case, got, got_lse, *, causal, window, seqused=None, what=""):
    label = (f"{what} H={case['q'].shape[1]}:{case['k'].shape[1]} D={case['q'].shape[2]} "
             f"lens_q={case['lens_q'].tolist()} lens_k={case['lens_k'].tolist()} "
             f"causal={causal} window={window}")
    failures = []
    covered = np.zeros(got.shape[0], bool)
    for b in range(len(case["lens_q"])):
        q0, q1 = int(case["cu_q"][b]), int(case["cu_q"][b + 1])
        covered[q0:q1] = True
        if q1 == q0:
            continue
        ref, ref_lse = sequence_reference(case, b, causal=causal, window=window,
                                          seqused=seqused)
        g = got[q0:q1]
        nan = int(np.count_nonzero(~np.isfinite(g)))
        m = error_metrics(g, ref)
        ok = nan == 0 and (passes(m) if np.abs(ref).max() > 0 else m["max_abs"] == 0)
        if not ok:
            err = np.abs(np.nan_to_num(g.astype(np.float64), nan=1e9) - ref).max(axis=-1)
            r, h = np.unravel_index(int(np.argmax(err)), err.shape)
            bad_rows = sorted({int(x) for x in np.nonzero(err > 1e-2 * max(
                np.abs(ref).max(), 1e-30))[0]})
            failures.append(f"sequence {b} (rows {q0}..{q1 - 1}): {m}, NaN {nan}, worst local "
                            f"row {r} head {h} err {err[r, h]:.3g}, bad local rows "
                            f"{bad_rows[:10]}{'...' if len(bad_rows) > 10 else ''}")
            continue
        if got_lse is not None:
            gl = got_lse[:, q0:q1]
            if np.isnan(gl).any():
                failures.append(f"sequence {b}: {int(np.isnan(gl).sum())} LSE values unwritten")
                continue
            empty = np.isneginf(ref_lse)
            if (np.isneginf(gl) != empty).any():
                failures.append(f"sequence {b}: LSE -inf where a row sees no key, exactly; "
                                f"first wrong (head, row) "
                                f"{np.argwhere(np.isneginf(gl) != empty)[0].tolist()}")
                continue
            if (~empty).any():
                e = np.abs(gl[~empty] - ref_lse[~empty]).max()
                if e > LSE_TOL:
                    failures.append(f"sequence {b}: LSE max abs error {e:.3g}")
    pad = got[~covered]
    if pad.size and np.isfinite(pad).any():
        rows = np.flatnonzero(~covered)[np.isfinite(pad).any(axis=(1, 2))]
        failures.append(f"rows no sequence covers were written: {rows[:10].tolist()}")
    assert not failures, f"{label}:\n  " + "\n  ".join(failures)


def paged_varlen_case(rng, lens_q, lens_k, *, page_size, H=4, Hkv=2, D=64, spare_pages=3,
                      extra_columns=1):
    """A varlen case whose keys live in a paged cache: the packed k, v of varlen_case (what
    the reference reads) scattered into pages of one shuffled pool (spare pages no sequence
    uses, filled with fresh values), each sequence's block-table row padded with -1 past its
    last page (extra_columns more than the longest needs)."""
    case = varlen_case(rng, lens_q, lens_k, H=H, Hkv=Hkv, D=D)
    lens_k = case["lens_k"]
    need = -(-lens_k // page_size)
    max_pages = int(need.max(initial=0)) + extra_columns
    num_pages = int(need.sum()) + spare_pages
    pool = rng.permutation(num_pages)
    table = np.full((len(lens_k), max_pages), -1, np.int32)
    k_pages = bf16(rng, (num_pages, page_size, Hkv, D))
    v_pages = bf16(rng, (num_pages, page_size, Hkv, D))
    at = 0
    for b, n in enumerate(lens_k):
        table[b, :need[b]] = pool[at:at + need[b]]
        at += need[b]
        k0 = int(case["cu_k"][b])
        for j in range(int(n)):
            page, row = table[b, j // page_size], j % page_size
            k_pages[page, row] = case["k"][k0 + j]
            v_pages[page, row] = case["v"][k0 + j]
    case.update(k_pages=k_pages, v_pages=v_pages, table=table)
    return case


def run_paged_varlen(case, *, causal=False, window=(-1, -1), lse=True, device_offsets=True,
                     device_table=True, seqused=None, table=None, what="", check=True):
    """flash_attn_varlen_func(..., block_table=) on a paged_varlen_case (out and LSE poisoned
    first), every sequence checked against the packed reference. table: the block table the
    kernels get (default the case's; planted bad ones for bounds tests). Returns (out, lse)."""
    q = case["q"]
    dev = {n: tensors.from_numpy(case[n]) for n in ("q", "k_pages", "v_pages")}
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    wrap = DeviceInt32 if device_offsets else (lambda x: np.asarray(x, np.int32))
    table = case["table"] if table is None else table
    kw = dict(causal=causal, window_size=window, return_lse=lse, out=out,
              block_table=DeviceInt32(table) if device_table else np.asarray(table, np.int32))
    if seqused is not None:
        kw["seqused_k"] = wrap(seqused)
    return _call_and_check(case, (dev["q"], dev["k_pages"], dev["v_pages"], wrap(case["cu_q"]),
                                  wrap(case["cu_k"])), kw, dev, out, seqused=seqused,
                           check=check, what=what)
