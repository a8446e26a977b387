"""ptxattn.torch's autograd without a GPU: the ops' fakes (opcheck), the autograd formula, the
SDPA wrapper and the model backends in training, torch.compile(fullgraph=True) and make_fx
over forward and backward.

The kernels behind ptxattn::attention and ptxattn::attention_backward are replaced by torch
references on CPU tensors (tests/torch_refs.py, through the seams _op.forward_kernel and
_op.backward_kernel), which keep the kernels' contracts: the backward reference computes the
gradients from the out and lse it is handed. So these tests check everything between the
caller and the kernels (what is saved, recomputed, passed, summed, traced) against autograd
of torch's math attention in float64. The kernels themselves are checked on the GPU
(tests/test_gpu_torch_autograd.py). Skipped without torch.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pt = pytest.importorskip("ptxattn.torch")
import torch_refs  # noqa: E402

from ptxattn.torch import _op, sdpa  # noqa: E402

BF = torch.bfloat16
OP = torch.ops.ptxattn.attention.default
BWD = torch.ops.ptxattn.attention_backward.default


def tensor(shape, seed, grad=False, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g).to(dtype)
    return t.requires_grad_(grad)


def qkv(b=2, h=4, hk=2, lq=9, lk=13, d=64, layout="bhld", grad=True, seed=0):
    def shape(heads, n):
        return (b, heads, n, d) if layout == "bhld" else (b, n, heads, d)
    return (tensor(shape(h, lq), seed, grad), tensor(shape(hk, lk), seed + 1, grad),
            tensor(shape(hk, lk), seed + 2, grad))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def refs(monkeypatch):
    """The torch references behind the ops; the SDPA wrapper's device check accepts CPU
    tensors. CALLS records what reached the "kernels"."""
    calls = torch_refs.install(monkeypatch)
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    pt.reset_fallback_counts()
    yield calls
    pt.reset_fallback_counts()


def math_grads(q, k, v, dout, *, scale, layout="bhld", causal=False, window=None,
               diagonal="bottom_right", lse_weight=None):
    """Autograd of float64 math attention on the same (bf16) values: the yardstick."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = torch_refs.math_attention(*leaves, scale=scale, layout=layout, causal=causal,
                                         window=window, diagonal=diagonal)
    loss = (out * dout.double()).sum()
    if lse_weight is not None:
        loss = loss + (torch.where(torch.isneginf(lse), 0.0, lse) * lse_weight.double()).sum()
    return torch.autograd.grad(loss, leaves), out


# --------------------------------------------------------------------------- opcheck

OPCHECK_FORWARD = {
    "bhld-gqa-lse": dict(layout="bhld", args=(True, True, -1, -1, "bottom_right", False)),
    "bshd-causal-lse": dict(layout="bshd", args=(True, True)),
    "bhld-window-top-left": dict(layout="bhld", args=(False, True, 4, 2, "top_left", True)),
    "bshd-no-lse": dict(layout="bshd", args=(False, False)),
}


@pytest.mark.parametrize("name", list(OPCHECK_FORWARD))
def test_opcheck_attention(refs, name):
    """torch.library.opcheck: schema (no mutation, no aliasing), the autograd registration,
    the fake against the real implementation (shapes, strides, dtypes), AOT dispatch with
    dynamic shapes (forward and backward for tensors that require grad)."""
    case = OPCHECK_FORWARD[name]
    q, k, v = qkv(layout=case["layout"], lq=13, lk=13)
    result = torch.library.opcheck(OP, (q, k, v, 0.125, case["layout"], *case["args"]))
    assert set(result.values()) == {"SUCCESS"}, result
    assert any(c["kind"] == "backward" for c in refs) or not q.requires_grad


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_opcheck_attention_backward(refs, layout):
    q, k, v = (t.detach() for t in qkv(layout=layout))
    out, lse = torch_refs.forward(q, k, v, 0.3, layout, True, None, "bottom_right", True)
    dout = tensor(out.shape, 9)
    result = torch.library.opcheck(BWD, (q, k, v, out, lse, dout, 0.3, layout, True, -1, -1,
                                         "bottom_right", True))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("append", [False, True])
