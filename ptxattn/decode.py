"""flash_attn_with_kvcache: decode (1 to 16 queries) against a KV cache, split-KV, packed GQA.

    out = ptxattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    out, lse = ptxattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                               cache_seqlens=lengths, causal=True,
                                               return_lse=True)

Named and shaped as FlashAttention's: q (B, Lq, H, D), caches (B, Lmax, Hkv, D), new k/v
(B, Lnew, Hkv, D) appended in place at positions cache_seqlens[b] .. + Lnew - 1 before the
attention, which then sees cache_seqlens[b] + Lnew keys (cache_seqlens is not modified).
layout="bhld" takes q (B, H, Lq, D), caches (B, Hkv, Lmax, D) and k/v (B, Hkv, Lnew, D).

The call is one asynchronous launch sequence (append, decode, combine) on the caller's stream:
lengths stay on the device, the split count comes from shapes, and per-call memory (output,
workspace, LSE) comes from the caller's allocator: torch.empty when q is a torch tensor,
tensors.empty (stream-ordered cuMemAllocAsync) otherwise. So a decode step can be captured in
a CUDA graph and replayed with new lengths. See decode_plan.py for the lengths contract and
the split heuristic, decode_launch.py for the kernels.

Imported from plan.py: _window (the causal/window_size rule); the argument readers (bf16
views, int32 device vectors, the stream) are device_args.py's, shared with varlen.py.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from . import driver, tensors, tma
from .driver import is_capturing as _is_capturing
from .device_args import bf16_view, call_stream, foreign, host_int32, is_torch
from .plan import _window
from .decode_builds import FALLBACK_PAGED_VARIANT, PAGED_VARIANT_ENV, build_for, paged_variant
from .decode_launch import PDL_ENV, TMA_CHUNK, Launcher, binding_of
from .decode_plan import (CHECK_BOUNDS_ENV, LAYOUTS, MAX_CACHE_LEN, POISON_WORKSPACE_ENV,
                          DecodeCall, Lengths, Paging, bhld_of, bytes_strides, check_bounds_requested,
                          check_host_block_table, check_host_lengths, check_num_splits,
                          check_page_size, check_rows_aligned, check_scale, check_shapes,
                          check_out_view, overlaps, resolve_splits, splits_of,
                          workspace_floats)
from .tensors import DeviceArray

F32 = np.dtype(np.float32)


# --------------------------------------------------------------------------- arguments

def _lengths(obj, batch: int, cache_len: int, seq_new: int, stream: int) -> Lengths:
    """cache_seqlens as Lengths; host data is range-checked here (see decode_plan)."""
    if obj is None:
        if seq_new:
            raise ValueError("cache_seqlens: k and v are appended at each sequence's length, "
                             "so cache_seqlens is needed (None means every sequence is full)")
        return Lengths("full", value=cache_len)
    if isinstance(obj, bool):
        raise TypeError("cache_seqlens: expected an int32 array or an int, got a bool")
    if isinstance(obj, (int, np.integer)):
        check_host_lengths(np.full(batch, int(obj), np.int64), batch, cache_len, seq_new)
        return Lengths("int", value=int(obj))
    if is_torch(obj) and not obj.is_cuda:
        torch = sys.modules["torch"]
        if obj.dtype != torch.int32:
            raise TypeError(f"cache_seqlens: expected dtype int32 (FlashAttention's), got "
                            f"{obj.dtype}")
        obj = obj.numpy()
    if isinstance(obj, np.ndarray):
        tensors.refuse_masked("cache_seqlens", obj)
        if obj.dtype != np.int32:
            raise TypeError(f"cache_seqlens: expected dtype int32 (FlashAttention's), got "
                            f"{obj.dtype}")
        values = np.ascontiguousarray(obj)
        check_host_lengths(values, batch, cache_len, seq_new)
        return Lengths("host", host=values)
    vec = foreign("cache_seqlens", obj, "int32", stream)
    if vec.shape != (batch,):
        raise ValueError(f"cache_seqlens: expected shape ({batch},), one length per sequence, "
                         f"got {vec.shape}")
    if batch > 1 and vec.strides[0] != 1:
        raise ValueError(f"cache_seqlens: expected a contiguous array, got stride "
                         f"{vec.strides[0]}")
    if vec.ptr % 4:
        raise ValueError(f"cache_seqlens: base address 0x{vec.ptr:x} is not 4-byte aligned")
    return Lengths("device", ptr=vec.ptr, owner=vec)


def _paging(obj, batch: int, k_dims, stream: int) -> Paging:
    """block_table as Paging: (B, max_pages) int32, a device array (read by the kernels only)
    or host data (checked against host lengths in validate, copied in per call)."""
    num_pages, _, page_size, _ = k_dims          # (num_pages, page_size, Hkv, D) read as BSHD
    check_page_size(page_size)
    if isinstance(obj, bool) or isinstance(obj, (int, float)):
        raise TypeError(f"block_table: expected an int32 array (B, max_pages), got "
                        f"{type(obj).__name__}")
    host = host_int32("block_table", obj)
    if host is not None:
        shape, strides = host.shape, tensors.contiguous_strides(host.shape)
    else:
        vec = foreign("block_table", obj, "int32", stream)
        shape, strides = vec.shape, vec.strides
    if len(shape) != 2 or shape[0] != batch:
        raise ValueError(f"block_table: expected shape ({batch}, max_pages), one row of page "
                         f"numbers per sequence, got {tuple(shape)}")
    max_pages = int(shape[1])
    if max_pages == 0:
        raise ValueError("block_table: rows of no page (max_pages 0)")
    if max_pages > 1 and strides[1] != 1:
        raise ValueError(f"block_table: expected rows of contiguous entries, got stride "
                         f"{strides[1]} along a row")
    row_stride = int(strides[0]) if batch > 1 else max_pages
    if batch > 1 and row_stride < max_pages:
        raise ValueError(f"block_table: row stride {row_stride} is below the row's "
                         f"{max_pages} entries")
    paging = Paging("host" if host is not None else "device", page_size=page_size,
                    num_pages=num_pages, max_pages=max_pages, row_stride=row_stride)
    if paging.capacity > MAX_CACHE_LEN:
        raise ValueError(f"block_table: {max_pages} pages of {page_size} positions exceed "
                         f"{MAX_CACHE_LEN}")
    if host is not None:
        paging.host = host
    else:
        if vec.ptr % 4:
            raise ValueError(f"block_table: base address 0x{vec.ptr:x} is not 4-byte aligned")
        paging.ptr, paging.owner = vec.ptr, vec
    return paging


def validate(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False,
             window_size=(-1, -1), softmax_scale=None, return_lse=False, num_splits=0, *,
             block_table=None, layout="bshd", out=None, lse_out=None,
             stream=None) -> DecodeCall:
    """Every check of a call, in a fixed order, before any launch: a DecodeCall or a
    ValueError/TypeError naming the argument (nothing is written on error)."""
    if not isinstance(layout, str) or layout.lower() not in LAYOUTS:
        raise ValueError(f"layout: expected 'bshd' (FlashAttention's (batch, seq, heads, "
                         f"head_dim)) or 'bhld', got {layout!r}")
    layout = layout.lower()
    paged = block_table is not None
    if paged and layout != "bshd":
        raise ValueError("layout: a paged cache (block_table=) is (num_pages, page_size, Hkv, "
                         "D), FlashAttention's: layout must be 'bshd'")
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: k and v are appended together; "
                         "pass both or neither")
    handle, stream_object = call_stream(q, (q, k_cache, v_cache, out), stream)
    views = {name: bf16_view(name, obj, handle)
             for name, obj in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                               ("k", k), ("v", v)) if obj is not None}
    q_dims = bhld_of("q", views["q"].shape, layout)
    k_dims = bhld_of("k_cache", views["k_cache"].shape, layout)
    bhld_of("v_cache", views["v_cache"].shape, layout)
    new = None
    if k is not None:
        new = (bhld_of("k", views["k"].shape, layout), views["v"].shape, views["k"].shape)
        bhld_of("v", views["v"].shape, layout)
    check_shapes(q_dims, k_dims, views["v_cache"].shape, views["k_cache"].shape, layout, new,
                 paged=paged)
    devices = {n: a.device for n, a in views.items() if a.device is not None}
    if len(set(devices.values())) > 1:
        raise ValueError("q, k_cache, v_cache: expected arrays on one device, got "
                         + ", ".join(f"{n} on CUDA device {d}" for n, d in devices.items()))
    batch, heads, seq_q, head_dim = q_dims
    _, heads_kv, cache_len, _ = k_dims
    paging = _paging(block_table, batch, k_dims, handle) if paged else None
    if paging is not None:
        cache_len = paging.capacity              # the positions a sequence's pages can hold
        if new is not None and new[0][2] > cache_len:
            raise ValueError(f"k: {new[0][2]} new keys do not fit {paging.max_pages} pages of "
                             f"{paging.page_size} positions")
    seq_new = new[0][2] if new is not None else 0
    left, right = _window(causal, window_size, "bottom_right", "window_size")
    scale = check_scale(softmax_scale, head_dim)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {type(return_lse).__name__}")
    splits_requested = check_num_splits(num_splits)
    lengths = _lengths(cache_seqlens, batch, cache_len, seq_new, handle)
    build = build_for(head_dim)
    if paging is not None and paging.kind == "host":
        check_host_block_table(paging.host, _host_lengths_of(lengths, batch, seq_new), paging)

    # geometry: TMA reads the caches (16-byte base and strides), the other kernels move
    # 16-byte chunks of q, k, v and the output
    for name in ("k_cache", "v_cache"):
        arr = views[name]
        tma.check_base(arr.ptr, name)
        if paging is None:
            tma.map_geometry(layout, batch, heads_kv, cache_len, head_dim, build.block_n,
                             TMA_CHUNK, arr.strides, name)
        else:
            _paged_map_geometry(arr, paging, heads_kv, head_dim, build.block_n, name)
    if paging is not None:
        paging.variant = _paged_variant_for(paging, views, heads_kv, head_dim, build)
    check_rows_aligned(views["q"], layout, "q")
    if k is not None:
        for name in ("k", "v"):
            check_rows_aligned(views[name], layout, name)
        if bytes_strides(views["k"], layout, "k") != bytes_strides(views["v"], layout, "v"):
            raise ValueError("v: expected the strides of k (the append copies both with one "
                             "set of strides)")
        if (bytes_strides(views["k_cache"], layout, "k_cache")
                != bytes_strides(views["v_cache"], layout, "v_cache")):
            raise ValueError("v_cache: expected the strides of k_cache when k and v are "
                             "appended")
        for name in ("k", "v"):
            for cache in ("k_cache", "v_cache"):
                if overlaps(views[name], views[cache]):
                    raise ValueError(f"{name}: overlaps {cache}; the new keys and values "
                                     "must not alias the caches")
    if overlaps(views["k_cache"], views["v_cache"]) and k is not None:
        raise ValueError("v_cache: overlaps k_cache; appending would write one into the other")

    out_view = None
    if out is not None:
        out_view = bf16_view("out", out, handle)
        check_out_view(out_view, views)
        check_rows_aligned(out_view, layout, "out")
        out_strides = bytes_strides(out_view, layout, "out")
    else:
        out_strides = _contiguous_bytes(views["q"].shape, layout)
    lse_view = None
    if lse_out is not None:
        if not return_lse:
            raise ValueError("lse_out: given with return_lse=False")
        lse_view = foreign("lse_out", lse_out, "float32", handle)
        if lse_view.shape != (batch, heads, seq_q) or (
                batch * heads * seq_q > 1
                and lse_view.strides != tensors.contiguous_strides(lse_view.shape)):
            raise ValueError(f"lse_out: expected a contiguous float32 array of shape "
                             f"{(batch, heads, seq_q)}, got shape {lse_view.shape} strides "
                             f"{lse_view.strides}")
    call = DecodeCall(q=views["q"], k_cache=views["k_cache"], v_cache=views["v_cache"],
                      k_new=views.get("k"), v_new=views.get("v"), out=out_view, out_given=out,
                      lse_out=lse_view, layout=layout, batch=batch, seq_q=seq_q, heads=heads,
                      heads_kv=heads_kv, head_dim=head_dim, cache_len=cache_len,
                      seq_new=seq_new, lengths=lengths, window=(left, right), scale=scale,
                      want_lse=return_lse, splits=0, splits_requested=splits_requested,
                      stream=handle, stream_object=stream_object, torch=is_torch(q),
                      build=build, out_strides=out_strides, q_shape=tuple(views["q"].shape),
                      objects={"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v},
                      paging=paging)
    if call.rows >= 1 << 31:
        raise ValueError(f"q: {call.rows} output rows (B x H x Lq) are too many for one call "
                         "(the kernels' row indices are 32-bit)")
    return call


def _host_lengths_of(lengths: Lengths, batch: int, seq_new: int):
    """The keys each sequence holds after the append, when the lengths are host data (else
    None: they live on the device)."""
    if lengths.kind == "device":
        return None
    if lengths.kind == "host":
        return lengths.host.astype(np.int64) + seq_new
    return np.full(batch, lengths.value + (seq_new if lengths.kind == "int" else 0), np.int64)


def _paged_map_geometry(arr, paging: Paging, heads_kv: int, head_dim: int, block_n: int,
                        name: str) -> dict:
    rows, d_blocks = paging.map_box(head_dim, block_n)
    return tma.map_geometry("bshd", paging.num_pages, heads_kv, paging.page_size, head_dim,
                            rows, TMA_CHUNK, arr.strides, name, d_blocks)


def _paged_variant_for(paging: Paging, views: dict, heads_kv: int, head_dim: int,
                       build) -> str:
    """The paged build variant this call runs: PTXATTN_PAGED_VARIANT's (else the build table's
    default), unless it lays tiles out in row groups and the caches' pages are not packed
    page_size rows apart (their row groups do not fold into one TMA dim): then "today", the
    build that reads any strides TMA can address."""
    variant = paged_variant()
    if not variant.row_group:
        return variant.name
    box_rows = min(paging.page_size, build.block_n)
    try:
        for name in ("k_cache", "v_cache"):
            tma.row_group_geometry(paging.num_pages, paging.page_size, heads_kv, head_dim,
                                   box_rows, tuple(views[name].strides), TMA_CHUNK, name)
    except ValueError:
        return FALLBACK_PAGED_VARIANT
    return variant.name


def _contiguous_bytes(shape, layout: str) -> tuple[int, int, int]:
    strides = tensors.contiguous_strides(shape)
    b, h, r, _ = tma.bhl_strides(layout, shape, strides, "out")
    return 2 * b, 2 * r, 2 * h


# --------------------------------------------------------------------------- one call

def _torch_empty(shape, dtype: str, like):
    torch = sys.modules["torch"]
    return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)


class _Fresh:
    """The per-call memory of one launch sequence (never kept between calls)."""
    __slots__ = ("out", "out_ptr", "lse", "lse_ptr", "ws", "ws_ptr", "keep")


def _allocate(call: DecodeCall, out_obj, lse_obj) -> _Fresh:
    """Output (unless given), LSE (if asked, unless given) and the splits' workspace, from the
    caller's allocator: torch.empty under torch, tensors.empty (stream-ordered) otherwise."""
    f = _Fresh()
    f.keep = []
    q_obj = call.objects["q"]
    if call.torch:
        f.out = out_obj if out_obj is not None else _torch_empty(call.out_shape, "bfloat16", q_obj)
        f.out_ptr = call.out.ptr if out_obj is not None else f.out.data_ptr()
        if call.want_lse:
            f.lse = lse_obj if lse_obj is not None else _torch_empty(call.lse_shape, "float32",
                                                                    q_obj)
            f.lse_ptr = call.lse_out.ptr if lse_obj is not None else f.lse.data_ptr()
        else:
            f.lse, f.lse_ptr = None, 0
        n = call.workspace_floats
        f.ws = _torch_empty((n,), "float32", q_obj) if n else None
        f.ws_ptr = f.ws.data_ptr() if n else 0
    else:
        owner = call.stream_object
        if out_obj is not None:
            f.out, f.out_ptr = out_obj, call.out.ptr
        else:
            f.out = tensors.empty(call.out_shape, stream=call.stream, stream_owner=owner)
            f.out_ptr = f.out.ptr
        if call.want_lse:
            if lse_obj is not None:
                f.lse, f.lse_ptr = lse_obj, call.lse_out.ptr
            else:
                f.lse = tensors.empty(call.lse_shape, stream=call.stream, dtype=F32,
                                      stream_owner=owner)
                f.lse_ptr = f.lse.ptr
        else:
            f.lse, f.lse_ptr = None, 0
        n = call.workspace_floats
        f.ws = tensors.empty((n,), stream=call.stream, dtype=F32, stream_owner=owner) if n \
            else None
        f.ws_ptr = f.ws.ptr if n else 0
    if f.ws is not None and os.environ.get(POISON_WORKSPACE_ENV, "").strip() not in ("", "0"):
        driver.memset_u8(f.ws_ptr, 0xFF, 4 * call.workspace_floats, stream=call.stream)
    return f


