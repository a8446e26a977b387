"""The ctypes launch (ptxattn/fastlaunch.py): its structures against cuda.h's layout and the
binding's own C memory, the choice between ctypes and the binding (knob, pretend drivers,
a missing libcuda), and errors. No GPU: libcuda is replaced by a recording ctypes-callable
stand-in; tests/test_gpu_fastlaunch.py launches for real."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import shutil
import subprocess

import numpy as np
import pytest
from cuda.bindings import driver as d          # cuda-python: a hard dependency

from ptxattn import driver, fastlaunch
from ptxattn.errors import CudaError


CUDA_H_DIRS = ("/usr/local/cuda/include", "/usr/local/cuda-13.0/include")


def test_struct_sizes_and_offsets_are_cuda_hs():
    """cuda.h (13.0): CUlaunchConfig is 56 bytes with hStream at 32, attrs at 40, numAttrs at
    48; CUlaunchAttribute 72 with its value at 8; the value union 64, 8-byte aligned."""
    c = fastlaunch.LaunchConfig
    assert ctypes.sizeof(c) == 56
    assert (c.sharedMemBytes.offset, c.hStream.offset, c.attrs.offset, c.numAttrs.offset) == (
        24, 32, 40, 48)
    a = fastlaunch.LaunchAttribute
    assert (ctypes.sizeof(a), a.value.offset) == (72, 8)
    v = fastlaunch.LaunchAttributeValue
    assert (ctypes.sizeof(v), ctypes.alignment(v)) == (64, 8)
    assert v.clusterDim.offset == v.programmaticStreamSerializationAllowed.offset == 0


def test_attribute_ids_are_the_bindings():
    ids = d.CUlaunchAttributeID
    assert fastlaunch.CLUSTER_DIMENSION == int(ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    assert fastlaunch.PROGRAMMATIC_STREAM_SERIALIZATION == int(
        ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)


def test_struct_layout_matches_a_c_compiler_reading_cuda_h(tmp_path):
    """Where a C compiler and cuda.h are on this machine: their sizeof/offsetof agree."""
    cc = shutil.which("gcc") or shutil.which("cc")
    inc = next((p for p in CUDA_H_DIRS if os.path.exists(os.path.join(p, "cuda.h"))), None)
    if cc is None or inc is None:
        pytest.skip("no C compiler or cuda.h here")
    src = tmp_path / "lay.c"
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "cuda.h"\n'
                   'int main(void){printf("%zu %zu %zu %zu %zu %zu %zu\\n",'
                   'sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream),'
                   'offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),'
                   'sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),'
                   '_Alignof(CUlaunchAttributeValue)); return 0;}\n')
    exe = tmp_path / "lay"
    subprocess.run([cc, f"-I{inc}", str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]
    c, a = fastlaunch.LaunchConfig, fastlaunch.LaunchAttribute
    assert got == [ctypes.sizeof(c), c.hStream.offset, c.attrs.offset, c.numAttrs.offset,
                   ctypes.sizeof(a), a.value.offset,
                   ctypes.alignment(fastlaunch.LaunchAttributeValue)]


def _binding_config(grid, block, smem, stream, cluster=(1, 1, 1), programmatic=False):
    config = d.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = d.CUstream(stream)
    attrs = []
    if cluster != (1, 1, 1):
        a = d.CUlaunchAttribute()
        a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
        attrs.append(a)
    if programmatic:
        a = d.CUlaunchAttribute()
        a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        attrs.append(a)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    return config


def _bytes_read_by_the_driver(address: int):
    """(the config's 56 bytes without the attrs pointer, the attribute array's bytes)."""
    raw = ctypes.string_at(address, 56)
    attrs_ptr = int.from_bytes(raw[40:48], "little")
    n = int.from_bytes(raw[48:52], "little")
    return raw[:40] + raw[48:52], ctypes.string_at(attrs_ptr, 72 * n) if n else b""


@pytest.mark.parametrize("cluster,programmatic", [((1, 1, 1), False), ((2, 1, 1), False),
                                                  ((1, 1, 1), True), ((2, 1, 1), True)],
                         ids=["plain", "cluster", "pdl", "cluster+pdl"])
def test_config_bytes_equal_the_bindings(cluster, programmatic):
    """What the driver reads (the config, its attribute array) is byte for byte what the
    binding's CUlaunchConfig holds for the same launch; of_binding reads it back."""
    args = ((132, 3, 2), (256, 1, 1), 229 * 1024, 0x7F00_1234_5678)
    ours = fastlaunch.Config(*args, cluster=cluster, programmatic=programmatic)
    theirs = _binding_config(*args, cluster=cluster, programmatic=programmatic)
    assert _bytes_read_by_the_driver(ours.address) == _bytes_read_by_the_driver(
        theirs.getPtr())
    back = fastlaunch.Config.of_binding(theirs)
    assert _bytes_read_by_the_driver(back.address) == _bytes_read_by_the_driver(
        theirs.getPtr())


