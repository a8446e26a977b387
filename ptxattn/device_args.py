"""Device arguments of the FlashAttention-style entry points (flash_attn_with_kvcache,
flash_attn_varlen_func): bf16 views of CUDA arrays, int32 / float32 device vectors (lengths,
offsets, block tables, an LSE out) from torch, DLPack or __cuda_array_interface__, host int32
data (NumPy, CPU tensors), and the stream a call runs on. Each reader raises a TypeError or
ValueError naming the argument; none touches the device memory it describes."""

from __future__ import annotations

import math
import sys

import numpy as np

from . import driver, tensors
from .plan import caller_stream as _caller_stream
from .tensors import BF16, DeviceArray


def is_torch(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def bf16_view(name: str, obj, stream: int) -> DeviceArray:
    """A device view of a bf16 CUDA array (torch, DLPack, __cuda_array_interface__)."""
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{name}: expected a CUDA array, got a NumPy (host) array; "
                        "flash_attn_with_kvcache works on device caches in place (copy host "
                        "data with ptxattn.from_numpy)")
    if not (isinstance(obj, DeviceArray) or hasattr(obj, "__dlpack__")
            or hasattr(obj, "__cuda_array_interface__")):
        raise TypeError(f"{name}: expected a CUDA array (DLPack or __cuda_array_interface__), "
                        f"got {type(obj).__name__}")
    arr = tensors.as_device_array(obj, name=name, stream=stream)
    if arr.dtype != BF16:
        raise TypeError(f"{name}: expected dtype bfloat16, got {arr.dtype}")
    return arr


class Vector:
    """A non-bf16 device array (int32 lengths, a float32 LSE out): address and geometry."""

    def __init__(self, ptr, shape, strides, device, owner):
        self.ptr, self.shape, self.strides = int(ptr), tuple(shape), tuple(strides)
        self.device, self.owner = device, owner


_DL_CODES = {"int32": (tensors.kDLInt, 32), "float32": (tensors.kDLFloat, 32)}
_TYPESTRS = {"int32": "<i4", "float32": "<f4"}


def foreign(name: str, obj, dtype: str, stream: int) -> Vector:
    """A device array of `dtype` from torch, DLPack or __cuda_array_interface__ (a host array
    or another dtype is a TypeError naming the argument; a null address of a non-empty array
    a ValueError)."""
    vec = _foreign(name, obj, dtype, stream)
    if vec.ptr == 0 and math.prod(vec.shape):
        raise ValueError(f"{name}: a null device pointer (address 0) for an array of shape "
                         f"{vec.shape}; expected the address of its device memory")
    return vec


