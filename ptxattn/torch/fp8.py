"""FP8 attention in PyTorch models: opt-in, never the default.

- `ptxattn::attention_fp8`, a torch.library custom op: bf16 CUDA q, k, v quantized to e4m3 by
  ptxattn's kernels inside the call, the FP8 forward, bf16 out
  (`ptxattn.torch.attention(..., precision="fp8")` calls it).
Its SDPA-semantics router (torch's SDPA outside the kernel's scope) is ptxattn.torch.fp8_sdpa,
which the diffusers backend "ptxattn_fp8" calls (`ptxattn.torch.register_diffusers(fp8=True)`).

What it trades: e4m3 rounds Q, K, V and P to 3 mantissa bits, ~5% relative L2 against the
float64 reference on random inputs (the bf16 path: ~0.2%), more where scores spread widely;
bench/notes.md (session 5) has the figures. Forward only, no LSE.
"""

from __future__ import annotations

import math

import torch

from ptxattn.api import attention as _attention

LAYOUTS = ("bhld", "bshd")


def _attention_fp8_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        layout: str, is_causal: bool, smooth_k: bool) -> torch.Tensor:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise ValueError(f"{name}: ptxattn::attention_fp8 runs on CUDA tensors, got one on "
                             f"{t.device}")
    if q.requires_grad or k.requires_grad or v.requires_grad:
        q, k, v = q.detach(), k.detach(), v.detach()      # forward only, as the bf16 op
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    _attention(q, k, v, precision="fp8", scale=scale, layout=layout, out=out,
               causal=is_causal, smooth_k=smooth_k)
    return out


attention_fp8_op = torch.library.custom_op("ptxattn::attention_fp8", _attention_fp8_impl,
                                           mutates_args=())


@attention_fp8_op.register_fake
def _attention_fp8_fake(q, k, v, scale, layout, is_causal, smooth_k):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              layout: str = "bhld", is_causal: bool = False, smooth_k: bool = False):
    """The FP8 op with defaults (scale 1/sqrt(D)); no fallback: the call must be one the
    kernel takes, else the library's ValueError/TypeError naming the argument."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    if q.dim() != 4:
        raise ValueError(f"q: expected a rank-4 tensor, got shape {tuple(q.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _OP(q, k, v, float(scale), layout, bool(is_causal), bool(smooth_k))


_OP = torch.ops.ptxattn.attention_fp8.default
