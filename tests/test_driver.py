"""The driver layer's CPU-testable behaviour: no-GPU errors, CudaError, JIT errors, launch config."""

import ctypes
import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from fakes import at_once

from ptxattn import driver, stages
from ptxattn.errors import CudaError, JitError, NoGpuError, PtxattnError

from cuda.bindings import driver as cu   # a hard dependency: missing, it fails (never skips)
R = cu.CUresult


@pytest.fixture
def fresh(monkeypatch):
    """No context yet (restored afterwards, so a real one on a GPU machine survives)."""
    monkeypatch.setattr(driver, "_CONTEXT", None)
    monkeypatch.delenv("PTXATTN_DEVICE", raising=False)
    return monkeypatch


def one_line(exc) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_no_device_is_one_clear_error(fresh):
    fresh.setattr(cu, "cuInit", lambda flags: (R.CUDA_ERROR_NO_DEVICE,))
    with pytest.raises(NoGpuError) as info:
        driver.context()
    assert one_line(info.value) == \
        "ptxattn: no CUDA GPU available (cuInit returned CUDA_ERROR_NO_DEVICE)"
    assert isinstance(info.value, PtxattnError) and isinstance(info.value, RuntimeError)
    assert driver.gpu_available() is False
    with pytest.raises(NoGpuError):
        driver.device_info()


def test_missing_driver_library_is_the_same_kind_of_error(fresh):
    def no_libcuda(flags):
        # what cuda-bindings raises when libcuda.so cannot be loaded
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via '
                           "system search.\nEnsure the NVIDIA display driver is installed.")
    fresh.setattr(cu, "cuInit", no_libcuda)
    with pytest.raises(NoGpuError) as info:
        driver.context()
    assert one_line(info.value).startswith("ptxattn: no CUDA GPU available (the CUDA driver "
                                           "library libcuda could not be loaded")


def test_missing_cuda_python_is_a_no_gpu_error(fresh):
    fresh.setattr(driver, "_cu_module", None)
    fresh.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(NoGpuError, match="cuda-python is not installed"):
        driver.context()


def test_zero_devices_and_bad_device_choice(fresh):
    fresh.setattr(cu, "cuInit", lambda flags: (R.CUDA_SUCCESS,))
    fresh.setattr(cu, "cuDeviceGetCount", lambda: (R.CUDA_SUCCESS, 0))
    with pytest.raises(NoGpuError, match="reports no devices"):
        driver.context()
    fresh.setattr(cu, "cuDeviceGetCount", lambda: (R.CUDA_SUCCESS, 2))
    fresh.setenv("PTXATTN_DEVICE", "5")
    with pytest.raises(NoGpuError, match=r"PTXATTN_DEVICE=5, but the driver reports 2 device"):
        driver.context()
    fresh.setenv("PTXATTN_DEVICE", "gpu0")
    with pytest.raises(NoGpuError, match="not a device number"):
        driver.context()


def test_attention_validates_first_then_says_no_gpu(fresh):
    import ptxattn
    from ptxattn.tensors import BF16
    fresh.setattr(cu, "cuInit", lambda flags: (R.CUDA_ERROR_NO_DEVICE,))
    q = np.ones((1, 1, 64, 128), np.float32).astype(BF16)
    with pytest.raises(ValueError, match="k:"):                 # bad input: ValueError first
        ptxattn.attention(q, q[:, :, :, :64], q[:, :, :, :64])
    with pytest.raises(NoGpuError, match="CUDA_ERROR_NO_DEVICE"):
        ptxattn.attention(q, q, q)


def test_cuda_error_names_the_call_and_the_error():
    err = CudaError(700, "cuLaunchKernelEx(stage01.ptxattn_fwd, grid=(1, 1, 1))")
    assert err.result == 700 and err.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    text = str(err)
    assert text.startswith("cuLaunchKernelEx(stage01.ptxattn_fwd, grid=(1, 1, 1)) failed: "
                           "CUDA_ERROR_ILLEGAL_ADDRESS (700): ")
    # the driver's sentence when a driver is there, an explicit stand-in otherwise
    assert text.endswith(("illegal memory access was encountered",
                          "no description available from the driver"))


