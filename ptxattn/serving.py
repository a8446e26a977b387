"""A plan/run split for serving engines (in the spirit of FlashInfer's wrappers).

An engine runs every layer of a model step with the same batch layout: the same sequences,
offsets, lengths and block table; only the layer's activations and caches differ. A plan does
the host work once per layout, and each layer's run() is one launch sequence with a few
microseconds of host time and no validation beyond what changes between layers:

    prefill = ptxattn.plan_varlen(cu_q_host, cu_k_host, heads=32, heads_kv=8, head_dim=128,
                                  causal=True)
    for layer in layers:
        out = prefill.run(q, k, v)                       # one launch: the forward kernel

    step = ptxattn.plan_decode(batch=64, heads=32, heads_kv=8, head_dim=128,
                               cache_seqlens=lengths, block_table=table, page_size=16,
                               num_pages=pages, host_lengths=lengths_host)
    for layer in layers:
        out = step.run(q, k_cache[layer], v_cache[layer], k=k_new, v=v_new)

What a plan decides, once:
- prefill (PrefillPlan): with host copies of the offsets, the tile table (varlen_plan.
  tile_table: the blocks of every sequence, longest first) is built on the host and uploaded
  into a buffer the plan owns; run() is then the forward kernel alone. With device offsets
  only, run() launches the tile kernel first (two launches, still no host sync). The launch
  geometry and the workspace size either way.
- decode (DecodePlan): the split count, from the host lengths when given (the longest
  sequence's tiles, not the cache's capacity), else from the capacity; the lengths and block
  table the kernels read (device arrays, read on the device at every run; host copies are
  uploaded once into buffers the plan owns). A Launcher per layer's caches (their tensor maps
  and packed parameters), built at a layer's first run.
A plan keeps figures, not the first layer's arrays: a PrefillPlan's runs are checked against
the shapes and strides it was validated with, and a run of plain torch tensors builds no
views (their addresses; what the transformers integration runs per layer).
A plan holds only read-only device state (its table, its copies of lengths and block table);
per-call memory (outputs, LSE, split-KV workspace) comes fresh from the caller's allocator
every run, so runs can be in flight together and a run can be captured in a CUDA graph. Re-plan
when the layout changes: a plan built from host copies does not follow a device array the
engine rewrites afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np

from . import decode, driver, replay, tensors, torch_runs, varlen
from .decode_builds import build_for, paged_variant
from .decode_plan import (MAX_SPLITS, Paging, check_host_block_table, check_host_lengths,
                          check_out_view, choose_splits, m_tiles_of, overlaps,
                          scaled_paged_splits)
from .device_args import foreign, host_int32
from .varlen_plan import table_bytes, tile_table, window_params


def _upload(values: np.ndarray) -> driver.DeviceBuffer:
    """A plan-owned device copy of host int32 data (read-only for the kernels)."""
    buf = driver.DeviceBuffer(max(values.nbytes, 4))
    driver.memcpy_htod(buf.ptr, np.ascontiguousarray(values))
    return buf


class _Int32View:
    """A plan-owned int32 device array offered through __cuda_array_interface__."""

    def __init__(self, values: np.ndarray):
        self.values = np.ascontiguousarray(values, np.int32)
        self.buffer = _upload(self.values)
        self.__cuda_array_interface__ = {"shape": self.values.shape, "typestr": "<i4",
                                         "data": (self.buffer.ptr, False), "strides": None,
                                         "version": 3}


# --------------------------------------------------------------------------- prefill

class PrefillPlan:
    """flash_attn_varlen_func's host work for one batch layout; run(q, k, v) per layer."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, *, heads: int, heads_kv: int,
                 head_dim: int, total_q: int | None = None, total_k: int | None = None,
                 max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                 causal: bool = False, window_size=(-1, -1), softmax_scale=None,
                 return_lse: bool = False, seqused_k=None):
        self.heads, self.heads_kv, self.head_dim = int(heads), int(heads_kv), int(head_dim)
        self.causal, self.window_size = causal, tuple(window_size)
        self.softmax_scale, self.return_lse = softmax_scale, return_lse
        hq, hk = host_int32("cu_seqlens_q", cu_seqlens_q), host_int32("cu_seqlens_k",
                                                                      cu_seqlens_k)
        hu = host_int32("seqused_k", seqused_k) if seqused_k is not None else None
        self.host = hq is not None and hk is not None and (seqused_k is None or hu is not None)
        if total_q is None or total_k is None:
            if hq is None or hk is None:
                raise ValueError("total_q, total_k: needed with device offsets (the tensors' "
                                 "rows at run)")
            total_q = int(hq[-1]) if total_q is None else total_q
            total_k = int(hk[-1]) if total_k is None else total_k
        self.total_q, self.total_k = int(total_q), int(total_k)
        lens_q = np.diff(hq.astype(np.int64)) if hq is not None else None
        lens_k = (hu.astype(np.int64) if hu is not None else
                  np.diff(hk.astype(np.int64)) if hk is not None else None)
        self.max_seqlen_q = int(max_seqlen_q if max_seqlen_q is not None else
                                (lens_q.max(initial=0) if lens_q is not None else self.total_q))
        self.max_seqlen_k = int(max_seqlen_k if max_seqlen_k is not None else
                                (lens_k.max(initial=0) if lens_k is not None else self.total_k))
        # the offsets the kernels read: the caller's device arrays, or plan-owned copies
        self._owned = []
        self.cu_q = cu_seqlens_q if hq is None else self._own(hq)
        self.cu_k = cu_seqlens_k if hk is None else self._own(hk)
        self.seqused_k = seqused_k if (seqused_k is None or hu is None) else self._own(hu)
        self._host = (hq, hk, hu)
        self._table = None                      # plan-owned table (host offsets)
        self._call = None                       # the first run's validated call
        self._launcher = None
        self._torch_geometry = None             # the torch runs' figures (_run_at's)
        self._steady = None                     # torch_runs.prefill_run's, once validated
        self._frozen: dict = {}                 # addresses -> the Launcher's frozen launches

    def _own(self, values):
        view = _Int32View(values)
        self._owned.append(view)
        return view

    def _first_run(self, q, k, v, out):
        """Validate the layout against the first layer's arrays (padded buffers allowed), build
        the Launcher and, from host offsets, the table."""
        call = varlen.validate(q, k, v, self._host[0] if self.host else self.cu_q,
                               self._host[1] if self.host else self.cu_k, self.max_seqlen_q,
                               self.max_seqlen_k, self.causal, self.window_size,
                               self.softmax_scale, self.return_lse,
                               self._host[2] if self.host else self.seqused_k, out=out,
                               padded_ok=True)
        if (call.heads, call.heads_kv, call.head_dim) != (self.heads, self.heads_kv,
                                                          self.head_dim):
            raise ValueError(f"q: expected heads {self.heads}, K/V heads {self.heads_kv} and "
                             f"head dim {self.head_dim} (the plan's), got {call.heads}, "
                             f"{call.heads_kv}, {call.head_dim}")
        self._launcher = varlen.Launcher(call, driver.context().sm_count)
        if self.host:
            stage = self._launcher.stage
            table = tile_table(self._host[0], self._host[1], self._host[2], call.total_q,
                               call.total_k, stage.block_m, stage.block_n,
                               window_params(call.window), call.max_entries)
            self._table = _upload(table_bytes(table, call.max_entries))
            self.entries = len(table)
        else:
            # device offsets: the tile kernel reads them at every run
            self._offset_ptrs = (call.cu_q.ptr, call.cu_k.ptr,
                                 call.seqused_k.ptr if call.seqused_k is not None else 0)
        # what later runs are checked against (the Launcher's figures and maps were built
        # for these shapes and strides): kept as figures, so that the plan pins none of the
        # first layer's arrays
        self._geometry = {name: None if arr is None else (tuple(arr.shape), tuple(arr.strides))
                          for name, arr in (("q", call.q), ("k", call.k), ("v", call.v),
                                            ("out", call.out))}
        if call.torch:
            # torch tensors of later runs: these shapes, strides, device and stream; the
            # output torch.empty's or a caller's of the same (contiguous) strides
            out_strides = tensors.contiguous_strides(call.out_shape)
            shapes = tuple(x for name in ("q", "k", "v") for x in self._geometry[name])
            # the byte extents of q, k, v and such an output about their base addresses: a
            # caller's out= is checked against the inputs with these, per call only additions
            self._extents = tuple(tensors._span(0, *self._geometry[name], 2)
                                  for name in ("q", "k", "v")) + (
                tensors._span(0, tuple(call.out_shape), tuple(out_strides), 2),)
            self._torch_geometry = (
                shapes, call.q.device, call.stream,
                # what _run_at reads, worked out once
                (out_strides[0], out_strides[1]), tuple(out_strides), call.out_shape,
                call.lse_shape if call.want_lse else None, -(-call.workspace_bytes // 4))
            types = tensors._torch_types()
            if types is not None:
                g = self._torch_geometry
                # (shape, strides) of q, k, v and of an output (contiguous, q's shape)
                checked = tuple(self._geometry[n] for n in ("q", "k", "v")) + (
                    (tuple(call.out_shape), tuple(out_strides)),)
                self._steady = torch_runs.prefill_run(
                    types, g[1], g[2], checked, g[6], g[7],
                    self._table.ptr if self._table is not None else None, self._frozen,
                    self._freeze_checked)
        self._call = dataclasses.replace(varlen.detached(call),
                                         stream_object=call.stream_object)

    def run(self, q, k, v, out=None):
        """One layer: out (q's shape; fresh from the caller's allocator unless given), or
        (out, lse) when the plan returns the LSE. One launch with host offsets, two without."""
        steady = self._steady
        if steady is not None:
            result = steady(q, k, v, out)
            if result is not None:
                return result
        call = self._call
        if call is None:
            self._first_run(q, k, v, out)
            call = self._call
        qv, kv, vv, ov_given = _varlen_views(call, self._geometry, q, k, v, out)
        if ov_given is None:
            out = _empty(call, q, call.out_shape, "bfloat16")
            ov = varlen._out_view(out)
        else:
            ov = ov_given
        lse = _empty(call, q, call.lse_shape, "float32") if call.want_lse else None
        lse_ptr = varlen._ptr(lse) if lse is not None else 0
        ln = self._launcher
        if self._table is not None:
            ln.run_forward(qv, kv, vv, ov, lse_ptr, self._table.ptr)
        else:
            ws = _workspace(call, q)
            ln.run(qv, kv, vv, ov, lse_ptr, varlen._ptr(ws), *self._offset_ptrs, 0)
            del ws                           # stream-ordered (or torch's caching allocator)
        return (out, lse) if call.want_lse else out

    def _freeze_checked(self, key: tuple):
        """The steady run's freeze (torch_runs.prefill_run): the launches of a key's addresses
        when its q, k, v and output bases are 16-byte aligned and the output overlaps no input
        (what _varlen_views checks; None otherwise: the full path raises)."""
        q_ptr, k_ptr, v_ptr, out_ptr = key[:4]
        if (q_ptr | k_ptr | v_ptr | out_ptr) % 16 or _aliases(out_ptr, key[:3], self._extents):
            return None
        return self._freeze(key)

    def _run_at(self, like, q_ptr: int, k_ptr: int, v_ptr: int, out=None, out_ptr: int = 0):
        """One layer from the addresses of torch tensors that have the plan's shapes and
        strides, on its device and torch's current stream there, 16-byte aligned: what
        the steady run checks, which a caller of this must have checked (the transformers
        integration, which keys its layouts on exactly these: nothing here validates the
        addresses, so this is no public entry). `like`: a plain bf16 torch.Tensor on the
        plan's device (q: fresh tensors are its new_empty, torch.empty without the device
        and dtype arguments to parse). The output is `out` (checked as the steady run checks
        it) or fresh;
        LSE and workspace fresh from torch's allocator (stream-ordered); then the launches.
        out_ptr: a given out's address (its data_ptr() when 0)."""
        geometry = self._torch_geometry
        if out is None:
            out = like.new_empty(geometry[5])
            out_ptr = out.data_ptr()
        elif not out_ptr:
            out_ptr = out.data_ptr()
        lse = lse_ptr = ws = None
        if geometry[6] is not None:
            lse = like.new_empty(geometry[6], dtype=sys.modules["torch"].float32)
            lse_ptr = lse.data_ptr()
        if self._table is not None:
            ws_ptr = self._table.ptr
        else:
            ws = like.new_empty((geometry[7],), dtype=sys.modules["torch"].int32)
            ws_ptr = ws.data_ptr()
        # the launches of these addresses, frozen at their first call: the caching
        # allocator hands a layer's tensors the same few addresses call after call
        key = (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, ws_ptr)
        launches = self._frozen.get(key)
        if launches is None:
            launches = self._freeze(key)
        driver.launch_frozen(launches)
        del ws                               # torch's caching allocator: stream-ordered
        return (out, lse) if lse is not None else out

    def _freeze(self, key: tuple) -> tuple:
        """The Launcher's frozen launches for _run_at's addresses, remembered under key."""
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, ws_ptr = key
        geometry, ln = self._torch_geometry, self._launcher
        shapes, (o_row, o_head), out_strides = geometry[0], geometry[3], geometry[4]
        maps = ln.maps_at((q_ptr, shapes[1]), (k_ptr, shapes[3]), (v_ptr, shapes[5]),
                          (out_ptr, out_strides))
        launches = replay.frozen(ln.frozen(
            maps, out_ptr, o_row, o_head, lse_ptr or 0, ws_ptr,
            None if self._table is not None else self._offset_ptrs))
        _remember(self._frozen, key, launches)
        return launches

    @property
    def _torch_layout(self):
        """((q shape, q strides, k shape, k strides, v shape, v strides), device index,
        stream) of the runs _run_at takes, once a first run of torch tensors without out=
        has fixed them; else None."""
        g = self._torch_geometry
        return None if g is None else g[:3]


# frozen launches a plan keeps per layer of addresses (the oldest dropped past this): a
# model's layers reuse a few allocator blocks, so a handful are live at a time
FROZEN_PER_PLAN = 64


def _remember(cache: dict, key, launches) -> None:
    """Insert into a plan's bounded cache of frozen launches (plain dict order: oldest first)."""
    if len(cache) >= FROZEN_PER_PLAN:
        cache.pop(next(iter(cache), None), None)
    cache[key] = launches


def _aliases(out_ptr: int, input_ptrs: tuple, extents: tuple) -> bool:
    """Whether an output at out_ptr overlaps any input at input_ptrs, from their byte extents
    about their bases (PrefillPlan._extents: the inputs', then the output's), as
    decode_plan.overlaps decides it for views."""
    o_lo, o_hi = extents[-1]
    lo, hi = out_ptr + o_lo, out_ptr + o_hi
    for ptr, (a, b) in zip(input_ptrs, extents):
        if ptr + a < hi and lo < ptr + b:
            return True
    return False


def _empty(call, q, shape, dtype: str):
    """A run's output or LSE from the caller's allocator (varlen._empty's, on q's device: the
    plan keeps no array to read it from)."""
    if call.torch:
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=getattr(torch, dtype), device=q.device)
    return tensors.empty(shape, stream=call.stream, stream_owner=call.stream_object,
                         dtype=np.dtype(np.float32) if dtype == "float32" else tensors.BF16)


def _workspace(call, q):
    """A run's tile table and scratch (varlen._workspace's, on q's device)."""
    if call.torch:
        torch = sys.modules["torch"]
        return torch.empty((-(-call.workspace_bytes // 4),), dtype=torch.int32,
                           device=q.device)
    return driver.DeviceBuffer(call.workspace_bytes, stream=call.stream,
                               stream_owner=call.stream_object)


def _varlen_views(call, geometry: dict, q, k, v, out):
    """The run's arrays as views, checked against the plan's geometry (shapes and strides:
    what the Launcher's figures and maps were built for; an out= of any strides when the
    first run had none)."""
    stream = call.stream
    views = []
    for name, obj in (("q", q), ("k", k), ("v", v), ("out", out)):
        if obj is None:
            views.append(None)
            continue
        arr = tensors.as_device_array(obj, name=name, stream=stream)
        like = geometry[name]
        ref_shape = like[0] if like is not None else geometry["q"][0]
        ref_strides = like[1] if like is not None else None
        if tuple(arr.shape) != tuple(ref_shape) or (ref_strides is not None and
                                                    tuple(arr.strides) != tuple(ref_strides)):
            raise ValueError(f"{name}: shape {tuple(arr.shape)} strides {tuple(arr.strides)}, "
                             f"but the plan was run with {tuple(ref_shape)} {ref_strides}: "
                             "plan again for another geometry")
        if arr.ptr % 16:
            raise ValueError(f"{name}: base address 0x{arr.ptr:x} is not 16-byte aligned")
        views.append(arr)
    if views[3] is not None:
        # a later run's out is checked as the first run's was (it may alias this run's inputs)
        check_out_view(views[3], dict(zip(("q", "k", "v"), views[:3])))
    return views


# --------------------------------------------------------------------------- decode

class DecodePlan:
    """flash_attn_with_kvcache's host work for one batch layout (a decode step of every layer,
    the same lengths and block table); run(q, k_cache, v_cache, k=, v=) per layer."""

    def __init__(self, *, batch: int, heads: int, heads_kv: int, head_dim: int,
                 seq_q: int = 1, cache_seqlens=None, block_table=None,
                 page_size: int | None = None, num_pages: int | None = None,
                 cache_len: int | None = None, seq_new: int = 0, causal: bool = False,
                 window_size=(-1, -1), softmax_scale=None, return_lse: bool = False,
                 num_splits: int = 0, host_lengths=None, sm_count: int | None = None):
        self.batch, self.heads, self.heads_kv = int(batch), int(heads), int(heads_kv)
        self.head_dim, self.seq_q, self.seq_new = int(head_dim), int(seq_q), int(seq_new)
        self.causal, self.window_size = causal, tuple(window_size)
        self.softmax_scale, self.return_lse = softmax_scale, return_lse
        build = build_for(self.head_dim)
        self._owned = []
        host_table = host_int32("block_table", block_table) if block_table is not None else None
        if block_table is not None:
            if page_size is None or num_pages is None:
                raise ValueError("page_size, num_pages: needed with a block table")
            max_pages = (host_table.shape[1] if host_table is not None
                         else _int32_shape("block_table", block_table)[1])
            capacity = max_pages * int(page_size)
        else:
            if cache_len is None:
                raise ValueError("cache_len: needed without a block table (the cache's Lmax)")
            capacity = int(cache_len)
        self.capacity = capacity
        lengths_host = host_int32("host_lengths", host_lengths) if host_lengths is not None \
            else None
        dev_lengths = cache_seqlens
        h = host_int32("cache_seqlens", cache_seqlens) if cache_seqlens is not None else None
        if h is not None:                    # host lengths given as cache_seqlens: ours to copy
            lengths_host = h if lengths_host is None else lengths_host
            dev_lengths = self._own(h)
        if lengths_host is not None:
            check_host_lengths(lengths_host.astype(np.int64), self.batch, capacity, self.seq_new)
        if host_table is not None:
            paging = Paging("host", page_size=int(page_size), num_pages=int(num_pages),
                            max_pages=host_table.shape[1])
            reach = (None if lengths_host is None
                     else lengths_host.astype(np.int64) + self.seq_new)
            check_host_block_table(host_table, reach, paging)
            block_table = self._own(host_table)
        self.cache_seqlens, self.block_table = dev_lengths, block_table
        # the split count: from the longest sequence when the lengths are known here
        longest = capacity if lengths_host is None else min(
            capacity, int(lengths_host.max(initial=0)) + self.seq_new)
        if num_splits:
            self.splits = max(1, min(int(num_splits), MAX_SPLITS,
                                     -(-max(longest, 1) // build.block_n)))
        else:
            sms = sm_count if sm_count is not None else driver.context().sm_count
            self.splits = choose_splits(self.batch, self.heads_kv,
                                        m_tiles_of(self.heads // self.heads_kv, self.seq_q),
                                        max(longest, 1), build.block_n, sms, build.ctas_per_sm)
            if block_table is not None:      # the paged variant's factor (PAGED_VARIANTS)
                self.splits = scaled_paged_splits(
                    self.splits, Paging("device", page_size=int(page_size), num_pages=1,
                                        max_pages=1, variant=paged_variant().name),
                    build.block_n, -(-max(longest, 1) // build.block_n))
        self._layers: dict = {}
        # torch runs: the layers' geometry once a first torch layer fixed it (_TorchDecode),
        # and per layer of caches its Launcher's frozen launches (the steady run's)
        self._torch: _TorchDecode | None = None
        self._torch_layers: dict = {}
        self._steady = None                  # torch_runs.decode_run's, once learned

    def _own(self, values):
        view = _Int32View(values)
        self._owned.append(view)
        return view

    def _layer(self, q, k_cache, v_cache, k, v):
        """A layer's validated call and Launcher, built at its first run (keyed by its caches)."""
        key = (_address(k_cache), _address(v_cache))
        hit = self._layers.get(key)
        if hit is None:
            call = decode.validate(q, k_cache, v_cache, k, v, self.cache_seqlens, self.causal,
                                   self.window_size, self.softmax_scale, self.return_lse,
                                   self.splits, block_table=self.block_table)
            if (call.batch, call.heads, call.heads_kv, call.head_dim, call.seq_q) != (
                    self.batch, self.heads, self.heads_kv, self.head_dim, self.seq_q):
                raise ValueError(f"q: expected (B, Lq, H, D) = ({self.batch}, {self.seq_q}, "
                                 f"{self.heads}, {self.head_dim}) with {self.heads_kv} K/V "
                                 f"heads (the plan's), got ({call.batch}, {call.seq_q}, "
                                 f"{call.heads}, {call.head_dim}) with {call.heads_kv}")
            call.splits = self.splits
            decode._stream_handshake(call)
            launcher = decode.Launcher(call, call.stream)
            seqlens_ptr, seqlen_const = decode._lengths_args(call, keep := [])
            table_ptr = decode._block_table_arg(call, keep)
            hit = (call, launcher, seqlens_ptr, seqlen_const, table_ptr, keep,
                   tuple(call.q.strides), tuple(call.q.shape))
            self._layers[key] = hit
        return hit

    def run(self, q, k_cache, v_cache, out=None, k=None, v=None):
        """One layer's decode step: the append (with k, v), the attention, the combine; out
        (q's shape, contiguous; fresh from the caller's allocator unless given), or
        (out, lse)."""
        steady = self._steady
        if steady is not None:
            result = steady(q, k_cache, v_cache, out, k, v)
            if result is not None:
                return result
        return self._run_full(q, k_cache, v_cache, out, k, v)

    def _freeze_checked(self, layer: dict, key: tuple):
        """The steady run's freeze (torch_runs.decode_run): a layer's launches for a key's
        addresses when q, the new keys and values and the output are 16-byte aligned and the
        output overlaps no input (what _run_full checks; None otherwise: it raises)."""
        qp, op, lse_ptr, ws_ptr, kp, vp = key
        kc, vc = layer[None][4:]
        if (qp | op | kp | vp) % 16 or _aliases(op, (qp, kc, vc, kp, vp),
                                                self._torch.extents):
            return None
        launcher, seqlens_ptr, seqlen_const, table_ptr = layer[None][:4]
        launches = replay.frozen(launcher.frozen(qp, op, lse_ptr, ws_ptr, seqlens_ptr,
                                                 seqlen_const, kp, vp, 0, table_ptr))
        _remember(layer, key, launches)
        return launches

    def _run_full(self, q, k_cache, v_cache, out, k, v):
        call, launcher, seqlens_ptr, seqlen_const, table_ptr, _, strides, shape = self._layer(
            q, k_cache, v_cache, k, v)
        # a plain bf16 torch q of the layer's shape and strides: its address alone (the
        # checks below, without building tuples; its new_empty gives the fresh tensors)
        q_ptr = tensors.torch_ptr(q, shape, strides, call.q.device) if call.torch else None
        like = q if q_ptr is not None else None
        if q_ptr is None:
            q_ptr, q_shape, q_strides = _meta(q, call.stream)
            if q_shape != shape or q_strides != strides:
                raise ValueError(f"q: shape {q_shape} strides {q_strides} at 0x{q_ptr:x}; the "
                                 f"plan's layers take {shape} {strides}, 16-byte aligned")
        if q_ptr % 16:
            raise ValueError(f"q: shape {shape} strides {strides} at 0x{q_ptr:x}; the plan's "
                             f"layers take {shape} {strides}, 16-byte aligned")
        k_ptr = v_ptr = 0
        if call.seq_new:
            if k is None or v is None:
                raise ValueError("k, v: the plan appends new keys (seq_new > 0)")
            k_ptr, v_ptr = _ptr(k, call.stream), _ptr(v, call.stream)
            if (k_ptr | v_ptr) % 16:
                raise ValueError("k, v: base addresses must be 16-byte aligned")
        torch = sys.modules.get("torch") if call.torch else None
        if out is None:
            if like is not None:
                out = like.new_empty(call.out_shape)
                out_ptr = out.data_ptr()
            elif torch is not None:
                out = torch.empty(call.out_shape, dtype=torch.bfloat16, device=q.device)
                out_ptr = out.data_ptr()
            else:
                out = tensors.empty(call.out_shape, stream=call.stream)
                out_ptr = out.ptr
        else:
            out_ptr = self._checked_out(call, out, q, k_cache, v_cache, k, v)
        lse = None
        lse_ptr = 0
        if call.want_lse:
            lse = (like.new_empty(call.lse_shape, dtype=torch.float32) if like is not None
                   else torch.empty(call.lse_shape, dtype=torch.float32, device=q.device)
                   if torch is not None else
                   tensors.empty(call.lse_shape, stream=call.stream, dtype=np.float32))
            lse_ptr = lse.data_ptr() if torch is not None else lse.ptr
        n = call.workspace_floats
        ws = None
        ws_ptr = 0
        if n:
            ws = (like.new_empty((n,), dtype=torch.float32) if like is not None
                  else torch.empty((n,), dtype=torch.float32, device=q.device)
                  if torch is not None else
                  tensors.empty((n,), stream=call.stream, dtype=np.float32))
            ws_ptr = ws.data_ptr() if torch is not None else ws.ptr
        launcher.run(q_ptr, out_ptr, lse_ptr, ws_ptr, seqlens_ptr, seqlen_const, k_ptr, v_ptr,
                     0, table_ptr)
        del ws                               # stream-ordered (or torch's caching allocator)
        if like is not None:
            self._learn_torch(call, q, k_cache, v_cache, k, v,
                              (launcher, seqlens_ptr, seqlen_const, table_ptr))
        return (out, lse) if call.want_lse else out

    @staticmethod
    def _checked_out(call, out, q, k_cache, v_cache, k, v) -> int:
        """A caller's out: q's shape, contiguous (the layer's Launcher writes the output
        with the strides it was built for), 16-byte aligned, aliasing no input."""
        view = tensors.as_device_array(out, name="out", stream=call.stream)
        strides = tensors.contiguous_strides(call.out_shape)
        if tuple(view.shape) != tuple(call.out_shape) or (
                math.prod(call.out_shape) > 1 and tuple(view.strides) != tuple(strides)):
            raise ValueError(f"out: expected a contiguous array of q's shape "
                             f"{tuple(call.out_shape)}, got shape {tuple(view.shape)} strides "
                             f"{tuple(view.strides)}")
        if view.readonly:
            raise ValueError("out: the device array is exported read-only")
        if view.ptr % 16:
            raise ValueError(f"out: base address 0x{view.ptr:x} is not 16-byte aligned")
        inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v}
        for name, obj in inputs.items():
            if obj is not None and overlaps(view, tensors.as_device_array(
                    obj, name=name, stream=call.stream)):
                raise ValueError(f"out: overlaps {name}; the output must not alias an input")
        return view.ptr

    def _learn_torch(self, call, q, k_cache, v_cache, k, v, layer) -> None:
        """After a full run of torch tensors: the plan's torch geometry (from its first such
        layer) and this layer's entry for the steady run, when its tensors have that geometry."""
        metas = [tensors.torch_meta(x) for x in (q, k_cache, v_cache)]
        new = None
        if call.seq_new:
            new_metas = [tensors.torch_meta(x) for x in (k, v)]
            if None in new_metas or new_metas[0][1:] != new_metas[1][1:]:
                return
            new = (tuple(new_metas[0][1]), tuple(new_metas[0][2]))
        if None in metas:
            return
        (_, qs, qst, dev), (_, ks, kst, _), (_, vs, vst, _) = metas
        out_shape = tuple(call.out_shape)
        out_strides = tuple(tensors.contiguous_strides(out_shape))
        geometry = _TorchDecode(
            device=dev, stream=call.stream, q=(tuple(qs), tuple(qst)),
            k_cache=(tuple(ks), tuple(kst)), v_cache=(tuple(vs), tuple(vst)), new=new,
            out=(out_shape, out_strides),
            lse_shape=tuple(call.lse_shape) if call.want_lse else None,
            ws_floats=call.workspace_floats,
            extents=tuple(tensors._span(0, *g, 2) for g in (
                (tuple(qs), tuple(qst)), (tuple(ks), tuple(kst)), (tuple(vs), tuple(vst)),
                new or ((0,), (1,)), new or ((0,), (1,)))) + (
                tensors._span(0, out_shape, out_strides, 2),))
        if self._torch is None:
            types = tensors._torch_types()
            if types is None:
                return
            self._torch = geometry
            self._steady = torch_runs.decode_run(types, geometry, self._torch_layers,
                                                 self._freeze_checked)
        if geometry != self._torch:
            return
        key = (k_cache.data_ptr(), v_cache.data_ptr())
        if key not in self._torch_layers:
            if len(self._torch_layers) >= 4096:
                self._torch_layers.pop(next(iter(self._torch_layers)), None)
            # (the launcher and its fixed arguments, then the caches' addresses)
            self._torch_layers[key] = {None: layer + key}


@dataclasses.dataclass(frozen=True)
class _TorchDecode:
    """What a DecodePlan's torch runs are checked against: device, stream, (shape, strides)
    of q, the caches, the new keys/values (None without an append) and the output, the LSE's
    shape (None without), the workspace's floats, and the byte extents about their bases of
    q, k_cache, v_cache, k, v and the output (_aliases')."""
    device: int
    stream: int
    q: tuple
    k_cache: tuple
    v_cache: tuple
    new: tuple | None
    out: tuple
    lse_shape: tuple | None
    ws_floats: int
    extents: tuple


def _int32_shape(name: str, obj) -> tuple:
    """The shape of an int32 device array (torch, __cuda_array_interface__, DLPack)."""
    shape = getattr(obj, "shape", None)
    if shape is None:
        cai = getattr(obj, "__cuda_array_interface__", None)
        shape = cai["shape"] if cai is not None else foreign(name, obj, "int32", 0).shape
    if len(shape) != 2:
        raise ValueError(f"{name}: expected shape (B, max_pages), got {tuple(shape)}")
    return tuple(int(n) for n in shape)


def _address(obj) -> int:
    if hasattr(obj, "data_ptr"):
        return obj.data_ptr()
    if isinstance(obj, tensors.DeviceArray):
        return obj.ptr
    return tensors.as_device_array(obj).ptr


def _ptr(obj, stream: int) -> int:
    """The address of a bf16 device array (_meta's), cheaply for torch tensors."""
    m = tensors.torch_meta(obj)
    return m[0] if m is not None else tensors.as_device_array(obj, stream=stream).ptr


def _meta(obj, stream: int) -> tuple[int, tuple, tuple]:
    """(address, shape, strides) of a bf16 device array, cheaply for torch tensors."""
    m = tensors.torch_meta(obj)
    if m is not None:
        return m[0], tuple(m[1]), tuple(m[2])
    arr = tensors.as_device_array(obj, stream=stream)
    return arr.ptr, tuple(arr.shape), tuple(arr.strides)


def plan_varlen(cu_seqlens_q, cu_seqlens_k, **kw) -> PrefillPlan:
    """A PrefillPlan (see the module's docstring): host offsets make run() one launch."""
    return PrefillPlan(cu_seqlens_q, cu_seqlens_k, **kw)


def plan_decode(**kw) -> DecodePlan:
    """A DecodePlan (see the module's docstring)."""
    return DecodePlan(**kw)

