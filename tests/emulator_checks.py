"""Checks of a kernel run on the CPU emulator against the float64 reference (the project's
bar), shared by the emulator's kernel tests. No tests here."""

from __future__ import annotations

import numpy as np

import ptxattn
from ptxattn import reference

LSE_TOL = 2e-3          # absolute, natural-log units: tests/test_gpu_production.py's bar


def plant(fake, *edits):
    """Make every module the emulated driver loads carry planted bugs: edits are (old, new)
    text replacements of the expanded PTX; each must match (so a control cannot silently test
    an unchanged kernel)."""
    def rewrite(text):
        for old, new in edits:
            count = text.count(old)
            assert count >= 1, f"planted edit found nothing to replace: {old!r}"
            text = text.replace(old, new)
        return text
    fake.rewrite_ptx = rewrite


def qkv(batch, heads, seq_q, seq_k, head_dim, *, heads_kv=None, layout="bhld", seed=0):
    """Fresh random normal inputs (never zeros), float32, rounded to bf16 by the library."""
    rng = np.random.default_rng(seed)
    hk = heads if heads_kv is None else heads_kv

    def make(h, n):
        shape = (batch, h, n, head_dim) if layout == "bhld" else (batch, n, h, head_dim)
        return rng.standard_normal(shape).astype(np.float32)
    return make(heads, seq_q), make(hk, seq_k), make(hk, seq_k)


def check(fake, stage, batch, heads, seq_q, seq_k, head_dim, *, heads_kv=None,
          layout="bhld", causal=False, window=None, diagonal="bottom_right",
          return_lse=False, seed=0):
    """Run attention() on the emulator (outputs come poisoned: fresh emulated memory is all
    NaN) and assert the bar; returns the launch report. A failure names the worst rows and
    heads, the error sizes and the NaN count."""
    q, k, v = qkv(batch, heads, seq_q, seq_k, head_dim, heads_kv=heads_kv, layout=layout,
                  seed=seed)
    kw = dict(stage=stage, layout=layout, causal=causal, window=window, diagonal=diagonal)
    result = ptxattn.attention(q, k, v, return_lse=return_lse, **kw)
    out, lse = result if return_lse else (result, None)
    ref = reference.attention_reference(q, k, v, layout=layout, causal=causal, window=window,
                                        diagonal=diagonal, return_lse=return_lse)
    ref, ref_lse = ref if return_lse else (ref, None)
    metrics = reference.error_metrics(out, ref)
    case = (f"{stage or 'production'} B={batch} H={heads} Hkv={heads_kv or heads} Lq={seq_q} "
            f"Lk={seq_k} D={head_dim} {layout} causal={causal} window={window} "
            f"diagonal={diagonal}")
    if not reference.passes(metrics):
        o = np.asarray(out, np.float32).astype(np.float64)
        err = np.abs(np.nan_to_num(o, nan=1e9) - ref)
        bhld = err if layout == "bhld" else err.transpose(0, 2, 1, 3)
        per_row = bhld.max(axis=-1)                     # (B, H, L)
        worst = np.argsort(per_row.reshape(-1))[::-1][:5]
        where = [np.unravel_index(i, per_row.shape) for i in worst]
        nan_rows = sorted({int(r) for r in np.argwhere(~np.isfinite(
            o if layout == "bhld" else o.transpose(0, 2, 1, 3)))[:, 2]})[:12]
        raise AssertionError(
            f"{case}: {metrics}; worst (batch, head, row): "
            f"{[(int(b), int(h), int(r), float(per_row[b, h, r])) for b, h, r in where]}; "
            f"rows with NaN/Inf: {nan_rows}")
    if return_lse:
        lse = np.asarray(lse, np.float64)
        fin = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(lse), fin), \
            f"{case}: LSE finite where the reference is not (or the reverse)"
        err = np.abs(lse[fin] - ref_lse[fin])
        assert err.size == 0 or err.max() <= LSE_TOL, f"{case}: LSE max error {err.max():.3g}"
    report = fake.launches[-1][-1]
    assert report is not None and not report.hazards
    return report
