"""ptxattn.torch without a GPU: routing and fallback decisions, the op's fake implementation,
torch.compile(fullgraph=True) tracing, and the diffusers/transformers backends on tiny models.

The kernel launch is replaced by a CPU stand-in (`routed`: records each call and computes it
with torch's SDPA in float32), and the CUDA device check by one that accepts CPU tensors, so
"would ptxattn take this call" is tested on CPU tensors. Skipped where torch (or, for their
tests, diffusers/transformers) is not installed; .ci/run installs torch (CPU) and both.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pt = pytest.importorskip("ptxattn.torch")
from ptxattn.torch import sdpa  # noqa: E402

F = torch.nn.functional
BF = torch.bfloat16


def qkv(b=1, h=2, lq=16, lk=16, d=128, hk=None, dtype=BF, layout="bhld", seed=0):
    g = torch.Generator().manual_seed(seed)
    hk = hk or h

    def make(heads, n):
        shape = (b, heads, n, d) if layout == "bhld" else (b, n, heads, d)
        return torch.randn(shape, generator=g).to(dtype)
    return make(h, lq), make(hk, lk), make(hk, lk)


def reference(q, k, v, is_causal, scale, layout):
    """What the stand-in kernel returns: torch's SDPA in float32, rounded to bf16."""
    h_axis = 1 if layout == "bhld" else 2
    gqa = q.shape[h_axis] != k.shape[h_axis]
    out = sdpa._torch_sdpa(q.float(), k.float(), v.float(), None, 0.0, is_causal, scale, gqa,
                           layout)
    return out.to(q.dtype).contiguous()


@pytest.fixture
def routed(monkeypatch):
    """CPU tensors count as ptxattn's CUDA device; kernel calls are recorded and computed by
    `reference`. Counts and warnings start fresh."""
    calls = []

    def kernel(q, k, v, is_causal, scale, layout):
        calls.append(dict(shape=tuple(q.shape), kv=tuple(k.shape), causal=is_causal,
                          scale=scale, layout=layout))
        return reference(q, k, v, is_causal, scale, layout)

    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(sdpa, "_kernel", kernel)
    pt.reset_fallback_counts()
    yield calls
    pt.reset_fallback_counts()


# --------------------------------------------------------------------------- decisions

