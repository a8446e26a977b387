"""scaled_dot_product_attention with PyTorch's semantics: ptxattn where the kernel takes the
call, torch's own SDPA everywhere else.

The decision reads tensor metadata only (dtype, device, shape): no host sync, no data
access. Tensors that require grad take ptxattn too: its op has an autograd formula (the
backward kernels), so a training step runs forward and backward on ptxattn. Each fallback reason warns once per process and is counted
(fallback_counts()), so a model that silently lost the fast path shows it. Outside the
kernel's scope the call is torch's own, so ptxattn never raises an error that SDPA would not.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import warnings

import torch
import torch.nn.functional as F

from ptxattn import tensors
from ptxattn.stages import PRODUCTION

from . import _op

# reason key -> what the warning says
REASONS = {
    "ndim": "q, k, v are not all 4-D (batch, heads, seq, head_dim)",
    "nested": "nested (jagged) tensors",
    "cpu": "tensors not on a CUDA device",
    "device": "CUDA tensors on a device other than ptxattn's (PTXATTN_DEVICE)",
    "compute_capability": "a GPU other than compute capability 9.0 (the kernels are sm_90a)",
    "dtype": "dtypes other than bfloat16 for q, k and v",
    "attn_mask": "an attn_mask",
    "dropout": "dropout_p > 0",
    "head_dim": "a head dim the kernel lacks (or v's head dim differs from q's)",
    "shape": "batch or length of k and v differ, or batch of q differs from k's",
    "gqa_without_enable_gqa": "k/v heads differ from q's and enable_gqa=False",
    "gqa_heads": "k/v heads that do not divide q's heads",
    "empty": "an empty tensor (no batch, heads, queries or keys)",
    "causal_lengths": "is_causal with Lq != Lk (the kernel has no diagonal offset yet)",
    "causal": "is_causal (the kernel has no causal mask yet)",
    # transformers only: arguments of its attention functions that SDPA has no word for
    "model_features": "position_bias, softcap, attention sinks (s_aux) or output_attentions "
                      "(transformers)",
    # transformers' packed calls (continuous batching: "paged|ptxattn")
    "grad": "packed variable-length tensors that require grad (the varlen and paged kernels "
            "have no backward)",
    "page_size": "a paged cache whose page size is no power of two from 16 to 256",
    # transformers' decode masks (static cache, or a few queries with a mask): the decode
    # kernel takes them when they are the plain causal mask of the cache's length
    "mask_padding": "a decode-step mask whose padding hides keys below the query's position "
                    "(left padding, transformers); the decode kernel takes lengths, not holes",
    "mask_unverified": "a decode-step mask built while compiling or capturing a CUDA graph, "
                       "whose padding cannot be read there (transformers' generate() builds "
                       "static-cache masks outside its compiled forward)",
}

_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()
_packed: collections.Counter = collections.Counter()
_warned: set[str] = set()
_capability: dict[int, tuple[int, int]] = {}


def fallback_counts() -> dict[str, int]:
    """How many calls fell back to torch's SDPA, per reason (a copy), since the last reset."""
    with _lock:
        return dict(_counts)


def packed_call_counts() -> dict[str, int]:
    """How many of transformers' packed calls (continuous batching, "paged|ptxattn") ran on
    ptxattn's kernels since the last reset, per kernel: "varlen" (flash_attn_varlen_func)
    and "paged" (flash_attn_with_kvcache with a block table). A copy."""
    with _lock:
        return dict(_packed)


def _note_packed(kernel: str) -> None:
    if torch.compiler.is_compiling():
        return
    with _lock:
        _packed[kernel] += 1


def reset_fallback_counts() -> None:
    """Zero the counts (fallback_counts() and packed_call_counts()) and re-arm the
    once-per-reason warnings."""
    with _lock:
        _counts.clear()
        _packed.clear()
        _warned.clear()
        _TAKEN.clear()


def _note_fallback(reason: str) -> None:
    # In a graph being compiled the decision is made once at trace time; warning or counting
    # there would cost a graph break, so compiled calls are not counted.
    if torch.compiler.is_compiling():
        return
    with _lock:
        _counts[reason] += 1
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn(f"ptxattn.torch: falling back to torch's scaled_dot_product_attention "
                      f"for {REASONS[reason]} (reason {reason!r}; warned once, counted in "
                      f"ptxattn.torch.fallback_counts())", RuntimeWarning, stacklevel=4)


_ENVIRON = getattr(os.environ, "_data", None)   # POSIX: os.environ's own dict of bytes
_DEVICE_OF: dict = {}            # PTXATTN_DEVICE as os.environ holds it -> its device


def _ptxattn_device() -> int:
    """The device ptxattn runs on (PTXATTN_DEVICE, default 0), -1 when the text is no number.
    The text is read on every call (one dict lookup where os.environ keeps bytes) and parsed
    once per value. (Plain dict lookups: torch.compile traces this function.)"""
    raw = _ENVIRON.get(b"PTXATTN_DEVICE") if _ENVIRON is not None \
        else os.environ.get("PTXATTN_DEVICE")
    device = _DEVICE_OF.get(raw)
    if device is None:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")
        text = text.strip() or "0"
        device = _DEVICE_OF[raw] = int(text) if text.isdigit() else -1
    return device


