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

Decode steps (1 to 16 queries) go to the split-KV decode kernel
(ptxattn.torch.kvcache.decode_step), which computes what the "sdpa" function would for the
same call:
- with the dynamic cache there is no mask (the whole cache is the key tensor);
- with the static cache (`cache_implementation="static"`, the CUDA-graph path) transformers
  hands the whole preallocated cache and a materialized mask: causal from the query's
  position, and the 2D padding mask (padded with False past its length). The mask builder
  registered for "ptxattn" (`ptxattn_mask`) returns transformers' own sdpa mask, and when it
  is exactly the plain one that the cache's length implies (the plain causal mask function,
  no offset or local window, and a padding mask that hides no key below the query's
  position), it attaches that length to the mask, an int32 device tensor (B,)
  (`mask._ptxattn_cache_seqlens`). The attention function then runs the decode kernel with
  those cache_seqlens and a bottom-right causal mask, which sees exactly the keys the mask
  keeps. Reading the padding needs the host (one check per forward, not per layer); a mask
  built while compiling or capturing cannot be checked and falls back (reason
  `mask_unverified`). generate() builds static-cache masks eagerly, before its compiled
  forward (prepare_inputs_for_generation), so its decode steps are checked and routed. A
  padding mask that hides keys (left padding) falls back too (`mask_padding`): the decode
  kernel knows lengths, not holes.

Training: tensors that require grad run on the forward kernel with its autograd formula (the
backward kernels); the decode kernel has no backward, so decode_step never takes them.
"""

from __future__ import annotations

import torch

from . import sdpa, transformers_paged

NAME = "ptxattn"
_DECODE_MAX_QUERIES = 16         # decode_builds.MAX_QUERIES: calls the decode kernel takes


def _sdpa_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def ptxattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature; returns (output (B, S, H, D), None).
    Packed calls (cu_seq_lens_q and cu_seq_lens_k given: continuous batching under
    transformers 5.24, which runs "paged|ptxattn" as "ptxattn", or a padding-free batch) go
    to the varlen path (transformers_paged)."""
    if transformers_paged.is_packed_call(kwargs):
        return transformers_paged.paged_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs)

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
    lengths = None
    if attention_mask is not None:
        lengths = static_cache_lengths(attention_mask, query, key)
    if q_len <= _DECODE_MAX_QUERIES:
        # a decode step (1 to 16 queries against the cache): the split-KV decode kernel
        from .kvcache import decode_step
        out = decode_step(query, key, value, attention_mask, dropout, scaling, causal, groups,
                          cache_seqlens=lengths)
        if out is not None:
            return out, None
    qb, kb, vb = (t.transpose(1, 2) for t in (query, k, v))
    why = sdpa.fallback_reason(qb, kb, vb, attention_mask, dropout, causal, groups > 1, "bshd")
    if why == "attn_mask":
        # the mask builder's word on a decode-shaped mask it could not vouch for
        why = getattr(attention_mask, MASK_REASON, None) or why
    if why is not None:
        return fallback(why)
    out = sdpa._kernel(qb, kb, vb, causal, scaling, "bshd")
    return out, None


# --------------------------------------------------------------------------- static-cache masks

CACHE_SEQLENS = "_ptxattn_cache_seqlens"    # on a mask: the cache lengths it is plain for
MASK_REASON = "_ptxattn_mask_reason"        # on a decode-shaped mask it is not: why


def static_cache_lengths(mask, query, key):
    """The int32 (B,) cache lengths `mask` was built plain for (ptxattn_mask), when it is
    that mask for this call's shapes ((B, 1, q, L) against keys of L positions); else None."""
    lengths = getattr(mask, CACHE_SEQLENS, None)
    if lengths is None or mask.dim() != 4:
        return None
    b, _, q_len, _ = query.shape
    if tuple(mask.shape) != (b, 1, q_len, key.shape[2]) or tuple(lengths.shape) != (b,):
        return None
    return lengths


