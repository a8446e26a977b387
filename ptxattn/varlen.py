"""flash_attn_varlen_func: attention over variable-length sequences packed end to end.

    out = ptxattn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal=True)

Named and shaped as FlashAttention's: q (total_q, H, D), k and v (total_k, Hkv, D) bf16 CUDA
arrays; sequence b is q rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 against k/v rows
cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 (or seqused_k[b] of them); causal and windows per
sequence, bottom-right when the lengths differ (a chunk of queries against a longer cache);
GQA/MQA; D 64, 128, 256; empty sequences allowed (no query: nothing; no key: output 0, LSE
-inf). return_lse=True also returns the float32 (H, total_q) log-sum-exp. block_table= reads
the keys from a paged cache instead (k, v (num_pages, page_size, Hkv, D), row b of the int32
table naming sequence b's pages): chunked prefill against a serving engine's pages.

The call is two launches on the caller's stream, both reading the offsets on the device (no
host sync: a CUDA graph can capture it and replay it with new offsets): varlen_tiles.ptx cuts
the sequences into BLOCK_M-row blocks and sorts them longest first into a tile table, then the
production forward kernel's PTXATTN_VARLEN build walks that table with persistent CTAs
(scheduler.ptxh). Per-call memory (output, LSE, the table) comes from the caller's allocator:
torch.empty under torch, tensors.empty / stream-ordered buffers otherwise. varlen_plan.py holds
the offsets' contract and the NumPy model of the table.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys
import threading

import numpy as np

from . import builds, driver, fastlaunch, launch, tensors, tma
from .choice import specialized
from .driver import is_capturing as _is_capturing
from .decode import _block_table_arg, _paged_map_geometry
from .decode import _paging as decode_paging
from .decode_plan import (CHECK_BOUNDS_ENV, check_bounds_requested, check_host_block_table,
                          check_out_view, check_scale)
from .device_args import bf16_view, call_stream, foreign, host_int32, is_torch
from .plan import _window
from .stages import PRODUCTION, SWIZZLE_128B, ptx_root
from .tensors import DeviceArray
from .varlen_plan import (BOUNDS_NAMES, BOUNDS_WORDS, MAX_ROWS, PAGED_TOTAL_K, TILES_SMEM,
                          TILES_THREADS, Offsets, VarlenCall, check_host_offsets, check_host_used,
                          check_max_seqlen, grid_of, window_params)

F32 = np.dtype(np.float32)
TILES_FILE, TILES_ENTRY = "varlen_tiles.ptx", "ptxattn_varlen_tiles"
TMA_CHUNK = 64

PTR, U32, S32 = driver.PTR, driver.U32, driver.S32
# varlen_tiles.ptx's parameters, in its .entry's order (tests check them against the PTX)
TILES_PARAMS = (
    ("cu_q_ptr", PTR), ("cu_k_ptr", PTR), ("seqused_k_ptr", PTR), ("table_ptr", PTR),
    ("scratch_ptr", PTR), ("bounds_ptr", PTR), ("batch", U32), ("total_q", U32),
    ("total_k", U32), ("max_entries", U32), ("block_m", U32), ("block_n_shift", U32),
    ("window_left", S32), ("window_right", S32), ("paged_keys", U32),
)


# --------------------------------------------------------------------------- validation

def _offsets(name: str, obj, stream: int) -> Offsets:
    """An int32 offsets argument as Offsets (1-D, contiguous; host data copied)."""
    if obj is None or isinstance(obj, (bool, int, float)):
        raise TypeError(f"{name}: expected an int32 array, got {type(obj).__name__}")
    host = host_int32(name, obj)
    if host is not None:
        if host.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D int32 array, got shape {host.shape}")
        return Offsets("host", length=host.size, host=host)
    vec = foreign(name, obj, "int32", stream)
    if len(vec.shape) != 1:
        raise ValueError(f"{name}: expected a 1-D int32 array, got shape {vec.shape}")
    if vec.shape[0] > 1 and vec.strides[0] != 1:
        raise ValueError(f"{name}: expected a contiguous array, got stride {vec.strides[0]}")
    if vec.ptr % 4:
        raise ValueError(f"{name}: base address 0x{vec.ptr:x} is not 4-byte aligned")
    return Offsets("device", length=int(vec.shape[0]), ptr=vec.ptr, owner=vec)


def _rank3(name: str, arr) -> tuple[int, int, int]:
    if len(arr.shape) != 3:
        raise ValueError(f"{name}: expected a rank-3 array (total rows, heads, head_dim), got "
                         f"shape {tuple(arr.shape)}")
    return tuple(int(n) for n in arr.shape)


def _strides4(arr) -> tuple[int, int, int, int]:
    """(batch, seq, head, dim) element strides of a (total, heads, D) view read as BSHD of
    batch 1."""
    s_row, s_head, s_dim = (int(x) for x in arr.strides)
    return (s_row * max(arr.shape[0], 1), s_row, s_head, s_dim)


def _geometry(name: str, arr, heads: int, rows_total: int, d: int, box_rows: int) -> None:
    tma.check_base(arr.ptr, name)
    tma.map_geometry("bshd", 1, heads, max(rows_total, 1), d, box_rows, TMA_CHUNK,
                     _strides4(arr), name)


def validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
             window_size=(-1, -1), softmax_scale=None, return_lse=False, seqused_k=None,
             block_table=None, *, out=None, stream=None, padded_ok=False) -> VarlenCall:
    """Every check of a call before any launch: a VarlenCall, or a ValueError / TypeError
    naming the argument (nothing is written on error). padded_ok: host offsets may end before
    the tensors' rows (plan() for static, padded buffers)."""
    paged = block_table is not None
    if paged and padded_ok:
        raise ValueError("block_table: a plan (plan_varlen) takes packed keys; pass the paged "
                         "cache to flash_attn_varlen_func itself")
    handle, stream_object = call_stream(q, (q, k, v, out), stream)
    views = {n: bf16_view(n, o, handle) for n, o in (("q", q), ("k", k), ("v", v))}
    total_q, heads, d = _rank3("q", views["q"])
    if paged:
        num_pages, page_size, heads_kv, dk = _paged_dims("k", views["k"])
        total_k = num_pages * page_size          # the pool's rows (a sequence's are its pages)
    else:
        total_k, heads_kv, dk = _rank3("k", views["k"])
    if tuple(views["v"].shape) != tuple(views["k"].shape):
        raise ValueError(f"v: expected the same shape as k, {tuple(views['k'].shape)}, got "
                         f"{tuple(views['v'].shape)}")
    if dk != d:
        raise ValueError(f"k: head dim {dk} does not match q's head dim {d}")
    build = builds.get(d) if d in builds.HEAD_DIMS else None
    if build is None:
        raise ValueError(f"q: head dim {d}; flash_attn_varlen_func is built for "
                         f"{', '.join(map(str, builds.HEAD_DIMS))}")
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"k: {heads_kv} K/V heads do not divide q's {heads} heads (GQA/MQA "
                         "needs Hkv dividing H)")
    for name, n in (("q", total_q),) + ((("k", total_k),) if not paged else ()):
        if n > MAX_ROWS:
            raise ValueError(f"{name}: {n} rows exceed {MAX_ROWS}")
    devices = {n: a.device for n, a in views.items() if a.device is not None}
    if len(set(devices.values())) > 1:
        raise ValueError("q, k, v: expected arrays on one device, got "
                         + ", ".join(f"{n} on CUDA device {dv}" for n, dv in devices.items()))
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, handle)
    if cu_seqlens_k is None:
        # vLLM's call: a paged cache's counts from seqused_k alone. The tile kernel then reads
        # cu_q in cu_k's place: the paged build takes no key offsets, only counts
        if not paged or seqused_k is None:
            raise ValueError("cu_seqlens_k: None needs block_table= and seqused_k= (a paged "
                             "cache's key counts); packed keys need their offsets")
        cu_k = cu_q
    else:
        cu_k = _offsets("cu_seqlens_k", cu_seqlens_k, handle)
    batch = cu_q.length - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q: expected B + 1 offsets, got none")
    if cu_k.length != cu_q.length:
        raise ValueError(f"cu_seqlens_k: expected {cu_q.length} offsets (cu_seqlens_q's, B + 1), "
                         f"got {cu_k.length}")
    if cu_q.kind == "host":
        check_host_offsets("cu_seqlens_q", cu_q.host, total_q, "q", padded_ok)
    if cu_k.kind == "host":
        if paged:       # offsets of the sequences' own counts: no packed rows to end at
            check_host_offsets("cu_seqlens_k", cu_k.host, int(cu_k.host[-1]) if cu_k.length
                               else 0, "k", True)
        else:
            check_host_offsets("cu_seqlens_k", cu_k.host, total_k, "k", padded_ok)
    used = None
    if seqused_k is not None:
        used = _offsets("seqused_k", seqused_k, handle)
        if used.length != batch:
            raise ValueError(f"seqused_k: expected shape ({batch},), one count per sequence, "
                             f"got ({used.length},)")
        if used.kind == "host":
            check_host_used(used.host, batch, cu_k.host if cu_k.kind == "host" and not paged
                            else None)
    lengths_q = np.diff(cu_q.host.astype(np.int64)) if cu_q.kind == "host" else None
    if used is not None:
        lengths_k = used.host.astype(np.int64) if used.kind == "host" else None
    else:
        lengths_k = np.diff(cu_k.host.astype(np.int64)) if cu_k.kind == "host" else None
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q)
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k)
    paging = None
    if paged:
        paging = _paged_table(block_table, batch, (num_pages, heads_kv, page_size, d), handle,
                              lengths_k, "seqused_k" if used is not None else "cu_seqlens_k")
    left, right = _window(causal, window_size, "bottom_right", "window_size")
    scale = check_scale(softmax_scale, d)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {type(return_lse).__name__}")

    if total_q:
        _geometry("q", views["q"], heads, total_q, d, builds.Q_BOX_ROWS)
    if paged:
        for name in ("k", "v"):
            tma.check_base(views[name].ptr, name)
            _paged_map_geometry(views[name], paging, heads_kv, d, build.block_n, name)
    elif total_k:
        for name in ("k", "v"):
            _geometry(name, views[name], heads_kv, total_k, d, build.block_n)
    out_view = None
    if out is not None:
        out_view = bf16_view("out", out, handle)
        check_out_view(out_view, views)
        if total_q:
            _geometry("out", out_view, heads, total_q, d, builds.Q_BOX_ROWS)
    return VarlenCall(q=views["q"], k=views["k"], v=views["v"], out=out_view, out_given=out,
                      total_q=total_q, heads=heads, head_dim=d, total_k=total_k,
                      heads_kv=heads_kv, batch=batch, cu_q=cu_q, cu_k=cu_k, seqused_k=used,
                      max_seqlen_q=max_q, max_seqlen_k=max_k, window=(left, right),
                      scale=scale, want_lse=return_lse, stream=handle,
                      stream_object=stream_object, torch=is_torch(q), build=build,
                      objects={"q": q, "k": k, "v": v}, paging=paging)


