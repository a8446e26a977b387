"""NumPy float64 reference attention and the pass bar every stage must meet.

The reference sees exactly what the kernel sees: inputs rounded to bf16
(float32 -> bf16 with ml_dtypes; float64 goes through float32 first), then
computed in float64, chunked over query rows so that a 16K x 16K problem
never materialises a full score matrix.
"""

from __future__ import annotations

import math
import numbers

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# The bar (README.md, "Correctness"). bf16 rounding of the exact answer alone gives a relative
# L2 error of ~1.7e-3 and the kernels sit at 2.2-2.4e-3, so 4e-3 leaves room for the kernel's
# fp32 accumulation but not for a uniform bias of 0.5% or a wrong row here and there.
PASS_REL_L2 = 4e-3
PASS_MAX_ABS_FRACTION = 1e-2          # max |error| <= 1e-2 * max |reference|
# Against the peer on the same inputs (GPU runs with PyTorch): ours <= 1.25 x cuDNN's + 5e-4.
PEER_FACTOR = 1.25
PEER_SLACK = 5e-4
# The query tiles' row counts: 128 (two consumer warpgroups of 64; the lineage's 64-row tiles
# divide it) and 192 (the production kernel's three consumers at D = 64). Their least common
# multiple is the period after which a row sits at the same place in every tile.
# tests/test_reference.py checks that every registered kernel's tile divides one of these.
TILE_ROWS = (128, 192)
ROW_PERIOD = math.lcm(*TILE_ROWS)     # 384
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


def _window(causal: bool, window) -> tuple[int, int] | None:
    """(left, right) with -1 for unbounded, or None for no mask; causal is (-1, 0).

    causal=True together with a window keeps both masks: the right bound becomes min(right, 0).
    """
    if window is None:
        return (-1, 0) if causal else None
    try:
        left, right = window
    except (TypeError, ValueError):
        left = right = None
    if not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in (left, right)):
        raise ValueError(f"window: expected (left, right) integers, got {window!r}")
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"window: each bound is >= 0, or -1 for unbounded; got {window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def key_mask(query_rows, seq_q: int, seq_k: int, window: tuple[int, int],
             diagonal: str = "bottom_right") -> np.ndarray:
    """[len(query_rows), seq_k] booleans: True where query i may see key j.

    Aligned bottom-right (FlashAttention's convention when Lq != Lk): with d = Lk - Lq,
    query i sees key j iff i + d - left <= j <= i + d + right (a bound of -1 is no bound).
    diagonal="top_left" (PyTorch's is_causal) takes d = 0.
    """
    if diagonal not in ("bottom_right", "top_left"):
        raise ValueError(f"diagonal: expected 'bottom_right' or 'top_left', got {diagonal!r}")
    left, right = window
    offset = seq_k - seq_q if diagonal == "bottom_right" else 0
    i = np.asarray(query_rows, dtype=np.int64)[:, None] + offset
    j = np.arange(seq_k, dtype=np.int64)[None, :]
    keep = np.ones((i.shape[0], seq_k), dtype=bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def _check_rank4(name: str, x: np.ndarray) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name}: expected a 4-D array (B, H, L, D) or (B, L, H, D), "
                         f"got {x.ndim}-D with shape {x.shape}")


