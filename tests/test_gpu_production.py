"""The production kernel on the GPU against the float64 reference (skipped without a GPU).

What it adds over stage 14, each checked on fresh standard-normal inputs with outputs (and the
log-sum-exp) poisoned with NaN before the launch: any lengths (ragged Q and K/V tiles),
Lq != Lk both ways, GQA/MQA, both layouts, the log-sum-exp, and the builds for head dims 64
and 256 (stages.PRODUCTION_VARIANTS). Rows are compared at random (seeded) positions, never at
tile-aligned strides, plus every row's last tile edge.
"""

from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from ptxattn import stages, tensors
from ptxattn.reference import BF16, attention_reference, error_metrics, passes, sample_rows
from gpu_checks import launch_once

pytestmark = pytest.mark.gpu

D = 128
PROD = stages.PRODUCTION
MAX_CHECKED_ROWS = 256
LSE_TOL = 2e-3          # absolute, in natural-log units (lse is O(1..10) here)


def qkv(B, H, Hkv, Lq, Lk, layout, seed, d=D):
    rng = np.random.default_rng(seed)

    def one(h, L):
        shape = (B, h, L, d) if layout == "bhld" else (B, L, h, d)
        return rng.standard_normal(shape, dtype=np.float32).astype(BF16)

    return one(H, Lq), one(Hkv, Lk), one(Hkv, Lk)


def checked_rows(Lq, seed):
    """Random query rows (seeded; reference.sample_rows), the first and the last among them:
    every row position of a 128-row and of a 192-row tile (D = 64's three consumers) in every
    test, and the ragged edge of the last Q tile. All rows up to MAX_CHECKED_ROWS."""
    return sample_rows(Lq, MAX_CHECKED_ROWS, seed=seed + 7919)


def launch(q, k, v, layout, *, lse=True, **mask):
    """Device copies in, NaN-poisoned out and lse, one launch, both back on the host."""
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                                   # bf16 NaN
    p = ptxattn.prepare(qd, kd, vd, layout=layout, out=out, return_lse=lse, **mask)
    d = q.shape[-1]
    masked = bool(mask.get("causal")) or mask.get("window") not in (None, (-1, -1))
    assert p.stage.production and p.stage.head_dims == (d,)      # this head dim's build
    build = stages.PRODUCTION_VARIANTS[(d, masked)]
    assert (p.stage.block_m, p.stage.block_n) == (build.block_m, build.block_n)
    assert p.block == (build.threads, 1, 1)      # D = 64: 512 threads, three consumers
    assert p.smem_bytes == build.smem_bytes
    assert (("PTXATTN_MASKED", "1") in p.stage.defines) == masked
    return launch_once(p, out, (qd, kd, vd), lse)


def check(q, k, v, layout, seed, lse=True, **mask):
    """Against the float64 reference on sampled rows; rows that see no key must be exactly 0
    with lse -inf (everything else finite)."""
    o, l = launch(q, k, v, layout, lse=lse, **mask)
    assert np.isfinite(o.astype(np.float32)).all(), "unwritten or non-finite output"
    seq_axis = 2 if layout == "bhld" else 1
    rows = checked_rows(q.shape[seq_axis], seed)
    causal = mask.get("causal", False)
    ref, ref_lse = attention_reference(q, k, v, layout=layout, rows=rows, return_lse=True,
                                       causal=causal, window=mask.get("window"),
                                       diagonal=mask.get("diagonal", "bottom_right"))
    m = error_metrics(np.take(o, rows, axis=seq_axis), ref)
    if np.abs(ref).max() > 0:
        assert passes(m), m
    else:                                             # every sampled row sees no key
        assert m["max_abs"] == 0, m
    if lse:
        assert l.dtype == np.float32 and l.shape == (q.shape[0], q.shape[1 if layout == "bhld"
                                                                        else 2], q.shape[seq_axis])
        # every row's lse is written (rows with no key: -inf), not only the sampled ones
        assert not np.isnan(l).any(), f"{int(np.isnan(l).sum())} lse values left unwritten (NaN)"
        got = l[:, :, rows].astype(np.float64)
        empty = np.isneginf(ref_lse)
        assert (np.isneginf(got) == empty).all(), "rows with no key: lse must be -inf, others finite"
        assert np.isfinite(got[~empty]).all(), "unwritten or non-finite lse"
        if (~empty).any():
            err = np.abs(got[~empty] - ref_lse[~empty]).max()
            assert err <= LSE_TOL, f"lse max abs error {err:.2e}"
    return m


