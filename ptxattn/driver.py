"""Thin layer over cuda.bindings.driver.

Every call is checked (`check`), every resource is owned by an object that
releases it, and nothing touches the driver until it is first needed: the
bindings are imported by `cu()`, the context is made by `context()`.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import threading

from . import fastlaunch
from .errors import CudaError, JitError, NoGpuError

_NO_GPU = "ptxattn: no CUDA GPU available"
_JIT_LOG_BYTES = 1 << 20          # big enough for a verbose log of a whole-program JIT
_DEFAULT_DYNAMIC_SMEM = 48 * 1024  # above this a kernel must opt in per function

# Kernel parameter types for the tuple form of kernelParams: ((values...), (types...)).
# A CUtensorMap goes by value with type None; a device pointer as a Python int
# with c_void_p (a CUdeviceptr object there is the address of the Python
# wrapper, which the H200 answered with CUDA_ERROR_ILLEGAL_ADDRESS).
BY_VALUE = None
PTR = ctypes.c_void_p
U64 = ctypes.c_uint64
U32 = ctypes.c_uint32
S32 = ctypes.c_int32
F32 = ctypes.c_float

_cu_module = None


def cu():
    """cuda.bindings.driver, imported on first use."""
    global _cu_module
    if _cu_module is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise NoGpuError(f"{_NO_GPU} (cuda-python is not installed: {e})") from None
        _cu_module = driver
    return _cu_module


def _is_binding_launch(fn) -> bool:
    """Whether fn is cuda.bindings' own cuLaunchKernelEx (its compiled function): where cu()
    answers another (a test's pretend driver, the emulator, anything patched in, even before
    the first cu()), launches go to that one, never through ctypes to libcuda."""
    return (type(fn).__name__ == "cython_function_or_method"
            and getattr(fn, "__module__", None) == "cuda.bindings.driver"
            and getattr(fn, "__name__", None) == "cuLaunchKernelEx")


def check(result, call: str):
    """Unpack a binding's (CUresult, *values) tuple; raise CudaError unless success."""
    err = int(result[0])
    if err != 0:
        raise CudaError(err, call)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else tuple(result[1:])


# --------------------------------------------------------------------------- context

