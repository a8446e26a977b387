"""attn_implementation="ptxattn" for transformers models (AttentionInterface).

transformers hands attention functions (batch, heads, seq, head_dim) views that are
transposes of its (batch, seq, heads, head_dim) projections. Transposed back they are that
layout again, which ptxattn reads in place (layout="bshd"), and its output comes out
(batch, seq, heads, head_dim) contiguous: what transformers wants back, without the
transpose-and-copy that its "sdpa" function does.

Masks come from transformers' sdpa mask builder (registered for "ptxattn" too): for a plain
causal prefill with no padding it returns no mask and the call is `is_causal`. Any call the
kernel does not take (a padding or sliding-window mask, causal before the kernel has it,
position bias, softcap, fp16 ...) goes whole to transformers' own "sdpa" function, warned once
per reason and counted (ptxattn.torch.fallback_counts()).

Decode steps (1 to 16 queries, no mask: transformers' dynamic-cache decode) go to the split-KV
decode kernel (ptxattn.torch.kvcache.decode_step), which computes what the "sdpa" function
would for the same call.
"""

from __future__ import annotations

import torch

from . import sdpa

NAME = "ptxattn"
_DECODE_MAX_QUERIES = 16         # decode_builds.MAX_QUERIES: calls the decode kernel takes


def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def ptxattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature; returns (output (B, S, H, D), None)."""
    def fallback(reason: str):
        sdpa._note_fallback(reason)
        return _sdpa_forward()(module, query, key, value, attention_mask, dropout=dropout,
                               scaling=scaling, is_causal=is_causal, **kwargs)

    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return fallback("model_features")
    if kwargs.get("output_attentions", False):
        return fallback("model_features")
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    k, v = key, value
    if causal and kv_len > q_len:
        # prefill into an empty static cache: the keys past the queries are all masked
        # (transformers' sdpa function does the same slice)
        k, v = key[:, :, :q_len], value[:, :, :q_len]
    groups = getattr(module, "num_key_value_groups", 1)
    if q_len <= _DECODE_MAX_QUERIES:
        # a decode step (1 to 16 queries against the cache): the split-KV decode kernel
        from .kvcache import decode_step
        out = decode_step(query, key, value, attention_mask, dropout, scaling, causal, groups)
        if out is not None:
            return out, None
    qb, kb, vb = (t.transpose(1, 2) for t in (query, k, v))
    why = sdpa.fallback_reason(qb, kb, vb, attention_mask, dropout, causal, groups > 1, "bshd")
    if why is not None:
        return fallback(why)
    out = sdpa._kernel(qb, kb, vb, causal, scaling, "bshd")
    return out, None


def register() -> str:
    """Register "ptxattn" (attention function and mask builder); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, ptxattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