def _lengths_args(call: DecodeCall, keep: list) -> tuple[int, int]:
    """(seqlens_ptr, seqlen_const) for the kernels; host lengths are copied in (stream-ordered
    memory, freed after the launch in stream order)."""
    lengths = call.lengths
    if lengths.kind == "device":
        return lengths.ptr, 0
    if lengths.kind == "host":
        buf = driver.DeviceBuffer(lengths.host.nbytes, stream=call.stream,
                                  stream_owner=call.stream_object)
        driver.memcpy_htod(buf.ptr, lengths.host, stream=call.stream)
        keep.append(buf)
        return buf.ptr, 0
    return 0, lengths.value


def _block_table_arg(call, keep: list) -> int:
    """The block table's device address for the kernels (0 without paging); a host table is
    copied in (stream-ordered memory, freed after the launch in stream order). call: a
    DecodeCall or a VarlenCall (their .paging, .stream and .stream_object)."""
    paging = call.paging
    if paging is None:
        return 0
    if paging.kind == "device":
        return paging.ptr
    buf = driver.DeviceBuffer(paging.host.nbytes, stream=call.stream,
                              stream_owner=call.stream_object)
    driver.memcpy_htod(buf.ptr, paging.host, stream=call.stream)
    keep.append(buf)
    return buf.ptr