def _paged_dims(name: str, arr) -> tuple[int, int, int, int]:
    """(num_pages, page_size, Hkv, D) of a paged cache."""
    if len(arr.shape) != 4:
        raise ValueError(f"{name}: with block_table, expected a paged cache of rank 4 "
                         f"(num_pages, page_size, Hkv, D), got shape {tuple(arr.shape)}")
    return tuple(int(n) for n in arr.shape)


def _paged_table(block_table, batch: int, k_dims, handle: int, lengths_k, lengths_name: str):
    """block_table as decode_plan.Paging (decode's checks, the argument named k for this call);
    host lengths within the pages a row reaches, and a host table's reached entries within
    the pool."""
    try:
        paging = decode_paging(block_table, batch, k_dims, handle)
    except ValueError as e:
        raise ValueError(str(e).replace("k_cache:", "k:", 1)) from None
    if lengths_k is not None and lengths_k.size and int(lengths_k.max()) > paging.capacity:
        b = int(np.argmax(lengths_k))
        raise ValueError(f"{lengths_name}: sequence {b} has {int(lengths_k[b])} keys, more "
                         f"than its block_table row reaches ({paging.max_pages} pages of "
                         f"{paging.page_size} keys: {paging.capacity})")
    if paging.kind == "host":
        check_host_block_table(paging.host, lengths_k, paging)
    return paging


