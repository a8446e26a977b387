"""The README's PyTorch example, run on the CPU with CUDA stood in for, checks what the project
checks: a kernel 5% off (or 1% off) must fail it, the exact answer rounded to bf16 must pass.

The block asserted max |err| < 2e-2 against torch's bf16 SDPA, which a 5% bias at this shape
passes (outputs are ~0.1-0.3). tests/test_gpu_api.py runs the same block on the GPU as
written; here `ptxattn.attention` is replaced by torch's SDPA in float32 (times a bias), and
the CUDA calls by CPU stand-ins, to see what the block's own check accepts.
"""

from __future__ import annotations

import contextlib

import pytest
from readme_blocks import imported_packages, python_blocks

torch = pytest.importorskip("torch")

import ptxattn  # noqa: E402


def torch_block() -> str:
    [block] = [b for b in python_blocks() if "torch" in imported_packages(b)]
    return block


class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def cpu_cuda(monkeypatch):
    """device="cuda" tensors made on the CPU; streams that order nothing (one CPU stream)."""
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **kw: randn(*a, **kw))
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    from_dlpack = torch.from_dlpack
    monkeypatch.setattr(torch, "from_dlpack",
                        lambda x: x if isinstance(x, torch.Tensor) else from_dlpack(x))
    torch.manual_seed(0)


def kernel_off_by(monkeypatch, bias: float):
    """ptxattn.attention as a kernel whose every output is `bias` times the right one."""
    def attention(q, k, v, *, out=None, **kwargs):
        exact = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        result = (exact * bias).to(q.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out
    monkeypatch.setattr(ptxattn, "attention", attention)


def run_block():
    exec(compile(torch_block(), "README.md (PyTorch example)", "exec"), {"__name__": "__readme__"})


def test_the_block_passes_the_exact_answer_in_bf16(cpu_cuda, monkeypatch):
    kernel_off_by(monkeypatch, 1.0)
    run_block()


@pytest.mark.parametrize("bias", [1.05, 1.01])
def test_the_block_fails_a_kernel_off_by_a_few_percent(cpu_cuda, monkeypatch, bias):
    kernel_off_by(monkeypatch, bias)
    with pytest.raises(AssertionError):
        run_block()
