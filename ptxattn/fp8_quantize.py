"""The FP8 path's quantizer: the launches of ptx/sm90/production/quantize_fp8.ptx and what they
write (Operands), on the device, for the FP8 forward (fp8_forward.py).

- ptxattn_fp8_kv_stats: per (batch, K/V head, chunk of keys) partial sums of K (smoothing) and
  the channel maxima of V;
- ptxattn_fp8_quantize: bf16 -> e4m3 with per-block scales, bit for bit fp8_reference's
  quantize_inputs: Q per 128 query rows, K per K_BLOCK keys (after subtracting its channel mean
  when smoothing), V per channel, stored as V^T with the keys of each group of 32 permuted
  (fp8_reference.PV_KEY_ORDER);
- ptxattn_fp8_transpose_v: V^T (permuted) from e4m3 V, for pre-quantized inputs.

Every output comes fresh from the stream-ordered allocator (tensors.empty) per call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from . import driver, tensors, tma
from .fp8_reference import Q_BLOCK, V_BLOCK, padded_keys
from .stages import SWIZZLE_NONE, ptx_root
from .tensors import E4M3, DeviceArray

K_BLOCK = 128                     # keys per K scale (a multiple of every FP8 build's BLOCK_N)
QUANTIZE_FILE = "sm90/production/quantize_fp8.ptx"
QUANTIZE_THREADS = 256
STATS_ROWS = 64                   # keys per stats box
_MAX_CHUNKS = 64                  # partial sums per head the quantizer reduces
_F32 = np.dtype(np.float32)


def quantize_smem(head_dim: int) -> int:
    """Dynamic shared memory of ptxattn_fp8_quantize (and _transpose_v): the bf16 block, the
    V^T staging, 8 floats, an mbarrier, 1 KiB to align the base (quantize_fp8.ptx header)."""
    return 128 * head_dim * 2 + head_dim * 144 + 32 + 8 + 1024


def stats_smem(head_dim: int) -> int:
    """... of ptxattn_fp8_kv_stats: K and V boxes, the per-thread reduction, an mbarrier."""
    return 2 * STATS_ROWS * head_dim * 2 + QUANTIZE_THREADS * 64 + 8 + 1024


def stats_chunks(batch: int, heads_kv: int, seq_k: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of the stats pass: enough CTAs to fill the GPU twice over
    (~264), at most _MAX_CHUNKS partials a head, whole 64-row boxes."""
    boxes = -(-seq_k // STATS_ROWS)
    want = max(1, min(_MAX_CHUNKS, boxes, -(-264 // max(1, batch * heads_kv))))
    rows = -(-boxes // want) * STATS_ROWS
    return -(-seq_k // rows), rows


_KERNELS: dict[tuple[int, int], dict] = {}
_KERNELS_LOCK = threading.Lock()


def quantize_source(head_dim: int) -> str:
    """The expanded PTX of the quantizer for one head dim (what ptxas and the JIT get)."""
    from . import ptx
    return ptx.expand_file(ptx_root() / QUANTIZE_FILE, [ptx_root() / "sm90" / "include"],
                           {"HEAD_DIM": head_dim}).text


def _quantize_functions(head_dim: int) -> dict:
    ctx = driver.context()
    key = (ctx.ordinal, head_dim)
    with _KERNELS_LOCK:
        if key not in _KERNELS:
            module = driver.load_module(quantize_source(head_dim),
                                        f"quantize_fp8 -DHEAD_DIM={head_dim}")
            found = {name: module.function(name) for name in
                     ("ptxattn_fp8_kv_stats", "ptxattn_fp8_quantize", "ptxattn_fp8_transpose_v")}
            found["ptxattn_fp8_kv_stats"].set_max_dynamic_smem(stats_smem(head_dim))
            found["ptxattn_fp8_quantize"].set_max_dynamic_smem(quantize_smem(head_dim))
            found["ptxattn_fp8_transpose_v"].set_max_dynamic_smem(quantize_smem(head_dim))
            _KERNELS[key] = found
        return _KERNELS[key]


@dataclass
class Operands:
    """What the FP8 forward reads, on the device: e4m3 Q (B, H, Lq, D) and K (B, Hkv, Lk, D)
    in any 16-byte strides, V^T (B, Hkv, D, lk_pad) with permuted keys, and the descales as
    (array, element strides): q (batch, head_kv, head within its group, 128-row block), k
    (batch, head_kv, 128-key block), v (batch, head_kv, channel). A stride 0 broadcasts."""
    q8: DeviceArray
    k8: DeviceArray
    vt8: DeviceArray
    q_descale: tuple[DeviceArray, tuple[int, int, int, int]]
    k_descale: tuple[DeviceArray, tuple[int, int, int]]
    v_descale: tuple[DeviceArray, tuple[int, int, int]]
    layout: str                  # of q8 and k8 ("bhld" for the quantizer's)
    seq_k: int
    lk_pad: int
    k_mean: DeviceArray | None = None
    owned: tuple = ()            # arrays made here (freed with close())
    launches: tuple = ()         # the LaunchSpecs that write them, in order

    def close(self) -> None:
        """Free what was made here (stream-ordered: after the work queued on its stream)."""
        for array in self.owned:
            array.free()


def quantize(q: DeviceArray, k: DeviceArray, v: DeviceArray, layout: str, *,
             smooth_k: bool = False, stream=None, stream_owner=None) -> Operands:
    """Launch the quantizer on bf16 device arrays (validated: 16-byte strides, D in
    HEAD_DIMS): ptxattn_fp8_kv_stats, then ptxattn_fp8_quantize, on `stream`."""
    ops = quantize_launches(q, k, v, layout, smooth_k=smooth_k, stream=stream,
                            stream_owner=stream_owner)
    for spec in ops.launches:
        spec()
    return ops


def quantize_launches(q: DeviceArray, k: DeviceArray, v: DeviceArray, layout: str, *,
                      smooth_k: bool = False, stream=None, stream_owner=None) -> Operands:
    """The quantizer's outputs allocated and its two launches built (not launched)."""
    handle = driver.stream_handle(stream)
    b, h, lq, d = _dims(q.shape, layout)
    _, hkv, lk, _ = _dims(k.shape, layout)
    fns = _quantize_functions(d)
    mq, nk = -(-lq // Q_BLOCK), -(-lk // V_BLOCK)
    lk_pad = padded_keys(lk)
    chunks, chunk_rows = stats_chunks(b, hkv, lk)

    def new(shape, dtype):
        return tensors.empty(shape, stream=handle, dtype=dtype, stream_owner=stream_owner)

    q8, k8, vt8 = new((b, h, lq, d), E4M3), new((b, hkv, lk, d), E4M3), \
        new((b, hkv, d, lk_pad), E4M3)
    q_descale, k_descale = new((b, h, max(mq, 1)), _F32), new((b, hkv, nk), _F32)
    v_descale = new((b, hkv, d), _F32)
    vmax = new((b, hkv, chunks, d), _F32)
    ksum = new((b, hkv, chunks, d), _F32) if smooth_k else None
    k_mean = new((b, hkv, d), _F32) if smooth_k else None

    def box(arr, heads, seq, rows, name):
        return tma.encode_qkvo_map(arr.ptr, layout, b, heads, seq, d, rows, SWIZZLE_NONE, 64,
                                   arr.strides, name=name)

    by_value = driver.BY_VALUE
    stats = ((box(k, hkv, lk, STATS_ROWS, "k"), box(v, hkv, lk, STATS_ROWS, "v"),
              ksum.ptr if ksum else 0, vmax.ptr, lk, chunk_rows, int(smooth_k)),
             (by_value, by_value, driver.PTR, driver.PTR, driver.U32, driver.U32, driver.U32))
    stats_spec = driver.LaunchSpec(fns["ptxattn_fp8_kv_stats"], (chunks, hkv, b),
                                   (QUANTIZE_THREADS, 1, 1), stats_smem(d), stats, stream=handle)
    jobs = b * (h * mq + 2 * hkv * nk)
    values = (box(q, h, max(lq, 1), 128, "q"), box(k, hkv, lk, 128, "k"),
              box(v, hkv, lk, 128, "v"), q8.ptr, q_descale.ptr, k8.ptr, k_descale.ptr,
              vt8.ptr, v_descale.ptr, k_mean.ptr if k_mean else 0, ksum.ptr if ksum else 0,
              vmax.ptr, h, hkv, lq, lk, lk_pad, chunks, int(smooth_k))
    types = (by_value,) * 3 + (driver.PTR,) * 9 + (driver.U32,) * 7
    quantize_spec = driver.LaunchSpec(fns["ptxattn_fp8_quantize"], (jobs, 1, 1),
                                      (QUANTIZE_THREADS, 1, 1), quantize_smem(d),
                                      (values, types), stream=handle)
    group = h // hkv
    owned = tuple(x for x in (q8, k8, vt8, q_descale, k_descale, v_descale, vmax, ksum, k_mean)
                  if x is not None)
    return Operands(q8, k8, vt8,
                    (q_descale, (h * max(mq, 1), group * max(mq, 1), max(mq, 1), 1)),
                    (k_descale, (hkv * nk, nk, 1)), (v_descale, (hkv * d, d, 1)),
                    "bhld", lk, lk_pad, k_mean, owned, (stats_spec, quantize_spec))


def transpose_v(v8: DeviceArray, layout: str, *, stream=None, stream_owner=None) -> DeviceArray:
    """V^T (B, Hkv, D, lk_pad) with permuted keys from e4m3 V in `layout` (any 16-byte
    strides): ptxattn_fp8_transpose_v on `stream`."""
    handle = driver.stream_handle(stream)
    b, hkv, lk, d = _dims(v8.shape, layout)
    vt8 = tensors.empty((b, hkv, d, padded_keys(lk)), stream=handle, dtype=E4M3,
                        stream_owner=stream_owner)
    transpose_v_launch(v8, vt8, layout, stream=handle)()
    return vt8


def transpose_v_launch(v8: DeviceArray, vt8: DeviceArray, layout: str, *, stream=None):
    """The LaunchSpec of ptxattn_fp8_transpose_v from v8 into vt8 (allocated by the caller)."""
    b, hkv, lk, d = _dims(v8.shape, layout)
    s_batch, s_head, s_row, _ = tma.bhl_strides(layout, v8.shape, v8.strides, "v")
    tmap = tma.encode_tiled(v8.ptr, (d, lk, hkv, b), (s_row, s_head, s_batch), (d, 128, 1, 1),
                            SWIZZLE_NONE, data_type="u8", name="v")
    fn = _quantize_functions(d)["ptxattn_fp8_transpose_v"]
    return driver.LaunchSpec(fn, (b * hkv * -(-lk // V_BLOCK), 1, 1), (QUANTIZE_THREADS, 1, 1),
                             quantize_smem(d), ((tmap, vt8.ptr, hkv, lk, vt8.shape[-1]),
                                                (driver.BY_VALUE, driver.PTR, driver.U32,
                                                 driver.U32, driver.U32)),
                             stream=driver.stream_handle(stream))


def _dims(shape, layout: str) -> tuple[int, int, int, int]:
    b, x, y, d = (int(n) for n in shape)
    return (b, x, y, d) if layout == "bhld" else (b, y, x, d)


_CONSTANTS: dict[int, DeviceArray] = {}      # device -> its float32 1.0 (read-only)


def one(device: int) -> DeviceArray:
    """A device float32 1.0: the descale a None stands for (all strides 0). Never written
    after it is made, so one per device serves every call."""
    with _KERNELS_LOCK:
        if device not in _CONSTANTS:
            arr = tensors.empty((1,), dtype=_F32)
            driver.memcpy_htod(arr.ptr, np.ones(1, np.float32))
            _CONSTANTS[device] = arr
        return _CONSTANTS[device]
