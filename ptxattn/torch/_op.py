"""The custom ops `ptxattn::attention` and `ptxattn::attention_backward`: the production
forward and backward kernels as PyTorch operators, joined by an autograd formula.

Registered with torch.library.custom_op, each with a fake (meta) implementation, so that
torch.compile(fullgraph=True) traces forward and backward as opaque nodes and inductor calls
the real ones; `register_autograd` makes loss.backward() run the backward kernels. The
forward saves q, k, v, out and its LSE (computed whenever grad is needed); the backward op
takes them with dout and returns (dq, dk, dv), dK/dV summed over GQA groups by the kernel.

Safe under CUDA-graph capture, forward and backward: every output, the LSE and every
workspace of the backward come from torch's caching allocator (torch.empty; passed to the
library as out=, lse_out= and its allocator hook), the launches go on torch's current
stream, and the library does no host sync on these paths. So a whole training step can be
captured (after one warm-up step: the first call of a build JIT-compiles it).

The two kernels are seams (forward_kernel, backward_kernel): the CPU tests swap in torch
references on CPU tensors to check the wiring, the fakes and torch.compile without a GPU.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ptxattn import tensors, tma
from ptxattn.api import attention as _attention
from ptxattn.backward import attention_backward as _attention_backward
from ptxattn.fastpath import steady_call
from ptxattn.plan import _window
from ptxattn.stages import PRODUCTION, PRODUCTION_VARIANTS

LAYOUTS = ("bhld", "bshd")


_TAKES_CAUSAL = any(masked for (_, masked) in PRODUCTION_VARIANTS)


def library_takes_causal() -> bool:
    """Whether the production kernel has a masked build (stages.PRODUCTION_VARIANTS), so that
    is_causal calls can run on ptxattn. Answered once, at import: the registry does not change
    while a process runs, and this sits on every causal call's path (a plain global read, which
    torch.compile traces without the lru_cache warning it gives)."""
    return _TAKES_CAUSAL


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


def _cuda_forward(q, k, v, scale: float, layout: str, is_causal: bool, window, diagonal: str,
                  return_lse: bool):
    """(out, lse) of one call on the production kernel: lse float32 (B, H, Lq) with
    return_lse, else an empty tensor. Both come from torch's allocator (torch.empty), the LSE
    passed as the library's lse_out=, so the call allocates nothing of its own and can be
    captured in a CUDA graph; the launch goes on torch's current stream."""
    if not return_lse:
        return (_run(q, k, v, scale, layout, is_causal, window=window, diagonal=diagonal),
                q.new_empty((0,), dtype=torch.float32))
    q, k, v = _inputs(q, k, v, layout, is_causal, window)
    out = q.new_empty(out_shape(q, v, layout))
    b, x, y, _ = q.shape
    heads, seq = (x, y) if layout == "bhld" else (y, x)
    lse = torch.empty((b, heads, seq), dtype=torch.float32, device=q.device)
    _attention(q, k, v, scale=scale, layout=layout, out=out, return_lse=True, lse_out=lse,
               causal=is_causal, window=window, diagonal=diagonal)
    return out, lse


def _cuda_backward(q, k, v, out, lse, dout, scale: float, layout: str, is_causal: bool, window,
                   diagonal: str, deterministic: bool):
    """(dq, dk, dv) from the backward kernels (ptxattn.backward), every output and workspace
    from torch's allocator (torch.empty through the library's allocator hook: a CUDA-graph
    capture takes them from its private pool), launched on torch's current stream."""
    q, k, v = _inputs(q, k, v, layout, is_causal, window)
    out, dout = _compact(out.detach(), layout), _compact(dout.detach(), layout)
    lse = lse.detach()
    device = q.device

    def allocator(shape, dtype):
        return torch.empty(shape, dtype=torch.float32 if dtype == _F32 else torch.bfloat16,
                           device=device)
    dq, dk, dv = _attention_backward(q, k, v, out, lse, dout, scale=scale, layout=layout,
                                     causal=is_causal, window=window, diagonal=diagonal,
                                     deterministic=deterministic, allocator=allocator)
    return dq, dk, dv


