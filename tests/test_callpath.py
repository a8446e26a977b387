"""The call path of issue 11 on CPU, with the driver calls recorded (tests/test_prepare.py's
fixture): tensor maps encoded once per (address, geometry), never reused for a new address;
stream-ordered outputs freed on their stream after every stream they were used on; launch
configs per stream; the steady call makes one driver call (the launch). And bench/callpath.py
runs with its pretend driver. GPU checks of the same things: tests/test_gpu_callpath.py.
"""

import gc
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from fakes import FAKE_BASE, FakeDLPack
from test_prepare import MiB, OK, cu, gpu, launched  # noqa: F401  (gpu is a fixture)

from ptxattn import api as attn
from ptxattn import driver, fastpath, launch, tma
from ptxattn.tensors import DeviceArray

SHAPE = (1, 2, 128, 128)


def dev(shape, slot, **kw):
    return FakeDLPack(shape, ptr=FAKE_BASE + slot * 256 * MiB, **kw)


@pytest.fixture
def tagged_maps(gpu, monkeypatch):
    """cuTensorMapEncodeTiled answers a map whose first 8 bytes are the address it was
    encoded for (where the real driver's layout is opaque), so a launch's maps can be read
    back from its parameters in either form."""
    def encode(*args):
        gpu["cuTensorMapEncodeTiled"].append(args)
        tmap = cu.CUtensorMap()
        tmap.opaque = [int(args[2])] + [0] * 15
        return OK, tmap
    monkeypatch.setattr(cu, "cuTensorMapEncodeTiled", encode)
    return gpu


def param_slots(call, count):
    """The first `count` kernel parameters' host addresses, from a launch in either form:
    the tuple form (values, types) or the address of a packed void*[]."""
    import ctypes
    params = call[2]
    if isinstance(params, tuple):
        values, types = params
        return [int(v.getPtr()) if t is None else None for v, t in zip(values[:count], types)]
    return list((ctypes.c_void_p * count).from_address(params))


def map_addresses(call):
    import ctypes
    return [ctypes.c_uint64.from_address(slot).value for slot in param_slots(call, 4)]


def test_a_new_address_with_the_same_geometry_gets_new_maps(tagged_maps):
    gpu = tagged_maps
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    attn.attention(q, k, v, out=o)
    assert len(gpu["cuTensorMapEncodeTiled"]) == 4
    attn.attention(q, k, v, out=o)                      # same everything: no encode
    assert len(gpu["cuTensorMapEncodeTiled"]) == 4
    assert map_addresses(gpu["cuLaunchKernelEx"][1]) == [x.ptr for x in (q, k, v, o)]
    # The same geometry at new addresses (a new tensor of the same shape): the launch must
    # carry maps encoded for the new addresses. A cache that ignored the address fails here.
    q2, k2, v2, o2 = (dev(SHAPE, 4 + i) for i in range(4))
    attn.attention(q2, k2, v2, out=o2)
    assert len(gpu["cuTensorMapEncodeTiled"]) == 8
    assert map_addresses(gpu["cuLaunchKernelEx"][2]) == [x.ptr for x in (q2, k2, v2, o2)]
    # ...and the first set again: its maps are still right (and not re-encoded)
    attn.attention(q, k, v, out=o)
    assert map_addresses(gpu["cuLaunchKernelEx"][3]) == [x.ptr for x in (q, k, v, o)]
    assert len(gpu["cuTensorMapEncodeTiled"]) == 8