BOUNDS_WORDS = 8     # the PTXATTN_CHECK_BOUNDS report: a bad length (words 0-1), a bad page (2-4)


def _bounds_buffer(call: DecodeCall) -> driver.DeviceBuffer:
    if _is_capturing(call.stream):
        raise RuntimeError(f"{CHECK_BOUNDS_ENV}=1 reads the kernel's report back on the host, "
                           "which a stream being captured into a CUDA graph cannot do; capture "
                           f"without {CHECK_BOUNDS_ENV}")
    buf = driver.DeviceBuffer(4 * BOUNDS_WORDS, stream=call.stream,
                              stream_owner=call.stream_object)
    driver.memset_u8(buf.ptr, 0, 4 * BOUNDS_WORDS, stream=call.stream)
    return buf


def _raise_if_out_of_bounds(call: DecodeCall, buf: driver.DeviceBuffer) -> None:
    report = np.zeros(BOUNDS_WORDS, np.int32)
    driver.memcpy_dtoh(report, buf.ptr, stream=call.stream)    # waits for the stream
    if report[0]:
        b = int(report[0]) - 1
        top = call.cache_len - call.seq_new
        raise ValueError(f"cache_seqlens: on the device, sequence {b} has length "
                         f"{int(report[1])}, outside [0, {top}] ({CHECK_BOUNDS_ENV}=1; "
                         "without it the kernels clamp to [0, Lmax]); the output is of the "
                         "clamped lengths")
    if report[2]:
        b, page, entry = int(report[2]) - 1, int(report[3]), int(report[4])
        raise ValueError(f"block_table: on the device, sequence {b}'s page {page} (within its "
                         f"length) is entry {entry}, outside [0, {call.paging.num_pages}) "
                         f"({CHECK_BOUNDS_ENV}=1; without it the kernels read such a page as "
                         "zeros and the append drops its writes: no access leaves the caches)")


