"""The FP8 path (the quantizer's kernels and the -D PTXATTN_FP8 builds of the production kernel)
run end to end on the CPU emulator, at tiny shapes, against its NumPy model
(ptxattn/fp8_reference.py) and the float64 reference: the same checks as the H200's
tests/test_gpu_fp8.py (tests/fp8_checks.py), before any device run.

Covered: every FP8 head dim (64: three consumers and 192-row tiles; 128; 256: 64-key tiles, two
per K descale), ragged Lq and Lk (a ragged last Q tile reads its block's Q descale; the key tail
is masked), GQA and MQA, causal with both diagonals, sliding windows (one leaving rows without
keys), the LSE, both layouts, a persistent grid walking several tiles, a random schedule,
smoothing of K, pre-quantized e4m3 inputs with FlashAttention-3's descales, and the quantizer
and V's transpose bit for bit. The emulator's fresh memory is all NaN and fp8_call poisons O,
so an element left unwritten fails the check.
"""

from __future__ import annotations

import numpy as np
import pytest
from fp8_checks import (MODEL_BAR, check_fp8, check_prequantized, diff, prequantized_inputs,
                        qkv, qkv_fp8, quantize_on_gpu)

import ptxattn
from ptxattn import driver, fp8_quantize, tensors
from ptxattn import fp8_reference as model
from ptxattn.reference import attention_reference, error_metrics

# (B, H, Hkv, Lq, Lk, D, layout, mask)
FORWARD = [
    (1, 2, 2, 64, 64, 64, "bhld", {}),
    (1, 3, 1, 130, 200, 64, "bshd", dict(causal=True)),
    (1, 2, 2, 1, 1, 128, "bhld", {}),
    (2, 2, 1, 150, 260, 128, "bhld", {}),
    (1, 2, 2, 300, 200, 128, "bshd", dict(causal=True)),
    (1, 1, 1, 150, 260, 128, "bhld", dict(causal=True, diagonal="top_left")),
    (1, 2, 1, 190, 190, 128, "bhld", dict(window=(40, 20))),
    (1, 2, 2, 200, 100, 128, "bhld", dict(window=(10, 0))),     # rows that see no key
    (1, 2, 2, 130, 200, 256, "bhld", {}),
    (1, 4, 1, 100, 300, 256, "bshd", dict(causal=True)),
]


def _case_id(c):
    b, h, hk, lq, lk, d, layout, mask = c
    extra = "-".join(f"{k}={v}" for k, v in mask.items())
    return f"D{d}-{layout}-B{b}-H{h}:{hk}-L{lq}x{lk}" + (f"-{extra}" if extra else "")


@pytest.mark.parametrize("case", FORWARD, ids=_case_id)
def test_fp8_forward_on_the_emulator(emulated_gpu, case):
    b, h, hk, lq, lk, d, layout, mask = case
    q, k, v = qkv_fp8(b, h, hk, lq, lk, d, layout, seed=lq + lk + d)
    check_fp8(q, k, v, layout, seed=lq, **mask)
    names = [launch[0] for launch in emulated_gpu.launches]
    assert names[-1] == "ptxattn_fwd_fp8", names
    report = emulated_gpu.launches[-1][-1]
    assert report is not None and not report.hazards, report.hazards


