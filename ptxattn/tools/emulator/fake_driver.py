"""A fake of cuda.bindings.driver, backed by the emulator: an H200 that runs on the CPU.

It implements the calls ptxattn.driver and ptxattn.tma make (and the few around them:
contexts, device attributes, modules from PTX text, function attributes, cuLaunchKernelEx and
cuLaunchKernel with parameters in both forms, memory (plain and stream-ordered), copies and
sets, streams and events as immediate no-ops, cuTensorMapEncodeTiled), and takes the enums and
structs (CUresult, CUlaunchConfig, CUtensorMap, ...) from the real bindings, so ptxattn's own
code runs unchanged. Every launch runs to completion inside the call: streams are synchronous.
A call it does not implement raises, naming itself, rather than returning something plausible.

install(monkeypatch) puts it behind ptxattn.driver.cu() (the one place the runtime reaches
the bindings) and clears the runtime's caches of contexts, modules, kernels and maps, before and
after, so no fake handle leaks into a later test.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import time


from .errors import EmulatorError, HazardError
from .isa import MAX_SMEM_OPTIN
from .machine import Launch, registers_at_launch
from .memory import GlobalMemory
from .parse import parse
from .program import Program
from .tensormap import DTYPE_BYTES, TensorMap, validate

H200 = {
    "name": "NVIDIA H200 (ptxattn CPU emulator)",
    "sm_count": 132,
    "cc": (9, 0),
    "max_smem_optin": MAX_SMEM_OPTIN,
    "l2_bytes": 50 * 1024 * 1024,
    "total_memory": 150_754_820_096,
    "clock_khz": 1_980_000,
    "memory_clock_khz": 3_201_000,
    "bus_bits": 6144,
    "driver_version": 13000,
}
_DEFAULT_SMEM = 48 * 1024
# the runtime's caches of driver state (a Launcher keeps the driver's launch call and its
# functions' handles: one kept from an earlier emulator would launch on that emulator's memory)
_CACHE_NAMES = ("_KERNELS", "_STEADY", "_MODULES", "_CONFIGS", "_MAPS", "_RESULTS", "_METRICS",
                "_CONSTANTS", "_LAUNCHERS", "_TILES_FN", "_FUNCTIONS")


class FakeModule:
    def __init__(self, text: str, prog_module, label: str):
        self.text = text
        self.parsed = prog_module
        self.label = label
        self.programs: dict[str, Program] = {}


class FakeFunction:
    def __init__(self, module: FakeModule, name: str, prog: Program):
        self.module = module
        self.name = name
        self.prog = prog
        self.max_dynamic_smem = _DEFAULT_SMEM

    def __int__(self):
        return id(self) & 0xFFFFFFFFFFFF


class Handle:
    """An opaque handle (stream, event, context) the bindings would return."""

    def __init__(self, kind: str, value: int):
        self.kind, self.value = kind, value

    def __int__(self):
        return self.value

    def getPtr(self):
        return self.value

    def __repr__(self):
        return f"<emulated {self.kind} 0x{self.value:x}>"


class FakeDriver:
    """The fake bindings module. Options: seed (random scheduling and async completion),
    strict (raise at the first hazard), raise_hazards (False: keep them in .launches only),
    quantum (instructions per scheduling slice)."""

    def __init__(self, *, seed: int | None = None, strict: bool = False,
                 raise_hazards: bool = True, quantum: int = 256, sm_count: int | None = None,
                 max_instructions: int = 5_000_000, extern_offset: int = 0,
                 ignore_hazards=()):
        from cuda.bindings import driver as real
        self._real = real
        self.seed = seed
        self.strict = strict
        self.raise_hazards = raise_hazards
        self.quantum = quantum
        self.max_instructions = max_instructions
        self.extern_offset = extern_offset     # see Program: a misaligned dynamic shared base
        # hazard kinds recorded in the launch reports but not raised (triage of a known one)
        self.ignore_hazards = set(ignore_hazards)
        self.sm_count = sm_count or H200["sm_count"]
        self.gmem = GlobalMemory()
        self.launches: list = []        # (function name, grid, block, smem, Report)
        self._ctx = real.CUcontext(0x0E5A_0000)
        self._current = None
        self._programs: dict[str, tuple] = {}
        self._next_handle = 0x1000
        self._events: dict[int, float] = {}
        self.maps: list[TensorMap] = []
        # text -> text, applied to every module loaded (negative controls plant bugs here)
        self.rewrite_ptx = None
        # expanded text -> its line map (expanded line -> source file, line), recorded by
        # install() as ptxattn.ptx expands files, so reports name ptx/... files and lines
        self.source_maps: dict[str, object] = {}

    # -- plumbing
    def __getattr__(self, name):
        real = getattr(self._real, name)
        if name.startswith("cu") and callable(real) and not isinstance(real, type):
            def not_emulated(*args, **kwargs):
                raise EmulatorError(f"the emulated driver does not implement {name}")
            return not_emulated
        return real

    def _ok(self, *values):
        S = self._real.CUresult.CUDA_SUCCESS
        return (S, *values)

    def _err(self, name: str):
        return (getattr(self._real.CUresult, name),)

    def _handle(self, kind):
        self._next_handle += 16
        return Handle(kind, self._next_handle)

    # -- init, device, context
    def cuInit(self, flags):
        return self._ok()

    def cuDriverGetVersion(self):
        return self._ok(H200["driver_version"])

    def cuDeviceGetCount(self):
        return self._ok(1)

    def cuDeviceGet(self, ordinal):
        if int(ordinal) != 0:
            return self._err("CUDA_ERROR_INVALID_DEVICE")
        return self._ok(self._real.CUdevice(0))

    def cuDeviceGetName(self, length, dev):
        return self._ok(H200["name"].encode()[:length - 1] + b"\0")

    def cuDeviceTotalMem(self, dev):
        return self._ok(H200["total_memory"])

    def cuDeviceGetAttribute(self, attr, dev):
        A = self._real.CUdevice_attribute
        values = {
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: H200["cc"][0],
            A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: H200["cc"][1],
            A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: self.sm_count,
            A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: H200["max_smem_optin"],
            A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: _DEFAULT_SMEM,
            A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 228 * 1024,
            A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: H200["l2_bytes"],
            A.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_CLOCK_RATE: H200["clock_khz"],
            A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: H200["memory_clock_khz"],
            A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: H200["bus_bits"],
            A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: 1024,
            A.CU_DEVICE_ATTRIBUTE_WARP_SIZE: 32,
            A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: 65536,
            A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: 65536,
            A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: 2048,
            A.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: 1,
            A.CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: 1,
        }
        if attr not in values:
            return self._err("CUDA_ERROR_INVALID_VALUE")
        return self._ok(values[attr])

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._ok(self._ctx)

    def cuDevicePrimaryCtxRelease(self, dev):
        return self._ok()

    def cuCtxGetCurrent(self):
        return self._ok(self._current if self._current is not None else self._real.CUcontext(0))

    def cuCtxSetCurrent(self, ctx):
        self._current = ctx
        return self._ok()

    def cuCtxSynchronize(self):
        return self._ok()

    def cuCtxGetDevice(self):
        return self._ok(self._real.CUdevice(0))

    def cuGetErrorString(self, err):
        return self._ok(f"{self._real.CUresult(int(err)).name} (emulated driver)".encode())

    def cuGetErrorName(self, err):
        return self._ok(self._real.CUresult(int(err)).name.encode())

    # -- modules and functions
    def cuModuleLoadDataEx(self, image, nopts=0, options=(), values=()):
        text = bytes(image).split(b"\0", 1)[0].decode()
        if self.rewrite_ptx is not None:
            text = self.rewrite_ptx(text)
        logs = {}
        O = self._real.CUjit_option
        for opt, val in zip(options or (), values or ()):
            if opt in (O.CU_JIT_INFO_LOG_BUFFER, O.CU_JIT_ERROR_LOG_BUFFER):
                logs[opt] = val
        try:
            module = self.load_text(text)
        except EmulatorError as e:
            buf = logs.get(O.CU_JIT_ERROR_LOG_BUFFER)
            if buf is not None:
                msg = f"ptxattn emulator: {e}".encode()[:len(buf) - 1]
                buf[:len(msg)] = msg
                buf[len(msg)] = 0
            return self._err("CUDA_ERROR_INVALID_PTX")
        info = logs.get(O.CU_JIT_INFO_LOG_BUFFER)
        if info is not None:
            names = ", ".join(f for f in module.parsed.functions)
            msg = f"ptxattn emulator: parsed {names}".encode()[:len(info) - 1]
            info[:len(msg)] = msg
            info[len(msg)] = 0
        return self._ok(module)

    def cuModuleLoadData(self, image):
        return self.cuModuleLoadDataEx(image)

    def load_text(self, text: str) -> FakeModule:
        sha = hashlib.sha256(text.encode()).hexdigest()
        hit = self._programs.get(sha)
        if hit is None:
            hit = _PARSED.get(sha)
            if hit is None:
                hit = parse(text)
                _PARSED[sha] = hit
            self._programs[sha] = hit
        return FakeModule(text, hit, sha[:12])

    def cuModuleGetFunction(self, module, name):
        name = name.decode() if isinstance(name, bytes) else str(name)
        fn = module.parsed.functions.get(name)
        if fn is None or not fn.entry:
            return self._err("CUDA_ERROR_NOT_FOUND")
        key = (module.label, name, self.extern_offset)
        prog = _PROGRAMS.get(key)
        if prog is None:
            prog = Program(module.parsed, name, self.extern_offset)
            _PROGRAMS[key] = prog
        return self._ok(FakeFunction(module, name, prog))

    def cuModuleUnload(self, module):
        return self._ok()

    def cuFuncSetAttribute(self, f, attr, value):
        FA = self._real.CUfunction_attribute
        if attr == FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            if int(value) + f.prog.static_smem > H200["max_smem_optin"]:
                return self._err("CUDA_ERROR_INVALID_VALUE")
            f.max_dynamic_smem = int(value)
            return self._ok()
        return self._ok()

    def cuFuncGetAttribute(self, attr, f):
        FA = self._real.CUfunction_attribute
        fn = f.prog.fn
        bound = fn.maxntid or fn.reqntid
        threads = bound[0] * bound[1] * bound[2] if bound else 1024
        values = {
            FA.CU_FUNC_ATTRIBUTE_NUM_REGS: registers_at_launch(f.prog, threads),
            FA.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: 0,
            FA.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: f.prog.static_smem,
            FA.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: threads,
            FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: f.max_dynamic_smem,
            FA.CU_FUNC_ATTRIBUTE_PTX_VERSION: 84,
            FA.CU_FUNC_ATTRIBUTE_BINARY_VERSION: 90,
        }
        if attr not in values:
            return self._err("CUDA_ERROR_INVALID_VALUE")
        return self._ok(values[attr])

    # -- launches
    def cuLaunchKernelEx(self, config, f, kernel_params, extra):
        grid = (int(config.gridDimX), int(config.gridDimY), int(config.gridDimZ))
        block = (int(config.blockDimX), int(config.blockDimY), int(config.blockDimZ))
        cluster = (1, 1, 1)
        LA = self._real.CUlaunchAttributeID
        for attr in list(config.attrs)[:int(config.numAttrs)]:
            if attr.id == LA.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
                c = attr.value.clusterDim
                cluster = (int(c.x), int(c.y), int(c.z))
        return self._launch(f, grid, block, int(config.sharedMemBytes), kernel_params, cluster)

    def cuOccupancyMaxActiveClusters(self, f, config):
        """One CTA an SM (the kernels' shared memory): the SMs' worth of clusters."""
        size = 1
        LA = self._real.CUlaunchAttributeID
        for attr in list(config.attrs)[:int(config.numAttrs)]:
            if attr.id == LA.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
                c = attr.value.clusterDim
                size = int(c.x) * int(c.y) * int(c.z)
        return self._ok(self.sm_count // size)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
        return self._launch(f, (int(gx), int(gy), int(gz)), (int(bx), int(by), int(bz)),
                            int(smem), kernel_params, (1, 1, 1))

    def _launch(self, f, grid, block, smem, kernel_params, cluster):
        if not isinstance(f, FakeFunction):
            raise EmulatorError(f"cuLaunchKernel: {f!r} is not a function of the emulated "
                                f"driver")
        if smem > f.max_dynamic_smem:
            return self._err("CUDA_ERROR_INVALID_VALUE")
        params = pack_launch_params(f.prog, kernel_params)
        source_map = self.source_maps.get(f.module.text) or _source_map_for(f.module.text)
        launch = Launch(f.prog, grid, block, smem, params, self.gmem, seed=self.seed,
                        strict=self.strict, quantum=self.quantum, sm_count=self.sm_count,
                        max_instructions=self.max_instructions, source_map=source_map,
                        cluster=cluster)
        try:
            report = launch.run()
        except HazardError as e:
            report = getattr(e, "report", None)
            self.launches.append((f.name, grid, block, smem, report))
            kept = [h for h in e.hazards if h.kind not in self.ignore_hazards]
            if self.raise_hazards and kept:
                if len(kept) != len(e.hazards):
                    raise HazardError(kept) from None
                raise
            return self._ok()
        self.launches.append((f.name, grid, block, smem, report))
        return self._ok()

    # -- memory
    def cuMemAlloc(self, nbytes):
        return self._ok(self._real.CUdeviceptr(self.gmem.alloc(int(nbytes))))

    def cuMemAllocAsync(self, nbytes, stream):
        return self.cuMemAlloc(nbytes)

    def cuMemFree(self, ptr):
        self.gmem.free(int(ptr))
        return self._ok()

    def cuMemFreeAsync(self, ptr, stream):
        return self.cuMemFree(ptr)

    def cuMemGetInfo(self):
        total = H200["total_memory"]
        return self._ok(total - self.gmem.bytes_live, total)

    def cuMemcpyHtoD(self, dst, src, nbytes):
        n = int(nbytes)
        if n:
            self.gmem.write_bytes(int(dst), ctypes.string_at(int(src), n))
        return self._ok()

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        return self.cuMemcpyHtoD(dst, src, nbytes)

    def cuMemcpyDtoH(self, dst, src, nbytes):
        n = int(nbytes)
        if n:
            data = self.gmem.read_bytes(int(src), n)
            ctypes.memmove(int(dst), data.ctypes.data, n)
        return self._ok()

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
        return self.cuMemcpyDtoH(dst, src, nbytes)

    def cuMemcpyDtoD(self, dst, src, nbytes):
        n = int(nbytes)
        if n:
            self.gmem.write_bytes(int(dst), self.gmem.read_bytes(int(src), n))
        return self._ok()

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        return self.cuMemcpyDtoD(dst, src, nbytes)

    def _memset(self, width, ptr, value, count):
        pattern = int(value).to_bytes(8, "little")[:width]
        if int(count):
            self.gmem.fill(int(ptr), pattern, int(count))
        return self._ok()

    def cuMemsetD8(self, ptr, value, count):
        return self._memset(1, ptr, value, count)

    def cuMemsetD16(self, ptr, value, count):
        return self._memset(2, ptr, value, count)

    def cuMemsetD32(self, ptr, value, count):
        return self._memset(4, ptr, value, count)

    def cuMemsetD8Async(self, ptr, value, count, stream):
        return self._memset(1, ptr, value, count)

    def cuMemsetD16Async(self, ptr, value, count, stream):
        return self._memset(2, ptr, value, count)

    def cuMemsetD32Async(self, ptr, value, count, stream):
        return self._memset(4, ptr, value, count)

    def cuPointerGetAttribute(self, attr, ptr):
        PA = self._real.CUpointer_attribute
        if attr == PA.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
            if self.gmem.find(int(ptr)) is None:
                return self._err("CUDA_ERROR_INVALID_VALUE")
            return self._ok(0)
        return self._err("CUDA_ERROR_INVALID_VALUE")

    # -- streams and events: everything is synchronous
    def cuStreamCreate(self, flags):
        return self._ok(self._real.CUstream(int(self._handle("stream"))))

    def cuStreamCreateWithPriority(self, flags, priority):
        return self.cuStreamCreate(flags)

    def cuStreamDestroy(self, stream):
        return self._ok()

    def cuStreamSynchronize(self, stream):
        return self._ok()

    def cuStreamQuery(self, stream):
        return self._ok()

    def cuStreamWaitEvent(self, stream, event, flags):
        return self._ok()

    def cuEventCreate(self, flags):
        h = self._handle("event")
        return self._ok(h)

    def cuEventRecord(self, event, stream):
        self._events[int(event)] = time.perf_counter()
        return self._ok()

    def cuEventSynchronize(self, event):
        return self._ok()

    def cuEventQuery(self, event):
        return self._ok()

    def cuEventElapsedTime(self, start, end):
        a, b = self._events.get(int(start)), self._events.get(int(end))
        if a is None or b is None:
            return self._err("CUDA_ERROR_INVALID_HANDLE")
        return self._ok((b - a) * 1e3)

    def cuEventDestroy(self, event):
        self._events.pop(int(event), None)
        return self._ok()

    # -- tensor maps
    def cuTensorMapEncodeTiled(self, dtype, rank, address, dims, strides, box, element_strides,
                               interleave, swizzle, l2, oob):
        def names(enum, prefix):
            return enum.name.removeprefix(prefix)
        tm = TensorMap(
            dtype=names(dtype, "CU_TENSOR_MAP_DATA_TYPE_"), rank=int(rank),
            address=int(address),
            dims=tuple(int(x) for x in dims), strides=tuple(int(x) for x in strides),
            box=tuple(int(x) for x in box),
            element_strides=tuple(int(x) for x in element_strides),
            interleave=names(interleave, "CU_TENSOR_MAP_INTERLEAVE_"),
            swizzle=names(swizzle, "CU_TENSOR_MAP_SWIZZLE_"),
            l2_promotion=names(l2, "CU_TENSOR_MAP_L2_PROMOTION_"),
            oob_fill=names(oob, "CU_TENSOR_MAP_FLOAT_OOB_FILL_"))
        if tm.dtype not in DTYPE_BYTES or tm.swizzle not in ("NONE", "32B", "64B", "128B"):
            return self._err("CUDA_ERROR_INVALID_VALUE")
        counts = (len(tm.dims), len(tm.strides) + 1, len(tm.box), len(tm.element_strides))
        if counts != (tm.rank,) * 4:
            return self._err("CUDA_ERROR_INVALID_VALUE")
        why = validate(tm)
        if why is not None:
            self.last_error = why
            return self._err("CUDA_ERROR_INVALID_VALUE")
        out = self._real.CUtensorMap()
        out.opaque = tm.encode()
        self.maps.append(tm)
        return self._ok(out)

    # -- CUDA graphs: not emulated
    def cuStreamBeginCapture(self, *a):
        raise EmulatorError("CUDA graph capture is not emulated")


_PARSED: dict[str, object] = {}          # parsed modules by text, shared by every fake
_PROGRAMS: dict[tuple, Program] = {}


def pack_launch_params(prog: Program, kernel_params) -> bytes:
    """The parameter buffer from either form ptxattn.driver passes: the tuple form
    ((values...), (ctypes types or None for by-value structs...)), or the address of a void*[]
    array (each entry points at one parameter's bytes). Sizes are checked against the kernel's
    declaration: a mismatch is an ABI bug, reported by parameter name."""
    params = prog.fn.params
    buf = bytearray(prog.fn.param_bytes)
    if kernel_params is None or (isinstance(kernel_params, int) and kernel_params == 0):
        if params:
            raise EmulatorError(f"{prog.name} takes {len(params)} parameters, the launch "
                                f"passes none")
        return bytes(buf)
    if isinstance(kernel_params, tuple):
        values, types = kernel_params
        if len(values) != len(params) or len(types) != len(params):
            raise EmulatorError(f"{prog.name} takes {len(params)} parameters "
                                f"({', '.join(p.name for p in params)}), the launch passes "
                                f"{len(values)}")
        for p, value, ctype in zip(params, values, types):
            if ctype is None:
                data = ctypes.string_at(int(value.getPtr()), p.size)
            else:
                held = ctype(value)
                if ctypes.sizeof(held) != p.size:
                    raise EmulatorError(f"parameter {p.name} is .{p.ptype}"
                                        f"{f'[{p.count}]' if p.count > 1 else ''} ({p.size} "
                                        f"bytes), the launch passes {ctype.__name__} "
                                        f"({ctypes.sizeof(held)} bytes)")
                data = bytes(held)
            buf[p.offset:p.offset + p.size] = data
        return bytes(buf)
    address = int(kernel_params)
    pointers = (ctypes.c_void_p * len(params)).from_address(address)
    for p, ptr in zip(params, pointers):
        if not ptr:
            raise EmulatorError(f"kernelParams entry for {p.name} is a null pointer")
        buf[p.offset:p.offset + p.size] = ctypes.string_at(ptr, p.size)
    return bytes(buf)


def _source_map_for(text: str):
    """expanded line -> (file, line) when the text came from ptxattn.ptx (its cache)."""
    ptx = sys.modules.get("ptxattn.ptx")
    cache = getattr(ptx, "_CACHE", None) if ptx is not None else None
    if not cache:
        return None
    for expanded in list(cache.values()):
        if getattr(expanded, "text", None) == text:
            return expanded.map_line
    return None


# ----------------------------------------------------------------------------- installing

def clear_runtime_caches() -> None:
    """Forget every context, module, kernel, map and remembered call the runtime holds
    (found by name in any ptxattn module, so a moved module is still covered)."""
    for name, mod in list(sys.modules.items()):
        if not (name == "ptxattn" or name.startswith("ptxattn.")) or mod is None:
            continue
        if name.startswith("ptxattn.tools.emulator"):
            continue
        for cache in _CACHE_NAMES:
            d = getattr(mod, cache, None)
            if isinstance(d, dict):
                d.clear()
        reset = getattr(mod, "_reset_for_tests", None)
        if callable(reset) and name.endswith("driver"):
            reset()
        if hasattr(mod, "clear_steady_cache") and callable(mod.clear_steady_cache):
            try:
                mod.clear_steady_cache()
            except Exception:
                pass


def install(monkeypatch, **options) -> FakeDriver:
    """Make ptxattn.driver.cu() return a FakeDriver for the rest of the test."""
    import importlib
    driver = importlib.import_module("ptxattn.driver")
    ptx = importlib.import_module("ptxattn.ptx")
    fake = FakeDriver(**options)
    clear_runtime_caches()
    monkeypatch.setattr(driver, "_cu_module", fake)
    expand_file = ptx.expand_file

    def recording(*args, **kwargs):
        expanded = expand_file(*args, **kwargs)
        fake.source_maps[expanded.text] = expanded.map_line
        return expanded
    monkeypatch.setattr(ptx, "expand_file", recording)
    return fake
