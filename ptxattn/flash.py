"""flash_attn_func: FlashAttention's dense call on ptxattn's production kernel.

The same name, argument names, order and defaults as `flash_attn.flash_attn_func` (FlashAttention
2), the layout it uses ((batch, seqlen, heads, head_dim), BSHD) and its meaning of `causal` and
`window_size` (bottom-right aligned: query i of Lq sees keys up to i + Lk - Lq), so that a
caller can switch the import. What the kernel has no part for (dropout, softcap, ALiBi, the
attention probabilities) is refused with a ValueError that names the argument, never ignored.
The decode and varlen calls, flash_attn_with_kvcache and flash_attn_varlen_func, follow the same
rule (ptxattn/decode.py, ptxattn/varlen.py).
"""

from __future__ import annotations

__all__ = ["flash_attn_func"]


def _is_torch(x) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch"


def _refuse_unsupported(dropout_p, softcap, alibi_slopes, return_attn_probs) -> None:
    """FlashAttention arguments whose non-default values the kernel cannot honour."""
    if dropout_p != 0:
        raise ValueError(f"dropout_p: ptxattn has no attention dropout (expected 0.0, got "
                         f"{dropout_p!r}); use torch's scaled_dot_product_attention for it")
    if softcap != 0:
        raise ValueError(f"softcap: ptxattn has no logit soft-capping (expected 0.0, got "
                         f"{softcap!r})")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ptxattn has no ALiBi bias (expected None)")
    if return_attn_probs:
        raise ValueError("return_attn_probs: ptxattn never forms the attention probabilities; "
                         "return_lse=True returns (out, lse), lse float32 (batch, heads, seqlen_q)")


def _window_of(causal: bool, window_size) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window) for ptxattn.attention from FlashAttention's causal and window_size:
    as FlashAttention does, causal=True sets the window's right edge to 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair (left, right) of ints >= -1, got "
                        f"{window_size!r}") from None
    if causal is True:
        return causal, (None if left == -1 else (left, 0))
    return causal, (None if (left, right) == (-1, -1) else (left, right))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_lse=False, out=None, stream=None):
    """softmax(softmax_scale * q k^T + mask) v on (batch, seqlen, heads, head_dim) arrays
    (FlashAttention's flash_attn_func).

    q: (B, Lq, H, D), k and v: (B, Lk, Hkv, D), bf16; D 64, 128 or 256; Hkv divides H (GQA/MQA:
    query head h reads k/v head h // (H // Hkv)); any Lq, Lk >= 1.
    softmax_scale: default 1 / sqrt(D).
    causal: bottom-right aligned, as FlashAttention's (query i sees keys up to i + Lk - Lq).
    window_size=(left, right): query i sees keys [i + Lk - Lq - left, i + Lk - Lq + right], -1
    unbounded; with causal=True the right edge is 0, as in FlashAttention.
    deterministic: the backward's dQ in a fixed order (torch tensors that require grad); the
    forward is deterministic anyway.
    Refused with a ValueError naming the argument (the kernel has no part for them):
    dropout_p != 0, softcap != 0, alibi_slopes, return_attn_probs=True.
    Beyond FlashAttention's: return_lse=True returns (out, lse), lse float32 (B, H, Lq), the
    natural log-sum-exp (-inf for a query that sees no key, whose output is 0); out= and
    stream= as ptxattn.attention's (arrays other than torch tensors).

    torch tensors run through ptxattn.torch.attention (the custom op ptxattn::attention): a
    torch tensor comes back, autograd runs the backward kernels, torch.compile traces it as one
    node. Other arrays run through ptxattn.attention(layout="bshd"): NumPy in, NumPy out; any
    other DLPack array in, a ptxattn.DeviceArray out.
    """
    _refuse_unsupported(dropout_p, softcap, alibi_slopes, return_attn_probs)
    causal_flag, window = _window_of(causal, window_size)
    if _is_torch(q):
        if out is not None or stream is not None:
            raise ValueError("out=, stream=: torch tensors come from torch's allocator and run "
                             "on torch's current stream; give neither")
        from . import torch as pt
        return pt.attention(q, k, v, scale=softmax_scale, layout="bshd", is_causal=causal_flag,
                            window=window, return_lse=return_lse,
                            deterministic=deterministic)
    from .api import attention
    return attention(q, k, v, scale=softmax_scale, layout="bshd", causal=causal_flag,
                     window=window, return_lse=return_lse, out=out, stream=stream)
