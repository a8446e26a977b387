"""The FP8 path on the GPU (skipped without one): the quantizer against its NumPy model bit for
bit, and the FP8 forward against the FP8 model and the float64 reference.

Every output the kernels write is poisoned first (e4m3 0xFF and float32 0xFFFFFFFF are NaN),
so an unwritten element shows up as a NaN or a mismatch; every failure message says which
tensor, how many elements, where the first one is and what it holds against the model.
"""

from __future__ import annotations

import numpy as np
import pytest

from ptxattn import driver, fp8, tensors
from ptxattn import fp8_reference as model
from ptxattn.reference import BF16

pytestmark = pytest.mark.gpu


def qkv(B, H, Hkv, Lq, Lk, D, layout, seed, k_bias=0.0):
    """Standard-normal bf16 inputs; K with a per-channel bias shared by its tokens (k_bias)
    so that smoothing has something to remove; one Q block all zeros where there are 2+."""
    rng = np.random.default_rng(seed)

    def one(h, L):
        return rng.standard_normal((B, h, L, D), dtype=np.float32)

    q, k, v = one(H, Lq), one(Hkv, Lk), one(Hkv, Lk)
    k += k_bias * rng.standard_normal((B, Hkv, 1, D), dtype=np.float32)
    if Lq > 128:
        q[0, 0, 128:256] = 0                     # a zero block: descale 1, e4m3 zeros
    out = [x.astype(BF16) for x in (q, k, v)]
    if layout == "bshd":
        out = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in out]
    return out


@pytest.fixture
def poisoned(monkeypatch):
    """Every array the FP8 code allocates comes filled with NaN bytes (0xFF)."""
    real = tensors.empty

    def empty(shape, *, stream=None, dtype=BF16, stream_owner=None):
        arr = real(shape, stream=stream, dtype=dtype, stream_owner=stream_owner)
        if arr.nbytes:
            driver.memset_u8(arr.ptr, 0xFF, arr.nbytes, stream=stream)
        return arr

    monkeypatch.setattr(tensors, "empty", empty)


def diff(name: str, got: np.ndarray, want: np.ndarray) -> str | None:
    """None when equal (bytes for e4m3, values for float32); else what differs and where."""
    assert got.shape == want.shape, f"{name}: shape {got.shape}, the model's {want.shape}"
    if got.dtype == model.E4M3:
        g, w = got.view(np.uint8), want.view(np.uint8)
    else:
        g, w = got.view(np.uint32), want.astype(np.float32).view(np.uint32)
    bad = np.argwhere(g != w)
    if not len(bad):
        return None
    first = tuple(int(i) for i in bad[0])
    nan = int(np.count_nonzero(np.isnan(got.astype(np.float32))))
    return (f"{name}: {len(bad)} of {g.size} elements differ ({nan} NaN: unwritten?), first at "
            f"{first}: got {got[first]!r} (0x{int(g[first]):x}), model {want[first]!r} "
            f"(0x{int(w[first]):x})")


def quantize_on_gpu(q, k, v, layout, smooth):
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    ops = fp8.quantize(qd, kd, vd, layout, smooth_k=smooth)
    got = {"q8": ops.q8.to_numpy(), "q_descale": ops.q_descale[0].to_numpy(),
           "k8": ops.k8.to_numpy(), "k_descale": ops.k_descale[0].to_numpy(),
           "vt8": ops.vt8.to_numpy(), "v_descale": ops.v_descale[0].to_numpy()}
    if smooth:
        got["k_mean"] = ops.k_mean.to_numpy()
    ops.close()
    for x in (qd, kd, vd):
        x.free()
    return got


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
    vt = fp8.transpose_v(dev, layout).to_numpy()
    problem = diff("vt8", vt, model.permute_vt(v8, model.padded_keys(Lk)))
    assert problem is None, problem