def _foreign(name: str, obj, dtype: str, stream: int) -> Vector:
    if is_torch(obj):
        torch = sys.modules["torch"]
        if obj.dtype != getattr(torch, dtype):
            raise TypeError(f"{name}: expected dtype {dtype}, got {obj.dtype}")
        if not obj.is_cuda:
            raise TypeError(f"{name}: expected a CUDA tensor, got one on {obj.device}")
        current = tensors.torch_current_stream(obj.get_device())
        if current != stream:
            driver.stream_wait(stream, current)
        return Vector(obj.data_ptr(), obj.shape, obj.stride(), obj.get_device(), obj)
    if isinstance(obj, DeviceArray):
        if obj.dtype != np.dtype(dtype):
            raise TypeError(f"{name}: expected dtype {dtype}, got {obj.dtype}")
        return Vector(obj.ptr, obj.shape, obj.strides, obj.device, obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None and not hasattr(obj, "__dlpack__"):
        if cai.get("typestr") != _TYPESTRS[dtype]:
            raise TypeError(f"{name}: expected dtype {dtype} (typestr {_TYPESTRS[dtype]!r}), "
                            f"got typestr {cai.get('typestr')!r}")
        shape = tuple(int(n) for n in cai["shape"])
        strides = (tensors.contiguous_strides(shape) if cai.get("strides") is None
                   else tuple(int(s) // 4 for s in cai["strides"]))
        return Vector(cai["data"][0] or 0, shape, strides, None, obj)
    if hasattr(obj, "__dlpack__"):
        return from_dlpack(name, obj, dtype, stream)
    raise TypeError(f"{name}: expected a CUDA {dtype} array, got {type(obj).__name__}")


def from_dlpack(name: str, obj, dtype: str, stream: int) -> Vector:
    """Consume a DLPack capsule of `dtype` (tensors' capsule structs; the importer there
    takes bf16 only). The consumed tensor's deleter runs when the returned view's owner goes."""
    if hasattr(obj, "__dlpack_device__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) not in (tensors.kDLCUDA, tensors.kDLCUDAManaged):
            raise TypeError(f"{name}: expected a CUDA array, got one on "
                            f"{tensors._device_name(int(dev_type))} memory")
    s = 1 if stream == 0 else stream
    try:
        capsule = obj.__dlpack__(stream=s, max_version=tensors.DLPACK_VERSION)
    except TypeError:
        capsule = obj.__dlpack__(stream=s)
    addr = id(capsule)
    for versioned in (True, False):
        if tensors._capsule_is_valid(addr, tensors._NAME[versioned]):
            break
    else:
        raise TypeError(f"{name}: __dlpack__ did not return an unused DLPack capsule")
    pointer = tensors._capsule_get_pointer(addr, tensors._NAME[versioned])
    managed = (tensors.DLManagedTensorVersioned if versioned
               else tensors.DLManagedTensor).from_address(pointer)
    tensors._capsule_set_name(addr, tensors._USED_NAME[versioned])
    holder = tensors._Imported(capsule, pointer, managed.deleter, obj)
    t = managed.dl_tensor
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (*_DL_CODES[dtype], 1):
        raise TypeError(f"{name}: expected dtype {dtype}, got "
                        f"{tensors._dtype_name(t.dtype.code, t.dtype.bits, t.dtype.lanes)}")
    if t.device.device_type not in (tensors.kDLCUDA, tensors.kDLCUDAManaged):
        raise TypeError(f"{name}: expected a CUDA array, got one on "
                        f"{tensors._device_name(t.device.device_type)} memory")
    shape = tuple(t.shape[:t.ndim])
    strides = tuple(t.strides[:t.ndim]) if t.strides else tensors.contiguous_strides(shape)
    return Vector((t.data or 0) + t.byte_offset, shape, strides, t.device.device_id, holder)


def host_int32(name: str, obj):
    """A NumPy int32 array of a host argument (NumPy, or a CPU torch tensor), else None."""
    if is_torch(obj) and not obj.is_cuda:
        torch = sys.modules["torch"]
        if obj.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype int32 (FlashAttention's), got {obj.dtype}")
        obj = obj.numpy()
    if isinstance(obj, np.ndarray):
        tensors.refuse_masked(name, obj)
        if obj.dtype != np.int32:
            raise TypeError(f"{name}: expected dtype int32 (FlashAttention's), got {obj.dtype}")
        return np.ascontiguousarray(obj)
    return None


def call_stream(q, arrays, stream) -> tuple[int, object]:
    """(handle, object): torch's current stream for torch tensors (stream= must be None then:
    torch code chooses streams with torch.cuda.stream), else stream=, else the framework's."""
    if is_torch(q):
        if not q.is_cuda:
            raise TypeError(f"q: expected a CUDA tensor, got one on {q.device}")
        if stream is not None:
            raise TypeError("stream: torch tensors run on torch's current stream; choose it "
                            "with `with torch.cuda.stream(s):` (stream= is for other arrays)")
        return tensors.torch_current_stream(q.get_device()), None
    if stream is None:
        stream = _caller_stream(arrays)
    return driver.stream_handle(stream), stream
