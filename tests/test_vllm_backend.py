"""ptxattn's vLLM backend (ptxattn/torch/vllm_backend.py) against vLLM's interface, without
vLLM installed: the methods vLLM's AttentionBackend / AttentionImpl define, driven the way
vLLM's model runner drives them, with vLLM's FlashAttentionMetadata fields.

On the CPU emulator with torch tensors in its memory (tests/emulated_torch.py), the real
kernels behind the seams: a vLLM step (do_kv_cache_update of the step's tokens by
slot_mapping, padded tokens at slot -1, then forward) for a mixed batch (a prefill from
nothing, a chunked prefill against a cached prefix, decodes, an empty-query request) and a
decode-only batch, over a shuffled block table; every sequence against the float64 reference
of its own keys, the cache's other slots untouched, the output's padded rows untouched. Also:
the slot writes against a Python model (padded slots, no real token), what the backend refuses,
and the profiling run.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
import packed_checks as pc  # noqa: E402

from emulated_torch import EmulatedTorch  # noqa: E402
from ptxattn.torch import sdpa  # noqa: E402
from ptxattn.torch import vllm_backend as vb  # noqa: E402

BF = torch.bfloat16


@pytest.fixture
def emu(emulated_gpu, monkeypatch):
    monkeypatch.setattr(sdpa, "_capability", {})
    return EmulatedTorch(emulated_gpu, monkeypatch)


def _metadata(dev, query_lens, seq_lens, table):
    """vLLM's FlashAttentionMetadata fields for a batch, its tensors on dev's device."""
    cu = pc.offsets(query_lens)
    return types.SimpleNamespace(
        num_actual_tokens=int(cu[-1]), max_query_len=max(query_lens),
        query_start_loc=dev.to_device(cu), max_seq_len=max(seq_lens),
        seq_lens=dev.to_device(torch.tensor(seq_lens, dtype=torch.int32)),
        block_table=dev.to_device(table), slot_mapping=None, use_cascade=False,
        common_prefix_len=0, causal=True)


def _host(t):
    return t.detach().to("cpu", copy=True)


def _slots(table, starts, query_lens, block_size, padded):
    """vLLM's slot_mapping: token t of request b (position starts[b] + t) goes to slot
    table[b, p // block_size] * block_size + p % block_size; then `padded` slots of -1."""
    slots = []
    for b, (s, n) in enumerate(zip(starts, query_lens)):
        for p in range(s, s + n):
            slots.append(int(table[b, p // block_size]) * block_size + p % block_size)
    return torch.tensor(slots + [-1] * padded, dtype=torch.int64)


def _step(dev, gen, *, query_lens, cached, block_size, H, Hkv, D, window=None, padded=3):
    """One vLLM step through the backend; returns what the checks need. dev: where tensors
    live (to_device, empty): the emulator's memory, or CUDA (tests/test_gpu_vllm_backend.py)."""
    seq_lens = [c + n for c, n in zip(cached, query_lens)]
    B = len(query_lens)
    max_pages = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    table = pc.random_pages(gen, B, seq_lens, block_size, num_blocks, max_pages)
    shape = vb.PtxattnBackend.get_kv_cache_shape(num_blocks, block_size, Hkv, D)
    host_cache = torch.randn(shape, generator=gen).to(BF)
    kv_cache = dev.to_device(host_cache)
    tokens = sum(query_lens)
    # q, k, v as vLLM's layers make them: views into one fused QKV projection (row stride
    # (H + 2 Hkv) D, not their own)
    qkv = dev.to_device(torch.randn(tokens + padded, (H + 2 * Hkv) * D, generator=gen).to(BF))
    q = qkv[:, :H * D].view(-1, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(-1, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(-1, Hkv, D)
    assert q.stride(0) == k.stride(0) == (H + 2 * Hkv) * D
    md = _metadata(dev, query_lens, seq_lens, table)
    md.slot_mapping = dev.to_device(_slots(table, cached, query_lens, block_size, padded))
    impl = vb.PtxattnImpl(H, D, D ** -0.5, Hkv, None, window, "auto")
    impl.do_kv_cache_update(None, k, v, kv_cache, md.slot_mapping)
    output = dev.empty((tokens + padded, H, D), BF)
    output.fill_(float("nan"))
    got = impl.forward(None, q, k, v, kv_cache, md, output=output)
    return dict(got=got, output=output, q=q, k=k, v=v, kv_cache=kv_cache, host_cache=host_cache,
                table=table, md=md, seq_lens=seq_lens, tokens=tokens, impl=impl)


def _check(r, *, window, what):
    assert r["got"] is r["output"], f"{what}: forward returned another tensor"
    kc, vc = _host(r["kv_cache"][0]), _host(r["kv_cache"][1])
    keys = [pc.sequence_keys(kc, r["table"][b], n) for b, n in enumerate(r["seq_lens"])]
    vals = [pc.sequence_keys(vc, r["table"][b], n) for b, n in enumerate(r["seq_lens"])]
    cu_q, cu_k = _host(r["md"].query_start_loc), pc.offsets(r["seq_lens"])
    ref = pc.varlen_reference(_host(r["q"]), torch.cat(keys), torch.cat(vals), cu_q, cu_k,
                              window=(-1, -1) if window is None else (window - 1, 0))
    output = _host(r["output"])
    pc.check_packed(output, ref, cu_q, what)
    assert torch.isnan(output[r["tokens"]:].float()).all(), \
        f"{what}: a padded token's output row was written"
    # the step's tokens landed in their slots, and nothing else moved
    slots = _host(r["md"].slot_mapping)
    written = slots[slots >= 0]
    flat = _host(r["kv_cache"]).view(2, -1, *r["kv_cache"].shape[-2:])
    assert torch.equal(flat[0, written], _host(r["k"])[:r["tokens"]]), f"{what}: keys"
    assert torch.equal(flat[1, written], _host(r["v"])[:r["tokens"]]), f"{what}: values"
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    host = r["host_cache"].view(flat.shape)
    assert torch.equal(flat[:, untouched], host[:, untouched]), \
        f"{what}: a slot outside the step moved"


MIXED_CASES = [(16, 64, 4, 2, None), (64, 128, 4, 1, None), (256, 256, 2, 2, None),
               (32, 128, 4, 2, 40)]


def mixed_step(dev, block_size, D, H, Hkv, window):
    """A prefill from nothing, a chunk against a cached prefix, two decodes, a request whose
    step brings no token (its keys still count: seq_len = cached)."""
    gen = torch.Generator().manual_seed(block_size + D)
    r = _step(dev, gen, query_lens=[70, 33, 1, 1, 0], cached=[0, 150, 40, 300, 20],
              block_size=block_size, H=H, Hkv=Hkv, D=D, window=window)
    _check(r, window=window, what=f"mixed step page {block_size} D {D}")


def decode_step(dev):
    gen = torch.Generator().manual_seed(5)
    r = _step(dev, gen, query_lens=[1] * 7, cached=[0, 1, 15, 16, 17, 200, 511],
              block_size=16, H=8, Hkv=2, D=128, padded=1)
    _check(r, window=None, what="decode-only step")


@pytest.mark.parametrize("block_size,D,H,Hkv,window", MIXED_CASES)
def test_a_mixed_step_meets_the_bar(emu, block_size, D, H, Hkv, window):
    mixed_step(emu, block_size, D, H, Hkv, window)


def test_a_decode_only_step_meets_the_bar(emu):
    decode_step(emu)


def test_write_slots_matches_a_python_model():
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(5, 4, 2, 8, generator=gen).to(BF)
    for slots in ([3, 7, -1, 19, -1], [-1, -1], [0, -1, 1], [12]):
        new = torch.randn(len(slots) + 2, 2, 8, generator=gen).to(BF)
        want = cache.clone().view(-1, 2, 8)
        for i, s in enumerate(slots):
            if s >= 0:
                want[s] = new[i]
        got = cache.clone()
        vb.write_slots(got, new, torch.tensor(slots, dtype=torch.int64))
        assert torch.equal(got.view(-1, 2, 8), want), slots


def test_the_backend_states_what_it_takes():
    B = vb.PtxattnBackend
    assert B.get_name() == "CUSTOM" and B.get_impl_cls() is vb.PtxattnImpl
    assert B.accept_output_buffer and not B.forward_includes_kv_cache_update
    assert B.get_kv_cache_shape(10, 64, 8, 128) == (2, 10, 64, 8, 128)
    for bad in (dict(block_size=48), dict(block_size=512), dict(head_size=96)):
        args = dict(num_blocks=10, block_size=64, num_kv_heads=8, head_size=128) | bad
        with pytest.raises(ValueError, match="ptxattn"):
            B.get_kv_cache_shape(**args)
    assert [B.supports_head_size(d) for d in (64, 80, 128, 256)] == [True, False, True, True]
    assert B.supports_kv_cache_dtype("auto") and not B.supports_kv_cache_dtype("fp8")
    assert B.supports_attn_type("decoder") and not B.supports_attn_type("encoder")
    assert B.supports_compute_capability((9, 0)) and not B.supports_compute_capability((8, 0))
    assert B.supports_combination(128, BF, "auto", 16, True, False, False, (9, 0))
    assert B.supports_combination(128, BF, "auto", 16, False, False, False, (9, 0)) is None


@pytest.mark.parametrize("kw,what", [
    (dict(alibi_slopes=[0.1]), "alibi_slopes"), (dict(logits_soft_cap=30.0), "logits_soft_cap"),
    (dict(sinks=object()), "sinks"), (dict(kv_cache_dtype="fp8_e4m3"), "FP8"),
    (dict(attn_type="encoder"), "attn_type"), (dict(head_size=80), "head size"),
    (dict(some_future_feature=True), "some_future_feature")])
def test_what_the_kernels_lack_is_refused_at_construction(kw, what):
    args = dict(num_heads=8, head_size=128, scale=0.1, num_kv_heads=2) | kw
    with pytest.raises(NotImplementedError, match=what):
        vb.PtxattnImpl(**args)


def test_the_profiling_run_zero_fills_and_bad_calls_say_why():
    impl = vb.PtxattnImpl(4, 64, 0.125, 2)
    out = torch.full((3, 4, 64), float("nan"), dtype=BF)
    assert impl.forward(None, None, None, None, None, None, output=out) is out
    assert torch.count_nonzero(out) == 0
    with pytest.raises(ValueError, match="output"):
        impl.forward(None, None, None, None, None, None)
    with pytest.raises(NotImplementedError, match="quantization"):
        impl.forward(None, None, None, None, None, None, output=out, output_scale=1.0)
    with pytest.raises(NotImplementedError, match="cascade"):
        impl.forward(None, None, None, None, None, types.SimpleNamespace(use_cascade=True),
                     output=out)


def test_register_and_the_builder_need_vllm():
    pytest.importorskip("ptxattn")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vLLM"):
            vb.register()
        with pytest.raises(ImportError, match="vLLM"):
            vb.PtxattnBackend.get_builder_cls()
    else:                                                   # pragma: no cover (CI has none)
        vb.register()
