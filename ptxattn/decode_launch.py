"""The decode kernels on the device: JIT, parameter tables, and one launch sequence per call.

Three kernels, each hand-written PTX under ptx/sm90/production/:
- ptxattn_append (decode_append.ptx): new keys/values into the caches, when the call has some;
- ptxattn_decode (decode.ptx): split-KV attention with packed GQA;
- ptxattn_combine (combine.ptx): the splits' partials into the output, when splits > 1.

Each kernel's parameters are one table here (name, ctypes type), in the PTX's order;
tests/test_decode_cpu.py checks every table against the .entry's parameter list. A Launcher
holds what does not change between calls of one shape (functions, tensor maps of the caches,
grids, parameters packed once) and re-packs per call only what does: q, the output, the
workspace, the LSE, the lengths pointer (or int), new keys' addresses, the bounds word. Caches
that move between calls (transformers' DynamicCache) are a rebind of the caches' slots (two
maps, cache_len, the append's cache pointers and strides), not a new Launcher.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

from . import driver, fastlaunch, tma
from .decode_builds import (APPEND_THREADS, COMBINE_THREADS, THREADS, DecodeBuild,
                            paged_variant)
from .stages import SWIZZLE_128B, ptx_root

KERNEL_DIR = Path("sm90") / "production"
DECODE_FILE, DECODE_ENTRY = "decode.ptx", "ptxattn_decode"
COMBINE_FILE, COMBINE_ENTRY = "combine.ptx", "ptxattn_combine"
APPEND_FILE, APPEND_ENTRY = "decode_append.ptx", "ptxattn_append"
TMA_CHUNK = 64                   # elements of D per innermost box dim (128-byte swizzle)
PDL_ENV = "PTXATTN_DECODE_PDL"   # 0: the combine launches plainly (a measurement knob)
COMBINE_ROWS_PER_CTA = COMBINE_THREADS // 32

MAP, PTR, U64, U32, S32, F32 = (driver.BY_VALUE, driver.PTR, driver.U64, driver.U32,
                                driver.S32, driver.F32)

# ---- the ABI: one table per kernel, in the .entry's order ---------------------------------
DECODE_PARAMS = (
    ("tmap_k", MAP), ("tmap_v", MAP),
    ("q_ptr", PTR), ("q_batch_stride", U64), ("q_row_stride", U64), ("q_head_stride", U64),
    ("o_ptr", PTR), ("o_batch_stride", U64), ("o_row_stride", U64), ("o_head_stride", U64),
    ("lse_ptr", PTR), ("ws_ptr", PTR), ("ws_lse_ptr", PTR), ("seqlens_ptr", PTR),
    ("bounds_ptr", PTR),
    ("seqlen_const", U32), ("seq_new", U32), ("cache_len", U32), ("seq_q", U32),
    ("heads", U32), ("heads_kv", U32), ("group", U32), ("batch", U32), ("m_tiles", U32),
    ("splits", U32), ("softmax_scale", F32), ("window_left", S32), ("window_right", S32),
)
COMBINE_PARAMS = (
    ("ws_ptr", PTR), ("ws_lse_ptr", PTR),
    ("o_ptr", PTR), ("o_batch_stride", U64), ("o_row_stride", U64), ("o_head_stride", U64),
    ("lse_ptr", PTR), ("rows", U32), ("seq_q", U32), ("heads", U32), ("splits", U32),
)
APPEND_PARAMS = (
    ("k_new", PTR), ("v_new", PTR),
    ("new_batch_stride", U64), ("new_row_stride", U64), ("new_head_stride", U64),
    ("k_cache", PTR), ("v_cache", PTR),
    ("cache_batch_stride", U64), ("cache_row_stride", U64), ("cache_head_stride", U64),
    ("seqlens_ptr", PTR), ("seqlen_const", U32), ("seq_new", U32), ("cache_len", U32),
    ("heads_kv", U32), ("chunks", U32), ("total", U32),
)
# The paged builds (PTXATTN_PAGED) take these after the rest (decode_kv_address.ptxh)
PAGED_DECODE_PARAMS = (
    ("block_table_ptr", PTR), ("bt_row_stride", U32), ("max_pages", U32), ("num_pages", U32),
    ("page_shift", U32),
)
PAGED_APPEND_PARAMS = (
    ("block_table_ptr", PTR), ("bt_row_stride", U32), ("num_pages", U32), ("page_shift", U32),
)
# What changes per call, by parameter name, in the order Launcher.run fills them (the rest is
# fixed by the Launcher's key); a paged build adds its block table's address
DECODE_PER_CALL = ("q_ptr", "o_ptr", "lse_ptr", "ws_ptr", "ws_lse_ptr", "seqlens_ptr",
                   "bounds_ptr", "seqlen_const")
COMBINE_PER_CALL = ("ws_ptr", "ws_lse_ptr", "o_ptr", "lse_ptr")
APPEND_PER_CALL = ("k_new", "v_new", "seqlens_ptr", "seqlen_const")
PAGED_PER_CALL = ("block_table_ptr",)


def decode_params(paged: bool = False):
    """The decode kernel's parameter table of one build."""
    return DECODE_PARAMS + (PAGED_DECODE_PARAMS if paged else ())


