"""flash_attn_with_kvcache inside PyTorch: a custom op with a fake implementation, and the
decode step of transformers' attention function.

- `ptxattn::flash_attn_with_kvcache` (torch.library.custom_op, mutates k_cache and v_cache:
  new keys are appended in place): torch.compile(fullgraph=True) traces it as one opaque node;
  CUDA graphs capture it (the library allocates with torch.empty and never syncs). A call
  without new keys is `ptxattn::kvcache_attention`, the same call as an op that mutates
  nothing, so a traced graph needs no copy of the caches around it.
  `flash_attn_with_kvcache(...)` below has FlashAttention's signature and calls the library
  directly in plain eager mode (the dispatcher adds nothing there: _op._eager's rule), the op
  otherwise.
- `decode_step(...)`: what attn_implementation="ptxattn" does with a call of 1 to 16 queries
  and no mask (transformers' decode step with a dynamic cache: the whole cache is the key
  tensor): the decode kernel, split-KV with packed GQA, instead of the forward kernel. None
  when the call is not one it takes (the caller then goes on as before).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ptxattn import decode as _decode
from ptxattn.decode_builds import DECODE_BUILDS, MAX_QUERIES

from . import _op
from . import sdpa as _sdpa


def _impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          k: Optional[torch.Tensor], v: Optional[torch.Tensor],
          cache_seqlens: Optional[torch.Tensor], seqlen: int, causal: bool, window_left: int, window_right: int, softmax_scale: float,
          num_splits: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one call; seqlen >= 0 is an int cache_seqlens, -1 none given."""
    lengths = cache_seqlens if cache_seqlens is not None else (seqlen if seqlen >= 0 else None)
    return _decode.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=lengths, causal=causal,
        window_size=(window_left, window_right), softmax_scale=softmax_scale, return_lse=True,
        num_splits=num_splits, layout=layout)


kvcache_op = torch.library.custom_op("ptxattn::flash_attn_with_kvcache", _impl,
                                     mutates_args=("k_cache", "v_cache"))


def _read_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: Optional[torch.Tensor], seqlen: int, causal: bool,
               window_left: int, window_right: int, softmax_scale: float, num_splits: int,
               layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call without new keys: the caches are only read. A traced caller
    (decode_step under torch.compile) cannot check storage offsets: an operand the kernel
    cannot read in place (not 16-byte aligned) is read from an aligned copy, strides kept."""
    q, k_cache, v_cache = (t if t.data_ptr() % 16 == 0 else t.clone()
                           for t in (q, k_cache, v_cache))
    return _impl(q, k_cache, v_cache, None, None, cache_seqlens, seqlen, causal, window_left,
                 window_right, softmax_scale, num_splits, layout)


# The same call without appends, as an op that mutates nothing. A traced graph holds a
# mutating op as auto_functionalized over the whole caches, which a backend that does not
# re-inplace (anything but inductor) runs as a clone of both caches and a copy back: every
# layer of every decode step would copy the KV cache. transformers' decode steps never append
# (the model writes its cache itself), so they go here.
read_op = torch.library.custom_op("ptxattn::kvcache_attention", _read_impl, mutates_args=())


def _out_and_lse(q, layout):
    b, x, y, _ = q.shape
    heads, seq = (y, x) if layout == "bshd" else (x, y)
    return q.new_empty(q.shape), q.new_empty((b, heads, seq), dtype=torch.float32)


@kvcache_op.register_fake
def _fake(q, k_cache, v_cache, k, v, cache_seqlens, seqlen, causal, window_left, window_right,
          softmax_scale, num_splits, layout):
    return _out_and_lse(q, layout)


@read_op.register_fake
def _read_fake(q, k_cache, v_cache, cache_seqlens, seqlen, causal, window_left, window_right,
               softmax_scale, num_splits, layout):
    return _out_and_lse(q, layout)


_OP = torch.ops.ptxattn.flash_attn_with_kvcache.default
_READ_OP = torch.ops.ptxattn.kvcache_attention.default


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            causal=False, window_size=(-1, -1), softmax_scale=None,
                            return_lse=False, num_splits=0, *, layout="bshd"):
    """FlashAttention's flash_attn_with_kvcache on torch tensors (see ptxattn.decode)."""
    if _op._eager(q, k_cache, v_cache):
        return _decode.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, causal=causal,
            window_size=window_size, softmax_scale=softmax_scale, return_lse=return_lse,
            num_splits=num_splits, layout=layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    seqlen = -1
    tensor_lengths = None
    if isinstance(cache_seqlens, torch.Tensor):
        tensor_lengths = cache_seqlens
    elif cache_seqlens is not None:
        seqlen = int(cache_seqlens)
    left, right = (int(x) for x in window_size)
    if k is None and v is None:
        out, lse = _READ_OP(q, k_cache, v_cache, tensor_lengths, seqlen, bool(causal), left,
                            right, scale, int(num_splits), layout)
    else:
        out, lse = _OP(q, k_cache, v_cache, k, v, tensor_lengths, seqlen, bool(causal), left,
                       right, scale, int(num_splits), layout)
    return (out, lse) if return_lse else out


def decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                dropout: float, scaling: float | None, causal: bool, groups: int,
                cache_seqlens: torch.Tensor | None = None) -> torch.Tensor | None:
    """transformers' attention call on the decode kernel, or None when it is not one it takes:
    (B, H, q, D) query with q <= 16, (B, Hkv, L, D) keys and values, no dropout, bf16 tensors
    without grad on ptxattn's device, a head dim the decode kernel has, and no mask unless
    the caller vouches for it with `cache_seqlens`. The answer is what transformers' "sdpa"
    function computes for the same call (its is_causal is top-left):
    - no mask: q = 1 sees every key; q > 1 causal sees keys [0, i] for query i, i.e. the first
      q keys (a bottom-right causal over a "cache" of q keys, passed as cache_seqlens=q);
      q > 1 not causal sees every key. `causal` is the caller's (q > 1, no mask, the module's
      is_causal);
    - cache_seqlens (int32 (B,) on the device; a static cache's plain mask, see
      transformers_backend.decode_verdict): query i of q sees keys [0, L_b - q + i], the
      bottom-right causal over each sequence's L_b keys, which is what that mask keeps.
    Returns (B, q, H, D) contiguous, what transformers wants back. Metadata only: in eager
    mode the alignment is read from the storage offset (torch's allocations are 512-byte
    aligned); while compiling it is left to the op's body (_read_impl), so torch.compile
    traces this without a graph break (tests/test_torch_decode_routing.py)."""
    if (attention_mask is not None and cache_seqlens is None) or dropout \
            or query.dim() != 4 or key.dim() != 4:
        return None
    b, h, q_len, d = query.shape
    kv_len = key.shape[2]
    if not (1 <= q_len <= MAX_QUERIES and kv_len >= q_len and d in DECODE_BUILDS):
        return None
    if (query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16
            or value.dtype != torch.bfloat16
            or query.requires_grad or key.requires_grad or value.requires_grad
            or key.shape != value.shape or key.shape[1] * max(groups, 1) != h
            or value.shape[-1] != d or key.shape[0] != b):
        return None
    if _sdpa._device_reason(query, key, value) is not None:
        return None
    # transformers' (B, H, S, D) are transposes of (B, S, H, D) projections and caches: read
    # them as BSHD in place; the output comes out (B, q, H, D) contiguous
    q, kc, vc = (t.transpose(1, 2) for t in (query, key, value))
    # a storage offset is not traceable (dynamo breaks the graph on storage_offset(), and a
    # break inside the attention function compiles every layer as a frame of its own, past
    # dynamo's recompile limit); while compiling, the read op's body aligns at run time instead
    compiling = torch.compiler.is_compiling()
    for t in (q, kc, vc):
        if t.stride(-1) != 1 or (not compiling and t.storage_offset() % 8) or any(
                s % 8 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
            return None
    if cache_seqlens is not None:
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cache_seqlens,
                                       causal=q_len > 1, softmax_scale=scaling)
    causal = bool(causal and q_len > 1)
    lengths = q_len if causal and kv_len > q_len else None
    return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=causal,
                                   softmax_scale=scaling)
