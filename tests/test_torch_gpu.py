"""ptxattn.torch on the GPU: the op against torch's math, torch.compile(fullgraph=True) equal
to eager, CUDA-graph capture and replay, each fallback reason, and diffusers/transformers
routing on tiny configurations.

Skips: without torch (or torch without CUDA) these tests skip_or_fail, so PTXATTN_REQUIRE_GPU=1
makes a missing torch a failure. diffusers and transformers are optional model libraries (the
`models` extra): their tests always skip, with the reason, when they are not importable.
"""

from __future__ import annotations

import warnings

import pytest

from gpu_checks import skip_or_fail
from torch_gpu import pt, torch  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu


def make(torch, shape, dtype=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda",
                       dtype=torch.float32).to(dtype or torch.bfloat16)


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def math_sdpa(torch, q, k, v, **kw):
    """torch's SDPA in float32 (the yardstick for bf16 outputs)."""
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_op_matches_math(torch, pt, layout):
    shape_q, shape_kv = ((2, 8, 300, 128), (2, 2, 517, 128)) if layout == "bhld" else \
        ((2, 300, 8, 128), (2, 517, 2, 128))
    q, k, v = make(torch, shape_q, seed=1), make(torch, shape_kv, seed=2), make(torch, shape_kv, seed=3)
    out, lse = pt.attention(q, k, v, layout=layout, return_lse=True)
    qb, kb, vb = (t if layout == "bhld" else t.transpose(1, 2) for t in (q, k, v))
    expect = math_sdpa(torch, qb, kb, vb, enable_gqa=True)
    got = out if layout == "bhld" else out.transpose(1, 2)
    assert got.dtype == torch.bfloat16 and got.shape == expect.shape
    assert rel_l2(got, expect) < 4e-3
    scores = torch.einsum("bhqd,bhkd->bhqk", qb.float(),
                          kb.float().repeat_interleave(4, dim=1)) / 128 ** 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-3, atol=1e-3)


def test_compile_fullgraph_matches_eager(torch, pt):
    q, k, v = (make(torch, (1, 4, 1000, 128), seed=s) for s in (4, 5, 6))

    def f(q, k, v):
        return pt.scaled_dot_product_attention(q, k, v) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    eager = f(q, k, v)
    assert torch.equal(compiled(q, k, v), eager)
    assert pt.fallback_counts() == {}


def test_cuda_graph_capture_and_replay(torch, pt):
    q, k, v = (make(torch, (2, 4, 777, 128), seed=s) for s in (7, 8, 9))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                 # warm-up (JIT, tensor maps) off capture
        pt.scaled_dot_product_attention(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = pt.scaled_dot_product_attention(q, k, v)
    for seed in (10, 20):
        for t, s in zip((q, k, v), range(seed, seed + 3)):
            t.copy_(make(torch, t.shape, seed=s))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, pt.scaled_dot_product_attention(q, k, v))
        assert rel_l2(static_out, math_sdpa(torch, q, k, v)) < 4e-3


def _expect_fallback(torch, pt, reason, call, reference):
    with pytest.warns(RuntimeWarning, match=f"reason '{reason}'"):
        out = call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # warned once: a second call is silent
        call()
    assert pt.fallback_counts() == {reason: 2}
    assert torch.equal(out, reference()), reason


def test_fallbacks_warn_once_and_equal_torch(torch, pt):
    F = torch.nn.functional
    q, k, v = (make(torch, (1, 2, 64, 128), seed=s) for s in (1, 2, 3))
    cases = {
        "dtype": lambda: ((q.half(), k.half(), v.half()), {}),
        "head_dim": lambda: ((q[..., :96].contiguous(), k[..., :96].contiguous(),
                              v[..., :96].contiguous()), {}),
        "attn_mask": lambda: ((q, k, v),
                              {"attn_mask": torch.rand(64, 64, device="cuda") > 0.3}),
        "cpu": lambda: ((q.cpu(), k.cpu(), v.cpu()), {}),
        "causal_lengths": lambda: ((q[:, :, :10], k, v), {"is_causal": True}),
    }
    if not pt.library_takes_causal():
        cases["causal"] = lambda: ((q, k, v), {"is_causal": True})
    for reason, case in cases.items():
        pt.reset_fallback_counts()
        args, kw = case()
        _expect_fallback(torch, pt, reason,
                         lambda: pt.scaled_dot_product_attention(*args, **kw),
                         lambda: F.scaled_dot_product_attention(*args, **kw))