# --------------------------------------------------------------------------- the kernels

@functools.lru_cache(maxsize=1)
def tiles_source() -> str:
    from . import ptx
    return ptx.expand_file(ptx_root() / "sm90" / "production" / TILES_FILE,
                           [ptx_root() / "sm90" / "include"], {}).text


_TILES_FN: dict[int, driver.Function] = {}
_TILES_LOCK = threading.Lock()


def tiles_function() -> driver.Function:
    """varlen_tiles.ptx, JIT-compiled once per device, its shared memory opted in."""
    ctx = driver.context()
    fn = _TILES_FN.get(ctx.ordinal)
    if fn is None:
        with _TILES_LOCK:
            fn = _TILES_FN.get(ctx.ordinal)
            if fn is None:
                module = driver.load_module(tiles_source(), TILES_FILE)
                fn = module.function(TILES_ENTRY)
                fn.set_max_dynamic_smem(TILES_SMEM)
                _TILES_FN[ctx.ordinal] = fn
    return fn


def forward_build(head_dim: int, paged: bool = False):
    """The production kernel's varlen build for a head dim (the masked build's figures);
    paged: its build over a paged K/V cache (kv_paged.ptxh)."""
    return specialized(PRODUCTION, head_dim, True, True, paged)


class Launcher:
    """What a call's geometry fixes: both kernels, the tensor maps of q, k, v and the output
    (the output's per call unless out= is the same array), the packed parameters. run()
    re-fills the per-call addresses and enqueues the tile kernel, then the forward kernel."""

    def __init__(self, call: VarlenCall, sm_count: int):
        # the call's figures only: a Launcher is cached (_LAUNCHERS, a plan's) and must pin
        # none of the caller's memory
        self.call = detached(call)
        self.paging = paging = self.call.paging
        self.stage = forward_build(call.head_dim, paging is not None)
        self.forward_fn = launch.kernel(self.stage)
        self.tiles_fn = tiles_function()
        self.params = launch.params_of(self.stage)
        left, right = call.window_params
        d = call.head_dim
        cap = launch.persistent_ctas()
        self.grid = grid_of(call.max_entries, call.heads, sm_count if cap is None
                            else min(sm_count, cap))
        self.values = dict(
            seq_q=call.total_q, seq_k=call.total_k, heads=call.heads, batch=1,
            softmax_scale=call.scale, heads_per_kv=call.heads // call.heads_kv,
            diag_offset=0, window_left=left, window_right=right, total_q=call.total_q)
        if paging is not None:
            self.values.update(bt_row_stride=paging.row_stride, max_pages=paging.max_pages,
                               num_pages=paging.num_pages, page_shift=paging.page_shift)
        self.tiles_values = dict(
            batch=call.batch, total_q=call.total_q,
            total_k=PAGED_TOTAL_K if paging is not None else call.total_k,
            max_entries=call.max_entries, block_m=self.stage.block_m,
            block_n_shift=self.stage.block_n.bit_length() - 1, window_left=left,
            window_right=right, paged_keys=call.paged_keys)
        self.tiles_config = driver._launch_config((1, 1, 1), (TILES_THREADS, 1, 1), TILES_SMEM,
                                                  (1, 1, 1), call.stream)[0]
        self.forward_config = driver._launch_config(
            (self.grid, 1, 1), (self.stage.threads, 1, 1), self.stage.smem_bytes, (1, 1, 1),
            call.stream)[0]
        # each kernel's launch of its config (through ctypes where that is identical in
        # effect: driver.kernel_launch)
        self._tiles_launch = driver.kernel_launch(self.tiles_config, self.tiles_fn,
                                                  f"cuLaunchKernelEx ({TILES_ENTRY})")
        self._forward_launch = driver.kernel_launch(self.forward_config, self.forward_fn,
                                                    "cuLaunchKernelEx (ptxattn_fwd (varlen))")
        self.lock = threading.Lock()
        # Both kernels' parameters packed once into void*[] arrays of our own (_Packed): a
        # call rewrites its slots in place and passes the array's address, so the binding
        # packs nothing per call (its tuple form costs ~6-9 us a launch on the host)
        names = [p.name for p in self.params]
        maps = ("tmap_q", "tmap_k", "tmap_v", "tmap_o")
        self.words = FORWARD_WORDS + (PAGED_WORDS if paging is not None else ())
        self._forward = _Packed([self.values.get(n, 0) for n in names],
                                [p.ctype for p in self.params], maps, names,
                                words=self.words)
        # a call's writes: the four map entries (adjacent in the ABI) as one slice, the
        # per-call words as one slice of their array (FORWARD_WORDS' order)
        first = names.index(maps[0])
        if [names.index(n) for n in maps] != list(range(first, first + 4)):
            raise ValueError(f"{self.stage.name}: tmap_q..tmap_o are not adjacent parameters")
        self._forward_maps = slice(first, first + 4)
        self._forward_words = self._forward.words
        self._forward_word_index = tuple(names.index(n) for n in FORWARD_WORDS)   # frozen()'s
        self._o_rows = max(call.total_q, 1)
        tiles_names = [n for n, _ in TILES_PARAMS]
        self._tiles = _Packed([self.tiles_values.get(n, 0) for n in tiles_names],
                              [t for _, t in TILES_PARAMS], (), tiles_names)
        tiles_per_call = ("cu_q_ptr", "cu_k_ptr", "seqused_k_ptr", "table_ptr", "scratch_ptr",
                          "bounds_ptr")
        self._tiles_slots = self._tiles.holders_of(tiles_names, tiles_per_call)
        self._tiles_index = tuple(tiles_names.index(n) for n in tiles_per_call)
        self._scratch_offset = 16 + 16 * call.max_entries
        self._maps: dict = {}

    def _map(self, arr, heads: int, rows: int, box_rows: int, name: str):
        """The tensor map of one of q, k, v, out (a view) at its address."""
        return self._map_at(name, arr.ptr, tuple(arr.strides), arr.shape[0], heads, rows,
                            box_rows)

    def _map_at(self, name: str, ptr: int, strides: tuple, array_rows: int, heads: int,
                rows: int, box_rows: int):
        """The tensor map of an array of `array_rows` rows with these element strides at ptr
        (remembered per address and strides: a layer's activations come back at the same
        addresses step after step). The key holds everything the map encodes: a map of
        another row count would bound the box walk at the wrong row."""
        key = (name, ptr, strides, array_rows, heads, rows, box_rows)
        entry = self._maps.get(key)
        if entry is None:
            s_row, s_head, s_dim = (int(x) for x in strides)
            tmap = tma.encode_qkvo_map(ptr, "bshd", 1, heads, max(rows, 1),
                                       self.call.head_dim, box_rows, SWIZZLE_128B, TMA_CHUNK,
                                       (s_row * max(array_rows, 1), s_row, s_head, s_dim),
                                       name=name)
            # (the map, the address of its 128 bytes: what a launch's entry points at)
            entry = (tmap, int(tmap.getPtr()))
            if len(self._maps) >= 256:
                self._maps.pop(next(iter(self._maps)), None)
            self._maps[key] = entry
        return entry

    def run_tiles(self, workspace_ptr: int, cu_q_ptr: int, cu_k_ptr: int, seqused_ptr: int,
                  bounds_ptr: int) -> None:
        """Enqueue varlen_tiles.ptx: the table at workspace_ptr (its scratch after it)."""
        with self.lock:
            self._tiles_locked(workspace_ptr, cu_q_ptr, cu_k_ptr, seqused_ptr, bounds_ptr)

    def _tiles_locked(self, workspace_ptr, cu_q_ptr, cu_k_ptr, seqused_ptr, bounds_ptr):
        for holder, value in zip(self._tiles_slots, (
                cu_q_ptr, cu_k_ptr, seqused_ptr, workspace_ptr,
                workspace_ptr + self._scratch_offset, bounds_ptr)):
            holder.value = value
        self._tiles_launch(self._tiles.address)

    def run_forward(self, q, k, v, out, lse_ptr: int, table_ptr: int) -> None:
        """Enqueue the forward kernel's varlen build over the table at table_ptr. q, k, v and
        out: views of this geometry (their tensor maps are encoded once per address)."""
        maps = self._maps_of(q, k, v, out)
        with self.lock:
            self._forward_locked(maps, out.ptr, out.strides[0], out.strides[1], lse_ptr,
                                 table_ptr)

    def _maps_of(self, q, k, v, out) -> tuple:
        call = self.call
        if not call.total_k:
            # no key in the whole batch: every sequence has seq_k 0 and no row sees a key; k
            # and v may have no memory at all, so their maps get one row of q's (read as
            # zeros: the one K/V tile of such a sequence lies before row 0)
            k = v = q
        if self.paging is not None:
            kv = (self._paged_map(k, "k"), self._paged_map(v, "v"))
        else:
            kv = (self._map(k, call.heads_kv, call.total_k, self.stage.block_n, "k"),
                  self._map(v, call.heads_kv, call.total_k, self.stage.block_n, "v"))
        return (self._map(q, call.heads, call.total_q, builds.Q_BOX_ROWS, "q"), *kv,
                self._map(out, call.heads, call.total_q, builds.Q_BOX_ROWS, "out"))

    def _paged_map(self, arr, name: str):
        """The tensor map of a paged cache (num_pages, page_size, Hkv, D): (64 of D, row in
        the page, D / 64, K/V head, page), its box a tile (a page holds one) or a page of 64
        columns of D (kv_paged.ptxh), remembered per address and strides as _map_at's."""
        paging, d = self.paging, self.call.head_dim
        key = ("paged " + name, arr.ptr, tuple(arr.strides))
        entry = self._maps.get(key)
        if entry is None:
            rows, d_blocks = paging.map_box(d, self.stage.block_n)
            tmap = tma.encode_qkvo_map(arr.ptr, "bshd", paging.num_pages, self.call.heads_kv,
                                       paging.page_size, d, rows, SWIZZLE_128B, TMA_CHUNK,
                                       tuple(arr.strides), name=name, d_blocks=d_blocks)
            entry = (tmap, int(tmap.getPtr()))
            if len(self._maps) >= 256:
                self._maps.pop(next(iter(self._maps)), None)
            self._maps[key] = entry
        return entry

    def maps_at(self, q, k, v, out) -> tuple:
        """The four (map, address) pairs for (ptr, strides) pairs of arrays of this geometry
        (the plans' torch path: no views built). A map seen before is one dict lookup
        (_map_at's key)."""
        call = self.call
        if self.paging is not None:
            raise ValueError("a paged call's Launcher runs through run() (plans take packed "
                             "keys)")
        if not call.total_k:
            k = v = q                                           # as _maps_of
            k_rows = call.total_q
        else:
            k_rows = call.total_k
        get, heads, heads_kv = self._maps.get, call.heads, call.heads_kv
        tq, tk, bn, qb = call.total_q, call.total_k, self.stage.block_n, builds.Q_BOX_ROWS
        maps = []
        for key in (("q", q[0], q[1], tq, heads, tq, qb),
                    ("k", k[0], k[1], k_rows, heads_kv, tk, bn),
                    ("v", v[0], v[1], k_rows, heads_kv, tk, bn),
                    ("out", out[0], out[1], tq, heads, tq, qb)):
            entry = get(key)
            maps.append(entry if entry is not None else self._map_at(*key))
        return maps

    def _forward_locked(self, maps, out_ptr: int, o_row: int, o_head: int, lse_ptr: int,
                        table_ptr: int, paged_words: tuple = ()) -> None:
        q, k, v, o = maps
        self._forward.array[self._forward_maps] = (q[1], k[1], v[1], o[1])
        # self.words' order: FORWARD_WORDS, then (paged) PAGED_WORDS
        self._forward_words[:] = (out_ptr, o_row, o_head, o_row * self._o_rows, lse_ptr,
                                  table_ptr, *paged_words)
        # the maps stay referenced (maps) until the driver has copied their bytes
        self._forward_launch(self._forward.address)

    def run(self, q, k, v, out, lse_ptr: int, workspace_ptr: int, cu_q_ptr: int,
            cu_k_ptr: int, seqused_ptr: int, bounds_ptr: int,
            block_table_ptr: int = 0) -> None:
        """The call's two launches, in stream order: the table, then the attention (a paged
        call's reads the block table at block_table_ptr and reports into bounds_ptr too)."""
        if (self.paging is not None) != bool(block_table_ptr):
            raise ValueError("block_table_ptr: a paged Launcher's calls need one, and only "
                             "theirs")
        maps = self._maps_of(q, k, v, out)
        paged_words = (block_table_ptr, bounds_ptr) if self.paging is not None else ()
        with self.lock:
            self._tiles_locked(workspace_ptr, cu_q_ptr, cu_k_ptr, seqused_ptr, bounds_ptr)
            self._forward_locked(maps, out.ptr, out.strides[0], out.strides[1], lse_ptr,
                                 workspace_ptr, paged_words)

    def run_at(self, maps, out_ptr: int, o_row: int, o_head: int, lse_ptr: int,
               workspace_ptr: int, offsets: tuple | None) -> None:
        """run() from maps_at()'s maps and raw addresses: the tile kernel first when
        offsets (cu_q_ptr, cu_k_ptr, seqused_ptr) are given, else the forward kernel alone
        over the table at workspace_ptr."""
        with self.lock:
            if offsets is not None:
                self._tiles_locked(workspace_ptr, *offsets, 0)
            self._forward_locked(maps, out_ptr, o_row, o_head, lse_ptr, workspace_ptr)

    def frozen(self, maps, out_ptr: int, o_row: int, o_head: int, lse_ptr: int,
               workspace_ptr: int, offsets: tuple | None) -> tuple:
        """run_at's launches with these arguments fixed: each kernel's parameters copied into
        a void*[] of their own (fastlaunch.frozen_params) that nothing rewrites, so a call
        of them takes no lock and writes no slot. A tuple of zero-argument launches in
        stream order, each returning its CUresult (0: enqueued); they keep the maps."""
        launches = []
        if offsets is not None:
            values = (*offsets, workspace_ptr, workspace_ptr + self._scratch_offset, 0)
            slots = {i: type(h)(value) for i, h, value in zip(
                self._tiles_index, self._tiles_slots, values)}
            address, keep = fastlaunch.frozen_params(self._tiles.array, slots)
            launches.append(self._tiles_launch.frozen(address, keep))
        words = (out_ptr, o_row, o_head, o_row * self._o_rows, lse_ptr, workspace_ptr)
        slots = {i: ctypes.c_uint64(w) for i, w in zip(self._forward_word_index, words)}
        slots.update({self._forward_maps.start + j: m[1] for j, m in enumerate(maps)})
        address, keep = fastlaunch.frozen_params(self._forward.array, slots)
        launches.append(self._forward_launch.frozen(address, (keep, tuple(maps))))
        return tuple(launches)


