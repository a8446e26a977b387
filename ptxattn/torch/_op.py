"""The custom op `ptxattn::attention`: the production kernel as a PyTorch operator.

Registered with torch.library.custom_op, with a fake (meta) implementation, so that
torch.compile(fullgraph=True) traces it as one opaque node and inductor calls the real one.

Safe under CUDA-graph capture: the output comes from torch's caching allocator (torch.empty)
and is passed as `out=`; the launch goes on torch's current stream, passed explicitly; the
library does no host sync on this path. (return_lse=True is the exception: see `_lse_call`.)
"""

from __future__ import annotations

import functools
import math

import torch

import ptxattn
from ptxattn import tma
from ptxattn.stages import PRODUCTION, PRODUCTION_VARIANTS

LAYOUTS = ("bhld", "bshd")


@functools.lru_cache(maxsize=1)
def library_takes_causal() -> bool:
    """Whether the production kernel has a masked build (stages.PRODUCTION_VARIANTS), so that
    is_causal calls can run on ptxattn. Answered once: the registry does not change while a
    process runs, and this sits on every causal call's path (it used inspect.signature there)."""
    return any(masked for (_, masked) in PRODUCTION_VARIANTS)


def out_shape(q: torch.Tensor, v: torch.Tensor, layout: str) -> tuple[int, ...]:
    """q's shape with v's head dim (they are equal for every call the kernel takes)."""
    return (*q.shape[:-1], v.shape[-1])


def _tma_ready(t: torch.Tensor, layout: str, name: str) -> bool:
    """True when TMA can read `t` in place: 16-byte base and strides, head dim stride 1.
    The rule is the library's own (tma.map_geometry), so the two cannot disagree."""
    if t.data_ptr() % 16:
        return False
    b, x, y, d = t.shape
    heads, seq = (x, y) if layout == "bhld" else (y, x)
    try:
        tma.map_geometry(layout, b, heads, seq, d, PRODUCTION.q_box_rows, PRODUCTION.tma_chunk,
                         t.stride(), name)
    except ValueError:
        return False
    return True


def _lse_call(q, k, v, out, scale, layout, stream, causal_kw):
    """(out, lse) with the library's own float32 lse buffer, wrapped zero-copy for torch.

    The library has no lse out= yet, so the buffer is its own cuMemAlloc: that is not
    allowed while a stream is being captured, hence the error below rather than a broken
    capture. torch.from_dlpack consumes it on the same stream, so no wait is added."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("ptxattn::attention: return_lse=True cannot run under CUDA-graph "
                           "capture yet (the library allocates the lse buffer itself); capture "
                           "with return_lse=False")
    _, lse = ptxattn.attention(q, k, v, scale=scale, layout=layout, out=out, stream=stream,
                               return_lse=True, **causal_kw)
    lse = torch.from_dlpack(lse)
    if lse.dtype != torch.float32:
        raise TypeError(f"ptxattn::attention: the library's lse came as {lse.dtype}, "
                        "expected float32")
    return lse


@torch.library.custom_op("ptxattn::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: str,
                 is_causal: bool, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale q k^T) v on CUDA bf16 tensors; (out, lse), lse empty unless asked for."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name}: ptxattn::attention runs on CUDA tensors, got one on "
                             f"{t.device} (ptxattn.torch.scaled_dot_product_attention falls "
                             "back to torch's SDPA for those)")
    causal_kw = {}
    if is_causal:
        if not library_takes_causal():
            raise ValueError("is_causal: this ptxattn has no causal kernel yet")
        causal_kw = {"causal": True}
    # DLPack export refuses tensors that require grad; the op is forward-only (no autograd
    # formula is registered, so a backward through it raises in torch).
    q, k, v = q.detach(), k.detach(), v.detach()
    # A view TMA cannot address (odd strides, an unaligned slice) is copied once, compactly.
    q, k, v = (t if _tma_ready(t, layout, n) else t.contiguous()
               for n, t in (("q", q), ("k", k), ("v", v)))
    out = torch.empty(out_shape(q, v, layout), dtype=q.dtype, device=q.device)
    stream = torch.cuda.current_stream(q.device)
    if return_lse:
        lse = _lse_call(q, k, v, out, scale, layout, stream, causal_kw)
        return out, lse
    ptxattn.attention(q, k, v, scale=scale, layout=layout, out=out, stream=stream, **causal_kw)
    return out, q.new_empty((0,), dtype=torch.float32)


@attention_op.register_fake
def _attention_fake(q, k, v, scale, layout, is_causal, return_lse):
    out = q.new_empty(out_shape(q, v, layout))
    if not return_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    b, x, y, _ = q.shape
    heads, seq = (x, y) if layout == "bhld" else (y, x)
    return out, q.new_empty((b, heads, seq), dtype=torch.float32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              layout: str = "bhld", is_causal: bool = False, return_lse: bool = False):
    """The op with defaults: scale 1/sqrt(D); returns out, or (out, lse) with return_lse.

    No fallback here: the call must be one the kernel takes (bf16 CUDA tensors, a head dim
    in stages.PRODUCTION.head_dims, k/v heads dividing q's); the library raises a clear
    ValueError/TypeError naming the argument otherwise. For SDPA's semantics with fallback
    use scaled_dot_product_attention."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    if q.dim() != 4:
        raise ValueError(f"q: expected a rank-4 tensor, got shape {tuple(q.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = torch.ops.ptxattn.attention(q, k, v, float(scale), layout, bool(is_causal),
                                           bool(return_lse))
    return (out, lse) if return_lse else out
