"""The bf16 measurement variants (builds.BF16_VARIANTS: d256n80, FlashAttention-3's 128 x 80 tile
at D = 256) on the GPU (skipped without one), in the style of tests/test_gpu_fp8_variants.py:
through api.prepare(..., defines=builds.bf16_variant_defines(name)), every output (and LSE)
poisoned with NaN first, against the float64 reference under DESIGN.md's bf16 bar on sampled
rows (reference.sample_rows) plus a NaN scan of the whole output; and beside today's default
build on the same inputs (its error may not exceed 1.25 x the default's + 5e-4: DESIGN.md's
rule against cuDNN, here against our own row). The CPU emulator's copy of these checks:
tests/test_emulator_bf16_variants.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import assert_passes, check_rows, launch_once

import ptxattn
from ptxattn import builds, tensors
from ptxattn.reference import BF16, attention_reference

pytestmark = pytest.mark.gpu

VARIANTS = sorted(builds.BF16_VARIANTS)
LSE_TOL = 2e-3          # absolute, natural-log units (tests/test_gpu_production.py's)


def qkv(B, H, Hkv, Lq, Lk, d, seed, layout="bhld"):
    rng = np.random.default_rng(seed)

    def one(h, L):
        shape = (B, h, L, d) if layout == "bhld" else (B, L, h, d)
        return rng.standard_normal(shape, dtype=np.float32).astype(BF16)
    return one(H, Lq), one(Hkv, Lk), one(Hkv, Lk)


def run(q, k, v, defines, layout="bhld"):
    """(out, lse, prepared's tile) on the host after one launch into a NaN-poisoned output."""
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                                   # bf16 NaN
    p = ptxattn.prepare(qd, kd, vd, layout=layout, out=out, return_lse=True,
                        defines=defines or None)
    tile = (p.stage.block_m, p.stage.block_n, p.block, p.smem_bytes)
    o, l = launch_once(p, out, (qd, kd, vd), lse=True)
    return o, l, tile


def check_variant(variant, q, k, v, seed, layout="bhld"):
    b = builds.BF16_VARIANTS[variant]
    o, l, tile = run(q, k, v, builds.bf16_variant_defines(variant), layout)
    assert tile == (b.block_m, b.block_n, (b.threads, 1, 1), b.smem_bytes), tile
    m = check_rows(q, k, v, o, layout=layout, seed=seed)
    assert_passes(m, f"{variant}")
    assert not np.isnan(l).any(), f"{int(np.isnan(l).sum())} lse values left unwritten"
    axis = 2 if layout == "bhld" else 1
    rows = np.arange(0, q.shape[axis], max(1, q.shape[axis] // 97))
    _, ref_lse = attention_reference(q, k, v, layout=layout, rows=rows, return_lse=True)
    err = np.abs(l[:, :, rows].astype(np.float64) - ref_lse).max()
    assert err <= LSE_TOL, f"{variant}: lse max abs error {err:.2e}"
    return m


SHAPES = [  # (B, H, Hkv, Lq, Lk): one key, tails of every size, whole tiles, GQA, long
    (1, 2, 2, 64, 1), (1, 2, 1, 70, 81), (2, 4, 2, 300, 300), (1, 2, 2, 128, 80),
    (1, 2, 2, 129, 160), (1, 3, 1, 257, 1001), (1, 4, 4, 64, 4100), (1, 2, 1, 1000, 16383),
    (2, 8, 8, 1024, 16384)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_variant_against_float64(variant, shape):
    b, h, hk, lq, lk = shape
    d = builds.BF16_VARIANTS[variant].head_dim
    q, k, v = qkv(b, h, hk, lq, lk, d, seed=lq + lk)
    check_variant(variant, q, k, v, seed=lq + lk)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_bshd(variant):
    d = builds.BF16_VARIANTS[variant].head_dim
    q, k, v = qkv(1, 4, 2, 333, 2011, d, seed=5, layout="bshd")
    check_variant(variant, q, k, v, seed=5, layout="bshd")


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_persistent_grid_walks_many_tiles(variant, monkeypatch):
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "3")
    d = builds.BF16_VARIANTS[variant].head_dim
    q, k, v = qkv(2, 3, 3, 700, 900, d, seed=7)
    check_variant(variant, q, k, v, seed=7)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_error_beside_the_default(variant):
    """The benchmark's shape at a shorter Lq: the variant's error against float64 within
    1.25 x the default build's + 5e-4 on the same inputs and rows."""
    d = builds.BF16_VARIANTS[variant].head_dim
    q, k, v = qkv(2, 8, 8, 512, 16384, d, seed=23)
    mine = check_variant(variant, q, k, v, seed=23)
    o, _, _ = run(q, k, v, None)
    base = check_rows(q, k, v, o, seed=23)
    assert_passes(base, "default")
    assert mine["rel_l2"] <= 1.25 * base["rel_l2"] + 5e-4, (mine, base)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_is_deterministic(variant):
    d = builds.BF16_VARIANTS[variant].head_dim
    q, k, v = qkv(1, 2, 2, 300, 1000, d, seed=3)
    a, la, _ = run(q, k, v, builds.bf16_variant_defines(variant))
    b, lb, _ = run(q, k, v, builds.bf16_variant_defines(variant))
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)) and np.array_equal(la, lb)


def test_variant_refuses_a_masked_call():
    q, k, v = qkv(1, 1, 1, 64, 100, 256, seed=1)
    with pytest.raises(ValueError, match="dense only"):
        ptxattn.prepare(q, k, v, causal=True, defines=builds.bf16_variant_defines("d256n80"))
