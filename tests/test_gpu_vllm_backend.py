"""ptxattn's vLLM backend on the GPU: the emulator tests' vLLM steps (tests/test_vllm_backend.py:
a mixed batch of a prefill, a chunked prefill, decodes and an empty request at block sizes
16/32/64/256 and D 64/128/256, a sliding window, and a decode-only batch; padded tokens at
slot -1) with CUDA tensors, every sequence against the float64 reference, the cache's other
slots and the padded output rows untouched. Then the same step captured in a CUDA graph and
replayed on new contents (vLLM captures its decode steps): the slot writes wait for nothing."""

from __future__ import annotations

import pytest

from torch_gpu import torch  # noqa: F401  (a fixture)
import test_vllm_backend as tv

pytestmark = pytest.mark.gpu


class Cuda:
    """Where tv._step puts its tensors: CUDA device 0."""

    def __init__(self, torch):
        self.torch = torch

    def to_device(self, t):
        return t.to("cuda")

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("block_size,D,H,Hkv,window", tv.MIXED_CASES)
def test_a_mixed_step_meets_the_bar(torch, block_size, D, H, Hkv, window):
    tv.mixed_step(Cuda(torch), block_size, D, H, Hkv, window)
    torch.cuda.synchronize()


def test_a_decode_only_step_meets_the_bar(torch):
    tv.decode_step(Cuda(torch))


def test_a_decode_step_replays_in_a_cuda_graph(torch):
    from ptxattn.torch import vllm_backend as vb
    dev = Cuda(torch)
    gen = torch.Generator().manual_seed(9)
    r = tv._step(dev, gen, query_lens=[1] * 5, cached=[3, 16, 40, 100, 255], block_size=16,
                 H=8, Hkv=2, D=128, padded=2)
    impl, md, kv_cache = r["impl"], r["md"], r["kv_cache"]
    q, k, v, output = r["q"], r["k"], r["v"], r["output"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            impl.do_kv_cache_update(None, k, v, kv_cache, md.slot_mapping)
            impl.forward(None, q, k, v, kv_cache, md, output=output)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(2):
        before = kv_cache.clone()
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        r.update(host_cache=before.cpu(), got=output)
        tv._check(r, window=None, what=f"graph replay {step}")
    assert isinstance(impl, vb.PtxattnImpl)