def test_check_unpacks_and_raises():
    assert driver.check((R.CUDA_SUCCESS,), "x") is None
    assert driver.check((R.CUDA_SUCCESS, 5), "x") == 5
    assert driver.check((R.CUDA_SUCCESS, 5, 6), "x") == (5, 6)
    with pytest.raises(CudaError) as info:
        driver.check((R.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc(1099511627776)")
    assert info.value.result == 2 and info.value.call == "cuMemAlloc(1099511627776)"
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)


# --------------------------------------------------------------------------- JIT (driver mocked)

KERNEL = textwrap.dedent("""\
    .version 8.4
    .target sm_90a
    .address_size 64
    #include "bad.ptxh"
    .visible .entry ptxattn_fwd()
    {
        ret;
    }
    """)


@pytest.fixture
def fake_jit(monkeypatch, tmp_path):
    """A stage in tmp_path and a fake context; cuModuleLoadDataEx is replaced per test."""
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "bad.ptxh").write_text("// helper\n.func broken()\n{\n    bogus.op;\n}\n")
    (tmp_path / "98_bad.ptx").write_text(KERNEL)
    stage = dataclasses.replace(stages.get_stage(1), number=98, name="bad",
                                file=str(tmp_path / "98_bad.ptx"))

    class FakeContext:
        ordinal = 0
    monkeypatch.setattr(driver, "context", lambda: FakeContext())
    monkeypatch.setattr(driver, "_MODULES", {})
    return stage


def write_log(buf: bytearray, text: str):
    data = text.encode() + b"\0"
    buf[:len(data)] = data


def test_jit_failure_is_annotated_with_stage_file_and_line(fake_jit, monkeypatch, tmp_path):
    from ptxattn import ptx
    text = ptx.source(fake_jit)
    line = next(i for i, l in enumerate(text.splitlines(), 1) if "bogus.op" in l)
    seen = {}

    def load(image, n, options, values):
        seen["image"] = image
        seen["options"] = list(options)
        seen["values"] = values
        write_log(values[2], f"ptxas application ptx input, line {line}; error   : "
                             "Not a name of any known instruction: 'bogus'\n"
                             "ptxas fatal   : Ptx assembly aborted due to errors")
        return (R.CUDA_ERROR_INVALID_PTX, None)
    monkeypatch.setattr(cu, "cuModuleLoadDataEx", load)

    with pytest.raises(JitError) as info:
        driver.load_module(text, "stage98", stage=fake_jit)
    err = info.value
    header = str(err).splitlines()[0]
    assert header == (f"JIT compile of stage98 failed (CUDA_ERROR_INVALID_PTX) at "
                      f"{tmp_path / 'include' / 'bad.ptxh'}:4:")
    assert f"-> {tmp_path / 'include' / 'bad.ptxh'}:4: bogus.op;" in str(err)
    assert err.locations == [(str(tmp_path / "include" / "bad.ptxh"), 4, "bogus.op;")]
    assert "Ptx assembly aborted" in err.log
    # what the driver was asked for
    assert seen["image"] == text.encode() + b"\0"
    opt = cu.CUjit_option
    assert seen["options"] == [opt.CU_JIT_INFO_LOG_BUFFER, opt.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                               opt.CU_JIT_ERROR_LOG_BUFFER, opt.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
                               opt.CU_JIT_LOG_VERBOSE]
    assert seen["values"][1] == len(seen["values"][0]) and seen["values"][4] == 1


def test_jit_success_keeps_the_info_log_and_caches(fake_jit, monkeypatch):
    calls = []

    def load(image, n, options, values):
        calls.append(image)
        write_log(values[0], "ptxas info    : Used 168 registers, used 1 barriers")
        return (R.CUDA_SUCCESS, "module-handle")
    monkeypatch.setattr(cu, "cuModuleLoadDataEx", load)
    m = driver.load_module(".version 8.4\n", "tiny")
    assert m.jit_log == "ptxas info    : Used 168 registers, used 1 barriers"
    assert m.handle == "module-handle" and len(m.sha256) == 64
    assert driver.load_module(".version 8.4\n", "again") is m and len(calls) == 1


# --------------------------------------------------------------------------- launch config, streams

