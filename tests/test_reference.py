"""The NumPy reference against an independent per-row formula, and the pass bar."""

import math

import ml_dtypes
import numpy as np
import pytest

from ptxattn.reference import (BF16, PASS_MAX_ABS, PASS_REL_L2, attention_reference,
                               error_metrics, passes, random_qkv)


def naive(q, k, v, scale):
    """Row by row with Python floats: o_i = sum_j softmax_j(scale * q_i . k_j) v_j (BHLD)."""
    q, k, v = (np.asarray(x, np.float32).astype(np.float64) for x in (q, k, v))
    B, H, Lq, D = q.shape
    out = np.zeros((B, H, Lq, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                s = [scale * sum(q[b, h, i, d] * k[b, h, j, d] for d in range(D))
                     for j in range(k.shape[2])]
                m = max(s)
                e = [math.exp(x - m) for x in s]
                z = sum(e)
                for j, w in enumerate(e):
                    out[b, h, i] += (w / z) * v[b, h, j]
    return out


@pytest.mark.parametrize("scale", [None, 0.3, 0.0])
def test_matches_naive_formula_bhld(scale):
    q, k, v = random_qkv(1, 2, 5, 7, 8, "bhld", seed=1)
    ref = attention_reference(q, k, v, scale=scale)
    expect = naive(q, k, v, 1 / math.sqrt(8) if scale is None else scale)
    np.testing.assert_allclose(ref, expect, rtol=1e-12, atol=1e-12)


def test_scale_zero_is_the_mean_of_v():
    q, k, v = random_qkv(1, 1, 3, 6, 8, seed=2)
    ref = attention_reference(q, k, v, scale=0.0)
    mean = v.astype(np.float64).mean(axis=2, keepdims=True)
    np.testing.assert_allclose(ref, np.broadcast_to(mean, ref.shape), rtol=1e-12)


def test_bshd_is_the_transposed_bhld():
    q, k, v = random_qkv(2, 3, 4, 6, 8, "bshd", seed=3)
    assert q.shape == (2, 4, 3, 8) and k.shape == (2, 6, 3, 8)
    ref = attention_reference(q, k, v, layout="bshd")
    t = lambda x: x.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(ref, t(attention_reference(t(q), t(k), t(v))), rtol=1e-14)
    np.testing.assert_allclose(t(ref), naive(t(q), t(k), t(v), 1 / math.sqrt(8)),
                               rtol=1e-12, atol=1e-12)


def test_chunking_and_row_subset_do_not_change_the_answer():
    q, k, v = random_qkv(2, 2, 33, 17, 16, seed=4)
    full = attention_reference(q, k, v)
    for chunk in (1, 5, 32, 1000):
        np.testing.assert_allclose(attention_reference(q, k, v, chunk_rows=chunk), full,
                                   rtol=1e-13, atol=1e-15)
    rows = np.array([0, 7, 32])
    np.testing.assert_allclose(attention_reference(q, k, v, rows=rows), full[:, :, rows],
                               rtol=1e-13, atol=1e-15)
    qs, ks, vs = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    np.testing.assert_allclose(attention_reference(qs, ks, vs, layout="bshd", rows=rows),
                               full[:, :, rows].transpose(0, 2, 1, 3), rtol=1e-13, atol=1e-15)


def test_inputs_are_rounded_to_bf16_first():
    rng = np.random.default_rng(5)
    q64, k64, v64 = (rng.standard_normal((1, 1, 4, 8)) for _ in range(3))
    rounded = [x.astype(np.float32).astype(ml_dtypes.bfloat16) for x in (q64, k64, v64)]
    np.testing.assert_array_equal(attention_reference(q64, k64, v64),
                                  attention_reference(*rounded))
    np.testing.assert_array_equal(attention_reference(*(x.astype(np.float32) for x in (q64, k64, v64))),
                                  attention_reference(*rounded))


def test_large_scores_stay_finite():
    q, k, v = random_qkv(1, 1, 8, 8, 16, seed=6)
    ref = attention_reference(q, k, v, scale=1000.0)
    assert np.isfinite(ref).all()


def test_random_qkv_is_seeded_normal_bf16():
    q, k, v = random_qkv(2, 3, 64, 32, 128, "bhld", seed=7)
    assert q.dtype == BF16 and q.shape == (2, 3, 64, 128) and v.shape == (2, 3, 32, 128)
    q2, _, _ = random_qkv(2, 3, 64, 32, 128, "bhld", seed=7)
    np.testing.assert_array_equal(q.view(np.uint16), q2.view(np.uint16))
    x = q.astype(np.float32)
    assert abs(x.mean()) < 0.05 and abs(x.std() - 1) < 0.05
    assert not np.array_equal(q.view(np.uint16), k.view(np.uint16)[:, :, :1].repeat(64, 2))
    with pytest.raises(ValueError, match="layout"):
        random_qkv(1, 1, 1, 1, 8, "lbhd")


def test_metrics_pass_a_bf16_rounded_answer():
    q, k, v = random_qkv(1, 2, 64, 64, 128, seed=8)
    ref = attention_reference(q, k, v)
    exact = error_metrics(ref, ref)
    assert exact == {"rel_l2": 0.0, "max_abs": 0.0, "nan_count": 0} and passes(exact)
    m = error_metrics(ref.astype(np.float32).astype(BF16), ref)  # what a correct kernel returns
    assert passes(m), m
    assert m["rel_l2"] < PASS_REL_L2 / 2 and m["max_abs"] < PASS_MAX_ABS


def test_metrics_catch_wrong_answers():
    q, k, v = random_qkv(1, 2, 64, 64, 128, seed=9)
    ref = attention_reference(q, k, v)
    wrong = {
        "default scale ignored": attention_reference(q, k, v, scale=1.0),
        "scale applied twice": attention_reference(q, k, v, scale=1 / 128),
        "keys reversed": attention_reference(q, k[:, :, ::-1], v),
        "one row zero": np.where(np.arange(64)[None, None, :, None] == 5, 0.0, ref),
        "heads swapped": ref[:, ::-1],
        "no softmax normalisation": ref * 1.05,
    }
    for what, out in wrong.items():
        assert not passes(error_metrics(out, ref)), what
    poisoned = ref.copy()
    poisoned[0, 1, 3, 7] = np.nan
    m = error_metrics(poisoned, ref)
    assert m["nan_count"] == 1 and not passes(m)
    inf = ref.copy()
    inf[0, 0, 0, 0] = np.inf
    assert error_metrics(inf, ref)["nan_count"] == 1


def test_metrics_shape_mismatch_and_empty():
    with pytest.raises(ValueError, match="shape"):
        error_metrics(np.zeros((1, 1, 2, 8)), np.zeros((1, 1, 3, 8)))
    assert passes(error_metrics(np.zeros((1, 1, 0, 8)), np.zeros((1, 1, 0, 8))))


def test_empty_keys_are_rejected():
    q, _, _ = random_qkv(1, 1, 4, 1, 8)
    with pytest.raises(ValueError, match="key length is 0"):
        attention_reference(q, q[:, :, :0], q[:, :, :0])