def append_params(paged: bool = False):
    """The append kernel's parameter table of one build."""
    return APPEND_PARAMS + (PAGED_APPEND_PARAMS if paged else ())


def kernel_path(file: str) -> Path:
    return ptx_root() / KERNEL_DIR / file


PAGED_DEFINE = "PTXATTN_PAGED"   # the paged-cache build of the decode and append kernels


def build_defines(head_dim: int, paged: bool = False, variant: str | None = None) -> dict:
    """The preprocessor defines of one build: the head dim's row of gen_decode.ptxh, the
    paged cache's K/V addressing (decode_kv_address.ptxh, decode_append.ptx) and, for the
    paged decode kernel, its variant's (decode_kv_paged.ptxh; None: today's, no define)."""
    out = {"HEAD_DIM": head_dim, **({PAGED_DEFINE: 1} if paged else {})}
    if paged and variant is not None:
        out.update(paged_variant(variant).defines)
    return out


@functools.lru_cache(maxsize=64)
def kernel_source(file: str, head_dim: int, paged: bool = False,
                  variant: str | None = None) -> str:
    """The expanded PTX of one kernel for one head dim (the build row of gen_decode.ptxh);
    variant: the paged decode kernel's (decode_builds.PAGED_VARIANTS)."""
    from . import ptx
    path = kernel_path(file)
    return ptx.expand_file(path, [ptx_root() / "sm90" / "include"],
                           build_defines(head_dim, paged, variant)).text


_FUNCTIONS: dict[tuple, driver.Function] = {}
_FUNCTIONS_LOCK = threading.RLock()


def function(file: str, entry: str, head_dim: int, smem_bytes: int = 0,
             paged: bool = False, variant: str | None = None) -> driver.Function:
    """The kernel, JIT-compiled once per (device, file, build), shared-memory opt-in done."""
    ctx = driver.context()
    defines = build_defines(head_dim, paged, variant)
    key = (ctx.ordinal, file, tuple(sorted(defines.items())))
    hit = _FUNCTIONS.get(key)
    if hit is not None:
        return hit
    with _FUNCTIONS_LOCK:
        if key not in _FUNCTIONS:
            label = file + "".join(f" -D{k}={v}" for k, v in defines.items())
            module = driver.load_module(kernel_source(file, head_dim, paged, variant), label)
            fn = module.function(entry)
            if smem_bytes:
                fn.set_max_dynamic_smem(smem_bytes)
            _FUNCTIONS[key] = fn
        return _FUNCTIONS[key]