def _capturing(mask) -> bool:
    return bool(mask.is_cuda and torch.cuda.is_available()
                and torch.cuda.is_current_stream_capturing())


def decode_verdict(q_length: int, kv_length: int, q_offset, kv_offset, mask_function,
                   padding_2d, local_size, batch_size: int, device):
    """(lengths, None) when transformers' mask for these arguments is exactly the bottom-right
    causal mask over cache lengths q_offset + q_length (lengths: int32 (B,) on `device`);
    (None, reason) when it is a decode-shaped mask that is not, or cannot be checked; (None,
    None) when the call is no decode step (more than 16 queries) or not a causal mask.

    The mask keeps key j for query i iff j <= q_offset + i and padding[b, j] (padding: the 2D
    mask, False past its length); the kernel keeps j <= L - q_length + i. With L = q_offset +
    q_length they agree iff padding[b, j] holds for every j < L (and L fits the keys)."""
    from transformers.masking_utils import causal_mask_function
    if q_length > _DECODE_MAX_QUERIES:
        return None, None
    if mask_function is not causal_mask_function or local_size is not None or (
            not isinstance(kv_offset, int) or kv_offset != 0):
        return None, None              # another pattern: fallback_reason says "attn_mask"
    if torch.compiler.is_compiling() or any(
            isinstance(t, torch.Tensor) and _capturing(t) for t in (q_offset, padding_2d)):
        return None, "mask_unverified"
    ends = q_offset + q_length                   # int, or a device tensor (static caches)
    if isinstance(ends, torch.Tensor):
        ends = ends.reshape(()).to(device=device, dtype=torch.int32)
    else:
        ends = torch.tensor(int(ends), dtype=torch.int32, device=device)
    ok = ends <= kv_length
    if padding_2d is not None:
        pad = padding_2d.to(device=device, dtype=torch.bool)[:, :kv_length]
        if pad.shape[-1] < kv_length:
            pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[-1]))
        keys = torch.arange(kv_length, device=device)
        ok = ok & (pad | (keys[None, :] >= ends)).all()
    if not bool(ok):                              # the host check (one per forward)
        return None, "mask_padding"
    return ends.reshape(1).repeat(batch_size), None


def ptxattn_mask(*args, **kwargs):
    """The mask builder of "ptxattn": transformers' sdpa_mask, exactly (so every fallback sees
    the mask the "sdpa" function would), with its decode verdict attached to the mask
    (CACHE_SEQLENS or MASK_REASON, see decode_verdict)."""
    from transformers.masking_utils import sdpa_mask
    mask = sdpa_mask(*args, **kwargs)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    bound = _sdpa_mask_signature().bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    lengths, reason = decode_verdict(a["q_length"], a["kv_length"], a["q_offset"],
                                     a["kv_offset"], a["mask_function"], a["attention_mask"],
                                     a["local_size"], a["batch_size"], mask.device)
    if lengths is not None or reason is not None:
        # generate() (transformers >= 5.2x) hands the model mask.contiguous(), a copy without
        # the verdict when the mask is an expanded view (batch > 1). A decode-step mask is
        # small (B x q x L booleans, q <= 16): contiguous here, that call returns it as it is.
        mask = mask.contiguous()
    if lengths is not None:
        setattr(mask, CACHE_SEQLENS, lengths)
    elif reason is not None:
        setattr(mask, MASK_REASON, reason)
    return mask


_SIGNATURE = []


def _sdpa_mask_signature():
    if not _SIGNATURE:
        import inspect
        from transformers.masking_utils import sdpa_mask
        _SIGNATURE.append(inspect.signature(sdpa_mask))
    return _SIGNATURE[0]


def register() -> str:
    """Register "ptxattn" (attention function and mask builder) and "paged|ptxattn"
    (continuous batching, transformers_paged); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ptxattn_attention_forward)
    AttentionMaskInterface.register(NAME, ptxattn_mask)
    transformers_paged.register()
    return NAME