def test_stream_zero_is_null_and_no_attrs_pointer_when_none():
    c = fastlaunch.Config((1, 1, 1), (32, 1, 1), 0, 0)
    raw = ctypes.string_at(c.address, 56)
    assert raw[32:52] == bytes(20)


def test_of_binding_refuses_an_attribute_it_does_not_copy():
    config = _binding_config((1, 1, 1), (32, 1, 1), 0, 0)
    a = d.CUlaunchAttribute()
    a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    a.value.cooperative = 1
    config.attrs = [a]
    config.numAttrs = 1
    with pytest.raises(ValueError, match="attribute 2"):
        fastlaunch.Config.of_binding(config)


# ---------------------------------------------------------------- the choice and the calls

class _Recorder:
    """A stand-in for libcuda's cuLaunchKernelEx: records the four words, answers `result`."""

    def __init__(self, result=0):
        self.calls, self.result = [], result

    def __call__(self, config, function, params, extra):
        raw = ctypes.string_at(config, 56)
        self.calls.append((raw, function, params, extra))
        return self.result


class _Fn:
    name = "ptxattn_fwd"
    module = type("M", (), {"label": "stage01"})

    def __init__(self):
        self.handle = d.CUfunction(0xABC0)


@pytest.fixture
def libcuda(monkeypatch):
    """fastlaunch.function() answers a recorder; cu() is the real binding module."""
    rec = _Recorder()
    driver.cu()
    monkeypatch.setattr(fastlaunch, "_FUNCTION", [rec])
    monkeypatch.delenv(fastlaunch.ENV, raising=False)
    monkeypatch.delenv(fastlaunch.PER_THREAD_ENV, raising=False)
    return rec


def _config():
    return driver._launch_config((4, 1, 1), (128, 1, 1), 1024, (1, 1, 1), 0x50)[0]


def test_kernel_launch_goes_through_ctypes_with_raw_words(libcuda):
    launch = driver.kernel_launch(_config(), _Fn(), "cuLaunchKernelEx (x)")
    assert isinstance(launch, driver.FastLaunch)
    launch(0x1234_0000)
    raw, function, params, extra = libcuda.calls[0]
    assert (function, params, extra) == (0xABC0, 0x1234_0000, None)
    assert raw[:4] == (4).to_bytes(4, "little") and raw[32:40] == (0x50).to_bytes(8, "little")


def test_the_knob_forces_the_binding(libcuda, monkeypatch):
    monkeypatch.setenv(fastlaunch.ENV, "binding")
    assert isinstance(driver.kernel_launch(_config(), _Fn(), "x"), driver.BindingLaunch)
    monkeypatch.setenv(fastlaunch.ENV, "")
    assert isinstance(driver.kernel_launch(_config(), _Fn(), "x"), driver.FastLaunch)


def test_per_thread_default_stream_keeps_the_binding(libcuda, monkeypatch):
    """The binding then resolves the _ptsz entry point: stream 0 means another stream."""
    monkeypatch.setenv(fastlaunch.PER_THREAD_ENV, "1")
    assert isinstance(driver.kernel_launch(_config(), _Fn(), "x"), driver.BindingLaunch)