# the forward kernel's parameters a call rewrites besides its maps, in _forward_locked's order
FORWARD_WORDS = ("o_ptr", "o_row_stride", "o_head_stride", "o_batch_stride", "lse_ptr",
                 "tiles_ptr")
PAGED_WORDS = ("block_table_ptr", "bounds_ptr")    # the paged build's (kv_paged.ptxh), after


class _Packed:
    """A kernel's parameters as a void*[] of our own (driver.pack_params' layout), built once:
    numbers sit in ctypes holders that a call rewrites in place, and the by-value tensor maps
    (`maps`, by name) are entries that a call points at a map's 128 bytes. Rewritten and
    launched under the Launcher's lock: the driver copies the bytes at cuLaunchKernelEx, so
    the next call may rewrite them."""

    _PLACEHOLDER = (ctypes.c_char * 128)()      # a map slot before its first call

    def __init__(self, values, types, maps, names, words=()):
        self.holders = []
        addresses = []
        # `words`: 8-byte parameters (pointers, u64) kept adjacent in one array, in that
        # order, so that a call rewrites them with one slice assignment
        if set(words) - set(names):
            raise ValueError(f"per-call words {sorted(set(words) - set(names))}: no such "
                             "parameter")
        self.words = (ctypes.c_uint64 * max(len(words), 1))()
        for name, value, ctype in zip(names, values, types):
            if name in words:
                if ctype is None or ctypes.sizeof(ctype) != 8:
                    raise ValueError(f"{name}: a per-call word must be an 8-byte parameter")
                i = words.index(name)
                self.words[i] = int(value or 0)
                self.holders.append(None)
                addresses.append(ctypes.addressof(self.words) + 8 * i)
            elif ctype is None:
                if name not in maps:
                    raise ValueError(f"{name}: a by-value parameter without a per-call map")
                self.holders.append(None)
                addresses.append(ctypes.addressof(self._PLACEHOLDER))
            else:
                held = ctype(value)
                self.holders.append(held)
                addresses.append(ctypes.addressof(held))
        self.array = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)
        self.address = ctypes.addressof(self.array)

    def holders_of(self, names, wanted) -> tuple:
        return tuple(self.holders[list(names).index(n)] for n in wanted)


