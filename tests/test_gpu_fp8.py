"""The FP8 path on the GPU (skipped without one): the quantizer against its NumPy model bit for
bit, and the FP8 forward against the FP8 model and the float64 reference.

Every output the kernels write is poisoned first (e4m3 0xFF and float32 0xFFFFFFFF are NaN),
so an unwritten element shows up as a NaN or a mismatch; every failure message says which
tensor, how many elements, where the first one is and what it holds against the model.
"""

from __future__ import annotations

import numpy as np
import pytest

from ptxattn import driver, fp8_quantize, tensors
from ptxattn import fp8_reference as model
from ptxattn.reference import BF16, attention_reference, error_metrics
from fp8_checks import (check_fp8, check_prequantized, diff, fp8_call, prequantized_inputs, qkv,
                        qkv_fp8, quantize_on_gpu)

import ptxattn

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every array the FP8 code allocates (its operands, descales, the LSE, an out it makes)
    comes filled with NaN bytes (0xFF): an element a kernel leaves unwritten stays NaN."""
    real = tensors.empty

    def empty(shape, *, stream=None, dtype=BF16, stream_owner=None):
        arr = real(shape, stream=stream, dtype=dtype, stream_owner=stream_owner)
        if arr.nbytes:
            driver.memset_u8(arr.ptr, 0xFF, arr.nbytes, stream=stream)
        return arr

    monkeypatch.setattr(tensors, "empty", empty)


SHAPES = [  # (B, H, Hkv, Lq, Lk, D): ragged and exact blocks, GQA, one key
    (2, 4, 2, 300, 200, 128), (1, 2, 2, 128, 128, 128), (1, 3, 1, 129, 1, 64),
    (2, 2, 1, 257, 1000, 64), (1, 2, 2, 200, 384, 256), (1, 4, 4, 64, 4100, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
@pytest.mark.parametrize("smooth", [False, True])
def test_quantizer_matches_the_model_bit_for_bit(shape, layout, smooth, poisoned):
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, layout, seed=sum(shape), k_bias=3.0 if smooth else 0)
    got = quantize_on_gpu(q, k, v, layout, smooth)
    k_mean = None
    if smooth:
        want_mean = model.k_channel_mean(model._to_bhld(k.astype(np.float32), layout))
        rel = np.abs(got["k_mean"] - want_mean) / np.maximum(np.abs(want_mean), 1e-3)
        assert np.isfinite(got["k_mean"]).all() and rel.max() < 1e-5, \
            f"k_mean: max relative difference {rel.max():.2e} from float64's mean (NaN: " \
            f"{int(np.isnan(got['k_mean']).sum())})"
        k_mean = got["k_mean"]                   # the rest must match given the GPU's mean
    want = model.quantize_inputs(q, k, v, layout, smooth_k=smooth, k_mean=k_mean)
    problems = [diff(name, got[name], getattr(want, name))
                for name in ("q8", "q_descale", "k8", "k_descale", "vt8", "v_descale")]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_transpose_v_of_prequantized_v(D, layout, poisoned):
    """e4m3 V (every byte pattern but NaN) -> V^T with permuted keys, zeros past Lk."""
    B, Hkv, Lk = 2, 3, 300
    rng = np.random.default_rng(D)
    raw = rng.integers(0, 256, (B, Hkv, Lk, D), dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x11                         # no NaN patterns
    v8 = raw.view(model.E4M3)
    given = np.ascontiguousarray(v8.transpose(0, 2, 1, 3)) if layout == "bshd" else v8
    dev = tensors.empty(given.shape, dtype=model.E4M3)
    driver.memcpy_htod(dev.ptr, given)
    vt = fp8_quantize.transpose_v(dev, layout).to_numpy()
    problem = diff("vt8", vt, model.permute_vt(v8, model.padded_keys(Lk)))
    assert problem is None, problem


@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_forward_launches_and_writes_every_element(D):
    """The smallest calls: one tile, then a ragged tile of each side; every output written."""
    for Lq, Lk in ((64, 64), (1, 1), (130, 200)):
        q, k, v = qkv_fp8(1, 2, 2, Lq, Lk, D, "bhld", seed=Lq + D)
        check_fp8(q, k, v, "bhld", seed=Lq)


FP8_LENGTHS = [1, 2, 63, 127, 129, 1000, 4095]


@pytest.mark.parametrize("L", FP8_LENGTHS)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_fp8_any_length(L, layout):
    B, H = (2, 3) if L <= 1000 else (1, 2)
    check_fp8(*qkv_fp8(B, H, H, L, L, 128, layout, seed=L), layout, seed=L)


@pytest.mark.parametrize("Lq,Lk", [(1, 1000), (1000, 1), (129, 4095), (4095, 129), (77, 8191)])
def test_fp8_cross_attention(Lq, Lk):
    check_fp8(*qkv_fp8(2, 2, 2, Lq, Lk, 128, "bshd", seed=Lq + Lk), "bshd", seed=Lq)


@pytest.mark.parametrize("H,Hkv", [(8, 4), (8, 1), (12, 1)])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_gqa_and_mqa(H, Hkv, D):
    check_fp8(*qkv_fp8(2, H, Hkv, 300, 517, D, "bhld", seed=H + Hkv + D), "bhld", seed=H)


def test_fp8_gqa_reads_the_right_kv_head():
    q, k, v = qkv_fp8(1, 8, 2, 256, 384, 128, "bhld", seed=5)
    v = v.astype(np.float32)
    v[:, 1] += 4.0
    check_fp8(q, k, v.astype(BF16), "bhld", seed=5)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=True, diagonal="top_left"),
                                  dict(window=(128, 0)), dict(window=(17, 5))])
def test_fp8_masks(D, mask):
    check_fp8(*qkv_fp8(1, 4, 2, 1000, 1301, D, "bshd", seed=D + 3), "bshd", seed=D, **mask)


def test_fp8_window_that_leaves_rows_without_keys():
    check_fp8(*qkv_fp8(1, 2, 2, 700, 300, 128, "bhld", seed=77), "bhld", seed=77, window=(10, 0))


@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_head_dims_long(D):
    check_fp8(*qkv_fp8(1, 2, 2, 4096, 4096, D, "bshd", seed=D), "bshd", seed=D)


def test_fp8_small_persistent_grid_walks_many_tiles(monkeypatch):
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    check_fp8(*qkv_fp8(2, 3, 1, 1000, 1000, 128, "bhld", seed=23), "bhld", seed=23, causal=True)


def test_fp8_k_blocks_of_different_magnitudes():
    """Per-128-key K descales folded into each K/V tile's softmax factor (at D = 256 two 64-key
    tiles share one): blocks 30x apart would break a tile-to-scale mix-up."""
    for D in (128, 256):
        q, k, v = qkv_fp8(1, 2, 2, 256, 640, D, "bhld", seed=D + 1)
        kf = k.astype(np.float32)
        kf[:, :, 128:256] *= 3
        kf[:, :, 384:512] *= 0.02
        check_fp8(q, kf.astype(BF16), v, "bhld", seed=D)


def test_fp8_repeated_calls_are_deterministic():
    q, k, v = qkv_fp8(2, 4, 2, 1000, 1000, 128, "bhld", seed=31)
    first, first_lse = fp8_call(q, k, v, "bhld", causal=True)
    for _ in range(3):
        again, again_lse = fp8_call(q, k, v, "bhld", causal=True)
        assert np.array_equal(first.view(np.uint16), again.view(np.uint16)), \
            f"{int((first.view(np.uint16) != again.view(np.uint16)).sum())} elements moved: a race"
        assert np.array_equal(first_lse, again_lse, equal_nan=True)


def test_fp8_numpy_path_and_smoothing():
    q, k, v = qkv_fp8(1, 2, 2, 300, 400, 64, "bhld", seed=41)
    out = ptxattn.attention(q, k, v, precision="fp8")
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == q.shape
    assert np.isfinite(out.astype(np.float32)).all()
    ref = attention_reference(q, k, v)
    kb = (k.astype(np.float32) + 3 * np.random.default_rng(1).standard_normal(
        (1, 2, 1, 64)).astype(np.float32)).astype(BF16)
    plain = error_metrics(ptxattn.attention(q, kb, v, precision="fp8"), attention_reference(q, kb, v))
    smooth = error_metrics(ptxattn.attention(q, kb, v, precision="fp8", smooth_k=True),
                           attention_reference(q, kb, v))
    assert smooth["rel_l2"] < plain["rel_l2"], (plain, smooth)
    assert error_metrics(out, ref)["rel_l2"] < 0.08


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_fp8_prequantized_inputs_with_fa3_descales(layout):
    """e4m3 q, k, v taken as they are (V transposed by our kernel), FlashAttention-3's
    (batch, heads_kv) descales: against the model on the same e4m3 values and scales."""
    q8, k8, v8, descales = prequantized_inputs(2, 4, 2, 300, 450, 128, seed=3)

    def to_layout(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bshd" else x

    def dev(x, dtype):
        arr = tensors.empty(x.shape, dtype=dtype)
        driver.memcpy_htod(arr.ptr, np.ascontiguousarray(x))
        return arr

    qd, kd, vd = (dev(to_layout(x), model.E4M3) for x in (q8, k8, v8))
    scales = {n: dev(x, np.float32) for n, x in descales.items()}
    out, lse = ptxattn.attention(qd, kd, vd, layout=layout, precision="fp8", return_lse=True,
                                 causal=True, **scales)
    check_prequantized(to_layout(out.to_numpy()), lse.to_numpy(), q8, k8, v8, descales,
                       causal=True)