def test_core_never_imports_torch():
    code = ("import sys, ptxattn, ptxattn.api, ptxattn.reference, ptxattn.tools.bench; "
            "import ptxattn.tools.cli; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kernel_takes_plain_bf16_call(routed):
    assert pt.fallback_reason(*qkv()) is None
    assert pt.fallback_reason(*qkv(h=8, hk=2), enable_gqa=True) is None
    assert pt.fallback_reason(*qkv(lq=5, lk=300)) is None            # any lengths, Lq != Lk
    assert pt.fallback_reason(*qkv(layout="bshd"), layout="bshd") is None


@pytest.mark.parametrize("case, reason", [
    (lambda: dict(args=qkv(dtype=torch.float16)), "dtype"),
    (lambda: dict(args=qkv(dtype=torch.float32)), "dtype"),
    (lambda: dict(args=qkv(d=32)), "head_dim"),        # the production kernel takes 64, 128, 256
    (lambda: dict(args=qkv(d=96)), "head_dim"),
    (lambda: dict(args=qkv(), attn_mask=torch.ones(16, 16, dtype=torch.bool)), "attn_mask"),
    (lambda: dict(args=qkv(), dropout_p=0.1), "dropout"),
    (lambda: dict(args=qkv(h=8, hk=2)), "gqa_without_enable_gqa"),
    (lambda: dict(args=qkv(h=8, hk=3), enable_gqa=True), "gqa_heads"),
    (lambda: dict(args=qkv(lq=8, lk=16), is_causal=True), "causal_lengths"),
    (lambda: dict(args=qkv(lk=0)), "empty"),
    (lambda: dict(args=tuple(t[0] for t in qkv())), "ndim"),
])
def test_fallback_reasons(routed, case, reason):
    c = case()
    args = c.pop("args")
    assert pt.fallback_reason(*args, **c) == reason


def test_causal_waits_for_the_kernel(routed, monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(sdpa._op, "library_takes_causal", lambda: False)
    assert pt.fallback_reason(q, k, v, is_causal=True) == "causal"
    monkeypatch.setattr(sdpa._op, "library_takes_causal", lambda: True)
    assert pt.fallback_reason(q, k, v, is_causal=True) is None


def test_tensors_that_require_grad_are_taken(routed):
    """The op has an autograd formula now: grad no longer falls back, with grad mode on or
    off, on any of q, k, v (and no reason for it remains)."""
    for which in range(3):
        args = list(qkv())
        args[which].requires_grad_(True)
        assert pt.fallback_reason(*args) is None
        assert pt.fallback_reason(*args, is_causal=True) is None
        with torch.no_grad():
            assert pt.fallback_reason(*args) is None
    assert "requires_grad" not in pt.REASONS
    g = [t.requires_grad_(True) for t in qkv(layout="bshd", h=4, hk=2)]
    assert pt.fallback_reason(*g, enable_gqa=True, layout="bshd") is None
    # what still falls back with grad is what falls back without it
    assert pt.fallback_reason(*g, dropout_p=0.1, enable_gqa=True, layout="bshd") == "dropout"


def test_cpu_tensors_fall_back_without_the_fixture():
    pt.reset_fallback_counts()
    assert pt.fallback_reason(*qkv()) == "cpu"


def test_v_head_dim_differs(routed):
    q, k, _ = qkv()
    v = torch.randn(1, 2, 16, 64).to(BF)
    assert pt.fallback_reason(q, k, v) == "head_dim"


# --------------------------------------------------------------------------- the wrapper

def test_routed_call_reaches_the_kernel(routed):
    q, k, v = qkv(h=4, hk=2, lq=10, lk=33)
    out = pt.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    assert len(routed) == 1 and routed[0]["scale"] == 0.3 and routed[0]["layout"] == "bhld"
    torch.testing.assert_close(out, reference(q, k, v, False, 0.3, "bhld"))
    assert pt.fallback_counts() == {}


def test_fallback_is_torch_sdpa_warned_once_and_counted(routed):
    q, k, v = qkv(dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="reason 'dtype'"):
        out = pt.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a second warning would raise here
        pt.scaled_dot_product_attention(q, k, v)
    mask = torch.zeros(16, 16, dtype=torch.bool)
    mask[:, :3] = True
    qb, kb, vb = qkv()
    with pytest.warns(RuntimeWarning, match="reason 'attn_mask'"):
        out = pt.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask),
                               rtol=0, atol=0)
    assert pt.fallback_counts() == {"dtype": 2, "attn_mask": 1}
    assert routed == []


def test_fallback_raises_what_sdpa_raises(routed):
    """GQA without enable_gqa is SDPA's error, not a new one of ours."""
    q, k, v = qkv(h=8, hk=2)
    with pytest.raises(RuntimeError) as ours, pytest.warns(RuntimeWarning):
        pt.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(q, k, v)
    assert str(ours.value) == str(theirs.value)


def test_bshd_fallback_matches_permuted_sdpa(routed):
    q, k, v = qkv(layout="bshd", dtype=torch.float32)
    with pytest.warns(RuntimeWarning):
        out = sdpa.attention(q, k, v, layout="bshd")
    expect = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(out, expect.transpose(1, 2), rtol=0, atol=0)


# --------------------------------------------------------------------------- the op

@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_fake_impl_shapes(layout):
    q, k, v = (t.to("meta") for t in qkv(h=4, hk=2, lq=7, lk=9, layout=layout))
    out, lse = torch.ops.ptxattn.attention(q, k, v, 0.1, layout, False, True)
    assert out.shape == q.shape and out.dtype == BF and out.device.type == "meta"
    assert lse.shape == (1, 4, 7) and lse.dtype == torch.float32
    out, lse = torch.ops.ptxattn.attention(q, k, v, 0.1, layout, False, False)
    assert lse.numel() == 0


def test_op_refuses_cpu_tensors_clearly():
    with pytest.raises(ValueError, match="q: ptxattn::attention runs on CUDA tensors"):
        pt.attention(*qkv())