def _device_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """cpu / device / compute_capability, or None for CUDA tensors ptxattn can run on."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "cpu"
    index = q.get_device()                  # a CUDA tensor's device index (no device object)
    if k.get_device() != index or v.get_device() != index or index != _ptxattn_device():
        return "device"
    cc = _capability.get(index)
    if cc is None:
        if torch.compiler.is_compiling():   # asked once, eagerly, not inside a trace
            return None
        cc = _capability[index] = torch.cuda.get_device_capability(index)
    if cc != (9, 0):
        return "compute_capability"
    return None


_DEVICE_REASON = _device_reason


def fallback_reason(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                    enable_gqa=False, layout: str = "bhld") -> str | None:
    """Why the call goes to torch's SDPA (a key of REASONS), or None when ptxattn takes it.

    layout "bhld" is SDPA's (batch, heads, seq, head_dim); "bshd" is diffusers'
    (batch, seq, heads, head_dim). Metadata only: safe to call on every attention call."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "ndim"
    if q.is_nested or k.is_nested or v.is_nested:
        return "nested"
    why = _device_reason(q, k, v)
    if why:
        return why
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return "dtype"
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p > 0.0:
        return "dropout"
    h_axis, l_axis = (1, 2) if layout == "bhld" else (2, 1)
    qs, ks, vs = q.shape, k.shape, v.shape          # each read once (a torch.Size per read)
    d = qs[3]
    if ks[3] != d or vs[3] != d or d not in PRODUCTION.head_dims:
        return "head_dim"
    if ks != vs or ks[0] != qs[0]:
        return "shape"
    hq, hk = qs[h_axis], ks[h_axis]
    if hq != hk:
        if not enable_gqa:
            return "gqa_without_enable_gqa"
        if hk == 0 or hq % hk:
            return "gqa_heads"
    if 0 in qs or 0 in ks:                          # numel() == 0
        return "empty"
    if is_causal:
        if qs[l_axis] != ks[l_axis]:
            return "causal_lengths"
        if not _op.library_takes_causal():
            return "causal"
    return None


def _torch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout):
    """torch's own SDPA, in either layout (bshd: permuted views in and out, as diffusers'
    native backend does). enable_gqa only when set, so older torch keeps working."""
    if layout == "bshd":
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    extra = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, **extra)
    return out.permute(0, 2, 1, 3) if layout == "bshd" else out


def _kernel(q, k, v, is_causal, scale, layout):
    """The ptxattn path (a seam the CPU tests replace)."""
    return _op.attention(q, k, v, scale=scale, layout=layout, is_causal=is_causal)


_KERNEL = _kernel                   # the seams as shipped: the steady call only runs with them


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, layout: str = "bhld"):
    """SDPA semantics in `layout`; the shared body of the SDPA wrapper and the backends."""
    out, decided = _steady(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout)
    if out is not None:
        return out
    why = fallback_reason(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, layout)
    if why is not None:
        _note_fallback(why)
        return _torch_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout)
    if decided is not None:
        with _lock:
            if len(_TAKEN) >= _TAKEN_MAX:
                _TAKEN.clear()
            _TAKEN[decided] = True
    return _kernel(q, k, v, is_causal, scale, layout)


# The steady call of the wrapper: fallback_reason's verdict is a function of the metadata it
# reads (ranks, dtypes, devices, shapes) and of the arguments; for plain CUDA
# bf16 tensors without grad (what tensors.torch_meta reads, in one pass per tensor) the
# shapes and devices it needs are in that reading. So a call whose reading and arguments
# equal those of a call ptxattn took before is taken again without asking fallback_reason,
# and the same reading goes on to the library's steady path (no tensor is read twice). Any
# other call, and every call while a test replaces a seam, asks fallback_reason.
_TAKEN: dict = {}
_TAKEN_MAX = 4096


def _steady(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout):
    """(out, None) for a call taken as before; else (None, the verdict's key or None)."""
    if (attn_mask is not None or not (type(dropout_p) is float or type(dropout_p) is int)
            or dropout_p > 0.0 or _kernel is not _KERNEL
            or _device_reason is not _DEVICE_REASON
            or not (scale is None or type(scale) is float or type(scale) is int)):
        return None, None
    # first: while torch compiles or traces, tensors are not read here at all (a data_ptr()
    # in a traced function breaks the graph)
    if not _op._unwatched():
        return None, None
    meta = tensors.torch_meta
    qm, km, vm = meta(q), meta(k), meta(v)
    if qm is None or km is None or vm is None:
        return None, None
    is_causal, enable_gqa = bool(is_causal), bool(enable_gqa)
    decided = (qm[1], km[1], vm[1], qm[3], km[3], vm[3], is_causal, enable_gqa, layout,
               _ptxattn_device(), PRODUCTION.head_dims)
    if decided not in _TAKEN:
        return None, decided
    shape = qm[1]
    scale = 1.0 / math.sqrt(shape[-1]) if scale is None else float(scale)
    return _op._run(q, k, v, scale, layout, is_causal, (qm, km, vm)), None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, through ptxattn where it can.

    (batch, heads, seq, head_dim) tensors. ptxattn runs bf16 CUDA calls with a head dim in
    stages.PRODUCTION.head_dims, no mask, no dropout, GQA with enable_gqa=True, with or
    without grad (its backward kernels);
    is_causal (top-left, as torch) once the kernel has it and only with Lq == Lk. Everything
    else is torch's SDPA, warned once per reason and counted: see fallback_counts()."""
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     layout="bhld")