def test_a_missing_libcuda_or_symbol_keeps_the_binding(monkeypatch):
    driver.cu()
    monkeypatch.setattr(fastlaunch, "_FUNCTION", [])
    monkeypatch.setattr(fastlaunch, "LIBRARY", "libcuda-that-is-not-here.so.1")
    assert fastlaunch.function() is None
    assert isinstance(driver.kernel_launch(_config(), _Fn(), "x"), driver.BindingLaunch)
    monkeypatch.setattr(fastlaunch, "_FUNCTION", [])
    monkeypatch.setattr(fastlaunch, "LIBRARY", ctypes.util.find_library("c") or "libc.so.6")
    monkeypatch.setattr(fastlaunch, "SYMBOL", "cuLaunchKernelEx_not_in_libc")
    assert fastlaunch.function() is None


def test_only_the_bindings_compiled_function_counts_as_the_binding():
    assert driver._is_binding_launch(d.cuLaunchKernelEx)
    wrapped = functools.wraps(d.cuLaunchKernelEx)(lambda *a: (0,))
    assert not driver._is_binding_launch(wrapped)          # same name and module, Python
    assert not driver._is_binding_launch(d.cuLaunchKernel)
    assert not driver._is_binding_launch(None)


def test_a_pretend_driver_keeps_its_launch(libcuda, monkeypatch):
    """A test's or the emulator's cuLaunchKernelEx (patched in cu()) gets every launch."""
    seen = []
    monkeypatch.setattr(driver.cu(), "cuLaunchKernelEx",
                        lambda config, fn, params, extra: (seen.append(params), (0,))[1])
    launch = driver.kernel_launch(_config(), _Fn(), "x")
    assert isinstance(launch, driver.BindingLaunch)
    launch(0x99)
    assert seen == [0x99] and libcuda.calls == []


def test_a_non_zero_result_raises_the_same_cuda_error(libcuda, monkeypatch):
    libcuda.result = 700
    launch = driver.kernel_launch(_config(), _Fn(), "cuLaunchKernelEx (ptxattn_decode)")
    with pytest.raises(CudaError) as fast_err:
        launch(0x10)
    monkeypatch.setattr(driver.cu(), "cuLaunchKernelEx", lambda *a: (700,))
    with pytest.raises(CudaError) as binding_err:
        driver.kernel_launch(_config(), _Fn(), "cuLaunchKernelEx (ptxattn_decode)")(0x10)
    assert str(fast_err.value) == str(binding_err.value)
    assert "ptxattn_decode" in str(fast_err.value)


def test_launch_spec_packs_then_goes_through_ctypes(libcuda, monkeypatch):
    """The first launch hands the tuple form to the binding; later ones pass the packed
    void*[] through ctypes, every time the same address."""
    first = []

    def binding(config, fn, params, extra):
        first.append(params)
        return (0,)
    # the spec's binding passes for the binding's own function, but records
    monkeypatch.setattr(driver, "_is_binding_launch", lambda fn: fn is binding)
    monkeypatch.setattr(driver.cu(), "cuLaunchKernelEx", binding)
    spec = driver.LaunchSpec(_Fn(), (2, 1, 1), 64, 0,
                             ((7, 2.5), (ctypes.c_uint32, ctypes.c_float)), cluster=(2, 1, 1))
    for _ in range(3):
        spec()
    assert isinstance(first[0], tuple) and len(first) == 1
    assert len(libcuda.calls) == 2 and libcuda.calls[0][2] == libcuda.calls[1][2]
    slots = (ctypes.c_void_p * 2).from_address(libcuda.calls[0][2])
    assert ctypes.c_uint32.from_address(slots[0]).value == 7
    raw = libcuda.calls[0][0]
    assert int.from_bytes(raw[48:52], "little") == 1          # the cluster attribute


def test_pdl_config_of_the_decode_combine_converts(libcuda):
    from ptxattn import decode_launch
    config, _ = decode_launch._dependent_config((3, 1, 1), (128, 1, 1), 0x60)
    launch = driver.kernel_launch(config, _Fn(), "x")
    launch(0x10)
    raw = libcuda.calls[0][0]
    attrs = int.from_bytes(raw[40:48], "little")
    assert int.from_bytes(raw[48:52], "little") == 1
    attr = fastlaunch.LaunchAttribute.from_address(attrs)
    assert (attr.id, attr.value.programmaticStreamSerializationAllowed) == (
        fastlaunch.PROGRAMMATIC_STREAM_SERIALIZATION, 1)


# ---------------------------------------------------------------- the ctypes TMA encoder