class Context:
    """The primary context of one device, retained and made current on demand.

    The primary context is the one PyTorch, CuPy and the runtime API use, so
    memory and streams they made work here unchanged (and vice versa).
    """

    def __init__(self, ordinal: int):
        d = cu()
        self.ordinal = ordinal
        self.device = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        self.handle = check(d.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._address = int(self.handle)      # compared on every call (make_current)
        self.alive = True
        self.make_current()
        attr = d.CUdevice_attribute
        self.compute_capability = (
            self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
        self.sm_count = self.attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.max_smem_optin = self.attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        # the production walk's sections fit a share of it (tile_walk.host_section)
        self.l2_bytes = self.attribute(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        # stream-ordered allocation (cuMemAllocAsync) from the device's default pool
        self.memory_pools = bool(self.attribute(attr.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED))

    def make_current(self) -> None:
        # Cheap when it already is (the usual case, also when torch/cupy made
        # this same primary context current): one cuCtxGetCurrent.
        if not self.alive:
            raise NoGpuError(f"{_NO_GPU} (the CUDA context was released at interpreter exit)")
        d = _cu_module
        err, current = d.cuCtxGetCurrent()
        if err:
            raise CudaError(int(err), "cuCtxGetCurrent")
        if int(current) != self._address:
            check(d.cuCtxSetCurrent(self.handle), "cuCtxSetCurrent")

    def attribute(self, attr) -> int:
        return int(check(cu().cuDeviceGetAttribute(attr, self.device), "cuDeviceGetAttribute"))

    @property
    def arch(self) -> str:
        """The PTX target with arch-specific features: sm_90a on Hopper, sm_100a on B200."""
        major, minor = self.compute_capability
        suffix = "a" if major >= 9 else ""
        return f"sm_{major}{minor}{suffix}"


_CONTEXT: Context | None = None
_CONTEXT_LOCK = threading.Lock()


def _open_context() -> Context:
    d = cu()
    try:
        result = d.cuInit(0)
    except Exception as e:  # cuda-bindings raises when libcuda.so cannot be loaded at all
        raise NoGpuError(f"{_NO_GPU} (the CUDA driver library libcuda could not be loaded: "
                         f"{type(e).__name__})") from None
    if int(result[0]) != 0:
        raise NoGpuError(f"{_NO_GPU} (cuInit returned {_result_name(result[0])})")
    count = int(check(d.cuDeviceGetCount(), "cuDeviceGetCount"))
    if count == 0:
        raise NoGpuError(f"{_NO_GPU} (the driver reports no devices)")
    text = os.environ.get("PTXATTN_DEVICE", "0").strip() or "0"
    try:
        ordinal = int(text)
    except ValueError:
        raise NoGpuError(f"{_NO_GPU} (PTXATTN_DEVICE={text!r} is not a device number)") from None
    if not 0 <= ordinal < count:
        raise NoGpuError(f"{_NO_GPU} (PTXATTN_DEVICE={ordinal}, but the driver reports "
                         f"{count} device(s))")
    return Context(ordinal)


def context() -> Context:
    """The process-wide context, created on first use and made current on this thread."""
    global _CONTEXT
    if _CONTEXT is None:
        with _CONTEXT_LOCK:
            if _CONTEXT is None:
                _CONTEXT = _open_context()
                atexit.register(_at_exit, _CONTEXT)
    _CONTEXT.make_current()
    return _CONTEXT


def _at_exit(ctx: Context) -> None:
    # Objects freed during interpreter teardown must not call into a driver that
    # may be unloading: the process exit releases their memory anyway.
    ctx.alive = False


def gpu_available() -> bool:
    try:
        context()
        return True
    except NoGpuError:
        return False


def _reset_for_tests() -> None:
    """Forget the context (tests that monkeypatch cuInit). It is marked dead first: a buffer
    of it collected later must not free its address in whatever context comes next (the
    emulator's next one hands out the same addresses)."""
    global _CONTEXT
    if _CONTEXT is not None:
        _CONTEXT.alive = False
    _CONTEXT = None
    _MODULES.clear()
    _CONFIGS.clear()


def _result_name(err) -> str:
    try:
        return cu().CUresult(int(err)).name
    except Exception:
        return f"CUresult {int(err)}"


def device_info() -> dict:
    """What a benchmark record needs to say which GPU and driver it ran on."""
    ctx = context()
    d = cu()
    attr = d.CUdevice_attribute

    def maybe(a):
        # Some attributes (clock rates) are deprecated in recent toolkits: report None.
        try:
            return ctx.attribute(a)
        except Exception:
            return None

    name = check(d.cuDeviceGetName(256, ctx.device), "cuDeviceGetName")
    version = int(check(d.cuDriverGetVersion(), "cuDriverGetVersion"))
    return {
        "name": bytes(name).split(b"\0", 1)[0].decode(errors="replace"),
        "device": ctx.ordinal,
        "compute_capability": ctx.compute_capability,
        "arch": ctx.arch,
        "sm_count": ctx.sm_count,
        "max_smem_optin": ctx.max_smem_optin,
        "l2_bytes": maybe(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        "total_memory": int(check(d.cuDeviceTotalMem(ctx.device), "cuDeviceTotalMem")),
        "driver_version": version,
        "driver_version_str": f"{version // 1000}.{version % 1000 // 10}",
        "clock_khz": maybe(attr.CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
        "memory_clock_khz": maybe(attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
        "memory_bus_bits": maybe(attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
    }


# --------------------------------------------------------------------------- modules

class Function:
    """A kernel of a loaded module."""

    def __init__(self, module: "Module", name: str, handle):
        self.module = module
        self.name = name
        self.handle = handle
        self._dynamic_smem = _DEFAULT_DYNAMIC_SMEM

    def attribute(self, attr) -> int:
        return int(check(cu().cuFuncGetAttribute(attr, self.handle), "cuFuncGetAttribute"))

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to more than 48 KiB of dynamic shared memory (once per size)."""
        if nbytes > self._dynamic_smem:
            a = cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu().cuFuncSetAttribute(self.handle, a, int(nbytes)),
                  f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) for {self.name}")
            self._dynamic_smem = nbytes

    @property
    def num_regs(self) -> int:
        return self.attribute(cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def local_bytes(self) -> int:
        return self.attribute(cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)

    @property
    def static_smem(self) -> int:
        return self.attribute(cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)

    @property
    def max_threads(self) -> int:
        return self.attribute(cu().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)


class Module:
    """A JIT-compiled PTX module; `jit_log` is the info log ("Used N registers")."""

    def __init__(self, handle, label: str, jit_log: str, sha256: str):
        self.handle = handle
        self.label = label
        self.jit_log = jit_log
        self.sha256 = sha256
        self._functions: dict[str, Function] = {}

    def function(self, name: str = "ptxattn_fwd") -> Function:
        if name not in self._functions:
            handle = check(cu().cuModuleGetFunction(self.handle, name.encode()),
                           f"cuModuleGetFunction({name!r}) in {self.label}")
            self._functions[name] = Function(self, name, handle)
        return self._functions[name]


_MODULES: dict[tuple[int, str], Module] = {}
_MODULES_LOCK = threading.RLock()   # one JIT per text, also when threads ask at once


def load_module(ptx_text: str, label: str, stage=None, defines: dict | None = None) -> Module:
    """JIT-compile PTX with the driver (whole program, keeps setmaxnreg).

    Cached in-process by (device, sha256 of the text). The driver has its own
    disk cache: a hit there returns an empty info log (CUDA_CACHE_DISABLE=1
    forces a fresh compile when the register report is wanted).
    """
    ctx = context()
    sha = hashlib.sha256(ptx_text.encode()).hexdigest()
    key = (ctx.ordinal, sha)
    with _MODULES_LOCK:
        if key not in _MODULES:
            _MODULES[key] = _jit(ptx_text, label, sha, stage, defines)
        return _MODULES[key]


def _jit(ptx_text: str, label: str, sha: str, stage, defines) -> Module:
    d = cu()
    opt = d.CUjit_option
    info_log, error_log = bytearray(_JIT_LOG_BYTES), bytearray(_JIT_LOG_BYTES)
    options = [opt.CU_JIT_INFO_LOG_BUFFER, opt.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
               opt.CU_JIT_ERROR_LOG_BUFFER, opt.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
               opt.CU_JIT_LOG_VERBOSE]
    values = [info_log, _JIT_LOG_BYTES, error_log, _JIT_LOG_BYTES, 1]
    image = ptx_text.encode() + b"\0"   # the JIT reads PTX as a NUL-terminated string
    result = d.cuModuleLoadDataEx(image, len(options), options, values)
    if int(result[0]) != 0:
        log = _c_string(error_log) or _c_string(info_log)
        annotated, where = log, []
        if stage is not None:
            try:
                from . import ptx
                annotated, where = ptx.annotate(ptx.expand(stage, defines), log)
            except Exception:
                pass  # a log without source lines beats no error at all
        raise JitError(label, _result_name(result[0]), log, annotated, where)
    return Module(result[1], label, _c_string(info_log), sha)


def _c_string(buf: bytearray) -> str:
    return bytes(buf).split(b"\0", 1)[0].decode(errors="replace").strip()


# --------------------------------------------------------------------------- launch

_CONFIGS: dict[tuple, tuple] = {}     # (grid, block, smem, cluster, stream) -> (config, attrs)
_CONFIGS_MAX = 1024
# Held to evict and insert (lookups need no lock): between iter() and next() of the eviction
# another thread's insert would raise "dictionary changed size during iteration".
_CONFIGS_LOCK = threading.Lock()


def _launch_config(grid, block, smem_bytes: int, cluster, stream: int):
    """A CUlaunchConfig for this geometry and stream, built once and shared (never mutated
    after it is cached: cuLaunchKernelEx only reads it)."""
    key = (grid, block, smem_bytes, cluster, stream)
    hit = _CONFIGS.get(key)
    if hit is not None:
        return hit
    d = cu()
    config = d.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem_bytes
    config.hStream = d.CUstream(stream)
    attrs = []
    if cluster != (1, 1, 1):
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
        attrs.append(attr)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    with _CONFIGS_LOCK:
        if len(_CONFIGS) >= _CONFIGS_MAX:
            _CONFIGS.pop(next(iter(_CONFIGS)), None)     # oldest first; rebuilt if needed again
        _CONFIGS[key] = (config, attrs)
    return config, attrs


def pack_params(params) -> tuple[int, tuple]:
    """The tuple form ((values...), (types...)) as a void*[] of our own: (its address, what
    must stay alive while it is used). What the binding does on every call, done once: a
    by-value CUtensorMap points at its own 128 bytes (getPtr), a number at a ctypes copy."""
    values, types = params
    holders = []
    addresses = []
    for value, ctype in zip(values, types):
        if ctype is None:
            addresses.append(int(value.getPtr()))
            holders.append(value)
        else:
            held = ctype(value)
            holders.append(held)
            addresses.append(ctypes.addressof(held))
    array = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)
    holders.append(array)
    return ctypes.addressof(array), tuple(holders)


class LaunchSpec:
    """A launch with everything built up front, so `launch()` only enqueues.

    `params` is the tuple form ((values...), (types...)) of kernelParams. The first launch
    hands that to the binding (which packs it in C: the cheapest for a one-shot call); from
    the second launch on, a void*[] packed once (pack_params) goes instead, through ctypes
    where kernel_launch allows it (fastlaunch), else through the binding.
    """

    def __init__(self, function: Function, grid, block, smem_bytes: int, params,
                 *, cluster=(1, 1, 1), stream=0):
        grid, block, cluster = _dim3(grid), _dim3(block), _dim3(cluster)
        config, self._attrs = _launch_config(grid, block, int(smem_bytes), cluster,
                                             stream_handle(stream))
        self.function, self.grid, self.block, self.cluster = function, grid, block, cluster
        self.smem_bytes, self.params, self.config = int(smem_bytes), params, config
        self._launch = cu().cuLaunchKernelEx
        self._launched = False
        # (address, holders) of pack_params, one object: a launch reads it once, so the
        # address it passes and what keeps that address alive can never come from two packs
        # (two threads launching at once may each pack; either result is complete)
        self._packed = None
        self._fast = None           # the packed launch (kernel_launch), with the first pack

    @property
    def _what(self) -> str:     # only built for an error message
        return (f"cuLaunchKernelEx({self.function.module.label}.{self.function.name}, "
                f"grid={self.grid}, block={self.block}, cluster={self.cluster}, "
                f"smem={self.smem_bytes})")

    def __call__(self) -> None:
        # The hot path of a benchmark: one driver call, one integer check.
        packed = self._packed
        if packed is None and self._launched:
            packed = self._packed = pack_params(self.params)
            if _is_binding_launch(self._launch):
                self._fast = _fast_launch(self.config, self.function, self._what)
        fast = self._fast
        if fast is not None and packed is not None:
            fast(packed[0])
            return
        args = self.params if packed is None else packed[0]
        result = self._launch(self.config, self.function.handle, args, 0)
        if int(result[0]) != 0:
            raise CudaError(int(result[0]), self._what)
        self._launched = True


class FastLaunch:
    """One kernel's launch of one config through ctypes (fastlaunch): call(params_address)
    enqueues it with that void*[] as kernelParams, or raises CudaError(what)."""

    __slots__ = ("_fn", "_config", "_address", "_handle", "what")

    def __init__(self, fn, config: fastlaunch.Config, handle: int, what: str):
        self._fn, self._config, self._handle, self.what = fn, config, handle, what
        self._address = config.address

    def __call__(self, params: int) -> None:
        err = self._fn(self._address, self._handle, params, None)
        if err:
            raise CudaError(err, self.what)

    def frozen(self, params: int, keep):
        """This launch with the void*[] at `params` (nothing rewrites it; `keep`: what it
        points at) as a zero-argument call that returns the CUresult."""
        fn = fastlaunch.raw_function()
        if fn is None:
            return FrozenLaunch(self, params, keep)
        return fastlaunch.Frozen(fn, self._address, self._handle, params,
                                 (keep, self._config), self.what)


class BindingLaunch:
    """The same through cuda.bindings' cuLaunchKernelEx (as cu() answers it now)."""

    __slots__ = ("_fn", "config", "_handle", "what")

    def __init__(self, config, function: Function, what: str):
        self._fn, self.config, self._handle, self.what = (cu().cuLaunchKernelEx, config,
                                                          function.handle, what)

    def __call__(self, params: int) -> None:
        err = int(self._fn(self.config, self._handle, params, 0)[0])
        if err:
            raise CudaError(err, self.what)

    def frozen(self, params: int, keep):
        return FrozenLaunch(self, params, keep)


def launch_frozen(launches) -> None:
    """Enqueue frozen launches (FastLaunch.frozen's, BindingLaunch.frozen's) in order; a
    CUresult other than 0 raises CudaError naming the launch."""
    for launch in launches:
        err = launch()
        if err:
            raise CudaError(err, launch.what)


class FrozenLaunch:
    """A FastLaunch's or BindingLaunch's frozen() where fastlaunch.Frozen does not apply: the
    same zero-argument call through the launch object (which raises its own CudaError;
    0 otherwise, as Frozen's CUresult)."""

    __slots__ = ("_launch", "_params", "_keep", "what")

    def __init__(self, launch, params: int, keep):
        self._launch, self._params, self._keep, self.what = launch, params, keep, launch.what

    def __call__(self) -> int:
        self._launch(self._params)             # raises CudaError itself
        return 0


def _fast_launch(config, function: Function, what: str) -> FastLaunch | None:
    """A FastLaunch of this binding config where launches may go through ctypes: cu() is
    cuda.bindings itself (no pretend driver), the knob allows it, libcuda has the symbol."""
    if not _is_binding_launch(cu().cuLaunchKernelEx) or not fastlaunch.wanted():
        return None
    fn = fastlaunch.function()
    if fn is None:
        return None
    return FastLaunch(fn, fastlaunch.Config.of_binding(config), int(function.handle), what)


def launch_mode() -> str:
    """How kernel_launch launches now: "ctypes", or "binding (why)" (for benchmark records)."""
    if not _is_binding_launch(cu().cuLaunchKernelEx):
        return "binding (a pretend driver)"
    if not fastlaunch.wanted():
        return f"binding ({fastlaunch.ENV} or {fastlaunch.PER_THREAD_ENV})"
    return "ctypes" if fastlaunch.function() is not None else "binding (no libcuda symbol)"


def kernel_launch(config, function: Function, what: str):
    """A launch of `function` with this cuda.bindings CUlaunchConfig taking a void*[]
    address per call: through ctypes (FastLaunch) where that is identical in effect, else
    through the binding (BindingLaunch; PTXATTN_LAUNCH=binding forces it)."""
    return _fast_launch(config, function, what) or BindingLaunch(config, function, what)


def launch(function: Function, grid, block, smem_bytes: int, params, *,
           cluster=(1, 1, 1), stream=0) -> None:
    LaunchSpec(function, grid, block, smem_bytes, params, cluster=cluster, stream=stream)()


def max_active_clusters(function: Function, block, smem_bytes: int, cluster, stream=0) -> int:
    """How many clusters of `cluster` CTAs (each `block` threads, `smem_bytes` of dynamic shared
    memory) of `function` the device runs at once (cuOccupancyMaxActiveClusters): the bound of
    a persistent grid of clusters. 0 when none fits."""
    cluster = _dim3(cluster)
    config, _attrs = _launch_config(cluster, _dim3(block), int(smem_bytes), cluster,
                                    stream_handle(stream))
    return int(check(cu().cuOccupancyMaxActiveClusters(function.handle, config),
                     f"cuOccupancyMaxActiveClusters({function.name}, cluster={cluster})"))


def _dim3(v) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, int) else tuple(v)
    return tuple(int(x) for x in v) + (1,) * (3 - len(v))


# --------------------------------------------------------------------------- streams, events

def stream_handle(stream) -> int:
    """The raw CUstream of None (legacy default stream: 0), an int, a Stream, or
    a foreign stream object: torch/cupy `.cuda_stream`, cupy `.ptr`,
    cuda.core `__cuda_stream__()` or `.handle`. Pure Python: no driver call."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise TypeError(f"stream: expected a stream or an int handle, got {stream!r}")
    if isinstance(stream, int):
        return _handle_in_range(stream)
    if isinstance(stream, Stream):
        return stream.handle
    if hasattr(stream, "__cuda_stream__"):
        return _handle_in_range(int(stream.__cuda_stream__()[1]))
    for name in ("cuda_stream", "handle", "ptr"):
        value = getattr(stream, name, None)
        if value is not None:
            return _handle_in_range(int(value))
    if hasattr(stream, "getPtr"):       # a cuda.bindings CUstream
        return int(stream)
    raise TypeError("stream: expected None, an int handle or a stream object with "
                    f".cuda_stream/.handle/.ptr, got {type(stream).__name__}")


_HANDLE_LIMIT = 1 << 64          # a CUstream is a 64-bit pointer


def _handle_in_range(handle: int) -> int:
    if not 0 <= handle < _HANDLE_LIMIT:
        raise ValueError(f"stream: expected a handle in [0, 2**64) (a CUstream is a 64-bit "
                         f"pointer), got {handle}")
    return handle


class _ClosedWhenCollected:
    """close() runs when the object is collected; a destructor must not raise."""

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Stream(_ClosedWhenCollected):
    """A CUDA stream: created (and destroyed) here, or a borrowed handle."""

    def __init__(self, handle: int | None = None, *, non_blocking: bool = True):
        if handle is None:
            context()
            flags = cu().CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else 0
            self.handle = int(check(cu().cuStreamCreate(int(flags)), "cuStreamCreate"))
            self.owned = True
        else:
            self.handle = stream_handle(handle)
            self.owned = False

    @classmethod
    def wrap(cls, stream) -> "Stream":
        return stream if isinstance(stream, Stream) else cls(stream_handle(stream))

    def synchronize(self) -> None:
        context()
        check(cu().cuStreamSynchronize(cu().CUstream(self.handle)), "cuStreamSynchronize")

    def close(self) -> None:
        handle, self.handle = self.handle, 0
        if self.owned and handle and _CONTEXT is not None and _CONTEXT.alive:
            _CONTEXT.make_current()
            check(cu().cuStreamDestroy(cu().CUstream(handle)), "cuStreamDestroy")


    def __int__(self) -> int:
        return self.handle

    @property
    def cuda_stream(self) -> int:
        return self.handle


class Event(_ClosedWhenCollected):
    def __init__(self, timing: bool = True):
        context()
        flags = 0 if timing else int(cu().CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.handle = check(cu().cuEventCreate(flags), "cuEventCreate")

    def record(self, stream=None) -> "Event":
        check(cu().cuEventRecord(self.handle, cu().CUstream(stream_handle(stream))), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        check(cu().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None and _CONTEXT is not None and _CONTEXT.alive:
            check(cu().cuEventDestroy(handle), "cuEventDestroy")



def elapsed_ms(start: Event, end: Event) -> float:
    end.synchronize()
    return float(check(cu().cuEventElapsedTime(start.handle, end.handle), "cuEventElapsedTime"))


class EventPair:
    """start() ... stop() around work on one stream; elapsed_ms() waits for stop."""

    def __init__(self):
        self.begin, self.end = Event(), Event()

    def start(self, stream=None) -> None:
        self.begin.record(stream)

    def stop(self, stream=None) -> None:
        self.end.record(stream)

    def elapsed_ms(self) -> float:
        return elapsed_ms(self.begin, self.end)


def is_capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a CUDA graph (False where the driver cannot
    say: a pretend driver without the call)."""
    d = cu()
    try:
        err, status = d.cuStreamIsCapturing(d.CUstream(stream))
    except Exception:                      # noqa: BLE001 - a driver without the call
        return False
    if int(err):
        return False
    return int(status) != int(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


def stream_wait(consumer, producer) -> None:
    """Make `consumer` wait for the work enqueued so far on `producer`."""
    c, p = stream_handle(consumer), stream_handle(producer)
    if c == p:
        return
    event = Event(timing=False).record(p)
    check(cu().cuStreamWaitEvent(cu().CUstream(c), event.handle, 0), "cuStreamWaitEvent")
    event.close()  # safe: the driver frees it once the recorded work completes


def synchronize(stream=None) -> None:
    """Wait for a stream, or for the whole context when stream is None."""
    context()
    if stream is None:
        check(cu().cuCtxSynchronize(), "cuCtxSynchronize")
    else:
        check(cu().cuStreamSynchronize(cu().CUstream(stream_handle(stream))), "cuStreamSynchronize")


# --------------------------------------------------------------------------- memory

_DEFAULT_STREAMS = (0, 1, 2)   # legacy default (0 and its alias 1), per-thread default (2)


class DeviceBuffer(_ClosedWhenCollected):
    """Device bytes, freed by close() or when collected (while the context lives).

    stream=None: cuMemAlloc / cuMemFree (the free waits for the whole device). A stream that
    is sure to outlive the buffer (the legacy or per-thread default stream, or a stream whose
    object `stream_owner` holds: a ptxattn.Stream, a torch/cupy stream): stream-ordered,
    cuMemAllocAsync / cuMemFreeAsync on that stream from the device's default memory pool, so
    neither call waits for the GPU and the memory is reused in stream order. A bare handle of
    any other stream gets cuMemAlloc: nothing guarantees that stream still exists at the free,
    and a free enqueued on a destroyed stream is undefined behaviour.
    Lifetime across streams: when the memory is handed to another stream (a DLPack consumer's,
    a later launch's; `used_on`), the free first waits for the whole device. Waiting for just
    that stream would be cheaper, but its handle may be gone by then, and a wait on a destroyed
    stream crashed the process on the H200 (2026-12-01): a device wait is always defined.
    """

    def __init__(self, nbytes: int, stream=None, stream_owner=None):
        self.nbytes = int(nbytes)
        self.ptr = 0
        self._ctx = None
        self.stream = None if stream is None else stream_handle(stream)
        self.stream_owner = stream_owner
        self._used_elsewhere = False
        # a stream object held by the buffer keeps its stream; a bare int handle does not
        lives_on = self.stream in _DEFAULT_STREAMS or not (
            stream_owner is None or isinstance(stream_owner, int))
        if self.nbytes:
            self._ctx = context()
            d = cu()
            if self.stream is not None and lives_on and getattr(self._ctx, "memory_pools", False):
                self.ptr = int(check(d.cuMemAllocAsync(self.nbytes, d.CUstream(self.stream)),
                                     f"cuMemAllocAsync({self.nbytes})"))
            else:
                self.stream = None          # no pools on this device: plain cuMemAlloc
                self.ptr = int(check(d.cuMemAlloc(self.nbytes), f"cuMemAlloc({self.nbytes})"))

    def used_on(self, stream) -> None:
        """Note that work on `stream` (a handle or stream object) may use this memory."""
        if self.stream is not None:
            handle = stream_handle(stream)
            if handle != self.stream:
                self._used_elsewhere = True

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if not ptr or self._ctx is None or not self._ctx.alive:
            return
        self._ctx.make_current()
        d = cu()
        if self.stream is None:
            check(d.cuMemFree(d.CUdeviceptr(ptr)), "cuMemFree")
            return
        on = self.stream
        try:
            owner_alive = self.stream in _DEFAULT_STREAMS or \
                stream_handle(self.stream_owner) == self.stream
        except Exception:
            owner_alive = False
        if not owner_alive:
            # the caller closed its stream object (a ptxattn.Stream reads 0 then): its handle
            # is gone, so wait for the device and free on the legacy default stream
            on = 0
        if self._used_elsewhere or not owner_alive:
            # queued work on another stream may still read or write it (see the class note)
            check(d.cuCtxSynchronize(), "cuCtxSynchronize")
        check(d.cuMemFreeAsync(d.CUdeviceptr(ptr), d.CUstream(on)), "cuMemFreeAsync")
        self.stream_owner = None

    def __repr__(self) -> str:
        return f"DeviceBuffer(ptr=0x{self.ptr:x}, nbytes={self.nbytes})"


def zeroed_scratch(ctx, nbytes: int, stream: int) -> tuple:
    """`nbytes` of zeroed device memory for one launch on `stream` (a raw handle): from the
    device's stream-ordered pool (cuMemAllocAsync), zeroed there (cuMemsetD8Async), so work
    queued on other streams never sees it. Returns (address, its CUdeviceptr, the CUstream),
    for free_scratch right after the launch is queued: the free is enqueued while the stream
    surely exists (the caller has just launched on it), which a free left to garbage
    collection could not promise. Under CUDA-graph capture the three become an allocation,
    memset and free node of the graph, so every replay gets its own memory. A device without
    memory pools: cuMemAlloc and cuMemFree, which waits for the device."""
    d = _cu_module or cu()
    on = d.CUstream(stream)
    if getattr(ctx, "memory_pools", False):
        err, dptr = d.cuMemAllocAsync(nbytes, on)
    else:
        err, dptr = d.cuMemAlloc(nbytes)
    if int(err):
        raise CudaError(int(err), f"cuMemAllocAsync({nbytes}) (per-call scratch)")
    (err,) = d.cuMemsetD8Async(dptr, 0, nbytes, on)
    if int(err):
        free_scratch(ctx, (0, dptr, on))
        raise CudaError(int(err), "cuMemsetD8Async (per-call scratch)")
    return int(dptr), dptr, on


def free_scratch(ctx, scratch: tuple) -> None:
    """Free what zeroed_scratch returned, in stream order after the work queued so far."""
    d = _cu_module or cu()
    _, dptr, on = scratch
    (err,) = (d.cuMemFreeAsync(dptr, on) if getattr(ctx, "memory_pools", False)
              else d.cuMemFree(dptr))
    if int(err):
        raise CudaError(int(err), "cuMemFreeAsync (per-call scratch)")


def memcpy_htod(dst: int, src, stream=None) -> None:
    """Copy a C-contiguous NumPy array to device address dst (async on a stream if given).

    An async copy from pageable memory is staged before the call returns, and is
    ordered before later work on the same stream.
    """
    if src.nbytes == 0:
        return
    context()
    d = cu()
    if stream is None:
        check(d.cuMemcpyHtoD(d.CUdeviceptr(dst), src.ctypes.data, src.nbytes), "cuMemcpyHtoD")
    else:
        check(d.cuMemcpyHtoDAsync(d.CUdeviceptr(dst), src.ctypes.data, src.nbytes,
                                  d.CUstream(stream_handle(stream))), "cuMemcpyHtoDAsync")


def memcpy_dtoh(dst, src: int, stream=None) -> None:
    """Copy into a C-contiguous NumPy array; with a stream, waits for that stream."""
    if dst.nbytes == 0:
        return
    context()
    d = cu()
    if stream is None:
        check(d.cuMemcpyDtoH(dst.ctypes.data, d.CUdeviceptr(src), dst.nbytes), "cuMemcpyDtoH")
    else:
        s = d.CUstream(stream_handle(stream))
        check(d.cuMemcpyDtoHAsync(dst.ctypes.data, d.CUdeviceptr(src), dst.nbytes, s),
              "cuMemcpyDtoHAsync")
        check(d.cuStreamSynchronize(s), "cuStreamSynchronize")


def _memset(bits: int, ptr: int, value: int, count: int, stream) -> None:
    """cuMemsetD8/D16 (synchronous on the legacy stream) or its Async form on `stream`."""
    if count == 0:
        return
    context()
    d = cu()
    name = f"cuMemsetD{bits}"
    if stream is None:
        check(getattr(d, name)(d.CUdeviceptr(ptr), value, count), name)
    else:
        check(getattr(d, name + "Async")(d.CUdeviceptr(ptr), value, count,
                                         d.CUstream(stream_handle(stream))), name + "Async")


def memset_u16(ptr: int, value: int, count: int, stream=None) -> None:
    """Fill `count` 16-bit words (0xFFFF is a bf16 NaN: used to poison outputs)."""
    _memset(16, ptr, value, count, stream)


def memset_u8(ptr: int, value: int, count: int, stream=None) -> None:
    """Fill `count` bytes."""
    _memset(8, ptr, value, count, stream)


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of device memory, as cuMemGetInfo reports them."""
    context()
    free, total = check(cu().cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


def pointer_device(ptr: int) -> int:
    """Ordinal of the device that owns a device address (for __cuda_array_interface__)."""
    d = cu()
    attr = d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(check(d.cuPointerGetAttribute(attr, d.CUdeviceptr(ptr)), "cuPointerGetAttribute"))