def test_opcheck_flash_attn_with_kvcache(monkeypatch, append):
    """The KV-cache op (issue 24): its fake and its declared in-place appends, with the
    decode call replaced by a torch reference that appends and attends."""
    from ptxattn.torch import kvcache
    monkeypatch.setattr(kvcache._decode, "flash_attn_with_kvcache", torch_refs.kvcache)
    q = tensor((2, 3, 4, 64), 1)
    kc, vc = tensor((2, 20, 2, 64), 2), tensor((2, 20, 2, 64), 3)
    k = tensor((2, 3, 2, 64), 4) if append else None
    v = tensor((2, 3, 2, 64), 5) if append else None
    lengths = torch.tensor([5, 11], dtype=torch.int32)
    args = (q, kc, vc, k, v, lengths, -1, True, -1, -1, 0.125, 0, "bshd")
    result = torch.library.opcheck(torch.ops.ptxattn.flash_attn_with_kvcache.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_kvcache_attention(monkeypatch):
    """The read-only KV-cache op (calls without new keys): its fake, and that it mutates
    nothing."""
    from ptxattn.torch import kvcache
    monkeypatch.setattr(kvcache._decode, "flash_attn_with_kvcache", torch_refs.kvcache)
    q = tensor((2, 1, 4, 64), 1)
    kc, vc = tensor((2, 20, 2, 64), 2), tensor((2, 20, 2, 64), 3)
    lengths = torch.tensor([5, 20], dtype=torch.int32)
    args = (q, kc, vc, lengths, -1, False, -1, -1, 0.125, 0, "bshd")
    result = torch.library.opcheck(torch.ops.ptxattn.kvcache_attention.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("append", [False, True])
def test_a_traced_decode_copies_no_cache_unless_it_appends(monkeypatch, append):
    """Traced through AOT (the graph any backend gets), a call without new keys is the
    read-only op, with no auto_functionalized around the caches (which a backend that does
    not re-inplace runs as a clone of both caches and a copy back, every layer of every
    step); a call that appends stays the mutating op. The answers are the eager ones."""
    from torch._dynamo.backends.common import aot_autograd
    from ptxattn.torch import kvcache
    monkeypatch.setattr(kvcache._decode, "flash_attn_with_kvcache", torch_refs.kvcache)
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm.code)
        return gm
    q = tensor((2, 1, 4, 64), 1)
    kc, vc = tensor((2, 20, 2, 64), 2), tensor((2, 20, 2, 64), 3)
    new = (tensor((2, 1, 2, 64), 4), tensor((2, 1, 2, 64), 5)) if append else (None, None)
    lengths = torch.tensor([5, 11], dtype=torch.int32)

    def step(q, kc, vc, lengths, k=None, v=None):
        return pt.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths) * 2
    eager = step(q, kc.clone(), vc.clone(), lengths, *new)
    torch._dynamo.reset()
    try:
        got = torch.compile(step, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(
            q, kc, vc, lengths, *new)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, graphs
    code = graphs[0]
    if append:
        assert "ptxattn.flash_attn_with_kvcache" in code, code
    else:
        assert "ptxattn.kvcache_attention" in code and "auto_functionalized" not in code \
            and "copy_" not in code, code
    assert torch.equal(got, eager)


def test_fakes_give_the_real_shapes_strides_and_dtypes_on_meta():
    q, k, v = (t.detach().to("meta") for t in qkv(layout="bshd", lq=7, lk=9))
    out, lse = OP(q, k, v, 0.1, "bshd", True, True, -1, -1, "bottom_right", False)
    assert out.shape == q.shape and out.dtype == BF and out.is_contiguous()
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    dq, dk, dv = BWD(q, k, v, out, lse, out, 0.1, "bshd", True, -1, -1, "bottom_right", False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(t.dtype == BF and t.is_contiguous() and t.device.type == "meta"
               for t in (dq, dk, dv))


# --------------------------------------------------------------------------- the autograd formula

GRAD_CASES = {
    "bhld-dense-gqa2": dict(layout="bhld", h=4, hk=2, lq=9, lk=13),
    "bshd-dense-mha": dict(layout="bshd", h=2, hk=2, lq=17, lk=5),
    "bhld-mqa-causal": dict(layout="bhld", h=4, hk=1, lq=11, lk=11, causal=True),
    "bshd-gqa4-causal-lq-lt-lk": dict(layout="bshd", h=8, hk=2, lq=5, lk=12, causal=True),
    "bhld-causal-top-left": dict(layout="bhld", h=2, hk=2, lq=7, lk=12, causal=True,
                                 diagonal="top_left"),
    "bshd-window": dict(layout="bshd", h=4, hk=4, lq=16, lk=16, window=(3, 1)),
    "bhld-causal-window-gqa8": dict(layout="bhld", h=8, hk=1, lq=13, lk=13, causal=True,
                                    window=(4, 0)),
    "bhld-scale": dict(layout="bhld", h=2, hk=1, lq=6, lk=10, scale=0.7, d=128),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_match_autograd_of_math_attention(refs, name):
    case = dict(GRAD_CASES[name])
    mask = {key: case.pop(key) for key in ("causal", "window", "diagonal") if key in case}
    scale = case.pop("scale", None)
    q, k, v = qkv(**case)
    scale_value = scale if scale is not None else q.shape[-1] ** -0.5
    out = pt.attention(q, k, v, scale=scale, layout=case["layout"],
                       is_causal=mask.get("causal", False), window=mask.get("window"),
                       diagonal=mask.get("diagonal", "bottom_right"))
    dout = tensor(out.shape, 77)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want, want_out = math_grads(q, k, v, dout, scale=scale_value, layout=case["layout"],
                                **mask)
    assert rel(out, want_out) < 1e-2
    for g_name, g, w, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == BF, g_name
        assert rel(g, w) < 1e-2, f"{name} {g_name}: rel L2 {rel(g, w):.3g}"
    kinds = [c["kind"] for c in refs]
    assert kinds == ["forward", "backward"], kinds
    fwd, bwd = refs
    assert fwd["return_lse"] is True                    # grad needed: the LSE is computed
    assert bwd["lse_shape"] == (q.shape[0], fwd["q"][1 if case["layout"] == "bhld" else 2],
                                fwd["q"][2 if case["layout"] == "bhld" else 1])
    assert (bwd["scale"], bwd["causal"], bwd["window"], bwd["diagonal"]) == (
        scale_value, mask.get("causal", False), mask.get("window"),
        mask.get("diagonal", "bottom_right"))


def test_rows_that_see_no_key_get_no_gradient(refs):
    """A window that leaves the first rows with no key (bottom-right, Lk < Lq): those rows'
    output and dq are 0 and they give nothing to dk, dv (the rest against math autograd)."""
    q, k, v = qkv(h=2, hk=2, lq=10, lk=4)
    out = pt.attention(q, k, v, is_causal=True)        # query i sees keys <= i - 6
    dout = tensor(out.shape, 5)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert out[:, :, :6].abs().max() == 0 and dq[:, :, :6].abs().max() == 0
    want, _ = math_grads(q, k, v, dout, scale=0.125, causal=True)
    for g, w in zip((dq, dk, dv), want):
        assert rel(g, w) < 1e-2


def test_deterministic_reaches_the_backward_kernel(refs):
    q, k, v = qkv()
    out = pt.attention(q, k, v, deterministic=True)
    out.sum().backward()
    assert [c.get("deterministic") for c in refs if c["kind"] == "backward"] == [True]
    refs.clear()
    pt.attention(q, k, v).sum().backward()
    assert [c.get("deterministic") for c in refs if c["kind"] == "backward"] == [False]


def test_a_gradient_through_the_lse_is_included(refs):
    """loss = <out, dout> + <lse, w>: the LSE's gradient (P K for dq, P^T (w q) for dk, two
    more kernel calls) is added; without it dq and dk would be off by far more than 1e-2."""
    q, k, v = qkv(layout="bshd", h=4, hk=2, lq=8, lk=8)
    out, lse = pt.attention(q, k, v, layout="bshd", is_causal=True, return_lse=True)
    dout, w = tensor(out.shape, 3), tensor(lse.shape, 4, dtype=torch.float32)
    got = torch.autograd.grad((out.float() * dout.float()).sum() + (lse * w).sum(), (q, k, v))
    want, _ = math_grads(q, k, v, dout, scale=0.125, layout="bshd", causal=True, lse_weight=w)
    without, _ = math_grads(q, k, v, dout, scale=0.125, layout="bshd", causal=True)
    for name, g, wg, wo in zip(("dq", "dk", "dv"), got, want, without):
        assert rel(g, wg) < 1e-2, f"{name}: {rel(g, wg):.3g}"
        if name != "dv":                                # dv does not depend on the LSE
            assert rel(wo, wg) > 5e-2, name
    kinds = [c["kind"] for c in refs]
    assert kinds == ["forward", "backward", "forward", "backward"], kinds
    # only the LSE used: dout is zero, the main backward still runs (its dq, dk are 0)
    refs.clear()
    out, lse = pt.attention(q, k, v, layout="bshd", return_lse=True)
    got = torch.autograd.grad((lse * w).sum(), (q, k))
    want, _ = math_grads(q, k, v, torch.zeros_like(out), scale=0.125, layout="bshd",
                         lse_weight=w)
    assert rel(got[0], want[0]) < 1e-2 and rel(got[1], want[1]) < 1e-2


def test_the_op_called_without_its_lse_recomputes_it_in_the_backward(refs):
    q, k, v = qkv()
    out, lse = OP(q, k, v, 0.125, "bhld", True, False)
    assert lse.numel() == 0
    dout = tensor(out.shape, 8)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert [(c["kind"], c.get("return_lse")) for c in refs] == [
        ("forward", False), ("forward", True), ("backward", None)]
    want, _ = math_grads(q, k, v, dout, scale=0.125, causal=True)
    for g, w in zip(got, want):
        assert rel(g, w) < 1e-2


def test_no_grad_mode_and_inputs_without_grad_record_nothing(refs):
    q, k, v = qkv()
    with torch.no_grad():
        out = pt.attention(q, k, v)
    assert not out.requires_grad and refs[-1]["return_lse"] is False
    q2, k2, v2 = (t.detach() for t in (q, k, v))
    assert not pt.attention(q2, k2, v2).requires_grad
    # grad for k alone: the formula runs, dq is not asked for
    k2.requires_grad_(True)
    out = pt.attention(q2, k2, v2)
    (dk,) = torch.autograd.grad(out.sum(), (k2,))
    assert dk.shape == k2.shape


def test_mask_arguments_are_checked_by_name():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="window"):
        pt.attention(q, k, v, window=3)
    with pytest.raises(ValueError, match="window: left"):
        pt.attention(q, k, v, window=(-2, 0))
    with pytest.raises(ValueError, match="diagonal"):
        pt.attention(q, k, v, diagonal="centre")


# --------------------------------------------------------------------------- the SDPA wrapper

@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_the_sdpa_wrapper_trains_on_ptxattn(refs, layout):
    """A tensor that requires grad no longer falls back: forward and backward run on the ops
    (no fallback counted, no warning), and the gradients are SDPA's."""
    q, k, v = qkv(layout=layout, h=4, hk=2, lq=12, lk=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sdpa.attention(q, k, v, is_causal=True, enable_gqa=True, layout=layout)
    dout = tensor(out.shape, 6)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert pt.fallback_counts() == {}
    assert [c["kind"] for c in refs] == ["forward", "backward"]
    assert refs[0]["diagonal"] == "bottom_right" and refs[0]["causal"] is True
    want, _ = math_grads(q, k, v, dout, scale=0.125, layout=layout, causal=True)
    for g, w in zip(got, want):
        assert rel(g, w) < 1e-2


def test_what_still_falls_back_in_training_warns_once_and_counts(refs):
    q, k, v = qkv(h=2, hk=2, lq=8, lk=8)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with pytest.warns(RuntimeWarning, match="reason 'attn_mask'"):
        out = pt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.float().sum().backward()
    assert q.grad is not None and pt.fallback_counts() == {"attn_mask": 2} and refs == []


# --------------------------------------------------------------------------- compile and tracing

class TinyAttention(torch.nn.Module):
    """Projections around ptxattn's SDPA wrapper: GQA 4:2, causal, (B, S, H, D) in."""

    def __init__(self, dim=256, heads=4, heads_kv=2):
        super().__init__()
        self.heads, self.heads_kv, self.d = heads, heads_kv, dim // heads
        self.q = torch.nn.Linear(dim, dim, dtype=BF)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * self.d, dtype=BF)
        self.o = torch.nn.Linear(dim, dim, dtype=BF)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.heads_kv, self.d).unbind(2)
        o = pt.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                            is_causal=True, enable_gqa=True)
        return self.o(o.transpose(1, 2).reshape(b, s, -1)).float().square().mean()