def attention_reference(q, k, v, scale: float | None = None, layout: str = "bhld",
                        chunk_rows: int | None = None, rows=None, *, causal: bool = False,
                        window=None, return_lse: bool = False,
                        diagonal: str = "bottom_right"):
    """softmax(scale * q k^T) v in float64, returned in `layout`.

    `rows` (an index array or slice of query positions) restricts the result
    to those query rows, for checking big shapes on a subset; `chunk_rows`
    bounds the query rows per step (default: ~16M scores per step).

    GQA/MQA: k and v may have fewer heads than q (heads_kv dividing heads); query head h
    uses key/value head h // (heads // heads_kv). `causal` / `window=(left, right)` mask
    keys (see key_mask); a row that sees no key at all has output 0 and LSE -inf.
    With return_lse=True the result is (out, lse): lse[b, h, i] is the natural-log
    log-sum-exp over the visible keys of scale * q_i . k_j, float64, shape (B, H, rows).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rank4(name, np.asarray(x))
    qh = _to_bhld(_bf16_to_f64(q), layout)
    kh = _to_bhld(_bf16_to_f64(k), layout)
    vh = _to_bhld(_bf16_to_f64(v), layout)
    batch, heads, full_q, head_dim = qh.shape
    if kh.shape[:3] != vh.shape[:3]:
        raise ValueError(f"v: batch, heads and length must match k's (BHLD {kh.shape[:3]}), "
                         f"got {vh.shape[:3]}")
    if kh.shape[0] != batch or kh.shape[3] != head_dim:
        raise ValueError(f"k: batch and head dim must match q's ({batch}, {head_dim}), "
                         f"got ({kh.shape[0]}, {kh.shape[3]})")
    heads_kv, seq_k = kh.shape[1], kh.shape[2]
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"k: key/value heads ({heads_kv}) must divide query heads ({heads})")
    if seq_k == 0:
        raise ValueError("k: key length is 0; softmax over no keys is undefined")
    mask = _window(causal, window)
    query_rows = np.arange(full_q)
    if rows is not None:
        query_rows = query_rows[rows]
        qh = qh[:, :, rows]
    seq_q = qh.shape[2]
    group = heads // heads_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * seq_k))
    # (B, Hkv, G, L, D): query heads grouped under their key/value head. Each chunk's G x rows
    # go into one matrix per k/v head: a matmul broadcast over G (a stride-0 operand) leaves
    # BLAS for NumPy's own loop, 5x slower (seen 2026-12-01, NumPy 2.4).
    qg = qh.reshape(batch, heads_kv, group, seq_q, head_dim)
    kt = kh.transpose(0, 1, 3, 2)
    out = np.empty((batch, heads_kv, group, seq_q, vh.shape[3]), np.float64)
    lse = np.empty((batch, heads_kv, group, seq_q), np.float64)
    for start in range(0, seq_q, chunk_rows):
        stop = min(seq_q, start + chunk_rows)
        rows_here = stop - start
        s = np.matmul(qg[:, :, :, start:stop].reshape(batch, heads_kv, group * rows_here,
                                                      head_dim), kt)
        s = s.reshape(batch, heads_kv, group, rows_here, seq_k) * scale
        if mask is not None:
            s += np.where(key_mask(query_rows[start:stop], full_q, seq_k, mask, diagonal), 0.0, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        empty = np.isneginf(m)                       # rows that see no key
        m = np.where(empty, 0.0, m)
        s -= m                                       # stable: the largest exponent is 0
        np.exp(s, out=s)
        total = s.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            lse[..., start:stop] = (m + np.log(total))[..., 0]
        s /= np.where(empty, 1.0, total)
        out[..., start:stop, :] = np.matmul(
            s.reshape(batch, heads_kv, group * rows_here, seq_k), vh).reshape(
            batch, heads_kv, group, rows_here, -1)
    out = out.reshape(batch, heads, seq_q, -1)
    lse = lse.reshape(batch, heads, seq_q)
    if layout.lower() != "bhld":
        out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out


def error_metrics(out, ref) -> dict:
    """rel_l2 = |out - ref| / |ref|, max_abs, ref_max_abs = max |ref|, and nan_count: the
    non-finite entries of out (NaN and +-Inf both count)."""
    o = np.asarray(out)
    o = (o.astype(np.float32) if o.dtype == BF16 else o).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise ValueError(f"out: shape {o.shape} does not match the reference's {r.shape}")
    bad = int(np.count_nonzero(~np.isfinite(o)))
    if o.size == 0:
        return {"rel_l2": 0.0, "max_abs": 0.0, "ref_max_abs": 0.0, "nan_count": 0}
    diff = o - r
    ref_norm = float(np.linalg.norm(r))
    rel = float(np.linalg.norm(diff)) / ref_norm if ref_norm else float(np.linalg.norm(diff))
    return {"rel_l2": rel, "max_abs": float(np.max(np.abs(diff))),
            "ref_max_abs": float(np.max(np.abs(r))), "nan_count": bad}


def passes(metrics: dict) -> bool:
    """The correctness bar: no NaN/Inf, rel L2 <= 4e-3, max |err| <= 1e-2 * max |ref|."""
    return (metrics["nan_count"] == 0
            and metrics["rel_l2"] <= PASS_REL_L2
            and metrics["max_abs"] <= PASS_MAX_ABS_FRACTION * metrics["ref_max_abs"])


def peer_bound(peer_rel_l2: float) -> float:
    """The largest relative L2 error ours may have beside a peer's on the same inputs."""
    return PEER_FACTOR * float(peer_rel_l2) + PEER_SLACK


