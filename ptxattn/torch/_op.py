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

from ptxattn import tensors, tma
from ptxattn.api import attention as _attention
from ptxattn.fastpath import steady_call
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


def _tma_ready(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> bool:
    """True when TMA can read q, k and v in place: 16-byte bases and strides, head dim stride
    1. The rule is the library's own (tma.map_geometry), so the two cannot disagree."""
    return ((q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
            and _geometry_ok(layout, q.shape, q.stride())
            and _geometry_ok(layout, k.shape, k.stride())
            and _geometry_ok(layout, v.shape, v.stride()))


@functools.lru_cache(maxsize=1024)
def _geometry_ok(layout: str, shape, strides) -> bool:
    """tma.map_geometry's verdict on a shape and strides (remembered: a model sends the same
    few geometries on every call)."""
    if len(shape) != 4:
        return True         # not ours to judge: the library names the rank error
    b, x, y, d = shape
    heads, seq = (x, y) if layout == "bhld" else (y, x)
    try:
        tma.map_geometry(layout, b, heads, seq, d, PRODUCTION.q_box_rows, PRODUCTION.tma_chunk,
                         strides, "q")
    except ValueError:
        return False
    return True


def _compact(t: torch.Tensor, layout: str) -> torch.Tensor:
    ready = t.data_ptr() % 16 == 0 and _geometry_ok(layout, t.shape, t.stride())
    return t if ready else t.contiguous()


def _lse_call(q, k, v, out, scale, layout, stream, causal_kw):
    """(out, lse) with the library's own float32 lse buffer, wrapped zero-copy for torch.

    The library has no lse out= yet, so the buffer is its own cuMemAlloc: that is not
    allowed while a stream is being captured, hence the error below rather than a broken
    capture. torch.from_dlpack consumes it on the same stream, so no wait is added."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("ptxattn::attention: return_lse=True cannot run under CUDA-graph "
                           "capture yet (the library allocates the lse buffer itself); capture "
                           "with return_lse=False")
    _, lse = _attention(q, k, v, scale=scale, layout=layout, out=out, stream=stream,
                        return_lse=True, **causal_kw)
    lse = torch.from_dlpack(lse)
    if lse.dtype != torch.float32:
        raise TypeError(f"ptxattn::attention: the library's lse came as {lse.dtype}, "
                        "expected float32")
    return lse


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    layout: str, is_causal: bool,
                    return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale q k^T) v on CUDA bf16 tensors; (out, lse), lse empty unless asked for."""
    if return_lse:
        q, k, v = _inputs(q, k, v, layout, is_causal)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        stream = torch.cuda.current_stream(q.device)
        causal_kw = {"causal": True} if is_causal else {}
        return out, _lse_call(q, k, v, out, scale, layout, stream, causal_kw)
    return _run(q, k, v, scale, layout, is_causal), q.new_empty((0,), dtype=torch.float32)


def _inputs(q, k, v, layout: str, is_causal: bool):
    """The op's checks, and q, k, v as the library takes them."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_cuda:
                raise ValueError(f"{name}: ptxattn::attention runs on CUDA tensors, got one on "
                                 f"{t.device} (ptxattn.torch.scaled_dot_product_attention "
                                 "falls back to torch's SDPA for those)")
    if is_causal and not library_takes_causal():
        raise ValueError("is_causal: this ptxattn has no causal kernel yet")
    # The library refuses tensors that require grad (as DLPack does); the op is forward-only
    # (no autograd formula is registered, so a backward through it raises in torch).
    if q.requires_grad or k.requires_grad or v.requires_grad:
        q, k, v = q.detach(), k.detach(), v.detach()
    # A view TMA cannot address (odd strides, an unaligned slice) is copied once, compactly.
    if not _tma_ready(q, k, v, layout):
        q, k, v = _compact(q, layout), _compact(k, layout), _compact(v, layout)
    return q, k, v


def _run(q, k, v, scale: float, layout: str, is_causal: bool, qkv_meta=None) -> torch.Tensor:
    """The output of one call (no LSE), written by the library into torch's memory.

    The library's steady path is asked first, with the tensors as given: a hit means that
    these exact tensors (addresses, shapes, strides; CUDA, bf16, no grad) validated and
    launched before, so none of _inputs' checks or copies could change anything. A miss
    (a first call, a view TMA cannot read, a tensor that requires grad, a CPU tensor) takes
    _inputs and the library's full path, with their errors. qkv_meta: tensors.torch_meta of
    q, k, v, when the caller has read them (the SDPA wrapper)."""
    shape = q.shape
    if qkv_meta is None:
        d = v.shape[-1]
    else:
        d = qkv_meta[2][1][-1]
    if shape[-1] == d:
        # out_shape(q, v, layout) is q's shape: empty_like is torch's cheapest allocation
        out = torch.empty_like(q, memory_format=_CONTIGUOUS)
        if qkv_meta is not None:
            # what torch_meta would read of it: made here, so a CUDA bf16 contiguous tensor
            # without grad on q's device
            qkv_meta = (*qkv_meta, (out.data_ptr(), shape, out.stride(), qkv_meta[0][3]))
    else:
        out = q.new_empty((*shape[:-1], d))
    # stream=None: torch's current stream, read by the library (one raw handle, no Stream
    # object: with out= given it allocates nothing that would have to hold one)
    if steady_call(q, k, v, out, None, scale, layout, None, False, is_causal, None,
                   "bottom_right", qkv_meta)[0] is not None:
        return out
    q, k, v = _inputs(q, k, v, layout, is_causal)
    _attention(q, k, v, scale=scale, layout=layout, out=out, causal=is_causal)
    return out


attention_op = torch.library.custom_op("ptxattn::attention", _attention_impl, mutates_args=())


@attention_op.register_fake
def _attention_fake(q, k, v, scale, layout, is_causal, return_lse):
    out = q.new_empty(out_shape(q, v, layout))
    if not return_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    b, x, y, _ = q.shape
    heads, seq = (x, y) if layout == "bhld" else (y, x)
    return out, q.new_empty((b, heads, seq), dtype=torch.float32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              layout: str = "bhld", is_causal: bool = False, return_lse: bool = False,
              precision: str = "bf16"):
    """The op with defaults: scale 1/sqrt(D); returns out, or (out, lse) with return_lse.

    No fallback here: the call must be one the kernel takes (bf16 CUDA tensors, a head dim
    in stages.PRODUCTION.head_dims, k/v heads dividing q's); the library raises a clear
    ValueError/TypeError naming the argument otherwise. For SDPA's semantics with fallback
    use scaled_dot_product_attention. precision="fp8": the opt-in FP8 op
    (ptxattn.torch.fp8: ~5% relative error for up to twice the tensor rate; no LSE)."""
    if precision != "bf16":
        if precision != "fp8":
            raise ValueError(f"precision: expected 'bf16' or 'fp8', got {precision!r}")
        if return_lse:
            raise ValueError("return_lse: the FP8 op returns no LSE; use precision='bf16'")
        from .fp8 import attention as attention_fp8
        return attention_fp8(q, k, v, scale=scale, layout=layout, is_causal=is_causal)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    if q.dim() != 4:
        raise ValueError(f"q: expected a rank-4 tensor, got shape {tuple(q.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not return_lse and _unwatched():
        # plain CUDA bf16 tensors without grad (tensors.torch_meta: exact torch.Tensor, so
        # _eager's conditions hold), read once for the library's steady path too
        meta = tensors.torch_meta
        qm, km, vm = meta(q), meta(k), meta(v)
        if qm is not None and km is not None and vm is not None:
            return _run(q, k, v, float(scale), layout, bool(is_causal), (qm, km, vm))
    if _eager(q, k, v):
        if not return_lse:
            return _run(q, k, v, float(scale), layout, bool(is_causal))
        out, lse = _attention_impl(q, k, v, float(scale), layout, bool(is_causal), True)
    else:
        out, lse = _OP(q, k, v, float(scale), layout, bool(is_causal), bool(return_lse))
    return (out, lse) if return_lse else out


_OP = torch.ops.ptxattn.attention.default
_CONTIGUOUS = torch.contiguous_format
_C = torch._C
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
# Each of these tells whether torch could be watching or transforming the call; where one is
# missing from this torch, the op is always called through the dispatcher.
_WATCHERS = tuple(getattr(_C, name, None) for name in (
    "_get_tracing_state", "_is_torch_function_mode_enabled", "_are_functorch_transforms_active"))
_DISPATCH_MODES = getattr(_C, "_len_torch_dispatch_stack", None)
_CAN_BYPASS = _DISPATCH_MODES is not None and None not in _WATCHERS


def _eager(q, k, v) -> bool:
    """True when calling the op's body directly is the same as calling the op: plain eager
    execution of plain tensors. The dispatcher's own per-call cost (its Python layers for a
    custom op: autograd wrapper, redispatch, alias checks) is most of a small call's host
    time, and in plain eager mode it adds nothing: the op has no autograd formula (its body
    detaches), no autocast or batching rule. Anything that observes or rewrites ops takes
    the dispatcher, so it sees one ptxattn::attention node as before: torch.compile/export
    (is_compiling), jit tracing, __torch_function__ modes, functorch transforms (vmap,
    grad), __torch_dispatch__ modes (FakeTensorMode, make_fx, DebugMode), tensor subclasses
    (DTensor, FakeTensor, FunctionalTensor: not exactly torch.Tensor), and inputs that
    require grad with grad mode on."""
    if not _CAN_BYPASS or type(q) is not _Tensor or type(k) is not _Tensor \
            or type(v) is not _Tensor:
        return False
    if (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled():
        return False        # the op's autograd wrapper marks such outputs: keep its behaviour
    return _unwatched()


def _unwatched() -> bool:
    """_eager's answer about torch's state rather than the tensors: nothing compiles, traces,
    transforms or intercepts ops right now."""
    if not _CAN_BYPASS:
        return False
    tracing, function_modes, functorch = _WATCHERS
    return not (_is_compiling() or tracing() is not None or function_modes() or functorch()
                or _DISPATCH_MODES())