def test_compile_fullgraph_traces_the_op(routed):
    """torch.compile(fullgraph=True) sees one ptxattn::attention node (no graph break); the
    backend swaps that node for the CPU reference to run the graph."""
    graphs = []

    def stand_in(q, k, v, scale, layout, is_causal, return_lse, *mask_and_backward):
        return reference(q, k, v, is_causal, scale, layout), q.new_empty((0,), dtype=torch.float32)

    ops = (torch.ops.ptxattn.attention, torch.ops.ptxattn.attention.default)

    def backend(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        for node in gm.graph.nodes:
            if node.target in ops:
                node.target = stand_in
        gm.recompile()
        return gm.forward

    # the real op path (not the recording stand-in of `routed`)
    sdpa._kernel = lambda q, k, v, c, s, layout: pt.attention(q, k, v, scale=s, layout=layout,
                                                               is_causal=c)

    def f(q, k, v):
        return pt.scaled_dot_product_attention(q, k, v, enable_gqa=True) * 2

    torch._dynamo.reset()
    q, k, v = qkv(h=4, hk=2, lq=12, lk=20)
    out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    assert len(graphs) == 1 and sum(t in ops for t in graphs[0]) == 1, graphs
    torch.testing.assert_close(out, reference(q, k, v, False, None, "bhld") * 2)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- diffusers

def _tiny_wan():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1,
        rope_max_seq_len=32).to(BF).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g).to(BF),
                  timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, 32, generator=g).to(BF),
                  return_dict=False)
    return model, inputs


def test_diffusers_backend_routes_every_attention_call(routed):
    model, inputs = _tiny_wan()
    with torch.no_grad():
        native = model(**inputs)[0]
        assert pt.register_diffusers() == "ptxattn"
        model.set_attention_backend("ptxattn")
        try:
            ours = model(**inputs)[0]
        finally:
            model.reset_attention_backend()
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry
            _AttentionBackendRegistry.set_active_backend(
                _AttentionBackendRegistry._active_backend.__class__("native"))
    # one layer: self-attention over 2*4*4 = 32 tokens, cross-attention to 7 text tokens
    assert [(c["shape"], c["kv"], c["layout"]) for c in routed] == [
        ((1, 32, 2, 128), (1, 32, 2, 128), "bshd"), ((1, 32, 2, 128), (1, 7, 2, 128), "bshd")]
    assert pt.fallback_counts() == {}
    err = ((ours.float() - native.float()).norm() / native.float().norm()).item()
    assert err < 2e-2, err


# --------------------------------------------------------------------------- transformers

def _tiny_llama(impl):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=128,
                                   max_position_embeddings=64)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(BF).eval()


def test_transformers_causal_prefill_routes_with_gqa(routed, monkeypatch):
    pt.register_transformers()
    monkeypatch.setattr(sdpa._op, "library_takes_causal", lambda: True)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expect = _tiny_llama("sdpa")(ids).logits
        got = _tiny_llama("ptxattn")(ids).logits
    assert [(c["shape"], c["kv"], c["causal"], c["layout"]) for c in routed] == [
        ((2, 24, 2, 128), (2, 24, 1, 128), True, "bshd")]
    torch.testing.assert_close(got.float(), expect.float(), rtol=2e-2, atol=2e-2)


def test_transformers_padding_mask_falls_back_to_sdpa(routed, monkeypatch):
    pt.register_transformers()
    monkeypatch.setattr(sdpa._op, "library_takes_causal", lambda: True)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0                                   # left padding: a real mask
    with torch.no_grad():
        expect = _tiny_llama("sdpa")(ids, attention_mask=mask).logits
        with pytest.warns(RuntimeWarning, match="reason 'attn_mask'"):
            got = _tiny_llama("ptxattn")(ids, attention_mask=mask).logits
    assert routed == [] and pt.fallback_counts() == {"attn_mask": 1}
    torch.testing.assert_close(got, expect, rtol=0, atol=0)


@pytest.mark.parametrize("register, package", [("register_diffusers", "diffusers"),
                                               ("register_transformers", "transformers")])
def test_register_without_the_model_library_says_what_to_install(monkeypatch, register,
                                                                 package):
    """Not a bare ModuleNotFoundError from inside the backend: an ImportError that names the
    call, the library, its minimum version and the install command."""
    monkeypatch.setitem(sys.modules, package, None)          # `import package` fails
    with pytest.raises(ImportError) as err:
        getattr(pt, register)()
    message = str(err.value)
    for words in (f"{register}() needs {package} (>= ", f"pip install '{package}>=",
                  "pip install -e '.[models]'"):
        assert words in message, message
    assert type(err.value).__name__ == "MissingModelLibraryError", repr(err.value)


