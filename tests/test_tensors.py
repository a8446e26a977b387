"""DLPack capsules (built and parsed with ctypes) and tensor-map geometry, on the CPU."""

import ctypes
import gc
import weakref

import ml_dtypes
import numpy as np
import pytest
from fakes import FAKE_BASE, FakeCAI, FakeDLPack, LegacyDLPack

from ptxattn import tensors, tma
from ptxattn.tensors import BF16, DeviceArray, as_device_array, make_capsule

_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]

DL_TYPES = {np.dtype(np.float32): (tensors.kDLFloat, 32, 1),
            np.dtype(np.uint16): (tensors.kDLUInt, 16, 1)}


class Owner:
    """A producer-side object only the capsule references: its weakref shows release."""


class HostExport:
    """Exports a NumPy buffer through our capsule builder with device kDLCPU."""

    def __init__(self, array, legacy_only=False, dltype=None):
        self.array, self.legacy_only, self.asked = array, legacy_only, []
        self.dltype = dltype or DL_TYPES[array.dtype]
        self.owner = Owner()
        self.owner.array = array

    def __dlpack_device__(self):
        return (tensors.kDLCPU, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        self.asked.append(max_version)
        a = self.array
        versioned = (not self.legacy_only and max_version is not None
                     and tuple(max_version) >= (1, 0))
        return make_capsule(a.ctypes.data, a.shape, [s // a.itemsize for s in a.strides],
                            self.dltype, (tensors.kDLCPU, 0), self.owner, versioned=versioned)


def released(make_ref) -> bool:
    gc.collect()
    return make_ref() is None


@pytest.mark.parametrize("legacy_only", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_numpy_consumes_our_capsule(dtype, legacy_only):
    base = np.arange(4 * 6 * 8).reshape(4, 6, 8).astype(dtype)
    view = base[1:, ::2, 3:]                       # offset and strided
    producer = HostExport(view, legacy_only)
    owner = weakref.ref(producer.owner)
    got = np.from_dlpack(producer)
    del producer
    np.testing.assert_array_equal(got, view)
    assert np.shares_memory(got, base)             # zero copy
    assert not released(owner)                     # alive while numpy holds it
    del got
    assert released(owner)                         # numpy called the deleter


@pytest.mark.parametrize("versioned", [False, True])
def test_unconsumed_capsule_releases_its_owner(versioned):
    a = np.zeros((2, 3), np.float32)
    owner = Owner()
    ref = weakref.ref(owner)
    cap = make_capsule(a.ctypes.data, a.shape, (3, 1), DL_TYPES[a.dtype], (tensors.kDLCPU, 0),
                       owner, versioned=versioned)
    del owner
    assert not released(ref)
    assert _is_valid(cap, b"dltensor_versioned" if versioned else b"dltensor")
    del cap                                        # dies unconsumed: its destructor releases
    assert released(ref)


def test_a_consumer_error_survives_the_capsule_dying():
    # NumPy cannot take bf16: it drops our capsule with its error set. The capsule's
    # destructor must keep that error (a ctypes-callback destructor would clobber it).
    producer = HostExport(np.zeros(4, np.uint16), dltype=(tensors.kDLBfloat, 16, 1))
    owner = weakref.ref(producer.owner)
    with pytest.raises((RuntimeError, BufferError, TypeError)) as info:
        np.from_dlpack(producer)
    assert not isinstance(info.value, SystemError)
    del producer, info
    assert released(owner)


@pytest.mark.parametrize("make", [FakeDLPack, LegacyDLPack])
def test_import_parses_the_capsule_and_calls_the_deleter(make):
    producer = make((2, 5, 3, 128), strides=(5 * 3 * 256, 3 * 256, 256, 1), ptr=FAKE_BASE + 32,
                    device=3)
    owner = weakref.ref(producer)
    arr = as_device_array(producer, name="q", stream=0)
    assert (arr.ptr, arr.shape, arr.strides, arr.device) == (
        FAKE_BASE + 32, (2, 5, 3, 128), (5 * 3 * 256, 3 * 256, 256, 1), 3)
    assert not arr.readonly and arr.dtype == BF16
    cap = arr.owner.capsule
    used = b"used_dltensor_versioned" if make is FakeDLPack else b"used_dltensor"
    assert _is_valid(cap, used)                    # renamed per protocol
    # we asked for a versioned tensor, with the legacy default stream spelled 1
    assert producer.calls[-1]["stream"] == 1
    calls = producer.calls
    del producer, cap
    assert not released(owner)                     # our import keeps the producer alive
    del arr
    assert released(owner)                         # we called the producer's deleter
    assert calls[-1]["max_version"] == ((1, 0) if make is FakeDLPack else None)


def test_import_readonly_flag_and_contiguous_default():
    arr = as_device_array(FakeDLPack((4, 8), readonly=True))
    assert arr.readonly and arr.strides == (8, 1) and arr.is_contiguous


def test_import_refuses_host_and_bad_dtypes():
    with pytest.raises(TypeError, match="x: expected a CUDA device array.*CPU"):
        as_device_array(np.zeros(3, np.float32), name="x")
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, got float16"):
        as_device_array(FakeDLPack((2, 2), dtype="float16"), name="x")
    with pytest.raises(TypeError, match="x: expected a NumPy array or a CUDA array"):
        as_device_array(object(), name="x")


def test_device_array_exports_and_reimports():
    owner = object()
    arr = DeviceArray(FAKE_BASE, (2, 64, 3, 128), strides=(64 * 3 * 128, 3 * 128, 128, 1),
                      device=1, owner=owner)
    assert arr.__dlpack_device__() == (tensors.kDLCUDA, 1)

    class Wrapper:  # so as_device_array goes through the capsule, not the isinstance shortcut
        def __dlpack_device__(self):
            return arr.__dlpack_device__()

        def __dlpack__(self, **kw):
            return arr.__dlpack__(**kw)

    back = as_device_array(Wrapper())
    assert (back.ptr, back.shape, back.strides, back.device) == (arr.ptr, arr.shape, arr.strides, 1)
    with pytest.raises(BufferError):
        arr.__dlpack__(dl_device=(tensors.kDLCPU, 0))
    with pytest.raises(BufferError):
        arr.__dlpack__(copy=True)


def test_cuda_array_interface_import():
    arr = as_device_array(FakeCAI((2, 4, 128), strides_bytes=(4 * 512, 512, 2), ptr=FAKE_BASE,
                                  stream=1))
    assert arr.strides == (4 * 256, 256, 1) and arr.device is None and arr.producer_stream == 0
    with pytest.raises(TypeError, match="float32"):
        as_device_array(FakeCAI((2, 2), typestr="<f4"), name="k")


def test_span_and_contiguity():
    a = DeviceArray(1000, (2, 3, 4), strides=(12, 4, 1))
    assert a.span() == (1000, 1000 + 24 * 2) and a.is_contiguous and a.nbytes == 48
    b = DeviceArray(1000, (2, 3, 4), strides=(24, 4, 1))
    assert not b.is_contiguous and b.span() == (1000, 1000 + (24 + 8 + 3 + 1) * 2)
    assert DeviceArray(0, (2, 0, 4)).span() == (0, 0)


def test_to_bf16_rounds_float32_and_float64():
    x = np.array([1.0 + 2 ** -9, 3.14159265358979, -2.5e-3], np.float64)
    expect = x.astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(tensors.to_bf16(x).view(np.uint16), expect.view(np.uint16))
    np.testing.assert_array_equal(tensors.to_bf16(x.astype(np.float32)).view(np.uint16),
                                  expect.view(np.uint16))
    with pytest.raises(TypeError, match="float16"):
        tensors.to_bf16(x.astype(np.float16))


# --------------------------------------------------------------------------- tensor maps

@pytest.mark.parametrize("chunk", [8, 64])
def test_map_geometry_bhld(chunk):
    B, H, L, D = 2, 3, 256, 128
    g = tma.map_geometry("bhld", B, H, L, D, rows=64, chunk=chunk)
    assert g["dims"] == (chunk, L, D // chunk, H, B)
    # row, d_outer, head, batch strides in bytes
    assert g["strides"] == (D * 2, chunk * 2, L * D * 2, H * L * D * 2)
    assert g["box"] == (chunk, 64, D // chunk, 1, 1)
    assert g["element_strides"] == (1, 1, 1, 1, 1)


@pytest.mark.parametrize("chunk", [8, 64])
def test_map_geometry_bshd(chunk):
    B, H, L, D = 2, 3, 256, 128
    g = tma.map_geometry("bshd", B, H, L, D, rows=128, chunk=chunk)
    assert g["dims"] == (chunk, L, D // chunk, H, B)
    assert g["strides"] == (H * D * 2, chunk * 2, D * 2, L * H * D * 2)
    assert g["box"] == (chunk, 128, D // chunk, 1, 1)


def test_map_geometry_strided_view_and_size_one_dims():
    # q = wide[..., :128] with wide's head dim 256; batch of 1 with a meaningless stride
    g = tma.map_geometry("bhld", 1, 2, 64, 128, rows=64, chunk=8,
                         strides=(5, 64 * 256, 256, 1), name="q")
    assert g["strides"] == (512, 16, 64 * 512, 2 * 64 * 128 * 2)  # batch: contiguous stand-in
    assert tma.bhl_strides("bshd", (1, 64, 2, 128), (5, 256, 128, 1)) == (64 * 256, 128, 256, 1)


def test_map_geometry_rejects_what_tma_cannot_address():
    with pytest.raises(ValueError, match="q: row stride .* not a multiple of 16 bytes"):
        tma.map_geometry("bhld", 1, 1, 64, 128, 64, 8, strides=(64 * 132, 64 * 132, 132, 1), name="q")
    with pytest.raises(ValueError, match="k: last \\(head\\) dim must have stride 1"):
        tma.map_geometry("bhld", 1, 1, 64, 128, 64, 8, strides=(2 * 64 * 128, 2 * 64 * 128, 256, 2),
                         name="k")
    with pytest.raises(ValueError, match="v: head stride must be positive"):
        tma.map_geometry("bhld", 1, 2, 64, 128, 64, 8, strides=(0, -8192, 128, 1), name="v")
    with pytest.raises(ValueError, match="not a multiple of the TMA chunk"):
        tma.map_geometry("bhld", 1, 1, 64, 100, 64, 8)
    with pytest.raises(ValueError, match="exceeds 256"):
        tma.map_geometry("bhld", 1, 1, 64, 128, 512, 8)
    with pytest.raises(ValueError, match="layout"):
        tma.map_geometry("hbld", 1, 1, 64, 128, 64, 8)
    with pytest.raises(ValueError, match="out: base address 0x1008 is not 16-byte aligned"):
        tma.check_base(0x1008, "out")
    tma.check_base(0x1010, "out")


def test_export_orders_the_consumer_after_our_writes(monkeypatch):
    from ptxattn import driver
    waits = []
    monkeypatch.setattr(driver, "context", lambda: None)
    monkeypatch.setattr(driver, "stream_wait", lambda consumer, producer: waits.append((consumer, producer)))
    arr = DeviceArray(FAKE_BASE, (64, 128), stream=0x500)    # last written on stream 0x500
    for consumer_stream, expect in ((None, (0, 0x500)), (1, (0, 0x500)), (0x600, (0x600, 0x500)),
                                    (0x500, None), (-1, None)):
        waits.clear()
        arr.__dlpack__(stream=consumer_stream)
        assert waits == ([expect] if expect else []), consumer_stream
    arr.stream = None                                         # nothing pending: no wait
    arr.__dlpack__(stream=0x600)
    assert waits == []
