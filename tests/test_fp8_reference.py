"""The FP8 path's NumPy models (ptxattn/fp8_reference.py), CPU only.

1. The key permutation of V^T that makes the S accumulator registers the A fragments of the
   FP8 PV wgmma, proven on one simulated warpgroup (and the key tail: zero padding, masked
   scores).
2. The quantizer model: e4m3 rounding as cvt.rn.satfinite does it, per-block scales, layouts,
   smoothing.
3. The FP8 forward model against the float64 reference (the accuracy it trades).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ptxattn import fp8_reference as fp8
from ptxattn.reference import BF16, attention_reference, error_metrics, random_qkv


# --------------------------------------------------------------------------- the permutation

def test_the_permutation_is_a_bijection_within_each_group_of_32():
    order = fp8.PV_KEY_ORDER
    assert sorted(order) == list(range(32))
    assert (order[fp8.PV_POSITION_OF_KEY] == np.arange(32)).all()
    assert (fp8.PV_POSITION_OF_KEY[order] == np.arange(32)).all()
    # written out: positions 4q..4q+3 of each half hold keys 2q, 2q+1, 8+2q, 9+2q
    assert list(order[:8]) == [0, 1, 8, 9, 2, 3, 10, 11]
    assert list(order[16:20]) == [16, 17, 24, 25]


def test_fragment_maps_cover_their_tiles_once():
    for n in (64, 128, 256):
        rows, cols = fp8.accumulator_coords(n)
        cells = rows * n + cols
        assert sorted(cells.ravel()) == list(range(64 * n))
    rows, cols = fp8.a_fragment_coords()
    assert sorted((rows * 32 + cols).ravel()) == list(range(64 * 32))


@pytest.mark.parametrize("n", [64, 128, 256])
def test_every_a_byte_is_the_threads_own_score_of_the_permuted_key(n):
    """The proof: for every thread, k-step and A byte, the S register that PACK_P puts there
    holds the score of the same query row at the key that V^T holds at that k position."""
    s_rows, s_cols = fp8.accumulator_coords(n)
    a_rows, a_cols = fp8.a_fragment_coords()
    for step in range(n // 32):
        src = fp8.p_source_register(step, np.arange(16))
        assert (src < n // 2).all() and len(set(src.tolist())) == 16
        # the same thread, the same row: no value crosses threads
        assert (s_rows[:, src] == a_rows).all()
        # the score's key is the one V^T stores at the A byte's k position
        assert (s_cols[:, src] == 32 * step + fp8.PV_KEY_ORDER[a_cols]).all()
    # the k-steps together use every S register exactly once
    used = np.concatenate([fp8.p_source_register(t, np.arange(16)) for t in range(n // 32)])
    assert sorted(used) == list(range(n // 2))


@pytest.mark.parametrize("n, d", [(64, 64), (128, 128), (128, 256), (256, 64)])
def test_pv_from_registers_and_permuted_vt_equals_pv(n, d):
    rng = np.random.default_rng(n + d)
    p = rng.integers(-4, 5, (64, n)).astype(np.float64)          # exact in any order
    v = rng.integers(-4, 5, (n, d)).astype(np.float64)
    vt = fp8.permute_vt(v[None], n)[0]
    assert np.array_equal(fp8.simulate_pv_fragments(p, vt), p @ v)
    # without the permutation the same registers give a wrong answer
    assert not np.array_equal(fp8.simulate_pv_fragments(p, v.T.copy()), p @ v)
    p, v = rng.standard_normal((64, n)), rng.standard_normal((n, d))
    out = fp8.simulate_pv_fragments(p, fp8.permute_vt(v[None], n)[0])
    np.testing.assert_allclose(out, p @ v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seq_k", [1, 31, 33, 100, 128])
def test_the_key_tail_pads_zeros_and_masked_scores_contribute_nothing(seq_k):
    """Keys past Lk: V^T holds zeros at their positions (the quantizer writes them, TMA fills
    past the padded length), and their scores are masked (-inf, so P = 0): the tile's PV is
    that of the real keys alone, and no NaN from whatever lies past the end."""
    rng = np.random.default_rng(seq_k)
    n = 128
    v = rng.standard_normal((seq_k, 64))
    vt = fp8.permute_vt(v[None], fp8.padded_keys(seq_k))[0][:, :n]
    if vt.shape[1] < n:
        vt = np.pad(vt, ((0, 0), (0, n - vt.shape[1])))      # TMA's zero fill
    assert (fp8.unpermute_vt(vt[None], seq_k)[0] == v[:seq_k]).all()
    keys = fp8.PV_KEY_ORDER[np.arange(n) % 32] + 32 * (np.arange(n) // 32)
    assert (vt[:, keys >= seq_k] == 0).all()
    p = rng.random((64, n))
    p[:, seq_k:] = 0                                         # exp2(-inf) of the masked scores
    out = fp8.simulate_pv_fragments(p, vt)
    np.testing.assert_allclose(out, p[:, :seq_k] @ v[:min(seq_k, n)], rtol=1e-12, atol=1e-12)
    if seq_k < n:                                             # garbage padding would poison O
        bad = vt.copy()
        bad[:, keys >= seq_k] = np.nan
        assert np.isnan(fp8.simulate_pv_fragments(p, bad)).any()


# --------------------------------------------------------------------------- e4m3 and the quantizer

def test_e4m3_rounding_is_round_to_nearest_even_and_saturating():
    x = np.array([0, 1, 17, 19, 448, 449, 460, 500, 1e9, -1e9, 2 ** -9, 2 ** -10, 3 * 2 ** -11,
                  np.nan], np.float32)
    got = fp8.to_e4m3(x).astype(np.float32)
    want = [0, 1, 16, 20, 448, 448, 448, 448, 448, -448, 2 ** -9, 0, 2 ** -9, np.nan]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    assert fp8.to_e4m3(x).dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_block_scales_and_the_zero_block():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 300, 64)).astype(np.float32)
    x[1, 2, 128:256] = 0                                      # block 1 of one head all zero
    q, descale = fp8.quantize_blocks(x, 128)
    assert q.shape == x.shape and descale.shape == (2, 3, 3)
    amax = np.abs(np.pad(x, ((0, 0), (0, 0), (0, 84), (0, 0))).reshape(2, 3, 3, 128, 64)).max(
        axis=(-2, -1))
    np.testing.assert_array_equal(descale[amax > 0], (amax / np.float32(448))[amax > 0])
    assert descale[1, 2, 1] == 1 and (q[1, 2, 128:256].astype(np.float32) == 0).all()
    deq = q.astype(np.float32) * np.repeat(descale, 128, axis=-1)[..., :300, None]
    # each element within half an e4m3 step (2^-4 relative), or the subnormal step
    tol = np.maximum(np.abs(x) * 2 ** -4, np.repeat(descale, 128, -1)[..., :300, None] * 2 ** -10)
    assert (np.abs(deq - x) <= tol * 1.0001).all()
    assert (np.abs(q.astype(np.float32)) <= 448).all()
    # the block's largest element lands on 448 exactly
    big = np.abs(q.astype(np.float32)).reshape(2, 3, -1)
    assert (big.max(-1) == 448).all()


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_quantize_inputs_layouts_and_shapes(layout):
    q, k, v = random_qkv(2, 4, 200, 300, 64, layout=layout, seed=1)
    kq, kk, kv = (x[:, :, ::2] if layout == "bshd" else x[:, ::2] for x in (q, k, v))  # GQA 4:2
    inputs = fp8.quantize_inputs(q, kk, kv, layout, k_block=128)
    assert inputs.q8.shape == (2, 4, 200, 64) and inputs.q_descale.shape == (2, 4, 2)
    assert inputs.k8.shape == (2, 2, 300, 64) and inputs.k_descale.shape == (2, 2, 3)
    assert inputs.vt8.shape == (2, 2, 64, 384) and inputs.v_descale.shape == (2, 2, 64)
    bhld = (lambda x: x.transpose(0, 2, 1, 3)) if layout == "bshd" else (lambda x: x)
    _, _, v_deq = fp8.dequantized(inputs)
    vf = bhld(kv.astype(np.float32)).astype(np.float64)
    assert np.abs(v_deq - vf).max() <= np.abs(vf).max() * 2 ** -4
    same = fp8.quantize_inputs(bhld(q), bhld(kk), bhld(kv), "bhld", k_block=128)
    for name in ("q8", "q_descale", "k8", "k_descale", "vt8", "v_descale"):
        assert np.array_equal(getattr(inputs, name).view(np.uint8) if getattr(inputs, name).dtype
                              == fp8.E4M3 else getattr(inputs, name),
                              getattr(same, name).view(np.uint8) if getattr(same, name).dtype
                              == fp8.E4M3 else getattr(same, name)), name


def test_smoothing_subtracts_the_channel_mean_and_the_softmax_does_not_see_it():
    q, k, v = random_qkv(1, 2, 256, 256, 64, seed=2)
    rng = np.random.default_rng(3)
    k = (k.astype(np.float32) + 4 * rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
         ).astype(BF16)
    smooth = fp8.quantize_inputs(q, k, v, smooth_k=True)
    mean = k.astype(np.float32).astype(np.float64).mean(axis=2)
    np.testing.assert_allclose(smooth.k_mean, mean, rtol=1e-6)
    _, k_deq, _ = fp8.dequantized(smooth)
    assert abs(k_deq.mean(axis=2)).max() < 0.05            # centred (up to rounding)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    out, lse = fp8.fp8_attention(q, k, v, smooth_k=True, return_lse=True)
    plain = fp8.fp8_attention(q, k, v)
    assert error_metrics(out, ref)["rel_l2"] < error_metrics(plain, ref)["rel_l2"]
    assert error_metrics(out, ref)["rel_l2"] < 0.07
    assert np.abs(lse - ref_lse).max() < 0.1               # the LSE of the unsmoothed scores


# --------------------------------------------------------------------------- the FP8 forward model

def test_the_model_with_exact_values_is_exact_attention():
    """Inputs whose blocks e4m3 holds exactly (powers of two, each block's largest 4, so every
    value times 448 / 4 is an e4m3 value): dequantized they are the inputs again, and with one
    key per row (P = 2^8 exactly, then divided by itself) the output is V's row."""
    rng = np.random.default_rng(5)
    values = np.array([0, 0.5, 1, 2, 4, -0.5, -1, -2, -4], np.float32)
    q, k, v = (rng.choice(values, (1, 1, 64, 32)) for _ in range(3))
    for x in (q, k, v):
        x[0, 0, 0, 0] = 4
        x[0, 0, :, 1] = 4                                    # every channel's and block's max
    q, k, v = (x.astype(BF16) for x in (q, k, v))
    inputs = fp8.quantize_inputs(q, k, v)
    for x, y in zip(fp8.dequantized(inputs), (q, k, v)):
        np.testing.assert_allclose(x, y.astype(np.float64), rtol=1e-6, atol=0)
    out = fp8.fp8_attention_model(inputs, causal=True, window=(0, 0))   # the diagonal only
    np.testing.assert_allclose(out, v.astype(np.float32), rtol=1e-6, atol=0)


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_model_against_the_float64_reference(d):
    q, k, v = random_qkv(1, 2, 384, 320, d, seed=d)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    out, lse = fp8.fp8_attention(q, k, v, return_lse=True)
    m = error_metrics(out, ref)
    # each of Q, K, V, P rounded to e4m3 alone costs ~2.5%; together ~5.3% (bench/notes.md)
    assert m["nan_count"] == 0 and 0.03 < m["rel_l2"] < 0.07, m
    assert np.abs(lse - ref_lse).max() < 0.1
    rows = np.array([0, 5, 127, 128, 200, 383])
    sub = fp8.fp8_attention(q, k, v, rows=rows)
    np.testing.assert_array_equal(sub, out[:, :, rows])


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(40, 3)),
                                  dict(causal=True, diagonal="top_left")])
