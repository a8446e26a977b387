"""NumPy float64 reference attention and the pass bar every stage must meet.

The reference sees exactly what the kernel sees: inputs rounded to bf16
(float32 -> bf16 with ml_dtypes; float64 goes through float32 first), then
computed in float64, chunked over query rows so that a 16K x 16K problem
never materialises a full score matrix.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

PASS_REL_L2 = 8e-3
PASS_MAX_ABS = 2e-2
_CHUNK_ELEMENTS = 1 << 24     # float64 scores per chunk: 128 MiB


def _bf16_to_f64(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    if x.dtype != BF16:
        x = x.astype(np.float32).astype(BF16)
    return x.astype(np.float64)


def _to_bhld(x: np.ndarray, layout: str) -> np.ndarray:
    layout = layout.lower()
    if layout == "bhld":
        return x
    if layout == "bshd":
        return x.transpose(0, 2, 1, 3)
    raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")


def attention_reference(q, k, v, scale: float | None = None, layout: str = "bhld",
                        chunk_rows: int | None = None, rows=None) -> np.ndarray:
    """softmax(scale * q k^T) v in float64, returned in `layout`.

    `rows` (an index array or slice of query positions) restricts the result
    to those query rows, for checking big shapes on a subset; `chunk_rows`
    bounds the query rows per step (default: ~16M scores per step).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 4:
            raise ValueError(f"{name}: expected a rank-4 array, (B, H, L, D) for layout 'bhld' "
                             f"or (B, L, H, D) for 'bshd', got shape {np.shape(x)}")
    qh = _to_bhld(_bf16_to_f64(q), layout)
    kh = _to_bhld(_bf16_to_f64(k), layout)
    vh = _to_bhld(_bf16_to_f64(v), layout)
    if rows is not None:
        qh = qh[:, :, rows]
    batch, heads, seq_q, head_dim = qh.shape
    seq_k = kh.shape[2]
    if seq_k == 0:
        raise ValueError("k: key length is 0; softmax over no keys is undefined")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * seq_k))
    out = np.empty((batch, heads, seq_q, vh.shape[3]), np.float64)
    kt = kh.transpose(0, 1, 3, 2)
    for start in range(0, seq_q, chunk_rows):
        stop = min(seq_q, start + chunk_rows)
        s = np.matmul(qh[:, :, start:stop], kt) * scale
        s -= s.max(axis=-1, keepdims=True)          # stable: the largest exponent is 0
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[:, :, start:stop] = np.matmul(s, vh)
    return out if layout.lower() == "bhld" else out.transpose(0, 2, 1, 3)


def error_metrics(out, ref) -> dict:
    """rel_l2 = |out - ref| / |ref|, max_abs, nan_count (NaN or Inf entries in out)."""
    o = np.asarray(out)
    o = (o.astype(np.float32) if o.dtype == BF16 else o).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise ValueError(f"out: shape {o.shape} does not match the reference's {r.shape}")
    bad = int(np.count_nonzero(~np.isfinite(o)))
    if o.size == 0:
        return {"rel_l2": 0.0, "max_abs": 0.0, "nan_count": 0}
    diff = o - r
    ref_norm = float(np.linalg.norm(r))
    rel = float(np.linalg.norm(diff)) / ref_norm if ref_norm else float(np.linalg.norm(diff))
    return {"rel_l2": rel, "max_abs": float(np.max(np.abs(diff))), "nan_count": bad}


def passes(metrics: dict) -> bool:
    """The pass bar of bench/README.md: finite, rel L2 <= 8e-3, max abs <= 2e-2."""
    return (metrics["nan_count"] == 0
            and metrics["rel_l2"] <= PASS_REL_L2
            and metrics["max_abs"] <= PASS_MAX_ABS)


def random_qkv(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
               layout: str = "bhld", seed: int = 0):
    """Standard-normal q, k, v as ml_dtypes.bfloat16 arrays in `layout`."""
    layout = layout.lower()
    if layout not in ("bhld", "bshd"):
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    rng = np.random.default_rng(seed)

    def one(seq):
        shape = (batch, heads, seq, head_dim) if layout == "bhld" else (batch, seq, heads, head_dim)
        return rng.standard_normal(shape, dtype=np.float32).astype(BF16)

    return one(seq_q), one(seq_k), one(seq_k)
