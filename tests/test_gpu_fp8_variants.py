"""The FP8 measurement variants (builds.FP8_VARIANTS: 192- and 224-key tiles at D = 128, a
3-deep ring at 192, the former 64-key tiles at D = 256, three consumers at D = 128 with 96-key
tiles) on the GPU (skipped without one), in the style of tests/test_gpu_fp8.py: against the FP8 model tiled
as each variant is, on pre-quantized e4m3 inputs with FlashAttention-3's (batch, heads_kv)
descales (what the variants take), every output poisoned first; and on bf16 inputs quantized
per head against float64 with the FP8 path's bar, beside today's default build. The CPU
emulator's copy of these checks: tests/test_emulator_fp8_variants.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from fp8_checks import check_prequantized, prequantized_inputs, variant_call

from ptxattn import builds, driver, fp8_forward, tensors
from ptxattn import fp8_reference as model
from ptxattn.reference import BF16, attention_reference, error_metrics

pytestmark = pytest.mark.gpu

VARIANTS = sorted(builds.FP8_VARIANTS)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every array the FP8 code allocates comes filled with NaN bytes (0xFF)."""
    real = tensors.empty

    def empty(shape, *, stream=None, dtype=BF16, stream_owner=None):
        arr = real(shape, stream=stream, dtype=dtype, stream_owner=stream_owner)
        if arr.nbytes:
            driver.memset_u8(arr.ptr, 0xFF, arr.nbytes, stream=stream)
        return arr

    monkeypatch.setattr(tensors, "empty", empty)


SHAPES = [  # (B, H, Hkv, Lq, Lk): one key, tails of every size, whole tiles, GQA, long
    (1, 2, 2, 64, 1), (2, 4, 2, 300, 200), (1, 2, 2, 128, 192), (1, 2, 2, 128, 224),
    (1, 3, 1, 129, 449), (2, 2, 1, 257, 1000), (1, 4, 4, 64, 4100), (1, 2, 1, 1000, 16384),
    # m3n96: 192-row Q tiles (a second tile of 8 rows), exactly one 96-key tile, GQA
    (1, 4, 2, 200, 96)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_variant_matches_the_model(variant, shape):
    b, h, hk, lq, lk = shape
    d = builds.FP8_VARIANTS[variant].head_dim
    q8, k8, v8, descales = prequantized_inputs(b, h, hk, lq, lk, d, seed=lq + lk)
    out, lse = variant_call(q8, k8, v8, descales, fp8_forward.variant_defines(variant))
    check_prequantized(out, lse, q8, k8, v8, descales,
                       block_n=builds.FP8_VARIANTS[variant].block_n)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_persistent_grid_walks_many_tiles(variant, monkeypatch):
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "3")
    d = builds.FP8_VARIANTS[variant].head_dim
    q8, k8, v8, descales = prequantized_inputs(2, 3, 3, 700, 900, d, seed=7)
    out, lse = variant_call(q8, k8, v8, descales, fp8_forward.variant_defines(variant))
    check_prequantized(out, lse, q8, k8, v8, descales,
                       block_n=builds.FP8_VARIANTS[variant].block_n)


def _per_head_e4m3(x):
    """bf16 (B, H, L, D) -> e4m3 and its (B, H) descale: amax / 448 per head."""
    f = x.astype(np.float32)
    amax = np.abs(f).max(axis=(2, 3))
    scale = np.where(amax > 0, amax / model.E4M3_MAX, 1.0).astype(np.float32)
    return model.to_e4m3(f / scale[..., None, None]), scale


@pytest.mark.parametrize("variant,d", [("default", 128), ("default", 256)]
                         + [(v, builds.FP8_VARIANTS[v].head_dim) for v in VARIANTS])
def test_variant_accuracy_on_random_inputs(variant, d):
    """bf16 N(0, 1) inputs quantized per head: within the FP8 bar of float64, as the default
    build is on the same e4m3 inputs (bench/fp8_bench.py's FP8_BAR)."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 4, 2048, d), dtype=np.float32).astype(BF16)
               for _ in range(3))
    (q8, qs), (k8, ks), (v8, vs) = (_per_head_e4m3(x) for x in (q, k, v))
    out, lse = variant_call(q8, k8, v8, dict(q_descale=qs, k_descale=ks, v_descale=vs),
                            fp8_forward.variant_defines(variant))
    m = error_metrics(out, attention_reference(q, k, v))
    assert m["nan_count"] == 0 and m["rel_l2"] <= 0.075, m


@pytest.mark.parametrize("diagonal", ["bottom_right", "top_left"])
def test_power_of_two_variant_causal(diagonal):
    """d256n64 (the former D = 256 row) builds the masked kernel too: causal with GQA, ragged both ways."""
    from ptxattn import fp8
    q8, k8, v8, descales = prequantized_inputs(2, 4, 2, 700, 1300, 256, seed=13)
    plan = fp8.validate(q8, k8, v8, return_lse=True, causal=True, diagonal=diagonal,
                        **descales)
    prepared = fp8_forward.prepare(plan, fp8_forward.variant_defines("d256n64"))
    try:
        prepared.launch()
        out, lse = prepared.out.to_numpy(), prepared.lse.to_numpy()
    finally:
        prepared.close()
    check_prequantized(out, lse, q8, k8, v8, descales, block_n=64, causal=True,
                       diagonal=diagonal)
