"""cuLaunchKernelEx called through ctypes: the launch without cuda.bindings' per-call work.

The binding's cuLaunchKernelEx converts its Python arguments on every call (the config
object, the CUfunction object, the kernelParams form) and returns a tuple; session 9 measured
9.65 us a launch on the H200's host. Here the CUlaunchConfig is a ctypes structure built once
per launch geometry (cuda.h's layout: LaunchConfig, LaunchAttribute below), the function and
stream are raw pointers, and a call passes four machine words to libcuda's own symbol.

What goes to the driver is byte for byte what the binding passes (tests/test_fastlaunch.py
compares the structures against the binding's C memory), so the two paths are identical in
effect; the knob PTXATTN_LAUNCH=binding sends every launch through the binding (a
measurement knob, and the way back should a driver ever disagree). ctypes.CDLL releases the
GIL around the call, as the binding does: a launch that waits for a full queue blocks only
its own thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

ENV = "PTXATTN_LAUNCH"               # "binding": every launch through cuda.bindings
# cuda.bindings' own switch to the per-thread default stream (it then resolves the _ptsz
# entry points): a launch on stream 0 would mean another stream here, so the binding goes
PER_THREAD_ENV = "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM"
LIBRARY = "libcuda.so.1"
SYMBOL = "cuLaunchKernelEx"

# cuda.h: CUlaunchAttributeID
CLUSTER_DIMENSION = 4
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class LaunchAttributeValue(ctypes.Union):
    """cuda.h's CUlaunchAttributeValue: 64 bytes (char pad[64]), 8-byte aligned (its
    CUaccessPolicyWindow holds a pointer); the two members ptxattn sets."""
    _fields_ = [("pad", ctypes.c_char * 64), ("_align", ctypes.c_void_p),
                ("clusterDim", _Dim3), ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id (an enum: int), char pad[8 - sizeof(id)], value."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (56 bytes: hStream at 32, attrs at 40, numAttrs at 48)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class Config:
    """A CUlaunchConfig of our own and the attribute array it points at (kept together: the
    driver reads both at every launch). Never mutated after it is built."""

    __slots__ = ("struct", "attrs", "address")

    def __init__(self, grid, block, smem_bytes: int, stream: int, *, cluster=(1, 1, 1),
                 programmatic: bool = False):
        attrs = []
        if tuple(cluster) != (1, 1, 1):
            a = LaunchAttribute(id=CLUSTER_DIMENSION)
            a.value.clusterDim = _Dim3(*cluster)
            attrs.append(a)
        if programmatic:
            a = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        self.attrs = (LaunchAttribute * max(len(attrs), 1))(*attrs)
        s = self.struct = LaunchConfig()
        s.gridDimX, s.gridDimY, s.gridDimZ = grid
        s.blockDimX, s.blockDimY, s.blockDimZ = block
        s.sharedMemBytes = int(smem_bytes)
        s.hStream = int(stream) or None
        if attrs:
            s.attrs = ctypes.cast(self.attrs, ctypes.POINTER(LaunchAttribute))
        s.numAttrs = len(attrs)
        self.address = ctypes.addressof(s)

    @classmethod
    def of_binding(cls, config) -> "Config":
        """The same launch as a cuda.bindings CUlaunchConfig (the attributes ptxattn uses:
        cluster dimensions, programmatic stream serialization; anything else raises)."""
        cluster, programmatic = (1, 1, 1), False
        for attr in list(config.attrs)[:int(config.numAttrs)]:
            if int(attr.id) == CLUSTER_DIMENSION:
                c = attr.value.clusterDim
                cluster = (int(c.x), int(c.y), int(c.z))
            elif int(attr.id) == PROGRAMMATIC_STREAM_SERIALIZATION:
                programmatic = bool(attr.value.programmaticStreamSerializationAllowed)
            else:
                raise ValueError(f"launch attribute {int(attr.id)}: not supported by the "
                                 "ctypes launch")
        return cls((int(config.gridDimX), int(config.gridDimY), int(config.gridDimZ)),
                   (int(config.blockDimX), int(config.blockDimY), int(config.blockDimZ)),
                   int(config.sharedMemBytes), int(config.hStream), cluster=cluster,
                   programmatic=programmatic)


_LOCK = threading.Lock()
_FUNCTION: list = []          # [the ctypes function or None], filled on first use
_RAW: list = []               # [the same symbol without argtypes, or None]


def wanted() -> bool:
    """Whether launches may go through ctypes (not PTXATTN_LAUNCH=binding, not the
    binding's per-thread default stream)."""
    if os.environ.get(ENV, "").strip().lower() == "binding":
        return False
    return os.environ.get(PER_THREAD_ENV, "0").strip() in ("", "0")


def function():
    """libcuda's cuLaunchKernelEx as a ctypes function (config, CUfunction, void**, void**)
    -> CUresult, or None where the library or the symbol is missing (then the binding)."""
    if not _FUNCTION:
        with _LOCK:
            if not _FUNCTION:
                _FUNCTION.append(_load())
    return _FUNCTION[0]


def raw_function():
    """The same cuLaunchKernelEx without argtypes: it takes ctypes.c_void_p objects as they
    are (no conversion of Python ints per call), for launches whose arguments are all fixed
    up front (Frozen)."""
    if not _RAW:
        with _LOCK:
            if not _RAW:
                fn = None
                try:
                    fn = ctypes.CDLL(LIBRARY)[SYMBOL]      # [name]: a new object, own argtypes
                    fn.restype = ctypes.c_int
                except (OSError, AttributeError):
                    fn = None
                _RAW.append(fn)
    return _RAW[0]


class Frozen:
    """One kernel launch with every argument fixed: the config, the function and a void*[]
    that nothing rewrites (frozen_params), so a call is the driver call alone and needs no
    lock. `keep` holds what the array points at (holders, tensor maps) for as long as the
    launch may be called."""

    __slots__ = ("_fn", "_args", "_keep", "what")

    def __init__(self, fn, config_address: int, handle: int, params_address: int, keep,
                 what: str):
        self._fn, self._keep, self.what = fn, keep, what
        self._args = (ctypes.c_void_p(config_address), ctypes.c_void_p(handle),
                      ctypes.c_void_p(params_address), None)

    def __call__(self) -> int:
        """The launch's CUresult (0: enqueued)."""
        return self._fn(*self._args)


def frozen_params(template, slots: dict) -> tuple[int, tuple]:
    """A copy of a packed void*[] (`template`: a ctypes c_void_p array, driver.pack_params'
    layout) with some entries replaced: `slots` maps an index to an address (a tensor map's
    128 bytes) or to a ctypes value (held here, the entry pointing at it). Returns (the
    copy's address, what must stay alive with it)."""
    array = (ctypes.c_void_p * len(template))(*template)
    held = []
    for index, value in slots.items():
        if isinstance(value, int):
            array[index] = value
        else:
            held.append(value)
            array[index] = ctypes.addressof(value)
    return ctypes.addressof(array), (array, tuple(held))


def _load():
    try:
        lib = ctypes.CDLL(LIBRARY)
        fn = getattr(lib, SYMBOL)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


def _reset_for_tests() -> None:
    with _LOCK:
        _FUNCTION.clear()
        _RAW.clear()
