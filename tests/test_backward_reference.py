"""The float64 reference gradients (ptxattn/reference_backward.py) on the CPU: against central
finite differences of the float64 forward on tiny shapes (masks, GQA, Lq != Lk), and the
properties the kernels are checked for (rows with no key, chunking, layouts)."""

from __future__ import annotations

import numpy as np
import pytest

from ptxattn import reference
from ptxattn.reference import BF16
from ptxattn.reference_backward import attention_backward_reference, attention_grads_f64

EPS = 1e-6


def _f64(rng, *shape):
    return rng.standard_normal(shape)


def _numeric(loss, x):
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        keep = x[i]
        x[i] = keep + EPS
        up = loss()
        x[i] = keep - EPS
        down = loss()
        x[i] = keep
        grad[i] = (up - down) / (2 * EPS)
    return grad


CASES = [  # (H, Hkv, Lq, Lk, D, mask (left, right) or None, diagonal)
    (2, 2, 5, 5, 3, None, "bottom_right"),
    (4, 2, 5, 7, 3, None, "bottom_right"),          # GQA, Lq < Lk
    (3, 1, 6, 4, 2, (-1, 0), "bottom_right"),        # MQA, causal, Lq > Lk: rows with no key
    (2, 2, 6, 4, 2, (-1, 0), "top_left"),
    (2, 1, 7, 7, 3, (2, 1), "bottom_right"),         # a window both sides
    (2, 2, 4, 9, 3, (1, -1), "top_left"),
]


@pytest.mark.parametrize("H,Hkv,Lq,Lk,D,mask,diagonal", CASES)
def test_gradients_equal_finite_differences(H, Hkv, Lq, Lk, D, mask, diagonal):
    rng = np.random.default_rng(H * 100 + Lq * 10 + Lk)
    q, k, v = _f64(rng, 1, H, Lq, D), _f64(rng, 1, Hkv, Lk, D), _f64(rng, 1, Hkv, Lk, D)
    dout = _f64(rng, 1, H, Lq, D)
    scale = 0.7

    def loss():
        out = attention_grads_f64(q, k, v, dout, scale, mask=mask, diagonal=diagonal)[3]
        return float((out * dout).sum())

    dq, dk, dv, _ = attention_grads_f64(q, k, v, dout, scale, mask=mask, diagonal=diagonal)
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        num = _numeric(loss, x)
        err = np.abs(num - g).max()
        assert err < 1e-6 * max(1.0, np.abs(num).max()), f"{name}: max |analytic - numeric| {err}"


def test_the_forward_inside_is_the_forward_reference():
    q, k, v = reference.random_qkv(1, 4, 33, 47, 16, seed=3)
    k, v = k[:, :2], v[:, :2]
    dout = reference.random_qkv(1, 4, 33, 33, 16, seed=4)[0]
    for mask in (dict(), dict(causal=True), dict(window=(5, 3), diagonal="top_left")):
        out = attention_backward_reference(q, k, v, dout, return_out=True, **mask)[3]
        want = reference.attention_reference(q, k, v, **mask)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_rows_that_see_no_key_have_zero_dq_and_give_nothing():
    """Causal bottom-right with Lq > Lk: the first Lq - Lk rows see no key."""
    q, k, v = reference.random_qkv(1, 2, 9, 4, 8, seed=5)
    dout = reference.random_qkv(1, 2, 9, 9, 8, seed=6)[0]
    dq, dk, dv = attention_backward_reference(q, k, v, dout, causal=True)
    assert (dq[:, :, :5] == 0).all() and np.isfinite(dq).all()
    # the same gradients of k and v with those rows' dout set to anything else
    dout2 = dout.astype(np.float32)
    dout2[:, :, :5] = 100.0
    _, dk2, dv2 = attention_backward_reference(q, k, v, dout2.astype(BF16), causal=True)
    np.testing.assert_array_equal(dk, dk2)
    np.testing.assert_array_equal(dv, dv2)


def test_chunking_changes_nothing_but_rounding():
    q, k, v = reference.random_qkv(2, 4, 70, 50, 16, seed=7)
    dout = reference.random_qkv(2, 4, 70, 70, 16, seed=8)[0]
    whole = attention_backward_reference(q, k, v, dout, window=(9, 4))
    chunked = attention_backward_reference(q, k, v, dout, window=(9, 4), chunk_rows=7)
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_layouts_agree_and_gqa_sums_over_the_group():
    q, k, v = reference.random_qkv(1, 4, 20, 24, 8, seed=9)
    dout = reference.random_qkv(1, 4, 20, 20, 8, seed=10)[0]
    kg, vg = k[:, :1], v[:, :1]                        # MQA: one K/V head for four
    dq, dk, dv = attention_backward_reference(q, kg, vg, dout)
    # the same as MHA with the K/V head repeated, gradients summed over the copies
    kr, vr = np.repeat(kg, 4, axis=1), np.repeat(vg, 4, axis=1)
    dq4, dk4, dv4 = attention_backward_reference(q, kr, vr, dout)
    np.testing.assert_allclose(dq, dq4, atol=1e-12)
    np.testing.assert_allclose(dk, dk4.sum(axis=1, keepdims=True), atol=1e-12)
    np.testing.assert_allclose(dv, dv4.sum(axis=1, keepdims=True), atol=1e-12)
    t = (lambda x: x.transpose(0, 2, 1, 3))
    b = attention_backward_reference(t(q), t(kg), t(vg), t(dout), layout="bshd")
    for x, y in zip((dq, dk, dv), b):
        np.testing.assert_allclose(t(y), x, atol=1e-12)


def test_bf16_rounding_of_the_inputs():
    """float32 inputs are rounded to bf16 first, as the kernels see them."""
    rng = np.random.default_rng(11)
    q, k, v, dout = (rng.standard_normal((1, 2, 8, 8)).astype(np.float32) for _ in range(4))
    a = attention_backward_reference(q, k, v, dout)
    b = attention_backward_reference(*(x.astype(BF16) for x in (q, k, v, dout)))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kw,words", [
    (dict(dout=np.zeros((1, 2, 9, 8))), ("dout", "shape")),
    (dict(k=np.zeros((1, 3, 8, 8)), v=np.zeros((1, 3, 8, 8))), ("divide",)),
    (dict(k=np.zeros((1, 2, 0, 8)), v=np.zeros((1, 2, 0, 8))), ("key length",)),
])
def test_bad_shapes_are_named(kw, words):
    args = dict(q=np.zeros((1, 2, 8, 8)), k=np.zeros((1, 2, 8, 8)), v=np.zeros((1, 2, 8, 8)),
                dout=np.zeros((1, 2, 8, 8)))
    args.update(kw)
    with pytest.raises(ValueError) as info:
        attention_backward_reference(args["q"], args["k"], args["v"], args["dout"])
    for w in words:
        assert w in str(info.value)