# The kernels behind the two ops: the seams a CPU test replaces (with torch reference
# implementations on CPU tensors, tests/torch_refs.py) to check the autograd wiring, the
# fakes and torch.compile without a GPU. The shipped ones run only while these are in place.
forward_kernel = _cuda_forward
backward_kernel = _cuda_backward


def _window_of(window_left: int, window_right: int):
    return None if (window_left, window_right) == (-1, -1) else (window_left, window_right)


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    layout: str, is_causal: bool, return_lse: bool, window_left: int = -1,
                    window_right: int = -1, diagonal: str = "bottom_right",
                    deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale q k^T + mask) v on CUDA bf16 tensors; (out, lse), lse empty unless asked
    for. deterministic is the backward's (the autograd formula reads it)."""
    return forward_kernel(q, k, v, scale, layout, is_causal, _window_of(window_left, window_right),
                          diagonal, return_lse)


def _attention_backward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                             scale: float, layout: str, is_causal: bool, window_left: int,
                             window_right: int, diagonal: str,
                             deterministic: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """(dq, dk, dv) of ptxattn::attention for an upstream gradient dout, from the forward's
    out and lse; dk, dv summed over each GQA group (k's and v's shapes)."""
    return backward_kernel(q, k, v, out, lse, dout, scale, layout, is_causal,
                           _window_of(window_left, window_right), diagonal, deterministic)


def _inputs(q, k, v, layout: str, is_causal: bool, window=None):
    """The op's checks, and q, k, v as the library takes them."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_cuda:
                raise ValueError(f"{name}: ptxattn::attention runs on CUDA tensors, got one on "
                                 f"{t.device} (ptxattn.torch.scaled_dot_product_attention "
                                 "falls back to torch's SDPA for those)")
    if (is_causal or window is not None) and not library_takes_causal():
        raise ValueError("is_causal: this ptxattn has no masked kernel yet")
    # Inside the autograd formula the op sees the tensors it was called with, which may
    # require grad; the library refuses those (as DLPack does): it reads their data only.
    if q.requires_grad or k.requires_grad or v.requires_grad:
        q, k, v = q.detach(), k.detach(), v.detach()
    # A view TMA cannot address (odd strides, an unaligned slice) is copied once, compactly.
    if not _tma_ready(q, k, v, layout):
        q, k, v = _compact(q, layout), _compact(k, layout), _compact(v, layout)
    return q, k, v


def _run(q, k, v, scale: float, layout: str, is_causal: bool, qkv_meta=None, window=None,
         diagonal: str = "bottom_right") -> torch.Tensor:
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
    if steady_call(q, k, v, out, None, scale, layout, None, False, is_causal, window,
                   diagonal, qkv_meta)[0] is not None:
        return out
    q, k, v = _inputs(q, k, v, layout, is_causal, window)
    _attention(q, k, v, scale=scale, layout=layout, out=out, causal=is_causal, window=window,
               diagonal=diagonal)
    return out


attention_op = torch.library.custom_op("ptxattn::attention", _attention_impl, mutates_args=())
backward_op = torch.library.custom_op("ptxattn::attention_backward", _attention_backward_impl,
                                      mutates_args=())


@attention_op.register_fake
def _attention_fake(q, k, v, scale, layout, is_causal, return_lse, window_left=-1,
                    window_right=-1, diagonal="bottom_right", deterministic=False):
    out = q.new_empty(out_shape(q, v, layout))
    if not return_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    b, x, y, _ = q.shape
    heads, seq = (x, y) if layout == "bhld" else (y, x)
    return out, q.new_empty((b, heads, seq), dtype=torch.float32)


@backward_op.register_fake
def _attention_backward_fake(q, k, v, out, lse, dout, scale, layout, is_causal, window_left,
                             window_right, diagonal, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --------------------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out and the LSE (the forward computes it whenever grad is needed:
    attention() asks for it); a call made without it (return_lse=False through the op
    directly) recomputes it in the backward."""
    q, k, v, scale, layout, is_causal, return_lse, left, right, diagonal, deterministic = inputs
    out, lse = output
    # unused outputs give None, not zeros: the backward then knows no gradient reaches the LSE
    ctx.set_materialize_grads(False)
    ctx.mask = (scale, layout, is_causal, left, right, diagonal, deterministic)
    ctx.has_lse = return_lse
    if return_lse:
        ctx.save_for_backward(q, k, v, out, lse)
    else:
        ctx.save_for_backward(q, k, v, out)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, *saved_lse = ctx.saved_tensors
    scale, layout, is_causal, left, right, diagonal, deterministic = ctx.mask
    nones = (None,) * 8
    if not ctx.has_lse:
        grad_lse = None           # the op returned an empty LSE: nothing depends on it
    if grad_out is None and grad_lse is None:
        return (None, None, None) + nones
    if saved_lse:
        lse = saved_lse[0]
    else:
        out, lse = _OP(q, k, v, scale, layout, is_causal, True, left, right, diagonal,
                       deterministic)
    dout = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype)
    dq, dk, dv = _BACKWARD_OP(q, k, v, out, lse, dout, scale, layout, is_causal, left, right,
                              diagonal, deterministic)
    if grad_lse is not None:
        dq, dk = _lse_gradient(q, k, v, out, lse, grad_lse, dq, dk, ctx.mask)
    return (dq, dk, dv) + nones


