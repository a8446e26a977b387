"""ptxattn.torch's opt-in FP8 path without a GPU: the op flag, the SDPA-semantics router and
the fake implementation (the launch replaced by a CPU stand-in, as in tests/test_torch.py).
Skipped where torch is not installed; the GPU side is tests/test_gpu_fp8.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pt = pytest.importorskip("ptxattn.torch")
from ptxattn.torch import fp8_sdpa  # noqa: E402
from ptxattn.torch import sdpa  # noqa: E402

BF = torch.bfloat16


def qkv(b=1, h=2, lq=16, lk=16, d=128, layout="bshd"):
    g = torch.Generator().manual_seed(0)
    shape = (lambda n: (b, n, h, d)) if layout == "bshd" else (lambda n: (b, h, n, d))
    return (torch.randn(shape(lq), generator=g).to(BF), torch.randn(shape(lk), generator=g).to(BF),
            torch.randn(shape(lk), generator=g).to(BF))


@pytest.fixture
def routed(monkeypatch):
    calls = []

    def kernel(q, k, v, is_causal, scale, layout):
        calls.append(dict(shape=tuple(q.shape), layout=layout, causal=is_causal))
        return torch.zeros_like(q)

    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(fp8_sdpa, "_kernel", kernel)
    pt.reset_fallback_counts()
    yield calls
    pt.reset_fallback_counts()


def test_the_fp8_router_takes_what_the_kernel_takes(routed):
    q, k, v = qkv()
    fp8_sdpa.sdpa_attention(q, k, v, layout="bshd")
    assert routed == [dict(shape=(1, 16, 2, 128), layout="bshd", causal=False)]
    assert pt.fallback_counts() == {}


def test_the_fp8_router_falls_back_to_torch_sdpa(routed):
    q, k, v = qkv()
    mask = torch.zeros(1, 2, 16, 16, dtype=torch.bool)
    with pytest.warns(RuntimeWarning, match="attn_mask"):
        out = fp8_sdpa.sdpa_attention(q, k, v, attn_mask=mask, layout="bshd")
    assert routed == [] and pt.fallback_counts() == {"attn_mask": 1}
    assert out.shape == q.shape


def test_the_op_flag_and_its_errors():
    q, k, v = qkv(layout="bhld")
    with pytest.raises(ValueError, match="precision"):
        pt.attention(q, k, v, precision="int8")
    with pytest.raises(ValueError, match="return_lse"):
        pt.attention(q, k, v, precision="fp8", return_lse=True)
    with pytest.raises(ValueError, match="CUDA"):
        pt.attention(q, k, v, precision="fp8")         # CPU tensors: refused clearly
    with pytest.raises(ValueError, match="window"):
        pt.attention(q, k, v, precision="fp8", window=(16, 0))
    with pytest.raises(ValueError, match="diagonal"):
        pt.attention(q, k, v, precision="fp8", is_causal=True, diagonal="top_left")


def test_the_fp8_fake_impl_traces():
    q, k, v = qkv(layout="bhld")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out = torch.ops.ptxattn.attention_fp8(fq, fk, fv, 0.1, "bhld", False, False)
    assert tuple(out.shape) == tuple(q.shape) and out.dtype == BF


def test_the_fp8_diffusers_backend_is_opt_in():
    """register_diffusers() adds "ptxattn" only; "ptxattn_fp8" comes with fp8=True, and
    registering either never makes it the active backend."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention_dispatch import (AttentionBackendName,
                                                     _AttentionBackendRegistry)
    assert pt.register_diffusers() == "ptxattn"
    assert pt.register_diffusers(fp8=True) == "ptxattn_fp8"
    assert AttentionBackendName("ptxattn_fp8").value == "ptxattn_fp8"
    assert getattr(_AttentionBackendRegistry._active_backend, "value", None) != "ptxattn_fp8"
