"""flash_attn_func: FlashAttention's names, order, defaults and layout; the arguments the kernel
cannot honour refused by name before any device work; causal/window_size as FlashAttention means
them, run end to end on the CPU emulator against the float64 reference; torch tensors routed
through the custom op (autograd)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import ptxattn
from ptxattn import flash

# flash_attn.flash_attn_func (FlashAttention 2.x), in order, with defaults
FLASH_ATTN_FUNC = [("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty),
                   ("v", inspect.Parameter.empty), ("dropout_p", 0.0),
                   ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                   ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False),
                   ("return_attn_probs", False)]


def test_the_signature_is_flash_attentions_then_ours_keyword_only():
    params = list(inspect.signature(ptxattn.flash_attn_func).parameters.values())
    theirs = [(p.name, p.default) for p in params[:len(FLASH_ATTN_FUNC)]]
    assert theirs == FLASH_ATTN_FUNC
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:len(FLASH_ATTN_FUNC)])
    ours = params[len(FLASH_ATTN_FUNC):]
    assert [p.name for p in ours] == ["return_lse", "out", "stream"]
    assert all(p.kind is p.KEYWORD_ONLY for p in ours)
    assert ptxattn.flash_attn_func is flash.flash_attn_func
    assert "flash_attn_func" in ptxattn.__all__


@pytest.mark.parametrize("kwargs, named", [
    ({"dropout_p": 0.1}, "dropout_p"), ({"softcap": 30.0}, "softcap"),
    ({"alibi_slopes": np.ones(4, np.float32)}, "alibi_slopes"),
    ({"return_attn_probs": True}, "return_attn_probs"),
])
def test_what_the_kernel_cannot_do_is_refused_by_name(no_driver, kwargs, named):
    q, k, v = ptxattn.random_qkv(1, 4, 64, 64, 64, "bshd", seed=0)
    with pytest.raises(ValueError, match=named):
        ptxattn.flash_attn_func(q, k, v, **kwargs)


def test_positional_dropout_is_read_as_dropout(no_driver):
    """FlashAttention 2's fourth positional argument is dropout_p, not the scale."""
    q, k, v = ptxattn.random_qkv(1, 4, 64, 64, 64, "bshd", seed=0)
    with pytest.raises(ValueError, match="dropout_p"):
        ptxattn.flash_attn_func(q, k, v, 0.5)


def _captured(monkeypatch):
    seen = {}

    def attention(q, k, v, **kwargs):
        seen.update(kwargs)
        return "out"
    monkeypatch.setattr("ptxattn.api.attention", attention)
    return seen


@pytest.mark.parametrize("causal, window_size, expect", [
    (False, (-1, -1), (False, None)),
    (True, (-1, -1), (True, None)),
    (False, (16, 0), (False, (16, 0))),
    (False, (16, 8), (False, (16, 8))),
    (True, (16, 8), (True, (16, 0))),          # FlashAttention: causal sets right = 0
    (True, (-1, 5), (True, None)),
])
def test_causal_and_window_size_map_as_flash_attention_means_them(monkeypatch, causal,
                                                                  window_size, expect):
    seen = _captured(monkeypatch)
    assert ptxattn.flash_attn_func("q", "k", "v", causal=causal, window_size=window_size,
                                   softmax_scale=0.5) == "out"
    assert (seen["causal"], seen["window"]) == expect
    assert seen["layout"] == "bshd" and seen["scale"] == 0.5


def test_a_window_size_that_is_no_pair_is_a_type_error():
    with pytest.raises(TypeError, match="window_size"):
        ptxattn.flash_attn_func("q", "k", "v", window_size=3)


@pytest.mark.parametrize("B, Lq, Lk, H, Hkv, D, causal, window", [
    (1, 70, 130, 2, 2, 64, True, (-1, -1)),        # Lq != Lk, bottom-right causal
    (2, 65, 65, 4, 2, 128, False, (-1, -1)),       # GQA 4:2, a ragged tail
    (1, 96, 96, 2, 1, 64, False, (20, 10)),        # MQA, a two-sided window
])
def test_runs_against_the_float64_reference_on_the_emulator(emulated_gpu, B, Lq, Lk, H, Hkv,
                                                            D, causal, window):
    q, k, v = ptxattn.random_qkv(B, H, Lq, Lk, D, "bshd", seed=Lq + Lk + D, heads_kv=Hkv)
    out, lse = ptxattn.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                       return_lse=True)
    assert out.shape == q.shape and lse.shape == (B, H, Lq)
    mask_window = None if window == (-1, -1) else window
    ref, ref_lse = ptxattn.attention_reference(q, k, v, layout="bshd", causal=causal,
                                               window=mask_window, return_lse=True)
    metrics = ptxattn.error_metrics(out, ref)
    assert ptxattn.passes(metrics), metrics
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 1e-3


def test_torch_tensors_go_through_the_custom_op(monkeypatch):
    torch = pytest.importorskip("torch")
    import ptxattn.torch as pt
    seen = {}

    def attention(q, k, v, **kwargs):
        seen.update(kwargs)
        return q
    monkeypatch.setattr(pt, "attention", attention)
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    assert ptxattn.flash_attn_func(q, q, q, causal=True, window_size=(4, 4),
                                   deterministic=True) is q
    assert seen == {"scale": None, "layout": "bshd", "is_causal": True, "window": (4, 0),
                    "return_lse": False, "deterministic": True}
    with pytest.raises(ValueError, match="out="):
        ptxattn.flash_attn_func(q, q, q, out=q)


# --------------------------------------------------------------------------- the README's block

def test_readme_flash_attention_block_runs_on_the_emulator(emulated_gpu):
    """The README's FlashAttention-style block as written (NumPy in, the emulated H200), and
    its decode and varlen results against the float64 reference."""
    from readme_blocks import python_blocks
    (block,) = python_blocks("## FlashAttention-style calls")
    scope = {"__name__": "__readme__"}
    exec(compile(block, "README.md (FlashAttention-style calls)", "exec"), scope)
    q, k, v = scope["q"], scope["k"], scope["v"]
    lengths = scope["lengths"]
    for b, n in enumerate(lengths):
        ref = ptxattn.attention_reference(q[b:b + 1, -1:], k[b:b + 1, :n], v[b:b + 1, :n],
                                          layout="bshd")
        metrics = ptxattn.error_metrics(scope["o1"][b:b + 1], ref)
        assert ptxattn.passes(metrics), (b, metrics)
    cu = scope["cu"]
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        ref = ptxattn.attention_reference(q[:1, lo:hi], k[:1, lo:hi], v[:1, lo:hi],
                                          layout="bshd", causal=True)
        metrics = ptxattn.error_metrics(scope["o2"][None, lo:hi], ref)
        assert ptxattn.passes(metrics), (s, metrics)
    out, lse = scope["out"], scope["lse"]
    ref = ptxattn.attention_reference(q, k, v, layout="bshd", window=(32, 0))
    assert ptxattn.passes(ptxattn.error_metrics(out, ref)) and lse.shape == (2, 4, 100)


def test_readme_names_every_flash_attention_argument_it_maps():
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = text[text.index("| FlashAttention argument |"):]
    for name, _ in FLASH_ATTN_FUNC[3:]:
        assert f"`{name}`" in table, name