def detached(call: VarlenCall) -> VarlenCall:
    """The call's shape fields without the caller's arrays and offsets (for what is kept)."""
    paging = call.paging
    if paging is not None:          # its geometry; the table itself is the call's
        paging = dataclasses.replace(paging, kind="device", ptr=0, host=None, owner=None)
    return dataclasses.replace(call, q=None, k=None, v=None, out=None, out_given=None,
                               cu_q=None, cu_k=None, seqused_k=None, stream_object=None,
                               objects={}, paging=paging)


# --------------------------------------------------------------------------- one call

def _empty(shape, dtype, call: VarlenCall):
    if call.torch:
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=call.objects["q"].device)
    return tensors.empty(shape, stream=call.stream, stream_owner=call.stream_object,
                         dtype=np.dtype(dtype) if dtype == "float32" else tensors.BF16)


def _ptr(x) -> int:
    return x.data_ptr() if hasattr(x, "data_ptr") else x.ptr


def _workspace(nbytes: int, call: VarlenCall):
    """The tile table's memory, fresh from the caller's allocator every call."""
    if call.torch:
        torch = sys.modules["torch"]
        return torch.empty((-(-nbytes // 4),), dtype=torch.int32,
                           device=call.objects["q"].device)
    return driver.DeviceBuffer(nbytes, stream=call.stream, stream_owner=call.stream_object)


def _device_offsets(off: Offsets | None, call: VarlenCall, keep: list) -> int:
    if off is None:
        return 0
    if off.kind == "device":
        return off.ptr
    buf = driver.DeviceBuffer(max(off.host.nbytes, 4), stream=call.stream,
                              stream_owner=call.stream_object)
    driver.memcpy_htod(buf.ptr, off.host, stream=call.stream)
    keep.append(buf)
    return buf.ptr


def _out_view(arr) -> DeviceArray:
    if isinstance(arr, DeviceArray):
        return arr
    return DeviceArray(arr.data_ptr(), tuple(arr.shape), tuple(arr.stride()),
                       device=arr.get_device(), owner=arr)


def _raise_if_out_of_bounds(buf, call: VarlenCall) -> None:
    report = np.zeros(BOUNDS_WORDS, np.int32)
    driver.memcpy_dtoh(report, buf.ptr, stream=call.stream)        # waits for the stream
    kind = int(report[0])
    if kind:
        name, index, value = BOUNDS_NAMES[kind], int(report[1]), int(report[2])
        reach = call.paged_keys
        rule = {1: f"offsets from 0, non-decreasing, ending at q's {call.total_q} rows",
                2: f"offsets from 0, non-decreasing, ending at k's {call.total_k} rows",
                3: "counts within each sequence's keys",
                4: f"a sequence's keys within its block_table row's {reach}",
                5: f"counts within a block_table row's {reach} keys"}[kind]
        what = "sequence" if kind in (4, 5) else "index"
        raise ValueError(f"{name}: on the device, {what} {index} holds {value}"
                         f"{' keys' if kind in (4, 5) else ''}, which breaks its contract "
                         f"({rule}; {CHECK_BOUNDS_ENV}=1; without it the kernels clamp every "
                         "offset into the tensors)")
    if report[4]:
        seq, page, entry = int(report[4]) - 1, int(report[5]), int(report[6])
        raise ValueError(f"block_table: on the device, sequence {seq}'s page {page} is entry "
                         f"{entry}, outside the cache's [0, {call.paging.num_pages}) pages "
                         f"({CHECK_BOUNDS_ENV}=1; without it the kernels read such a page as "
                         "zeros)")


def _handshake(call: VarlenCall) -> None:
    """Our DeviceArrays' pending writes on other streams are waited for (as attention())."""
    if call.torch:
        return
    for arr in (call.q, call.k, call.v, call.out):
        if arr is None:
            continue
        pending = arr.producer_stream if arr.producer_stream is not None else arr.stream
        if pending is not None and pending != call.stream:
            driver.stream_wait(call.stream, pending)
        arr.used_on(call.stream)


_LAUNCHERS: dict[tuple, Launcher] = {}
_LAUNCHERS_LOCK = threading.Lock()


def _launcher(call: VarlenCall) -> Launcher:
    ctx = driver.context()
    paging = call.paging
    key = (ctx.ordinal, call.stream, call.total_q, call.total_k, call.heads, call.heads_kv,
           call.head_dim, call.batch, call.window, call.scale,
           os.environ.get(launch.PERSISTENT_CTAS_ENV),
           None if paging is None else (paging.page_size, paging.num_pages, paging.max_pages,
                                        paging.row_stride))
    hit = _LAUNCHERS.get(key)
    if hit is None:
        hit = Launcher(call, ctx.sm_count)
        with _LAUNCHERS_LOCK:
            if len(_LAUNCHERS) >= 64:
                _LAUNCHERS.pop(next(iter(_LAUNCHERS)), None)
            _LAUNCHERS[key] = hit
    return hit


def run_call(call: VarlenCall, launcher: Launcher):
    """Fresh output, LSE and table; the two launches; the result in the caller's kind."""
    if call.out_given is not None:
        out, out_view = call.out_given, call.out
    else:
        out = _empty(call.out_shape, "bfloat16", call)
        out_view = _out_view(out)
    lse = _empty(call.lse_shape, "float32", call) if call.want_lse else None
    keep = []
    workspace = _workspace(call.workspace_bytes, call)
    bounds = None
    if check_bounds_requested():
        if _is_capturing(call.stream):
            raise RuntimeError(f"{CHECK_BOUNDS_ENV}=1 reads the kernel's report back on the "
                               "host, which a stream being captured cannot do")
        bounds = driver.DeviceBuffer(4 * BOUNDS_WORDS, stream=call.stream,
                                     stream_owner=call.stream_object)
        driver.memset_u8(bounds.ptr, 0, 4 * BOUNDS_WORDS, stream=call.stream)
    launcher.run(call.q, call.k, call.v, out_view, _ptr(lse) if lse is not None else 0,
                 _ptr(workspace), _device_offsets(call.cu_q, call, keep),
                 _device_offsets(call.cu_k, call, keep),
                 _device_offsets(call.seqused_k, call, keep),
                 bounds.ptr if bounds is not None else 0, _block_table_arg(call, keep))
    if not call.torch:
        for arr in (out, lse):
            if isinstance(arr, DeviceArray):
                arr.stream = call.stream
                arr.stream_owner = call.stream_object
    if bounds is not None:
        _raise_if_out_of_bounds(bounds, call)
    del keep, workspace                 # stream-ordered: freed after the launches
    return out, lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, window_size=(-1, -1), softmax_scale=None,
                           return_lse=False, seqused_k=None, block_table=None, *, out=None,
                           stream=None):
    """Attention over packed variable-length sequences (FlashAttention's API).

    q: (total_q, H, D) bf16; k, v: (total_k, Hkv, D) bf16, Hkv dividing H (GQA/MQA); D 64,
    128 or 256. cu_seqlens_q, cu_seqlens_k: int32 (B + 1) offsets (device arrays, or NumPy
    arrays checked and copied in); sequence b is q rows [cu_seqlens_q[b], cu_seqlens_q[b+1])
    against k/v rows from cu_seqlens_k[b], cu_seqlens_k[b + 1] - cu_seqlens_k[b] of them or
    seqused_k[b] (int32 (B)) when given; with block_table and seqused_k, cu_seqlens_k may be
    None (vLLM's call: the counts are seqused_k's). max_seqlen_q / max_seqlen_k: ints,
    checked against host offsets (the kernels size their work from the offsets on the device).
    causal: bottom-right per sequence (query i of Lq sees keys <= i + Lk - Lq);
    window_size=(left, right), -1 unbounded. softmax_scale defaults to 1 / sqrt(D).
    return_lse: also return the float32 (H, total_q) log-sum-exp (-inf for a query that sees
    no key, whose output is 0). Sequences may be empty. Rows of q past cu_seqlens_q[-1] are
    not written.
    block_table: int32 (B, max_pages) (device, or NumPy checked and copied in) with k, v a
    paged cache (num_pages, page_size, Hkv, D), page_size a power of two from 16 to 256:
    sequence b's key j is row j % page_size of page block_table[b, j // page_size], its count
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or seqused_k[b]) at most max_pages * page_size;
    entries past a sequence's last page are not read (-1 is fine). On the device, an entry
    outside [0, num_pages) reads as zeros (PTXATTN_CHECK_BOUNDS=1 reports it).
    Beyond FlashAttention's: out= (a bf16 array of q's shape), stream= (non-torch arrays).
    Device offsets are never read on the host: out-of-range or decreasing ones are clamped
    into the tensors by the kernels (no access leaves q, k, v or the output), and
    PTXATTN_CHECK_BOUNDS=1 reports them as a ValueError (it waits for the GPU).
    Returns out, or (out, lse): torch tensors for torch q, DeviceArrays otherwise.
    """
    call = validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    window_size, softmax_scale, return_lse, seqused_k, block_table, out=out,
                    stream=stream)
    if call.empty:
        out_arr = call.out_given if call.out_given is not None else _empty(
            call.out_shape, "bfloat16", call) if call.torch else DeviceArray(
            0, call.out_shape, device=call.q.device)
        if not return_lse:
            return out_arr
        lse = _empty(call.lse_shape, "float32", call) if call.torch else DeviceArray(
            0, call.lse_shape, device=call.q.device, dtype=F32)
        return out_arr, lse
    _handshake(call)
    result, lse = run_call(call, _launcher(call))
    return (result, lse) if return_lse else result