def _lse_gradient(q, k, v, out, lse, grad_lse, dq, dk, mask):
    """dq, dk with the LSE's own gradient added: d lse_i / d s_ij = P_ij (s = scale q.k), so
    dQ_i += scale g_i (P K)_i and dK_j += scale sum_i P_ij g_i q_i. (P K) is the forward
    with k for v, and P^T (g q) the backward's dV for dout = g q: two more kernel calls, each
    with the forward's mask and LSE; paid only when a gradient reaches the LSE (a merge of
    partial attentions, as context parallel does, sends one)."""
    scale, layout, is_causal, left, right, diagonal, deterministic = mask
    g = grad_lse.float()
    g = g[..., None] if layout == "bhld" else g.transpose(1, 2)[..., None]
    pk, _ = _OP(q, k, k, scale, layout, is_causal, False, left, right, diagonal, deterministic)
    _, _, pgq = _BACKWARD_OP(q, k, v, out, lse, (g * q.float()).to(q.dtype), scale, layout,
                             is_causal, left, right, diagonal, deterministic)
    dq = (dq.float() + scale * g * pk.float()).to(dq.dtype)
    dk = (dk.float() + scale * pgq.float()).to(dk.dtype)
    return dq, dk


attention_op.register_autograd(_backward, setup_context=_setup_context)