def test_dropout_falls_back_and_grad_runs_on_ptxattn(torch, pt):
    q, k, v = (make(torch, (1, 2, 64, 128), seed=s) for s in (1, 2, 3))
    with pytest.warns(RuntimeWarning, match="reason 'dropout'"):
        out = pt.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()
    qg = q.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # no fallback for grad any more
        out = pt.scaled_dot_product_attention(qg, k, v)
    out.float().sum().backward()
    ref = q.clone().requires_grad_(True)
    math_sdpa(torch, ref, k, v).sum().backward()
    err = rel_l2(qg.grad, ref.grad)
    assert torch.isfinite(qg.grad).all() and err < 1e-2, f"dq against float32 SDPA: {err:.3g}"
    assert pt.fallback_counts() == {"dropout": 1}


def test_gqa_without_enable_gqa_raises_what_sdpa_raises(torch, pt):
    q, k, v = make(torch, (1, 8, 64, 128)), make(torch, (1, 2, 64, 128)), make(torch, (1, 2, 64, 128))
    with pytest.raises(RuntimeError) as ours, pytest.warns(RuntimeWarning):
        pt.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert str(ours.value) == str(theirs.value)
    out = pt.scaled_dot_product_attention(q, k, v, enable_gqa=True)   # routed
    assert rel_l2(out, math_sdpa(torch, q, k, v, enable_gqa=True)) < 4e-3


def _count_kernel_calls(monkeypatch):
    from ptxattn.torch import sdpa
    calls, real = [], sdpa._kernel

    def counting(q, k, v, is_causal, scale, layout):
        calls.append((tuple(q.shape), tuple(k.shape), is_causal, layout))
        return real(q, k, v, is_causal, scale, layout)
    monkeypatch.setattr(sdpa, "_kernel", counting)
    return calls


def test_diffusers_wan_tiny_routes_through_ptxattn(torch, pt, monkeypatch):
    try:
        import diffusers
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    except Exception as e:
        pytest.skip(f"diffusers is not importable (optional, extra `models`): {e}")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=4,
        out_channels=4, text_dim=64, freq_dim=64, ffn_dim=256, num_layers=2,
        rope_max_seq_len=64).to("cuda", torch.bfloat16).eval()
    inputs = dict(hidden_states=make(torch, (1, 4, 3, 16, 16), seed=1),
                  timestep=torch.tensor([500], device="cuda"),
                  encoder_hidden_states=make(torch, (1, 13, 64), seed=2), return_dict=False)
    calls = _count_kernel_calls(monkeypatch)
    with torch.no_grad():
        native = model(**inputs)[0]
        pt.register_diffusers()
        model.set_attention_backend("ptxattn")
        try:
            ours = model(**inputs)[0]
        finally:
            model.reset_attention_backend()
            _AttentionBackendRegistry.set_active_backend(AttentionBackendName("native"))
    assert len(calls) == 4 and all(c[3] == "bshd" for c in calls), calls   # 2 layers x (self, cross)
    assert pt.fallback_counts() == {}
    assert rel_l2(ours, native) < 2e-2


def test_transformers_llama_tiny(torch, pt, monkeypatch):
    try:
        import transformers
    except Exception as e:
        pytest.skip(f"transformers is not importable (optional, extra `models`): {e}")
    pt.register_transformers()
    cfg = dict(vocab_size=128, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               max_position_embeddings=512)

    def model(impl):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **cfg, attn_implementation=impl)).to("cuda", torch.bfloat16).eval()

    ids = torch.randint(0, 128, (2, 300), device="cuda")
    calls = _count_kernel_calls(monkeypatch)
    with torch.no_grad():
        expect = model("sdpa")(ids).logits
        got = model("ptxattn")(ids).logits
    if pt.library_takes_causal():
        assert len(calls) == 2 and all(c[2] for c in calls), calls
        assert rel_l2(got, expect) < 2e-2
    else:                       # causal prefill: transformers' sdpa function, counted
        assert calls == [] and pt.fallback_counts() == {"causal": 2}
        assert torch.equal(got, expect)


def test_readme_model_blocks_run(torch, pt):
    """The python blocks of README "Use ptxattn in your model", as written (the diffusers one
    skips without diffusers, an optional model library)."""
    from readme_blocks import python_blocks
    blocks = python_blocks("## Use ptxattn in your model")
    assert len(blocks) == 2
    for block in blocks:
        if "diffusers" in block:
            try:
                import diffusers  # noqa: F401
            except Exception as e:
                pytest.skip(f"diffusers is not importable (optional, extra `models`): {e}")
        pt.reset_fallback_counts()
        exec(compile(block, "README.md", "exec"), {})
