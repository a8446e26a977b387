"""A "ptxattn" attention backend for diffusers' attention dispatch
(diffusers.models.attention_dispatch, 0.35 and later).

diffusers hands backends (batch, seq, heads, head_dim) tensors; ptxattn reads that layout in
place (layout="bshd": no permute, no copy) and writes its output in it. Calls outside the
kernel's scope go to torch's SDPA on permuted views, exactly as diffusers' "native" backend
does, and are counted like every other fallback (ptxattn.torch.fallback_counts()).

diffusers names its backends in an Enum (AttentionBackendName) that has no public way to add
one: `register()` adds the member PTXATTN = "ptxattn" to it (the Enum's own tables, the same
as a member written in the class), then registers the function with _AttentionBackendRegistry.
"""

from __future__ import annotations

import torch

from . import sdpa

NAME = "ptxattn"
NAME_FP8 = "ptxattn_fp8"          # opt-in: register(fp8=True); never the default


def _add_enum_member(enum_cls, name: str, value: str):
    """Add a member to a str-valued Enum after its creation; idempotent."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    member.__init__(value)
    # type.__setattr__: the Enum metaclass refuses new attributes named like members
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    return member


def ptxattn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, return_lse: bool = False):
    """The backend: (batch, seq, heads, head_dim) in and out; (out, lse) with return_lse,
    lse float32 (batch, heads, seq) as flash-attn's backend returns it."""
    if (attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]):
        # diffusers' native backend does the same: a (batch, seq_k) key mask
        attn_mask = attn_mask.unsqueeze(1).unsqueeze(1)
    if return_lse:
        why = sdpa.fallback_reason(query, key, value, attn_mask, dropout_p, is_causal,
                                   enable_gqa, "bshd")
        if why is not None:
            raise ValueError(f"ptxattn attention backend: return_lse=True needs a call the "
                             f"kernel takes ({sdpa.REASONS[why]} is not); torch's SDPA has no "
                             "lse output either")
        from ._op import attention
        return attention(query, key, value, scale=scale, layout="bshd", is_causal=is_causal,
                         return_lse=True)
    return sdpa.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                          layout="bshd")


def ptxattn_fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                          is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False, return_lse: bool = False):
    """The opt-in FP8 backend: (batch, seq, heads, head_dim) in and out, through
    ptxattn.torch.fp8_sdpa (e4m3 Q, K, V and P: ~5% relative error); torch's SDPA for the calls
    the kernel does not take. No LSE."""
    if return_lse:
        raise ValueError("ptxattn_fp8 attention backend: return_lse=True is not supported "
                         "(the FP8 op returns no LSE); use the 'ptxattn' backend")
    if (attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]):
        attn_mask = attn_mask.unsqueeze(1).unsqueeze(1)
    from . import fp8_sdpa
    return fp8_sdpa.sdpa_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa, layout="bshd")


def register(fp8: bool = False) -> str:
    """Make "ptxattn" (or, with fp8=True, the opt-in "ptxattn_fp8") a diffusers attention
    backend (idempotent); returns the name. Neither is ever made the default."""
    from diffusers.models import attention_dispatch as dispatch

    name, function = (NAME_FP8, ptxattn_fp8_attention) if fp8 else (NAME, ptxattn_attention)
    backend = _add_enum_member(dispatch.AttentionBackendName, name.upper(), name)
    if backend not in dispatch._AttentionBackendRegistry._backends:
        dispatch._AttentionBackendRegistry.register(
            backend, constraints=[dispatch._check_device, dispatch._check_shape],
            supports_context_parallel=False)(function)
    return name
