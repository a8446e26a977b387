"""Device arrays, NumPy copies, and DLPack in both directions (with ctypes).

DeviceArray is the library's only device tensor: a bf16 strided view of
device memory that it owns (a DeviceBuffer) or borrows (an imported DLPack
tensor or __cuda_array_interface__ object, kept alive by `owner`).

DLPack rules followed here (https://dmlc.github.io/dlpack/latest/python_spec.html):
- a producer returns a PyCapsule named "dltensor" (DLManagedTensor) or, when
  the consumer asked with max_version >= (1, 0), "dltensor_versioned"
  (DLManagedTensorVersioned);
- a consumer renames the capsule "used_dltensor[_versioned]" and calls the
  tensor's deleter when done with it; a capsule that dies still unused calls the
  deleter from its destructor;
- `stream` is the consumer's stream: the producer makes its pending work
  visible there (None = legacy default stream, -1 = no synchronisation).

Every struct field is written and read here with ctypes; only the capsule
object and its destructor/deleter come from NumPy's C code (see make_capsule:
a Python-level destructor cannot keep an exception that is in flight).
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from ctypes import POINTER, Structure, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import ml_dtypes
import numpy as np

from . import driver
from .tma import contiguous_strides

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)       # the FP8 path's operands (ptxattn/fp8.py)

kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
kDLInt, kDLUInt, kDLFloat, kDLBfloat = 0, 1, 2, 4
kDLFloat8_e4m3fn = 10                            # DLPack 1.1
# What a DeviceArray may hold, as DLPack (code, bits, lanes).
_DLPACK_CODES = {BF16: (kDLBfloat, 16, 1), np.dtype(np.float32): (kDLFloat, 32, 1),
                 E4M3: (kDLFloat8_e4m3fn, 8, 1)}
DLPACK_FLAG_READ_ONLY = 1
DLPACK_VERSION = (1, 0)
_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host (pinned)", 4: "OpenCL", 7: "Vulkan",
                 8: "Metal", 10: "ROCm", 13: "CUDA managed", 14: "oneAPI"}


# --------------------------------------------------------------------------- C structs

class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32),
                ("dtype", DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


# --------------------------------------------------------------------------- capsule API

# Private prototypes (PYFUNCTYPE: called with the GIL held, Python errors
# raised) so that we never change argtypes on the shared ctypes.pythonapi.
# Capsules are passed by address (id()).
_api = ctypes.pythonapi
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_capsule_get_pointer = ctypes.PYFUNCTYPE(c_void_p, c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, c_void_p, c_void_p)(("PyCapsule_SetName", _api))

_NAME = {False: b"dltensor", True: b"dltensor_versioned"}
# PyCapsule_SetName keeps the pointer: the new names must live forever.
_USED_NAME_BUFFERS = {v: ctypes.create_string_buffer(b"used_" + n) for v, n in _NAME.items()}
_USED_NAME = {v: ctypes.addressof(b) for v, b in _USED_NAME_BUFFERS.items()}


class _Keep(ctypes.c_uint16 * 1):
    """What an exported capsule keeps alive: the producer object and the shape
    and strides arrays its DLTensor points at. Being a ctypes array it has a
    buffer, so a NumPy array can be built on it and hold it as its base."""


def make_capsule(data: int, shape, strides, dtype: tuple[int, int, int],
                 device: tuple[int, int], owner, *, versioned: bool = False,
                 readonly: bool = False):
    """A DLPack capsule over any memory: device=(kDLCUDA, id) for device arrays,
    (kDLCPU, 0) for host memory. `strides` in elements; `owner` is kept alive
    until the consumer calls the deleter (or the capsule dies unconsumed).

    Why the capsule is NumPy's: a capsule often dies while an exception is in
    flight (a consumer that rejects it, e.g. for bf16, drops it and returns
    the error). Its destructor must then save and restore that exception,
    which C can do and a ctypes callback cannot (the callback's return clears
    it). So NumPy's C code makes the capsule, with its exception-safe
    destructor and a deleter that takes the GIL from any thread, over a
    one-element placeholder array whose base is `keep`; then we point every
    DLTensor field (data, device, dtype, shape, strides, flags) at ours. NumPy's
    deleter only frees its struct and drops the placeholder, which drops `keep`.
    """
    ndim = len(shape)
    keep = _Keep()
    keep.owner = owner
    keep.dims = (c_int64 * max(2 * ndim, 1))(*shape, *strides)
    placeholder = np.frombuffer(keep, np.uint16).reshape((1,) * ndim)
    capsule = None
    if versioned:
        try:
            capsule = placeholder.__dlpack__(max_version=DLPACK_VERSION)
        except TypeError:
            pass                      # NumPy < 2.1: legacy capsules only, which DLPack allows
    if capsule is None:
        capsule = placeholder.__dlpack__()
    versioned = bool(_capsule_is_valid(id(capsule), _NAME[True]))
    address = _capsule_get_pointer(id(capsule), _NAME[versioned])
    managed = (DLManagedTensorVersioned if versioned else DLManagedTensor).from_address(address)
    if versioned:
        managed.flags = DLPACK_FLAG_READ_ONLY if readonly else 0
    t = managed.dl_tensor
    t.data = data or None
    t.byte_offset = 0
    t.device.device_type, t.device.device_id = device
    t.ndim = ndim
    t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype
    base = ctypes.addressof(keep.dims)
    t.shape = ctypes.cast(base, POINTER(c_int64))
    t.strides = ctypes.cast(base + 8 * ndim, POINTER(c_int64))
    return capsule


# --------------------------------------------------------------------------- import

# A DLPack deleter, void (*)(void *): one prototype for all (making a ctypes function type per
# call costs more than the call itself).
_DELETER = ctypes.PYFUNCTYPE(None, c_void_p)


class _Imported:
    """Owns a consumed DLPack tensor: calls its deleter when collected."""

    def __init__(self, capsule, address: int, deleter: int | None, producer):
        self.capsule = capsule      # renamed "used_...": kept only so it is visibly alive
        self.address = address
        self.deleter = deleter
        self.producer = producer

    def __del__(self):
        deleter, self.deleter = self.deleter, None
        if deleter:
            try:
                _DELETER(deleter)(self.address)
            except Exception:
                pass


def _dtype_name(code: int, bits: int, lanes: int) -> str:
    base = {kDLInt: "int", kDLUInt: "uint", kDLFloat: "float", kDLBfloat: "bfloat"}.get(code)
    name = f"{base}{bits}" if base else f"DLPack type code {code}, {bits} bits"
    return name if lanes == 1 else f"{name}x{lanes}"


def _device_name(device_type: int) -> str:
    return _DEVICE_NAMES.get(device_type, f"DLPack device type {device_type}")


def _consume_capsule(capsule, producer, name: str, dtype=BF16) -> "DeviceArray":
    addr = id(capsule)
    for versioned in (True, False):
        if _capsule_is_valid(addr, _NAME[versioned]):
            break
    else:
        raise TypeError(f"{name}: __dlpack__ did not return an unused DLPack capsule")
    address = _capsule_get_pointer(addr, _NAME[versioned])
    managed = (DLManagedTensorVersioned if versioned else DLManagedTensor).from_address(address)
    _capsule_set_name(addr, _USED_NAME[versioned])
    # From here on we own the tensor: the holder calls its deleter, also on errors below.
    holder = _Imported(capsule, address, managed.deleter, producer)
    if versioned and managed.version.major > DLPACK_VERSION[0]:
        raise BufferError(f"{name}: DLPack version {managed.version.major}.{managed.version.minor} "
                          "is newer than the 1.x this library reads")
    t = managed.dl_tensor
    dev = (t.device.device_type, t.device.device_id)
    if dev[0] not in (kDLCUDA, kDLCUDAManaged):
        raise TypeError(f"{name}: expected a CUDA device array, got one on "
                        f"{_device_name(dev[0])} memory (pass host data as a NumPy array)")
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != _DLPACK_CODES[dtype]:
        wanted = "bfloat16" if dtype == BF16 else str(dtype)
        raise TypeError(f"{name}: expected dtype {wanted}, got "
                        f"{_dtype_name(t.dtype.code, t.dtype.bits, t.dtype.lanes)} (device arrays "
                        f"are used in place, never converted: cast to {wanted} first)")
    ndim = t.ndim
    shape = tuple(t.shape[:ndim])          # a ctypes pointer slice: one call, plain ints
    strides = (tuple(t.strides[:ndim]) if t.strides
               else contiguous_strides(shape))
    readonly = bool(versioned and managed.flags & DLPACK_FLAG_READ_ONLY)
    return DeviceArray((t.data or 0) + t.byte_offset, shape, strides, device=dev[1],
                       owner=holder, readonly=readonly, dtype=dtype)


def _dlpack_stream_arg(stream: int) -> int:
    # DLPack names CUDA's legacy default stream 1 (0 is disallowed as ambiguous).
    return 1 if stream == 0 else stream


def as_device_array(obj, *, name: str = "array", stream=None, dtype=BF16) -> "DeviceArray":
    """Zero-copy view of a CUDA array from DLPack or __cuda_array_interface__.

    `stream` (an int handle, default: legacy default stream) is where the
    array will be used; a DLPack producer makes its pending writes visible
    there. Raises TypeError for host arrays and for dtypes other than `dtype`
    (bfloat16; float32 for the backward's log-sum-exp input), our own DeviceArrays included
    (a float32 log-sum-exp is no q, k, v or out).
    """
    arr = _import(obj, name, stream, np.dtype(dtype))
    if arr.ptr == 0 and arr.size:
        raise ValueError(f"{name}: a null device pointer (address 0) for an array of shape "
                         f"{tuple(arr.shape)}; expected the address of its device memory")
    return arr


def refuse_masked(name: str, obj) -> None:
    """A NumPy masked array is refused: its data would be used and its mask ignored."""
    if isinstance(obj, np.ma.MaskedArray):
        raise TypeError(f"{name}: expected a plain NumPy array, got a masked array "
                        "(numpy.ma.MaskedArray), whose mask attention would ignore; pass "
                        "array.filled(value) or array.data to say what masked entries hold")


def _import(obj, name: str, stream, dtype: np.dtype) -> "DeviceArray":
    if isinstance(obj, DeviceArray):
        if obj.dtype != dtype:
            wanted = "bfloat16" if dtype == BF16 else str(dtype)
            raise TypeError(f"{name}: expected dtype {wanted}, got {obj.dtype} (a DeviceArray "
                            "of another dtype; device arrays are used in place, never "
                            f"converted: cast to {wanted} first)")
        return obj
    handle = driver.stream_handle(stream)
    fast = _from_torch(obj, handle) if dtype == BF16 else (
        _from_torch(obj, handle, True) if dtype == np.float32 else None)
    if fast is not None:
        return fast
    if hasattr(obj, "__dlpack__"):
        if hasattr(obj, "__dlpack_device__"):
            dev_type, _ = obj.__dlpack_device__()
            if int(dev_type) not in (kDLCUDA, kDLCUDAManaged):
                raise TypeError(f"{name}: expected a CUDA device array, got one on "
                                f"{_device_name(int(dev_type))} memory "
                                "(pass host data as a NumPy array)")
        s = _dlpack_stream_arg(handle)
        try:
            try:
                capsule = obj.__dlpack__(stream=s, max_version=DLPACK_VERSION)
            except TypeError:       # a producer from before DLPack 1.0
                capsule = obj.__dlpack__(stream=s)
        except Exception as e:
            # e.g. torch: "Can't export tensors that require gradient, use tensor.detach()"
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(f"{name}: its __dlpack__ refused to export it: "
                       f"{type(e).__name__}: {e}") from e
        return _consume_capsule(capsule, obj, name, dtype)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(cai, obj, name, dtype)
    raise TypeError(f"{name}: expected a NumPy array or a CUDA array (DLPack or "
                    f"__cuda_array_interface__), got {type(obj).__name__}")


# torch's types once torch is imported: (module, Tensor, bfloat16, strided, raw stream getter,
# float32).
# Remembered per module object (tests put a stand-in module in sys.modules).
_TORCH: tuple | None = None


def _torch_types():
    global _TORCH
    torch = sys.modules.get("torch")
    cached = _TORCH
    if cached is not None and cached[0] is torch:
        return cached
    if torch is None or getattr(torch, "Tensor", None) is None:
        return None
    # the raw handle without building a torch Stream object (what torch's own compiled code
    # reads); None where that private call is missing (the public one is used then)
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    _TORCH = (torch, torch.Tensor, torch.bfloat16, torch.strided, raw,
              getattr(torch, "float32", None))
    return _TORCH


def torch_meta(obj, float32: bool = False) -> tuple | None:
    """(data_ptr, shape, strides, device index) of a plain CUDA bf16 torch.Tensor (float32
    with float32=True: a log-sum-exp) that DLPack would export as it is; None for anything
    else (then DLPack decides, and raises its errors).

    Only exact torch.Tensor objects qualify (not subclasses), without requires_grad, strided,
    not nested, not a conjugate or negative view. data_ptr() includes the storage offset. torch is never
    imported here: a tensor exists only once its module is."""
    types = _TORCH if _TORCH is not None and _TORCH[0] is sys.modules.get("torch") \
        else _torch_types()
    if types is None or type(obj) is not types[1]:
        return None
    if (obj.dtype is not types[5 if float32 else 2] or not obj.is_cuda or obj.requires_grad
            or obj.layout is not types[3] or obj.is_nested or obj.is_conj() or obj.is_neg()):
        return None                 # (a strided nested tensor is a torch.Tensor without sizes)
    return obj.data_ptr(), obj.shape, obj.stride(), obj.get_device()


def torch_ptr(obj, shape: tuple, strides: tuple, device: int) -> int | None:
    """data_ptr() of a tensor that torch_meta reads (the same checks) with exactly this shape
    and these strides on CUDA device `device`; None for anything else (then the caller's full
    path decides, and raises its errors). What a plan's run() pays per tensor of the geometry
    it was validated with: no tuple built, one comparison each for shape and strides."""
    types = _TORCH if _TORCH is not None and _TORCH[0] is sys.modules.get("torch") \
        else _torch_types()
    if types is None or type(obj) is not types[1] or obj.dtype is not types[2]:
        return None
    try:
        # torch_meta's checks in fewer reads: a bf16 tensor carries no conjugate bit (only
        # complex ones do); the stride comparison refuses every non-strided layout (a sparse
        # COO tensor's strides are zeros, the plans' innermost stride is 1; CSR and nested
        # tensors have none and raise)
        if (not obj.is_cuda or obj.get_device() != device or obj.requires_grad
                or obj.is_neg() or obj.stride() != strides or obj.shape != shape):
            return None
    except RuntimeError:
        return None
    return obj.data_ptr()


def torch_current_stream(device: int) -> int:
    """torch's current stream on `device`, as a raw handle."""
    types = _TORCH if _TORCH is not None and _TORCH[0] is sys.modules.get("torch") \
        else _torch_types()
    raw = types[4]
    if raw is not None:
        return int(raw(device))
    return sys.modules["torch"].cuda.current_stream(device).cuda_stream


def _from_torch(obj, stream: int, float32: bool = False) -> "DeviceArray | None":
    """A plain CUDA bf16 (float32=True: float32) torch.Tensor read without a DLPack capsule,
    or None (then DLPack).

    What torch's __dlpack__(stream=s) would give, at a fraction of its host time: the same
    address (data_ptr() includes the storage offset), shape, strides, device, the tensor kept
    alive as the owner, and the same stream handshake (when `stream` is not torch's current
    stream of the device, `stream` waits for the work queued there so far). Only tensors that
    torch_meta reads take this path; anything else (subclasses, requires_grad,
    conjugate/negative views, other dtypes or devices) goes through __dlpack__, which accepts
    it or raises its own error.
    """
    meta = torch_meta(obj, float32)
    if meta is None:
        return None
    ptr, shape, strides, device = meta
    current = torch_current_stream(device)
    if current != stream:
        driver.stream_wait(stream, current)
    return DeviceArray(ptr, shape, strides, device=device, owner=obj,
                       dtype=np.float32 if float32 else BF16)


def _from_cai(cai: dict, obj, name: str, dtype=BF16) -> "DeviceArray":
    typestr = cai.get("typestr", "")
    if dtype != BF16:
        if typestr != dtype.str:
            raise TypeError(f"{name}: expected dtype {dtype} (typestr {dtype.str!r}), got "
                            f"{_describe_typestr(typestr)}")
        typestr = BF16.str      # (checked: the shape and stride handling below is shared)
    # NumPy has no bf16 typestr: the only one a producer can write is ml_dtypes'
    # "<V2" (what np.dtype(ml_dtypes.bfloat16).str says).
    if typestr != BF16.str:
        raise TypeError(f"{name}: expected dtype bfloat16 (typestr {BF16.str!r}), "
                        f"got {_describe_typestr(typestr)} (device arrays are used in place, "
                        "never converted: cast to bfloat16 first)")
    if cai.get("mask") is not None:
        raise TypeError(f"{name}: masked __cuda_array_interface__ arrays are not supported")
    shape = tuple(int(n) for n in cai["shape"])
    ptr, readonly = cai["data"]
    if cai.get("strides") is None:
        strides = contiguous_strides(shape)
    else:
        byte_strides = tuple(int(s) for s in cai["strides"])
        if any(s % dtype.itemsize for s in byte_strides):
            raise ValueError(f"{name}: strides {byte_strides} (bytes) are not whole "
                             f"{'bf16' if dtype == BF16 else dtype} elements")
        strides = tuple(s // dtype.itemsize for s in byte_strides)
    # The producer's stream (v3): its pending writes must be waited for before use.
    # 1 and 2 name the legacy and per-thread default streams; handle 1 is really 0.
    producer_stream = cai.get("stream")
    if producer_stream == 1:
        producer_stream = 0
    return DeviceArray(int(ptr or 0), shape, strides, device=None, owner=obj,
                       readonly=bool(readonly), producer_stream=producer_stream, dtype=dtype)


def _describe_typestr(typestr: str) -> str:
    try:
        return f"{np.dtype(typestr)} (typestr {typestr!r})"
    except TypeError:
        return repr(typestr)


# --------------------------------------------------------------------------- DeviceArray

class DeviceArray:
    """A strided view of device memory (strides in elements): bf16 for q, k, v and out,
    float32 for the log-sum-exp, float8_e4m3fn for the FP8 path's operands.

    `stream` is the stream of the last write enqueued by this library; readers
    on another stream (DLPack consumers, to_numpy) are ordered after it.
    """

    def __init__(self, ptr: int, shape, strides=None, *, device: int | None = 0, owner=None,
                 readonly: bool = False, stream: int | None = None,
                 producer_stream: int | None = None, dtype=BF16):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _DLPACK_CODES:
            raise TypeError(f"DeviceArray: dtype {self.dtype} is not supported "
                            "(bfloat16, float32 or float8_e4m3fn)")
        self.ptr = int(ptr)
        self.shape = tuple(map(int, shape))
        self.strides = tuple(map(int, strides)) if strides is not None \
            else contiguous_strides(self.shape)
        self.device = device
        self.owner = owner
        self.readonly = readonly
        self.stream = stream
        self.stream_owner = None      # keeps the object behind `stream` alive, if any
        self.producer_stream = producer_stream

    def used_on(self, stream) -> None:
        """Work on `stream` may read or write this array: memory this library allocated in
        stream order is then not reused before that work (see driver.DeviceBuffer)."""
        used_on = getattr(self.owner, "used_on", None)
        if used_on is not None:
            used_on(stream)

    def free(self) -> None:
        """Release the device memory now, if this array owns it (arrays from empty() and
        from_numpy()); views of other producers' memory are left alone. Later use of the
        array is an error the caller owns; the finalizer would free the same memory."""
        from .driver import DeviceBuffer
        if isinstance(self.owner, DeviceBuffer):
            self.owner.close()
            self.ptr = 0

    # -- shape facts
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return all(s == c for n, s, c in zip(self.shape, self.strides, contiguous_strides(self.shape))
                   if n != 1)

    def span(self) -> tuple[int, int]:
        """[first, last+1) byte addresses this view can touch."""
        return _span(self.ptr, self.shape, self.strides, self.dtype.itemsize)

    def __repr__(self) -> str:
        return (f"DeviceArray(shape={self.shape}, strides={self.strides}, dtype={self.dtype}, "
                f"device={self.device}, ptr=0x{self.ptr:x})")

    # -- copies
    def to_numpy(self) -> np.ndarray:
        """Copy to the host as an ml_dtypes.bfloat16 array (waits for pending writes)."""
        from . import driver
        if self.size == 0:
            return np.empty(self.shape, self.dtype)
        driver.context()
        if self.is_contiguous:
            host = np.empty(self.shape, self.dtype)
            driver.memcpy_dtoh(host, self.ptr, stream=self.stream)
            return host
        lo, hi = self.span()
        item = self.dtype.itemsize
        raw = np.empty((hi - lo) // item, self.dtype)
        driver.memcpy_dtoh(raw, lo, stream=self.stream)
        offset = (self.ptr - lo) // item
        view = np.lib.stride_tricks.as_strided(
            raw[offset:], self.shape, tuple(s * item for s in self.strides))
        return np.ascontiguousarray(view)

    def fill_u16(self, value: int, stream=None) -> None:
        """Set every element's 16 bits (0xFFFF = NaN poison); contiguous arrays only."""
        from . import driver
        if not self.is_contiguous:
            raise ValueError("fill_u16 needs a contiguous array")
        driver.memset_u16(self.ptr, value, self.size, stream=stream)
        self.stream = driver.stream_handle(stream)   # None: the legacy default stream, 0

    # -- DLPack export
    def __dlpack_device__(self) -> tuple[int, int]:
        return (kDLCUDA, self.device or 0)

    def __dlpack__(self, stream=None, *, max_version=None, dl_device=None, copy=None):
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray lives on {self.__dlpack_device__()}, "
                              f"cannot export to {tuple(dl_device)}")
        if copy:
            raise BufferError("DeviceArray exports views only (copy=True is not supported)")
        # The consumer's stream: None and 1 both mean the legacy default stream
        # (handle 0); -1 asks for no synchronisation.
        if stream != -1 and self.stream is not None:
            from . import driver
            consumer = 0 if stream in (None, 1) else int(stream)
            if consumer != self.stream:
                driver.context()
                driver.stream_wait(consumer, self.stream)
                self.used_on(consumer)
        versioned = max_version is not None and tuple(max_version) >= DLPACK_VERSION
        return make_capsule(self.ptr, self.shape, self.strides, _DLPACK_CODES[self.dtype],
                            self.__dlpack_device__(), self, versioned=versioned,
                            readonly=self.readonly)


@functools.lru_cache(maxsize=4096)
def _span(ptr: int, shape: tuple, strides: tuple, item: int) -> tuple[int, int]:
    # remembered: the overlap checks of every call with out= ask it for the same arrays
    if math.prod(shape) == 0:
        return (ptr, ptr)
    lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))
    return (ptr + lo * item, ptr + (hi + 1) * item)


