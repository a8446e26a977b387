"""torch's SDPA semantics on the opt-in FP8 path: the FP8 op (ptxattn.torch.fp8) where the
kernel takes the call (the same scope as the bf16 path: ptxattn.torch.fallback_reason), torch's
own SDPA (bf16) elsewhere, warned once per reason and counted with the bf16 path's fallbacks.
The diffusers backend "ptxattn_fp8" calls it. Never the default.
"""

from __future__ import annotations

from . import fp8, sdpa


def _kernel(q, k, v, is_causal, scale, layout):
    """The FP8 path (a seam the CPU tests replace)."""
    return fp8.attention(q, k, v, scale=scale, layout=layout, is_causal=is_causal)


def sdpa_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, layout: str = "bhld"):
    """SDPA semantics in `layout` on the FP8 path where the kernel takes the call; torch's own
    SDPA (bf16) elsewhere, warned once per reason and counted as ptxattn.torch's fallbacks."""
    why = sdpa.fallback_reason(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, layout)
    if why is not None:
        sdpa._note_fallback(why)
        return sdpa._torch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                layout)
    return _kernel(q, k, v, is_causal, scale, layout)
