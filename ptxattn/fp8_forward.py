"""The FP8 forward's launch: the FP8 builds of the production kernel (ptx/sm90/production/
forward.ptx with -D PTXATTN_FP8, one per row of builds.FP8_BUILDS), their tensor maps and
parameters, and the call that quantizes (or transposes V), then runs the forward.
fp8.attention() validates and comes here with a Plan (fp8.Plan).
"""

from __future__ import annotations

import threading

import numpy as np

from . import builds, driver, fp8_quantize, tensors, tma
from .launch import (LINEAGE_PARAMS, PRODUCTION_PARAMS, UNBOUNDED, WALK_SECTION, Param, pack,
                     persistent_ctas, walk_section)
from .fp8_reference import padded_keys
from .stages import PRODUCTION, SWIZZLE_128B
from .tensors import BF16, E4M3, DeviceArray

ENTRY = "ptxattn_fwd_fp8"
Q_BOX_ROWS = builds.Q_BOX_ROWS
HEAD_DIMS = builds.FP8_HEAD_DIMS
_F32 = np.dtype(np.float32)

# The FP8 build's parameters after the production kernel's (descales.ptxh: DESCALE_PARAMS):
# each descale's float32 array and its element strides (a stride 0 broadcasts)
DESCALE_PARAMS: tuple[Param, ...] = (
    Param("q_descale_ptr", driver.PTR, ".u64"),
    Param("q_descale_batch", driver.U32, ".u32"),
    Param("q_descale_head_kv", driver.U32, ".u32"),
    Param("q_descale_group", driver.U32, ".u32"),     # the head within its GQA group
    Param("q_descale_block", driver.U32, ".u32"),     # a 128-row block of queries
    Param("k_descale_ptr", driver.PTR, ".u64"),
    Param("k_descale_batch", driver.U32, ".u32"),
    Param("k_descale_head_kv", driver.U32, ".u32"),
    Param("k_descale_block", driver.U32, ".u32"),     # a 128-key block
    Param("v_descale_ptr", driver.PTR, ".u64"),
    Param("v_descale_batch", driver.U32, ".u32"),
    Param("v_descale_head_kv", driver.U32, ".u32"),
    Param("v_descale_channel", driver.U32, ".u32"),
)
# then the tile walk's section (the bf16 builds' rule: include/tile_walk.ptxh)
PARAMS: tuple[Param, ...] = LINEAGE_PARAMS + PRODUCTION_PARAMS + DESCALE_PARAMS + (WALK_SECTION,)


def build_of(head_dim: int, defines: dict | None = None) -> builds.Build:
    """The FP8 row of a head dim (ValueError naming the ones there are), or the measurement
    variant its defines select (FP8_BLOCK_N=..., builds.FP8_VARIANTS)."""
    return builds.fp8_variant(head_dim, defines)


def variant_defines(name: str) -> dict[str, str]:
    """The defines of a measurement variant by name ("n192", "n224"; "" or "default": none)."""
    if name in ("", "default"):
        return {}
    try:
        return dict(builds.FP8_VARIANTS[name].defines)
    except KeyError:
        raise ValueError(f"FP8 variant {name!r}: expected default or one of "
                         f"{', '.join(builds.FP8_VARIANTS)}") from None


