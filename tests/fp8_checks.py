"""Checks of the FP8 path against its NumPy model (ptxattn/fp8_reference.py) and the float64
reference, shared by the GPU tests (tests/test_gpu_fp8.py) and the CPU emulator's
(tests/test_emulator_fp8.py). No tests here.

Every failure message says which tensor, how many elements, where the first one is and what
it holds against the model; the forward's names the worst (batch, head) pairs.
"""

from __future__ import annotations

import numpy as np

import ptxattn
from ptxattn import driver, fp8_quantize, tensors
from ptxattn import fp8_reference as model
from ptxattn.reference import BF16, attention_reference, error_metrics, sample_rows

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


# =========================================================================== the FP8 forward

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


DESCALES = ("q_descale", "k_descale", "v_descale")


def prequantized_inputs(B, H, Hkv, Lq, Lk, D, seed, given=DESCALES):
    """e4m3 q, k, v (BHLD, values ~100 wide) and FlashAttention-3's (batch, heads_kv) descales,
    random for the names in `given`, 1 for the rest (what a descale not passed stands for)."""
    rng = np.random.default_rng(seed)

    def e4m3(h, L):
        return model.to_e4m3((100 * rng.standard_normal((B, h, L, D))).astype(np.float32))

    q8, k8, v8 = e4m3(H, Lq), e4m3(Hkv, Lk), e4m3(Hkv, Lk)
    descales = {n: (rng.random((B, Hkv)) * 0.02 + 0.002).astype(np.float32)
                if n in given else np.ones((B, Hkv), np.float32) for n in DESCALES}
    return q8, k8, v8, descales


def check_prequantized(got, lse, q8, k8, v8, descales, block_n=None, **mask):
    """The kernel's out (BHLD) and LSE on e4m3 inputs against the FP8 model on the same e4m3
    values and descales (tiled by block_n keys: None, the FP8 row's; a variant's own)."""
    group = q8.shape[1] // k8.shape[1]
    seq_k = k8.shape[2]
    inputs = model.Fp8Inputs(q8, np.repeat(descales["q_descale"], group, axis=1)[..., None],
                             k8, descales["k_descale"][..., None],
                             model.permute_vt(v8, model.padded_keys(seq_k)),
                             descales["v_descale"][..., None], seq_k, k_block=1 << 30)
    want, want_lse = model.fp8_attention_model(inputs, return_lse=True, block_n=block_n,
                                               **mask)
    m = error_metrics(got, want)
    assert m["nan_count"] == 0 and m["rel_l2"] <= MODEL_BAR, f"out against the model: {m}"
    lse_err = float(np.abs(np.asarray(lse, np.float64) - want_lse).max())
    assert lse_err <= LSE_MODEL_TOL, f"lse max error {lse_err:.3e} against the model"


def variant_call(q8, k8, v8, descales, defines, layout="bhld"):
    """A measurement variant's forward (fp8_forward.prepare with its defines) on e4m3 NumPy
    inputs with FlashAttention-3's descales; (out, lse) as NumPy. Its out is the call's own
    allocation (the emulator's fresh memory is NaN; on the GPU, the check's NaN count and
    the model comparison catch rows left unwritten only where they differ)."""
    from ptxattn import fp8, fp8_forward
    plan = fp8.validate(q8, k8, v8, layout=layout, return_lse=True, **descales)
    prepared = fp8_forward.prepare(plan, defines)
    try:
        prepared.out.fill_u16(0xFFFF)               # poisoned: every element must be written
        prepared.launch()
        got, got_lse = prepared.out.to_numpy(), prepared.lse.to_numpy()
    finally:
        prepared.close()
    return got, got_lse
