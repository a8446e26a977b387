"""PTX types as NumPy dtypes, and the arithmetic whose rounding NumPy does not give directly.

Rounding, as implemented:
  - add/sub/mul/div/sqrt .rn on f32: IEEE round-to-nearest-even (NumPy float32, or float64 then
    float32, which is exact for these ops since 53 >= 2*24 + 2);
  - fma.rn.f32: the product exact in float64, the sum rounded in float64 and then to float32;
    this differs from one rounding only when the float64 sum is inexact and lands exactly on a
    float32 midpoint (~2^-29 of random operands);
  - directed modes (.rz .rm .rp) on add/sub/mul/fma: exact, from the float64 result and its
    TwoSum error term;
  - .ftz: subnormal inputs and results flushed to sign-preserving zero; .sat: clamped to [0, 1]
    with NaN -> 0;
  - ex2.approx / lg2.approx / rcp.approx / rsqrt.approx / sin / cos / tanh .approx: the exact
    function in float64 rounded to float32 (the hardware is within 2 ulp of it; a kernel that
    passes here but depends on the last ulp is not proven by this);
  - bf16, f16, e4m3, e5m2: ml_dtypes / NumPy conversions, round-to-nearest-even; .satfinite
    clamps to the largest finite value (NaN stays NaN), .relu clamps negatives to +0.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)

# PTX type -> the NumPy dtype its values are computed in
DTYPE = {
    "pred": np.dtype(np.bool_),
    "b8": np.dtype(np.uint8), "u8": np.dtype(np.uint8), "s8": np.dtype(np.int8),
    "b16": np.dtype(np.uint16), "u16": np.dtype(np.uint16), "s16": np.dtype(np.int16),
    "f16": np.dtype(np.float16), "bf16": np.dtype(np.uint16),
    "e4m3x2": np.dtype(np.uint16), "e5m2x2": np.dtype(np.uint16),
    "b32": np.dtype(np.uint32), "u32": np.dtype(np.uint32), "s32": np.dtype(np.int32),
    "f32": np.dtype(np.float32), "f16x2": np.dtype(np.uint32), "bf16x2": np.dtype(np.uint32),
    "tf32": np.dtype(np.uint32),
    "b64": np.dtype(np.uint64), "u64": np.dtype(np.uint64), "s64": np.dtype(np.int64),
    "f64": np.dtype(np.float64),
}
UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
            8: np.dtype(np.uint64)}
SIGNED = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32),
          8: np.dtype(np.int64)}
FLOAT_TYPES = ("f16", "f32", "f64", "bf16")
F32_TINY = np.float32(np.finfo(np.float32).tiny)
F32 = np.float32
F64 = np.float64


def is_signed(t: str) -> bool:
    return t[0] == "s"


def is_float(t: str) -> bool:
    return t in FLOAT_TYPES


def bits_of(t: str) -> int:
    return DTYPE[t].itemsize * 8


def poison(dtype: np.dtype, n: int) -> np.ndarray:
    """What an uninitialised register holds: all ones (a NaN for floats, -1 for ints)."""
    if dtype == np.bool_:
        return np.zeros(n, np.bool_)
    return np.full(n * dtype.itemsize, 0xFF, np.uint8).view(dtype)


# ----------------------------------------------------------------------------- float helpers

def ftz(x: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to sign-preserving zero."""
    sub = np.abs(x) < F32_TINY
    if not sub.any():
        return x
    return np.where(sub & (x != 0), np.copysign(np.float32(0), x), x)


def sat(x: np.ndarray) -> np.ndarray:
    """Clamp to [0, 1]; NaN -> 0."""
    return np.where(np.isnan(x), x.dtype.type(0), np.clip(x, 0, 1)).astype(x.dtype)


def round_directed(s: np.ndarray, e: np.ndarray, mode: str) -> np.ndarray:
    """float32 of the exact value s + e (s float64, e its float64 error term) in `mode`."""
    r = s.astype(F32)
    if mode == "rn":
        return r
    d = (s - r.astype(F64)) + e          # exact value minus r (sign is right)
    if mode == "rm":
        fix = d < 0
        to = np.float32(-np.inf)
    elif mode == "rp":
        fix = d > 0
        to = np.float32(np.inf)
    elif mode == "rz":
        v = s + e
        fix = ((v > 0) & (d < 0)) | ((v < 0) & (d > 0))
        to = np.float32(0)
    else:
        raise ValueError(mode)
    if fix.any():
        r = np.where(fix, np.nextafter(r, to), r)
    return r


def two_sum(a: np.ndarray, b: np.ndarray):
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def add_f32(a, b, mode="rn"):
    if mode == "rn":
        return a + b
    s, e = two_sum(a.astype(F64), b.astype(F64))
    return round_directed(s, e, mode)


