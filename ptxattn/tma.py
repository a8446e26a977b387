"""Tensor maps (cuTensorMapEncodeTiled) for Q, K, V and O.

Contract (ptx/sm90/README.md, "Tensor maps"): every map is 5-D over
(d_inner, row, d_outer, head, batch), d_inner = `chunk` elements of the head
dim, d_outer = D / chunk. Byte strides of dims 1..4 are (row stride, 2*chunk,
head stride, batch stride), taken from the array's real strides, so BHLD, BSHD
and strided views differ only in strides. The box is (chunk, rows, D/chunk, 1, 1)
and lands in shared memory as [d_outer][row][chunk].
"""

from __future__ import annotations

import ctypes
import functools
import threading

from .stages import SWIZZLE_128B, SWIZZLE_NONE

ELEMENT_BYTES = 2            # bf16
_TMA_ALIGN = 16              # base address and every global stride, in bytes
_MAX_BOX = 256               # TMA box dims are 1..256 elements


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def layout_shape(layout: str, batch: int, heads: int, seq: int, head_dim: int) -> tuple:
    return (batch, heads, seq, head_dim) if layout == "bhld" else (batch, seq, heads, head_dim)


def bhl_strides(layout: str, shape, strides=None, name: str = "tensor") -> tuple[int, int, int, int]:
    """Element strides (batch, head, row, dim) of a 4-D array in `layout` order.

    A stride of a size-1 dim never addresses anything and frameworks report
    arbitrary values there: it is replaced by the contiguous one.
    """
    strides = tuple(int(s) for s in (strides if strides is not None else contiguous_strides(shape)))
    if len(strides) != 4:
        raise ValueError(f"{name}: expected 4 strides, got {len(strides)}")
    strides = tuple(c if n == 1 else s for n, s, c in zip(shape, strides, contiguous_strides(shape)))
    if layout == "bhld":
        return strides[0], strides[1], strides[2], strides[3]
    return strides[0], strides[2], strides[1], strides[3]


def map_geometry(layout: str, batch: int, heads: int, seq: int, head_dim: int, rows: int,
                 chunk: int, strides=None, name: str = "tensor", d_blocks: int | None = None
                 ) -> dict:
    """Dims, byte strides, box and element strides of one map, as plain ints.

    `strides` are element strides in the array's own axis order (layout order);
    None means contiguous. d_blocks: the box's d_outer extent (None: all D / chunk; 1 makes
    a box of one chunk of D, as the paged decode cache's per-page boxes). Raises ValueError
    (naming `name`) when TMA cannot address the array.
    """
    dims, byte_strides, box = _geometry(layout, batch, heads, seq, head_dim, rows, chunk,
                                        None if strides is None else tuple(strides), name,
                                        d_blocks)
    return {"dims": dims, "strides": byte_strides, "box": box,
            "element_strides": (1, 1, 1, 1, 1)}