def empty(shape, *, stream=None, dtype=BF16, stream_owner=None) -> DeviceArray:
    """An uninitialised contiguous device array (bf16 unless dtype says float32).

    With a stream (a handle or stream object, 0 the legacy default stream) the memory is
    stream-ordered: allocated and, when the array is freed or collected, released on that
    stream (driver.DeviceBuffer), without waiting for the GPU. Without one, cuMemAlloc."""
    shape = tuple(map(int, shape))
    size = math.prod(shape)
    handle = None if stream is None else driver.stream_handle(stream)
    buf = driver.DeviceBuffer(size * np.dtype(dtype).itemsize, stream=handle,
                              stream_owner=stream_owner)
    device = driver.context().ordinal
    return DeviceArray(buf.ptr, shape, device=device, owner=buf, dtype=dtype, stream=handle)


def fresh(nbytes: int, shape: tuple, strides: tuple, dtype: np.dtype, device: int,
          stream: int, stream_owner=None) -> DeviceArray:
    """empty() for a caller that already holds every field in its final form (attention()'s
    steady path: plain int tuples, a supported np.dtype, a raw handle): the same array,
    without converting and checking them again on every call."""
    buf = driver.DeviceBuffer(nbytes, stream=stream, stream_owner=stream_owner)
    arr = DeviceArray.__new__(DeviceArray)
    arr.dtype, arr.ptr, arr.shape, arr.strides, arr.device = dtype, buf.ptr, shape, strides, device
    arr.owner, arr.readonly, arr.stream, arr.stream_owner = buf, False, stream, None
    arr.producer_stream = None
    return arr


def to_bf16(array: np.ndarray, name: str = "array") -> np.ndarray:
    """bf16 as is; float32 rounded to bf16 (float64 through float32); else TypeError."""
    if array.dtype == BF16:
        return array
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    if array.dtype == np.float32:
        return array.astype(BF16)
    raise TypeError(f"{name}: expected dtype bfloat16 (or float32/float64, rounded to bfloat16), "
                    f"got {array.dtype}")


def from_numpy(array: np.ndarray, *, stream=None) -> DeviceArray:
    """Copy a NumPy array (bf16, or float32/float64 rounded to bf16) to the device.

    With a stream the copy is asynchronous on it and ordered before later work there.
    """
    from . import driver
    host = np.ascontiguousarray(to_bf16(np.asarray(array)))
    out = empty(host.shape, stream=stream)
    driver.memcpy_htod(out.ptr, host, stream=stream)
    # Without a stream the copy went to the legacy default stream (a pageable copy may
    # still be in flight when cuMemcpyHtoD returns): readers on other streams wait for it.
    out.stream = driver.stream_handle(stream)
    out.staging = host    # an async copy from pageable memory is staged, but keep it anyway
    return out
