"""Arguments the public API takes today without a word (issue 28, defect 6): each must become a
clear error naming the argument, raised before the driver is touched, with nothing written.

Written against the public API only (ptxattn.attention, ptxattn.prepare), so that the
attention.py split leaves them as they are. They are strict xfails until the fix lands with
that split: today each call is accepted (or fails with a bare error), so each test fails; the
fix turns them into passes, and strict=True then makes the stale marker itself fail, so that
whoever fixes them removes it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fakes import FAKE_BASE, FakeDLPack

import ptxattn

FIXED_AFTER_SPLIT = pytest.mark.xfail(strict=True, reason="fixed after the attention.py split")
B, H, L, D = 1, 2, 128, 128
SENTINEL = 7.0


def host(shape=(B, H, L, D), seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)


def sentinel_out(shape=(B, H, L, D)):
    return np.full(shape, SENTINEL, np.float32).astype(ml_dtypes.bfloat16)


def refused(kind, name: str, *words, q=None, k=None, v=None, out=None, **kwargs):
    """The call raises `kind` whose message starts with `name:` and holds `words`; `out` (a
    sentinel unless given) is left as it was; prepare() refuses the same way."""
    q = host(seed=0) if q is None else q
    k = host(seed=1) if k is None else k
    v = host(seed=2) if v is None else v
    given_out = out
    out = sentinel_out(tuple(q.shape)) if out is None and isinstance(q, np.ndarray) else out
    before = None if out is None else np.array(out, copy=True)
    for call in (ptxattn.attention, ptxattn.prepare):
        with pytest.raises(kind) as err:
            call(q, k, v, out=out, **kwargs)
        message = str(err.value)
        assert message.startswith(f"{name}:"), message
        for word in words:
            assert word in message, message
        if before is not None and given_out is None:
            assert np.array_equal(np.asarray(out).view(np.uint16), before.view(np.uint16)), \
                "out was written before the error"


@FIXED_AFTER_SPLIT
def test_scale_true_is_not_taken_as_one(no_driver):
    refused(TypeError, "scale", "bool", scale=True)


@FIXED_AFTER_SPLIT
def test_a_scale_past_float32_is_refused_before_it_becomes_inf(no_driver):
    # 1e39 is finite in float64, inf once the kernel's float32 parameter holds it
    refused(ValueError, "scale", "float32", scale=1e39)


@FIXED_AFTER_SPLIT
@pytest.mark.parametrize("window", [{8, 0}, {8: 0, 0: 8}, (x for x in (8, 0))],
                         ids=["set", "dict", "generator"])
def test_a_window_is_a_sequence_pair_not_any_iterable(no_driver, window):
    # a set's order is arbitrary: {8, 0} unpacks as (0, 8) or (8, 0)
    refused(TypeError, "window", "pair", window=window)


@FIXED_AFTER_SPLIT
def test_a_numpy_masked_array_is_refused_not_its_mask_ignored(no_driver):
    q = np.ma.masked_array(host(seed=0), mask=np.zeros((B, H, L, D), bool))
    q.mask[0, 0, 3] = True
    refused(TypeError, "q", "masked", q=q)


@FIXED_AFTER_SPLIT
def test_a_null_device_pointer_is_refused(no_driver):
    q = FakeDLPack((B, H, L, D), ptr=0)
    k, v, out = (FakeDLPack((B, H, L, D), ptr=FAKE_BASE + (i + 1) * (1 << 28))
                 for i in range(3))
    refused(ValueError, "q", "null", q=q, k=k, v=v, out=out)


@FIXED_AFTER_SPLIT
def test_a_stream_handle_past_64_bits_is_a_clear_error(no_driver):
    refused(ValueError, "stream", str(2 ** 64), stream=2 ** 64)


@FIXED_AFTER_SPLIT
def test_q_with_no_heads_and_k_with_two_is_refused(no_driver):
    q = host((B, 0, L, D))
    refused(ValueError, "k", "heads", q=q, out=sentinel_out((B, 0, L, D)))


@FIXED_AFTER_SPLIT
def test_a_diagonal_without_causal_or_a_window_is_refused(no_driver):
    # the diagonal only places a mask; without causal= or window= it would change nothing
    refused(ValueError, "diagonal", "causal", diagonal="top_left")