LENGTHS = [1, 2, 63, 127, 129, 1000, 4095, 8191]


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_any_length(L, layout):
    B, H = (2, 3) if L <= 1000 else (1, 2)
    q, k, v = qkv(B, H, H, L, L, layout, seed=L)
    check(q, k, v, layout, seed=L)


CROSS = [(1, 1000), (1000, 1), (129, 4095), (4095, 129), (63, 257), (640, 64), (77, 8191)]


@pytest.mark.parametrize("Lq,Lk", CROSS)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_cross_attention(Lq, Lk, layout):
    q, k, v = qkv(2, 2, 2, Lq, Lk, layout, seed=Lq * 31 + Lk)
    check(q, k, v, layout, seed=Lq + Lk)


@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 4), (8, 2), (8, 1), (16, 2), (12, 1)])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_gqa_and_mqa(H, Hkv, layout):
    q, k, v = qkv(2, H, Hkv, 300, 517, layout, seed=H * 10 + Hkv)
    check(q, k, v, layout, seed=H + Hkv)


def test_gqa_reads_the_right_kv_head():
    """Each K/V head distinct and far apart: a kernel that read head h instead of h // g (or
    any fixed head) would give another output entirely, far outside the bar."""
    q, k, v = qkv(1, 8, 2, 256, 384, "bhld", seed=5)
    v = v.astype(np.float32)
    v[:, 1] += 4.0                                    # K/V head 1 sits elsewhere
    v = v.astype(BF16)
    check(q, k, v, "bhld", seed=5)


def test_lse_is_optional_and_changes_nothing():
    q, k, v = qkv(2, 4, 4, 1000, 1000, "bhld", seed=11)
    with_lse, _ = launch(q, k, v, "bhld", lse=True)
    without, none = launch(q, k, v, "bhld", lse=False)
    assert none is None
    np.testing.assert_array_equal(with_lse.view(np.uint16), without.view(np.uint16))