def test_new_shapes_and_strides_at_the_same_address_get_new_maps(tagged_maps):
    gpu = tagged_maps
    attn.attention(*(dev(SHAPE, i) for i in range(3)), out=dev(SHAPE, 3))
    first = [c[3] for c in gpu["cuTensorMapEncodeTiled"]]
    longer = (1, 2, 256, 128)                              # same addresses, more rows
    attn.attention(*(dev(longer, i) for i in range(3)), out=dev(longer, 3))
    assert len(gpu["cuTensorMapEncodeTiled"]) == 8
    q_dims = [int(x) for x in gpu["cuTensorMapEncodeTiled"][4][3]]     # (chunk, rows, ...)
    assert q_dims[1] == 256
    # a strided view at the same address (the heads 2x farther apart): new maps, new strides
    strided = (2 * 128 * 128, 128 * 128 * 2, 128, 1)
    attn.attention(*(dev(SHAPE, i, strides=strided) for i in range(3)), out=dev(SHAPE, 3))
    encodes = gpu["cuTensorMapEncodeTiled"]
    assert len(encodes) == 11                               # q, k, v new; out as before
    assert [int(x) for x in encodes[8][4]][2] == 128 * 128 * 2 * 2   # head stride in bytes
    assert first != [c[3] for c in encodes[4:8]]


def test_the_cache_is_bounded(tagged_maps, monkeypatch):
    monkeypatch.setattr(tma, "_MAPS_MAX", 6)
    for i in range(4):
        attn.attention(*(dev(SHAPE, 4 * i + j) for j in range(3)), out=dev(SHAPE, 4 * i + 3))
    assert len(tma._MAPS) <= 6


def test_a_steady_call_makes_one_driver_call(gpu):
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    attn.attention(q, k, v, out=o)                          # JIT, encodes, config
    before = {name: len(c) for name, c in gpu.items() if name != "ctx"}
    for _ in range(3):
        attn.attention(q, k, v, out=o)
    after = {name: len(c) for name, c in gpu.items() if name != "ctx"}
    grew = {name: after[name] - before.get(name, 0) for name in after
            if after[name] != before.get(name, 0)}
    assert grew == {"cuLaunchKernelEx": 3}


class _Stream:
    """A caller's stream object (as a torch, cupy or ptxattn stream): holding it keeps the
    stream alive, so outputs on it can be stream-ordered."""
    def __init__(self, handle):
        self.handle = handle


def test_fresh_outputs_are_stream_ordered_and_freed_on_their_stream(gpu):
    q, k, v = (dev(SHAPE, i) for i in range(3))
    out = attn.attention(q, k, v, stream=_Stream(0x51))
    (nbytes, stream), = gpu["cuMemAllocAsync"]
    assert nbytes == out.nbytes and int(stream) == 0x51 and not gpu["cuMemAlloc"]
    assert out.stream == 0x51 and not gpu["cuMemFreeAsync"]
    ptr = out.ptr
    del out
    gc.collect()
    (freed, on), = gpu["cuMemFreeAsync"]
    assert int(freed) == ptr and int(on) == 0x51
    assert not gpu["cuMemFree"] and not gpu["cuCtxSynchronize"]    # nothing waits for the GPU


def test_an_output_used_on_another_stream_waits_for_the_device_before_its_free(gpu, monkeypatch):
    order = []
    for name in ("cuCtxSynchronize", "cuMemFreeAsync", "cuStreamWaitEvent"):
        real = getattr(cu, name)
        monkeypatch.setattr(cu, name, lambda *a, _n=name, _r=real: (order.append(_n), _r(*a))[1])
    q, k, v = (dev(SHAPE, i) for i in range(3))
    owner = _Stream(0x51)
    out = attn.attention(q, k, v, stream=owner)
    capsule = out.__dlpack__(stream=0x62)       # a consumer on stream 0x62 reads it
    # and our own array is an input of a launch on stream 0x73
    attn.attention(out, dev(SHAPE, 6), dev(SHAPE, 7), stream=0x73)
    order.clear()
    ptr = out.ptr
    del out, capsule
    gc.collect()
    # 0x62 and 0x73 may be destroyed by now: the free waits for the device, never on them
    assert order == ["cuCtxSynchronize", "cuMemFreeAsync"]
    (freed, on), = gpu["cuMemFreeAsync"][-1:]
    assert int(freed) == ptr and int(on) == 0x51


def test_a_bare_stream_handle_gets_a_plain_allocation(gpu):
    """Nothing says a bare handle's stream outlives the output: no stream-ordered free on it."""
    q, k, v = (dev(SHAPE, i) for i in range(3))
    out = attn.attention(q, k, v, stream=0x51)
    assert gpu["cuMemAlloc"] and not gpu["cuMemAllocAsync"]
    out.free()
    assert gpu["cuMemFree"] and not gpu["cuMemFreeAsync"]