def test_launch_spec_builds_the_config_without_launching():
    class F:
        name, handle = "ptxattn_fwd", None
        module = type("M", (), {"label": "stage01"})
    params = ((1, 2.0), (ctypes.c_uint32, ctypes.c_float))
    spec = driver.LaunchSpec(F(), (4, 3, 2), 128, 99 * 1024, params, stream=0x1230)
    c = spec.config
    assert (c.gridDimX, c.gridDimY, c.gridDimZ) == (4, 3, 2)
    assert (c.blockDimX, c.blockDimY, c.blockDimZ) == (128, 1, 1)
    assert c.sharedMemBytes == 99 * 1024 and int(c.hStream) == 0x1230 and c.numAttrs == 0
    spec = driver.LaunchSpec(F(), (4, 1, 1), (384,), 0, params, cluster=(2, 1, 1))
    assert spec.config.numAttrs == 1
    attr = spec.config.attrs[0]
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z) == (2, 1, 1)


def test_a_launch_passes_the_packed_array_it_keeps_alive_even_when_packs_interleave():
    """Two threads launching one spec at once may both pack its parameters. Whatever the
    interleaving, every launch must pass the address of an array the spec (or the launching
    call) still holds: here a second launch runs between the stores of the first one's pack."""
    class F:
        name, handle = "ptxattn_fwd", None
        module = type("M", (), {"label": "stage01"})

    class Racy(driver.LaunchSpec):
        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)
            if name in ("_args", "_packed") and value is not None \
                    and self.__dict__.get("_launched") and not self.__dict__.get("_raced"):
                object.__setattr__(self, "_raced", True)
                self()                      # the other thread, mid-store

    spec = Racy(F(), (1, 1, 1), 128, 0, ((7, 2.5), (ctypes.c_uint32, ctypes.c_float)))
    passed = []
    spec._launch = lambda config, handle, args, flags: (passed.append(args), (0,))[1]
    for _ in range(4):
        spec()
    assert isinstance(passed[0], tuple) and len(passed) == 5

    def arrays(x):        # the ctypes arrays the spec holds, however it nests them
        if isinstance(x, ctypes.Array):
            yield ctypes.addressof(x)
        elif isinstance(x, tuple):
            for item in x:
                yield from arrays(item)
    held = passed[-1]
    assert held in set(arrays(spec._packed)), "the launch passed an array nobody keeps alive"
    assert passed[-2] == held
    slots = (ctypes.c_void_p * 2).from_address(held)
    assert ctypes.c_uint32.from_address(slots[0]).value == 7
    assert ctypes.c_float.from_address(slots[1]).value == 2.5


def test_the_launch_config_cache_stays_bounded_with_threads_filling_it(monkeypatch):
    """Eight threads building configs for distinct streams at once, past the cap: the cache
    never exceeds it and no thread sees an error from the eviction."""
    monkeypatch.setattr(driver, "_CONFIGS", {})
    monkeypatch.setattr(driver, "_CONFIGS_MAX", 4)

    def fill(t):
        for i in range(200):
            config, _ = driver._launch_config((1, 1, 1), (128, 1, 1), 0, (1, 1, 1),
                                              0x1000 * (t + 1) + i)
            assert int(config.hStream) == 0x1000 * (t + 1) + i
    errors = at_once(fill, 8)
    assert not errors, errors
    assert 1 <= len(driver._CONFIGS) <= 4


def test_stream_handles():
    class Torch:
        cuda_stream = 11

    class Cupy:
        ptr = 12

    class Core:
        def __cuda_stream__(self):
            return (0, 13)
    assert driver.stream_handle(None) == 0
    assert driver.stream_handle(7) == 7
    assert driver.stream_handle(Torch()) == 11
    assert driver.stream_handle(Cupy()) == 12
    assert driver.stream_handle(Core()) == 13
    assert driver.stream_handle(cu.CUstream(14)) == 14
    assert driver.stream_handle(driver.Stream(15)) == 15       # wrapping: no driver call
    with pytest.raises(TypeError, match="stream:"):
        driver.stream_handle("default")
    with pytest.raises(ValueError, match="stream:"):
        driver.stream_handle(-1)


def test_kernel_param_types_follow_the_h200_facts():
    assert driver.BY_VALUE is None
    assert driver.PTR is ctypes.c_void_p
    assert (driver.U64, driver.U32, driver.F32) == (ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float)


def test_importing_ptxattn_loads_no_cuda_bindings():
    code = ("import sys, ptxattn, ptxattn.api, ptxattn.reference, ptxattn.tensors, "
            "ptxattn.tma, ptxattn.ptx, ptxattn.driver; "
            "print([m for m in sys.modules if m.startswith('cuda')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