class Pack:
    """One kernel's parameters packed once into a void*[] (driver.pack_params), with named
    slots that a call rewrites in place before its launch (under the Launcher's lock: the
    driver copies the values at cuLaunchKernelEx, so the next call may rewrite them)."""

    def __init__(self, table, values: dict, per_call: tuple[str, ...]):
        names = [name for name, _ in table]
        missing = set(names) ^ set(values)
        if missing:
            raise ValueError(f"kernel parameters: {sorted(missing)} missing or unknown")
        self.address, self.holders = driver.pack_params(
            ([values[n] for n in names], [ctype for _, ctype in table]))
        self.slot = {n: self.holders[i] for i, n in enumerate(names)}
        self.per_call = tuple(self.slot[n] for n in per_call)
        self.per_call_names = tuple(per_call)
        self._index = {n: i for i, n in enumerate(names)}

    def set_map(self, name: str, tmap) -> None:
        """Point a by-value tensor-map slot at another map's bytes (a rebind); the pack keeps
        the map alive until the next one replaces it."""
        i = self._index[name]
        self.holders[-1][i] = int(tmap.getPtr())        # holders[-1]: the void*[] itself
        self.slot[name] = tmap

    def fill(self, *values) -> None:
        """The per-call slots, in the order of the kernel's *_PER_CALL names."""
        for holder, value in zip(self.per_call, values):
            holder.value = value

    def frozen(self, *values) -> tuple[int, tuple]:
        """A copy of the packed array with the per-call slots (fill's order) holding these
        values, nothing shared that a later fill rewrites: (its address, what to keep
        alive: the copy, its holders, the maps and constants it points at)."""
        slots = {self._index[name]: type(holder)(value) for name, holder, value in zip(
            self.per_call_names, self.per_call, values)}
        address, keep = fastlaunch.frozen_params(self.holders[-1], slots)
        return address, (keep, tuple(self.slot.values()))


def binding_of(call) -> tuple:
    """What a Launcher's caches are bound to: (k_cache ptr, v_cache ptr, cache_len, k_cache
    strides, v_cache strides), element strides in the call's layout order."""
    return (call.k_cache.ptr, call.v_cache.ptr, call.cache_len,
            tuple(call.k_cache.strides), tuple(call.v_cache.strides))