# --------------------------------------------------------------------------- capstone configs

@pytest.mark.parametrize("which", ["wan", "ltx", "llama"])
def test_capstone_configs_build(which):
    """The published configurations embedded in bench/models/capstone.py are accepted by the
    installed diffusers/transformers (built on the meta device: no memory, no weights)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[1] / "bench" / "models" / "capstone.py"
    spec = importlib.util.spec_from_file_location("capstone", path)
    cap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cap)
    with torch.device("meta"):
        if which == "llama":
            transformers = pytest.importorskip("transformers")
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **{**cap.LLAMA_3_1_8B, "num_hidden_layers": 1}))
            attn = model.model.layers[0].self_attn
            assert (attn.head_dim, attn.num_key_value_groups) == (128, 4)
        else:
            diffusers = pytest.importorskip("diffusers")
            cls, cfg = ((diffusers.WanTransformer3DModel, cap.WAN_T2V_1_3B) if which == "wan"
                        else (diffusers.LTXVideoTransformer3DModel, cap.LTX_VIDEO))
            model = cls(**{**cfg, "num_layers": 1})
            assert model.config.attention_head_dim == cfg["attention_head_dim"]


# --------------------------------------------------------------------------- the eager path

def test_eager_calls_skip_the_dispatcher_only_when_nothing_watches(monkeypatch):
    """ptxattn.torch.attention calls the op's body directly in plain eager mode (the custom
    op's Python dispatch layers are most of a small call's host time), and goes through the
    dispatcher whenever torch could be observing or transforming the call."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from ptxattn.torch import _op
    direct = []
    monkeypatch.setattr(_op, "_run", lambda q, k, v, s, layout, c, *a, **kw: direct.append(s) or q)
    q, k, v = qkv()
    assert _op._eager(q, k, v)
    pt.attention(q, k, v, scale=0.5)
    assert direct == [0.5]

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            if func is torch.ops.ptxattn.attention.default:
                x = args[0]
                return x.new_zeros(x.shape), x.new_empty((0,), dtype=torch.float32)
            return func(*args, **(kwargs or {}))

    with Watch():
        assert not _op._eager(q, k, v)
        out = pt.attention(q, k, v, scale=0.25)
    assert torch.ops.ptxattn.attention.default in seen and direct == [0.5]
    assert out.shape == q.shape

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Functions():
        assert not _op._eager(q, k, v)
    verdicts = []

    def batched(x):
        verdicts.append(_op._eager(x, x, x))
        return x
    torch.vmap(batched)(torch.zeros(3, 1, 2, 4, 8))
    assert verdicts == [False]

    class Sub(torch.Tensor):
        pass
    assert not _op._eager(q.as_subclass(Sub), k, v)
    g = q.clone().requires_grad_()
    assert not _op._eager(g, k, v)                        # the op's autograd wrapper decides
    with torch.no_grad():
        assert _op._eager(g, k, v)
    assert _op._eager(q, k, v)                            # and plain again afterwards


def test_the_op_checks_tma_geometry_once_per_shape_and_copies_what_tma_cannot_read():
    from ptxattn.torch import _op
    q, k, v = qkv(d=128)
    assert _op._tma_ready(q, k, v, "bhld")
    odd = torch.randn(1, 2, 16, 132).to(BF)[..., :128]       # rows 264 bytes apart: not /16
    assert not _op._tma_ready(odd, k, v, "bhld")
    assert _op._compact(odd, "bhld").is_contiguous() and _op._compact(q, "bhld") is q
    assert _op._geometry_ok.cache_info().currsize >= 2