def test_fp8_persistent_grid_walks_several_tiles(emulated_gpu, monkeypatch):
    """Two CTAs over 2 x 3 heads x 3 ragged Q tiles, causal: the walk, the Q buffers and the
    per-tile Q/K descales across tiles."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    q, k, v = qkv_fp8(2, 3, 1, 300, 300, 128, "bhld", seed=23)
    check_fp8(q, k, v, "bhld", seed=23, causal=True)
    assert emulated_gpu.launches[-1][1][0] <= 2


def test_fp8_k_blocks_of_different_magnitudes(emulated_gpu):
    """K descales per 128 keys folded into each K/V tile's factor (D = 256: two 64-key tiles a
    descale): blocks 30x apart would show a tile-to-scale mix-up."""
    for d in (128, 256):
        q, k, v = qkv_fp8(1, 1, 1, 64, 400, d, "bhld", seed=d + 1)
        kf = k.astype(np.float32)
        kf[:, :, 128:256] *= 3
        kf[:, :, 256:384] *= 0.1
        check_fp8(q, kf.astype(k.dtype), v, "bhld", seed=d)


def test_fp8_under_a_random_schedule(monkeypatch):
    """Random interleaving and completion of the asynchronous units: the same bar, no hazard."""
    from ptxattn.tools.emulator import fake_driver
    fake = fake_driver.install(monkeypatch, seed=99)
    try:
        monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "1")
        q, k, v = qkv_fp8(1, 2, 1, 200, 170, 128, "bhld", seed=3)
        check_fp8(q, k, v, "bhld", seed=3, causal=True)
        assert not fake.launches[-1][-1].hazards
    finally:
        fake_driver.clear_runtime_caches()


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_smoothing_on_the_emulator(emulated_gpu, d):
    """smooth_k: K with a per-channel bias; against the model given the emulated kernel's own
    mean (float32 sums in another order than NumPy's), and closer to float64 than unsmoothed."""
    q, k, v = qkv(1, 2, 1, 150, 200, d, "bhld", seed=d, k_bias=3.0)
    out = ptxattn.attention(q, k, v, precision="fp8", smooth_k=True)
    plain = ptxattn.attention(q, k, v, precision="fp8")
    ops = fp8_quantize.quantize(*(tensors.from_numpy(x) for x in (q, k, v)), "bhld",
                                smooth_k=True)
    k_mean = ops.k_mean.to_numpy()
    ops.close()
    want = model.fp8_attention_model(model.quantize_inputs(q, k, v, smooth_k=True,
                                                           k_mean=k_mean))
    ref = attention_reference(q, k, v)
    vs_model, smooth, unsmooth = (error_metrics(out, want), error_metrics(out, ref),
                                  error_metrics(plain, ref))
    assert vs_model["nan_count"] == 0 and vs_model["rel_l2"] <= MODEL_BAR, vs_model
    assert smooth["rel_l2"] < unsmooth["rel_l2"], (smooth, unsmooth)


@pytest.mark.parametrize("layout,given", [("bhld", ("q_descale", "k_descale", "v_descale")),
                                          ("bshd", ("q_descale", "k_descale", "v_descale")),
                                          ("bhld", ("k_descale",))])
def test_fp8_prequantized_inputs_on_the_emulator(emulated_gpu, layout, given):
    """e4m3 NumPy q, k, v with FlashAttention-3's (batch, heads_kv) descales (a descale not
    given is 1), GQA, causal, a ragged tail: against the model on the same e4m3 values and
    scales."""
    q8, k8, v8, descales = prequantized_inputs(1, 4, 2, 150, 170, 128, seed=3, given=given)

    def to_layout(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bshd" else x

    out, lse = ptxattn.attention(*(to_layout(x) for x in (q8, k8, v8)), layout=layout,
                                 precision="fp8", return_lse=True, causal=True,
                                 **{n: descales[n] for n in given})
    check_prequantized(to_layout(out), lse, q8, k8, v8, descales, causal=True)


@pytest.mark.parametrize("shape,layout,smooth", [
    ((1, 3, 1, 129, 70, 64), "bhld", False),
    ((1, 2, 2, 200, 130, 128), "bshd", True),
    ((1, 2, 1, 70, 200, 256), "bhld", True),
], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_fp8_quantizer_bit_for_bit_on_the_emulator(emulated_gpu, shape, layout, smooth):
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = qkv(B, H, Hkv, Lq, Lk, D, layout, seed=sum(shape), k_bias=3.0 if smooth else 0)
    got = quantize_on_gpu(q, k, v, layout, smooth)
    want = model.quantize_inputs(q, k, v, layout, smooth_k=smooth,
                                 k_mean=got.get("k_mean"))
    problems = [diff(name, got[name], getattr(want, name))
                for name in ("q8", "q_descale", "k8", "k_descale", "vt8", "v_descale")]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def test_fp8_transpose_v_on_the_emulator(emulated_gpu):
    """e4m3 V (every byte pattern but NaN) -> V^T with permuted keys, zeros past Lk."""
    B, Hkv, Lk, D = 1, 2, 150, 64
    raw = np.random.default_rng(D).integers(0, 256, (B, Hkv, Lk, D), dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x11                         # no NaN patterns
    v8 = raw.view(model.E4M3)
    dev = tensors.empty(v8.shape, dtype=model.E4M3)
    driver.memcpy_htod(dev.ptr, v8)
    vt = fp8_quantize.transpose_v(dev, "bhld").to_numpy()
    problem = diff("vt8", vt, model.permute_vt(v8, model.padded_keys(Lk)))
    assert problem is None, problem


# ---- negative controls: a planted bug in one module must fail the checks above --------------

def _plant_in(fake, entry: str, old: str, new: str) -> list[int]:
    """Rewrite `old` to `new` in every loaded module that defines `entry` (each must contain
    `old`); returns a list that counts the rewritten modules."""
    done = []

    def rewrite(text):
        if f".entry {entry}(" not in text:
            return text
        assert old in text, f"planted edit found nothing to replace in {entry}: {old!r}"
        done.append(1)
        return text.replace(old, new)
    fake.rewrite_ptx = rewrite
    return done


def test_control_a_k_descale_of_the_wrong_block_fails(emulated_gpu):
    """K descales read per 256 keys instead of 128: the block-magnitude case must fail."""
    done = _plant_in(emulated_gpu, "ptxattn_fwd_fp8", "shr.u32 %tmp, %kv_key, 7;",
                     "shr.u32 %tmp, %kv_key, 8;")
    q, k, v = qkv_fp8(1, 1, 1, 64, 400, 128, "bhld", seed=129)
    kf = k.astype(np.float32)
    kf[:, :, 128:256] *= 3
    kf[:, :, 256:384] *= 0.1
    with pytest.raises(AssertionError, match="off the FP8 model|vs float64"):
        check_fp8(q, kf.astype(k.dtype), v, "bhld", seed=128)
    assert done


def test_control_padding_rows_in_the_smoothed_k_amax_fail(emulated_gpu):
    """The quantizer counting the zero rows past Lk (minus K's mean) into a K block's amax:
    the bit-for-bit check must fail (the bug the emulator found first)."""
    done = _plant_in(emulated_gpu, "ptxattn_fp8_quantize", "@%p_row max.f32 %amax, %amax, %t;",
                     "max.f32 %amax, %amax, %t;")
    q, k, v = qkv(1, 2, 2, 200, 130, 128, "bshd", seed=5, k_bias=3.0)
    got = quantize_on_gpu(q, k, v, "bshd", True)
    want = model.quantize_inputs(q, k, v, "bshd", smooth_k=True, k_mean=got["k_mean"])
    assert diff("k_descale", got["k_descale"], want.k_descale) is not None
    assert done