def mul_f32(a, b, mode="rn"):
    if mode == "rn":
        return a * b
    p = a.astype(F64) * b.astype(F64)           # exact: 48 significant bits
    return round_directed(p, np.zeros_like(p), mode)


def fma_f32(a, b, c, mode="rn"):
    p = a.astype(F64) * b.astype(F64)
    if mode == "rn":
        return (p + c.astype(F64)).astype(F32)
    s, e = two_sum(p, c.astype(F64))
    return round_directed(s, e, mode)


def f64_to_f32(x):
    return x.astype(F32)


# ----------------------------------------------------------------------------- narrow floats

def f32_to_bf16_bits(x: np.ndarray, mode: str = "rn", relu: bool = False,
                     satfinite: bool = False) -> np.ndarray:
    x = np.asarray(x, F32)
    if relu:
        x = np.where(np.isnan(x), x, np.maximum(x, np.float32(0)))
    if mode == "rz":
        bits = x.view(np.uint32) >> np.uint32(16)
        nan = np.isnan(x)
        out = bits.astype(np.uint16)
        out = np.where(nan, np.uint16(0x7FFF), out)
    elif mode == "rn":
        out = x.astype(BF16).view(np.uint16)
    else:
        raise ValueError(f"cvt to bf16 with rounding .{mode}")
    if satfinite:
        big = np.isinf(out.view(BF16))
        out = np.where(big, np.where(x < 0, np.uint16(0xFF7F), np.uint16(0x7F7F)), out)
    return out.astype(np.uint16)