def grid(build: builds.Build, batch: int, heads: int, seq_q: int,
         sm_count: int) -> tuple[int, int, int]:
    """Persistent CTAs: one per SM, at most one a tile."""
    tiles = -(-seq_q // build.block_m) * heads * batch
    return (min(sm_count, tiles), 1, 1)


def chosen_defines(plan) -> dict | None:
    """The defines of the build attention() runs for a validated FP8 plan: the variant of
    builds.FP8_PREQUANTIZED_DENSE for pre-quantized inputs without a mask, else None (the
    table's row of its head dim, which prepare() takes by default)."""
    name = builds.FP8_PREQUANTIZED_DENSE.get(plan.head_dim)
    if name is None or not plan.quantized or plan.masked:
        return None
    return variant_defines(name)


def qk_swizzle(head_dim: int) -> tuple[str, int]:
    """(swizzle, bytes a box row) of Q's and K's e4m3 tiles (the row's qk_row_bytes: 128-byte
    rows, or 128-byte blocks of 256-byte rows; 64-byte rows at D = 64)."""
    row = build_of(head_dim).qk_row_bytes
    return (tma.SWIZZLE_64B if row == builds.SMALL_SWIZZLE_ROW_BYTES else SWIZZLE_128B), row


def defines_of(head_dim: int, masked: bool, defines: dict | None = None) -> dict:
    """The preprocessor defines of an FP8 build (and a measurement knob's)."""
    return {"HEAD_DIM": str(head_dim), "PTXATTN_FP8": "1",
            **({"PTXATTN_MASKED": "1"} if masked else {}), **(defines or {})}


def forward_source(head_dim: int, masked: bool, defines: dict | None = None) -> str:
    """The expanded PTX of an FP8 build (what ptxas and the JIT get)."""
    from . import ptx
    return ptx.source(PRODUCTION, defines_of(head_dim, masked, defines))


_KERNELS: dict[tuple, driver.Function] = {}
_KERNELS_LOCK = threading.Lock()


def kernel(head_dim: int, masked: bool, defines: dict | None = None) -> driver.Function:
    """ptxattn_fwd_fp8 of this build, JIT-compiled once per (device, build, defines)."""
    ctx = driver.context()
    key = (ctx.ordinal, head_dim, masked, tuple(sorted((defines or {}).items())))
    with _KERNELS_LOCK:
        if key not in _KERNELS:
            label = (f"forward -DPTXATTN_FP8 -DHEAD_DIM={head_dim}"
                     + (" -DPTXATTN_MASKED" if masked else ""))
            module = driver.load_module(forward_source(head_dim, masked, defines), label)
            function = module.function(ENTRY)
            function.set_max_dynamic_smem(build_of(head_dim, defines).smem_bytes)
            _KERNELS[key] = function
        return _KERNELS[key]


def e4m3_map(arr: DeviceArray, layout: str, batch: int, heads: int, seq: int, head_dim: int,
             rows: int, name: str):
    """Q's or K's map: 5-D (row bytes, rows, D / row bytes, heads, batch) over e4m3, a box of
    `rows` rows, swizzled by the row (qk_swizzle): lands as [D / chunk][rows][chunk bytes]."""
    swizzle, chunk = qk_swizzle(head_dim)
    s_batch, s_head, s_row, _ = tma.bhl_strides(layout, arr.shape, arr.strides, name)
    return tma.encode_tiled(arr.ptr, (chunk, seq, head_dim // chunk, heads, batch),
                            (s_row, chunk, s_head, s_batch),
                            (chunk, rows, head_dim // chunk, 1, 1), swizzle, data_type="u8",
                            name=name)


def vt_map(vt8: DeviceArray, build: builds.Build):
    """V^T's map: 5-D (keys, D, 1, heads_kv, batch) over (B, Hkv, D, Lk_pad) e4m3, a box of
    BLOCK_N keys of every channel (producer.ptxh: V_TILE_BOX, the tile's first key leading):
    lands as [D][BLOCK_N bytes], swizzled by its rows (128B at 128 keys, 64B at 64). A variant
    whose BLOCK_N is no swizzle width loads a tile as vt_chunks boxes of vt_row_bytes keys
    (64B-swizzled at 192 keys, 32B at 224; kv_multicast.ptxh's KV_LOAD_V)."""
    b, hkv, d, lk_pad = vt8.shape
    swizzle = {builds.SWIZZLE_ROW_BYTES: SWIZZLE_128B,
               builds.SMALL_SWIZZLE_ROW_BYTES: tma.SWIZZLE_64B,
               builds.SMALLEST_SWIZZLE_ROW_BYTES: tma.SWIZZLE_32B}[build.vt_row_bytes]
    return tma.encode_tiled(vt8.ptr, (lk_pad, d, 1, hkv, b),
                            (lk_pad, d * lk_pad, d * lk_pad, hkv * d * lk_pad),
                            (build.vt_row_bytes, d, 1, 1, 1), swizzle, data_type="u8", name="v")


class PreparedFp8:
    """One FP8 call with every launch built: launch() runs the quantizer (or V's transpose)
    then the forward; launch_prepare() and launch_forward() run each part alone (the benchmark
    reports the quantization inside and outside the figure). `owned`: what this call made (its
    temporaries, and out/lse unless they go back to the caller); `keep`: what must outlive the
    launches (the inputs, the maps)."""

    def __init__(self, plan, out, lse, prep, forward, owned, keep):
        self.plan, self.out, self.lse = plan, out, lse
        self._prep, self._forward, self._owned, self._keep = prep, forward, owned, keep
        self.stream = plan.stream

    def launch_prepare(self) -> None:
        for spec in self._prep:
            spec()

    def launch_forward(self) -> None:
        self._forward()

    def launch(self) -> None:
        self.launch_prepare()
        self.launch_forward()

    @property
    def flops(self) -> int:
        p = self.plan
        return 4 * p.batch * p.heads * p.seq_q * p.seq_k * p.head_dim

    def release(self, *, keep_outputs: bool = False) -> None:
        """Free what this call made, in stream order (queued launches finish first); the
        outputs too unless keep_outputs (they go back to the caller)."""
        for item in self._owned:
            if keep_outputs and (item is self.out or item is self.lse):
                continue
            if isinstance(item, fp8_quantize.Operands):
                item.close()
            else:
                item.free()
        self._owned = ()

    def close(self) -> None:
        driver.synchronize(self.stream)
        self.release()


def _device_inputs(plan, owned: list):
    """q, k, v on the device: NumPy inputs copied in (bf16 or e4m3), device arrays as they are."""
    if not plan.host:
        return plan.q, plan.k, plan.v
    out = []
    for x in (plan.q, plan.k, plan.v):
        if plan.quantized:
            arr = tensors.empty(x.shape, stream=plan.stream, dtype=E4M3)
            driver.memcpy_htod(arr.ptr, np.ascontiguousarray(x), stream=plan.stream)
            arr.staging = x
        else:
            arr = tensors.from_numpy(x, stream=plan.stream)
        owned.append(arr)
        out.append(arr)
    return tuple(out)


def _fa3_descales(plan, owned: list):
    """(array, strides) of q, k, v descales in the kernel's form from FlashAttention-3's
    (batch, heads_kv) ones (None: a 1.0 with strides 0); NumPy descales are copied in."""
    ctx = driver.context()
    out = {}
    for name, width in (("q_descale", 4), ("k_descale", 3), ("v_descale", 3)):
        given = plan.descales.get(name)
        if given is None:
            out[name] = (fp8_quantize.one(ctx.ordinal), (0,) * width)
            continue
        arr, (s_batch, s_head) = given
        if isinstance(arr, np.ndarray):
            host = np.ascontiguousarray(arr, dtype=np.float32)
            dev = tensors.empty(host.shape, stream=plan.stream, dtype=_F32)
            driver.memcpy_htod(dev.ptr, host, stream=plan.stream)
            dev.staging = host
            owned.append(dev)
            arr, (s_batch, s_head) = dev, (host.shape[1] if host.shape[0] > 1 else 0,
                                           1 if host.shape[1] > 1 else 0)
        out[name] = (arr, (s_batch, s_head) + (0,) * (width - 2))
    return out


def prepare(plan, defines: dict | None = None) -> PreparedFp8:
    """Allocate, quantize-or-transpose, build maps and parameters (launch nothing). `defines`:
    a measurement knob's, or a variant's (variant_defines), which takes the dense build and one
    K descale a head where its tiles straddle K's 128-key blocks."""
    build = build_of(plan.head_dim, defines)
    if build.variant:
        if plan.masked and build.block_n_shift is None:
            raise ValueError(f"FP8 variant {build.variant}: dense only (no causal or window: "
                             "the masked walk shifts by log2 BLOCK_N)")
        # pre-quantized inputs carry FlashAttention-3's (batch, heads_kv) K descales
        if builds.FP8_SCALE_BLOCK % build.block_n and not plan.quantized:
            raise ValueError(f"FP8 variant {build.variant}: its {build.block_n}-key tiles "
                             "straddle K's 128-key descale blocks; it takes pre-quantized "
                             "e4m3 inputs with FlashAttention-3's (batch, heads_kv) descales")
    ctx = driver.context()
    stream = plan.stream
    function = kernel(plan.head_dim, plan.masked, defines)
    owned: list = []
    q, k, v = _device_inputs(plan, owned)
    B, H, Hkv, Lq, Lk, D = (plan.batch, plan.heads, plan.heads_kv, plan.seq_q, plan.seq_k,
                            plan.head_dim)
    prep = []
    if plan.quantized:
        ops = fp8_quantize.Operands(q, k, None, None, None, None, plan.layout, Lk, padded_keys(Lk))
        scales = _fa3_descales(plan, owned)
        ops.q_descale, ops.k_descale, ops.v_descale = (scales["q_descale"], scales["k_descale"],
                                                       scales["v_descale"])
        vt8 = tensors.empty((B, Hkv, D, ops.lk_pad), stream=stream, dtype=E4M3)
        ops.vt8 = vt8
        owned.append(vt8)
        prep.append(fp8_quantize.transpose_v_launch(v, vt8, plan.layout, stream=stream))
    else:
        ops = fp8_quantize.quantize_launches(q, k, v, plan.layout, smooth_k=plan.smooth_k, stream=stream,
                                    stream_owner=plan.stream_object)
        owned.append(ops)
        prep.extend(ops.launches)
    if plan.out is not None and not plan.host:
        out = plan.out                                   # the caller's: never freed here
    else:
        out = tensors.empty(plan.out_shape, stream=stream, stream_owner=plan.stream_object)
        owned.append(out)
    lse = None
    if plan.want_lse:
        lse = tensors.empty((B, H, Lq), stream=stream, dtype=_F32,
                            stream_owner=plan.stream_object)
        owned.append(lse)
    maps = (e4m3_map(ops.q8, ops.layout, B, H, Lq, D, Q_BOX_ROWS, "q"),
            e4m3_map(ops.k8, ops.layout, B, Hkv, Lk, D, build.block_n, "k"),
            vt_map(ops.vt8, build),
            tma.encode_qkvo_map(out.ptr, plan.layout, B, H, Lq, D, Q_BOX_ROWS, SWIZZLE_128B, 64,
                                out.strides, name="out"))
    o_batch, o_head, o_row, _ = tma.bhl_strides(plan.layout, out.shape, out.strides, "out")
    left, right = (UNBOUNDED if x < 0 else min(x, UNBOUNDED) for x in plan.window)
    params = dict(zip(("tmap_q", "tmap_k", "tmap_v", "tmap_o"), maps))
    params.update(o_ptr=out.ptr, o_row_stride=o_row, o_head_stride=o_head, o_batch_stride=o_batch,
                  seq_q=Lq, seq_k=Lk, heads=H, batch=B, softmax_scale=plan.scale,
                  heads_per_kv=H // Hkv, lse_ptr=lse.ptr if lse is not None else 0,
                  diag_offset=plan.diag_offset, window_left=left, window_right=right)
    for name, (arr, strides) in (("q", ops.q_descale), ("k", ops.k_descale),
                                 ("v", ops.v_descale)):
        params[f"{name}_descale_ptr"] = arr.ptr
        fields = [p.name for p in DESCALE_PARAMS if p.name.startswith(f"{name}_descale_")][1:]
        params.update(zip(fields, strides))
    cap = persistent_ctas()
    cover = grid(build, B, H, Lq, ctx.sm_count if cap is None else min(ctx.sm_count, cap))
    params["walk_section"] = walk_section(plan, build, ctx, cover[0])
    forward = driver.LaunchSpec(function, cover, (build.threads, 1, 1), build.smem_bytes,
                                pack(PARAMS, params), stream=stream)
    out.stream = stream
    if lse is not None:
        lse.stream = stream
    return PreparedFp8(plan, out, lse, tuple(prep), forward, tuple(owned), (q, k, v, maps))


def run(plan):
    """Launch the call of a validated plan (the build chosen_defines picks); NumPy in -> NumPy
    out (synchronized)."""
    if plan.empty:
        device = None if plan.host else getattr(plan.q, "device", None)
        out = plan.out if plan.out is not None else (
            np.empty(plan.out_shape, BF16) if plan.host else
            DeviceArray(0, plan.out_shape, device=device))
        if plan.want_lse:
            shape = (plan.batch, plan.heads, plan.seq_q)
            lse = np.empty(shape, np.float32) if plan.host else DeviceArray(
                0, shape, device=device, dtype=_F32)
            return out, lse
        return out
    prepared = prepare(plan, chosen_defines(plan))
    try:
        prepared.launch()
        if plan.host:
            result = prepared.out.to_numpy()         # waits for the launches
            lse = prepared.lse.to_numpy() if plan.want_lse else None
            if plan.out is not None:
                plan.out[...] = result
                result = plan.out
            return (result, lse) if plan.want_lse else result
        result = plan.out if plan.out is not None else prepared.out
        return (result, prepared.lse) if plan.want_lse else result
    finally:
        # temporaries freed in stream order; device outputs go back to the caller
        prepared.release(keep_outputs=not plan.host)