def _mask_arguments(is_causal, window, diagonal):
    """(is_causal, left, right, diagonal) as the op takes them; the library checks the rest
    (a causal window's right edge, the diagonal's name) with its own errors."""
    # the library's reading of a window (a sequence pair of ints >= -1; a set, dict or
    # iterator is refused), without its causal rules, which the call itself applies
    left, right = _window(False, window, "bottom_right")
    if diagonal not in ("bottom_right", "top_left"):
        raise ValueError(f"diagonal: expected 'bottom_right' or 'top_left', got {diagonal!r}")
    return bool(is_causal), int(left), int(right), diagonal


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              layout: str = "bhld", is_causal: bool = False, return_lse: bool = False,
              window=None, diagonal: str = "bottom_right", deterministic: bool = False,
              precision: str = "bf16"):
    """The op with defaults: scale 1/sqrt(D); returns out, or (out, lse) with return_lse.

    Masks as ptxattn.attention's: is_causal (bottom-right by default: query i of Lq sees keys
    up to i + Lk - Lq; diagonal="top_left" is torch's is_causal), window=(left, right).
    Differentiable: with grad mode on and a tensor that requires grad, the forward also
    computes the LSE and saves it, and loss.backward() runs the backward kernels
    (ptxattn::attention_backward; dK and dV summed over each GQA group; deterministic=True
    adds dQ in a fixed order, bit-for-bit equal across runs). A gradient that reaches the
    returned LSE is included.

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
        if window is not None or diagonal != "bottom_right":
            raise ValueError(f"window/diagonal: the FP8 op takes is_causal only (bottom-right), "
                             f"got window={window!r}, diagonal={diagonal!r}; use "
                             "ptxattn.attention(precision='fp8', window=...) or "
                             "precision='bf16'")
        from .fp8 import attention as attention_fp8
        return attention_fp8(q, k, v, scale=scale, layout=layout, is_causal=is_causal)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    if q.dim() != 4:
        raise ValueError(f"q: expected a rank-4 tensor, got shape {tuple(q.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    plain_mask = window is None and diagonal == "bottom_right"
    if plain_mask and not return_lse and _unwatched() and forward_kernel is _FORWARD:
        # plain CUDA bf16 tensors without grad (tensors.torch_meta: exact torch.Tensor, so
        # _eager's conditions hold), read once for the library's steady path too
        meta = tensors.torch_meta
        qm, km, vm = meta(q), meta(k), meta(v)
        if qm is not None and km is not None and vm is not None:
            return _run(q, k, v, float(scale), layout, bool(is_causal), (qm, km, vm))
    causal, left, right, diagonal = _mask_arguments(is_causal, window, diagonal)
    deterministic = bool(deterministic)
    if _eager(q, k, v):
        if not return_lse and forward_kernel is _FORWARD:
            return _run(q, k, v, float(scale), layout, causal, window=_window_of(left, right),
                        diagonal=diagonal)
        out, lse = _attention_impl(q, k, v, float(scale), layout, causal, bool(return_lse),
                                   left, right, diagonal, deterministic)
    else:
        # with grad needed the forward computes the LSE too (the backward reads it)
        want_lse = bool(return_lse) or (_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad))
        out, lse = _OP(q, k, v, float(scale), layout, causal, want_lse, left, right, diagonal,
                       deterministic)
    return (out, lse) if return_lse else out


_OP = torch.ops.ptxattn.attention.default
_BACKWARD_OP = torch.ops.ptxattn.attention_backward.default
_FORWARD = _cuda_forward
_F32 = np.dtype(np.float32)
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
    time, and in plain eager mode without grad it adds nothing: no autograd (nothing
    requires grad), no autocast or batching rule. Anything that observes or rewrites ops takes
    the dispatcher, so it sees one ptxattn::attention node as before: torch.compile/export
    (is_compiling), jit tracing, __torch_function__ modes, functorch transforms (vmap,
    grad), __torch_dispatch__ modes (FakeTensorMode, make_fx, DebugMode), tensor subclasses
    (DTensor, FakeTensor, FunctionalTensor: not exactly torch.Tensor), and inputs that
    require grad with grad mode on."""
    if not _CAN_BYPASS or type(q) is not _Tensor or type(k) is not _Tensor \
            or type(v) is not _Tensor:
        return False
    if (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled():
        return False        # the op's autograd formula records the call for the backward
    return _unwatched()


def _unwatched() -> bool:
    """_eager's answer about torch's state rather than the tensors: nothing compiles, traces,
    transforms or intercepts ops right now."""
    if not _CAN_BYPASS:
        return False
    tracing, function_modes, functorch = _WATCHERS
    return not (_is_compiling() or tracing() is not None or function_modes() or functorch()
                or _DISPATCH_MODES())