def test_tensor_map_enums_are_the_bindings():
    from ptxattn import tma
    from ptxattn.stages import SWIZZLE_128B, SWIZZLE_NONE
    assert tma.CT_DATA_TYPE == {
        "bf16": int(d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
        "u8": int(d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8)}
    s = d.CUtensorMapSwizzle
    assert tma.CT_SWIZZLE == {SWIZZLE_NONE: int(s.CU_TENSOR_MAP_SWIZZLE_NONE),
                              tma.SWIZZLE_32B: int(s.CU_TENSOR_MAP_SWIZZLE_32B),
                              tma.SWIZZLE_64B: int(s.CU_TENSOR_MAP_SWIZZLE_64B),
                              SWIZZLE_128B: int(s.CU_TENSOR_MAP_SWIZZLE_128B)}
    assert (tma.CT_INTERLEAVE_NONE, tma.CT_L2_PROMOTION_128B, tma.CT_OOB_FILL_NONE) == (
        int(d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE),
        int(d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B),
        int(d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    assert tma.TENSOR_MAP_BYTES == 8 * len(d.CUtensorMap().opaque)


def _ints(value):
    """A marshalled argument as plain ints (ctypes scalars, arrays; binding values, lists)."""
    if isinstance(value, ctypes.Array):
        return [int(x) for x in value]
    if isinstance(value, list):
        return [int(x) for x in value]
    if isinstance(value, (ctypes.c_void_p,)):
        return value.value or 0
    if hasattr(value, "value") and not hasattr(value, "getPtr"):
        return int(value.value)
    return int(value)


@pytest.mark.parametrize("swizzle,data_type", [("128B", "bf16"), ("64B", "u8"),
                                               ("none", "bf16")])
def test_ctypes_encoder_marshals_what_the_binding_is_given(monkeypatch, swizzle, data_type):
    """tma._encode's binding call and encode_args get the same figures, argument by argument
    (the tensor map's own address aside: the binding allocates its own)."""
    from ptxattn import tma
    from ptxattn.stages import SWIZZLE_NONE
    swizzle = SWIZZLE_NONE if swizzle == "none" else swizzle
    driver.cu()
    seen = []
    monkeypatch.setattr(driver.cu(), "cuTensorMapEncodeTiled",
                        lambda *a: (seen.append(a), (0, d.CUtensorMap()))[1])
    dims, strides, box = (64, 1000, 2, 8, 3), (256 * 8, 128, 256, 256 * 8 * 1000), (64, 128, 2,
                                                                                  1, 1)
    row = 64 * (2 if data_type == "bf16" else 1)
    if swizzle == "64B":
        dims, box, row = (64,) + dims[1:], (64,) + box[1:], 64
    tma._encode(0x7F00_0000_1000, dims, strides, box, swizzle, row, "k", data_type)
    tmap = tma.RawTensorMap()
    ours = tma.encode_args(tmap, 0x7F00_0000_1000, dims, strides, box, swizzle, data_type)
    theirs = seen[0]
    assert len(ours) == 12 and len(theirs) == 11         # the binding returns the map
    assert [_ints(x) for x in ours[1:]] == [_ints(x) for x in theirs]
    assert _ints(ours[0]) == tmap.address and tmap.address % tma.TENSOR_MAP_ALIGN == 0


def test_ctypes_encoder_writes_its_aligned_map_and_raises_the_drivers_refusal():
    from ptxattn import tma

    def encoder(tmap, *rest):
        ctypes.memset(tmap.value, 0xAB, tma.TENSOR_MAP_BYTES)
        return 0
    tmap = tma.encode_tiled_ctypes(0x1000, (64, 128), (128,), (64, 64), "128B",
                                   encoder=encoder)
    assert tmap.to_bytes() == b"\xab" * 128 and tmap.getPtr() % 128 == 0
    with pytest.raises(CudaError, match="cuTensorMapEncodeTiled"):
        tma.encode_tiled_ctypes(0x1000, (64, 128), (128,), (64, 64), "128B",
                                encoder=lambda *a: 1)
    with pytest.raises(ValueError, match="aligned"):
        tma.encode_tiled_ctypes(0x1008, (64, 128), (128,), (64, 64), "128B", encoder=encoder)
    with pytest.raises(ValueError, match="swizzle"):
        tma.encode_tiled_ctypes(0x1000, (64, 128), (128,), (64, 64), "32B", encoder=encoder)


# ---------------------------------------------------------------- the plans' per-call checks

@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_torch_ptr_takes_exactly_what_torch_meta_takes_of_the_plans_geometry(monkeypatch):
    """tensors.torch_ptr: the address of a plain bf16 "CUDA" tensor (CPU tensors pass for
    CUDA ones here) of exactly the shape and strides asked, on the device asked; None for
    each thing torch_meta refuses, and for another shape, strides or device."""
    torch = pytest.importorskip("torch")
    from ptxattn import tensors
    T = torch.Tensor
    monkeypatch.setattr(T, "is_cuda", property(lambda t: t.device.type == "cpu"),
                        raising=False)
    monkeypatch.setattr(T, "get_device", lambda t: 0)
    monkeypatch.setattr(tensors, "_TORCH", None)
    x = torch.zeros(6, 4, 8, dtype=torch.bfloat16)
    shape, strides = (6, 4, 8), (32, 8, 1)
    assert tensors.torch_ptr(x, shape, strides, 0) == x.data_ptr()
    assert tensors.torch_meta(x)[0] == x.data_ptr()

    class Sub(torch.Tensor):
        pass
    refused = {
        "float32": x.float(),
        "requires_grad": torch.zeros(6, 4, 8, dtype=torch.bfloat16, requires_grad=True),
        "subclass": x.as_subclass(Sub),
        "negative view": torch._neg_view(x),
        "shape": x[:5],
        "strides": x.transpose(0, 1).contiguous().transpose(0, 1),
        "not a tensor": np.zeros((6, 4, 8)),
    }
    for why, obj in refused.items():
        assert tensors.torch_ptr(obj, shape, strides, 0) is None, why
    assert tensors.torch_ptr(x, shape, strides, 1) is None, "device"
    assert tensors.torch_meta(torch._neg_view(x)) is None      # (the same refusal there)
    nested = torch.nested.nested_tensor([torch.zeros(4, 8), torch.zeros(4, 8)],
                                        dtype=torch.bfloat16)
    assert tensors.torch_ptr(nested, shape, strides, 0) is None
    # other layouts: refused by the stride comparison (torch_ptr reads no layout)
    flat = torch.zeros(6, 32, dtype=torch.bfloat16)
    assert tensors.torch_ptr(flat.to_sparse(), (6, 32), (32, 1), 0) is None, "sparse COO"
    assert tensors.torch_ptr(flat.to_sparse_csr(), (6, 32), (32, 1), 0) is None, "CSR"
    assert tensors.torch_ptr(flat, (6, 32), (32, 1), 0) == flat.data_ptr()
    monkeypatch.setattr(T, "is_cuda", property(lambda t: False), raising=False)
    assert tensors.torch_ptr(x, shape, strides, 0) is None, "a CPU tensor"


def test_packed_words_sit_adjacent_and_are_what_the_entries_point_at():
    """varlen._Packed's per-call words: one uint64 array, in the words' order, each entry of
    the void*[] pointing at its word (a call rewrites them with one slice assignment)."""
    from ptxattn import varlen
    names = ["tmap", "a", "o_ptr", "n", "lse_ptr"]
    types = [None, driver.U32, driver.PTR, driver.U64, driver.U64]
    p = varlen._Packed([None, 5, 0, 9, 0], types, ("tmap",), names,
                       words=("lse_ptr", "o_ptr"))
    p.words[:] = (0xAAAA, 0xBBBB)
    entries = (ctypes.c_void_p * 5).from_address(p.address)
    assert ctypes.c_uint64.from_address(entries[4]).value == 0xAAAA
    assert ctypes.c_uint64.from_address(entries[2]).value == 0xBBBB
    assert ctypes.c_uint32.from_address(entries[1]).value == 5
    assert ctypes.c_uint64.from_address(entries[3]).value == 9
    with pytest.raises(ValueError, match="8-byte"):
        varlen._Packed([None, 5], types[:2], ("tmap",), names[:2], words=("a",))
    with pytest.raises(ValueError, match="no such"):
        varlen._Packed([None, 5], types[:2], ("tmap",), names[:2], words=("zz",))