class Launcher:
    """Everything of a call that its geometry fixes: functions, grids, packed parameters,
    and the caches' binding (their tensor maps, cache_len, the append's cache pointers and
    strides). `run` re-packs the per-call slots and enqueues the kernels in order (append,
    decode, combine) on one stream; given a binding (binding_of) other than the one it holds,
    it first rebinds the caches' slots to it (a transformers DynamicCache's step: new
    addresses, one position longer), so one Launcher serves every step of one geometry."""

    def __init__(self, call, stream: int, attention: bool = True):
        build: DecodeBuild = call.build
        self.build, self.stream = build, stream
        self.splits = call.splits
        self.rows = call.rows
        self.append = call.seq_new > 0
        self.paging = paging = call.paging
        self.paged = paged = paging is not None
        self.lock = threading.Lock()
        d = call.head_dim
        self.variant = paging.variant if paged else None
        self.decode_fn = function(DECODE_FILE, DECODE_ENTRY, d, build.smem_bytes, paged,
                                  self.variant) if attention else None
        self.combine_fn = function(COMBINE_FILE, COMBINE_ENTRY, d) \
            if attention and self.splits > 1 else None
        self.append_fn = function(APPEND_FILE, APPEND_ENTRY, d, 0, paged) \
            if self.append else None
        self.layout, self.batch, self.heads_kv, self.head_dim = (
            call.layout, call.batch, call.heads_kv, d)
        self.bound = binding_of(call)
        from .decode_plan import bytes_strides
        if self.append_fn is not None:
            self._pack_append(call, bytes_strides)
        if attention:
            self._pack_attention(call, bytes_strides)
        # each kernel's launch of its config (through ctypes where that is identical in
        # effect: driver.kernel_launch)
        self.launches = {name: driver.kernel_launch(getattr(self, name + "_config"), fn,
                                                    f"cuLaunchKernelEx (ptxattn_{name})")
                         for name, fn in (("append", self.append_fn), ("decode", self.decode_fn),
                                          ("combine", self.combine_fn)) if fn is not None}

    def _pack_attention(self, call, bytes_strides) -> None:
        build, stream, d = self.build, self.stream, call.head_dim
        paging = self.paging
        caches = (("k_cache", call.k_cache), ("v_cache", call.v_cache))
        if paging is None:
            maps = tuple(tma.encode_qkvo_map(arr.ptr, call.layout, call.batch, call.heads_kv,
                                             call.cache_len, d, build.block_n, SWIZZLE_128B,
                                             TMA_CHUNK, arr.strides, name=name)
                         for name, arr in caches)
        elif paged_variant(paging.variant).row_group:
            # (64 of D, 8 rows, D / 64, K/V head, row group of the pool); the box a page's (or
            # a tile's) rows over all of D (decode_kv_paged.ptxh)
            box_rows = min(paging.page_size, build.block_n)
            maps = tuple(tma.encode_tiled(arr.ptr, *tma.row_group_geometry(
                paging.num_pages, paging.page_size, call.heads_kv, d, box_rows,
                tuple(arr.strides), TMA_CHUNK, name), SWIZZLE_128B, name=name)
                for name, arr in caches)
        else:
            # (64 of D, row in the page, D / 64, K/V head, page) over all pages; the box a
            # tile (page >= tile) or a page of 64 columns of D (decode_kv_paged.ptxh)
            rows, d_blocks = paging.map_box(d, build.block_n)
            maps = tuple(tma.encode_qkvo_map(arr.ptr, "bshd", paging.num_pages, call.heads_kv,
                                             paging.page_size, d, rows, SWIZZLE_128B,
                                             TMA_CHUNK, arr.strides, name=name,
                                             d_blocks=d_blocks)
                         for name, arr in caches)
        self._maps = maps                            # the packs point at their bytes
        qs = bytes_strides(call.q, call.layout, "q")
        os_ = call.out_strides
        left, right = call.window_params
        self.decode_grid = call.m_tiles * self.splits * call.batch * call.heads_kv
        values = dict(
            tmap_k=maps[0], tmap_v=maps[1], q_ptr=0, q_batch_stride=qs[0], q_row_stride=qs[1],
            q_head_stride=qs[2], o_ptr=0, o_batch_stride=os_[0], o_row_stride=os_[1],
            o_head_stride=os_[2], lse_ptr=0, ws_ptr=0, ws_lse_ptr=0, seqlens_ptr=0,
            bounds_ptr=0, seqlen_const=0, seq_new=call.seq_new, cache_len=call.cache_len,
            seq_q=call.seq_q, heads=call.heads, heads_kv=call.heads_kv, group=call.group,
            batch=call.batch, m_tiles=call.m_tiles, splits=self.splits,
            softmax_scale=call.scale, window_left=left, window_right=right)
        if paging is not None:
            values.update(block_table_ptr=0, bt_row_stride=paging.row_stride,
                          max_pages=paging.max_pages, num_pages=paging.num_pages,
                          page_shift=paging.page_shift)
        self.decode = Pack(decode_params(self.paged), values,
                           DECODE_PER_CALL + (PAGED_PER_CALL if self.paged else ()))
        self.decode_config = driver._launch_config((self.decode_grid, 1, 1), (THREADS, 1, 1),
                                                   build.smem_bytes, (1, 1, 1), stream)[0]
        if self.combine_fn is not None:
            self.combine = Pack(COMBINE_PARAMS, dict(
                ws_ptr=0, ws_lse_ptr=0, o_ptr=0, o_batch_stride=os_[0], o_row_stride=os_[1],
                o_head_stride=os_[2], lse_ptr=0, rows=call.rows, seq_q=call.seq_q,
                heads=call.heads, splits=self.splits), COMBINE_PER_CALL)
            grid = -(-call.rows // COMBINE_ROWS_PER_CTA)
            if programmatic_combine():
                self.combine_config, self._combine_attrs = _dependent_config(
                    (grid, 1, 1), (COMBINE_THREADS, 1, 1), stream)
            else:
                self.combine_config = driver._launch_config(
                    (grid, 1, 1), (COMBINE_THREADS, 1, 1), 0, (1, 1, 1), stream)[0]

    def _pack_append(self, call, bytes_strides) -> None:
        ns = bytes_strides(call.k_new, call.layout, "k")
        cs = bytes_strides(call.k_cache, call.layout, "k_cache")
        chunks = call.head_dim // 8
        total = call.batch * call.seq_new * call.heads_kv * chunks
        values = dict(
            k_new=0, v_new=0, new_batch_stride=ns[0], new_row_stride=ns[1],
            new_head_stride=ns[2], k_cache=call.k_cache.ptr, v_cache=call.v_cache.ptr,
            cache_batch_stride=cs[0], cache_row_stride=cs[1], cache_head_stride=cs[2],
            seqlens_ptr=0, seqlen_const=0, seq_new=call.seq_new, cache_len=call.cache_len,
            heads_kv=call.heads_kv, chunks=chunks, total=total)
        if self.paging is not None:
            values.update(block_table_ptr=0, bt_row_stride=self.paging.row_stride,
                          num_pages=self.paging.num_pages, page_shift=self.paging.page_shift)
        self.append_pack = Pack(append_params(self.paged), values,
                                APPEND_PER_CALL + (PAGED_PER_CALL if self.paged else ()))
        grid = -(-total // APPEND_THREADS)
        self.append_config = driver._launch_config((grid, 1, 1), (APPEND_THREADS, 1, 1), 0,
                                                   (1, 1, 1), self.stream)[0]

    def rebind(self, binding: tuple) -> None:
        """The caches' slots for another binding (binding_of's tuple, already validated by
        the caller): the decode kernel's two maps (encoded afresh and not remembered: a moving
        cache's addresses never come back, tma.encode_qkvo_map_once) and cache_len, the
        append's cache pointers, strides and cache_len. Call under self.lock. A paged
        Launcher's binding is its key's (pools do not move): it is not rebound."""
        if self.paged:
            raise ValueError("a paged Launcher's caches are fixed by its key")
        k_ptr, v_ptr, cache_len, k_strides, v_strides = binding
        if self.decode_fn is not None:
            p = self.decode
            geometry = (self.layout, self.batch, self.heads_kv, cache_len, self.head_dim,
                        self.build.block_n)
            shared = tma.geometry_once(*geometry, TMA_CHUNK, k_strides, "k_cache") \
                if k_strides == v_strides else None          # one shape: one geometry
            for name, ptr, strides in (("tmap_k", k_ptr, k_strides),
                                       ("tmap_v", v_ptr, v_strides)):
                p.set_map(name, tma.encode_qkvo_map_once(
                    ptr, *geometry, SWIZZLE_128B, TMA_CHUNK, strides,
                    name=name[-1] + "_cache", geometry=shared))
            p.slot["cache_len"].value = cache_len
        if self.append_fn is not None:
            slot = self.append_pack.slot
            shape = tma.layout_shape(self.layout, self.batch, self.heads_kv, cache_len,
                                     self.head_dim)
            b, h, r, _ = tma.bhl_strides(self.layout, shape, k_strides, "k_cache")
            for name, value in (("k_cache", k_ptr), ("v_cache", v_ptr),
                                ("cache_batch_stride", 2 * b), ("cache_row_stride", 2 * r),
                                ("cache_head_stride", 2 * h), ("cache_len", cache_len)):
                slot[name].value = value
        self.bound = binding

    def run(self, q_ptr: int, out_ptr: int, lse_ptr: int, ws_ptr: int, seqlens_ptr: int,
            seqlen_const: int, k_new_ptr: int = 0, v_new_ptr: int = 0,
            bounds_ptr: int = 0, block_table_ptr: int = 0, binding: tuple | None = None) -> None:
        """Enqueue the call's kernels. With splits > 1 the decode kernel writes the workspace
        (partials at ws_ptr, LSEs after them) and the combine writes out_ptr and lse_ptr. A
        paged Launcher's kernels read the block table at block_table_ptr. binding: the
        caches this call reads (binding_of; None: the ones it holds); a Launcher shared
        between calls gets theirs on every run, so a rebind by one is never another's."""
        split = self.splits > 1
        ws_lse = ws_ptr + 4 * self.splits * self.rows * self.build.head_dim if split else 0
        launch = self.launches
        with self.lock:
            if binding is not None and binding != self.bound:
                self.rebind(binding)
            if self.append_fn is not None:
                p = self.append_pack
                p.fill(k_new_ptr, v_new_ptr, seqlens_ptr, seqlen_const, block_table_ptr)
                launch["append"](p.address)
            if self.decode_fn is None:
                return
            p = self.decode
            p.fill(q_ptr, 0 if split else out_ptr, 0 if split else lse_ptr,
                   ws_ptr if split else 0, ws_lse, seqlens_ptr, bounds_ptr, seqlen_const,
                   block_table_ptr)
            launch["decode"](p.address)
            if split:
                p = self.combine
                p.fill(ws_ptr, ws_lse, out_ptr, lse_ptr)
                launch["combine"](p.address)

    def frozen(self, q_ptr: int, out_ptr: int, lse_ptr: int, ws_ptr: int, seqlens_ptr: int,
               seqlen_const: int, k_new_ptr: int = 0, v_new_ptr: int = 0,
               bounds_ptr: int = 0, block_table_ptr: int = 0,
               binding: tuple | None = None) -> tuple:
        """run()'s launches with these arguments fixed (each kernel's parameters copied:
        Pack.frozen), so that calling them takes no lock and rewrites no slot: zero-argument
        launches in stream order, each returning its CUresult (0: enqueued). binding: the
        caches they read, as run's (None: the ones held now); a later rebind does not reach
        them (they keep the maps they point at)."""
        split = self.splits > 1
        ws_lse = ws_ptr + 4 * self.splits * self.rows * self.build.head_dim if split else 0
        launches = []
        with self.lock:
            if binding is not None and binding != self.bound:
                self.rebind(binding)
            if self.append_fn is not None:
                launches.append(self.launches["append"].frozen(*self.append_pack.frozen(
                    k_new_ptr, v_new_ptr, seqlens_ptr, seqlen_const, block_table_ptr)))
            if self.decode_fn is not None:
                launches.append(self.launches["decode"].frozen(*self.decode.frozen(
                    q_ptr, 0 if split else out_ptr, 0 if split else lse_ptr,
                    ws_ptr if split else 0, ws_lse, seqlens_ptr, bounds_ptr, seqlen_const,
                    block_table_ptr)))
                if split:
                    launches.append(self.launches["combine"].frozen(*self.combine.frozen(
                        ws_ptr, ws_lse, out_ptr, lse_ptr)))
        return tuple(launches)


def programmatic_combine() -> bool:
    """Whether the combine goes as the decode grid's programmatic dependent launch (default;
    PTXATTN_DECODE_PDL=0 launches it plainly: a measurement knob)."""
    return os.environ.get(PDL_ENV, "1").strip() != "0"


def _dependent_config(grid, block, stream: int):
    """A CUlaunchConfig with programmatic stream serialization: the kernel may launch before
    the previous one in the stream completes (it waits in griddepcontrol.wait)."""
    d = driver.cu()
    config = d.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = 0
    config.hStream = d.CUstream(stream)
    attr = d.CUlaunchAttribute()
    attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    attrs = [attr]
    config.attrs = attrs
    config.numAttrs = 1
    return config, attrs