@pytest.fixture
def pretend_cuda(monkeypatch):
    """bench/callpath.py's pretend driver and CPU tensors passing for CUDA ones: the wrapper,
    the op and the library run their real code; launches are recorded, not run."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import callpath
    launches = []
    with callpath.fake_driver(), callpath.torch_pretends_cuda(torch):
        cu = __import__("ptxattn").driver.cu()
        real = cu.cuLaunchKernelEx
        cu.cuLaunchKernelEx = lambda *a: (launches.append(a), real(*a))[1]
        sdpa._capability.clear()
        pt.reset_fallback_counts()
        try:
            yield launches
        finally:
            cu.cuLaunchKernelEx = real
            sdpa._capability.clear()
            pt.reset_fallback_counts()
    sys.modules.pop("callpath", None)


def test_the_wrapper_asks_fallback_reason_once_per_metadata(pretend_cuda, monkeypatch):
    launches = pretend_cuda
    asked = []
    real = sdpa.fallback_reason
    monkeypatch.setattr(sdpa, "fallback_reason", lambda *a, **k: asked.append(1) or real(*a, **k))
    q, k, v = qkv(h=4, hk=2)
    for _ in range(3):
        out = pt.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert len(asked) == 1 and len(launches) == 3 and out.shape == q.shape
    # each argument or metadata the verdict depends on, changed alone: asked again
    pt.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    assert len(asked) == 2
    with pytest.warns(RuntimeWarning, match="enable_gqa"):
        with pytest.raises(RuntimeError):           # torch's SDPA refuses, as it would
            pt.scaled_dot_product_attention(q, k, v)
    assert len(asked) == 3
    with pytest.warns(RuntimeWarning, match="attn_mask"):
        pt.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                        attn_mask=torch.ones(16, 16, dtype=torch.bool))
    assert len(asked) == 4 and pt.fallback_counts() == {"attn_mask": 1,
                                                        "gqa_without_enable_gqa": 1}
    q2, k2, v2 = qkv(h=4, hk=2, lq=32, lk=32)       # new shapes
    pt.scaled_dot_product_attention(q2, k2, v2, enable_gqa=True)
    assert len(asked) == 5
    monkeypatch.setenv("PTXATTN_DEVICE", "1")        # another device for ptxattn: SDPA's
    with pytest.warns(RuntimeWarning, match="device"):
        pt.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert len(asked) == 6 and pt.fallback_counts()["device"] == 1
    monkeypatch.delenv("PTXATTN_DEVICE")
    n = len(launches)
    pt.scaled_dot_product_attention(q, k, v, enable_gqa=True)     # remembered again
    assert len(asked) == 6 and len(launches) == n + 1
    g = q.clone().requires_grad_()                   # grad: never the steady call, but ours
    n = len(launches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # no fallback warning
        out = pt.scaled_dot_product_attention(g, k, v, enable_gqa=True)
    assert len(asked) == 7 and len(launches) == n + 1 and out.requires_grad

    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    with Watch():                                    # an observer: the dispatched op
        pt.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert len(asked) == 8


def test_the_wrapper_reads_no_tensor_while_torch_watches(monkeypatch):
    """Under torch.compile (and any mode or transform) the wrapper's remembered verdicts are
    not consulted and no tensor is read for them: a data_ptr() in a traced function would
    break the graph (fullgraph=True fails)."""
    from torch.overrides import TorchFunctionMode

    from ptxattn import tensors
    from ptxattn.torch import _op

    def forbidden(t):
        raise AssertionError("a tensor was read while torch was watching")
    monkeypatch.setattr(tensors, "torch_meta", forbidden)

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    q, k, v = qkv()
    with Functions():
        assert sdpa._steady(q, k, v, None, 0.0, False, None, False, "bhld") == (None, None)
    monkeypatch.setattr(_op, "_unwatched", lambda: False)
    assert sdpa._steady(q, k, v, None, 0.0, False, None, False, "bhld") == (None, None)


def test_the_wrapper_decision_traces_under_compile_fullgraph():
    """torch.compile(fullgraph=True) traces fallback_reason and _ptxattn_device (plain dict
    lookups, no sentinel objects): a graph break there fails every compiled model."""
    def f(q, k, v):
        why = sdpa.fallback_reason(q, k, v)
        return q + (1 if why is None else 2) + sdpa._ptxattn_device()
    torch._dynamo.reset()
    q, k, v = qkv()
    out = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    assert torch.equal(out, q + 2)                     # CPU tensors: the "cpu" reason
    torch._dynamo.reset()


def test_the_whole_wrapper_traces_under_compile_fullgraph():
    """The shipped seams (no `routed`): the remembered-verdict check, then fallback_reason
    and torch's SDPA for CPU tensors, all inside one graph."""
    def f(q, k, v):
        return pt.scaled_dot_product_attention(q, k, v) * 2
    torch._dynamo.reset()
    q, k, v = qkv(dtype=torch.float32)
    out = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v) * 2)
    torch._dynamo.reset()
