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
    ops = fp8_quantize.quantize(qd, kd, vd, layout, smooth_k=smooth)
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
    vt = fp8_quantize.transpose_v(dev, layout).to_numpy()
    problem = diff("vt8", vt, model.permute_vt(v8, model.padded_keys(Lk)))
    assert problem is None, problem


# =========================================================================== the FP8 forward

import ptxattn                                                              # noqa: E402
from ptxattn.reference import attention_reference, error_metrics, sample_rows   # noqa: E402

MODEL_BAR = 1e-2          # rel L2 of the kernel against the FP8 model (same quantized inputs)
PEER_FACTOR, PEER_SLACK = 1.25, 5e-3     # against float64: <= 1.25 x the model's + 5e-3
LSE_MODEL_TOL = 2e-2      # nats, against the model's LSE


def fp8_call(q, k, v, layout, **kw):
    """Device copies in, a NaN-poisoned bf16 out, precision="fp8" with the LSE; both back."""
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    o, lse = ptxattn.attention(qd, kd, vd, layout=layout, out=out, return_lse=True,
                               precision="fp8", **kw)
    got, got_lse = o.to_numpy(), lse.to_numpy()
    for x in (qd, kd, vd, out):
        x.free()
    return got, got_lse


def check_fp8(q, k, v, layout, seed, **mask):
    """The kernel on sampled rows (every head) against the FP8 model on the same quantized
    inputs and against float64; rows that see no key exactly 0 with lse -inf; no NaN/Inf
    anywhere in out or lse. Returns the figures (printed on failure)."""
    got, got_lse = fp8_call(q, k, v, layout, **mask)
    seq_axis = 2 if layout == "bhld" else 1
    nan_out = int(np.count_nonzero(~np.isfinite(got.astype(np.float32))))
    nan_lse = int(np.count_nonzero(np.isnan(got_lse)))
    rows = sample_rows(q.shape[seq_axis], 256, seed=seed + 7919)
    ref, ref_lse = attention_reference(q, k, v, layout=layout, rows=rows, return_lse=True,
                                       **mask)
    inputs = model.quantize_inputs(q, k, v, layout)
    want, want_lse = model.fp8_attention_model(inputs, rows=rows, return_lse=True, **mask)
    if layout == "bshd":
        want = want.transpose(0, 2, 1, 3)
    mine = np.take(got, rows, axis=seq_axis)
    vs_model, vs_ref, model_ref = (error_metrics(mine, want), error_metrics(mine, ref),
                                   error_metrics(want, ref))
    figures = (f"vs model {vs_model}, vs float64 {vs_ref} (the model's own: {model_ref}), "
               f"non-finite out {nan_out}, NaN lse {nan_lse}")
    assert nan_out == 0 and nan_lse == 0, f"unwritten or non-finite elements: {figures}"
    empty = np.isneginf(ref_lse)
    lse_rows = got_lse[:, :, rows]
    assert (np.isneginf(lse_rows) == empty).all(), \
        f"{int((np.isneginf(lse_rows) != empty).sum())} rows: lse -inf where the reference " \
        f"has keys or finite where it has none; {figures}"
    if empty.any():
        zero = np.moveaxis(mine, seq_axis, 2)[empty] if layout == "bhld" else \
            np.moveaxis(mine, 1, 2)[empty]
        assert (zero.astype(np.float32) == 0).all(), f"rows with no key not 0; {figures}"
    if np.abs(ref).max() == 0:
        return figures
    worst = _worst_heads(mine, want, layout)
    assert vs_model["rel_l2"] <= MODEL_BAR, f"kernel off the FP8 model ({worst}); {figures}"
    assert vs_ref["rel_l2"] <= PEER_FACTOR * model_ref["rel_l2"] + PEER_SLACK, figures
    assert vs_ref["max_abs"] <= PEER_FACTOR * model_ref["max_abs"] + 1e-2 * ref_max(ref), figures
    finite = ~empty
    lse_err = float(np.abs(lse_rows[finite] - want_lse[finite]).max()) if finite.any() else 0.0
    assert lse_err <= LSE_MODEL_TOL, f"lse max error {lse_err:.3e} against the model; {figures}"
    return figures


def ref_max(ref):
    return float(np.abs(ref).max())


def _worst_heads(mine, want, layout):
    """The (batch, head) pairs furthest from the model, for the failure message."""
    m = mine.astype(np.float32).astype(np.float64)
    w = want.astype(np.float64)
    if layout == "bshd":
        m, w = m.transpose(0, 2, 1, 3), w.transpose(0, 2, 1, 3)
    err = np.linalg.norm(m - w, axis=(2, 3)) / np.maximum(np.linalg.norm(w, axis=(2, 3)), 1e-30)
    order = np.argsort(err, axis=None)[::-1][:3]
    return "worst (batch, head): " + ", ".join(
        f"{np.unravel_index(i, err.shape)} {err.ravel()[i]:.3e}" for i in order)


def qkv_fp8(B, H, Hkv, Lq, Lk, D, layout, seed):
    rng = np.random.default_rng(seed)

    def one(h, L):
        shape = (B, h, L, D) if layout == "bhld" else (B, L, h, D)
        return rng.standard_normal(shape, dtype=np.float32).astype(BF16)

    return one(H, Lq), one(Hkv, Lk), one(Hkv, Lk)


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
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 300, 450, 128
    rng = np.random.default_rng(3)

    def e4m3(h, L, spread):
        x = (spread * rng.standard_normal((B, h, L, D))).astype(np.float32)
        return model.to_e4m3(x)

    q8, k8, v8 = e4m3(H, Lq, 100), e4m3(Hkv, Lk, 100), e4m3(Hkv, Lk, 100)
    descales = {n: (rng.random((B, Hkv)) * 0.02 + 0.002).astype(np.float32)
                for n in ("q_descale", "k_descale", "v_descale")}

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
    got = out.to_numpy()
    got = got.transpose(0, 2, 1, 3) if layout == "bshd" else got
    inputs = model.Fp8Inputs(q8, np.repeat(descales["q_descale"], H // Hkv, axis=1)[..., None],
                             k8, descales["k_descale"][..., None],
                             model.permute_vt(v8, model.padded_keys(Lk)),
                             descales["v_descale"][..., None], Lk, k_block=1 << 30)
    want, want_lse = model.fp8_attention_model(inputs, causal=True, return_lse=True)
    m = error_metrics(got, want)
    assert m["nan_count"] == 0 and m["rel_l2"] <= MODEL_BAR, m
    assert np.abs(lse.to_numpy() - want_lse).max() <= LSE_MODEL_TOL
