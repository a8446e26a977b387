"""ptxattn.torch's opt-in FP8 path on the GPU: the op flag (ptxattn::attention_fp8) on CUDA bf16
tensors against the FP8 model (ptxattn/fp8_reference.py) and the float64 reference,
torch.compile(fullgraph=True) equal to eager, the SDPA-semantics router, and torch.float8_e4m3fn
tensors with FlashAttention-3's descales as CUDA tensors. The CPU side is tests/test_torch_fp8.py.

Every failure message gives the error figures, the NaN count and the worst (batch, head).
"""

from __future__ import annotations

import numpy as np
import pytest
from fp8_checks import MODEL_BAR, PEER_FACTOR, PEER_SLACK, check_prequantized, prequantized_inputs
from torch_gpu import pt, torch  # noqa: F401  (fixtures)

from ptxattn import fp8_reference as model
from ptxattn.reference import BF16, attention_reference, error_metrics

pytestmark = pytest.mark.gpu


def to_numpy_bf16(torch, x):
    return x.detach().cpu().contiguous().view(torch.int16).numpy().view(BF16)


def cuda_qkv(torch, B, H, Hkv, Lq, Lk, D, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(h, L):
        shape = (B, h, L, D) if layout == "bhld" else (B, L, h, D)
        return torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)

    return one(H, Lq), one(Hkv, Lk), one(Hkv, Lk)


def check_against_model(torch, out, q, k, v, layout, causal):
    """out (a CUDA bf16 tensor) against the FP8 model on the same bf16 inputs and float64."""
    qn, kn, vn = (to_numpy_bf16(torch, x) for x in (q, k, v))
    got = to_numpy_bf16(torch, out)
    want = model.fp8_attention_model(model.quantize_inputs(qn, kn, vn, layout), causal=causal)
    if layout == "bshd":
        want = want.transpose(0, 2, 1, 3)
    ref = attention_reference(qn, kn, vn, layout=layout, causal=causal)
    vs_model, vs_ref, model_ref = (error_metrics(got, want), error_metrics(got, ref),
                                   error_metrics(want, ref))
    g = got.astype(np.float64) if layout == "bhld" else got.astype(np.float64).transpose(0, 2, 1, 3)
    w = want if layout == "bhld" else want.transpose(0, 2, 1, 3)
    per_head = np.linalg.norm(g - w, axis=(2, 3)) / np.maximum(np.linalg.norm(w, axis=(2, 3)),
                                                               1e-30)
    worst = np.unravel_index(int(np.nanargmax(per_head)), per_head.shape)
    figures = (f"vs model {vs_model}, vs float64 {vs_ref} (the model's own {model_ref}); "
               f"worst (batch, head) {tuple(int(i) for i in worst)} at "
               f"{float(per_head[worst]):.3e}")
    assert vs_model["nan_count"] == 0, f"non-finite output: {figures}"
    assert vs_model["rel_l2"] <= MODEL_BAR, f"off the FP8 model: {figures}"
    assert vs_ref["rel_l2"] <= PEER_FACTOR * model_ref["rel_l2"] + PEER_SLACK, figures


@pytest.mark.parametrize("layout,causal,shape", [
    ("bhld", False, (1, 2, 2, 64, 64, 128)),
    ("bshd", True, (2, 4, 2, 300, 517, 128)),
    ("bhld", True, (1, 3, 1, 200, 130, 64)),
    ("bshd", False, (1, 2, 1, 129, 400, 256)),
])
def test_the_fp8_op_meets_the_model(torch, pt, layout, causal, shape):
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = cuda_qkv(torch, B, H, Hkv, Lq, Lk, D, layout, seed=sum(shape))
    out = pt.attention(q, k, v, layout=layout, is_causal=causal, precision="fp8")
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_cuda
    check_against_model(torch, out, q, k, v, layout, causal)


def test_the_fp8_op_compiles_to_the_same_answer(torch, pt):
    q, k, v = cuda_qkv(torch, 1, 4, 2, 300, 300, 128, "bshd", seed=7)

    def f(q, k, v):
        return pt.attention(q, k, v, layout="bshd", is_causal=True, precision="fp8") * 2

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    same = torch.equal(eager.view(torch.int16), compiled.view(torch.int16))
    assert same, (f"{int((eager != compiled).sum())} elements differ between eager and "
                  "torch.compile")


def test_the_fp8_router_runs_the_kernel(torch, pt):
    from ptxattn.torch import fp8_sdpa
    q, k, v = cuda_qkv(torch, 1, 2, 2, 200, 200, 128, "bhld", seed=11)
    out = fp8_sdpa.sdpa_attention(q, k, v, is_causal=False)
    assert pt.fallback_counts() == {}, pt.fallback_counts()
    check_against_model(torch, out, q, k, v, "bhld", False)


def test_torch_e4m3_tensors_with_cuda_descales(torch, pt):
    """torch.float8_e4m3fn CUDA q, k, v and float32 CUDA (batch, heads_kv) descales, BSHD,
    causal: read in place, against the model on the same e4m3 values and scales."""
    import ptxattn
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    q8, k8, v8, descales = prequantized_inputs(1, 4, 2, 300, 450, 128, seed=13)

    def cuda_e4m3(x):
        bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).view(np.uint8)
        return torch.from_numpy(bshd).cuda().view(torch.float8_e4m3fn)

    scales = {n: torch.from_numpy(x).cuda() for n, x in descales.items()}
    out, lse = ptxattn.attention(*(cuda_e4m3(x) for x in (q8, k8, v8)), layout="bshd",
                                 precision="fp8", return_lse=True, causal=True, **scales)
    got = np.asarray(out.to_numpy() if hasattr(out, "to_numpy") else to_numpy_bf16(torch, out))
    lse = lse.to_numpy() if hasattr(lse, "to_numpy") else lse.cpu().numpy()
    check_prequantized(got.transpose(0, 2, 1, 3), lse, q8, k8, v8, descales, causal=True)