def pack_bf16x2(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """cvt.rn.bf16x2.f32 d, hi, lo: two float32 rounded to bf16, hi in the upper half."""
    hi, lo = np.broadcast_arrays(np.asarray(hi, F32), np.asarray(lo, F32))
    return np.stack((lo, hi), axis=-1).astype(BF16).view(np.uint32).reshape(hi.shape)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(F32)


def f32_to_f16_bits(x, mode="rn", relu=False, satfinite=False):
    x = np.asarray(x, F32)
    if relu:
        x = np.where(np.isnan(x), x, np.maximum(x, np.float32(0)))
    if mode != "rn":
        raise ValueError(f"cvt to f16 with rounding .{mode}")
    if satfinite:
        x = np.where(np.isnan(x), x, np.clip(x, -65504.0, 65504.0)).astype(F32)
    return x.astype(np.float16).view(np.uint16)


def f32_to_fp8_bits(x, fmt: np.dtype, relu=False, satfinite=True):
    x = np.asarray(x, F32)
    if relu:
        x = np.where(np.isnan(x), x, np.maximum(x, np.float32(0)))
    big = float(ml_dtypes.finfo(fmt).max)
    if satfinite:
        x = np.where(np.isnan(x), x, np.clip(x, -big, big)).astype(F32)
    return x.astype(fmt).view(np.uint8)


def fp8_bits_to_f32(b, fmt: np.dtype):
    return np.asarray(b, np.uint8).view(fmt).astype(F32)


def pack2_16(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return (hi.astype(np.uint32) << np.uint32(16)) | lo.astype(np.uint32)


def pack2_8(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return ((hi.astype(np.uint16) << np.uint16(8)) | lo.astype(np.uint16)).astype(np.uint16)


# ----------------------------------------------------------------------------- integers

def wrap_int(value: int, t: str) -> int:
    """An integer literal as the bits of type t, then read back as t's NumPy value."""
    n = bits_of(t)
    v = int(value) & ((1 << n) - 1)
    if is_signed(t) and v >= 1 << (n - 1):
        v -= 1 << n
    return v


def const_array(value, t: str) -> np.ndarray:
    """A constant of PTX type t, as a 0-d array (it broadcasts over any lanes)."""
    dt = DTYPE[t]
    if dt == np.bool_:
        return np.array(bool(value))
    if dt.kind == "f":
        return np.array(value, dt)
    return np.array(wrap_int(value, t), dt)


def shl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = a.dtype.itemsize * 8
    big = b >= n
    sh = np.minimum(b, n - 1).astype(a.dtype)
    return np.where(big, a.dtype.type(0), a << sh)


def shr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = a.dtype.itemsize * 8
    if a.dtype.kind == "i":                        # arithmetic: sign fill past the width
        return a >> np.minimum(b, n - 1).astype(a.dtype)
    big = b >= n
    sh = np.minimum(b, n - 1).astype(a.dtype)
    return np.where(big, a.dtype.type(0), a >> sh)


def div_trunc(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero (PTX), divisors already checked non-zero."""
    safe = np.where(b == 0, b.dtype.type(1), b)
    if a.dtype.kind == "u":
        return a // safe
    q = np.abs(a.astype(np.int64)) // np.abs(safe.astype(np.int64))
    q = np.where((a < 0) != (safe < 0), -q, q)
    return q.astype(a.dtype)


def rem_trunc(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    safe = np.where(b == 0, b.dtype.type(1), b)
    if a.dtype.kind == "u":
        return a % safe
    q = div_trunc(a, safe)
    return (a - q * safe).astype(a.dtype)


def mul_hi(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = a.dtype.itemsize * 8
    if n <= 32:
        wide = (SIGNED if a.dtype.kind == "i" else UNSIGNED)[a.dtype.itemsize * 2]
        return ((a.astype(wide) * b.astype(wide)) >> wide.type(n)).astype(a.dtype)
    # 64-bit high halves: Python integers (rare)
    out = [(int(x) * int(y)) >> 64 for x, y in zip(a.tolist(), b.tolist())]
    mask = (1 << 64) - 1
    return np.array([v & mask for v in out], np.uint64).view(a.dtype)


def mul_wide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    wide = (SIGNED if a.dtype.kind == "i" else UNSIGNED)[a.dtype.itemsize * 2]
    return a.astype(wide) * b.astype(wide)


def popc(a: np.ndarray) -> np.ndarray:
    x = a.astype(np.uint64)
    count = np.zeros(a.shape, np.uint32)
    for _ in range(a.dtype.itemsize * 8):
        count += (x & np.uint64(1)).astype(np.uint32)
        x >>= np.uint64(1)
    return count


def clz(a: np.ndarray) -> np.ndarray:
    n = a.dtype.itemsize * 8
    x = a.astype(np.uint64)
    out = np.full(a.shape, n, np.uint32)
    for i in range(n):
        hit = ((x >> np.uint64(n - 1 - i)) & np.uint64(1)).astype(bool) & (out == n)
        out = np.where(hit, np.uint32(i), out)
    return out


def brev(a: np.ndarray) -> np.ndarray:
    n = a.dtype.itemsize * 8
    x = a.astype(np.uint64)
    out = np.zeros(a.shape, np.uint64)
    for i in range(n):
        out |= ((x >> np.uint64(i)) & np.uint64(1)) << np.uint64(n - 1 - i)
    return out.astype(UNSIGNED[a.dtype.itemsize]).view(a.dtype)


def bfe(a: np.ndarray, pos: np.ndarray, length: np.ndarray) -> np.ndarray:
    n = a.dtype.itemsize * 8
    out = []
    signed = a.dtype.kind == "i"
    for x, p, l in zip(a.tolist(), pos.tolist(), length.tolist()):
        p, l = int(p) & 0xFF, int(l) & 0xFF
        xu = int(x) & ((1 << n) - 1)
        if l == 0:
            v = 0
        else:
            if p >= n:
                field = 0
                sbit = (xu >> (n - 1)) & 1 if signed else 0
            else:
                field = (xu >> p) & ((1 << l) - 1) if l < 64 else xu >> p
                sbit = (xu >> min(p + l - 1, n - 1)) & 1 if signed else 0
            v = field
            if signed and sbit:
                v = field | (((1 << n) - 1) & ~((1 << l) - 1)) if l < n else field
            v &= (1 << n) - 1
        out.append(v)
    return np.array(out, UNSIGNED[a.dtype.itemsize]).view(a.dtype)


def bfi(a, b, pos, length):
    n = a.dtype.itemsize * 8
    out = []
    for x, y, p, l in zip(a.tolist(), b.tolist(), pos.tolist(), length.tolist()):
        p, l = int(p) & 0xFF, int(l) & 0xFF
        xu, yu = int(x) & ((1 << n) - 1), int(y) & ((1 << n) - 1)
        if l == 0 or p >= n:
            out.append(yu)
            continue
        l = min(l, n - p)
        m = ((1 << l) - 1) << p
        out.append((yu & ~m) | ((xu << p) & m))
    return np.array(out, UNSIGNED[a.dtype.itemsize]).view(a.dtype)


def prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray, mode: str | None) -> np.ndarray:
    """prmt.b32 (default mode only, and the f4e/b4e/rc8/ecl/ecr/rc16 modes)."""
    bytes8 = np.stack([(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] +
                      [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)])
    a, b, c = np.broadcast_arrays(a, b, c)
    bytes8 = np.stack([(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] +
                      [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)])
    out = np.zeros(a.shape, np.uint32)
    lanes = np.arange(a.size)
    if mode is None:
        for i in range(4):
            sel = (c >> np.uint32(4 * i)) & np.uint32(0xF)
            src = bytes8[(sel & np.uint32(7)).astype(np.int64), lanes]
            msb = (src >> np.uint32(7)) & np.uint32(1)
            byte = np.where((sel & np.uint32(8)) != 0, msb * np.uint32(0xFF), src)
            out |= byte.astype(np.uint32) << np.uint32(8 * i)
        return out
    raise ValueError(f"prmt mode .{mode}")