@functools.lru_cache(maxsize=1024)
def _geometry(layout, batch, heads, seq, head_dim, rows, chunk, strides, name, d_blocks=None):
    """(dims, byte strides, box) of map_geometry; a pure function of its arguments, so a call
    path that sees the same geometry again pays a dict lookup (errors are not cached)."""
    layout = layout.lower()
    if layout not in ("bhld", "bshd"):
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    if chunk <= 0 or head_dim % chunk:
        raise ValueError(f"{name}: head dim {head_dim} is not a multiple of the TMA chunk {chunk}")
    if not 1 <= rows <= _MAX_BOX or head_dim // chunk > _MAX_BOX:
        raise ValueError(f"{name}: TMA box ({chunk}, {rows}, {head_dim // chunk}) exceeds 256")
    shape = layout_shape(layout, batch, heads, seq, head_dim)
    s_batch, s_head, s_row, s_dim = bhl_strides(layout, shape, strides, name)
    if s_dim != 1:
        raise ValueError(f"{name}: last (head) dim must have stride 1 for TMA, got stride {s_dim}")

    dims = (chunk, seq, head_dim // chunk, heads, batch)
    byte_strides = (s_row * ELEMENT_BYTES, chunk * ELEMENT_BYTES,
                    s_head * ELEMENT_BYTES, s_batch * ELEMENT_BYTES)
    for label, n, s in (("row", seq, s_row), ("head", heads, s_head), ("batch", batch, s_batch)):
        if n > 1 and s <= 0:
            raise ValueError(f"{name}: {label} stride must be positive for TMA, got {s} elements")
        if (s * ELEMENT_BYTES) % _TMA_ALIGN:
            raise ValueError(f"{name}: {label} stride of {s} elements ({s * ELEMENT_BYTES} bytes) "
                             f"is not a multiple of {_TMA_ALIGN} bytes, which TMA requires")
    if d_blocks is not None and not 1 <= d_blocks <= head_dim // chunk:
        raise ValueError(f"{name}: a box of {d_blocks} chunks of D (D / chunk is "
                         f"{head_dim // chunk})")
    return dims, byte_strides, (chunk, rows, d_blocks or head_dim // chunk, 1, 1)


ROW_GROUP = 8                # the paged row-group layout: 8 key rows over all of D


@functools.lru_cache(maxsize=256)
def row_group_geometry(num_pages: int, page_size: int, heads: int, head_dim: int, box_rows: int,
                       strides=None, chunk: int = 64, name: str = "tensor"):
    """(dims, byte strides, box) of a paged cache (num_pages, page_size, heads, D) as the
    paged decode's row-group build reads it (ptx/sm90/production/decode_kv_paged.ptxh): 5-D
    (chunk elements of D, 8 rows, D / chunk, head, row group of the pool), one box of
    box_rows / 8 row groups over all of D. The pool's row groups fold (page, group in the page)
    into one dim, so pages must lie page_size rows apart; ValueError naming `name` and the
    reason when the strides do not allow it (the caller falls back to a box per 64 columns)."""
    shape = (num_pages, page_size, heads, head_dim)
    s_page, s_head, s_row, s_dim = bhl_strides("bshd", shape, strides, name)
    if s_dim != 1:
        raise ValueError(f"{name}: last (head) dim must have stride 1 for TMA, got {s_dim}")
    if head_dim % chunk or page_size % ROW_GROUP or box_rows % ROW_GROUP:
        raise ValueError(f"{name}: D {head_dim}, page {page_size}, box {box_rows} rows: row "
                         f"groups need D a multiple of {chunk} and rows of 8")
    if num_pages > 1 and s_page != page_size * s_row:
        raise ValueError(f"{name}: pages {s_page} elements apart, not page_size x the row "
                         f"stride ({page_size} x {s_row}): the pool's row groups do not fold "
                         "into one dim")
    groups = num_pages * page_size // ROW_GROUP
    if groups > 1 << 32:
        raise ValueError(f"{name}: {groups} row groups exceed TMA's 2^32 a dim")
    byte_strides = (s_row * ELEMENT_BYTES, chunk * ELEMENT_BYTES, s_head * ELEMENT_BYTES,
                    ROW_GROUP * s_row * ELEMENT_BYTES)
    for label, s in zip(("row", "D block", "head", "row group"), byte_strides):
        if s <= 0 or s % _TMA_ALIGN or s >= 1 << 40:
            raise ValueError(f"{name}: {label} stride of {s} bytes: TMA needs a positive "
                             f"multiple of {_TMA_ALIGN} below 2^40")
    dims = (chunk, ROW_GROUP, head_dim // chunk, heads, groups)
    box = (chunk, ROW_GROUP, head_dim // chunk, 1, box_rows // ROW_GROUP)
    return dims, byte_strides, box


def check_base(ptr: int, name: str = "tensor") -> None:
    if ptr % _TMA_ALIGN:
        raise ValueError(f"{name}: base address 0x{ptr:x} is not {_TMA_ALIGN}-byte aligned, "
                         "which TMA requires")


def encode_qkvo_map_once(ptr: int, layout: str, batch: int, heads: int, seq: int,
                         head_dim: int, rows: int, swizzle: str, chunk: int, strides=None,
                         name: str = "tensor", geometry: tuple | None = None):
    """encode_qkvo_map's map, encoded without remembering it or its geometry (neither
    _MAPS nor _geometry's cache): for arrays that move every call (transformers'
    DynamicCache: a new address and length every step), whose maps would only fill the caches
    with entries no call asks for again. geometry: geometry_once's answer for these
    arguments when the caller has it (two caches of one shape and strides share it)."""
    check_base(ptr, name)
    dims, byte_strides, box = geometry if geometry is not None else geometry_once(
        layout, batch, heads, seq, head_dim, rows, chunk, strides, name)
    return _encode(int(ptr), dims, byte_strides, box, swizzle, chunk * ELEMENT_BYTES, name)


def geometry_once(layout: str, batch: int, heads: int, seq: int, head_dim: int, rows: int,
                  chunk: int, strides=None, name: str = "tensor") -> tuple:
    """(dims, byte strides, box) of map_geometry, its checks included, without _geometry's
    cache (see encode_qkvo_map_once)."""
    return _geometry.__wrapped__(layout, batch, heads, seq, head_dim, rows, chunk,
                                 None if strides is None else tuple(strides), name)


# Encoded maps by everything cuTensorMapEncodeTiled is given: (address, dims, byte strides,
# box, swizzle) with the data type, rank, interleave, L2 promotion and OOB fill fixed here.
# A map is a pure function of that key, so a hit can never be stale: a new address, shape,
# stride, box or swizzle is a new key and a new encode. Bounded; the oldest go first.
_MAPS: dict[tuple, object] = {}
_MAPS_MAX = 8192             # 4 maps a call: a step of ~2000 distinct calls stays cached
_MAPS_LOCK = threading.Lock()


def clear_map_cache() -> None:
    with _MAPS_LOCK:
        _MAPS.clear()


def encode_qkvo_map(ptr: int, layout: str, batch: int, heads: int, seq: int, head_dim: int,
                    rows: int, swizzle: str, chunk: int, strides=None, name: str = "tensor",
                    d_blocks: int | None = None):
    """A bf16 CUtensorMap for one of Q, K, V, O (pass it by value, type None); encoded once
    per (address, geometry, swizzle) and shared after (the launch copies its bytes).
    d_blocks: as map_geometry's."""
    check_base(ptr, name)
    dims, byte_strides, box = _geometry(layout, batch, heads, seq, head_dim, rows, chunk,
                                        None if strides is None else tuple(strides), name,
                                        d_blocks)
    key = (int(ptr), dims, byte_strides, box, swizzle)
    tmap = _MAPS.get(key)
    if tmap is None:
        tmap = _encode(int(ptr), dims, byte_strides, box, swizzle, chunk * ELEMENT_BYTES, name)
        with _MAPS_LOCK:
            if len(_MAPS) >= _MAPS_MAX:
                _MAPS.pop(next(iter(_MAPS)), None)
            _MAPS[key] = tmap
    return tmap


SWIZZLE_64B = "64B"          # FP8 tiles of 64-byte rows (ptxattn/fp8.py)
SWIZZLE_32B = "32B"          # V^T's row blocks in the FP8 224-key variant (fp8_forward.vt_map)
_SWIZZLE_BYTES = {SWIZZLE_NONE: None, SWIZZLE_32B: 32, SWIZZLE_64B: 64, SWIZZLE_128B: 128}


def encode_tiled(ptr: int, dims, byte_strides, box, swizzle: str, *, data_type: str = "bf16",
                 name: str = "tensor"):
    """A CUtensorMap of any rank (dims innermost first, byte strides of dims 1.., box) for
    bf16 or one-byte ("u8": e4m3) elements, encoded once per key like encode_qkvo_map."""
    check_base(ptr, name)
    key = (int(ptr), tuple(dims), tuple(byte_strides), tuple(box), swizzle, data_type)
    tmap = _MAPS.get(key)
    if tmap is None:
        row_bytes = box[0] * (ELEMENT_BYTES if data_type == "bf16" else 1)
        tmap = _encode(int(ptr), tuple(dims), tuple(byte_strides), tuple(box), swizzle,
                       row_bytes, name, data_type)
        with _MAPS_LOCK:
            if len(_MAPS) >= _MAPS_MAX:
                _MAPS.pop(next(iter(_MAPS)), None)
            _MAPS[key] = tmap
    return tmap


def _check_swizzle(swizzle, row_bytes, name) -> None:
    if swizzle not in _SWIZZLE_BYTES:
        raise ValueError(f"swizzle: expected one of {tuple(_SWIZZLE_BYTES)}, got {swizzle!r}")
    span = _SWIZZLE_BYTES[swizzle]
    if span is not None and row_bytes > span:
        raise ValueError(f"{name}: a {swizzle}-swizzled box row is at most {span} bytes, "
                         f"got {row_bytes}")


def _encode(ptr, dims, byte_strides, box, swizzle, row_bytes, name, data_type="bf16"):
    from .driver import check, cu  # driver only when a map is actually built

    _check_swizzle(swizzle, row_bytes, name)
    d = cu()
    sw = {SWIZZLE_128B: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
          SWIZZLE_64B: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
          SWIZZLE_32B: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
          SWIZZLE_NONE: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE}[swizzle]
    kind = (d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if data_type == "bf16"
            else d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8)
    return check(d.cuTensorMapEncodeTiled(
        kind,
        len(dims),
        ptr,
        [d.cuuint64_t(x) for x in dims],
        [d.cuuint64_t(x) for x in byte_strides],
        [d.cuuint32_t(x) for x in box],
        [d.cuuint32_t(1)] * len(dims),
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        sw,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    ), f"cuTensorMapEncodeTiled({name}: dims={dims}, strides={byte_strides}, box={box})")


# ---------------------------------------------------------------- the ctypes encoder
# cuTensorMapEncodeTiled called on libcuda directly (an alternative to the binding's, not
# used by default: tests/test_gpu_fastlaunch.py checks both give the same 128 bytes). cuda.h's
# enum values, which tests/test_fastlaunch.py checks against the binding's enums:
CT_DATA_TYPE = {"bf16": 9, "u8": 0}                  # CU_TENSOR_MAP_DATA_TYPE_{BFLOAT16,UINT8}
CT_SWIZZLE = {SWIZZLE_NONE: 0, SWIZZLE_32B: 1, SWIZZLE_64B: 2, SWIZZLE_128B: 3}
CT_INTERLEAVE_NONE, CT_L2_PROMOTION_128B, CT_OOB_FILL_NONE = 0, 2, 0
TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 128        # CUtensorMap: 16 words, alignas(128)


class RawTensorMap:
    """128 bytes of an encoded CUtensorMap in memory of our own, 128-byte aligned; getPtr()
    as the binding's CUtensorMap has it (what pack_params and the Launchers read)."""

    __slots__ = ("_buffer", "address")

    def __init__(self):
        self._buffer = (ctypes.c_char * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
        base = ctypes.addressof(self._buffer)
        self.address = base + (-base) % TENSOR_MAP_ALIGN

    def getPtr(self) -> int:                         # noqa: N802 (the binding's name)
        return self.address

    def to_bytes(self) -> bytes:
        return ctypes.string_at(self.address, TENSOR_MAP_BYTES)


def encode_args(tmap: RawTensorMap, ptr: int, dims, byte_strides, box, swizzle: str,
                data_type: str = "bf16") -> tuple:
    """cuTensorMapEncodeTiled's twelve arguments as ctypes values, in cuda.h's order: the
    same figures _encode hands the binding (element strides all 1, no interleave, 128-byte
    L2 promotion, no OOB fill)."""
    rank = len(dims)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    return (ctypes.c_void_p(tmap.address), ctypes.c_int(CT_DATA_TYPE[data_type]), u32(rank),
            ctypes.c_void_p(int(ptr)), (u64 * rank)(*dims),
            (u64 * max(rank - 1, 1))(*byte_strides), (u32 * rank)(*box),
            (u32 * rank)(*([1] * rank)), ctypes.c_int(CT_INTERLEAVE_NONE),
            ctypes.c_int(CT_SWIZZLE[swizzle]), ctypes.c_int(CT_L2_PROMOTION_128B),
            ctypes.c_int(CT_OOB_FILL_NONE))


_ENCODER: list = []


def _ctypes_encoder():
    """libcuda's cuTensorMapEncodeTiled as a ctypes function, or None where it is missing."""
    if not _ENCODER:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _ENCODER.append(fn)
    return _ENCODER[0]


def encode_tiled_ctypes(ptr: int, dims, byte_strides, box, swizzle: str, *,
                        data_type: str = "bf16", name: str = "tensor", encoder=None
                        ) -> RawTensorMap:
    """encode_tiled's map (uncached) through ctypes on libcuda; `encoder`: the C function
    (None: libcuda's). Raises what _encode raises: ValueError for a bad swizzle or box row,
    CudaError for a driver refusal, NoGpuError without libcuda."""
    from .errors import CudaError, NoGpuError
    check_base(ptr, name)
    row_bytes = box[0] * (ELEMENT_BYTES if data_type == "bf16" else 1)
    _check_swizzle(swizzle, row_bytes, name)
    fn = encoder if encoder is not None else _ctypes_encoder()
    if fn is None:
        raise NoGpuError("ptxattn: libcuda.so.1 (cuTensorMapEncodeTiled) is not loadable")
    tmap = RawTensorMap()
    err = fn(*encode_args(tmap, ptr, dims, byte_strides, box, swizzle, data_type))
    if err:
        raise CudaError(int(err), f"cuTensorMapEncodeTiled({name}: dims={tuple(dims)}, "
                                  f"strides={tuple(byte_strides)}, box={tuple(box)})")
    return tmap