def _recording_backend(graphs):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(name):
        def compiler(gm, example_inputs):
            graphs[name] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))


def test_compile_fullgraph_traces_forward_and_backward(refs):
    """torch.compile(fullgraph=True) of a module's forward + loss.backward(): one graph, the
    forward graph holds ptxattn::attention (asked for its LSE), the backward graph
    ptxattn::attention_backward, and the gradients equal eager ones."""
    torch.manual_seed(0)
    model = TinyAttention()
    x = tensor((2, 16, 256), 1)
    model(x).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    graphs = {}
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))
        compiled(x).backward()
    finally:
        torch._dynamo.reset()
    assert graphs["forward"].count(OP) == 1 and BWD not in graphs["forward"], graphs["forward"]
    assert graphs["backward"].count(BWD) == 1 and OP not in graphs["backward"], \
        graphs["backward"]
    for p, g in zip(model.parameters(), eager):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    assert pt.fallback_counts() == {}


@pytest.mark.slow
def test_compile_with_inductor_on_the_cpu(refs):
    """The default backend (inductor, C++ on the CPU) compiles the module's forward and
    backward around the opaque ops, and gives the eager gradients (to rounding)."""
    torch.manual_seed(0)
    model = TinyAttention()
    x = tensor((1, 8, 256), 2)
    model(x).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    try:
        torch.compile(model, fullgraph=True)(x).backward()
    finally:
        torch._dynamo.reset()
    for p, g in zip(model.parameters(), eager):
        torch.testing.assert_close(p.grad.float(), g.float(), rtol=2e-2, atol=2e-3)
    assert {c["kind"] for c in refs} == {"forward", "backward"}