def passes_against_peer(ours: dict, peer: dict) -> bool:
    """The GPU-side relative bar: our rel L2 <= 1.25 x the peer's (cuDNN) + 5e-4."""
    return float(ours["rel_l2"]) <= peer_bound(peer["rel_l2"])


def sample_rows(seq_q: int, count: int = 256, seed: int = 0,
                period: int = ROW_PERIOD, tiles: tuple[int, ...] = TILE_ROWS) -> np.ndarray:
    """Sorted query rows to compare, at seeded random positions (never a fixed stride).

    Every row position inside a tile of each size in `tiles` (128 rows: both consumer
    warpgroups; 192 rows: all three of the D = 64 build; in each, every warp and both halves of
    each accumulator fragment) appears at least once when count leaves room for it (194 rows
    at the defaults: one residue modulo `period` per position of the largest tile, chosen so
    that the smaller tile's positions are all hit too), each in a randomly chosen stretch of
    `period` rows; the first and last rows (the tail) are always in. The rest are drawn at
    random. All rows when seq_q <= count. `period` must be a multiple of every tile size.
    """
    if seq_q < 0 or count < 1 or period < 1 or any(t < 1 or period % t for t in tiles):
        raise ValueError(f"sample_rows: expected seq_q >= 0, count >= 1, period >= 1 and a "
                         f"multiple of every tile size; got {seq_q}, {count}, {period}, {tiles}")
    if seq_q <= count:
        return np.arange(seq_q)
    rng = np.random.default_rng(seed)
    picked = {0, seq_q - 1}
    # Residues modulo `period`: for each position of the largest tile (in random order) one of
    # the residues that put a row there, preferring one that also hits a position of a smaller
    # tile not hit yet; then whatever positions of the smaller tiles are still missing.
    largest = max(tiles)
    covered = {t: set() for t in tiles}
    residues = []

    def take(r):
        residues.append(int(r))
        for t in tiles:
            covered[t].add(int(r) % t)

    for c in rng.permutation(min(largest, seq_q)):
        options = [int(r) for r in range(c, min(period, seq_q), largest)]
        fresh = [r for r in options
                 if any(r % t not in covered[t] for t in tiles if t != largest)]
        take(fresh[rng.integers(len(fresh))] if fresh else options[rng.integers(len(options))])
    for t in sorted(tiles):
        for c in rng.permutation(min(t, seq_q)):
            if int(c) not in covered[t]:
                options = list(range(int(c), min(period, seq_q), t))
                take(options[rng.integers(len(options))])
    for r in residues[:max(0, count - 2)]:
        stretches = (seq_q - 1 - r) // period + 1      # stretches k with k * period + r < seq_q
        picked.add(int(r + period * rng.integers(stretches)))
    if len(picked) < count:
        rest = np.setdiff1d(np.arange(seq_q), np.fromiter(picked, np.int64))
        picked.update(int(x) for x in rng.choice(rest, count - len(picked), replace=False))
    return np.array(sorted(picked))


def random_qkv(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
               layout: str = "bhld", seed: int = 0, heads_kv: int | None = None):
    """Standard-normal q, k, v as ml_dtypes.bfloat16 arrays in `layout`; k and v with
    heads_kv heads (GQA/MQA; default: as many as q)."""
    layout = layout.lower()
    if layout not in ("bhld", "bshd"):
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    rng = np.random.default_rng(seed)

    def one(seq, h):
        shape = (batch, h, seq, head_dim) if layout == "bhld" else (batch, seq, h, head_dim)
        return rng.standard_normal(shape, dtype=np.float32).astype(BF16)

    hkv = heads if heads_kv is None else heads_kv
    return one(seq_q, heads), one(seq_k, hkv), one(seq_k, hkv)