def _stream_handshake(call: DecodeCall) -> None:
    """As attention(): our DeviceArrays' pending writes on other streams are waited for, and
    stream-ordered memory used here is not reused before this stream is done with it."""
    if call.torch:
        return
    for arr in (call.q, call.k_cache, call.v_cache, call.k_new, call.v_new, call.out):
        if arr is None:
            continue
        pending = arr.producer_stream if arr.producer_stream is not None else arr.stream
        if pending is not None and pending != call.stream:
            driver.stream_wait(call.stream, pending)
        arr.used_on(call.stream)


def run_call(call: DecodeCall, launcher: Launcher, out_obj=None, lse_obj=None):
    """One call on a built Launcher: fresh memory, the launches, the result in the caller's
    kind (torch tensors under torch, DeviceArrays otherwise, the caller's out/lse_out)."""
    fresh = _allocate(call, out_obj, lse_obj)
    keep = fresh.keep
    seqlens_ptr, seqlen_const = _lengths_args(call, keep)
    table_ptr = _block_table_arg(call, keep)
    bounds = _bounds_buffer(call) if check_bounds_requested() else None
    k_new = call.k_new.ptr if call.k_new is not None else 0
    v_new = call.v_new.ptr if call.v_new is not None else 0
    launcher.run(call.q.ptr, fresh.out_ptr, fresh.lse_ptr, fresh.ws_ptr, seqlens_ptr,
                 seqlen_const, k_new, v_new, bounds.ptr if bounds is not None else 0,
                 table_ptr, _binding(call))
    if isinstance(fresh.ws, DeviceArray):
        # the splits' workspace is this call's alone: its stream-ordered free is queued right
        # behind the launches that use it (the memory returns once they are done), not left to
        # a finalizer that may run after the context is gone
        fresh.ws.free()
    if not call.torch:
        for arr in (fresh.out, fresh.lse):
            if isinstance(arr, DeviceArray):
                arr.stream = call.stream
                arr.stream_owner = call.stream_object
        if call.seq_new:
            for arr in (call.k_cache, call.v_cache):
                arr.stream = call.stream           # written here: later readers wait for it
    if bounds is not None:
        _raise_if_out_of_bounds(call, bounds)
    return (fresh.out, fresh.lse) if call.want_lse else fresh.out


def _empty_result(call: DecodeCall):
    """No query (B, H or Lq = 0): no attention launch; an append still runs."""
    if call.torch:
        out = call.out_given if call.out_given is not None else _torch_empty(
            call.out_shape, "bfloat16", call.objects["q"])
        lse = _torch_empty(call.lse_shape, "float32", call.objects["q"]) if call.want_lse \
            else None
    else:
        out = call.out_given if call.out_given is not None else DeviceArray(
            0, call.out_shape, device=call.q.device)
        lse = DeviceArray(0, call.lse_shape, device=call.q.device, dtype=F32) \
            if call.want_lse else None
    return (out, lse) if call.want_lse else out


