"""Tensor maps: what cuTensorMapEncodeTiled was given, in the 128 bytes it returns, and the
box geometry a TMA load or store walks.

The fake driver encodes its arguments into the map's 16 words itself (self-describing, with a
magic word and a checksum), so a map copied into parameter space, into global memory or
between processes still decodes; a map whose bytes were not made by the encoder (or were
corrupted) is rejected.

Geometry (CUDA driver API, cuTensorMapEncodeTiled): dims[0] is the innermost (contiguous)
dimension; strides[i] (bytes) are those of dims 1..rank-1; a box of boxDim[i] elements
(sampled every elementStrides[i]) lands in shared memory densely, innermost first; elements
whose coordinates fall outside [0, dim) read as zero (or NaN with the NaN_REQUEST_ZERO_FMA fill)
and are not written by a store. With 32/64/128-byte swizzle each 16-byte chunk of the box at
shared address a goes to a ^ (((a >> 7) & (span / 16 - 1)) << 4): the same address-bit pattern
wgmma descriptors use, so the two agree wherever the tile sits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x31554D4558545450        # "PTXEMU1" little-endian-ish tag
DTYPE_BYTES = {"UINT8": 1, "UINT16": 2, "UINT32": 4, "INT32": 4, "UINT64": 8, "INT64": 8,
               "FLOAT16": 2, "FLOAT32": 4, "FLOAT64": 8, "BFLOAT16": 2, "FLOAT32_FTZ": 4,
               "TFLOAT32": 4, "TFLOAT32_FTZ": 4}
SWIZZLE_BYTES = {"NONE": 0, "32B": 32, "64B": 64, "128B": 128}


@dataclass(frozen=True)
class TensorMap:
    dtype: str                    # "BFLOAT16", ...
    rank: int
    address: int
    dims: tuple                   # elements, innermost first
    strides: tuple                # bytes, dims 1..rank-1
    box: tuple
    element_strides: tuple
    interleave: str               # "NONE", "16B", "32B"
    swizzle: str                  # "NONE", "32B", "64B", "128B"
    l2_promotion: str
    oob_fill: str                 # "NONE" (zeros) or "NAN_REQUEST_ZERO_FMA"

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def box_elements(self) -> tuple:
        """Elements per dimension that one box brings: ceil(box / element stride)."""
        return tuple(-(-b // e) for b, e in zip(self.box, self.element_strides))

    @property
    def box_bytes(self) -> int:
        n = 1
        for x in self.box_elements:
            n *= x
        return n * self.element_bytes

    def describe(self) -> str:
        return (f"tensor map {self.dtype} rank {self.rank} at 0x{self.address:x}: dims "
                f"{self.dims}, strides {self.strides}, box {self.box}, swizzle {self.swizzle}")

    # ------------------------------------------------------------------ the 128 bytes
    def encode(self) -> list[int]:
        names = sorted(DTYPE_BYTES)
        words = [0] * 16
        words[0] = MAGIC
        words[1] = self.address
        for i in range(5):
            words[2 + i] = self.dims[i] if i < self.rank else 0
        for i in range(4):
            words[7 + i] = self.strides[i] if i < self.rank - 1 else 0
        box = list(self.box) + [0] * (5 - self.rank)
        est = list(self.element_strides) + [0] * (5 - self.rank)
        words[11] = box[0] | box[1] << 16 | box[2] << 32 | box[3] << 48
        words[12] = (box[4] | sum(e << (16 + 4 * i) for i, e in enumerate(est))
                     | self.rank << 40 | names.index(self.dtype) << 48)
        words[13] = (["NONE", "16B", "32B"].index(self.interleave)
                     | list(SWIZZLE_BYTES).index(self.swizzle) << 8
                     | ["NONE", "L2_64B", "L2_128B", "L2_256B"].index(self.l2_promotion) << 16
                     | ["NONE", "NAN_REQUEST_ZERO_FMA"].index(self.oob_fill) << 24)
        words[14] = _checksum(words[:14])
        words[15] = 0
        return words

    @classmethod
    def decode(cls, words) -> "TensorMap | None":
        words = [int(x) for x in words]
        if len(words) != 16 or words[0] != MAGIC or words[14] != _checksum(words[:14]):
            return None
        names = sorted(DTYPE_BYTES)
        rank = (words[12] >> 40) & 0xFF
        box_all = [words[11] & 0xFFFF, (words[11] >> 16) & 0xFFFF, (words[11] >> 32) & 0xFFFF,
                   (words[11] >> 48) & 0xFFFF, words[12] & 0xFFFF]
        est = [(words[12] >> (16 + 4 * i)) & 0xF for i in range(5)]
        return cls(dtype=names[(words[12] >> 48) & 0xFF], rank=rank, address=words[1],
                   dims=tuple(words[2:2 + rank]), strides=tuple(words[7:7 + rank - 1]),
                   box=tuple(box_all[:rank]), element_strides=tuple(est[:rank]),
                   interleave=["NONE", "16B", "32B"][words[13] & 0xFF],
                   swizzle=list(SWIZZLE_BYTES)[(words[13] >> 8) & 0xFF],
                   l2_promotion=["NONE", "L2_64B", "L2_128B", "L2_256B"][(words[13] >> 16) & 0xFF],
                   oob_fill=["NONE", "NAN_REQUEST_ZERO_FMA"][(words[13] >> 24) & 0xFF])


def _checksum(words) -> int:
    h = 0xCBF29CE484222325
    for x in words:
        h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def validate(t: TensorMap) -> str | None:
    """Why cuTensorMapEncodeTiled would reject these arguments (CUDA_ERROR_INVALID_VALUE), or
    None. The rules of the driver API documentation."""
    if not 1 <= t.rank <= 5:
        return f"rank {t.rank} (1 to 5)"
    if t.interleave != "NONE" and t.rank < 3:
        return "interleaved layouts need rank >= 3"
    align = 32 if t.interleave == "32B" else 16
    if t.address % align:
        return f"global address 0x{t.address:x} is not {align}-byte aligned"
    for i, d in enumerate(t.dims):
        if not 1 <= d <= 1 << 32:
            return f"dims[{i}] = {d} (1 to 2^32)"
    for i, s in enumerate(t.strides):
        if s % align or s >= 1 << 40 or s <= 0:
            return (f"strides[{i}] = {s} bytes: a positive multiple of {align} below 2^40 is "
                    f"required")
    for i, b in enumerate(t.box):
        if not 1 <= b <= 256:
            return f"boxDim[{i}] = {b} (1 to 256)"
    for i, e in enumerate(t.element_strides):
        if not 1 <= e <= 8:
            return f"elementStrides[{i}] = {e} (1 to 8)"
    inner = t.box[0] * t.element_bytes
    if t.interleave == "NONE" and inner % 16:
        return f"boxDim[0] * element size = {inner} bytes is not a multiple of 16"
    span = SWIZZLE_BYTES[t.swizzle]
    if span and t.interleave == "NONE" and inner > span:
        return f"the inner box ({inner} bytes) exceeds the {t.swizzle} swizzle span"
    if t.oob_fill == "NAN_REQUEST_ZERO_FMA" and t.dtype not in (
            "FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16", "FLOAT32_FTZ", "TFLOAT32",
            "TFLOAT32_FTZ"):
        return "the NaN OOB fill needs a floating-point data type"
    return None


def box_offsets(t: TensorMap, coords) -> tuple[np.ndarray, np.ndarray]:
    """(byte offsets from the map's address, in-bounds mask) of every box element, in the order
    they sit in shared memory (innermost fastest)."""
    if t.interleave != "NONE":
        from .errors import Unsupported
        raise Unsupported(f"interleaved tensor maps ({t.interleave})")
    counts = t.box_elements
    offs = np.zeros(1, np.int64)
    ok = np.ones(1, np.bool_)
    # build outermost first so that the innermost index varies fastest
    for d in reversed(range(t.rank)):
        idx = int(coords[d]) + np.arange(counts[d], dtype=np.int64) * t.element_strides[d]
        inb = (idx >= 0) & (idx < t.dims[d])
        stride = t.element_bytes if d == 0 else t.strides[d - 1]
        offs = (offs[:, None] + idx[None, :] * stride).reshape(-1)
        ok = (ok[:, None] & inb[None, :]).reshape(-1)
    return offs, ok


def swizzle_addresses(addr: np.ndarray, swizzle: str) -> np.ndarray:
    """Apply a 16-byte-chunk XOR swizzle to shared addresses (uint64 or int64 arrays)."""
    span = SWIZZLE_BYTES[swizzle]
    if not span:
        return addr
    mask = span // 16 - 1
    return addr ^ (((addr >> 7) & mask) << 4)