def test_make_fx_traces_forward_and_backward_with_the_fakes_only():
    """Fake tensors, no kernel and no seam: the traced training step holds the forward op
    with return_lse=True and the backward op, whose outputs have q's, k's and v's shapes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, dout):
        out = pt.attention(q, k, v, layout="bshd", is_causal=True, window=(8, 0),
                           deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    q, k, v = qkv(layout="bshd", h=8, hk=2, lq=33, lk=33)
    gm = make_fx(step, tracing_mode="fake")(q, k, v, tensor(q.shape, 3))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    fwd = [n for n in nodes if n.target is OP]
    bwd = [n for n in nodes if n.target is BWD]
    assert len(fwd) == 1 and len(bwd) == 1, [n.target for n in nodes]
    assert fwd[0].args[3:] == (0.125, "bshd", True, True, 8, 0, "bottom_right", True)
    assert bwd[0].args[6:] == (0.125, "bshd", True, 8, 0, "bottom_right", True)
    shapes = [tuple(x.meta["val"].shape) for x in gm.graph.output_node().args[0]]
    assert shapes == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]


# --------------------------------------------------------------------------- model backends

def test_transformers_llama_trains_on_ptxattn(refs):
    """A training step of a tiny Llama (GQA 4:2, labels, loss.backward()) with
    attn_implementation="ptxattn": every layer's attention runs forward and backward on the
    ops, no fallback, and the parameter gradients are those of the "sdpa" implementation."""
    transformers = pytest.importorskip("transformers")
    pt.register_transformers()
    cfg = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=64)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    grads = {}
    for impl in ("sdpa", "ptxattn"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **cfg, attn_implementation=impl)).to(BF).train()
        model(ids, labels=ids).loss.backward()
        grads[impl] = {n: p.grad.float() for n, p in model.named_parameters()}
    kinds = [c["kind"] for c in refs]
    assert kinds.count("forward") == 2 and kinds.count("backward") == 2, kinds
    assert all(c["causal"] for c in refs)
    assert pt.fallback_counts() == {}
    for name, g in grads["sdpa"].items():
        assert rel(grads["ptxattn"][name], g) < 3e-2, name


def test_diffusers_wan_trains_on_ptxattn(refs):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1,
        rope_max_seq_len=32).to(BF).train()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g).to(BF),
                  timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, 32, generator=g).to(BF),
                  return_dict=False)
    model(**inputs)[0].float().square().mean().backward()
    native = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    pt.register_diffusers()
    model.set_attention_backend("ptxattn")
    try:
        model(**inputs)[0].float().square().mean().backward()
    finally:
        model.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(
            _AttentionBackendRegistry._active_backend.__class__("native"))
    kinds = [c["kind"] for c in refs]
    assert kinds.count("forward") == 2 and kinds.count("backward") == 2, kinds   # self, cross
    assert pt.fallback_counts() == {}
    for n, p in model.named_parameters():
        assert rel(p.grad, native[n]) < 3e-2, n


# --------------------------------------------------------------------------- the real op code

@pytest.fixture
def pretend_cuda(monkeypatch):
    """bench/callpath.py's pretend driver and CPU tensors passing for CUDA ones: the ops run
    their real code (the library's validation, tensor maps, parameter packing), launches and
    the library's own allocations are recorded, nothing runs."""
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import callpath

    from ptxattn import backward, driver
    launches, allocs = [], []
    saved_functions = dict(backward._FUNCTIONS)
    with callpath.fake_driver(), callpath.torch_pretends_cuda(torch):
        backward._FUNCTIONS.clear()                 # pretend kernels never outlive the pretence
        cu = driver.cu()
        launch, alloc = cu.cuLaunchKernelEx, cu.cuMemAllocAsync
        cu.cuLaunchKernelEx = lambda *a: (launches.append(a), launch(*a))[1]
        cu.cuMemAllocAsync = lambda *a: (allocs.append(a), alloc(*a))[1]
        sdpa._capability.clear()
        pt.reset_fallback_counts()
        try:
            yield launches, allocs
        finally:
            cu.cuLaunchKernelEx, cu.cuMemAllocAsync = launch, alloc
            backward._FUNCTIONS.clear()
            backward._FUNCTIONS.update(saved_functions)
            sdpa._capability.clear()
            pt.reset_fallback_counts()
    sys.modules.pop("callpath", None)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_training_step_allocates_only_from_torch(pretend_cuda, deterministic):
    """Forward (with its LSE) and backward through the real op code: one forward launch and
    three backward launches, and no allocation by the library itself (every output, the LSE
    and every workspace come from torch's allocator: what CUDA-graph capture of a training
    step needs). The gradients come back as torch tensors of the inputs' shapes."""
    launches, allocs = pretend_cuda
    q, k, v = qkv(layout="bshd", h=4, hk=2, lq=70, lk=70, d=128)
    before = len(allocs)
    out = pt.attention(q, k, v, layout="bshd", is_causal=True, deterministic=deterministic)
    assert len(launches) == 1 and out.requires_grad
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert len(launches) == 4, len(launches)
    assert len(allocs) == before, "the library allocated memory of its own"
    for g, x in zip((dq, dk, dv), (q, k, v)):
        assert type(g) is torch.Tensor and g.shape == x.shape and g.dtype == BF