# --------------------------------------------------------------------------- the entry point

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            causal=False, window_size=(-1, -1), softmax_scale=None,
                            return_lse=False, num_splits=0, *, block_table=None, layout="bshd",
                            out=None, lse_out=None, stream=None):
    """Attention of 1 to 16 queries per sequence against a KV cache (FlashAttention's API).

    q: (B, Lq, H, D) bf16, Lq <= 16; k_cache, v_cache: (B, Lmax, Hkv, D) bf16, Hkv dividing H
    (GQA/MQA); D 64, 128 or 256. layout="bhld": q (B, H, Lq, D), caches (B, Hkv, Lmax, D).
    cache_seqlens: each sequence's cached length, an int32 device array (B,), an int, a NumPy
    int32 array, or None (every sequence holds Lmax keys).
    k, v: optional (B, Lnew, Hkv, D) new keys and values, written into the caches in place at
    positions cache_seqlens[b] .. + Lnew - 1 first; the attention then sees cache_seqlens[b]
    + Lnew keys. cache_seqlens itself is not modified.
    causal: bottom-right (query lq of Lq sees keys <= L - Lq + lq, L the sequence's keys);
    window_size=(left, right): keys in [L - Lq + lq - left, L - Lq + lq + right], -1
    unbounded (causal is right = 0). softmax_scale defaults to 1 / sqrt(D).
    return_lse: also return the float32 (B, H, Lq) log-sum-exp (natural log; -inf for a query
    that sees no key, whose output is 0).
    block_table: a paged cache (FlashAttention's): k_cache and v_cache are then (num_pages,
    page_size, Hkv, D), page_size a power of two from 16 to 256, and block_table an int32
    (B, max_pages) array whose row b names sequence b's pages in order (key j of sequence b
    is row j % page_size of page block_table[b, j // page_size]); a sequence holds at most
    max_pages * page_size keys. New k/v are appended into the pages in place. Entries past a
    sequence's last page are never read (transformers pads with -1). Read on the device like
    the lengths: a device table's entries outside [0, num_pages) within a sequence's pages
    read as zero keys and drop the append's writes (no access leaves the caches), and
    PTXATTN_CHECK_BOUNDS=1 reports them; a NumPy table is checked here (ValueError).
    num_splits: split-KV's split count (0: the heuristic, decode_plan.choose_splits; at most
    128, and at most the cache's K/V tiles).
    Beyond FlashAttention's: layout, out= (a bf16 array of q's shape), lse_out= (a float32
    (B, H, Lq) array), stream= (non-torch arrays; torch tensors run on torch's current stream).

    Lengths are read on the device: the call never waits for the GPU, allocates only from the
    caller's allocator (torch.empty under torch), and can be captured in a CUDA graph and
    replayed with new lengths. Device lengths outside [0, Lmax - Lnew] are clamped by the
    kernels (no read or write leaves the caches); PTXATTN_CHECK_BOUNDS=1 reports them as a
    ValueError (it waits for the GPU). Host lengths out of range are a ValueError.
    Returns out (torch tensors for torch q, DeviceArrays otherwise, or the caller's out), or
    (out, lse) with return_lse=True.
    """
    result, key = _steady_call(q, k_cache, v_cache, k, v, cache_seqlens, causal, window_size,
                               softmax_scale, return_lse, num_splits, layout, out, lse_out,
                               stream, block_table)
    if result is not None:
        return result
    call = validate(q, k_cache, v_cache, k, v, cache_seqlens, causal, window_size,
                    softmax_scale, return_lse, num_splits, block_table=block_table,
                    layout=layout, out=out, lse_out=lse_out, stream=stream)
    if call.empty:
        if call.seq_new and call.batch and call.heads_kv:     # no query, but keys to append
            call.splits = 1
            _stream_handshake(call)
            seqlens_ptr, seqlen_const = _lengths_args(call, keep := [])
            table_ptr = _block_table_arg(call, keep)
            Launcher(call, call.stream, attention=False).run(
                0, 0, 0, 0, seqlens_ptr, seqlen_const, call.k_new.ptr, call.v_new.ptr,
                block_table_ptr=table_ptr)
            del keep
        return _empty_result(call)
    call.splits = resolve_splits(call, driver.context().sm_count)
    _stream_handshake(call)
    launcher = _launcher(call)
    result = run_call(call, launcher, out, lse_out)
    if key is not None:
        _remember(key, call, launcher)
    return result


