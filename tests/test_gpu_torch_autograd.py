"""ptxattn.torch's autograd on the GPU: loss.backward() on the backward kernels.

In order, so that a failure names its layer: the ops launch and write every element (outputs
poisoned with NaN through the allocator hook); gradients through ptxattn.torch.attention
under the backward's bar (bwd_checks: each of dq, dk, dv against the float64 reference, rel
L2 <= 2 x PyTorch's bf16 math backend's + 1e-3, no NaN/Inf, with the worst heads and rows in
the message) over layouts, GQA/MQA, masks (both diagonals, windows, rows that see no key),
odd lengths, Lq != Lk, head dims 64/128/256, scale; the LSE's own gradient; deterministic=True
bit for bit over 10 runs; torch.compile(fullgraph=True) of forward + backward; a whole
training step (forward, backward, SGD) captured in a CUDA graph and replayed; the SDPA
wrapper, transformers (training, and static-cache decode) and diffusers on tiny models.

Run (the lead, on the H200): PTXATTN_REQUIRE_GPU=1 python -m pytest -q tests/test_gpu_torch_autograd.py
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from bwd_checks import check_grads
from torch_gpu import pt, torch  # noqa: F401  (fixtures)
from ptxattn.reference import BF16

pytestmark = pytest.mark.gpu


def make(torch, shape, seed, grad=False, dtype=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
    return t.to(dtype or torch.bfloat16).requires_grad_(grad)


def host(t):
    return t.detach().float().cpu().numpy().astype(BF16)


def shapes(layout, B, H, Hkv, Lq, Lk, D):
    if layout == "bhld":
        return (B, H, Lq, D), (B, Hkv, Lk, D)
    return (B, Lq, H, D), (B, Lk, Hkv, D)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def counting(monkeypatch, kind):
    """Count the calls that reach one of the ops' kernels (the shipped ones, still run)."""
    from ptxattn.torch import _op
    calls = []
    real = getattr(_op, kind)

    def wrapper(*args):
        calls.append(tuple(args[0].shape))
        return real(*args)
    monkeypatch.setattr(_op, kind, wrapper)
    return calls


# --------------------------------------------------------------------------- launches, elements