def test_each_stream_gets_its_own_launch_config(gpu):
    q, k, v, o = (dev(SHAPE, i) for i in range(4))
    for s in (0x10, 0x20, 0x10, 0):
        attn.attention(q, k, v, out=o, stream=s)
    assert [int(c[0].hStream) for c in gpu["cuLaunchKernelEx"]] == [0x10, 0x20, 0x10, 0]
    assert len(driver._CONFIGS) == 3


def test_own_arrays_as_out_on_another_stream_are_noted(gpu):
    q, k, v = (dev(SHAPE, i) for i in range(3))
    from ptxattn import tensors
    o = tensors.empty(SHAPE, stream=0x51, stream_owner=_Stream(0x51))
    assert not o.owner._used_elsewhere
    attn.attention(q, k, v, out=o, stream=0x52)
    assert o.owner._used_elsewhere
    assert isinstance(o, DeviceArray)


# --------------------------------------------------------------------------- the benchmark

def test_callpath_bench_runs_with_the_pretend_driver(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import callpath
    saved_maps = dict(tma._MAPS)
    saved_steady = dict(fastpath._STEADY)
    assert callpath.main(["--fake", "--profile", "--calls", "3", "--repeats", "1",
                          "--top", "5", "--label", "t", "--out", str(tmp_path)]) == 0
    assert fastpath._STEADY == saved_steady          # no pretend launch is remembered after
    record = json.loads((tmp_path / "callpath-t.json").read_text())
    calls = record["driver_calls_per_call"]
    assert calls["attention_out"] == {"cuLaunchKernelEx": 1.0}
    assert calls["attention"] == {"cuLaunchKernelEx": 1.0, "cuMemAllocAsync": 1.0,
                                  "cuMemFreeAsync": 1.0}
    assert calls["launch"] == {}
    # stage 15: attention_out's launch plus its own tile counter, allocated, zeroed and freed
    # per call on the call's stream (issue 28, defect 1)
    assert calls["stage15_out"] == {"cuLaunchKernelEx": 1.0, "cuMemAllocAsync": 1.0,
                                    "cuMemsetD8Async": 1.0, "cuMemFreeAsync": 1.0}
    paths = {"attention", "attention_out", "launch", "stage15_out"}
    torch = sys.modules.get("torch")
    if torch is not None:       # CPU torch tensors passing for CUDA ones: the torch paths too
        paths |= {"torch_attention", "torch_attention_out", "torch_op", "torch_sdpa_wrapper"}
        assert calls["torch_attention_out"] == {"cuLaunchKernelEx": 1.0}
        # the op allocates its output with torch: on the GPU the caching allocator hands a
        # layer the same address call after call (maps remembered), but a CPU tensor standing
        # in may land elsewhere, and then its map is encoded again: never anything else
        for name in ("torch_op", "torch_sdpa_wrapper"):
            assert calls[name].get("cuLaunchKernelEx") == 1.0, (name, calls[name])
            assert set(calls[name]) <= {"cuLaunchKernelEx", "cuTensorMapEncodeTiled"}, name
            assert calls[name].get("cuTensorMapEncodeTiled", 0) <= 1.0, (name, calls[name])
        # the pretence is undone: CPU tensors are CPU tensors again
        assert not torch.zeros(1).is_cuda and torch.zeros(1).get_device() == -1
    assert set(record["host"]) == paths
    python_calls = record["python_calls_per_call"]
    assert set(python_calls) == paths and python_calls["launch"] == 4
    # a steady call: far fewer Python calls than the full path's ~400 (issue 11's profile)
    assert python_calls["attention_out"] < 300
    assert "cumulative" in (tmp_path / "callpath-t-profile.txt").read_text()
    # the pretend driver left nothing behind: no fake maps, the real driver functions back
    assert tma._MAPS == saved_maps and driver.context is not None
    assert not getattr(cu.cuLaunchKernelEx, "__name__", "").startswith("<lambda")
    assert np.isfinite(record["host"]["launch"]["median_us"])
    sys.modules.pop("callpath", None)


def test_a_second_launch_passes_a_void_array_packed_once(gpu):
    """From the second launch on, kernelParams is the address of our own void*[]: each slot
    must point at the same bytes the tuple form describes (maps: their own 128 bytes)."""
    import ctypes
    q, k, v = (dev(SHAPE, i) for i in range(3))
    p = attn.prepare(q, k, v, return_lse=True)
    p.launch()
    p.launch()
    p.launch()
    first, second, third = (c[2] for c in gpu["cuLaunchKernelEx"])
    values, types = first
    assert isinstance(first, tuple) and isinstance(second, int) and third == second
    slots = (ctypes.c_void_p * len(values)).from_address(second)
    for i, (value, ctype) in enumerate(zip(values, types)):
        if ctype is None:
            assert slots[i] == value.getPtr()            # the map's own bytes, by value
        else:
            got = ctype.from_address(slots[i]).value
            assert got == (pytest.approx(value) if ctype is ctypes.c_float else value), i
    assert values[launch.slot(p.abi, "lse_ptr")] == p.lse.ptr and values[4] == p.out.ptr


def test_plain_torch_tensors_are_read_without_a_capsule(gpu, monkeypatch):
    """A stand-in torch module: exact CUDA bf16 Tensors are read directly, with torch's stream
    handshake (our stream waits for torch's current one when they differ); anything DLPack
    might treat differently (requires_grad here) still goes through __dlpack__."""
    import types

    torch = types.ModuleType("torch")
    torch.bfloat16, torch.strided = object(), object()
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: 0x7A00)

    class Tensor(FakeDLPack):
        is_cuda = True
        is_nested = False
        requires_grad = False
        layout = torch.strided

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.dtype = torch.bfloat16      # torch's dtype object (FakeDLPack's is a name)
            self.dlpack_dtype = "bfloat16"

        def __dlpack__(self, *args, **kwargs):
            self.dtype, saved = self.dlpack_dtype, self.dtype
            try:
                return super().__dlpack__(*args, **kwargs)
            finally:
                self.dtype = saved

        def is_conj(self):
            return False

        def is_neg(self):
            return False

        def get_device(self):
            return 0

        def data_ptr(self):
            return self.ptr

        def stride(self):
            return self.strides
    torch.Tensor = Tensor
    monkeypatch.setitem(sys.modules, "torch", torch)
    from ptxattn import tensors
    t = Tensor(SHAPE, ptr=FAKE_BASE + 0x100, strides=(4 * 128 * 128, 128, 512, 1))
    a = tensors.as_device_array(t, stream=0x7A00)
    assert (a.ptr, a.shape, a.strides, a.device, a.owner) == (t.ptr, SHAPE, t.strides, 0, t)
    assert t.calls == [] and not gpu["cuStreamWaitEvent"]          # no capsule, no wait
    tensors.as_device_array(t, stream=0x5100)                     # another stream: it waits
    (stream, event, flags), = gpu["cuStreamWaitEvent"]
    assert int(stream) == 0x5100 and int(gpu["cuEventRecord"][0][1]) == 0x7A00
    t.requires_grad = True
    tensors.as_device_array(t, stream=0x7A00)
    assert len(t.calls) == 1                                      # DLPack decides then


def test_a_closed_stream_object_frees_after_a_device_wait_on_the_default_stream(gpu):
    from ptxattn import driver as drv
    q, k, v = (dev(SHAPE, i) for i in range(3))
    s = drv.Stream(0x51)                  # a borrowed handle: close() only forgets it
    out = attn.attention(q, k, v, stream=s)
    assert gpu["cuMemAllocAsync"]
    s.close()                             # the caller is done with its stream before the output
    out.free()
    (freed, on), = gpu["cuMemFreeAsync"]
    assert int(on) == 0 and len(gpu["cuCtxSynchronize"]) == 1