def test_numpy_path_returns_out_and_lse():
    q, k, v = qkv(1, 4, 2, 129, 300, "bhld", seed=3)
    out, lse = ptxattn.attention(q, k, v, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == q.shape
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == (1, 4, 129)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    assert passes(error_metrics(out, ref))
    assert np.abs(lse - ref_lse).max() <= LSE_TOL


def test_repeated_launches_are_deterministic_and_correct():
    """A race shows as an error that moves between launches: the same inputs, five launches,
    the same bits, each against the reference."""
    q, k, v = qkv(1, 4, 2, 1000, 777, "bshd", seed=9)
    first = None
    for _ in range(5):
        o, l = launch(q, k, v, "bshd")
        if first is None:
            first = (o, l)
            check(q, k, v, "bshd", seed=9)
        np.testing.assert_array_equal(o.view(np.uint16), first[0].view(np.uint16))
        np.testing.assert_array_equal(l.view(np.uint32), first[1].view(np.uint32))


@pytest.mark.slow
def test_video_shape_bshd():
    """(1, 12, 32760, 128) BSHD: Wan 2.1 at 480p, 81 frames. A ragged last tile of 120 rows."""
    q, k, v = qkv(1, 12, 12, 32760, 32760, "bshd", seed=32760)
    check(q, k, v, "bshd", seed=1)


def test_small_persistent_grid_walks_many_ragged_tiles(monkeypatch):
    """Two CTAs walk every tile: ring positions and barrier phases run on across ragged tiles."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    q, k, v = qkv(2, 3, 1, 1000, 1001, "bhld", seed=21)
    check(q, k, v, "bhld", seed=21)


# --------------------------------------------------------------------------- masks

@pytest.mark.parametrize("L", [1, 63, 129, 1000, 4095])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_causal_square(L, layout):
    q, k, v = qkv(2, 3, 3, L, L, layout, seed=L + 1)
    check(q, k, v, layout, seed=L, causal=True)


@pytest.mark.parametrize("Lq,Lk", [(100, 1000), (1000, 100), (129, 4095), (640, 513), (1, 777)])
@pytest.mark.parametrize("diagonal", ["bottom_right", "top_left"])
def test_causal_cross(Lq, Lk, diagonal):
    """Bottom-right: a prefill against a cache (Lq < Lk), or rows that see no key (Lq > Lk);
    top-left: PyTorch's is_causal."""
    q, k, v = qkv(2, 2, 2, Lq, Lk, "bhld", seed=Lq + 3 * Lk)
    check(q, k, v, "bhld", seed=Lq, causal=True, diagonal=diagonal)


WINDOWS = [(128, 0), (17, 5), (0, 0), (300, 300), (-1, 100), (50, -1), (1000, 0)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_sliding_window(window, layout):
    q, k, v = qkv(1, 4, 2, 1000, 1301, layout, seed=sum(window) + 7)
    check(q, k, v, layout, seed=5, window=window)


@pytest.mark.parametrize("window", [(0, 2**31 - 1), (2**31 - 1, 0), (2**40, 5)])
def test_huge_window_sides_are_unbounded(window):
    """A side of 2^30 or more means no bound (the review's case: 2^31 - 1 overflowed the
    kernel's s32 key-range arithmetic; 2^32 wrapped to 0 when packed)."""
    q, k, v = qkv(1, 2, 1, 300, 300, "bhld", seed=window[1] % 97 + 3)
    check(q, k, v, "bhld", seed=11, window=window)


def test_window_that_leaves_rows_without_keys():
    """Lq > Lk bottom-right with a narrow window: the first rows see no key (output 0, lse
    -inf); the others see at most 11 keys."""
    q, k, v = qkv(1, 2, 2, 700, 300, "bhld", seed=77)
    check(q, k, v, "bhld", seed=77, window=(10, 0))


@pytest.mark.parametrize("H,Hkv", [(8, 2), (8, 1)])
def test_causal_gqa_lse(H, Hkv):
    q, k, v = qkv(2, H, Hkv, 1500, 1500, "bshd", seed=H * Hkv)
    check(q, k, v, "bshd", seed=H, causal=True)


def test_causal_many_tiles_small_grid(monkeypatch):
    """Two CTAs walk every (uneven) causal tile: ring positions and phases across tiles of
    different lengths."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    q, k, v = qkv(2, 3, 1, 1000, 1000, "bhld", seed=23)
    check(q, k, v, "bhld", seed=23, causal=True)


def test_masked_launches_are_deterministic():
    q, k, v = qkv(1, 4, 2, 1000, 1000, "bhld", seed=31)
    first, _ = launch(q, k, v, "bhld", causal=True)
    for _ in range(3):
        again, _ = launch(q, k, v, "bhld", causal=True)
        np.testing.assert_array_equal(again.view(np.uint16), first.view(np.uint16))


# ---- head dims 64 and 256: their own builds (tile shape, carve-up, O staging) -----------------
# D = 64: BLOCK_N 128, one 128-byte swizzle column per row. D = 256: BLOCK_N 64, O staged in
# the consumer's Q rows and Q released only after the O store read them (production.ptx's
# build table): the tests below walk ragged tiles, ring wrap-around and the Q/O hand-over.

HEAD_DIM_BUILDS = [64, 256]
TAILS = [1, 63, 129, 1000]


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
@pytest.mark.parametrize("L", TAILS)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_head_dim_any_length(d, L, layout):
    q, k, v = qkv(2, 3, 3, L, L, layout, seed=d + L, d=d)
    check(q, k, v, layout, seed=d + L)


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
@pytest.mark.parametrize("Lq,Lk", [(1, 1000), (1000, 63), (129, 4095), (63, 129)])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_head_dim_cross_attention(d, Lq, Lk, layout):
    q, k, v = qkv(2, 2, 2, Lq, Lk, layout, seed=d * 7 + Lq * 31 + Lk, d=d)
    check(q, k, v, layout, seed=Lq + Lk)


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
@pytest.mark.parametrize("H,Hkv", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_head_dim_gqa_and_mqa(d, H, Hkv, layout):
    q, k, v = qkv(2, H, Hkv, 300, 517, layout, seed=d + H * 10 + Hkv, d=d)
    check(q, k, v, layout, seed=H + Hkv)


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
def test_head_dim_gqa_reads_the_right_kv_head(d):
    q, k, v = qkv(1, 8, 2, 256, 384, "bhld", seed=5, d=d)
    v = v.astype(np.float32)
    v[:, 1] += 4.0                                    # K/V head 1 sits elsewhere
    v = v.astype(BF16)
    check(q, k, v, "bhld", seed=5)


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
def test_head_dim_every_column_of_d_lands_in_place(d):
    """V's columns scaled by their index: a 64-column block of D stored, read (LBO) or staged
    in the wrong place moves whole columns, and the reference sees it."""
    q, k, v = qkv(1, 2, 2, 200, 300, "bshd", seed=d + 1, d=d)
    ramp = (1.0 + np.arange(d, dtype=np.float32) / 16.0)
    v = (v.astype(np.float32) * ramp).astype(BF16)
    check(q, k, v, "bshd", seed=d + 1)


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
def test_head_dim_small_persistent_grid_walks_many_tiles(d, monkeypatch):
    """Two CTAs walk every tile: the ring wraps many times, and at D = 256 each tile's O is
    staged where the next tile's Q lands (the Q EMPTY hand-over after the store's read)."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    q, k, v = qkv(2, 3, 1, 1000, 1001, "bhld", seed=21 + d, d=d)
    check(q, k, v, "bhld", seed=21)


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
def test_head_dim_repeated_launches_are_deterministic(d, monkeypatch):
    """A race on the Q/O staging region (D = 256) or the ring shows as bits that move."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "4")
    q, k, v = qkv(1, 4, 2, 1000, 777, "bshd", seed=9 + d, d=d)
    first = launch(q, k, v, "bshd")
    check(q, k, v, "bshd", seed=9)
    for _ in range(4):
        o, l = launch(q, k, v, "bshd")
        np.testing.assert_array_equal(o.view(np.uint16), first[0].view(np.uint16))
        np.testing.assert_array_equal(l.view(np.uint32), first[1].view(np.uint32))


@pytest.mark.parametrize("d", HEAD_DIM_BUILDS)
def test_head_dim_numpy_path_returns_out_and_lse(d):
    q, k, v = qkv(1, 4, 2, 129, 300, "bhld", seed=3 + d, d=d)
    out, lse = ptxattn.attention(q, k, v, return_lse=True)
    assert out.dtype == BF16 and out.shape == q.shape and lse.shape == (1, 4, 129)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    assert passes(error_metrics(out, ref))
    assert np.abs(lse - ref_lse).max() <= LSE_TOL


@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"causal": True, "diagonal": "top_left"},
                                  {"window": (100, 20)}], ids=["dense", "causal", "top_left",
                                                               "window"])
@pytest.mark.parametrize("Lq,Lk", [(1110, 1301), (342, 1110)])
def test_d64_third_consumer_rows_of_ragged_tiles(mask, Lq, Lk, monkeypatch):
    """D = 64 runs 192-row tiles, the third consumer's rows 128-191 of each. Lq = 1110 is five
    tiles and 150 rows: the last tile's third consumer holds 22 rows and 42 past seq_q (342:
    one tile and 150 rows). With masks and a 3-CTA grid the per-row key ranges, the
    log-sum-exp rows (consumer * 64) and the O store of that consumer in a ragged tile are
    checked across a persistent walk, with GQA."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "3")
    q, k, v = qkv(2, 4, 2, Lq, Lk, "bshd", seed=Lq + Lk + len(mask), d=64)
    check(q, k, v, "bshd", seed=Lq, **mask)


@pytest.mark.slow
@pytest.mark.parametrize("d,H", [(64, 8), (256, 2)])
def test_head_dim_long_sequence(d, H):
    q, k, v = qkv(1, H, H, 8191, 8191, "bhld", seed=d, d=d)
    check(q, k, v, "bhld", seed=d)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("Lq,Lk", [(1000, 1000), (300, 1301), (700, 300)])
def test_head_dim_causal(d, Lq, Lk):
    q, k, v = qkv(1, 4, 2, Lq, Lk, "bshd", seed=d + Lq, d=d)
    check(q, k, v, "bshd", seed=d, causal=True)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("window", [(100, 20), (0, 0)])
def test_head_dim_window(d, window):
    q, k, v = qkv(2, 2, 2, 777, 1001, "bhld", seed=d + sum(window), d=d)
    check(q, k, v, "bhld", seed=d, window=window)