@pytest.mark.parametrize("layout", ["bhld", "bshd"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_op_writes_every_element(torch, pt, layout, d):
    """The backward through the torch allocator hook, every output and workspace NaN before
    the launches: dq, dk, dv all finite afterwards (a tile not written shows as NaN)."""
    import ptxattn
    qs, kvs = shapes(layout, 2, 4, 2, 333, 517, d)
    q, k, v, dout = (make(torch, s, i) for i, s in enumerate((qs, kvs, kvs, qs)))
    out, lse = pt.attention(q, k, v, layout=layout, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()

    def poisoned(shape, dtype):
        return torch.full(shape, float("nan"), device="cuda",
                          dtype=torch.float32 if dtype == np.float32 else torch.bfloat16)
    dq, dk, dv = ptxattn.attention_backward(q, k, v, out, lse, dout, layout=layout,
                                            allocator=poisoned)
    torch.cuda.synchronize()
    for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert type(g) is torch.Tensor and g.shape == x.shape
        bad = (~torch.isfinite(g)).sum().item()
        assert bad == 0, f"{name}: {bad} of {g.numel()} elements NaN/Inf (D={d}, {layout})"


def test_autograd_launches_and_writes(torch, pt):
    q, k, v = (make(torch, (1, 2, 200, 128), i, grad=True) for i in range(3))
    out = pt.attention(q, k, v, is_causal=True)
    out.float().sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name


# --------------------------------------------------------------------------- the bar

GRAD_CASES = {
    "bhld-d128-dense": dict(layout="bhld", B=2, H=4, Hkv=4, Lq=257, Lk=257, D=128),
    "bshd-d128-gqa4-lq-lt-lk": dict(layout="bshd", B=1, H=8, Hkv=2, Lq=300, Lk=517, D=128),
    "bhld-d64-mqa-causal": dict(layout="bhld", B=2, H=8, Hkv=1, Lq=383, Lk=383, D=64,
                                causal=True),
    "bshd-d256-gqa2-causal": dict(layout="bshd", B=1, H=4, Hkv=2, Lq=511, Lk=511, D=256,
                                  causal=True),
    "bhld-d128-causal-top-left": dict(layout="bhld", B=1, H=4, Hkv=4, Lq=200, Lk=450, D=128,
                                      causal=True, diagonal="top_left"),
    "bshd-d128-causal-empty-rows": dict(layout="bshd", B=1, H=4, Hkv=2, Lq=450, Lk=200,
                                        D=128, causal=True),
    "bhld-d128-window": dict(layout="bhld", B=1, H=4, Hkv=4, Lq=700, Lk=700, D=128,
                             window=(128, 64)),
    "bshd-d64-causal-window-gqa8": dict(layout="bshd", B=1, H=8, Hkv=1, Lq=641, Lk=641, D=64,
                                        causal=True, window=(100, 0)),
    "bhld-d128-scale-odd": dict(layout="bhld", B=3, H=2, Hkv=1, Lq=1, Lk=4097, D=128,
                                scale=0.3),
    "bhld-d256-lq-gt-lk": dict(layout="bhld", B=1, H=2, Hkv=2, Lq=777, Lk=129, D=256),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_meet_the_bar(torch, pt, name):
    """loss.backward() through ptxattn.torch.attention against the float64 reference
    gradients, under the issue's bar; rows that see no key get dq exactly 0."""
    from bwd_checks import no_key_rows
    c = dict(GRAD_CASES[name])
    mask = {key: c.pop(key) for key in ("causal", "window", "diagonal") if key in c}
    scale = c.pop("scale", None)
    layout = c["layout"]
    qs, kvs = shapes(layout, c["B"], c["H"], c["Hkv"], c["Lq"], c["Lk"], c["D"])
    q, k, v = make(torch, qs, 1, True), make(torch, kvs, 2, True), make(torch, kvs, 3, True)
    dout = make(torch, qs, 4)
    out = pt.attention(q, k, v, layout=layout, scale=scale,
                       is_causal=mask.get("causal", False), window=mask.get("window"),
                       diagonal=mask.get("diagonal", "bottom_right"))
    out.backward(dout)
    grads = [host(t.grad) for t in (q, k, v)]
    check_grads(grads, host(q), host(k), host(v), host(dout), layout=layout, scale=scale,
                **mask)
    empty = no_key_rows(c["Lq"], c["Lk"], **mask)
    if len(empty):
        dq = q.grad if layout == "bhld" else q.grad.transpose(1, 2)
        assert dq[:, :, torch.as_tensor(empty, device="cuda")].abs().max().item() == 0, \
            f"{name}: dq of rows that see no key is not 0 (rows {empty[:8].tolist()}...)"


def test_the_lse_gradient(torch, pt):
    """loss = <out, dout> + <lse, w>: against autograd of float64 math attention on the GPU."""
    q, k, v = (make(torch, s, i, True) for i, s in
               enumerate(((1, 8, 300, 128), (1, 2, 300, 128), (1, 2, 300, 128))))
    dout, w = make(torch, (1, 8, 300, 128), 5), make(torch, (1, 8, 300), 6, dtype=torch.float32)
    out, lse = pt.attention(q, k, v, is_causal=True, return_lse=True)
    got = torch.autograd.grad((out.float() * dout.float()).sum() + (lse * w).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qd, kd, vd = leaves
    kd4, vd4 = (t.repeat_interleave(4, dim=1) for t in (kd, vd))
    s = (qd @ kd4.transpose(-1, -2)) * 128 ** -0.5
    s = s.masked_fill(torch.ones(300, 300, device="cuda", dtype=torch.bool).triu(1),
                      float("-inf"))
    loss = ((torch.softmax(s, -1) @ vd4) * dout.double()).sum() + \
        (torch.logsumexp(s, -1) * w.double()).sum()
    want = torch.autograd.grad(loss, leaves)
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all() and rel(g, r) < 1e-2, f"{name}: rel L2 {rel(g, r):.3g}"


def test_deterministic_is_bitwise_over_10_runs(torch, pt):
    q, k, v = (make(torch, s, i, True) for i, s in
               enumerate(((2, 8, 1000, 128), (2, 2, 1000, 128), (2, 2, 1000, 128))))
    dout = make(torch, (2, 8, 1000, 128), 7)
    first = None
    for run in range(10):
        grads = torch.autograd.grad(pt.attention(q, k, v, is_causal=True, deterministic=True),
                                    (q, k, v), dout)
        if first is None:
            first = grads
            continue
        for name, a, b in zip(("dq", "dk", "dv"), grads, first):
            diff = (a.view(torch.int16) != b.view(torch.int16)).sum().item()
            assert diff == 0, f"run {run}: {name} differs from run 0 in {diff} elements"


# --------------------------------------------------------------------------- compile and graphs

def _block(torch, dim=512, heads=4, heads_kv=2, deterministic=True):
    import ptxattn.torch as pt

    class AttentionBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.d = dim // heads
            self.q = torch.nn.Linear(dim, dim, dtype=torch.bfloat16)
            self.kv = torch.nn.Linear(dim, 2 * heads_kv * self.d, dtype=torch.bfloat16)
            self.o = torch.nn.Linear(dim, dim, dtype=torch.bfloat16)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, heads, self.d)
            k, v = self.kv(x).view(b, s, 2, heads_kv, self.d).unbind(2)
            o = pt.attention(q, k, v, layout="bshd", is_causal=True,
                             deterministic=deterministic)
            return self.o(o.reshape(b, s, -1)).float().square().mean()
    torch.manual_seed(0)
    return AttentionBlock().cuda()


def test_compile_fullgraph_forward_and_backward_match_eager(torch, pt, monkeypatch):
    model = _block(torch)
    x = make(torch, (2, 512, 512), 1)
    model(x).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    backward_calls = counting(monkeypatch, "backward_kernel")
    torch._dynamo.reset()
    try:
        torch.compile(model, fullgraph=True)(x).backward()
    finally:
        torch._dynamo.reset()
    assert backward_calls, "the compiled backward did not reach ptxattn::attention_backward"
    for (name, p), g in zip(model.named_parameters(), eager):
        assert rel(p.grad, g) < 1e-2, f"{name}: compiled against eager {rel(p.grad, g):.3g}"


def test_a_captured_training_step_replays(torch, pt):
    """Forward, backward and an SGD step captured in one CUDA graph (after warm-up steps on a
    side stream), replayed on new batches: the parameters track an eager copy of the model
    trained on the same batches (deterministic attention: the same kernels, the same order)."""
    model = _block(torch)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.5)
    static_x = make(torch, (2, 384, 512), 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                  # warm-up: JIT, maps, allocator pools
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            model(static_x).backward()
            opt.step()
            opt_twin.zero_grad(set_to_none=True)
            twin(static_x).backward()
            opt_twin.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = model(static_x)
        static_loss.backward()
        opt.step()
    torch.cuda.synchronize()
    # the capture ran nothing: replay it step by step against the twin
    for step in range(5):
        x = make(torch, (2, 384, 512), 100 + step)
        static_x.copy_(x)
        graph.replay()
        opt_twin.zero_grad(set_to_none=True)
        loss = twin(x)
        loss.backward()
        opt_twin.step()
        torch.cuda.synchronize()
        assert torch.isfinite(static_loss).item(), f"step {step}: loss not finite"
        assert abs(static_loss.item() - loss.item()) <= 1e-3 * abs(loss.item()), \
            f"step {step}: replayed loss {static_loss.item():.6g}, eager {loss.item():.6g}"
    for (name, p), t in zip(model.named_parameters(), twin.parameters()):
        assert rel(p, t) < 1e-3, f"{name}: replayed against eager {rel(p, t):.3g}"


# --------------------------------------------------------------------------- wrapper and models

def test_sdpa_wrapper_trains_on_ptxattn(torch, pt, monkeypatch):
    calls = counting(monkeypatch, "backward_kernel")
    q = make(torch, (2, 8, 512, 128), 1, True)
    k, v = make(torch, (2, 2, 512, 128), 2, True), make(torch, (2, 2, 512, 128), 3, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    dout = make(torch, out.shape, 4)
    out.backward(dout)
    assert len(calls) == 1 and pt.fallback_counts() == {}
    check_grads([host(t.grad) for t in (q, k, v)], host(q), host(k), host(v), host(dout),
                causal=True)


def test_transformers_llama_training_step(torch, pt, monkeypatch):
    try:
        import transformers
    except Exception as e:
        pytest.skip(f"transformers is not importable (optional, extra `models`): {e}")
    pt.register_transformers()
    cfg = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               max_position_embeddings=1024)
    ids = torch.randint(0, 512, (2, 700), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    calls = counting(monkeypatch, "backward_kernel")
    grads, losses = {}, {}
    for impl in ("sdpa", "ptxattn"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **cfg, attn_implementation=impl)).to("cuda", torch.bfloat16).train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses[impl] = loss.item()
        grads[impl] = {n: p.grad.float() for n, p in model.named_parameters()}
    assert len(calls) == 2, f"backward kernel calls {calls} (2 layers)"
    assert pt.fallback_counts() == {}
    assert abs(losses["ptxattn"] - losses["sdpa"]) < 1e-2 * abs(losses["sdpa"]), losses
    worst = max(grads["sdpa"], key=lambda n: rel(grads["ptxattn"][n], grads["sdpa"][n]))
    err = rel(grads["ptxattn"][worst], grads["sdpa"][worst])
    assert err < 3e-2, f"worst parameter gradient {worst}: rel L2 {err:.3g} against sdpa"


def test_diffusers_wan_training_step(torch, pt, monkeypatch):
    try:
        import diffusers
        from diffusers.models.attention_dispatch import (AttentionBackendName,
                                                         _AttentionBackendRegistry)
    except Exception as e:
        pytest.skip(f"diffusers is not importable (optional, extra `models`): {e}")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=4,
        out_channels=4, text_dim=64, freq_dim=64, ffn_dim=256, num_layers=2,
        rope_max_seq_len=64).to("cuda", torch.bfloat16).train()
    inputs = dict(hidden_states=make(torch, (1, 4, 3, 16, 16), 1),
                  timestep=torch.tensor([500], device="cuda"),
                  encoder_hidden_states=make(torch, (1, 13, 64), 2), return_dict=False)
    model(**inputs)[0].float().square().mean().backward()
    native = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls = counting(monkeypatch, "backward_kernel")
    pt.register_diffusers()
    model.set_attention_backend("ptxattn")
    try:
        model(**inputs)[0].float().square().mean().backward()
    finally:
        model.reset_attention_backend()
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName("native"))
    assert len(calls) == 4, calls                   # 2 layers x (self, cross)
    assert pt.fallback_counts() == {}
    worst = max(native, key=lambda n: rel(dict(model.named_parameters())[n].grad, native[n]))
    err = rel(dict(model.named_parameters())[worst].grad, native[worst])
    assert err < 3e-2, f"worst parameter gradient {worst}: rel L2 {err:.3g} against native"


# --------------------------------------------------------------------------- static cache decode

def _peaked_llama(transformers, torch, impl, layers=2):
    """Random weights with a large lm_head, so greedy tokens have wide margins and a token
    difference means a real difference, not a tie broken by rounding."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=512,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=2048, attn_implementation=impl)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.generation_config.pad_token_id = 0
    return model


def test_static_cache_decode_steps_on_the_decode_kernel(torch, pt, monkeypatch):
    """Teacher-forced decode steps through a StaticCache (eager: the mask is built and checked
    in the forward): every step on the decode kernel with the cache's lengths, logits as
    "sdpa"'s."""
    try:
        import transformers
    except Exception as e:
        pytest.skip(f"transformers is not importable (optional, extra `models`): {e}")
    from ptxattn.torch import kvcache
    pt.register_transformers()
    calls, real = [], kvcache.flash_attn_with_kvcache

    def count(q, kc, vc, **kw):
        calls.append((tuple(q.shape), tuple(kc.shape), kw.get("cache_seqlens")))
        return real(q, kc, vc, **kw)
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", count)
    ids = torch.randint(0, 256, (2, 300), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    nxt = torch.randint(0, 256, (2, 4), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(2))
    logits = {}
    for impl in ("sdpa", "ptxattn"):
        model = _peaked_llama(transformers, torch, impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=512)
        mask = torch.ones(2, 300, dtype=torch.long, device="cuda")
        steps = []
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            for t in range(4):
                mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
                steps.append(model(nxt[:, t:t + 1], attention_mask=mask, past_key_values=cache,
                                   use_cache=True).logits.float())
        logits[impl] = steps
    decode = [c for c in calls if c[0][1] == 1]
    assert len(decode) == 8, f"decode kernel calls {calls} (4 steps x 2 layers)"
    assert [c[2].tolist() for c in decode[::2]] == [[301, 301], [302, 302], [303, 303],
                                                     [304, 304]], decode
    assert all(c[1] == (2, 512, 2, 128) for c in decode), decode
    assert pt.fallback_counts() == {}, pt.fallback_counts()
    for t, (a, b) in enumerate(zip(logits["ptxattn"], logits["sdpa"])):
        assert rel(a, b) < 2e-2, f"decode step {t}: logits rel L2 {rel(a, b):.3g} against sdpa"


def test_static_cache_generate_compiled(torch, pt, monkeypatch):
    """generate(cache_implementation="static") on CUDA: transformers compiles the decode
    forward (mode reduce-overhead: CUDA graphs) and builds each step's mask eagerly. The
    decode kernel runs inside the compiled step (its calls counted where the op's body runs:
    warm-up and recording; replays run the graph), and the greedy tokens are compared with
    "sdpa"'s, reporting where they first differ."""
    try:
        import transformers
    except Exception as e:
        pytest.skip(f"transformers is not importable (optional, extra `models`): {e}")
    from ptxattn.torch import kvcache
    pt.register_transformers()
    runs = []
    real = kvcache._decode.flash_attn_with_kvcache

    def count(*args, **kw):
        runs.append(tuple(args[0].shape))
        return real(*args, **kw)
    monkeypatch.setattr(kvcache._decode, "flash_attn_with_kvcache", count)
    ids = torch.randint(0, 256, (1, 200), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(3))
    tokens = {}
    for impl in ("sdpa", "ptxattn"):
        torch._dynamo.reset()
        model = _peaked_llama(transformers, torch, impl)
        tokens[impl] = model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=24, do_sample=False,
                                      cache_implementation="static")[0, 200:].tolist()
    torch._dynamo.reset()
    assert any(r[1] == 1 for r in runs), f"the decode kernel never ran in a decode step: {runs}"
    first = next((i for i, (a, b) in enumerate(zip(tokens["ptxattn"], tokens["sdpa"]))
                  if a != b), None)
    assert first is None or first >= 12, (
        f"greedy tokens first differ at new token {first}: ptxattn {tokens['ptxattn']}, "
        f"sdpa {tokens['sdpa']}")


def test_return_lse_is_captured_in_a_cuda_graph(torch, pt):
    """The forward with its LSE (what training needs) under CUDA-graph capture: the LSE comes
    from torch's allocator (lse_out=), so the capture succeeds and replays match eager."""
    q, k, v = (make(torch, (2, 4, 777, 128), s) for s in (7, 8, 9))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pt.attention(q, k, v, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = pt.attention(q, k, v, return_lse=True)
    for seed in (10, 20):
        for t, s in zip((q, k, v), range(seed, seed + 3)):
            t.copy_(make(torch, t.shape, s))
        graph.replay()
        out, lse = pt.attention(q, k, v, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(static_out, out), "replayed out differs from eager"
        assert torch.equal(static_lse, lse), "replayed lse differs from eager"


def test_readme_training_block_runs(torch, pt):
    from readme_blocks import python_blocks
    (block,) = python_blocks("## Training")
    exec(compile(block, "README.md", "exec"), {})