def test_fp8_model_masks_and_rows_that_see_no_key(mask):
    q, k, v = random_qkv(1, 2, 300, 200, 64, seed=7)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **mask)
    out, lse = fp8.fp8_attention(q, k, v, return_lse=True, block_n=64, **mask)
    m = error_metrics(out, ref)
    assert m["nan_count"] == 0 and m["rel_l2"] < 0.08, m
    empty = np.isneginf(ref_lse)
    assert (np.isneginf(lse) == empty).all() and (out[empty] == 0).all()
    assert np.abs(lse[~empty] - ref_lse[~empty]).max() < 0.15


def test_p_stays_below_e4m3s_largest_value():
    with pytest.raises(ValueError, match="exceed"):
        fp8.fp8_attention_model(fp8.quantize_inputs(*random_qkv(1, 1, 8, 8, 64)),
                                rebase_log2=8.0, p_log2=8.0)


def test_block_scales_of_k_fold_into_the_softmax_per_tile():
    """K blocks with very different magnitudes: per-block scales (one per K/V tile, folded
    into that tile's softmax factor) give the same answer as the reference up to FP8's error,
    where a wrong tile-to-scale pairing would not."""
    q, k, v = random_qkv(1, 1, 128, 512, 64, seed=9)
    kf = k.astype(np.float32)
    kf[:, :, 128:256] *= 3
    kf[:, :, 384:] *= 0.02
    k = kf.astype(BF16)
    ref = attention_reference(q, k, v)
    inputs = fp8.quantize_inputs(q, k, v, k_block=128)
    assert inputs.k_descale[0, 0, 1] > 100 * inputs.k_descale[0, 0, 3]
    m = error_metrics(fp8.fp8_attention_model(inputs, block_n=128), ref)
    assert m["rel_l2"] < 0.08, m
    shuffled = fp8.Fp8Inputs(**{**inputs.__dict__,
                                "k_descale": inputs.k_descale[..., ::-1].copy()})
    assert error_metrics(fp8.fp8_attention_model(shuffled, block_n=128), ref)["rel_l2"] > 0.3
