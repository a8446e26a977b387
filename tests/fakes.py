"""Fake device arrays for CPU tests: they describe CUDA memory that is never read.

FakeDLPack exports a real DLPack capsule (built with ptxattn.tensors.make_capsule)
that says kDLCUDA; FakeCAI offers __cuda_array_interface__. Validation only
reads shapes, strides, dtypes, devices and addresses, so no GPU is needed.
"""

from __future__ import annotations

from ptxattn import tensors

FAKE_BASE = 0x7F00_0000_0000           # 16-byte aligned; never dereferenced
DTYPES = {"bfloat16": (tensors.kDLBfloat, 16, 1), "float16": (tensors.kDLFloat, 16, 1),
          "float32": (tensors.kDLFloat, 32, 1), "int32": (tensors.kDLInt, 32, 1)}


def contiguous(shape):
    return tensors.contiguous_strides(shape)


class FakeDLPack:
    def __init__(self, shape, *, strides=None, ptr=FAKE_BASE, device=0, dtype="bfloat16",
                 device_type=tensors.kDLCUDA, versioned_ok=True, readonly=False):
        self.shape = tuple(shape)
        self.strides = tuple(strides) if strides is not None else contiguous(self.shape)
        self.ptr, self.device, self.dtype = ptr, device, dtype
        self.device_type, self.versioned_ok, self.readonly = device_type, versioned_ok, readonly
        self.calls = []

    def __dlpack_device__(self):
        return (self.device_type, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        versioned = self.versioned_ok and max_version is not None and tuple(max_version) >= (1, 0)
        return tensors.make_capsule(self.ptr, self.shape, self.strides, DTYPES[self.dtype],
                                    (self.device_type, self.device), self,
                                    versioned=versioned, readonly=self.readonly)


class LegacyDLPack(FakeDLPack):
    """A producer from before DLPack 1.0: __dlpack__ takes only `stream`."""

    def __dlpack__(self, stream=None):
        return super().__dlpack__(stream=stream)


class FakeCAI:
    def __init__(self, shape, *, strides_bytes=None, ptr=FAKE_BASE, typestr=None, stream=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr or tensors.BF16.str,
            "data": (ptr, False),
            "strides": strides_bytes,
            "version": 3,
            "stream": stream,
        }


def at_once(worker, n: int = 8, timeout: float = 60.0) -> list:
    """Run worker(0) .. worker(n - 1) on n threads released together by a barrier; the
    exceptions they raised (a thread's own exception is otherwise lost), plus one per thread
    still running after `timeout`."""
    import threading
    start, errors = threading.Barrier(n), []

    def run(i):
        try:
            start.wait()
            worker(i)
        except Exception as e:                   # noqa: BLE001 - returned to the test
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    errors += [TimeoutError(f"{t.name} still running") for t in threads if t.is_alive()]
    return errors