def plan_splits(q_shape, k_cache_shape, layout: str = "bshd", sm_count: int | None = None,
                num_splits: int = 0) -> int:
    """The split count a call of these shapes gets (a tool for benchmarks and tests)."""
    (b, h, lq, d) = bhld_of("q", q_shape, layout)
    (_, hk, lmax, _) = bhld_of("k_cache", k_cache_shape, layout)
    build = build_for(d)
    from .decode_plan import choose_splits, m_tiles_of
    if num_splits:
        return max(1, min(num_splits, -(-lmax // build.block_n)))
    sms = sm_count if sm_count is not None else driver.context().sm_count
    return choose_splits(b, hk, m_tiles_of(h // hk, lq), lmax, build.block_n, sms,
                         build.ctas_per_sm)


# --------------------------------------------------------------------------- remembered calls
#
# A model calls this once per layer per token with the same shapes, caches and flags: only q,
# the new keys, the output and the lengths' values move. A remembered call is keyed on
# everything the full path's validation and Launcher read, except those per-call addresses
# (and an int length's value), which are re-checked on every call (alignment, overlaps, the
# int's range) before their slots are re-packed. Anything the key cannot describe exactly
# (NumPy lengths, lse_out=, DLPack producers, subclasses) takes the full path. An entry holds
# the Launcher (functions, the caches' maps, packed parameters), never per-call memory: the
# output and workspace come fresh from the caller's allocator every call.
#
# transformers' DynamicCache moves the caches too: each step's key tensor is a fresh
# torch.cat result (a new address, one position longer, strides of the new length). A second
# level (_REBOUND) is keyed on the same fields without the caches' addresses, length and
# strides; a hit re-checks those (the full path's cache checks: alignment, TMA strides, the
# extents against q, out and the new keys, an int length within the new top, the split
# count of the new length) and runs a Launcher of the geometry rebound to them
# (Launcher.rebind: two fresh tensor maps, cache_len, the append's cache pointers), remembering
# nothing per step. A binding the second level served again within _PROMOTE_WITHIN of its
# calls (a static cache: the same caches every step, one step of layers apart) takes the full
# path once, which remembers it at the first level with a Launcher of its own, so a static
# cache's steady call stays that path. A binding that comes back only later (a benchmark or a
# server replaying the same prompt: the allocator hands back the same addresses at the same
# lengths) stays on the second level: promoted, it would be evicted from the first level's
# _STEADY_MAX entries before its next sight, a full path every replayed step.

_STEADY: dict[tuple, "_Steady"] = {}
_STEADY_MAX = 256
_STEADY_LOCK = threading.Lock()
_LAUNCHERS: dict[tuple, Launcher] = {}
_REBOUND: dict[tuple, "_Rebound"] = {}
_REBOUND_SPLITS_MAX = 8      # Launchers a second-level entry keeps (one per split count)
_SEEN: dict[tuple, int] = {}   # binding -> the second-level call that served it last
_SEEN_MAX = 4096             # the bindings the second level served last (oldest go first)
_PROMOTE_WITHIN = _STEADY_MAX  # second-level calls between two sights that promote a binding
_SERVED = [0]                # second-level calls so far (under _STEADY_LOCK)
_FROZEN_PER_ENTRY = 16       # frozen launches a first-level entry keeps (oldest go first)


def clear_steady_cache() -> None:
    with _STEADY_LOCK:
        _STEADY.clear()
        _LAUNCHERS.clear()
        _REBOUND.clear()
        _SEEN.clear()
        _SERVED[0] = 0


def _bounded_put(table: dict, key, value, limit: int) -> None:
    """table[key] = value, the oldest entry dropped first past `limit` (under _STEADY_LOCK)."""
    table.pop(key, None)
    while len(table) >= limit:
        table.pop(next(iter(table)), None)
    table[key] = value


def _launcher(call: DecodeCall) -> Launcher:
    """A Launcher for this call's geometry and caches (built once per both and stream; a
    second-level call rebinds one of these to its caches, see Launcher.run's binding)."""
    paging = call.paging
    key = (driver.context().ordinal, call.stream, call.layout, call.batch, call.seq_q,
           call.heads, call.heads_kv, call.head_dim, call.cache_len, call.seq_new,
           call.k_cache.ptr, tuple(call.k_cache.shape), call.k_cache.strides, call.v_cache.ptr,
           call.v_cache.strides, tuple(call.q.strides), call.out_strides,
           None if call.k_new is None else tuple(call.k_new.strides),
           call.window, call.scale, call.splits, os.environ.get(PDL_ENV),
           None if paging is None else (paging.page_size, paging.num_pages, paging.max_pages,
                                        paging.row_stride, paging.variant))
    hit = _LAUNCHERS.get(key)
    if hit is None:
        hit = Launcher(call, call.stream)
        with _STEADY_LOCK:
            _bounded_put(_LAUNCHERS, key, hit, _STEADY_MAX)
    return hit


def _binding(call: DecodeCall):
    """The caches' binding a run passes its Launcher (None for a paged call: its pools are
    part of the Launcher's key and never rebound)."""
    return None if call.paging is not None else binding_of(call)


def _relative_span(arr) -> tuple[int, int] | None:
    if arr is None:
        return None
    lo, hi = arr.span()
    return lo - arr.ptr, hi - arr.ptr


class _Steady:
    """A remembered call: its Launcher, what the per-call checks need, and its frozen
    launches by per-call addresses (Launcher.frozen: bound to this entry's caches)."""
    __slots__ = ("ctx", "launcher", "call", "q_span", "new_span", "cache_spans", "top",
                 "binding", "frozen")

    def __init__(self, ctx, call: DecodeCall, launcher: Launcher):
        self.ctx, self.call, self.launcher = ctx, call, launcher
        self.frozen: dict = {}
        self.q_span = _relative_span(call.q)
        self.new_span = _relative_span(call.k_new)
        self.cache_spans = (call.k_cache.span(), call.v_cache.span())
        self.top = call.cache_len - call.seq_new
        self.binding = _binding(call)


class _Rebound:
    """A remembered call of moving caches (second level): its geometry's Launchers by split
    count, and what the per-call checks of the caches need."""
    __slots__ = ("ctx", "call", "q_span", "new_span", "axis", "launchers", "last", "sm_count")

    def __init__(self, ctx, call: DecodeCall):
        self.ctx, self.call = ctx, call
        self.q_span = _relative_span(call.q)
        self.new_span = _relative_span(call.k_new)
        self.axis = 1 if call.layout == "bshd" else 2       # the caches' length axis
        self.launchers: dict[int, Launcher] = {}
        self.last = (0, 0)              # (K/V tiles, split count) of the last length seen
        self.sm_count = ctx.sm_count


# The knobs a remembered call is keyed on, read as os.environ keeps them (POSIX: a dict of
# bytes; one lookup each, as attention()'s steady path reads its knob)
_KNOB_NAMES = (CHECK_BOUNDS_ENV, POISON_WORKSPACE_ENV, PDL_ENV, PAGED_VARIANT_ENV)
_ENVIRON = getattr(os.environ, "_data", None)
try:
    _KNOB_KEYS = tuple(os.environ.encodekey(n) for n in _KNOB_NAMES)
except AttributeError:           # pragma: no cover - not CPython's os.environ
    _ENVIRON = None


def _knobs() -> tuple:
    if _ENVIRON is not None:
        get = _ENVIRON.get
        return tuple(get(k) for k in _KNOB_KEYS)
    return tuple(os.environ.get(n) for n in _KNOB_NAMES)


def _on(value) -> bool:
    """A knob's value (str or bytes) switches it on unless unset, empty or 0."""
    if value is None:
        return False
    text = value.decode() if isinstance(value, bytes) else value
    return text.strip() not in ("", "0")


def _torch_key_part(obj, torch_type):
    """(ptr, shape, strides, device) of a plain bf16 CUDA torch tensor, else None."""
    if type(obj) is not torch_type:
        return None
    return tensors.torch_meta(obj)


# where the caches' metas sit in a first-level key, and the layout's
_K_AT, _V_AT, _LAYOUT_AT, _TABLE_AT = 3, 4, 14, 17


def _rebound_key(key: tuple) -> tuple | None:
    """The second-level key of a first-level one: the caches' (ptr, shape, strides, device)
    become (shape without the length axis, device). None for a paged call."""
    if key[_TABLE_AT] is not None:
        return None
    axis = 1 if key[_LAYOUT_AT].lower() == "bshd" else 2      # as validate reads it
    k, v = key[_K_AT], key[_V_AT]
    k_part = (tuple(k[1][:axis]) + tuple(k[1][axis + 1:]), k[3])
    v_part = (tuple(v[1][:axis]) + tuple(v[1][axis + 1:]), v[3])
    return key[:_K_AT] + (k_part, v_part) + key[_V_AT + 1:]


def _steady_call(q, k_cache, v_cache, k, v, cache_seqlens, causal, window_size, softmax_scale,
                 return_lse, num_splits, layout, out, lse_out, stream, block_table=None):
    """(result, None) when a remembered launch took the call; else (None, key or None). Never
    raises for bad input: what it cannot key exactly goes to the full path."""
    torch = sys.modules.get("torch")
    if (torch is None or type(q) is not torch.Tensor or stream is not None or lse_out is not None
            or type(causal) is not bool or type(return_lse) is not bool
            or type(layout) is not str or type(num_splits) is not int
            or type(window_size) is not tuple or len(window_size) != 2
            or type(window_size[0]) is not int or type(window_size[1]) is not int
            or not (softmax_scale is None or type(softmax_scale) is float)):
        return None, None
    tt = torch.Tensor
    metas = []
    for obj in (q, k_cache, v_cache, k, v, out):
        if obj is None:
            metas.append(None)
            continue
        m = _torch_key_part(obj, tt)
        if m is None:
            return None, None
        metas.append(m)
    if cache_seqlens is None:
        lengths_key, seqlen_value, seqlens_ptr = "full", None, 0
    elif type(cache_seqlens) is int:
        lengths_key, seqlen_value, seqlens_ptr = "int", cache_seqlens, 0
    elif (type(cache_seqlens) is tt and cache_seqlens.dtype is torch.int32
          and cache_seqlens.is_cuda):
        lengths_key = ("device", tuple(cache_seqlens.shape), cache_seqlens.stride(),
                       cache_seqlens.get_device())
        seqlen_value, seqlens_ptr = None, cache_seqlens.data_ptr()
    else:
        return None, None
    if block_table is None:
        table_key, table_ptr = None, 0
    elif (type(block_table) is tt and block_table.dtype is torch.int32 and block_table.is_cuda
          and block_table.dim() == 2):
        table_key = (tuple(block_table.shape), block_table.stride(), block_table.get_device())
        table_ptr = block_table.data_ptr()
    else:
        return None, None
    qm, km, vm, knm, vnm, om = metas
    env = _knobs()
    key = (qm[1], qm[2], qm[3], km, vm,
           None if knm is None else (knm[1], knm[2], knm[3]),
           None if vnm is None else (vnm[1], vnm[2], vnm[3]),
           None if om is None else (om[1], om[2], om[3]),
           lengths_key, causal, window_size, softmax_scale, return_lse, num_splits, layout,
           tensors.torch_current_stream(qm[3]), env, table_key)
    entry = _STEADY.get(key)
    if entry is not None:
        if entry.ctx is not driver.context():
            return None, key
        launcher, binding = entry.launcher, entry.binding
        spans, top, second = entry.cache_spans, entry.top, False
    else:
        # the second level: the same call on caches that moved and grew (DynamicCache)
        if table_key is not None or _on(env[0]):     # pools do not move; the bounds report
            return None, key                         # names the full path's cache_len
        rebound = _REBOUND.get(_rebound_key(key))
        if rebound is None or rebound.ctx is not driver.context():
            return None, key
        caches = _moved_caches(rebound, km, vm)
        if caches is None:
            return None, key
        binding, spans, top, launcher = caches
        if launcher is None:
            return None, key                         # a new split count: the full path
        if lengths_key == "full":
            seqlen_value = binding[2]                # "full" is the caches' new length
        entry, second = rebound, True
    # the per-call checks of what the key leaves out
    q_ptr = qm[0]
    if q_ptr % 16:
        return None, key
    if seqlen_value is not None and not 0 <= seqlen_value <= top:
        return None, key
    if (seqlens_ptr | table_ptr) % 4:
        return None, key
    k_ptr = v_ptr = 0
    if knm is not None:
        k_ptr, v_ptr = knm[0], vnm[0]
        if (k_ptr | v_ptr) % 16:
            return None, key
        lo, hi = entry.new_span
        for ptr in (k_ptr, v_ptr):
            for c0, c1 in spans:
                if ptr + lo < c1 and c0 < ptr + hi:
                    return None, key
    if om is not None:
        if om[0] % 16:
            return None, key
        lo, hi = entry.q_span               # out has q's shape and (keyed) strides
        o0, o1 = om[0] + lo, om[0] + hi
        out_spans = [(q_ptr + lo, q_ptr + hi), *spans]
        if knm is not None:
            out_spans += [(k_ptr + entry.new_span[0], k_ptr + entry.new_span[1]),
                          (v_ptr + entry.new_span[0], v_ptr + entry.new_span[1])]
        for a0, a1 in out_spans:
            if o0 < a1 and a0 < o1:
                return None, key
    if second:
        with _STEADY_LOCK:                  # a binding served here; seen again soon, it
            _SERVED[0] += 1                 # takes the full path (promoted, _moved_caches)
            _bounded_put(_SEEN, binding, _SERVED[0], _SEEN_MAX)
    call = entry.call
    # fresh tensors as q's new_empty (q is a plain bf16 CUDA tensor: torch.empty without the
    # dtype and device arguments to parse)
    f_out = out if out is not None else q.new_empty(call.out_shape)
    out_ptr = om[0] if out is not None else f_out.data_ptr()
    lse = None
    lse_ptr = 0
    if return_lse:
        lse = q.new_empty(call.lse_shape, dtype=torch.float32)
        lse_ptr = lse.data_ptr()
    n = workspace_floats(launcher.splits, call.rows, call.head_dim)
    ws = q.new_empty((n,), dtype=torch.float32) if n else None
    ws_ptr = ws.data_ptr() if n else 0
    if _on(env[1]) and ws is not None:
        driver.memset_u8(ws_ptr, 0xFF, 4 * n, stream=call.stream)
    bounds = _bounds_buffer(call) if _on(env[0]) else None
    seqlen_arg = seqlen_value if seqlen_value is not None else call.lengths.value
    if second or bounds is not None or seqlen_value is not None:
        # (an int length moves every step: its launches are not worth freezing)
        launcher.run(q_ptr, out_ptr, lse_ptr, ws_ptr, seqlens_ptr, seqlen_arg, k_ptr, v_ptr,
                     bounds.ptr if bounds is not None else 0, table_ptr, binding)
    else:
        # a first-level entry's launches for these addresses, frozen at their first call
        # (the caching allocator hands the output and workspace the same blocks back)
        fkey = (q_ptr, out_ptr, lse_ptr, ws_ptr, seqlens_ptr, seqlen_arg, k_ptr, v_ptr,
                table_ptr)
        launches = entry.frozen.get(fkey)
        if launches is None:
            launches = launcher.frozen(q_ptr, out_ptr, lse_ptr, ws_ptr, seqlens_ptr,
                                       seqlen_arg, k_ptr, v_ptr, 0, table_ptr, binding=binding)
            with _STEADY_LOCK:
                _bounded_put(entry.frozen, fkey, launches, _FROZEN_PER_ENTRY)
        driver.launch_frozen(launches)
    if bounds is not None:
        _raise_if_out_of_bounds(call, bounds)
    return ((f_out, lse) if return_lse else f_out), None


def _moved_caches(rebound: _Rebound, km, vm):
    """(binding, cache spans, top, Launcher or None) for caches the second-level key leaves
    out, after the full path's checks of them (v_cache's shape, the length's range, TMA's
    base and strides, the append's shared strides and k_cache/v_cache overlap); None when one
    fails (the full path then raises its error) or the binding was served here recently. The
    Launcher is None when the new length asks for a split count this entry has not built."""
    call = rebound.call
    k_ptr, k_shape, k_strides, _ = km
    v_ptr, v_shape, v_strides, _ = vm
    if k_shape != v_shape:
        return None
    length = k_shape[rebound.axis]
    seq_new = call.seq_new
    if not (1 <= length <= MAX_CACHE_LEN and seq_new <= length) or (k_ptr | v_ptr) % 16:
        return None
    binding = (k_ptr, v_ptr, length, tuple(k_strides), tuple(v_strides))
    last = _SEEN.get(binding)
    if last is not None and _SERVED[0] - last < _PROMOTE_WITHIN:
        return None                        # a static cache's: promoted to the first level
    layout = call.layout
    try:
        for strides in ((k_strides,) if k_strides == v_strides else (k_strides, v_strides)):
            tma.geometry_once(layout, call.batch, call.heads_kv, length, call.head_dim,
                                  call.build.block_n, TMA_CHUNK, strides)
    except ValueError:
        return None
    shape = tuple(k_shape)
    spans = (_span(k_ptr, shape, binding[3]), _span(v_ptr, shape, binding[4]))
    if seq_new:
        if k_strides != v_strides and (tma.bhl_strides(layout, shape, k_strides)
                                       != tma.bhl_strides(layout, shape, v_strides)):
            return None
        (k0, k1), (v0, v1) = spans
        if k0 < v1 and v0 < k1:
            return None
    build = call.build
    blocks = -(-length // build.block_n)
    last_blocks, splits = rebound.last
    if blocks != last_blocks:              # the split count depends on the length's tiles
        splits = splits_of(build, call.batch, call.heads_kv, call.m_tiles, call.rows,
                           length, call.splits_requested, rebound.sm_count)
        rebound.last = (blocks, splits)    # one assignment: threads never see half of it
    return binding, spans, length - seq_new, rebound.launchers.get(splits)


def _span(ptr: int, shape: tuple, strides: tuple) -> tuple[int, int]:
    """[first, last + 1) bytes of a bf16 view (tensors._span without its cache: a moving
    cache's spans are never asked again)."""
    return tensors._span.__wrapped__(ptr, shape, strides, 2)


def _remember(key: tuple, call: DecodeCall, launcher: Launcher) -> None:
    """Store a launched torch call under its key (the full path's answer for those arguments),
    and its geometry's Launcher under the second-level key."""
    if (not call.torch or call.lengths.kind == "host" or call.lse_out is not None
            or (call.paging is not None and call.paging.kind == "host")):
        return
    ctx = driver.context()
    entry = _Steady(ctx, call, launcher)
    # the entry keeps the call's plain fields; drop its references to the caller's tensors
    entry.call = _detached(call)
    key2 = _rebound_key(key)
    with _STEADY_LOCK:
        _bounded_put(_STEADY, key, entry, _STEADY_MAX)
        if key2 is None:
            return
        rebound = _REBOUND.get(key2)
        if rebound is None or rebound.ctx is not ctx:
            rebound = _Rebound(ctx, call)
            rebound.call = entry.call
            _bounded_put(_REBOUND, key2, rebound, _STEADY_MAX)
        _bounded_put(rebound.launchers, launcher.splits, launcher, _REBOUND_SPLITS_MAX)


def _detached(call: DecodeCall) -> DecodeCall:
    """The call's shape fields without the caller's arrays (an entry must pin no memory)."""
    import dataclasses
    return dataclasses.replace(call, q=None, k_cache=None, v_cache=None, k_new=None,
                               v_new=None, out=None, out_given=None, lse_out=None,
                               lengths=Lengths(call.lengths.kind, value=call.lengths.value),
                               objects={},
                               paging=None if call.paging is None else dataclasses.replace(
                                   call.paging, ptr=0, host=None, owner=None))
